/* transport.c - the table of transports, the daemon's instances of them,
 * and the defaults behind every op a backend leaves out. */
#include "transport.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "cuda/gpu.h"
#include "local/local.h"
#include "pool.h"
#include "rdma/rdma.h"
#include "tcp/tcp.h"

/* ------------------------------------------------------------ defaults */

static bool def_usable(kvf__transport *t, kvf__peer *p) { return true; }
static int def_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) { return -EOPNOTSUPP; }
static void def_xfer(kvf__transport *t, kvf__xfer *x) {}
static bool def_mark_layers(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n) { return false; }

/* Blocks as runs, for transports that move runs (tcp, rdma): the layouts
 * are walked straight into coalesced runs, no descriptor lists. */
int kvf__transport_post_block_runs(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last) {
  kvf__runs runs = {0};
  int rc = b->xf.transform ? kvf__xform_runs(&b->xf, b->src, b->sids, b->dst, b->dids, b->first, b->n_layers, &runs)
                           : kvf__blocks_pair(b->src, b->sids, b->dst, b->dids, b->n, b->first, b->n_layers, &runs);
  if (rc == 0) rc = t->ops->post(t, x, &runs, last);
  kvf__runs_free(&runs);
  return rc;
}

void kvf__transport_block_side(const kvf__lview *v, const kvf__layout *l, const uint32_t *ids, uint32_t first,
                               kvf__gpu_bside *out) {
  const kvf__pool *p = kvfd.pools[v->pool];
  kvf__gpu_end e;
  kvf__pool_gpu_end(p, 0, &e);
  size_t skip = (size_t)first * v->n_kv; /* the table holds every layer of l */
  *out = (kvf__gpu_bside){.dev = p->cuda_dev, .base = e.addr, .table = kvf__gpu_layout_table(l->gpu) + skip * 8,
                          .offsets = v->offsets + (size_t)(first - v->first_layer) * v->n_kv,
                          .stride = v->block_stride, .ids = ids};
}

static int def_grant_open(kvf__transport *t, kvf__xfer *x) { return 0; }
static int def_peer_up(kvf__transport *t, kvf__peer *p) { return 0; }
static void def_peer_down(kvf__transport *t, kvf__peer *p) {}
static int def_pool_added(kvf__transport *t, kvf__pool *p, char *err, size_t errlen) {
  snprintf(err, errlen, "the %s transport cannot take memory registered after start", t->ops->name);
  return -EOPNOTSUPP;
}
int kvf__transport_pool_mapped(kvf__transport *t, kvf__pool *p, char *err, size_t errlen) { return 0; }
static void def_pool_removed(kvf__transport *t, kvf__pool *p) {}
static int def_unstage(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n, const struct kvf__xstaged *st,
                       char *why, size_t len) {
  snprintf(why, len, "the sender says it staged layers %u-%u, but the %s transport gave the grant no staging",
           first, first + n - 1, t->ops->name);
  return KVF_EPROTO;
}
static void def_hello(kvf__transport *t, Kvf__Hello *h) {}
static const char *def_protection(kvf__transport *t) { return NULL; }
static void def_inspect(kvf__transport *t, char *buf, size_t len) {
  snprintf(buf, len, "\"name\": \"%s\"", t->ops->name);
}
static void def_destroy(kvf__transport *t) {}

static const kvf__transport_ops defaults = {
    .name = "none",
    .usable = def_usable,
    .post = def_post,
    .post_blocks = kvf__transport_post_block_runs,
    .mark_layers = def_mark_layers,
    .unstage = def_unstage,
    .abort = def_xfer,
    .xfer_done = def_xfer,
    .grant_open = def_grant_open,
    .grant_close = def_xfer,
    .peer_up = def_peer_up,
    .peer_down = def_peer_down,
    .pool_added = def_pool_added,
    .pool_removed = def_pool_removed,
    .hello = def_hello,
    .protection = def_protection,
    .inspect = def_inspect,
    .destroy = def_destroy,
};

