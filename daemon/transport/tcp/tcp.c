/* tcp.c - the tcp transport: one-sided writes over plain TCP.
 *
 * Each daemon opens tcp-streams data connections to each peer it sends to;
 * a connection starts with a framed DataHello and then carries only data
 * frames: a fixed 32-byte header naming (grant handle, pool, offset, length)
 * in the receiver's space, followed by the payload. The receiver reads each
 * payload straight into pool memory, after checking that the range lies
 * inside the grant that handle names and that the grant belongs to the peer
 * that owns the connection. No intermediate buffer on either side. A
 * transform between KV layouts goes in pattern batches (tcp_pattern.h: one
 * entry for a chunk's strided pieces, placed as they are read) to a peer
 * whose Hello says it reads them.
 *
 * Threads: one sender thread per outbound stream (blocking writev from pool
 * memory, many frames per call) and one receiver thread per inbound stream.
 * They never touch loop state: results go to the loop through the
 * transport's mailbox (mailbox.h), and the loop calls back into xfer.c.
 *
 * State: the instance (tcp_transport, reached from the kvf__transport that
 * every op gets) holds the grants this side accepts writes for; each peer's
 * streams hang in the peer's tcp slot (tcp_peer).
 *
 * GPU pools (path "tcp-bounce"): the CPU cannot touch cuda pool memory, so
 * each stream stages through two pinned host slots (gstage). Sending, one
 * batched kernel launch gathers a slot's frames from the GPU while the
 * previous slot's batch is written to the socket. Receiving, GPU-bound
 * payloads are read into a slot; when it is full, or the socket has nothing
 * more to read, one launch scatters it into the GPU while the other slot
 * fills. A batch counts as landed only once its copies into the GPU are
 * complete. */
#include "tcp.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "auth.h"
#include "cuda/gpu.h"
#include "frame.h"
#include "layout.h"
#include "map.h"
#include "peer.h"
#include "pool.h"
#include "xfer.h"
#include "xfer_trace.h"
#include "tcp_wire.h"
#include "tcp_pattern.h"
#include "tcp_io.h"
#include "spin.h"

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
  bool sealed;           /* its batches go with BATCH_SEALED (tcp_wire.h) */
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
  uint64_t total;
  uint64_t landed;
  int writers;
  atomic_bool closed;    /* set under g_lock; a receiver mid-payload reads it without */
  lmark *marks;          /* layer markers not yet seen on every stream */
  size_t n_marks;
  uint64_t first_ns;     /* the first batch for it read (g_lock) */
  bool unsealed;         /* some batch for it came without BATCH_SEALED (g_lock) */
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

static tcp_transport *to_tcp(kvf__transport *t) { return kvf__container_of(t, tcp_transport, base); }

static tcp_peer *tcp_peer_of(tcp_transport *tt, const kvf__peer *p) {
  return kvf__transport_peer(&tt->base, p);
}

static void on_event(kvf__mail *m);

static void push_event(tcp_transport *tt, tevent *e) {
  e->tt = tt;
  kvf__mailbox_post(&tt->mb, &e->mail, on_event);
}

/* tp: the peer the event is about; NULL for a ticket's completion. */
static void post_event(tcp_transport *tt, int kind, ticket *tk, uint64_t handle, int status, tcp_peer *tp) {
  tevent *e = calloc(1, sizeof(*e));
  if (!e) abort(); /* a lost completion would hang a transfer: fail loudly */
  e->kind = kind;
  e->tk = tk;
  e->handle = handle;
  e->status = status;
  e->peer = tp ? tp->p : NULL;
  e->gen = tp ? tp->gen : 0;
  push_event(tt, e);
}

static void ticket_part_done(ticket *tk, int status) {
  if (status) {
    int zero = 0;
    atomic_compare_exchange_strong(&tk->status, &zero, status);
  }
  if (atomic_fetch_sub(&tk->outstanding, 1) > 1) return;
  atomic_store(&tk->done_ns, kvf__now_ns());
  post_event(tk->tt, EV_TICKET, tk, 0, 0, NULL);
}

/* EV_LANDED, with the grant's first and last byte's times. */
static void post_landed(tcp_peer *tp, uint64_t handle, uint64_t first_ns, bool sealed) {
  tevent *e = calloc(1, sizeof(*e));
  if (!e) abort(); /* as post_event */
  *e = (tevent){.kind = EV_LANDED, .handle = handle, .peer = tp->p, .gen = tp->gen, .t_first = first_ns,
                .t_last = kvf__now_ns(), .sealed = sealed};
  push_event(tp->tt, e);
}

static void item_free(item *it) {
  free(it->w);
  if (it->ps) kvf__tcp_pshare_free(it->ps);
  free(it->ps);
  free(it);
}


/* --------------------------------------------------------- sender threads */

/* Writes an item's patterns as pattern batches (tcp_pattern.h). */
static int write_item_pat(stream *s, item *it) {
  uint8_t hdr[BHDR_LEN], ents[BATCH_FRAMES * KVF__TCP_PAT_ENT];
  struct iovec *iov = malloc(KVF__TCP_PAT_IOVS * sizeof(*iov));
  int rc = iov ? 0 : -ENOMEM;
  for (size_t i = 0; rc == 0 && i < it->ps->n;) {
    if (atomic_load(&it->tk->aborted) || atomic_load(&s->tp->stop)) rc = KVF_ECANCELED;
    uint64_t bytes;
    int n = rc ? 0 : kvf__tcp_pat_batch(it->ps, &i, it->handle, hdr, ents, iov, &bytes);
    bool faulted = false;
    if (rc == 0) rc = kvf__tcp_writev_all(s->fd, iov, n, &faulted);
    if (rc == 0 && faulted) rc = SOURCE_FAULT; /* at a batch's end: the stream is in step */
  }
  free(iov);
  return rc;
}

/* Writes an item's frames as batches, one writev each. */
static int write_item(stream *s, item *it) {
  if (it->ps) return write_item_pat(s, it);
  uint8_t hdr[BHDR_LEN], ents[BATCH_FRAMES][ENT_LEN];
  struct iovec iov[BATCH_FRAMES + 2];
  for (size_t i = 0; i < it->n;) {
    if (atomic_load(&it->tk->aborted) || atomic_load(&s->tp->stop)) return KVF_ECANCELED;
    uint32_t k = 0;
    for (; k < BATCH_FRAMES && i < it->n; k++, i++) {
      const wr *w = &it->w[i];
      ent_encode(ents[k], w->dst_pool, w->len, w->dst_off);
      iov[2 + k] = (struct iovec){(void *)w->src, w->len};
    }
    bhdr_encode(hdr, k, it->handle, it->sealed);
    iov[0] = (struct iovec){hdr, BHDR_LEN};
    iov[1] = (struct iovec){ents, (size_t)k * ENT_LEN};
    bool faulted = false;
    int rc = kvf__tcp_writev_all(s->fd, iov, (int)k + 2, &faulted);
    if (rc) return rc;
    if (faulted) return SOURCE_FAULT; /* at a batch's end: the stream is in step */
  }
  return 0;
}

/* A layer marker: header and its one entry. */
static int write_marker(stream *s, const item *it) {
  uint8_t buf[BHDR_LEN + ENT_LEN];
  put32(buf, LAYER_MAGIC);
  put32(buf + 4, it->streams);
  put64(buf + 8, it->handle);
  ent_encode(buf + BHDR_LEN, it->first, it->n_layers, 0);
  struct iovec iov = {buf, sizeof(buf)};
  return kvf__tcp_writev_all(s->fd, &iov, 1, NULL);
}

/* ------------------------------------------------------- GPU staging */

static void stage_free(gstage *g) {
  if (!g) return;
  for (int i = 0; i < 2; i++) {
    sslot *sl = &g->slot[i];
    if (sl->busy) kvf__gpu_batch_wait(sl->b);
    kvf__gpu_batch_free(sl->b);
    kvf__gpu_host_free(sl->host);
  }
  free(g);
}

