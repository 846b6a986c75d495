/* rdma_int.h - the rdma transport's one private header: the constants and
 * types its files share, and the kvf__rdma_ functions that cross them.
 * Only the files of this folder include it (and bench/post_bench.c, which
 * times the posting code without a device); the daemon sees rdma.h.
 *
 * The objects, from the instance down:
 *   rdma_transport  the instance (embeds kvf__transport; to_rdma())
 *   rdev            a device port we use: PD, MRs of every pool, CM
 *                   listener, completion channel, progress thread
 *   rpeer           a peer that is up (in the peer's slot: rpeer_of()):
 *                   its queues of tickets, its pools, one rlink per rdev
 *   rlink           a peer on one of our devices: its CQ(s) and QPs
 *   rqp             one RC queue pair, dialed (we write) or accepted
 *                   (the peer's completion notices; window binds)
 *   ticket          one ops->post call, queued on the rpeer
 *   xstate          per transfer (x->tp_state), across its tickets
 *   rgrant          a grant this side accepts writes for (memory windows)
 *   tevent          what a thread hands to the loop (mailbox.h)
 *
 * Who touches what: the loop owns the CM, the peers, the grants and the
 * windows; a device's progress thread owns the send and receive queues and
 * the CQs of its links once they are published to it; fields say "(loop)",
 * "(qlock)" or "thread" where that matters. */
#ifndef KVF_RDMA_INT_H
#define KVF_RDMA_INT_H

#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>

#include "auth.h"
#include "map.h"
#include "rdma.h"
#include "rdma_mw.h"
#include "sbuf.h"
#include "xfer.h"
#include "cuda/gpu.h"
#include "kv_xform.h"

#define MAX_DEVS 8
#define MAX_QPS 128             /* per link: dialed and accepted */
#define CHAIN_MAX 32            /* work requests per ibv_post_send (one doorbell) */
#define GATHER_MAX 32           /* scatter/gather entries per work request at most (the
                                   device's max_sge below that): runs that land back to
                                   back go as one write gathering their sources */
#define CHAIN_BYTES (1u << 20)  /* a chain that gathers ends at this many bytes:
                                   several chains stay in flight within QP_WINDOW */
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
/* Runs that are strided (desc.h: kvf__runs' unit and step): a run reads
 * len / unit pieces, one scatter/gather entry each. unit 0: plain runs. */
typedef struct rstride {
  uint64_t unit, step;
} rstride;

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
  /* The bounce path (rdma_bounce.c): runs staged through pinned memory,
   * claimed a chunk at a time by the thread of the lane's QP */
  bool bounce;
  struct xbounce *xb;           /* the receiver stages too (its grant's slots); else NULL */
  /* A chunk of a staged part (rdma_stage.c): its layers are noted to the
   * receiver once written; the part is called back once all its chunks are */
  struct sgroup *grp;           /* NULL: the ticket is the whole post */
  uint32_t grp_first, grp_n;
  bool gather;                  /* some body runs land back to back: requests gather them */
  rstride stride;               /* strided runs (kvf__runs' unit, step); unit 0: plain */
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
  struct xbounce *xb;           /* the receiver's staging slots, once a post needed them */
  uint64_t wrs, loop_ns, build_ns, bell_ns; /* posting cost, summed over its tickets (loop) */
};

