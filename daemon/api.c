/* api.c - the local API: engines connect to a Unix stream socket, prove who
 * they are by SO_PEERCRED, and speak length-prefixed ApiRequest frames. Each
 * request gets exactly one ApiResponse; events are pushed in between. A
 * pool's fd rides with its MapResp (SCM_RIGHTS through uv_write2, so it
 * stays in order with every other frame). A client that sends garbage is
 * dropped; nothing it sends can take the daemon down. */
#include "api.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <malloc.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "desc.h"
#include "frame.h"
#include "inspect.h"
#include "layouts.h"
#include "metrics.h"
#include "pool.h"
#include "pool_engine.h"
#include "xfer.h"
#include "xfer_fan.h"

#define READ_CHUNK (256u << 10)
/* A refused client is answered once (its hello) and closed; until then it
 * holds no client slot, only this much of the daemon's memory, and at most
 * MAX_REFUSED such connections wait at once (more are closed unanswered). */
#define REFUSED_FRAME_MAX 4096u
#define REFUSED_READ 4096u
#define MAX_REFUSED 64u

/* Fair turns (DESIGN.md, "Control plane"): one client is served at most
 * TURN_REQUESTS requests or TURN_NS of work at a time; then the loop goes
 * round (peers' heartbeats, timers, the other clients) before its next
 * turn. A client whose unread replies pass OUT_MARK is served nothing more
 * until it has read them: its requests wait in its socket, not as replies
 * in our memory. */
#define TURN_REQUESTS 64u
#define TURN_NS 1000000ull
#define OUT_MARK (256u << 10)
/* Freed output past this since the last trim goes back to the system when
 * a client goes (kvf__keep_freed_memory keeps freed memory otherwise). */
#define TRIM_AFTER (8u << 20)

/* A client call that arrives as several SendReq frames (SendReq.chained). */
typedef struct send_chain {
  bool active;            /* frames of a call are coming; the last answers */
  bool created;           /* the call's first frame began the transfer */
  bool posted;            /* some frame of the call was taken */
  int rc;                 /* the first refusal, which the call returns */
  char err[256];
  char id[KVF_XFER_ID_MAX + 1];
} send_chain;

struct kvf__session {
  uv_pipe_t pipe;
  uv_timer_t hello_timer; /* closes a client that does not say Hello */
  int handles_open;       /* pipe and timer: freed once both closed */
  bool operator;          /* root or our user: may take an operator slot */
  kvf__framebuf fb;
  uint32_t id;
  pid_t pid;
  uid_t uid;
  gid_t gid;
  int refused;            /* status every request gets, then we close */
  bool hello_done;
  bool closing;
  bool reading;           /* uv_read_start is on */
  bool ready;             /* on A.ready: frames wait for its next turn */
  bool out_wait;          /* unread output above OUT_MARK: served once it is read */
  size_t out_bytes;       /* replies and events written, not yet taken by the socket */
  kvf__session *ready_next;
  uint32_t n_xfers;
  send_chain chain;
  char name[64];
  bool no_soon;           /* HelloReq.no_soon: no Soon for this client */
  kvf__api_sink *sink;    /* detached session (tests, fuzzing): no socket */
  void *sink_arg;
  kvf__session *prev, *next;
};

/* The views InspectReq.what names (InspectWhat, LAYOUTS last). */
#define INSPECT_VIEWS ((size_t)KVF__INSPECT_WHAT__INSPECT_TRACE + 1)

/* An inspect view as last rendered. */
typedef struct render {
  uint64_t gen;           /* A.gen when rendered */
  uint64_t at, cost;      /* when it was rendered, and what that took (ns) */
  char *text;
} render;

static struct {
  uv_loop_t *loop;
  uv_pipe_t server;
  bool listening;
  kvf__session *head;
  size_t n;
  size_t n_refused;       /* of n: refused, waiting for their hello */
  uint32_t next_id;
  kvf__ratelimit refused_rl;
  bool handles;           /* turns is initialised */
  uv_idle_t turns;        /* active while sessions wait for a turn */
  kvf__session *ready_head, *ready_tail;
  size_t out_bytes;       /* over the open sessions: unread replies and events */
  size_t out_freed;       /* output buffers freed since the last malloc_trim */
  uint64_t gen;           /* changes with each request and event: cached inspects go stale */
  render cache[INSPECT_VIEWS][2]; /* inspect renders by what and json */
} A;

size_t kvf__api_sessions(void) { return A.n; }
size_t kvf__api_output_bytes(void) { return A.out_bytes; }
uint32_t kvf__api_session_id(const kvf__session *s) { return s->id; }
pid_t kvf__api_session_pid(const kvf__session *s) { return s->pid; }

void kvf__api_session_xfers(kvf__session *s, int delta) { s->n_xfers += (uint32_t)delta; }

/* --------------------------------------------------------------- writing */

typedef struct wreq {
  uv_write_t req;
  kvf__session *s;
  size_t len;
  uv_pipe_t *fdpipe;   /* carries a pool fd; closed once written */
  uint8_t data[];
} wreq;

static void session_close(kvf__session *s, const char *why);
static void ready_push(kvf__session *s);

static void on_fdpipe_closed(uv_handle_t *h) { free(h); }

static size_t unwritten(kvf__session *s) { return uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe); }

/* Also for the writes a close cancels (libuv calls them back before the
 * pipe's close callback, so s is still there). */
static void on_written(uv_write_t *req, int status) {
  wreq *w = req->data;
  kvf__session *s = w->s;
  s->out_bytes -= w->len;
  if (!s->closing) A.out_bytes -= w->len; /* a closed session's bytes left the total at its close */
  A.out_freed += w->len;
  if (w->fdpipe) uv_close((uv_handle_t *)w->fdpipe, on_fdpipe_closed);
  free(w);
  if (s->out_wait && !s->closing && unwritten(s) <= OUT_MARK) {
    s->out_wait = false;
    ready_push(s);
  }
}

