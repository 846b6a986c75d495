/* xfer.c - the transfer state machine (see xfer.h and DESIGN.md).
 *
 * Receiver side: a grant is a kvf__xfer with role RECV. It waits for a sender
 * (a local send, or a peer's SendIntent), or is pushed ahead to the source
 * node when the grant names it. Once bound it is open in the transport and
 * completes when the transport saw every byte and the sender said SendDone.
 *
 * Sender side: the first part of a send creates a kvf__xfer with role SEND.
 * Parts that come before the grant wait in x->send.early; once the grant is
 * known every part is paired in order against it and handed to the
 * transport.
 *
 * A failure (size mismatch, deadline, cancel, lost peer or client) moves the
 * transfer to DRAIN (or a receiver to FENCE) until the transport no longer
 * touches its memory, then the owner gets its event. The other side learns
 * of it by a Cancel message (remote) or directly (local twin). A transfer is
 * freed only after its transport callbacks are all in, so callbacks never
 * see freed memory.
 *
 * The states of each role are drawn in xfer.h; kvf__xfer_set_state() is the
 * only place that changes them. Transfers of blocks (KV layouts) have
 * their own file, xfer_blocks.c. */
#include "xfer.h"
#include "xfer_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "grant_index.h"
#include "layouts.h"
#include "log.h"
#include "map.h"
#include "metrics.h"
#include "peer.h"
#include "pool_engine.h"
#include "xfer_fan.h"
#ifdef KVF_FAILPOINTS
#include "failpoint.h"
#endif

/* A grant pushed to us before the send came. */
typedef struct pregrant {
  kvf__peer *from;        /* counted in its waiting */
  char peer[KVF__NAME_MAX + 1];
  char id[KVF_XFER_ID_MAX + 1];
  uint64_t handle;
  kvf__descs dst;
  uint64_t expires_ns;
  int refused;            /* we refused this grant: the send fails with it */
  char why[128];
  kvf__tp_grant tp;       /* owned */
  kvf__xblocks gb;        /* a grant of blocks: its view and ids, owned */
  bool layer_events;
} pregrant;

/* A peer's send waiting for our grant. */
typedef struct intent {
  kvf__peer *peer;
  uint64_t expires_ns;
} intent;

static struct {
  uv_loop_t *loop;
  kvf__xfer_env env;
  kvf__map recv_by_id, send_by_id, by_handle, pregrants, intents;
  kvf__xfer *head;
  size_t n_live;
  uint64_t next_handle;
  uv_timer_t sweep;
  bool sweep_on;
  kvf__ratelimit waiting_rl;
  bool stopping;          /* kvf__xfer_shutdown: no more fences */
} X;

void kvf__xfer_emit(kvf__session *s, const Kvf__Event *ev) { if (!kvf__xfan_event(s, ev)) X.env.emit(s, ev); }

/* How long a cancelled receiver of a one-sided transport keeps its grant
 * open for the sender's CancelDone (fence_wanted). */
#define FENCE_MS 2000
/* How long a write refusal waits for its peer to go away (see
 * judge_refusal). kill -9 closes the peer's control connection within
 * milliseconds; the margin is for a loaded machine. */
#define REFUSAL_GRACE_MS 300

/* ----------------------------------------------------------------- states */

#define XX(s, phase, name)                                                                     \
  _Static_assert((int)KVF__RECV_##s == (int)KVF__XS_##s && (int)KVF__SEND_##s == (int)KVF__XS_##s, \
                 "the states both roles share have one value");
KVF__XFER_END_STATES(XX)
#undef XX
_Static_assert(KVF__RECV_NSTATES <= 32 && KVF__SEND_NSTATES <= 32, "a state's successors are bits of an unsigned");

typedef struct state_row {
  const char *name; /* for logs */
  int phase;        /* enum kvf__xstate */
} state_row;

static const state_row recv_rows[KVF__RECV_NSTATES] = {
    [KVF__RECV_NONE] = {"none", KVF__X_NONE},
#define XX(s, phase, name) [KVF__RECV_##s] = {name, KVF__X_##phase},
    KVF__XFER_END_STATES(XX) KVF__RECV_STATES(XX)
#undef XX
};

static const state_row send_rows[KVF__SEND_NSTATES] = {
    [KVF__SEND_NONE] = {"none", KVF__X_NONE},
#define XX(s, phase, name) [KVF__SEND_##s] = {name, KVF__X_##phase},
    KVF__XFER_END_STATES(XX) KVF__SEND_STATES(XX)
#undef XX
};

/* Where each state may go: the drawings in xfer.h, one bit per state. */
#define R(s) (1u << KVF__RECV_##s)
static const unsigned recv_next[KVF__RECV_NSTATES] = {
    [KVF__RECV_NONE] = R(WAIT),
    [KVF__RECV_WAIT] = R(OPENING) | R(OPEN) | R(DRAIN),
    [KVF__RECV_OPENING] = R(OPEN) | R(WAIT) | R(DRAIN), /* WAIT: pushed again (kvf__xwait_hold) */
    [KVF__RECV_OPEN] = R(LANDED) | R(SENDER_DONE) | R(DONE) | R(FENCE) | R(WAIT) | R(DRAIN),
    [KVF__RECV_LANDED] = R(DONE) | R(FENCE) | R(DRAIN),
    [KVF__RECV_SENDER_DONE] = R(DONE) | R(FENCE) | R(DRAIN),
    [KVF__RECV_FENCE] = R(FAILED),
    [KVF__RECV_DRAIN] = R(FAILED),
};
#undef R

#define S(s) (1u << KVF__SEND_##s)
static const unsigned send_next[KVF__SEND_NSTATES] = {
    [KVF__SEND_NONE] = S(WAIT),
    [KVF__SEND_WAIT] = S(QUEUED) | S(ACTIVE) | S(DRAIN),
    [KVF__SEND_QUEUED] = S(FLUSH) | S(DRAIN),
    [KVF__SEND_ACTIVE] = S(FLUSH) | S(DRAIN),
    [KVF__SEND_FLUSH] = S(CONFIRMED) | S(RESULT) | S(DONE) | S(DRAIN),
    [KVF__SEND_CONFIRMED] = S(DONE) | S(DRAIN),
    [KVF__SEND_RESULT] = S(DONE) | S(DRAIN),
    [KVF__SEND_DRAIN] = S(FAILED),
};
#undef S

static int role_state(const kvf__xfer *x) {
  return x->role == KVF__RECV ? (int)x->recv.state : (int)x->send.state;
}

static const char *state_name(const kvf__xfer *x, int state) {
  bool recv = x->role == KVF__RECV;
  if (state < 0 || state >= (recv ? KVF__RECV_NSTATES : KVF__SEND_NSTATES)) return "?";
  return (recv ? recv_rows : send_rows)[state].name;
}

/* What only a bug in the daemon's own logic leads to (peer and client
 * messages that do not fit the state are refused before they get here):
 * logged, and fatal with env.strict (tests). */
static void bug(const kvf__xfer *x, const char *what) {
  kvf__err("transfer '%s' (%s, state %s): %s: a bug in kvferryd", x->id,
           x->role == KVF__RECV ? "receiving" : "sending", state_name(x, role_state(x)), what);
  if (X.env.strict) abort();
}

/* The one place where a transfer's state changes, and its phase with it
 * (to: a state of x's role, or KVF__XS_*). A change the role's table lacks
 * is a bug: reported, then made anyway, as the code that asked for it
 * expects. */
void kvf__xfer_set_state(kvf__xfer *x, int to) {
  bool recv = x->role == KVF__RECV;
  if (to <= 0 || to >= (recv ? KVF__RECV_NSTATES : KVF__SEND_NSTATES)) {
    bug(x, "a change to no state");
    return;
  }
  int from = role_state(x);
  if (!((recv ? recv_next : send_next)[from] & (1u << to))) {
    char what[64];
    snprintf(what, sizeof(what), "the change to %s is not in its table", state_name(x, to));
    bug(x, what);
  }
  if (recv) x->recv.state = (enum kvf__recv_state)to;
  else x->send.state = (enum kvf__send_state)to;
  x->state = (recv ? recv_rows : send_rows)[to].phase;
}

/* Neither failed nor finished: DRAIN, FENCE, DONE and FAILED are not. */
bool kvf__xfer_live(const kvf__xfer *x) {
  return x->state != KVF__X_DRAIN && x->state != KVF__X_DONE && x->state != KVF__X_FAILED;
}

/* A sender that has no grant yet: its parts queue. */
static bool send_waiting(const kvf__xfer *x) {
  return x->send.state == KVF__SEND_WAIT || x->send.state == KVF__SEND_QUEUED;
}

/* ------------------------------------------------------------ bookkeeping */

static const char *own_node(void) { return kvfd.cfg.node; }