#define TAKE(f) t->merged.f = ops->f ? ops->f : defaults.f

void kvf__transport_init(kvf__transport *t, const kvf__transport_ops *ops, uv_loop_t *loop, unsigned slot) {
  t->merged.name = ops->name;
  t->merged.one_sided = ops->one_sided;
  TAKE(usable);
  TAKE(post);
  TAKE(post_blocks);
  TAKE(mark_layers);
  TAKE(unstage);
  TAKE(abort);
  TAKE(xfer_done);
  TAKE(grant_open);
  TAKE(grant_close);
  TAKE(peer_up);
  TAKE(peer_down);
  TAKE(pool_added);
  TAKE(pool_removed);
  TAKE(hello);
  TAKE(protection);
  TAKE(inspect);
  TAKE(destroy);
  t->ops = &t->merged;
  t->loop = loop;
  t->slot = slot;
}

/* ------------------------------------------------------------ the table */

static const struct transport_type {
  const char *name;
  kvf__transport_create_fn create;
  /* Runs whatever `transports` says: local carries transfers between this
   * daemon's clients; tcp takes the peers' data streams that arrive on the
   * peer port, and carries data when nothing configured can. */
  bool always;
  bool to_peers;                /* may carry data to peers (a `transports` word) */
} types[] = {
    {"local", kvf__local_create, true, false},
    {"tcp", kvf__tcp_create, true, true},
    {"rdma", kvf__rdma_create, false, true},
};

#define N_TYPES (sizeof(types) / sizeof(types[0]))
_Static_assert(N_TYPES <= KVF__TRANSPORTS_MAX, "kvf__peer.tp_slot is too small for the transport table");

/* Whether the config's `transports` list names name. */
static bool configured(const char *name) {
  char list[sizeof(kvfd.cfg.transports)];
  snprintf(list, sizeof(list), "%s", kvfd.cfg.transports);
  for (char *save = NULL, *w = strtok_r(list, ",", &save); w; w = strtok_r(NULL, ",", &save))
    if (strcmp(w, name) == 0) return true;
  return false;
}

int kvf__transports_start(uv_loop_t *loop) {
  for (unsigned i = 0; i < N_TYPES; i++) {
    char err[512] = "";
    if (!types[i].always && !configured(types[i].name)) continue;
    int rc = types[i].create(loop, i, &kvfd.transports[i], err, sizeof(err));
    if (rc == -ENODEV && !types[i].always) {
      kvf__warn("%s unavailable (%s); using the other transports", types[i].name, err);
      continue;
    }
    if (rc) {
      kvf__err("%s: %s", types[i].name, err[0] ? err : kvf_strerror(rc));
      kvf__transports_stop();
      return rc;
    }
  }
  return 0;
}

void kvf__transports_stop(void) {
  for (unsigned i = 0; i < N_TYPES; i++) {
    kvf__transport *t = kvfd.transports[i];
    kvfd.transports[i] = NULL;
    if (t) t->ops->destroy(t);
  }
}

kvf__transport *kvf__transport_find(const char *name) {
  for (unsigned i = 0; i < N_TYPES; i++)
    if (strcmp(types[i].name, name) == 0) return kvfd.transports[i];
  return NULL;
}

size_t kvf__transports_for_peers(kvf__transport **out, size_t cap) {
  size_t n = 0;
  char list[sizeof(kvfd.cfg.transports)];
  snprintf(list, sizeof(list), "%s", kvfd.cfg.transports);
  for (char *save = NULL, *w = strtok_r(list, ",", &save); w && n < cap; w = strtok_r(NULL, ",", &save)) {
    for (unsigned i = 0; i < N_TYPES; i++)
      if (types[i].to_peers && kvfd.transports[i] && strcmp(types[i].name, w) == 0) out[n++] = kvfd.transports[i];
  }
  if (n == 0 && cap > 0) {
    kvf__warn("none of the transports '%s' can run here; falling back to tcp", kvfd.cfg.transports);
    out[n++] = kvf__transport_find("tcp");
  }
  return n;
}
