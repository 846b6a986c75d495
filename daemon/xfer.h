/* xfer.h - the transfer state machine: grants, sends (whole or in parts),
 * rendezvous whichever side comes first, pre-grants pushed to the sender,
 * pairing, deadlines, cancel, and the RECV_DONE / SEND_DONE events. It talks
 * to clients, peers and transports only through kvf__xfer_env, so tests can
 * drive it with fakes.
 *
 * A transfer has a role and, per role, one state (x->recv.state or
 * x->send.state). Every change goes through one function in xfer.c that
 * checks the tables below; [phase] is what kvferryctl and the metrics show
 * (x->state). Peer and client messages that do not fit the state are
 * refused or ignored before any change is made.
 *
 * Receiver (RECV, a grant):
 *
 *   kvf__xfer_grant
 *     |
 *     v
 *   WAIT [waiting] ---- a local send binds it ------------------------------+
 *     |                                                                     |
 *     | a sender is bound (its SendIntent, or the grant is pushed to the    |
 *     | source it names): the transport's grant_open                        |
 *     +-- returns > 0 --> OPENING [active]                                  |
 *     |                     | kvf__xfer_on_grant_ready(0): the Grant goes   |
 *     +-- returns 0: the Grant goes --+                                     |
 *                                     v                                     v
 *                                   OPEN [active] <-------------------------+
 *                    kvf__xfer_on_landed /     \ SendDone (the grant's size)
 *                                       v       v
 *                          LANDED [active]     SENDER_DONE [active]
 *                                SendDone \     / kvf__xfer_on_landed
 *                                          v   v
 *                                          DONE
 *
 *   Also to DONE: from OPEN, LANDED or SENDER_DONE, kvf__xfer_on_delivered
 *   (rdma's WRITE_WITH_IMM: every byte placed, and the sender done); from
 *   OPEN, the last copy of the local sender.
 *
 * Sender (SEND):
 *
 *   kvf__xfer_send, first part
 *     |
 *     v
 *   WAIT [waiting] -- the last part (no MORE) --> QUEUED [waiting]
 *     |  parts queue until the grant is known        |
 *     | the grant is known (local grant, pre-grant,  | the grant is known: the
 *     | Grant): the queued parts are posted          | queued parts are posted
 *     v                                              v
 *   ACTIVE [active] -- the last part posted --> FLUSH [flushing]
 *     parts are posted as they come                 |          |
 *                            the last completion:   |          | RecvResult(ok) before it
 *                            SendDone goes          |          v (one-sided writes)
 *                                                   |     CONFIRMED [flushing]
 *                                                   v          |
 *                                     RESULT [confirming]      | the last completion
 *                                                   |          |
 *                                    RecvResult(ok) v          |
 *                                                 DONE <-------+
 *
 *   Also to DONE: from FLUSH, the last completion of a local send (its
 *   receiver finishes with it).
 *
 * Failure, both roles (deadline, cancel, size mismatch, a refused post or
 * grant, the transport's error, the other side's Cancel or failed result,
 * the peer or the client gone): every state above but DONE goes to
 *
 *   FENCE [failing]   receiver only: its client cancelled (or went away) a
 *                     grant whose Grant went to a one-sided transport's
 *                     sender (OPEN, LANDED, SENDER_DONE). The grant stays
 *                     open until the sender's CancelDone says none of its
 *                     writes is in flight, or FENCE_MS passed, the peer
 *                     went or the daemon stops; then it closes: -> FAILED.
 *   DRAIN [failing]   otherwise: the transport lets go of the memory. A
 *                     sender waits for its posts to come back (aborted),
 *                     then sends the Cancel (and CancelDone) it owes; a
 *                     local receiver waits for its sender's copies. With
 *                     nothing out, at once: -> FAILED.
 *
 * DONE and FAILED are final: the owner has its event and the transfer is
 * freed once its timer closed. */
#ifndef KVF_XFER_H
#define KVF_XFER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "desc.h"
#include "kvferryd.h"
#include "layout.h"
#include "spin.h"
#include "transport/transport.h"

