/* rdma_mw.c - see rdma_mw.h. */
#include "rdma_mw.h"

#include <errno.h>
#include <infiniband/verbs.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvferry.h"

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