static gstage *stage_get(stream *s) {
  if (s->stage) return s->stage;
  gstage *g = calloc(1, sizeof(*g));
  if (!g) return NULL;
  for (int i = 0; i < 2; i++) {
    sslot *sl = &g->slot[i];
    sl->host = kvf__gpu_host_alloc(STAGE_SLOT, &sl->dev);
    if (!sl->host || kvf__gpu_batch_new(&sl->b) != 0) {
      kvf__warn("tcp: cannot set up pinned staging for GPU memory on stream %u", s->index);
      stage_free(g);
      return NULL;
    }
  }
  s->stage = g;
  return g;
}

/* Sender: gathers the next frames of it (from *i on) into sl, launching one
 * copy for those in GPU memory; host frames are written from where they are. */
static int stage_fill(item *it, size_t *i, sslot *sl) {
  kvf__gpu_batch_reset(sl->b);
  sl->first = *i;
  sl->n = 0;
  sl->used = 0;
  while (*i < it->n && sl->n < BATCH_FRAMES) {
    const wr *w = &it->w[*i];
    if (w->dev >= 0) {
      if (sl->used + w->len > STAGE_SLOT) break;
      int rc = kvf__gpu_batch_add(sl->b, w->dev, (uint64_t)(uintptr_t)w->src, sl->dev + sl->used, w->len);
      if (rc) return rc;
      sl->off[sl->n] = sl->used;
      sl->used += w->len;
    }
    sl->n++;
    (*i)++;
  }
  int rc = kvf__gpu_batch_launch(sl->b);
  sl->busy = rc == 0;
  return rc;
}

/* Sender: waits for sl's copy, then writes its frames as one batch. */
static int stage_send(stream *s, item *it, sslot *sl) {
  uint8_t hdr[BHDR_LEN], ents[BATCH_FRAMES][ENT_LEN];
  struct iovec iov[BATCH_FRAMES + 2];
  sl->busy = false;
  if (kvf__gpu_batch_wait(sl->b) != 0) return GPU_COPY_FAILED;
  for (size_t k = 0; k < sl->n; k++) {
    const wr *w = &it->w[sl->first + k];
    ent_encode(ents[k], w->dst_pool, w->len, w->dst_off);
    iov[2 + k] = (struct iovec){w->dev >= 0 ? sl->host + sl->off[k] : (void *)w->src, w->len};
  }
  bhdr_encode(hdr, (uint32_t)sl->n, it->handle, it->sealed);
  iov[0] = (struct iovec){hdr, BHDR_LEN};
  iov[1] = (struct iovec){ents, sl->n * ENT_LEN};
  bool faulted = false;
  int rc = kvf__tcp_writev_all(s->fd, iov, (int)sl->n + 2, &faulted);
  return rc ? rc : faulted ? SOURCE_FAULT : 0;
}

/* write_item for items with GPU frames: the gather into one slot overlaps
 * the socket write of the other. */
static int write_item_staged(stream *s, item *it) {
  gstage *g = stage_get(s);
  if (!g) return GPU_COPY_FAILED;
  size_t i = 0;
  int cur = 0, rc = 0;
  bool pending = false;
  while (rc == 0 && (i < it->n || pending)) {
    if (atomic_load(&it->tk->aborted) || atomic_load(&s->tp->stop)) {
      rc = KVF_ECANCELED;
      break;
    }
    bool filled = false;
    if (i < it->n) {
      rc = stage_fill(it, &i, &g->slot[cur]) ? GPU_COPY_FAILED : 0;
      filled = rc == 0;
    }
    if (rc == 0 && pending) rc = stage_send(s, it, &g->slot[cur ^ 1]);
    pending = filled;
    cur ^= 1;
  }
  for (int k = 0; k < 2; k++) /* nothing may still write into a slot */
    if (g->slot[k].busy) {
      g->slot[k].busy = false;
      kvf__gpu_batch_wait(g->slot[k].b);
    }
  return rc;
}

/* Longest a data stream may make no progress before it counts as broken. */
#define STREAM_STALL_MS 10000u

/* s->fd is fd (or -1), under the peer's lock: a peer_down meanwhile shuts
 * it down, which ends a connect or handshake blocked on it at once (the
 * loop joins this thread). false: the peer is already stopping. */
static bool stream_fd_publish(stream *s, int fd) {
  pthread_mutex_lock(&s->tp->lock);
  bool go = fd < 0 || !atomic_load(&s->tp->stop);
  s->fd = go ? fd : -1;
  pthread_mutex_unlock(&s->tp->lock);
  return go;
}

static int connect_fail(stream *s, int fd, int rc) {
  stream_fd_publish(s, -1);
  close(fd);
  return rc;
}