static void handle_key(char *buf, size_t len, const kvf__xfer *x, uint64_t handle) {
  if (x->role == KVF__RECV) snprintf(buf, len, "r:%016llx", (unsigned long long)handle);
  else snprintf(buf, len, "s:%s\x1f%016llx", x->peer_name, (unsigned long long)handle);
}

static void pair_key(char *buf, size_t len, const char *peer, const char *id) {
  snprintf(buf, len, "%s\x1f%s", peer, id);
}

static uint64_t deadline_ns(uint32_t ms) {
  return kvf__now_ns() + (uint64_t)(ms ? ms : kvfd.cfg.default_deadline_ms) * 1000000ull;
}

static void on_deadline(uv_timer_t *t) {
  kvf__xfer *x = t->data;
  char why[192];
  int status = kvf__xwait_deadline(x, why, sizeof(why)); /* it waited for its peer */
  if (status) kvf__xfer_fail(x, status, why, true, KVF_EDEADLINE);
  else kvf__xfer_fail(x, KVF_EDEADLINE, "the transfer's deadline expired", true, KVF_EDEADLINE);
}

static kvf__xfer *xfer_new(kvf__session *s, const char *id, int role, uint32_t deadline_ms) {
  kvf__xfer *x = calloc(1, sizeof(*x));
  if (!x) return NULL;
  snprintf(x->id, sizeof(x->id), "%s", id);
  x->role = role;
  kvf__xfer_set_state(x, role == KVF__RECV ? KVF__RECV_WAIT : KVF__SEND_WAIT);
  x->owner = s;
  x->created_ns = kvf__now_ns();
  x->deadline_ms = deadline_ms ? deadline_ms : kvfd.cfg.default_deadline_ms;
  kvf__map *byid = role == KVF__RECV ? &X.recv_by_id : &X.send_by_id;
  if (kvf__map_put(byid, id, x) != 0) {
    free(x);
    return NULL;
  }
  uv_timer_init(X.loop, &x->timer);
  x->timer.data = x;
  uv_timer_start(&x->timer, on_deadline, x->deadline_ms, 0);
  x->next = X.head;
  if (X.head) X.head->prev = x;
  X.head = x;
  X.n_live++;
  if (s && X.env.session_xfers) X.env.session_xfers(s, +1);
  return x;
}

/* Engine memory a transfer names stays registered until the transfer is
 * gone (kvf_mem_unregister meanwhile: KVF_EBUSY). Only our own pools. */
static int hold_pool(kvf__xfer *x, uint32_t pool) {
  if (!kvf__pool_is_engine(pool)) return 0;
  for (uint32_t i = 0; i < x->n_held; i++)
    if (x->held[i] == pool) return 0;
  if (x->n_held == x->cap_held) {
    uint32_t cap = x->cap_held ? 2 * x->cap_held : 2;
    uint32_t *v = realloc(x->held, cap * sizeof(*v));
    if (!v) return -ENOMEM;
    x->held = v;
    x->cap_held = cap;
  }
  x->held[x->n_held++] = pool;
  kvf__pool_engine_hold(pool);
  return 0;
}

static int hold_descs(kvf__xfer *x, const kvf__descs *d) {
  uint32_t last = UINT32_MAX;
  for (size_t i = 0; i < d->n; i++) {
    if (d->pool[i] == last) continue;
    last = d->pool[i];
    int rc = hold_pool(x, last);
    if (rc) return rc;
  }
  return 0;
}

static void release_pools(kvf__xfer *x) {
  for (uint32_t i = 0; i < x->n_held; i++) kvf__pool_engine_release(x->held[i]);
  free(x->held);
  x->held = NULL;
  x->n_held = x->cap_held = 0;
}

static void free_after_close(uv_handle_t *h) {
  kvf__xfer *x = h->data;
  release_pools(x);
  kvf__descs_free(&x->dst);
  kvf__xblocks_free(&x->mine);
  if (x->role == KVF__SEND) {
    kvf__descs_free(&x->send.early);
    kvf__xblocks_free(&x->send.grant);
    free(x->send.layers_sent);
    free(x->send.early_layers);
    free(x->send.unannounced);
  } else {
    free(x->recv.landed);
  }
  kvf__tp_grant_free(&x->tp_grant);
  free(x);
}

static void xfer_destroy(kvf__xfer *x) {
  char key[KVF__NAME_MAX + 64];
  kvf__xwait_clear(x);
  if (x->tp) x->tp->ops->xfer_done(x->tp, x);
  kvf__xfer_unclaim(x); /* its memory may take another grant */
  kvf__map_del(x->role == KVF__RECV ? &X.recv_by_id : &X.send_by_id, x->id);
  if (x->handle) {
    handle_key(key, sizeof(key), x, x->handle);
    if (kvf__map_get(&X.by_handle, key) == x) kvf__map_del(&X.by_handle, key);
  }
  if (x->twin) x->twin->twin = NULL;
  if (x->prev) x->prev->next = x->next;
  else X.head = x->next;
  if (x->next) x->next->prev = x->prev;
  X.n_live--;
  if (x->owner && X.env.session_xfers) X.env.session_xfers(x->owner, -1);
  uv_timer_stop(&x->timer);
  uv_close((uv_handle_t *)&x->timer, free_after_close);
}

const char *kvf__xfer_path(const kvf__xfer *x) {
  if (x->path) return x->path;
  return x->tp ? x->tp->ops->name : "none";
}

static void emit(kvf__xfer *x, int status, const char *error) {
  kvf__xtrace_stamp(x, KVF__XT_EVENT, 0);
  if (!x->owner) return;
  Kvf__Event ev = KVF__EVENT__INIT;
  ev.type = x->role == KVF__RECV ? KVF__EVENT_TYPE__EVENT_RECV_DONE : KVF__EVENT_TYPE__EVENT_SEND_DONE;
  ev.xfer_id = x->id;
  ev.status = status;
  ev.path = (char *)kvf__xfer_path(x);
  ev.peer = x->peer_name;
  ev.bytes = kvf__xfer_bytes(x);
  ev.descriptors = kvf__xfer_descriptors(x);
  ev.error = (char *)(error ? error : "");
  char tf[sizeof(x->transform)];
  ev.transform = (char *)kvf__xfer_event_transform(x, tf, sizeof(tf));
  kvf__xfer_emit(x->owner, &ev);
}

static void send_recv_result(kvf__xfer *x, int status, const char *why);

/* tell_sender: a receive's RecvResult goes to its sender after the
 * engine's event, so that the peer write (a loopback TCP send runs the
 * peer's receive path inline) is off the handoff's path. */
static void succeed_then(kvf__xfer *x, bool tell_sender) {
  if (x->role == KVF__RECV) kvf__xrecv_flush_layers(x); /* every layer is in */
  kvf__xoutcome_record(x, 0, NULL);
  kvf__xfer_set_state(x, KVF__XS_DONE);
  emit(x, 0, NULL);
  if (tell_sender) send_recv_result(x, 0, NULL);
  kvf__xtrace_finish(x, 0);
  kvf__metrics_transfer(x, 0);
  kvfd.stats.transfers_done++;
  if (x->role == KVF__RECV) kvfd.stats.bytes_received += kvf__xfer_bytes(x);
  else kvfd.stats.bytes_sent += kvf__xfer_bytes(x);
  xfer_destroy(x);
}

static void succeed(kvf__xfer *x) { succeed_then(x, false); }

/* ---------------------------------------------------------- peer messages */

int kvf__xfer_peer_send(kvf__peer *p, Kvf__PeerMsg *m) {
  if (!p || !X.env.peer_up(p)) return KVF_EPEERLOST;
  return X.env.peer_send(p, m);
}

/* Nonzero only when the descriptors could not be packed (out of memory); a
 * lost peer is noticed and handled by the peer layer. */
static int send_grant(kvf__xfer *x) {
  Kvf__Grant g = KVF__GRANT__INIT;
  Kvf__DescList dl = KVF__DESC_LIST__INIT;
  Kvf__Layout lw;
  uint8_t *bw = NULL; /* blocks: the view's offsets, then the ids */
  int rc = x->blocks ? kvf__xblocks_to_grant(x, &g, &lw, &bw) : kvf__descs_to_wire(&x->dst, &dl);
  if (rc) return rc;
  g.xfer_id = x->id;
  g.handle = x->handle;
  g.descs = &dl;
  /* What is left of our deadline: a grant sent late must not outlive ours. */
  uint64_t used_ms = (kvf__now_ns() - x->created_ns) / 1000000ull;
  g.deadline_ms = used_ms < x->deadline_ms ? (uint32_t)(x->deadline_ms - used_ms) : 1;
  g.windows.data = x->tp_grant.win;
  g.windows.len = x->tp_grant.win_len;
  g.window_of.data = x->tp_grant.of;
  g.window_of.len = x->tp_grant.of_len;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_GRANT;
  m.grant = &g;
  kvf__xfer_peer_send(x->peer, &m);
  kvf__descs_wire_free(&dl);
  free(bw);
  return 0;
}