typedef struct inflight {       /* one posted chain */
  ticket *tk;
  uint64_t seq;                 /* wr_id of its last, signalled, work request */
  uint32_t wrs;                 /* send queue slots it holds */
  uint32_t runs;                /* body runs it completes */
  bool tail;
  uint64_t bytes;
  int32_t chunk;                /* the bounce chunk it holds (-1: none) */
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
  uint32_t max_sge;             /* per work request (GATHER_MAX at most; 1: no gathering) */
  bool gathered;                /* the last chain changed the template's lists */
  uint32_t sq_cap, sq_used;
  uint64_t bytes_out;           /* in flight */
  _Atomic uint64_t wrs, bytes;  /* posted on it, all told (status: how a transfer spread) */
  uint32_t rq_cap, rq_posted;
  uint64_t seq;
  inflight *ring;
  uint32_t ring_head, ring_n;
  struct ibv_send_wr wr[CHAIN_MAX];
  /* the chain's entries, each request's after the one before it (one
   * entry each, as most chains have, share the cache lines they had) */
  struct ibv_sge sge[CHAIN_MAX * GATHER_MAX];
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
  bool *pool_bounce;            /* its NICs do not reach the pool: writes go through its staging */
  uint64_t up_ns;               /* the current set of QPs was dialed */
  bool said_ready;
  bool degraded;                /* said that some links stay down */
  bool resetting;               /* kvf__rdma_reset_peer is dropping its links */
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
  uint32_t max_cqe, max_qp_wr, max_sge;
  uint32_t write_sge;           /* entries a write takes on every dialed QP so far (loop; GATHER_MAX at most) */
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
  /* The bounce path's staging (rdma_bounce.c): one registered area, the
   * sending chunks first (the thread's own), then the receiving slots
   * (given to grants by the loop, under rt->bounce.lock). */
  struct {
    uint8_t *mem;
    uint64_t alias;             /* its device address when CUDA maps it; 0: not */
    size_t len, chunk;          /* chunk: a sending chunk's and a receiving slot's size */
    struct ibv_mr *mr;
    uint32_t n_tx, n_rx;
    int32_t *free_tx;           /* thread: free sending chunks (a stack) */
    uint32_t n_free;
    uint8_t *rx_used;           /* per receiving slot (bounce.lock) */
    atomic_uint_fast64_t tx_bytes, tx_chunks, rx_bytes, rx_chunks, credits, stalls;
  } bb;
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
  bool lost;                    /* bound windows that went with a reset: the grant fails */
  unsigned tries;
  uint64_t since_ns;
  struct rgrant *next_b;        /* rt->mw.binding, or rt->mw.zombies once closed */
  uint64_t st_off, st_len;      /* its slice of the staging arena (rdma_stage.c); st_len 0: none */
  uint32_t st_done;             /* granted layers the staging pass placed */
  uint64_t st_landed_ns;        /* the last write's notice came while passes ran */
  struct spass *passes;         /* transform passes running (rdma_stage.c) */
  struct kvf__sgpu *st_gpu;     /* a cuda pool's: what its GPU passes share (from the first note) */
  struct bgrant *bg;            /* the bounce path: its staging slots (receiver) */
  struct xbounce *credit_of;    /* not a grant: the token of a send's credits (sender) */
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

/* The instance: reached from the kvf__transport every op gets (to_rdma).
 * Loop-owned unless a field says otherwise. */
struct rdma_transport {
  kvf__transport base;
  /* devices (rdma_dev.c) */
  rdev devs[MAX_DEVS];
  int n_devs;
  struct ibv_context **all;     /* librdmacm's device list */
  uint8_t **pool_base;          /* pool memory, by pool id */
  bool *pool_bounce;            /* pool not registered with the NICs: staged (rdma_bounce.c) */
  size_t n_pool_slots;          /* length of the per-pool arrays (pool_base, pool_bounce, mrs, lkey):
                                   KVF__POOLS_MAX, so that engine memory never moves them */
  size_t n_hello_pools;         /* our pools the Hello lists (the config's) */
  bool any_gpu;                 /* some pool of ours is GPU memory */
  /* connections (rdma_conn.c) */
  struct rdma_event_channel *cm;
  uv_poll_t cm_poll;
  uv_timer_t sweep;
  rpeer *peers[KVF__MAX_PEERS_CFG]; /* every peer up, for the sweeps (each also in its peer's slot) */
  size_t n_peers;
  uint64_t gen;                 /* incarnations of peers' data paths */
  parked *parked;
  kvf__map grants;              /* "%08x" token -> rgrant */
  /* The reaper destroys dead links' QPs, ids and CQs: with the path gone
   * rdma_destroy_id can block for seconds, which the loop must not. */
  struct {
    pthread_t thr;
    bool on, stop;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    rlink *head;                /* links to destroy (lock) */
  } reaper;
  /* our Hello's rdma part, pointing into devs (kvf__rdma_build_hello) */
  struct {
    Kvf__RdmaInfo info;
    Kvf__RdmaDevice dev[MAX_DEVS];
    Kvf__RdmaDevice *dev_ptr[MAX_DEVS];
    Kvf__RdmaMr *mr;            /* n_devs x pools */
    Kvf__RdmaMr **mr_ptr;
  } hello;
  /* posting (rdma_post.c) */
  kvf__mailbox mb;              /* threads -> loop: tevents, tickets */
  ticket *live;                 /* tickets not yet called back */
  struct {
    uint64_t calls, runs, ns;   /* loop-side cost of ops->post */
    /* the last finished transfer's posting cost, summed over its tickets
     * (a chained send posts one per frame) */
    uint64_t last_wrs, last_loop_ns, last_build_ns, last_bell_ns;
  } post;
  /* the staging arena of transforms (rdma_stage.c): host memory, each
   * device's MR of it in mrs[KVF__RDMA_STAGE_POOL]; extents by offset */
  struct {
    uint8_t *mem;
    size_t len;
    uint64_t alias;             /* its device address when CUDA maps it (GPU passes); 0: not */
    struct { uint64_t off, len; } *used;
    size_t n_used, cap_used;
    uint64_t grants, refused, staged_parts, chunks, passes, pass_ns, bytes;
    uint64_t strided_parts;     /* transforms written directly in strided runs instead */
    uint64_t tail_ns;           /* passes still running after the last write landed, summed */
    uint64_t gpu_passes;        /* ... of them by the transform kernel, into cuda pools */
  } stage;
  /* memory windows (rdma_mw.c) */
  char protection[400];         /* one line for status, doctor and the log */
  struct {
    bool on;                    /* in use: pools take no remote writes but through them */
    char why[200];              /* why not, when not */
    rgrant *binding;            /* grants whose windows are being bound */
    rgrant *zombies;            /* closed grants with binds still in flight */
    bool lost_pending;          /* grants lost their windows in a reset: fail them */
    uv_timer_t timer;
    bool timer_on;
    uint64_t live, bound, grants, merged, failed, bind_ns;
    uint64_t lookups, searches; /* sender: runs' windows looked up; of those, not by window_of */
    size_t last_win;
    uint64_t last_bind_ns;
  } mw;
  /* the bounce path (rdma_bounce.c) */
  struct {
    pthread_mutex_t lock;       /* rx, devices' rx_used; held by a thread while it copies into a grant */
    struct bgrant *rx;          /* receiving grants with staging slots */
    atomic_uint n_rx;
    struct bgrant *waiting;     /* (loop) grants waiting for slots, oldest first */
    uv_timer_t timer;           /* slots came free: the waiting grants take them */
    uint64_t grants, sends, waits;
  } bounce;
  /* lifetime (rdma.c) */
  bool handles;                 /* the handles above are initialised */
  unsigned closing;             /* references: the instance's own, and handles whose close callback is due */
};

/* ------------------------------------------------------------ small helpers */

static inline rdma_transport *to_rdma(kvf__transport *t) { return kvf__container_of(t, rdma_transport, base); }

/* The peer's state: in its slot for this transport (NULL: not up here). */
static inline rpeer *rpeer_of(rdma_transport *rt, const kvf__peer *p) { return kvf__transport_peer(&rt->base, p); }

static inline const char *peer_name(const rpeer *rp) { return rp->p->cfg.name; }

/* The key of a grant in rt->grants: the token its final write carries. */
static inline void grant_key(char *buf, size_t len, uint32_t token) { snprintf(buf, len, "%08x", token); }

static inline uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline int set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  return fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 ? -errno : 0;
}

