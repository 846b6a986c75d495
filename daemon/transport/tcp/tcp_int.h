/* tcp_int.h - what the files of the tcp transport share (tcp.c: ops,
 * events, peers; tcp_send.c: items, writes, staging, senders; tcp_recv.c:
 * receives, grant pinning, layer markers). Private to daemon/transport/tcp/. */
#ifndef KVF_TCP_INT_H
#define KVF_TCP_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <ucontext.h>

#include "tcp.h"
#include "cuda/gpu.h"
#include "map.h"
#include "mailbox.h"
#include "peer.h"
#include "xfer.h"
#include "tcp_wire.h"
#include "tcp_pattern.h"

#define MAX_STREAMS 64              /* tcp-streams is capped here */
#define STAGE_SLOT (4u << 20)       /* a GPU staging slot; >= SLICE */
#define SMALL_POST (128u << 10)     /* a post up to this goes on one stream (deal_frames) */
/* A GPU copy failed (internal): fails the transfer, not the stream. */
#define GPU_COPY_FAILED (-EREMOTEIO)
/* An item's source memory faulted under writev (engine memory whose file
 * shrank): the batch went out with zeros in its place, the stream is in
 * step, the item fails with -EFAULT. */
#define SOURCE_FAULT (-EFAULT)
/* read_exact: the grant being read into closed; the rest of the payload
 * (*rest bytes) is still to be read, into a sink. */
#define PAYLOAD_SUNK 1
/* How long a receiver's recv waits before it looks whether the grant it
 * reads into closed (a stalled or lossy stream must not pin a closed
 * grant's memory: tcp_grant_close would have to cut every stream). */
#define RECV_CHECK_MS 50
/* A grant's batch this long after its last one starts a new part: a
 * layer-wise send's part after a layer's compute (145 us and up), where a
 * stream's batches come microseconds apart. */
#define PART_GAP_US 50
/* Fairness across peers: a sender worker writes about this much of one
 * stream before it takes the next stream in the run queue; a receiver
 * worker reads about this much of one stream before it serves the others
 * ready on its epoll set. */
#define SEND_QUANTUM (2u << 20)
#define RECV_QUANTUM (2u << 20)
/* Longest a sender worker spends connecting a stream (and its handshake):
 * meanwhile it serves no other stream. */
#define CONNECT_MS 3000
/* Stack of an inbound stream's receive (a coroutine, tcp_recv.c): its
 * deepest path of ours (a pattern batch, read_exact, a discard) takes under
 * 80 KiB, but GPU staging calls into the CUDA driver and logging into
 * libsystemd on it; only the pages touched are resident (MAP_NORESERVE).
 * Sanitizers need more. */
#if defined(__SANITIZE_ADDRESS__)
#define RECV_STACK (4u << 20)
#else
#define RECV_STACK (1u << 20)
#endif
#define RECV_GUARD 4096u            /* of RECV_STACK: its lowest page, never mapped */
/* iovecs a read_exact takes at most (and one for the read-ahead: IOV_MAX
 * a recvmsg) */
#define RECV_IOVS 1023
_Static_assert(RECV_IOVS >= BATCH_FRAMES + 2, "a batch's payloads are read in one read_exact");

_Static_assert(BHDR_LEN == KVF__TCP_BATCH_HDR && ENT_LEN == KVF__TCP_BATCH_ENT &&
                   BATCH_FRAMES == KVF__TCP_BATCH_MAX,
               "transport.h's batch constants differ from tcp.c's");

/* ---------------------------------------------------- work and completions */

/* One kvf__transport_ops.post call: done when every stream finished its
 * share. */
typedef struct tcp_transport tcp_transport;

typedef struct ticket {
  tcp_transport *tt;
  kvf__xfer *x;
  bool last;
  atomic_int outstanding;
  atomic_int status;
  atomic_bool aborted;
  _Atomic uint64_t first_ns, done_ns; /* first byte handed to a socket, last written */
} ticket;

typedef struct wr {      /* one data frame to write */
  const uint8_t *src;    /* host memory, or a device address when dev >= 0 */
  uint32_t dst_pool;
  uint32_t len;
  uint64_t dst_off;
  int dev;               /* -1: host; else the GPU holding src */
} wr;

typedef struct item {    /* a stream's share of one post */
  struct item *next;
  size_t pos;            /* the next frame or pattern to write (a quantum ended in it) */
  ticket *tk;
  uint64_t handle;
  wr *w;
  size_t n;
  bool gpu;              /* some frames come from GPU memory */
  bool sealed;           /* its batches go with BATCH_SEALED (tcp_wire.h) */
  kvf__tcp_pshare *ps;   /* instead of frames: patterns (tcp_pattern.h) */
  bool marker;           /* a layer marker, no frames and no ticket: */
  uint32_t first, n_layers, streams;
} item;