/* Wraps a dup of fd in a pipe handle, which is what uv_write2 can pass. */
static uv_pipe_t *fd_handle(int fd) {
  uv_pipe_t *p = malloc(sizeof(*p));
  int dfd = dup(fd);
  if (!p || dfd < 0 || uv_pipe_init(A.loop, p, 0) != 0) {
    free(p);
    if (dfd >= 0) close(dfd);
    return NULL;
  }
  if (uv_pipe_open(p, dfd) != 0) {
    close(dfd);
    uv_close((uv_handle_t *)p, on_fdpipe_closed);
    return NULL;
  }
  return p;
}

/* A detached session's frames go to its sink, whole, in order. */
static int sink_write(kvf__session *s, const Kvf__ApiMessage *m, int fd) {
  size_t n = kvf__api_message__get_packed_size(m);
  uint8_t *buf = malloc(KVF__FRAME_HDR + n);
  if (!buf) return -ENOMEM;
  kvf__frame_put_header(buf, (uint32_t)n);
  kvf__api_message__pack(m, buf + KVF__FRAME_HDR);
  s->sink(s, buf, KVF__FRAME_HDR + n, fd, s->sink_arg);
  free(buf);
  return 0;
}

/* Replies and events a client has not read yet stay in the daemon's
 * memory: past 4 x max-frame the client is taken for one that stopped
 * reading, and dropped (its transfers fail; nobody else waits on it). */
static bool backlog_full(kvf__session *s) {
  size_t queued = uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe);
  if (queued <= 4 * (size_t)kvfd.cfg.max_frame) return false;
  kvf__warn("client %u (%s, pid %d, uid %u): %zu bytes of replies and events unread "
            "(more than 4 x max-frame); disconnected",
            s->id, s->name, (int)s->pid, (unsigned)s->uid, queued);
  session_close(s, NULL);
  return true;
}

/* api-output-budget: what all clients leave unread, together. At least
 * two max-frame replies always fit, so one large reply is never refused. */
static size_t output_budget(void) {
  uint64_t b = kvfd.cfg.api_output_budget, two = 2ull * kvfd.cfg.max_frame;
  return (size_t)(b > two ? b : two);
}

/* The open session that holds the most unread output (NULL: none holds any). */
static kvf__session *biggest_holder(void) {
  kvf__session *big = NULL;
  for (kvf__session *t = A.head; t; t = t->next)
    if (!t->closing && t->out_bytes && (!big || t->out_bytes > big->out_bytes)) big = t;
  return big;
}

/* Makes room for n more bytes within api-output-budget by dropping the
 * clients that hold the most; true when that was s itself. */
static bool over_budget(kvf__session *s, size_t n) {
  size_t budget = output_budget();
  while (A.out_bytes + n > budget) {
    kvf__session *big = biggest_holder();
    if (!big) return false; /* nobody holds anything: one reply always goes */
    kvfd.stats.api_output_drops++;
    kvf__warn("client %u (%s, pid %d, uid %u): dropped, it holds the most unread replies and events "
              "(%zu bytes) and all clients' unread output (%zu bytes, %zu more to write) is past "
              "api-output-budget (%zu)", big->id, big->name, (int)big->pid, (unsigned)big->uid,
              big->out_bytes, A.out_bytes, n, budget);
    session_close(big, NULL);
    if (big == s) return true;
  }
  return false;
}

static int session_write(kvf__session *s, const Kvf__ApiMessage *m, int fd) {
  if (s->closing) return KVF_EDAEMON;
  if (s->sink) return sink_write(s, m, fd);
  if (backlog_full(s)) return KVF_ELIMIT;
  size_t n = kvf__api_message__get_packed_size(m);
  if (over_budget(s, KVF__FRAME_HDR + n)) return KVF_ELIMIT;
  wreq *w = malloc(sizeof(*w) + KVF__FRAME_HDR + n);
  if (!w) return -ENOMEM;
  w->fdpipe = NULL;
  w->s = s;
  w->len = KVF__FRAME_HDR + n;
  kvf__frame_put_header(w->data, (uint32_t)n);
  kvf__api_message__pack(m, w->data + KVF__FRAME_HDR);
  w->req.data = w;
  uv_buf_t buf = uv_buf_init((char *)w->data, (unsigned)(KVF__FRAME_HDR + n));
  int rc;
  if (fd >= 0) {
    w->fdpipe = fd_handle(fd);
    rc = w->fdpipe ? uv_write2(&w->req, (uv_stream_t *)&s->pipe, &buf, 1, (uv_stream_t *)w->fdpipe, on_written)
                   : UV_ENOMEM;
  } else {
    rc = uv_write(&w->req, (uv_stream_t *)&s->pipe, &buf, 1, on_written);
  }
  if (rc) {
    if (w->fdpipe) uv_close((uv_handle_t *)w->fdpipe, on_fdpipe_closed);
    free(w);
    session_close(s, uv_strerror(rc));
    return KVF_EDAEMON;
  }
  s->out_bytes += w->len; /* until on_written, also when libuv wrote it at once */
  A.out_bytes += w->len;
  return 0;
}

static void reply_fd(kvf__session *s, Kvf__ApiResponse *r, int fd) {
  Kvf__ApiMessage m = KVF__API_MESSAGE__INIT;
  m.body_case = KVF__API_MESSAGE__BODY_RESPONSE;
  m.response = r;
  session_write(s, &m, fd);
}

static void reply_status(kvf__session *s, uint64_t seq, int status, const char *error) {
  Kvf__ApiResponse r = KVF__API_RESPONSE__INIT;
  r.seq = seq;
  r.status = status;
  r.error = (char *)(error ? error : "");
  if (status) {
    kvfd.stats.api_errors++;
    kvf__metrics_api_error(status);
  }
  reply_fd(s, &r, -1);
}

void kvf__api_emit(kvf__session *s, const Kvf__Event *ev) {
  A.gen++; /* something changed: an inspect after this event must show it */
  Kvf__ApiMessage m = KVF__API_MESSAGE__INIT;
  m.body_case = KVF__API_MESSAGE__BODY_EVENT;
  m.event = (Kvf__Event *)ev;
  session_write(s, &m, -1);
}

bool kvf__api_wants_soon(const kvf__session *s) { return s && !s->no_soon; }

