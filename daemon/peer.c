/* peer.c - daemon <-> daemon control connections on the libuv loop.
 *
 * Every daemon dials every peer in its config and accepts their dials. A
 * connection is established once both Hellos are exchanged; when both sides
 * dialed, the connection dialed by the node with the smaller name wins, so
 * both agree without a round trip. The loser is retired, not dropped: a
 * Goodbye "superseded" goes out on it, our side shuts for writing and we
 * read on until the peer closes (its frames still count), so nothing sent
 * on it is lost. The larger node switches to the winner when it reads the
 * smaller one's Hello on it, in the loop turn that answers it, so only the
 * smaller node can find its route retired before it has read the winner's
 * Hello; it then takes its own dial (which the peer already reads) as the
 * route at once instead of taking the peer down (hand_over); that dial
 * must still complete within peer-handshake-timeout-ms. Forming a mesh
 * thus never drops a link (tests/ops/test_peer_mesh.py).
 *
 * A live link (heard from within two heartbeats) is never replaced by a
 * newcomer claiming the same node, except by the other half of a
 * simultaneous dial: a Hello with another session, a second connection in
 * the same direction, or one opened long after the link came up is refused
 * with a Goodbye saying why, and logged (rate-limited, with its address).
 * A peer that really restarted closed its old connection (or it falls
 * silent), so its redial wins a moment later. With peer-address-check (the
 * default) an inbound Hello counts only from the address configured for
 * the node it names, and our dials leave from our peer-listen address when
 * that is one IP (several daemons on one host, each on its own IP).
 *
 * Heartbeats flow every heartbeat-ms; a peer silent for peer-timeout-ms, a
 * broken connection or a Goodbye takes it down: its transfers fail at once
 * with KVF_EPEERLOST and we redial with exponential backoff.
 *
 * Inbound connections that have not said Hello are bounded: in all
 * (max-pending-peers), per source address (max-pending-per-address) and in
 * time (peer-handshake-timeout-ms). Configured peers' addresses are served
 * first: a full table makes room for them by closing a stranger's oldest
 * (admit_pending).
 *
 * A connection that opens with DataHello is a tcp data stream: it leaves
 * the loop and goes to a receiver thread of the tcp transport.
 *
 * With a cluster key (cluster-key-file, auth.h), both kinds of connection
 * prove the key by challenge-response first; until then nothing of the
 * connection counts: no peer up, no pools or rkeys sent, no data stream
 * adopted. Without a key the protocol is as it always was. */
#include "peer.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "auth.h"
#include "failpoint.h"
#include "peer_int.h"
#include "frame.h"
#include "transport/tcp/tcp.h"
#include "xfer.h"

/* The reason in the Goodbye on a connection that lost the tie-break of a
 * simultaneous dial (see the header comment). */
#define SUPERSEDED "superseded by the other connection of a simultaneous dial"
/* The Goodbye on an on-demand link that carried no transfer for
 * peer-idle-close-ms: the other side goes idle too, instead of redialing. */
#define IDLE_CLOSE "idle (peer-idle-close-ms)"
#ifndef IP_BIND_ADDRESS_NO_PORT
#define IP_BIND_ADDRESS_NO_PORT 24 /* Linux 4.2 */
#endif
#define READ_CHUNK (256u << 10)
#define MAX_WRITE_QUEUE (256u << 20)
/* Before its Hello a connection is nobody's: it may send frames of at most
 * this much (the largest Hello, 64 pools and 8 RDMA devices, is ~20 KiB),
 * read in small chunks, so max-pending-peers of them hold little memory. */
#define PENDING_FRAME_MAX (64u << 10)
#define PENDING_READ 4096u

/* Where a connection stands with the cluster key (auth.h). */
enum auth_state {
  AUTH_OFF = 0, /* no key: the protocol as without authentication */
  AUTH_HELLO,   /* waiting for the peer's first Hello (or DataHello) */
  AUTH_PROOF,   /* acceptor: sent nonce and proof, waiting for the dialer's Auth */
  AUTH_FULL,    /* proofs checked: waiting for the peer's full Hello */
  AUTH_DATA,    /* data stream receiver: sent the challenge, waiting for Auth */
  AUTH_DONE,
  AUTH_REFUSED, /* refused: closing, deaf to the peer */
};

struct kvf__pconn {
  uv_tcp_t tcp;
  kvf__framebuf fb;
  kvf__peer *peer;
  bool outbound;
  bool established;
  bool closing;
  bool parked;            /* a data stream waiting for its peer to be up */
  bool pending;           /* inbound, not yet established: counts in P.n_pending */
  bool connected;         /* outbound: connected, our (first) Hello sent */
  bool retiring;          /* lost a tie-break: draining until the peer closes */
  uint16_t peers_here;    /* inbound: how many configured peers have its source address */
  bool src_known;
  uint8_t src[16];        /* inbound: the source IP (IPv4 mapped into IPv6) */
  uint64_t born_ns;
  uint64_t session;       /* the peer's incarnation, once established */
  struct kvf__pconn *pend_prev, *pend_next; /* P.pend_head list, oldest first */
  uint32_t stream;
  uv_timer_t hs_timer;
  uv_connect_t creq;
  struct kvf__pconn *next_listed; /* in P.parked (a data stream) or P.retiring (a control
                                     connection): never both */
  uint8_t auth;                        /* enum auth_state */
  uint8_t nonce[KVF__AUTH_NONCE];      /* ours, for this connection */
  uint8_t peer_nonce[KVF__AUTH_NONCE];
  uv_shutdown_t shut;                  /* a refusal notice is flushed, then closed */
};

static struct {
  uv_loop_t *loop;
  kvf__transport *tcp;
  kvf__transport *tps[8];
  size_t n_tps;
  uv_tcp_t listener;
  bool listening;
  int listen_port;
  kvf__peer *peers;
  size_t n;
  uv_timer_t hb;
  kvf__pconn *parked;
  kvf__pconn *retiring;   /* retired connections draining (retire) */
  size_t n_pending;       /* inbound connections not yet established (limits) */
  kvf__pconn *pend_head, *pend_tail; /* those connections, oldest first */
  kvf__ratelimit pending_rl;
  kvf__ratelimit evict_rl;
  kvf__ratelimit claim_rl; /* refused Hellos: wrong address, live link */
  struct sockaddr_storage dial_from; /* peer-listen's IP when it is one */
  bool bind_dials;
} P;

static void conn_close(kvf__pconn *c, const char *why);
static void control_socket_tune(kvf__pconn *c);
static void peer_down(kvf__peer *p, const char *why);
static void dial(kvf__peer *p);
static void schedule_reconnect(kvf__peer *p);
static void auth_abandoned(kvf__pconn *c, const char *why);
static bool make_room(const kvf__peer *skip, size_t limit);
static void conn_addr(kvf__pconn *c, char *buf, size_t len);
static const char *printable(const char *s, char *buf, size_t cap);

const char *kvf__peer_state_name(int state) {
  switch (state) {
  case KVF__PEER_UP: return "up";
  case KVF__PEER_CONNECTING: return "connecting";
  case KVF__PEER_IDLE: return "idle";
  default: return "down";
  }
}

kvf__peer *kvf__peer_find(const char *name) {
  for (size_t i = 0; i < P.n; i++)
    if (!P.peers[i].removed && strcmp(P.peers[i].cfg.name, name) == 0) return &P.peers[i];
  return NULL;
}

/* Peers a reload removed keep their slot (transfers may still point at
 * it) but are not listed. */
size_t kvf__peer_count(void) {
  size_t n = 0;
  for (size_t i = 0; i < P.n; i++) n += !P.peers[i].removed;
  return n;
}

kvf__peer *kvf__peer_at(size_t i) {
  for (size_t k = 0; k < P.n; k++)
    if (!P.peers[k].removed && i-- == 0) return &P.peers[k];
  return NULL;
}
int kvf__peers_listen_port(void) { return P.listen_port; }

/* -------------------------------------------------------------- writing */

typedef struct wreq {
  uv_write_t req;
  uint8_t data[];
} wreq;

static void on_written(uv_write_t *req, int status) { free(req->data); }

