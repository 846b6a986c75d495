/* tcp_send.c - the tcp transport's sending side (tcp.c's comment at the top):
 * a post dealt into items over the peer's streams, the writes of frames,
 * patterns and layer markers, GPU staging, the streams' connect and their
 * sender threads. */
#include "tcp_int.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "auth.h"
#include "frame.h"
#include "layout.h"
#include "pool.h"
#include "tcp_io.h"
#include "spin.h"

void kvf__tcp_item_free(tcp_transport *tt, item *it) {
  free(it->w);
  if (it->ps) kvf__tcp_pspare_give(&tt->spare, it->ps);
  free(it->ps);
  free(it);
}


/* --------------------------------------------------------- sender threads */

/* Writes an item's patterns as pattern batches (tcp_pattern.h), from
 * it->pos on, until *budget bytes went out (then it->pos says where the
 * next quantum goes on). */
static int write_item_pat(stream *s, item *it, int64_t *budget) {
  uint8_t hdr[BHDR_LEN], ents[BATCH_FRAMES * KVF__TCP_PAT_ENT];
  struct iovec *iov = malloc(KVF__TCP_PAT_IOVS * sizeof(*iov));
  int rc = iov ? 0 : -ENOMEM;
  while (rc == 0 && it->pos < it->ps->n && *budget > 0) {
    if (atomic_load(&it->tk->aborted) || atomic_load(&s->tp->stop)) rc = KVF_ECANCELED;
    uint64_t bytes = 0;
    int n = rc ? 0 : kvf__tcp_pat_batch(it->ps, &it->pos, it->handle, hdr, ents, iov, &bytes);
    bool faulted = false;
    if (rc == 0) rc = kvf__tcp_writev_all(s->fd, iov, n, &faulted);
    if (rc == 0 && faulted) rc = SOURCE_FAULT; /* at a batch's end: the stream is in step */
    *budget -= (int64_t)bytes;
  }
  free(iov);
  return rc;
}

/* Writes an item's frames as batches, one writev each, from it->pos on,
 * until *budget bytes went out. */