enum kvf__role { KVF__RECV = 1, KVF__SEND = 2 };

/* Phases, what x->state holds: XX(phase, the name kvferryctl and the
 * metrics show). Nothing lists a transfer that is DONE or FAILED: it is
 * freed right away. */
#define KVF__XPHASE_MAP(XX) \
  XX(WAIT, "waiting")       \
  XX(ACTIVE, "active")      \
  XX(FLUSH, "flushing")     \
  XX(RESULT, "confirming")  \
  XX(DRAIN, "failing")      \
  XX(DONE, "done")          \
  XX(FAILED, "failed")

enum kvf__xstate {
  KVF__X_NONE,
#define XX(phase, name) KVF__X_##phase,
  KVF__XPHASE_MAP(XX)
#undef XX
};

/* The states of each role, drawn above: XX(state, phase, name for logs).
 * The ones both roles share come first, so that they have the same value
 * in both enums. */
#define KVF__XFER_END_STATES(XX) \
  XX(DRAIN, DRAIN, "drain")      \
  XX(DONE, DONE, "done")         \
  XX(FAILED, FAILED, "failed")

#define KVF__RECV_STATES(XX)                \
  XX(WAIT, WAIT, "wait")                    \
  XX(OPENING, ACTIVE, "opening")            \
  XX(OPEN, ACTIVE, "open")                  \
  XX(LANDED, ACTIVE, "landed")              \
  XX(SENDER_DONE, ACTIVE, "sender-done")    \
  XX(FENCE, DRAIN, "fence")

#define KVF__SEND_STATES(XX)                \
  XX(WAIT, WAIT, "wait")                    \
  XX(QUEUED, WAIT, "queued")                \
  XX(ACTIVE, ACTIVE, "active")              \
  XX(FLUSH, FLUSH, "flush")                 \
  XX(CONFIRMED, FLUSH, "confirmed")         \
  XX(RESULT, RESULT, "result")

enum kvf__xend { /* DRAIN, DONE, FAILED of either role */
  KVF__XS_NONE,
#define XX(s, phase, name) KVF__XS_##s,
  KVF__XFER_END_STATES(XX)
#undef XX
};
enum kvf__recv_state {
  KVF__RECV_NONE,
#define XX(s, phase, name) KVF__RECV_##s,
  KVF__XFER_END_STATES(XX) KVF__RECV_STATES(XX)
#undef XX
  KVF__RECV_NSTATES
};
enum kvf__send_state {
  KVF__SEND_NONE,
#define XX(s, phase, name) KVF__SEND_##s,
  KVF__XFER_END_STATES(XX) KVF__SEND_STATES(XX)
#undef XX
  KVF__SEND_NSTATES
};

/* The transport's part of a Grant, opaque here (rdma: its memory windows,
 * Grant.windows, and each descriptor's window, Grant.window_of). */
typedef struct kvf__tp_grant {
  uint8_t *win;
  size_t win_len;
  uint8_t *of;
  size_t of_len;
} kvf__tp_grant;

/* One side of a transfer of blocks (KV layouts): a view of a layout and
 * block ids. Ours hold our registered layout; a sender's copy of a peer's
 * grant holds the view the Grant carried. */
typedef struct kvf__xblocks {
  kvf__layout *layout;        /* ours, held; NULL for a peer's view */
  kvf__lview view;            /* a receiver's granted layers; a sender's whole layout */
  uint64_t *offsets;          /* a peer's view: its offsets, owned */
  uint32_t *ids;              /* owned */
  size_t n;
  uint32_t head1;             /* a fan's sub-transfer (xfer_fan.h): only model head head1 - 1; 0: all */
} kvf__xblocks;

/* A range of layers. */
typedef struct kvf__lrange {
  uint32_t first, n;
} kvf__lrange;