static inline void set_port(struct sockaddr_storage *ss, uint16_t port) {
  if (ss->ss_family == AF_INET6) ((struct sockaddr_in6 *)ss)->sin6_port = htons(port);
  else ((struct sockaddr_in *)ss)->sin_port = htons(port);
}

/* ------------------------------------------------------------ rdma_post.c
 * Posting (loop side), the progress threads, and events to the loop. */

void kvf__rdma_calibrate_clock(void);
uint64_t kvf__rdma_fast_ns(void);
/* A chain of n work requests in q->wr (last->next NULL) completing runs
 * body runs of tk (or the tail), holding bounce chunk (-1: none). */
int kvf__rdma_doorbell(rlink *lk, rqp *q, ticket *tk, size_t n, uint32_t runs, bool tail, uint64_t t0,
                       uint64_t bytes, int32_t chunk);
/* A signalled request posted with wr_id ++q->seq, in flight (tk NULL: no
 * ticket's, e.g. a bounce credit). */
void kvf__rdma_ring_push(rqp *q, ticket *tk, uint32_t wrs, uint32_t runs, bool tail, uint64_t bytes,
                         int32_t chunk);
/* From any thread: the loop resets the peer's data path (if still that
 * incarnation). */
void kvf__rdma_fail_peer_soon(rpeer *rp, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* k parts of tk are over (status 0: completed); the last queues its
 * callback. Any thread. */
void kvf__rdma_credit(ticket *tk, size_t k, int status);
void kvf__rdma_wake(rdev *d);
void kvf__rdma_threads_wake(void *rt); /* spin.h's windows: every started device's thread */
/* Takes back what of tk no thread has claimed; returns how many parts.
 * qlock held (or no thread left on rp). */
size_t kvf__rdma_take_back(rpeer *rp, ticket *tk);
int kvf__rdma_post_recvs(rqp *q, uint32_t n);
/* The send chain template of a dialed QP, and filling it (post_bench
 * times these without a device). Runs runs[order[first..first + n)] (or
 * without order, runs[first..first + n)) go as work requests of up to
 * q->max_sge entries: a run whose bytes land right after the one before it
 * (same remote memory and key) joins its request, as one more entry or, when
 * its source follows too, a longer one; a request stays within rdma-slice
 * bytes, and a chain that gathers ends at CHAIN_BYTES. kvf__rdma_span
 * says how many runs from first make at most max_wrs requests (what a
 * thread claims for the room in its send queue); kvf__rdma_build_chain
 * builds them, the same requests, into q->wr and returns their bytes, the
 * number of requests in *wrs; without gathering (the ticket has no runs back
 * to back: ticket.gather), a request a run, n of them. Strided runs (st
 * not NULL, unit set) take an entry a piece, never extended, and gather. */
void kvf__rdma_init_chain(rqp *q);
size_t kvf__rdma_span(const rqp *q, const kvf__run *runs, const uint32_t *order, const uint32_t *rkeys,
                      const rstride *st, size_t first, size_t avail, size_t max_wrs);
uint64_t kvf__rdma_build_chain(rlink *lk, rqp *q, const kvf__run *runs, const uint32_t *order, size_t first,
                               size_t n, const uint32_t *rkeys, const rstride *st, bool gathering, size_t *wrs);
void kvf__rdma_restore_chain(rqp *q, size_t n);
void *kvf__rdma_progress_main(void *arg);
void kvf__rdma_send_cmd(rdev *d, int kind, rlink *lk);
/* Returns once the device thread no longer touches lk. */
void kvf__rdma_detach_and_wait(rlink *lk);
/* slice: the most bytes a run may have (rdma-slice; less when it bounces). */
/* staged: the receiver stages them (its pools need not be known here). */
int kvf__rdma_check_runs(const rpeer *rp, const kvf__runs *runs, uint64_t slice, bool staged, size_t *extra);
ticket *kvf__rdma_ticket_new(rdma_transport *rt, kvf__xfer *x, kvf__runs *runs, uint64_t slice, size_t extra,
                             bool last);
void kvf__rdma_ticket_free(ticket *tk);
xstate *kvf__rdma_xstate_of(kvf__xfer *x);
int kvf__rdma_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last);
/* The same as one chunk, layers [first, first + n), of a staged part
 * (rdma_stage.c): called back through kvf__rdma_stage_chunk_done. */
