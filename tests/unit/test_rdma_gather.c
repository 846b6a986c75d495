/* test_rdma_gather.c - work requests that gather runs (rdma_post.c:
 * kvf__rdma_span, what a progress thread claims for the room in its send
 * queue, and kvf__rdma_build_chain, the chain it builds), without a
 * device: the chain is built into a QP's template and read back. Every
 * chain is checked byte for byte against its runs: each entry's source
 * and each byte's remote address are the runs', in order, nothing more or
 * less; a request gathers only runs that land back to back through one
 * key, within its entries (max_sge) and rdma-slice bytes, and the span
 * claims exactly the runs that many requests hold; a plain chain after
 * gathered ones finds the template as it was. Also kvf__rdma_cut_runs
 * (rdma_stage.c): a staged part's runs cut where the receiver's windows
 * over its slice meet. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "transport/rdma/rdma_int.h"

#define SRC_BASE (1ull << 44)
/* check_chain's last chain, before the template is put back: its first
 * request's entries and its first entry's length */
static int first_sges;
static uint32_t first_len;
#define RADDR (1ull << 40)

typedef struct rig {
  rdma_transport rt;
  uint8_t *bases[1];
  rdev dev;
  rlink lk;
  rpeer rp;
  rqp q;
  uint32_t lkey, rkey;
  uint64_t raddr;
} rig;

static rig *rig_new(uint32_t max_sge) {
  rig *g = calloc(1, sizeof(*g));
  assert_non_null(g);
  g->bases[0] = (uint8_t *)(uintptr_t)SRC_BASE; /* addresses are computed, never touched */
  g->rt.pool_base = g->bases;
  g->lkey = 11;
  g->rkey = 12;
  g->raddr = RADDR;
  g->dev.lkey = &g->lkey;
  g->rp.rt = &g->rt;
  g->lk = (rlink){.rp = &g->rp, .dev = &g->dev, .rkey = &g->rkey, .raddr = &g->raddr, .n_rpools = 1};
  g->q = (rqp){.lk = &g->lk, .outbound = true, .max_sge = max_sge, .max_inline = 64};
  kvf__rdma_init_chain(&g->q);
  kvfd.cfg.rdma_slice = 1u << 20;
  return g;
}

/* Where byte `at` of run r is read: a strided run's pieces a step apart. */
static uint64_t source_of(const kvf__run *r, const rstride *st, uint64_t at) {
  return st && st->unit ? r->src_off + at / st->unit * st->step + at % st->unit : r->src_off + at;
}

/* The bytes an entry may read on from byte `at` of r: a strided run's
 * entry never crosses a piece. */
static uint64_t readable(const kvf__run *r, const rstride *st, uint64_t at) {
  return st && st->unit ? st->unit - at % st->unit : r->len - at;
}

/* Builds runs[first .. first + n) (through order when given; st: strided)
 * and checks the chain against them; returns its work requests. */
static size_t check_strided_chain(rig *g, const kvf__run *runs, const uint32_t *order, const uint32_t *rkeys,
                                  const rstride *st, size_t first, size_t n) {
  size_t wrs = 0;
  uint64_t bytes = kvf__rdma_build_chain(&g->lk, &g->q, runs, order, first, n, rkeys, st, true, &wrs);
  assert_true(wrs >= 1 && wrs <= CHAIN_MAX && wrs <= n);
  size_t k = 0; /* the run being matched, and how far */
  uint64_t at = 0, total = 0;
  for (size_t w = 0; w < wrs; w++) {
    const struct ibv_send_wr *wr = &g->q.wr[w];
    assert_ptr_equal(wr->next, w + 1 < wrs ? &g->q.wr[w + 1] : NULL);
    assert_int_equal(wr->opcode, IBV_WR_RDMA_WRITE);
    assert_true(wr->num_sge >= 1 && (uint32_t)wr->num_sge <= (g->q.max_sge > 1 ? g->q.max_sge : 1));
    uint64_t dst = wr->wr.rdma.remote_addr - RADDR, wr_bytes = 0;
    const kvf__run *r0 = &runs[order ? order[first + k] : first + k];
    assert_int_equal(wr->wr.rdma.rkey, rkeys ? rkeys[order ? order[first + k] : first + k] : g->rkey);
    assert_int_equal(dst, r0->dst_off + at);
    for (int e = 0; e < wr->num_sge; e++) {
      const struct ibv_sge *s = &wr->sg_list[e];
      assert_int_equal(s->lkey, g->lkey);
      uint64_t src = s->addr - SRC_BASE, left = s->length;
      assert_true(left > 0);
      while (left) {
        assert_true(k < n);
        size_t j = order ? order[first + k] : first + k;
        const kvf__run *r = &runs[j];
        if (rkeys) assert_int_equal(rkeys[j], wr->wr.rdma.rkey);
        assert_int_equal(src, source_of(r, st, at)); /* the entry reads the run's source */
        assert_int_equal(dst, r->dst_off + at);        /* which lands where the run says */
        uint64_t take = readable(r, st, at) < left ? readable(r, st, at) : left;
        src += take;
        dst += take;
        left -= take;
        at += take;
        wr_bytes += take;
        if (at == r->len) {
          k++;
          at = 0;
        }
      }
    }
    assert_true(wr_bytes <= kvfd.cfg.rdma_slice || wr->num_sge == 1);
    assert_int_equal(!!(wr->send_flags & IBV_SEND_INLINE), wr_bytes <= g->q.max_inline);
    total += wr_bytes;
  }
  assert_int_equal(k, n); /* every run, whole */
  assert_int_equal(at, 0);
  assert_int_equal(bytes, total);
  first_sges = g->q.wr[0].num_sge;
  first_len = g->q.wr[0].sg_list[0].length;
  kvf__rdma_restore_chain(&g->q, wrs);
  return wrs;
}