static int conn_send(kvf__pconn *c, const Kvf__PeerMsg *m) {
  if (c->closing) return KVF_EPEERLOST;
  if (uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > MAX_WRITE_QUEUE) {
    conn_close(c, "the peer stopped reading");
    return KVF_EPEERLOST;
  }
  size_t n = kvf__peer_msg__get_packed_size(m);
  if (n > kvfd.cfg.max_frame) return KVF_ELIMIT;
  wreq *w = malloc(sizeof(*w) + KVF__FRAME_HDR + n);
  if (!w) return -ENOMEM;
  kvf__frame_put_header(w->data, (uint32_t)n);
  kvf__peer_msg__pack(m, w->data + KVF__FRAME_HDR);
  w->req.data = w;
  uv_buf_t buf = uv_buf_init((char *)w->data, (unsigned)(KVF__FRAME_HDR + n));
  int rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, &buf, 1, on_written);
  if (rc) {
    free(w);
    conn_close(c, uv_strerror(rc));
    return KVF_EPEERLOST;
  }
  return 0;
}

int kvf__peer_send(kvf__peer *p, const Kvf__PeerMsg *m) {
  if (p->state != KVF__PEER_UP || !p->conn) return KVF_EPEERLOST;
  return conn_send(p->conn, m);
}

/* A Goodbye saying why on connection c (send_goodbye: to an up peer). */
static void conn_goodbye(kvf__pconn *c, const char *why) {
  Kvf__Goodbye g = KVF__GOODBYE__INIT;
  g.reason = (char *)why;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_GOODBYE;
  m.goodbye = &g;
  conn_send(c, &m);
}

static void send_goodbye(kvf__peer *p, const char *why) {
  if (p->state == KVF__PEER_UP && p->conn) conn_goodbye(p->conn, why);
}

static void send_hello(kvf__pconn *c) {
  Kvf__Hello h = KVF__HELLO__INIT;
  h.version = KVF__PEER_VERSION;
  h.node = kvfd.cfg.node;
  h.session = kvfd.session;
  h.data_streams = kvfd.cfg.tcp_streams;
  h.heartbeat_ms = kvfd.cfg.heartbeat_ms;
  char *names[8 + 2]; /* + 2: tcp's capability words (tcp_pattern.h, tcp_wire.h), added by its hello */
  for (size_t i = 0; i < P.n_tps; i++) names[i] = (char *)P.tps[i]->ops->name;
  h.transports = names;
  h.n_transports = P.n_tps;
  Kvf__PoolInfo infos[KVF__MAX_POOLS_CFG], *ptrs[KVF__MAX_POOLS_CFG];
  /* The config's pools: engine memory that comes later reaches a peer in
   * the grants that name it. */
  size_t n_pools = kvfd.cfg.n_pools < KVF__MAX_POOLS_CFG ? kvfd.cfg.n_pools : KVF__MAX_POOLS_CFG;
  for (size_t i = 0; i < n_pools; i++) {
    kvf__pool_info__init(&infos[i]);
    infos[i].id = (uint32_t)i;
    infos[i].name = (char *)kvfd.cfg.pools[i].name;
    infos[i].kind = (char *)kvfd.cfg.pools[i].kind;
    infos[i].size = kvfd.cfg.pools[i].size;
    ptrs[i] = &infos[i];
  }
  h.pools = ptrs;
  h.n_pools = n_pools;
  /* What each transport says of itself (rdma: where its devices listen
   * and the rkeys of our pools on each). */
  for (size_t i = 0; i < KVF__TRANSPORTS_MAX; i++)
    if (kvfd.transports[i]) kvfd.transports[i]->ops->hello(kvfd.transports[i], &h);
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_HELLO;
  m.hello = &h;
  conn_send(c, &m);
}

/* ------------------------------------------------------------ lifecycle */

static void on_conn_closed(uv_handle_t *h) {
  kvf__pconn *c = h->data;
  kvf__framebuf_free(&c->fb);
  free(c);
}

static void on_hs_timer_closed(uv_handle_t *h) {
  kvf__pconn *c = h->data;
  uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

static void unlist(kvf__pconn **head, kvf__pconn *c) {
  for (kvf__pconn **pp = head; *pp; pp = &(*pp)->next_listed)
    if (*pp == c) {
      *pp = c->next_listed;
      return;
    }
}

/* The connection no longer counts against max-pending-peers. */
static void unpend(kvf__pconn *c) {
  if (!c->pending) return;
  c->pending = false;
  P.n_pending--;
  if (c->pend_prev) c->pend_prev->pend_next = c->pend_next;
  else P.pend_head = c->pend_next;
  if (c->pend_next) c->pend_next->pend_prev = c->pend_prev;
  else P.pend_tail = c->pend_prev;
  c->pend_prev = c->pend_next = NULL;
}

static void conn_close(kvf__pconn *c, const char *why) {
  if (c->closing) return;
  if (c->auth == AUTH_PROOF || c->auth == AUTH_DATA) auth_abandoned(c, why);
  c->closing = true;
  unpend(c);
  if (c->parked) unlist(&P.parked, c);
  if (c->retiring) unlist(&P.retiring, c);
  kvf__peer *p = c->peer;
  bool was_dialing = p && p->dialing == c;
  if (was_dialing) p->dialing = NULL;
  if (p && p->conn == c) peer_down(p, why);
  else if (why && p) kvf__debug("peer %s: closed a connection: %s", p->cfg.name, why);
  /* A dial that ended before its Hello (refused, timed out, closed) must
   * be retried, or the peer would stay "connecting" for good. */
  if (was_dialing && p->state != KVF__PEER_UP) {
    p->state = KVF__PEER_DOWN;
    if (why && !p->last_error[0]) snprintf(p->last_error, sizeof(p->last_error), "%s", why);
    schedule_reconnect(p);
  }
  /* Its handle closes only after the timer's (on_hs_timer_closed): nothing
   * more may be read from it meanwhile, or a Hello already in the socket
   * (a dial whose patience ran out in this loop iteration) would bring the
   * link up on a connection about to be freed. */
  uv_read_stop((uv_stream_t *)&c->tcp);
  uv_timer_stop(&c->hs_timer);
  uv_close((uv_handle_t *)&c->hs_timer, on_hs_timer_closed);
}

static void on_reconnect(uv_timer_t *t) { dial(t->data); }

/* Registry members, and static peers with peer-connect on-demand, are
 * dialed on first need (kvf__peer_need) and closed when idle. */
static bool on_demand(const kvf__peer *p) {
  return p->registered || kvfd.cfg.peer_connect == KVF__CONNECT_ON_DEMAND;
}

static void schedule_reconnect(kvf__peer *p) {
  if (kvfd.stopping || p->removed) return;
  if (on_demand(p) && !p->queued) { /* nothing waits for it: the next need dials */
    p->state = KVF__PEER_IDLE;
    return;
  }
  uint32_t ms = p->backoff_ms ? p->backoff_ms : kvfd.cfg.reconnect_min_ms;
  p->backoff_ms = ms * 2 > kvfd.cfg.reconnect_max_ms ? kvfd.cfg.reconnect_max_ms : ms * 2;
  /* Sends wait for this peer (xfer_wait.c): probe at the shortest delay,
   * so that they go on soon after the network heals. */
  if (p->queued) ms = kvfd.cfg.reconnect_min_ms;
  uv_timer_start(&p->reconnect, on_reconnect, ms, 0);
}

static void transports_down(kvf__peer *p) {
  if (p->tp) p->tp->ops->peer_down(p->tp, p);
  if (p->tp && p->tp != P.tcp) P.tcp->ops->peer_down(P.tcp, p);
  p->tp = NULL;
  if (p->hello) kvf__hello__free_unpacked(p->hello, NULL);
  p->hello = NULL;
}

static void peer_down(kvf__peer *p, const char *why) {
  kvf__pconn *c = p->conn;
  p->conn = NULL;
  p->state = KVF__PEER_DOWN;
  p->downs++;
  snprintf(p->last_error, sizeof(p->last_error), "%s", why ? why : "");
  kvf__warn("peer %s down: %s", p->cfg.name, why ? why : "closed");
  /* The transport first: once its threads let go of the memory, the
   * transfers can fail and their owners reuse the blocks. */
  transports_down(p);
  kvf__xfer_on_peer_down(p);
  if (c) conn_close(c, NULL);
  schedule_reconnect(p);
}

void kvf__peer_fail(kvf__peer *p, const char *why) {
  if (p->state == KVF__PEER_UP) peer_down(p, why);
}

static void adopt_stream(kvf__pconn *c) {
  int fd = -1;
  uv_os_fd_t ufd;
  if (uv_fileno((uv_handle_t *)&c->tcp, &ufd) == 0) fd = fcntl(ufd, F_DUPFD_CLOEXEC, 0);
  if (fd >= 0) {
    int fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl & ~O_NONBLOCK); /* receiver threads block */
  }
  kvf__peer *p = c->peer;
  c->peer = NULL; /* it is not the peer's control connection */
  conn_close(c, NULL);
  if (fd < 0 || kvf__tcp_adopt_stream(P.tcp, p, fd, c->stream) != 0) {
    if (fd >= 0) close(fd);
    kvf__warn("peer %s: could not adopt data stream %u", p->cfg.name, c->stream);
  }
}

