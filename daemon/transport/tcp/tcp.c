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
 * Threads: a fixed set, tcp-threads a side, whatever the number of peers.
 * Sender workers (tcp_send.c) take outbound streams with queued items from
 * a run queue, one worker a stream at a time (its data stays in order),
 * and write a quantum of it (blocking writev from pool memory, many frames
 * per call) before the next stream. Receiver workers (tcp_recv.c) each
 * serve the inbound streams on their epoll set; a stream's receive parks
 * where a read would block, in the middle of a batch too, so a stalled
 * peer holds back no other. Workers never touch loop state: results go to
 * the loop through the transport's mailbox (mailbox.h), and the loop calls
 * back into xfer.c.
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
#include "tcp_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "pool.h"
#include "xfer_trace.h"
#include "spin.h"

static void on_event(kvf__mail *m);

void kvf__tcp_push_event(tcp_transport *tt, tevent *e) {
  e->tt = tt;
  kvf__mailbox_post(&tt->mb, &e->mail, on_event);
}

/* tp: the peer the event is about; NULL for a ticket's completion. */
void kvf__tcp_post_event(tcp_transport *tt, int kind, ticket *tk, uint64_t handle, int status, tcp_peer *tp) {
  tevent *e = calloc(1, sizeof(*e));
  if (!e) abort(); /* a lost completion would hang a transfer: fail loudly */
  e->kind = kind;
  e->tk = tk;
  e->handle = handle;
  e->status = status;
  e->peer = tp ? tp->p : NULL;
  e->gen = tp ? tp->gen : 0;
  kvf__tcp_push_event(tt, e);
}

void kvf__tcp_ticket_part_done(ticket *tk, int status) {
  if (status) {
    int zero = 0;
    atomic_compare_exchange_strong(&tk->status, &zero, status);
  }
  if (atomic_fetch_sub(&tk->outstanding, 1) > 1) return;
  atomic_store(&tk->done_ns, kvf__now_ns());
  kvf__tcp_post_event(tk->tt, EV_TICKET, tk, 0, 0, NULL);
}


static int tcp_grant_open(kvf__transport *t, kvf__xfer *x) {
  rgrant *g = calloc(1, sizeof(*g));
  if (!g) return -ENOMEM;
  int rc = kvf__rangeset_build(&g->rs, &x->dst);
  if (rc) {
    free(g);
    return rc;
  }
  kvf__tcp_rindex_build(&g->ix, &g->rs);
  g->x = x;
  g->peer = x->peer;
  g->total = x->dst.total;
  g->soon = kvf__api_wants_soon(x->owner);
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
    kvf__tcp_rindex_free(&g->ix);
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
  kvf__tcp_rindex_free(&g->ix);
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
  pthread_cond_init(&tp->in_done, NULL);
  kvf__transport_set_peer(t, p, tp);
  pthread_mutex_lock(&tp->lock);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    stream *s = &tp->out[i];
    s->tp = tp;
    s->index = i;
    s->fd = -1;
    s->outbound = true;
    kvf__tcp_stream_schedule(s); /* a sender worker connects it */
  }
  pthread_mutex_unlock(&tp->lock);
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
  int rc = kvf__tcp_stream_hand(tp->tt, s); /* a receiver worker sends the ACK and reads */
  if (rc) {
    close(fd);
    free(s);
    return rc;
  }
  pthread_mutex_lock(&tp->lock);
  s->next_in = tp->in;
  tp->in = s;
  pthread_mutex_unlock(&tp->lock);
  return 0;
}

/* Completes every queued item with the peer's loss; the tickets reach the
 * loop through the event queue like any other completion. */