static int write_item(stream *s, item *it, int64_t *budget) {
  if (it->ps) return write_item_pat(s, it, budget);
  uint8_t hdr[BHDR_LEN], ents[BATCH_FRAMES][ENT_LEN];
  struct iovec iov[BATCH_FRAMES + 2];
  while (it->pos < it->n && *budget > 0) {
    if (atomic_load(&it->tk->aborted) || atomic_load(&s->tp->stop)) return KVF_ECANCELED;
    uint32_t k = 0;
    for (size_t i = it->pos; k < BATCH_FRAMES && i < it->n; k++, i++) {
      const wr *w = &it->w[i];
      ent_encode(ents[k], w->dst_pool, w->len, w->dst_off);
      iov[2 + k] = (struct iovec){(void *)w->src, w->len};
      *budget -= w->len;
    }
    it->pos += k;
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

void kvf__tcp_stage_free(gstage *g) {
  if (!g) return;
  for (int i = 0; i < 2; i++) {
    sslot *sl = &g->slot[i];
    if (sl->busy) kvf__gpu_batch_wait(sl->b);
    kvf__gpu_batch_free(sl->b);
    kvf__gpu_host_free(sl->host);
  }
  free(g);
}

gstage *kvf__tcp_stage_get(stream *s) {
  if (s->stage) return s->stage;
  gstage *g = calloc(1, sizeof(*g));
  if (!g) return NULL;
  for (int i = 0; i < 2; i++) {
    sslot *sl = &g->slot[i];
    sl->host = kvf__gpu_host_alloc(STAGE_SLOT, &sl->dev);
    if (!sl->host || kvf__gpu_batch_new(&sl->b) != 0) {
      kvf__warn("tcp: cannot set up pinned staging for GPU memory on stream %u", s->index);
      kvf__tcp_stage_free(g);
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
  gstage *g = kvf__tcp_stage_get(s);
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

/* Sets fd's send and receive timeouts to ms. */
static void fd_timeouts(int fd, uint32_t ms) {
  struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

/* connect() bounded by CONNECT_MS: a worker connecting serves no other
 * stream meanwhile. A peer_down shuts fd down, which ends the wait. */
static int connect_bounded(int fd, const kvf__peer *p) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) return -errno;
  int rc = connect(fd, (const struct sockaddr *)&p->addr, p->addrlen) == 0 ? 0 : -errno;
  if (rc == -EINPROGRESS) {
    struct pollfd pf = {.fd = fd, .events = POLLOUT};
    int n;
    while ((n = poll(&pf, 1, CONNECT_MS)) < 0 && errno == EINTR) {}
    int err = 0;
    socklen_t len = sizeof(err);
    if (n == 0) rc = -ETIMEDOUT;
    else if (n < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) rc = -errno;
    else rc = -err;
  }
  if (fcntl(fd, F_SETFL, fl) != 0 && rc == 0) rc = -errno;
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
  fd_timeouts(fd, CONNECT_MS); /* the handshake, as the connect */
  int rc = connect_bounded(fd, p);
  if (rc) return connect_fail(s, fd, rc);
  Kvf__DataHello dh = KVF__DATA_HELLO__INIT;
  dh.version = KVF__PEER_VERSION;
  dh.node = kvfd.cfg.node;
  dh.session = p->remote_session;
  dh.stream = s->index;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_DATA_HELLO;
  m.data_hello = &dh;
  rc = kvf__tcp_send_msg(fd, &m);
  if (rc == 0 && kvf__auth_enabled()) rc = kvf__tcp_answer_challenge(fd, p, s->index);
  if (rc == 0) rc = kvf__tcp_await_ack(fd);
  if (rc) return connect_fail(s, fd, rc);
  /* A peer that stops reading must not hold a sender worker forever. The
   * bound is not peer-timeout-ms: the control connection says whether the
   * peer lives (and its loss shuts these streams down), while a lossy
   * network stalls a bulk stream's writes for seconds of TCP backoff after
   * it heals, and that must not take a live peer down. */
  fd_timeouts(fd, kvfd.cfg.peer_timeout_ms > STREAM_STALL_MS ? kvfd.cfg.peer_timeout_ms : STREAM_STALL_MS);
  pthread_mutex_lock(&s->tp->lock);
  s->connected = true;
  pthread_mutex_unlock(&s->tp->lock);
  return 0;
}

/* This thread's last activity (moved data), for spin.h's window. */
static _Thread_local uint64_t thread_last_ns;

/* ------------------------------------------------------- sender workers
 *
 * tcp-threads workers serve every peer's outbound streams. A stream with
 * items (or its connect) to do sits in the transport's run queue; a worker
 * takes it (no other worker touches it meanwhile: a stream's data goes out
 * in order), writes about SEND_QUANTUM of it, and puts it back at the tail
 * if more is queued, so a bulk transfer to one peer does not hold back the
 * others. The writes block (bounded by the stream's stall timeout); more
 * workers than a few stalled peers keep the rest moving. */

/* Appends s to the run queue; the caller holds rq_lock. */
static void rq_push(tcp_transport *tt, stream *s) {
  s->sched = RQ_QUEUED;
  s->next_run = NULL;
  if (tt->rq_tail) tt->rq_tail->next_run = s;
  else tt->rq_head = s;
  tt->rq_tail = s;
  /* more than the pollers take: a sleeping worker wakes for it */
  if (atomic_fetch_add(&tt->rq_len, 1) + 1 > tt->rq_polling) pthread_cond_signal(&tt->rq_cond);
}

void kvf__tcp_stream_schedule(stream *s) {
  tcp_transport *tt = s->tp->tt;
  pthread_mutex_lock(&tt->rq_lock);
  if (s->sched == RQ_IDLE && !atomic_load(&s->tp->stop)) rq_push(tt, s);
  pthread_mutex_unlock(&tt->rq_lock);
}

/* A polling worker: polls until a stream is queued (or stop) or spin.h's
 * window closes; returns holding rq_lock. It takes the lock only once
 * there is work, and only by trylock: pollers that queued on the mutex
 * would each sleep in it, and their wake-ups would fall on the unlock of
 * the one that got the stream, on the handoff's path. */
static void poll_queue(tcp_transport *tt) {
  for (;;) {
    bool work = atomic_load_explicit(&tt->rq_len, memory_order_relaxed) > 0 || atomic_load(&tt->rq_stop);
    if (work && pthread_mutex_trylock(&tt->rq_lock) == 0) return;
    if (!work && !kvf__spin_open(KVF__SPIN_SEND, thread_last_ns)) break;
    kvf__spin_relax(KVF__SPIN_SEND);
  }
  pthread_mutex_lock(&tt->rq_lock);
}

/* The next stream to serve. While spin.h's window is open (the next part
 * of a handoff is likely soon) up to rq_max_polling workers poll the queue
 * instead of sleeping, and a push that they are enough to take wakes
 * nobody (a futex wake on the poster's path); each push beyond them wakes a
 * sleeping worker. With one poller, a striped post's first stream moved at
 * once and the others waited for a wake-up each (a thread asleep on a
 * halted CPU: tens of microseconds); with as many as a peer has streams,
 * all of them move at once. NULL: stop. */
static stream *rq_take(tcp_transport *tt) {
  pthread_mutex_lock(&tt->rq_lock);
  while (!tt->rq_head && !tt->rq_stop) {
    if (tt->rq_polling >= tt->rq_max_polling || !kvf__spin_open(KVF__SPIN_SEND, thread_last_ns)) {
      kvf__spin_cond_wait(&tt->rq_cond, &tt->rq_lock, KVF__SPIN_SEND, thread_last_ns);
      continue;
    }
    tt->rq_polling++;
    pthread_mutex_unlock(&tt->rq_lock);
    poll_queue(tt);
    tt->rq_polling--; /* the stream it saw may be another's by now: the loop looks again */
  }
  stream *s = tt->rq_stop ? NULL : tt->rq_head;
  if (s) {
    tt->rq_head = s->next_run;
    if (!tt->rq_head) tt->rq_tail = NULL;
    atomic_fetch_sub(&tt->rq_len, 1);
    s->sched = RQ_RUNNING;
  }
  pthread_mutex_unlock(&tt->rq_lock);
  return s;
}

/* spin.h opened the send window (a peer's grant came ahead of its send):
 * workers asleep wake to poll the queue through it, as many as may poll,
 * so the send finds them awake. */
void kvf__tcp_senders_wake(void *arg) {
  tcp_transport *tt = arg;
  pthread_mutex_lock(&tt->rq_lock);
  for (unsigned i = tt->rq_polling; i < tt->rq_max_polling; i++) pthread_cond_signal(&tt->rq_cond);
  pthread_mutex_unlock(&tt->rq_lock);
}

/* s's quantum is over: back in the queue when it has more to do. */
static void rq_release(stream *s) {
  tcp_peer *tp = s->tp;
  tcp_transport *tt = tp->tt;
  pthread_mutex_lock(&tp->lock);
  pthread_mutex_lock(&tt->rq_lock);
  if ((s->cur || s->head) && !atomic_load(&tp->stop)) {
    rq_push(tt, s);
  } else {
    s->sched = RQ_IDLE;
    pthread_cond_broadcast(&tt->rq_idle);
  }
  pthread_mutex_unlock(&tt->rq_lock);
  pthread_mutex_unlock(&tp->lock);
}

/* Takes tp's streams out of the run queue and waits for those running:
 * tp->stop is set and their fds shut down, so their writes end soon. */
void kvf__tcp_streams_unschedule(tcp_peer *tp) {
  tcp_transport *tt = tp->tt;
  pthread_mutex_lock(&tt->rq_lock);
  stream **pp = &tt->rq_head;
  tt->rq_tail = NULL;
  while (*pp) {
    stream *s = *pp;
    if (s->tp == tp) {
      *pp = s->next_run;
      atomic_fetch_sub(&tt->rq_len, 1);
      s->sched = RQ_IDLE;
    } else {
      tt->rq_tail = s;
      pp = &s->next_run;
    }
  }
  for (uint32_t i = 0; i < tp->n_out; i++)
    while (tp->out[i].sched == RQ_RUNNING) pthread_cond_wait(&tt->rq_idle, &tt->rq_lock);
  pthread_mutex_unlock(&tt->rq_lock);
}

/* The next item of s: the one its last quantum ended in, else its queue's
 * head. */
static item *stream_item(stream *s) {
  if (s->cur) return s->cur;
  pthread_mutex_lock(&s->tp->lock);
  item *it = atomic_load(&s->tp->stop) ? NULL : s->head;
  if (it) {
    s->head = it->next;
    if (!s->head) s->tail = NULL;
  }
  pthread_mutex_unlock(&s->tp->lock);
  return it;
}

static bool item_left(const item *it) { return it->ps ? it->pos < it->ps->n : it->pos < it->n; }

/* Writes some of it (*budget); true when it is done (written or failed). */
static bool send_item(stream *s, item *it, int64_t *budget) {
  if (it->marker) { /* no ticket: a lost marker fails the peer, so the grant */
    int rc = s->broken ? 0 : write_marker(s, it);
    if (rc && !s->broken) kvf__tcp_post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, s->broken = rc, s->tp);
    *budget -= BHDR_LEN + ENT_LEN;
    return true;
  }
  uint64_t none = 0;
  atomic_compare_exchange_strong(&it->tk->first_ns, &none, kvf__now_ns());
  int rc = s->broken ? KVF_EPEERLOST : it->gpu ? write_item_staged(s, it) : write_item(s, it, budget);
  if (it->gpu) *budget = 0; /* staged items go whole: their slots pipeline */
  if (rc == 0 && !it->gpu && item_left(it)) return false;
  bool item_only = rc == KVF_ECANCELED || rc == GPU_COPY_FAILED || rc == SOURCE_FAULT; /* the stream is fine */
  if (rc && !item_only && !s->broken) {
    s->broken = rc;
    kvf__tcp_post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, rc, s->tp);
  }
  kvf__tcp_ticket_part_done(it->tk, rc == 0 ? 0 : rc == GPU_COPY_FAILED ? -EIO : item_only ? rc : KVF_EPEERLOST);
  return true;
}

/* One quantum of s: its connect first (queued at peer up), then items. */
static void serve_stream(stream *s) {
  if (!s->hello_sent) {
    s->hello_sent = true;
    int rc = connect_stream(s);
    if (rc) kvf__tcp_post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, s->broken = rc, s->tp);
  }
  int64_t budget = SEND_QUANTUM;
  item *it;
  while (budget > 0 && (it = stream_item(s)) != NULL) {
    bool done = send_item(s, it, &budget);
    s->cur = done ? NULL : it;
    if (done) kvf__tcp_item_free(s->tp->tt, it);
  }
  thread_last_ns = kvf__now_ns();
}

static void *sender_main(void *arg) {
  tcp_transport *tt = arg;
  stream *s;
  while ((s = rq_take(tt)) != NULL) {
    serve_stream(s);
    rq_release(s);
  }
  return NULL;
}

/* tcp-threads 0: half the cores, at least 4: a worker blocks in a write
 * to a full socket, and with fewer workers than a peer's tcp-streams (4 by
 * default) one peer's stripes do not all move at once (bench-tcp's 4 KiB
 * descriptors: 9-35% slower in 3 paired rounds with 2 workers a side on 2
 * cores; with 4, on par within the noise). */
unsigned kvf__tcp_workers(void) {
  if (kvfd.cfg.tcp_threads) return kvfd.cfg.tcp_threads;
  long n = sysconf(_SC_NPROCESSORS_ONLN) / 2;
  return n < 4 ? 4 : n > 16 ? 16 : (unsigned)n;
}

/* Workers that may poll the run queue at once (tcp-pollers; 0: this): as many as a peer has
 * streams (so a striped post moves on all of them at once) where a
 * quarter of the CPUs this daemon may run on can spin for them; one on
 * smaller machines, where a poller takes the CPU that the data's other
 * threads need. */
static unsigned max_polling(unsigned workers) {
  if (kvfd.cfg.tcp_pollers) return kvfd.cfg.tcp_pollers < workers ? kvfd.cfg.tcp_pollers : workers;
  cpu_set_t set;
  int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
  unsigned n = cpus > 0 ? (unsigned)cpus / 4 : 1;
  unsigned cap = kvfd.cfg.tcp_streams < workers ? kvfd.cfg.tcp_streams : workers;
  return n < 1 ? 1 : n > cap ? cap : n;
}

int kvf__tcp_senders_start(tcp_transport *tt) {
  tt->rq_max_polling = max_polling(tt->n_workers);
  pthread_mutex_init(&tt->rq_lock, NULL);
  pthread_cond_init(&tt->rq_cond, NULL);
  pthread_cond_init(&tt->rq_idle, NULL);
  tt->senders = calloc(tt->n_workers, sizeof(pthread_t));
  if (!tt->senders) return -ENOMEM;
  for (; tt->n_senders < tt->n_workers; tt->n_senders++) {
    int rc = pthread_create(&tt->senders[tt->n_senders], NULL, sender_main, tt);
    if (rc) return -rc;
    pthread_setname_np(tt->senders[tt->n_senders], "kvf-tcp-send");
  }
  return 0;
}

/* Every peer is down: the queue is empty. */
void kvf__tcp_senders_stop(tcp_transport *tt) {
  pthread_mutex_lock(&tt->rq_lock);
  tt->rq_stop = true; /* ends a poll too (busy-poll: it never times out) */
  pthread_cond_broadcast(&tt->rq_cond);
  pthread_mutex_unlock(&tt->rq_lock);
  for (unsigned i = 0; i < tt->n_senders; i++) pthread_join(tt->senders[i], NULL);
  free(tt->senders);
  pthread_mutex_destroy(&tt->rq_lock);
  pthread_cond_destroy(&tt->rq_cond);
  pthread_cond_destroy(&tt->rq_idle);
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
  kvf__tcp_pshare sh[MAX_STREAMS];
  for (uint32_t i = 0; i < tp->n_out; i++)
    if (!(items[i]->ps = calloc(1, sizeof(kvf__tcp_pshare)))) return -ENOMEM;
  for (uint32_t i = 0; i < tp->n_out; i++) kvf__tcp_pspare_take(&tp->tt->spare, &sh[i]);
  int rc = kvf__tcp_pat_deal(runs->v, runs->n, sh, tp->n_out, &tp->rr, runs->bytes <= SMALL_POST);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    *items[i]->ps = sh[i];
    atomic_fetch_add(&tp->tt->pat_sent, sh[i].n);
  }
  return rc;
}