static void adopt_parked(kvf__peer *p) {
  kvf__pconn **pp = &P.parked;
  while (*pp) {
    kvf__pconn *c = *pp;
    if (c->peer == p) {
      *pp = c->next_listed;
      c->parked = false;
      adopt_stream(c);
    } else {
      pp = &c->next_listed;
    }
  }
}

static bool peer_offers(const kvf__peer *p, const char *name) {
  for (size_t i = 0; p->hello && i < p->hello->n_transports; i++)
    if (strcmp(p->hello->transports[i], name) == 0) return true;
  return false;
}

/* The first of our transports, in config order, that the peer offers too
 * and that can reach it. */
static kvf__transport *choose_transport(kvf__peer *p) {
  for (size_t i = 0; i < P.n_tps; i++) {
    kvf__transport *t = P.tps[i];
    if (peer_offers(p, t->ops->name) && t->ops->usable(t, p)) return t;
  }
  return NULL;
}

static void peer_up(kvf__peer *p, kvf__pconn *c) {
  p->last_used_ns = kvf__now_ns();
  p->conn = c;
  p->state = KVF__PEER_UP;
  p->ups++;
  p->backoff_ms = 0;
  p->up_since_ns = p->last_rx_ns = kvf__now_ns();
  p->last_error[0] = 0;
  uv_timer_stop(&p->reconnect);
  p->tp = choose_transport(p);
  if (!p->tp) {
    peer_down(p, "no transport in common with the peer");
    return;
  }
  int rc = p->tp->ops->peer_up(p->tp, p);
  /* Inbound tcp data streams may come whichever transport carries ours. */
  if (rc == 0 && p->tp != P.tcp) rc = P.tcp->ops->peer_up(P.tcp, p);
  kvf__info("peer %s up (%s connection, session %016llx, transport %s)", p->cfg.name,
            c->outbound ? "outbound" : "inbound", (unsigned long long)p->remote_session,
            p->tp->ops->name);
  if (rc) {
    peer_down(p, "the transport could not start");
    return;
  }
  adopt_parked(p);
  /* A link the peer opened counts under max-peers too (it is never refused:
   * the peer needs it). */
  if (on_demand(p)) make_room(p, (size_t)kvfd.cfg.max_peers + 1);
  kvf__xfer_on_peer_up(p); /* the sends that waited for it go on */
}

/* An on-demand link that carries nothing closes quietly: both sides go
 * idle (tell: the peer hears why), the next need redials. */
static void go_idle(kvf__peer *p, bool tell) {
  kvf__pconn *c = p->conn;
  if (tell) send_goodbye(p, IDLE_CLOSE);
  p->conn = NULL;
  p->state = KVF__PEER_IDLE;
  transports_down(p);
  kvf__xfer_on_peer_down(p); /* the waiting stay waiting; grants it had not taken wait again */
  if (c) conn_close(c, NULL);
  uv_timer_stop(&p->reconnect);
  kvf__debug("peer %s: idle link closed (%u pushed grants to push again)", p->cfg.name, p->regrants);
  if (p->regrants) { /* its close crossed our pushed grants: dial for them */
    p->regrants = 0;
    kvf__peer_need(p);
  }
}

/* Marks the peers that transfers are bound to as used now. */
static void mark_used(uint64_t now) {
  for (const kvf__xfer *x = kvf__xfer_first(); x; x = x->next)
    if (x->peer) x->peer->last_used_ns = now;
}

static bool idle_link(const kvf__peer *p, uint64_t now) {
  bool held = p->waiting > 0;
#ifdef KVF_FAILPOINTS
  if (kvf__failpoint(KVF__FP_IDLE_CLOSE_HELD)) held = false; /* as if its pushed grant were still on the way */
#endif
  return p->state == KVF__PEER_UP && on_demand(p) && !p->queued && !held && p->last_used_ns < now;
}

/* max-peers bounds live links: below limit (max-peers, or one more when
 * the link of skip, just up, counts) nothing happens; else the least
 * recently used idle one but skip makes room. False when none can. */
static bool make_room(const kvf__peer *skip, size_t limit) {
  size_t live = 0;
  uint64_t now = kvf__now_ns();
  kvf__peer *lru = NULL;
  mark_used(now);
  for (size_t i = 0; i < P.n; i++) {
    kvf__peer *p = &P.peers[i];
    live += p->state == KVF__PEER_UP || p->state == KVF__PEER_CONNECTING;
    if (p != skip && idle_link(p, now) && (!lru || p->last_used_ns < lru->last_used_ns)) lru = p;
  }
  if (live < limit) return true;
  if (lru) go_idle(lru, true);
  return lru != NULL;
}

void kvf__peer_need(kvf__peer *p) {
  p->last_used_ns = kvf__now_ns();
  if (p->state != KVF__PEER_IDLE || p->removed || kvfd.stopping || !make_room(p, kvfd.cfg.max_peers))
    return;
  p->backoff_ms = 0;
  dial(p); /* a refused or failed dial retries while sends wait (schedule_reconnect) */
}

/* Both sides dialed: keep the connection dialed by the smaller node name.
 * Two of the same direction mean the peer redialed: it no longer trusts the
 * old one, so the new one wins. */
static bool wins_over(const kvf__pconn *c, const kvf__pconn *other) {
  bool i_am_smaller = strcmp(kvfd.cfg.node, c->peer->cfg.name) < 0;
  if (c->outbound == other->outbound) return true;
  return c->outbound == i_am_smaller;
}

/* An owned copy of a Hello that outlives the frame it came in. */
static Kvf__Hello *hello_copy(const Kvf__Hello *h) {
  size_t n = kvf__hello__get_packed_size(h);
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) return NULL;
  kvf__hello__pack(h, buf);
  Kvf__Hello *copy = kvf__hello__unpack(NULL, n, buf);
  free(buf);
  return copy;
}

static void on_retire_flushed(uv_shutdown_t *req, int status) { (void)req, (void)status; }

static void on_handshake_timeout(uv_timer_t *t);

/* A connection that lost the tie-break: a Goodbye "superseded", then our
 * side shut for writing; we read on until the peer closes its side, so
 * nothing it sent on it before it learned is lost (its frames still reach
 * the transfers), for at most a handshake timeout. */
static void retire(kvf__pconn *c) {
  if (c->closing || c->retiring) return;
  c->retiring = true;
  c->next_listed = P.retiring;
  P.retiring = c;
  conn_goodbye(c, SUPERSEDED);
  c->shut.data = c;
  if (c->closing || uv_shutdown(&c->shut, (uv_stream_t *)&c->tcp, on_retire_flushed) != 0) {
    conn_close(c, NULL);
    return;
  }
  uv_timer_start(&c->hs_timer, on_handshake_timeout, kvfd.cfg.peer_handshake_timeout_ms, 0);
}

/* Heard from within two heartbeats (ours or the peer's, the longer): the
 * link is alive, whatever a newcomer claims. */
static bool link_alive(const kvf__peer *p) {
  uint64_t hb = kvfd.cfg.heartbeat_ms;
  if (p->hello && p->hello->heartbeat_ms > hb) hb = p->hello->heartbeat_ms;
  return kvf__now_ns() - p->last_rx_ns < 2 * hb * 1000000ull;
}

/* Why newcomer c (Hello h) may not take over p's live link; NULL when it
 * may (or there is none). It may when the old link went quiet (a peer that
 * restarted: its old connection closed or fell silent), and when c is the
 * other half of a simultaneous dial (same incarnation, other direction,
 * opened within a handshake timeout of the link coming up; wins_over then
 * decides which of the two stays). Anything else is refused, so one forged
 * Hello cannot reset a link that answers its heartbeats. */
