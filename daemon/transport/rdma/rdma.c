/* rdma.c - the rdma transport: one-sided RDMA WRITE over reliable-connected
 * queue pairs, set up through librdmacm (rdma-core).
 *
 * Setup. At start each device (named by rdma-devices, or every active RoCE
 * port whose address matches ours) is opened through librdmacm's device list,
 * every pool is registered with it once (never on the transfer path), and a
 * CM listener is bound to the IP of the device's GID - never a wildcard, as
 * several daemons may share one host. The Hello carries, per device, that
 * address and port and one (addr, rkey) per pool. When a peer comes up, this
 * daemon dials rdma-qps-per-peer QPs from its device i to the peer's device
 * i (modulo the peer's count) and uses them only to write; the peer dials its
 * own QPs to us. The CM request's private data names both daemons' sessions:
 * the acceptor finds the peer by it (or parks the request until that peer's
 * Hello is in) and refuses stale incarnations.
 *
 * Data path. ops->post turns the coalesced runs into a ticket (runs cut at
 * rdma-slice) queued on the peer. One progress thread per device claims
 * chunks of runs from the queue for each of its QPs that has room, builds a
 * linked list of RDMA_WRITE work requests of which only the last is
 * signalled, and rings the doorbell once per list. QPs and devices take
 * chunks as fast as they finish theirs, which stripes a transfer over all of
 * them. The last run of a transfer is held back until every other write of
 * that transfer completed (on whatever QP or device) and then goes as
 * RDMA_WRITE_WITH_IMM carrying the low 32 bits of the grant handle: its
 * completion at the receiver proves that all the data is placed.
 *
 * Receiver. Accepted QPs keep zero-length receives posted; a WRITE_WITH_IMM
 * completion goes to the loop, which maps the 32-bit token to the open grant
 * (checking that it belongs to the peer of that QP) and calls
 * kvf__xfer_on_delivered.
 *
 * Threads. The progress threads own the QPs and CQs of their device (one CQ
 * per peer and device); after rdma-poll-us without work they sleep on the
 * device's completion channel. The loop owns the CM (its event channel is a
 * uv_poll), the peers and the grants. Threads hand results to the loop
 * through a queue and a uv_async; the loop hands links to a thread by
 * command and waits for the thread to let go of a link before destroying it.
 *
 * Failure. A work completion in error, a QP async error or a CM disconnect
 * on a dialed QP resets the peer's data path (reset_peer): every transfer in
 * flight to it ends with KVF_EPEERLOST at once, its QPs are rebuilt and later
 * transfers flow again, while the control connection stays (a daemon that is
 * gone is noticed there, and peer_down follows). Dialing is retried with
 * backoff; posts wait at most UNREADY_MS for a QP, and a peer whose QPs do
 * not connect within CONNECT_MS is failed (kvf__peer_fail). Accepted QPs only
 * carry the peer's completion notices: their failures are the peer's to
 * handle. peer_down detaches the peer's links from the threads, moves its
 * QPs to the error state (no more DMA from our pools), completes its
 * outstanding tickets with KVF_EPEERLOST and leaves the blocking destruction
 * of QPs, ids and CQs to a reaper thread. Writes that failed never release a
 * transfer's final WRITE_WITH_IMM. MRs belong to the pools and live until the
 * daemon exits.
 *
 * Note: a grant's memory is reachable through the pool's rkey for as long as
 * the pool is registered; grant_close stops completions from being accepted,
 * but a sender that has not yet seen the cancel may still be writing. */
#include "rdma.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include "auth.h"
#include "map.h"
#include "metrics.h"
#include "peer.h"
#include "pool.h"
#include "rdma_mw.h"
#include "xfer.h"
#ifdef KVF_FAILPOINTS
#include "failpoint.h"
#endif

#define MAX_DEVS 8
#define MAX_QPS 128             /* per link: dialed and accepted */
#define CHAIN_MAX 32            /* work requests per ibv_post_send (one doorbell) */
#define QP_WINDOW (4u << 20)    /* bytes in flight per QP before it claims more: a
                                   transfer spreads over every QP and device
                                   instead of filling the first send queue */
#define CQ_BATCH 32
#define RESOLVE_MS 1000          /* address and route resolution; retried (REDIAL_MS) */
#define CONNECT_MS 15000        /* else the peer is failed (last resort) */
#define UNREADY_MS 2000         /* posts wait this long for a QP, then fail */
#define ACK_TIMEOUT 14          /* 4.096 us << 14 = 67 ms per try: with 6 retries a
                                   dead path errors the QP in about half a second */
#define RETRY_COUNT 6             /* not 7: rxe (like the RNR count) reads 7 as infinite */
#define REDIAL_MS 250             /* first retry of a dialed QP that did not connect */
#define RNR_RETRY 7             /* infinite: a receiver short of receives slows us */
#define PARK_MS 5000            /* how long a CM request may wait for its peer */
#define PRIV_MAGIC 0x5246564bu  /* "KVFR" */
#define PRIV_VERSION 1
#define PRIV_LEN 24
/* With a cluster key the request also carries 16 bytes of the sender's
 * proof (auth.h): 40 of the 56 bytes of private data RDMA_PS_TCP leaves. */
#define PRIV_AUTH_LEN (PRIV_LEN + KVF__AUTH_RDMA_PROOF)
#define INFO_VERSION 1
#define TAG_RECV UINT64_MAX     /* wr_id of every receive */
#define CAP_IPC_LOCK_BIT 14

/* ------------------------------------------------------------ types */

enum ev_kind { EV_TICKET = 1, EV_IMM, EV_FAIL };

typedef struct rdma_transport rdma_transport;

/* Thread -> loop, through the instance's mailbox. */
typedef struct tevent {
  kvf__mail mail;               /* first member */
  rdma_transport *rt;
  int kind;
  kvf__peer *peer;
  uint64_t gen;
  uint32_t imm;
  char why[160];
} tevent;

typedef struct rdev rdev;
typedef struct rpeer rpeer;
typedef struct rlink rlink;
typedef struct rqp rqp;
typedef struct xstate xstate;

/* Memory windows, sender side: the body runs of a ticket that go through
 * windows bound on one QP (a type 2 window takes writes only from there). */
typedef struct lane {
  rqp *q;                       /* compared, never followed, by the threads */
  size_t next, end;             /* order[next..end) not yet claimed (qlock) */
} lane;

/* One ops->post call. Its parts: n_body plain writes and, for the last post
 * of a transfer, the tail. It is called back once every part is done. */
typedef struct ticket {
  tevent ev;                    /* EV_TICKET; first member */
  struct ticket *next_q;        /* the peer's body or tail queue (qlock) */
  struct ticket *prev_live, *next_live; /* tickets not yet called back (loop) */
  kvf__xfer *x;
  xstate *xs;
  rpeer *rp;                    /* NULL once the peer is gone (loop) */
  kvf__run *runs;               /* owned; each at most rdma-slice */
  size_t n_runs;
  size_t n_body;                /* runs[0..n_body) are plain writes */
  size_t next;                  /* next body run to claim (qlock) */
  bool last, has_tail;
  kvf__run tail;                /* WRITE_WITH_IMM; len 0 when the post had no run */
  uint32_t imm;
  /* Memory windows (the grant has them): each run's rkey is its window's
   * (rkeys, by run); body runs are claimed lane by lane through order
   * (indices into runs; NULL when there is one lane: runs as they are);
   * the tail goes on its window's QP. */
  uint32_t *rkeys;
  uint32_t *order;
  lane *lanes;
  size_t n_lanes;
  size_t left;                  /* lanes: body runs not yet claimed (qlock) */
  uint32_t tail_rkey;
  rqp *tail_q;                  /* NULL: any QP */
  rdev *tail_dev;               /* its device, to wake */
  uint32_t tail_qpn;            /* tail_q, by number and device index */
  uint16_t tail_devi;
  size_t total;                 /* n_body + has_tail */
  atomic_size_t done;
  atomic_int status;
  atomic_uint_fast64_t build_ns, bell_ns, wrs;
  uint64_t loop_ns;
} ticket;

#define MAX_LANES 256

/* A Grant's memory windows as the sender looks them up: decoded once per
 * transfer, however many posts (a chained send's frames) it takes. */
typedef struct wtable {
  const uint8_t *of;            /* Grant.window_of (x->tp_grant): each descriptor's window */
  size_t of_len;
  kvf__mw_rec *v;
  uint32_t *lane;               /* per record: its (device, QP) lane */
  size_t n, nl;
  size_t first[MAX_LANES];      /* per lane: a record naming it */
} wtable;

/* Per transfer (x->tp_state), from its first post until xfer_done. */
struct xstate {
  atomic_long pending;          /* body writes handed over, not yet completed */
  _Atomic(ticket *) tail;       /* the last part, waiting for pending == 0 */
  unsigned out;                 /* tickets not yet called back (loop) */
  wtable *wt;                   /* the Grant's windows, once a post needed them */
  uint64_t wrs, loop_ns, build_ns, bell_ns; /* posting cost, summed over its tickets (loop) */
};

typedef struct inflight {       /* one posted chain */
  ticket *tk;
  uint64_t seq;                 /* wr_id of its last, signalled, work request */
  uint32_t wrs;                 /* send queue slots it holds */
  uint32_t runs;                /* body runs it completes */
  bool tail;
  uint64_t bytes;
} inflight;

struct rqp {
  rlink *lk;
  struct rdma_cm_id *id;
  struct ibv_qp *qp;            /* NULL until created */
  uint32_t qp_num;
  bool outbound;
  bool established;             /* loop */
  bool gone;                    /* loop: failed and replaced or dropped; inert until the link goes */
  atomic_bool ready;            /* dialed and established: the thread may post */
  /* memory windows, accepted QPs (loop): binds go on their send queue */
  int peer_dev;                 /* the dialing device, by index in the peer's Hello; -1 unknown */
  uint32_t remote_qpn;          /* the dialing QP */
  uint32_t bind_cap, bind_used; /* send queue slots for binds */
  /* progress thread only, once published */
  bool dead;
  uint32_t max_inline;
  uint32_t sq_cap, sq_used;
  uint64_t bytes_out;           /* in flight */
  uint32_t rq_cap, rq_posted;
  uint64_t seq;
  inflight *ring;
  uint32_t ring_head, ring_n;
  struct ibv_send_wr wr[CHAIN_MAX];
  struct ibv_sge sge[CHAIN_MAX];
};

/* A peer on one of our devices: its CQ and QPs. */
struct rlink {
  rlink *next;                  /* the device thread's list */
  rpeer *rp;
  rdev *dev;
  char peer_dev[64];
  struct sockaddr_storage dst;  /* the peer device's CM address */
  struct ibv_cq *cq;
  struct ibv_cq *bcq;           /* memory windows: the accepted QPs' binds (loop only) */
  unsigned binds_out;           /* bind chains in flight on bcq */
  uint32_t depth;
  uint64_t *raddr;              /* per peer pool, on the peer device */
  uint32_t *rkey;
  size_t n_rpools;
  unsigned n_out;
  unsigned n_ready;             /* dialed QPs established (loop) */
  unsigned redial;              /* dialed QPs to try again (loop) */
  uint32_t redial_ms;
  uint64_t redial_at;
  rqp *all[MAX_QPS];            /* every QP, for teardown (loop) */
  unsigned n_all;
  _Atomic(rqp *) qps[MAX_QPS];  /* those the thread may touch */
  atomic_uint n_qps;
  bool attached;
  bool detached;                /* the thread let go (dev->lock) */
  bool cq_failed;               /* thread */
};

struct rpeer {
  rdma_transport *rt;
  kvf__peer *p;
  uint64_t gen;
  uint64_t session;             /* the peer's, from its Hello */
  rlink *links[MAX_DEVS];
  int n_links;
  pthread_mutex_t qlock;
  ticket *qhead, *qtail;        /* body work, in post order */
  ticket *thead, *ttail;        /* tails cleared to go */
  atomic_uint queued;           /* tickets in either queue */
  uint64_t *pool_size;          /* the peer's pools, by id */
  size_t n_pools;
  bool gpu_pools;                /* the peer has cuda pools (path rdma-gdr) */
  bool *pool_gpu;
  uint64_t up_ns;               /* the current set of QPs was dialed */
  bool said_ready;
  bool degraded;                /* said that some links stay down */
  unsigned resets;
};

typedef struct cmd {
  struct cmd *next;
  int kind;
  rlink *lk;
} cmd;
enum { CMD_ATTACH = 1, CMD_DETACH, CMD_STOP };

struct rdev {
  rdma_transport *rt;
  int index;
  char name[64];
  uint8_t port;
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_comp_channel *ch;
  struct ibv_mr **mrs;          /* per pool */
  uint32_t *lkey;
  union ibv_gid gid;
  uint32_t gid_index;
  struct sockaddr_storage addr; /* the GID's address: CM listener and source */
  char ip[INET6_ADDRSTRLEN];
  uint16_t cm_port;
  struct rdma_cm_id *listener;
  uint32_t max_cqe, max_qp_wr;
  bool mw2;                     /* type 2 memory windows */
  int mw_bounds;                /* enum kvf__mw_bounds, from the start check */
  char mw_check[160];           /* what the check saw */
  uv_poll_t async_poll;
  bool async_on;
  pthread_t thr;
  bool started;
  int efd, epfd;
  pthread_mutex_t lock;         /* cmds, link->detached */
  pthread_cond_t cond;
  cmd *cmds, *cmds_tail;
  rlink *links;                 /* thread only */
  atomic_uint_fast64_t wrs, bytes, chains, imms, cqes, build_ns, bell_ns, sleeps;
};

typedef struct bchain bchain;

typedef struct rgrant {
  rdma_transport *rt;
  kvf__xfer *x;
  kvf__peer *peer;
  /* memory windows (loop): one per planned range, bound round-robin on
   * the peer's accepted QPs */
  kvf__range *win;
  size_t n_win;
  struct ibv_mw **mw;
  rqp **qs;                     /* while binding: the QPs, NULL once lost */
  size_t nq;
  size_t *cur;                  /* per QP: its next window (i = j, j + nq, ...) */
  size_t posted;
  unsigned chains_out;
  bchain *chains;
  int status;
  bool binding, closed;
  bool restart;                 /* a QP failed under the binds: start over */
  unsigned tries;
  uint64_t since_ns;
  struct rgrant *next_b;        /* rt->binding, or rt->zombies once closed */
} rgrant;

