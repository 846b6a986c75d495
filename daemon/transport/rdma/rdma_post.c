/* rdma_post.c - the rdma data path: what ops->post does on the loop, what
 * the progress threads do with it, and what they hand back.
 *
 * Posting (loop). ops->post checks the runs against the peer's pools, cuts
 * them at rdma-slice into a ticket and queues it on the peer (rpeer); with
 * memory windows each run also gets its window's rkey and the lane of the QP
 * that window is bound on (rdma_mw.c). The last run of a transfer (the tail)
 * is held back until every other write of it completed, on whatever QP or
 * device, and then goes as RDMA_WRITE_WITH_IMM carrying the low 32 bits of
 * the grant handle. Writes that failed never release a tail.
 *
 * Progress threads (one per device). Each claims chunks of runs from the
 * peers' queues for each of its QPs that has room (QP_WINDOW bytes in
 * flight), builds a linked chain of RDMA_WRITE work requests of which only
 * the last is signalled (runs that land back to back share one request,
 * its scatter/gather list gathering their sources: a staged part's rows,
 * rdma_stage.c), and rings the doorbell once per chain: QPs and
 * devices take chunks as fast as they finish theirs, which stripes a
 * transfer over all of them. They poll their CQs, keep zero-length receives
 * posted on accepted QPs (a WRITE_WITH_IMM consumes one) and, after
 * rdma-poll-us without work, sleep on the device's completion channel.
 *
 * To the loop. Completed tickets, completion notices (the peer's
 * WRITE_WITH_IMM) and failures go through the instance's mailbox; the loop
 * calls back kvf__xfer_on_posted, kvf__xfer_on_delivered (once the token
 * maps to an open grant of that peer) or resets the peer. The loop hands
 * links to a thread by command and waits for it to let go of one before
 * destroying it.
 *
 * bench/post_bench.c links this file to time the loop's and the threads'
 * cost per run without a device. */
#include "rdma_int.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include "pool.h"
#include "spin.h"
#ifdef KVF_FAILPOINTS
#include "failpoint.h"
#endif

/* ------------------------------------------------------------ clocks */

/* CPU time of the calling thread: what posting costs the loop, whatever
 * else the (few, shared) CPUs run meanwhile. A syscall; used once per post. */
static uint64_t thread_cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The hot path's clock: the TSC scaled to ns once at start, because
 * clock_gettime may be a syscall or an emulated HPET read (the soft-RoCE VM)
 * and would cost more than what it measures. Only differences are used. */
static double ns_per_tick = 1.0;

static uint64_t fast_ns(void) {
#if defined(__x86_64__) || defined(__i386__)
  return (uint64_t)((double)__rdtsc() * ns_per_tick);
#else
  return mono_ns();
#endif
}

uint64_t kvf__rdma_fast_ns(void) { return fast_ns(); }

void kvf__rdma_calibrate_clock(void) {
#if defined(__x86_64__) || defined(__i386__)
  uint64_t t0 = mono_ns(), c0 = __rdtsc();
  struct timespec nap = {0, 20 * 1000000L};
  nanosleep(&nap, NULL);
  uint64_t t1 = mono_ns(), c1 = __rdtsc();
  if (c1 > c0) ns_per_tick = (double)(t1 - t0) / (double)(c1 - c0);
#endif
}

/* ------------------------------------------------------------ events to the loop */

static void on_event(kvf__mail *m);

static void push_event(tevent *e) { kvf__mailbox_post(&e->rt->mb, &e->mail, on_event); }

static tevent *new_event(int kind, const rpeer *rp) {
  tevent *e = calloc(1, sizeof(*e));
  if (!e) abort(); /* a lost completion would hang a transfer: fail loudly */
  e->rt = rp->rt;
  e->kind = kind;
  e->peer = rp->p;
  e->gen = rp->gen;
  return e;
}

/* From any thread: the loop fails the peer (if still that incarnation). */
void kvf__rdma_fail_peer_soon(rpeer *rp, const char *fmt, ...) {
  tevent *e = new_event(EV_FAIL, rp);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->why, sizeof(e->why), fmt, ap);
  va_end(ap);
  push_event(e);
}

/* ------------------------------------------------------------ ticket accounting */

/* k parts of tk are over (status 0: completed). The last part queues the
 * ticket's callback. Any thread. */
void kvf__rdma_credit(ticket *tk, size_t k, int status) {
  if (k == 0) return;
  if (status) {
    int zero = 0;
    atomic_compare_exchange_strong(&tk->status, &zero, status);
  }
  if (atomic_fetch_add(&tk->done, k) + k == tk->total) push_event(&tk->ev);
}

void kvf__rdma_wake(rdev *d) {
  uint64_t one = 1;
  ssize_t w = write(d->efd, &one, sizeof(one));
  (void)w; /* a full counter already wakes the thread */
}

static void wake_peer(rpeer *rp) {
  for (int i = 0; i < rp->n_links; i++) kvf__rdma_wake(rp->links[i]->dev);
}

/* Queues the transfer's tail once its last part is posted and every other
 * write completed. Under qlock, so that abort and drain see it either still
 * waiting or queued. */
static void release_tail(xstate *xs, rpeer *rp) {
  rdev *only = NULL;
  pthread_mutex_lock(&rp->qlock);
  ticket *t = atomic_exchange(&xs->tail, NULL);
  if (t) {
    t->next_q = NULL;
    if (rp->ttail) rp->ttail->next_q = t;
    else rp->thead = t;
    rp->ttail = t;
    atomic_fetch_add(&rp->queued, 1);
    only = t->tail_dev;
  }
  pthread_mutex_unlock(&rp->qlock);
  if (only) kvf__rdma_wake(only); /* its QP's thread may be asleep */
}

/* k body writes of xs completed successfully (failed ones never count, so a
 * failure never lets the tail tell the receiver that all data is placed). */
static void body_done(xstate *xs, rpeer *rp, long k) {
  if (k && atomic_fetch_sub(&xs->pending, k) == k && atomic_load(&xs->tail)) release_tail(xs, rp);
}

/* ------------------------------------------------------------ progress thread: completions */

static rqp *qp_by_num(rlink *lk, uint32_t num) {
  unsigned n = atomic_load(&lk->n_qps);
  for (unsigned i = 0; i < n; i++) {
    rqp *q = atomic_load(&lk->qps[i]);
    if (q && q->qp_num == num) return q;
  }
  return NULL;
}

void kvf__rdma_ring_push(rqp *q, ticket *tk, uint32_t wrs, uint32_t runs, bool tail, uint64_t bytes,
                         int32_t chunk) {
  uint32_t i = (q->ring_head + q->ring_n) % q->sq_cap;
  q->ring[i] = (inflight){tk, q->seq, wrs, runs, tail, bytes, chunk};
  q->ring_n++;
  q->sq_used += wrs;
  q->bytes_out += bytes;
}