static void cancel_to(kvf__peer *p, uint64_t handle, const char *id, int status, const char *why,
                      bool to_sender, bool ack) {
  Kvf__Cancel c = KVF__CANCEL__INIT;
  c.handle = handle;
  c.xfer_id = (char *)id;
  c.status = status;
  c.error = (char *)why;
  c.to_sender = to_sender;
  c.ack = ack;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_CANCEL;
  m.cancel = &c;
  kvf__xfer_peer_send(p, &m);
}

static void send_cancel(kvf__xfer *x, int status, const char *why) {
  bool fencing = x->role == KVF__RECV && x->recv.state == KVF__RECV_FENCE;
  cancel_to(x->peer, x->handle, x->id, status, why, x->role == KVF__RECV, fencing);
}

static void send_cancel_done(kvf__peer *p, uint64_t handle) {
  Kvf__CancelDone d = KVF__CANCEL_DONE__INIT;
  d.handle = handle;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_CANCEL_DONE;
  m.cancel_done = &d;
  kvf__xfer_peer_send(p, &m);
}

static void send_recv_result(kvf__xfer *x, int status, const char *why) {
  Kvf__RecvResult r = KVF__RECV_RESULT__INIT;
  r.handle = x->handle;
  r.status = status;
  r.error = (char *)(why ? why : "");
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_RECV_RESULT;
  m.recv_result = &r;
  kvf__xfer_peer_send(x->peer, &m);
}

/* ---------------------------------------------------------------- failure */

void kvf__xfer_succeed(kvf__xfer *x) { succeed(x); }

static void emit_failure(kvf__xfer *x) {
  kvf__xoutcome_record(x, x->status, x->error);
  kvf__xfer_set_state(x, KVF__XS_FAILED);
  emit(x, x->status, x->error);
  kvf__xtrace_finish(x, x->status ? x->status : KVF_ECANCELED);
  kvf__metrics_transfer(x, x->status);
  kvfd.stats.transfers_failed++;
  xfer_destroy(x);
}

static void on_refusal_judged(uv_timer_t *t) {
  kvf__xfer *x = t->data;
  if (!X.env.peer_up(x->peer)) {
    x->status = KVF_EPEERLOST;
    snprintf(x->error, sizeof(x->error), "lost the peer (its memory went before its connections: writes refused)");
  }
  emit_failure(x);
}

/* A peer that dies (kill -9) tears its memory down before its connections,
 * so writes in flight come back refused (KVF_EPERM) just before the peer
 * is seen to go. A refusal waits a moment for that: when the peer went,
 * the transfer reports its loss, as every other transfer to it does.
 * True when the verdict is deferred (on_refusal_judged finishes x). */
static bool judge_refusal(kvf__xfer *x) {
  if (x->role != KVF__SEND || x->status != KVF_EPERM || !x->peer || X.stopping ||
      uv_is_active((uv_handle_t *)&x->timer))
    return false;
  uv_timer_start(&x->timer, on_refusal_judged, REFUSAL_GRACE_MS, 0);
  return true;
}

static void finish_failure(kvf__xfer *x) {
  if (!judge_refusal(x)) emit_failure(x);
}

/* A receiver whose client cancelled (or went away) while a one-sided
 * transport's sender may be writing into the grant. Deadlines stay strict:
 * a transfer past its deadline closes its grant at once. */
static bool fence_wanted(const kvf__xfer *x, int status, bool notify) {
  if (x->role != KVF__RECV) return false;
  enum kvf__recv_state s = x->recv.state;
  bool granted = s == KVF__RECV_OPEN || s == KVF__RECV_LANDED || s == KVF__RECV_SENDER_DONE;
  /* else no Grant went out: no writes */
  return notify && status == KVF_ECANCELED && !X.stopping && x->peer && x->handle && x->tp &&
         x->tp->ops->one_sided && granted;
}

/* The fence is over: the sender's writes are back (CancelDone), it took
 * too long, or the peer is gone. */
static void fence_end(kvf__xfer *x, const char *why) {
  if (x->role != KVF__RECV || x->recv.state != KVF__RECV_FENCE) return;
  if (why)
    kvf__warn("transfer '%s': %s; closing its grant now (a write still in flight fails the sender's connection)",
              x->id, why);
  uv_timer_stop(&x->timer);
  x->tp->ops->grant_close(x->tp, x);
  finish_failure(x);
}

static void on_fence_timeout(uv_timer_t *t) {
  char why[96];
  snprintf(why, sizeof(why), "the sender did not confirm within %d ms that its writes stopped", FENCE_MS);
  fence_end(t->data, why);
}

/* Fails x with status for its owner. notify: tell the other side, which
 * then reports remote_status. */
void kvf__xfer_fail(kvf__xfer *x, int status, const char *why, bool notify, int remote_status) {
  if (!kvf__xfer_live(x)) return;
  bool fencing = fence_wanted(x, status, notify);
  /* the transport holds a receiver's grant from its grant_open on */
  bool granted = x->role == KVF__RECV && x->recv.state != KVF__RECV_WAIT;
  kvf__xfer_set_state(x, fencing ? KVF__RECV_FENCE : KVF__XS_DRAIN);
  x->status = status;
  snprintf(x->error, sizeof(x->error), "%s", why ? why : "");
  uv_timer_stop(&x->timer);
  if (x->twin) {
    kvf__xfer *t = x->twin;
    kvf__xfer_fail(t, remote_status, why, false, 0);
  } else if (notify && x->peer && (x->handle || x->role == KVF__SEND)) {
    /* A sender tells the receiver only once its own writes have stopped:
     * the receiver closes the grant on that word (rdma invalidates its
     * memory windows), and a write still in flight would then fail the
     * whole queue pair, and every transfer on it. */
    if (x->role == KVF__SEND && x->send.parts_out > 0) {
      x->send.cancel_owed = true;
      x->send.cancel_status = remote_status;
    } else {
      send_cancel(x, remote_status, why);
    }
  }
  if (fencing) { /* the grant stays open until the sender's CancelDone */
    uv_timer_start(&x->timer, on_fence_timeout, FENCE_MS, 0);
    return;
  }
  if (granted && x->peer && x->tp) x->tp->ops->grant_close(x->tp, x);
  if (x->role == KVF__SEND && x->send.parts_out > 0) {
    x->tp->ops->abort(x->tp, x);
    return; /* kvf__xfer_on_posted finishes it */
  }
  /* A local receiver's memory is written by its twin's posts: wait for them. */
  if (x->role == KVF__RECV && x->twin && x->twin->send.parts_out > 0) return;
  finish_failure(x);
}

/* ----------------------------------------------------------------- sending */

static const kvf__descs *grant_of(const kvf__xfer *x) { return x->twin ? &x->twin->dst : &x->dst; }

/* Pairs part against the grant and hands it to the transport; a failure
 * fails x. */
static int post_part(kvf__xfer *x, const kvf__descs *part, bool last) {
  kvf__xsend *s = &x->send;
  kvf__runs runs = {0};
  int rc = kvf__pair(part, grant_of(x), &s->cursor, &runs);
  if (rc == 0 && last && s->cursor != grant_of(x)->n) rc = KVF_ESIZE;
#ifdef KVF_FAILPOINTS
  if (rc == 0 && last && x->peer && kvf__failpoint(KVF__FP_WRITE_OUTSIDE)) kvf__failpoint_runs(grant_of(x), &runs);
#endif
  s->last_post_ns = kvf__now_ns();
  if (!s->first_post_ns) s->first_post_ns = s->last_post_ns;
  if (rc == 0) rc = x->tp->ops->post(x->tp, x, &runs, last);
  kvf__runs_free(&runs);
  if (rc) {
    const char *why = rc == KVF_ESIZE ? "send and grant descriptors differ in size or count"
                                      : kvf__xfer_post_failure(rc, "the transport refused the data");
    kvf__xfer_fail(x, rc, why, true, rc);
    return rc;
  }
  s->parts_out++;
  s->bytes_posted += part->total;
  if (last) kvf__xfer_set_state(x, KVF__SEND_FLUSH);
  else if (s->state != KVF__SEND_ACTIVE) kvf__xfer_set_state(x, KVF__SEND_ACTIVE);
  return 0;
}

/* The grant is known: pair and post what came early, the last part among
 * it when QUEUED. */
static void start_sending(kvf__xfer *x) {
  kvf__xtrace_stamp(x, KVF__XT_PAIR, 0);
  if (x->blocks || kvf__xsend_grant_is_blocks(x)) {
    kvf__xsend_blocks_start(x);
    return;
  }
  bool last = x->send.state == KVF__SEND_QUEUED;
  kvf__descs early = x->send.early;
  memset(&x->send.early, 0, sizeof(x->send.early));
  if (early.n) post_part(x, &early, last);
  else kvf__xfer_set_state(x, KVF__SEND_ACTIVE);
  kvf__descs_free(&early);
}