static size_t check_chain(rig *g, const kvf__run *runs, const uint32_t *order, const uint32_t *rkeys, size_t first,
                          size_t n) {
  return check_strided_chain(g, runs, order, rkeys, NULL, first, n);
}

/* n runs of len bytes landing back to back from dst0, their sources the
 * slots of perm (a slot is len bytes). */
static kvf__run *rows(size_t n, uint64_t len, uint64_t dst0, const uint32_t *perm) {
  kvf__run *v = calloc(n, sizeof(*v));
  assert_non_null(v);
  for (size_t i = 0; i < n; i++)
    v[i] = (kvf__run){.src_off = perm[i] * len, .dst_off = dst0 + i * len, .len = len, .dst_desc = UINT32_MAX};
  return v;
}

static uint32_t *shuffled(size_t n, uint64_t seed) {
  uint32_t *p = malloc(n * sizeof(*p));
  assert_non_null(p);
  for (size_t i = 0; i < n; i++) p[i] = (uint32_t)(2 * i); /* never adjacent */
  for (size_t i = n - 1; i > 0; i--) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    size_t k = (size_t)(seed >> 33) % (i + 1);
    uint32_t t = p[i];
    p[i] = p[k];
    p[k] = t;
  }
  return p;
}

/* A staged part's rows: back to back at the receiver, scattered at the
 * source: 32 entries a request, a chain within CHAIN_BYTES. */
static void test_staged_rows_gather(void **state) {
  rig *g = rig_new(32);
  size_t n = 1000;
  uint32_t *perm = shuffled(n, 7);
  kvf__run *runs = rows(n, 4096, 0, perm);
  size_t first = 0, chains = 0, wrs = 0;
  while (first < n) {
    size_t cnt = kvf__rdma_span(&g->q, runs, NULL, NULL, NULL, first, n - first, CHAIN_MAX);
    assert_true(cnt >= 1);
    /* 1 MiB a chain: 256 rows, 8 requests of 32 */
    assert_int_equal(cnt, n - first < 256 ? n - first : 256);
    wrs += check_chain(g, runs, NULL, NULL, first, cnt);
    first += cnt;
    chains++;
  }
  assert_int_equal(chains, 4);
  assert_int_equal(wrs, 32); /* 8 requests per 256 rows; the last 232 rows: 8 */
  /* a plain chain after gathered ones: a request a run, each its own entry */
  size_t plain = 0;
  kvf__rdma_build_chain(&g->lk, &g->q, runs, NULL, 0, 8, NULL, NULL, false, &plain);
  assert_int_equal(plain, 8);
  for (size_t i = 0; i < 8; i++) {
    assert_ptr_equal(g->q.wr[i].sg_list, &g->q.sge[i]);
    assert_int_equal(g->q.wr[i].num_sge, 1);
    assert_int_equal(g->q.sge[i].addr, SRC_BASE + runs[i].src_off);
    assert_int_equal(g->q.wr[i].wr.rdma.remote_addr, RADDR + runs[i].dst_off);
  }
  assert_null(g->q.wr[7].next);
  kvf__rdma_restore_chain(&g->q, plain);
  free(runs);
  free(perm);
  free(g);
}

/* Sources that follow each other too extend one entry: a request may then
 * hold more runs than entries. */
static void test_adjacent_sources_share_an_entry(void **state) {
  rig *g = rig_new(2);
  uint32_t perm[] = {10, 11, 12, 40, 41, 7};
  kvf__run *runs = rows(6, 256, 4096, perm);
  size_t cnt = kvf__rdma_span(&g->q, runs, NULL, NULL, NULL, 0, 6, CHAIN_MAX);
  assert_int_equal(cnt, 6);
  /* [10 11 12][40 41] in one request of two entries, [7] in the next */
  assert_int_equal(check_chain(g, runs, NULL, NULL, 0, 6), 2);
  assert_int_equal(first_sges, 2);
  assert_int_equal(first_len, 3 * 256);
  free(runs);
  free(g);
}