/* Bind work requests posted in one call; the last one's wr_id. */
struct bchain {
  bchain *next;
  rgrant *g;
  rqp *q;
  uint32_t n;
};

typedef struct parked {         /* a CM request whose peer is not up yet */
  struct parked *next;
  struct rdma_cm_id *id;
  rdev *dev;
  uint64_t session;
  uint64_t since_ns;
} parked;

/* What the loop needs of a CM event after it is acked. */
typedef struct cm_ev {
  enum rdma_cm_event_type type;
  struct rdma_cm_id *id;
  void *ctx;                    /* id->context, read before the ack */
  int status;
  uint8_t priv[PRIV_AUTH_LEN];
  size_t priv_len;
} cm_ev;

struct rdma_transport {
  kvf__transport base;
  rdev devs[MAX_DEVS];
  int n_devs;
  struct ibv_context **all;
  struct rdma_event_channel *cm;
  uv_poll_t cm_poll;
  kvf__mailbox mb;              /* threads -> loop: tevents, tickets */
  uv_timer_t sweep;
  bool handles;
  unsigned closing;             /* handles whose close callback is still due */
  rpeer *peers[KVF__MAX_PEERS_CFG]; /* every peer up, for the sweeps (each also in its peer's slot) */
  size_t n_peers;
  kvf__map grants;              /* "%08x" token -> rgrant */
  parked *parked;
  ticket *live;
  uint64_t gen;
  uint8_t **pool_base;          /* pool memory, by pool id */
  bool any_gpu;                 /* some pool of ours is GPU memory */
  /* The reaper destroys dead links' QPs, ids and CQs: with the path gone
   * rdma_destroy_id can block for seconds, which the loop must not. */
  pthread_t reaper;
  bool reaper_on, reaper_stop;
  pthread_mutex_t reap_lock;
  pthread_cond_t reap_cond;
  rlink *reap_head;
  Kvf__RdmaInfo info;
  Kvf__RdmaDevice hdev[MAX_DEVS];
  Kvf__RdmaDevice *hdev_ptr[MAX_DEVS];
  Kvf__RdmaMr *hmr;
  Kvf__RdmaMr **hmr_ptr;
  /* loop-side counters of the posting cost */
  uint64_t posts, post_runs, post_ns;
  /* the last finished transfer's posting cost, summed over its tickets
   * (a chained send posts one per frame) */
  uint64_t last_wrs, last_loop_ns, last_build_ns, last_bell_ns;
  /* memory windows (loop) */
  bool mw;                      /* in use: pools take no remote writes but through them */
  char mw_why[200];             /* why not, when not */
  char protection[400];         /* one line for status, doctor and the log */
  rgrant *binding;              /* grants whose windows are being bound */
  rgrant *zombies;              /* closed grants with binds still in flight */
  uv_timer_t mw_timer;
  bool mw_timer_on;
  uint64_t mw_live, mw_bound, mw_grants, mw_merged, mw_failed, mw_bind_ns;
  uint64_t mw_lookups, mw_searches;  /* sender: runs' windows looked up; of those, not by window_of */
  size_t last_win;
  uint64_t last_bind_ns;
};

static rdma_transport *to_rdma(kvf__transport *t) { return kvf__container_of(t, rdma_transport, base); }

static void fail_peer_soon(rpeer *rp, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void reset_peer(rpeer *rp, const char *why);
static void relisten(rdev *d);
static int start_listener(rdev *d, uint16_t port, char *err, size_t errlen);

/* ------------------------------------------------------------ helpers */

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

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

static void calibrate_clock(void) {
#if defined(__x86_64__) || defined(__i386__)
  uint64_t t0 = mono_ns(), c0 = __rdtsc();
  struct timespec nap = {0, 20 * 1000000L};
  nanosleep(&nap, NULL);
  uint64_t t1 = mono_ns(), c1 = __rdtsc();
  if (c1 > c0) ns_per_tick = (double)(t1 - t0) / (double)(c1 - c0);
#endif
}

static int set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  return fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 ? -errno : 0;
}

static const char *peer_name(const rpeer *rp) { return rp->p->cfg.name; }

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get_u64(const uint8_t *p) {
  return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32;
}

static void addr_text(const struct sockaddr_storage *ss, char *buf, size_t len) {
  const void *a = ss->ss_family == AF_INET6 ? (const void *)&((const struct sockaddr_in6 *)ss)->sin6_addr
                                            : (const void *)&((const struct sockaddr_in *)ss)->sin_addr;
  if (!inet_ntop(ss->ss_family, a, buf, (socklen_t)len)) snprintf(buf, len, "?");
}

