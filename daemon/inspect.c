/* inspect.c - see inspect.h. Every view has a JSON form (stable keys, for
 * scripts and tests) and a table for people. */
#include "inspect.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"
#include "pool_engine.h"
#include "auth.h"
#include "cuda/gpu.h"
#include "kvferryd.h"
#include "layouts.h"
#include "metrics.h"
#include "peer.h"
#include "pool.h"
#include "registry.h"
#include "sbuf.h"
#include "spin.h"
#include "transport/transport.h"
#include "xfer.h"
#include "xfer_int.h"
#include "xfer_trace.h"

static void peer_addr(const kvf__peer *p, char *buf, size_t len) {
  const char *h = p->cfg.host;
  snprintf(buf, len, strchr(h, ':') ? "[%s]:%u" : "%s:%u", h, p->cfg.port);
}

/* Engine memory: the pid of the client that registered it (0: its client
 * went away and a transfer still holds it), -1 for daemon pools. */
static int owner_pid(const kvf__pool *p) {
  if (!p->engine) return -1;
  return p->owner ? (int)kvf__api_session_pid(p->owner) : 0;
}

static void pools_json(kvf__sbuf *b) {
  kvf__sb_printf(b, "[");
  const char *sep = "";
  for (size_t i = 0; i < kvfd.n_pools; i++) {
    const kvf__pool *p = kvfd.pools[i];
    if (!p) continue;
    kvf__sb_printf(b, "%s{\"id\": %u, \"name\": ", sep, p->id);
    sep = ", ";
    kvf__sb_json_str(b, p->name);
    kvf__sb_printf(b, ", \"kind\": \"%s\", \"size\": %llu, \"backing\": \"%s\", \"locked\": %s, "
                      "\"registration\": \"%s\", \"cuda_mapped\": %s, \"engine\": %s, \"owner_pid\": %d",
                   p->kind, (unsigned long long)p->size, p->backing, p->locked ? "true" : "false", p->nic_reg,
                   kvf__pool_gpu(p) || p->dev_alias ? "true" : "false", p->engine ? "true" : "false", owner_pid(p));
    kvf__mem_timing t;
    if (kvf__pool_engine_timing(p, &t)) /* what registering it cost */
      kvf__sb_printf(b, ", \"import_ms\": %.3f, \"nic_ms\": %.3f", t.import_ns / 1e6, t.nic_ns / 1e6);
    kvf__sb_printf(b, "}");
  }
  kvf__sb_printf(b, "]");
}

static size_t peers_up(void) {
  size_t n = 0;
  for (size_t i = 0; i < kvf__peer_count(); i++) n += kvf__peer_at(i)->state == KVF__PEER_UP;
  return n;
}

/* "running", or "stopping" once SIGTERM came (transfers draining). */
static const char *run_state(void) { return kvfd.draining || kvfd.stopping ? "stopping" : "running"; }

/* The rdma transport's devices, ports, GIDs, QPs and posting cost (its own
 * JSON fragment); "rdma": null when it is not running. */
static void rdma_status(kvf__sbuf *b, int json) {
  kvf__transport *t = kvf__transport_find("rdma");
  char *frag = t ? malloc(64 << 10) : NULL;
  if (frag) t->ops->inspect(t, frag, 64 << 10);
  if (json) kvf__sb_printf(b, frag ? ", \"rdma\": {%s}" : ", \"rdma\": null", frag);
  else kvf__sb_printf(b, "rdma            %s\n", frag ? frag : "off");
  /* What a peer can write into our pools (memory windows or not). */
  if (!json && t && t->ops->protection(t)) kvf__sb_printf(b, "rdma writes     %s\n", t->ops->protection(t));
  free(frag);
}

/* "cluster-key" when peers must prove the cluster key, else "off". */
static const char *auth_mode(void) { return kvf__auth_enabled() ? "cluster-key" : "off"; }

/* Bytes that active grants reserve, over all pools (0 when idle). */
static unsigned long long granted_bytes(void) {
  unsigned long long n = 0;
  for (const kvf__xfer *x = kvf__xfer_first(); x; x = x->next)
    if (x->role == KVF__RECV && x->state != KVF__X_DRAIN) n += kvf__xfer_bytes(x);
  return n;
}