int kvf__rdma_post_chunk(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last, struct sgroup *grp,
                         uint32_t first, uint32_t n);
void kvf__rdma_abort(kvf__transport *t, kvf__xfer *x);
void kvf__rdma_xfer_done(kvf__transport *t, kvf__xfer *x);

/* ------------------------------------------------------------ rdma_conn.c
 * The CM, queue pairs, peers, the Hello. */

bool kvf__rdma_usable(kvf__transport *t, kvf__peer *p);
int kvf__rdma_peer_up(kvf__transport *t, kvf__peer *p);
void kvf__rdma_peer_down(kvf__transport *t, kvf__peer *p);
void kvf__rdma_reset_peer(rpeer *rp, const char *why);
void kvf__rdma_on_cm_readable(uv_poll_t *h, int status, int events);
void kvf__rdma_on_sweep(uv_timer_t *tm);
/* Parked CM requests of adopt (accepted) or too old (rejected; all of
 * them with drop_all). */
void kvf__rdma_sweep_parked(rdma_transport *rt, rpeer *adopt, bool drop_all);
void *kvf__rdma_reaper_main(void *arg);
int kvf__rdma_build_hello(rdma_transport *rt);
void kvf__rdma_hello(kvf__transport *t, Kvf__Hello *h);

/* ------------------------------------------------------------ rdma_dev.c
 * Devices: discovery, registration, listeners, threads, async events. */