/* A receiver's own part: its size is its grant's (kvf__xfer_bytes). */
typedef struct kvf__xrecv {
  enum kvf__recv_state state;
  /* blocks with layer events (KVF_GRANT_LAYER_EVENTS): which granted
   * layers landed, and the first not yet reported (they go in order) */
  bool layer_events;
  uint8_t *landed;
  uint32_t next_event;
  /* staged parts whose transform pass runs (rdma_stage.c): the SendDone
   * waits for them (done_owed, with its bytes) */
  unsigned passes_out;
  bool done_owed;
  uint64_t owed_bytes;
} kvf__xrecv;

/* A sender's own part: its size is what it posted so far. */
/* A part written into the receiver's staging (rdma): the heads and order
 * of what sits there, which the receiver's transform pass reads
 * (LayersDone.staged_*). nh 0: not staged. */
typedef struct kvf__xstaged {
  uint32_t order, h0, nh;
} kvf__xstaged;

typedef struct kvf__xsend {
  enum kvf__send_state state;
  kvf__descs early;           /* parts that came before the grant (WAIT, QUEUED) */
  size_t cursor;              /* the next grant descriptor to pair */
  uint64_t descs_taken;       /* descriptors the client's parts brought so far */
  uint64_t bytes_posted;      /* bytes paired and handed to the transport so far */
  unsigned parts_out;         /* posts the transport has not called back yet */
  /* Owed to the receiver once parts_out is 0 (DRAIN): our writes must have
   * stopped before it closes its grant (rdma invalidates the memory
   * windows, and a write still in flight would fail the whole queue pair). */
  bool cancel_owed;           /* a Cancel with cancel_status */
  int cancel_status;
  bool cancel_done_owed;      /* a CancelDone: its Cancel asked for one (ack) */
  uint64_t first_post_ns;     /* the first and last part handed to the */
  uint64_t last_post_ns;      /* transport, and its last completion (debug trace) */
  uint64_t posted_ns;
  /* blocks */
  kvf__xblocks grant;         /* a remote grant's blocks (a local grant: its twin's) */
  uint8_t *layers_sent;       /* per layer of our layout: a part named it */
  kvf__lrange *early_layers;  /* parts that came before the grant, in order */
  size_t n_early;
  bool layer_events;          /* the grant wants them: */
  kvf__lrange *unannounced;   /* posted parts the receiver has not heard of */
  size_t n_unannounced;
  kvf__xstaged staged;        /* the transport staged its parts: each is announced */
  uint8_t wait_peer;          /* XW_* (xfer_int.h): waits for its peer's link */
  kvf__cadence cadence;       /* when its parts came (spin.h) */
  bool intent_sent;           /* a SendIntent went: our SendDone names the id (on_send_done) */
} kvf__xsend;

/* A transfer's timeline (xfer_trace.h): CLOCK_MONOTONIC ns, 0 = not yet. */
enum { KVF__XT_POST, KVF__XT_PAIR, KVF__XT_FIRST, KVF__XT_LAST, KVF__XT_RESULT, KVF__XT_EVENT, KVF__XT_PART, KVF__XT_N };
typedef struct kvf__xtrace {
  uint64_t t[KVF__XT_N];
} kvf__xtrace;

