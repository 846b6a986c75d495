/* test_tcp_pattern.c - pattern batches of the tcp transport
 * (daemon/transport/tcp/tcp_pattern.c): the receiver's check of a pattern
 * against the grant (a pattern reaching one byte outside in any dimension
 * is refused with KVF_EPERM, malformed ones with KVF_EPROTO), the piece
 * walk that places the payload (never outside the pattern's pieces), and
 * the sender's grouping of runs (the pieces it describes are the runs'). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "desc.h"
#include "kvferryd.h"
#include "pool.h"
#include "kvferry.h"
#include "transport/tcp/tcp.h"
#include "transport/tcp/tcp_pattern.h"

/* Little-endian by hand, independently of tcp_pattern.c. */
static void le(uint8_t *p, uint64_t v, int n) {
  for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* A batch of one pattern entry into buf; returns its length. */
static size_t batch1(uint8_t *buf, uint64_t handle, uint32_t pool, uint32_t len, uint32_t n1, uint32_t n2,
                     uint64_t off, uint64_t s1, uint64_t s2) {
  le(buf, 0x5046564bu, 4); /* "KVFP" */
  le(buf + 4, 1, 4);
  le(buf + 8, handle, 8);
  uint8_t *e = buf + 16;
  le(e, pool, 4), le(e + 4, len, 4), le(e + 8, n1, 4), le(e + 12, n2, 4);
  le(e + 16, off, 8), le(e + 24, s1, 8), le(e + 32, s2, 8);
  return 16 + 40;
}

/* The grant: pool 1, [4096, 4096 + 8000), and pool 2, [0, 100). */
static void grant(kvf__rangeset *rs) {
  uint32_t pool[] = {1, 2};
  uint64_t off[] = {4096, 0}, len[] = {8000, 100};
  kvf__descs d = {pool, off, len, 2, 8100};
  assert_int_equal(kvf__rangeset_build(rs, &d), 0);
}

static int check(const kvf__rangeset *rs, uint32_t pool, uint32_t len, uint32_t n1, uint32_t n2, uint64_t off,
                 uint64_t s1, uint64_t s2, uint64_t *bytes) {
  uint8_t buf[64];
  size_t n = batch1(buf, 0xabcdef, pool, len, n1, n2, off, s1, s2);
  uint64_t handle = 0;
  uint32_t count = 0;
  int rc = kvf__tcp_pattern_check(buf, n, rs, &handle, &count, bytes);
  if (rc == 0 || rc == KVF_EPERM) assert_true(handle == 0xabcdef && count == 1);
  return rc;
}

/* A 2D pattern whose last piece ends at the grant's last byte: 4 rows of
 * 8 pieces of 64 bytes, s1 = 256, s2 = 2048 from 4096: the last piece
 * ends at 4096 + 3 * 2048 + 7 * 256 + 64 = 4096 + 8000. */
static void test_check_edges(void **state) {
  (void)state;
  kvf__rangeset rs;
  grant(&rs);
  uint64_t bytes;
  assert_int_equal(check(&rs, 1, 64, 8, 4, 4096, 256, 2048, &bytes), 0);
  assert_int_equal(bytes, 64 * 8 * 4);
  /* one byte further in each dimension: refused */
  assert_int_equal(check(&rs, 1, 65, 8, 4, 4096, 256, 2048, &bytes), KVF_EPERM);   /* len */
  assert_int_equal(check(&rs, 1, 64, 8, 4, 4097, 256, 2048, &bytes), KVF_EPERM);   /* off */
  assert_int_equal(check(&rs, 1, 64, 8, 4, 4095, 256, 2048, &bytes), KVF_EPERM);   /* before */
  assert_int_equal(check(&rs, 1, 64, 8, 4, 4096, 257, 2048, &bytes), KVF_EPERM);   /* s1 */
  assert_int_equal(check(&rs, 1, 64, 8, 4, 4096, 256, 2049, &bytes), KVF_EPERM);   /* s2 */
  assert_int_equal(check(&rs, 1, 64, 9, 4, 4096, 256, 2048, &bytes), KVF_EPERM);   /* n1 */
  assert_int_equal(check(&rs, 1, 64, 8, 5, 4096, 256, 2048, &bytes), KVF_EPERM);   /* n2 */
  assert_int_equal(check(&rs, 3, 64, 8, 4, 4096, 256, 2048, &bytes), KVF_EPERM);   /* pool */
  assert_int_equal(check(&rs, 2, 64, 8, 4, 4096, 256, 2048, &bytes), KVF_EPERM);   /* other pool's range */
  /* strides that wrap 64 bits are refused, not wrapped back inside */
  assert_int_equal(check(&rs, 1, 64, 2, 1, 4096, UINT64_MAX - 100, 0, &bytes), KVF_EPERM);
  assert_int_equal(check(&rs, 1, 64, 1, 2, 4096, 0, UINT64_MAX, &bytes), KVF_EPERM);
  assert_int_equal(check(&rs, 1, 1, 1 << 16, 2, 4096, 1ull << 48, 1ull << 63, &bytes), KVF_EPERM);
  /* pool 2: the whole range as one piece, and one byte over */
  assert_int_equal(check(&rs, 2, 100, 1, 1, 0, 0, 0, &bytes), 0);
  assert_int_equal(check(&rs, 2, 101, 1, 1, 0, 0, 0, &bytes), KVF_EPERM);
  /* single pieces ignore their (unused) strides */
  assert_int_equal(check(&rs, 2, 10, 1, 1, 90, UINT64_MAX, UINT64_MAX, &bytes), 0);
  kvf__rangeset_free(&rs);
}

/* Batches of many entries (the receiver remembers the range that held
 * the last box): kvf__tcp_pat_first_outside agrees with each box checked
 * on its own by a linear scan of the ranges, the boxes computed here in
 * 128 bits. Entries are drawn near and across the ranges' edges, in other
 * pools and with the last entry's range in mind. */
static bool box_inside(const kvf__range *v, size_t n, const kvf__tcp_pat *p) {
  unsigned __int128 end = (unsigned __int128)p->off + (unsigned __int128)(p->n2 - 1) * p->s2 +
                          (unsigned __int128)(p->n1 - 1) * p->s1 + p->len;
  for (size_t i = 0; i < n; i++)
    if (v[i].pool == p->pool && p->off >= v[i].start && end <= v[i].end) return true;
  return false;
}

static void test_first_outside_many(void **state) {
  (void)state;
  uint32_t pool[] = {1, 1, 1, 2};
  uint64_t off[] = {0, 2000, 3000, 0}, len[] = {1000, 1000, 500, 1000}; /* [2000, 3500) merges */
  kvf__descs d = {pool, off, len, 4, 3500};
  kvf__rangeset rs;
  assert_int_equal(kvf__rangeset_build(&rs, &d), 0);
  uint64_t seed = 17;
  int refused = 0, taken = 0;
  for (int round = 0; round < 20000; round++) {
    kvf__tcp_pat e[8];
    uint32_t n = 0;
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t count = 1 + (uint32_t)(seed >> 40) % 8;
    uint64_t at = 0;
    for (; n < count; n++) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      uint64_t r = seed >> 16;
      kvf__tcp_pat *p = &e[n];
      p->pool = r % 7 == 0 ? 2 : 1;
      p->len = 1 + (uint32_t)(r >> 3) % 64;
      p->n1 = 1 + (uint32_t)(r >> 9) % 4, p->n2 = 1 + (uint32_t)(r >> 11) % 3;
      p->s1 = (r >> 13) % 80, p->s2 = (r >> 20) % 300;
      /* near the last entry (same range, or just past it), or near an edge */
      static const uint64_t edges[] = {0, 1000, 2000, 3000, 3500};
      p->off = (r >> 27) % 2 ? at + (r >> 28) % 200 : edges[(r >> 29) % 5] - (r >> 32) % 3 * 64;
      if (p->off > UINT64_MAX / 2) p->off = 0;
      at = p->off;
    }
    uint32_t want = 0;
    while (want < count && box_inside(rs.v, rs.n, &e[want])) want++;
    assert_int_equal(kvf__tcp_pat_first_outside(&rs, e, count), want);
    want < count ? refused++ : taken++;
  }
  assert_true(refused > 1000 && taken > 1000); /* both outcomes drawn often */
  kvf__rangeset_free(&rs);
}