static void bind_local(kvf__xfer *send, kvf__xfer *recv) {
  send->twin = recv;
  recv->twin = send;
  send->tp = recv->tp = X.env.local;
  snprintf(send->peer_name, sizeof(send->peer_name), "%s", own_node());
  snprintf(recv->peer_name, sizeof(recv->peer_name), "%s", own_node());
  kvf__xtrace_stamp(recv, KVF__XT_PAIR, 0);
  kvf__xfer_set_state(recv, KVF__RECV_OPEN);
  start_sending(send);
}

/* Takes dst and gb (a grant of blocks: its view and ids). */
static int bind_remote_send(kvf__xfer *x, uint64_t handle, kvf__descs *dst, kvf__xblocks *gb, bool layer_events) {
  char key[KVF__NAME_MAX + 64];
  x->handle = handle;
  x->dst = *dst;
  memset(dst, 0, sizeof(*dst));
  x->send.grant = *gb;
  memset(gb, 0, sizeof(*gb));
  x->send.layer_events = layer_events;
  x->peer_session = x->peer->remote_session; /* the receiver's incarnation (xfer_wait.c) */
  handle_key(key, sizeof(key), x, handle);
  if (kvf__map_put(&X.by_handle, key, x) != 0) return KVF_EEXIST;
  x->tp = X.env.peer_transport(x->peer);
  start_sending(x);
  return 0;
}

/* Binds a grant to a remote sender and tells it where the blocks go. */
static int bind_remote_recv(kvf__xfer *x, kvf__peer *p) {
  kvf__xtrace_stamp(x, KVF__XT_PAIR, 0);
  x->peer = p;
  snprintf(x->peer_name, sizeof(x->peer_name), "%s", X.env.peer_name(p));
  x->tp = X.env.peer_transport(p);
  /* A remote transport checks writes (and binds windows) over ranges. */
  int rc = x->blocks && !x->dst.n ? kvf__blocks_descs(&x->mine.view, x->mine.ids, x->mine.n, &x->dst) : 0;
  if (rc == 0 && x->blocks && x->mine.head1) x->dst.total = kvf__xfer_bytes(x); /* a fan's head lands alone */
  if (rc == 0) rc = x->tp->ops->grant_open(x->tp, x);
  if (rc < 0) return rc;
  if (rc > 0) { /* kvf__xfer_on_grant_ready sends it */
    kvf__xfer_set_state(x, KVF__RECV_OPENING);
    return 0;
  }
  kvf__xfer_set_state(x, KVF__RECV_OPEN);
  return send_grant(x);
}

int kvf__xrecv_bind_remote(kvf__xfer *x, kvf__peer *p) { return bind_remote_recv(x, p); }

static void send_intent(kvf__xfer *x) {
  Kvf__SendIntent si = KVF__SEND_INTENT__INIT;
  si.xfer_id = x->id;
  si.deadline_ms = x->deadline_ms;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_SEND_INTENT;
  m.send_intent = &si;
  x->send.intent_sent = true;
  kvf__xfer_peer_send(x->peer, &m);
}

static pregrant *take_pregrant(const char *peer, const char *id) {
  char key[KVF__NAME_MAX + KVF_XFER_ID_MAX + 4];
  pair_key(key, sizeof(key), peer, id);
  pregrant *g = kvf__map_del(&X.pregrants, key);
  if (g && g->from) g->from->waiting--;
  return g;
}

/* Intents leave the table only through here, so that the peer's count of
 * what it left waiting stays true. */
static void intent_drop(const char *id) {
  intent *in = kvf__map_del(&X.intents, id);
  if (in && in->peer) in->peer->waiting--;
  free(in);
}

/* Whether p may leave one more intent or pushed grant here; says why not. */
static bool peer_may_wait(kvf__peer *p, const char *what, const char *id, char *why, size_t len) {
  if (p->waiting < kvfd.cfg.max_peer_waiting) return true;
  snprintf(why, len, "%s refused by %s: peer %s already has max-peer-waiting (%u) intents and pushed grants waiting",
           what, own_node(), X.env.peer_name(p), kvfd.cfg.max_peer_waiting);
  uint64_t dropped;
  if (kvf__log_ratelimit(&X.waiting_rl, &dropped))
    kvf__warn("peer %s: transfer '%s': %s (%llu more such refusals since the last line)", X.env.peer_name(p), id,
              why, (unsigned long long)dropped);
  kvfd.stats.peer_errors++;
  return false;
}

static void pregrant_free(pregrant *g) {
  kvf__descs_free(&g->dst);
  kvf__xblocks_free(&g->gb);
  kvf__tp_grant_free(&g->tp);
  free(g);
}

/* 1..KVF_XFER_ID_MAX bytes of UTF-8 without control characters: ids go
 * into JSON (status, kvferryctl, Python) and logs. */
static int valid_id(const char *id) {
  size_t n = id ? strlen(id) : 0;
  return n > 0 && n <= KVF_XFER_ID_MAX && kvf__xfer_id_chars_valid(id, n);
}

static bool is_local(const char *node) { return node && strcmp(node, own_node()) == 0; }

/* Rendezvous for a new send: a local grant, a pre-grant, or ask the peer
 * (once it is up: until then the send waits for it, xfer_wait.c). */
static void rendezvous_send(kvf__xfer *x) {
  if (x->peer && !X.env.peer_up(x->peer)) {
    kvf__xwait_park(x);
    return;
  }
  if (!x->peer) {
    kvf__xfer *r = kvf__map_get(&X.recv_by_id, x->id);
    if (r && r->recv.state == KVF__RECV_WAIT && !r->peer && !r->twin &&
        (r->peer_name[0] == 0 || is_local(r->peer_name)))
      bind_local(x, r);
    return;
  }
  pregrant *g = take_pregrant(x->peer_name, x->id);
  if (g && g->refused) {
    kvf__xfer_fail(x, g->refused, g->why, false, 0);
    pregrant_free(g);
    return;
  }
  if (g) {
    x->tp_grant = g->tp;
    memset(&g->tp, 0, sizeof(g->tp));
    int rc = bind_remote_send(x, g->handle, &g->dst, &g->gb, g->layer_events);
    pregrant_free(g);
    if (rc) kvf__xfer_fail(x, rc, "duplicate grant handle", true, KVF_EPROTO);
    return;
  }
  send_intent(x);
}

void kvf__xsend_rendezvous(kvf__xfer *x) { rendezvous_send(x); }

static int check_existing_send(kvf__xfer *x, kvf__session *s, const char *dst_node) {
  if (x->owner != s) return KVF_EEXIST;
  /* its last part came, or it failed */
  if (x->send.state != KVF__SEND_WAIT && x->send.state != KVF__SEND_ACTIVE) return KVF_EEXIST;
  if (strcmp(x->peer ? x->peer_name : own_node(), dst_node) != 0) return KVF_EINVAL;
  return 0;
}

/* Keeps a part that came before the grant; the last one closes the queue.
 * An error takes nothing. */
static int queue_part(kvf__xfer *x, const kvf__descs *part, bool last) {
  int rc = kvf__descs_append(&x->send.early, part);
  if (rc) return rc;
  x->send.descs_taken += part->n;
  if (last) kvf__xfer_set_state(x, KVF__SEND_QUEUED);
  return 0;
}

/* A later part of a send under way. */
static int continue_send(kvf__xfer *x, const kvf__descs *part, bool last) {
  if (x->send.state == KVF__SEND_WAIT) return queue_part(x, part, last);
  x->send.descs_taken += part->n;
  post_part(x, part, last); /* a failure fails x: its event says so */
  return 0;
}

/* Where a send goes: *p the peer, NULL for this node. */
static int send_target(const char *id, const char *dst_node, kvf__peer **p, char *err, size_t errlen) {
  if (!valid_id(id) || !dst_node || !dst_node[0]) return KVF_EINVAL;
  *p = NULL;
  if (is_local(dst_node)) return 0;
  *p = X.env.peer_find(dst_node);
  if (*p) return 0;
  snprintf(err, errlen, "no peer named '%s' in this daemon's configuration", dst_node);
  return KVF_ENOPEER;
}

/* The send of id under way that a new part continues, or NULL for a new
 * send; *rc when the part cannot go to it. */
static kvf__xfer *send_under_way(kvf__session *s, const char *id, const char *dst_node, int *rc, char *err,
                                 size_t errlen) {
  kvf__xfer *x = kvf__map_get(&X.send_by_id, id);
  *rc = x ? check_existing_send(x, s, dst_node) : 0;
  if (*rc) snprintf(err, errlen, "transfer '%s' is already sending here", id);
  return x;
}