void kvf__api_soon(kvf__session *s, const char *xfer_id, uint32_t within_us) {
  if (!kvf__api_wants_soon(s)) return;
  Kvf__Soon soon = KVF__SOON__INIT;
  soon.xfer_id = (char *)xfer_id;
  soon.within_us = within_us;
  Kvf__ApiMessage m = KVF__API_MESSAGE__INIT;
  m.body_case = KVF__API_MESSAGE__BODY_SOON;
  m.soon = &soon;
  kvfd.stats.api_soon++;
  session_write(s, &m, -1);
}

bool kvf__api_soon_estimated(kvf__session *s, const char *xfer_id, double est_us) {
  if (est_us > KVF__SOON_MAX_US) return false;
  kvf__api_soon(s, xfer_id, (uint32_t)est_us);
  return true;
}

/* ------------------------------------------------------------- requests */

static bool uid_allowed(uid_t uid, gid_t gid) {
  const kvf__config *c = &kvfd.cfg;
  if (uid == 0 || uid == geteuid()) return true;
  for (size_t i = 0; i < c->n_allow_uids; i++)
    if (c->allow_uids[i] == uid) return true;
  if (c->n_allow_gids == 0) return false;
  gid_t groups[256];
  int ng = 256;
  struct passwd *pw = getpwuid(uid);
  if (!pw || getgrouplist(pw->pw_name, gid, groups, &ng) < 0) {
    groups[0] = gid;
    ng = 1;
  }
  for (int g = 0; g < ng; g++)
    for (size_t i = 0; i < c->n_allow_gids; i++)
      if (c->allow_gids[i] == groups[g]) return true;
  return false;
}

/* A refused client's first request, whatever it is, gets the refusal. */
static void refuse(kvf__session *s, uint64_t seq) {
  char err[160];
  if (s->refused == KVF_EPERM)
    snprintf(err, sizeof(err), "uid %u may not use kvferryd (api-allow-users, api-allow-groups)",
             (unsigned)s->uid);
  else
    snprintf(err, sizeof(err), "max-clients (%u) clients are connected; try again later",
             kvfd.cfg.max_clients);
  reply_status(s, seq, s->refused, err);
  session_close(s, NULL);
}

static void on_hello(kvf__session *s, uint64_t seq, const Kvf__HelloReq *h) {
  if (h->version < 1 || h->version > KVF__API_VERSION) { /* 2 only added Event.transform */
    reply_status(s, seq, KVF_EVERSION, "the daemon speaks API versions 1-2");
    session_close(s, NULL);
    return;
  }
  snprintf(s->name, sizeof(s->name), "%s", h->client_name ? h->client_name : "");
  s->no_soon = h->no_soon;
  s->hello_done = true;
  if (!s->sink) uv_timer_stop(&s->hello_timer);
  Kvf__HelloResp hr = KVF__HELLO_RESP__INIT;
  hr.version = h->version;
  hr.node = kvfd.cfg.node;
  hr.max_frame = kvfd.cfg.max_frame;
  hr.max_descs = kvfd.cfg.max_descs;
  hr.send_chains = true;
  Kvf__ApiResponse r = KVF__API_RESPONSE__INIT;
  r.seq = seq;
  r.body_case = KVF__API_RESPONSE__BODY_HELLO;
  r.hello = &hr;
  reply_fd(s, &r, -1);
  kvf__debug("client %u (%s, pid %d, uid %u) connected", s->id, s->name, (int)s->pid, (unsigned)s->uid);
}

static void pool_info(const kvf__pool *p, Kvf__PoolInfo *pi) {
  kvf__pool_info__init(pi);
  pi->id = p->id;
  pi->name = (char *)p->name;
  pi->kind = (char *)p->kind;
  pi->size = p->size;
  pi->backing = (char *)p->backing;
  pi->engine = p->engine != NULL;
  pi->nic_reg = (char *)p->nic_reg;
}

/* The daemon's pools and this client's own engine memory. */
static void on_pools(kvf__session *s, uint64_t seq) {
  Kvf__PoolInfo *infos = calloc(kvfd.n_pools ? kvfd.n_pools : 1, sizeof(*infos));
  Kvf__PoolInfo **ptrs = calloc(kvfd.n_pools ? kvfd.n_pools : 1, sizeof(*ptrs));
  if (!infos || !ptrs) {
    free(infos);
    free(ptrs);
    reply_status(s, seq, -ENOMEM, "out of memory");
    return;
  }
  Kvf__PoolsResp pr = KVF__POOLS_RESP__INIT;
  for (uint32_t i = 0; i < kvfd.n_pools; i++) {
    const kvf__pool *p = kvf__pool_get(i);
    if (!kvf__pool_usable_by(p, s)) continue;
    pool_info(p, &infos[pr.n_pools]);
    ptrs[pr.n_pools] = &infos[pr.n_pools];
    pr.n_pools++;
  }
  pr.pools = ptrs;
  Kvf__ApiResponse r = KVF__API_RESPONSE__INIT;
  r.seq = seq;
  r.body_case = KVF__API_RESPONSE__BODY_POOLS;
  r.pools = &pr;
  reply_fd(s, &r, -1);
  free(infos);
  free(ptrs);
}

static void on_map(kvf__session *s, uint64_t seq, const Kvf__MapReq *mr) {
  const kvf__pool *p = kvf__pool_get(mr->pool);
  if (!kvf__pool_usable_by(p, s)) {
    reply_status(s, seq, KVF_ENOPOOL, "no such pool");
    return;
  }
  if (p->engine) {
    reply_status(s, seq, KVF_EINVAL, "engine memory is this client's own: it has it mapped already");
    return;
  }
  Kvf__PoolInfo pi;
  pool_info(p, &pi);
  Kvf__MapResp mresp = KVF__MAP_RESP__INIT;
  mresp.pool = &pi;
  Kvf__ApiResponse r = KVF__API_RESPONSE__INIT;
  r.seq = seq;
  r.body_case = KVF__API_RESPONSE__BODY_MAP;
  r.map = &mresp;
  reply_fd(s, &r, p->fd);
}

/* ctx: the session, which may name daemon pools and its own engine memory. */
static int check_range(void *ctx, uint32_t pool, uint64_t off, uint64_t len) {
  const kvf__pool *p = kvf__pool_get(pool);
  if (!kvf__pool_usable_by(p, ctx)) return KVF_ENOPOOL;
  return kvf__pool_check_range(p, off, len);
}