static inflight ring_pop(rqp *q) {
  inflight f = q->ring[q->ring_head];
  q->ring_head = (q->ring_head + 1) % q->sq_cap;
  q->ring_n--;
  q->sq_used -= f.wrs;
  q->bytes_out -= f.bytes;
  return f;
}

/* The chains up to wr_id seq completed (RC completes in order). */
static void retire(rlink *lk, rqp *q, uint64_t seq) {
  while (q->ring_n && q->ring[q->ring_head].seq <= seq) {
    inflight f = ring_pop(q);
    kvf__rdma_bounce_chunk_free(lk->dev, f.chunk);
    if (!f.tk) continue; /* a bounce credit */
    if (f.runs) body_done(f.tk->xs, lk->rp, f.runs);
    kvf__rdma_credit(f.tk, f.runs + f.tail, 0);
  }
}

/* Everything in flight on q is lost. A transfer's tail among it (the write
 * that completes the receiver) may have landed before the QP failed: its
 * ticket ends with KVF_EUNKNOWN, so that the sender asks the receiver
 * instead of reporting a loss the receiver may not have seen. */
static void flush_ring(rqp *q, int status) {
  while (q->ring_n) {
    inflight f = ring_pop(q);
    kvf__rdma_bounce_chunk_free(q->lk->dev, f.chunk);
    if (f.tk) kvf__rdma_credit(f.tk, f.runs + f.tail, f.tail ? KVF_EUNKNOWN : status);
  }
}

/* A dialed QP carries our writes: its failure fails the peer. An accepted
 * one only brings the peer's completion notices; the peer sees the failure
 * on its side (or is gone), so it just stops here. */
static void qp_failed(rlink *lk, rqp *q, const char *why) {
  if (q->dead) return;
  q->dead = true;
  flush_ring(q, KVF_EPEERLOST);
  if (q->outbound)
    kvf__rdma_fail_peer_soon(lk->rp, "rdma: QP %u (%s -> %s %s) failed: %s", q->qp_num, lk->dev->name,
                   peer_name(lk->rp), lk->peer_dev, why);
}

static void on_recv_wc(rlink *lk, rqp *q, const struct ibv_wc *wc) {
  q->rq_posted--;
  if (wc->status != IBV_WC_SUCCESS) {
    if (wc->status != IBV_WC_WR_FLUSH_ERR) qp_failed(lk, q, ibv_wc_status_str(wc->status));
    return;
  }
  if (wc->opcode != IBV_WC_RECV_RDMA_WITH_IMM) return;
  atomic_fetch_add_explicit(&lk->dev->imms, 1, memory_order_relaxed);
  /* a chunk of the bounce path: placed here, in CQ order, before any later notice */
  if (wc->byte_len && kvf__rdma_bounce_chunk(lk, ntohl(wc->imm_data))) return;
  tevent *e = new_event(EV_IMM, lk->rp);
  e->imm = ntohl(wc->imm_data);
  push_event(e);
}

/* The peer refused a write (a remote access error: outside its memory
 * windows, or through one already invalidated). RC completes in order, so
 * the failing chain is the oldest in flight: its transfer fails with
 * KVF_EPERM, the others with KVF_EPEERLOST as the QP goes. */
static void refused(rqp *q) {
  if (!q->ring_n) return;
  inflight f = ring_pop(q);
  kvf__rdma_bounce_chunk_free(q->lk->dev, f.chunk);
  if (f.tk) kvf__rdma_credit(f.tk, f.runs + f.tail, KVF_EPERM);
}

static void on_wc(rlink *lk, const struct ibv_wc *wc) {
  rqp *q = qp_by_num(lk, wc->qp_num);
  if (!q) return;
  if (wc->wr_id == TAG_RECV) {
    on_recv_wc(lk, q, wc);
  } else if (wc->status != IBV_WC_SUCCESS) {
    if (wc->status == IBV_WC_REM_ACCESS_ERR && q->outbound && !q->dead) refused(q);
    qp_failed(lk, q, ibv_wc_status_str(wc->status));
  } else {
    retire(lk, q, wc->wr_id);
  }
}

/* Zero-length receives: a WRITE_WITH_IMM consumes one without touching
 * memory. The loop posts the first ones, the thread keeps them topped up. */
int kvf__rdma_post_recvs(rqp *q, uint32_t n) {
  struct ibv_recv_wr wr[CHAIN_MAX], *bad;
  while (n > 0) {
    uint32_t k = n < CHAIN_MAX ? n : CHAIN_MAX;
    for (uint32_t i = 0; i < k; i++)
      wr[i] = (struct ibv_recv_wr){.wr_id = TAG_RECV, .next = i + 1 < k ? &wr[i + 1] : NULL};
    int rc = ibv_post_recv(q->qp, wr, &bad);
    if (rc) return -rc;
    q->rq_posted += k;
    n -= k;
  }
  return 0;
}

static void replenish(rlink *lk) {
  unsigned n = atomic_load(&lk->n_qps);
  for (unsigned i = 0; i < n; i++) {
    rqp *q = atomic_load(&lk->qps[i]);
    if (!q || q->dead || q->rq_posted >= q->rq_cap) continue;
    int rc = kvf__rdma_post_recvs(q, q->rq_cap - q->rq_posted);
    if (rc) qp_failed(lk, q, strerror(-rc));
  }
}

static bool poll_link(rlink *lk) {
  struct ibv_wc wc[CQ_BATCH];
  int n, total = 0;
  while ((n = ibv_poll_cq(lk->cq, CQ_BATCH, wc)) > 0) {
    for (int i = 0; i < n; i++) on_wc(lk, &wc[i]);
    total += n;
    if (n < CQ_BATCH) break;
  }
  if (n < 0 && !lk->cq_failed) {
    lk->cq_failed = true;
    kvf__rdma_fail_peer_soon(lk->rp, "rdma: polling the CQ of %s on %s failed", peer_name(lk->rp), lk->dev->name);
  }
  if (total == 0) return false;
  atomic_fetch_add_explicit(&lk->dev->cqes, (uint64_t)total, memory_order_relaxed);
  replenish(lk);
  return true;
}

/* ------------------------------------------------------------ progress thread: posting */

static void unlink_q(ticket **head, ticket **tail, ticket *prev, ticket *tk) {
  if (prev) prev->next_q = tk->next_q;
  else *head = tk->next_q;
  if (*tail == tk) *tail = prev;
}

/* The oldest tail q may post: one for any QP, or one whose window is
 * bound on q. qlock held. */