/* A new send: *x, to p (NULL: this node), or an error. */
static int send_new(kvf__session *s, const char *id, const char *dst_node, kvf__peer *p, uint32_t deadline_ms,
                    kvf__xfer **x, char *err, size_t errlen) {
  /* A peer that is down or reconnecting: the send waits for it, within
   * its deadline and max-peer-waiting (rendezvous_send). */
  if (p && !X.env.peer_up(p) && !kvf__xwait_may_queue(p, dst_node, err, errlen)) return KVF_ELIMIT;
  *x = xfer_new(s, id, KVF__SEND, deadline_ms);
  if (!*x) return -ENOMEM;
  (*x)->peer = p;
  snprintf((*x)->peer_name, sizeof((*x)->peer_name), "%s", dst_node);
  return 0;
}

int kvf__xfer_send(kvf__session *s, const char *id, const char *dst_node,
                   kvf__descs *descs, bool more, uint32_t deadline_ms, char *err, size_t errlen) {
  kvf__peer *p;
  int rc = send_target(id, dst_node, &p, err, errlen);
  if (rc) return rc;
  kvf__xfer *x = send_under_way(s, id, dst_node, &rc, err, errlen);
  if (rc) return rc;
  if (x && x->blocks) {
    snprintf(err, errlen, "transfer '%s' sends blocks: a part of descriptors cannot continue it", id);
    return KVF_EINVAL;
  }
  if (x && (rc = hold_descs(x, descs)) != 0) return rc;
  if (x) kvf__xtrace_part(x, !more, false);
  if (x) return continue_send(x, descs, !more);
  if ((rc = send_new(s, id, dst_node, p, deadline_ms, &x, err, errlen)) != 0) return rc;
  rc = hold_descs(x, descs);
  if (rc == 0) rc = queue_part(x, descs, !more);
  if (rc) {
    xfer_destroy(x); /* unseen: no event follows an error */
    return rc;
  }
  kvf__xtrace_part(x, !more, false);
  rendezvous_send(x);
  return 0;
}

int kvf__xfer_send_blocks(kvf__session *s, const char *id, const char *dst_node, const kvf__blockreq *b,
                          bool more, uint32_t deadline_ms, char *err, size_t errlen) {
  kvf__peer *p;
  kvf__lview v;
  int rc = send_target(id, dst_node, &p, err, errlen);
  if (rc == 0) rc = kvf__xblocks_view(b, &v, err, errlen);
  if (rc) return rc;
  kvf__xfer *x = send_under_way(s, id, dst_node, &rc, err, errlen);
  if (rc == 0 && x) rc = kvf__xsend_part_check(x, b, &v, err, errlen);
  if (rc) return rc;
  if (x) return kvf__xsend_part_take(x, &v, !more);
  if (b->n == 0) {
    snprintf(err, errlen, "the first part of a send names its blocks");
    return KVF_EINVAL;
  }
  if ((rc = send_new(s, id, dst_node, p, deadline_ms, &x, err, errlen)) != 0) return rc;
  rc = hold_pool(x, b->layout->pool);
  if (rc == 0) rc = kvf__xsend_blocks_begin(x, b);
  if (rc == 0) rc = kvf__xsend_part_take(x, &v, !more);
  if (rc) {
    xfer_destroy(x); /* unseen: no event follows an error */
    return rc;
  }
  rendezvous_send(x);
  return 0;
}

/* --------------------------------------------------------------- granting */

static void rendezvous_grant(kvf__xfer *x, kvf__peer *src) {
  bool src_local = x->peer_name[0] == 0 || is_local(x->peer_name);
  kvf__xfer *s = src_local ? kvf__map_get(&X.send_by_id, x->id) : NULL;
  if (s && !s->peer && !s->twin && send_waiting(s)) {
    bind_local(s, x);
    return;
  }
  intent *in = kvf__map_get(&X.intents, x->id);
  if (in && (!src || in->peer == src)) {
    kvf__peer *p = in->peer;
    intent_drop(x->id);
    int rc = bind_remote_recv(x, p);
    if (rc) kvf__xfer_fail(x, rc, "the transport could not open the grant", true, rc);
    return;
  }
  /* Push the grant ahead: the sender finds it when its send comes. */
  if (src && X.env.peer_up(src)) {
    int rc = bind_remote_recv(x, src);
    if (rc) kvf__xfer_fail(x, rc, "the transport could not open the grant", false, 0);
  } else if (src) kvf__peer_need(src); /* pushed once it is up (kvf__xfer_on_peer_up) */
}

/* What every grant checks first: its id, the source it names (*src), and
 * that the id is free. */
static int grant_check(const char *id, const char *src_node, kvf__peer **src, char *err, size_t errlen) {
  if (!valid_id(id)) return KVF_EINVAL;
  *src = NULL;
  if (src_node && src_node[0] && !is_local(src_node)) {
    *src = X.env.peer_find(src_node);
    if (!*src) {
      snprintf(err, errlen, "no peer named '%s' in this daemon's configuration", src_node);
      return KVF_ENOPEER;
    }
  }
  if (kvf__map_get(&X.recv_by_id, id)) {
    snprintf(err, errlen, "a grant for '%s' is already active here", id);
    return KVF_EEXIST;
  }
  return 0;
}

/* A new grant x gets its handle and meets its sender (or waits). An error
 * destroys x unseen. */
static int grant_start(kvf__xfer *x, const char *src_node, kvf__peer *src) {
  x->handle = X.next_handle++;
  char key[KVF__NAME_MAX + 64];
  handle_key(key, sizeof(key), x, x->handle);
  if (kvf__map_put(&X.by_handle, key, x) != 0) {
    x->handle = 0;
    xfer_destroy(x);
    return -ENOMEM;
  }
  if (src_node && src_node[0]) snprintf(x->peer_name, sizeof(x->peer_name), "%s", src_node);
  rendezvous_grant(x, src);
  return 0;
}

int kvf__xfer_grant(kvf__session *s, const char *id, const char *src_node,
                    kvf__descs *descs, uint32_t deadline_ms, char *err, size_t errlen) {
  kvf__peer *src;
  int rc = grant_check(id, src_node, &src, err, errlen);
  if (rc) return rc;
  kvf__xfer *x = xfer_new(s, id, KVF__RECV, deadline_ms);
  if (!x) return -ENOMEM;
  x->dst = *descs;
  memset(descs, 0, sizeof(*descs));
  if ((rc = hold_descs(x, &x->dst)) != 0 || (rc = kvf__xfer_claim(x, err, errlen)) != 0) {
    xfer_destroy(x);
    return rc;
  }
  return grant_start(x, src_node, src);
}

int kvf__xfer_grant_blocks(kvf__session *s, const char *id, const char *src_node, const kvf__blockreq *b,
                           uint32_t deadline_ms, char *err, size_t errlen) {
  kvf__peer *src;
  kvf__lview v;
  int rc = grant_check(id, src_node, &src, err, errlen);
  if (rc == 0 && b->n == 0) rc = KVF_EINVAL;
  if (rc == 0) rc = kvf__xblocks_view(b, &v, err, errlen);
  if (rc) return rc;
  uint8_t *landed = b->layer_events ? calloc(v.n_layers, 1) : NULL;
  kvf__xfer *x = b->layer_events && !landed ? NULL : xfer_new(s, id, KVF__RECV, deadline_ms);
  if (!x) {
    free(landed);
    return -ENOMEM;
  }
  x->blocks = true;
  kvf__xblocks_take(&x->mine, b, &v);
  x->recv.layer_events = b->layer_events;
  x->recv.landed = landed;
  if ((rc = hold_pool(x, b->layout->pool)) != 0 || (!b->no_claim && (rc = kvf__xfer_claim(x, err, errlen)) != 0)) {
    xfer_destroy(x);
    return rc;
  }
  return grant_start(x, src_node, src);
}

/* ---------------------------------------------------------------- cancel */

int kvf__xfer_cancel(kvf__session *s, const char *id) {
  if (!valid_id(id)) return KVF_EINVAL;
  kvf__xfer *r = kvf__map_get(&X.recv_by_id, id);
  kvf__xfer *t = kvf__map_get(&X.send_by_id, id);
  int found = 0;
  if (r && r->owner == s && kvf__xfer_live(r)) {
    kvf__xfer_fail(r, KVF_ECANCELED, "cancelled by the receiving client", true, KVF_EREMOTECANCEL);
    found = 1;
  }
  if (t && t->owner == s && kvf__xfer_live(t)) {
    kvf__xfer_fail(t, KVF_ECANCELED, "cancelled by the sending client", true, KVF_EREMOTECANCEL);
    found = 1;
  }
  return found ? 0 : KVF_ENOENT;
}

/* x no longer reports to its client (which is gone, or learns of the
 * failure otherwise) nor counts among its transfers. */
static void disown(kvf__xfer *x) {
  if (x->owner && X.env.session_xfers) X.env.session_xfers(x->owner, -1);
  x->owner = NULL;
}