/* Copies and checks a request's descriptors against the pools s may name. */
static int take_descs(kvf__session *s, const Kvf__DescList *w, kvf__descs *d, char *err, size_t errlen) {
  int rc = kvf__descs_from_wire(d, w, kvfd.cfg.max_descs);
  if (rc == KVF_ELIMIT) snprintf(err, errlen, "more than max-descs (%u) descriptors", kvfd.cfg.max_descs);
  else if (rc == KVF_EPROTO)
    snprintf(err, errlen, "malformed descriptor list (not whole %u-byte records)", KVF__DESC_WIRE_SIZE);
  else if (rc) snprintf(err, errlen, "malformed descriptor list (empty, zero length or total overflow)");
  if (rc) return rc;
  size_t bad = 0;
  rc = kvf__descs_check(d, check_range, s, &bad);
  if (rc) {
    snprintf(err, errlen, "descriptor %zu (pool %u, offset %llu, length %llu): %s", bad, d->pool[bad],
             (unsigned long long)d->offset[bad], (unsigned long long)d->length[bad],
             rc == KVF_ENOPOOL ? "no such pool" : "outside the pool");
    kvf__descs_free(d);
  }
  return rc;
}

static int check_quota(kvf__session *s, char *err, size_t errlen) {
  if (s->n_xfers < kvfd.cfg.max_transfers_per_client) return 0;
  snprintf(err, errlen, "this client has max-transfers-per-client (%u) transfers active",
           kvfd.cfg.max_transfers_per_client);
  return KVF_ELIMIT;
}

/* After SIGTERM the transfers in flight may finish, but none may start. */
static int check_draining(char *err, size_t errlen) {
  if (!kvfd.draining) return 0;
  snprintf(err, errlen, "kvferryd is stopping; no new transfers");
  return -ESHUTDOWN;
}

/* A request's block list: its layout (one of this client's) and its ids
 * (*ids malloc'ed, the caller frees what the transfer did not take). */
static int take_blocks(kvf__session *s, const Kvf__BlockList *w, kvf__blockreq *b, uint32_t **ids, char *err,
                       size_t errlen) {
  memset(b, 0, sizeof(*b));
  *ids = NULL;
  b->layout = kvf__layouts_get(s, w->layout);
  if (!b->layout) {
    snprintf(err, errlen, "no layout %u registered by this client", w->layout);
    return KVF_ENOENT;
  }
  int rc = kvf__ids_from_wire(w->ids, kvfd.cfg.max_descs, ids, &b->n);
  if (rc == KVF_ELIMIT) snprintf(err, errlen, "more than max-descs (%u) block ids", kvfd.cfg.max_descs);
  else if (rc) snprintf(err, errlen, "malformed block id list (not whole 4-byte ids)");
  b->ids = ids;
  b->first = w->first_layer;
  b->n_layers = w->n_layers;
  return rc;
}

static int grant_blocks(kvf__session *s, const Kvf__GrantReq *g, char *err, size_t errlen) {
  kvf__blockreq b;
  uint32_t *ids;
  int rc = take_blocks(s, g->blocks, &b, &ids, err, errlen);
  b.layer_events = g->layer_events;
  if (rc == 0 && b.n == 0) {
    snprintf(err, errlen, "a grant of blocks names at least one block");
    rc = KVF_EINVAL;
  }
  if (rc == 0) rc = kvf__xfan_grant_blocks(s, g->xfer_id, g->src_node, &b, g->deadline_ms, err, errlen);
  free(ids);
  return rc;
}

static int grant_descs(kvf__session *s, const Kvf__GrantReq *g, char *err, size_t errlen) {
  kvf__descs d;
  if (g->layer_events) {
    snprintf(err, errlen, "layer events need a grant of blocks");
    return KVF_EINVAL;
  }
  int rc = take_descs(s, g->descs, &d, err, errlen);
  if (rc) return rc;
  rc = kvf__xfer_grant(s, g->xfer_id, g->src_node, &d, g->deadline_ms, err, errlen);
  kvf__descs_free(&d);
  return rc;
}

/* A request sent without waiting for its answer (KVF_NOWAIT) that the
 * daemon refused began no transfer: its refusal becomes that transfer's one
 * DONE event, with what the response would have said. */
static void refusal_event(kvf__session *s, Kvf__EventType type, const char *id, const char *peer, int rc,
                          const char *err) {
  if (rc == 0) return;
  kvfd.stats.api_errors++;
  kvf__metrics_api_error(rc);
  Kvf__Event ev = KVF__EVENT__INIT;
  ev.type = type;
  ev.xfer_id = (char *)(id ? id : "");
  ev.status = rc;
  ev.path = (char *)"none";
  ev.peer = (char *)(peer ? peer : "");
  ev.error = (char *)(err && err[0] ? err : kvf_strerror(rc));
  kvf__api_emit(s, &ev);
}

static void on_grant(kvf__session *s, uint64_t seq, const Kvf__GrantReq *g) {
  char err[256] = "";
  int rc = check_draining(err, sizeof(err));
  if (rc == 0) rc = check_quota(s, err, sizeof(err));
  if (rc == 0 && g->blocks && g->descs) {
    snprintf(err, sizeof(err), "a grant names descriptors or blocks, not both");
    rc = KVF_EINVAL;
  }
  if (rc == 0) rc = g->blocks ? grant_blocks(s, g, err, sizeof(err)) : grant_descs(s, g, err, sizeof(err));
  if (g->no_reply) refusal_event(s, KVF__EVENT_TYPE__EVENT_RECV_DONE, g->xfer_id, g->src_node, rc, err);
  else reply_status(s, seq, rc, err);
}

/* A part that continues a send that has ended is refused, never the start
 * of a new transfer under the same id (kvferry.h, "Transfer ids"). */
static int check_continues(kvf__session *s, const Kvf__SendReq *q, char *err, size_t errlen) {
  if (!q->continues || kvf__xfan_sending(s, q->xfer_id)) return 0;
  snprintf(err, errlen, "the send this part continues has ended (its SEND_DONE says how); "
                        "the id names a new transfer once that event is taken");
  return KVF_ENOENT;
}

