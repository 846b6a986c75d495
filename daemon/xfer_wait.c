/* xfer_wait.c - sends that wait for their peer's link instead of failing
 * (issue 15, items 9 and 7).
 *
 * A send to a peer that is down or reconnecting is queued (XW_LINK): it
 * keeps its parts, its deadline runs, and it meets its grant once the link
 * is up (kvf__xfer_on_peer_up). The same holds for a send that had not met
 * its grant when the link dropped: nothing of it was on the wire but its
 * intent, which it says again.
 *
 * A send that had handed every byte over and said SendDone (RESULT) when
 * the link dropped may have succeeded: its receiver may have finished and
 * its RecvResult been lost with the link. It waits (XW_OUTCOME); when the
 * same incarnation of the peer is back it asks (OutcomeQuery, XW_ASKED) and
 * reports the receiver's answer (xfer_outcome.c keeps it there). When it
 * cannot know (the peer restarted, was removed, or stayed away past the
 * deadline) it fails with KVF_EUNKNOWN, never a plain loss.
 *
 * A send interrupted while its parts were still coming fails as before
 * (KVF_EPEERLOST): its receiver fails its grant too. With one-sided writes
 * (rdma) a send whose every part was posted (FLUSH) waits until its posts
 * are back: the receiver finishes on the transfer's last write alone, so if
 * that write was out when its queue pair failed (the transport says
 * KVF_EUNKNOWN) only the receiver can say, and the send waits like one in
 * RESULT; if it never went (KVF_EPEERLOST), the send fails. Over tcp a
 * receiver waits for our SendDone, which goes after our posts came back: a
 * send in FLUSH cannot have finished there and fails. A send the receiver
 * already confirmed (CONFIRMED) succeeds once its posts are back.
 *
 * x->peer->queued counts the sends waiting here, for max-peer-waiting and
 * for peer.c, which probes faster while any wait. */
#include "xfer_int.h"

#include <stdio.h>
#include <string.h>

#include "log.h"
#include "peer.h"

static void set_wait(kvf__xfer *x, int how) {
  if (!x->send.wait_peer && how) x->peer->queued++;
  else if (x->send.wait_peer && !how) x->peer->queued--;
  x->send.wait_peer = (uint8_t)how;
}

bool kvf__xwait_may_queue(kvf__peer *p, const char *node, char *err, size_t errlen) {
  if (p->queued < kvfd.cfg.max_peer_waiting) return true;
  snprintf(err, errlen, "peer '%s' is not connected and max-peer-waiting (%u) sends already wait for it", node,
           kvfd.cfg.max_peer_waiting);
  return false;
}

void kvf__xwait_park(kvf__xfer *x) {
  set_wait(x, XW_LINK);
  kvf__peer_need(x->peer); /* an idle on-demand peer is dialed now */
  kvf__debug("transfer '%s': peer %s is not connected; the send waits for it (deadline %u ms)", x->id,
             x->peer_name, x->deadline_ms);
}

void kvf__xwait_clear(kvf__xfer *x) {
  if (x->role == KVF__SEND && x->peer) set_wait(x, XW_NONE);
}

/* A grant pushed to p that p had not taken when it closed the link for
 * idleness (p->state is IDLE, not DOWN: its close crossed our push, or our
 * push reached it too late): nothing of it went on the wire but the push,
 * so it waits again, unbound, and is pushed on the next link
 * (kvf__xfer_on_peer_up), which the idle close dials at once (p->regrants).
 * A peer lost for real fails it, as before (KVF_EPEERLOST). */
static bool regrant(kvf__xfer *x) {
  kvf__peer *p = x->peer;
  if (p->state != KVF__PEER_IDLE || (x->recv.state != KVF__RECV_OPEN && x->recv.state != KVF__RECV_OPENING))
    return false;
  x->tp->ops->grant_close(x->tp, x);
  x->tp = NULL;
  x->peer = NULL;
  kvf__xfer_set_state(x, KVF__RECV_WAIT);
  p->regrants++;
  return true;
}

bool kvf__xwait_hold(kvf__xfer *x) {
  if (!x->peer || kvfd.stopping || x->peer->removed) return false;
  if (x->role == KVF__RECV) return regrant(x);
  if (x->role != KVF__SEND) return false;
  switch (x->send.state) {
  case KVF__SEND_WAIT:
  case KVF__SEND_QUEUED:
    if (x->handle) return false; /* bound: not a state that stays here */
    set_wait(x, XW_LINK);
    return true;
  case KVF__SEND_RESULT:
    set_wait(x, XW_OUTCOME);
    return true;
  case KVF__SEND_CONFIRMED:
    return true; /* the receiver said every byte landed: done once our posts are back */
  case KVF__SEND_FLUSH:
    if (!x->tp || !x->tp->ops->one_sided) return false;
    set_wait(x, XW_OUTCOME); /* asked once its posts are back and so is the link (send_done) */
    return true;
  default:
    return false; /* data under way: it fails, and so does the receiver */
  }
}

int kvf__xwait_deadline(const kvf__xfer *x, char *why, size_t len) {
  if (x->role != KVF__SEND) return 0;
  switch (x->send.wait_peer) {
  case XW_LINK:
    snprintf(why, len, "the transfer's deadline expired while peer %s was not connected", x->peer_name);
    return KVF_EDEADLINE;
  case XW_OUTCOME:
    snprintf(why, len, "outcome unknown: the link to peer %s dropped after every byte was sent, and it did not "
             "come back within the deadline", x->peer_name);
    return KVF_EUNKNOWN;
  case XW_ASKED:
    snprintf(why, len, "outcome unknown: peer %s did not answer what became of the transfer within the deadline",
             x->peer_name);
    return KVF_EUNKNOWN;
  default:
    return 0;
  }
}