void kvf__xfer_withdraw_send(kvf__session *s, const char *id, int status, const char *why, bool silent) {
  kvf__xfer *x = id ? kvf__map_get(&X.send_by_id, id) : NULL;
  if (!x || x->owner != s || !kvf__xfer_live(x)) return;
  if (silent) disown(x);
  kvf__xfer_fail(x, status, why, true, KVF_EREMOTECANCEL);
}

bool kvf__xfer_sending(kvf__session *s, const char *id) {
  kvf__xfer *x = id ? kvf__map_get(&X.send_by_id, id) : NULL;
  return x && x->owner == s && (x->send.state == KVF__SEND_WAIT || x->send.state == KVF__SEND_ACTIVE);
}

/* Fails every transfer for which orphan(x) holds. Failing x may destroy its
 * local twin (and only that), so the walk steps over the twin first. */
static void fail_each(bool (*match)(kvf__xfer *, void *), void *arg, int status, const char *why,
                      bool notify, int remote_status) {
  kvf__xfer *x = X.head;
  while (x) {
    kvf__xfer *next = x->next;
    if (match(x, arg) && kvf__xfer_live(x)) {
      if (next && next == x->twin) next = next->next;
      kvf__xfer_fail(x, status, why, notify, remote_status);
    }
    x = next;
  }
}

static bool is_orphan(kvf__xfer *x, void *arg) { return x->owner == NULL; }

/* The owner goes first from all its transfers, so that failing one half of
 * a local pair never reports to the client that is gone. */
void kvf__xfer_session_gone(kvf__session *s) {
  for (kvf__xfer *x = X.head; x; x = x->next)
    if (x->owner == s) disown(x);
  fail_each(is_orphan, NULL, KVF_ECANCELED, "the client went away", true, KVF_EREMOTECANCEL);
}

/* ----------------------------------------------------- transport callbacks */

static void complete_local(kvf__xfer *send) {
  kvf__xfer *recv = send->twin;
  kvf__xfer_keep_transform(send, recv); /* their events say it after the unpairing */
  send->twin = NULL;
  if (recv) {
    recv->twin = NULL;
    kvf__xtrace_twin(recv, send);
    succeed(recv);
  }
  succeed(send);
}

static void send_done(kvf__xfer *x) {
  Kvf__SendDone d = KVF__SEND_DONE__INIT;
  d.handle = x->handle;
  d.bytes = x->send.bytes_posted;
  d.descriptors = x->send.descs_taken;
  char tf[sizeof(x->transform)];
  d.transform = (char *)kvf__xfer_event_transform(x, tf, sizeof(tf));
  if (x->send.intent_sent) d.xfer_id = x->id;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_SEND_DONE;
  m.send_done = &d;
  kvf__xfer_set_state(x, KVF__SEND_RESULT);
  /* The link dropped while our last writes were out (one-sided): the
   * receiver may have finished on them, so it is asked (now, or when the
   * same incarnation of it is back); our SendDone died with the link. */
  if (x->send.wait_peer) {
    if (X.env.peer_up(x->peer) && x->peer->remote_session == x->peer_session) kvf__xwait_ask(x);
    return;
  }
#ifdef KVF_FAILPOINTS
  if (kvf__failpoint(KVF__FP_SEND_DONE_WITHHELD)) return;
#endif
  if (kvf__xfer_peer_send(x->peer, &m) != 0 && !kvf__xwait_hold(x))
    kvf__xfer_fail(x, KVF_EPEERLOST, "lost the peer", false, 0);
}

void kvf__xfer_on_posted(kvf__xfer *x, int status, bool last) {
  kvf__xsend *s = &x->send;
  s->parts_out--;
  s->posted_ns = kvf__now_ns();
  if (s->state == KVF__SEND_DRAIN) {
    if (s->parts_out > 0) return;
    if (s->cancel_owed) send_cancel(x, s->cancel_status, x->error);
    if (s->cancel_done_owed) send_cancel_done(x->peer, x->handle);
    kvf__xfer *twin_recv = x->twin;
    finish_failure(x);
    /* A failed local receiver waits for its sender's copies to stop. */
    if (twin_recv && twin_recv->recv.state == KVF__RECV_DRAIN) finish_failure(twin_recv);
    return;
  }
  /* The receiver confirmed every byte: a late error (the link dropped) is
   * only the transport letting go of our source. */
  if (status && s->state == KVF__SEND_CONFIRMED) status = 0;
  /* One-sided (rdma): the write that completes the receiver was out when
   * its queue pair failed (the transport says KVF_EUNKNOWN). It may have
   * landed: the receiver's word decides, asked once the link is back. Any
   * other failure means that write never went: the receiver cannot have
   * finished, and the send fails now even if it was waiting. */
  if (status == KVF_EUNKNOWN && s->state == KVF__SEND_FLUSH && (s->wait_peer || kvf__xwait_hold(x))) status = 0;
  else if (status == KVF_EUNKNOWN) status = KVF_EPEERLOST;
  if (status) {
    kvf__xfer_fail(x, status, kvf__xfer_post_failure(status, "the transport failed"), true, status);
    return;
  }
  if (s->parts_out > 0) return;
  if (s->n_unannounced) kvf__xsend_announce_layers(x);
  if (s->state == KVF__SEND_FLUSH && x->twin) complete_local(x);
  else if (s->state == KVF__SEND_FLUSH) send_done(x);
  else if (s->state == KVF__SEND_CONFIRMED) succeed(x);
  /* else ACTIVE: more parts come */
}

/* Every byte is placed and the sender said so: the grant closes. */
static void complete_recv(kvf__xfer *x) {
  x->tp->ops->grant_close(x->tp, x);
#ifdef KVF_FAILPOINTS
  if (kvf__xoutcome_failpoint(x)) {
    succeed(x);
    return;
  }
#endif
  succeed_then(x, true);
}

/* Every granted byte was placed; the receive still waits for the sender's
 * SendDone, whose hop is not free (the sender's loop, the control link):
 * a tcp sender whose source faulted under its writev keeps the stream in
 * step with zeros, and only its word vouches for what the bytes hold
 * (tests/ops/test_engine_wire.py). Bytes from sources that cannot fault
 * come as kvf__xfer_on_vouched instead (tcp_wire.h: BATCH_SEALED). */
void kvf__xfer_on_landed(kvf__xfer *x) {
  switch (x->recv.state) {
  case KVF__RECV_OPEN: kvf__xfer_set_state(x, KVF__RECV_LANDED); break;
  case KVF__RECV_SENDER_DONE: complete_recv(x); break;
  case KVF__RECV_WAIT:
  case KVF__RECV_OPENING: bug(x, "the transport saw every byte of a grant it was not given"); break;
  default: break; /* told twice, or failed */
  }
}

void kvf__xfer_on_delivered(kvf__xfer *x) {
  if (!x->tr.t[KVF__XT_LAST]) kvf__xtrace_stamp(x, KVF__XT_LAST, 0); /* one-sided: what we can see */
  switch (x->recv.state) {
  case KVF__RECV_OPEN:
  case KVF__RECV_LANDED:
  case KVF__RECV_SENDER_DONE: complete_recv(x); break;
  case KVF__RECV_WAIT: bug(x, "the transport delivered into a grant it was not given"); break;
  default: break; /* OPENING: no sender knows the grant yet (a peer guessed it); or failed */
  }
}

void kvf__xfer_on_vouched(kvf__xfer *x) {
  kvf__xplan whole = {.transform = false};
  if (x->blocks && !x->transform[0]) kvf__xplan_describe(&whole, x->transform, sizeof(x->transform));
  kvf__xfer_on_delivered(x);
}

void kvf__xfer_on_data_error(kvf__xfer *x, int status, const char *why) {
  kvf__xfer_fail(x, status, why, true, status);
}

/* Landed: every byte is in, and the sender's word comes over the control
 * connection, which a data-path reset leaves alone. */
void kvf__xfer_on_grant_lost(kvf__xfer *x, const char *why) {
  int s = x->recv.state;
  if (kvf__xfer_live(x) && (s == KVF__RECV_OPEN || s == KVF__RECV_SENDER_DONE))
    kvf__xfer_fail(x, KVF_EPEERLOST, why, true, KVF_EPEERLOST);
}

void kvf__xfer_on_grant_ready(kvf__xfer *x, int status, const char *why) {
  if (!kvf__xfer_live(x)) return;
  if (x->recv.state != KVF__RECV_OPENING) {
    bug(x, "the transport opened a grant twice");
    return;
  }
  if (status) {
    kvf__xfer_fail(x, status, why, true, status);
    return;
  }
  kvf__xfer_set_state(x, KVF__RECV_OPEN);
  int rc = send_grant(x);
  if (rc) kvf__xfer_fail(x, rc, "could not send the grant", true, rc);
}

/* -------------------------------------------------------- peer messages */