/* One SendReq frame: 0 when the transfer took its descriptors. */
static int send_part(kvf__session *s, const Kvf__SendReq *q, char *err, size_t errlen) {
  kvf__descs d;
  int rc = check_continues(s, q, err, errlen);
  if (rc) return rc;
  if (!kvf__xfan_sending(s, q->xfer_id)) {
    rc = check_draining(err, errlen);
    if (rc == 0) rc = check_quota(s, err, errlen);
  }
  if (rc == 0 && q->blocks && q->descs) {
    snprintf(err, errlen, "a send names descriptors or blocks, not both");
    rc = KVF_EINVAL;
  }
  if (rc == 0 && q->blocks) {
    kvf__blockreq b;
    uint32_t *ids;
    rc = take_blocks(s, q->blocks, &b, &ids, err, errlen);
    if (rc == 0) rc = kvf__xfan_send_blocks(s, q->xfer_id, q->dst_node, &b, q->more, q->deadline_ms, err, errlen);
    free(ids);
    return rc;
  }
  if (rc == 0) rc = take_descs(s, q->descs, &d, err, errlen);
  if (rc == 0) {
    rc = kvf__xfer_send(s, q->xfer_id, q->dst_node, &d, q->more, q->deadline_ms, err, errlen);
    kvf__descs_free(&d);
  }
  return rc;
}

/* A refused frame fails the whole call. What earlier frames of it posted
 * cannot stay: a transfer the call began goes without an event (the call
 * returns the error instead), one it continued fails with its event. */
static void chain_fail(kvf__session *s, int rc, const char *err) {
  send_chain *ch = &s->chain;
  if (ch->rc) return;
  ch->rc = rc;
  snprintf(ch->err, sizeof(ch->err), "%s", err);
  if (ch->posted) kvf__xfer_withdraw_send(s, ch->id, rc, err, ch->created);
}

/* A part sent with KVF_SEND_NOWAIT: no answer; a refusal fails the send it
 * continues, whose event says why (none left: its event already went). */
static void send_no_reply(kvf__session *s, const Kvf__SendReq *q) {
  char err[256] = "";
  int rc = !q->chained ? send_part(s, q, err, sizeof(err)) : KVF_EPROTO;
  if (rc == 0) return;
  if (rc == KVF_EPROTO && !err[0]) snprintf(err, sizeof(err), "a part without an answer cannot be chained");
  /* A refused first part began nothing: its refusal is its SEND_DONE. */
  if (!q->continues) refusal_event(s, KVF__EVENT_TYPE__EVENT_SEND_DONE, q->xfer_id, q->dst_node, rc, err);
  else kvf__xfan_withdraw_send(s, q->xfer_id, rc, err);
}

static void on_send(kvf__session *s, uint64_t seq, const Kvf__SendReq *q) {
  char err[256] = "";
  if (q->no_reply) {
    send_no_reply(s, q);
    return;
  }
  send_chain *ch = &s->chain;
  if (!ch->active && q->chained) {
    *ch = (send_chain){.active = true, .created = !kvf__xfan_sending(s, q->xfer_id)};
    snprintf(ch->id, sizeof(ch->id), "%s", q->xfer_id ? q->xfer_id : "");
  } else if (ch->active && strcmp(q->xfer_id ? q->xfer_id : "", ch->id) != 0) {
    chain_fail(s, KVF_EPROTO, "a chained send changed its transfer id");
  }
  int rc = ch->active ? ch->rc : 0;
  if (rc == 0) {
    rc = send_part(s, q, err, sizeof(err));
    if (rc && ch->active) chain_fail(s, rc, err);
    else if (ch->active) ch->posted = true;
  }
  if (q->chained) return; /* the call's last frame answers for all of it */
  if (ch->active) {
    rc = ch->rc;
    snprintf(err, sizeof(err), "%s", ch->err);
    *ch = (send_chain){0};
  }
  reply_status(s, seq, rc, err);
}

static void on_layout(kvf__session *s, uint64_t seq, const Kvf__LayoutReq *q) {
  char err[256] = "";
  kvf__layout l;
  uint32_t id = 0;
  int rc = kvf__layout_from_wire(q->layout, &l, err, sizeof(err));
  if (rc == 0) rc = kvf__layouts_add(s, &l, &id, err, sizeof(err));
  kvf__layout_clear(&l); /* what the registry did not take */
  if (rc) {
    reply_status(s, seq, rc, err);
    return;
  }
  Kvf__LayoutResp lr = KVF__LAYOUT_RESP__INIT;
  lr.id = id;
  Kvf__ApiResponse r = KVF__API_RESPONSE__INIT;
  r.seq = seq;
  r.body_case = KVF__API_RESPONSE__BODY_LAYOUT;
  r.layout = &lr;
  reply_fd(s, &r, -1);
}

static void on_layout_free(kvf__session *s, uint64_t seq, const Kvf__LayoutFreeReq *q) {
  int rc = kvf__layouts_free(s, q->id);
  reply_status(s, seq, rc, rc ? "this client has no such layout" : "");
}

/* ---------------------------------------------------------- engine memory */

/* The fd that rode with the current frame (SCM_RIGHTS; libuv queues what
 * an ipc pipe receives), or -1. The caller owns it. */
static int take_passed_fd(kvf__session *s) {
  if (s->sink || uv_pipe_pending_count(&s->pipe) == 0) return -1;
  /* uv_accept opens any kind of fd as a pipe handle; we keep a dup of it
   * and let libuv close the original with the handle (closed on a later
   * turn of the loop, hence on the heap). */
  uv_pipe_t *tmp = malloc(sizeof(*tmp));
  if (!tmp) return -1;
  uv_os_fd_t fd = -1;
  int dup_fd = -1;
  uv_pipe_init(A.loop, tmp, 0);
  if (uv_accept((uv_stream_t *)&s->pipe, (uv_stream_t *)tmp) == 0 && uv_fileno((uv_handle_t *)tmp, &fd) == 0)
    dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  uv_close((uv_handle_t *)tmp, on_fdpipe_closed);
  return dup_fd;
}

/* fds no frame asked for are closed, not kept: a client cannot make the
 * daemon hold its files. */