/* The receiver's granule table (kvf__tcp_rindex) answers as the binary
 * search does: ranges of one pool at random places and lengths, clustered
 * (many in a granule: the lookup's bounded steps, then the search) and
 * apart, looked up at, near and across their edges; then boxes of whole
 * batches through both. */
static void test_rindex_agrees(void **state) {
  (void)state;
  enum { N = 4000 };
  uint32_t *pool = malloc(N * sizeof(*pool));
  uint64_t *off = malloc(N * sizeof(*off)), *len = malloc(N * sizeof(*len)), total = 0;
  assert_true(pool && off && len);
  uint64_t seed = 99;
  for (int i = 0; i < N; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t r = seed >> 16;
    pool[i] = 3;
    off[i] = i % 5 == 0 ? 1000000 + (r % 4096) : (r % (1ull << 30)) + 4096;
    len[i] = 1 + (r >> 33) % 9000;
    total += len[i];
  }
  kvf__descs d = {pool, off, len, N, total};
  kvf__rangeset rs;
  assert_int_equal(kvf__rangeset_build(&rs, &d), 0);
  kvf__tcp_rindex ix;
  kvf__tcp_rindex_build(&ix, &rs);
  assert_non_null(ix.first);
  int held = 0;
  for (int k = 0; k < 200000; k++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t r = seed >> 16;
    const kvf__range *at = &rs.v[r % rs.n];
    uint64_t o = (r >> 20) % 3 == 0 ? at->start + (r >> 24) % 64 - 8 : (r >> 22) % 3 == 0 ? at->end - (r >> 26) % 16
                                                                                  : (r >> 12) % (1ull << 31);
    uint64_t l = 1 + (r >> 40) % 64;
    uint32_t p = (r >> 30) % 17 == 0 ? 4 : 3;
    long want = kvf__ranges_find(rs.v, rs.n, p, o, l);
    assert_int_equal(kvf__tcp_rindex_find(&ix, p, o, l), want);
    held += want >= 0;
  }
  assert_true(held > 20000); /* both outcomes drawn often */
  for (int round = 0; round < 5000; round++) {
    kvf__tcp_pat e[8];
    for (int i = 0; i < 8; i++) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      uint64_t r = seed >> 16;
      const kvf__range *at = &rs.v[r % rs.n];
      e[i] = (kvf__tcp_pat){.pool = 3, .len = 1 + (uint32_t)(r >> 20) % 32, .n1 = 1 + (uint32_t)(r >> 26) % 3,
                            .n2 = 1 + (uint32_t)(r >> 28) % 3, .off = at->start + (r >> 30) % 64,
                            .s1 = (r >> 36) % 64, .s2 = (r >> 42) % 256};
    }
    assert_int_equal(kvf__tcp_pat_first_outside_ix(&ix, e, 8), kvf__tcp_pat_first_outside(&rs, e, 8));
  }
  kvf__tcp_rindex_free(&ix);
  kvf__rangeset_free(&rs);
  free(pool);
  free(off);
  free(len);
}