/* No gathering where the destinations do not follow, the keys (memory
 * windows) differ, the request would pass rdma-slice, or the device takes
 * one entry; the span then counts one request a run, as before. */
static void test_no_gather(void **state) {
  rig *g = rig_new(32);
  uint32_t *perm = shuffled(64, 3);
  kvf__run *runs = rows(64, 4096, 0, perm);
  for (size_t i = 0; i < 64; i += 2) runs[i].dst_off += 1u << 30; /* every other one elsewhere */
  assert_int_equal(kvf__rdma_span(&g->q, runs, NULL, NULL, NULL, 0, 64, CHAIN_MAX), CHAIN_MAX);
  assert_int_equal(check_chain(g, runs, NULL, NULL, 0, CHAIN_MAX), CHAIN_MAX);
  free(runs);

  runs = rows(64, 4096, 0, perm);
  uint32_t rkeys[64];
  for (size_t i = 0; i < 64; i++) rkeys[i] = 500 + (uint32_t)(i / 8); /* a window per 8 rows */
  assert_int_equal(kvf__rdma_span(&g->q, runs, NULL, rkeys, NULL, 0, 64, 3), 24);
  assert_int_equal(check_chain(g, runs, NULL, rkeys, 0, 24), 3);

  kvfd.cfg.rdma_slice = 16384; /* 4 rows a request */
  assert_int_equal(kvf__rdma_span(&g->q, runs, NULL, NULL, NULL, 0, 64, 5), 20);
  assert_int_equal(check_chain(g, runs, NULL, NULL, 0, 20), 5);

  rig *one = rig_new(1);
  assert_int_equal(kvf__rdma_span(&one->q, runs, NULL, NULL, NULL, 0, 64, 7), 7);
  assert_int_equal(check_chain(one, runs, NULL, NULL, 0, 7), 7);
  free(one);
  free(runs);
  free(perm);
  free(g);
}

/* Through a lane's order (memory windows, several QPs): gathered in that
 * order, from any position. */
static void test_order(void **state) {
  rig *g = rig_new(4);
  uint32_t *perm = shuffled(40, 9);
  kvf__run *runs = rows(40, 1024, 0, perm);
  uint32_t order[20];
  for (size_t i = 0; i < 20; i++) order[i] = (uint32_t)(i < 10 ? i : 30 + (i - 10)); /* two stretches */
  size_t cnt = kvf__rdma_span(&g->q, runs, order, NULL, NULL, 2, 18, CHAIN_MAX);
  assert_int_equal(cnt, 18);
  /* rows 2-5, 6-9, then 30-33, 34-37, 38-39 */
  assert_int_equal(check_chain(g, runs, order, NULL, 2, 18), 5);
  free(runs);
  free(perm);
  free(g);
}

/* Strided runs (an NHD source's tokens of one head into an HND head
 * slice, kv_xform.h): an entry a piece, read a step apart; requests gather
 * whole runs back to back within max_sge entries (two head slices of 16
 * pieces at 32), never a run's pieces over two requests; a run of one piece
 * after one of one piece whose source follows shares its entry. */
