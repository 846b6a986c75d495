/* fuzz_common.c - see fuzz_common.h. */
#include "fuzz_common.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"
#include "metrics.h"
#include "pool.h"
#include "transport/tcp/tcp.h"

kvf__peer *fz_b, *fz_c;
char fz_sess_mem[FZ_NSESS];

static uv_loop_t loop;
static kvf__peer peers[2];
static int sess_count[FZ_NSESS];

void fz_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("fuzz invariant broken: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  abort();
}

static bool strict(void) {
  static int on = -1;
  if (on < 0) on = getenv("KVF_FUZZ_STRICT") && atoi(getenv("KVF_FUZZ_STRICT"));
  return on;
}

void fz_check_status(int status, const char *what) {
  if (strict() && status != 0 && (status > 0 || strcmp(kvf_err_name(status), "UNKNOWN") == 0))
    fz_fail("%s with status %d, not a kvferry error", what, status);
}

/* ------------------------------------------------------------ transports */

typedef struct fz_post {
  kvf__xfer *x;
  kvf__runs runs;
  bool last, local, aborted;
} fz_post;

static struct {
  fz_post *v;
  size_t head, n, cap;
} posts;

static struct {
  kvf__xfer **v;
  bool *landed;
  size_t n, cap;
} opened;

static bool in_pool(uint32_t pool, uint64_t off, uint64_t len) {
  return pool < kvfd.n_pools && kvf__pool_check_range(kvfd.pools[pool], off, len) == 0;
}

/* Made with kvf__transport_init (below): the ops left out get the
 * defaults, and t->ops is the instance's merged copy. */
static kvf__transport tp_local, tp_net, tp_one_sided;

/* Every run's source is in our pools (the API checked the send); a local
 * run's destination too (the API checked the grant). */
static int f_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) {
  bool local = t == &tp_local; /* not t->ops: that is the merged copy */
  uint64_t bytes = 0;
  for (size_t i = 0; i < runs->n; i++) {
    const kvf__run *r = &runs->v[i];
    if (!in_pool(r->src_pool, r->src_off, r->len))
      fz_fail("post of '%s': source pool %u [%llu, +%llu) is outside the pools", x->id, r->src_pool,
              (unsigned long long)r->src_off, (unsigned long long)r->len);
    if (local && !in_pool(r->dst_pool, r->dst_off, r->len))
      fz_fail("local post of '%s': destination pool %u [%llu, +%llu) is outside the pools", x->id,
              r->dst_pool, (unsigned long long)r->dst_off, (unsigned long long)r->len);
    /* local.c copies with memcpy (README.md) */
    if (local && strict() && r->src_pool == r->dst_pool && r->src_off < r->dst_off + r->len &&
        r->dst_off < r->src_off + r->len)
      fz_fail("local post of '%s': source and destination overlap in pool %u", x->id, r->src_pool);
    bytes += r->len;
  }
  if (bytes != runs->bytes) fz_fail("post of '%s': runs say %llu bytes, hold %llu", x->id,
                                    (unsigned long long)runs->bytes, (unsigned long long)bytes);
  if (posts.head + posts.n == posts.cap) {
    if (posts.head) {
      memmove(posts.v, posts.v + posts.head, posts.n * sizeof(*posts.v));
      posts.head = 0;
    } else {
      size_t ncap = posts.cap ? posts.cap * 2 : 64;
      fz_post *nv = realloc(posts.v, ncap * sizeof(*nv));
      if (!nv) return -ENOMEM;
      posts.v = nv;
      posts.cap = ncap;
    }
  }
  posts.v[posts.head + posts.n++] = (fz_post){.x = x, .runs = *runs, .last = last, .local = local};
  memset(runs, 0, sizeof(*runs)); /* ours now, as a transport's */
  return 0;
}

static void f_abort(kvf__transport *t, kvf__xfer *x) {
  for (size_t i = posts.head; i < posts.head + posts.n; i++)
    if (posts.v[i].x == x) posts.v[i].aborted = true;
}

static ptrdiff_t opened_index(const kvf__xfer *x) {
  for (size_t i = 0; i < opened.n; i++)
    if (opened.v[i] == x) return (ptrdiff_t)i;
  return -1;
}