static void drop_stray_fds(kvf__session *s) {
  int fd;
  while ((fd = take_passed_fd(s)) >= 0) {
    close(fd);
    kvf__debug("client %u (pid %d): closed an fd that no request asked for", s->id, (int)s->pid);
  }
}

static void on_mem_register(kvf__session *s, uint64_t seq, const Kvf__MemRegisterReq *q) {
  char err[256] = "";
  int fd = q->has_fd ? take_passed_fd(s) : -1;
  int rc = 0;
  if (q->has_fd && fd < 0) {
    snprintf(err, sizeof(err), "the request says an fd rides with it, and none came");
    rc = KVF_EINVAL;
  }
  kvf__pool *p = NULL;
  kvf__mem_timing t = {0};
  if (rc == 0) rc = kvf__pool_engine_add(s, q, fd, &p, &t, err, sizeof(err));
  else if (fd >= 0) close(fd);
  if (rc) {
    reply_status(s, seq, rc, err);
    return;
  }
  Kvf__PoolInfo pi;
  pool_info(p, &pi);
  Kvf__MemRegisterResp mr = KVF__MEM_REGISTER_RESP__INIT;
  mr.pool = &pi;
  mr.import_ns = t.import_ns;
  mr.nic_ns = t.nic_ns;
  Kvf__ApiResponse r = KVF__API_RESPONSE__INIT;
  r.seq = seq;
  r.body_case = KVF__API_RESPONSE__BODY_MEM_REGISTER;
  r.mem_register = &mr;
  reply_fd(s, &r, -1);
}

/* The client's layouts on the pool go with it (they could not be used). */
static void on_mem_unregister(kvf__session *s, uint64_t seq, const Kvf__MemUnregisterReq *q) {
  char err[256] = "";
  int rc = kvf__pool_engine_removable(s, q->pool, err, sizeof(err));
  if (rc == 0) {
    kvf__layouts_pool_gone(s, q->pool);
    rc = kvf__pool_engine_remove(s, q->pool, err, sizeof(err));
  }
  reply_status(s, seq, rc, err);
}

/* Renders are O(transfers), and clients may poll them back to back (six
 * pipelining a thousand each took the loop for seconds). A render that took
 * T is reused for the next 10 T (so rendering takes at most a tenth of the
 * loop; a render of a few entries is fresh for microseconds), and never
 * after a request or event of any client: a client always sees what it did
 * and what it was told. What changes by itself (ages, a transfer's
 * progress, a peer's state) shows at most 10 T late. */
#define RENDER_REUSE 10u

static const char *inspect_text(int what, int json) {
  if (what < 0 || (size_t)what >= INSPECT_VIEWS) what = KVF__INSPECT_WHAT__INSPECT_STATUS;
  json = json != 0;
  render *c = &A.cache[what][json];
  uint64_t now = kvf__now_ns();
  if (c->text && c->gen == A.gen && now - c->at < RENDER_REUSE * c->cost) return c->text;
  free(c->text);
  c->text = kvf__inspect_render(what, json);
  c->gen = A.gen;
  c->at = kvf__now_ns();
  c->cost = c->at - now;
  return c->text;
}

static void inspect_cache_free(void) {
  for (size_t w = 0; w < INSPECT_VIEWS; w++)
    for (int j = 0; j < 2; j++) {
      free(A.cache[w][j].text);
      A.cache[w][j].text = NULL;
    }
}

static void on_inspect(kvf__session *s, uint64_t seq, const Kvf__InspectReq *q) {
  const char *text = inspect_text(q->what, q->json);
  if (!text) {
    reply_status(s, seq, -ENOMEM, "out of memory");
    return;
  }
  Kvf__InspectResp ir = KVF__INSPECT_RESP__INIT;
  ir.text = (char *)text;
  Kvf__ApiResponse r = KVF__API_RESPONSE__INIT;
  r.seq = seq;
  r.body_case = KVF__API_RESPONSE__BODY_INSPECT;
  r.inspect = &ir;
  reply_fd(s, &r, -1);
}

static void on_request(kvf__session *s, const Kvf__ApiRequest *q) {
  if (s->refused) {
    refuse(s, q->seq);
    return;
  }
  if (q->body_case == KVF__API_REQUEST__BODY_HELLO) {
    if (s->hello_done) reply_status(s, q->seq, KVF_EPROTO, "hello twice");
    else on_hello(s, q->seq, q->hello);
    return;
  }
  if (!s->hello_done) {
    reply_status(s, q->seq, KVF_EPROTO, "the first request must be hello");
    session_close(s, "no hello");
    return;
  }
  if (q->body_case != KVF__API_REQUEST__BODY_INSPECT) A.gen++;
  switch (q->body_case) {
  case KVF__API_REQUEST__BODY_POOLS: on_pools(s, q->seq); break;
  case KVF__API_REQUEST__BODY_MAP: on_map(s, q->seq, q->map); break;
  case KVF__API_REQUEST__BODY_GRANT: on_grant(s, q->seq, q->grant); break;
  case KVF__API_REQUEST__BODY_SEND: on_send(s, q->seq, q->send); break;
  case KVF__API_REQUEST__BODY_CANCEL: {
    int rc = kvf__xfan_cancel(s, q->cancel->xfer_id);
    if (!q->cancel->no_reply) reply_status(s, q->seq, rc, ""); /* else: ended already, its event says how */
    break;
  }
  case KVF__API_REQUEST__BODY_INSPECT: on_inspect(s, q->seq, q->inspect); break;
  case KVF__API_REQUEST__BODY_LAYOUT: on_layout(s, q->seq, q->layout); break;
  case KVF__API_REQUEST__BODY_LAYOUT_FREE: on_layout_free(s, q->seq, q->layout_free); break;
  case KVF__API_REQUEST__BODY_MEM_REGISTER: on_mem_register(s, q->seq, q->mem_register); break;
  case KVF__API_REQUEST__BODY_MEM_UNREGISTER: on_mem_unregister(s, q->seq, q->mem_unregister); break;
  default: reply_status(s, q->seq, KVF_EPROTO, "unknown request"); break;
  }
}

/* ------------------------------------------------------------- sessions */

/* Its cancelled writes were freed before this (libuv calls them back
 * first): a client that left much unread gives that memory back here. */