static ticket *claim_tail(rpeer *rp, rqp *q) {
  for (ticket *prev = NULL, *tk = rp->thead; tk; prev = tk, tk = tk->next_q)
    if (!tk->tail_q || tk->tail_q == q) {
      unlink_q(&rp->thead, &rp->ttail, prev, tk);
      atomic_fetch_sub(&rp->queued, 1);
      return tk;
    }
  return NULL;
}

/* Up to room body runs for q: of the oldest ticket, or (memory windows) of
 * the oldest whose runs for q's lane are not all claimed. qlock held. */
static ticket *claim_body(rpeer *rp, rqp *q, uint32_t room, size_t *first, size_t *cnt) {
  if (room > CHAIN_MAX) room = CHAIN_MAX;
  for (ticket *prev = NULL, *tk = rp->qhead; tk; prev = tk, tk = tk->next_q) {
    size_t *next = &tk->next, end = tk->n_body;
    lane *l = NULL;
    for (size_t i = 0; i < tk->n_lanes && !l; i++)
      if (tk->lanes[i].q == q && tk->lanes[i].next < tk->lanes[i].end) l = &tk->lanes[i];
    if (tk->lanes && !l) continue;
    if (l) {
      next = &l->next;
      end = l->end;
    }
    *first = *next;
    if (tk->bounce) { /* a chunk of runs, when a chunk (and the receiver's slot) is free */
      if (q->lk->dev->bb.n_free == 0 || (tk->xb && atomic_load(&tk->xb->credits) <= 0)) {
        atomic_fetch_add_explicit(&q->lk->dev->bb.stalls, 1, memory_order_relaxed);
        continue;
      }
      if (tk->xb) atomic_fetch_sub(&tk->xb->credits, 1);
      *cnt = kvf__rdma_bounce_fit(q->lk->dev, tk, *next, end - *next);
    } else if (tk->gather) { /* room counts work requests; gathered, they may take more runs */
      *cnt = kvf__rdma_span(q, tk->runs, tk->order, tk->rkeys, &tk->stride, *next, end - *next, room);
    } else {
      *cnt = end - *next < room ? end - *next : room;
    }
    *next += *cnt;
    bool drained = l ? (tk->left -= *cnt) == 0 : *next == end;
    if (drained) {
      unlink_q(&rp->qhead, &rp->qtail, prev, tk);
      atomic_fetch_sub(&rp->queued, 1);
    }
    return tk;
  }
  return NULL;
}

/* Takes the next piece of work for q, which has room: a tail first (it
 * ends a transfer), else body runs. */
static ticket *claim(rpeer *rp, rqp *q, uint32_t room, size_t *first, size_t *cnt, bool *tail) {
  if (atomic_load(&rp->queued) == 0) return NULL;
  pthread_mutex_lock(&rp->qlock);
  ticket *tk = claim_tail(rp, q);
  *tail = tk != NULL;
  if (!tk) tk = claim_body(rp, q, room, first, cnt);
  pthread_mutex_unlock(&rp->qlock);
  return tk;
}

/* The QP's chain of work requests is linked and typed once (RDMA WRITE);
 * building a chain then writes only what differs per run. */
void kvf__rdma_init_chain(rqp *q) {
  for (size_t i = 0; i < CHAIN_MAX; i++)
    q->wr[i] = (struct ibv_send_wr){.next = i + 1 < CHAIN_MAX ? &q->wr[i + 1] : NULL,
                                    .sg_list = &q->sge[i],
                                    .num_sge = 1,
                                    .opcode = IBV_WR_RDMA_WRITE};
}

/* The work request being gathered: its last run (and that run's key), its
 * entries and bytes, and the chain's bytes so far. */
typedef struct gather {
  const kvf__run *last;
  uint32_t rkey, sges, last_need;
  uint64_t wr_bytes, chain_bytes;
  bool gathered;                /* some request of the chain holds more than one run */
} gather;

/* The entries run r takes: a strided run's pieces, else one. */
static inline uint32_t entries(const rstride *st, const kvf__run *r) {
  return st && st->unit ? (uint32_t)(r->len / st->unit) : 1;
}

/* Whether r (key rkey) joins g's request: its bytes land right after the
 * last run's, in the same memory through the same key (so the request is
 * one contiguous write inside the window both runs were checked against),
 * within the request's and the chain's bytes, and with an entry to spare
 * unless its source follows the last run's too (*same: then it extends
 * that entry). A strided run (need entries, one a piece) joins with room
 * for all of them, and extends no entry. */
static inline bool gather_joins(const gather *g, const kvf__run *r, uint32_t rkey, uint32_t max_sge, uint32_t need,
                                bool *same) {
  const kvf__run *p = g->last;
  if (r->dst_pool != p->dst_pool || rkey != g->rkey || r->dst_off != p->dst_off + p->len ||
      g->wr_bytes + r->len > kvfd.cfg.rdma_slice || g->chain_bytes + r->len > CHAIN_BYTES)
    return false;
  *same = need == 1 && r->src_pool == p->src_pool && r->src_off == p->src_off + p->len && g->last_need == 1;
  return *same || g->sges + need <= max_sge;
}

static inline void gather_add(gather *g, const kvf__run *r, uint32_t rkey, bool join, bool same, uint32_t need) {
  if (!join) {
    g->sges = 0;
    g->wr_bytes = 0;
  }
  g->sges += same ? 0 : need;
  g->last_need = need;
  g->gathered |= join;
  g->wr_bytes += r->len;
  g->chain_bytes += r->len;
  g->last = r;
  g->rkey = rkey;
}

size_t kvf__rdma_span(const rqp *q, const kvf__run *runs, const uint32_t *order, const uint32_t *rkeys,
                      const rstride *st, size_t first, size_t avail, size_t max_wrs) {
  gather g = {0};
  size_t i = 0, wrs = 0;
  for (; i < avail; i++) {
    size_t j = order ? order[first + i] : first + i;
    uint32_t rkey = rkeys ? rkeys[j] : 0, need = entries(st, &runs[j]);
    bool same = false, join = i > 0 && gather_joins(&g, &runs[j], rkey, q->max_sge, need, &same);
    /* a chain that gathers ends at CHAIN_BYTES (else its requests of one
     * run each after it; one that does not keeps its old length) */
    if (!join && i > 0 && g.gathered && g.chain_bytes + runs[j].len > CHAIN_BYTES) break;
    if (!join && ++wrs > max_wrs) break;
    gather_add(&g, &runs[j], rkey, join, same, need);
  }
  return i;
}