static const char *newcomer_refused(const kvf__pconn *c, const Kvf__Hello *h) {
  const kvf__peer *p = c->peer;
  if (!p->conn || p->conn == c || !link_alive(p)) return NULL;
  if (p->remote_session != h->session)
    return "a live link with another incarnation of that node answers its heartbeats";
  if (c->outbound == p->conn->outbound ||
      c->born_ns > p->up_since_ns + (uint64_t)kvfd.cfg.peer_handshake_timeout_ms * 1000000ull)
    return "a live link with that node answers its heartbeats";
  return NULL;
}

/* Logs (at most once a second), says why to the other end, closes. */
static void refuse_claim(kvf__pconn *c, const char *node, const char *why) {
  char addr[80], name[72], text[256];
  uint64_t dropped;
  kvfd.stats.peer_errors++;
  if (kvf__log_ratelimit(&P.claim_rl, &dropped)) {
    conn_addr(c, addr, sizeof(addr));
    kvf__warn("refused a Hello from %s claiming to be peer %s: %s (%llu more such refusals "
              "since the last such line)", addr, printable(node, name, sizeof(name)), why,
              (unsigned long long)dropped);
  }
  snprintf(text, sizeof(text), "refused by node '%s': %s", kvfd.cfg.node, why);
  conn_goodbye(c, text);
  conn_close(c, NULL);
}

static void establish(kvf__pconn *c, const Kvf__Hello *h) {
  kvf__peer *p = c->peer;
  uint64_t session = h->session;
  c->established = true;
  c->session = session;
  c->fb.max = kvfd.cfg.max_frame;
  unpend(c);
  uv_timer_stop(&c->hs_timer);
  if (p->dialing == c) p->dialing = NULL;
  if (p->conn == c) { /* handed over to before its Hello (on_goodbye) */
    if (p->remote_session != session) peer_down(p, "the peer restarted");
    return;
  }
  if (p->conn && p->remote_session != session) peer_down(p, "the peer restarted");
  p->remote_session = session;
  if (!p->conn) {
    p->hello = hello_copy(h);
    if (!p->hello) {
      conn_close(c, "out of memory");
      return;
    }
    peer_up(p, c);
    return;
  }
  if (wins_over(c, p->conn)) {
    kvf__pconn *old = p->conn;
    p->conn = c; /* transfers keep flowing: only the route changes */
    retire(old);
  } else {
    retire(c);
  }
}

/* The peer retired p's connection c, which won on its side: our own dial
 * (the smaller name's) won there, and its Hello to us may still be on the
 * way. That dial becomes the route at once (the peer reads our frames on
 * it after our Hello), instead of taking the peer down; it must still
 * complete within the handshake timeout. False when there is no such dial. */
static bool hand_over(kvf__peer *p, kvf__pconn *c) {
  kvf__pconn *next = p->dialing;
  if (strcmp(kvfd.cfg.node, p->cfg.name) >= 0 || !next || next->closing || !next->connected ||
      (next->auth != AUTH_OFF && next->auth != AUTH_FULL))
    return false;
  p->dialing = NULL;
  p->conn = next;
  kvf__debug("peer %s: our dial takes over from the connection it superseded", p->cfg.name);
  retire(c);
  return true;
}

/* ---------------------------------------------------------- messages */

/* The IP of a socket address as 16 bytes, IPv4 mapped into IPv6, so that
 * an IPv4 peer seen through a dual-stack listener compares equal. */
static bool ip_key(const struct sockaddr_storage *ss, uint8_t out[16]) {
  if (ss->ss_family == AF_INET) {
    memset(out, 0, 10);
    out[10] = out[11] = 0xff;
    memcpy(out + 12, &((const struct sockaddr_in *)ss)->sin_addr, 4);
    return true;
  }
  if (ss->ss_family != AF_INET6) return false;
  memcpy(out, &((const struct sockaddr_in6 *)ss)->sin6_addr, 16);
  return true;
}

static bool peer_has_ip(const kvf__peer *p, const uint8_t ip[16]) {
  uint8_t k[16];
  return ip_key(&p->addr, k) && memcmp(k, ip, 16) == 0;
}

/* peer-address-check: an inbound Hello naming p must come from p's
 * configured (resolved) address. */
static bool from_peer_address(const kvf__pconn *c, const kvf__peer *p) {
  return !kvfd.cfg.peer_address_check || (c->src_known && peer_has_ip(p, c->src));
}

/* The configured peer a Hello comes from; NULL when refused (closed). */
static kvf__peer *hello_peer(kvf__pconn *c, const Kvf__Hello *h) {
  if (h->version != KVF__PEER_VERSION) {
    kvf__warn("refused peer %s: protocol version %u, we speak %u", h->node, h->version, KVF__PEER_VERSION);
    conn_close(c, "version mismatch");
    return NULL;
  }
  kvf__peer *p = kvf__peer_find(h->node);
  if (!p || (c->peer && c->peer != p)) {
    kvf__warn("refused a peer calling itself '%s': not in this daemon's configuration", h->node);
    /* and say why to the dialer, whose log would show only a closed
     * connection (best effort: it goes out before the close) */
    char why[KVF__NAME_MAX * 2 + 64];
    snprintf(why, sizeof(why), "node '%s' is not in the configuration of node '%s'", h->node, kvfd.cfg.node);
    conn_goodbye(c, why);
    conn_close(c, NULL);
    return NULL;
  }
  if (!c->outbound && !c->peer && !from_peer_address(c, p)) {
    refuse_claim(c, h->node, "the connection does not come from the address configured for that "
                             "peer (peer-address-check)");
    return NULL;
  }
  return p;
}

static void auth_keyless_refuses(kvf__pconn *c, const Kvf__Hello *h);

static void on_hello(kvf__pconn *c, const Kvf__Hello *h) {
  kvf__peer *p = hello_peer(c, h);
  if (!p) return;
  c->peer = p;
  if (h->nonce.len) { /* the peer has a cluster key, we have none */
    auth_keyless_refuses(c, h);
    return;
  }
  const char *why = newcomer_refused(c, h);
  if (why) {
    refuse_claim(c, h->node, why);
    return;
  }
  if (!c->outbound) send_hello(c);
  establish(c, h);
}

/* A data stream whose sender is known (and proved the key, when we have
 * one): to a receiver thread, now or once the peer is up. */
static void data_stream_ready(kvf__pconn *c) {
  kvf__peer *p = c->peer;
  uv_read_stop((uv_stream_t *)&c->tcp);
  /* The dialer learned our session from our Hello, which may reach it
   * before we have read its Hello: park until the peer is up. */
  if (p->state == KVF__PEER_UP) {
    adopt_stream(c);
    return;
  }
  c->parked = true;
  c->next_listed = P.parked;
  P.parked = c;
}

static void auth_challenge_data(kvf__pconn *c);

static void on_data_hello(kvf__pconn *c, const Kvf__DataHello *d) {
  kvf__peer *p = kvf__peer_find(d->node);
  if (!p || d->version != KVF__PEER_VERSION || d->session != kvfd.session) {
    conn_close(c, NULL);
    return;
  }
  c->peer = p;
  c->stream = d->stream;
  if (c->auth == AUTH_HELLO) auth_challenge_data(c);
  else data_stream_ready(c);
}

static void on_goodbye(kvf__pconn *c, const Kvf__Goodbye *g) {
  kvf__peer *p = c->peer;
  char why[320];
  snprintf(why, sizeof(why), "the peer said goodbye%s%s", g->reason && g->reason[0] ? ": " : "",
           g->reason ? g->reason : "");
  bool superseded = g->reason && strcmp(g->reason, SUPERSEDED) == 0;
  if (p && p->conn == c && g->reason && !strcmp(g->reason, IDLE_CLOSE) && on_demand(p)) {
    go_idle(p, false);
    return;
  }
  if (p && p->conn == c) {
    if (!superseded || !hand_over(p, c)) peer_down(p, why);
    return;
  }
  if (superseded) return; /* the peer retires it: we read on until it closes */
  /* a refusal before the link came up: the reason is all the dialer learns */
  if (p && g->reason && g->reason[0]) kvf__warn("peer %s: %s", p->cfg.name, why);
  conn_close(c, why);
}

/* ---------------------------------------------------------- cluster key
 *
 * The handshake of auth.h. Before both proofs are checked a connection
 * sends only version, node, nonce and proof: pools, transports and rkeys
 * go out in the full Hellos that follow. Every refusal is logged with the
 * peer's address and the node it claims, counted (auth_failures) and, on
 * our dials, retried with the usual backoff. */

