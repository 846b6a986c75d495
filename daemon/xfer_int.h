/* xfer_int.h - what xfer.c, xfer_blocks.c, xfer_wait.c and xfer_outcome.c
 * share: the state machine's core operations, the blocks' half of it, and
 * the sends that wait for their peer. Private to those files. */
#ifndef KVF_XFER_INT_H
#define KVF_XFER_INT_H

#include "xfer.h"
#include "spin.h"
#include "xfer_trace.h"

/* xfer.c: the core. */
void kvf__xfer_fail(kvf__xfer *x, int status, const char *why, bool notify, int remote_status);
/* What a transport's failed or refused post (status) means, for both
 * sides' events; `otherwise` where the status says nothing more. */
const char *kvf__xfer_post_failure(int status, const char *otherwise);
void kvf__xfer_set_state(kvf__xfer *x, int to);
bool kvf__xfer_live(const kvf__xfer *x);
int kvf__xfer_peer_send(kvf__peer *p, Kvf__PeerMsg *m);
void kvf__xfer_emit(kvf__session *s, const Kvf__Event *ev);
void kvf__xfer_succeed(kvf__xfer *x);
kvf__xfer *kvf__xfer_by_handle(kvf__peer *p, int role, uint64_t handle);
/* A new send (or one that waited for its peer) meets its grant: a local
 * grant, a pushed one, or it tells the peer (SendIntent). */
void kvf__xsend_rendezvous(kvf__xfer *x);
/* Binds a waiting grant to the remote sender p and sends (or opens) it. */
int kvf__xrecv_bind_remote(kvf__xfer *x, kvf__peer *p);
/* The sender said every byte is handed over (SendDone, or an OutcomeQuery
 * that repeats it). */
void kvf__xrecv_sender_done(kvf__xfer *x, uint64_t bytes);

/* xfer_wait.c: sends that wait for their peer (x->send.wait_peer). */
enum { XW_NONE = 0, XW_LINK, XW_OUTCOME, XW_ASKED };
/* Whether one more send may wait for p (max-peer-waiting); err says why not. */
bool kvf__xwait_may_queue(kvf__peer *p, const char *node, char *err, size_t errlen);
/* A new send to a peer that is not up: it waits for it. */
void kvf__xwait_park(kvf__xfer *x);
/* x is going away: it no longer counts as waiting. */
void kvf__xwait_clear(kvf__xfer *x);
/* x's peer went down: true when x waits for it instead of failing. */
bool kvf__xwait_hold(kvf__xfer *x);
/* x's deadline came while it waited: the status to fail with (why says
 * it), or 0 when it was not waiting. */
int kvf__xwait_deadline(const kvf__xfer *x, char *why, size_t len);
void kvf__xwait_on_reply(kvf__peer *p, const Kvf__OutcomeReply *r);
/* Asks x's peer (up, the same incarnation) what became of x. */
void kvf__xwait_ask(kvf__xfer *x);

/* xfer_outcome.c: the receiver's memory of how its remote grants ended. */
int kvf__xoutcome_init(uv_loop_t *loop);
void kvf__xoutcome_shutdown(void);
void kvf__xoutcome_record(const kvf__xfer *x, int status, const char *why);
void kvf__xoutcome_on_query(kvf__peer *p, const Kvf__OutcomeQuery *q);
#ifdef KVF_FAILPOINTS
/* result-lost, result-withheld (failpoint.h): true when x's RecvResult is
 * not to be sent. */
bool kvf__xoutcome_failpoint(kvf__xfer *x);
#endif

/* xfer_blocks.c: both sides. */
void kvf__xblocks_free(kvf__xblocks *b);
/* Checks a request's blocks against its layout: the view of its layers in
 * *v, KVF_ERANGE (err says which) for layers or ids outside it. */
int kvf__xblocks_view(const kvf__blockreq *b, kvf__lview *v, char *err, size_t errlen);
/* Our side's blocks: the layout held, the ids taken from b. */
void kvf__xblocks_take(kvf__xblocks *mine, const kvf__blockreq *b, const kvf__lview *v);
/* A grant of blocks on the wire: the receiver's view of the granted layers
 * and its ids, in *buf (freed by the caller). */
int kvf__xblocks_to_grant(kvf__xfer *x, Kvf__Grant *g, Kvf__Layout *lw, uint8_t **buf);
/* A Grant's blocks into *gb (owned); KVF_EPROTO when they do not decode,
 * KVF_ELIMIT past our max-descs. */
int kvf__xblocks_from_grant(const Kvf__Grant *g, kvf__xblocks *gb);

/* What a transfer of blocks does to them (kv_xform.h: "whole blocks", or
 * heads, orders and tokens per block), once its sender knows the grant;
 * false when not known here (descriptors, no grant yet, a remote sender). */
bool kvf__xfer_transform(const kvf__xfer *x, char *buf, size_t len);
/* Event.transform of x: kvf__xfer_transform's (with how a transport placed
 * it: ", staged"), a receiver's sender's SendDone.transform, or "". */
const char *kvf__xfer_event_transform(const kvf__xfer *x, char *buf, size_t len);
/* The sender's copy of a Grant's transport part (windows), and freeing it. */
int kvf__tp_grant_copy(kvf__tp_grant *t, const Kvf__Grant *g);
void kvf__tp_grant_free(kvf__tp_grant *t);
/* A local pair parts: each keeps the description for its event. */
void kvf__xfer_keep_transform(kvf__xfer *send, kvf__xfer *recv);
/* Receiver: the size of a grant of blocks (a fan's sub-grant: its head's). */
uint64_t kvf__xrecv_blocks_bytes(const kvf__xfer *x);
/* Receiver: the sender's LayersDone (a staged part: transformed first). */
void kvf__xrecv_layers_done(kvf__xfer *x, const Kvf__LayersDone *d);
/* Receiver: the receive is complete; the layers not reported yet landed. */
void kvf__xrecv_flush_layers(kvf__xfer *x);

/* Sender. */
bool kvf__xsend_grant_is_blocks(const kvf__xfer *x);
/* A new send of blocks takes b (its first part). */
int kvf__xsend_blocks_begin(kvf__xfer *x, const kvf__blockreq *b);
/* A later part: same layout and blocks, layers no earlier part named. */
int kvf__xsend_part_check(const kvf__xfer *x, const kvf__blockreq *b, const kvf__lview *v, char *err,
                          size_t errlen);
/* Takes a checked part of layers v: queued until the grant is known, posted
 * after. An error takes nothing. */
int kvf__xsend_part_take(kvf__xfer *x, const kvf__lview *v, bool last);
/* The grant is known: check that the blocks fit, post the early parts. */
void kvf__xsend_blocks_start(kvf__xfer *x);
/* Owed layer events, once none of the parts posted is out. */
void kvf__xsend_announce_layers(kvf__xfer *x);

#endif
