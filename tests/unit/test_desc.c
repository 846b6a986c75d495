/* test_desc.c - descriptor lists (daemon/desc.c): wire validation, checks
 * against pools, in-order pairing, coalescing into runs, range sets. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "desc.h"
#include "kvferry.h"

/* ---- helpers ---------------------------------------------------------- */

/* Encodes one DescList.packed record byte by byte, independently of
 * daemon/desc.c: u32 pool, u64 offset, u64 length, little-endian. */
static void enc_rec(uint8_t *r, uint32_t pool, uint64_t off, uint64_t len) {
  for (int b = 0; b < 4; b++) r[b] = (uint8_t)(pool >> (8 * b));
  for (int b = 0; b < 8; b++) r[4 + b] = (uint8_t)(off >> (8 * b));
  for (int b = 0; b < 8; b++) r[12 + b] = (uint8_t)(len >> (8 * b));
}

static uint64_t dec_le(const uint8_t *p, int nbytes) {
  uint64_t v = 0;
  for (int b = 0; b < nbytes; b++) v |= (uint64_t)p[b] << (8 * b);
  return v;
}

/* A wire list of n records from caller arrays (own buffer; unwire frees). */
static Kvf__DescList wire(const uint32_t *pool, const uint64_t *off, const uint64_t *len, size_t n) {
  Kvf__DescList w = KVF__DESC_LIST__INIT;
  uint8_t *buf = malloc(n ? n * 20 : 1);
  assert_non_null(buf);
  for (size_t i = 0; i < n; i++) enc_rec(buf + i * 20, pool[i], off[i], len[i]);
  w.packed.data = buf;
  w.packed.len = n * 20;
  return w;
}

static void unwire(Kvf__DescList *w) {
  free(w->packed.data);
  w->packed.data = NULL;
  w->packed.len = 0;
}

/* Builds a list from arrays through the validated path. */
static void mk(kvf__descs *d, const uint32_t *pool, const uint64_t *off, const uint64_t *len,
               size_t n) {
  Kvf__DescList w = wire(pool, off, len, n);
  assert_int_equal(kvf__descs_from_wire(d, &w, 1u << 20), 0);
  unwire(&w);
}

/* n blocks of len bytes in pool, at base + i*stride. */
static void mk_strided(kvf__descs *d, uint32_t pool, uint64_t base, uint64_t stride, uint64_t len,
                       size_t n) {
  uint32_t *p = malloc(n * sizeof(*p));
  uint64_t *o = malloc(n * sizeof(*o));
  uint64_t *l = malloc(n * sizeof(*l));
  assert_non_null(p);
  assert_non_null(o);
  assert_non_null(l);
  for (size_t i = 0; i < n; i++) {
    p[i] = pool;
    o[i] = base + i * stride;
    l[i] = len;
  }
  mk(d, p, o, l, n);
  free(p);
  free(o);
  free(l);
}

static void assert_run(const kvf__run *r, uint32_t sp, uint64_t so, uint32_t dp, uint64_t dof,
                       uint64_t len) {
  assert_int_equal(r->src_pool, sp);
  assert_int_equal(r->src_off, so);
  assert_int_equal(r->dst_pool, dp);
  assert_int_equal(r->dst_off, dof);
  assert_int_equal(r->len, len);
}

/* ---- descs_from_wire ---------------------------------------------------- */

static void test_from_wire_ok(void **state) {
  uint32_t p[] = {0, 1, 0};
  uint64_t o[] = {0, 4096, 100};
  uint64_t l[] = {10, 20, 30};
  Kvf__DescList w = wire(p, o, l, 3);
  kvf__descs d;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 3), 0); /* n == max is fine */
  assert_int_equal(d.n, 3);
  assert_int_equal(d.total, 60);
  /* A copy: not the wire's bytes, which may go away. */
  assert_true((void *)d.pool != (void *)w.packed.data);
  assert_true((void *)d.offset != (void *)w.packed.data);
  assert_true((void *)d.length != (void *)w.packed.data);
  assert_memory_equal(d.pool, p, sizeof p);
  assert_memory_equal(d.offset, o, sizeof o);
  assert_memory_equal(d.length, l, sizeof l);
  /* Back to the wire: the same bytes, in a buffer of its own. */
  Kvf__DescList v;
  assert_int_equal(kvf__descs_to_wire(&d, &v), 0);
  assert_int_equal(v.packed.len, 3 * 20);
  assert_non_null(v.packed.data);
  assert_ptr_not_equal(v.packed.data, w.packed.data);
  assert_memory_equal(v.packed.data, w.packed.data, 3 * 20);
  kvf__descs_wire_free(&v);
  assert_null(v.packed.data);
  assert_int_equal(v.packed.len, 0);
  kvf__descs_wire_free(&v); /* idempotent */
  unwire(&w);
  kvf__descs_free(&d);
  assert_null(d.pool);
  assert_int_equal(d.n, 0);
  kvf__descs_free(&d); /* idempotent */
}

