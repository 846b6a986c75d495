/* metrics.c - the counters and the exposition text (see metrics.h).
 *
 * Counters that cannot be read back from the daemon's state (finished
 * transfers by role, path and status; latency histograms; API errors by
 * name) live here, fed by hooks. Everything else (active transfers, peers,
 * pools, connections) is read at scrape time, so it cannot drift from what
 * kvferryctl shows. Label sets are small and bounded: roles, transport
 * names and error names. */
#include "metrics.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api.h"
#include "peer.h"
#include "pool.h"
#include "transport/transport.h"
#include "xfer.h"
#include "xfer_trace.h"

#define PATH_MAX_LEN 32
#define MAX_COLLECTORS 8

/* Upper bounds of the latency buckets, in seconds: 100 us (a local copy)
 * up to 30 s (the default deadline). */
static const double bucket_le[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                   0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,     10, 30};
#define N_BUCKETS (sizeof bucket_le / sizeof bucket_le[0])

/* Finished transfers of one (role, path, status). */
typedef struct xseries {
  int role;
  char path[PATH_MAX_LEN];
  int status;
  uint64_t transfers, bytes, descriptors;
} xseries;

/* Latency of successful transfers of one (role, path). */
typedef struct hseries {
  int role;
  char path[PATH_MAX_LEN];
  uint64_t buckets[N_BUCKETS]; /* not cumulative; summed when rendered */
  uint64_t count;
  double sum;
} hseries;

typedef struct eseries {
  int status;
  uint64_t count;
} eseries;

static struct {
  xseries *x;
  size_t nx, capx;
  hseries *h;
  size_t nh, caph;
  eseries *e;
  size_t ne, cape;
  uint64_t reloads_ok, reloads_failed;
  kvf__metrics_collector *collectors[MAX_COLLECTORS];
  size_t ncollectors;
} M;

/* ------------------------------------------------------------ registry */

/* Grows *v (of *cap elements of size sz) to hold one more; false on OOM. */
static bool grow(void **v, size_t *cap, size_t n, size_t sz) {
  if (n < *cap) return true;
  size_t ncap = *cap ? *cap * 2 : 16;
  void *nv = realloc(*v, ncap * sz);
  if (!nv) return false;
  *v = nv;
  *cap = ncap;
  return true;
}

static xseries *xseries_get(int role, const char *path, int status) {
  for (size_t i = 0; i < M.nx; i++)
    if (M.x[i].role == role && M.x[i].status == status && !strcmp(M.x[i].path, path))
      return &M.x[i];
  if (!grow((void **)&M.x, &M.capx, M.nx, sizeof *M.x)) return NULL;
  xseries *s = &M.x[M.nx++];
  memset(s, 0, sizeof *s);
  s->role = role;
  s->status = status;
  snprintf(s->path, sizeof s->path, "%s", path);
  return s;
}

static hseries *hseries_get(int role, const char *path) {
  for (size_t i = 0; i < M.nh; i++)
    if (M.h[i].role == role && !strcmp(M.h[i].path, path)) return &M.h[i];
  if (!grow((void **)&M.h, &M.caph, M.nh, sizeof *M.h)) return NULL;
  hseries *s = &M.h[M.nh++];
  memset(s, 0, sizeof *s);
  s->role = role;
  snprintf(s->path, sizeof s->path, "%s", path);
  return s;
}

static void observe(hseries *h, double seconds) {
  for (size_t i = 0; i < N_BUCKETS; i++) {
    if (seconds <= bucket_le[i]) {
      h->buckets[i]++;
      break;
    }
  }
  h->count++; /* above the last bound: only +Inf (= count) holds it */
  h->sum += seconds;
}

void kvf__metrics_transfer(const kvf__xfer *x, int status) {
  const char *path = kvf__xfer_path(x);
  xseries *s = xseries_get(x->role, path, status);
  if (s) {
    s->transfers++;
    s->bytes += kvf__xfer_bytes(x);
    s->descriptors += kvf__xfer_descriptors(x);
  }
  if (status != 0) return; /* a deadline or a cancel says nothing about speed */
  hseries *h = hseries_get(x->role, path);
  if (h) observe(h, (double)(kvf__now_ns() - x->created_ns) / 1e9);
}