static int connect_stream(stream *s) {
  kvf__peer *p = s->tp->p;
  int fd = socket(p->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  if (!stream_fd_publish(s, fd)) {
    close(fd);
    return KVF_EPEERLOST;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  /* A peer that stops reading must not hold a sender thread forever. The
   * bound is not peer-timeout-ms: the control connection says whether the
   * peer lives (and its loss shuts these streams down), while a lossy
   * network stalls a bulk stream's connect and writes for seconds of TCP
   * backoff after it heals, and that must not take a live peer down. */
  uint32_t stall_ms = kvfd.cfg.peer_timeout_ms > STREAM_STALL_MS ? kvfd.cfg.peer_timeout_ms : STREAM_STALL_MS;
  struct timeval tv = {.tv_sec = stall_ms / 1000, .tv_usec = (stall_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (connect(fd, (struct sockaddr *)&p->addr, p->addrlen) != 0) return connect_fail(s, fd, -errno);
  Kvf__DataHello dh = KVF__DATA_HELLO__INIT;
  dh.version = KVF__PEER_VERSION;
  dh.node = kvfd.cfg.node;
  dh.session = p->remote_session;
  dh.stream = s->index;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_DATA_HELLO;
  m.data_hello = &dh;
  int rc = kvf__tcp_send_msg(fd, &m);
  if (rc == 0 && kvf__auth_enabled()) rc = kvf__tcp_answer_challenge(fd, p, s->index);
  if (rc == 0) rc = kvf__tcp_await_ack(fd);
  if (rc) return connect_fail(s, fd, rc);
  pthread_mutex_lock(&s->tp->lock);
  s->connected = true;
  pthread_mutex_unlock(&s->tp->lock);
  return 0;
}

/* This thread's last activity (moved data), for spin.h's window. */
static _Thread_local uint64_t thread_last_ns;

/* Waits for s's next item: polls the queue while spin.h's window is open
 * (the next part of a handoff is likely soon), then sleeps on the cond. */
static item *next_item(stream *s) {
  tcp_peer *tp = s->tp;
  pthread_mutex_lock(&tp->lock);
  while (!s->head && !atomic_load(&tp->stop) && kvf__spin_open(KVF__SPIN_SEND, thread_last_ns)) {
    unsigned seen = atomic_load(&tp->posts);
    pthread_mutex_unlock(&tp->lock);
    while (atomic_load(&tp->posts) == seen && !atomic_load(&tp->stop) &&
           kvf__spin_open(KVF__SPIN_SEND, thread_last_ns))
      kvf__spin_relax();
    pthread_mutex_lock(&tp->lock);
  }
  while (!s->head && !atomic_load(&tp->stop)) pthread_cond_wait(&s->cond, &tp->lock);
  item *it = s->head;
  if (it && !atomic_load(&tp->stop)) {
    s->head = it->next;
    if (!s->head) s->tail = NULL;
  } else {
    it = NULL;
  }
  pthread_mutex_unlock(&tp->lock);
  return it;
}

static void *sender_main(void *arg) {
  stream *s = arg;
  int broken = connect_stream(s);
  if (broken) post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, broken, s->tp);
  item *it;
  while ((it = next_item(s)) != NULL) {
    if (it->marker) { /* no ticket: a lost marker fails the peer, so the grant */
      int rc = broken ? 0 : write_marker(s, it);
      if (rc && !broken) post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, broken = rc, s->tp);
      item_free(it);
      continue;
    }
    uint64_t none = 0;
    atomic_compare_exchange_strong(&it->tk->first_ns, &none, kvf__now_ns());
    int rc = broken ? KVF_EPEERLOST : it->gpu ? write_item_staged(s, it) : write_item(s, it);
    bool item_only = rc == KVF_ECANCELED || rc == GPU_COPY_FAILED || rc == SOURCE_FAULT; /* the stream is fine */
    if (rc && !item_only && !broken) {
      broken = rc;
      post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, rc, s->tp);
    }
    ticket_part_done(it->tk, rc == 0 ? 0 : rc == GPU_COPY_FAILED ? -EIO : item_only ? rc : KVF_EPEERLOST);
    item_free(it);
    thread_last_ns = kvf__now_ns();
  }
  return NULL;
}

/* ------------------------------------------------------- receiver threads */

/* One recvmsg. With spin (waiting for a batch's header: a handoff starts
 * there), while spin.h's window is open (data moved on this thread lately,
 * or a grant here waits for its data), it polls without blocking first, so
 * that the data does not wait for this thread to wake. Within a payload it
 * blocks: a bulk stream's wake-ups are few and its CPU is better spent on
 * the copies. */
static int recv_some(int fd, struct iovec *iov, int n, bool spin) {
  struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
  for (;;) {
    ssize_t r = recvmsg(fd, &msg, MSG_DONTWAIT);
    while (spin && r < 0 && errno == EAGAIN && kvf__spin_open(KVF__SPIN_RECV, thread_last_ns)) {
      kvf__spin_relax();
      r = recvmsg(fd, &msg, MSG_DONTWAIT);
    }
    if (r < 0 && errno == EAGAIN) r = recvmsg(fd, &msg, 0);
    if (r > 0) thread_last_ns = kvf__now_ns();
    if (r > 0) return (int)r;
    if (r == 0) return -ECONNRESET;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return -EAGAIN; /* RECV_CHECK_MS passed */
    if (errno != EINTR) return -errno;
  }
}

static int discard(int fd, uint64_t len, uint8_t *ahead, uint32_t *have);

static uint64_t iov_bytes(const struct iovec *v, int n) {
  uint64_t sum = 0;
  for (int i = 0; i < n; i++) sum += v[i].iov_len;
  return sum;
}

/* Fills iov[0..n) completely, and opportunistically the start of the next
 * batch header into ahead (saving a syscall per batch). ahead NULL: the
 * stream continues with bytes that belong elsewhere, so read nothing more.
 * With faulted: an element whose memory faults (EFAULT: an engine's file
 * shrank; the kernel leaves the bytes it could not place in the socket) is
 * read into a sink instead, and *faulted says so: the stream stays in step.
 * With gone: once it is set (the grant closed), PAYLOAD_SUNK with *rest
 * the bytes not read yet: the caller lets go of the grant first, since
 * reading the rest can take as long as the stream stalls. */
static int read_exact(int fd, struct iovec *iov, int n, uint8_t *ahead, uint32_t *have, bool *faulted,
                      const atomic_bool *gone, uint64_t *rest) {
  struct iovec local[RECV_IOVS + 1];
  memcpy(local, iov, (size_t)n * sizeof(*iov));
  int cnt = n;
  if (ahead) local[cnt++] = (struct iovec){ahead, BHDR_LEN};
  struct iovec *v = local;
  int left = n; /* iovecs that must be filled */
  while (left > 0) {
    if (gone && atomic_load(gone)) {
      *rest = iov_bytes(v, left);
      return PAYLOAD_SUNK;
    }
    /* after a fault, one element at a time, so that it is found */
    int r = recv_some(fd, v, faulted && *faulted ? 1 : cnt, false);
    if (r == -EAGAIN) continue;
    if (r == -EFAULT && faulted && !*faulted) {
      *faulted = true;
      continue;
    }
    if (r == -EFAULT && faulted) {
      r = discard(fd, v->iov_len, NULL, NULL);
      if (r) return r;
      v++;
      cnt--;
      left--;
      continue;
    }
    if (r < 0) return r;
    size_t got = (size_t)r;
    while (got > 0 && left > 0) {
      size_t take = got < v->iov_len ? got : v->iov_len;
      v->iov_base = (uint8_t *)v->iov_base + take;
      v->iov_len -= take;
      got -= take;
      if (v->iov_len == 0) {
        v++;
        cnt--;
        left--;
      }
    }
    if (got > 0) *have = (uint32_t)got; /* the read-ahead buffer took it */
  }
  return 0;
}

static int read_header(int fd, uint8_t *hdr, uint32_t *have) {
  while (*have < BHDR_LEN) {
    struct iovec iov = {hdr + *have, BHDR_LEN - *have};
    int r = recv_some(fd, &iov, 1, true);
    if (r == -EAGAIN) continue;
    if (r < 0) return r;
    *have += (uint32_t)r;
  }
  return 0;
}

static int discard(int fd, uint64_t len, uint8_t *ahead, uint32_t *have) {
  static uint8_t sink[64 << 10]; /* contents never read */
  while (len > 0) {
    uint64_t k = len < sizeof(sink) ? len : sizeof(sink);
    struct iovec iov = {sink, k};
    int rc = read_exact(fd, &iov, 1, k == len ? ahead : NULL, have, NULL, NULL, NULL);
    if (rc) return rc;
    len -= k;
  }
  return 0;
}

/* The open grant of handle that tp's peer may write into, or NULL; the
 * caller holds g_lock. */
static rgrant *open_grant_of(tcp_peer *tp, uint64_t handle) {
  char key[KVF__MAP_KEY_U64];
  kvf__map_key_u64(key, handle);
  rgrant *g = kvf__map_get(&tp->tt->grants, key);
  return g && !g->closed && g->peer == tp->p ? g : NULL;
}

/* Looks up and pins the grant a batch writes into; NULL when the batch must
 * be discarded. A batch with any entry outside its grant fails that grant.
 * The entries are e, or for a pattern batch pe. */
static rgrant *pin_grant(tcp_peer *tp, const batch_hdr *h, batch_ent *e, kvf__tcp_pat *pe) {
  tcp_transport *tt = tp->tt;
  pthread_mutex_lock(&tt->g_lock);
  rgrant *g = open_grant_of(tp, h->handle);
  uint32_t bad = !g ? h->count : pe ? kvf__tcp_pat_first_outside(&g->rs, pe, h->count)
                                    : first_outside(&g->rs, e, h->count);
  if (bad < h->count) {
    kvf__warn("peer %s wrote outside grant %016llx (pool %u offset %llu%s): refused", tp->p->cfg.name,
              (unsigned long long)h->handle, pe ? pe[bad].pool : e[bad].pool,
              (unsigned long long)(pe ? pe[bad].off : e[bad].offset), pe ? ", a pattern" : "");
    post_event(tt, EV_DATA_ERROR, NULL, h->handle, KVF_EPERM, tp);
    g = NULL;
  }
  if (g) g->writers++;
  if (g && !h->sealed) g->unsealed = true;
  if (g && !g->first_ns) g->first_ns = kvf__now_ns();
  pthread_mutex_unlock(&tt->g_lock);
  return g;
}

static void unpin_grant(rgrant *g, tcp_peer *tp, uint64_t handle, uint64_t len) {
  tcp_transport *tt = tp->tt;
  pthread_mutex_lock(&tt->g_lock);
  g->writers--;
  g->landed += len;
  if (!g->closed && g->landed == g->total) post_landed(tp, handle, g->first_ns, !g->unsealed);
  if (g->closed && g->writers == 0) pthread_cond_broadcast(&tt->g_cond);
  pthread_mutex_unlock(&tt->g_lock);
}

/* Reads and checks a batch's entries; *bytes is the payload that follows. */
static int read_entries(stream *s, const batch_hdr *h, batch_ent *e, uint64_t *bytes) {
  int rc = check_header(h);
  if (rc) return rc;
  uint8_t raw[BATCH_FRAMES][ENT_LEN];
  struct iovec iov = {raw, (size_t)h->count * ENT_LEN};
  rc = read_exact(s->fd, &iov, 1, NULL, NULL, NULL, NULL, NULL);
  if (rc) return rc;
  return decode_entries(&raw[0][0], h->count, e, bytes);
}

/* ---- receiving into GPU pools (staged) */

/* One piece of b is done (or, with the reading guard, b is read whole);
 * the last one lands b. status: 0, -EIO a GPU copy failed (the grant
 * fails), KVF_EPEERLOST the stream broke (the peer fails anyway). */
static void sbatch_piece_done(stream *s, sbatch *b, int status) {
  if (status && !b->status) b->status = status;
  if (--b->pieces > 0) return;
  if (b->status == -EIO) post_event(s->tp->tt, EV_COPY_ERROR, NULL, b->handle, -EIO, s->tp);
  unpin_grant(b->g, s->tp, b->handle, b->status ? 0 : b->bytes);
  free(b);
}

/* Completes slot sl's copy into the GPU (fail: it never ran). */
static void rstage_complete(stream *s, sslot *sl, bool fail) {
  int rc = fail ? -EIO : 0;
  if (sl->busy) {
    sl->busy = false;
    if (kvf__gpu_batch_wait(sl->b) != 0) rc = -EIO;
  }
  for (size_t i = 0; i < sl->n_pieces; i++) sbatch_piece_done(s, sl->owner[i], rc);
  sl->n_pieces = 0;
  sl->used = 0;
  kvf__gpu_batch_reset(sl->b);
}

/* Starts the current slot's copy and moves to the other slot, completing
 * the copy that last used it. */
static void rstage_flush(stream *s, gstage *g) {
  sslot *sl = &g->slot[g->cur];
  if (sl->n_pieces && !sl->busy) {
    if (kvf__gpu_batch_launch(sl->b) == 0) sl->busy = true;
    else rstage_complete(s, sl, true);
  }
  g->cur ^= 1;
  rstage_complete(s, &g->slot[g->cur], false);
}

/* Everything read so far lands before the thread blocks or leaves. */
static void rstage_drain(stream *s) {
  gstage *g = s->stage;
  if (!g || (!g->slot[0].n_pieces && !g->slot[1].n_pieces)) return;
  rstage_flush(s, g);
  rstage_complete(s, &g->slot[g->cur ^ 1], false);
}

/* Nothing more to read right now (so staged GPU data should land). */
static bool socket_idle(int fd, uint32_t have) {
  int avail = 0;
  return have < BHDR_LEN && (ioctl(fd, FIONREAD, &avail) != 0 || avail == 0);
}

/* A batch with entries in GPU pools: GPU payloads are read into the
 * staging slots (as many per readv as fit), host ones straight into pool
 * memory; a full slot is launched while the other fills. */
static int receive_batch_gpu(stream *s, const batch_hdr *h, const batch_ent *e, rgrant *g, uint64_t bytes,
                             uint8_t *ahead, uint32_t *have) {
  gstage *st = stage_get(s);
  sbatch *b = st ? calloc(1, sizeof(*b)) : NULL;
  if (!b) {
    unpin_grant(g, s->tp, h->handle, 0);
    post_event(s->tp->tt, EV_COPY_ERROR, NULL, h->handle, -ENOMEM, s->tp);
    return discard(s->fd, bytes, ahead, have);
  }
  *b = (sbatch){.g = g, .handle = h->handle, .bytes = bytes, .pieces = 1};
  struct iovec iov[BATCH_FRAMES];
  int rc = 0;
  uint32_t i = 0;
  while (i < h->count && rc == 0) {
    sslot *sl = &st->slot[st->cur];
    int n = 0;
    while (i < h->count) {
      kvf__pool *pool = kvfd.pools[e[i].pool]; /* in range: the rangeset held it */
      if (!kvf__pool_gpu(pool)) {
        iov[n++] = (struct iovec){pool->base + e[i].offset, e[i].len};
      } else {
        if (sl->used + e[i].len > STAGE_SLOT || sl->n_pieces == BATCH_FRAMES) break;
        iov[n++] = (struct iovec){sl->host + sl->used, e[i].len};
        if (kvf__gpu_batch_add(sl->b, pool->cuda_dev, sl->dev + sl->used,
                               (uint64_t)(uintptr_t)pool->base + e[i].offset, e[i].len) == 0) {
          sl->owner[sl->n_pieces++] = b;
          b->pieces++;
        } else {
          b->status = -EIO;
        }
        sl->used += e[i].len;
      }
      i++;
    }
    if (n) rc = read_exact(s->fd, iov, n, i == h->count ? ahead : NULL, have, NULL, NULL, NULL);
    if (i < h->count) rstage_flush(s, st); /* the slot is full */
  }
  sbatch_piece_done(s, b, rc ? KVF_EPEERLOST : 0); /* read whole (or not) */
  return rc;
}

static int receive_batch(stream *s, const batch_hdr *h, uint8_t *ahead, uint32_t *have) {
  batch_ent e[BATCH_FRAMES];
  uint64_t bytes;
  int rc = read_entries(s, h, e, &bytes);
  if (rc) return rc;
  rgrant *g = pin_grant(s->tp, h, e, NULL);
  if (!g) return discard(s->fd, bytes, ahead, have);
  for (uint32_t i = 0; i < h->count; i++)
    if (kvf__pool_gpu(kvfd.pools[e[i].pool])) return receive_batch_gpu(s, h, e, g, bytes, ahead, have);
  struct iovec iov[BATCH_FRAMES];
  for (uint32_t i = 0; i < h->count; i++) /* in range: the rangeset held them */
    iov[i] = (struct iovec){kvfd.pools[e[i].pool]->base + e[i].offset, e[i].len};
  bool faulted = false;
  uint64_t rest = 0;
  rc = read_exact(s->fd, iov, (int)h->count, ahead, have, &faulted, &g->closed, &rest);
  bool sunk = rc == PAYLOAD_SUNK;
  if (rc == 0 && faulted) post_event(s->tp->tt, EV_DATA_ERROR, NULL, h->handle, -EFAULT, s->tp);
  unpin_grant(g, s->tp, h->handle, rc || faulted ? 0 : bytes);
  return sunk ? discard(s->fd, rest, ahead, have) : rc;
}

/* A pattern batch into GPU pools: its pieces go through receive_batch_gpu
 * as plain entries, BATCH_FRAMES at a time, each share pinning g once more
 * (receive_batch_gpu unpins it). */
static int receive_pattern_gpu(stream *s, const batch_hdr *h, const kvf__tcp_pat *pe, rgrant *g,
                               uint8_t *ahead, uint32_t *have) {
  batch_ent e[BATCH_FRAMES];
  uint32_t k = 0, i = 0;
  uint64_t piece = 0, bytes = 0;
  int rc = 0;
  while (rc == 0 && i < h->count) {
    const kvf__tcp_pat *p = &pe[i];
    e[k++] = (batch_ent){p->pool, p->len, p->off + piece / p->n1 * p->s2 + piece % p->n1 * p->s1};
    bytes += p->len;
    if (++piece == (uint64_t)p->n1 * p->n2) piece = 0, i++;
    if (k < BATCH_FRAMES && i < h->count) continue;
    batch_hdr sub = {DATA_MAGIC, k, h->handle, false};
    rc = receive_batch_gpu(s, &sub, e, g, bytes, i == h->count ? ahead : NULL, have);
    k = 0, bytes = 0;
    if (rc == 0 && i < h->count) {
      pthread_mutex_lock(&s->tp->tt->g_lock);
      g->writers++; /* pinned: the grant waits for its writers */
      pthread_mutex_unlock(&s->tp->tt->g_lock);
    }
  }
  return rc;
}

/* A pattern batch (tcp_pattern.h): checked whole, then each entry's pieces
 * read straight where they go (host pools), BATCH_FRAMES iovecs a read. */
static int receive_pattern(stream *s, const batch_hdr *h, uint8_t *ahead, uint32_t *have) {
  uint8_t raw[BATCH_FRAMES * KVF__TCP_PAT_ENT];
  kvf__tcp_pat pe[BATCH_FRAMES];
  uint64_t bytes, landed = 0, rest = 0;
  if (h->count == 0 || h->count > BATCH_FRAMES) return KVF_EPROTO;
  struct iovec iov[RECV_IOVS];
  iov[0] = (struct iovec){raw, (size_t)h->count * KVF__TCP_PAT_ENT};
  int rc = read_exact(s->fd, iov, 1, NULL, NULL, NULL, NULL, NULL);
  if (rc == 0) rc = kvf__tcp_pat_decode(raw, h->count, pe, &bytes);
  if (rc) return rc;
  rgrant *g = pin_grant(s->tp, h, NULL, pe);
  if (!g) return discard(s->fd, bytes, ahead, have);
  atomic_fetch_add(&s->tp->tt->pat_batches, 1);
  uint64_t pieces = 0;
  for (uint32_t i = 0; i < h->count; i++) pieces += (uint64_t)pe[i].n1 * pe[i].n2;
  atomic_fetch_add(&s->tp->tt->pat_pieces, pieces);
  for (uint32_t i = 0; i < h->count; i++)
    if (kvf__pool_gpu(kvfd.pools[pe[i].pool])) return receive_pattern_gpu(s, h, pe, g, ahead, have);
  bool faulted = false;
  kvf__tcp_rplan rp; /* in range: the grant's check held every box */
  kvf__tcp_rplan_init(&rp, pe, h->count);
  for (int n; rc == 0 && (n = kvf__tcp_rplan_step(&rp, iov, RECV_IOVS)) > 0;) {
    uint64_t got = iov_bytes(iov, n);
    rc = read_exact(s->fd, iov, n, kvf__tcp_rplan_done(&rp) ? ahead : NULL, have, &faulted, &g->closed, &rest);
    landed += got;
    if (rc == 0 && kvf__tcp_rplan_scatter(&rp) != 0) faulted = true;
  }
  bool sunk = rc == PAYLOAD_SUNK;
  if (rc == 0 && faulted) post_event(s->tp->tt, EV_DATA_ERROR, NULL, h->handle, -EFAULT, s->tp);
  unpin_grant(g, s->tp, h->handle, rc || faulted ? 0 : bytes);
  return sunk ? discard(s->fd, rest + bytes - landed, ahead, have) : rc;
}

/* The thread of inbound stream s is ending: the loop joins it and frees
 * the stream (reap_stream), unless peer_down gets there first. Without
 * this, a stream the peer closed while we stay up (it tore down an earlier
 * incarnation of its state, e.g. the losing side of a simultaneous dial)
 * kept its fd and memory until our next peer_down. */
static void stream_gone(stream *s) {
  tevent *e = calloc(1, sizeof(*e));
  if (!e) return; /* peer_down frees it */
  e->kind = EV_STREAM_GONE;
  e->stream = s;
  e->peer = s->tp->p;
  e->gen = s->tp->gen;
  push_event(s->tp->tt, e);
}

/* Counts a marker for g; the layers landed once every stream showed it. */
static void count_marker(tcp_peer *tp, rgrant *g, uint64_t handle, uint32_t first, uint32_t n, uint32_t streams) {
  size_t i = 0;
  while (i < g->n_marks && (g->marks[i].first != first || g->marks[i].n != n)) i++;
  if (i == g->n_marks) {
    lmark *nm = realloc(g->marks, (g->n_marks + 1) * sizeof(*nm));
    if (!nm) return; /* the layers are reported with RECV_DONE */
    g->marks = nm;
    g->marks[g->n_marks++] = (lmark){first, n, 0};
  }
  if (++g->marks[i].seen < streams) return;
  g->marks[i] = g->marks[--g->n_marks];
  tevent *e = calloc(1, sizeof(*e));
  if (!e) return;
  *e = (tevent){.kind = EV_LAYERS, .handle = handle, .first = first, .n = n, .peer = tp->p, .gen = tp->gen};
  push_event(tp->tt, e);
}

/* A layer marker: what this stream read before it lands first. */
static int receive_marker(stream *s, const batch_hdr *h, uint8_t *ahead, uint32_t *have) {
  uint8_t raw[ENT_LEN];
  struct iovec iov = {raw, ENT_LEN};
  int rc = read_exact(s->fd, &iov, 1, ahead, have, NULL, NULL, NULL);
  if (rc) return rc;
  batch_ent e;
  ent_decode(raw, &e);
  if (h->count == 0 || h->count > MAX_STREAMS || e.len == 0) return KVF_EPROTO;
  rstage_drain(s);
  tcp_transport *tt = s->tp->tt;
  pthread_mutex_lock(&tt->g_lock);
  rgrant *g = open_grant_of(s->tp, h->handle);
  if (g) count_marker(s->tp, g, h->handle, e.pool, e.len, h->count);
  pthread_mutex_unlock(&tt->g_lock);
  return 0;
}

static void *receiver_main(void *arg) {
  stream *s = arg;
  uint8_t hdr[BHDR_LEN];
  uint32_t have = 0;
  if (kvf__send_all(s->fd, KVF__TCP_ACK, KVF__FRAME_HDR, -1) != 0) {
    if (!atomic_load(&s->tp->stop)) post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, KVF_EPEERLOST, s->tp);
    stream_gone(s);
    return NULL;
  }
  int rc;
  for (;;) {
    if (s->stage && socket_idle(s->fd, have)) rstage_drain(s);
    rc = read_header(s->fd, hdr, &have);
    if (rc) break;
    batch_hdr h;
    bhdr_decode(hdr, &h);
    have = 0;
    rc = h.magic == LAYER_MAGIC        ? receive_marker(s, &h, hdr, &have)
         : h.magic == KVF__TCP_PAT_MAGIC ? receive_pattern(s, &h, hdr, &have)
                                         : receive_batch(s, &h, hdr, &have);
    if (rc == KVF_EPROTO)
      kvf__warn("peer %s: malformed data batch on stream %u; closing it", s->tp->p->cfg.name, s->index);
    if (rc) break;
  }
  rstage_drain(s);
  /* The sender closing its stream is how its own teardown looks from here
   * (e.g. a stream of an earlier incarnation of the peer's state): the
   * control connection tells whether the peer is alive, so only a broken
   * protocol takes the peer down. Failing it on every close made two
   * daemons that reconnect at once flap. */
  if (!atomic_load(&s->tp->stop) && rc != -ECONNRESET)
    post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, rc, s->tp);
  stream_gone(s);
  return NULL;
}