static kvf__xfer *by_handle(kvf__peer *p, int role, uint64_t handle) {
  kvf__xfer probe = {.role = role}; /* a grant's key names no peer: p may be NULL (a local one) */
  if (role == KVF__SEND) snprintf(probe.peer_name, sizeof(probe.peer_name), "%s", X.env.peer_name(p));
  char key[KVF__NAME_MAX + 64];
  handle_key(key, sizeof(key), &probe, handle);
  kvf__xfer *x = kvf__map_get(&X.by_handle, key);
  return x && x->peer == p ? x : NULL;
}

kvf__xfer *kvf__xfer_by_handle(kvf__peer *p, int role, uint64_t handle) { return by_handle(p, role, handle); }

static void on_intent(kvf__peer *p, const Kvf__SendIntent *si) {
  if (!valid_id(si->xfer_id)) return;
  kvf__xfer *x = kvf__map_get(&X.recv_by_id, si->xfer_id);
  if (x && kvf__xfer_live(x) && x->peer == p) {
    /* our pushed grant crossed their intent; say it again (or soon) */
    if (x->recv.state == KVF__RECV_OPENING) return;
    int rc = send_grant(x);
    if (rc) kvf__xfer_fail(x, rc, "could not send the grant", true, rc);
    return;
  }
  bool named_other = x && x->peer_name[0] && strcmp(x->peer_name, X.env.peer_name(p)) != 0;
  if (x && x->recv.state == KVF__RECV_WAIT && !x->twin && !named_other) {
    int rc = bind_remote_recv(x, p);
    if (rc) kvf__xfer_fail(x, rc, "the transport could not open the grant", true, rc);
    return;
  }
  intent *in = kvf__map_get(&X.intents, si->xfer_id);
  if (!in || in->peer != p) {
    char why[192];
    if (!peer_may_wait(p, "send intent", si->xfer_id, why, sizeof(why))) {
      cancel_to(p, 0, si->xfer_id, KVF_ELIMIT, why, true, false);
      return;
    }
  }
  if (!in) {
    in = calloc(1, sizeof(*in));
    if (!in || kvf__map_put(&X.intents, si->xfer_id, in) != 0) {
      free(in);
      return;
    }
  }
  if (in->peer != p) {
    if (in->peer) in->peer->waiting--;
    p->waiting++;
  }
  in->peer = p;
  in->expires_ns = deadline_ns(si->deadline_ms);
}

/* What a Grant brought: its descriptors, or its blocks (a view and ids). */
typedef struct grant_in {
  kvf__descs dst;
  kvf__xblocks gb;
} grant_in;

static void grant_in_free(grant_in *in) {
  kvf__descs_free(&in->dst);
  kvf__xblocks_free(&in->gb);
}

/* Keeps a grant (or our refusal of it) until the send for it comes; takes
 * what in holds. */
static void keep_pregrant(kvf__peer *p, const Kvf__Grant *g, grant_in *in, int refused, const char *why) {
  pregrant *old = take_pregrant(X.env.peer_name(p), g->xfer_id);
  if (old) pregrant_free(old);
  char full[192];
  if (!peer_may_wait(p, "pushed grant", g->xfer_id, full, sizeof(full))) {
    cancel_to(p, g->handle, g->xfer_id, KVF_ELIMIT, full, false, false);
    grant_in_free(in);
    return;
  }
  pregrant *ng = calloc(1, sizeof(*ng));
  char key[KVF__NAME_MAX + KVF_XFER_ID_MAX + 4];
  pair_key(key, sizeof(key), X.env.peer_name(p), g->xfer_id);
  if (!ng || kvf__map_put(&X.pregrants, key, ng) != 0) {
    free(ng);
    grant_in_free(in);
    return;
  }
  ng->from = p;
  p->waiting++;
  snprintf(ng->peer, sizeof(ng->peer), "%s", X.env.peer_name(p));
  snprintf(ng->id, sizeof(ng->id), "%s", g->xfer_id);
  ng->handle = g->handle;
  ng->dst = in->dst;
  ng->gb = in->gb;
  ng->layer_events = g->layer_events;
  memset(in, 0, sizeof(*in));
  ng->expires_ns = deadline_ns(g->deadline_ms);
  ng->refused = refused;
  snprintf(ng->why, sizeof(ng->why), "%s", why ? why : "");
  if (kvf__tp_grant_copy(&ng->tp, g) != 0) ng->refused = -ENOMEM;
}

/* A grant with more descriptors than our max-descs (the receiver's may be
 * larger): the receiver's grant fails with the reason (Cancel on its
 * handle), and so does our send, now or when it comes. The connection
 * stays up. */
static void refuse_grant(kvf__peer *p, const Kvf__Grant *g, int rc) {
  char why[192];
  if (g->layout)
    snprintf(why, sizeof(why), "grant of %zu blocks refused by %s: its max-descs is %u", g->block_ids.len / 4,
             own_node(), kvfd.cfg.max_descs);
  else
    snprintf(why, sizeof(why), "grant of %zu descriptors refused by %s: its max-descs is %u",
             g->descs ? g->descs->packed.len / KVF__DESC_WIRE_SIZE : 0, own_node(), kvfd.cfg.max_descs);
  kvf__warn("peer %s: transfer '%s': %s", X.env.peer_name(p), g->xfer_id, why);
  kvfd.stats.peer_errors++;
  cancel_to(p, g->handle, g->xfer_id, rc, why, false, false);
  kvf__xfer *x = kvf__map_get(&X.send_by_id, g->xfer_id);
  if (x && x->peer == p && send_waiting(x)) {
    kvf__xfer_fail(x, rc, why, false, 0);
    return;
  }
  grant_in none = {0};
  keep_pregrant(p, g, &none, rc, why);
}

/* Decodes what a Grant brought into *in: descriptors, or blocks. */
static int grant_decode(const Kvf__Grant *g, grant_in *in) {
  memset(in, 0, sizeof(*in));
  if (g->layout) return kvf__xblocks_from_grant(g, &in->gb);
  return kvf__descs_from_wire(&in->dst, g->descs, kvfd.cfg.max_descs);
}

static void on_grant(kvf__peer *p, const Kvf__Grant *g) {
  grant_in in;
  if (!valid_id(g->xfer_id) || !g->handle) return;
  int rc = grant_decode(g, &in);
  if (rc == KVF_ELIMIT) refuse_grant(p, g, rc);
  if (rc) return; /* malformed: no daemon sends that; ignored */
  kvf__spin_expect(false); /* its send's data path polls until the send comes (spin.h) */
  kvf__xfer *x = kvf__map_get(&X.send_by_id, g->xfer_id);
  if (x && x->peer == p && send_waiting(x)) {
    rc = kvf__tp_grant_copy(&x->tp_grant, g);
    if (rc == 0) rc = bind_remote_send(x, g->handle, &in.dst, &in.gb, g->layer_events);
    grant_in_free(&in);
    if (rc) kvf__xfer_fail(x, rc, "duplicate grant handle", true, KVF_EPROTO);
    return;
  }
  if (x && x->peer == p && x->handle == g->handle) {
    grant_in_free(&in); /* a repeat of the grant we already use */
    return;
  }
  keep_pregrant(p, g, &in, 0, NULL);
}

static void on_send_done(kvf__peer *p, const Kvf__SendDone *d) {
  /* the sender's intent crossed our pushed grant and came after the grant
   * ended (proto: SendDone.xfer_id): it waits for nothing */
  intent *in = d->xfer_id && d->xfer_id[0] ? kvf__map_get(&X.intents, d->xfer_id) : NULL;
  if (in && in->peer == p) intent_drop(d->xfer_id);
  kvf__xfer *x = by_handle(p, KVF__RECV, d->handle);
  if (x && d->transform) snprintf(x->transform, sizeof(x->transform), "%s", d->transform);
  if (x) kvf__xrecv_sender_done(x, d->bytes);
}

void kvf__xrecv_sender_done(kvf__xfer *x, uint64_t bytes) {
  if (!kvf__xfer_live(x)) return;
  if (x->recv.passes_out) { /* staged parts are still being placed: kvf__xrecv_unstaged says it again */
    x->recv.done_owed = true;
    x->recv.owed_bytes = bytes;
    return;
  }
  kvf__xtrace_stamp(x, KVF__XT_RESULT, 0);
  if (bytes != kvf__xfer_bytes(x)) {
    kvf__xfer_fail(x, KVF_ESIZE, "the sender sent a different number of bytes", true, KVF_ESIZE);
    return;
  }
  if (x->recv.state == KVF__RECV_OPEN) kvf__xfer_set_state(x, KVF__RECV_SENDER_DONE);
  else if (x->recv.state == KVF__RECV_LANDED) complete_recv(x);
  /* else said twice, or OPENING: no sender knows the grant yet */
}