int kvf__rdma_open_devices(rdma_transport *rt, char *err, size_t errlen);
int kvf__rdma_check_memlock(const rdma_transport *rt, char *err, size_t errlen);
int kvf__rdma_setup_device(rdev *d, char *err, size_t errlen);
int kvf__rdma_register_pools(rdev *d, char *err, size_t errlen);
int kvf__rdma_register_pool(rdev *d, kvf__pool *p, char *err, size_t errlen);
int kvf__rdma_start_listener(rdev *d, uint16_t port, char *err, size_t errlen);
void kvf__rdma_relisten(rdev *d);
int kvf__rdma_start_thread(rdev *d, char *err, size_t errlen);
void kvf__rdma_on_dev_async(uv_poll_t *h, int status, int events);
void kvf__rdma_free_device(rdev *d);
void kvf__rdma_addr_text(const struct sockaddr_storage *ss, char *buf, size_t len);

/* ------------------------------------------------------------ rdma_mw.c
 * Memory windows (rdma_mw.h has their records and planning). */

int kvf__rdma_decide_windows(rdma_transport *rt, char *err, size_t errlen);
int kvf__rdma_grant_open(kvf__transport *t, kvf__xfer *x);
void kvf__rdma_grant_close(kvf__transport *t, kvf__xfer *x);
/* Before the PDs go: every grant closed, every window deallocated. */
void kvf__rdma_free_grants(rdma_transport *rt);
/* Sender: each run of tk through its window, lane by lane. */
int kvf__rdma_ticket_windows(ticket *tk, const rpeer *rp, const kvf__xfer *x, xstate *xs);
void kvf__rdma_wtable_free(wtable *t);
rqp *kvf__rdma_window_qp(const rpeer *rp, const kvf__mw_rec *w);
/* Room for a Grant's window records and each descriptor's window. */
int kvf__rdma_grant_part_alloc(kvf__tp_grant *t, size_t n_win, size_t n_desc);
void kvf__rdma_accepted_ready(rqp *q);
void kvf__rdma_mw_forget_link(rlink *lk);

/* ------------------------------------------------------------ rdma_bounce.c
 * The bounce path: pools the NICs do not reach, staged through pinned
 * host memory registered once per device. */

#define BOUNCE_HDR 4096u        /* a slot's header: where its runs go; data follows */
#define BOUNCE_MAGIC 0x4b564242u
#define BOUNCE_REC_POOL UINT32_MAX /* Grant.windows: the record of the receiver's slots */
#define KVF__MR_REC_POOL (UINT32_MAX - 1) /* Grant.windows: a pool's MR (rdma_engine.c) */

/* Sender, per transfer whose receiver stages too: its grant's slots. */
typedef struct xbounce {
  uint64_t addr;                /* the first slot, on the receiver's device */
  uint32_t rkey;
  uint32_t slot, n_slots;       /* slot: a slot's size */
  uint16_t dev;                 /* the receiver's device, by index in its Hello */
  uint32_t token;               /* the grant's, for the chunks' immediates */
  uint32_t credit;              /* ours, that the receiver's credits carry */
  atomic_int credits;           /* slots free at the receiver */
  uint32_t next;                /* the next slot (the pinned QP's thread) */
  rqp *q;                       /* every chunk and the tail go on it, */
  int qdev;                     /* found again by (device, number) at each post */
  uint32_t qpn;
  rdma_transport *rt;
} xbounce;

