/* rdma_mw.c - memory windows of the rdma transport (rdma_mw.h says why).
 *
 *   records      the 32-byte window records a Grant carries, checked and
 *                decoded (pure; tests/unit/test_rdma_mw.c)
 *   planning     a grant's ranges merged into at most rdma-mw-max-windows
 *                windows, and each descriptor's window (Grant.window_of)
 *   bounds check whether a device refuses a write that leaves a window (a
 *                loopback test at start)
 *   deciding     whether to use them (rdma-memory-windows) and the one line
 *                of protection that status, doctor and the log give
 *   binding      receiver: a grant's windows bound on the peer's accepted
 *                QPs before its Grant goes, invalidated at grant_close
 *   sending      sender: each run's window and the QP (lane) it is bound on
 *
 * The grants (ops grant_open/grant_close) live here too: without windows a
 * grant is only the token that the final write's immediate names. */
#include "rdma_int.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "spin.h"
#ifdef KVF_FAILPOINTS
#include "failpoint.h"
#endif

/* ------------------------------------------------------------ records */

static void put_le(uint8_t *p, uint64_t v, int n) {
  for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

void kvf__mw_rec_put(uint8_t *p, const kvf__mw_rec *r) {
  put_le(p, r->pool, 4);
  put_le(p + 4, r->off, 8);
  put_le(p + 12, r->len, 8);
  put_le(p + 20, r->rkey, 4);
  put_le(p + 24, r->qpn, 4);
  put_le(p + 28, r->dev, 2);
  put_le(p + 30, 0, 2);
}

void kvf__mw_rec_get(const uint8_t *p, kvf__mw_rec *r) {
  r->pool = (uint32_t)get_le(p, 4);
  r->off = get_le(p + 4, 8);
  r->len = get_le(p + 12, 8);
  r->rkey = (uint32_t)get_le(p + 20, 4);
  r->qpn = (uint32_t)get_le(p + 24, 4);
  r->dev = (uint16_t)get_le(p + 28, 2);
}

int kvf__mw_recs_check(const uint8_t *b, size_t len) {
  if (len % KVF__MW_REC) return KVF_EPROTO;
  kvf__mw_rec prev = {0}, r;
  for (size_t i = 0; i < len / KVF__MW_REC; i++) {
    kvf__mw_rec_get(b + i * KVF__MW_REC, &r);
    if (r.len == 0 || r.off + r.len < r.off) return KVF_EPROTO;
    if (i && (r.pool < prev.pool || (r.pool == prev.pool && r.off < prev.off + prev.len))) return KVF_EPROTO;
    prev = r;
  }
  return 0;
}

void kvf__mw_recs_decode(const uint8_t *b, size_t n, kvf__mw_rec *v) {
  for (size_t i = 0; i < n; i++) kvf__mw_rec_get(b + i * KVF__MW_REC, &v[i]);
}

long kvf__mw_find(const kvf__mw_rec *v, size_t n, uint32_t pool, uint64_t off, uint64_t len, bool nearest) {
  size_t lo = 0, hi = n;
  while (lo < hi) { /* records [0, lo) start at or before (pool, off) */
    size_t mid = lo + (hi - lo) / 2;
    if (v[mid].pool < pool || (v[mid].pool == pool && v[mid].off <= off)) lo = mid + 1;
    else hi = mid;
  }
  const kvf__mw_rec *r = lo ? &v[lo - 1] : NULL;
  if (r && kvf__mw_holds(r, pool, off, len)) return (long)(lo - 1);
  if (!nearest) return -1;
  if (r && r->pool == pool) return (long)(lo - 1);
  return lo < n && v[lo].pool == pool ? (long)lo : -1;
}

/* ------------------------------------------------------------ planning */

typedef struct gap {
  uint64_t size;
  size_t at;          /* between ranges at and at + 1 */
} gap;

static int gap_cmp(const void *a, const void *b) {
  const gap *x = a, *y = b;
  if (x->size != y->size) return x->size < y->size ? -1 : 1;
  return x->at < y->at ? -1 : x->at > y->at;
}

int kvf__mw_plan(const kvf__rangeset *rs, size_t max, kvf__range **out, size_t *n, size_t *merged) {
  *out = NULL;
  *n = *merged = 0;
  if (rs->n == 0) return 0;
  bool *join = calloc(rs->n, sizeof(*join)); /* join[i]: range i runs on into i + 1 */
  kvf__range *w = malloc(rs->n * sizeof(*w));
  gap *g = rs->n > max ? malloc(rs->n * sizeof(*g)) : NULL;
  if (!join || !w || (rs->n > max && !g)) {
    free(join);
    free(w);
    free(g);
    return -ENOMEM;
  }
  if (g) { /* span the smallest gaps first, ties in address order */
    size_t ng = 0;
    for (size_t i = 0; i + 1 < rs->n; i++)
      if (rs->v[i].pool == rs->v[i + 1].pool) g[ng++] = (gap){rs->v[i + 1].start - rs->v[i].end, i};
    qsort(g, ng, sizeof(*g), gap_cmp);
    for (size_t k = 0; k < ng && k < rs->n - max; k++) join[g[k].at] = true;
  }
  size_t k = 0;
  for (size_t i = 0; i < rs->n; i++) {
    if (i > 0 && join[i - 1]) {
      w[k - 1].end = rs->v[i].end;
      (*merged)++;
    } else {
      w[k++] = rs->v[i];
    }
  }
  free(join);
  free(g);
  *out = w;
  *n = k;
  return 0;
}

/* ------------------------------------------------------------ each descriptor's window */

int kvf__mw_index(const kvf__descs *d, const kvf__range *win, size_t n, uint8_t *of) {
  size_t hint = 0;
  for (size_t i = 0; i < d->n; i++) {
    uint32_t pool = d->pool[i];
    uint64_t off = d->offset[i], len = d->length[i];
    long w; /* engines hand out blocks in runs: the last window, or the next, first */
    if (hint < n && kvf__range_holds(&win[hint], pool, off, len)) w = (long)hint;
    else if (hint + 1 < n && kvf__range_holds(&win[hint + 1], pool, off, len)) w = (long)hint + 1;
    else w = kvf__ranges_find(win, n, pool, off, len);
    if (w < 0) return KVF_EINVAL;
    hint = (size_t)w;
    put_le(of + i * KVF__MW_OF, (uint64_t)w, KVF__MW_OF);
  }
  return 0;
}

/* ------------------------------------------------------------ bounds check */

#define CHECK_PAGE 4096u
#define CHECK_WAIT_MS 2000

typedef struct probe {
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  uint8_t port;
  uint32_t gid_index;
  union ibv_gid gid;
  enum ibv_mtu mtu;
  uint8_t *buf;             /* page 0: the window; page 1: past it; page 2: source */
  struct ibv_mr *mr;
  struct ibv_cq *cq;
  struct ibv_qp *a, *b;     /* a writes, b holds the window */
  struct ibv_mw *mw;
} probe;

static uint64_t ms_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static struct ibv_qp *probe_qp(probe *p) {
  struct ibv_qp_init_attr a = {.send_cq = p->cq, .recv_cq = p->cq, .qp_type = IBV_QPT_RC,
                               .cap = {.max_send_wr = 4, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1}};
  struct ibv_qp *qp = ibv_create_qp(p->pd, &a);
  struct ibv_qp_attr m = {.qp_state = IBV_QPS_INIT, .port_num = p->port,
                          .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE};
  if (qp && ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
    ibv_destroy_qp(qp);
    return NULL;
  }
  return qp;
}

/* To RTS, connected to the QP numbered dqpn on our own GID. */
static int probe_connect(probe *p, struct ibv_qp *qp, uint32_t dqpn) {
  struct ibv_qp_attr m = {
      .qp_state = IBV_QPS_RTR, .path_mtu = p->mtu, .dest_qp_num = dqpn, .rq_psn = 1, .max_dest_rd_atomic = 1,
      .min_rnr_timer = 12,
      .ah_attr = {.is_global = 1, .port_num = p->port,
                  .grh = {.dgid = p->gid, .sgid_index = (uint8_t)p->gid_index, .hop_limit = 64}}};
  if (ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    return -errno;
  m = (struct ibv_qp_attr){.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 3, .rnr_retry = 3,
                           .sq_psn = 1, .max_rd_atomic = 1};
  return ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                   IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)
             ? -errno
             : 0;
}

/* The status of wr_id's completion; -ETIMEDOUT. */
static int probe_wait(probe *p, uint64_t wr_id) {
  uint64_t end = ms_now() + CHECK_WAIT_MS;
  struct ibv_wc wc;
  while (ms_now() < end) {
    int n = ibv_poll_cq(p->cq, 1, &wc);
    if (n < 0) return -EIO;
    if (n == 1 && wc.wr_id == wr_id) return (int)wc.status;
    if (n == 0) {
      struct timespec nap = {0, 100000};
      nanosleep(&nap, NULL);
    }
  }
  return -ETIMEDOUT;
}

static int probe_write(probe *p, uint64_t off, uint32_t len, uint32_t rkey, uint64_t wr_id) {
  struct ibv_sge sge = {.addr = (uintptr_t)p->buf + 2 * CHECK_PAGE, .length = len, .lkey = p->mr->lkey};
  struct ibv_send_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                           .send_flags = IBV_SEND_SIGNALED,
                           .wr.rdma = {.remote_addr = (uintptr_t)p->buf + off, .rkey = rkey}},
                     *bad;
  if (ibv_post_send(p->a, &wr, &bad)) return -EIO;
  return probe_wait(p, wr_id);
}