enum ev_kind {
  EV_TICKET, EV_LANDED, EV_DATA_ERROR, EV_STREAM_ERROR, EV_COPY_ERROR, EV_STREAM_GONE, EV_LAYERS,
  EV_STARTED /* a grant's first batch was read */
};

typedef struct tevent {
  kvf__mail mail;
  tcp_transport *tt;
  int kind;
  ticket *tk;
  uint64_t handle;
  int status;
  kvf__peer *peer;
  uint64_t gen;
  void *stream;          /* EV_STREAM_GONE: the inbound stream to reap */
  uint32_t first, n;     /* EV_LAYERS: the layers that landed */
  uint64_t t_first, t_last; /* EV_LANDED: the grant's first byte read, its last landed */
  bool sealed;           /* EV_LANDED: every batch of the grant came sealed */
} tevent;

/* Receiver: a layer marker seen on some of its streams. */
typedef struct lmark {
  uint32_t first, n, seen;
} lmark;

/* Receiver side: what a grant accepts. */
typedef struct rgrant {
  kvf__xfer *x;
  kvf__peer *peer;
  kvf__rangeset rs;
  kvf__tcp_rindex ix;    /* over rs, for pattern boxes */
  uint64_t total;
  uint64_t landed;
  int writers;
  atomic_bool closed;    /* set under g_lock; a receiver mid-payload reads it without */
  lmark *marks;          /* layer markers not yet seen on every stream */
  size_t n_marks;
  uint64_t first_ns;     /* the first batch for it read (g_lock) */
  bool unsealed;         /* some batch for it came without BATCH_SEALED (g_lock) */
  uint64_t last_batch_ns;/* the last batch for it read (g_lock) */
  uint64_t soon_until_ns;/* its engine was told Soon for the rest, until then (loop) */
  uint64_t part_ns;      /* the batch that started its last part (after a pause), read then (g_lock) */
  uint64_t part_landed;  /* its bytes landed before that batch: the last part's rate is the wire's (g_lock) */
  bool soon;             /* its engine takes a Soon: the first batch read says so (EV_STARTED),
                          * and each that comes PART_GAP_US after the one before (a new part) */
} rgrant;

/* Receiver: a batch with payloads staged for a GPU; it lands (unpins its
 * grant) once read whole and every staged piece of it is in the GPU. */
typedef struct sbatch {
  rgrant *g;
  uint64_t handle;
  uint64_t bytes;
  int pieces;            /* staged pieces not yet copied, +1 while reading */
  int status;            /* a copy failed */
} sbatch;

/* Pinned staging for GPU pools: two slots per stream, used by its thread. */
typedef struct sslot {
  uint8_t *host;         /* STAGE_SLOT bytes, pinned and device-mapped */
  uint64_t dev;          /* the same memory as kernels address it */
  kvf__gpu_batch *b;
  uint64_t used;
  bool busy;             /* a copy was launched and not yet waited for */
  size_t first, n;       /* sender: frames [first, first + n) of the item */
  uint64_t off[BATCH_FRAMES]; /* sender: where each frame sits in the slot */
  sbatch *owner[BATCH_FRAMES]; /* receiver: the batch of each staged piece */
  size_t n_pieces;
} sslot;

typedef struct gstage {
  sslot slot[2];
  int cur;
} gstage;

enum { RQ_IDLE, RQ_QUEUED, RQ_RUNNING }; /* an outbound stream in the run queue (rq_lock) */

struct rworker;

typedef struct stream {
  struct tcp_peer *tp;
  uint32_t index;
  int fd;                /* outbound: from socket() on, so peer_down can shut it */
  bool connected;        /* outbound: its handshake done (tp->lock) */
  item *head, *tail;     /* sender queue (tp->lock) */
  bool outbound;
  struct stream *next_in;/* inbound list */
  gstage *stage;         /* GPU staging, made at the first GPU frame */
  /* outbound, for the sender workers (tcp_send.c): */
  int sched;             /* RQ_* (the transport's rq_lock) */
  struct stream *next_run; /* run queue link (rq_lock) */
  item *cur;             /* the item a quantum ended in (its worker's; peer_down's once idle) */
  int broken;            /* its connect or a write failed: the rest of its items fail */
  bool hello_sent;       /* connect_stream got as far as the handshake */
  /* inbound, for the receiver workers (tcp_recv.c): */
  struct rworker *w;     /* the worker whose epoll set holds it */
  struct stream *next_w, *next_ready, *next_new; /* the worker's lists (its own) */
  ucontext_t co;         /* the receive's coroutine: it parks where a read would block */
  void *stack;
  bool on_ready;         /* in the worker's ready list (yielded with data left) */
  bool finished;         /* the coroutine returned */
  bool watch;            /* mid-payload with a grant pinned: resumed every RECV_CHECK_MS */
  bool done;             /* its worker let go of it (tp->lock): peer_down or reap frees it */
  uint64_t quantum;      /* bytes read since it was last resumed */
  uint8_t *bounce;       /* pattern pieces' bounce buffer (tcp_pattern.h): its own, since
                          * the streams of a worker interleave mid-read */
} stream;

