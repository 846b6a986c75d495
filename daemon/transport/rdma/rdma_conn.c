/* rdma_conn.c - the rdma transport's connections: the CM, queue pairs and
 * peers, and the Hello that tells peers how to reach us.
 *
 * Dialing. When a peer comes up (peer_up, with its Hello), each of our
 * devices gets a link to the peer's device of the same index (modulo its
 * count): a CQ and rdma-qps-per-peer dialed QPs, only ever written from.
 * The CM request's private data names both daemons' sessions (and, with a
 * cluster key, a proof of it): the acceptor finds the peer by it, or parks
 * the request until that peer's Hello is in, and refuses stale
 * incarnations. Accepted QPs only receive the peer's completion notices
 * (and, with memory windows, carry the binds of our windows).
 *
 * Failure. A work completion in error, a QP async error or a CM disconnect
 * on a dialed QP resets the peer's data path (kvf__rdma_reset_peer): every
 * transfer in flight to it ends with KVF_EPEERLOST at once (so does each
 * grant whose memory windows were bound on the dropped QPs: its Grant named
 * them, kvf__rdma_mw_forget_link), its QPs are
 * rebuilt and later transfers flow again, while the control connection
 * stays (a daemon that is gone is noticed there, and peer_down follows).
 * Dialing is retried with backoff; posts wait at most UNREADY_MS for a QP,
 * and a peer whose QPs do not connect within CONNECT_MS is failed
 * (kvf__peer_fail). Accepted QPs' failures are the peer's to handle.
 * peer_down detaches the peer's links from the threads, moves its QPs to the
 * error state (no more DMA from our pools), completes its outstanding
 * tickets with KVF_EPEERLOST and leaves the blocking destruction of QPs, ids
 * and CQs to the reaper thread. */
#include "rdma_int.h"

#include <errno.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>

#include "peer.h"
#include "pool.h"

/* The CM request's private data: little-endian fields. */
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

/* ------------------------------------------------------------ connections */