/* The byte layout, spelled out: bytes 0x01..0x14 are one record. */
static void test_from_wire_layout(void **state) {
  uint8_t rec[1 + 2 * 20];
  Kvf__DescList w = KVF__DESC_LIST__INIT;
  for (size_t i = 0; i < 20; i++) rec[1 + i] = (uint8_t)(i + 1);
  for (size_t i = 0; i < 20; i++) rec[21 + i] = (uint8_t)(0xff - i);
  /* Misaligned on purpose: records are read byte-wise. */
  w.packed.data = rec + 1;
  w.packed.len = 2 * 20;
  kvf__descs d;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), KVF_EINVAL); /* total overflows */
  w.packed.len = 20;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), 0);
  assert_int_equal(d.n, 1);
  assert_true(d.pool[0] == 0x04030201u);
  assert_true(d.offset[0] == 0x0c0b0a0908070605ull);
  assert_true(d.length[0] == 0x14131211100f0e0dull);
  assert_true(d.total == 0x14131211100f0e0dull);
  kvf__descs_free(&d);
  w.packed.data = rec + 21;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), 0);
  assert_true(d.pool[0] == 0xfcfdfeffu);
  assert_true(d.offset[0] == 0xf4f5f6f7f8f9fafbull);
  assert_true(d.length[0] == 0xecedeeeff0f1f2f3ull);
  kvf__descs_free(&d);
}

/* A length that is not whole records is malformed, whatever else holds. */
static void test_from_wire_bad_length(void **state) {
  uint32_t p[] = {0, 0, 0, 0};
  uint64_t o[] = {0, 1, 2, 3};
  uint64_t l[] = {1, 1, 1, 1};
  Kvf__DescList w = wire(p, o, l, 4);
  kvf__descs d;
  size_t bad_lens[] = {1, 19, 21, 39, 41, 59, 61, 79};
  for (size_t i = 0; i < sizeof bad_lens / sizeof bad_lens[0]; i++) {
    w.packed.len = bad_lens[i];
    assert_int_equal(kvf__descs_from_wire(&d, &w, 100), KVF_EPROTO);
    assert_null(d.pool);
    assert_int_equal(d.n, 0);
  }
  /* Less than one record is malformed, not empty. */
  w.packed.len = 19;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), KVF_EPROTO);
  /* Malformed is reported before the limit. */
  w.packed.len = 61;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 2), KVF_EPROTO);
  assert_int_equal(d.n, 0);
  /* Whole records again: fine. */
  w.packed.len = 60;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), 0);
  assert_int_equal(d.n, 3);
  kvf__descs_free(&d);
  unwire(&w);
}

static void test_from_wire_empty(void **state) {
  kvf__descs d;
  Kvf__DescList w = KVF__DESC_LIST__INIT;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), KVF_EINVAL);
  assert_int_equal(kvf__descs_from_wire(&d, NULL, 100), KVF_EINVAL);
  assert_int_equal(d.n, 0);
  assert_null(d.pool);
  /* An empty list packs to nothing. */
  kvf__descs e = {0};
  assert_int_equal(kvf__descs_to_wire(&e, &w), 0);
  assert_int_equal(w.packed.len, 0);
  assert_null(w.packed.data);
  kvf__descs_wire_free(&w);
}

static void test_from_wire_zero_length(void **state) {
  uint32_t p[] = {0, 0, 0};
  uint64_t o[] = {0, 10, 20};
  uint64_t l[] = {10, 0, 10};
  Kvf__DescList w = wire(p, o, l, 3);
  kvf__descs d;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), KVF_EINVAL);
  assert_null(d.pool); /* freed on failure */
  assert_int_equal(d.n, 0);
  unwire(&w);
  uint64_t l0[] = {0};
  w = wire(p, o, l0, 1);
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), KVF_EINVAL);
  unwire(&w);
  uint64_t llast[] = {1, 1, 0};
  w = wire(p, o, llast, 3);
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), KVF_EINVAL);
  unwire(&w);
}

static void test_from_wire_too_many(void **state) {
  uint32_t p[] = {0, 0, 0, 0};
  uint64_t o[] = {0, 1, 2, 3};
  uint64_t l[] = {1, 1, 1, 1};
  Kvf__DescList w = wire(p, o, l, 4);
  kvf__descs d;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 3), KVF_ELIMIT);
  assert_int_equal(d.n, 0);
  assert_int_equal(kvf__descs_from_wire(&d, &w, 0), KVF_ELIMIT);
  assert_int_equal(kvf__descs_from_wire(&d, &w, 4), 0);
  assert_int_equal(d.total, 4);
  kvf__descs_free(&d);
  unwire(&w);
}