/* "ADDR:PORT" of the other end. */
static void conn_addr(kvf__pconn *c, char *buf, size_t len) {
  struct sockaddr_storage ss;
  int n = sizeof(ss);
  char ip[INET6_ADDRSTRLEN] = "?";
  if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &n) != 0) {
    snprintf(buf, len, "(unknown address)");
  } else if (ss.ss_family == AF_INET6) {
    uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof(ip));
    snprintf(buf, len, "[%s]:%u", ip, ntohs(((struct sockaddr_in6 *)&ss)->sin6_port));
  } else {
    uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof(ip));
    snprintf(buf, len, "%s:%u", ip, ntohs(((struct sockaddr_in *)&ss)->sin_port));
  }
}

/* A name a stranger sent, made safe for one log line. */
static const char *printable(const char *s, char *buf, size_t cap) {
  size_t n = 0;
  for (; s && *s && n + 1 < cap; s++) buf[n++] = (*s >= 0x20 && *s < 0x7f) ? *s : '?';
  buf[n] = '\0';
  return n ? buf : "(no name)";
}

/* Logs and counts a refusal; the caller closes. */
static void auth_fail(kvf__pconn *c, const char *node, const char *why) {
  char addr[80], name[72];
  conn_addr(c, addr, sizeof(addr));
  c->auth = AUTH_REFUSED;
  kvfd.stats.auth_failures++;
  kvf__warn("refused peer %s at %s: %s", printable(node, name, sizeof(name)), addr, why);
  if (c->peer && c->peer->state != KVF__PEER_UP)
    snprintf(c->peer->last_error, sizeof(c->peer->last_error), "%s", why);
}

/* The connection ended while we waited for the peer's proof. */
static void auth_abandoned(kvf__pconn *c, const char *why) {
  char text[160];
  snprintf(text, sizeof(text), "the peer did not authenticate (%s; a cluster key mismatch, or it has none)",
           why ? why : "closed");
  auth_fail(c, c->peer ? c->peer->cfg.name : NULL, text);
}

static void auth_send(kvf__pconn *c, const uint8_t *proof, const uint8_t *nonce) {
  Kvf__Auth a = KVF__AUTH__INIT;
  if (proof) a.proof = (ProtobufCBinaryData){KVF__AUTH_PROOF, (uint8_t *)proof};
  if (nonce) a.nonce = (ProtobufCBinaryData){KVF__AUTH_NONCE, (uint8_t *)nonce};
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_AUTH;
  m.auth = &a;
  conn_send(c, &m);
}

/* The Hello before authentication: who we are and our nonce, nothing else. */
static void auth_send_hello(kvf__pconn *c, const uint8_t *nonce, const uint8_t *proof) {
  Kvf__Hello h = KVF__HELLO__INIT;
  h.version = KVF__PEER_VERSION;
  h.node = kvfd.cfg.node;
  if (nonce) h.nonce = (ProtobufCBinaryData){KVF__AUTH_NONCE, (uint8_t *)nonce};
  if (proof) h.proof = (ProtobufCBinaryData){KVF__AUTH_PROOF, (uint8_t *)proof};
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_HELLO;
  m.hello = &h;
  conn_send(c, &m);
}

static void on_notice_flushed(uv_shutdown_t *req, int status) {
  kvf__pconn *c = req->data;
  /* Cancelled: the handle is already being closed (by conn_close, or by
   * the final walk at exit, which must not see a second uv_close). */
  if (status != UV_ECANCELED) conn_close(c, NULL);
}

/* Refusing a dialer whose key setup differs from ours: our short Hello
 * (with a nonce when we have a key) tells it why, then we close once it is
 * written. */
static void auth_notice_and_close(kvf__pconn *c) {
  uv_read_stop((uv_stream_t *)&c->tcp);
  if (kvf__auth_enabled() && kvf__auth_nonce(c->nonce) == 0) auth_send_hello(c, c->nonce, NULL);
  else auth_send_hello(c, NULL, NULL);
  c->shut.data = c;
  if (c->closing || uv_shutdown(&c->shut, (uv_stream_t *)&c->tcp, on_notice_flushed) != 0)
    conn_close(c, NULL);
}

/* We have no key and the peer has one (its Hello carries a nonce). */
static void auth_keyless_refuses(kvf__pconn *c, const Kvf__Hello *h) {
  const char *why = "it uses a cluster key and this daemon has none (set cluster-key-file)";
  auth_fail(c, h->node, why);
  if (c->outbound) conn_close(c, why);
  else auth_notice_and_close(c);
}

static int hello_proof(kvf__pconn *c, enum kvf__auth_role role, uint8_t out[KVF__AUTH_PROOF]) {
  size_t klen;
  const uint8_t *key = kvf__auth_key(&klen);
  const char *peer = c->peer->cfg.name;
  if (c->outbound) return kvf__auth_hello_proof(key, klen, role, c->nonce, c->peer_nonce, peer, kvfd.cfg.node, out);
  return kvf__auth_hello_proof(key, klen, role, c->peer_nonce, c->nonce, kvfd.cfg.node, peer, out);
}

static bool proof_ok(kvf__pconn *c, enum kvf__auth_role role, const ProtobufCBinaryData *got) {
  uint8_t want[KVF__AUTH_PROOF];
  bool ok = hello_proof(c, role, want) == 0 && got->len == KVF__AUTH_PROOF &&
            kvf__auth_equal(want, got->data, KVF__AUTH_PROOF);
  explicit_bzero(want, sizeof(want));
  return ok;
}

/* Dialer: the acceptor's first Hello carries its nonce and its proof. */
static void auth_dialer_hello(kvf__pconn *c, const Kvf__Hello *h) {
  uint8_t proof[KVF__AUTH_PROOF];
  if (!hello_peer(c, h)) return;
  const char *why = !h->nonce.len ? "it has no cluster key and this daemon requires one"
                    : h->nonce.len != KVF__AUTH_NONCE ? "malformed authentication"
                                                      : NULL;
  if (!why) memcpy(c->peer_nonce, h->nonce.data, KVF__AUTH_NONCE);
  if (!why && !proof_ok(c, KVF__AUTH_ACCEPTOR, &h->proof)) why = "cluster key mismatch";
  if (why) {
    auth_fail(c, c->peer->cfg.name, why);
    conn_close(c, why);
    return;
  }
  hello_proof(c, KVF__AUTH_DIALER, proof);
  auth_send(c, proof, NULL);
  c->auth = AUTH_FULL;
  send_hello(c);
}

/* Acceptor: the dialer's first Hello; we answer with nonce and proof. */
static void auth_acceptor_hello(kvf__pconn *c, const Kvf__Hello *h) {
  uint8_t proof[KVF__AUTH_PROOF];
  kvf__peer *p = hello_peer(c, h);
  if (!p) return;
  c->peer = p;
  if (!h->nonce.len) {
    auth_fail(c, h->node, "it has no cluster key and this daemon requires one");
    auth_notice_and_close(c);
    return;
  }
  if (h->nonce.len != KVF__AUTH_NONCE || kvf__auth_nonce(c->nonce) != 0) {
    auth_fail(c, h->node, h->nonce.len != KVF__AUTH_NONCE ? "malformed authentication" : "no random bytes");
    conn_close(c, NULL);
    return;
  }
  memcpy(c->peer_nonce, h->nonce.data, KVF__AUTH_NONCE);
  hello_proof(c, KVF__AUTH_ACCEPTOR, proof);
  auth_send_hello(c, c->nonce, proof);
  c->auth = AUTH_PROOF;
}

/* Acceptor: the dialer's proof. */
static void auth_acceptor_check(kvf__pconn *c, const Kvf__Auth *a) {
  if (proof_ok(c, KVF__AUTH_DIALER, &a->proof)) {
    c->auth = AUTH_FULL;
    return;
  }
  auth_fail(c, c->peer->cfg.name, "cluster key mismatch");
  conn_close(c, NULL);
}

/* Both proofs are checked: the full Hello establishes as without a key. */
static void auth_full_hello(kvf__pconn *c, const Kvf__Hello *h) {
  if (!hello_peer(c, h)) return;
  const char *why = newcomer_refused(c, h);
  if (why) {
    refuse_claim(c, h->node, why);
    return;
  }
  c->auth = AUTH_DONE;
  if (!c->outbound) send_hello(c);
  establish(c, h);
}

/* Data stream receiver: a nonce the sender must prove the key over. */
static void auth_challenge_data(kvf__pconn *c) {
  if (kvf__auth_nonce(c->nonce) != 0) {
    conn_close(c, NULL);
    return;
  }
  auth_send(c, NULL, c->nonce);
  c->auth = AUTH_DATA;
}