/* The tcp transport's open grants and data streams (JSON only). */
static void tcp_status(kvf__sbuf *b) {
  kvf__transport *t = kvf__transport_find("tcp");
  char frag[512] = "";
  if (t) t->ops->inspect(t, frag, sizeof(frag));
  kvf__sb_printf(b, t ? ", \"tcp\": {%s}" : ", \"tcp\": null", frag);
}

static void render_status(kvf__sbuf *b, int json) {
  kvf__xfer_counts xc;
  kvf__xfer_counts_get(&xc);
  const kvf__stats *st = &kvfd.stats;
  double up = (double)(kvf__now_ns() - kvfd.start_ns) / 1e9;
  if (!json) {
    kvf__sb_printf(b, "node            %s\nversion         %s\npid             %d\nuptime          %.1f s\n"
                      "api socket      %s\npeer listen     %s:%d\nclients         %zu\npeers           %zu up of %zu\n"
                      "transfers       %zu active (%zu grants, %zu sends), %zu pre-grants, %zu waiting sends\n"
                      "completed       %llu done, %llu failed\nbytes           %llu sent, %llu received\n"
                      "pools           %zu (%zu engine memory)\n",
                   kvfd.cfg.node, KVF__VERSION, (int)getpid(), up, kvfd.cfg.api_socket, kvfd.cfg.listen_host,
                   kvf__peers_listen_port(), kvf__api_sessions(), peers_up(), kvf__peer_count(), xc.active,
                   xc.grants, xc.sends, xc.pregrants, xc.intents, (unsigned long long)st->transfers_done,
                   (unsigned long long)st->transfers_failed, (unsigned long long)st->bytes_sent,
                   (unsigned long long)st->bytes_received, kvfd.cfg.n_pools + kvf__pool_engine_count(),
                   kvf__pool_engine_count());
    kvf__sb_printf(b, "metrics         %s\nstate           %s\ncuda            %s\n",
                   kvf__metrics_url()[0] ? kvf__metrics_url() : "off", run_state(), kvf__gpu_why());
    kvf__sb_printf(b, "auth            %s (%llu refused)\n", auth_mode(),
                   (unsigned long long)st->auth_failures);
    kvf__sb_printf(b, "unread output   %zu bytes (%llu clients dropped for api-output-budget)\n",
                   kvf__api_output_bytes(), (unsigned long long)st->api_output_drops);
    kvf__registry_render(b, false);
    rdma_status(b, json);
    return;
  }
  kvf__sb_printf(b, "{\"node\": ");
  kvf__sb_json_str(b, kvfd.cfg.node);
  kvf__sb_printf(b, ", \"version\": \"%s\", \"pid\": %d, \"uptime_s\": %.3f, \"api_socket\": ", KVF__VERSION,
                 (int)getpid(), up);
  kvf__sb_json_str(b, kvfd.cfg.api_socket);
  kvf__sb_printf(b, ", \"peer_port\": %d, \"clients\": %zu, \"peers_total\": %zu, \"peers_up\": %zu, "
                    "\"transfers_active\": %zu, \"grants_active\": %zu, \"sends_active\": %zu, "
                    "\"pregrants\": %zu, \"waiting_sends\": %zu, \"transfers_done\": %llu, "
                    "\"transfers_failed\": %llu, \"bytes_sent\": %llu, \"bytes_received\": %llu, "
                    "\"api_errors\": %llu, \"peer_errors\": %llu, \"transports\": [%s\"tcp\", \"local\"], \"pools\": ",
                 kvf__peers_listen_port(), kvf__api_sessions(), kvf__peer_count(), peers_up(), xc.active,
                 xc.grants, xc.sends, xc.pregrants, xc.intents, (unsigned long long)st->transfers_done,
                 (unsigned long long)st->transfers_failed, (unsigned long long)st->bytes_sent,
                 (unsigned long long)st->bytes_received, (unsigned long long)st->api_errors,
                 (unsigned long long)st->peer_errors, kvf__transport_find("rdma") ? "\"rdma\", " : "");
  pools_json(b);
  kvf__sb_printf(b, ", \"engine_pools\": %zu, \"metrics\": ", kvf__pool_engine_count());
  kvf__sb_json_str(b, kvf__metrics_url());
  kvf__sb_printf(b, ", \"state\": \"%s\"", run_state());
  kvf__sb_printf(b, ", \"auth\": \"%s\", \"auth_failures\": %llu", auth_mode(),
                 (unsigned long long)st->auth_failures);
  kvf__gpu_stats gs;
  kvf__gpu_stats_get(&gs);
  kvf__sb_printf(b, ", \"cuda\": {\"ready\": %s, \"gpus\": %d, \"detail\": ", kvf__gpu_ready() ? "true" : "false",
                 kvf__gpu_count());
  kvf__sb_json_str(b, kvf__gpu_why());
  kvf__sb_printf(b, ", \"kernel_launches\": %llu, \"kernel_chunks\": %llu, \"kernel_bytes\": %llu, "
                    "\"staged_bytes\": %llu, \"fallback_bytes\": %llu, \"errors\": %llu, "
                    "\"block_copy\": \"%s\", \"block_launches\": %llu, \"block_pieces\": %llu, "
                    "\"block_bytes\": %llu, \"block_kernel_us\": %.1f}",
                 (unsigned long long)gs.launches, (unsigned long long)gs.chunks, (unsigned long long)gs.bytes_kernel,
                 (unsigned long long)gs.bytes_staged, (unsigned long long)gs.bytes_fallback,
                 (unsigned long long)gs.errors, kvf__gpu_blocks_kernel() ? "kernel" : "cuMemcpy per run (no kernel)",
                 (unsigned long long)gs.block_launches, (unsigned long long)gs.block_pieces,
                 (unsigned long long)gs.block_bytes, (double)gs.block_kernel_ns / 1e3);
  rdma_status(b, json);
  kvf__sb_printf(b, ", \"granted_bytes\": %llu", granted_bytes());
  kvf__sb_printf(b, ", \"api_output_bytes\": %zu, \"api_output_drops\": %llu, \"api_soon\": %llu",
                 kvf__api_output_bytes(), (unsigned long long)st->api_output_drops,
                 (unsigned long long)st->api_soon);
  kvf__sb_printf(b, ", \"spin_backoffs\": {");
  for (int i = 0; i < KVF__SPIN_N; i++)
    kvf__sb_printf(b, "%s\"%s\": %llu", i ? ", " : "", kvf__spin_kind_name(i),
                   (unsigned long long)kvf__spin_backoffs(i));
  kvf__sb_printf(b, "}");
  tcp_status(b);
  kvf__registry_render(b, true);
  kvf__sb_printf(b, "}\n");
}