static void set_port(struct sockaddr_storage *ss, uint16_t port) {
  if (ss->ss_family == AF_INET6) ((struct sockaddr_in6 *)ss)->sin6_port = htons(port);
  else ((struct sockaddr_in *)ss)->sin_port = htons(port);
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
static void fail_peer_soon(rpeer *rp, const char *fmt, ...) {
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
static void credit(ticket *tk, size_t k, int status) {
  if (k == 0) return;
  if (status) {
    int zero = 0;
    atomic_compare_exchange_strong(&tk->status, &zero, status);
  }
  if (atomic_fetch_add(&tk->done, k) + k == tk->total) push_event(&tk->ev);
}

static void wake(rdev *d) {
  uint64_t one = 1;
  ssize_t w = write(d->efd, &one, sizeof(one));
  (void)w; /* a full counter already wakes the thread */
}

static void wake_peer(rpeer *rp) {
  for (int i = 0; i < rp->n_links; i++) wake(rp->links[i]->dev);
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
  if (only) wake(only); /* its QP's thread may be asleep */
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

static void ring_push(rqp *q, ticket *tk, uint32_t wrs, uint32_t runs, bool tail, uint64_t bytes) {
  uint32_t i = (q->ring_head + q->ring_n) % q->sq_cap;
  q->ring[i] = (inflight){tk, q->seq, wrs, runs, tail, bytes};
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
    if (f.runs) body_done(f.tk->xs, lk->rp, f.runs);
    credit(f.tk, f.runs + f.tail, 0);
  }
}

/* Everything in flight on q is lost. */
static void flush_ring(rqp *q, int status) {
  while (q->ring_n) {
    inflight f = ring_pop(q);
    credit(f.tk, f.runs + f.tail, status);
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
    fail_peer_soon(lk->rp, "rdma: QP %u (%s -> %s %s) failed: %s", q->qp_num, lk->dev->name,
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
  credit(f.tk, f.runs + f.tail, KVF_EPERM);
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
static int post_recvs(rqp *q, uint32_t n) {
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
    int rc = post_recvs(q, q->rq_cap - q->rq_posted);
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
    fail_peer_soon(lk->rp, "rdma: polling the CQ of %s on %s failed", peer_name(lk->rp), lk->dev->name);
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
    *cnt = end - *next < room ? end - *next : room;
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

/* The QP's chain of work requests is linked and typed once (RDMA WRITE,
 * one SGE each); building a chain then writes only what differs per run. */
static void init_chain(rqp *q) {
  for (size_t i = 0; i < CHAIN_MAX; i++)
    q->wr[i] = (struct ibv_send_wr){.next = i + 1 < CHAIN_MAX ? &q->wr[i + 1] : NULL,
                                    .sg_list = &q->sge[i],
                                    .num_sge = 1,
                                    .opcode = IBV_WR_RDMA_WRITE};
}

/* The chain of runs[first..first + n), or with order of runs[order[first..
 * first + n)]. rkeys: per run, when the grant has memory windows; else
 * the pools'. */
static uint64_t build_chain(rlink *lk, rqp *q, const kvf__run *runs, const uint32_t *order, size_t first, size_t n,
                            const uint32_t *rkeys) {
  /* Runs of a chain nearly always share their pools: keep the last pool's
   * keys and bases at hand instead of looking them up per run. */
  const kvf__run *r = &runs[order ? order[first] : first];
  uint32_t sp = r->src_pool, dp = r->dst_pool, lkey = lk->dev->lkey[sp], rkey = lk->rkey[dp];
  uint8_t *const *pool_base = lk->rp->rt->pool_base;
  uintptr_t base = (uintptr_t)pool_base[sp];
  uint64_t raddr = lk->raddr[dp], bytes = 0;
  uint32_t max_inline = q->max_inline;
  for (size_t i = 0; i < n; i++) {
    size_t j = order ? order[first + i] : first + i;
    r = &runs[j];
    if (r->src_pool != sp) {
      sp = r->src_pool;
      lkey = lk->dev->lkey[sp];
      base = (uintptr_t)pool_base[sp];
    }
    if (r->dst_pool != dp) {
      dp = r->dst_pool;
      rkey = lk->rkey[dp];
      raddr = lk->raddr[dp];
    }
    struct ibv_sge *s = &q->sge[i];
    struct ibv_send_wr *w = &q->wr[i];
    s->addr = base + r->src_off;
    s->length = (uint32_t)r->len;
    s->lkey = lkey;
    w->send_flags = r->len <= max_inline ? IBV_SEND_INLINE : 0;
    w->wr.rdma.remote_addr = raddr + r->dst_off;
    w->wr.rdma.rkey = rkeys ? rkeys[j] : rkey;
    bytes += r->len;
  }
  q->wr[n - 1].next = NULL;
  return bytes;
}

/* Puts back what a posted chain changed in the template. */
static void restore_chain(rqp *q, size_t n) {
  struct ibv_send_wr *last = &q->wr[n - 1];
  last->next = n < CHAIN_MAX ? last + 1 : NULL;
  last->wr_id = 0;
  q->wr[0].opcode = IBV_WR_RDMA_WRITE;
  q->wr[0].num_sge = 1;
  q->wr[0].imm_data = 0;
}

static void account(rdev *d, ticket *tk, uint64_t wrs, uint64_t bytes, uint64_t build, uint64_t bell) {
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
static int ring_doorbell(rlink *lk, rqp *q, ticket *tk, size_t n, uint32_t runs, bool tail,
                         uint64_t t0, uint64_t bytes) {
  struct ibv_send_wr *last = &q->wr[n - 1], *bad = NULL;
  last->send_flags |= IBV_SEND_SIGNALED;
  last->wr_id = ++q->seq;
  uint64_t t1 = fast_ns();
  int rc = ibv_post_send(q->qp, q->wr, &bad);
  account(lk->dev, tk, n, bytes, t1 - t0, fast_ns() - t1);
  restore_chain(q, n);
  if (rc) {
    credit(tk, runs + tail, KVF_EPEERLOST);
    qp_failed(lk, q, strerror(rc));
    return -rc;
  }
  ring_push(q, tk, (uint32_t)n, runs, tail, bytes);
  return 0;
}

static int post_chunk(rlink *lk, rqp *q, ticket *tk, size_t first, size_t cnt) {
  uint64_t t0 = fast_ns();
  uint64_t bytes = build_chain(lk, q, tk->runs, tk->order, first, cnt, tk->rkeys);
  return ring_doorbell(lk, q, tk, cnt, (uint32_t)cnt, false, t0, bytes);
}

/* The transfer's last write, with the token of the receiver's grant. */
static int post_tail(rlink *lk, rqp *q, ticket *tk) {
  uint64_t t0 = fast_ns();
  struct ibv_send_wr *w = &q->wr[0];
  if (tk->tail.len) {
    build_chain(lk, q, &tk->tail, NULL, 0, 1, tk->rkeys ? &tk->tail_rkey : NULL);
  } else { /* nothing left to write: a zero-length write carries the notice */
    w->next = NULL;
    w->num_sge = 0;
    w->send_flags = 0;
    w->wr.rdma.remote_addr = lk->n_rpools ? lk->raddr[0] : 0;
    w->wr.rdma.rkey = lk->n_rpools ? lk->rkey[0] : 0;
  }
  w->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  w->imm_data = htonl(tk->imm);
  return ring_doorbell(lk, q, tk, 1, 0, true, t0, tk->tail.len);
}

static bool pump_qp(rlink *lk, rqp *q) {
  bool any = false;
  while (!q->dead && q->sq_used < q->sq_cap && q->bytes_out < QP_WINDOW) {
    size_t first = 0, cnt = 0;
    bool tail = false;
    ticket *tk = claim(lk->rp, q, q->sq_cap - q->sq_used, &first, &cnt, &tail);
    if (!tk) break;
    if (tail) post_tail(lk, q, tk);
    else post_chunk(lk, q, tk, first, cnt);
    any = true;
  }
  return any;
}

static bool pump_link(rlink *lk) {
  bool any = false;
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

static void *progress_main(void *arg) {
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
    if (kvfd.cfg.busy_poll || (spin_ns && fast_ns() - idle < spin_ns)) continue;
    sleep_until_work(d);
    idle = spin_ns ? fast_ns() : 0;
  }
  return NULL;
}

static void send_cmd(rdev *d, int kind, rlink *lk) {
  cmd *c = calloc(1, sizeof(*c));
  if (!c) abort(); /* a lost detach would leave a thread on freed memory */
  c->kind = kind;
  c->lk = lk;
  pthread_mutex_lock(&d->lock);
  if (d->cmds_tail) d->cmds_tail->next = c;
  else d->cmds = c;
  d->cmds_tail = c;
  pthread_mutex_unlock(&d->lock);
  wake(d);
}

/* Returns once the device thread no longer touches lk. */
static void detach_and_wait(rlink *lk) {
  rdev *d = lk->dev;
  send_cmd(d, CMD_DETACH, lk);
  pthread_mutex_lock(&d->lock);
  while (!lk->detached) pthread_cond_wait(&d->cond, &d->lock);
  pthread_mutex_unlock(&d->lock);
  lk->attached = false;
}

/* ------------------------------------------------------------ the loop: posting */

/* The peer's state: in its slot for this transport (NULL: not up here). */
static rpeer *rpeer_of(rdma_transport *rt, const kvf__peer *p) { return kvf__transport_peer(&rt->base, p); }

/* Every run must land inside a pool the peer announced and come from one of
 * ours (all registered). *extra gets how many more runs slicing makes. */
static int check_runs(const rpeer *rp, const kvf__runs *runs, size_t *extra) {
  uint64_t slice = kvfd.cfg.rdma_slice;
  *extra = 0;
  for (size_t i = 0; i < runs->n; i++) {
    const kvf__run *r = &runs->v[i];
    if (r->src_pool >= kvfd.n_pools || r->dst_pool >= rp->n_pools) return KVF_ENOPOOL;
    uint64_t size = rp->pool_size[r->dst_pool];
    if (r->len == 0 || r->dst_off > size || r->len > size - r->dst_off) return KVF_ERANGE;
    if (r->len > slice) *extra += (size_t)((r->len - 1) / slice);
  }
  return 0;
}

/* GPUDirect: the NIC reads or writes GPU memory on either end. */
static bool runs_touch_gpu(const rpeer *rp, const kvf__runs *runs) {
  for (size_t i = 0; i < runs->n; i++)
    if (kvf__pool_gpu(kvfd.pools[runs->v[i].src_pool]) || rp->pool_gpu[runs->v[i].dst_pool]) return true;
  return false;
}

/* Takes the runs (no copy) or, when some exceed rdma-slice (extra more
 * runs), a sliced copy. */
static int take_runs(ticket *tk, kvf__runs *runs, size_t extra) {
  uint64_t slice = kvfd.cfg.rdma_slice;
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

static ticket *ticket_new(rdma_transport *rt, kvf__xfer *x, kvf__runs *runs, size_t extra, bool last) {
  ticket *tk = calloc(1, sizeof(*tk));
  if (!tk || take_runs(tk, runs, extra) != 0) {
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
  return tk;
}

/* ---- memory windows, sender side */

/* Our QP that a window's record names (its receiving end holds it). */
static rqp *window_qp(const rpeer *rp, const kvf__mw_rec *w) {
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

static void wtable_free(wtable *t) {
  if (!t) return;
  free(t->v);
  free(t->lane);
  free(t);
}

/* Decodes a Grant's windows, each with its lane: a (device, QP) of the
 * records; few. */
static int wtable_decode(const kvf__xfer *x, wtable **out) {
  if (kvf__mw_recs_check(x->tp_grant.win, x->tp_grant.win_len) != 0) return KVF_EPROTO;
  wtable *t = calloc(1, sizeof(*t));
  if (!t) return -ENOMEM;
  t->n = x->tp_grant.win_len / KVF__MW_REC;
  t->of = x->tp_grant.of;
  t->of_len = x->tp_grant.of_len;
  t->v = malloc((t->n ? t->n : 1) * sizeof(*t->v));
  t->lane = malloc((t->n ? t->n : 1) * sizeof(*t->lane));
  if (!t->v || !t->lane) {
    wtable_free(t);
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
  for (size_t l = 0; l < wp->t->nl; l++) wp->qs[l] = window_qp(rp, &wp->t->v[wp->t->first[l]]);
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
static int ticket_windows(ticket *tk, const rpeer *rp, const kvf__xfer *x, xstate *xs) {
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
    rp->rt->mw_lookups += nb + (tk->has_tail && tk->tail.len);
    rp->rt->mw_searches += t.searched;
  }
  free(lane_of);
  return rc; /* on failure the caller frees the ticket, with what was made here */
}

static void ticket_free(ticket *tk) {
  free(tk->runs);
  free(tk->rkeys);
  free(tk->order);
  free(tk->lanes);
  free(tk);
}

static xstate *xstate_of(kvf__xfer *x) {
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

static int rdma_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) {
  uint64_t t0 = thread_cpu_ns();
  rdma_transport *rt = to_rdma(t);
  rpeer *rp = x->peer ? rpeer_of(rt, x->peer) : NULL;
  if (!rp) return KVF_EPEERLOST;
  size_t extra = 0;
  int rc = check_runs(rp, runs, &extra);
  if (rc) return rc;
  if (!x->path && (rt->any_gpu || rp->gpu_pools) && runs_touch_gpu(rp, runs)) x->path = "rdma-gdr";
  size_t n = runs->n;
  xstate *xs = xstate_of(x);
  ticket *tk = xs ? ticket_new(rt, x, runs, extra, last) : NULL;
  rc = tk ? 0 : -ENOMEM;
  if (tk && x->tp_grant.win_len && (rc = ticket_windows(tk, rp, x, xs)) != 0) {
    ticket_free(tk);
    tk = NULL;
  }
  if (!tk) return rc; /* xs, if made, goes with the transfer (rdma_xfer_done) */
  tk->xs = xs;
  tk->rp = rp;
  xs->out++;
  live_link(tk);
  hand_over(rp, xs, tk);
  tk->loop_ns = thread_cpu_ns() - t0;
  rt->posts++;
  rt->post_runs += n;
  rt->post_ns += tk->loop_ns;
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
static size_t take_back(rpeer *rp, ticket *tk) {
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
static void rdma_abort(kvf__transport *t, kvf__xfer *x) {
  rdma_transport *rt = to_rdma(t);
  rpeer *rp = x->peer ? rpeer_of(rt, x->peer) : NULL;
  const xstate *xs = x->tp_state;
  if (!rp || !xs || xs->out == 0) return;
  pthread_mutex_lock(&rp->qlock);
  for (ticket *tk = rt->live; tk; tk = tk->next_live)
    if (tk->x == x && tk->rp == rp) credit(tk, take_back(rp, tk), KVF_ECANCELED);
  pthread_mutex_unlock(&rp->qlock);
}

/* The transfer is gone and every ticket of it called back. */
static void rdma_xfer_done(kvf__transport *t, kvf__xfer *x) {
  xstate *xs = x->tp_state;
  if (!xs) return;
  wtable_free(xs->wt);
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
  rqp *q = rp ? window_qp(rp, &l->w) : NULL;
  ticket *tk = q ? calloc(1, sizeof(*tk)) : NULL;
  xstate *xs = tk ? calloc(1, sizeof(*xs)) : NULL;
  if (tk) tk->runs = malloc(sizeof(*tk->runs));
  if (tk) tk->rkeys = malloc(sizeof(*tk->rkeys));
  if (tk) tk->lanes = malloc(sizeof(*tk->lanes));
  if (!xs || !tk->runs || !tk->rkeys || !tk->lanes) {
    kvf__warn("failpoint late-write: the window's QP is gone; not written");
    if (tk) ticket_free(tk);
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
    ticket_free(tk);
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
    rt->last_wrs = xs->wrs;
    rt->last_loop_ns = xs->loop_ns;
    rt->last_build_ns = xs->build_ns;
    rt->last_bell_ns = xs->bell_ns;
    kvf__debug("rdma: %s: %llu work requests; posting cost per request: %.0f ns on the loop, "
               "%.0f ns building, %.0f ns in ibv_post_send",
               x->id, (unsigned long long)rt->last_wrs, (double)rt->last_loop_ns / (double)rt->last_wrs,
               (double)rt->last_build_ns / (double)rt->last_wrs, (double)rt->last_bell_ns / (double)rt->last_wrs);
  }
  ticket_free(tk);
  xs->out--;
  kvf__xfer_on_posted(x, st == KVF_ECANCELED ? 0 : st, last);
}

static void grant_key(char *buf, size_t len, uint32_t token) { snprintf(buf, len, "%08x", token); }

static void on_imm(const tevent *e) {
  rpeer *rp = rpeer_of(e->rt, e->peer);
  char key[16];
  if (!rp || rp->gen != e->gen) return;
  grant_key(key, sizeof(key), e->imm);
  rgrant *g = kvf__map_get(&e->rt->grants, key);
  if (!g || g->peer != e->peer) {
    kvf__debug("rdma: completion notice %08x from %s matches no open grant", e->imm, peer_name(rp));
    return;
  }
  kvf__xfer_on_delivered(g->x);
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
    if (rp && rp->gen == e->gen) reset_peer(rp, e->why);
    break;
  }
  free(e);
}


/* ------------------------------------------------------------ memory windows: binding
 *
 * With memory windows (rt->mw) a grant is opened asynchronously: its
 * destination ranges (merged, at most rdma-mw-max-windows) each get a type 2
 * window, bound round-robin on the peer's accepted QPs of every device (a
 * type 2 window takes writes only through the QP it is bound on, and the
 * sender writes through its end of that QP). The loop owns it all: binds go
 * on the accepted QPs' send queues, whose completions land in a CQ of their
 * own (lk->bcq) that only the loop polls (mw_timer, every millisecond while
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
  if (rt->mw_timer_on || (!rt->binding && !rt->zombies)) return;
  uv_timer_start(&rt->mw_timer, on_mw_timer, 0, 1);
  rt->mw_timer_on = true;
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

static void bind_reset(rgrant *g) {
  for (size_t i = 0; g->mw && i < g->n_win; i++)
    if (g->mw[i]) {
      ibv_dealloc_mw(g->mw[i]);
      g->rt->mw_live--;
    }
  free(g->mw);
  free(g->qs);
  free(g->cur);
  g->mw = NULL;
  g->qs = NULL;
  g->cur = NULL;
  g->nq = 0;
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
    g->rt->mw_live++;
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
 * they are bound on go: mw_forget_link). */
static void bind_done(rgrant *g) {
  rdma_transport *rt = g->rt;
  unlist(&rt->binding, g);
  g->binding = false;
  free(g->cur);
  g->cur = NULL;
  if (g->status) {
    rt->mw_failed++;
  } else {
    uint64_t ns = kvf__now_ns() - g->since_ns;
    rt->mw_bound += g->n_win;
    rt->mw_bind_ns += ns;
    rt->last_win = g->n_win;
    rt->last_bind_ns = ns;
    kvf__debug("rdma: %s: %zu memory windows bound in %.1f ms", g->x->id, g->n_win, (double)ns / 1e6);
  }
}

static void reap_zombies(rdma_transport *rt) {
  for (rgrant *g = rt->zombies, *next; g; g = next) {
    next = g->next_b;
    if (g->chains_out) continue;
    unlist(&rt->zombies, g);
    free(g);
  }
}

/* Every millisecond while binds are in flight. A grant's callback may
 * close any grant (the peer may fail), so after each the scan restarts. */
static void on_mw_timer(uv_timer_t *tm) {
  rdma_transport *rt = kvf__container_of(tm, rdma_transport, mw_timer);
  poll_all_binds(rt);
  reap_zombies(rt);
  bool pumped = false;
  for (rgrant *g = rt->binding; g; g = g->next_b) {
    if (g->restart && !g->chains_out && !g->status) bind_reset(g);
    if (!g->qs && !g->status) bind_start(g);
    if (g->qs && !g->status && !g->restart) {
      bind_pump(g);
      pumped = true;
    }
  }
  if (pumped) poll_all_binds(rt); /* binds the device completed as they were posted (rxe does) */
  for (;;) {
    rgrant *g = rt->binding;
    while (g && !bind_finished(g)) g = g->next_b;
    if (!g) break;
    bind_done(g);
    kvf__xfer_on_grant_ready(g->x, g->status, g->status ? "binding the grant's memory windows failed" : NULL);
  }
  if (!rt->binding && !rt->zombies) {
    uv_timer_stop(&rt->mw_timer);
    rt->mw_timer_on = false;
  }
}

/* Room for the Grant's window records and each descriptor's window. */
static int grant_part_alloc(kvf__tp_grant *t, size_t n_win, size_t n_desc) {
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
  size_t ranges = rs.n;
  kvf__rangeset_free(&rs);
  if (rc == 0 && g->n_win == 0) rc = KVF_EINVAL;
  if (rc == 0) rc = grant_part_alloc(&x->tp_grant, g->n_win, x->dst.n);
  /* Each descriptor's window, worked out now, ahead of the send, so that
   * the sender posts without searching. */
  if (rc == 0) rc = kvf__mw_index(&x->dst, g->win, g->n_win, x->tp_grant.of);
  if (rc) return rc;
  rdma_transport *rt = g->rt;
  if (merged) {
    rt->mw_merged++;
    kvf__warn("rdma: grant %s has %zu separate ranges, more than rdma-mw-max-windows (%u): its %zu memory "
              "windows also span the %zu smallest gaps between them", x->id, ranges, kvfd.cfg.rdma_mw_max_windows,
              g->n_win, merged);
  }
  rt->mw_grants++;
  g->since_ns = kvf__now_ns();
  g->binding = true;
  g->next_b = rt->binding;
  rt->binding = g;
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
  if (g->binding) unlist(&rt->binding, g);
  g->binding = false;
  if (g->chains_out) wait_binds(g);
  for (size_t i = 0; g->mw && i < g->n_win; i++)
    if (g->mw[i]) {
      ibv_dealloc_mw(g->mw[i]);
      rt->mw_live--;
    }
  free(g->mw);
  free(g->win);
  free(g->qs);
  free(g->cur);
  g->mw = NULL;
  g->win = NULL;
  g->qs = NULL;
  g->cur = NULL;
  g->nq = 0;
  g->closed = true;
  if (!g->chains_out) return true;
  kvf__warn("rdma: binds of a closed grant still in flight after %d ms", BIND_WAIT_MS);
  g->next_b = rt->zombies;
  rt->zombies = g;
  mw_timer_arm(rt);
  return false;
}

/* The windows of g bound on lk's QPs: binds in flight never complete, a
 * grant still binding fails, and the windows go at once. They can take no
 * write any more, and a type 2 window holds its QP: rxe's destroy_qp waits
 * (up to 50 s) for the windows bound on it to go. */
static void forget_windows(rgrant *g, rlink *lk) {
  for (bchain *c = g->chains, *next; c; c = next) {
    next = c->next;
    if (c->q->lk == lk) chain_done(c, false);
  }
  for (size_t j = 0; j < g->nq; j++) {
    if (!g->qs[j] || g->qs[j]->lk != lk) continue;
    g->qs[j] = NULL;
    if (g->binding) bind_retry(g, "a queue pair of the peer went away");
    for (size_t i = j; g->mw && i < g->n_win; i += g->nq)
      if (g->mw[i]) {
        ibv_dealloc_mw(g->mw[i]);
        g->mw[i] = NULL;
        g->rt->mw_live--;
      }
  }
}

/* The link goes (peer down or reset); its QPs are in the error state. */
static void mw_forget_link(rlink *lk) {
  rdma_transport *rt = lk->rp->rt;
  for (size_t i = 0; i < rt->grants.nb; i++)
    for (kvf__map_ent *e = rt->grants.b[i]; e; e = e->next) forget_windows(e->val, lk);
  for (rgrant *g = rt->zombies; g; g = g->next_b) forget_windows(g, lk);
}

/* An accepted QP is connected: which QP and device of the peer dialed it
 * (the Grant names windows by them). */
static void accepted_ready(rqp *q) {
  struct ibv_qp_attr a;
  struct ibv_qp_init_attr ia;
  const Kvf__RdmaInfo *ri = q->lk->rp->p->hello ? q->lk->rp->p->hello->rdma : NULL;
  struct sockaddr *sa = rdma_get_peer_addr(q->id);
  if (!q->lk->rp->rt->mw || !ri || !sa || ibv_query_qp(q->qp, &a, IBV_QP_DEST_QPN, &ia) != 0) return;
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

static int rdma_grant_open(kvf__transport *t, kvf__xfer *x) {
  rdma_transport *rt = to_rdma(t);
  char key[16];
  for (size_t i = 0; rt->any_gpu && !x->path && i < x->dst.n; i++)
    if (x->dst.pool[i] < kvfd.n_pools && kvf__pool_gpu(kvfd.pools[x->dst.pool[i]])) x->path = "rdma-gdr";
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
  if (!rt->mw) return 0;
  rc = mw_grant_open(g, x);
  if (rc < 0) {
    kvf__map_del(&rt->grants, key);
    if (mw_release(g)) free(g);
  }
  return rc;
}

static void rdma_grant_close(kvf__transport *t, kvf__xfer *x) {
  rdma_transport *rt = to_rdma(t);
  char key[16];
  grant_key(key, sizeof(key), (uint32_t)x->handle);
  rgrant *g = kvf__map_get(&rt->grants, key);
  if (!g || g->x != x) return;
  kvf__map_del(&rt->grants, key);
  if (mw_release(g)) free(g);
}

/* ------------------------------------------------------------ connections */

static bool rdma_usable(kvf__transport *t, kvf__peer *p) {
  const Kvf__RdmaInfo *ri = p->hello ? p->hello->rdma : NULL;
  return to_rdma(t)->n_devs > 0 && ri && ri->version == INFO_VERSION && ri->n_devices > 0;
}

/* Fills b (PRIV_AUTH_LEN bytes of room); returns the length to send. */
static size_t priv_encode(uint8_t *b, uint64_t dst_session) {
  size_t klen;
  put_u32(b, PRIV_MAGIC);
  put_u32(b + 4, PRIV_VERSION);
  put_u64(b + 8, kvfd.session);
  put_u64(b + 16, dst_session);
  if (!kvf__auth_enabled()) return PRIV_LEN;
  const uint8_t *key = kvf__auth_key(&klen); /* before klen is read */
  kvf__auth_rdma_proof(key, klen, kvfd.session, dst_session, b + PRIV_LEN);
  return PRIV_AUTH_LEN;
}

/* Cluster key: the request's proof, checked before rdma_accept. A CM
 * request is one message (a challenge would cost a round trip per QP), so
 * the proof binds the two daemons' sessions rather than nonces: it proves
 * the key, and the session maps to the peer that proved it on the control
 * connection (node and QP index add nothing to that). A request recorded on
 * the wire could be replayed to the same start of this daemon while that
 * start of the sender lives; an attacker able to record it can also inject
 * RoCE packets, which only a protected fabric stops. The CM pads private
 * data, so a missing proof reads as zeros and fails like a wrong one. */
static bool priv_auth_ok(const uint8_t *b, size_t len, uint64_t src, uint64_t dst) {
  uint8_t want[KVF__AUTH_RDMA_PROOF];
  size_t klen;
  if (!kvf__auth_enabled()) return true;
  if (len < PRIV_AUTH_LEN) return false;
  const uint8_t *key = kvf__auth_key(&klen); /* before klen is read */
  kvf__auth_rdma_proof(key, klen, src, dst, want);
  return kvf__auth_equal(want, b + PRIV_LEN, sizeof(want));
}

static int priv_decode(const uint8_t *b, size_t len, uint64_t *src, uint64_t *dst) {
  if (len < PRIV_LEN || get_u32(b) != PRIV_MAGIC || get_u32(b + 4) != PRIV_VERSION) return KVF_EPROTO;
  *src = get_u64(b + 8);
  *dst = get_u64(b + 16);
  return 0;
}

static rqp *qp_new(rlink *lk, bool outbound) {
  if (lk->n_all == MAX_QPS) return NULL;
  rqp *q = calloc(1, sizeof(*q));
  if (!q) return NULL;
  q->lk = lk;
  q->outbound = outbound;
  q->peer_dev = -1;
  lk->all[lk->n_all++] = q;
  return q;
}

/* From here on the progress thread sees q (its CQ entries, its queues). */
static void publish(rlink *lk, rqp *q) {
  unsigned n = atomic_load(&lk->n_qps);
  atomic_store(&lk->qps[n], q);
  atomic_store(&lk->n_qps, n + 1);
}

static int create_qp(rlink *lk, rqp *q) {
  rdev *d = lk->dev;
  if (q->id->verbs != d->ctx) return -EXDEV;
  /* With memory windows an accepted QP's send queue carries the binds of
   * the peer's grants, into the loop's own CQ. */
  bool binds = !q->outbound && lk->bcq;
  struct ibv_qp_init_attr a = {
      .qp_context = q,
      .send_cq = binds ? lk->bcq : lk->cq,
      .recv_cq = lk->cq,
      .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = q->outbound || binds ? lk->depth : 1,
              .max_recv_wr = q->outbound ? 1 : lk->depth,
              .max_send_sge = 1,
              .max_recv_sge = 1,
              .max_inline_data = q->outbound ? kvfd.cfg.rdma_inline : 0},
  };
  struct ibv_qp_init_attr want = a;
  if (rdma_create_qp(q->id, d->pd, &a) != 0) {
    if (want.cap.max_inline_data == 0) return -errno;
    a = want; /* the device may not inline: go without */
    a.cap.max_inline_data = 0;
    if (rdma_create_qp(q->id, d->pd, &a) != 0) return -errno;
  }
  q->qp = q->id->qp;
  q->qp_num = q->qp->qp_num;
  q->max_inline = a.cap.max_inline_data;
  q->bind_cap = binds ? lk->depth : 0;
  if (q->outbound) {
    init_chain(q);
    q->sq_cap = lk->depth;
    q->ring = calloc(q->sq_cap, sizeof(*q->ring));
    if (!q->ring) return -ENOMEM;
  } else {
    q->rq_cap = lk->depth;
    int rc = post_recvs(q, q->rq_cap);
    if (rc) return rc;
  }
  publish(lk, q);
  return 0;
}

static const char *qp_error_text(int rc, char *buf, size_t len) {
  if (rc == -EXDEV) return "the address resolves to another device";
  snprintf(buf, len, "%s", strerror(-rc));
  return buf;
}

/* Frees a dialed QP that has no verbs QP yet (address or route resolution
 * failed): no thread knows it and its id holds no connection. */
static void forget_qp(rlink *lk, rqp *q) {
  for (unsigned i = 0; i < lk->n_all; i++)
    if (lk->all[i] == q) {
      lk->all[i] = lk->all[--lk->n_all];
      break;
    }
  if (q->id) rdma_destroy_id(q->id);
  free(q->ring);
  free(q);
}

/* A dialed QP that never connected (the path is still coming back, or the
 * peer is not listening yet) is retried with backoff, up to CONNECT_MS after
 * the peer came up, instead of failing the peer at once: fast cycles of
 * peer failures would only churn the control connection. The old QP stays
 * (inert) until the link goes. */
static void redial_later(rqp *q, const char *what, const char *detail) {
  rlink *lk = q->lk;
  kvf__debug("rdma: %s: %s (%s -> %s) failed: %s; trying again", peer_name(lk->rp), what, lk->dev->name,
             lk->peer_dev, detail);
  if (!q->qp) { /* never reached the thread and never connected: gone at once */
    forget_qp(lk, q);
  } else {
    q->gone = true;
    ibv_modify_qp(q->qp, &(struct ibv_qp_attr){.qp_state = IBV_QPS_ERR}, IBV_QP_STATE);
    if (q->id) q->id->context = NULL;
  }
  /* 250 ms doubling to 1 s; every 5 s once the peer runs without this link */
  bool late = kvf__now_ns() - lk->rp->up_ns > (uint64_t)CONNECT_MS * 1000000ull;
  lk->redial_ms = late ? 5000 : lk->redial_ms ? (lk->redial_ms * 2 > 1000 ? 1000 : lk->redial_ms * 2) : REDIAL_MS;
  lk->redial_at = kvf__now_ns() + (uint64_t)lk->redial_ms * 1000000ull;
  lk->redial++;
}

/* Fails the peer from the loop's next turn, not from inside a CM or
 * peer_up handler that still holds q. */
static void dial_failed(rqp *q, const char *what, const char *detail) {
  rlink *lk = q->lk;
  if (!q->outbound) { /* see qp_failed */
    kvf__debug("rdma: %s: dropped an accepted QP on %s: %s: %s", peer_name(lk->rp), lk->dev->name, what, detail);
    q->gone = true;
    if (q->qp) ibv_modify_qp(q->qp, &(struct ibv_qp_attr){.qp_state = IBV_QPS_ERR}, IBV_QP_STATE);
    return;
  }
  if (!q->established) {
    redial_later(q, what, detail);
    return;
  }
  fail_peer_soon(lk->rp, "rdma: %s with %s (%s -> %s %s) failed: %s", what, peer_name(lk->rp), lk->dev->name,
                 lk->peer_dev, q->outbound ? "dialed" : "accepted", detail);
}

static int dial(rlink *lk) {
  rqp *q = qp_new(lk, true);
  if (!q) return -ENOMEM;
  if (rdma_create_id(lk->rp->rt->cm, &q->id, q, RDMA_PS_TCP) != 0) return -errno;
  uint8_t timeout = ACK_TIMEOUT;
  /* A dead path must error the QP well before transfer deadlines. */
  if (rdma_set_option(q->id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &timeout, sizeof(timeout)))
    kvf__debug("rdma: cannot set the ACK timeout (%s); using the CM's", strerror(errno));
  struct sockaddr_storage src = lk->dev->addr;
  set_port(&src, 0);
  /* Fails at once when the path is down: the peer is failed (and retried
   * with backoff) from the loop's next turn, like any later CM failure. */
  if (rdma_resolve_addr(q->id, (struct sockaddr *)&src, (struct sockaddr *)&lk->dst, RESOLVE_MS) != 0)
    dial_failed(q, "address resolution", strerror(errno));
  return 0;
}

static void on_route_resolved(rqp *q) {
  char buf[96];
  int rc = create_qp(q->lk, q);
  if (rc) {
    dial_failed(q, "creating a QP", qp_error_text(rc, buf, sizeof(buf)));
    return;
  }
  uint8_t priv[PRIV_AUTH_LEN];
  size_t priv_len = priv_encode(priv, q->lk->rp->session);
  struct rdma_conn_param cp = {.private_data = priv,
                               .private_data_len = (uint8_t)priv_len,
                               .retry_count = RETRY_COUNT,
                               .rnr_retry_count = RNR_RETRY};
  if (rdma_connect(q->id, &cp) != 0) dial_failed(q, "rdma_connect", strerror(errno));
}

static bool peer_ready(const rpeer *rp) {
  for (int i = 0; i < rp->n_links; i++)
    if (rp->links[i]->n_ready < rp->links[i]->n_out) return false;
  return true;
}

static void on_established(rqp *q) {
  rpeer *rp = q->lk->rp;
  q->established = true;
  if (!q->outbound) {
    accepted_ready(q);
    return;
  }
  atomic_store(&q->ready, true);
  wake(q->lk->dev);
  q->lk->n_ready++;
  if (peer_ready(rp) && !rp->said_ready) {
    rp->said_ready = true;
    kvf__info("rdma: peer %s ready: %d device(s) x %u QP(s), %.1f ms to connect", peer_name(rp),
              rp->n_links, kvfd.cfg.rdma_qps_per_peer, (double)(kvf__now_ns() - rp->up_ns) / 1e6);
  }
}

static rdev *dev_of(rdma_transport *rt, struct ibv_context *ctx) {
  for (int i = 0; i < rt->n_devs; i++)
    if (rt->devs[i].ctx == ctx) return &rt->devs[i];
  return NULL;
}

static void reject(struct rdma_cm_id *id) {
  rdma_reject(id, NULL, 0);
  rdma_destroy_id(id);
}

static rlink *link_on(rpeer *rp, const rdev *d) {
  for (int i = 0; i < rp->n_links; i++)
    if (rp->links[i]->dev == d) return rp->links[i];
  return NULL;
}

/* An inbound QP of the peer: it only receives the peer's completion notices. */
static void accept_on(rpeer *rp, rdev *d, struct rdma_cm_id *id) {
  char buf[96];
  rlink *lk = link_on(rp, d);
  rqp *q = lk ? qp_new(lk, false) : NULL;
  if (!q) {
    reject(id);
    return;
  }
  q->id = id;
  id->context = q;
  int rc = create_qp(lk, q);
  if (rc) {
    rdma_reject(id, NULL, 0);
    dial_failed(q, "creating a QP", qp_error_text(rc, buf, sizeof(buf)));
    return;
  }
  struct rdma_conn_param cp = {.retry_count = RETRY_COUNT, .rnr_retry_count = RNR_RETRY};
  if (rdma_accept(id, &cp) != 0) dial_failed(q, "rdma_accept", strerror(errno));
}

static rpeer *rpeer_by_session(rdma_transport *rt, uint64_t session) {
  for (size_t i = 0; i < rt->n_peers; i++)
    if (rt->peers[i]->session == session) return rt->peers[i];
  return NULL;
}

/* The peer dialed before its Hello reached us: hold the request a while. */
static void park(rdma_transport *rt, struct rdma_cm_id *id, rdev *d, uint64_t session) {
  parked *pk = calloc(1, sizeof(*pk));
  if (!pk) {
    reject(id);
    return;
  }
  id->context = NULL;
  pk->id = id;
  pk->dev = d;
  pk->session = session;
  pk->since_ns = kvf__now_ns();
  pk->next = rt->parked;
  rt->parked = pk;
}

static void on_connect_request(rdma_transport *rt, const cm_ev *ev) {
  uint64_t src, dst;
  rdev *d = dev_of(rt, ev->id->verbs);
  if (!d || priv_decode(ev->priv, ev->priv_len, &src, &dst) != 0 || dst != kvfd.session) {
    kvf__debug("rdma: refused a connection request (unknown, or for an earlier start of this daemon)");
    reject(ev->id);
    return;
  }
  if (!priv_auth_ok(ev->priv, ev->priv_len, src, dst)) {
    struct sockaddr *sa = rdma_get_peer_addr(ev->id);
    char ip[64] = "?";
    if (sa) addr_text((const struct sockaddr_storage *)sa, ip, sizeof(ip));
    kvfd.stats.auth_failures++;
    kvf__warn("rdma: refused a connection request from %s (session %016llx): cluster key mismatch, "
              "or the peer has none", ip, (unsigned long long)src);
    reject(ev->id);
    return;
  }
  rpeer *rp = rpeer_by_session(rt, src);
  if (rp) accept_on(rp, d, ev->id);
  else park(rt, ev->id, d, src);
}

/* Parked requests of this peer (adopt) or too old / of no peer (drop). */
static void sweep_parked(rdma_transport *rt, rpeer *adopt, bool drop_all) {
  uint64_t now = kvf__now_ns();
  parked **pp = &rt->parked;
  while (*pp) {
    parked *pk = *pp;
    bool mine = adopt && pk->session == adopt->session;
    bool old = now - pk->since_ns > (uint64_t)PARK_MS * 1000000ull;
    if (!mine && !old && !drop_all) {
      pp = &pk->next;
      continue;
    }
    *pp = pk->next;
    if (mine) accept_on(adopt, pk->dev, pk->id);
    else reject(pk->id);
    free(pk);
  }
}

static void on_cm_event(rdma_transport *rt, const cm_ev *ev) {
  if (ev->type == RDMA_CM_EVENT_CONNECT_REQUEST) {
    on_connect_request(rt, ev);
    return;
  }
  for (int i = 0; i < rt->n_devs; i++)
    if (ev->id == rt->devs[i].listener) {
      if (ev->type == RDMA_CM_EVENT_DEVICE_REMOVAL) kvf__err("rdma: device %s was removed", rt->devs[i].name);
      return;
    }
  rqp *q = ev->ctx;
  if (!q) return; /* a parked request, or a QP of a peer already down */
  char detail[96];
  snprintf(detail, sizeof(detail), "%s (status %d)", rdma_event_str(ev->type), ev->status);
  kvf__debug("rdma: %s QP %u %s %s on %s: %s", q->outbound ? "dialed" : "accepted", q->qp_num,
             q->outbound ? "to" : "from", peer_name(q->lk->rp), q->lk->dev->name, detail);
  switch (ev->type) {
  case RDMA_CM_EVENT_ADDR_RESOLVED:
    if (rdma_resolve_route(q->id, RESOLVE_MS) != 0) dial_failed(q, "route resolution", strerror(errno));
    break;
  case RDMA_CM_EVENT_ROUTE_RESOLVED: on_route_resolved(q); break;
  case RDMA_CM_EVENT_ESTABLISHED: on_established(q); break;
  case RDMA_CM_EVENT_ADDR_ERROR:
  case RDMA_CM_EVENT_ROUTE_ERROR:
  case RDMA_CM_EVENT_UNREACHABLE:
  case RDMA_CM_EVENT_REJECTED:
  case RDMA_CM_EVENT_CONNECT_ERROR:
  case RDMA_CM_EVENT_DISCONNECTED:
  case RDMA_CM_EVENT_DEVICE_REMOVAL:
    dial_failed(q, q->established ? "the connection" : "connecting", detail);
    break;
  default: break;
  }
}

static void on_cm_readable(uv_poll_t *h, int status, int events) {
  rdma_transport *rt = kvf__container_of(h, rdma_transport, cm_poll);
  struct rdma_cm_event *raw;
  while (rdma_get_cm_event(rt->cm, &raw) == 0) {
    cm_ev ev = {.type = raw->event, .id = raw->id, .ctx = raw->id->context, .status = raw->status};
    size_t n = raw->param.conn.private_data_len;
    if (raw->event == RDMA_CM_EVENT_CONNECT_REQUEST && raw->param.conn.private_data) {
      ev.priv_len = n < PRIV_AUTH_LEN ? n : PRIV_AUTH_LEN;
      memcpy(ev.priv, raw->param.conn.private_data, ev.priv_len);
    }
    /* Acked before handling: a handler may destroy ids, which waits for
     * their events to be acked. */
    rdma_ack_cm_event(raw);
    on_cm_event(rt, &ev);

  }
}

/* ------------------------------------------------------------ peers */

static void destroy_link(rlink *lk) {
  uint64_t t0 = kvf__now_ns();
  for (unsigned i = 0; i < lk->n_all; i++) {
    rqp *q = lk->all[i];
    if (q->id) {
      if (q->established) rdma_disconnect(q->id);
      if (q->qp) rdma_destroy_qp(q->id);
      rdma_destroy_id(q->id);
    }
    free(q->ring);
    free(q);
  }
  if (lk->cq) ibv_destroy_cq(lk->cq);
  if (lk->bcq) ibv_destroy_cq(lk->bcq);
  kvf__debug("rdma: destroyed %u QP(s) and a CQ of %s in %.1f ms", lk->n_all, lk->dev->name,
             (double)(kvf__now_ns() - t0) / 1e6);
  free(lk->raddr);
  free(lk->rkey);
  free(lk);
}

static void *reaper_main(void *arg) {
  rdma_transport *rt = arg;
  pthread_mutex_lock(&rt->reap_lock);
  for (;;) {
    while (!rt->reap_head && !rt->reaper_stop) pthread_cond_wait(&rt->reap_cond, &rt->reap_lock);
    rlink *lk = rt->reap_head;
    if (!lk) break;
    rt->reap_head = lk->next;
    pthread_mutex_unlock(&rt->reap_lock);
    destroy_link(lk);
    pthread_mutex_lock(&rt->reap_lock);
  }
  pthread_mutex_unlock(&rt->reap_lock);
  return NULL;
}

/* The loop's part of a link's end: every QP to the error state (no more
 * DMA from our pools), no more CM events for its ids; the reaper destroys
 * the rest. Without a reaper (start failed), at once. */
static void reap_link(rlink *lk) {
  rdma_transport *rt = lk->rp->rt;
  for (unsigned i = 0; i < lk->n_all; i++) {
    rqp *q = lk->all[i];
    if (q->qp) ibv_modify_qp(q->qp, &(struct ibv_qp_attr){.qp_state = IBV_QPS_ERR}, IBV_QP_STATE);
    if (q->qp) q->qp->qp_context = NULL; /* async events of it until destroyed: ignored */
    if (q->id) q->id->context = NULL;
  }
  if (lk->bcq) mw_forget_link(lk);
  if (lk->cq) lk->cq->cq_context = NULL;
  if (!rt->reaper_on) {
    destroy_link(lk);
    return;
  }
  pthread_mutex_lock(&rt->reap_lock);
  lk->next = rt->reap_head;
  rt->reap_head = lk;
  pthread_cond_signal(&rt->reap_cond);
  pthread_mutex_unlock(&rt->reap_lock);
}

/* Completes every ticket of rp with KVF_EPEERLOST for what never ran; what
 * was in flight the threads completed when they let go of the links. */
static void drain_peer(rpeer *rp) {
  for (ticket *tk = rp->rt->live; tk; tk = tk->next_live) {
    if (tk->rp != rp) continue;
    size_t k = take_back(rp, tk);
    tk->rp = NULL;
    credit(tk, k, KVF_EPEERLOST);
  }
}

static void unregister_peer(rpeer *rp) {
  rdma_transport *rt = rp->rt;
  kvf__transport_set_peer(&rt->base, rp->p, NULL);
  for (size_t i = 0; i < rt->n_peers; i++)
    if (rt->peers[i] == rp) {
      rt->peers[i] = rt->peers[--rt->n_peers];
      return;
    }
}

/* Threads off the peer's links, its QPs to the reaper, its tickets done. */
static void drop_links(rpeer *rp) {
  for (int i = 0; i < rp->n_links; i++)
    if (rp->links[i]->attached) detach_and_wait(rp->links[i]);
  for (int i = 0; i < rp->n_links; i++) reap_link(rp->links[i]);
  rp->n_links = 0;
  drain_peer(rp);
}

static void rdma_peer_down(kvf__transport *t, kvf__peer *p) {
  rpeer *rp = rpeer_of(to_rdma(t), p);
  if (!rp) return;
  unregister_peer(rp);
  drop_links(rp);
  pthread_mutex_destroy(&rp->qlock);
  free(rp->pool_size);
  free(rp->pool_gpu);
  free(rp);
}

static int find_mrs(rlink *lk, const Kvf__RdmaDevice *rd, const rpeer *rp) {
  lk->n_rpools = rp->n_pools;
  lk->raddr = calloc(rp->n_pools ? rp->n_pools : 1, sizeof(*lk->raddr));
  lk->rkey = calloc(rp->n_pools ? rp->n_pools : 1, sizeof(*lk->rkey));
  if (!lk->raddr || !lk->rkey) return -ENOMEM;
  size_t found = 0;
  for (size_t i = 0; i < rd->n_mrs; i++) {
    const Kvf__RdmaMr *m = rd->mrs[i];
    if (m->pool >= rp->n_pools || m->length < rp->pool_size[m->pool]) continue;
    lk->raddr[m->pool] = m->addr;
    lk->rkey[m->pool] = m->rkey;
    found++;
  }
  return found >= rp->n_pools ? 0 : KVF_EPROTO;
}

static int parse_dst(rlink *lk, const Kvf__RdmaDevice *rd) {
  struct addrinfo hints = {.ai_flags = AI_NUMERICHOST, .ai_socktype = SOCK_STREAM}, *res;
  char port[8];
  snprintf(port, sizeof(port), "%u", rd->cm_port);
  if (!rd->cm_addr || getaddrinfo(rd->cm_addr, port, &hints, &res) != 0) return KVF_EPROTO;
  memcpy(&lk->dst, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  return 0;
}

/* CQ entries: every dialed QP's sends and every accepted QP's receives
 * (plus one each for the other direction), within what the device allows. */
static int make_cq(rlink *lk, const Kvf__RdmaInfo *ri) {
  rdev *d = lk->dev;
  uint32_t qps = lk->n_out + (ri->qps_per_peer ? ri->qps_per_peer : lk->n_out);
  uint32_t depth = kvfd.cfg.rdma_queue_depth;
  if (depth > d->max_qp_wr) depth = d->max_qp_wr;
  if ((uint64_t)qps * (depth + 1) > d->max_cqe) depth = d->max_cqe / qps - 1;
  if (depth < 2) return -ENOSPC;
  lk->depth = depth;
  lk->cq = ibv_create_cq(d->ctx, (int)(qps * (depth + 1)), lk, d->ch, 0);
  if (!lk->cq) return -errno;
  const rdma_transport *rt = lk->rp->rt;
  if (!rt->mw) return 0;
  /* Binds: every accepted QP's send queue, flushed whole on an error. */
  uint32_t acc = (ri->qps_per_peer ? ri->qps_per_peer : lk->n_out) *
                 (uint32_t)((ri->n_devices + (size_t)rt->n_devs - 1) / (size_t)rt->n_devs);
  lk->bcq = ibv_create_cq(d->ctx, (int)(acc * (depth + 1)), lk, NULL, 0);
  return lk->bcq ? 0 : -errno;
}

static int link_new(rpeer *rp, rdev *d, const Kvf__RdmaDevice *rd, const Kvf__RdmaInfo *ri) {
  rlink *lk = calloc(1, sizeof(*lk));
  if (!lk) return -ENOMEM;
  lk->rp = rp;
  lk->dev = d;
  lk->n_out = kvfd.cfg.rdma_qps_per_peer;
  snprintf(lk->peer_dev, sizeof(lk->peer_dev), "%s", rd->name ? rd->name : "?");
  rp->links[rp->n_links++] = lk;
  int rc = find_mrs(lk, rd, rp);
  if (rc == 0) rc = parse_dst(lk, rd);
  if (rc) {
    kvf__warn("rdma: peer %s announced device %s without a usable address or rkeys", peer_name(rp),
              lk->peer_dev);
    return rc;
  }
  if ((rc = make_cq(lk, ri)) != 0) return rc;
  send_cmd(d, CMD_ATTACH, lk);
  lk->attached = true;
  for (unsigned i = 0; i < lk->n_out && rc == 0; i++) rc = dial(lk);
  return rc;
}

static rpeer *rpeer_new(rdma_transport *rt, kvf__peer *p) {
  rpeer *rp = calloc(1, sizeof(*rp));
  if (!rp) return NULL;
  const Kvf__Hello *h = p->hello;
  rp->rt = rt;
  rp->p = p;
  rp->gen = ++rt->gen;
  rp->session = p->remote_session;
  rp->up_ns = kvf__now_ns();
  rp->n_pools = h->n_pools;
  rp->pool_size = calloc(h->n_pools ? h->n_pools : 1, sizeof(*rp->pool_size));
  rp->pool_gpu = calloc(h->n_pools ? h->n_pools : 1, sizeof(*rp->pool_gpu));
  if (!rp->pool_size || !rp->pool_gpu) {
    free(rp->pool_size);
    free(rp->pool_gpu);
    free(rp);
    return NULL;
  }
  for (size_t i = 0; i < h->n_pools; i++) {
    const Kvf__PoolInfo *pi = h->pools[i];
    if (pi->id >= h->n_pools) continue;
    rp->pool_size[pi->id] = pi->size;
    rp->pool_gpu[pi->id] = pi->kind && strncmp(pi->kind, "cuda", 4) == 0;
    rp->gpu_pools |= rp->pool_gpu[pi->id];
  }
  pthread_mutex_init(&rp->qlock, NULL);
  rt->peers[rt->n_peers++] = rp;
  kvf__transport_set_peer(&rt->base, p, rp);
  return rp;
}

/* Dials our QPs to the peer; the data path opens as they get established
 * (posts queue meanwhile). A failure here is cleaned up by peer_down. */
/* One link per device of ours, each dialing its QPs. */
static int make_links(rpeer *rp) {
  rdma_transport *rt = rp->rt;
  const Kvf__RdmaInfo *ri = rp->p->hello->rdma;
  rp->up_ns = kvf__now_ns();
  rp->said_ready = rp->degraded = false;
  for (int i = 0; i < rt->n_devs; i++) {
    int rc = link_new(rp, &rt->devs[i], ri->devices[(size_t)i % ri->n_devices], ri);
    if (rc) {
      kvf__warn("rdma: peer %s: cannot set up device %s: %s", peer_name(rp), rt->devs[i].name,
                rc < -4000 ? kvf_strerror(rc) : strerror(-rc));
      return rc;
    }
  }
  return 0;
}

static int rdma_peer_up(kvf__transport *t, kvf__peer *p) {
  rdma_transport *rt = to_rdma(t);
  const Kvf__RdmaInfo *ri = p->hello ? p->hello->rdma : NULL;
  if (!ri || ri->n_devices == 0 || rt->n_peers == KVF__MAX_PEERS_CFG) return KVF_EPROTO;
  rpeer *rp = rpeer_new(rt, p);
  if (!rp) return -ENOMEM;
  int rc = make_links(rp);
  if (rc == 0) sweep_parked(rt, rp, false);
  return rc;
}

/* A dialed QP broke (completion error, QP fatal, disconnect): every
 * transfer in flight to the peer fails with KVF_EPEERLOST at once and the
 * peer's QPs are rebuilt, while the control connection stays: a data-path
 * failure does not reset the control plane (both daemons reconnecting at
 * the same moment only churns it). Posts meanwhile queue, and fail after
 * UNREADY_MS without a QP; a rebuild that cannot connect in CONNECT_MS
 * fails the peer. */
static void reset_peer(rpeer *rp, const char *why) {
  kvf__warn("peer %s: %s; failing its rdma transfers and reconnecting", peer_name(rp), why);
  rp->resets++;
  drop_links(rp);
  rp->gen = ++rp->rt->gen; /* what the old QPs still report is stale */
  if (make_links(rp) != 0) kvf__peer_fail(rp->p, "rdma: cannot rebuild the queue pairs");
}

static bool any_ready(const rpeer *rp) {
  for (int i = 0; i < rp->n_links; i++)
    if (rp->links[i]->n_ready) return true;
  return false;
}

/* No QP to carry them: posts that wait longer than UNREADY_MS fail. */
static void fail_queued(rpeer *rp) {
  pthread_mutex_lock(&rp->qlock);
  for (ticket *tk = rp->rt->live; tk; tk = tk->next_live)
    if (tk->rp == rp) credit(tk, take_back(rp, tk), KVF_EPEERLOST);
  pthread_mutex_unlock(&rp->qlock);
}

/* Once a second: drop parked requests nobody claimed, and fail peers whose
 * QPs do not connect (a CM that keeps retrying would hold them forever). */
static void on_sweep(uv_timer_t *tm) {
  rdma_transport *rt = kvf__container_of(tm, rdma_transport, sweep);
  sweep_parked(rt, NULL, false);
  for (int i = 0; i < rt->n_devs; i++)
    if (!rt->devs[i].listener) relisten(&rt->devs[i]);
  uint64_t now = kvf__now_ns();
  for (size_t i = 0; i < rt->n_peers; i++) {
    rpeer *rp = rt->peers[i];
    for (int l = 0; l < rp->n_links; l++) {
      rlink *lk = rp->links[l];
      for (; lk->redial && now >= lk->redial_at; lk->redial--)
        if (dial(lk) != 0) break;
    }
    if (!any_ready(rp) && atomic_load(&rp->queued) && now - rp->up_ns > (uint64_t)UNREADY_MS * 1000000ull)
      fail_queued(rp);
    if (peer_ready(rp) || now - rp->up_ns <= (uint64_t)CONNECT_MS * 1000000ull) continue;
    if (!any_ready(rp)) {
      kvf__peer_fail(rp->p, "rdma: queue pairs not connected in time");
      return; /* the array changed */
    }
    if (!rp->degraded) {
      rp->degraded = true;
      kvf__warn("rdma: peer %s: some devices did not reconnect in %d s; carrying on with the others "
                "and retrying them", peer_name(rp), CONNECT_MS / 1000);
    }
  }
}

/* ------------------------------------------------------------ device async events */

/* After its port went down and up (or its GIDs changed) a device's CM
 * listener hears no more requests (seen with rxe on Linux 6.1): listen again
 * on the same address and port, which the peers already know. */
static void relisten(rdev *d) {
  char err[256];
  if (d->listener) rdma_destroy_id(d->listener);
  d->listener = NULL;
  if (start_listener(d, d->cm_port, err, sizeof(err)) != 0) kvf__warn("rdma: %s; retrying", err);
  else kvf__info("rdma: %s listening again on %s:%u", d->name, d->ip, d->cm_port);
}

static void on_dev_async(uv_poll_t *h, int status, int events) {
  rdev *d = h->data;
  struct ibv_async_event ev;
  while (ibv_get_async_event(d->ctx, &ev) == 0) {
    enum ibv_event_type type = ev.event_type;
    kvf__peer *p = NULL;
    uint64_t gen = 0;
    if ((type == IBV_EVENT_QP_FATAL || type == IBV_EVENT_QP_REQ_ERR || type == IBV_EVENT_QP_ACCESS_ERR) &&
        ev.element.qp && ev.element.qp->qp_context) {
      rqp *q = ev.element.qp->qp_context;
      if (q->outbound) { /* accepted QPs: see qp_failed */
        p = q->lk->rp->p;
        gen = q->lk->rp->gen;
      }
    } else if (type == IBV_EVENT_CQ_ERR && ev.element.cq && ev.element.cq->cq_context) {
      rlink *lk = ev.element.cq->cq_context;
      p = lk->rp->p;
      gen = lk->rp->gen;
    }
    int port = ev.element.port_num;
    ibv_ack_async_event(&ev); /* before acting: tearing down waits for the ack */
    if (type == IBV_EVENT_PORT_ERR || type == IBV_EVENT_PORT_ACTIVE)
      kvf__warn("rdma: %s port %d is %s", d->name, port, type == IBV_EVENT_PORT_ACTIVE ? "active" : "down");
    if ((type == IBV_EVENT_PORT_ACTIVE || type == IBV_EVENT_GID_CHANGE) && port == d->port) relisten(d);
    else if (type == IBV_EVENT_DEVICE_FATAL)
      kvf__err("rdma: %s: fatal device error", d->name);
    rpeer *rp = p ? rpeer_of(d->rt, p) : NULL;
    if (rp && rp->gen == gen) {
      char why[128];
      snprintf(why, sizeof(why), "rdma: %s on %s", ibv_event_type_str(type), d->name);
      reset_peer(rp, why);
    }
  }
}

/* ------------------------------------------------------------ devices */

static bool is_wildcard(const char *host) {
  return !host[0] || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "::") == 0;
}

/* The address whose GID we want: rdma-listen's host, else peer-listen's. */
static bool wanted_ip(struct in6_addr *out) {
  const char *h = !is_wildcard(kvfd.cfg.rdma_listen_host) ? kvfd.cfg.rdma_listen_host
                  : !is_wildcard(kvfd.cfg.listen_host)     ? kvfd.cfg.listen_host
                                                           : NULL;
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res;
  if (!h || getaddrinfo(h, NULL, &hints, &res) != 0) return false;
  if (res->ai_family == AF_INET) {
    memset(out, 0, sizeof(*out));
    out->s6_addr[10] = out->s6_addr[11] = 0xff;
    memcpy(&out->s6_addr[12], &((struct sockaddr_in *)res->ai_addr)->sin_addr, 4);
  } else {
    *out = ((struct sockaddr_in6 *)res->ai_addr)->sin6_addr;
  }
  freeaddrinfo(res);
  return true;
}

static bool v4_mapped(const union ibv_gid *g) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(g->raw, prefix, 12) == 0;
}

/* A GID we can reach through the CM: RoCE v2, with an IPv4 or a global
 * IPv6 address. */
static bool usable_gid(const struct ibv_gid_entry *e) {
  if (e->gid_type != IBV_GID_TYPE_ROCE_V2) return false;
  return v4_mapped(&e->gid) || !(e->gid.raw[0] == 0xfe && (e->gid.raw[1] & 0xc0) == 0x80);
}

static void gid_to_addr(rdev *d) {
  memset(&d->addr, 0, sizeof(d->addr));
  if (v4_mapped(&d->gid)) {
    struct sockaddr_in *s = (struct sockaddr_in *)&d->addr;
    s->sin_family = AF_INET;
    memcpy(&s->sin_addr, &d->gid.raw[12], 4);
  } else {
    struct sockaddr_in6 *s = (struct sockaddr_in6 *)&d->addr;
    s->sin6_family = AF_INET6;
    memcpy(&s->sin6_addr, d->gid.raw, 16);
  }
  addr_text(&d->addr, d->ip, sizeof(d->ip));
}

/* Picks the GID: the configured index, else the first usable one (matching
 * want when given). */
static int pick_gid(rdev *d, uint32_t tbl_len, const struct in6_addr *want) {
  struct ibv_gid_entry e;
  if (kvfd.cfg.rdma_gid_index >= 0) {
    if (ibv_query_gid_ex(d->ctx, d->port, (uint32_t)kvfd.cfg.rdma_gid_index, &e, 0) != 0 || !usable_gid(&e))
      return -ENOENT;
    d->gid = e.gid;
    d->gid_index = e.gid_index;
    return 0;
  }
  for (uint32_t i = 0; i < tbl_len; i++) {
    if (ibv_query_gid_ex(d->ctx, d->port, i, &e, 0) != 0 || !usable_gid(&e)) continue;
    if (want && memcmp(e.gid.raw, want->s6_addr, 16) != 0) continue;
    if (!want && !v4_mapped(&e.gid)) continue;
    d->gid = e.gid;
    d->gid_index = e.gid_index;
    return 0;
  }
  return -ENOENT;
}

/* Adds (ctx, port) when the port is active RoCE with a GID we can use.
 * why gets the reason when it is not. */
static int add_device(rdma_transport *rt, struct ibv_context *ctx, uint8_t port, const struct in6_addr *want,
                      char *why, size_t wlen) {
  const char *name = ibv_get_device_name(ctx->device);
  struct ibv_port_attr pa;
  struct ibv_device_attr da;
  if (rt->n_devs == MAX_DEVS) return snprintf(why, wlen, "more than %d devices", MAX_DEVS), -E2BIG;
  if (ibv_query_port(ctx, port, &pa) != 0 || ibv_query_device(ctx, &da) != 0)
    return snprintf(why, wlen, "%s port %u cannot be queried", name, port), -ENODEV;
  if (pa.state != IBV_PORT_ACTIVE)
    return snprintf(why, wlen, "%s port %u is not active", name, port), -ENODEV;
  if (pa.link_layer != IBV_LINK_LAYER_ETHERNET)
    return snprintf(why, wlen, "%s port %u is not RoCE (InfiniBand needs IPoIB support)", name, port), -ENODEV;
  rdev *d = &rt->devs[rt->n_devs];
  memset(d, 0, sizeof(*d));
  d->rt = rt;
  d->efd = d->epfd = -1;
  pthread_mutex_init(&d->lock, NULL);
  pthread_cond_init(&d->cond, NULL);
  d->ctx = ctx;
  d->port = port;
  snprintf(d->name, sizeof(d->name), "%s", name);
  if (pick_gid(d, (uint32_t)pa.gid_tbl_len, want) != 0)
    return snprintf(why, wlen, "%s port %u has no RoCE v2 GID %s", name, port,
                    kvfd.cfg.rdma_gid_index >= 0 ? "with an IP at rdma-gid-index" : "for our address"),
           -ENODEV;
  gid_to_addr(d);
  d->max_cqe = (uint32_t)da.max_cqe;
  d->max_qp_wr = (uint32_t)da.max_qp_wr;
  d->index = rt->n_devs++;
  return 0;
}

static int open_named(rdma_transport *rt, const struct in6_addr *want, char *err, size_t errlen) {
  char list[sizeof(kvfd.cfg.rdma_devices)];
  snprintf(list, sizeof(list), "%s", kvfd.cfg.rdma_devices);
  for (char *save = NULL, *w = strtok_r(list, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
    char *colon = strchr(w, ':');
    uint8_t port = colon ? (uint8_t)atoi(colon + 1) : 1;
    if (colon) *colon = 0;
    struct ibv_context *ctx = NULL;
    for (int i = 0; rt->all[i]; i++)
      if (strcmp(ibv_get_device_name(rt->all[i]->device), w) == 0) ctx = rt->all[i];
    if (!ctx) return snprintf(err, errlen, "rdma-devices: no device named %s", w), -ENODEV;
    /* A named device need not carry our address: it may be a second rail. */
    int rc = add_device(rt, ctx, port, NULL, err, errlen);
    if (rc) return rc;
  }
  (void)want;
  return 0;
}

static int open_auto(rdma_transport *rt, const struct in6_addr *want, char *err, size_t errlen) {
  char why[160] = "no RDMA device has an active RoCE port";
  for (int i = 0; rt->all[i]; i++) {
    struct ibv_device_attr da;
    if (ibv_query_device(rt->all[i], &da) != 0) continue;
    for (uint8_t port = 1; port <= da.phys_port_cnt; port++)
      add_device(rt, rt->all[i], port, want, why, sizeof(why));
  }
  if (rt->n_devs) return 0;
  char ip[INET6_ADDRSTRLEN] = "";
  if (want) inet_ntop(AF_INET6, want, ip, sizeof(ip));
  snprintf(err, errlen, "%s%s%s (set rdma-devices or rdma-listen)", want ? "no RoCE v2 GID for " : why,
           want ? ip : "", want ? " on any device" : "");
  return -ENODEV;
}

static int open_devices(rdma_transport *rt, char *err, size_t errlen) {
  int n = 0;
  rt->all = rdma_get_devices(&n);
  if (!rt->all || n == 0) {
    snprintf(err, errlen, "no RDMA device found");
    return -ENODEV;
  }
  struct in6_addr want;
  bool have = wanted_ip(&want);
  if (kvfd.cfg.rdma_devices[0]) return open_named(rt, have ? &want : NULL, err, errlen);
  return open_auto(rt, have ? &want : NULL, err, errlen);
}

static bool has_ipc_lock(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  unsigned long long caps = 0;
  if (!f) return false;
  while (fgets(line, sizeof(line), f))
    if (sscanf(line, "CapEff: %llx", &caps) == 1) break;
  fclose(f);
  return caps & (1ull << CAP_IPC_LOCK_BIT);
}

/* Each registration pins the pool again, counted against RLIMIT_MEMLOCK
 * unless we hold CAP_IPC_LOCK. */
static int check_memlock(const rdma_transport *rt, char *err, size_t errlen) {
  uint64_t need = 0;
  for (size_t i = 0; i < kvfd.n_pools; i++) /* GPU memory pins no host pages */
    if (!kvf__pool_gpu(kvfd.pools[i])) need += kvfd.pools[i]->size;
  need *= (uint64_t)rt->n_devs;
  struct rlimit rl;
  if (need == 0 || has_ipc_lock() || getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
      rl.rlim_cur >= need)
    return 0;
  snprintf(err, errlen,
           "RLIMIT_MEMLOCK is %llu bytes but registering the pools with %d device(s) pins %llu; set "
           "LimitMEMLOCK=infinity in the service (or ulimit -l unlimited), or grant CAP_IPC_LOCK",
           (unsigned long long)rl.rlim_cur, rt->n_devs, (unsigned long long)need);
  return -ENOMEM;
}

static bool access_ok(const char *path) { return access(path, F_OK) == 0; }

/* A cuda pool, GPUDirect: dmabuf (cuMemGetHandleForAddressRange +
 * ibv_reg_dmabuf_mr) first, then ibv_reg_mr of the device address (works
 * with nvidia-peermem loaded); p->nic_reg says which. NULL when neither. */
/* With memory windows the pools take remote writes only through windows
 * bound on them; else through the pool's own rkey. */
static int pool_access(const rdma_transport *rt) {
  return IBV_ACCESS_LOCAL_WRITE | (rt->mw ? IBV_ACCESS_MW_BIND : IBV_ACCESS_REMOTE_WRITE);
}

static struct ibv_mr *register_gpu_pool(rdev *d, kvf__pool *p, char *why, size_t whylen) {
  const int access = pool_access(d->rt);
  int fd = -1;
  uint64_t off = 0;
  int rc = kvf__pool_dmabuf(p, &fd, &off);
  struct ibv_mr *mr = NULL;
  if (rc == 0) {
    mr = ibv_reg_dmabuf_mr(d->pd, off, p->size, (uint64_t)(uintptr_t)p->base, fd, access);
    int e = errno;
    close(fd);
    if (mr) {
      snprintf(p->nic_reg, sizeof(p->nic_reg), "dmabuf");
      return mr;
    }
    snprintf(why, whylen, "ibv_reg_dmabuf_mr: %s", strerror(e));
  } else {
    snprintf(why, whylen, "no dmabuf export (%s)", strerror(-rc));
  }
  mr = ibv_reg_mr(d->pd, p->base, p->size, access);
  if (mr) {
    snprintf(p->nic_reg, sizeof(p->nic_reg), "peermem");
    return mr;
  }
  size_t used = strlen(why);
  snprintf(why + used, whylen - used, "; ibv_reg_mr of GPU memory: %s (nvidia-peermem %s)", strerror(errno),
           access_ok("/sys/module/nvidia_peermem") ? "loaded" : "not loaded");
  snprintf(p->nic_reg, sizeof(p->nic_reg), "bounce");
  return NULL;
}

static int register_pools(rdev *d, char *err, size_t errlen) {
  d->mrs = calloc(kvfd.n_pools ? kvfd.n_pools : 1, sizeof(*d->mrs));
  d->lkey = calloc(kvfd.n_pools ? kvfd.n_pools : 1, sizeof(*d->lkey));
  if (!d->mrs || !d->lkey) return -ENOMEM;
  for (size_t i = 0; i < kvfd.n_pools; i++) {
    kvf__pool *p = kvfd.pools[i];
    if (kvf__pool_gpu(p)) {
      char why[256] = "";
      d->mrs[i] = register_gpu_pool(d, p, why, sizeof(why));
      if (!d->mrs[i]) {
        /* No half-registered daemon: without GPUDirect for this pool, rdma
         * steps aside (start fails with -ENODEV) and tcp carries the
         * transfers, staged through pinned memory (tcp-bounce); said. */
        snprintf(err, errlen, "pool %s (%s) cannot be registered with %s: %s; GPU pools are bounce-only", p->name,
                 p->kind, d->name, why);
        return -ENODEV;
      }
      d->lkey[i] = d->mrs[i]->lkey;
      continue;
    }
    snprintf(p->nic_reg, sizeof(p->nic_reg), "host");
    d->mrs[i] = ibv_reg_mr(d->pd, p->base, p->size, pool_access(d->rt));
    if (!d->mrs[i]) {
      int e = errno;
      snprintf(err, errlen, "registering pool %s (%llu bytes) with %s failed: %s%s", p->name,
               (unsigned long long)p->size, d->name, strerror(e),
               e == ENOMEM || e == EPERM ? " (raise RLIMIT_MEMLOCK: LimitMEMLOCK=infinity)" : "");
      return -e;
    }
    d->lkey[i] = d->mrs[i]->lkey;
  }
  return 0;
}

static int setup_device(rdev *d, char *err, size_t errlen) {
  d->pd = ibv_alloc_pd(d->ctx);
  d->ch = d->pd ? ibv_create_comp_channel(d->ctx) : NULL;
  if (!d->ch || set_nonblock(d->ch->fd) || set_nonblock(d->ctx->async_fd)) {
    snprintf(err, errlen, "%s: cannot allocate a protection domain or completion channel", d->name);
    return -ENOMEM;
  }
  return 0;
}

/* ---- memory windows: whether to use them (rdma-memory-windows) */

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
  for (int i = 0; rt->mw && i < rt->n_devs; i++) {
    const rdev *d = &rt->devs[i];
    if (d->mw_bounds == KVF__MW_BOUNDS_IGNORED) append(weak, sizeof(weak), "%s%s", weak[0] ? ", " : "", d->name);
    if (d->mw_bounds == KVF__MW_BOUNDS_UNKNOWN)
      append(unknown, sizeof(unknown), "%s%s (%s)", unknown[0] ? ", " : "", d->name, d->mw_check);
  }
  char *p = rt->protection;
  size_t n = sizeof(rt->protection);
  if (!rt->mw)
    snprintf(p, n, "no memory windows (%s): a peer can write any byte of a registered pool at any time", rt->mw_why);
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
static int decide_windows(rdma_transport *rt, char *err, size_t errlen) {
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
  rt->mw = mode != KVF__OFF && !missing[0];
  if (mode == KVF__OFF) snprintf(rt->mw_why, sizeof(rt->mw_why), "rdma-memory-windows off");
  else snprintf(rt->mw_why, sizeof(rt->mw_why), "%s", missing);
  if (mode == KVF__ON && !rt->mw) {
    snprintf(err, errlen, "rdma-memory-windows on, but the devices cannot take them: %s", missing);
    return -EOPNOTSUPP;
  }
  say_protection(rt);
  return 0;
}

static int start_listener(rdev *d, uint16_t port, char *err, size_t errlen) {
  struct sockaddr_storage a = d->addr;
  set_port(&a, port);
  if (rdma_create_id(d->rt->cm, &d->listener, d, RDMA_PS_TCP) != 0 ||

      rdma_bind_addr(d->listener, (struct sockaddr *)&a) != 0 || rdma_listen(d->listener, 64) != 0) {
    int e = errno;
    snprintf(err, errlen, "CM listener of %s on %s port %u: %s", d->name, d->ip, port, strerror(e));
    if (d->listener) rdma_destroy_id(d->listener);
    d->listener = NULL;
    return -e;
  }
  if (d->listener->verbs != d->ctx) {
    snprintf(err, errlen, "address %s belongs to another device than %s", d->ip, d->name);
    return -EXDEV;
  }
  d->cm_port = ntohs(rdma_get_src_port(d->listener));
  return 0;
}

static int start_thread(rdev *d, char *err, size_t errlen) {
  d->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  d->epfd = epoll_create1(EPOLL_CLOEXEC);
  struct epoll_event a = {.events = EPOLLIN}, b = {.events = EPOLLIN};
  if (d->efd < 0 || d->epfd < 0 || epoll_ctl(d->epfd, EPOLL_CTL_ADD, d->efd, &a) != 0 ||
      epoll_ctl(d->epfd, EPOLL_CTL_ADD, d->ch->fd, &b) != 0) {
    snprintf(err, errlen, "%s: progress thread setup: %s", d->name, strerror(errno));
    return -errno;
  }
  if (pthread_create(&d->thr, NULL, progress_main, d) != 0) {
    snprintf(err, errlen, "%s: cannot start its progress thread", d->name);
    return -EAGAIN;
  }
  d->started = true;
  return 0;
}

static int start_handles(rdma_transport *rt) {
  uv_loop_t *loop = rt->base.loop;
  int rc = kvf__mailbox_init(&rt->mb, loop);
  if (rc) return rc;
  uv_poll_init(loop, &rt->cm_poll, rt->cm->fd);
  uv_poll_start(&rt->cm_poll, UV_READABLE, on_cm_readable);
  uv_timer_init(loop, &rt->sweep);
  uv_timer_start(&rt->sweep, on_sweep, 250, 250);
  uv_unref((uv_handle_t *)&rt->sweep);
  uv_timer_init(loop, &rt->mw_timer);
  for (int i = 0; i < rt->n_devs; i++) {
    rdev *d = &rt->devs[i];
    uv_poll_init(loop, &d->async_poll, d->ctx->async_fd);
    d->async_poll.data = d;
    uv_poll_start(&d->async_poll, UV_READABLE, on_dev_async);
    d->async_on = true;
  }
  rt->handles = true;
  return 0;
}

/* Scrape-time gauges: queue pairs per peer and device, and the devices.
 * A collector takes no argument: the instance is the daemon's rdma
 * transport, found by name (none once it is destroyed). */
static void rdma_metrics(kvf__sbuf *b) {
  kvf__transport *t = kvf__transport_find("rdma");
  if (!t) return;
  rdma_transport *rt = to_rdma(t);
  kvf__metrics_family(b, "kvferry_rdma_devices", "gauge", "RDMA devices in use.");
  kvf__sb_printf(b, "kvferry_rdma_devices %d\n", rt->n_devs);
  kvf__metrics_family(b, "kvferry_rdma_queue_pairs", "gauge",
                      "Connected RDMA queue pairs, by peer and local device.");
  for (size_t i = 0; i < rt->n_peers; i++) {
    rpeer *rp = rt->peers[i];
    for (int j = 0; rp && j < rp->n_links; j++) {
      rlink *lk = rp->links[j];
      if (!lk) continue;
      kvf__sb_printf(b, "kvferry_rdma_queue_pairs{peer=");
      kvf__metrics_label(b, peer_name(rp));
      kvf__sb_printf(b, ",device=");
      kvf__metrics_label(b, lk->dev->name);
      kvf__sb_printf(b, "} %u\n", atomic_load(&lk->n_qps));
    }
  }
}

static int start(rdma_transport *rt, char *err, size_t errlen) {
  int rc = open_devices(rt, err, errlen);
  if (rc == 0) rc = check_memlock(rt, err, errlen);
  if (rc) return rc;
  calibrate_clock();
  rt->pool_base = calloc(kvfd.n_pools ? kvfd.n_pools : 1, sizeof(*rt->pool_base));
  if (!rt->pool_base) return -ENOMEM;
  for (size_t i = 0; i < kvfd.n_pools; i++) {
    rt->pool_base[i] = kvfd.pools[i]->base;
    rt->any_gpu |= kvf__pool_gpu(kvfd.pools[i]);
  }
  for (int i = 0; rc == 0 && i < rt->n_devs; i++) rc = setup_device(&rt->devs[i], err, errlen);
  if (rc == 0) rc = decide_windows(rt, err, errlen);
  for (int i = 0; rc == 0 && i < rt->n_devs; i++) rc = register_pools(&rt->devs[i], err, errlen);
  if (rc) return rc;
  rt->cm = rdma_create_event_channel();
  if (!rt->cm || set_nonblock(rt->cm->fd)) {
    snprintf(err, errlen, "cannot open the RDMA CM (rdma_ucm loaded?)");
    return -ENODEV;
  }
  for (int i = 0; rc == 0 && i < rt->n_devs; i++) rc = start_listener(&rt->devs[i], kvfd.cfg.rdma_listen_port, err, errlen);
  if (rc == 0) rc = start_handles(rt);
  for (int i = 0; rc == 0 && i < rt->n_devs; i++) rc = start_thread(&rt->devs[i], err, errlen);
  if (rc == 0 && pthread_create(&rt->reaper, NULL, reaper_main, rt) != 0) {
    snprintf(err, errlen, "cannot start the reaper thread");
    rc = -EAGAIN;
  }
  rt->reaper_on = rc == 0;
  if (rc == 0) kvf__metrics_add_collector(rdma_metrics);
  return rc;
}

/* ------------------------------------------------------------ Hello */

static int build_hello(rdma_transport *rt) {
  size_t n = (size_t)rt->n_devs * (kvfd.n_pools ? kvfd.n_pools : 1);
  rt->hmr = calloc(n, sizeof(*rt->hmr));
  rt->hmr_ptr = calloc(n, sizeof(*rt->hmr_ptr));
  if (!rt->hmr || !rt->hmr_ptr) return -ENOMEM;
  kvf__rdma_info__init(&rt->info);
  rt->info.version = INFO_VERSION;
  rt->info.qps_per_peer = kvfd.cfg.rdma_qps_per_peer;
  for (int i = 0; i < rt->n_devs; i++) {
    rdev *d = &rt->devs[i];
    Kvf__RdmaDevice *h = &rt->hdev[i];
    kvf__rdma_device__init(h);
    h->name = d->name;
    h->port = d->port;
    h->gid.data = d->gid.raw;
    h->gid.len = sizeof(d->gid.raw);
    h->gid_index = d->gid_index;
    h->cm_addr = d->ip;
    h->cm_port = d->cm_port;
    h->mrs = &rt->hmr_ptr[(size_t)i * kvfd.n_pools];
    h->n_mrs = kvfd.n_pools;
    for (size_t k = 0; k < kvfd.n_pools; k++) {
      Kvf__RdmaMr *m = &rt->hmr[(size_t)i * kvfd.n_pools + k];
      kvf__rdma_mr__init(m);
      m->pool = (uint32_t)k;
      m->addr = (uint64_t)(uintptr_t)kvfd.pools[k]->base;
      m->rkey = rt->mw ? 0 : d->mrs[k]->rkey; /* windows: no pool-wide write access */
      m->length = kvfd.pools[k]->size;
      h->mrs[k] = m;
    }
    rt->hdev_ptr[i] = h;
  }
  rt->info.devices = rt->hdev_ptr;
  rt->info.n_devices = (size_t)rt->n_devs;
  rt->info.memory_windows = rt->mw;
  return 0;
}

/* Where our devices listen and the rkeys of our pools on each. */
static void rdma_hello(kvf__transport *t, Kvf__Hello *h) {
  rdma_transport *rt = to_rdma(t);
  if (rt->n_devs) h->rdma = &rt->info;
}

/* ------------------------------------------------------------ status */

typedef struct jbuf {
  char *p;
  size_t len, n;
} jbuf;

static void jb(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void jb(jbuf *b, const char *fmt, ...) {
  if (b->n >= b->len) return;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(b->p + b->n, b->len - b->n, fmt, ap);
  va_end(ap);
  if (k > 0) b->n += (size_t)k;
}

static double per(uint64_t ns, uint64_t n) { return n ? (double)ns / (double)n : 0; }

/* A string value, escaped (device checks quote the verbs' words). */
static void jb_str(jbuf *b, const char *s) {
  jb(b, "\"");
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') jb(b, "\\%c", *s);
    else if ((unsigned char)*s >= 0x20) jb(b, "%c", *s);
  }
  jb(b, "\"");
}

static void inspect_device_windows(jbuf *b, const rdev *d) {
  const char *use = d->rt->mw                                        ? "type 2 in use"
                    : kvfd.cfg.rdma_memory_windows == KVF__OFF ? "off by config"
                    : d->mw2                                   ? "unusable"
                                                               : "not supported";
  jb(b, ", \"memory_windows\": \"%s\", \"mw_bounds\": \"%s\", \"mw_check\": ", use,
     d->mw2 ? kvf__mw_bounds_name(d->mw_bounds) : "-");
  jb_str(b, d->mw_check);
}

/* The memory windows: in use or not, what that means, and how many. */
static void inspect_windows(jbuf *b, const rdma_transport *rt) {
  static const char *const modes[] = {"auto", "on", "off"};
  bool enforced = rt->mw;
  for (int i = 0; i < rt->n_devs; i++) enforced &= rt->devs[i].mw_bounds == KVF__MW_BOUNDS_ENFORCED;
  size_t binding = 0;
  for (rgrant *g = rt->binding; g; g = g->next_b) binding++;
  jb(b, ", \"memory_windows\": {\"mode\": \"%s\", \"in_use\": %s, \"bounds_enforced\": %s, \"protection\": ",
     modes[kvfd.cfg.rdma_memory_windows % 3], rt->mw ? "true" : "false", enforced ? "true" : "false");
  jb_str(b, rt->protection);
  jb(b, ", \"max_per_grant\": %u, \"live\": %llu, \"bound\": %llu, \"grants\": %llu, \"binding\": %zu, "
        "\"merged_grants\": %llu, \"failed_grants\": %llu, \"bind_us_per_window\": %.2f, "
        "\"last_grant_windows\": %zu, \"last_bind_ms\": %.3f, \"lookups\": %llu, \"searches\": %llu}",
     kvfd.cfg.rdma_mw_max_windows, (unsigned long long)rt->mw_live, (unsigned long long)rt->mw_bound,
     (unsigned long long)rt->mw_grants, binding, (unsigned long long)rt->mw_merged, (unsigned long long)rt->mw_failed,
     per(rt->mw_bind_ns, rt->mw_bound) / 1000.0, rt->last_win, (double)rt->last_bind_ns / 1e6,
     (unsigned long long)rt->mw_lookups, (unsigned long long)rt->mw_searches);
}

static void inspect_devices(jbuf *b, const rdma_transport *rt) {
  jb(b, "\"devices\": [");
  for (int i = 0; i < rt->n_devs; i++) {
    const rdev *d = &rt->devs[i];
    struct ibv_port_attr pa;
    const char *state = ibv_query_port(d->ctx, d->port, &pa) == 0 && pa.state == IBV_PORT_ACTIVE ? "active" : "down";
    char gid[INET6_ADDRSTRLEN];
    inet_ntop(AF_INET6, d->gid.raw, gid, sizeof(gid));
    jb(b, "%s{\"name\": \"%s\", \"port\": %u, \"state\": \"%s\", \"gid\": \"%s\", \"gid_index\": %u, "
          "\"cm\": \"%s:%u\", \"pools_registered\": %zu, \"work_requests\": %llu, \"bytes\": %llu, "
          "\"doorbells\": %llu, \"completions\": %llu, \"notices\": %llu, \"sleeps\": %llu",
       i ? ", " : "", d->name, d->port, state, gid, d->gid_index, d->ip, d->cm_port, kvfd.n_pools,
       (unsigned long long)atomic_load(&d->wrs), (unsigned long long)atomic_load(&d->bytes),
       (unsigned long long)atomic_load(&d->chains), (unsigned long long)atomic_load(&d->cqes),
       (unsigned long long)atomic_load(&d->imms), (unsigned long long)atomic_load(&d->sleeps));
    inspect_device_windows(b, d);
    jb(b, "}");
  }
  jb(b, "]");
}

static void inspect_peers(jbuf *b, const rdma_transport *rt) {
  jb(b, ", \"peers\": [");
  for (size_t i = 0; i < rt->n_peers; i++) {
    rpeer *rp = rt->peers[i];
    jb(b, "%s{\"name\": \"%s\", \"resets\": %u, \"qps\": [", i ? ", " : "", peer_name(rp), rp->resets);
    int k = 0;
    for (int l = 0; l < rp->n_links; l++) {
      rlink *lk = rp->links[l];
      for (unsigned j = 0; j < lk->n_all; j++) {
        rqp *q = lk->all[j];
        if (q->gone) continue;
        jb(b, "%s{\"device\": \"%s\", \"peer_device\": \"%s\", \"qp\": %u, \"dir\": \"%s\", \"state\": \"%s\"}",
           k++ ? ", " : "", lk->dev->name, lk->peer_dev, q->qp_num, q->outbound ? "out" : "in",
           q->established ? "connected" : "connecting");
      }
    }
    jb(b, "]}");
  }
  jb(b, "]");
}

/* The posting cost: on the loop (ticket, slicing, checks) per run, in the
 * progress threads (building work requests, then ibv_post_send, which on
 * soft-RoCE also runs the emulated NIC) per work request. */
static void inspect_post(jbuf *b, const rdma_transport *rt) {
  uint64_t wrs = 0, build = 0, bell = 0;
  for (int i = 0; i < rt->n_devs; i++) {
    wrs += atomic_load(&rt->devs[i].wrs);
    build += atomic_load(&rt->devs[i].build_ns);
    bell += atomic_load(&rt->devs[i].bell_ns);
  }
  jb(b, ", \"post\": {\"calls\": %llu, \"runs\": %llu, \"work_requests\": %llu, \"loop_ns_per_run\": %.1f, "
        "\"build_ns_per_wr\": %.1f, \"doorbell_ns_per_wr\": %.1f, \"last_work_requests\": %llu, "
        "\"last_loop_ns_per_wr\": %.1f, \"last_build_ns_per_wr\": %.1f, \"last_doorbell_ns_per_wr\": %.1f}",
     (unsigned long long)rt->posts, (unsigned long long)rt->post_runs, (unsigned long long)wrs,
     per(rt->post_ns, rt->post_runs), per(build, wrs), per(bell, wrs), (unsigned long long)rt->last_wrs,
     per(rt->last_loop_ns, rt->last_wrs), per(rt->last_build_ns, rt->last_wrs), per(rt->last_bell_ns, rt->last_wrs));
}

static void rdma_inspect(kvf__transport *t, char *buf, size_t len) {
  const rdma_transport *rt = to_rdma(t);
  jbuf b = {buf, len, 0};
  if (len) buf[0] = 0;
  jb(&b, "\"name\": \"rdma\", \"qps_per_peer\": %u, \"queue_depth\": %u, \"slice\": %u, \"inline\": %u, ",
     kvfd.cfg.rdma_qps_per_peer, kvfd.cfg.rdma_queue_depth, kvfd.cfg.rdma_slice, kvfd.cfg.rdma_inline);
  inspect_devices(&b, rt);
  inspect_peers(&b, rt);
  inspect_post(&b, rt);
  size_t parked_n = 0;
  for (parked *pk = rt->parked; pk; pk = pk->next) parked_n++;
  jb(&b, ", \"open_grants\": %zu, \"parked_requests\": %zu", rt->grants.n, parked_n);
  inspect_windows(&b, rt);
}

static const char *rdma_protection(kvf__transport *t) { return to_rdma(t)->protection; }


/* ------------------------------------------------------------ teardown */

static void free_device(rdev *d) {
  for (size_t i = 0; d->mrs && i < kvfd.n_pools; i++)
    if (d->mrs[i]) ibv_dereg_mr(d->mrs[i]);
  free(d->mrs);
  free(d->lkey);
  if (d->ch) ibv_destroy_comp_channel(d->ch);
  if (d->pd) ibv_dealloc_pd(d->pd);
  if (d->efd >= 0) close(d->efd);
  if (d->epfd >= 0) close(d->epfd);
  pthread_mutex_destroy(&d->lock);
  pthread_cond_destroy(&d->cond);
}

/* Before the PDs go: every window deallocated. */
static void free_grants(rdma_transport *rt) {
  for (size_t i = 0; i < rt->grants.nb; i++)
    for (kvf__map_ent *e = rt->grants.b[i]; e; e = e->next)
      if (mw_release(e->val)) free(e->val);
  kvf__map_free(&rt->grants);
  while (rt->zombies) {
    rgrant *g = rt->zombies;
    rt->zombies = g->next_b;
    free(g);
  }
}

static void stop_reaper(rdma_transport *rt) {
  if (!rt->reaper_on) return;
  pthread_mutex_lock(&rt->reap_lock);
  rt->reaper_stop = true;
  pthread_cond_signal(&rt->reap_cond);
  pthread_mutex_unlock(&rt->reap_lock);
  pthread_join(rt->reaper, NULL); /* it destroys what is queued first */
  rt->reaper_on = false;
}

/* The instance is freed once its teardown is over and every handle it
 * closed is closed: libuv touches a handle until its close callback ran. */
static void unref(rdma_transport *rt) {
  if (--rt->closing == 0) free(rt);
}

static void on_closed(uv_handle_t *h) { unref(h->data); }
static void on_mailbox_closed(kvf__mailbox *mb) { unref(kvf__container_of(mb, rdma_transport, mb)); }

static void close_handle(rdma_transport *rt, uv_handle_t *h) {
  h->data = rt;
  rt->closing++;
  uv_close(h, on_closed);
}

static void stop_device(rdev *d) {
  if (d->started) {
    send_cmd(d, CMD_STOP, NULL);
    pthread_join(d->thr, NULL);
    d->started = false;
  }
  if (d->listener) rdma_destroy_id(d->listener);
  d->listener = NULL;
  if (d->async_on) {
    uv_poll_stop(&d->async_poll);
    close_handle(d->rt, (uv_handle_t *)&d->async_poll);
    d->async_on = false;
  }
}

/* Everything, in the order the libraries need: threads off the QPs, QPs and
 * ids before the event channel, MRs before the PD. */
static void teardown(rdma_transport *rt) {
  while (rt->n_peers) rdma_peer_down(&rt->base, rt->peers[0]->p);
  stop_reaper(rt);
  sweep_parked(rt, NULL, true);
  for (int i = 0; i < rt->n_devs; i++) stop_device(&rt->devs[i]);
  if (rt->handles) {
    uv_poll_stop(&rt->cm_poll);
    close_handle(rt, (uv_handle_t *)&rt->cm_poll);
    rt->closing++;
    kvf__mailbox_close(&rt->mb, on_mailbox_closed); /* delivers what is left first */
    uv_timer_stop(&rt->sweep);
    close_handle(rt, (uv_handle_t *)&rt->sweep);
    uv_timer_stop(&rt->mw_timer);
    close_handle(rt, (uv_handle_t *)&rt->mw_timer);
    rt->handles = false;
  }
  free_grants(rt);
  for (int i = 0; i < rt->n_devs; i++) free_device(&rt->devs[i]);
  if (rt->cm) rdma_destroy_event_channel(rt->cm);
  if (rt->all) rdma_free_devices(rt->all);
  free(rt->pool_base);
  free(rt->hmr);
  free(rt->hmr_ptr);
  pthread_mutex_destroy(&rt->reap_lock);
  pthread_cond_destroy(&rt->reap_cond);
}

static void rdma_destroy(kvf__transport *t) {
  rdma_transport *rt = to_rdma(t);
  teardown(rt);
  unref(rt);
}

static const kvf__transport_ops rdma_ops = {
    .name = "rdma",
    .one_sided = true,
    .usable = rdma_usable,
    .post = rdma_post,
    .abort = rdma_abort,
    .xfer_done = rdma_xfer_done,
    .grant_open = rdma_grant_open,
    .grant_close = rdma_grant_close,
    .peer_up = rdma_peer_up,
    .peer_down = rdma_peer_down,
    .hello = rdma_hello,
    .protection = rdma_protection,
    .inspect = rdma_inspect,
    .destroy = rdma_destroy,
};

static void log_devices(const rdma_transport *rt) {
  for (int i = 0; i < rt->n_devs; i++) {
    const rdev *d = &rt->devs[i];
    kvf__info("rdma: device %s port %u, GID[%u] %s, CM listening on %s:%u, %zu pool(s) registered", d->name,
              d->port, d->gid_index, d->ip, d->ip, d->cm_port, kvfd.n_pools);
  }
  if (rt->mw) kvf__info("rdma: writes: %s", rt->protection);
  else kvf__warn("rdma: writes: %s", rt->protection);
}

int kvf__rdma_create(uv_loop_t *loop, unsigned slot, kvf__transport **out, char *err, size_t errlen) {
  rdma_transport *rt = calloc(1, sizeof(*rt));
  if (!rt) return -ENOMEM;
  rt->closing = 1; /* the instance's own, dropped by destroy */
  kvf__transport_init(&rt->base, &rdma_ops, loop, slot);
  pthread_mutex_init(&rt->reap_lock, NULL);
  pthread_cond_init(&rt->reap_cond, NULL);
  int rc = start(rt, err, errlen);
  if (rc == 0) rc = build_hello(rt);
  if (rc) {
    teardown(rt);
    unref(rt);
    return rc;
  }
  log_devices(rt);
  *out = &rt->base;
  return 0;
}