static void test_from_wire_overflow(void **state) {
  uint32_t p[] = {0, 0, 0};
  uint64_t o[] = {0, 0, 0};
  uint64_t l[] = {UINT64_MAX / 2 + 1, UINT64_MAX / 2 + 1, 1};
  kvf__descs d;
  Kvf__DescList w = wire(p, o, l, 2);
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), KVF_EINVAL);
  assert_null(d.pool);
  unwire(&w);
  uint64_t l2[] = {UINT64_MAX, 1};
  w = wire(p, o, l2, 2);
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), KVF_EINVAL);
  unwire(&w);
  /* Exactly UINT64_MAX in total is representable and accepted. */
  uint64_t l3[] = {UINT64_MAX - 1, 1};
  w = wire(p, o, l3, 2);
  assert_int_equal(kvf__descs_from_wire(&d, &w, 100), 0);
  assert_true(d.total == UINT64_MAX);
  kvf__descs_free(&d);
  unwire(&w);
}

/* to_wire -> from_wire of 100k descriptors whose every byte varies: pool ids
 * above 2^16, offsets above 2^40, one length using all 8 bytes. The packed
 * bytes are checked against the layout independently of desc.c. */
static void test_wire_round_trip_100k(void **state) {
  enum { N = 100000 };
  kvf__descs a = {0};
  a.pool = malloc(N * sizeof(*a.pool));
  a.offset = malloc(N * sizeof(*a.offset));
  a.length = malloc(N * sizeof(*a.length));
  assert_non_null(a.pool);
  assert_non_null(a.offset);
  assert_non_null(a.length);
  a.n = N;
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < N; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17; /* xorshift64 */
    a.pool[i] = (uint32_t)(x >> 32) | 0x10000u;              /* > 2^16 */
    a.offset[i] = (x | (1ull << 41)) ^ ((uint64_t)i << 56);  /* > 2^40 */
    /* 99,999 lengths below 2^40 leave room for one of 8 full bytes. */
    a.length[i] = ((x * 0xff51afd7ed558ccdull) & ((1ull << 40) - 1)) | 1;
    a.total += a.length[i];
  }
  a.total -= a.length[N / 2];
  a.length[N / 2] = 0xf0e1d2c3b4a59687ull;
  a.total += a.length[N / 2];
  Kvf__DescList w;
  assert_int_equal(kvf__descs_to_wire(&a, &w), 0);
  assert_int_equal(w.packed.len, (size_t)N * 20);
  const uint8_t *r = w.packed.data;
  for (size_t i = 0; i < N; i++, r += 20) {
    if (dec_le(r, 4) != a.pool[i] || dec_le(r + 4, 8) != a.offset[i] ||
        dec_le(r + 12, 8) != a.length[i])
      fail_msg("record %zu does not match the layout", i);
  }
  /* Every byte position of a record takes many values. */
  for (size_t b = 0; b < 20; b++) {
    uint8_t seen[256] = {0};
    size_t distinct = 0;
    for (size_t i = 0; i < N; i++) {
      uint8_t v = w.packed.data[i * 20 + b];
      if (!seen[v]) seen[v] = 1, distinct++;
    }
    /* Some bits are pinned (pool > 2^16, offset > 2^40, odd lengths); the
     * top bytes of lengths below 2^40 take only the one large length's. */
    assert_true(distinct >= (b >= 17 ? 2 : 100));
  }
  kvf__descs d;
  assert_int_equal(kvf__descs_from_wire(&d, &w, N - 1), KVF_ELIMIT);
  assert_int_equal(kvf__descs_from_wire(&d, &w, N), 0);
  assert_int_equal(d.n, N);
  assert_true(d.total == a.total);
  assert_memory_equal(d.pool, a.pool, N * sizeof(*a.pool));
  assert_memory_equal(d.offset, a.offset, N * sizeof(*a.offset));
  assert_memory_equal(d.length, a.length, N * sizeof(*a.length));
  kvf__descs_free(&d);
  kvf__descs_wire_free(&w);
  kvf__descs_free(&a);
}

/* ---- descs_check --------------------------------------------------------- */

/* Pools 0 and 1 of 1000 bytes; pool 7 does not exist. */
typedef struct fake_pools {
  unsigned calls;
} fake_pools;

static int fake_check(void *ctx, uint32_t pool, uint64_t off, uint64_t len) {
  fake_pools *fp = ctx;
  fp->calls++;
  if (pool > 1) return KVF_ENOPOOL;
  if (off > 1000 || len > 1000 - off) return KVF_ERANGE;
  return 0;
}

static void test_descs_check(void **state) {
  fake_pools fp = {0};
  size_t bad = 999;
  kvf__descs d;
  uint32_t p[] = {0, 1, 0};
  uint64_t o[] = {0, 500, 900};
  uint64_t l[] = {1000, 500, 100};
  mk(&d, p, o, l, 3);
  assert_int_equal(kvf__descs_check(&d, fake_check, &fp, &bad), 0);
  assert_int_equal(fp.calls, 3);
  assert_int_equal(bad, 999); /* untouched on success */
  kvf__descs_free(&d);

  uint32_t p2[] = {0, 7, 0};
  uint64_t l2[] = {10, 10, 10};
  mk(&d, p2, o, l2, 3);
  fp.calls = 0;
  assert_int_equal(kvf__descs_check(&d, fake_check, &fp, &bad), KVF_ENOPOOL);
  assert_int_equal(bad, 1);
  assert_int_equal(fp.calls, 2); /* stops at the first failure */
  kvf__descs_free(&d);

  uint64_t o3[] = {0, 0, 901};
  mk(&d, p, o3, l, 3);
  assert_int_equal(kvf__descs_check(&d, fake_check, &fp, &bad), KVF_ERANGE);
  assert_int_equal(bad, 2); /* 0+1000 fits; 0+500 fits; 901+100 > 1000 */
  kvf__descs_free(&d);
}