/* Receiver, per grant with slots. */
typedef struct bgrant {
  struct bgrant *next;          /* rt->bounce.rx, or .waiting while no slot is free */
  struct rgrant *g;
  kvf__xfer *x;
  bool waiting;
  kvf__peer *peer;
  uint32_t token;
  rdev *dev;
  uint32_t first, n;            /* its slots */
  uint32_t next_slot;           /* the slot the next chunk fills (thread) */
  uint32_t credit;              /* the sender's token for credits (from the first chunk) */
  uint32_t owed;                /* credits not yet posted (no room on a QP) */
  kvf__rangeset rs;             /* where its chunks may go */
} bgrant;

bool kvf__rdma_pool_wants_bounce(const kvf__pool *p);
int kvf__rdma_bounce_setup(rdev *d, char *err, size_t errlen);
void kvf__rdma_bounce_free(rdev *d);
/* Receiver: a grant to pools some of which bounce gets slots (1), or waits
 * for them (2: kvf__xfer_on_grant_ready follows), or is not a bounce grant
 * (0), or an error. */
void kvf__rdma_on_bounce_timer(uv_timer_t *tm);
int kvf__rdma_bounce_grant_open(rgrant *g, kvf__xfer *x);
void kvf__rdma_bounce_grant_close(rgrant *g);
/* Receiver thread: a WRITE_WITH_IMM with data landed; true when it was a
 * bounce chunk (copied to its grant, and credited). */
bool kvf__rdma_bounce_chunk(rlink *lk, uint32_t imm);
void kvf__rdma_bounce_pay_credits(rlink *lk);
/* Loop: a credit for one of our sends. */
void kvf__rdma_bounce_credit(rdma_transport *rt, rgrant *marker);
/* Sender (loop, post): whether runs bounce, and *cap, the most bytes a
 * run may have then (the caller slices them). */
bool kvf__rdma_bounce_wanted(const rpeer *rp, const kvf__xfer *x, const kvf__runs *runs, uint64_t *cap);
/* Whether x's grant names the receiver's staging slots. */
bool kvf__rdma_bounce_staged(const kvf__xfer *x);
/* Makes tk a bounce ticket: its lane (or *windows: take the lanes of the
 * grant's memory windows), and the receiver's slots when it stages too. */
int kvf__rdma_bounce_ticket(ticket *tk, rpeer *rp, kvf__xfer *x, xstate *xs, bool *windows);
void kvf__rdma_bounce_xstate_free(rdma_transport *rt, xstate *xs);
/* Sender thread: posts up to a chunk of tk's runs [first, first + cnt) of
 * its lane (order) through a free chunk of lk's device. */
int kvf__rdma_bounce_post(rlink *lk, rqp *q, ticket *tk, size_t first, size_t cnt);
/* How many of tk's next runs (from first, in order) fit one chunk. */
size_t kvf__rdma_bounce_fit(const rdev *d, const ticket *tk, size_t first, size_t avail);
void kvf__rdma_bounce_chunk_free(rdev *d, int32_t chunk);

/* ------------------------------------------------------------ rdma_engine.c
 * Pools after start (engine memory). */

int kvf__rdma_pool_added(kvf__transport *t, kvf__pool *p, char *err, size_t errlen);
void kvf__rdma_pool_removed(kvf__transport *t, kvf__pool *p);
/* Receiver: MR records for the grant's pools our Hello did not list. */
int kvf__rdma_grant_add_mrs(rdma_transport *rt, kvf__xfer *x);
/* Sender: how many of the Grant's records are memory windows (the MR and
 * bounce records follow them); learning the MR records. */
size_t kvf__rdma_window_records(const kvf__tp_grant *g);
int kvf__rdma_learn_mrs(rpeer *rp, const kvf__xfer *x);

/* ------------------------------------------------------------ rdma_stage.c */

/* The staging arena's slot in the per-pool tables (one past the pools':
 * engine memory never takes it). Its window records name this pool with
 * absolute addresses (its base is 0), so a sender writes into it through
 * the window alone. */