static void test_check_malformed(void **state) {
  (void)state;
  kvf__rangeset rs;
  grant(&rs);
  uint64_t bytes, handle;
  uint32_t count;
  assert_int_equal(check(&rs, 1, 0, 8, 4, 4096, 256, 2048, &bytes), KVF_EPROTO);
  assert_int_equal(check(&rs, 1, 64, 0, 4, 4096, 256, 2048, &bytes), KVF_EPROTO);
  assert_int_equal(check(&rs, 1, 64, 8, 0, 4096, 256, 2048, &bytes), KVF_EPROTO);
  /* a payload over the most an entry carries */
  assert_int_equal(check(&rs, 1, KVF__TCP_PAT_MAX, 1, 1, 4096, 0, 0, &bytes), KVF_EPERM);
  assert_int_equal(check(&rs, 1, KVF__TCP_PAT_MAX + 1, 1, 1, 4096, 0, 0, &bytes), KVF_EPROTO);
  assert_int_equal(check(&rs, 1, 1u << 16, 1u << 16, 1u << 16, 4096, 1, 1, &bytes), KVF_EPROTO);
  assert_int_equal(check(&rs, 1, UINT32_MAX, UINT32_MAX, UINT32_MAX, 4096, 1, 1, &bytes), KVF_EPROTO);
  uint8_t buf[64];
  size_t n = batch1(buf, 1, 1, 64, 1, 1, 4096, 0, 0);
  assert_int_equal(kvf__tcp_pattern_check(buf, n - 1, &rs, &handle, &count, &bytes), KVF_EPROTO); /* short */
  le(buf + 4, 0, 4);
  assert_int_equal(kvf__tcp_pattern_check(buf, n, &rs, &handle, &count, &bytes), KVF_EPROTO); /* no entry */
  le(buf + 4, KVF__TCP_BATCH_MAX + 1, 4);
  assert_int_equal(kvf__tcp_pattern_check(buf, n, &rs, &handle, &count, &bytes), KVF_EPROTO);
  le(buf, 0x4446564bu, 4); /* a plain batch's magic */
  le(buf + 4, 1, 4);
  assert_int_equal(kvf__tcp_pattern_check(buf, n, &rs, &handle, &count, &bytes), KVF_EPROTO);
  kvf__rangeset_free(&rs);
}