/* The first failing index is reported, not a later one. */
static void test_descs_check_index(void **state) {
  fake_pools fp = {0};
  size_t bad = 999;
  kvf__descs d;
  uint32_t p[] = {0, 1, 0, 7};
  uint64_t o[] = {0, 0, 901, 0};
  uint64_t l[] = {1000, 500, 100, 1};
  mk(&d, p, o, l, 4);
  assert_int_equal(kvf__descs_check(&d, fake_check, &fp, &bad), KVF_ERANGE);
  assert_int_equal(bad, 2);
  /* bad may be NULL. */
  assert_int_equal(kvf__descs_check(&d, fake_check, &fp, NULL), KVF_ERANGE);
  kvf__descs_free(&d);
}

/* ---- append ------------------------------------------------------------- */

static void test_append(void **state) {
  kvf__descs a, b, acc = {0};
  uint32_t p[] = {0, 1};
  uint64_t o[] = {0, 100};
  uint64_t l[] = {10, 20};
  mk(&a, p, o, l, 2);
  mk(&b, p, o, l, 1);
  assert_int_equal(kvf__descs_append(&acc, &a), 0);
  assert_int_equal(kvf__descs_append(&acc, &b), 0);
  assert_int_equal(acc.n, 3);
  assert_int_equal(acc.total, 40);
  assert_int_equal(acc.pool[2], 0);
  assert_int_equal(acc.offset[1], 100);
  assert_int_equal(acc.length[2], 10);
  kvf__descs_free(&a);
  kvf__descs_free(&b);
  kvf__descs_free(&acc);
}

/* ---- pairing -------------------------------------------------------------- */

static void test_pair_equal(void **state) {
  kvf__descs s, d;
  uint32_t sp[] = {0, 0, 0};
  uint64_t so[] = {0, 1000, 5000};
  uint32_t dp[] = {1, 1, 1};
  uint64_t dof[] = {300, 7000, 100};
  uint64_t l[] = {64, 128, 256};
  mk(&s, sp, so, l, 3);
  mk(&d, dp, dof, l, 3);
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), 0);
  assert_int_equal(cur, 3);
  assert_int_equal(r.n, 3);
  assert_int_equal(r.bytes, 448);
  assert_run(&r.v[0], 0, 0, 1, 300, 64);
  assert_run(&r.v[1], 0, 1000, 1, 7000, 128);
  assert_run(&r.v[2], 0, 5000, 1, 100, 256);
  /* The grant is used up: another part does not fit. */
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), KVF_ESIZE);
  assert_int_equal(cur, 3);
  assert_int_equal(r.n, 3);
  kvf__runs_free(&r);
  assert_null(r.v);
  kvf__descs_free(&s);
  kvf__descs_free(&d);
}

static void test_pair_size_mismatch_each_index(void **state) {
  enum { N = 6 };
  for (size_t bad = 0; bad < N; bad++) {
    uint32_t p[N] = {0};
    uint64_t o[N], sl[N], dl[N];
    for (size_t i = 0; i < N; i++) {
      o[i] = i * 1000;
      sl[i] = dl[i] = 100;
    }
    dl[bad] = 99;
    kvf__descs s, d;
    mk(&s, p, o, sl, N);
    mk(&d, p, o, dl, N);
    kvf__runs r = {0};
    size_t cur = 0;
    assert_int_equal(kvf__pair(&s, &d, &cur, &r), KVF_ESIZE);
    assert_int_equal(cur, 0);    /* cursor unchanged */
    assert_int_equal(r.n, 0);    /* nothing appended before the check failed */
    assert_int_equal(r.bytes, 0);
    kvf__runs_free(&r);
    kvf__descs_free(&s);
    kvf__descs_free(&d);
  }
}

/* A mismatch in a later part leaves the cursor where the earlier part put it. */
static void test_pair_mismatch_mid_cursor(void **state) {
  kvf__descs d, s1, s2;
  mk_strided(&d, 1, 0, 100, 100, 4);
  mk_strided(&s1, 0, 0, 100, 100, 2);
  uint32_t p[] = {0, 0};
  uint64_t o[] = {0, 100};
  uint64_t l[] = {100, 101};
  mk(&s2, p, o, l, 2);
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s1, &d, &cur, &r), 0);
  assert_int_equal(cur, 2);
  size_t nruns = r.n;
  uint64_t bytes = r.bytes;
  assert_int_equal(kvf__pair(&s2, &d, &cur, &r), KVF_ESIZE);
  assert_int_equal(cur, 2);
  assert_int_equal(r.n, nruns);
  assert_int_equal(r.bytes, bytes);
  kvf__runs_free(&r);
  kvf__descs_free(&d);
  kvf__descs_free(&s1);
  kvf__descs_free(&s2);
}

