/* mw_probe.c - what a device does with type 2 memory windows, checked
 * against the real verbs (the soft-RoCE VM: tests/rdma/run.sh builds and
 * runs it first; by hand: rdma-vm/run --nodes 2 -- $BUILD/tests/rdma/mw_probe).
 *
 * One process, two devices (writer A = $NODE0_DEV, target B = $NODE1_DEV)
 * joined by RC QPs connected by hand. B registers a buffer without remote
 * access (LOCAL_WRITE | MW_BIND) and binds type 2 windows on its QP to A:
 *   caps     device_cap_flags: MEM_WINDOW, TYPE_2A, TYPE_2B; max_mw
 *   bind     IBV_WR_BIND_MW on B's QP, then A writes inside the window
 *   outside  A writes across the window's end, then wholly outside it
 *            (inside the MR): should fail with a remote access error, the
 *            bytes there unchanged (the fact is printed, see exit status)
 *   pastmr   A writes across the end of the MR: must fail
 *   noncarry A writes through the MR's own rkey: must fail (no remote access)
 *   otherqp  A writes through a second QP pair: a type 2 window belongs to
 *            the QP it was bound on, so this must fail
 *   localinv B posts IBV_WR_LOCAL_INV; a later write through the rkey fails
 *   sendinv  A sends with invalidate; a later write through the rkey fails
 *   dealloc  B deallocs a bound window; a later write through the rkey fails
 * (rxe fact: destroying a QP while a type 2 window is bound on it blocks for
 * about 50 s, the window holding a reference to the QP.)
 *   rebind   an invalidated window bound again (ibv_inc_rkey) takes writes
 *   rate     binds, local invalidations, alloc/dealloc per second (-n N)
 * Prints one line per check and exits 0 when every check passed, 3 when all
 * did but the device does not check writes against a window's bounds (rxe
 * on Linux 6.1: its responder checks the range against the MR only), 2
 * when the device has no type 2 windows (the rest skipped), 1 on any
 * other failure. */
#include <errno.h>
#include <stdarg.h>
#include <infiniband/verbs.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BUF (1u << 20)
#define WIN_OFF 4096u
#define WIN_LEN 8192u
#define DEPTH 256u
#define GID_INDEX 1

typedef struct side {
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_cq *cq;
  uint8_t *buf;
  struct ibv_mr *mr;
  union ibv_gid gid;
  enum ibv_mtu mtu;
} side;

typedef struct pair {
  struct ibv_qp *a, *b; /* a on A (writer), b on B (target) */
} pair;