static void auth_data_check(kvf__pconn *c, const Kvf__Auth *a) {
  uint8_t want[KVF__AUTH_PROOF];
  size_t klen;
  const uint8_t *key = kvf__auth_key(&klen);
  int rc = kvf__auth_data_proof(key, klen, c->nonce, kvfd.session, c->stream, kvfd.cfg.node, c->peer->cfg.name, want);
  bool ok = rc == 0 && a->proof.len == KVF__AUTH_PROOF && kvf__auth_equal(want, a->proof.data, KVF__AUTH_PROOF);
  explicit_bzero(want, sizeof(want));
  if (!ok) {
    auth_fail(c, c->peer->cfg.name, "cluster key mismatch on a data stream");
    conn_close(c, NULL);
    return;
  }
  c->auth = AUTH_DONE;
  data_stream_ready(c);
}

/* A frame before authentication completed. */
static void auth_frame(kvf__pconn *c, const Kvf__PeerMsg *m) {
  int body = m->body_case;
  if (c->auth == AUTH_REFUSED) return; /* closing after a notice */
  if (c->auth == AUTH_HELLO && body == KVF__PEER_MSG__BODY_HELLO && c->outbound) auth_dialer_hello(c, m->hello);
  else if (c->auth == AUTH_HELLO && body == KVF__PEER_MSG__BODY_HELLO) auth_acceptor_hello(c, m->hello);
  else if (c->auth == AUTH_HELLO && body == KVF__PEER_MSG__BODY_DATA_HELLO && !c->outbound)
    on_data_hello(c, m->data_hello);
  else if (c->auth == AUTH_PROOF && body == KVF__PEER_MSG__BODY_AUTH) auth_acceptor_check(c, m->auth);
  else if (c->auth == AUTH_FULL && body == KVF__PEER_MSG__BODY_HELLO) auth_full_hello(c, m->hello);
  else if (c->auth == AUTH_DATA && body == KVF__PEER_MSG__BODY_AUTH) auth_data_check(c, m->auth);
  else {
    kvfd.stats.peer_errors++;
    conn_close(c, "protocol error: unexpected message during authentication");
  }
}

/* One frame from a connection; returns false when the connection closed. */
static bool on_frame(kvf__pconn *c, const uint8_t *buf, uint32_t len) {
  Kvf__PeerMsg *m = kvf__peer_msg__unpack(NULL, len, buf);
  if (!m) {
    kvfd.stats.peer_errors++;
    kvf__warn("peer %s: undecodable frame of %u bytes; closing", c->peer ? c->peer->cfg.name : "(unknown)", len);
    conn_close(c, "protocol error");
    return false;
  }
  bool first = !c->peer, pre_auth = c->auth != AUTH_OFF && c->auth != AUTH_DONE;
  /* only the route counts: a retired or a refused connection does not
   * keep a link alive */
  if (c->peer && !pre_auth && c->peer->conn == c) c->peer->last_rx_ns = kvf__now_ns();
  /* With a key, nothing counts before the peer proved it. */
  if (pre_auth) auth_frame(c, m);
  else if (first && m->body_case == KVF__PEER_MSG__BODY_HELLO && !c->established) on_hello(c, m->hello);
  else if (first && m->body_case == KVF__PEER_MSG__BODY_DATA_HELLO && !c->outbound) on_data_hello(c, m->data_hello);
  /* a Goodbye may come instead of the Hello: the peer refused us, saying why */
  else if (!first && m->body_case == KVF__PEER_MSG__BODY_GOODBYE) on_goodbye(c, m->goodbye);
  else if (first || (!c->established && m->body_case != KVF__PEER_MSG__BODY_HELLO)) {
    kvfd.stats.peer_errors++;
    conn_close(c, "protocol error: no Hello first");
  } else if (m->body_case == KVF__PEER_MSG__BODY_HELLO && c->outbound && !c->established) {
    on_hello(c, m->hello);
  } else if (m->body_case != KVF__PEER_MSG__BODY_HEARTBEAT && c->peer->conn &&
             (c == c->peer->conn || c->session == c->peer->remote_session)) {
    kvf__xfer_on_peer_msg(c->peer, m); /* from the route, or a retiring one of the same incarnation */
  }
  kvf__peer_msg__free_unpacked(m, NULL);
  return !c->closing && !c->parked;
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  kvf__pconn *c = h->data;
  uint8_t *p;
  size_t avail;
  if (kvf__framebuf_space(&c->fb, c->established ? READ_CHUNK : PENDING_READ, &p, &avail) != 0) {
    *buf = uv_buf_init(NULL, 0);
    return;
  }
  *buf = uv_buf_init((char *)p, (unsigned)avail);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  kvf__pconn *c = s->data;
  if (c->closing) return;
  if (nread < 0) {
    conn_close(c, nread == UV_EOF ? "connection closed by the peer" : uv_strerror((int)nread));
    return;
  }
  kvf__framebuf_commit(&c->fb, (size_t)nread);
  for (;;) {
    const uint8_t *payload;
    uint32_t len;
    int rc = kvf__framebuf_next(&c->fb, &payload, &len);
    if (rc == 0) return;
    if (rc < 0) {
      kvfd.stats.peer_errors++;
      kvf__warn("peer %s: frame larger than %s (%u): %u bytes; closing",
                c->peer ? c->peer->cfg.name : "(unknown)",
                c->established ? "max-frame" : "a peer may send before its Hello", c->fb.max,
                kvf__frame_get_u32(c->fb.data + c->fb.off));
      conn_close(c, "oversized frame");
      return;
    }
#ifdef KVF_FAILPOINTS
    if (c->outbound && !c->established && !c->closing && kvf__failpoint(KVF__FP_CLOSE_DIAL_UNREAD)) {
      kvf__warn("failpoint close-dial-unread: closed the dial to %s, its first frame unread", c->peer->cfg.name);
      conn_close(c, "failpoint close-dial-unread");
    }
#endif
    if (c->closing || !on_frame(c, payload, len)) return; /* a closing connection's frames are dropped */
  }
}

static void on_handshake_timeout(uv_timer_t *t) {
  kvf__pconn *c = t->data;
  conn_close(c, "no Hello in time");
}

static kvf__pconn *conn_new(bool outbound) {
  kvf__pconn *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->outbound = outbound;
  c->auth = kvf__auth_enabled() ? AUTH_HELLO : AUTH_OFF;
  kvf__framebuf_init(&c->fb, kvfd.cfg.max_frame < PENDING_FRAME_MAX ? kvfd.cfg.max_frame : PENDING_FRAME_MAX);
  uv_tcp_init(P.loop, &c->tcp);
  c->tcp.data = c;
  uv_timer_init(P.loop, &c->hs_timer);
  c->hs_timer.data = c;
  c->born_ns = kvf__now_ns();
  uv_timer_start(&c->hs_timer, on_handshake_timeout, kvfd.cfg.peer_handshake_timeout_ms, 0);
  return c;
}

/* A dial to a port on this host where nothing listens yet can connect to
 * itself (TCP simultaneous open, when the kernel picks that very port as
 * the source): as good as refused, not a stranger's Hello to refuse. */
static bool self_connected(kvf__pconn *c) {
  struct sockaddr_storage a, b;
  int na = sizeof(a), nb = sizeof(b);
  if (uv_tcp_getsockname(&c->tcp, (struct sockaddr *)&a, &na) != 0 ||
      uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&b, &nb) != 0)
    return false;
  return na == nb && memcmp(&a, &b, (size_t)na) == 0;
}

static void on_connected(uv_connect_t *req, int status) {
  kvf__pconn *c = req->data;
  if (c->closing) return;
  if (status < 0) {
    kvf__peer *p = c->peer;
    snprintf(p->last_error, sizeof(p->last_error), "connect: %s", uv_strerror(status));
    kvf__debug("peer %s: connect failed: %s", p->cfg.name, uv_strerror(status));
    conn_close(c, NULL);
    return;
  }
  if (self_connected(c)) { /* the peer's port is in our ephemeral range and free */
    snprintf(c->peer->last_error, sizeof(c->peer->last_error), "connect: nothing listens there");
    conn_close(c, NULL);
    return;
  }
  control_socket_tune(c);
  uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
  c->connected = true;
  if (c->auth == AUTH_OFF) send_hello(c);
  else if (kvf__auth_nonce(c->nonce) == 0) auth_send_hello(c, c->nonce, NULL);
  else conn_close(c, "no random bytes for a nonce");
}