static void on_session_closed(uv_handle_t *h) {
  kvf__session *s = h->data;
  if (--s->handles_open > 0) return;
  kvf__framebuf_free(&s->fb);
  free(s);
  if (A.out_freed >= TRIM_AFTER) {
    A.out_freed = 0;
    malloc_trim(0);
  }
}

static void ready_remove(kvf__session *s) {
  kvf__session **pp = &A.ready_head, *prev = NULL;
  while (*pp && *pp != s) {
    prev = *pp;
    pp = &(*pp)->ready_next;
  }
  if (!*pp) return;
  *pp = s->ready_next;
  if (A.ready_tail == s) A.ready_tail = prev;
  s->ready = false;
  s->ready_next = NULL;
}

static void session_close(kvf__session *s, const char *why) {
  if (s->closing) return;
  s->closing = true;
  A.gen++;
  A.out_bytes -= s->out_bytes;
  if (s->ready) ready_remove(s);
  if (why) kvf__info("client %u (%s, pid %d): %s", s->id, s->name, (int)s->pid, why);
  kvf__xfer_session_gone(s);
  kvf__xfan_session_gone(s);
  kvf__layouts_session_gone(s);
  kvf__pool_engine_session_gone(s);
  if (s->prev) s->prev->next = s->next;
  else A.head = s->next;
  if (s->next) s->next->prev = s->prev;
  A.n--;
  if (s->refused) A.n_refused--;
  if (s->sink) return;
  uv_close((uv_handle_t *)&s->pipe, on_session_closed);
  if (s->handles_open == 2) uv_close((uv_handle_t *)&s->hello_timer, on_session_closed);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf);
static void on_turns(uv_idle_t *h);

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  kvf__session *s = h->data;
  uint8_t *p;
  size_t avail;
  if (kvf__framebuf_space(&s->fb, s->refused ? REFUSED_READ : READ_CHUNK, &p, &avail) != 0) {
    *buf = uv_buf_init(NULL, 0);
    return;
  }
  *buf = uv_buf_init((char *)p, (unsigned)avail);
}

static void reading(kvf__session *s, bool on) {
  if (s->sink || s->closing || s->reading == on) return;
  s->reading = on;
  if (on) uv_read_start((uv_stream_t *)&s->pipe, on_alloc, on_read);
  else uv_read_stop((uv_stream_t *)&s->pipe);
}

/* Queues s for a turn on a later pass of the loop. */
static void ready_push(kvf__session *s) {
  if (s->ready || s->closing) return;
  s->ready = true;
  s->ready_next = NULL;
  if (A.ready_tail) A.ready_tail->ready_next = s;
  else A.ready_head = s;
  A.ready_tail = s;
  if (!uv_is_active((uv_handle_t *)&A.turns)) uv_idle_start(&A.turns, on_turns);
}

/* Whether s may be served another request now; if not, it reads nothing
 * until it gets a turn (its frames wait in s->fb and in its socket). */
static bool may_serve(kvf__session *s, unsigned done, uint64_t t0) {
  if (s->sink) return true; /* detached sessions are fed by hand, whole */
  if (unwritten(s) > OUT_MARK) {
    s->out_wait = true;     /* on_written queues it once it has read */
    reading(s, false);
    return false;
  }
  if (done < TURN_REQUESTS && (done == 0 || kvf__now_ns() - t0 < TURN_NS)) return true;
  reading(s, false);
  ready_push(s);
  return false;
}

/* Decodes and answers the whole frames held in s->fb, for one turn: the
 * one path from a client's bytes to on_request (the socket's reads, the
 * turns, and kvf__api_feed). Reading resumes once s->fb is drained. */
static void serve(kvf__session *s) {
  uint64_t t0 = s->sink ? 0 : kvf__now_ns();
  for (unsigned done = 0; !s->closing && may_serve(s, done, t0); done++) {
    const uint8_t *payload;
    uint32_t len;
    int rc = kvf__framebuf_next(&s->fb, &payload, &len);
    if (rc == 0) {
      reading(s, true);
      return;
    }
    if (rc < 0) {
      char why[128];
      snprintf(why, sizeof(why), "sent a frame of %u bytes, more than %s (%u); dropped",
               kvf__frame_get_u32(s->fb.data + s->fb.off), s->refused ? "a refused client may send" : "max-frame",
               s->fb.max);
      kvfd.stats.api_errors++;
      session_close(s, why);
      return;
    }
    Kvf__ApiRequest *q = kvf__api_request__unpack(NULL, len, payload);
    if (!q) {
      kvfd.stats.api_errors++;
      session_close(s, "sent an undecodable frame; dropped");
      return;
    }
    on_request(s, q);
    kvf__api_request__free_unpacked(q, NULL);
    if (!s->closing) drop_stray_fds(s);
  }
}

/* One turn for each session that was waiting when this pass began; the
 * loop then polls (peers, timers, the other clients) before the next. */
static void on_turns(uv_idle_t *h) {
  kvf__session *s = A.ready_head;
  A.ready_head = A.ready_tail = NULL;
  while (s) {
    kvf__session *next = s->ready_next;
    s->ready = false;
    s->ready_next = NULL;
    if (!s->closing) serve(s); /* closed ones are freed only after this pass */
    s = next;
  }
  if (!A.ready_head) uv_idle_stop(h);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  kvf__session *s = st->data;
  if (nread < 0) {
    session_close(s, nread == UV_EOF ? NULL : uv_strerror((int)nread));
    return;
  }
  kvf__framebuf_commit(&s->fb, (size_t)nread);
  serve(s);
}

static void credentials(kvf__session *s) {
  struct ucred cred;
  socklen_t len = sizeof(cred);
  uv_os_fd_t fd;
  s->pid = -1;
  s->uid = (uid_t)-1;
  if (uv_fileno((uv_handle_t *)&s->pipe, &fd) == 0 &&
      getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
    s->pid = cred.pid;
    s->uid = cred.uid;
    s->gid = cred.gid;
  }
}

/* Counts the session in and decides, from its credentials and the
 * limits, whether it is refused (its first request then gets that status,
 * and it is closed). Refused sessions take no client slot. */