/* Ends request w of the chain: its entries, and inline when small. */
static inline void wr_close(struct ibv_send_wr *w, const gather *g, uint32_t max_inline) {
  w->num_sge = (int)g->sges;
  w->send_flags = g->wr_bytes <= max_inline ? IBV_SEND_INLINE : 0;
}

/* Runs of a chain nearly always share their pools: the last pools' keys
 * and bases, kept at hand instead of looked up per run. */
typedef struct at_hand {
  const rlink *lk;
  uint8_t *const *pool_base;
  uint32_t sp, dp, lkey, rkey;
  uintptr_t base;
  uint64_t raddr;
} at_hand;

static inline void hand_init(at_hand *h, const rlink *lk, const kvf__run *r) {
  *h = (at_hand){.lk = lk, .pool_base = lk->rp->rt->pool_base, .sp = r->src_pool, .dp = r->dst_pool,
                 .lkey = lk->dev->lkey[r->src_pool], .rkey = lk->rkey[r->dst_pool],
                 .base = (uintptr_t)lk->rp->rt->pool_base[r->src_pool], .raddr = lk->raddr[r->dst_pool]};
}

static inline void hand_src(at_hand *h, const kvf__run *r) {
  if (r->src_pool == h->sp) return;
  h->sp = r->src_pool;
  h->lkey = h->lk->dev->lkey[h->sp];
  h->base = (uintptr_t)h->pool_base[h->sp];
}

static inline void hand_dst(at_hand *h, const kvf__run *r) {
  if (r->dst_pool == h->dp) return;
  h->dp = r->dst_pool;
  h->rkey = h->lk->rkey[h->dp];
  h->raddr = h->lk->raddr[h->dp];
}

/* A request a run: what a ticket without runs back to back posts, at the
 * cost it had before requests gathered. */
static uint64_t build_plain(rlink *lk, rqp *q, const kvf__run *runs, const uint32_t *order, size_t first, size_t n,
                            const uint32_t *rkeys) {
  at_hand h;
  hand_init(&h, lk, &runs[order ? order[first] : first]);
  uint64_t bytes = 0;
  uint32_t max_inline = q->max_inline;
  for (size_t i = 0; i < n; i++) {
    size_t j = order ? order[first + i] : first + i;
    const kvf__run *r = &runs[j];
    hand_src(&h, r);
    hand_dst(&h, r);
    struct ibv_sge *s = &q->sge[i];
    struct ibv_send_wr *w = &q->wr[i];
    s->addr = h.base + r->src_off;
    s->length = (uint32_t)r->len;
    s->lkey = h.lkey;
    w->send_flags = r->len <= max_inline ? IBV_SEND_INLINE : 0;
    w->wr.rdma.remote_addr = h.raddr + r->dst_off;
    w->wr.rdma.rkey = rkeys ? rkeys[j] : h.rkey;
    bytes += r->len;
  }
  q->wr[n - 1].next = NULL;
  return bytes;
}

/* The entries of strided run r from s on: a piece each; the last written. */
static inline struct ibv_sge *fill_pieces(struct ibv_sge *s, const kvf__run *r, const rstride *st, uintptr_t base,
                                          uint32_t lkey, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    s[i] = (struct ibv_sge){.addr = base + r->src_off + i * st->step, .length = (uint32_t)st->unit, .lkey = lkey};
  return s + n - 1;
}

uint64_t kvf__rdma_build_chain(rlink *lk, rqp *q, const kvf__run *runs, const uint32_t *order, size_t first, size_t n,
                               const uint32_t *rkeys, const rstride *st, bool gathering, size_t *wrs) {
  if (!gathering) {
    *wrs = n;
    return build_plain(lk, q, runs, order, first, n, rkeys);
  }
  q->gathered = true; /* the template's lists change: restored after the post */
  at_hand h;
  hand_init(&h, lk, &runs[order ? order[first] : first]);
  uint32_t max_inline = q->max_inline;
  gather g = {0};
  struct ibv_send_wr *w = NULL;
  struct ibv_sge *s = NULL;
  for (size_t i = 0; i < n; i++) {
    size_t j = order ? order[first + i] : first + i;
    const kvf__run *r = &runs[j];
    hand_src(&h, r);
    uint32_t key = rkeys ? rkeys[j] : 0, need = entries(st, r);
    bool same = false, join = i > 0 && gather_joins(&g, r, key, q->max_sge, need, &same);
    if (same) {
      s->length += (uint32_t)r->len;
    } else {
      if (!join) {
        if (w) wr_close(w, &g, max_inline);
        w = w ? w + 1 : &q->wr[0];
        s = s ? s + 1 : &q->sge[0];
        w->sg_list = s;
        hand_dst(&h, r);
        w->wr.rdma.remote_addr = h.raddr + r->dst_off;
        w->wr.rdma.rkey = rkeys ? key : h.rkey;
      } else {
        s++;
      }
      if (need > 1) {
        s = fill_pieces(s, r, st, h.base, h.lkey, need);
      } else {
        s->addr = h.base + r->src_off;
        s->length = (uint32_t)r->len;
        s->lkey = h.lkey;
      }
    }
    gather_add(&g, r, key, join, same, need);
  }
  wr_close(w, &g, max_inline);
  w->next = NULL;
  *wrs = (size_t)(w - q->wr) + 1;
  return g.chain_bytes;
}

/* Puts back what a posted chain changed in the template. */
void kvf__rdma_restore_chain(rqp *q, size_t n) {
  for (size_t i = 0; q->gathered && i < n; i++) {
    q->wr[i].sg_list = &q->sge[i];
    q->wr[i].num_sge = 1;
  }
  q->gathered = false;
  struct ibv_send_wr *last = &q->wr[n - 1];
  last->next = n < CHAIN_MAX ? last + 1 : NULL;
  last->wr_id = 0;
  q->wr[0].opcode = IBV_WR_RDMA_WRITE;
  q->wr[0].num_sge = 1;
  q->wr[0].imm_data = 0;
}

static void account(rdev *d, rqp *q, ticket *tk, uint64_t wrs, uint64_t bytes, uint64_t build, uint64_t bell) {
  atomic_fetch_add_explicit(&q->wrs, wrs, memory_order_relaxed);
  atomic_fetch_add_explicit(&q->bytes, bytes, memory_order_relaxed);
  atomic_fetch_add_explicit(&d->wrs, wrs, memory_order_relaxed);
  atomic_fetch_add_explicit(&d->bytes, bytes, memory_order_relaxed);
  atomic_fetch_add_explicit(&d->chains, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&d->build_ns, build, memory_order_relaxed);
  atomic_fetch_add_explicit(&d->bell_ns, bell, memory_order_relaxed);
  atomic_fetch_add_explicit(&tk->wrs, wrs, memory_order_relaxed);
  atomic_fetch_add_explicit(&tk->build_ns, build, memory_order_relaxed);
  atomic_fetch_add_explicit(&tk->bell_ns, bell, memory_order_relaxed);
}