static void test_pair_src_longer(void **state) {
  kvf__descs s, d;
  mk_strided(&s, 0, 0, 64, 64, 5);
  mk_strided(&d, 1, 0, 64, 64, 4);
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), KVF_ESIZE);
  assert_int_equal(cur, 0);
  assert_int_equal(r.n, 0);
  /* After a first part took 2, 3 more do not fit into the 2 left. */
  kvf__descs s2, s3;
  mk_strided(&s2, 0, 0, 64, 64, 2);
  mk_strided(&s3, 0, 0, 64, 64, 3);
  assert_int_equal(kvf__pair(&s2, &d, &cur, &r), 0);
  assert_int_equal(cur, 2);
  assert_int_equal(kvf__pair(&s3, &d, &cur, &r), KVF_ESIZE);
  assert_int_equal(cur, 2);
  /* But 2 do. */
  assert_int_equal(kvf__pair(&s2, &d, &cur, &r), 0);
  assert_int_equal(cur, 4);
  kvf__runs_free(&r);
  kvf__descs_free(&s);
  kvf__descs_free(&d);
  kvf__descs_free(&s2);
  kvf__descs_free(&s3);
}

static void test_pair_in_parts(void **state) {
  /* Grant: 6 scattered blocks of different sizes. */
  uint32_t dp[] = {2, 2, 3, 2, 2, 3};
  uint64_t dof[] = {0, 10000, 0, 20000, 30000, 50000};
  uint64_t l[] = {100, 200, 300, 400, 500, 600};
  kvf__descs d;
  mk(&d, dp, dof, l, 6);
  /* Three parts of 1, 3 and 2 descriptors. */
  uint32_t sp[] = {0, 0, 0, 0, 0, 0};
  uint64_t so[] = {5, 1005, 2005, 3005, 4005, 5005};
  kvf__descs p1, p2, p3;
  mk(&p1, sp, so, l, 1);
  mk(&p2, sp + 1, so + 1, l + 1, 3);
  mk(&p3, sp + 4, so + 4, l + 4, 2);
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&p1, &d, &cur, &r), 0);
  assert_int_equal(cur, 1);
  assert_int_equal(kvf__pair(&p2, &d, &cur, &r), 0);
  assert_int_equal(cur, 4);
  assert_int_equal(kvf__pair(&p3, &d, &cur, &r), 0);
  assert_int_equal(cur, 6);
  assert_int_equal(r.n, 6);
  assert_int_equal(r.bytes, 2100);
  for (size_t i = 0; i < 6; i++) {
    assert_run(&r.v[i], 0, so[i], dp[i], dof[i], l[i]);
    assert_int_equal(r.v[i].dst_desc, i); /* the grant's index, across parts */
  }
  kvf__runs_free(&r);
  kvf__descs_free(&d);
  kvf__descs_free(&p1);
  kvf__descs_free(&p2);
  kvf__descs_free(&p3);
}

/* ---- coalescing ------------------------------------------------------------ */

static void test_coalesce_both_sides(void **state) {
  kvf__descs s, d;
  mk_strided(&s, 0, 4096, 512, 512, 8);   /* contiguous */
  mk_strided(&d, 1, 65536, 512, 512, 8);  /* contiguous */
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), 0);
  assert_int_equal(r.n, 1);
  assert_run(&r.v[0], 0, 4096, 1, 65536, 8 * 512);
  assert_int_equal(r.v[0].dst_desc, 0); /* a coalesced run: its first descriptor */
  assert_int_equal(r.bytes, 8 * 512);
  kvf__runs_free(&r);
  kvf__descs_free(&s);
  kvf__descs_free(&d);
}

static void test_coalesce_one_side_only(void **state) {
  kvf__descs s, d;
  mk_strided(&s, 0, 0, 512, 512, 4);    /* contiguous */
  mk_strided(&d, 1, 0, 1024, 512, 4);   /* gaps */
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), 0);
  assert_int_equal(r.n, 4);
  for (size_t i = 0; i < 4; i++) assert_run(&r.v[i], 0, i * 512, 1, i * 1024, 512);
  for (size_t i = 0; i < 4; i++) assert_int_equal(r.v[i].dst_desc, i);
  kvf__runs_free(&r);
  /* And the other way round. */
  cur = 0;
  assert_int_equal(kvf__pair(&d, &s, &cur, &r), 0);
  assert_int_equal(r.n, 4);
  assert_int_equal(r.bytes, 2048);
  kvf__runs_free(&r);
  kvf__descs_free(&s);
  kvf__descs_free(&d);
}