/* A grant reaches the transport only with descriptors inside our pools. */
static int f_grant_open(kvf__transport *t, kvf__xfer *x) {
  for (size_t i = 0; i < x->dst.n; i++)
    if (!in_pool(x->dst.pool[i], x->dst.offset[i], x->dst.length[i]))
      fz_fail("grant '%s' opened with descriptor %zu outside the pools", x->id, i);
  if (opened_index(x) >= 0) fz_fail("grant '%s' opened twice", x->id);
  if (opened.n == opened.cap) {
    size_t ncap = opened.cap ? opened.cap * 2 : 64;
    kvf__xfer **nv = realloc(opened.v, ncap * sizeof(*nv));
    bool *nl = realloc(opened.landed, ncap * sizeof(*nl));
    if (nv) opened.v = nv;
    if (nl) opened.landed = nl;
    if (!nv || !nl) return -ENOMEM;
    opened.cap = ncap;
  }
  opened.landed[opened.n] = false;
  opened.v[opened.n++] = x;
  return 0;
}

static void f_grant_close(kvf__transport *t, kvf__xfer *x) {
  ptrdiff_t i = opened_index(x);
  if (i < 0) fz_fail("grant '%s' closed but not open", x->id);
  opened.v[i] = opened.v[opened.n - 1];
  opened.landed[i] = opened.landed[opened.n - 1];
  opened.n--;
}

static const kvf__transport_ops local_ops = {
    .name = "local", .post = f_post, .abort = f_abort,
    .grant_open = f_grant_open, .grant_close = f_grant_close,
};
static const kvf__transport_ops net_ops = {
    .name = "tcp", .post = f_post, .abort = f_abort,
    .grant_open = f_grant_open, .grant_close = f_grant_close,
};
/* Peer B's transport is one-sided (as rdma): a receiver its client cancels
 * waits for B's CancelDone (or B going down) before closing the grant. */
static const kvf__transport_ops one_sided_ops = {
    .name = "rdma", .one_sided = true, .post = f_post, .abort = f_abort,
    .grant_open = f_grant_open, .grant_close = f_grant_close,
};

void fz_pump(bool land) {
  while (posts.n) {
    fz_post p = posts.v[posts.head++];
    posts.n--;
    if (posts.n == 0) posts.head = 0;
    /* memmove, not local.c's memcpy: a client may send from and grant to
     * overlapping ranges of one pool (README.md; KVF_FUZZ_STRICT=1 fails). */
    if (p.local)
      for (size_t i = 0; i < p.runs.n; i++) {
        const kvf__run *r = &p.runs.v[i];
        memmove(kvfd.pools[r->dst_pool]->base + r->dst_off, kvfd.pools[r->src_pool]->base + r->src_off, r->len);
      }
    kvf__runs_free(&p.runs);
    kvf__xfer_on_posted(p.x, p.aborted && !p.local ? KVF_ECANCELED : 0, p.last);
  }
  if (!land) return;
  for (size_t i = 0; i < opened.n;) {
    if (opened.landed[i]) {
      i++;
      continue;
    }
    opened.landed[i] = true;
    kvf__xfer_on_landed(opened.v[i]); /* may close this grant: look again */
    i = 0;
  }
}

/* ------------------------------------------------------------ environment */

/* Everything the daemon sends must pack, within max-frame as conn_send
 * requires. */
static int f_peer_send(kvf__peer *p, const Kvf__PeerMsg *m) {
  size_t n = kvf__peer_msg__get_packed_size(m);
  if (getenv("KVF_FUZZ_VERBOSE")) fprintf(stderr, "to peer %s: message %d, %zu bytes\n", p->cfg.name, m->body_case, n);
  if (n > kvfd.cfg.max_frame) return KVF_ELIMIT;
  uint8_t stackbuf[4096], *buf = n <= sizeof(stackbuf) ? stackbuf : malloc(n);
  if (!buf) return -ENOMEM;
  if (kvf__peer_msg__pack(m, buf) != n) fz_fail("a peer message packs to a size it did not announce");
  if (buf != stackbuf) free(buf);
  return 0;
}