#define KVF__RDMA_STAGE_POOL KVF__POOLS_MAX
#define KVF__RDMA_SLOTS (KVF__POOLS_MAX + 1)

int kvf__rdma_stage_setup(rdma_transport *rt, char *err, size_t errlen);
void kvf__rdma_stage_free(rdma_transport *rt);
/* Receiver: a slice for g's grant when it may need a transform pass (a
 * grant of blocks of stated geometry into host memory, with windows); none
 * when the arena has no room (the sender then writes directly). */
void kvf__rdma_stage_reserve(rgrant *g, kvf__xfer *x);
void kvf__rdma_stage_release(rdma_transport *rt, uint64_t off, uint64_t len);
/* The grant closes: waits for its passes still running, detaches them. */
typedef struct spass spass;
typedef struct sgroup sgroup;
void kvf__rdma_stage_detach(rgrant *g);
/* Receiver: appends g's slice to its planned windows, one per lane (the peer's QPs) at least. */
int kvf__rdma_stage_window(rgrant *g, size_t lanes);
/* Sender: cuts the runs that cross one of cuts (ascending) there, in order. */
int kvf__rdma_cut_runs(kvf__runs *runs, const uint64_t *cuts, size_t n_cuts);
/* Sender: post_blocks, staging what would be small writes. */
int kvf__rdma_post_blocks(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last);
/* Sender, a staged part: say the transform owes nothing more (each chunk
 * was noted as it completed; ops->mark_layers). */
bool kvf__rdma_mark_layers(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n);
/* Sender: a chunk's ticket is done (status st): its note, and the part's
 * callback once it was the last. */
void kvf__rdma_stage_chunk_done(struct sgroup *g, kvf__xfer *x, uint32_t first, uint32_t n, int st);
/* Receiver: the last write of g's grant landed (its notice). */
void kvf__rdma_stage_landed(rgrant *g);
/* Receiver: the sender's note that layers of a staged part landed. */
int kvf__rdma_unstage(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n, const kvf__xstaged *st,
                      char *why, size_t len);

/* Receiver, a grant of a cuda pool: its passes run the transform kernel
 * (kvf_xblocks) on the pool's GPU, reading the slice in the staging arena,
 * which CUDA maps (kvf__gpu_xblocks_from_host), one launch per noted chunk.
 * What they share, made at the grant's first note (the sender's staged
 * heads set the slice's layout): the plan slice -> grant, the slice's view
 * and its offsets, also on the GPU. kvf__rdma_sgpu_job: the launch's job
 * for layers [first, first + n) of the slice at device address slice into
 * dst, the grant's side from layer first (kvf__gpu_bside). The GPU test
 * (tests/gpu/gpu_stage.c) runs these as the daemon does;
 * tests/unit/test_rdma_stage_job.c runs the jobs' plans on the CPU. */
typedef struct kvf__sgpu {
  kvf__xstaged st;
  kvf__xplan p;
  kvf__lview sv;
  uint64_t *offs;               /* sv's offsets (owned) */
  uint32_t *ids;                /* the slice's block ids, 0..nd-1 (owned) */
  void *table;                  /* offs on the GPU (kvf__gpu_layout_upload) */
} kvf__sgpu;
int kvf__rdma_sgpu_make(const kvf__lview *gv, size_t nd, const kvf__xstaged *st, int dev, kvf__sgpu *s);
/* The same without the GPU's copy of the offsets (table NULL): for tests
 * that run a job's plan on the CPU. */
int kvf__rdma_sgpu_plan(const kvf__lview *gv, size_t nd, const kvf__xstaged *st, kvf__sgpu *s);
void kvf__rdma_sgpu_free(kvf__sgpu *s);
void kvf__rdma_sgpu_job(const kvf__sgpu *s, uint64_t slice, const kvf__gpu_bside *dst, uint32_t first, uint32_t n,
                        kvf__gpu_blocks *j);

/* ------------------------------------------------------------ rdma_status.c */

void kvf__rdma_inspect(kvf__transport *t, char *buf, size_t len);
void kvf__rdma_metrics(kvf__sbuf *b);

#endif