bool kvf__rdma_usable(kvf__transport *t, kvf__peer *p) {
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

/* rdma_create_qp with *a; a device that refuses it may not inline, or not
 * take that many entries per request with inline data: without inline
 * data, then with one entry (no gathering), then without both. */
static int create_qp_fallback(rqp *q, rdev *d, struct ibv_qp_init_attr *a) {
  struct ibv_qp_init_attr want = *a;
  for (int k = 0; k < 4; k++) {
    *a = want;
    if (k & 1) {
      if (!want.cap.max_inline_data) continue;
      a->cap.max_inline_data = 0;
    }
    if (k & 2) {
      if (want.cap.max_send_sge <= 1) continue;
      a->cap.max_send_sge = 1;
    }
    if (rdma_create_qp(q->id, d->pd, a) == 0) return 0;
  }
  return -errno;
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
  /* Our writes gather runs that land back to back (rdma_post.c): as many
   * entries per request as the device takes, up to GATHER_MAX */
  if (q->outbound) a.cap.max_send_sge = d->max_sge < GATHER_MAX ? (d->max_sge ? d->max_sge : 1) : GATHER_MAX;
  int rc = create_qp_fallback(q, d, &a);
  if (rc) return rc;
  q->qp = q->id->qp;
  q->qp_num = q->qp->qp_num;
  q->max_inline = a.cap.max_inline_data;
  q->max_sge = a.cap.max_send_sge < GATHER_MAX ? a.cap.max_send_sge : GATHER_MAX;
  if (q->outbound && q->max_sge < d->write_sge) d->write_sge = q->max_sge ? q->max_sge : 1;
  q->bind_cap = binds ? lk->depth : 0;
  if (q->outbound) {
    kvf__rdma_init_chain(q);
    q->sq_cap = lk->depth;
    q->ring = calloc(q->sq_cap, sizeof(*q->ring));
    if (!q->ring) return -ENOMEM;
  } else {
    q->rq_cap = lk->depth;
    if ((rc = kvf__rdma_post_recvs(q, q->rq_cap)) != 0) return rc;
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
  kvf__rdma_fail_peer_soon(lk->rp, "rdma: %s with %s (%s -> %s %s) failed: %s", what, peer_name(lk->rp), lk->dev->name,
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
    kvf__rdma_accepted_ready(q);
    return;
  }
  atomic_store(&q->ready, true);
  kvf__rdma_wake(q->lk->dev);
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
    if (sa) kvf__rdma_addr_text((const struct sockaddr_storage *)sa, ip, sizeof(ip));
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
void kvf__rdma_sweep_parked(rdma_transport *rt, rpeer *adopt, bool drop_all) {
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

void kvf__rdma_on_cm_readable(uv_poll_t *h, int status, int events) {
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

void *kvf__rdma_reaper_main(void *arg) {
  rdma_transport *rt = arg;
  pthread_mutex_lock(&rt->reaper.lock);
  for (;;) {
    while (!rt->reaper.head && !rt->reaper.stop) pthread_cond_wait(&rt->reaper.cond, &rt->reaper.lock);
    rlink *lk = rt->reaper.head;
    if (!lk) break;
    rt->reaper.head = lk->next;
    pthread_mutex_unlock(&rt->reaper.lock);
    destroy_link(lk);
    pthread_mutex_lock(&rt->reaper.lock);
  }
  pthread_mutex_unlock(&rt->reaper.lock);
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
  if (lk->bcq) kvf__rdma_mw_forget_link(lk);
  if (lk->cq) lk->cq->cq_context = NULL;
  if (!rt->reaper.on) {
    destroy_link(lk);
    return;
  }
  pthread_mutex_lock(&rt->reaper.lock);
  lk->next = rt->reaper.head;
  rt->reaper.head = lk;
  pthread_cond_signal(&rt->reaper.cond);
  pthread_mutex_unlock(&rt->reaper.lock);
}

/* Completes every ticket of rp with KVF_EPEERLOST for what never ran; what
 * was in flight the threads completed when they let go of the links. */
static void drain_peer(rpeer *rp) {
  for (ticket *tk = rp->rt->live; tk; tk = tk->next_live) {
    if (tk->rp != rp) continue;
    size_t k = kvf__rdma_take_back(rp, tk);
    tk->rp = NULL;
    kvf__rdma_credit(tk, k, KVF_EPEERLOST);
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
    if (rp->links[i]->attached) kvf__rdma_detach_and_wait(rp->links[i]);
  for (int i = 0; i < rp->n_links; i++) reap_link(rp->links[i]);
  rp->n_links = 0;
  drain_peer(rp);
}

void kvf__rdma_peer_down(kvf__transport *t, kvf__peer *p) {
  rpeer *rp = rpeer_of(to_rdma(t), p);
  if (!rp) return;
  unregister_peer(rp);
  drop_links(rp);
  pthread_mutex_destroy(&rp->qlock);
  free(rp->pool_size);
  free(rp->pool_gpu);
  free(rp->pool_bounce);
  free(rp);
}

static int find_mrs(rlink *lk, const Kvf__RdmaDevice *rd, const rpeer *rp) {
  lk->n_rpools = rp->n_pools;
  /* KVF__POOLS_MAX: the peer's engine memory comes later, in its grants */
  lk->raddr = calloc(KVF__RDMA_SLOTS, sizeof(*lk->raddr)); /* the staging slot's stays 0: windows' addresses */
  lk->rkey = calloc(KVF__RDMA_SLOTS, sizeof(*lk->rkey));
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
  if (!rt->mw.on) return 0;
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
  kvf__rdma_send_cmd(d, CMD_ATTACH, lk);
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
  rp->pool_size = calloc(KVF__RDMA_SLOTS, sizeof(*rp->pool_size));
  rp->pool_gpu = calloc(KVF__RDMA_SLOTS, sizeof(*rp->pool_gpu));
  rp->pool_bounce = calloc(KVF__RDMA_SLOTS, sizeof(*rp->pool_bounce));
  if (!rp->pool_size || !rp->pool_gpu || !rp->pool_bounce) {
    free(rp->pool_size);
    free(rp->pool_gpu);
    free(rp->pool_bounce);
    free(rp);
    return NULL;
  }
  /* Pools its NICs do not reach (the same on each of its devices). */
  const Kvf__RdmaInfo *ri = h->rdma;
  for (size_t i = 0; ri && ri->n_devices && i < ri->devices[0]->n_mrs; i++) {
    const Kvf__RdmaMr *m = ri->devices[0]->mrs[i];
    if (m->pool < h->n_pools && m->bounce) rp->pool_bounce[m->pool] = true;
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

int kvf__rdma_peer_up(kvf__transport *t, kvf__peer *p) {
  rdma_transport *rt = to_rdma(t);
  const Kvf__RdmaInfo *ri = p->hello ? p->hello->rdma : NULL;
  if (!ri || ri->n_devices == 0 || rt->n_peers == KVF__MAX_PEERS_CFG) return KVF_EPROTO;
  rpeer *rp = rpeer_new(rt, p);
  if (!rp) return -ENOMEM;
  int rc = make_links(rp);
  if (rc == 0) kvf__rdma_sweep_parked(rt, rp, false);
  return rc;
}

/* A dialed QP broke (completion error, QP fatal, disconnect): every
 * transfer in flight to the peer fails with KVF_EPEERLOST at once and the
 * peer's QPs are rebuilt, while the control connection stays: a data-path
 * failure does not reset the control plane (both daemons reconnecting at
 * the same moment only churns it). Posts meanwhile queue, and fail after
 * UNREADY_MS without a QP; a rebuild that cannot connect in CONNECT_MS
 * fails the peer. */
void kvf__rdma_reset_peer(rpeer *rp, const char *why) {
  kvf__warn("peer %s: %s; failing its rdma transfers and reconnecting", peer_name(rp), why);
  rp->resets++;
  rp->resetting = true; /* grants bound on these links fail (kvf__rdma_mw_forget_link) */
  drop_links(rp);
  rp->resetting = false;
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
    if (tk->rp == rp) kvf__rdma_credit(tk, kvf__rdma_take_back(rp, tk), KVF_EPEERLOST);
  pthread_mutex_unlock(&rp->qlock);
}

/* Once a second: drop parked requests nobody claimed, and fail peers whose
 * QPs do not connect (a CM that keeps retrying would hold them forever). */
void kvf__rdma_on_sweep(uv_timer_t *tm) {
  rdma_transport *rt = kvf__container_of(tm, rdma_transport, sweep);
  kvf__rdma_sweep_parked(rt, NULL, false);
  for (int i = 0; i < rt->n_devs; i++)
    if (!rt->devs[i].listener) kvf__rdma_relisten(&rt->devs[i]);
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

/* ------------------------------------------------------------ Hello */

int kvf__rdma_build_hello(rdma_transport *rt) {
  size_t n = (size_t)rt->n_devs * (kvfd.n_pools ? kvfd.n_pools : 1);
  rt->hello.mr = calloc(n, sizeof(*rt->hello.mr));
  rt->hello.mr_ptr = calloc(n, sizeof(*rt->hello.mr_ptr));
  if (!rt->hello.mr || !rt->hello.mr_ptr) return -ENOMEM;
  kvf__rdma_info__init(&rt->hello.info);
  rt->hello.info.version = INFO_VERSION;
  rt->hello.info.qps_per_peer = kvfd.cfg.rdma_qps_per_peer;
  for (int i = 0; i < rt->n_devs; i++) {
    rdev *d = &rt->devs[i];
    Kvf__RdmaDevice *h = &rt->hello.dev[i];
    kvf__rdma_device__init(h);
    h->name = d->name;
    h->port = d->port;
    h->gid.data = d->gid.raw;
    h->gid.len = sizeof(d->gid.raw);
    h->gid_index = d->gid_index;
    h->cm_addr = d->ip;
    h->cm_port = d->cm_port;
    h->mrs = &rt->hello.mr_ptr[(size_t)i * kvfd.n_pools];
    h->n_mrs = kvfd.n_pools;
    for (size_t k = 0; k < kvfd.n_pools; k++) {
      Kvf__RdmaMr *m = &rt->hello.mr[(size_t)i * kvfd.n_pools + k];
      kvf__rdma_mr__init(m);
      const kvf__pool *p = kvf__pool_get((uint32_t)k);
      m->pool = (uint32_t)k;
      m->bounce = !p || rt->pool_bounce[k]; /* no MR: writes go through our staging */
      m->addr = m->bounce ? 0 : (uint64_t)(uintptr_t)p->base;
      m->rkey = rt->mw.on || m->bounce ? 0 : d->mrs[k]->rkey; /* windows: no pool-wide write access */
      m->length = p ? p->size : 0;
      h->mrs[k] = m;
    }
    rt->hello.dev_ptr[i] = h;
  }
  rt->hello.info.devices = rt->hello.dev_ptr;
  rt->hello.info.n_devices = (size_t)rt->n_devs;
  rt->hello.info.memory_windows = rt->mw.on;
  return 0;
}

/* Where our devices listen and the rkeys of our pools on each. */
void kvf__rdma_hello(kvf__transport *t, Kvf__Hello *h) {
  rdma_transport *rt = to_rdma(t);
  if (rt->n_devs) h->rdma = &rt->hello.info;
}