typedef struct tcp_peer {
  tcp_transport *tt;
  kvf__peer *p;
  uint64_t gen;
  atomic_bool stop;
  stream *out;           /* tcp-streams outbound streams */
  uint32_t n_out;
  uint32_t rr;           /* next stream for round robin */
  stream *in;            /* inbound streams */
  pthread_mutex_t lock;  /* queues of out[] and the in list */
  pthread_cond_t in_done;/* an inbound stream's worker let go of it */
} tcp_peer;

struct tcp_transport {
  kvf__transport base;
  kvf__mailbox mb;         /* threads -> loop: tevents */
  pthread_mutex_t g_lock;  /* grants */
  pthread_cond_t g_cond;
  kvf__map grants;         /* handle -> rgrant */
  uint64_t gen;
  _Atomic uint64_t pat_batches, pat_pieces, pat_sent; /* pattern batches read, their pieces; patterns sent */
  kvf__tcp_pspare spare;   /* items' pattern arrays, for the next deal */
  /* The workers (tcp-threads a side): sending, a run queue of outbound
   * streams with items; receiving, an epoll set each. */
  unsigned n_workers;
  pthread_t *senders;
  unsigned n_senders;      /* started */
  pthread_mutex_t rq_lock;
  pthread_cond_t rq_cond;  /* workers: the run queue grew, or stop */
  pthread_cond_t rq_idle;  /* peer_down: a stream stopped running */
  stream *rq_head, *rq_tail;
  atomic_uint rq_len;      /* streams queued (changed under rq_lock): what a polling worker watches */
  unsigned rq_polling;     /* workers polling the queue instead of sleeping (rq_lock) */
  unsigned rq_max_polling; /* at most this many poll at once (kvf__tcp_senders_start) */
  atomic_bool rq_stop;     /* set under rq_lock; polling workers read it without */
  struct rworker *receivers;
  unsigned n_receivers;    /* started */
  atomic_uint rw_next;     /* round robin of new inbound streams */
  double recv_ns_per_byte; /* the last grant that landed: first batch read to last byte (loop); 0: none yet */
};

static inline tcp_transport *to_tcp(kvf__transport *t) { return kvf__container_of(t, tcp_transport, base); }

static inline tcp_peer *tcp_peer_of(tcp_transport *tt, const kvf__peer *p) {
  return kvf__transport_peer(&tt->base, p);
}


/* tcp.c */
void kvf__tcp_push_event(tcp_transport *tt, tevent *e);
/* tp: the peer the event is about; NULL for a ticket's completion. */
void kvf__tcp_post_event(tcp_transport *tt, int kind, ticket *tk, uint64_t handle, int status, tcp_peer *tp);
void kvf__tcp_ticket_part_done(ticket *tk, int status);

/* tcp_send.c */
void kvf__tcp_item_free(tcp_transport *tt, item *it);
void kvf__tcp_stage_free(gstage *g);
gstage *kvf__tcp_stage_get(stream *s);
/* The sender workers; the run queue (an outbound stream queued for its
 * connect, at peer up, or for its items); a stopping peer's streams out of
 * it, waiting for those running (tp->stop set and their fds shut down). */
int kvf__tcp_senders_start(tcp_transport *tt);
void kvf__tcp_senders_stop(tcp_transport *tt);
void kvf__tcp_senders_wake(void *tt);   /* spin.h's send window opened */
void kvf__tcp_stream_schedule(stream *s); /* the caller holds tp->lock */
void kvf__tcp_streams_unschedule(tcp_peer *tp);
int kvf__tcp_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last);
int kvf__tcp_post_blocks(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last);
bool kvf__tcp_mark_layers(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n);
void kvf__tcp_abort(kvf__transport *t, kvf__xfer *x);

/* tcp_recv.c */
/* The receiver workers; an adopted inbound stream handed to one of them
 * (it sends the ACK and reads); waits (tp->lock held) until s's worker let
 * go of it. */
int kvf__tcp_receivers_start(tcp_transport *tt);
void kvf__tcp_receivers_stop(tcp_transport *tt);
void kvf__tcp_receivers_wake(void *tt); /* spin.h's receive window opened */
int kvf__tcp_stream_hand(tcp_transport *tt, stream *s);
void kvf__tcp_stream_wait_done(tcp_peer *tp, stream *s);
unsigned kvf__tcp_workers(void); /* tcp-threads, 0 resolved (tcp_send.c) */

#endif