void kvf__xwait_ask(kvf__xfer *x) {
  Kvf__OutcomeQuery q = KVF__OUTCOME_QUERY__INIT;
  q.handle = x->handle;
  q.xfer_id = x->id;
  q.bytes = x->send.bytes_posted;
  q.descriptors = x->send.descs_taken;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_OUTCOME_QUERY;
  m.outcome_query = &q;
  set_wait(x, XW_ASKED);
  if (kvf__xfer_peer_send(x->peer, &m) != 0) set_wait(x, XW_OUTCOME); /* down again: asked next time */
}

/* p is up: a waiting send meets its grant, or asks what became of it. */
static void resume(kvf__xfer *x, kvf__peer *p) {
  char why[192];
  if (x->send.wait_peer == XW_LINK) {
    set_wait(x, XW_NONE);
    kvf__xsend_rendezvous(x);
    return;
  }
  if (p->remote_session == x->peer_session) {
    /* still FLUSH: its last writes are out; their return asks (send_done) */
    if (x->send.state == KVF__SEND_RESULT) kvf__xwait_ask(x);
    return;
  }
  snprintf(why, sizeof(why), "outcome unknown: peer %s restarted before its result reached this daemon (the "
           "data may or may not have landed)", x->peer_name);
  kvf__xfer_fail(x, KVF_EUNKNOWN, why, false, 0);
}

/* A grant that names p as its source and waits: pushed now that p is up,
 * as it would have been when posted (kvf__xfer_grant). */
static bool pushable(const kvf__xfer *x, const kvf__peer *p) {
  return x->role == KVF__RECV && x->recv.state == KVF__RECV_WAIT && !x->peer && !x->twin && x->peer_name[0] &&
         strcmp(x->peer_name, p->cfg.name) == 0;
}

void kvf__xfer_on_peer_up(kvf__peer *p) {
  size_t resumed = 0;
  for (kvf__xfer *x = kvf__xfer_first(), *next; x; x = next) {
    next = x->next; /* remote transfers have no twin: failing x frees only x */
    if (x->role == KVF__SEND && x->peer == p && x->send.wait_peer && kvf__xfer_live(x)) {
      resume(x, p);
      resumed++;
    } else if (pushable(x, p)) {
      int rc = kvf__xrecv_bind_remote(x, p);
      if (rc) kvf__xfer_fail(x, rc, "the transport could not open the grant", false, 0);
    }
  }
  if (resumed) kvf__info("peer %s up: %zu sends that waited for it go on", p->cfg.name, resumed);
}

void kvf__xfer_on_peer_restarted(kvf__peer *p, uint64_t incarnation) {
  char why[192];
  for (kvf__xfer *x = kvf__xfer_first(), *next; x; x = next) {
    next = x->next;
    if (x->role != KVF__SEND || x->peer != p || !kvf__xfer_live(x) || x->peer_session == incarnation ||
        (x->send.wait_peer != XW_OUTCOME && x->send.wait_peer != XW_ASKED))
      continue;
    snprintf(why, sizeof(why), "outcome unknown: peer %s restarted before its result reached this daemon (the "
             "data may or may not have landed)", p->cfg.name);
    kvf__xfer_fail(x, KVF_EUNKNOWN, why, false, 0);
  }
}

void kvf__xfer_on_peer_removed(kvf__peer *p) {
  char why[192];
  for (kvf__xfer *x = kvf__xfer_first(), *next; x; x = next) {
    next = x->next;
    if (!kvf__xfer_live(x)) continue;
    if (x->role == KVF__SEND && x->peer == p && x->send.wait_peer == XW_LINK) {
      snprintf(why, sizeof(why), "peer %s was removed from the configuration", p->cfg.name);
      kvf__xfer_fail(x, KVF_EPEERLOST, why, false, 0);
    } else if (x->role == KVF__SEND && x->peer == p && x->send.wait_peer) {
      snprintf(why, sizeof(why), "outcome unknown: peer %s was removed from the configuration before its result "
               "reached this daemon", p->cfg.name);
      kvf__xfer_fail(x, KVF_EUNKNOWN, why, false, 0);
    } else if (pushable(x, p)) {
      snprintf(why, sizeof(why), "peer %s, the grant's source, was removed from the configuration", p->cfg.name);
      kvf__xfer_fail(x, KVF_EPEERLOST, why, false, 0);
    }
  }
}

void kvf__xwait_on_reply(kvf__peer *p, const Kvf__OutcomeReply *r) {
  kvf__xfer *x = kvf__xfer_by_handle(p, KVF__SEND, r->handle);
  if (!x || !kvf__xfer_live(x) || x->send.state != KVF__SEND_RESULT || x->send.wait_peer != XW_ASKED) return;
  char why[192];
  set_wait(x, XW_NONE);
  switch (r->outcome) {
  case KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN:
    kvf__info("transfer '%s': peer %s says it %s (learned after the link came back)", x->id, p->cfg.name,
              r->status ? "failed" : "landed");
    if (r->status == 0) {
      kvf__xfer_succeed(x);
      return;
    }
    kvf__xfer_fail(x, r->status, r->error && r->error[0] ? r->error : "the receiver failed", false, 0);
    return;
  case KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_PENDING:
    return; /* its RecvResult (or Cancel) follows */
  default:
    snprintf(why, sizeof(why), "outcome unknown: peer %s has no record of the transfer (forgotten, or never "
             "granted)", p->cfg.name);
    kvf__xfer_fail(x, KVF_EUNKNOWN, why, false, 0);
  }
}