/* ------------------------------------------------------------------ ops */

/* Cuts runs into frames of at most SLICE bytes and deals them round robin
 * over the streams, so one huge descriptor still uses every connection. A
 * post of at most SMALL_POST bytes goes whole on one stream (the next in
 * turn): spread, its handoff would wait for the wake-up of a thread on
 * each side of every stream it touched (a layer-block's K and V on two). */
static int deal_frames(tcp_peer *tp, const kvf__runs *runs, item **items) {
  bool small = runs->bytes <= SMALL_POST;
  size_t cap = runs->n + (size_t)(runs->bytes / SLICE) + 1;
  size_t per = cap / tp->n_out + 2;
  for (uint32_t i = 0; i < tp->n_out; i++) {
    items[i]->w = malloc(per * sizeof(wr));
    if (!items[i]->w) return -ENOMEM;
  }
  uint32_t k = tp->rr;
  for (size_t r = 0; r < runs->n; r++) {
    const kvf__run *run = &runs->v[r];
    const kvf__pool *sp = kvfd.pools[run->src_pool];
    const uint8_t *src = sp->base + run->src_off; /* a device address for cuda pools */
    for (uint64_t done = 0; done < run->len;) {
      uint32_t len = (uint32_t)(run->len - done < SLICE ? run->len - done : SLICE);
      item *it = items[k];
      if (it->n == per) { /* uneven dealing: grow this stream's share */
        per *= 2;
        for (uint32_t j = 0; j < tp->n_out; j++) {
          wr *nw = realloc(items[j]->w, per * sizeof(wr));
          if (!nw) return -ENOMEM;
          items[j]->w = nw;
        }
      }
      it->w[it->n++] = (wr){src + done, run->dst_pool, len, run->dst_off + done, sp->cuda_dev};
      if (sp->cuda_dev >= 0) it->gpu = true;
      done += len;
      if (!small) k = (k + 1) % tp->n_out;
    }
  }
  tp->rr = small ? (k + 1) % tp->n_out : k;
  return 0;
}