/* Writes the payload 1, 2, 3, ... through the receiver's iovecs (cap
 * iovecs at a time) into mem, and checks every byte against the pattern's
 * definition: piece (i2, i1) at off + i2 * s2 + i1 * s1, nothing else
 * touched. */
static void place(const kvf__tcp_pat *p, size_t memlen, int cap) {
  uint8_t *mem = calloc(1, memlen), *want = calloc(1, memlen);
  struct iovec iov[64];
  uint64_t next = 0, k = 0;
  int n;
  while ((n = kvf__tcp_pat_iov(p, mem, &next, iov, cap)) > 0) {
    assert_true(n <= cap);
    for (int i = 0; i < n; i++) {
      uint8_t *b = iov[i].iov_base;
      assert_true(b >= mem && b + iov[i].iov_len <= mem + memlen);
      for (size_t j = 0; j < iov[i].iov_len; j++) b[j] = (uint8_t)(1 + k++ % 251);
    }
  }
  assert_int_equal(k, (uint64_t)p->len * p->n1 * p->n2);
  k = 0;
  for (uint64_t i2 = 0; i2 < p->n2; i2++)
    for (uint64_t i1 = 0; i1 < p->n1; i1++)
      for (uint64_t j = 0; j < p->len; j++) want[p->off + i2 * p->s2 + i1 * p->s1 + j] = (uint8_t)(1 + k++ % 251);
  assert_memory_equal(mem, want, memlen);
  free(mem);
  free(want);
}

static void test_place(void **state) {
  (void)state;
  kvf__tcp_pat a = {.len = 16, .n1 = 8, .n2 = 4, .off = 100, .s1 = 64, .s2 = 1024}; /* gaps both ways */
  place(&a, 8192, 64);
  place(&a, 8192, 3);
  kvf__tcp_pat b = {.len = 16, .n1 = 8, .n2 = 3, .off = 5, .s1 = 16, .s2 = 128}; /* rows contiguous */
  place(&b, 1024, 1);
  kvf__tcp_pat c = {.len = 32, .n1 = 4, .n2 = 4, .off = 0, .s1 = 128, .s2 = 32}; /* transposed */
  place(&c, 1024, 5);
}

/* The receiver's read plan over a batch of mixed entries (small pieces
 * through the bounce buffer, large ones straight; into a sealed pool,
 * bounced pieces of whole cache lines at line-aligned places streamed, the
 * others copied; into one that is not, every piece a guarded copy): the
 * payload, read step by step as the socket would deliver it, lands exactly
 * where the patterns' definition says, and nothing else in the pool
 * changes. */
