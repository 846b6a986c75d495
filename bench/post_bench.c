/* post_bench - the rdma sender's own cost to post one descriptor, on this
 * machine's CPU, for one transfer of N scattered 1 KiB descriptors (the
 * 100k case of bench-rdma):
 *
 *   loop   what ops->post does on the loop per run: the checks, the ticket
 *          and, with memory windows, each run's window from the Grant's
 *          window_of (decoding the Grant's windows once per transfer) and
 *          the lanes (one per QP the windows are bound on);
 *   build  what the progress threads do per run: claim (kvf__rdma_span)
 *          and build the work-request chains, CHAIN_MAX requests at a
 *          time, lane by lane (scattered descriptors gather nothing).
 *
 * The chains are built and not posted: ibv_post_send is the provider's and
 * the NIC's work (rxe does the NIC's in it), which bench-rdma measures in
 * the soft-RoCE VM, where this same cost is blurred by the emulation. The
 * functions timed are the daemon's own (rdma_post.c, rdma_mw.c, reached
 * through rdma_int.h and linked with the daemon's objects), run against a
 * fake peer of QPS dialed QPs on one device (no verbs call is made).
 *
 *   post-bench [N REPS QPS]     (defaults 100000 9 2: rdma-qps-per-peer)
 *
 * Prints one JSON line per mode (windows off, on): ns per descriptor, the
 * mean over REPS transfers after a first, untimed one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/rdma_int.h"

#define SLOT 1024u
#define POOL (1ull << 30)

static uint64_t lcg(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

/* n distinct 1 KiB slots of the pool, in random order (as kvferry-bench
 * scatters a request's blocks). */
static int scattered(kvf__descs *d, size_t n, uint64_t seed) {
  size_t slots = POOL / SLOT;
  uint32_t *perm = malloc(slots * sizeof(*perm));
  d->pool = calloc(n, sizeof(*d->pool));
  d->offset = malloc(n * sizeof(*d->offset));
  d->length = malloc(n * sizeof(*d->length));
  if (!perm || !d->pool || !d->offset || !d->length) return -1;
  for (size_t i = 0; i < slots; i++) perm[i] = (uint32_t)i;
  for (size_t i = 0; i < n; i++) { /* a partial Fisher-Yates shuffle */
    size_t j = i + lcg(&seed) % (slots - i);
    uint32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
    d->offset[i] = (uint64_t)perm[i] * SLOT;
    d->length[i] = SLOT;
  }
  d->n = n;
  d->total = (uint64_t)n * SLOT;
  free(perm);
  return 0;
}

typedef struct rig {
  rdev dev;
  rlink lk;
  rqp *qs;
  rpeer rp;
  uint32_t lkey, rkey;
  uint64_t raddr, psize;
  int fake_qp;            /* what the QPs' ibv_qp pointers point at: never used */
} rig;

static int rig_init(rig *g, rdma_transport *rt, unsigned nq) {
  memset(g, 0, sizeof(*g));
  g->rp.rt = rt;
  g->dev.rt = rt;
  g->lkey = 11;
  g->rkey = 12;
  g->raddr = 1ull << 40;
  g->psize = POOL;
  g->dev.lkey = &g->lkey;
  g->lk = (rlink){.rp = &g->rp, .dev = &g->dev, .rkey = &g->rkey, .raddr = &g->raddr, .n_rpools = 1};
  if (!(g->qs = calloc(nq, sizeof(*g->qs)))) return -1;
  for (unsigned j = 0; j < nq; j++) {
    rqp *q = &g->qs[j];
    *q = (rqp){.lk = &g->lk, .qp = (struct ibv_qp *)&g->fake_qp, .qp_num = 100 + j, .outbound = true,
               .max_sge = GATHER_MAX};
    kvf__rdma_init_chain(q);
    g->lk.all[g->lk.n_all++] = q;
  }
  g->rp.links[0] = &g->lk;
  g->rp.n_links = 1;
  g->rp.pool_size = &g->psize;
  g->rp.n_pools = 1;
  return 0;
}

/* The Grant of dst as a receiver with memory windows makes it: its ranges
 * planned into at most rdma-mw-max-windows windows, bound round-robin on
 * the QPs, and each descriptor's window. */
static int grant_windows(const kvf__descs *dst, unsigned nq, kvf__tp_grant *t) {
  kvf__rangeset rs;
  kvf__range *win;
  size_t nw, merged;
  if (kvf__rangeset_build(&rs, dst) || kvf__mw_plan(&rs, kvfd.cfg.rdma_mw_max_windows, &win, &nw, &merged))
    return -1;
  kvf__rangeset_free(&rs);
  if (kvf__rdma_grant_part_alloc(t, nw, dst->n) || kvf__mw_index(dst, win, nw, t->of)) return -1;
  for (size_t i = 0; i < nw; i++) {
    kvf__mw_rec r = {.pool = win[i].pool, .off = win[i].start, .len = win[i].end - win[i].start,
                     .rkey = 1000 + (uint32_t)i, .qpn = 100 + (uint32_t)(i % nq), .dev = 0};
    kvf__mw_rec_put(t->win + i * KVF__MW_REC, &r);
  }
  free(win);
  return 0;
}

/* The progress threads' part: every body run into chains, lane by lane
 * (with windows), else spread over the QPs; the tail last. */