/* Whether the peer reads pattern batches (tcp_pattern.h). Only transforms
 * use them (plain runs are long and go as frames, as they did). */
static bool offers(const tcp_peer *tp, const char *cap) {
  const Kvf__Hello *h = tp->p->hello;
  bool offered = false;
  for (size_t i = 0; h && i < h->n_transports && !offered; i++)
    offered = strcmp(h->transports[i], cap) == 0;
  return offered;
}

static bool patterns_for(const tcp_peer *tp) { return offers(tp, KVF__TCP_PAT_CAP); }

/* deal_frames as patterns (kvf__tcp_pat_deal). */
static int deal_patterns(tcp_peer *tp, const kvf__runs *runs, item **items) {
  kvf__tcp_pshare sh[MAX_STREAMS] = {0};
  for (uint32_t i = 0; i < tp->n_out; i++)
    if (!(items[i]->ps = calloc(1, sizeof(kvf__tcp_pshare)))) return -ENOMEM;
  int rc = kvf__tcp_pat_deal(runs->v, runs->n, sh, tp->n_out, &tp->rr, runs->bytes <= SMALL_POST);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    *items[i]->ps = sh[i];
    atomic_fetch_add(&tp->tt->pat_sent, sh[i].n);
  }
  return rc;
}

/* Appends it to s's queue and wakes s's thread (only s's: a post of one
 * stream's share does not wake them all); the caller holds the peer's lock. */
