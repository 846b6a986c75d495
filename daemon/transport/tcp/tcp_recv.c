/* tcp_recv.c - the tcp transport's receiving side (tcp.c's comment at the
 * top): receiver workers reading batches, pattern batches and layer markers
 * straight into pool memory (or through GPU staging), pinning the grant a
 * batch writes into. */
#include "tcp_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "frame.h"
#include "pool.h"
#include "tcp_io.h"
#include "spin.h"

/* This thread's last activity (moved data), for spin.h's window. */
static _Thread_local uint64_t thread_last_ns;

/* EV_LANDED, with the grant's first and last byte's times. */
static void post_landed(tcp_peer *tp, uint64_t handle, uint64_t first_ns, bool sealed) {
  tevent *e = calloc(1, sizeof(*e));
  if (!e) abort(); /* as kvf__tcp_post_event */
  *e = (tevent){.kind = EV_LANDED, .handle = handle, .peer = tp->p, .gen = tp->gen, .t_first = first_ns,
                .t_last = kvf__now_ns(), .sealed = sealed};
  kvf__tcp_push_event(tp->tt, e);
}

/* ------------------------------------------------------ receiver workers
 *
 * tcp-threads workers serve every peer's inbound streams, each stream on
 * one worker's epoll set. A stream's receive is the straight-line code
 * below (batches, pattern batches, markers, GPU staging), run as a
 * coroutine on a small stack of its own: where a read would block, it
 * parks (recv_some) and its worker serves the other streams until epoll
 * says this one is readable again. So a peer that stalls in the middle of
 * a batch holds back no other peer's data, and the receive keeps its
 * state (where in which batch, the grant pinned) without a thread. A
 * stream that reads RECV_QUANTUM in one go yields to the others too. */
typedef struct rworker {
  tcp_transport *tt;
  pthread_t thr;
  int ep, efd;             /* its epoll set; an eventfd in it: new streams, stop */
  pthread_mutex_t lock;    /* inbox, stop */
  stream *inbox;           /* adopted streams not started yet */
  bool stop;
  stream *list;            /* its streams (the worker's own from here on) */
  stream *ready, **ready_tail; /* yielded with data left */
  unsigned n_watch;        /* streams mid-payload with a grant pinned */
  ucontext_t main;         /* the worker's own context, while a stream runs */
} rworker;

/* The stream whose coroutine runs on this thread. */
static _Thread_local stream *co_cur;

/* Back to the worker; returns once the worker resumes this stream. */
static void co_yield(void) {
  stream *s = co_cur;
  swapcontext(&s->co, &s->w->main);
}

/* The stream read n bytes: past its quantum, it lets the others run. */
static void co_account(ssize_t n) {
  stream *s = co_cur;
  s->quantum += (uint64_t)n;
  if (s->quantum < RECV_QUANTUM) return;
  if (!s->on_ready) {
    s->on_ready = true;
    s->next_ready = NULL;
    *s->w->ready_tail = s;
    s->w->ready_tail = &s->next_ready;
  }
  co_yield();
}

/* One recvmsg. Where it would block, the stream parks until its worker
 * resumes it (readable, or RECV_CHECK_MS passed while it watches a grant):
 * -EAGAIN then, and the caller tries again. The worker, not the stream,
 * polls while spin.h's window is open (epoll_wait without a timeout). */
static int recv_some(int fd, struct iovec *iov, int n) {
  struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
  for (;;) {
    ssize_t r = recvmsg(fd, &msg, MSG_DONTWAIT);
    if (r > 0) {
      thread_last_ns = kvf__now_ns();
      co_account(r);
      return (int)r;
    }
    if (r == 0) return -ECONNRESET;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      co_yield();
      return -EAGAIN;
    }
    if (errno != EINTR) return -errno;
  }
}