struct kvf__xfer {
  char id[KVF_XFER_ID_MAX + 1];
  int role;                   /* enum kvf__role */
  int state;                  /* enum kvf__xstate: the phase of recv.state or
                                 send.state, set with them; what the rest of
                                 the daemon reads */
  kvf__session *owner;        /* NULL once the client went away */
  kvf__peer *peer;            /* the remote daemon; NULL when local */
  char peer_name[KVF__NAME_MAX + 1];
  kvf__xfer *twin;            /* local transfers: the other half */
  kvf__transport *tp;
  uint64_t handle;            /* the grant's handle, once known */
  uint64_t peer_session;      /* a sender: the receiver's incarnation it said
                                 SendDone to (asked again after a reconnect) */
  kvf__descs dst;             /* the grant's descriptors */
  int status;                 /* the failure to report once drained */
  char error[128];
  uint64_t created_ns;
  kvf__xtrace tr;             /* where its time went (xfer_trace.c) */
  uint32_t deadline_ms;
  uv_timer_t timer;           /* the deadline; FENCE_MS while fencing */
  void *tp_state;             /* the transport's own per-transfer state */
  kvf__tp_grant tp_grant;     /* set by grant_open on the receiver, from the Grant on
                                 the sender; owned */
  const char *stage_note;     /* rdma: how a transform went ("staged", ...; rdma_stage.c) */
  char transform[112];        /* receiver of a remote send of blocks: its SendDone.transform */
  const char *path;           /* set by the transport when more precise than its
                                 name ("local-nvlink", "tcp-bounce"); static */
  bool blocks;                /* blocks of KV layouts, not descriptors: */
  kvf__xblocks mine;          /* where they land (receiver) or come from (sender);
                                 a remote grant of blocks also has them as descriptors
                                 in dst, for its transport's checks */
  struct kvf__bset *bset;     /* a grant whose block ids a set holds (grant_index.c); NULL: ranges, or none */
  union {                     /* by role */
    kvf__xrecv recv;
    kvf__xsend send;
  };
  uint32_t *held;             /* engine pools of ours it names, held until */
  uint32_t n_held, cap_held;  /* it is gone (pool_engine.h) */
  kvf__xfer *prev, *next;     /* every live transfer */
};

/* What the state machine needs from the rest of the daemon. */
typedef struct kvf__xfer_env {
  void (*emit)(kvf__session *s, const Kvf__Event *ev);
  int (*peer_send)(kvf__peer *p, const Kvf__PeerMsg *m);
  kvf__peer *(*peer_find)(const char *node);       /* NULL: unknown node */
  bool (*peer_up)(const kvf__peer *p);
  const char *(*peer_name)(const kvf__peer *p);
  kvf__transport *(*peer_transport)(kvf__peer *p);
  void (*session_xfers)(kvf__session *s, int delta);
  kvf__transport *local;
  /* A state change the tables do not allow is a bug in the daemon: it is
   * logged, and with strict (tests) the process aborts. */
  bool strict;
} kvf__xfer_env;

int kvf__xfer_init(uv_loop_t *loop, const kvf__xfer_env *env);
void kvf__xfer_shutdown(void);

/* Client requests. Return 0 or an error (then no event follows). */
int kvf__xfer_grant(kvf__session *s, const char *id, const char *src_node,
                    kvf__descs *descs, uint32_t deadline_ms, char *err, size_t errlen);
int kvf__xfer_send(kvf__session *s, const char *id, const char *dst_node,
                   kvf__descs *descs, bool more, uint32_t deadline_ms, char *err, size_t errlen);
/* The same with blocks of layout l (held by the transfer while it uses it):
 * *ids (n of them) are taken on success. A grant covers layers [first,
 * first + n_layers) of l; a send's part its layers of the same range, and
 * may leave out the ids after the first part (n 0). */
typedef struct kvf__blockreq {
  kvf__layout *layout;
  uint32_t first, n_layers;   /* n_layers 0: to the layout's last layer */
  uint32_t **ids;
  size_t n;
  bool layer_events;          /* a grant: one event per landed layer */
  uint32_t head1;             /* a fan's sub-transfer (xfer_fan.h): only model head head1 - 1; 0: all */
  bool no_claim;              /* a fan's later sub-grant: the first one holds the blocks (grant_index) */
} kvf__blockreq;
int kvf__xfer_grant_blocks(kvf__session *s, const char *id, const char *src_node, const kvf__blockreq *b,
                           uint32_t deadline_ms, char *err, size_t errlen);
int kvf__xfer_send_blocks(kvf__session *s, const char *id, const char *dst_node, const kvf__blockreq *b,
                          bool more, uint32_t deadline_ms, char *err, size_t errlen);
int kvf__xfer_cancel(kvf__session *s, const char *id);
/* A client call that fed s's send of id failed after part of it was taken:
 * the send fails with status; silent: without an event to s (the call that
 * began it returns the error instead). The other side gets
 * KVF_EREMOTECANCEL. */