static void enqueue(stream *s, item *it) {
  atomic_fetch_add(&s->tp->posts, 1);
  pthread_cond_signal(&s->cond);
  if (s->tail) s->tail->next = it;
  else s->head = it;
  s->tail = it;
}

/* What a post deals over the streams' items: runs, or a part of blocks
 * with a transform (its plan as patterns). */
typedef struct dealing {
  const kvf__runs *runs;
  bool grouped;            /* runs of a transform: grouped into patterns */
  bool whole_blocks;       /* runs of blocks without a transform */
  const kvf__bpart *part;
} dealing;

static int deal(tcp_peer *tp, const dealing *d, item **items) {
  if (d->runs) return d->grouped ? deal_patterns(tp, d->runs, items) : deal_frames(tp, d->runs, items);
  kvf__tcp_pshare sh[MAX_STREAMS] = {0};
  for (uint32_t i = 0; i < tp->n_out; i++)
    if (!(items[i]->ps = calloc(1, sizeof(kvf__tcp_pshare)))) return -ENOMEM;
  const kvf__bpart *b = d->part; /* a small part on one stream, as deal_frames */
  bool small = kvf__xplan_bytes(&b->xf, b->n_layers, b->src->n_kv) <= SMALL_POST;
  int rc = kvf__tcp_pat_deal_plan(b, sh, tp->n_out, &tp->rr, small);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    *items[i]->ps = sh[i];
    atomic_fetch_add(&tp->tt->pat_sent, sh[i].n);
  }
  return rc;
}

/* Whether a post's batches may go sealed: the peer reads the flag and no
 * source pool of the runs can fault (pool.h: sealed). Blocks only without
 * a transform: a receiver that completes on sealed bytes takes them for
 * whole blocks (a transform's description comes with the SendDone). */
static bool sealed_for(const tcp_peer *tp, const kvf__xfer *x, const dealing *d) {
  if (!d->runs || d->grouped || (x->blocks && !d->whole_blocks) || !offers(tp, KVF__TCP_SEALED_CAP)) return false;
  for (size_t i = 0; i < d->runs->n; i++) {
    const kvf__pool *p = kvfd.pools[d->runs->v[i].src_pool];
    if (!p || !p->sealed) return false;
  }
  return true;
}

static int post_dealt(kvf__transport *t, kvf__xfer *x, const dealing *d, bool last) {
  tcp_transport *tt = to_tcp(t);
  tcp_peer *tp = tcp_peer_of(tt, x->peer);
  if (!tp || atomic_load(&tp->stop)) return KVF_EPEERLOST;
  item *items[MAX_STREAMS] = {0};
  ticket *tk = calloc(1, sizeof(*tk));
  int rc = tk ? 0 : -ENOMEM;
  for (uint32_t i = 0; rc == 0 && i < tp->n_out; i++)
    if (!(items[i] = calloc(1, sizeof(item)))) rc = -ENOMEM;
  if (rc == 0) rc = deal(tp, d, items);
  if (rc) {
    for (uint32_t i = 0; i < tp->n_out; i++)
      if (items[i]) item_free(items[i]);
    free(tk);
    return rc;
  }
  tk->tt = tt;
  tk->x = x;
  tk->last = last;
  for (uint32_t i = 0; i < tp->n_out; i++)
    if (items[i]->gpu) x->path = "tcp-bounce";
  int used = 0;
  bool sealed = sealed_for(tp, x, d);
  for (uint32_t i = 0; i < tp->n_out; i++) used += items[i]->n > 0 || (items[i]->ps && items[i]->ps->n > 0);
  /* An empty post (all parts already sent) still completes through the
   * queue, so the caller sees one callback either way. */
  atomic_store(&tk->outstanding, used ? used : 1);
  pthread_mutex_lock(&tp->lock);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    item *it = items[i];
    if (it->n == 0 && !(it->ps && it->ps->n)) {
      item_free(it);
      continue;
    }
    it->tk = tk;
    it->handle = x->handle;
    it->sealed = sealed;
    enqueue(&tp->out[i], it);
  }
  pthread_mutex_unlock(&tp->lock);
  if (!used) post_event(tt, EV_TICKET, tk, 0, 0, NULL);
  return 0;
}

static int tcp_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) {
  return post_dealt(t, x, &(dealing){.runs = runs}, last);
}

/* A transform to a peer that reads patterns, from host memory: straight
 * from the plan (no run per piece); anything else as runs. */
static int tcp_post_blocks(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last) {
  tcp_peer *tp = tcp_peer_of(to_tcp(t), x->peer); /* GPU sources stage frames (write_item_staged) */
  if (!b->xf.transform) { /* whole blocks: the layouts' coalesced runs */
    kvf__runs runs = {0};
    int rc = kvf__blocks_pair(b->src, b->sids, b->dst, b->dids, b->n, b->first, b->n_layers, &runs);
    if (rc == 0) rc = post_dealt(t, x, &(dealing){.runs = &runs, .whole_blocks = true}, last);
    kvf__runs_free(&runs);
    return rc;
  }
  if (!tp || !patterns_for(tp) || kvfd.pools[b->src->pool]->cuda_dev >= 0)
    return kvf__transport_post_block_runs(t, x, b, last);
  int rc = post_dealt(t, x, &(dealing){.part = b}, last);
  if (rc != -E2BIG) return rc;
  kvf__runs runs = {0}; /* chunks too large for an entry: the walk's runs, grouped */
  rc = kvf__xform_runs(&b->xf, b->src, b->sids, b->dst, b->dids, b->first, b->n_layers, &runs);
  if (rc == 0) rc = post_dealt(t, x, &(dealing){.runs = &runs, .grouped = true}, last);
  kvf__runs_free(&runs);
  return rc;
}

/* A marker behind the part just posted, on every stream (the format's
 * comment at the top). */