static const char *wc_text(int st) {
  return st >= 0 ? ibv_wc_status_str((enum ibv_wc_status)st) : st == -ETIMEDOUT ? "no completion" : "post failed";
}

static int probe_setup(probe *p, char *why, size_t len) {
  struct ibv_port_attr pa;
  if (ibv_query_port(p->ctx, p->port, &pa) || ibv_query_gid(p->ctx, p->port, (int)p->gid_index, &p->gid))
    return snprintf(why, len, "cannot query the port"), -EIO;
  p->mtu = pa.active_mtu;
  p->buf = aligned_alloc(CHECK_PAGE, 3 * CHECK_PAGE);
  if (!p->buf) return snprintf(why, len, "out of memory"), -ENOMEM;
  memset(p->buf, 0, 3 * CHECK_PAGE);
  p->mr = ibv_reg_mr(p->pd, p->buf, 3 * CHECK_PAGE, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  p->cq = p->mr ? ibv_create_cq(p->ctx, 16, NULL, NULL, 0) : NULL;
  p->a = p->cq ? probe_qp(p) : NULL;
  p->b = p->a ? probe_qp(p) : NULL;
  p->mw = p->b ? ibv_alloc_mw(p->pd, IBV_MW_TYPE_2) : NULL;
  if (!p->mw) return snprintf(why, len, "setting up a loopback QP pair and window: %s", strerror(errno)), -EIO;
  int rc = probe_connect(p, p->a, p->b->qp_num);
  if (rc == 0) rc = probe_connect(p, p->b, p->a->qp_num);
  if (rc) return snprintf(why, len, "connecting a loopback QP pair: %s", strerror(-rc)), rc;
  return 0;
}

static void probe_free(probe *p) {
  if (p->mw) ibv_dealloc_mw(p->mw);
  if (p->a) ibv_destroy_qp(p->a);
  if (p->b) ibv_destroy_qp(p->b);
  if (p->cq) ibv_destroy_cq(p->cq);
  if (p->mr) ibv_dereg_mr(p->mr);
  free(p->buf);
}

/* Binds the window over page 0 on b; its rkey, or 0. */
static uint32_t probe_bind(probe *p, char *why, size_t len) {
  uint32_t rkey = ibv_inc_rkey(p->mw->rkey);
  struct ibv_send_wr wr = {.wr_id = 1, .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED,
                           .bind_mw = {.mw = p->mw, .rkey = rkey,
                                       .bind_info = {.mr = p->mr, .addr = (uintptr_t)p->buf, .length = CHECK_PAGE,
                                                     .mw_access_flags = IBV_ACCESS_REMOTE_WRITE}}},
                     *bad;
  int st = ibv_post_send(p->b, &wr, &bad) ? -EIO : probe_wait(p, 1);
  if (st != IBV_WC_SUCCESS) return snprintf(why, len, "binding a window: %s", wc_text(st)), 0;
  return rkey;
}

int kvf__mw_check_bounds(struct ibv_context *ctx, struct ibv_pd *pd, uint8_t port, uint32_t gid_index,
                         char *why, size_t len) {
  probe p = {.ctx = ctx, .pd = pd, .port = port, .gid_index = gid_index};
  int verdict = KVF__MW_BOUNDS_UNKNOWN;
  uint32_t rkey = probe_setup(&p, why, len) == 0 ? probe_bind(&p, why, len) : 0;
  int in = rkey ? probe_write(&p, 0, 64, rkey, 2) : -1;
  if (rkey && in != IBV_WC_SUCCESS) {
    /* A loopback path that does not work fails writes with a transport
     * error: that says nothing about windows. */
    verdict = in == IBV_WC_REM_ACCESS_ERR ? KVF__MW_BROKEN : KVF__MW_BOUNDS_UNKNOWN;
    snprintf(why, len, "a write inside a bound window failed: %s", wc_text(in));
  } else if (rkey) {
    memset(p.buf + CHECK_PAGE, 0x5a, 64);
    int out = probe_write(&p, CHECK_PAGE - 8, 16, rkey, 3);
    bool landed = p.buf[CHECK_PAGE] != 0x5a;
    if (out == IBV_WC_REM_ACCESS_ERR && !landed) {
      verdict = KVF__MW_BOUNDS_ENFORCED;
      snprintf(why, len, "a write across a window's end fails with a remote access error");
    } else if (out == IBV_WC_SUCCESS) {
      verdict = KVF__MW_BOUNDS_IGNORED;
      snprintf(why, len, "a write across a window's end lands%s (the device checks it against the "
               "registration only)", landed ? " past it" : "");
    } else {
      snprintf(why, len, "a write across a window's end ended with: %s", wc_text(out));
    }
  }
  probe_free(&p);
  return verdict;
}

const char *kvf__mw_bounds_name(int b) {
  switch (b) {
  case KVF__MW_BOUNDS_ENFORCED: return "enforced";
  case KVF__MW_BOUNDS_IGNORED: return "not enforced";
  case KVF__MW_BROKEN: return "broken";
  default: return "unverified";
  }
}

/* ------------------------------------------------------------ deciding: whether to use them (rdma-memory-windows) */

static void append(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void append(char *buf, size_t len, const char *fmt, ...) {
  size_t used = strlen(buf);
  va_list ap;
  va_start(ap, fmt);
  if (used < len) vsnprintf(buf + used, len - used, fmt, ap);
  va_end(ap);
}

/* The one line that status, doctor and the start log give. */
static void say_protection(rdma_transport *rt) {
  char weak[160] = "", unknown[160] = "";
  for (int i = 0; rt->mw.on && i < rt->n_devs; i++) {
    const rdev *d = &rt->devs[i];
    if (d->mw_bounds == KVF__MW_BOUNDS_IGNORED) append(weak, sizeof(weak), "%s%s", weak[0] ? ", " : "", d->name);
    if (d->mw_bounds == KVF__MW_BOUNDS_UNKNOWN)
      append(unknown, sizeof(unknown), "%s%s (%s)", unknown[0] ? ", " : "", d->name, d->mw_check);
  }
  char *p = rt->protection;
  size_t n = sizeof(rt->protection);
  if (!rt->mw.on)
    snprintf(p, n, "no memory windows (%s): a peer can write any byte of a registered pool at any time", rt->mw.why);
  else if (weak[0])
    snprintf(p, n, "memory windows (type 2) per grant, but %s does not check a write against a window's bounds "
             "(tested at start): a peer can write any byte of the pools its open grants write to, while they are "
             "open", weak);
  else if (unknown[0])
    snprintf(p, n, "memory windows (type 2) per grant; whether the device checks a write against a window's "
             "bounds could not be tested at start on %s", unknown);
  else
    snprintf(p, n, "memory windows (type 2): a peer can write only the ranges of its open grants");
}

/* Type 2 windows of every device, and what each does with a write that
 * leaves one (a loopback test, before the pools are registered). */
int kvf__rdma_decide_windows(rdma_transport *rt, char *err, size_t errlen) {
  int mode = kvfd.cfg.rdma_memory_windows;
  char missing[200] = "";
  for (int i = 0; mode != KVF__OFF && i < rt->n_devs; i++) {
    rdev *d = &rt->devs[i];
    struct ibv_device_attr_ex ax;
    uint64_t f = ibv_query_device_ex(d->ctx, NULL, &ax) == 0
                     ? (uint64_t)ax.orig_attr.device_cap_flags | ax.device_cap_flags_ex
                     : 0;
    d->mw2 = f & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B);
    if (d->mw2) d->mw_bounds = kvf__mw_check_bounds(d->ctx, d->pd, d->port, d->gid_index, d->mw_check,
                                                    sizeof(d->mw_check));
    if (!d->mw2)
      append(missing, sizeof(missing), "%snot supported by %s", missing[0] ? "; " : "", d->name);
    else if (d->mw_bounds == KVF__MW_BROKEN)
      append(missing, sizeof(missing), "%s%s: %s", missing[0] ? "; " : "", d->name, d->mw_check);
  }
  rt->mw.on = mode != KVF__OFF && !missing[0];
  if (mode == KVF__OFF) snprintf(rt->mw.why, sizeof(rt->mw.why), "rdma-memory-windows off");
  else snprintf(rt->mw.why, sizeof(rt->mw.why), "%s", missing);
  if (mode == KVF__ON && !rt->mw.on) {
    snprintf(err, errlen, "rdma-memory-windows on, but the devices cannot take them: %s", missing);
    return -EOPNOTSUPP;
  }
  say_protection(rt);
  return 0;
}

/* ------------------------------------------------------------ binding (receiver)
 *
 * With memory windows (rt->mw.on) a grant is opened asynchronously: its
 * destination ranges (merged, at most rdma-mw-max-windows) each get a type 2
 * window, bound round-robin on the peer's accepted QPs of every device (a
 * type 2 window takes writes only through the QP it is bound on, and the
 * sender writes through its end of that QP). The loop owns it all: binds go
 * on the accepted QPs' send queues, whose completions land in a CQ of their
 * own (lk->bcq) that only the loop polls (mw.timer, every millisecond while
 * binds are in flight). Once every bind completed the Grant goes out with
 * the windows (kvf__xfer_on_grant_ready). When the transfer ends, however
 * it ends, grant_close deallocates the windows (which invalidates them)
 * before the memory goes back to the client. */

#define BIND_WAIT_MS 2000       /* grant_close waits this long for binds in flight */
#define BIND_TRIES 4            /* binds that fail with their QP start over on others */

static void on_mw_timer(uv_timer_t *tm);

/* The first pass runs at once (the loop's next turn), not a tick later: a
 * Grant waits for its windows, and a send may be waiting for the Grant. */
static void mw_timer_arm(rdma_transport *rt) {
  if (rt->mw.timer_on || (!rt->mw.binding && !rt->mw.zombies && !rt->mw.lost_pending)) return;
  uv_timer_start(&rt->mw.timer, on_mw_timer, 0, 1);
  rt->mw.timer_on = true;
}

/* Accepted QPs the peer dials: its devices times its QPs per device. */
static size_t accepted_expected(const rpeer *rp) {
  const Kvf__RdmaInfo *ri = rp->p->hello ? rp->p->hello->rdma : NULL;
  return ri ? ri->n_devices * (ri->qps_per_peer ? ri->qps_per_peer : 1) : 1;
}

/* The peer's QPs that can hold windows: accepted, connected, and known by
 * which of its devices dialed them. */
static size_t bind_qps(const rpeer *rp, rqp **qs, size_t cap) {
  size_t n = 0;
  for (int i = 0; i < rp->n_links; i++) {
    rlink *lk = rp->links[i];
    for (unsigned j = 0; lk->bcq && j < lk->n_all && n < cap; j++) {
      rqp *q = lk->all[j];
      if (!q->outbound && q->established && !q->gone && q->qp && q->peer_dev >= 0) qs[n++] = q;
    }
  }
  return n;
}

static void grant_failed(rgrant *g, int status, const char *why) {
  if (g->status) return;
  g->status = status;
  kvf__warn("rdma: binding the memory windows of %s failed: %s", g->x->id, why);
}

/* A QP failed under g's binds (the peer may be rebuilding its QPs right
 * now): once the binds in flight are back, g starts over on the QPs then
 * connected; after BIND_TRIES, g fails. */
static void bind_retry(rgrant *g, const char *why) {
  if (g->status || g->restart) return;
  if (g->tries + 1 >= BIND_TRIES) {
    grant_failed(g, KVF_EPEERLOST, why);
    return;
  }
  kvf__debug("rdma: %s: binding its memory windows again: %s", g->x->id, why);
  g->restart = true;
}

/* Deallocates g's windows (which invalidates them) and forgets the QPs
 * they were bound on. */
static void drop_windows(rgrant *g) {
  for (size_t i = 0; g->mw && i < g->n_win; i++)
    if (g->mw[i]) {
      ibv_dealloc_mw(g->mw[i]);
      g->rt->mw.live--;
    }
  free(g->mw);
  free(g->qs);
  free(g->cur);
  g->mw = NULL;
  g->qs = NULL;
  g->cur = NULL;
  g->nq = 0;
}

static void bind_reset(rgrant *g) {
  drop_windows(g);
  g->posted = 0;
  g->restart = false;
  g->tries++;
}

/* Picks the QPs (all of the peer's once they are connected, or what is
 * connected CONNECT_MS after the peer came up) and allocates the windows. */
static void bind_start(rgrant *g) {
  rpeer *rp = rpeer_of(g->rt, g->peer);
  rqp *qs[MAX_LANES];
  if (!rp) {
    grant_failed(g, KVF_EPEERLOST, "the peer is gone");
    return;
  }
  size_t n = bind_qps(rp, qs, MAX_LANES);
  bool late = kvf__now_ns() - rp->up_ns > (uint64_t)CONNECT_MS * 1000000ull;
  if (n < accepted_expected(rp) && !late) return;
  if (n == 0) {
    grant_failed(g, KVF_EPEERLOST, "none of the peer's queue pairs is connected");
    return;
  }
  g->qs = malloc(n * sizeof(*g->qs));
  g->cur = malloc(n * sizeof(*g->cur));
  g->mw = calloc(g->n_win, sizeof(*g->mw));
  if (!g->qs || !g->cur || !g->mw) {
    grant_failed(g, -ENOMEM, "out of memory");
    return;
  }
  g->nq = n;
  for (size_t j = 0; j < n; j++) {
    g->qs[j] = qs[j];
    g->cur[j] = j;
  }
}

/* Windows are allocated chain by chain, so that a big grant does not hold
 * the loop for all of them at once. */
static struct ibv_mw *window_alloc(rgrant *g, size_t i, rqp *q) {
  if (g->mw[i]) return g->mw[i];
  g->mw[i] = ibv_alloc_mw(q->lk->dev->pd, IBV_MW_TYPE_2);
  if (g->mw[i]) {
    g->rt->mw.live++;
    return g->mw[i];
  }
  int e = errno;
  char why[160];
  snprintf(why, sizeof(why), "ibv_alloc_mw (window %zu of %zu): %s", i + 1, g->n_win, strerror(e));
  grant_failed(g, e == ENOMEM ? KVF_ELIMIT : -e, why);
  return NULL;
}

/* Window i bound on q, as the Grant tells the sender. */
static void window_record(rgrant *g, size_t i, rqp *q, uint32_t rkey) {
  const kvf__range *w = &g->win[i];
  kvf__mw_rec r = {.pool = w->pool, .off = w->start, .len = w->end - w->start, .rkey = rkey,
                   .qpn = q->remote_qpn, .dev = (uint16_t)q->peer_dev};
  kvf__mw_rec_put(g->x->tp_grant.win + i * KVF__MW_REC, &r);
}

/* Posts one chain of binds (what fits) of g's windows for its QP j. */
static int bind_chain(rgrant *g, size_t j) {
  rqp *q = g->qs[j];
  struct ibv_send_wr wr[CHAIN_MAX], *bad = NULL;
  bchain *c = calloc(1, sizeof(*c));
  if (!c) return -ENOMEM;
  uint32_t k = 0, room = q->bind_cap - q->bind_used;
  for (; k < CHAIN_MAX && k < room && g->cur[j] < g->n_win; k++, g->cur[j] += g->nq) {
    size_t i = g->cur[j];
    const kvf__range *w = &g->win[i];
    if (!window_alloc(g, i, q)) break;
    uint32_t rkey = ibv_inc_rkey(g->mw[i]->rkey);
    wr[k] = (struct ibv_send_wr){
        .next = &wr[k + 1], .opcode = IBV_WR_BIND_MW,
        .bind_mw = {.mw = g->mw[i], .rkey = rkey,
                    .bind_info = {.mr = q->lk->dev->mrs[w->pool], .addr = (uintptr_t)g->rt->pool_base[w->pool] + w->start,
                                  .length = w->end - w->start, .mw_access_flags = IBV_ACCESS_REMOTE_WRITE}}};
    window_record(g, i, q, rkey);
  }
  if (k == 0) {
    free(c);
    return 0; /* g failed */
  }
  /* Only the last is signalled; a failure flushes the others with wr_id 0. */
  wr[k - 1].next = NULL;
  wr[k - 1].send_flags = IBV_SEND_SIGNALED;
  wr[k - 1].wr_id = (uintptr_t)c;
  int rc = ibv_post_send(q->qp, wr, &bad);
  if (rc) {
    free(c);
    return -rc;
  }
  *c = (bchain){g->chains, g, q, k};
  g->chains = c;
  g->chains_out++;
  g->posted += k;
  q->bind_used += k;
  q->lk->binds_out++;
  return 0;
}

static void bind_pump(rgrant *g) {
  for (size_t j = 0; j < g->nq && !g->status && !g->restart; j++) {
    rqp *q = g->qs[j];
    if (!q) {
      bind_retry(g, "a queue pair of the peer went away");
      return;
    }
    while (g->cur[j] < g->n_win && q->bind_used < q->bind_cap && !g->status) {
      int rc = bind_chain(g, j);
      if (rc) {
        bind_retry(g, strerror(-rc));
        return;
      }
    }
  }
}

static void chain_done(bchain *c, bool ok) {
  rgrant *g = c->g;
  for (bchain **pp = &g->chains; *pp; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  c->q->bind_used -= c->n;
  c->q->lk->binds_out--;
  g->chains_out--;
  if (!ok && !g->closed) bind_retry(g, "a bind work request failed");
  free(c);
}

/* A bind failed on q (or was flushed: q is in the error state). No more
 * windows go on it, and it is disconnected so that the peer rebuilds its
 * QPs (else it would keep writing into a QP that takes nothing). */
static void bind_qp_broken(rlink *lk, uint32_t qp_num, enum ibv_wc_status st) {
  for (unsigned i = 0; i < lk->n_all; i++) {
    rqp *q = lk->all[i];
    if (q->outbound || q->gone || !q->qp || q->qp_num != qp_num) continue;
    kvf__warn("rdma: %s: binding a memory window on QP %u (%s) failed: %s; dropping that QP", peer_name(lk->rp),
              q->qp_num, lk->dev->name, ibv_wc_status_str(st));
    q->gone = true;
    if (q->established && q->id) rdma_disconnect(q->id);
    return;
  }
}

static bool poll_binds(rlink *lk) {
  struct ibv_wc wc[CQ_BATCH];
  int n, total = 0;
  while ((n = ibv_poll_cq(lk->bcq, CQ_BATCH, wc)) > 0) {
    for (int i = 0; i < n; i++) {
      if (wc[i].status != IBV_WC_SUCCESS) bind_qp_broken(lk, wc[i].qp_num, wc[i].status);
      if (wc[i].wr_id) chain_done((bchain *)(uintptr_t)wc[i].wr_id, wc[i].status == IBV_WC_SUCCESS);
    }
    total += n;
  }
  return total > 0;
}

static void poll_all_binds(rdma_transport *rt) {
  for (size_t i = 0; i < rt->n_peers; i++)
    for (int l = 0; l < rt->peers[i]->n_links; l++) {
      rlink *lk = rt->peers[i]->links[l];
      if (lk->bcq && lk->binds_out) poll_binds(lk);
    }
}

static bool bind_finished(const rgrant *g) {
  return g->chains_out == 0 && (g->status || (!g->restart && g->qs && g->posted == g->n_win));
}

static void unlist(rgrant **head, rgrant *g) {
  for (rgrant **pp = head; *pp; pp = &(*pp)->next_b)
    if (*pp == g) {
      *pp = g->next_b;
      return;
    }
}

/* A bound grant: its windows stay until grant_close (or until the QPs
 * they are bound on go: kvf__rdma_mw_forget_link). */
static void bind_done(rgrant *g) {
  rdma_transport *rt = g->rt;
  unlist(&rt->mw.binding, g);
  g->binding = false;
  free(g->cur);
  g->cur = NULL;
  if (g->status) {
    rt->mw.failed++;
  } else {
    uint64_t ns = kvf__now_ns() - g->since_ns;
    rt->mw.bound += g->n_win;
    rt->mw.bind_ns += ns;
    rt->mw.last_win = g->n_win;
    rt->mw.last_bind_ns = ns;
    kvf__debug("rdma: %s: %zu memory windows bound in %.1f ms", g->x->id, g->n_win, (double)ns / 1e6);
  }
}

static void reap_zombies(rdma_transport *rt) {
  for (rgrant *g = rt->mw.zombies, *next; g; g = next) {
    next = g->next_b;
    if (g->chains_out) continue;
    unlist(&rt->mw.zombies, g);
    free(g);
  }
}

/* The grants that lost their bound windows in a reset fail, each looked
 * up again by its key, since failing one closes it (and may close others). */
static void fail_lost(rdma_transport *rt) {
  size_t n = 0, cap = 0;
  char (*keys)[16] = NULL;
  rt->mw.lost_pending = false;
  for (size_t i = 0; i < rt->grants.nb; i++)
    for (kvf__map_ent *e = rt->grants.b[i]; e; e = e->next) {
      const rgrant *g = e->val;
      if (!g->lost || g->closed || g->credit_of) continue;
      if (n == cap) {
        size_t c = cap ? 2 * cap : 16;
        void *k = realloc(keys, c * sizeof(*keys));
        if (!k) break; /* out of memory: these wait for their deadline */
        keys = k;
        cap = c;
      }
      snprintf(keys[n++], sizeof(keys[0]), "%s", e->key);
    }
  for (size_t i = 0; i < n; i++) {
    rgrant *g = kvf__map_get(&rt->grants, keys[i]);
    if (g && g->lost && !g->closed && !g->credit_of)
      kvf__xfer_on_grant_lost(g->x, "the rdma queue pairs its memory windows were bound on were reset (a data-path "
                                    "error with the peer); grant again");
  }
  free(keys);
}

/* Every millisecond while binds are in flight. A grant's callback may
 * close any grant (the peer may fail), so after each the scan restarts. */
static void on_mw_timer(uv_timer_t *tm) {
  rdma_transport *rt = kvf__container_of(tm, rdma_transport, mw.timer);
  if (rt->mw.lost_pending) fail_lost(rt);
  poll_all_binds(rt);
  reap_zombies(rt);
  bool pumped = false;
  for (rgrant *g = rt->mw.binding; g; g = g->next_b) {
    if (g->restart && !g->chains_out && !g->status) bind_reset(g);
    if (!g->qs && !g->status) bind_start(g);
    if (g->qs && !g->status && !g->restart) {
      bind_pump(g);
      pumped = true;
    }
  }
  if (pumped) poll_all_binds(rt); /* binds the device completed as they were posted (rxe does) */
  for (;;) {
    rgrant *g = rt->mw.binding;
    while (g && !bind_finished(g)) g = g->next_b;
    if (!g) break;
    bind_done(g);
    kvf__xfer_on_grant_ready(g->x, g->status, g->status ? "binding the grant's memory windows failed" : NULL);
  }
  if (!rt->mw.binding && !rt->mw.zombies && !rt->mw.lost_pending) {
    uv_timer_stop(&rt->mw.timer);
    rt->mw.timer_on = false;
  }
}

/* Room for the Grant's window records and each descriptor's window. */
int kvf__rdma_grant_part_alloc(kvf__tp_grant *t, size_t n_win, size_t n_desc) {
  t->win = calloc(n_win, KVF__MW_REC);
  t->of = malloc(n_desc ? n_desc * KVF__MW_OF : 1);
  if (!t->win || !t->of) return -ENOMEM; /* freed with the transfer */
  t->win_len = n_win * KVF__MW_REC;
  t->of_len = n_desc * KVF__MW_OF;
  return 0;
}

/* Plans g's windows and starts binding them; 1: the Grant waits for them. */
static int mw_grant_open(rgrant *g, kvf__xfer *x) {
  kvf__rangeset rs = {0};
  size_t merged = 0;
  int rc = kvf__rangeset_build(&rs, &x->dst);
  if (rc == 0) rc = kvf__mw_plan(&rs, kvfd.cfg.rdma_mw_max_windows, &g->win, &g->n_win, &merged);
  rpeer *rp = rpeer_of(g->rt, g->peer);
  /* its slice of the staging arena, last (highest pool), a window per QP at least */
  if (rc == 0) rc = kvf__rdma_stage_window(g, rp ? accepted_expected(rp) : 1);
  size_t ranges = rs.n;
  kvf__rangeset_free(&rs);
  if (rc == 0 && g->n_win == 0) rc = KVF_EINVAL;
  if (rc == 0) rc = kvf__rdma_grant_part_alloc(&x->tp_grant, g->n_win, x->dst.n);
  /* Each descriptor's window, worked out now, ahead of the send, so that
   * the sender posts without searching. */
  if (rc == 0) rc = kvf__mw_index(&x->dst, g->win, g->n_win, x->tp_grant.of);
  if (rc) return rc;
  rdma_transport *rt = g->rt;
  if (merged) {
    rt->mw.merged++;
    kvf__warn("rdma: grant %s has %zu separate ranges, more than rdma-mw-max-windows (%u): its %zu memory "
              "windows also span the %zu smallest gaps between them", x->id, ranges, kvfd.cfg.rdma_mw_max_windows,
              g->n_win, merged);
  }
  rt->mw.grants++;
  g->since_ns = kvf__now_ns();
  g->binding = true;
  g->next_b = rt->mw.binding;
  rt->mw.binding = g;
  mw_timer_arm(rt);
  return 1;
}

/* Waits (bounded) for g's binds in flight: a window must not become valid
 * after it was deallocated, nor be deallocated under its bind. */
static void wait_binds(rgrant *g) {
  uint64_t end = kvf__now_ns() + (uint64_t)BIND_WAIT_MS * 1000000ull;
  while (g->chains_out && kvf__now_ns() < end)
    if (!poll_binds(g->chains->q->lk)) {
      struct timespec nap = {0, 50000};
      nanosleep(&nap, NULL);
    }
}

/* Invalidates and frees g's windows. false: binds are still in flight (a
 * stuck device); g then waits among the zombies for them. */
static bool mw_release(rgrant *g) {
  rdma_transport *rt = g->rt;
  if (g->binding) unlist(&rt->mw.binding, g);
  g->binding = false;
  if (g->chains_out) wait_binds(g);
  drop_windows(g);
  free(g->win);
  g->win = NULL;
  g->closed = true;
  if (!g->chains_out) return true;
  kvf__warn("rdma: binds of a closed grant still in flight after %d ms", BIND_WAIT_MS);
  g->next_b = rt->mw.zombies;
  rt->mw.zombies = g;
  mw_timer_arm(rt);
  return false;
}

/* The windows of g bound on lk's QPs: binds in flight never complete, a
 * grant still binding binds again, and the windows go at once. They can
 * take no write any more, and a type 2 window holds its QP: rxe's
 * destroy_qp waits (up to 50 s) for the windows bound on it to go. A bound
 * grant whose windows go with a reset (the control connection stays) is
 * failed from the timer (fail_lost): its Grant named these windows, and a
 * write or completion notice of its sender's may have gone with them. */
static void forget_windows(rgrant *g, rlink *lk) {
  for (bchain *c = g->chains, *next; c; c = next) {
    next = c->next;
    if (c->q->lk == lk) chain_done(c, false);
  }
  for (size_t j = 0; j < g->nq; j++) {
    if (!g->qs[j] || g->qs[j]->lk != lk) continue;
    g->qs[j] = NULL;
    if (g->binding) bind_retry(g, "a queue pair of the peer went away");
    else if (!g->closed && lk->rp->resetting && !g->lost) {
      g->lost = true;
      g->rt->mw.lost_pending = true;
      mw_timer_arm(g->rt);
    }
    for (size_t i = j; g->mw && i < g->n_win; i += g->nq)
      if (g->mw[i]) {
        ibv_dealloc_mw(g->mw[i]);
        g->mw[i] = NULL;
        g->rt->mw.live--;
      }
  }
}

/* The link goes (peer down or reset); its QPs are in the error state. */
void kvf__rdma_mw_forget_link(rlink *lk) {
  rdma_transport *rt = lk->rp->rt;
  for (size_t i = 0; i < rt->grants.nb; i++)
    for (kvf__map_ent *e = rt->grants.b[i]; e; e = e->next) forget_windows(e->val, lk);
  for (rgrant *g = rt->mw.zombies; g; g = g->next_b) forget_windows(g, lk);
}

/* An accepted QP is connected: which QP and device of the peer dialed it
 * (the Grant names windows by them). */
void kvf__rdma_accepted_ready(rqp *q) {
  struct ibv_qp_attr a;
  struct ibv_qp_init_attr ia;
  const Kvf__RdmaInfo *ri = q->lk->rp->p->hello ? q->lk->rp->p->hello->rdma : NULL;
  struct sockaddr *sa = rdma_get_peer_addr(q->id);
  if (!q->lk->rp->rt->mw.on || !ri || !sa || ibv_query_qp(q->qp, &a, IBV_QP_DEST_QPN, &ia) != 0) return;
  q->remote_qpn = a.dest_qp_num;
  uint8_t want[16], have[16];
  size_t alen = sa->sa_family == AF_INET6 ? 16 : 4;
  memcpy(want, sa->sa_family == AF_INET6 ? (void *)&((struct sockaddr_in6 *)sa)->sin6_addr
                                         : (void *)&((struct sockaddr_in *)sa)->sin_addr, alen);
  for (size_t j = 0; j < ri->n_devices; j++)
    if (ri->devices[j]->cm_addr &&
        inet_pton(sa->sa_family, ri->devices[j]->cm_addr, have) == 1 && memcmp(want, have, alen) == 0) {
      q->peer_dev = (int)j;
      return;
    }
  kvf__debug("rdma: %s: an accepted QP comes from an address none of its devices announced",
             peer_name(q->lk->rp));
}

/* ------------------------------------------------------------ grants */

/* Windows invalidated first, then the staging slice goes back: no write
 * can reach it once another grant has it. */
static void close_grant(rgrant *g) {
  rdma_transport *rt = g->rt;
  uint64_t off = g->st_off, len = g->st_len;
  g->st_len = 0;
  kvf__rdma_stage_detach(g); /* its passes write into its blocks: over before the memory goes back */
  bool done = mw_release(g);
  kvf__rdma_stage_release(rt, off, len);
  if (done) free(g);
}

int kvf__rdma_grant_open(kvf__transport *t, kvf__xfer *x) {
  rdma_transport *rt = to_rdma(t);
  char key[16];
  kvf__spin_expect(true); /* the progress threads poll until the data comes (spin.h) */
  for (size_t i = 0; rt->any_gpu && !x->path && i < x->dst.n; i++) {
    const kvf__pool *p = kvf__pool_get(x->dst.pool[i]);
    if (p && kvf__pool_gpu(p) && !(x->dst.pool[i] < rt->n_pool_slots && rt->pool_bounce[x->dst.pool[i]]))
      x->path = "rdma-gdr";
  }
  grant_key(key, sizeof(key), (uint32_t)x->handle);
  rgrant *g = calloc(1, sizeof(*g));
  if (!g) return -ENOMEM;
  g->rt = rt;
  g->x = x;
  g->peer = x->peer;
  int rc = kvf__map_put(&rt->grants, key, g);
  if (rc) {
    free(g);
    kvf__warn("rdma: grant token %s of %s is still in use; refusing the grant", key, x->id);
    return rc == -EEXIST ? KVF_EEXIST : rc;
  }
  /* A grant to pools that bounce: staging slots, and no windows (nothing
   * of those pools is registered). */
  rc = kvf__rdma_bounce_grant_open(g, x);
  if (rc < 0) {
    kvf__map_del(&rt->grants, key);
    kvf__rdma_bounce_grant_close(g);
    free(g);
    return rc;
  }
  if (rc > 0) return rc == 2; /* 2: waiting for staging slots */
  if (rt->mw.on) kvf__rdma_stage_reserve(g, x);
  rc = rt->mw.on ? mw_grant_open(g, x) : 0;
  /* engine memory our Hello did not list: its MRs, for the sender */
  if (rc >= 0) {
    int e = kvf__rdma_grant_add_mrs(rt, x);
    if (e) rc = e;
  }
  if (rc < 0) {
    kvf__map_del(&rt->grants, key);
    close_grant(g);
  }
  return rc;
}

void kvf__rdma_grant_close(kvf__transport *t, kvf__xfer *x) {
  rdma_transport *rt = to_rdma(t);
  char key[16];
  grant_key(key, sizeof(key), (uint32_t)x->handle);
  rgrant *g = kvf__map_get(&rt->grants, key);
  if (!g || g->x != x) return;
  kvf__map_del(&rt->grants, key);
  kvf__rdma_bounce_grant_close(g);
  close_grant(g);
}

/* Before the PDs go: every grant closed, every window deallocated. */
void kvf__rdma_free_grants(rdma_transport *rt) {
  for (size_t i = 0; i < rt->grants.nb; i++)
    for (kvf__map_ent *e = rt->grants.b[i]; e; e = e->next) {
      if (((rgrant *)e->val)->credit_of) continue; /* a send's credit token: goes with its transfer */
      kvf__rdma_bounce_grant_close(e->val);
      close_grant(e->val);
    }
  kvf__map_free(&rt->grants);
  while (rt->mw.zombies) {
    rgrant *g = rt->mw.zombies;
    rt->mw.zombies = g->next_b;
    free(g);
  }
}

/* ------------------------------------------------------------ sending: the window of each run */

/* Our QP that a window's record names (its receiving end holds it). */
rqp *kvf__rdma_window_qp(const rpeer *rp, const kvf__mw_rec *w) {
  for (int i = 0; i < rp->n_links; i++) {
    rlink *lk = rp->links[i];
    if (lk->dev->index != (int)w->dev) continue;
    for (unsigned j = 0; j < lk->n_all; j++) {
      rqp *q = lk->all[j];
      if (q->outbound && !q->gone && q->qp && q->qp_num == w->qpn) return q;
    }
  }
  return NULL;
}

#ifdef KVF_FAILPOINTS
/* Failpoint write-wrong-qp: the tail goes on another of our QPs than the
 * one its window is bound on (a type 2 window takes writes only there). */
static void rogue_tail_qp(ticket *tk, const rpeer *rp) {
  for (int i = 0; i < rp->n_links; i++)
    for (unsigned j = 0; j < rp->links[i]->n_all; j++) {
      rqp *q = rp->links[i]->all[j];
      if (!q->outbound || q->gone || !q->established || q == tk->tail_q) continue;
      kvf__warn("failpoint write-wrong-qp: the last write goes on QP %u instead of %u", q->qp_num,
                tk->tail_q->qp_num);
      tk->tail_q = q;
      tk->tail_dev = q->lk->dev;
      return;
    }
}
#endif

void kvf__rdma_wtable_free(wtable *t) {
  if (!t) return;
  free(t->v);
  free(t->lane);
  free(t);
}

/* Decodes a Grant's windows, each with its lane: a (device, QP) of the
 * records; few. */
static int wtable_decode(const kvf__xfer *x, wtable **out) {
  size_t n_win = kvf__rdma_window_records(&x->tp_grant); /* MR and bounce records follow */
  if (kvf__mw_recs_check(x->tp_grant.win, n_win * KVF__MW_REC) != 0) return KVF_EPROTO;
  wtable *t = calloc(1, sizeof(*t));
  if (!t) return -ENOMEM;
  t->n = n_win;
  t->of = x->tp_grant.of;
  t->of_len = x->tp_grant.of_len;
  t->v = malloc((t->n ? t->n : 1) * sizeof(*t->v));
  t->lane = malloc((t->n ? t->n : 1) * sizeof(*t->lane));
  if (!t->v || !t->lane) {
    kvf__rdma_wtable_free(t);
    return -ENOMEM;
  }
  kvf__mw_recs_decode(x->tp_grant.win, t->n, t->v);
  for (size_t i = 0; i < t->n; i++) {
    const kvf__mw_rec *w = &t->v[i];
    size_t l = 0;
    while (l < t->nl && (t->v[t->first[l]].qpn != w->qpn || t->v[t->first[l]].dev != w->dev)) l++;
    t->lane[i] = l < MAX_LANES ? (uint32_t)l : UINT32_MAX;
    if (l < t->nl || l == MAX_LANES) continue;
    t->first[t->nl++] = i;
  }
  *out = t;
  return 0;
}

/* The table of a post: the transfer's windows and, looked up anew for each
 * post (a QP can be rebuilt between two), our QP behind each lane. */
typedef struct wpost {
  const wtable *t;
  rqp *qs[MAX_LANES];           /* by lane; NULL: that QP is gone */
  size_t hint;                  /* the last run's window: the next often is it or the one after */
  uint64_t searched;            /* runs whose Grant.window_of entry did not hold them */
} wpost;

static int wpost_init(wpost *wp, xstate *xs, const rpeer *rp, const kvf__xfer *x) {
  int rc = xs->wt ? 0 : wtable_decode(x, &xs->wt);
  if (rc) return rc;
  wp->t = xs->wt;
  wp->hint = 0;
  wp->searched = 0;
  for (size_t l = 0; l < wp->t->nl; l++) wp->qs[l] = kvf__rdma_window_qp(rp, &wp->t->v[wp->t->first[l]]);
  return 0;
}

/* The window that holds run r: 0, KVF_ERANGE when none does, KVF_EPEERLOST
 * when the QP it is bound through is gone. */
static int wtable_find(wpost *wp, const kvf__run *r, const kvf__mw_rec **w, uint32_t *ln) {
  const wtable *t = wp->t;
  bool rogue = false;
#ifdef KVF_FAILPOINTS
  rogue = kvf__failpoint(KVF__FP_WRITE_OUTSIDE); /* writes outside with a window it holds */
#endif
  /* The receiver says which window holds each of its descriptors; a
   * wrong or missing entry costs a search, never a write. */
  long i = -1;
  uint32_t k = rogue ? UINT32_MAX : kvf__mw_index_get(t->of, t->of_len, r->dst_desc);
#ifdef KVF_FAILPOINTS
  if (k != UINT32_MAX && kvf__failpoint(KVF__FP_BAD_WINDOW_INDEX)) k++;
#endif
  if (k < t->n && kvf__mw_holds(&t->v[k], r->dst_pool, r->dst_off, r->len)) i = (long)k;
  else {
    /* Engines hand out KV blocks in runs, so a run is often in the window
     * of the one before it, or the next: two compares before a search. */
    wp->searched += !rogue;
    if (!rogue && wp->hint < t->n && kvf__mw_holds(&t->v[wp->hint], r->dst_pool, r->dst_off, r->len))
      i = (long)wp->hint;
    else if (!rogue && wp->hint + 1 < t->n &&
             kvf__mw_holds(&t->v[wp->hint + 1], r->dst_pool, r->dst_off, r->len))
      i = (long)wp->hint + 1;
    else i = kvf__mw_find(t->v, t->n, r->dst_pool, r->dst_off, r->len, rogue);
  }
  if (i < 0) return KVF_ERANGE;
  wp->hint = (size_t)i;
  *w = &t->v[i];
  *ln = t->lane[i];
  return *ln < t->nl && wp->qs[*ln] ? 0 : KVF_EPEERLOST;
}

/* The grant has memory windows: each run goes through the window that
 * holds it, posted on the QP whose receiving end the window is bound to;
 * body runs are grouped into one lane per QP. */
int kvf__rdma_ticket_windows(ticket *tk, const rpeer *rp, const kvf__xfer *x, xstate *xs) {
  wpost t;
  size_t nb = tk->n_body, cnt[MAX_LANES] = {0}, at[MAX_LANES];
  int rc = wpost_init(&t, xs, rp, x);
  size_t nl = rc == 0 ? t.t->nl : 0;
  uint16_t *lane_of = nl > 1 ? malloc((nb ? nb : 1) * sizeof(*lane_of)) : NULL;
  tk->rkeys = malloc((nb ? nb : 1) * sizeof(*tk->rkeys));
  tk->order = nl > 1 ? malloc((nb ? nb : 1) * sizeof(*tk->order)) : NULL;
  tk->lanes = nl ? calloc(nl, sizeof(*tk->lanes)) : NULL;
  if (rc == 0 && (!tk->rkeys || (nl > 1 && !(lane_of && tk->order)) || (nl && !tk->lanes))) rc = -ENOMEM;
  const kvf__mw_rec *w = NULL;
  uint32_t ln = 0;
  for (size_t i = 0; rc == 0 && i < nb; i++) {
    if ((rc = wtable_find(&t, &tk->runs[i], &w, &ln)) != 0) break;
    if (lane_of) lane_of[i] = (uint16_t)ln;
    tk->rkeys[i] = w->rkey;
    cnt[ln]++;
  }
  if (rc == 0 && tk->has_tail && tk->tail.len && (rc = wtable_find(&t, &tk->tail, &w, &ln)) == 0) {
    tk->tail_q = t.qs[ln];
    tk->tail_dev = tk->tail_q->lk->dev;
    tk->tail_rkey = w->rkey;
    tk->tail_qpn = w->qpn;
    tk->tail_devi = w->dev;
  }
#ifdef KVF_FAILPOINTS
  if (rc == 0 && tk->tail_q && kvf__failpoint(KVF__FP_WRONG_QP)) rogue_tail_qp(tk, rp);
#endif
  if (rc == 0) { /* lane by lane, in post order within each: indices, not copies of runs */
    for (size_t l = 0, off = 0; l < nl; off += cnt[l++]) {
      at[l] = off;
      tk->lanes[l] = (lane){t.qs[l], off, off + cnt[l]};
    }
    for (size_t i = 0; lane_of && i < nb; i++) tk->order[at[lane_of[i]]++] = (uint32_t)i;
    tk->n_lanes = nl;
    tk->left = nb;
    rp->rt->mw.lookups += nb + (tk->has_tail && tk->tail.len);
    rp->rt->mw.searches += t.searched;
  }
  free(lane_of);
  return rc; /* on failure the caller frees the ticket, with what was made here */
}