/* Backwards adjacency (next block just before the previous) is no run. */
static void test_coalesce_reverse_order(void **state) {
  uint32_t p[] = {0, 0};
  uint64_t o[] = {512, 0};
  uint64_t l[] = {512, 512};
  kvf__descs s, d;
  mk(&s, p, o, l, 2);
  mk(&d, p, o, l, 2);
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), 0);
  assert_int_equal(r.n, 2);
  kvf__runs_free(&r);
  kvf__descs_free(&s);
  kvf__descs_free(&d);
}

static void test_coalesce_different_pools(void **state) {
  /* Offsets line up, pools change: src side. */
  uint32_t sp[] = {0, 1, 1};
  uint32_t dp[] = {2, 2, 3};
  uint64_t o[] = {0, 100, 200};
  uint64_t l[] = {100, 100, 100};
  kvf__descs s, d;
  mk(&s, sp, o, l, 3);
  mk(&d, dp, o, l, 3);
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), 0);
  assert_int_equal(r.n, 3);
  assert_run(&r.v[0], 0, 0, 2, 0, 100);
  assert_run(&r.v[1], 1, 100, 2, 100, 100);
  assert_run(&r.v[2], 1, 200, 3, 200, 100);
  assert_int_equal(r.bytes, 300);
  kvf__runs_free(&r);
  kvf__descs_free(&s);
  kvf__descs_free(&d);
}

static void test_coalesce_long_chain(void **state) {
  enum { N = 10000 };
  kvf__descs s, d;
  mk_strided(&s, 0, 0, 4096, 4096, N);
  mk_strided(&d, 5, 1u << 20, 4096, 4096, N);
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), 0);
  assert_int_equal(cur, N);
  assert_int_equal(r.n, 1);
  assert_run(&r.v[0], 0, 0, 5, 1u << 20, (uint64_t)N * 4096);
  assert_int_equal(r.bytes, (uint64_t)N * 4096);
  kvf__runs_free(&r);
  /* In parts: the runs of later parts extend the last run. */
  kvf__descs half1, half2;
  mk_strided(&half1, 0, 0, 4096, 4096, N / 2);
  mk_strided(&half2, 0, (uint64_t)N / 2 * 4096, 4096, 4096, N / 2);
  cur = 0;
  assert_int_equal(kvf__pair(&half1, &d, &cur, &r), 0);
  assert_int_equal(kvf__pair(&half2, &d, &cur, &r), 0);
  assert_int_equal(cur, N);
  assert_int_equal(r.n, 1);
  assert_int_equal(r.v[0].len, (uint64_t)N * 4096);
  kvf__runs_free(&r);
  kvf__descs_free(&half1);
  kvf__descs_free(&half2);
  kvf__descs_free(&s);
  kvf__descs_free(&d);
}

static void test_coalesce_scattered(void **state) {
  enum { N = 1000 };
  kvf__descs s, d;
  mk_strided(&s, 0, 0, 8192, 4096, N);
  mk_strided(&d, 1, 0, 8192, 4096, N);
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), 0);
  assert_int_equal(r.n, N);
  assert_true(r.cap >= r.n);
  uint64_t sum = 0;
  for (size_t i = 0; i < r.n; i++) {
    assert_run(&r.v[i], 0, i * 8192, 1, i * 8192, 4096);
    sum += r.v[i].len;
  }
  assert_int_equal(sum, r.bytes);
  assert_int_equal(r.bytes, s.total);
  kvf__runs_free(&r);
  kvf__descs_free(&s);
  kvf__descs_free(&d);
}

/* Mixed: runs of 3, 1 and 2 contiguous blocks; bytes sum right. */
static void test_coalesce_mixed(void **state) {
  uint32_t p[] = {0, 0, 0, 0, 0, 0};
  uint64_t so[] = {0, 10, 20, 100, 200, 230};
  uint64_t l[] = {10, 10, 10, 50, 30, 70};
  uint64_t dof[] = {1000, 1010, 1020, 5000, 7000, 7030};
  kvf__descs s, d;
  mk(&s, p, so, l, 6);
  mk(&d, p, dof, l, 6);
  kvf__runs r = {0};
  size_t cur = 0;
  assert_int_equal(kvf__pair(&s, &d, &cur, &r), 0);
  assert_int_equal(r.n, 3);
  assert_run(&r.v[0], 0, 0, 0, 1000, 30);
  assert_run(&r.v[1], 0, 100, 0, 5000, 50);
  assert_run(&r.v[2], 0, 200, 0, 7000, 100);
  assert_int_equal(r.bytes, 180);
  assert_int_equal(r.bytes, s.total);
  kvf__runs_free(&r);
  kvf__descs_free(&s);
  kvf__descs_free(&d);
}

/* ---- range sets -------------------------------------------------------------- */