static bool tcp_mark_layers(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n) {
  /* Never false: the sender's word after its post is called back would
   * come before the data landed here (a tcp post completes once written to
   * the socket). Unmarked layers are reported with RECV_DONE instead. */
  tcp_peer *tp = tcp_peer_of(to_tcp(t), x->peer);
  if (!tp || atomic_load(&tp->stop)) return true; /* the peer is gone: so is the transfer */
  item *marks[MAX_STREAMS] = {0};
  for (uint32_t i = 0; i < tp->n_out; i++)
    if (!(marks[i] = calloc(1, sizeof(item)))) {
      for (uint32_t j = 0; j < i; j++) free(marks[j]);
      return true; /* out of memory: unmarked */
    }
  pthread_mutex_lock(&tp->lock);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    item *it = marks[i];
    *it = (item){.handle = x->handle, .marker = true, .first = first, .n_layers = n, .streams = tp->n_out};
    enqueue(&tp->out[i], it);
  }
  pthread_mutex_unlock(&tp->lock);
  return true;
}

static void tcp_abort(kvf__transport *t, kvf__xfer *x) {
  tcp_peer *tp = x->peer ? tcp_peer_of(to_tcp(t), x->peer) : NULL;
  if (!tp) return;
  pthread_mutex_lock(&tp->lock);
  for (uint32_t i = 0; i < tp->n_out; i++)
    for (item *it = tp->out[i].head; it; it = it->next)
      if (it->tk && it->tk->x == x) atomic_store(&it->tk->aborted, true);
  pthread_mutex_unlock(&tp->lock);
}

static int tcp_grant_open(kvf__transport *t, kvf__xfer *x) {
  rgrant *g = calloc(1, sizeof(*g));
  if (!g) return -ENOMEM;
  int rc = kvf__rangeset_build(&g->rs, &x->dst);
  if (rc) {
    free(g);
    return rc;
  }
  g->x = x;
  g->peer = x->peer;
  g->total = x->dst.total;
  for (size_t i = 0; i < x->dst.n; i++)
    if (x->dst.pool[i] < kvfd.n_pools && kvf__pool_gpu(kvfd.pools[x->dst.pool[i]])) {
      x->path = "tcp-bounce";
      break;
    }
  tcp_transport *tt = to_tcp(t);
  char key[KVF__MAP_KEY_U64];
  kvf__map_key_u64(key, x->handle);
  pthread_mutex_lock(&tt->g_lock);
  rc = kvf__map_put(&tt->grants, key, g);
  pthread_mutex_unlock(&tt->g_lock);
  if (rc) {
    kvf__rangeset_free(&g->rs);
    free(g);
  }
  if (rc == 0) kvf__spin_expect(true); /* the receivers poll until the data comes (spin.h) */
  return rc;
}

static void shutdown_inbound(tcp_peer *tp) {
  pthread_mutex_lock(&tp->lock);
  for (stream *s = tp->in; s; s = s->next_in) shutdown(s->fd, SHUT_RDWR);
  pthread_mutex_unlock(&tp->lock);
}

/* Waits until no receiver thread writes into the grant. A receiver reading
 * a payload into it sees `closed` within RECV_CHECK_MS and reads the rest
 * into a sink, so a stalled or lossy stream stays up; one that cannot (a
 * staged GPU copy) has its peer's inbound streams cut after a bound, which
 * takes the peer down: before, every stalled payload did, and a transfer's
 * deadline passing just after a loss burst failed the transfers beside it. */
static void tcp_grant_close(kvf__transport *t, kvf__xfer *x) {
  tcp_transport *tt = to_tcp(t);
  char key[KVF__MAP_KEY_U64];
  kvf__map_key_u64(key, x->handle);
  pthread_mutex_lock(&tt->g_lock);
  rgrant *g = kvf__map_get(&tt->grants, key);
  if (!g) {
    pthread_mutex_unlock(&tt->g_lock);
    return;
  }
  atomic_store(&g->closed, true);
  bool cut = false;
  while (g->writers > 0) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 200 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    tcp_peer *tp = tcp_peer_of(tt, g->peer);
    if (pthread_cond_timedwait(&tt->g_cond, &tt->g_lock, &ts) == ETIMEDOUT && !cut && tp) {
      pthread_mutex_unlock(&tt->g_lock);
      shutdown_inbound(tp);
      pthread_mutex_lock(&tt->g_lock);
      cut = true;
    }
  }
  kvf__map_del(&tt->grants, key);
  pthread_mutex_unlock(&tt->g_lock);
  kvf__rangeset_free(&g->rs);
  free(g->marks);
  free(g);
}

static int tcp_peer_up(kvf__transport *t, kvf__peer *p) {
  tcp_peer *tp = calloc(1, sizeof(*tp));
  if (!tp) return -ENOMEM;
  tcp_transport *tt = to_tcp(t);
  tp->tt = tt;
  tp->p = p;
  tp->gen = ++tt->gen;
  tp->n_out = kvfd.cfg.tcp_streams;
  if (tp->n_out > MAX_STREAMS) tp->n_out = MAX_STREAMS;
  tp->out = calloc(tp->n_out, sizeof(stream));
  if (!tp->out) {
    free(tp);
    return -ENOMEM;
  }
  pthread_mutex_init(&tp->lock, NULL);
  for (uint32_t i = 0; i < tp->n_out; i++) pthread_cond_init(&tp->out[i].cond, NULL);
  kvf__transport_set_peer(t, p, tp);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    stream *s = &tp->out[i];
    s->tp = tp;
    s->index = i;
    s->fd = -1;
    s->outbound = true;
    s->started = pthread_create(&s->thr, NULL, sender_main, s) == 0;
    if (!s->started) return -EAGAIN;
  }
  return 0;
}

int kvf__tcp_adopt_stream(kvf__transport *t, kvf__peer *p, int fd, uint32_t index) {
  tcp_peer *tp = tcp_peer_of(to_tcp(t), p);
  if (!tp || atomic_load(&tp->stop)) return KVF_EPEERLOST;
  stream *s = calloc(1, sizeof(*s));
  if (!s) return -ENOMEM;
  s->tp = tp;
  s->fd = fd;
  s->index = index;
  struct timeval tv = {.tv_sec = 0, .tv_usec = RECV_CHECK_MS * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  pthread_mutex_lock(&tp->lock);
  s->next_in = tp->in;
  tp->in = s;
  s->started = pthread_create(&s->thr, NULL, receiver_main, s) == 0;
  pthread_mutex_unlock(&tp->lock);
  return s->started ? 0 : -EAGAIN;
}

/* Completes every queued item with the peer's loss; the tickets reach the
 * loop through the event queue like any other completion. */
static void drain_queues(tcp_peer *tp) {
  for (uint32_t i = 0; i < tp->n_out; i++) {
    item *it = tp->out[i].head;
    tp->out[i].head = tp->out[i].tail = NULL;
    while (it) {
      item *next = it->next;
      if (it->tk) ticket_part_done(it->tk, KVF_EPEERLOST); /* a layer marker has none */
      item_free(it);
      it = next;
    }
  }
}

static void tcp_peer_down(kvf__transport *t, kvf__peer *p) {
  tcp_peer *tp = tcp_peer_of(to_tcp(t), p);
  if (!tp) return;
  atomic_store(&tp->stop, true);
  pthread_mutex_lock(&tp->lock);
  for (uint32_t i = 0; i < tp->n_out; i++)
    if (tp->out[i].fd >= 0) shutdown(tp->out[i].fd, SHUT_RDWR);
  for (stream *s = tp->in; s; s = s->next_in) shutdown(s->fd, SHUT_RDWR);
  for (uint32_t i = 0; i < tp->n_out; i++) pthread_cond_broadcast(&tp->out[i].cond);
  pthread_mutex_unlock(&tp->lock);
  /* A sender in connect() or its handshake was woken by the shutdown. */
  for (uint32_t i = 0; i < tp->n_out; i++)
    if (tp->out[i].started) pthread_join(tp->out[i].thr, NULL);
  for (stream *s = tp->in; s; s = s->next_in)
    if (s->started) pthread_join(s->thr, NULL);
  drain_queues(tp);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    if (tp->out[i].fd >= 0) close(tp->out[i].fd);
    stage_free(tp->out[i].stage);
  }
  while (tp->in) {
    stream *s = tp->in;
    tp->in = s->next_in;
    close(s->fd);
    stage_free(s->stage);
    free(s);
  }
  pthread_mutex_destroy(&tp->lock);
  for (uint32_t i = 0; i < tp->n_out; i++) pthread_cond_destroy(&tp->out[i].cond);
  free(tp->out);
  free(tp);
  kvf__transport_set_peer(t, p, NULL);
}

