/* test_rdma_gather.c - work requests that gather runs (rdma_post.c:
 * kvf__rdma_span, what a progress thread claims for the room in its send
 * queue, and kvf__rdma_build_chain, the chain it builds), without a
 * device: the chain is built into a QP's template and read back. Every
 * chain is checked byte for byte against its runs: each entry's source
 * and each byte's remote address are the runs', in order, nothing more or
 * less; a request gathers only runs that land back to back through one
 * key, within its entries (max_sge) and rdma-slice bytes, and the span
 * claims exactly the runs that many requests hold; a plain chain after
 * gathered ones finds the template as it was. */
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

/* Builds runs[first .. first + n) (through order when given) and checks the
 * chain against them; returns its work requests. */
static size_t check_chain(rig *g, const kvf__run *runs, const uint32_t *order, const uint32_t *rkeys, size_t first,
                          size_t n) {
  size_t wrs = 0;
  uint64_t bytes = kvf__rdma_build_chain(&g->lk, &g->q, runs, order, first, n, rkeys, true, &wrs);
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
        assert_int_equal(src, r->src_off + at); /* the entry reads the run's source */
        assert_int_equal(dst, r->dst_off + at); /* which lands where the run says */
        uint64_t take = r->len - at < left ? r->len - at : left;
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
    size_t cnt = kvf__rdma_span(&g->q, runs, NULL, NULL, first, n - first, CHAIN_MAX);
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
  kvf__rdma_build_chain(&g->lk, &g->q, runs, NULL, 0, 8, NULL, false, &plain);
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
  size_t cnt = kvf__rdma_span(&g->q, runs, NULL, NULL, 0, 6, CHAIN_MAX);
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
  assert_int_equal(kvf__rdma_span(&g->q, runs, NULL, NULL, 0, 64, CHAIN_MAX), CHAIN_MAX);
  assert_int_equal(check_chain(g, runs, NULL, NULL, 0, CHAIN_MAX), CHAIN_MAX);
  free(runs);

  runs = rows(64, 4096, 0, perm);
  uint32_t rkeys[64];
  for (size_t i = 0; i < 64; i++) rkeys[i] = 500 + (uint32_t)(i / 8); /* a window per 8 rows */
  assert_int_equal(kvf__rdma_span(&g->q, runs, NULL, rkeys, 0, 64, 3), 24);
  assert_int_equal(check_chain(g, runs, NULL, rkeys, 0, 24), 3);

  kvfd.cfg.rdma_slice = 16384; /* 4 rows a request */
  assert_int_equal(kvf__rdma_span(&g->q, runs, NULL, NULL, 0, 64, 5), 20);
  assert_int_equal(check_chain(g, runs, NULL, NULL, 0, 20), 5);

  rig *one = rig_new(1);
  assert_int_equal(kvf__rdma_span(&one->q, runs, NULL, NULL, 0, 64, 7), 7);
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
  size_t cnt = kvf__rdma_span(&g->q, runs, order, NULL, 2, 18, CHAIN_MAX);
  assert_int_equal(cnt, 18);
  /* rows 2-5, 6-9, then 30-33, 34-37, 38-39 */
  assert_int_equal(check_chain(g, runs, order, NULL, 2, 18), 5);
  free(runs);
  free(perm);
  free(g);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_staged_rows_gather),
      cmocka_unit_test(test_adjacent_sources_share_an_entry),
      cmocka_unit_test(test_no_gather),
      cmocka_unit_test(test_order),
  };
  return cmocka_run_group_tests_name("rdma gathered work requests", tests, NULL, NULL);
}
