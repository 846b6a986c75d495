/* xfer_outcome.c - the receiver's memory of how its remote grants ended,
 * so that a sender whose link dropped before our RecvResult reached it can
 * ask after reconnecting (OutcomeQuery) and report what really happened,
 * instead of a loss while its receiver reported success (issue 15, item 7).
 *
 * Records are kept per grant handle (unique within this incarnation: a
 * restarted daemon has none, and the sender then knows the outcome is
 * unknown from the peer's new session). The table is bounded: a ring of
 * OUTCOME_MAX records, each kept at most as long as a transfer may wait
 * (its deadline, and at least default-deadline-ms). A sender that asks
 * about a record gone from it gets OUTCOME_UNKNOWN. */
#include "xfer_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "map.h"
#include "peer.h"
#ifdef KVF_FAILPOINTS
#include "failpoint.h"
#endif

#define OUTCOME_MAX 16384

typedef struct outcome {
  uint64_t handle;            /* 0: a free slot */
  uint64_t peer_session;      /* the sender's incarnation */
  uint64_t expires_ns;
  int status;
  char peer[KVF__NAME_MAX + 1];
  char error[96];
} outcome;

static struct {
  uv_loop_t *loop;
  outcome *ring;
  size_t next;
  kvf__map by_handle;
} O;


int kvf__xoutcome_init(uv_loop_t *loop) {
  memset(&O, 0, sizeof(O));
  O.loop = loop;
  O.ring = calloc(OUTCOME_MAX, sizeof(*O.ring));
  return O.ring ? 0 : -ENOMEM;
}

void kvf__xoutcome_shutdown(void) {
  kvf__map_free(&O.by_handle);
  free(O.ring);
  memset(&O, 0, sizeof(O));
}

/* A remote grant ended with status (0: done): remember it for its sender. */
void kvf__xoutcome_record(const kvf__xfer *x, int status, const char *why) {
  if (!O.ring || x->role != KVF__RECV || !x->peer || !x->handle) return;
  char key[KVF__MAP_KEY_U64];
  outcome *o = &O.ring[O.next];
  O.next = (O.next + 1) % OUTCOME_MAX;
  if (o->handle) { /* the oldest makes room */
    kvf__map_key_u64(key, o->handle);
    if (kvf__map_get(&O.by_handle, key) == o) kvf__map_del(&O.by_handle, key);
  }
  memset(o, 0, sizeof(*o));
  kvf__map_key_u64(key, x->handle);
  if (kvf__map_put(&O.by_handle, key, o) != 0) return; /* out of memory: unknown when asked */
  o->handle = x->handle;
  o->peer_session = x->peer->remote_session;
  uint32_t keep_ms = x->deadline_ms > kvfd.cfg.default_deadline_ms ? x->deadline_ms : kvfd.cfg.default_deadline_ms;
  o->expires_ns = kvf__now_ns() + (uint64_t)keep_ms * 1000000ull;
  o->status = status;
  snprintf(o->peer, sizeof(o->peer), "%s", x->peer_name);
  snprintf(o->error, sizeof(o->error), "%s", why ? why : "");
}

static const outcome *lookup(kvf__peer *p, uint64_t handle) {
  char key[KVF__MAP_KEY_U64];
  kvf__map_key_u64(key, handle);
  const outcome *o = kvf__map_get(&O.by_handle, key);
  if (!o || o->handle != handle || strcmp(o->peer, p->cfg.name) != 0 || o->peer_session != p->remote_session ||
      o->expires_ns <= kvf__now_ns())
    return NULL;
  return o;
}

/* What the sender reports of a receiver's status: a grant its own client
 * cancelled is the other side's cancel there. */
static int sender_view(int status) { return status == KVF_ECANCELED ? KVF_EREMOTECANCEL : status; }

static void reply(kvf__peer *p, uint64_t handle, Kvf__OutcomeReply__Outcome what, int status, const char *why) {
  Kvf__OutcomeReply r = KVF__OUTCOME_REPLY__INIT;
  r.handle = handle;
  r.outcome = what;
  r.status = status;
  r.error = (char *)(why ? why : "");
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_OUTCOME_REPLY;
  m.outcome_reply = &r;
  kvf__xfer_peer_send(p, &m);
}

/* The sender asks what became of our grant q->handle. A grant still open
 * takes the query as the SendDone it repeats (the one sent before the link
 * dropped may be lost): its RecvResult (or Cancel) follows when it ends. */
void kvf__xoutcome_on_query(kvf__peer *p, const Kvf__OutcomeQuery *q) {
  if (!q->handle) return;
  kvf__xfer *x = kvf__xfer_by_handle(p, KVF__RECV, q->handle);
  if (x && kvf__xfer_live(x)) {
    reply(p, q->handle, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_PENDING, 0, NULL);
    kvf__xrecv_sender_done(x, q->bytes);
    return;
  }
  if (x) { /* failing: its status is known, its event not yet out */
    reply(p, q->handle, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN, sender_view(x->status), x->error);
    return;
  }
  const outcome *o = lookup(p, q->handle);
  if (o) {
    kvf__debug("peer %s: transfer '%s': told the sender its outcome after a reconnect (%d)", p->cfg.name,
               q->xfer_id ? q->xfer_id : "?", o->status);
    reply(p, q->handle, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN, sender_view(o->status), o->error);
    return;
  }
  reply(p, q->handle, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_UNKNOWN, 0, NULL);
}

#ifdef KVF_FAILPOINTS
static void on_fp_drop(uv_timer_t *t) {
  kvf__peer_fail(t->data, "failpoint result-lost: the link dropped before the RecvResult went");
  uv_close((uv_handle_t *)t, (uv_close_cb)free);
}

/* result-lost, result-withheld: true when the RecvResult is not sent. The
 * link drops on the next loop turn, outside the caller (a transport's
 * callback, or the SendDone being handled). */
bool kvf__xoutcome_failpoint(kvf__xfer *x) {
  bool lost = kvf__failpoint(KVF__FP_RESULT_LOST);
  if (!x->peer || (!lost && !kvf__failpoint(KVF__FP_RESULT_WITHHELD))) return false;
  kvf__warn("failpoint %s: transfer '%s': its RecvResult is not sent", lost ? "result-lost" : "result-withheld",
            x->id);
  uv_timer_t *t = lost ? malloc(sizeof(*t)) : NULL;
  if (t) {
    uv_timer_init(O.loop, t);
    t->data = x->peer;
    uv_timer_start(t, on_fp_drop, 0, 0);
  }
  return true;
}
#endif