static side A, B;
static int failures;
static double t_start;
static bool bounds; /* the device checks writes against the window's bounds */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void report(const char *check, bool ok, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void report(const char *check, bool ok, const char *fmt, ...) {
  char detail[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof(detail), fmt, ap);
  va_end(ap);
  printf("mw_probe: %-9s %s  %s (at %.2f s)\n", check, ok ? "ok  " : "FAIL", detail, now_s() - t_start);
  fflush(stdout);
  if (!ok) failures++;
}

static struct ibv_context *open_dev(const char *name) {
  int n = 0;
  struct ibv_device **list = ibv_get_device_list(&n);
  struct ibv_context *ctx = NULL;
  for (int i = 0; list && i < n; i++)
    if (strcmp(ibv_get_device_name(list[i]), name) == 0) ctx = ibv_open_device(list[i]);
  if (list) ibv_free_device_list(list);
  return ctx;
}

static int side_init(side *s, const char *dev, int mr_access) {
  struct ibv_port_attr pa;
  s->ctx = open_dev(dev);
  if (!s->ctx) return fprintf(stderr, "mw_probe: no device %s\n", dev), -1;
  s->pd = ibv_alloc_pd(s->ctx);
  s->cq = ibv_create_cq(s->ctx, 4 * DEPTH, NULL, NULL, 0);
  s->buf = aligned_alloc(4096, BUF);
  if (!s->pd || !s->cq || !s->buf) return -1;
  memset(s->buf, 0, BUF);
  s->mr = ibv_reg_mr(s->pd, s->buf, BUF, mr_access);
  if (!s->mr) return fprintf(stderr, "mw_probe: ibv_reg_mr on %s: %s\n", dev, strerror(errno)), -1;
  if (ibv_query_port(s->ctx, 1, &pa) || ibv_query_gid(s->ctx, 1, GID_INDEX, &s->gid)) return -1;
  s->mtu = pa.active_mtu;
  return 0;
}

static struct ibv_qp *qp_create(side *s) {
  struct ibv_qp_init_attr a = {
      .send_cq = s->cq,
      .recv_cq = s->cq,
      .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = DEPTH, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1},
  };
  struct ibv_qp *qp = ibv_create_qp(s->pd, &a);
  struct ibv_qp_attr m = {.qp_state = IBV_QPS_INIT,
                          .port_num = 1,
                          .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE};
  if (!qp || ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    return NULL;
  return qp;
}

static int qp_connect(struct ibv_qp *qp, side *me, uint32_t dqpn, const side *peer) {
  struct ibv_qp_attr m = {
      .qp_state = IBV_QPS_RTR,
      .path_mtu = me->mtu < peer->mtu ? me->mtu : peer->mtu,
      .dest_qp_num = dqpn,
      .rq_psn = 1,
      .max_dest_rd_atomic = 1,
      .min_rnr_timer = 12,
      .ah_attr = {.is_global = 1,
                  .port_num = 1,
                  .grh = {.dgid = peer->gid, .sgid_index = GID_INDEX, .hop_limit = 64}},
  };
  if (ibv_modify_qp(qp, &m,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    return -1;
  m = (struct ibv_qp_attr){
      .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 6, .rnr_retry = 6, .sq_psn = 1, .max_rd_atomic = 1};
  return ibv_modify_qp(qp, &m,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                           IBV_QP_MAX_QP_RD_ATOMIC);
}

static int pair_make(pair *p) {
  p->a = qp_create(&A);
  p->b = qp_create(&B);
  if (!p->a || !p->b) return -1;
  if (qp_connect(p->a, &A, p->b->qp_num, &B) || qp_connect(p->b, &B, p->a->qp_num, &A)) return -1;
  return 0;
}

static void pair_free(pair *p) {
  if (p->a) ibv_destroy_qp(p->a);
  if (p->b) ibv_destroy_qp(p->b);
  p->a = p->b = NULL;
}

/* Waits for one completion on s's CQ (of wr_id, skipping flushes of others). */
static int wait_wc(side *s, uint64_t wr_id, struct ibv_wc *out) {
  double end = now_s() + 5;
  while (now_s() < end) {
    struct ibv_wc wc;
    int n = ibv_poll_cq(s->cq, 1, &wc);
    if (n < 0) return -1;
    if (n == 1 && wc.wr_id == wr_id) {
      *out = wc;
      return 0;
    }
  }
  return -ETIMEDOUT;
}

static void drain(side *s) {
  struct ibv_wc wc[16];
  while (ibv_poll_cq(s->cq, 16, wc) > 0) {
  }
}

static int post_bind(struct ibv_qp *qp, struct ibv_mw *mw, uint32_t rkey, uint64_t addr, uint64_t len,
                     uint64_t wr_id, bool signal) {
  struct ibv_send_wr wr = {.wr_id = wr_id,
                           .opcode = IBV_WR_BIND_MW,
                           .send_flags = signal ? IBV_SEND_SIGNALED : 0,
                           .bind_mw = {.mw = mw,
                                       .rkey = rkey,
                                       .bind_info = {.mr = B.mr,
                                                     .addr = addr,
                                                     .length = len,
                                                     .mw_access_flags = IBV_ACCESS_REMOTE_WRITE}}},
                     *bad;
  return ibv_post_send(qp, &wr, &bad);
}

static int post_inv(struct ibv_qp *qp, uint32_t rkey, uint64_t wr_id, bool signal) {
  struct ibv_send_wr wr = {.wr_id = wr_id,
                           .opcode = IBV_WR_LOCAL_INV,
                           .send_flags = signal ? IBV_SEND_SIGNALED : 0,
                           .invalidate_rkey = rkey},
                     *bad;
  return ibv_post_send(qp, &wr, &bad);
}

/* A writes len bytes of pattern into B at addr through rkey on qp; returns
 * the completion status (or -1 on a post error, -2 on timeout). */
static int write_through(struct ibv_qp *qp, uint32_t rkey, uint64_t addr, uint32_t len, uint8_t pattern) {
  static uint64_t id = 1000;
  memset(A.buf, pattern, len);
  struct ibv_sge sge = {.addr = (uintptr_t)A.buf, .length = len, .lkey = A.mr->lkey};
  struct ibv_send_wr wr = {.wr_id = ++id,
                           .sg_list = &sge,
                           .num_sge = 1,
                           .opcode = IBV_WR_RDMA_WRITE,
                           .send_flags = IBV_SEND_SIGNALED,
                           .wr.rdma = {.remote_addr = addr, .rkey = rkey}},
                     *bad;
  struct ibv_wc wc;
  if (ibv_post_send(qp, &wr, &bad)) return -1;
  if (wait_wc(&A, id, &wc)) return -2;
  return (int)wc.status;
}

static const char *st(int s) { return s >= 0 ? ibv_wc_status_str((enum ibv_wc_status)s) : s == -1 ? "post failed" : "timeout"; }

static bool all_are(const uint8_t *p, size_t n, uint8_t v) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != v) return false;
  return true;
}

static uint64_t baddr(uint64_t off) { return (uint64_t)(uintptr_t)B.buf + off; }

/* A bound window of [WIN_OFF, WIN_OFF + WIN_LEN) on p.b; returns its rkey or 0. */
static uint32_t bind_window(pair *p, struct ibv_mw *mw, const char *check) {
  struct ibv_wc wc;
  uint32_t rkey = ibv_inc_rkey(mw->rkey);
  int rc = post_bind(p->b, mw, rkey, baddr(WIN_OFF), WIN_LEN, 7, true);
  if (rc) return report(check, false, "posting IBV_WR_BIND_MW: %s", strerror(rc)), 0;
  if (wait_wc(&B, 7, &wc)) return report(check, false, "no bind completion"), 0;
  if (wc.status != IBV_WC_SUCCESS) return report(check, false, "bind completed with %s", ibv_wc_status_str(wc.status)), 0;
  mw->rkey = rkey; /* libibverbs updates it on success too; keep them in step */
  return rkey;
}

static void reset_pair(pair *p) {
  pair_free(p);
  drain(&A);
  drain(&B);
  if (pair_make(p)) {
    fprintf(stderr, "mw_probe: cannot connect QPs again\n");
    exit(1);
  }
}

static bool caps(void) {
  struct ibv_device_attr_ex ax;
  if (ibv_query_device_ex(B.ctx, NULL, &ax)) return report("caps", false, "ibv_query_device_ex failed"), false;
  uint64_t f = ax.orig_attr.device_cap_flags | ax.device_cap_flags_ex;
  bool mw = f & IBV_DEVICE_MEM_WINDOW, t2a = f & IBV_DEVICE_MEM_WINDOW_TYPE_2A, t2b = f & IBV_DEVICE_MEM_WINDOW_TYPE_2B;
  printf("mw_probe: caps      %s: MEM_WINDOW %d TYPE_2A %d TYPE_2B %d max_mw %d max_qp_wr %d "
         "(device_cap_flags 0x%x, ex 0x%llx)\n",
         ibv_get_device_name(B.ctx->device), mw, t2a, t2b, ax.orig_attr.max_mw, ax.orig_attr.max_qp_wr,
         ax.orig_attr.device_cap_flags, (unsigned long long)ax.device_cap_flags_ex);
  return t2a || t2b;
}

static void check_outside(pair *p, struct ibv_mw *mw) {
  uint32_t rkey = bind_window(p, mw, "bind");
  if (!rkey) return;
  int s = write_through(p->a, rkey, baddr(WIN_OFF), WIN_LEN, 0xa1);
  report("bind", s == IBV_WC_SUCCESS && all_are(B.buf + WIN_OFF, WIN_LEN, 0xa1), "write inside the window: %s",
         st(s));
  memset(B.buf + WIN_OFF + WIN_LEN, 0x5a, 64);
  s = write_through(p->a, rkey, baddr(WIN_OFF + WIN_LEN - 8), 16, 0xb2);
  bool untouched = all_are(B.buf + WIN_OFF + WIN_LEN, 64, 0x5a);
  bounds = s == IBV_WC_REM_ACCESS_ERR && untouched;
  printf("mw_probe: outside   %s  write straddling the window's end: %s, bytes past the end %s\n",
         bounds ? "ok  " : "NOT ENFORCED", st(s), untouched ? "unchanged" : "CHANGED");
  if (s != IBV_WC_SUCCESS) reset_pair(p);
  memset(B.buf + 2 * WIN_OFF + WIN_LEN, 0x5a, 64);
  s = write_through(p->a, rkey, baddr(2 * WIN_OFF + WIN_LEN), 64, 0xb3);
  untouched = all_are(B.buf + 2 * WIN_OFF + WIN_LEN, 64, 0x5a);
  printf("mw_probe: away      %s  write wholly outside the window (inside the MR): %s, bytes %s\n",
         s == IBV_WC_REM_ACCESS_ERR && untouched ? "ok  " : "NOT ENFORCED", st(s), untouched ? "unchanged" : "CHANGED");
  if (s != IBV_WC_SUCCESS) reset_pair(p);
  s = write_through(p->a, rkey, baddr(BUF - 8), 16, 0xb4);
  report("pastmr", s == IBV_WC_REM_ACCESS_ERR, "write straddling the end of the MR: %s", st(s));
  /* A type 2 window holds the QP it is bound on: rxe's destroy_qp waits
   * (50 s) for it to go, so it goes first. */
  ibv_dealloc_mw(mw);
  reset_pair(p);
}

static void check_mr_rkey(pair *p) {
  int s = write_through(p->a, B.mr->rkey, baddr(0), 64, 0xc3);
  report("noncarry", s == IBV_WC_REM_ACCESS_ERR, "write through the MR's own rkey: %s", st(s));
  reset_pair(p);
}

static void check_other_qp(pair *p, struct ibv_mw *mw) {
  pair q = {0};
  uint32_t rkey = bind_window(p, mw, "otherqp");
  if (!rkey) return;
  if (pair_make(&q)) return report("otherqp", false, "cannot connect a second pair");
  int s = write_through(q.a, rkey, baddr(WIN_OFF), 64, 0xd4);
  report("otherqp", s == IBV_WC_REM_ACCESS_ERR, "write through a window bound on another QP: %s", st(s));
  pair_free(&q);
  drain(&A);
  s = write_through(p->a, rkey, baddr(WIN_OFF), 64, 0xd5);
  report("sameqp", s == IBV_WC_SUCCESS, "the same write on the QP it was bound on: %s", st(s));
}

static void check_local_inv(pair *p, struct ibv_mw *mw) {
  struct ibv_wc wc;
  uint32_t rkey = mw->rkey;
  int rc = post_inv(p->b, rkey, 8, true);
  if (rc || wait_wc(&B, 8, &wc) || wc.status != IBV_WC_SUCCESS)
    return report("localinv", false, "IBV_WR_LOCAL_INV: %s", rc ? strerror(rc) : ibv_wc_status_str(wc.status));
  int s = write_through(p->a, rkey, baddr(WIN_OFF), 64, 0xe5);
  report("localinv", s == IBV_WC_REM_ACCESS_ERR, "write after LOCAL_INV: %s", st(s));
  reset_pair(p);
  rkey = bind_window(p, mw, "rebind");
  if (!rkey) return;
  s = write_through(p->a, rkey, baddr(WIN_OFF), 64, 0xe6);
  report("rebind", s == IBV_WC_SUCCESS, "invalidated window bound again on a new QP, write: %s", st(s));
}

static void check_send_inv(pair *p, struct ibv_mw *mw) {
  struct ibv_wc wc;
  uint32_t rkey = mw->rkey;
  struct ibv_recv_wr rw = {.wr_id = 9}, *rbad;
  struct ibv_send_wr sw = {.wr_id = 10, .opcode = IBV_WR_SEND_WITH_INV, .send_flags = IBV_SEND_SIGNALED,
                           .invalidate_rkey = rkey},
                     *sbad;
  if (ibv_post_recv(p->b, &rw, &rbad) || ibv_post_send(p->a, &sw, &sbad))
    return report("sendinv", false, "posting the send with invalidate failed");
  if (wait_wc(&A, 10, &wc) || wc.status != IBV_WC_SUCCESS)
    return report("sendinv", false, "send with invalidate: %s", ibv_wc_status_str(wc.status));
  struct ibv_wc rwc;
  bool got = wait_wc(&B, 9, &rwc) == 0;
  int s = write_through(p->a, rkey, baddr(WIN_OFF), 64, 0xf6);
  report("sendinv", s == IBV_WC_REM_ACCESS_ERR, "write after SEND_WITH_INV: %s (receiver wc %s, flags 0x%x)", st(s),
         got ? ibv_wc_status_str(rwc.status) : "none", got ? rwc.wc_flags : 0);
  reset_pair(p);
}

static void check_dealloc(pair *p) {
  struct ibv_mw *mw = ibv_alloc_mw(B.pd, IBV_MW_TYPE_2);
  if (!mw) return report("dealloc", false, "ibv_alloc_mw: %s", strerror(errno));
  uint32_t rkey = bind_window(p, mw, "dealloc");
  if (!rkey) return;
  int rc = ibv_dealloc_mw(mw);
  if (rc) return report("dealloc", false, "ibv_dealloc_mw of a bound window: %s", strerror(rc));
  int s = write_through(p->a, rkey, baddr(WIN_OFF), 64, 0x17);
  report("dealloc", s == IBV_WC_REM_ACCESS_ERR, "write after ibv_dealloc_mw of the bound window: %s", st(s));
  reset_pair(p);
}

/* Binds n windows on one QP in chains of k, signalling each chain's last. */
static void rate(pair *p, int n) {
  struct ibv_mw **mw = calloc((size_t)n, sizeof(*mw));
  struct ibv_wc wc[64];
  double t0 = now_s();
  for (int i = 0; i < n; i++)
    if (!(mw[i] = ibv_alloc_mw(B.pd, IBV_MW_TYPE_2))) return report("rate", false, "alloc %d: %s", i, strerror(errno));
  double t1 = now_s();
  int posted = 0, done = 0, inflight = 0;
  while (done < n) {
    while (posted < n && inflight < (int)DEPTH - 1) {
      bool sig = (posted % 32) == 31 || posted == n - 1;
      uint64_t off = (uint64_t)(posted % 16) * 32768;
      int rc = post_bind(p->b, mw[posted], ibv_inc_rkey(mw[posted]->rkey), baddr(off), 32768, (uint64_t)posted, sig);
      if (rc) return report("rate", false, "bind %d: %s", posted, strerror(rc));
      posted++;
      inflight++;
    }
    int k = ibv_poll_cq(B.cq, 64, wc);
    for (int i = 0; i < k; i++) {
      if (wc[i].status != IBV_WC_SUCCESS) return report("rate", false, "bind wc %s", ibv_wc_status_str(wc[i].status));
      int upto = (int)wc[i].wr_id + 1;
      inflight -= upto - done;
      done = upto;
    }
  }
  double t2 = now_s();
  posted = done = inflight = 0;
  while (done < n) {
    while (posted < n && inflight < (int)DEPTH - 1) {
      bool sig = (posted % 32) == 31 || posted == n - 1;
      int rc = post_inv(p->b, ibv_inc_rkey(mw[posted]->rkey), (uint64_t)posted, sig);
      if (rc) return report("rate", false, "inv %d: %s", posted, strerror(rc));
      posted++;
      inflight++;
    }
    int k = ibv_poll_cq(B.cq, 64, wc);
    for (int i = 0; i < k; i++) {
      if (wc[i].status != IBV_WC_SUCCESS) return report("rate", false, "inv wc %s", ibv_wc_status_str(wc[i].status));
      int upto = (int)wc[i].wr_id + 1;
      inflight -= upto - done;
      done = upto;
    }
  }
  double t3 = now_s();
  for (int i = 0; i < n; i++) ibv_dealloc_mw(mw[i]);
  double t4 = now_s();
  free(mw);
  printf("mw_probe: rate      %d windows: alloc %.0f/s, bind %.0f/s, local_inv %.0f/s, dealloc %.0f/s\n", n,
         n / (t1 - t0), n / (t2 - t1), n / (t3 - t2), n / (t4 - t3));
}

int main(int argc, char **argv) {
  const char *da = getenv("NODE0_DEV") ? getenv("NODE0_DEV") : "rxe0";
  const char *db = getenv("NODE1_DEV") ? getenv("NODE1_DEV") : "rxe1";
  int n = argc > 2 && strcmp(argv[1], "-n") == 0 ? atoi(argv[2]) : 16384;
  t_start = now_s();
  pair p = {0};
  if (side_init(&A, da, IBV_ACCESS_LOCAL_WRITE) ||
      side_init(&B, db, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND) || pair_make(&p)) {
    fprintf(stderr, "mw_probe: setup failed (%s)\n", strerror(errno));
    return 1;
  }
  if (!caps()) {
    printf("mw_probe: %s has no type 2 memory windows\n", db);
    return 2;
  }
  struct ibv_mw *mw = ibv_alloc_mw(B.pd, IBV_MW_TYPE_2);
  if (!mw) return report("alloc", false, "ibv_alloc_mw(IBV_MW_TYPE_2): %s", strerror(errno)), 1;
  report("alloc", true, "ibv_alloc_mw(IBV_MW_TYPE_2) rkey 0x%x", mw->rkey);
  check_outside(&p, mw); /* deallocates mw */
  check_mr_rkey(&p);
  struct ibv_mw *mw2 = ibv_alloc_mw(B.pd, IBV_MW_TYPE_2);
  if (mw2) {
    check_other_qp(&p, mw2);
    check_local_inv(&p, mw2);
    check_send_inv(&p, mw2);
  }
  check_dealloc(&p);
  if (n > 0) rate(&p, n);
  printf("mw_probe: %d failure(s); window bounds %s\n", failures, bounds ? "enforced" : "NOT enforced");
  return failures ? 1 : bounds ? 0 : 3;
}