static void test_read_plan(void **state) {
  (void)state;
  enum { MEM = 2 << 20 };
  kvf__pool pool = {0}, *pools[1] = {&pool};
  pool.base = aligned_alloc(64, MEM); /* offsets below choose streamed or copied */
  uint8_t *want = calloc(1, MEM);
  kvfd.pools = pools, kvfd.n_pools = 1;
  kvf__tcp_pat e[] = {
      {.len = 256, .n1 = 16, .n2 = 1, .off = 0, .s1 = 512},                /* TP 8 -> 4 NHD: bounced */
      {.len = 192, .n1 = 5, .n2 = 3, .off = 64 * 1000, .s1 = 320, .s2 = 4096}, /* whole lines: streamed */
      {.len = 128, .n1 = 7, .n2 = 1, .off = 1200003, .s1 = 192},           /* lines, misaligned: copied */
      {.len = 96, .n1 = 9, .n2 = 1, .off = 1300032, .s1 = 128},            /* aligned, part lines: copied */
      {.len = 4096, .n1 = 4, .n2 = 2, .off = 100000, .s1 = 8192, .s2 = 40000}, /* large: straight */
      {.len = 16, .n1 = 8, .n2 = 4, .off = 300001, .s1 = 64, .s2 = 1024},  /* bounced, 2D */
      {.len = 700, .n1 = 1, .n2 = 1, .off = 500000},                       /* one piece: straight */
      {.len = 256, .n1 = 2000, .n2 = 1, .off = 600000, .s1 = 256},         /* over the bounce buffer: straight */
      {.len = 256, .n1 = 1024, .n2 = 1, .off = 1400064, .s1 = 256},        /* the bounce buffer whole */
  };
  uint32_t n_e = sizeof(e) / sizeof(e[0]);
  uint64_t k = 0;
  for (uint32_t i = 0; i < n_e; i++)
    for (uint64_t i2 = 0; i2 < e[i].n2; i2++)
      for (uint64_t i1 = 0; i1 < e[i].n1; i1++)
        for (uint64_t j = 0; j < e[i].len; j++) want[e[i].off + i2 * e[i].s2 + i1 * e[i].s1 + j] = (uint8_t)(1 + k++ % 251);
  for (int cap = 1, sealed = 0; cap <= 1023; cap = sealed ? cap * 4 + 3 : cap, sealed = !sealed) {
    pool.sealed = sealed; /* guarded copies, or streamed */
    memset(pool.base, 0, MEM);
    kvf__tcp_rplan r;
    uint8_t *bounce = NULL;
    kvf__tcp_rplan_init(&r, e, n_e, &bounce);
    assert_non_null(r.bounce);
    assert_ptr_equal(r.bounce, bounce);
    struct iovec iov[1023];
    uint64_t fed = 0;
    int n;
    while ((n = kvf__tcp_rplan_step(&r, iov, cap)) > 0) {
      assert_true(n <= cap);
      for (int i = 0; i < n; i++)
        for (size_t j = 0; j < iov[i].iov_len; j++) ((uint8_t *)iov[i].iov_base)[j] = (uint8_t)(1 + fed++ % 251);
      assert_int_equal(kvf__tcp_rplan_scatter(&r), 0);
    }
    assert_true(kvf__tcp_rplan_done(&r));
    assert_int_equal(fed, k);
    assert_memory_equal(pool.base, want, MEM);
    free(bounce);
  }
  kvfd.pools = NULL, kvfd.n_pools = 0;
  free(pool.base);
  free(want);
}

/* Bounced pieces into pool memory (not sealed) whose file shrank under
 * the mapping: the scatter reports -EFAULT (the guard caught SIGBUS)
 * instead of killing the daemon, and the next scatter works again. */