/* Our dials leave from our peer-listen address when that is one IP, so that
 * the peer's peer-address-check sees the address it has for us (several
 * daemons on one host, each on its own IP, would otherwise all dial from
 * the one the route picks). The port is still picked at connect time, per
 * destination (IP_BIND_ADDRESS_NO_PORT): a bind to port 0 would hold one
 * for good, and could take a port a daemon of this host is about to listen
 * on. */
static int dial_from_listen_ip(kvf__pconn *c, const kvf__peer *p) {
  int family = P.dial_from.ss_family, one = 1;
  if (!P.bind_dials || family != p->addr.ss_family) return 0;
  int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -errno;
  (void)setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
  socklen_t len = family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
  int rc = bind(fd, (struct sockaddr *)&P.dial_from, len) == 0 ? 0 : -errno;
  if (rc == 0) rc = uv_tcp_open(&c->tcp, fd);
  if (rc) close(fd);
  return rc;
}

static void dial(kvf__peer *p) {
  if (p->state == KVF__PEER_UP || p->dialing || kvfd.stopping || p->removed) return;
  kvf__pconn *c = conn_new(true);
  if (!c) {
    schedule_reconnect(p);
    return;
  }
  c->peer = p;
  p->dialing = c;
  p->dial_ns = kvf__now_ns();
  p->state = KVF__PEER_CONNECTING;
  c->creq.data = c;
  int brc = dial_from_listen_ip(c, p);
  if (brc) kvf__debug("peer %s: cannot dial from the peer-listen address: %s", p->cfg.name, uv_strerror(brc));
  int rc = uv_tcp_connect(&c->creq, &c->tcp, (struct sockaddr *)&p->addr, on_connected);
  if (rc) conn_close(c, uv_strerror(rc));
}

/* Connections that have not said who they are yet are bounded by
 * max-pending-peers, and by max-pending-per-address from one source (each
 * also by peer-handshake-timeout-ms), so strangers cannot exhaust
 * descriptors or memory. Configured peers are served first: a connection
 * from a peer's address that finds the table full closes the oldest one
 * from an address no peer has, and a newer connection from an address at
 * its bound closes the oldest one from there (a real peer completes its
 * handshake in a round trip; a flood must outrun that to keep it out). */
static void evict(kvf__pconn *old, const char *limit) {
  uint64_t dropped;
  char addr[80];
  kvfd.stats.peer_errors++;
  if (kvf__log_ratelimit(&P.evict_rl, &dropped)) {
    conn_addr(old, addr, sizeof(addr));
    kvf__warn("closed a peer connection from %s that had not said Hello yet, to make room (%s; "
              "%llu more since the last such line)", addr, limit, (unsigned long long)dropped);
  }
  conn_close(old, NULL);
}

static bool same_src(const kvf__pconn *a, const kvf__pconn *b) {
  return a->src_known && b->src_known && memcmp(a->src, b->src, 16) == 0;
}

static void refuse_pending(kvf__pconn *c) {
  uint64_t dropped;
  char addr[80];
  kvfd.stats.peer_errors++;
  if (kvf__log_ratelimit(&P.pending_rl, &dropped)) {
    conn_addr(c, addr, sizeof(addr));
    kvf__warn("refused a peer connection from %s: max-pending-peers (%u) connections have not "
              "said Hello yet (%llu more refused since the last such line)",
              addr, kvfd.cfg.max_pending_peers, (unsigned long long)dropped);
  }
  conn_close(c, NULL);
}

static bool admit_pending(kvf__pconn *c) {
  kvf__pconn *oldest_same = NULL, *oldest_stranger = NULL;
  uint32_t same = 0;
  for (kvf__pconn *o = P.pend_head; o; o = o->pend_next) {
    if (same_src(o, c) && same++ == 0) oldest_same = o;
    if (!o->peers_here && !oldest_stranger) oldest_stranger = o;
  }
  /* each configured peer at that address may have its control connection
   * and its data streams (as many as ours, tcp-streams) pending at once */
  uint64_t bound = kvfd.cfg.max_pending_per_address + (uint64_t)c->peers_here * (1 + kvfd.cfg.tcp_streams);
  if (c->src_known && same >= bound) {
    if (oldest_stranger == oldest_same) oldest_stranger = NULL;
    evict(oldest_same, "max-pending-per-address");
    if (!oldest_stranger) /* the next one from another address */
      for (kvf__pconn *o = P.pend_head; o && !oldest_stranger; o = o->pend_next)
        if (!o->peers_here) oldest_stranger = o;
  }
  if (P.n_pending >= kvfd.cfg.max_pending_peers) {
    if (!c->peers_here || !oldest_stranger) {
      refuse_pending(c);
      return false;
    }
    evict(oldest_stranger, "max-pending-peers, for a configured peer's address");
  }
  c->pending = true;
  P.n_pending++;
  c->pend_prev = P.pend_tail;
  if (P.pend_tail) P.pend_tail->pend_next = c;
  else P.pend_head = c;
  P.pend_tail = c;
  return true;
}

/* Where an accepted connection comes from, and whether a peer is there. */
static void note_source(kvf__pconn *c) {
  struct sockaddr_storage ss;
  int n = sizeof(ss);
  c->src_known = uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &n) == 0 && ip_key(&ss, c->src);
  for (size_t i = 0; c->src_known && i < P.n; i++)
    c->peers_here += !P.peers[i].removed && peer_has_ip(&P.peers[i], c->src);
}

/* A control connection carries heartbeats: a thin stream. After a loss
 * burst TCP's exponential retransmission backoff can hold its next segment
 * back for seconds once the network is fine again, longer than
 * peer-timeout-ms, and the peer would be declared dead after the fault.
 * Linear timeouts for thin streams keep retries at the plain RTO. */
static void control_socket_tune(kvf__pconn *c) {
  uv_os_fd_t fd;
  int one = 1;
  uv_tcp_nodelay(&c->tcp, 1);
  if (uv_fileno((uv_handle_t *)&c->tcp, &fd) == 0)
    (void)setsockopt(fd, IPPROTO_TCP, TCP_THIN_LINEAR_TIMEOUTS, &one, sizeof(one));
}

static void on_accept(uv_stream_t *server, int status) {
  if (status < 0) return;
  kvf__pconn *c = conn_new(false);
  if (!c) return;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
    conn_close(c, NULL);
    return;
  }
  note_source(c);
  if (!admit_pending(c)) return;
  control_socket_tune(c);
  uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* A peer that is not up. A dial that has not established within
 * peer-timeout-ms (its SYN or Hello lost to a lossy network: TCP would
 * retry only after a second or more, the handshake timer after 5 s) is
 * given up and made again; within half that while sends wait for the peer
 * (xfer_wait.c), whose redial also comes at reconnect-min-ms whatever
 * backoff the outage grew: the link is back within about one peer-timeout
 * of the network healing. */
static void probe(kvf__peer *p, uint64_t now) {
  if (p->removed || p->state == KVF__PEER_UP || kvfd.stopping) return;
  if (p->state == KVF__PEER_IDLE) { /* waits for room under max-peers */
    if (p->queued) kvf__peer_need(p);
    return;
  }
  uint32_t patience = p->queued ? kvfd.cfg.peer_timeout_ms / 2 : kvfd.cfg.peer_timeout_ms;
  if (p->dialing) {
    if ((now - p->dial_ns) / 1000000ull > patience)
      conn_close(p->dialing, "no answer to our dial in time; dialing again");
    return;
  }
  if (p->queued && uv_is_active((uv_handle_t *)&p->reconnect) &&
      uv_timer_get_due_in(&p->reconnect) > kvfd.cfg.reconnect_min_ms)
    uv_timer_start(&p->reconnect, on_reconnect, kvfd.cfg.reconnect_min_ms, 0);
}