static kvf__peer *f_peer_find(const char *node) {
  for (size_t i = 0; i < 2; i++)
    if (strcmp(node, peers[i].cfg.name) == 0) return &peers[i];
  return NULL;
}

static bool f_peer_up(const kvf__peer *p) { return p->state == KVF__PEER_UP; }
static const char *f_peer_name(const kvf__peer *p) { return p->cfg.name; }
static kvf__transport *f_peer_transport(kvf__peer *p) { return p == fz_b ? &tp_one_sided : &tp_net; }

static ptrdiff_t sess_index(const kvf__session *s) {
  ptrdiff_t i = (const char *)s - fz_sess_mem;
  if (i < 0 || i >= FZ_NSESS) fz_fail("an event or count for an unknown session %p", (const void *)s);
  return i;
}

static void f_emit(kvf__session *s, const Kvf__Event *ev) {
  ptrdiff_t i = sess_index(s);
  if (getenv("KVF_FUZZ_VERBOSE"))
    fprintf(stderr, "event to session %td: %s '%s' status %d path %s peer %s bytes %llu %s\n", i,
            ev->type == KVF__EVENT_TYPE__EVENT_RECV_DONE ? "RECV_DONE" : "SEND_DONE", ev->xfer_id, ev->status,
            ev->path, ev->peer, (unsigned long long)ev->bytes, ev->error);
  fz_check_status(ev->status, "an event");
  uint8_t buf[2048];
  size_t n = kvf__event__get_packed_size(ev);
  if (n > sizeof(buf)) fz_fail("an event of %zu bytes", n);
  kvf__event__pack(ev, buf);
}

static void f_session_xfers(kvf__session *s, int delta) {
  ptrdiff_t i = sess_index(s);
  sess_count[i] += delta;
  if (sess_count[i] < 0) fz_fail("session %td has %d transfers", i, sess_count[i]);
}

/* ------------------------------------------------------------ setup */

kvf__descs fz_descs(const uint64_t (*t)[3], size_t n) {
  uint8_t buf[FZ_MAX_DESCS * KVF__DESC_WIRE_SIZE];
  if (n > FZ_MAX_DESCS) fz_fail("fz_descs: %zu descriptors", n);
  for (size_t i = 0; i < n; i++) {
    uint8_t *r = buf + i * KVF__DESC_WIRE_SIZE;
    for (int b = 0; b < 4; b++) r[b] = (uint8_t)(t[i][0] >> (8 * b));
    for (int b = 0; b < 8; b++) r[4 + b] = (uint8_t)(t[i][1] >> (8 * b));
    for (int b = 0; b < 8; b++) r[12 + b] = (uint8_t)(t[i][2] >> (8 * b));
  }
  Kvf__DescList w = KVF__DESC_LIST__INIT;
  w.packed.data = buf;
  w.packed.len = n * KVF__DESC_WIRE_SIZE;
  kvf__descs d;
  if (kvf__descs_from_wire(&d, &w, FZ_MAX_DESCS) != 0) fz_fail("fz_descs: a bad list");
  return d;
}

static void make_pools(void) {
  static const struct { const char *name; uint64_t size; } defs[] = {{"p0", FZ_POOL0_SIZE},
                                                                      {"p1", FZ_POOL1_SIZE}};
  kvfd.pools = calloc(2, sizeof(*kvfd.pools));
  if (!kvfd.pools) fz_fail("out of memory");
  for (uint32_t i = 0; i < 2; i++) {
    kvf__pool_cfg pc = {.size = defs[i].size};
    snprintf(pc.name, sizeof(pc.name), "%s", defs[i].name);
    snprintf(pc.kind, sizeof(pc.kind), "host");
    char err[256];
    if (kvf__pool_create(&pc, i, KVF__OFF, false, &kvfd.pools[i], err, sizeof(err)) != 0)
      fz_fail("pool: %s", err);
    kvfd.cfg.pools[i] = pc;
  }
  kvfd.n_pools = kvfd.cfg.n_pools = 2;
}