static void test_rangeset_build(void **state) {
  /* Unsorted; pool 1 has overlapping [100,300) + [200,400), adjacent
   * [400,500); a separate [600,700); pool 0 has [50,60). */
  uint32_t p[] = {1, 0, 1, 1, 1};
  uint64_t o[] = {600, 50, 200, 100, 400};
  uint64_t l[] = {100, 10, 200, 200, 100};
  kvf__descs d;
  mk(&d, p, o, l, 5);
  kvf__rangeset rs;
  assert_int_equal(kvf__rangeset_build(&rs, &d), 0);
  assert_int_equal(rs.n, 3);
  assert_int_equal(rs.v[0].pool, 0);
  assert_int_equal(rs.v[0].start, 50);
  assert_int_equal(rs.v[0].end, 60);
  assert_int_equal(rs.v[1].pool, 1);
  assert_int_equal(rs.v[1].start, 100);
  assert_int_equal(rs.v[1].end, 500);
  assert_int_equal(rs.v[2].pool, 1);
  assert_int_equal(rs.v[2].start, 600);
  assert_int_equal(rs.v[2].end, 700);

  /* Exact boundaries. */
  assert_true(kvf__rangeset_contains(&rs, 1, 100, 400));
  assert_true(kvf__rangeset_contains(&rs, 1, 100, 1));
  assert_true(kvf__rangeset_contains(&rs, 1, 499, 1));
  assert_true(kvf__rangeset_contains(&rs, 1, 600, 100));
  assert_true(kvf__rangeset_contains(&rs, 0, 50, 10));
  /* One byte past the end, one before the start. */
  assert_false(kvf__rangeset_contains(&rs, 1, 100, 401));
  assert_false(kvf__rangeset_contains(&rs, 1, 500, 1));
  assert_false(kvf__rangeset_contains(&rs, 1, 99, 1));
  assert_false(kvf__rangeset_contains(&rs, 1, 99, 2));
  assert_false(kvf__rangeset_contains(&rs, 1, 600, 101));
  assert_false(kvf__rangeset_contains(&rs, 0, 50, 11));
  assert_false(kvf__rangeset_contains(&rs, 0, 49, 1));
  /* Spanning the merged adjacent pieces [200,400)+[400,500). */
  assert_true(kvf__rangeset_contains(&rs, 1, 350, 100));
  /* Spanning the gap [500,600). */
  assert_false(kvf__rangeset_contains(&rs, 1, 450, 200));
  assert_false(kvf__rangeset_contains(&rs, 1, 550, 10));
  /* Another pool at the same offsets. */
  assert_false(kvf__rangeset_contains(&rs, 2, 100, 10));
  assert_false(kvf__rangeset_contains(&rs, 0, 100, 10));
  assert_false(kvf__rangeset_contains(&rs, 1, 50, 10));
  /* Zero length is never contained. */
  assert_false(kvf__rangeset_contains(&rs, 1, 100, 0));
  /* Offset + length overflow. */
  assert_false(kvf__rangeset_contains(&rs, 1, 200, UINT64_MAX));
  assert_false(kvf__rangeset_contains(&rs, 1, UINT64_MAX, 2));
  assert_false(kvf__rangeset_contains(&rs, 1, UINT64_MAX, 1));
  kvf__rangeset_free(&rs);
  assert_null(rs.v);
  assert_int_equal(rs.n, 0);
  kvf__descs_free(&d);
}

/* Many ranges of one pool in a random order (the radix path: at least 64,
 * starts differing in several bytes), overlapping, touching and apart,
 * against a map of which bytes were granted: the set is sorted, merged
 * (no two touch) and holds exactly the granted bytes. */
static void test_rangeset_radix_random(void **state) {
  enum { N = 3000, SPAN = 1 << 18 };
  static uint8_t granted[SPAN];
  uint32_t *p = malloc(N * sizeof(*p));
  uint64_t *o = malloc(N * sizeof(*o)), *l = malloc(N * sizeof(*l));
  assert_non_null(p && o && l);
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int round = 0; round < 4; round++) {
    memset(granted, 0, sizeof(granted));
    for (int i = 0; i < N; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      p[i] = 7;
      l[i] = 1 + (x >> 40) % (round == 3 ? 64 : 40);
      o[i] = (x % (SPAN - 64)) & (round == 2 ? ~63ull : ~0ull);
      memset(granted + o[i], 1, l[i]);
    }
    kvf__descs d;
    mk(&d, p, o, l, N);
    kvf__rangeset rs;
    assert_int_equal(kvf__rangeset_build(&rs, &d), 0);
    static uint8_t got[SPAN];
    memset(got, 0, sizeof(got));
    for (size_t i = 0; i < rs.n; i++) {
      assert_int_equal(rs.v[i].pool, 7);
      assert_true(rs.v[i].start < rs.v[i].end && rs.v[i].end <= SPAN);
      if (i > 0) assert_true(rs.v[i - 1].end < rs.v[i].start);
      memset(got + rs.v[i].start, 1, rs.v[i].end - rs.v[i].start);
    }
    assert_memory_equal(got, granted, SPAN);
    for (uint64_t b = 0; b < SPAN; b += 97) assert_int_equal(kvf__rangeset_contains(&rs, 7, b, 1), granted[b]);
    kvf__rangeset_free(&rs);
    kvf__descs_free(&d);
  }
  free(p);
  free(o);
  free(l);
}