void kvf__metrics_api_error(int status) {
  for (size_t i = 0; i < M.ne; i++)
    if (M.e[i].status == status) {
      M.e[i].count++;
      return;
    }
  if (!grow((void **)&M.e, &M.cape, M.ne, sizeof *M.e)) return;
  M.e[M.ne++] = (eseries){.status = status, .count = 1};
}

void kvf__metrics_reload(bool ok) {
  if (ok) M.reloads_ok++;
  else M.reloads_failed++;
}

int kvf__metrics_add_collector(kvf__metrics_collector *fn) {
  if (M.ncollectors == MAX_COLLECTORS) return -ENOSPC;
  M.collectors[M.ncollectors++] = fn;
  return 0;
}

void kvf__metrics_reset(void) {
  free(M.x);
  free(M.h);
  free(M.e);
  memset(&M, 0, sizeof M);
  kvf__xtrace_reset();
}

/* ------------------------------------------------------------ helpers */

void kvf__metrics_family(kvf__sbuf *b, const char *name, const char *type, const char *help) {
  kvf__sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void kvf__metrics_label(kvf__sbuf *b, const char *v) {
  kvf__sb_printf(b, "\"");
  for (; v && *v; v++) {
    if (*v == '\\' || *v == '"') kvf__sb_printf(b, "\\%c", *v);
    else if (*v == '\n') kvf__sb_printf(b, "\\n");
    else kvf__sb_printf(b, "%c", *v);
  }
  kvf__sb_printf(b, "\"");
}

static const char *role_name(int role) { return role == KVF__RECV ? "recv" : "send"; }
static const char *status_name(int status) { return status ? kvf_err_name(status) : "ok"; }

/* name{role="..",path="..",status=".."} */
static void xlabels(kvf__sbuf *b, const char *name, const xseries *s) {
  kvf__sb_printf(b, "%s{role=\"%s\",path=", name, role_name(s->role));
  kvf__metrics_label(b, s->path);
  kvf__sb_printf(b, ",status=\"%s\"}", status_name(s->status));
}

/* ------------------------------------------------------------ families */

static void render_info(kvf__sbuf *b) {
  struct timespec rt;
  clock_gettime(CLOCK_REALTIME, &rt);
  double now_real = (double)rt.tv_sec + (double)rt.tv_nsec / 1e9;
  double up = (double)(kvf__now_ns() - kvfd.start_ns) / 1e9;
  kvf__metrics_family(b, "kvferry_build_info", "gauge", "Version of kvferryd and this node's name.");
  kvf__sb_printf(b, "kvferry_build_info{version=\"%s\",node=", KVF__VERSION);
  kvf__metrics_label(b, kvfd.cfg.node);
  kvf__sb_printf(b, "} 1\n");
  kvf__metrics_family(b, "kvferry_start_time_seconds", "gauge",
                      "When kvferryd started, in seconds since the Unix epoch.");
  kvf__sb_printf(b, "kvferry_start_time_seconds %.3f\n", now_real - up);
  kvf__metrics_family(b, "kvferry_stopping", "gauge",
                      "1 while kvferryd drains transfers after SIGTERM.");
  kvf__sb_printf(b, "kvferry_stopping %d\n", kvfd.draining || kvfd.stopping);
  kvf__metrics_family(b, "kvferry_config_reloads_total", "counter",
                      "SIGHUP reloads, applied (ok) or refused (failed).");
  kvf__sb_printf(b, "kvferry_config_reloads_total{result=\"ok\"} %llu\n",
                 (unsigned long long)M.reloads_ok);
  kvf__sb_printf(b, "kvferry_config_reloads_total{result=\"failed\"} %llu\n",
                 (unsigned long long)M.reloads_failed);
}

static void render_finished(kvf__sbuf *b) {
  static const struct {
    const char *name, *help;
    size_t off;
  } fams[] = {
      {"kvferry_transfers_total", "Finished transfers by role, path and status (ok or the error).",
       offsetof(xseries, transfers)},
      {"kvferry_transfer_bytes_total", "Bytes of finished transfers by role, path and status.",
       offsetof(xseries, bytes)},
      {"kvferry_transfer_descriptors_total",
       "Block descriptors of finished transfers by role, path and status.",
       offsetof(xseries, descriptors)},
  };
  for (size_t f = 0; f < sizeof fams / sizeof fams[0]; f++) {
    kvf__metrics_family(b, fams[f].name, "counter", fams[f].help);
    for (size_t i = 0; i < M.nx; i++) {
      xlabels(b, fams[f].name, &M.x[i]);
      kvf__sb_printf(b, " %llu\n",
                     (unsigned long long)*(const uint64_t *)((const char *)&M.x[i] + fams[f].off));
    }
  }
}

static void render_latency(kvf__sbuf *b) {
  const char *name = "kvferry_transfer_duration_seconds";
  kvf__metrics_family(b, name, "histogram",
                      "Time from a successful transfer's grant or first send part to its event.");
  for (size_t i = 0; i < M.nh; i++) {
    const hseries *h = &M.h[i];
    uint64_t cum = 0;
    for (size_t k = 0; k <= N_BUCKETS; k++) {
      cum += k < N_BUCKETS ? h->buckets[k] : 0;
      kvf__sb_printf(b, "%s_bucket{role=\"%s\",path=", name, role_name(h->role));
      kvf__metrics_label(b, h->path);
      if (k < N_BUCKETS) kvf__sb_printf(b, ",le=\"%g\"} %llu\n", bucket_le[k], (unsigned long long)cum);
      else kvf__sb_printf(b, ",le=\"+Inf\"} %llu\n", (unsigned long long)h->count);
    }
    kvf__sb_printf(b, "%s_sum{role=\"%s\",path=", name, role_name(h->role));
    kvf__metrics_label(b, h->path);
    kvf__sb_printf(b, "} %.9f\n%s_count{role=\"%s\",path=", h->sum, name, role_name(h->role));
    kvf__metrics_label(b, h->path);
    kvf__sb_printf(b, "} %llu\n", (unsigned long long)h->count);
  }
}

static void render_active(kvf__sbuf *b) {
  static const int states[] = {KVF__X_WAIT, KVF__X_ACTIVE, KVF__X_FLUSH, KVF__X_RESULT, KVF__X_DRAIN};
  enum { NS = sizeof states / sizeof states[0] };
  uint64_t n[2][NS] = {{0}};
  for (const kvf__xfer *x = kvf__xfer_first(); x; x = x->next)
    for (size_t s = 0; s < NS; s++)
      if (x->state == states[s]) n[x->role == KVF__RECV ? 0 : 1][s]++;
  kvf__metrics_family(b, "kvferry_transfers_active", "gauge",
                      "Transfers under way by role and state.");
  for (int r = 0; r < 2; r++)
    for (size_t s = 0; s < NS; s++)
      kvf__sb_printf(b, "kvferry_transfers_active{role=\"%s\",state=\"%s\"} %llu\n",
                     r == 0 ? "recv" : "send", kvf__xstate_name(states[s]),
                     (unsigned long long)n[r][s]);
  kvf__xfer_counts xc;
  kvf__xfer_counts_get(&xc);
  kvf__metrics_family(b, "kvferry_pregrants", "gauge",
                      "Grants pushed here by receivers ahead of their send.");
  kvf__sb_printf(b, "kvferry_pregrants %zu\n", xc.pregrants);
  kvf__metrics_family(b, "kvferry_waiting_sends", "gauge",
                      "Peers' sends waiting here for a local grant.");
  kvf__sb_printf(b, "kvferry_waiting_sends %zu\n", xc.intents);
}

static uint64_t peer_downs(void) {
  uint64_t n = 0;
  for (size_t i = 0; i < kvf__peer_count(); i++) n += kvf__peer_at(i)->downs;
  return n;
}

static void render_errors(kvf__sbuf *b) {
  const kvf__stats *st = &kvfd.stats;
  kvf__metrics_family(b, "kvferry_errors_total", "counter",
                      "Errors by kind: api (refused requests, bad frames), peer_protocol, "
                      "peer_down (lost peer connections), transfer (failed transfers), "
                      "auth (peers refused by the cluster key check).");
  kvf__sb_printf(b, "kvferry_errors_total{kind=\"api\"} %llu\n", (unsigned long long)st->api_errors);
  kvf__sb_printf(b, "kvferry_errors_total{kind=\"peer_protocol\"} %llu\n",
                 (unsigned long long)st->peer_errors);
  kvf__sb_printf(b, "kvferry_errors_total{kind=\"peer_down\"} %llu\n",
                 (unsigned long long)peer_downs());
  kvf__sb_printf(b, "kvferry_errors_total{kind=\"transfer\"} %llu\n",
                 (unsigned long long)st->transfers_failed);
  kvf__sb_printf(b, "kvferry_errors_total{kind=\"auth\"} %llu\n",
                 (unsigned long long)st->auth_failures);
  kvf__metrics_family(b, "kvferry_api_errors_total", "counter",
                      "Local API requests answered with an error, by error name.");
  for (size_t i = 0; i < M.ne; i++)
    kvf__sb_printf(b, "kvferry_api_errors_total{error=\"%s\"} %llu\n", status_name(M.e[i].status),
                   (unsigned long long)M.e[i].count);
}

static void render_peers(kvf__sbuf *b) {
  size_t by_state[4] = {0};
  for (size_t i = 0; i < kvf__peer_count(); i++) {
    int s = kvf__peer_at(i)->state;
    if (s >= 0 && s < 4) by_state[s]++;
  }
  kvf__metrics_family(b, "kvferry_peers", "gauge", "Configured peer daemons by connection state.");
  for (int s = KVF__PEER_DOWN; s <= KVF__PEER_IDLE; s++)
    kvf__sb_printf(b, "kvferry_peers{state=\"%s\"} %zu\n", kvf__peer_state_name(s), by_state[s]);
  kvf__metrics_family(b, "kvferry_peer_up", "gauge", "1 when the peer daemon is connected.");
  for (size_t i = 0; i < kvf__peer_count(); i++) {
    const kvf__peer *p = kvf__peer_at(i);
    kvf__sb_printf(b, "kvferry_peer_up{peer=");
    kvf__metrics_label(b, p->cfg.name);
    kvf__sb_printf(b, "} %d\n", p->state == KVF__PEER_UP);
  }
  kvf__metrics_family(b, "kvferry_peer_transport", "gauge",
                      "The data transport chosen for each connected peer (value 1).");
  for (size_t i = 0; i < kvf__peer_count(); i++) {
    const kvf__peer *p = kvf__peer_at(i);
    if (p->state != KVF__PEER_UP || !p->tp) continue;
    kvf__sb_printf(b, "kvferry_peer_transport{peer=");
    kvf__metrics_label(b, p->cfg.name);
    kvf__sb_printf(b, ",transport=");
    kvf__metrics_label(b, p->tp->ops->name);
    kvf__sb_printf(b, "} 1\n");
  }
  kvf__metrics_family(b, "kvferry_peer_disconnects_total", "counter",
                      "Times the connection to each peer was lost.");
  for (size_t i = 0; i < kvf__peer_count(); i++) {
    const kvf__peer *p = kvf__peer_at(i);
    kvf__sb_printf(b, "kvferry_peer_disconnects_total{peer=");
    kvf__metrics_label(b, p->cfg.name);
    kvf__sb_printf(b, "} %llu\n", (unsigned long long)p->downs);
  }
}

/* Bytes of each pool that active grants reserve. */
static void granted_bytes(uint64_t *out, size_t n_pools) {
  memset(out, 0, n_pools * sizeof *out);
  for (const kvf__xfer *x = kvf__xfer_first(); x; x = x->next) {
    if (x->role != KVF__RECV || x->state == KVF__X_DRAIN) continue;
    if (x->blocks) { /* one layout, one pool */
      if (x->mine.view.pool < n_pools) out[x->mine.view.pool] += kvf__xfer_bytes(x);
      continue;
    }
    for (size_t i = 0; i < x->dst.n; i++)
      if (x->dst.pool[i] < n_pools) out[x->dst.pool[i]] += x->dst.length[i];
  }
}

/* One line per pool: name{pool=".."} value. */
static void pool_lines(kvf__sbuf *b, const char *name, const uint64_t *v) {
  for (size_t i = 0; i < kvfd.n_pools; i++) {
    if (!kvfd.pools[i]) continue;
    kvf__sb_printf(b, "%s{pool=", name);
    kvf__metrics_label(b, kvfd.pools[i]->name);
    kvf__sb_printf(b, "} %llu\n", (unsigned long long)v[i]);
  }
}

static void render_pools(kvf__sbuf *b) {
  static uint64_t v[KVF__POOLS_MAX]; /* the loop thread's */
  size_t n = kvfd.n_pools;
  kvf__metrics_family(b, "kvferry_pool_size_bytes", "gauge",
                      "Size of each memory pool, with its kind and backing (engine-* for engine memory).");
  for (size_t i = 0; i < n; i++) {
    const kvf__pool *p = kvfd.pools[i];
    if (!p) continue;
    kvf__sb_printf(b, "kvferry_pool_size_bytes{pool=");
    kvf__metrics_label(b, p->name);
    kvf__sb_printf(b, ",kind=");
    kvf__metrics_label(b, p->kind);
    kvf__sb_printf(b, ",backing=");
    kvf__metrics_label(b, p->backing);
    kvf__sb_printf(b, "} %llu\n", (unsigned long long)p->size);
  }
  kvf__metrics_family(b, "kvferry_pool_locked", "gauge",
                      "1 when the pool is locked in RAM (mlock succeeded).");
  for (size_t i = 0; i < n; i++) v[i] = kvfd.pools[i] && kvfd.pools[i]->locked;
  pool_lines(b, "kvferry_pool_locked", v);
  kvf__metrics_family(b, "kvferry_pool_granted_bytes", "gauge",
                      "Bytes of each pool reserved by active receive grants.");
  granted_bytes(v, n);
  pool_lines(b, "kvferry_pool_granted_bytes", v);
}

static size_t peers_up(void) {
  size_t n = 0;
  for (size_t i = 0; i < kvf__peer_count(); i++) n += kvf__peer_at(i)->state == KVF__PEER_UP;
  return n;
}

static void render_connections(kvf__sbuf *b) {
  kvf__metrics_family(b, "kvferry_connections", "gauge",
                      "Open connections: api (local clients), peer (control connections to "
                      "peer daemons), metrics (scrapes).");
  kvf__sb_printf(b, "kvferry_connections{kind=\"api\"} %zu\n", kvf__api_sessions());
  kvf__sb_printf(b, "kvferry_connections{kind=\"peer\"} %zu\n", peers_up());
  kvf__sb_printf(b, "kvferry_connections{kind=\"metrics\"} %zu\n", kvf__metrics_http_conns());
}

char *kvf__metrics_render(size_t *len) {
  kvf__sbuf b = {0};
  render_info(&b);
  render_finished(&b);
  render_latency(&b);
  kvf__xtrace_metrics(&b);
  render_active(&b);
  render_errors(&b);
  render_peers(&b);
  render_pools(&b);
  render_connections(&b);
  for (size_t i = 0; i < M.ncollectors; i++) M.collectors[i](&b);
  if (b.oom || !b.s) {
    kvf__sb_free(&b);
    return NULL;
  }
  if (len) *len = b.len;
  return b.s;
}