static uint64_t build_all(rig *g, ticket *tk, unsigned nq) {
  uint64_t bytes = 0;
  size_t nl = tk->lanes ? tk->n_lanes : 1;
  for (size_t l = 0; l < nl; l++) {
    size_t first = tk->lanes ? tk->lanes[l].next : 0, end = tk->lanes ? tk->lanes[l].end : tk->n_body;
    for (unsigned k = 0; first < end; k++) {
      rqp *q = tk->lanes ? tk->lanes[l].q : &g->qs[k % nq];
      size_t wrs, cnt = end - first < CHAIN_MAX ? end - first : CHAIN_MAX;
      if (tk->gather)
        cnt = kvf__rdma_span(q, tk->runs, tk->order, tk->rkeys, &tk->stride, first, end - first, CHAIN_MAX);
      bytes += kvf__rdma_build_chain(&g->lk, q, tk->runs, tk->order, first, cnt, tk->rkeys, &tk->stride, tk->gather,
                                     &wrs);
      kvf__rdma_restore_chain(q, wrs);
      first += cnt;
    }
  }
  if (tk->has_tail) {
    rqp *q = tk->tail_q ? tk->tail_q : &g->qs[0];
    size_t wrs;
    bytes += kvf__rdma_build_chain(&g->lk, q, &tk->tail, NULL, 0, 1, tk->rkeys ? &tk->tail_rkey : NULL, NULL, false,
                                   &wrs);
    kvf__rdma_restore_chain(q, wrs);
  }
  return bytes;
}

/* One transfer: ns on the loop and building, *bytes the chains carry. */
static int one_transfer(rig *g, const kvf__descs *src, const kvf__descs *dst, const kvf__tp_grant *grant,
                        unsigned nq, uint64_t *loop_ns, uint64_t *build_ns, uint64_t *bytes) {
  kvf__runs runs = {0};
  size_t cur = 0, extra = 0;
  if (kvf__pair(src, dst, &cur, &runs)) return -1; /* the transfer layer's part: desc-bench */
  kvf__xfer x = {.handle = 7};
  if (grant) x.tp_grant = *grant;
  uint64_t t0 = mono_ns();
  xstate *xs = kvf__rdma_check_runs(&g->rp, &runs, kvfd.cfg.rdma_slice, false, &extra) == 0 ? kvf__rdma_xstate_of(&x) : NULL;
  ticket *tk = xs ? kvf__rdma_ticket_new(g->rp.rt, &x, &runs, kvfd.cfg.rdma_slice, extra, true) : NULL;
  int rc = tk ? 0 : -1;
  if (tk && grant && kvf__rdma_ticket_windows(tk, &g->rp, &x, xs) != 0) rc = -1;
  uint64_t t1 = mono_ns();
  if (rc == 0) *bytes = build_all(g, tk, nq);
  *build_ns = mono_ns() - t1;
  *loop_ns = t1 - t0;
  if (tk) kvf__rdma_ticket_free(tk);
  if (xs) kvf__rdma_wtable_free(xs->wt);
  free(xs);
  kvf__runs_free(&runs);
  return rc;
}

int main(int argc, char **argv) {
  size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 100000;
  unsigned reps = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 10) : 9;
  unsigned nq = argc > 3 ? (unsigned)strtoul(argv[3], NULL, 10) : 2;
  if (n == 0 || n > POOL / SLOT || reps == 0 || nq == 0 || nq > MAX_QPS) {
    fprintf(stderr, "usage: post-bench [N (1..%llu) REPS QPS (1..%d)]\n", POOL / SLOT, MAX_QPS);
    return 2;
  }
  kvf__keep_freed_memory(); /* the daemon's heap policy */
  kvfd.cfg.rdma_slice = 1u << 20;
  kvfd.cfg.rdma_mw_max_windows = 16384;
  kvfd.n_pools = 1;
  static rdma_transport rt;
  static uint8_t *bases[1];
  bases[0] = (uint8_t *)(uintptr_t)(1ull << 44); /* addresses are computed, never touched */
  rt.pool_base = bases;
  rig g;
  kvf__descs src, dst;
  kvf__tp_grant grant = {0};
  if (rig_init(&g, &rt, nq) || scattered(&src, n, 1) || scattered(&dst, n, 2) || grant_windows(&dst, nq, &grant)) {
    fprintf(stderr, "post-bench: out of memory\n");
    return 1;
  }
  for (int mode = 0; mode < 2; mode++) {
    uint64_t loop = 0, build = 0, bytes = 0;
    for (unsigned r = 0; r <= reps; r++) {
      uint64_t l, b;
      if (one_transfer(&g, &src, &dst, mode ? &grant : NULL, nq, &l, &b, &bytes) != 0) {
        fprintf(stderr, "post-bench: the post failed\n");
        return 1;
      }
      if (r > 0) { /* the first warms the heap, as the daemon's earlier transfers do */
        loop += l;
        build += b;
      }
    }
    if (bytes != src.total) {
      fprintf(stderr, "post-bench: the chains carry %llu bytes of %llu\n", (unsigned long long)bytes,
              (unsigned long long)src.total);
      return 1;
    }
    double per = (double)reps * (double)n;
    printf("{\"descriptors\": %zu, \"reps\": %u, \"qps\": %u, \"memory_windows\": %s, \"windows\": %zu, "
           "\"loop_ns\": %.1f, \"build_ns\": %.1f, \"sum_ns\": %.1f}\n",
           n, reps, nq, mode ? "true" : "false", mode ? grant.win_len / KVF__MW_REC : 0, (double)loop / per,
           (double)build / per, (double)(loop + build) / per);
  }
  kvf__descs_free(&src);
  kvf__descs_free(&dst);
  free(grant.win);
  free(grant.of);
  free(g.qs);
  return 0;
}