static void on_recv_result(kvf__peer *p, const Kvf__RecvResult *r) {
  kvf__xfer *x = by_handle(p, KVF__SEND, r->handle);
  if (!x || !kvf__xfer_live(x)) return;
  kvf__xtrace_stamp(x, KVF__XT_RESULT, 0);
  enum kvf__send_state s = x->send.state;
  /* With one-sided writes the receiver may confirm before our own last
   * completion reached the loop: remember it, finish in on_posted. */
  if (r->status == 0 && s == KVF__SEND_FLUSH) kvf__xfer_set_state(x, KVF__SEND_CONFIRMED);
  else if (r->status == 0 && s == KVF__SEND_CONFIRMED) return; /* said twice */
  else if (r->status == 0 && s == KVF__SEND_RESULT) succeed(x);
  else kvf__xfer_fail(x, r->status ? r->status : KVF_EPROTO, r->error, false, 0);
}

static void on_cancel(kvf__peer *p, const Kvf__Cancel *c) {
  int status = c->status ? c->status : KVF_EREMOTECANCEL;
  const char *why = c->error && c->error[0] ? c->error : "cancelled by the peer";
  if (c->to_sender) {
    pregrant *g = c->xfer_id ? take_pregrant(X.env.peer_name(p), c->xfer_id) : NULL;
    if (g) pregrant_free(g);
    kvf__xfer *x = c->handle ? by_handle(p, KVF__SEND, c->handle) : NULL;
    /* By id only a Cancel that names no grant (a refused intent): one that
     * names a grant we do not hold must not fail a later send of that id. */
    if (!x && !c->handle && c->xfer_id) {
      x = kvf__map_get(&X.send_by_id, c->xfer_id);
      if (x && (x->peer != p || x->handle)) x = NULL;
    }
    /* With ack, the receiver keeps its grant open until we say that none
     * of our writes into it is in flight: now, or once they are back. */
    if (c->ack && x && x->send.parts_out > 0) x->send.cancel_done_owed = true;
    else if (c->ack) send_cancel_done(p, c->handle);
    if (x) kvf__xfer_fail(x, status, why, false, 0);
    return;
  }
  kvf__xfer *x = c->handle ? by_handle(p, KVF__RECV, c->handle) : NULL;
  if (!x && c->xfer_id) {
    /* A sender that had not seen our (pushed) grant yet names it by id. */
    x = kvf__map_get(&X.recv_by_id, c->xfer_id);
    if (x && (x->peer != p || !kvf__xfer_live(x))) x = NULL;
  }
  if (x) {
    /* Named by id, the sender's Cancel crossed our pushed grant, which
     * reaches it after its send is gone: drop it there too, or a later
     * send of the same id would take it and write through windows that
     * are invalidated now. */
    uint64_t crossed = !c->handle ? x->handle : 0;
    kvf__xfer_fail(x, status, why, false, 0);
    if (crossed) cancel_to(p, crossed, c->xfer_id, status, why, true, false);
    return;
  }
  intent *in = c->xfer_id ? kvf__map_get(&X.intents, c->xfer_id) : NULL;
  if (in && in->peer == p) intent_drop(c->xfer_id);
}

/* The sender's word that layers of our grant landed (its transport cannot
 * mark them in the data). */
static void on_layers_done(kvf__peer *p, const Kvf__LayersDone *d) {
  kvf__xfer *x = by_handle(p, KVF__RECV, d->handle);
  if (x) kvf__xrecv_layers_done(x, d);
}

static void on_cancel_done(kvf__peer *p, const Kvf__CancelDone *d) {
  kvf__xfer *x = d->handle ? by_handle(p, KVF__RECV, d->handle) : NULL;
  if (x) fence_end(x, NULL);
}

void kvf__xfer_on_peer_msg(kvf__peer *p, const Kvf__PeerMsg *m) {
  switch (m->body_case) {
  case KVF__PEER_MSG__BODY_SEND_INTENT: on_intent(p, m->send_intent); break;
  case KVF__PEER_MSG__BODY_GRANT: on_grant(p, m->grant); break;
  case KVF__PEER_MSG__BODY_SEND_DONE: on_send_done(p, m->send_done); break;
  case KVF__PEER_MSG__BODY_RECV_RESULT: on_recv_result(p, m->recv_result); break;
  case KVF__PEER_MSG__BODY_CANCEL: on_cancel(p, m->cancel); break;
  case KVF__PEER_MSG__BODY_CANCEL_DONE: on_cancel_done(p, m->cancel_done); break;
  case KVF__PEER_MSG__BODY_LAYERS_DONE: on_layers_done(p, m->layers_done); break;
  case KVF__PEER_MSG__BODY_OUTCOME_QUERY: kvf__xoutcome_on_query(p, m->outcome_query); break;
  case KVF__PEER_MSG__BODY_OUTCOME_REPLY: kvf__xwait_on_reply(p, m->outcome_reply); break;
  default: break;
  }
}

/* Drops the pre-grants and intents that match (or all when p is NULL and
 * expired_only is false); with expired_only, those past their time. */
static void sweep_tables(kvf__peer *p, bool expired_only) {
  uint64_t now = kvf__now_ns();
  kvf__map *maps[2] = {&X.pregrants, &X.intents};
  for (int k = 0; k < 2; k++) {
    kvf__map *m = maps[k];
    for (size_t i = 0; i < m->nb; i++) {
      kvf__map_ent *e = m->b[i];
      while (e) {
        kvf__map_ent *next = e->next;
        uint64_t exp = k == 0 ? ((pregrant *)e->val)->expires_ns : ((intent *)e->val)->expires_ns;
        bool of_peer = !p || (k == 0 ? strcmp(((pregrant *)e->val)->peer, X.env.peer_name(p)) == 0
                                     : ((intent *)e->val)->peer == p);
        if ((expired_only && exp <= now) || (!expired_only && of_peer)) {
          if (k == 0) pregrant_free(take_pregrant(((pregrant *)e->val)->peer, ((pregrant *)e->val)->id));
          else intent_drop(e->key);
        }
        e = next;
      }
    }
  }
}

/* Of peer p, and not kept waiting for it (xfer_wait.c). */
static bool of_peer_not_held(kvf__xfer *x, void *p) { return x->peer == p && !kvf__xwait_hold(x); }

/* Ends the fences that match: the peer is gone (its connections with it)
 * or the daemon stops. */
static void end_fences(kvf__peer *p) {
  for (kvf__xfer *x = X.head, *next; x; x = next) {
    next = x->next;
    if (x->role == KVF__RECV && x->recv.state == KVF__RECV_FENCE && (!p || x->peer == p)) fence_end(x, NULL);
  }
}

void kvf__xfer_on_peer_down(kvf__peer *p) {
  sweep_tables(p, false);
  fail_each(of_peer_not_held, p, KVF_EPEERLOST, "lost the peer daemon", false, 0);
  end_fences(p);
  if (p->queued)
    kvf__info("peer %s down: %u sends wait for it to come back (within their deadlines)", X.env.peer_name(p),
              p->queued);
}

static void on_sweep(uv_timer_t *t) { sweep_tables(NULL, true); }

/* ------------------------------------------------------------ lifecycle */

int kvf__xfer_init(uv_loop_t *loop, const kvf__xfer_env *env) {
  memset(&X, 0, sizeof(X));
  X.loop = loop;
  X.env = *env;
  /* Handles start at a random point so that a restarted daemon's handles do
   * not collide with the ones its peers remember. */
  X.next_handle = (kvfd.session << 20) | 1;
  int rc = kvf__xoutcome_init(loop);
  if (rc) return rc;
  uv_timer_init(loop, &X.sweep);
  uv_timer_start(&X.sweep, on_sweep, 1000, 1000);
  uv_unref((uv_handle_t *)&X.sweep);
  X.sweep_on = true;
  return 0;
}

static bool any_xfer(kvf__xfer *x, void *arg) { return true; }

void kvf__xfer_shutdown(void) {
  X.stopping = true; /* no new fences: the transports go next */
  end_fences(NULL);
  for (kvf__xfer *x = X.head; x; x = x->next) x->owner = NULL;
  fail_each(any_xfer, NULL, KVF_ECANCELED, "the daemon is stopping", true, KVF_EREMOTECANCEL);
  sweep_tables(NULL, false);
  kvf__xoutcome_shutdown();
  if (X.sweep_on) uv_close((uv_handle_t *)&X.sweep, NULL);
  X.sweep_on = false;
}

void kvf__xfer_counts_get(kvf__xfer_counts *c) {
  memset(c, 0, sizeof(*c));
  for (kvf__xfer *x = X.head; x; x = x->next) {
    c->active++;
    if (x->role == KVF__RECV) c->grants++;
    else c->sends++;
  }
  c->pregrants = X.pregrants.n;
  c->intents = X.intents.n;
}

kvf__xfer *kvf__xfer_first(void) { return X.head; }
