/* xfer.h - the transfer state machine: grants, sends (whole or in parts),
 * rendezvous whichever side comes first, pre-grants pushed to the sender,
 * pairing, deadlines, cancel, and the RECV_DONE / SEND_DONE events. It talks
 * to clients, peers and transports only through kvf__xfer_env, so tests can
 * drive it with fakes. */
#ifndef KVF_XFER_H
#define KVF_XFER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "desc.h"
#include "kvferryd.h"
#include "transport/transport.h"

enum kvf__role { KVF__RECV = 1, KVF__SEND = 2 };

enum kvf__xstate {
  KVF__X_WAIT = 1,   /* recv: no sender yet; send: no grant yet */
  KVF__X_ACTIVE,     /* bound; send: parts flow as they are posted */
  KVF__X_FLUSH,      /* send: last part with the transport */
  KVF__X_RESULT,     /* send: all handed off, waiting for the receiver's verdict;
                        recv: SendDone or data still missing */
  KVF__X_DRAIN,      /* failed; waiting for the transport to let go of memory */
};

/* The transport's part of a Grant, opaque here (rdma: its memory windows,
 * Grant.windows, and each descriptor's window, Grant.window_of). */
typedef struct kvf__tp_grant {
  uint8_t *win;
  size_t win_len;
  uint8_t *of;
  size_t of_len;
} kvf__tp_grant;

struct kvf__xfer {
  char id[KVF_XFER_ID_MAX + 1];
  int role;
  int state;
  kvf__session *owner;        /* NULL once the client went away */
  kvf__peer *peer;            /* the remote daemon; NULL when local */
  char peer_name[KVF__NAME_MAX + 1];
  kvf__xfer *twin;            /* local transfers: the other half */
  kvf__transport *tp;
  uint64_t handle;            /* the grant's handle, once known */
  kvf__descs dst;             /* the grant's descriptors */
  kvf__descs early;           /* send: parts posted before the grant came */
  bool early_last;
  bool last_posted;           /* send: the final part was handed to the transport */
  size_t cursor;              /* send: next grant descriptor to pair */
  uint64_t src_descs;         /* send: descriptors posted so far */
  uint64_t bytes;             /* send: bytes paired so far; recv: the grant's */
  unsigned parts_out;         /* send: transport posts not yet called back */
  bool send_done_seen;        /* recv: the sender said all bytes are out */
  bool landed;                /* recv: the transport saw every byte */
  bool result_ok;             /* send: the receiver confirmed before our last completion */
  int status;                 /* the failure to report once drained */
  char error[128];
  bool notify_remote;         /* tell the peer when we fail */
  bool cancel_owed;           /* send: failed with writes out; the Cancel goes once
                                 they are back (cancel_status for the receiver) */
  int cancel_status;
  bool done_owed;             /* send: the receiver asked (Cancel.ack) for a CancelDone once
                                 our writes are back */
  bool fencing;               /* recv, cancelled: the grant stays open until the sender's
                                 CancelDone (or FENCE_MS) says none of its writes is in flight */
  int remote_status;
  uint64_t created_ns;
  uint64_t first_post_ns;     /* send: the first and last part handed to the */
  uint64_t last_post_ns;      /* transport, and its last completion (debug trace) */
  uint64_t posted_ns;
  uint32_t deadline_ms;
  uv_timer_t timer;
  void *tp_state;             /* the transport's own per-transfer state */
  kvf__tp_grant tp_grant;     /* set by grant_open on the receiver, from the Grant on
                                 the sender; owned */
  bool grant_pending;         /* recv: grant_open is not done; the Grant waits */
  const char *path;           /* set by the transport when more precise than its
                                 name ("local-nvlink", "tcp-bounce"); static */
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
} kvf__xfer_env;

int kvf__xfer_init(uv_loop_t *loop, const kvf__xfer_env *env);
void kvf__xfer_shutdown(void);

/* Client requests. Return 0 or an error (then no event follows). */
int kvf__xfer_grant(kvf__session *s, const char *id, const char *src_node,
                    kvf__descs *descs, uint32_t deadline_ms, char *err, size_t errlen);
int kvf__xfer_send(kvf__session *s, const char *id, const char *dst_node,
                   kvf__descs *descs, bool more, uint32_t deadline_ms, char *err, size_t errlen);
int kvf__xfer_cancel(kvf__session *s, const char *id);
/* A client call that fed s's send of id failed after part of it was taken:
 * the send fails with status; silent: without an event to s (the call that
 * began it returns the error instead). The other side gets
 * KVF_EREMOTECANCEL. */
void kvf__xfer_withdraw_send(kvf__session *s, const char *id, int status, const char *why, bool silent);
/* True when s has a send of id under way (its next part needs no quota). */
bool kvf__xfer_sending(kvf__session *s, const char *id);
/* The client went away: drop its grants and sends, tell the peers. */
void kvf__xfer_session_gone(kvf__session *s);

/* Peer messages and events. */
void kvf__xfer_on_peer_msg(kvf__peer *p, const Kvf__PeerMsg *m);
void kvf__xfer_on_peer_down(kvf__peer *p);

/* Transport callbacks (loop thread). */
void kvf__xfer_on_posted(kvf__xfer *x, int status, bool last);
void kvf__xfer_on_landed(kvf__xfer *x);
/* Every byte is placed and the sender is done (rdma's WRITE_WITH_IMM):
 * completes the receive without waiting for SendDone. */
void kvf__xfer_on_delivered(kvf__xfer *x);
void kvf__xfer_on_data_error(kvf__xfer *x, int status, const char *why);
/* A grant_open that returned a positive value is done: 0 sends the Grant,
 * else the grant fails with status (why: for its owner). */
void kvf__xfer_on_grant_ready(kvf__xfer *x, int status, const char *why);

/* Introspection. */
typedef struct kvf__xfer_counts {
  size_t active, grants, sends, pregrants, intents;
} kvf__xfer_counts;
void kvf__xfer_counts_get(kvf__xfer_counts *c);
kvf__xfer *kvf__xfer_first(void);
const char *kvf__xstate_name(int state);
const char *kvf__xfer_path(const kvf__xfer *x);

#endif