static void test_strided_runs(void **state) {
  rig *g = rig_new(32);
  rstride st = {.unit = 256, .step = 8 * 256}; /* 8 heads of 128 x 2 bytes */
  size_t n = 64;                               /* 4 blocks x 8 heads x 2 regions */
  kvf__run *runs = calloc(n, sizeof(*runs));
  assert_non_null(runs);
  for (size_t i = 0; i < n; i++) { /* head slice i: 16 tokens, back to back at the receiver */
    uint64_t block = i / 8, head = i % 8;
    runs[i] = (kvf__run){.src_off = (block * 3 + 1) * 32768 + head * 256, .dst_off = i * 4096, .len = 4096,
                         .dst_desc = UINT32_MAX};
  }
  size_t first = 0, wrs = 0;
  while (first < n) {
    size_t cnt = kvf__rdma_span(&g->q, runs, NULL, NULL, &st, first, n - first, CHAIN_MAX);
    assert_int_equal(cnt, n - first < 64 ? n - first : 64); /* 32 requests of 2 runs, 256 KiB: one chain */
    size_t w = check_strided_chain(g, runs, NULL, NULL, &st, first, cnt);
    assert_int_equal(first_sges, 32);
    assert_int_equal(first_len, 256);
    wrs += w;
    first += cnt;
  }
  assert_int_equal(wrs, 32);
  /* 20 entries at most: one run a request (16 + 16 > 20) */
  rig *small = rig_new(20);
  assert_int_equal(kvf__rdma_span(&small->q, runs, NULL, NULL, &st, 0, 10, CHAIN_MAX), 10);
  assert_int_equal(check_strided_chain(small, runs, NULL, NULL, &st, 0, 10), 10);
  assert_int_equal(first_sges, 16);
  free(small);
  /* runs of one piece whose sources follow: one entry, as plain runs */
  kvf__run one[3] = {{.src_off = 0, .dst_off = 0, .len = 256}, {.src_off = 256, .dst_off = 256, .len = 256},
                     {.src_off = 4096, .dst_off = 512, .len = 512}};
  assert_int_equal(check_strided_chain(g, one, NULL, NULL, &st, 0, 3), 1);
  assert_int_equal(first_sges, 3); /* [0, 512) from 0; then 4096 and 4096 + step */
  assert_int_equal(first_len, 512);
  free(runs);
  /* heads of 128 bytes through memory windows: 2 KiB slices, a key a block */
  rstride small_st = {.unit = 128, .step = 8 * 128};
  runs = calloc(64, sizeof(*runs));
  uint32_t keys[64];
  for (size_t i = 0; i < 64; i++) {
    runs[i] = (kvf__run){.src_off = (i / 8) * 16384 + (i % 8) * 128, .dst_off = (i / 8) * 3 * 16384 + (i % 8) * 2048,
                         .len = 2048, .dst_desc = UINT32_MAX};
    keys[i] = 700 + (uint32_t)(i / 8);
  }
  assert_int_equal(kvf__rdma_span(&g->q, runs, NULL, keys, &small_st, 0, 64, CHAIN_MAX), 64);
  assert_int_equal(check_strided_chain(g, runs, NULL, keys, &small_st, 0, 64), 32);
  free(runs);
  free(g);
}

/* kvf__rdma_cut_runs: the runs of a staged part cut where the receiver's
 * windows over its slice meet. Random runs (some crossing several cuts,
 * some ending or starting on one) against random cuts: the pieces map the
 * same bytes, in the same order, and none crosses a cut. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(uint64_t n) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state % n;
}

static void test_runs_cut_at_windows(void **state) {
  (void)state;
  for (int trial = 0; trial < 200; trial++) {
    uint64_t cuts[8];
    size_t nc = rnd(8);
    for (size_t c = 0; c < nc; c++) cuts[c] = (c ? cuts[c - 1] : 0) + 1 + rnd(64 << 10);
    kvf__runs runs = {0};
    size_t n = 1 + rnd(12);
    runs.v = calloc(n, sizeof(*runs.v));
    assert_non_null(runs.v);
    uint64_t dst = rnd(4096);
    for (size_t i = 0; i < n; i++) {
      uint64_t len = 1 + rnd(nc ? cuts[nc - 1] / 2 + 2 : 8192);
      if (nc && rnd(4) == 0) dst = cuts[rnd(nc)]; /* starts on a cut */
      runs.v[i] = (kvf__run){.src_pool = 1, .dst_pool = 2, .src_off = rnd(1 << 20), .dst_off = dst, .len = len,
                             .dst_desc = UINT32_MAX};
      dst += len + rnd(3) * 512;
    }
    runs.n = runs.cap = n;
    kvf__run *orig = malloc(n * sizeof(*orig));
    assert_non_null(orig);
    memcpy(orig, runs.v, n * sizeof(*orig));
    assert_int_equal(kvf__rdma_cut_runs(&runs, cuts, nc), 0);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) { /* orig[i] is pieces k.. laid end to end */
      uint64_t at = 0;
      while (at < orig[i].len) {
        assert_true(k < runs.n);
        const kvf__run *r = &runs.v[k++];
        assert_int_equal(r->src_off, orig[i].src_off + at);
        assert_int_equal(r->dst_off, orig[i].dst_off + at);
        assert_int_equal(r->src_pool, 1);
        assert_int_equal(r->dst_pool, 2);
        assert_true(r->len > 0);
        for (size_t c = 0; c < nc; c++) assert_false(r->dst_off < cuts[c] && cuts[c] < r->dst_off + r->len);
        at += r->len;
      }
      assert_int_equal(at, orig[i].len);
    }
    assert_int_equal(k, runs.n);
    free(orig);
    kvf__runs_free(&runs);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_staged_rows_gather),
      cmocka_unit_test(test_adjacent_sources_share_an_entry),
      cmocka_unit_test(test_no_gather),
      cmocka_unit_test(test_order),
      cmocka_unit_test(test_strided_runs),
      cmocka_unit_test(test_runs_cut_at_windows),
  };
  return cmocka_run_group_tests_name("rdma gathered work requests", tests, NULL, NULL);
}