static void on_heartbeat(uv_timer_t *t) {
  uint64_t now = kvf__now_ns();
  Kvf__Heartbeat hb = KVF__HEARTBEAT__INIT;
  hb.time_ns = now;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_HEARTBEAT;
  m.heartbeat = &hb;
  uint64_t idle_ns = (uint64_t)kvfd.cfg.peer_idle_close_ms * 1000000ull;
  mark_used(now);
  for (size_t i = 0; i < P.n; i++) {
    kvf__peer *p = &P.peers[i];
    probe(p, now);
    if (p->state != KVF__PEER_UP) continue;
    if (idle_ns && idle_link(p, now) && now - p->last_used_ns > idle_ns) {
      go_idle(p, true);
      continue;
    }
    uint64_t silent_ms = (now - p->last_rx_ns) / 1000000ull;
    if (silent_ms > kvfd.cfg.peer_timeout_ms) {
      char why[96];
      snprintf(why, sizeof(why), "no word from the peer for %llu ms", (unsigned long long)silent_ms);
      peer_down(p, why);
      continue;
    }
    kvf__peer_send(p, &m);
  }
}

/* ------------------------------------------------------------ start/stop */

static int resolve(const char *host, uint16_t port, struct sockaddr_storage *ss, socklen_t *len) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
  char portstr[8];
  snprintf(portstr, sizeof(portstr), "%u", port);
  int rc = getaddrinfo(host, portstr, &hints, &res);
  if (rc) return -EHOSTUNREACH;
  memcpy(ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return 0;
}

static int start_listener(char *err, size_t errlen) {
  if (kvfd.cfg.listen_host[0] == 0) return 0;
  struct sockaddr_storage ss;
  socklen_t len;
  if (resolve(kvfd.cfg.listen_host, kvfd.cfg.listen_port, &ss, &len) != 0) {
    snprintf(err, errlen, "peer-listen: cannot resolve %s", kvfd.cfg.listen_host);
    return -EINVAL;
  }
  uv_tcp_init(P.loop, &P.listener);
  P.listening = true;
  int rc = uv_tcp_bind(&P.listener, (struct sockaddr *)&ss, 0);
  /* the kernel's queue must hold a flood's worth of connects: what overflows it is
   * dropped before admit_pending can prefer a configured peer (a dropped SYN costs
   * the peer a 1 s retransmit); the kernel caps this at net.core.somaxconn */
  if (rc == 0) rc = uv_listen((uv_stream_t *)&P.listener, SOMAXCONN, on_accept);
  if (rc) {
    snprintf(err, errlen, "peer-listen %s:%u: %s", kvfd.cfg.listen_host, kvfd.cfg.listen_port, uv_strerror(rc));
    return rc;
  }
  struct sockaddr_storage bound;
  int blen = sizeof(bound);
  uv_tcp_getsockname(&P.listener, (struct sockaddr *)&bound, &blen);
  uint8_t ip[16];
  static const uint8_t any4[16] = {[10] = 0xff, [11] = 0xff}, any6[16] = {0};
  P.bind_dials = ip_key(&bound, ip) && memcmp(ip, any4, 16) != 0 && memcmp(ip, any6, 16) != 0;
  if (P.bind_dials) {
    P.dial_from = bound;
    if (bound.ss_family == AF_INET6) ((struct sockaddr_in6 *)&P.dial_from)->sin6_port = 0;
    else ((struct sockaddr_in *)&P.dial_from)->sin_port = 0;
  }
  P.listen_port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                    : ((struct sockaddr_in *)&bound)->sin_port);
  return 0;
}

int kvf__peers_start(uv_loop_t *loop, kvf__transport **transports, size_t n, kvf__transport *tcp,
                     char *err, size_t errlen) {
  P.loop = loop;
  P.tcp = tcp;
  P.n_tps = n < 8 ? n : 8;
  memcpy(P.tps, transports, P.n_tps * sizeof(*transports));
  P.n = kvfd.cfg.n_peers;
  /* Room for every peer a reload may add: kvf__peer pointers stay valid. */
  P.peers = calloc(KVF__MAX_PEERS_CFG, sizeof(kvf__peer));
  if (!P.peers) return -ENOMEM;
  for (size_t i = 0; i < P.n; i++) {
    kvf__peer *p = &P.peers[i];
    p->cfg = kvfd.cfg.peers[i];
    if (resolve(p->cfg.host, p->cfg.port, &p->addr, &p->addrlen) != 0) {
      snprintf(err, errlen, "peer %s: cannot resolve %s", p->cfg.name, p->cfg.host);
      return -EINVAL;
    }
    uv_timer_init(loop, &p->reconnect);
    p->reconnect.data = p;
  }
  int rc = start_listener(err, errlen);
  if (rc) return rc;
  /* Pool setup may have taken seconds since the loop last read the clock;
   * handshake timers started now must not fire at the first iteration. */
  uv_update_time(loop);
  uv_timer_init(loop, &P.hb);
  uv_timer_start(&P.hb, on_heartbeat, kvfd.cfg.heartbeat_ms, kvfd.cfg.heartbeat_ms);
  for (size_t i = 0; i < P.n; i++) kvf__peer_start_link(&P.peers[i]);
  return 0;
}

void kvf__peers_stop(void) {
  for (size_t i = 0; i < P.n; i++) {
    kvf__peer *p = &P.peers[i];
    if (p->state == KVF__PEER_UP) {
      send_goodbye(p, "shutting down");
      kvf__pconn *c = p->conn;
      p->conn = NULL;
      p->state = KVF__PEER_DOWN;
      transports_down(p);
      kvf__xfer_on_peer_down(p);
      conn_close(c, NULL);
    }
    if (p->dialing) conn_close(p->dialing, NULL);
    uv_timer_stop(&p->reconnect);
    uv_close((uv_handle_t *)&p->reconnect, NULL);
  }
  while (P.parked) conn_close(P.parked, NULL);
  while (P.retiring) conn_close(P.retiring, NULL);
  while (P.pend_head) conn_close(P.pend_head, NULL); /* not worth waiting for */
  uv_timer_stop(&P.hb);
  uv_close((uv_handle_t *)&P.hb, NULL);
  if (P.listening) uv_close((uv_handle_t *)&P.listener, NULL);
}

/* ------------------------------------------------------------ reload */


/* Ends every connection of p (its transfers fail) and stops redialing. */
static void drop_peer(kvf__peer *p, const char *why) {
  bool was_removed = p->removed;
  p->removed = true; /* no reconnect is scheduled while we tear down */
  if (p->state == KVF__PEER_UP) {
    send_goodbye(p, why);
    peer_down(p, why);
  }
  if (p->dialing) conn_close(p->dialing, NULL);
  for (kvf__pconn *c = P.parked, *next; c; c = next) {
    next = c->next_listed;
    if (c->peer == p) conn_close(c, NULL);
  }
  uv_timer_stop(&p->reconnect);
  p->state = KVF__PEER_DOWN;
  p->removed = was_removed;
}

/* The slot of name, removed ones included; else a fresh one, or NULL. */
static kvf__peer *slot_for(const char *name) {
  for (size_t i = 0; i < P.n; i++)
    if (strcmp(P.peers[i].cfg.name, name) == 0) return &P.peers[i];
  for (size_t i = 0; i < P.n; i++) /* recycle a removed peer's slot */
    if (P.peers[i].removed && P.peers[i].state == KVF__PEER_DOWN && !P.peers[i].dialing)
      return &P.peers[i];
  if (P.n == KVF__MAX_PEERS_CFG) return NULL;
  kvf__peer *p = &P.peers[P.n++];
  memset(p, 0, sizeof *p);
  p->removed = true; /* until configured below */
  uv_timer_init(P.loop, &p->reconnect);
  p->reconnect.data = p;
  return p;
}

/* ---- for peer_members.c (peer_int.h) ---- */

kvf__peer *kvf__peer_slot_for(const char *name) { return slot_for(name); }
void kvf__peer_drop(kvf__peer *p, const char *why) { drop_peer(p, why); }
void kvf__peer_take_down(kvf__peer *p, const char *why) { peer_down(p, why); }
bool kvf__peer_on_demand(const kvf__peer *p) { return on_demand(p); }
size_t kvf__peer_slots(void) { return P.n; }
kvf__peer *kvf__peer_slot(size_t i) { return &P.peers[i]; }
int kvf__peer_resolve(const char *host, uint16_t port, struct sockaddr_storage *ss, socklen_t *len) {
  return resolve(host, port, ss, len);
}

/* Dials p, or leaves it idle until a need when it is on demand. */
void kvf__peer_start_link(kvf__peer *p) {
  if (on_demand(p)) p->state = KVF__PEER_IDLE;
  else dial(p);
}

void kvf__peers_heartbeat_restart(void) {
  uv_timer_start(&P.hb, on_heartbeat, kvfd.cfg.heartbeat_ms, kvfd.cfg.heartbeat_ms);
}
