/* peer.h - daemon <-> daemon control connections: Hello, heartbeats,
 * reconnect with backoff, dead-peer detection, message routing. */
#ifndef KVF_PEER_H
#define KVF_PEER_H

#include <netinet/in.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <uv.h>

#include "kvferryd.h"

/* IDLE: an on-demand peer with no link, by choice (peer-connect on-demand,
 * registry members): dialed on the next need. */
enum kvf__peer_state { KVF__PEER_DOWN = 0, KVF__PEER_CONNECTING, KVF__PEER_UP, KVF__PEER_IDLE };

typedef struct kvf__pconn kvf__pconn;

struct kvf__peer {
  kvf__peer_cfg cfg;
  int state;
  struct sockaddr_storage addr;   /* resolved once at start */
  socklen_t addrlen;
  uint64_t remote_session;        /* the incarnation we are up with */
  uint32_t remote_streams;
  Kvf__Hello *hello;              /* the peer's Hello, kept while it is up */
  kvf__transport *tp;             /* the data transport chosen for this peer */
  void *tp_slot[KVF__TRANSPORTS_MAX]; /* each transport's state for this peer
                                     (kvf__transport_peer) */
  kvf__pconn *conn;               /* the established control connection */
  kvf__pconn *dialing;            /* our outbound attempt, if any */
  uv_timer_t reconnect;
  uint32_t backoff_ms;
  uint64_t last_rx_ns;
  uint64_t up_since_ns;
  uint64_t ups, downs;
  char last_error[128];
  bool removed;                   /* dropped from the config by a reload; slot kept */
  bool registered;                /* a registry member (registry.c), not a peer line */
  uint64_t reg_incarnation;       /* the incarnation its registry record names */
  uint32_t waiting;               /* its send intents and pushed grants held here (xfer.c) */
  uint32_t queued;                /* our sends waiting for it to be up (xfer_wait.c) */
  uint32_t regrants;              /* grants pushed to it that its idle close sent back to waiting */
  uint64_t dial_ns;               /* when our current dial began */
  uint64_t last_used_ns;          /* a transfer was bound to it, or a need came (idle close) */
};

/* transports: candidates in preference order; tcp is the one that data
 * streams (DataHello) are handed to. */
int kvf__peers_start(uv_loop_t *loop, kvf__transport **transports, size_t n, kvf__transport *tcp,
                     char *err, size_t errlen);
void kvf__peers_stop(void);
kvf__peer *kvf__peer_find(const char *name);
size_t kvf__peer_count(void);
kvf__peer *kvf__peer_at(size_t i);
int kvf__peer_send(kvf__peer *p, const Kvf__PeerMsg *m);
/* A send or a pushed grant needs p: an idle on-demand peer is dialed
 * (making room under max-peers); anything else is left as it is. */
void kvf__peer_need(kvf__peer *p);
/* A transport saw the peer's data path break: drop and reconnect. */
void kvf__peer_fail(kvf__peer *p, const char *why);
const char *kvf__peer_state_name(int state);
/* SIGHUP: makes the peers match kvfd.cfg (already the new configuration):
 * dials added peers, says goodbye to removed ones (their transfers fail
 * with KVF_EPEERLOST), redials a peer whose address changed, and applies
 * heartbeat-ms. Problems are logged; the peer concerned stays as it was. */
void kvf__peers_reload(void);
/* Registry (registry.c): a member appeared, moved or restarted (its
 * record names a new incarnation: what is bound to the old one fails at
 * once). A name that a peer line configures keeps its line. */
void kvf__peers_member_put(const kvf__peer_cfg *pc, uint64_t incarnation);
/* A member's record went (its lease expired, or it left): like a peer line
 * removed by a reload. */
void kvf__peers_member_gone(const char *name, const char *why);
/* The address the peer listener bound (port resolved when 0 was asked). */
int kvf__peers_listen_port(void);

#endif