static void session_admit(kvf__session *s) {
  s->id = ++A.next_id;
  s->next = A.head;
  if (A.head) A.head->prev = s;
  A.head = s;
  A.n++;
  s->operator = s->uid == 0 || s->uid == geteuid();
  size_t limit = (size_t)kvfd.cfg.max_clients + (s->operator ? kvfd.cfg.api_operator_slots : 0);
  if (!uid_allowed(s->uid, s->gid)) s->refused = KVF_EPERM;
  else if (A.n - A.n_refused > limit) s->refused = KVF_ELIMIT;
  if (!s->refused) return;
  A.n_refused++;
  s->fb.max = REFUSED_FRAME_MAX < s->fb.max ? REFUSED_FRAME_MAX : s->fb.max;
  if (A.n_refused > MAX_REFUSED) return; /* closed at once; too_many_refused says so */
  if (s->refused == KVF_EPERM)
    kvf__warn("refused client pid %d uid %u gid %u: not root, kvferryd's user, in "
              "api-allow-users or in api-allow-groups", (int)s->pid, (unsigned)s->uid,
              (unsigned)s->gid);
  else
    kvf__warn("refused client pid %d uid %u: max-clients (%u) clients are connected", (int)s->pid,
              (unsigned)s->uid, kvfd.cfg.max_clients);
}

/* Refused connections that never say hello must not pile up. */
static bool too_many_refused(kvf__session *s) {
  uint64_t dropped;
  if (!s->refused || A.n_refused <= MAX_REFUSED) return false;
  if (kvf__log_ratelimit(&A.refused_rl, &dropped))
    kvf__warn("closed client pid %d uid %u unanswered: %u refused connections are still open "
              "(%llu more closed since the last such line)", (int)s->pid, (unsigned)s->uid,
              MAX_REFUSED, (unsigned long long)dropped);
  return true;
}

static void on_hello_timeout(uv_timer_t *t) {
  kvf__session *s = t->data;
  char why[96];
  snprintf(why, sizeof(why), "no Hello within api-hello-timeout-ms (%u ms); closed", kvfd.cfg.api_hello_timeout_ms);
  kvfd.stats.api_errors++;
  session_close(s, why);
}

static void on_connection(uv_stream_t *server, int status) {
  if (status < 0) return;
  kvf__session *s = calloc(1, sizeof(*s));
  if (!s) return;
  kvf__framebuf_init(&s->fb, kvfd.cfg.max_frame);
  uv_pipe_init(A.loop, &s->pipe, 1); /* ipc: lets uv_write2 pass pool fds */
  s->pipe.data = s;
  s->handles_open = 1;
  if (uv_accept(server, (uv_stream_t *)&s->pipe) != 0) {
    uv_close((uv_handle_t *)&s->pipe, on_session_closed);
    return;
  }
  /* Until its Hello, a client holds a slot on trust: not for long. */
  uv_timer_init(A.loop, &s->hello_timer);
  s->hello_timer.data = s;
  s->handles_open = 2;
  uv_timer_start(&s->hello_timer, on_hello_timeout, kvfd.cfg.api_hello_timeout_ms, 0);
  credentials(s);
  session_admit(s);
  if (too_many_refused(s)) {
    session_close(s, NULL);
    return;
  }
  reading(s, true);
}

kvf__session *kvf__api_session_detached(pid_t pid, uid_t uid, gid_t gid, kvf__api_sink *sink,
                                        void *arg) {
  kvf__session *s = sink ? calloc(1, sizeof(*s)) : NULL;
  if (!s) return NULL;
  kvf__framebuf_init(&s->fb, kvfd.cfg.max_frame);
  s->sink = sink;
  s->sink_arg = arg;
  s->pid = pid;
  s->uid = uid;
  s->gid = gid;
  session_admit(s);
  return s;
}

int kvf__api_feed(kvf__session *s, const void *data, size_t n) {
  if (s->closing) return KVF_EDAEMON;
  if (kvf__framebuf_append(&s->fb, data, n) != 0) return -ENOMEM;
  serve(s);
  return s->closing ? KVF_EDAEMON : 0;
}

bool kvf__api_session_closed(const kvf__session *s) { return s->closing; }

void kvf__api_session_free(kvf__session *s) {
  session_close(s, NULL);
  kvf__framebuf_free(&s->fb);
  free(s);
}

/* Refuses to steal the socket of a daemon that is still running. */
static int clear_stale_socket(const char *path, char *err, size_t errlen) {
  struct stat st;
  if (lstat(path, &st) != 0) return 0;
  if (!S_ISSOCK(st.st_mode)) {
    snprintf(err, errlen, "api-socket %s exists and is not a socket", path);
    return -EEXIST;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
  int live = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
  if (fd >= 0) close(fd);
  if (live) {
    snprintf(err, errlen, "api-socket %s: another kvferryd is listening there", path);
    return -EADDRINUSE;
  }
  unlink(path);
  return 0;
}

int kvf__api_check_socket(char *err, size_t errlen) { return clear_stale_socket(kvfd.cfg.api_socket, err, errlen); }

int kvf__api_start(uv_loop_t *loop, char *err, size_t errlen) {
  A.loop = loop;
  const char *path = kvfd.cfg.api_socket;
  int rc = clear_stale_socket(path, err, errlen);
  if (rc) return rc;
  uv_idle_init(loop, &A.turns);
  A.handles = true;
  uv_pipe_init(loop, &A.server, 0);
  A.listening = true;
  rc = uv_pipe_bind(&A.server, path);
  if (rc == 0) rc = uv_listen((uv_stream_t *)&A.server, 128, on_connection);
  if (rc) {
    snprintf(err, errlen, "api-socket %s: %s", path, uv_strerror(rc));
    return rc;
  }
  /* Who may talk to us is decided by SO_PEERCRED, not by file modes. */
  chmod(path, 0666);
  return 0;
}

void kvf__api_stop_accepting(void) {
  if (A.listening) {
    uv_close((uv_handle_t *)&A.server, NULL);
    unlink(kvfd.cfg.api_socket);
    A.listening = false;
  }
}

void kvf__api_stop(void) {
  kvf__api_stop_accepting();
  while (A.head) session_close(A.head, NULL);
  if (A.handles) {
    uv_close((uv_handle_t *)&A.turns, NULL);
    A.handles = false;
  }
  inspect_cache_free();
}
