/* tcp_int.h - what the files of the tcp transport share (tcp.c: ops,
 * events, peers; tcp_send.c: items, writes, staging, senders; tcp_recv.c:
 * receives, grant pinning, layer markers). Private to daemon/transport/tcp/. */
#ifndef KVF_TCP_INT_H
#define KVF_TCP_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

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
  ticket *tk;
  uint64_t handle;
  wr *w;
  size_t n;
  bool gpu;              /* some frames come from GPU memory */
  kvf__tcp_pshare *ps;   /* instead of frames: patterns (tcp_pattern.h) */
  bool marker;           /* a layer marker, no frames and no ticket: */
  uint32_t first, n_layers, streams;
} item;

enum ev_kind { EV_TICKET, EV_LANDED, EV_DATA_ERROR, EV_STREAM_ERROR, EV_COPY_ERROR, EV_STREAM_GONE, EV_LAYERS };

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
  uint64_t total;
  uint64_t landed;
  int writers;
  atomic_bool closed;    /* set under g_lock; a receiver mid-payload reads it without */
  lmark *marks;          /* layer markers not yet seen on every stream */
  size_t n_marks;
  uint64_t first_ns;     /* the first batch for it read (g_lock) */
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

typedef struct stream {
  struct tcp_peer *tp;
  uint32_t index;
  int fd;                /* outbound: from socket() on, so peer_down can shut it */
  bool connected;        /* outbound: its handshake done (tp->lock) */
  pthread_t thr;
  bool started;
  item *head, *tail;     /* sender queue */
  pthread_cond_t cond;   /* sender: signalled when its queue grows or the peer stops */
  bool outbound;
  struct stream *next_in;/* inbound list */
  gstage *stage;         /* GPU staging, made at the first GPU frame */
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
  atomic_uint posts;     /* items queued ever: what a spinning sender watches */
} tcp_peer;

struct tcp_transport {
  kvf__transport base;
  kvf__mailbox mb;         /* threads -> loop: tevents */
  pthread_mutex_t g_lock;  /* grants */
  pthread_cond_t g_cond;
  kvf__map grants;         /* handle -> rgrant */
  uint64_t gen;
  _Atomic uint64_t pat_batches, pat_pieces, pat_sent; /* pattern batches read, their pieces; patterns sent */
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
void kvf__tcp_item_free(item *it);
void kvf__tcp_stage_free(gstage *g);
gstage *kvf__tcp_stage_get(stream *s);
void *kvf__tcp_sender_main(void *arg);
int kvf__tcp_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last);
int kvf__tcp_post_blocks(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last);
bool kvf__tcp_mark_layers(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n);
void kvf__tcp_abort(kvf__transport *t, kvf__xfer *x);

/* tcp_recv.c */
void *kvf__tcp_receiver_main(void *arg);

#endif