static rgrant *grant_for_event(tcp_transport *tt, uint64_t handle) {
  char key[KVF__MAP_KEY_U64];
  kvf__map_key_u64(key, handle);
  pthread_mutex_lock(&tt->g_lock);
  rgrant *g = kvf__map_get(&tt->grants, key);
  if (g && g->closed) g = NULL;
  pthread_mutex_unlock(&tt->g_lock);
  return g;
}

/* EV_STREAM_GONE: unlinks, joins and frees the stream, when it still
 * belongs to the peer's current state (peer_down frees its own). */
static void reap_stream(const tevent *e) {
  tcp_peer *tp = tcp_peer_of(e->tt, e->peer);
  if (!tp || tp->gen != e->gen) return;
  stream *s = NULL;
  pthread_mutex_lock(&tp->lock);
  for (stream **pp = &tp->in; *pp; pp = &(*pp)->next_in)
    if (*pp == e->stream) {
      s = *pp;
      *pp = s->next_in;
      break;
    }
  pthread_mutex_unlock(&tp->lock);
  if (!s) return;
  if (s->started) pthread_join(s->thr, NULL);
  close(s->fd);
  stage_free(s->stage);
  free(s);
}

/* Which stream broke and how, for the log line of the peer's fall. */
static void stream_broke(const tevent *e) {
  char why[128];
  snprintf(why, sizeof(why), "a data stream broke (%s)", kvf_strerror(e->status));
  kvf__peer_fail(e->peer, why);
}

static void handle_event(tevent *e) {
  rgrant *g;
  switch (e->kind) {
  case EV_TICKET: {
    ticket *tk = e->tk;
    int st = atomic_load(&tk->status);
    if (atomic_load(&tk->first_ns)) kvf__xtrace_stamp(tk->x, KVF__XT_FIRST, atomic_load(&tk->first_ns));
    kvf__xtrace_stamp(tk->x, KVF__XT_LAST, atomic_load(&tk->done_ns) ? atomic_load(&tk->done_ns) : 0);
    kvf__xfer_on_posted(tk->x, st == KVF_ECANCELED ? 0 : st, tk->last);
    free(tk);
    break;
  }
  case EV_LANDED:
    if ((g = grant_for_event(e->tt, e->handle)) == NULL) break;
    kvf__xtrace_stamp(g->x, KVF__XT_FIRST, e->t_first);
    kvf__xtrace_stamp(g->x, KVF__XT_LAST, e->t_last);
    if (e->sealed) kvf__xfer_on_vouched(g->x); /* the bytes vouch (tcp_wire.h) */
    else kvf__xfer_on_landed(g->x);
    break;
  case EV_DATA_ERROR:
    if ((g = grant_for_event(e->tt, e->handle)) != NULL)
      kvf__xfer_on_data_error(g->x, e->status,
                              e->status == -EFAULT ? "the memory of a pool went away under the receive (an "
                                                     "engine's memory file shrank)"
                                                   : "the peer wrote outside the grant");
    break;
  case EV_COPY_ERROR:
    if ((g = grant_for_event(e->tt, e->handle)) != NULL)
      kvf__xfer_on_data_error(g->x, e->status, "copying received data into GPU memory failed");
    break;
  case EV_STREAM_ERROR:
    if (tcp_peer_of(e->tt, e->peer) && tcp_peer_of(e->tt, e->peer)->gen == e->gen)
      stream_broke(e);
    break;
  case EV_STREAM_GONE: reap_stream(e); break;
  case EV_LAYERS:
    if ((g = grant_for_event(e->tt, e->handle)) != NULL) kvf__xfer_on_layers_landed(g->x, e->first, e->n);
    break;
  }
}

static void on_event(kvf__mail *m) {
  tevent *e = kvf__container_of(m, tevent, mail);
  handle_event(e);
  free(e);
}

/* Data streams now open (outbound connected, inbound adopted): with
 * open_grants, what the chaos suite checks returns to its baseline. */
static void count_streams(tcp_transport *tt, size_t *out, size_t *in) {
  *out = *in = 0;
  for (size_t i = 0; i < kvf__peer_count(); i++) {
    tcp_peer *tp = tcp_peer_of(tt, kvf__peer_at(i));
    if (!tp) continue;
    pthread_mutex_lock(&tp->lock);
    for (uint32_t k = 0; k < tp->n_out; k++) *out += tp->out[k].connected;
    for (stream *s = tp->in; s; s = s->next_in) (*in)++;
    pthread_mutex_unlock(&tp->lock);
  }
}

static void tcp_inspect(kvf__transport *t, char *buf, size_t len) {
  tcp_transport *tt = to_tcp(t);
  pthread_mutex_lock(&tt->g_lock);
  size_t n = tt->grants.n;
  pthread_mutex_unlock(&tt->g_lock);
  size_t out, in;
  count_streams(tt, &out, &in);
  snprintf(buf, len, "\"name\": \"tcp\", \"streams_per_peer\": %u, \"open_grants\": %zu, "
                     "\"streams_out\": %zu, \"streams_in\": %zu, \"patterns_sent\": %llu, "
                     "\"pattern_batches_read\": %llu, \"pattern_pieces_read\": %llu",
           kvfd.cfg.tcp_streams, n, out, in, (unsigned long long)atomic_load(&tt->pat_sent),
           (unsigned long long)atomic_load(&tt->pat_batches), (unsigned long long)atomic_load(&tt->pat_pieces));
}

static void tcp_free(kvf__mailbox *mb) {
  tcp_transport *tt = kvf__container_of(mb, tcp_transport, mb);
  kvf__map_free(&tt->grants);
  pthread_mutex_destroy(&tt->g_lock);
  pthread_cond_destroy(&tt->g_cond);
  free(tt);
}

/* Every peer is down by now (peers stop first): no thread posts any more. */
static void tcp_destroy(kvf__transport *t) {
  kvf__mailbox_close(&to_tcp(t)->mb, tcp_free); /* delivers what is left first */
}

/* We read pattern batches (tcp_pattern.h): peer.c's Hello keeps a slot
 * for this word behind the transports' names. */
static void tcp_hello(kvf__transport *t, Kvf__Hello *h) {
  h->transports[h->n_transports++] = (char *)KVF__TCP_PAT_CAP;
  h->transports[h->n_transports++] = (char *)KVF__TCP_SEALED_CAP;
}

static const kvf__transport_ops tcp_ops = {
    .hello = tcp_hello,
    .name = "tcp",
    .post = tcp_post,
    .post_blocks = tcp_post_blocks,
    .mark_layers = tcp_mark_layers,
    .abort = tcp_abort,
    .grant_open = tcp_grant_open,
    .grant_close = tcp_grant_close,
    .pool_added = kvf__transport_pool_mapped,
    .peer_up = tcp_peer_up,
    .peer_down = tcp_peer_down,
    .inspect = tcp_inspect,
    .destroy = tcp_destroy,
};

int kvf__tcp_create(uv_loop_t *loop, unsigned slot, kvf__transport **out, char *err, size_t errlen) {
  tcp_transport *tt = calloc(1, sizeof(*tt));
  if (!tt) return -ENOMEM;
  kvf__transport_init(&tt->base, &tcp_ops, loop, slot);
  int rc = kvf__mailbox_init(&tt->mb, loop);
  if (rc) {
    snprintf(err, errlen, "cannot set up the tcp transport's mailbox: %s", uv_strerror(rc));
    free(tt);
    return rc;
  }
  pthread_mutex_init(&tt->g_lock, NULL);
  pthread_cond_init(&tt->g_cond, NULL);
  *out = &tt->base;
  return 0;
}