static void render_pools(kvf__sbuf *b, int json) {
  if (json) {
    kvf__sb_printf(b, "{\"pools\": ");
    pools_json(b);
    kvf__sb_printf(b, "}\n");
    return;
  }
  kvf__sb_printf(b, "%-4s %-20s %-8s %14s %-17s %-6s %s\n", "ID", "NAME", "KIND", "SIZE", "BACKING", "LOCKED",
                 "NIC REGISTRATION");
  for (size_t i = 0; i < kvfd.n_pools; i++) {
    const kvf__pool *p = kvfd.pools[i];
    if (!p) continue;
    kvf__sb_printf(b, "%-4u %-20s %-8s %14llu %-17s %-6s %s\n", p->id, p->name, p->kind,
                   (unsigned long long)p->size, p->backing, p->locked ? "yes" : "no",
                   kvf__pool_gpu(p) && strcmp(p->nic_reg, "none") == 0 ? "none (tcp-bounce)" : p->nic_reg);
  }
}

static void render_peers(kvf__sbuf *b, int json) {
  uint64_t now = kvf__now_ns();
  if (json) kvf__sb_printf(b, "{\"peers\": [");
  else kvf__sb_printf(b, "%-16s %-24s %-11s %-9s %10s %6s %s\n", "NAME", "ADDRESS", "STATE", "TRANSPORT",
                      "UP (s)", "DOWNS", "LAST ERROR");
  for (size_t i = 0; i < kvf__peer_count(); i++) {
    const kvf__peer *p = kvf__peer_at(i);
    char addr[300];
    peer_addr(p, addr, sizeof(addr));
    double up = p->state == KVF__PEER_UP ? (double)(now - p->up_since_ns) / 1e9 : 0;
    const char *tp = p->state == KVF__PEER_UP && p->tp ? p->tp->ops->name : "-";
    if (!json) {
      kvf__sb_printf(b, "%-16s %-24s %-11s %-9s %10.1f %6llu %s\n", p->cfg.name, addr,
                     kvf__peer_state_name(p->state), tp, up, (unsigned long long)p->downs, p->last_error);
      continue;
    }
    kvf__sb_printf(b, "%s{\"name\": ", i ? ", " : "");
    kvf__sb_json_str(b, p->cfg.name);
    kvf__sb_printf(b, ", \"address\": ");
    kvf__sb_json_str(b, addr);
    kvf__sb_printf(b, ", \"state\": \"%s\", \"transport\": \"%s\", \"session\": \"%016llx\", \"up_s\": %.3f, "
                      "\"ups\": %llu, \"downs\": %llu, \"last_error\": ",
                   kvf__peer_state_name(p->state), tp, (unsigned long long)p->remote_session, up,
                   (unsigned long long)p->ups, (unsigned long long)p->downs);
    kvf__sb_json_str(b, p->last_error);
    kvf__sb_printf(b, "}");
  }
  if (json) kvf__sb_printf(b, "]}\n");
}