/* Signals the chain's last request and rings the doorbell once. On failure
 * nothing of the chain counts as done: the QP is failed. */
int kvf__rdma_doorbell(rlink *lk, rqp *q, ticket *tk, size_t n, uint32_t runs, bool tail, uint64_t t0,
                       uint64_t bytes, int32_t chunk) {
  struct ibv_send_wr *last = &q->wr[n - 1], *bad = NULL;
  last->send_flags |= IBV_SEND_SIGNALED;
  last->wr_id = ++q->seq;
  uint64_t t1 = fast_ns();
  int rc = ibv_post_send(q->qp, q->wr, &bad);
  account(lk->dev, q, tk, n, bytes, t1 - t0, fast_ns() - t1);
  kvf__rdma_restore_chain(q, n);
  if (rc) {
    kvf__rdma_bounce_chunk_free(lk->dev, chunk);
    kvf__rdma_credit(tk, runs + tail, KVF_EPEERLOST);
    qp_failed(lk, q, strerror(rc));
    return -rc;
  }
  kvf__rdma_ring_push(q, tk, (uint32_t)n, runs, tail, bytes, chunk);
  return 0;
}

static int post_chunk(rlink *lk, rqp *q, ticket *tk, size_t first, size_t cnt) {
  uint64_t t0 = fast_ns();
  size_t wrs = 0;
  uint64_t bytes =
      kvf__rdma_build_chain(lk, q, tk->runs, tk->order, first, cnt, tk->rkeys, &tk->stride, tk->gather, &wrs);
  return kvf__rdma_doorbell(lk, q, tk, wrs, (uint32_t)cnt, false, t0, bytes, -1);
}

/* The transfer's last write, with the token of the receiver's grant. */
static int post_tail(rlink *lk, rqp *q, ticket *tk) {
  uint64_t t0 = fast_ns();
  struct ibv_send_wr *w = &q->wr[0];
  if (tk->tail.len) {
    size_t one;
    kvf__rdma_build_chain(lk, q, &tk->tail, NULL, 0, 1, tk->rkeys ? &tk->tail_rkey : NULL, &tk->stride,
                          tk->stride.unit != 0, &one);
  } else { /* nothing left to write: a zero-length write carries the notice */
    w->next = NULL;
    w->num_sge = 0;
    w->send_flags = 0;
    w->wr.rdma.remote_addr = lk->n_rpools ? lk->raddr[0] : 0;
    w->wr.rdma.rkey = lk->n_rpools ? lk->rkey[0] : 0;
  }
  w->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  w->imm_data = htonl(tk->imm);
  return kvf__rdma_doorbell(lk, q, tk, 1, 0, true, t0, tk->tail.len, -1);
}

static bool pump_qp(rlink *lk, rqp *q) {
  bool any = false;
  while (!q->dead && q->sq_used < q->sq_cap && q->bytes_out < QP_WINDOW) {
    size_t first = 0, cnt = 0;
    bool tail = false;
    ticket *tk = claim(lk->rp, q, q->sq_cap - q->sq_used, &first, &cnt, &tail);
    if (!tk) break;
    if (tail) post_tail(lk, q, tk);
    else if (tk->bounce) kvf__rdma_bounce_post(lk, q, tk, first, cnt);
    else post_chunk(lk, q, tk, first, cnt);
    any = true;
  }
  return any;
}

static bool pump_link(rlink *lk) {
  bool any = false;
  kvf__rdma_bounce_pay_credits(lk);
  unsigned n = atomic_load(&lk->n_qps);
  for (unsigned i = 0; i < n; i++) {
    rqp *q = atomic_load(&lk->qps[i]);
    if (q && q->outbound && atomic_load(&q->ready)) any |= pump_qp(lk, q);
  }
  return any;
}

/* ------------------------------------------------------------ progress thread: main */

static void detach_link(rdev *d, rlink *lk) {
  for (rlink **pp = &d->links; *pp; pp = &(*pp)->next)
    if (*pp == lk) {
      *pp = lk->next;
      break;
    }
  unsigned n = atomic_load(&lk->n_qps);
  for (unsigned i = 0; i < n; i++) {
    rqp *q = atomic_load(&lk->qps[i]);
    if (q) flush_ring(q, KVF_EPEERLOST);
  }
  pthread_mutex_lock(&d->lock);
  lk->detached = true;
  pthread_cond_broadcast(&d->cond);
  pthread_mutex_unlock(&d->lock);
}

/* Returns true on CMD_STOP. */
static bool run_cmds(rdev *d) {
  pthread_mutex_lock(&d->lock);
  cmd *c = d->cmds;
  d->cmds = d->cmds_tail = NULL;
  pthread_mutex_unlock(&d->lock);
  bool stop = false;
  while (c) {
    cmd *next = c->next;
    if (c->kind == CMD_ATTACH) {
      c->lk->next = d->links;
      d->links = c->lk;
    } else if (c->kind == CMD_DETACH) {
      detach_link(d, c->lk);
    } else {
      stop = true;
    }
    free(c);
    c = next;
  }
  return stop;
}

static bool cmds_waiting(rdev *d) {
  pthread_mutex_lock(&d->lock);
  bool any = d->cmds != NULL;
  pthread_mutex_unlock(&d->lock);
  return any;
}

/* Arms every CQ, looks once more (a completion before the arm raised no
 * event), then blocks until a completion event or a wake from the loop. */