/* Appends it to s's queue and puts s in the run queue (one worker wakes);
 * the caller holds the peer's lock. */
static void enqueue(stream *s, item *it) {
  if (s->tail) s->tail->next = it;
  else s->head = it;
  s->tail = it;
  kvf__tcp_stream_schedule(s);
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
  kvf__tcp_pshare sh[MAX_STREAMS];
  for (uint32_t i = 0; i < tp->n_out; i++)
    if (!(items[i]->ps = calloc(1, sizeof(kvf__tcp_pshare)))) return -ENOMEM;
  for (uint32_t i = 0; i < tp->n_out; i++) kvf__tcp_pspare_take(&tp->tt->spare, &sh[i]);
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
      if (items[i]) kvf__tcp_item_free(tt, items[i]);
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
      kvf__tcp_item_free(tt, it);
      continue;
    }
    it->tk = tk;
    it->handle = x->handle;
    it->sealed = sealed;
    enqueue(&tp->out[i], it);
  }
  pthread_mutex_unlock(&tp->lock);
  if (!used) kvf__tcp_post_event(tt, EV_TICKET, tk, 0, 0, NULL);
  return 0;
}

int kvf__tcp_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) {
  return post_dealt(t, x, &(dealing){.runs = runs}, last);
}

/* A transform to a peer that reads patterns, from host memory: straight
 * from the plan (no run per piece); anything else as runs. */
int kvf__tcp_post_blocks(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last) {
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
bool kvf__tcp_mark_layers(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n) {
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

void kvf__tcp_abort(kvf__transport *t, kvf__xfer *x) {
  tcp_peer *tp = x->peer ? tcp_peer_of(to_tcp(t), x->peer) : NULL;
  if (!tp) return;
  pthread_mutex_lock(&tp->lock);
  for (uint32_t i = 0; i < tp->n_out; i++)
    for (item *it = tp->out[i].head; it; it = it->next)
      if (it->tk && it->tk->x == x) atomic_store(&it->tk->aborted, true);
  pthread_mutex_unlock(&tp->lock);
}