#define PUT(b, lit) kvf__sb_put(b, lit, sizeof(lit) - 1)

static void put_str(kvf__sbuf *b, const char *s) { kvf__sb_put(b, s, strlen(s)); }

/* One row of the JSON list, without printf: a daemon with tens of
 * thousands of transfers renders them all per request. */
static void transfer_json(kvf__sbuf *b, const kvf__xfer *x, int first, const char *role, uint64_t descs,
                          unsigned long long age) {
  if (!first) PUT(b, ", ");
  PUT(b, "{\"id\": ");
  kvf__sb_json_str(b, x->id);
  PUT(b, ", \"role\": \"");
  put_str(b, role);
  PUT(b, "\", \"peer\": ");
  kvf__sb_json_str(b, x->peer_name);
  PUT(b, ", \"state\": \"");
  put_str(b, kvf__xstate_name(x->state));
  PUT(b, "\", \"path\": \"");
  put_str(b, kvf__xfer_path(x));
  PUT(b, "\", \"bytes\": ");
  kvf__sb_u64(b, kvf__xfer_bytes(x));
  PUT(b, ", \"descriptors\": ");
  kvf__sb_u64(b, descs);
  PUT(b, ", \"age_ms\": ");
  kvf__sb_u64(b, age);
  PUT(b, ", \"deadline_ms\": ");
  kvf__sb_u64(b, x->deadline_ms);
  char xf[96];
  if (kvf__xfer_transform(x, xf, sizeof(xf))) { /* blocks: whole, or heads/order/tokens transformed */
    PUT(b, ", \"transform\": ");
    kvf__sb_json_str(b, xf);
  }
  PUT(b, "}");
}

static void render_transfers(kvf__sbuf *b, int json) {
  uint64_t now = kvf__now_ns();
  if (json) kvf__sb_printf(b, "{\"transfers\": [");
  else kvf__sb_printf(b, "%-32s %-5s %-16s %-11s %-6s %14s %8s %8s\n", "ID", "ROLE", "PEER", "STATE", "PATH",
                      "BYTES", "DESCS", "AGE (ms)");
  int first = 1;
  for (kvf__xfer *x = kvf__xfer_first(); x; x = x->next) {
    const char *role = x->role == KVF__RECV ? "recv" : "send";
    uint64_t descs = kvf__xfer_descriptors(x);
    unsigned long long age = (unsigned long long)((now - x->created_ns) / 1000000ull);
    if (!json) {
      kvf__sb_printf(b, "%-32s %-5s %-16s %-11s %-6s %14llu %8llu %8llu\n", x->id, role,
                     x->peer_name[0] ? x->peer_name : "-", kvf__xstate_name(x->state), kvf__xfer_path(x),
                     (unsigned long long)kvf__xfer_bytes(x), (unsigned long long)descs, age);
      continue;
    }
    transfer_json(b, x, first, role, descs, age);
    first = 0;
  }
  if (json) kvf__sb_printf(b, "]}\n");
}