static void test_scatter_fault(void **state) {
  (void)state;
  enum { MEM = 64 << 10 };
  int fd = memfd_create("test_tcp_pattern", MFD_CLOEXEC);
  assert_true(fd >= 0);
  assert_int_equal(ftruncate(fd, MEM), 0);
  uint8_t *map = mmap(NULL, MEM, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  assert_true(map != MAP_FAILED);
  kvf__pool pool = {0}, *pools[1] = {&pool};
  pool.base = map;
  kvfd.pools = pools, kvfd.n_pools = 1;
  kvf__tcp_pat e = {.len = 256, .n1 = 16, .n2 = 1, .off = 4096, .s1 = 512};
  struct iovec iov[4];
  for (int shrunk = 1; shrunk >= 0; shrunk--) {
    assert_int_equal(ftruncate(fd, shrunk ? 0 : MEM), 0);
    kvf__tcp_rplan r;
    uint8_t *bounce = NULL;
    kvf__tcp_rplan_init(&r, &e, 1, &bounce);
    assert_int_equal(kvf__tcp_rplan_step(&r, iov, 4), 1);
    memset(iov[0].iov_base, 0x5a, iov[0].iov_len);
    assert_int_equal(kvf__tcp_rplan_scatter(&r), shrunk ? -EFAULT : 0);
    free(bounce);
  }
  for (uint32_t i = 0; i < e.n1; i++) assert_int_equal(map[e.off + i * e.s1 + 255], 0x5a);
  kvfd.pools = NULL, kvfd.n_pools = 0;
  munmap(map, MEM);
  close(fd);
}

/* Runs of the sender: whatever it groups, the pieces of its patterns in
 * order are the runs' destinations in order, and no pattern passes a run's
 * grant piece, length or pool. */
static void test_take(void **state) {
  (void)state;
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  for (int round = 0; round < 2000; round++) {
    kvf__run v[200];
    size_t n = 1 + (size_t)(seed % 200);
    uint64_t at = 0;
    for (size_t i = 0; i < n; i++) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      uint32_t kind = (uint32_t)(seed >> 33) % 8;
      uint64_t len = kind < 5 ? 256 : 64 + (seed >> 40) % 512;
      at += kind == 0 ? 0 : kind < 3 ? 256 : kind < 4 ? 2048 : (seed >> 20) % 5000;
      v[i] = (kvf__run){.src_pool = 0, .dst_pool = (uint32_t)(kind == 7), .src_off = i * 1000, .dst_off = at,
                        .len = len, .dst_desc = (uint32_t)(at / 65536)};
      at += len;
    }
    for (size_t r = 0; r < n;) {
      kvf__tcp_pat p;
      size_t took = kvf__tcp_pat_take(v + r, n - r, &p);
      assert_true(took >= 1 && took <= n - r);
      assert_true((uint64_t)p.len * p.n1 * p.n2 <= KVF__TCP_PAT_MAX);
      /* the pieces, expanded, are the runs' bytes in order */
      uint64_t piece = 0, total = (uint64_t)p.n1 * p.n2, covered = 0;
      for (size_t k = 0; k < took; k++) {
        assert_int_equal(v[r + k].dst_pool, p.pool);
        assert_int_equal(v[r + k].dst_desc, v[r].dst_desc);
        for (uint64_t b = 0; b < v[r + k].len; b++, covered++) {
          uint64_t i = covered / p.len, j = covered % p.len;
          assert_true(i < total);
          assert_int_equal(p.off + i / p.n1 * p.s2 + i % p.n1 * p.s1 + j, v[r + k].dst_off + b);
        }
      }
      piece = covered / p.len;
      assert_int_equal(covered % p.len, 0);
      assert_int_equal(piece, total);
      r += took;
    }
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      /* first: cmocka installs its SIGBUS handler around each test, and
       * pool_engine.c installs its guard's once, at the first guarded copy */
      cmocka_unit_test(test_scatter_fault),
      cmocka_unit_test(test_check_edges),
      cmocka_unit_test(test_check_malformed),
      cmocka_unit_test(test_first_outside_many),
      cmocka_unit_test(test_rindex_agrees),
      cmocka_unit_test(test_place),
      cmocka_unit_test(test_take),
      cmocka_unit_test(test_read_plan),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