static void sleep_until_work(rdev *d) {
  bool busy = false;
  for (rlink *lk = d->links; lk; lk = lk->next) ibv_req_notify_cq(lk->cq, 0);
  for (rlink *lk = d->links; lk; lk = lk->next) busy |= poll_link(lk);
  if (busy || cmds_waiting(d)) return;
  struct epoll_event ev[2];
  atomic_fetch_add_explicit(&d->sleeps, 1, memory_order_relaxed);
  if (epoll_wait(d->epfd, ev, 2, -1) < 0 && errno != EINTR) usleep(1000);
  struct ibv_cq *cq;
  void *ctx;
  while (ibv_get_cq_event(d->ch, &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
  uint64_t v;
  ssize_t r = read(d->efd, &v, sizeof(v));
  (void)r; /* EAGAIN: it was the completion channel */
}

/* spin.h opened a window (a grant here, or a peer's ahead of its send):
 * each device's progress thread, asleep on its channel, wakes to poll
 * through it (kvf__rdma_progress_main), so the data finds it awake. */
void kvf__rdma_threads_wake(void *arg) {
  rdma_transport *rt = arg;
  for (int i = 0; i < rt->n_devs; i++)
    if (rt->devs[i].started) kvf__rdma_wake(&rt->devs[i]);
}

void *kvf__rdma_progress_main(void *arg) {
  rdev *d = arg;
  uint64_t spin_ns = (uint64_t)kvfd.cfg.rdma_poll_us * 1000, idle = fast_ns();
  while (!run_cmds(d)) {
    bool busy = false;
    for (rlink *lk = d->links; lk; lk = lk->next) busy |= poll_link(lk);
    for (rlink *lk = d->links; lk; lk = lk->next) busy |= pump_link(lk);
    if (busy) {
      idle = spin_ns ? fast_ns() : 0;
      continue;
    }
    /* busy-poll, or a grant ahead of its data here (spin.h): no sleep */
    if (kvf__spin_open(KVF__SPIN_SEND, 0) || kvf__spin_open(KVF__SPIN_RECV, 0)) continue;
    if (spin_ns && fast_ns() - idle < spin_ns) continue;
    sleep_until_work(d);
    idle = spin_ns ? fast_ns() : 0;
  }
  return NULL;
}

void kvf__rdma_send_cmd(rdev *d, int kind, rlink *lk) {
  cmd *c = calloc(1, sizeof(*c));
  if (!c) abort(); /* a lost detach would leave a thread on freed memory */
  c->kind = kind;
  c->lk = lk;
  pthread_mutex_lock(&d->lock);
  if (d->cmds_tail) d->cmds_tail->next = c;
  else d->cmds = c;
  d->cmds_tail = c;
  pthread_mutex_unlock(&d->lock);
  kvf__rdma_wake(d);
}

/* Returns once the device thread no longer touches lk. */
void kvf__rdma_detach_and_wait(rlink *lk) {
  rdev *d = lk->dev;
  kvf__rdma_send_cmd(d, CMD_DETACH, lk);
  pthread_mutex_lock(&d->lock);
  while (!lk->detached) pthread_cond_wait(&d->cond, &d->lock);
  pthread_mutex_unlock(&d->lock);
  lk->attached = false;
}

/* ------------------------------------------------------------ the loop: posting */

/* Every run must land inside a pool the peer announced and come from one of
 * ours (all registered). *extra gets how many more runs slicing makes. */
int kvf__rdma_check_runs(const rpeer *rp, const kvf__runs *runs, uint64_t slice, bool staged, size_t *extra) {
  *extra = 0;
  for (size_t i = 0; i < runs->n; i++) {
    const kvf__run *r = &runs->v[i];
    /* the receiver's staging slot: its grant's window is the bound (rdma_stage.c) */
    bool stage = r->dst_pool == KVF__RDMA_STAGE_POOL;
    if (r->src_pool >= kvfd.n_pools || (!staged && !stage && r->dst_pool >= rp->n_pools)) return KVF_ENOPOOL;
    uint64_t size = staged || stage ? UINT64_MAX : rp->pool_size[r->dst_pool];
    if (r->len == 0 || r->dst_off > size || r->len > size - r->dst_off) return KVF_ERANGE;
    if (r->len > slice) *extra += (size_t)((r->len - 1) / slice);
  }
  return 0;
}

/* GPUDirect: the NIC reads or writes GPU memory on either end. */
static bool runs_touch_gpu(const rpeer *rp, const kvf__runs *runs) {
  for (size_t i = 0; i < runs->n; i++)
    if (kvf__pool_gpu(kvf__pool_get(runs->v[i].src_pool)) || rp->pool_gpu[runs->v[i].dst_pool]) return true;
  return false;
}

/* Takes the runs (no copy) or, when some exceed rdma-slice (extra more
 * runs), a sliced copy. */
static int take_runs(ticket *tk, kvf__runs *runs, uint64_t slice, size_t extra) {
  if (extra == 0) {
    tk->runs = runs->v;
    tk->n_runs = runs->n;
    memset(runs, 0, sizeof(*runs));
    return 0;
  }
  kvf__run *v = malloc((runs->n + extra) * sizeof(*v));
  if (!v) return -ENOMEM;
  size_t k = 0;
  for (size_t i = 0; i < runs->n; i++) {
    const kvf__run *r = &runs->v[i];
    for (uint64_t off = 0; off < r->len; off += slice) {
      uint64_t len = r->len - off < slice ? r->len - off : slice;
      v[k] = *r;
      v[k].src_off += off;
      v[k].dst_off += off;
      v[k++].len = len;
    }
  }
  tk->runs = v;
  tk->n_runs = k;
  return 0;
}

/* Whether some run lands right after the one before it: then the threads
 * gather (kvf__rdma_span); else they post a request a run, as cheaply as
 * before. Runs back to back only in a lane's order go ungathered. */
static bool may_gather(const kvf__run *v, size_t n) {
  for (size_t i = 1; i < n; i++)
    if (v[i].dst_off == v[i - 1].dst_off + v[i - 1].len && v[i].dst_pool == v[i - 1].dst_pool) return true;
  return false;
}

ticket *kvf__rdma_ticket_new(rdma_transport *rt, kvf__xfer *x, kvf__runs *runs, uint64_t slice, size_t extra,
                             bool last) {
  ticket *tk = calloc(1, sizeof(*tk));
  rstride st = {runs->unit, runs->step}; /* taking the runs clears the list */
  if (tk && st.unit && extra) { /* strided runs are cut at pieces, never at rdma-slice (rdma_stage.c) */
    free(tk);
    return NULL;
  }
  if (!tk || take_runs(tk, runs, slice, extra) != 0) {
    free(tk);
    return NULL;
  }
  tk->ev.kind = EV_TICKET;
  tk->ev.rt = rt;
  tk->x = x;
  tk->last = last;
  tk->n_body = tk->n_runs;
  tk->imm = (uint32_t)x->handle;
  if (last) {
    tk->has_tail = true;
    if (tk->n_runs) tk->tail = tk->runs[--tk->n_body];
  }
  tk->total = tk->n_body + tk->has_tail;
  tk->stride = st;
  tk->gather = st.unit || may_gather(tk->runs, tk->n_body); /* a strided run is a request of entries */
  return tk;
}

void kvf__rdma_ticket_free(ticket *tk) {
  free(tk->runs);
  free(tk->rkeys);
  free(tk->order);
  free(tk->lanes);
  free(tk);
}

xstate *kvf__rdma_xstate_of(kvf__xfer *x) {
  xstate *xs = x->tp_state;
  if (xs) return xs;
  xs = calloc(1, sizeof(*xs));
  if (!xs) return NULL;
  x->tp_state = xs;
  return xs;
}

static void live_link(ticket *tk) {
  rdma_transport *rt = tk->ev.rt;
  tk->next_live = rt->live;
  if (rt->live) rt->live->prev_live = tk;
  rt->live = tk;
}

static void live_unlink(ticket *tk) {
  if (tk->prev_live) tk->prev_live->next_live = tk->next_live;
  else tk->ev.rt->live = tk->next_live;
  if (tk->next_live) tk->next_live->prev_live = tk->prev_live;
}

static void enqueue_body(rpeer *rp, ticket *tk) {
  pthread_mutex_lock(&rp->qlock);
  if (rp->qtail) rp->qtail->next_q = tk;
  else rp->qhead = tk;
  rp->qtail = tk;
  atomic_fetch_add(&rp->queued, 1);
  pthread_mutex_unlock(&rp->qlock);
}

/* Order matters: pending grows before the body can complete, and the tail
 * is published before that, so exactly one of us (a thread reaching
 * pending == 0, or this check) releases it. */
static void hand_over(rpeer *rp, xstate *xs, ticket *tk) {
  atomic_fetch_add(&xs->pending, (long)tk->n_body);
  if (tk->has_tail) atomic_store(&xs->tail, tk);
  if (tk->n_body) enqueue_body(rp, tk);
  if (tk->has_tail && atomic_load(&xs->pending) == 0) release_tail(xs, rp);
  if (tk->total == 0) push_event(&tk->ev); /* nothing to move: called back at once */
  else wake_peer(rp);
}

int kvf__rdma_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) {
  return kvf__rdma_post_chunk(t, x, runs, last, NULL, 0, 0);
}

int kvf__rdma_post_chunk(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last, struct sgroup *grp,
                         uint32_t first, uint32_t n_layers) {
  uint64_t t0 = thread_cpu_ns();
  rdma_transport *rt = to_rdma(t);
  rpeer *rp = x->peer ? rpeer_of(rt, x->peer) : NULL;
  if (!rp) return KVF_EPEERLOST;
  size_t extra = 0;
  uint64_t slice = kvfd.cfg.rdma_slice, cap = 0;
  int rc = x->tp_grant.win_len ? kvf__rdma_learn_mrs(rp, x) : 0; /* engine memory of the peer's */
  if (rc) return rc;
  bool bounce = kvf__rdma_bounce_wanted(rp, x, runs, &cap), windows = kvf__rdma_window_records(&x->tp_grant) != 0;
  if (bounce && runs->unit) return -ENOTSUP; /* pieces copied one by one: rdma_stage.c stages instead */
  if (bounce && cap < slice) slice = cap;
  /* Through the receiver's staging, its own check of every run is what counts */
  rc = kvf__rdma_check_runs(rp, runs, slice, bounce && kvf__rdma_bounce_staged(x), &extra);
  if (rc) return rc;
  if (!bounce && !x->path && (rt->any_gpu || rp->gpu_pools) && runs_touch_gpu(rp, runs)) x->path = "rdma-gdr";
  size_t n = runs->n;
  xstate *xs = kvf__rdma_xstate_of(x);
  ticket *tk = xs ? kvf__rdma_ticket_new(rt, x, runs, slice, extra, last) : NULL;
  rc = tk ? 0 : -ENOMEM;
  if (tk && bounce) rc = kvf__rdma_bounce_ticket(tk, rp, x, xs, &windows);
  if (rc == 0 && tk && windows && (rc = kvf__rdma_ticket_windows(tk, rp, x, xs)) != 0) {
    kvf__rdma_ticket_free(tk);
    tk = NULL;
  }
  if (tk && rc) {
    kvf__rdma_ticket_free(tk);
    tk = NULL;
  }
  if (!tk) return rc; /* xs, if made, goes with the transfer (kvf__rdma_xfer_done) */
  tk->xs = xs;
  tk->rp = rp;
  tk->grp = grp;
  tk->grp_first = first;
  tk->grp_n = n_layers;
  xs->out++;
  live_link(tk);
  hand_over(rp, xs, tk);
  tk->loop_ns = thread_cpu_ns() - t0;
  rt->post.calls++;
  rt->post.runs += n;
  rt->post.ns += tk->loop_ns;
  return 0;
}

static ticket *unqueue(ticket **head, ticket **tail, ticket *want) {
  ticket *prev = NULL;
  for (ticket *tk = *head; tk; prev = tk, tk = tk->next_q) {
    if (tk != want) continue;
    if (prev) prev->next_q = tk->next_q;
    else *head = tk->next_q;
    if (*tail == tk) *tail = prev;
    return tk;
  }
  return NULL;
}

/* Takes back what of tk no thread has claimed: its unclaimed body runs and
 * its tail when not posted yet. Returns how many parts that is. qlock held
 * (or no thread left on rp). */
size_t kvf__rdma_take_back(rpeer *rp, ticket *tk) {
  size_t k = tk->lanes ? tk->left : tk->n_body - tk->next;
  tk->next = tk->n_body;
  tk->left = 0;
  for (size_t i = 0; i < tk->n_lanes; i++) tk->lanes[i].next = tk->lanes[i].end;
  if (k && unqueue(&rp->qhead, &rp->qtail, tk)) atomic_fetch_sub(&rp->queued, 1);
  if (tk->has_tail) {
    ticket *expect = tk;
    if (atomic_compare_exchange_strong(&tk->xs->tail, &expect, NULL)) {
      k++;
    } else if (unqueue(&rp->thead, &rp->ttail, tk)) {
      atomic_fetch_sub(&rp->queued, 1);
      k++;
    }
  }
  return k;
}

/* Stops the transfer's unclaimed work; what is in flight completes and the
 * callbacks come as usual. */
void kvf__rdma_abort(kvf__transport *t, kvf__xfer *x) {
  rdma_transport *rt = to_rdma(t);
  rpeer *rp = x->peer ? rpeer_of(rt, x->peer) : NULL;
  const xstate *xs = x->tp_state;
  if (!rp || !xs || xs->out == 0) return;
  pthread_mutex_lock(&rp->qlock);
  for (ticket *tk = rt->live; tk; tk = tk->next_live)
    if (tk->x == x && tk->rp == rp) kvf__rdma_credit(tk, kvf__rdma_take_back(rp, tk), KVF_ECANCELED);
  pthread_mutex_unlock(&rp->qlock);
}

/* The transfer is gone and every ticket of it called back. */
void kvf__rdma_xfer_done(kvf__transport *t, kvf__xfer *x) {
  xstate *xs = x->tp_state;
  if (!xs) return;
  kvf__rdma_bounce_xstate_free(to_rdma(t), xs);
  kvf__rdma_wtable_free(xs->wt);
  free(xs);
  x->tp_state = NULL;
}

/* ------------------------------------------------------------ the loop: events */

#ifdef KVF_FAILPOINTS
/* Failpoint late-write (kvferryd-rogue only): once a transfer that went
 * through memory windows succeeded, its last write goes again, 1 s
 * later, through the same window, which the receiver invalidated when the
 * transfer ended: it must be refused (a remote access error here). */
typedef struct late_write {
  uv_timer_t tm;
  rdma_transport *rt;
  kvf__peer *p;
  kvf__run run;
  kvf__mw_rec w;
} late_write;

static void late_free(uv_handle_t *h) { free(h->data); }

static void late_fire(uv_timer_t *tm) {
  late_write *l = tm->data;
  rpeer *rp = rpeer_of(l->rt, l->p);
  rqp *q = rp ? kvf__rdma_window_qp(rp, &l->w) : NULL;
  ticket *tk = q ? calloc(1, sizeof(*tk)) : NULL;
  xstate *xs = tk ? calloc(1, sizeof(*xs)) : NULL;
  if (tk) tk->runs = malloc(sizeof(*tk->runs));
  if (tk) tk->rkeys = malloc(sizeof(*tk->rkeys));
  if (tk) tk->lanes = malloc(sizeof(*tk->lanes));
  if (!xs || !tk->runs || !tk->rkeys || !tk->lanes) {
    kvf__warn("failpoint late-write: the window's QP is gone; not written");
    if (tk) kvf__rdma_ticket_free(tk);
    free(xs);
  } else {
    kvf__warn("failpoint late-write: writing %llu bytes at pool %u offset %llu through window rkey %08x "
              "of a finished transfer", (unsigned long long)l->run.len, l->run.dst_pool,
              (unsigned long long)l->run.dst_off, l->w.rkey);
    tk->ev.kind = EV_TICKET;
    tk->ev.rt = l->rt;
    tk->runs[0] = l->run;
    tk->rkeys[0] = l->w.rkey;
    tk->lanes[0] = (lane){q, 0, 1};
    tk->n_runs = tk->n_body = tk->total = tk->n_lanes = tk->left = 1;
    tk->xs = xs;
    tk->rp = rp;
    xs->out = 1;
    live_link(tk);
    hand_over(rp, xs, tk);
  }
  uv_close((uv_handle_t *)tm, late_free);
}

/* true when tk was the failpoint's own (done with here). */
static bool late_ticket_done(ticket *tk, int st) {
  if (!tk->x) {
    kvf__warn("failpoint late-write: the late write %s", st ? "was refused" : "LANDED");
    free(tk->xs);
    kvf__rdma_ticket_free(tk);
    return true;
  }
  if (!tk->last || st || !tk->tail_q || !tk->rp || !kvf__failpoint(KVF__FP_LATE_WRITE)) return false;
  late_write *l = calloc(1, sizeof(*l));
  if (!l) return false;
  l->rt = tk->ev.rt;
  l->p = tk->rp->p;
  l->run = tk->tail;
  l->w = (kvf__mw_rec){.rkey = tk->tail_rkey, .qpn = tk->tail_qpn, .dev = tk->tail_devi};
  uv_timer_init(l->rt->base.loop, &l->tm);
  l->tm.data = l;
  uv_timer_start(&l->tm, late_fire, 1000, 0);
  return false;
}
#endif

static void ticket_done(ticket *tk) {
  rdma_transport *rt = tk->ev.rt;
  live_unlink(tk);
  xstate *xs = tk->xs;
  kvf__xfer *x = tk->x;
  bool last = tk->last;
  int st = atomic_load(&tk->status);
  uint64_t wrs = atomic_load(&tk->wrs);
#ifdef KVF_FAILPOINTS
  if (late_ticket_done(tk, st)) return;
#endif
  xs->wrs += wrs;
  xs->loop_ns += tk->loop_ns;
  xs->build_ns += atomic_load(&tk->build_ns);
  xs->bell_ns += atomic_load(&tk->bell_ns);
  if (last && xs->wrs) {
    rt->post.last_wrs = xs->wrs;
    rt->post.last_loop_ns = xs->loop_ns;
    rt->post.last_build_ns = xs->build_ns;
    rt->post.last_bell_ns = xs->bell_ns;
    kvf__debug("rdma: %s: %llu work requests; posting cost per request: %.0f ns on the loop, "
               "%.0f ns building, %.0f ns in ibv_post_send",
               x->id, (unsigned long long)rt->post.last_wrs, (double)rt->post.last_loop_ns / (double)rt->post.last_wrs,
               (double)rt->post.last_build_ns / (double)rt->post.last_wrs, (double)rt->post.last_bell_ns / (double)rt->post.last_wrs);
  }
  struct sgroup *grp = tk->grp;
  uint32_t first = tk->grp_first, n = tk->grp_n;
  kvf__rdma_ticket_free(tk);
  xs->out--;
  if (grp) kvf__rdma_stage_chunk_done(grp, x, first, n, st);
  else kvf__xfer_on_posted(x, st == KVF_ECANCELED ? 0 : st, last);
}

static void on_imm(const tevent *e) {
  rpeer *rp = rpeer_of(e->rt, e->peer);
  char key[16];
  if (!rp || rp->gen != e->gen) return;
  grant_key(key, sizeof(key), e->imm);
  rgrant *g = kvf__map_get(&e->rt->grants, key);
  if (g && g->credit_of && g->peer == e->peer) { /* a slot of the peer's bounce staging is free again */
    kvf__rdma_bounce_credit(e->rt, g);
    return;
  }
  if (!g || g->peer != e->peer || !g->x) {
    kvf__debug("rdma: completion notice %08x from %s matches no open grant", e->imm, peer_name(rp));
    return;
  }
  /* blocks: the SendDone also counts. It says what the transfer did
   * (Event.transform), and with a staging slice the sender's staged notes
   * come before it: their transform passes must run first. */
  if (g->st_len) kvf__rdma_stage_landed(g);
  if (g->st_len || g->x->blocks) kvf__xfer_on_landed(g->x);
  else kvf__xfer_on_delivered(g->x);
}

static void on_event(kvf__mail *m) {
  tevent *e = kvf__container_of(m, tevent, mail);
  rpeer *rp;
  switch (e->kind) {
  case EV_TICKET:
    ticket_done((ticket *)e);
    return;
  case EV_IMM:
    on_imm(e);
    break;
  case EV_FAIL:
    rp = rpeer_of(e->rt, e->peer);
    if (rp && rp->gen == e->gen) kvf__rdma_reset_peer(rp, e->why);
    break;
  }
  free(e);
}