static int discard(int fd, uint64_t len, uint8_t *ahead, uint32_t *have);
static int read_exact(int fd, struct iovec *iov, int n, uint8_t *ahead, uint32_t *have, bool *faulted,
                      const atomic_bool *gone, uint64_t *rest);

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
static int read_exact_in(int fd, struct iovec *iov, int n, uint8_t *ahead, uint32_t *have, bool *faulted,
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
    int r = recv_some(fd, v, faulted && *faulted ? 1 : cnt);
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

/* read_exact_in; with gone, the stream is resumed every RECV_CHECK_MS
 * while it waits, so that it sees the grant close (tcp_grant_close waits
 * for it). */
static int read_exact(int fd, struct iovec *iov, int n, uint8_t *ahead, uint32_t *have, bool *faulted,
                      const atomic_bool *gone, uint64_t *rest) {
  stream *s = co_cur;
  bool watch = gone && !s->watch;
  if (watch) {
    s->watch = true;
    s->w->n_watch++;
  }
  int rc = read_exact_in(fd, iov, n, ahead, have, faulted, gone, rest);
  if (watch) {
    s->watch = false;
    s->w->n_watch--;
  }
  return rc;
}

static int read_header(int fd, uint8_t *hdr, uint32_t *have) {
  while (*have < BHDR_LEN) {
    struct iovec iov = {hdr + *have, BHDR_LEN - *have};
    int r = recv_some(fd, &iov, 1);
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

/* A batch for g is read (g_lock held). Its first, and the first of each
 * part that comes after a pause, may tell its engine Soon (tcp.c): the
 * engine's threads slept through the prefill before the grant's first
 * bytes, and through each layer's compute before a layer-wise part. */
static void note_batch(tcp_peer *tp, rgrant *g, uint64_t handle) {
  uint64_t now = kvf__now_ns();
  bool starts = !g->first_ns || now - g->last_batch_ns > (uint64_t)PART_GAP_US * 1000;
  if (starts) {
    g->part_ns = now;
    g->part_landed = g->landed;
  }
  if (!g->first_ns) g->first_ns = now;
  g->last_batch_ns = now;
  if (starts && g->soon) kvf__tcp_post_event(tp->tt, EV_STARTED, NULL, handle, 0, tp);
}

/* Looks up and pins the grant a batch writes into; NULL when the batch must
 * be discarded. A batch with any entry outside its grant fails that grant.
 * The entries are e, or for a pattern batch pe. The check runs after the
 * pin, outside g_lock: the grant's ranges do not change while it is open,
 * and the pin keeps it (tcp_grant_close waits for its writers), so the
 * receivers of a fan-in do not queue behind each other's checks. */
static rgrant *pin_grant(tcp_peer *tp, const batch_hdr *h, batch_ent *e, kvf__tcp_pat *pe) {
  tcp_transport *tt = tp->tt;
  pthread_mutex_lock(&tt->g_lock);
  rgrant *g = open_grant_of(tp, h->handle);
  if (g) g->writers++;
  pthread_mutex_unlock(&tt->g_lock);
  uint32_t bad = !g ? h->count : pe ? kvf__tcp_pat_first_outside_ix(&g->ix, pe, h->count)
                                    : first_outside(&g->rs, e, h->count);
  pthread_mutex_lock(&tt->g_lock);
  if (bad < h->count) {
    kvf__warn("peer %s wrote outside grant %016llx (pool %u offset %llu%s): refused", tp->p->cfg.name,
              (unsigned long long)h->handle, pe ? pe[bad].pool : e[bad].pool,
              (unsigned long long)(pe ? pe[bad].off : e[bad].offset), pe ? ", a pattern" : "");
    kvf__tcp_post_event(tt, EV_DATA_ERROR, NULL, h->handle, KVF_EPERM, tp);
    if (g && --g->writers == 0 && g->closed) pthread_cond_broadcast(&tt->g_cond);
    g = NULL;
  }
  if (g && !h->sealed) g->unsealed = true;
  if (g) note_batch(tp, g, h->handle);
  pthread_mutex_unlock(&tt->g_lock);
  return g;
}

static void unpin_grant(rgrant *g, tcp_peer *tp, uint64_t handle, uint64_t len) {
  tcp_transport *tt = tp->tt;
  pthread_mutex_lock(&tt->g_lock);
  g->writers--;
  g->landed += len;
  /* len 0 (a failed batch, a guard's pin) lands nothing: the grant landed
   * with the batch that brought its last byte, and is not posted twice */
  if (len && !g->closed && g->landed == g->total) post_landed(tp, handle, g->first_ns, !g->unsealed);
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
  if (b->status == -EIO) kvf__tcp_post_event(s->tp->tt, EV_COPY_ERROR, NULL, b->handle, -EIO, s->tp);
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
  gstage *st = kvf__tcp_stage_get(s);
  sbatch *b = st ? calloc(1, sizeof(*b)) : NULL;
  if (!b) {
    unpin_grant(g, s->tp, h->handle, 0);
    kvf__tcp_post_event(s->tp->tt, EV_COPY_ERROR, NULL, h->handle, -ENOMEM, s->tp);
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
  if (rc == 0 && faulted) kvf__tcp_post_event(s->tp->tt, EV_DATA_ERROR, NULL, h->handle, -EFAULT, s->tp);
  unpin_grant(g, s->tp, h->handle, rc || faulted ? 0 : bytes);
  return sunk ? discard(s->fd, rest, ahead, have) : rc;
}

static void pin_again(tcp_transport *tt, rgrant *g) {
  pthread_mutex_lock(&tt->g_lock);
  g->writers++; /* the grant waits for its writers */
  pthread_mutex_unlock(&tt->g_lock);
}

/* A pattern batch into GPU pools: its pieces go through receive_batch_gpu
 * as plain entries, BATCH_FRAMES at a time. Each share unpins g once (when
 * its staged copies are done, which may be before the next share is
 * read), so each after the first pins it again, and this holds a pin of
 * its own meanwhile: without it the grant could close (cancel, deadline)
 * and be freed between one share's unpin and the next one's pin. */
static int receive_pattern_gpu(stream *s, const batch_hdr *h, const kvf__tcp_pat *pe, rgrant *g,
                               uint8_t *ahead, uint32_t *have) {
  batch_ent e[BATCH_FRAMES];
  uint32_t k = 0, i = 0;
  uint64_t piece = 0, bytes = 0;
  int rc = 0;
  bool first = true;
  pin_again(s->tp->tt, g); /* the guard */
  while (rc == 0 && i < h->count) {
    const kvf__tcp_pat *p = &pe[i];
    e[k++] = (batch_ent){p->pool, p->len, p->off + piece / p->n1 * p->s2 + piece % p->n1 * p->s1};
    bytes += p->len;
    if (++piece == (uint64_t)p->n1 * p->n2) piece = 0, i++;
    if (k < BATCH_FRAMES && i < h->count) continue;
    if (!first) pin_again(s->tp->tt, g); /* the first share has pin_grant's */
    first = false;
    batch_hdr sub = {DATA_MAGIC, k, h->handle, false};
    rc = receive_batch_gpu(s, &sub, e, g, bytes, i == h->count ? ahead : NULL, have);
    k = 0, bytes = 0;
  }
  unpin_grant(g, s->tp, h->handle, 0);
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
  kvf__tcp_rplan_init(&rp, pe, h->count, &s->bounce);
  for (int n; rc == 0 && (n = kvf__tcp_rplan_step(&rp, iov, RECV_IOVS)) > 0;) {
    uint64_t got = iov_bytes(iov, n);
    rc = read_exact(s->fd, iov, n, kvf__tcp_rplan_done(&rp) ? ahead : NULL, have, &faulted, &g->closed, &rest);
    landed += got;
    if (rc == 0 && kvf__tcp_rplan_scatter(&rp) != 0) faulted = true;
  }
  bool sunk = rc == PAYLOAD_SUNK;
  if (rc == 0 && faulted) kvf__tcp_post_event(s->tp->tt, EV_DATA_ERROR, NULL, h->handle, -EFAULT, s->tp);
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
  kvf__tcp_push_event(s->tp->tt, e);
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
  kvf__tcp_push_event(tp->tt, e);
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

static void receive_stream(stream *s) {
  uint8_t hdr[BHDR_LEN];
  uint32_t have = 0;
  if (kvf__send_all(s->fd, KVF__TCP_ACK, KVF__FRAME_HDR, -1) != 0) {
    if (!atomic_load(&s->tp->stop)) kvf__tcp_post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, KVF_EPEERLOST, s->tp);
    stream_gone(s);
    return;
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
    kvf__tcp_post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, rc, s->tp);
  stream_gone(s);
}


/* The coroutine's body: the stream's receive, to its end. */
static void co_main(void) {
  stream *s = co_cur;
  receive_stream(s);
  s->finished = true;
} /* returns to the worker (uc_link) */

/* The worker lets go of a finished stream: its owner (peer_down, or the
 * loop's reap) may free it once done is set. */
static void stream_release(rworker *w, stream *s) {
  epoll_ctl(w->ep, EPOLL_CTL_DEL, s->fd, NULL);
  for (stream **pp = &w->list; *pp; pp = &(*pp)->next_w)
    if (*pp == s) {
      *pp = s->next_w;
      break;
    }
  munmap(s->stack, RECV_STACK);
  s->stack = NULL;
  tcp_peer *tp = s->tp;
  pthread_mutex_lock(&tp->lock);
  s->done = true;
  pthread_cond_broadcast(&tp->in_done);
  pthread_mutex_unlock(&tp->lock);
}

/* Runs s until it parks, yields or ends. */
static void resume(rworker *w, stream *s) {
  if (s->finished) return;
  co_cur = s;
  s->quantum = 0;
  swapcontext(&w->main, &s->co);
  co_cur = NULL;
  if (s->finished && !s->on_ready) stream_release(w, s);
}

/* Starts the streams handed to w. */
static bool take_inbox(rworker *w) {
  uint64_t v;
  if (read(w->efd, &v, sizeof(v)) < 0) { /* nothing new (EAGAIN) */
  }
  pthread_mutex_lock(&w->lock);
  stream *s = w->inbox;
  w->inbox = NULL;
  bool stop = w->stop;
  pthread_mutex_unlock(&w->lock);
  while (s) {
    stream *next = s->next_new;
    getcontext(&s->co);
    s->co.uc_stack = (stack_t){.ss_sp = (uint8_t *)s->stack + RECV_GUARD, .ss_size = RECV_STACK - RECV_GUARD};
    s->co.uc_link = &w->main;
    makecontext(&s->co, co_main, 0);
    s->next_w = w->list;
    w->list = s;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = s};
    epoll_ctl(w->ep, EPOLL_CTL_ADD, s->fd, &ev); /* failing, the stream's reads fail its receive */
    resume(w, s);
    s = next;
  }
  return stop;
}

static void run_ready(rworker *w) {
  stream *s = w->ready;
  w->ready = NULL;
  w->ready_tail = &w->ready;
  while (s) {
    stream *next = s->next_ready;
    s->on_ready = false;
    if (s->finished) stream_release(w, s);
    else resume(w, s);
    s = next;
  }
}

/* Streams waiting on a grant mid-payload look whether it closed. */
static void run_watch(rworker *w) {
  stream *next;
  for (stream *s = w->list; s; s = next) {
    next = s->next_w; /* s may be released */
    if (s->watch) resume(w, s);
  }
}

/* How long a receiver may sleep: until an event; RECV_CHECK_MS while
 * streams wait on grants (run_watch); until its spin backoff ends, when
 * its window is still open then. */
static int recv_wait_ms(const rworker *w) {
  int ms = w->n_watch ? RECV_CHECK_MS : -1;
  return w->list ? kvf__spin_wait_ms(KVF__SPIN_RECV, thread_last_ns, ms) : ms;
}

static void *receiver_main(void *arg) {
  rworker *w = arg;
  struct epoll_event ev[64];
  uint64_t tick = kvf__now_ns();
  for (;;) {
    int n = epoll_wait(w->ep, ev, 64, 0);
    if (n == 0 && !w->ready) { /* a worker without streams has nothing to poll for */
      if (w->list && kvf__spin_open(KVF__SPIN_RECV, thread_last_ns)) kvf__spin_relax(KVF__SPIN_RECV);
      else n = epoll_wait(w->ep, ev, 64, recv_wait_ms(w));
    }
    bool stop = false;
    for (int i = 0; i < n; i++) {
      if (ev[i].data.ptr) resume(w, ev[i].data.ptr);
      else stop = take_inbox(w);
    }
    if (stop) break;
    run_ready(w);
    uint64_t now = kvf__now_ns();
    if (w->n_watch && now - tick >= RECV_CHECK_MS * 1000000ull) run_watch(w);
    if (now - tick >= RECV_CHECK_MS * 1000000ull) tick = now;
  }
  return NULL;
}

int kvf__tcp_stream_hand(tcp_transport *tt, stream *s) {
  /* its lowest page a guard: an overflow faults instead of writing over
   * whatever lies below */
  s->stack = mmap(NULL, RECV_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK | MAP_NORESERVE,
                  -1, 0);
  if (s->stack == MAP_FAILED) {
    s->stack = NULL;
    return -ENOMEM;
  }
  if (mprotect(s->stack, RECV_GUARD, PROT_NONE) != 0) {
    munmap(s->stack, RECV_STACK);
    s->stack = NULL;
    return -errno;
  }
  rworker *w = &tt->receivers[atomic_fetch_add(&tt->rw_next, 1) % tt->n_receivers];
  s->w = w;
  pthread_mutex_lock(&w->lock);
  s->next_new = w->inbox;
  w->inbox = s;
  pthread_mutex_unlock(&w->lock);
  uint64_t one = 1;
  return write(w->efd, &one, sizeof(one)) == sizeof(one) ? 0 : -errno;
}

void kvf__tcp_stream_wait_done(tcp_peer *tp, stream *s) {
  while (!s->done) pthread_cond_wait(&tp->in_done, &tp->lock);
}

int kvf__tcp_receivers_start(tcp_transport *tt) {
  tt->receivers = calloc(tt->n_workers, sizeof(rworker));
  if (!tt->receivers) return -ENOMEM;
  for (; tt->n_receivers < tt->n_workers; tt->n_receivers++) {
    rworker *w = &tt->receivers[tt->n_receivers];
    w->tt = tt;
    w->ready_tail = &w->ready;
    w->ep = epoll_create1(EPOLL_CLOEXEC);
    w->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (w->ep < 0 || w->efd < 0 || epoll_ctl(w->ep, EPOLL_CTL_ADD, w->efd, &ev) != 0) {
      int rc = -errno;
      if (w->ep >= 0) close(w->ep);
      if (w->efd >= 0) close(w->efd);
      return rc;
    }
    pthread_mutex_init(&w->lock, NULL);
    int rc = pthread_create(&w->thr, NULL, receiver_main, w);
    if (rc) {
      close(w->ep);
      close(w->efd);
      pthread_mutex_destroy(&w->lock);
      return -rc;
    }
    pthread_setname_np(w->thr, "kvf-tcp-recv");
  }
  return 0;
}

/* spin.h opened the receive window (a grant opened here): every worker
 * asleep in epoll wakes (its eventfd, as for new streams) and, holding
 * streams, polls them through the window, so the data finds it awake. */
void kvf__tcp_receivers_wake(void *arg) {
  tcp_transport *tt = arg;
  uint64_t one = 1;
  for (unsigned i = 0; i < tt->n_receivers; i++)
    if (write(tt->receivers[i].efd, &one, sizeof(one)) < 0) { /* full (EAGAIN): it is awake anyway */
    }
}

/* Every peer is down: every stream was let go of. */
void kvf__tcp_receivers_stop(tcp_transport *tt) {
  for (unsigned i = 0; i < tt->n_receivers; i++) {
    rworker *w = &tt->receivers[i];
    pthread_mutex_lock(&w->lock);
    w->stop = true;
    pthread_mutex_unlock(&w->lock);
    uint64_t one = 1;
    if (write(w->efd, &one, sizeof(one)) < 0) kvf__warn("tcp: cannot stop a receiver worker: %s", strerror(errno));
    pthread_join(w->thr, NULL);
    close(w->ep);
    close(w->efd);
    pthread_mutex_destroy(&w->lock);
  }
  free(tt->receivers);
}
