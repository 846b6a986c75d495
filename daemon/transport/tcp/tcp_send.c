/* tcp_send.c - the tcp transport's sending side (tcp.c's comment at the top):
 * a post dealt into items over the peer's streams, the writes of frames,
 * patterns and layer markers, GPU staging, the streams' connect and their
 * sender threads. */
#include "tcp_int.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "auth.h"
#include "frame.h"
#include "pool.h"
#include "tcp_io.h"
#include "spin.h"

void kvf__tcp_item_free(item *it) {
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
    bhdr_encode(hdr, k, it->handle);
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
  bhdr_encode(hdr, (uint32_t)sl->n, it->handle);
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

void *kvf__tcp_sender_main(void *arg) {
  stream *s = arg;
  int broken = connect_stream(s);
  if (broken) kvf__tcp_post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, broken, s->tp);
  item *it;
  while ((it = next_item(s)) != NULL) {
    if (it->marker) { /* no ticket: a lost marker fails the peer, so the grant */
      int rc = broken ? 0 : write_marker(s, it);
      if (rc && !broken) kvf__tcp_post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, broken = rc, s->tp);
      kvf__tcp_item_free(it);
      continue;
    }
    uint64_t none = 0;
    atomic_compare_exchange_strong(&it->tk->first_ns, &none, kvf__now_ns());
    int rc = broken ? KVF_EPEERLOST : it->gpu ? write_item_staged(s, it) : write_item(s, it);
    bool item_only = rc == KVF_ECANCELED || rc == GPU_COPY_FAILED || rc == SOURCE_FAULT; /* the stream is fine */
    if (rc && !item_only && !broken) {
      broken = rc;
      kvf__tcp_post_event(s->tp->tt, EV_STREAM_ERROR, NULL, 0, rc, s->tp);
    }
    kvf__tcp_ticket_part_done(it->tk, rc == 0 ? 0 : rc == GPU_COPY_FAILED ? -EIO : item_only ? rc : KVF_EPEERLOST);
    kvf__tcp_item_free(it);
    thread_last_ns = kvf__now_ns();
  }
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
static bool patterns_for(const tcp_peer *tp) {
  const Kvf__Hello *h = tp->p->hello;
  bool offered = false;
  for (size_t i = 0; h && i < h->n_transports && !offered; i++)
    offered = strcmp(h->transports[i], KVF__TCP_PAT_CAP) == 0;
  return offered;
}

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
      if (items[i]) kvf__tcp_item_free(items[i]);
    free(tk);
    return rc;
  }
  tk->tt = tt;
  tk->x = x;
  tk->last = last;
  for (uint32_t i = 0; i < tp->n_out; i++)
    if (items[i]->gpu) x->path = "tcp-bounce";
  int used = 0;
  for (uint32_t i = 0; i < tp->n_out; i++) used += items[i]->n > 0 || (items[i]->ps && items[i]->ps->n > 0);
  /* An empty post (all parts already sent) still completes through the
   * queue, so the caller sees one callback either way. */
  atomic_store(&tk->outstanding, used ? used : 1);
  pthread_mutex_lock(&tp->lock);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    item *it = items[i];
    if (it->n == 0 && !(it->ps && it->ps->n)) {
      kvf__tcp_item_free(it);
      continue;
    }
    it->tk = tk;
    it->handle = x->handle;
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
  if (!b->xf.transform || !tp || !patterns_for(tp) || kvfd.pools[b->src->pool]->cuda_dev >= 0)
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