void fz_init(bool api_env, bool c_up) {
  const char *lvl = getenv("KVF_FUZZ_LOG"); /* e.g. KVF_FUZZ_LOG=3 for debug */
  kvf__log_init(lvl ? atoi(lvl) : KVF__LOG_ERR);
  kvf__config_defaults(&kvfd.cfg);
  snprintf(kvfd.cfg.node, sizeof(kvfd.cfg.node), FZ_NODE);
  kvfd.cfg.max_frame = FZ_MAX_FRAME;
  kvfd.cfg.max_descs = FZ_MAX_DESCS;
  kvfd.cfg.max_transfers_per_client = FZ_MAX_XFERS;
  kvfd.cfg.max_peer_waiting = FZ_MAX_WAITING;
  kvfd.session = 0; /* handles from 1, the same at every start */
  uv_loop_init(&loop);
  kvfd.loop = &loop;
  kvfd.start_ns = kvf__now_ns();
  kvf__transport_init(&tp_local, &local_ops, &loop, 0);
  kvf__transport_init(&tp_net, &net_ops, &loop, 1);
  kvf__transport_init(&tp_one_sided, &one_sided_ops, &loop, 1);
  make_pools();
  const char *names[2] = {FZ_PEER_B, FZ_PEER_C};
  for (int i = 0; i < 2; i++) {
    snprintf(peers[i].cfg.name, sizeof(peers[i].cfg.name), "%s", names[i]);
    snprintf(peers[i].cfg.host, sizeof(peers[i].cfg.host), "127.0.0.%d", i + 2);
    peers[i].cfg.port = 7470;
    peers[i].tp = &tp_net;
  }
  peers[0].state = KVF__PEER_UP;
  peers[1].state = c_up ? KVF__PEER_UP : KVF__PEER_DOWN;
  fz_b = &peers[0];
  fz_c = &peers[1];
  kvf__xfer_env env = {
      .emit = api_env ? kvf__api_emit : f_emit,
      .peer_send = f_peer_send,
      .peer_find = f_peer_find,
      .peer_up = f_peer_up,
      .peer_name = f_peer_name,
      .peer_transport = f_peer_transport,
      .session_xfers = api_env ? kvf__api_session_xfers : f_session_xfers,
      .local = &tp_local,
  };
  kvf__xfer_init(&loop, &env);
}

void fz_finish(bool fake_sessions) {
  for (int i = 0; i < 2; i++)
    if (peers[i].waiting > FZ_MAX_WAITING)
      fz_fail("peer %s has %u intents and pushed grants waiting, more than max-peer-waiting (%u)", peers[i].cfg.name,
              peers[i].waiting, FZ_MAX_WAITING);
  if (fake_sessions)
    for (int i = 0; i < FZ_NSESS; i++) kvf__xfer_session_gone((kvf__session *)&fz_sess_mem[i]);
  kvf__xfer_on_peer_down(fz_b);
  kvf__xfer_on_peer_down(fz_c);
  for (int i = 0; i < 2; i++) /* every way out of the tables counted */
    if (peers[i].waiting != 0)
      fz_fail("peer %s still counts %u waiting after it went down", peers[i].cfg.name, peers[i].waiting);
  fz_pump(false);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  if (c.active || c.pregrants || c.intents)
    fz_fail("left behind: %zu transfers (first '%s', state %s), %zu pre-grants, %zu intents", c.active,
            kvf__xfer_first() ? kvf__xfer_first()->id : "", 
            kvf__xfer_first() ? kvf__xstate_name(kvf__xfer_first()->state) : "-", c.pregrants, c.intents);
  if (posts.n || opened.n) fz_fail("the transports still hold %zu posts and %zu grants", posts.n, opened.n);
  for (int i = 0; fake_sessions && i < FZ_NSESS; i++)
    if (sess_count[i] != 0) fz_fail("session %d still counts %d transfers", i, sess_count[i]);
  /* The transfers' timers close: their memory goes back. */
  uv_run(&loop, UV_RUN_NOWAIT);
  kvf__metrics_reset();
  memset(&kvfd.stats, 0, sizeof(kvfd.stats));
}