/* Two ranges in different pools that would be adjacent in offsets stay apart. */
static void test_rangeset_no_cross_pool_merge(void **state) {
  uint32_t p[] = {0, 1};
  uint64_t o[] = {0, 100};
  uint64_t l[] = {100, 100};
  kvf__descs d;
  mk(&d, p, o, l, 2);
  kvf__rangeset rs;
  assert_int_equal(kvf__rangeset_build(&rs, &d), 0);
  assert_int_equal(rs.n, 2);
  assert_false(kvf__rangeset_contains(&rs, 0, 50, 100));
  assert_false(kvf__rangeset_contains(&rs, 1, 0, 100));
  assert_true(kvf__rangeset_contains(&rs, 1, 100, 100));
  kvf__rangeset_free(&rs);
  kvf__descs_free(&d);
}

/* Contained ranges and duplicates merge; a range inside another keeps the
 * outer end. */
static void test_rangeset_nested(void **state) {
  uint32_t p[] = {0, 0, 0, 0};
  uint64_t o[] = {100, 150, 100, 0};
  uint64_t l[] = {200, 10, 200, 50};
  kvf__descs d;
  mk(&d, p, o, l, 4);
  kvf__rangeset rs;
  assert_int_equal(kvf__rangeset_build(&rs, &d), 0);
  assert_int_equal(rs.n, 2);
  assert_int_equal(rs.v[0].start, 0);
  assert_int_equal(rs.v[0].end, 50);
  assert_int_equal(rs.v[1].start, 100);
  assert_int_equal(rs.v[1].end, 300);
  assert_true(kvf__rangeset_contains(&rs, 0, 100, 200));
  assert_false(kvf__rangeset_contains(&rs, 0, 40, 70));
  kvf__rangeset_free(&rs);
  kvf__descs_free(&d);
}

static void test_rangeset_empty_and_many(void **state) {
  kvf__descs e = {0};
  kvf__rangeset rs;
  assert_int_equal(kvf__rangeset_build(&rs, &e), 0);
  assert_int_equal(rs.n, 0);
  assert_false(kvf__rangeset_contains(&rs, 0, 0, 1));
  kvf__rangeset_free(&rs);

  /* 5000 scattered blocks: every block in, every gap out. */
  enum { N = 5000 };
  kvf__descs d;
  mk_strided(&d, 3, 0, 200, 100, N);
  assert_int_equal(kvf__rangeset_build(&rs, &d), 0);
  assert_int_equal(rs.n, N);
  for (size_t i = 0; i < N; i++) {
    assert_true(kvf__rangeset_contains(&rs, 3, i * 200, 100));
    assert_false(kvf__rangeset_contains(&rs, 3, i * 200 + 100, 1));
    assert_false(kvf__rangeset_contains(&rs, 3, i * 200 + 50, 51));
  }
  assert_false(kvf__rangeset_contains(&rs, 2, 0, 1));
  assert_false(kvf__rangeset_contains(&rs, 4, 0, 1));
  kvf__rangeset_free(&rs);
  kvf__descs_free(&d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_from_wire_ok),
      cmocka_unit_test(test_from_wire_layout),
      cmocka_unit_test(test_from_wire_bad_length),
      cmocka_unit_test(test_from_wire_empty),
      cmocka_unit_test(test_from_wire_zero_length),
      cmocka_unit_test(test_from_wire_too_many),
      cmocka_unit_test(test_from_wire_overflow),
      cmocka_unit_test(test_wire_round_trip_100k),
      cmocka_unit_test(test_descs_check),
      cmocka_unit_test(test_descs_check_index),
      cmocka_unit_test(test_append),
      cmocka_unit_test(test_pair_equal),
      cmocka_unit_test(test_pair_size_mismatch_each_index),
      cmocka_unit_test(test_pair_mismatch_mid_cursor),
      cmocka_unit_test(test_pair_src_longer),
      cmocka_unit_test(test_pair_in_parts),
      cmocka_unit_test(test_coalesce_both_sides),
      cmocka_unit_test(test_coalesce_one_side_only),
      cmocka_unit_test(test_coalesce_reverse_order),
      cmocka_unit_test(test_coalesce_different_pools),
      cmocka_unit_test(test_coalesce_long_chain),
      cmocka_unit_test(test_coalesce_scattered),
      cmocka_unit_test(test_coalesce_mixed),
      cmocka_unit_test(test_rangeset_build),
      cmocka_unit_test(test_rangeset_radix_random),
      cmocka_unit_test(test_rangeset_no_cross_pool_merge),
      cmocka_unit_test(test_rangeset_nested),
      cmocka_unit_test(test_rangeset_empty_and_many),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