static const char *order_name(uint32_t order) { return order == KVF_LAYOUT_HND ? "HND" : "NHD"; }

static void render_layouts(kvf__sbuf *b, int json) {
  if (json) kvf__sb_printf(b, "{\"layouts\": [");
  else kvf__sb_printf(b, "%-6s %-7s %-8s %-16s %6s %3s %8s %10s %10s %s\n", "ID", "CLIENT", "PID", "POOL", "LAYERS",
                      "KV", "BLOCKS", "BLOCK", "STRIDE", "GEOMETRY (tokens x heads x dim x bytes, order)");
  int first = 1;
  for (const kvf__layout *l = kvf__layouts_first(); l; l = kvf__layouts_next(l)) {
    const kvf__lgeom *g = &l->geom;
    const kvf__pool *lp = kvf__pool_get(l->pool);
    const char *pool = lp ? lp->name : "?";
    if (!json) {
      kvf__sb_printf(b, "%-6u %-7u %-8d %-16s %6u %3u %8u %10llu %10llu %u x %u x %u x %u, %s\n", l->id,
                     kvf__api_session_id(l->owner), (int)kvf__api_session_pid(l->owner), pool, l->n_layers,
                     l->n_kv, l->n_blocks, (unsigned long long)l->block_bytes,
                     (unsigned long long)l->block_stride, g->tokens_per_block, g->kv_heads, g->head_dim,
                     g->dtype_bytes, order_name(g->order));
      if (g->model_heads) /* tensor parallelism: which heads */
        kvf__sb_printf(b, "%*sheads %u-%u of %u\n", 71, "", g->first_head, g->first_head + g->kv_heads - 1,
                       g->model_heads);
      continue;
    }
    kvf__sb_printf(b, "%s{\"id\": %u, \"client\": %u, \"pid\": %d, \"pool\": ", first ? "" : ", ", l->id,
                   kvf__api_session_id(l->owner), (int)kvf__api_session_pid(l->owner));
    first = 0;
    kvf__sb_json_str(b, pool);
    kvf__sb_printf(b, ", \"pool_id\": %u, \"layers\": %u, \"n_kv\": %u, \"blocks\": %u, \"block_bytes\": %llu, "
                      "\"block_stride\": %llu, \"tokens_per_block\": %u, \"kv_heads\": %u, \"head_dim\": %u, "
                      "\"dtype_bytes\": %u, \"order\": \"%s\", \"first_head\": %u, \"model_kv_heads\": %u, "
                      "\"transfers\": %u}",
                   l->pool, l->n_layers, l->n_kv, l->n_blocks, (unsigned long long)l->block_bytes,
                   (unsigned long long)l->block_stride, g->tokens_per_block, g->kv_heads, g->head_dim,
                   g->dtype_bytes, order_name(g->order), g->first_head, g->model_heads, l->refs - 1);
  }
  if (json) kvf__sb_printf(b, "]}\n");
}

char *kvf__inspect_render(int what, int json) {
  kvf__sbuf b = {0};
  switch (what) {
  case KVF__INSPECT_WHAT__INSPECT_POOLS: render_pools(&b, json); break;
  case KVF__INSPECT_WHAT__INSPECT_PEERS: render_peers(&b, json); break;
  case KVF__INSPECT_WHAT__INSPECT_TRANSFERS: render_transfers(&b, json); break;
  case KVF__INSPECT_WHAT__INSPECT_LAYOUTS: render_layouts(&b, json); break;
  case KVF__INSPECT_WHAT__INSPECT_TRACE: kvf__xtrace_render(&b, json); break;
  default: render_status(&b, json); break;
  }
  if (b.oom || !b.s) {
    kvf__sb_free(&b);
    return NULL;
  }
  return b.s;
}