void kvf__xfer_withdraw_send(kvf__session *s, const char *id, int status, const char *why, bool silent);
/* True when s has a send of id that takes more parts (its next part needs
 * no quota); false once its last part came or it failed. */
bool kvf__xfer_sending(kvf__session *s, const char *id);
/* The client went away: drop its grants and sends, tell the peers. */
void kvf__xfer_session_gone(kvf__session *s);

/* Peer messages and events. */
void kvf__xfer_on_peer_msg(kvf__peer *p, const Kvf__PeerMsg *m);
/* The link to p dropped: transfers with data under way fail; sends that
 * had not met their grant, or had sent every byte and wait for the
 * receiver's result, wait for p to come back (xfer_wait.c). */
void kvf__xfer_on_peer_down(kvf__peer *p);
/* p is up (again): waiting sends go on, grants naming p are pushed. */
void kvf__xfer_on_peer_up(kvf__peer *p);
/* p left the configuration (after kvf__xfer_on_peer_down): what waits for
 * it fails now. */
void kvf__xfer_on_peer_removed(kvf__peer *p);
/* p restarted while not connected (the registry names a new incarnation):
 * sends that wait for the old incarnation's result fail now (KVF_EUNKNOWN)
 * instead of when the new one connects. */
void kvf__xfer_on_peer_restarted(kvf__peer *p, uint64_t incarnation);

/* Transport callbacks (loop thread). */
void kvf__xfer_on_posted(kvf__xfer *x, int status, bool last);
void kvf__xfer_on_landed(kvf__xfer *x);
/* Every byte is placed and the sender is done (rdma's WRITE_WITH_IMM):
 * completes the receive without waiting for SendDone. */
void kvf__xfer_on_delivered(kvf__xfer *x);
/* Every byte is placed from sources that cannot fault, and blocks came
 * whole, without a transform (tcp_wire.h: BATCH_SEALED): the same, without
 * the SendDone that would have said so. */
void kvf__xfer_on_vouched(kvf__xfer *x);
void kvf__xfer_on_data_error(kvf__xfer *x, int status, const char *why);
/* The transport lost the means to take the grant's data (rdma: the queue
 * pairs its memory windows were bound on were reset): x fails with
 * KVF_EPEERLOST, both sides, unless every byte landed already. */
void kvf__xfer_on_grant_lost(kvf__xfer *x, const char *why);
/* Receiver, blocks: every byte of layers [first, first + n) landed (a
 * transport that marks layers, or the sender's word). */
void kvf__xfer_on_layers_landed(kvf__xfer *x, uint32_t first, uint32_t n);
/* A transform pass of a staged part that the transport's unstage started
 * (transport.h) ended: layers [first, first + n) are placed, or rc fails x. */
void kvf__xrecv_unstaged(kvf__xfer *x, uint32_t first, uint32_t n, int rc, const char *why);
/* A grant_open that returned a positive value is done: 0 sends the Grant,
 * else the grant fails with status (why: for its owner). */
void kvf__xfer_on_grant_ready(kvf__xfer *x, int status, const char *why);

/* Introspection. */
typedef struct kvf__xfer_counts {
  size_t active, grants, sends, pregrants, intents;
} kvf__xfer_counts;
void kvf__xfer_counts_get(kvf__xfer_counts *c);
kvf__xfer *kvf__xfer_first(void);
/* The name of a phase (x->state), as kvferryctl and the metrics show it. */
const char *kvf__xstate_name(int state);
const char *kvf__xfer_path(const kvf__xfer *x);
/* What the events, kvferryctl and the metrics report of a transfer: a
 * receiver's grant; what a sender's parts brought (descriptors) and handed
 * to the transport so far (bytes). */
uint64_t kvf__xfer_bytes(const kvf__xfer *x);
uint64_t kvf__xfer_descriptors(const kvf__xfer *x);

#endif