static void drain_queues(tcp_peer *tp) {
  for (uint32_t i = 0; i < tp->n_out; i++) {
    item *it = tp->out[i].head;
    tp->out[i].head = tp->out[i].tail = NULL;
    if (tp->out[i].cur) { /* a quantum ended in it */
      tp->out[i].cur->next = it;
      it = tp->out[i].cur;
      tp->out[i].cur = NULL;
    }
    while (it) {
      item *next = it->next;
      if (it->tk) kvf__tcp_ticket_part_done(it->tk, KVF_EPEERLOST); /* a layer marker has none */
      kvf__tcp_item_free(tp->tt, it);
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
  /* The inbound streams' workers see the shutdown and let go of them; a
   * stream adopted a moment ago is started (and ends) first. */
  for (stream *s = tp->in; s; s = s->next_in) kvf__tcp_stream_wait_done(tp, s);
  pthread_mutex_unlock(&tp->lock);
  /* A sender worker in connect() or its handshake was woken by the
   * shutdown; one writing sees stop after its batch. */
  kvf__tcp_streams_unschedule(tp);
  drain_queues(tp);
  for (uint32_t i = 0; i < tp->n_out; i++) {
    if (tp->out[i].fd >= 0) close(tp->out[i].fd);
    kvf__tcp_stage_free(tp->out[i].stage);
  }
  while (tp->in) {
    stream *s = tp->in;
    tp->in = s->next_in;
    close(s->fd);
    kvf__tcp_stage_free(s->stage);
    free(s->bounce);
    free(s);
  }
  pthread_mutex_destroy(&tp->lock);
  pthread_cond_destroy(&tp->in_done);
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

/* EV_STREAM_GONE: unlinks, waits for its worker and frees the stream, when it still
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
  if (s) kvf__tcp_stream_wait_done(tp, s); /* its coroutine posted this just before it ended */
  pthread_mutex_unlock(&tp->lock);
  if (!s) return;
  close(s->fd);
  kvf__tcp_stage_free(s->stage);
  free(s->bounce);
  free(s);
}

/* Which stream broke and how, for the log line of the peer's fall. */
static void stream_broke(const tevent *e) {
  char why[128];
  snprintf(why, sizeof(why), "a data stream broke (%s)", kvf_strerror(e->status));
  kvf__peer_fail(e->peer, why);
}

/* The wire's rate (ns a byte) that g landed at, last byte at t_last: over
 * its last part alone, since parts after pauses (layer-wise) hold compute
 * between them; 0 when unknown. */
static double landed_rate(tcp_transport *tt, rgrant *g, uint64_t t_last) {
  pthread_mutex_lock(&tt->g_lock);
  uint64_t from = g->part_ns, bytes = g->total > g->part_landed ? g->total - g->part_landed : 0;
  pthread_mutex_unlock(&tt->g_lock);
  return bytes && t_last > from ? (double)(t_last - from) / (double)bytes : 0;
}

/* A grant's data began to come, or a part of it after a pause (a layer's
 * compute): its receiving engine hears Soon when the rest should land
 * within KVF__SOON_MAX_US at the rate that the last grant landed here at,
 * so that its library polls for RECV_DONE instead of sleeping (a grant
 * posted ahead of its send: the engine's threads slept since; a layer-wise
 * send's last parts: they slept through each layer). SOON_HOPS_US: the
 * last byte's way to the event, past the wire. */
#define SOON_HOPS_US 100
static void tell_soon(tcp_transport *tt, rgrant *g) {
  const kvf__xfer *x = g->x;
  uint64_t now = kvf__now_ns();
  if (!x || !x->owner || tt->recv_ns_per_byte <= 0 || now < g->soon_until_ns) return; /* told: it polls */
  pthread_mutex_lock(&tt->g_lock);
  uint64_t rest = g->total > g->landed ? g->total - g->landed : 0;
  pthread_mutex_unlock(&tt->g_lock);
  double est_us = (double)rest * tt->recv_ns_per_byte / 1e3 + SOON_HOPS_US;
  if (kvf__api_soon_estimated(x->owner, x->id, est_us)) g->soon_until_ns = now + (uint64_t)(est_us * 1e3);
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
  case EV_STARTED:
    if ((g = grant_for_event(e->tt, e->handle)) != NULL) tell_soon(e->tt, g);
    break;
  case EV_LANDED:
    if ((g = grant_for_event(e->tt, e->handle)) == NULL) break;
    double rate = landed_rate(e->tt, g, e->t_last);
    if (rate > 0) e->tt->recv_ns_per_byte = rate;
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
  snprintf(buf, len, "\"name\": \"tcp\", \"threads\": %u, \"senders_polling_max\": %u, \"streams_per_peer\": %u, "
                     "\"open_grants\": %zu, \"streams_out\": %zu, \"streams_in\": %zu, \"patterns_sent\": %llu, "
                     "\"pattern_batches_read\": %llu, \"pattern_pieces_read\": %llu",
           tt->n_senders + tt->n_receivers, tt->rq_max_polling, kvfd.cfg.tcp_streams, n, out, in,
           (unsigned long long)atomic_load(&tt->pat_sent), (unsigned long long)atomic_load(&tt->pat_batches),
           (unsigned long long)atomic_load(&tt->pat_pieces));
}

static void tcp_free(kvf__mailbox *mb) {
  tcp_transport *tt = kvf__container_of(mb, tcp_transport, mb);
  kvf__map_free(&tt->grants);
  kvf__tcp_pspare_destroy(&tt->spare);
  pthread_mutex_destroy(&tt->g_lock);
  pthread_cond_destroy(&tt->g_cond);
  free(tt);
}

/* Every peer is down by now (peers stop first): no thread posts any more. */
static void tcp_destroy(kvf__transport *t) {
  kvf__spin_wakers_remove(to_tcp(t));
  kvf__tcp_senders_stop(to_tcp(t));
  kvf__tcp_receivers_stop(to_tcp(t));
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
    .post = kvf__tcp_post,
    .post_blocks = kvf__tcp_post_blocks,
    .mark_layers = kvf__tcp_mark_layers,
    .abort = kvf__tcp_abort,
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
  kvf__tcp_pspare_init(&tt->spare);
  tt->n_workers = kvf__tcp_workers();
  rc = kvf__tcp_senders_start(tt);
  if (rc == 0) rc = kvf__tcp_receivers_start(tt);
  if (rc == 0) rc = kvf__spin_wakers_add(KVF__SPIN_SEND, kvf__tcp_senders_wake, tt);
  if (rc == 0) rc = kvf__spin_wakers_add(KVF__SPIN_RECV, kvf__tcp_receivers_wake, tt);
  if (rc) {
    snprintf(err, errlen, "cannot start the tcp transport's %u worker threads: %s", tt->n_workers, strerror(-rc));
    return rc; /* the daemon exits */
  }
  *out = &tt->base;
  return 0;
}

