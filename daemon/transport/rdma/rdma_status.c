/* rdma_status.c - what the rdma transport reports: its part of status and
 * inspect (devices, peers' queue pairs, the posting cost, memory windows)
 * and its metrics families. Read on the loop; the threads' counters are
 * atomics. */
#include "rdma_int.h"

#include <stdarg.h>
#include <stdio.h>

#include "json.h"
#include "metrics.h"
#include "pool.h"

/* Scrape-time gauges: queue pairs per peer and device, and the devices.
 * A collector takes no argument: the instance is the daemon's rdma
 * transport, found by name (none once it is destroyed). */
void kvf__rdma_metrics(kvf__sbuf *b) {
  kvf__transport *t = kvf__transport_find("rdma");
  if (!t) return;
  rdma_transport *rt = to_rdma(t);
  kvf__metrics_family(b, "kvferry_rdma_devices", "gauge", "RDMA devices in use.");
  kvf__sb_printf(b, "kvferry_rdma_devices %d\n", rt->n_devs);
  kvf__metrics_family(b, "kvferry_rdma_queue_pairs", "gauge",
                      "Connected RDMA queue pairs, by peer and local device.");
  for (size_t i = 0; i < rt->n_peers; i++) {
    rpeer *rp = rt->peers[i];
    for (int j = 0; rp && j < rp->n_links; j++) {
      rlink *lk = rp->links[j];
      if (!lk) continue;
      kvf__sb_printf(b, "kvferry_rdma_queue_pairs{peer=");
      kvf__metrics_label(b, peer_name(rp));
      kvf__sb_printf(b, ",device=");
      kvf__metrics_label(b, lk->dev->name);
      kvf__sb_printf(b, "} %u\n", atomic_load(&lk->n_qps));
    }
  }
  kvf__metrics_family(b, "kvferry_rdma_bounce_bytes_total", "counter",
                      "Bytes the rdma bounce path staged through pinned memory (path rdma-bounce), by device "
                      "and direction.");
  for (int i = 0; i < rt->n_devs; i++) {
    const rdev *d = &rt->devs[i];
    kvf__sb_printf(b, "kvferry_rdma_bounce_bytes_total{device=");
    kvf__metrics_label(b, d->name);
    kvf__sb_printf(b, ",dir=\"send\"} %llu\n", (unsigned long long)atomic_load(&d->bb.tx_bytes));
    kvf__sb_printf(b, "kvferry_rdma_bounce_bytes_total{device=");
    kvf__metrics_label(b, d->name);
    kvf__sb_printf(b, ",dir=\"recv\"} %llu\n", (unsigned long long)atomic_load(&d->bb.rx_bytes));
  }
}

/* ------------------------------------------------------------ status */

typedef struct jbuf {
  char *p;
  size_t len, n;
} jbuf;

static void jb(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void jb(jbuf *b, const char *fmt, ...) {
  if (b->n >= b->len) return;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(b->p + b->n, b->len - b->n, fmt, ap);
  va_end(ap);
  if (k > 0) b->n += (size_t)k;
}

static double per(uint64_t ns, uint64_t n) { return n ? (double)ns / (double)n : 0; }

/* A string value, escaped (device checks quote the verbs' words). */
static void jb_str(jbuf *b, const char *s) {
  if (b->n >= b->len) return;
  size_t k = kvf__json_quote(b->p + b->n, b->len - b->n, s);
  b->n = b->n + k < b->len ? b->n + k : b->len; /* cut, like jb */
}

static void inspect_device_windows(jbuf *b, const rdev *d) {
  const char *use = d->rt->mw.on                                        ? "type 2 in use"
                    : kvfd.cfg.rdma_memory_windows == KVF__OFF ? "off by config"
                    : d->mw2                                   ? "unusable"
                                                               : "not supported";
  jb(b, ", \"memory_windows\": \"%s\", \"mw_bounds\": \"%s\", \"mw_check\": ", use,
     d->mw2 ? kvf__mw_bounds_name(d->mw_bounds) : "-");
  jb_str(b, d->mw_check);
}

/* The memory windows: in use or not, what that means, and how many. */
static void inspect_windows(jbuf *b, const rdma_transport *rt) {
  static const char *const modes[] = {"auto", "on", "off"};
  bool enforced = rt->mw.on;
  for (int i = 0; i < rt->n_devs; i++) enforced &= rt->devs[i].mw_bounds == KVF__MW_BOUNDS_ENFORCED;
  size_t binding = 0;
  for (rgrant *g = rt->mw.binding; g; g = g->next_b) binding++;
  jb(b, ", \"memory_windows\": {\"mode\": \"%s\", \"in_use\": %s, \"bounds_enforced\": %s, \"protection\": ",
     modes[kvfd.cfg.rdma_memory_windows % 3], rt->mw.on ? "true" : "false", enforced ? "true" : "false");
  jb_str(b, rt->protection);
  jb(b, ", \"max_per_grant\": %u, \"live\": %llu, \"bound\": %llu, \"grants\": %llu, \"binding\": %zu, "
        "\"merged_grants\": %llu, \"failed_grants\": %llu, \"bind_us_per_window\": %.2f, "
        "\"last_grant_windows\": %zu, \"last_bind_ms\": %.3f, \"lookups\": %llu, \"searches\": %llu}",
     kvfd.cfg.rdma_mw_max_windows, (unsigned long long)rt->mw.live, (unsigned long long)rt->mw.bound,
     (unsigned long long)rt->mw.grants, binding, (unsigned long long)rt->mw.merged, (unsigned long long)rt->mw.failed,
     per(rt->mw.bind_ns, rt->mw.bound) / 1000.0, rt->mw.last_win, (double)rt->mw.last_bind_ns / 1e6,
     (unsigned long long)rt->mw.lookups, (unsigned long long)rt->mw.searches);
}

static void inspect_devices(jbuf *b, const rdma_transport *rt) {
  jb(b, "\"devices\": [");
  for (int i = 0; i < rt->n_devs; i++) {
    const rdev *d = &rt->devs[i];
    struct ibv_port_attr pa;
    const char *state = ibv_query_port(d->ctx, d->port, &pa) == 0 && pa.state == IBV_PORT_ACTIVE ? "active" : "down";
    char gid[INET6_ADDRSTRLEN];
    inet_ntop(AF_INET6, d->gid.raw, gid, sizeof(gid));
    jb(b, "%s{\"name\": \"%s\", \"port\": %u, \"state\": \"%s\", \"gid\": \"%s\", \"gid_index\": %u, "
          "\"cm\": \"%s:%u\", \"pools_registered\": %zu, \"work_requests\": %llu, \"bytes\": %llu, "
          "\"doorbells\": %llu, \"completions\": %llu, \"notices\": %llu, \"sleeps\": %llu, "
          "\"max_sge\": %u, \"write_sge\": %u",
       i ? ", " : "", d->name, d->port, state, gid, d->gid_index, d->ip, d->cm_port, kvfd.n_pools,
       (unsigned long long)atomic_load(&d->wrs), (unsigned long long)atomic_load(&d->bytes),
       (unsigned long long)atomic_load(&d->chains), (unsigned long long)atomic_load(&d->cqes),
       (unsigned long long)atomic_load(&d->imms), (unsigned long long)atomic_load(&d->sleeps), d->max_sge,
       d->write_sge);
    inspect_device_windows(b, d);
    jb(b, ", \"bounce\": {\"staging_bytes\": %zu, \"chunk\": %zu, \"send_chunks\": %u, \"recv_slots\": %u, "
          "\"sent_bytes\": %llu, \"sent_chunks\": %llu, \"received_bytes\": %llu, \"received_chunks\": %llu, "
          "\"credits_sent\": %llu, \"stalls\": %llu}}",
       d->bb.len, d->bb.chunk, d->bb.n_tx, d->bb.n_rx, (unsigned long long)atomic_load(&d->bb.tx_bytes),
       (unsigned long long)atomic_load(&d->bb.tx_chunks), (unsigned long long)atomic_load(&d->bb.rx_bytes),
       (unsigned long long)atomic_load(&d->bb.rx_chunks), (unsigned long long)atomic_load(&d->bb.credits),
       (unsigned long long)atomic_load(&d->bb.stalls));
  }
  jb(b, "]");
}

static void inspect_peers(jbuf *b, const rdma_transport *rt) {
  jb(b, ", \"peers\": [");
  for (size_t i = 0; i < rt->n_peers; i++) {
    rpeer *rp = rt->peers[i];
    jb(b, "%s{\"name\": \"%s\", \"resets\": %u, \"qps\": [", i ? ", " : "", peer_name(rp), rp->resets);
    int k = 0;
    for (int l = 0; l < rp->n_links; l++) {
      rlink *lk = rp->links[l];
      for (unsigned j = 0; j < lk->n_all; j++) {
        rqp *q = lk->all[j];
        if (q->gone) continue;
        jb(b, "%s{\"device\": \"%s\", \"peer_device\": \"%s\", \"qp\": %u, \"dir\": \"%s\", \"state\": \"%s\", "
              "\"work_requests\": %llu, \"bytes\": %llu}",
           k++ ? ", " : "", lk->dev->name, lk->peer_dev, q->qp_num, q->outbound ? "out" : "in",
           q->established ? "connected" : "connecting", (unsigned long long)atomic_load(&q->wrs),
           (unsigned long long)atomic_load(&q->bytes));
      }
    }
    jb(b, "]}");
  }
  jb(b, "]");
}

/* The posting cost: on the loop (ticket, slicing, checks) per run, in the
 * progress threads (building work requests, then ibv_post_send, which on
 * soft-RoCE also runs the emulated NIC) per work request. */
static void inspect_post(jbuf *b, const rdma_transport *rt) {
  uint64_t wrs = 0, build = 0, bell = 0;
  for (int i = 0; i < rt->n_devs; i++) {
    wrs += atomic_load(&rt->devs[i].wrs);
    build += atomic_load(&rt->devs[i].build_ns);
    bell += atomic_load(&rt->devs[i].bell_ns);
  }
  jb(b, ", \"post\": {\"calls\": %llu, \"runs\": %llu, \"work_requests\": %llu, \"loop_ns_per_run\": %.1f, "
        "\"build_ns_per_wr\": %.1f, \"doorbell_ns_per_wr\": %.1f, \"last_work_requests\": %llu, "
        "\"last_loop_ns_per_wr\": %.1f, \"last_build_ns_per_wr\": %.1f, \"last_doorbell_ns_per_wr\": %.1f}",
     (unsigned long long)rt->post.calls, (unsigned long long)rt->post.runs, (unsigned long long)wrs,
     per(rt->post.ns, rt->post.runs), per(build, wrs), per(bell, wrs), (unsigned long long)rt->post.last_wrs,
     per(rt->post.last_loop_ns, rt->post.last_wrs), per(rt->post.last_build_ns, rt->post.last_wrs), per(rt->post.last_bell_ns, rt->post.last_wrs));
}

void kvf__rdma_inspect(kvf__transport *t, char *buf, size_t len) {
  const rdma_transport *rt = to_rdma(t);
  jbuf b = {buf, len, 0};
  if (len) buf[0] = 0;
  jb(&b, "\"name\": \"rdma\", \"qps_per_peer\": %u, \"queue_depth\": %u, \"slice\": %u, \"inline\": %u, ",
     kvfd.cfg.rdma_qps_per_peer, kvfd.cfg.rdma_queue_depth, kvfd.cfg.rdma_slice, kvfd.cfg.rdma_inline);
  inspect_devices(&b, rt);
  inspect_peers(&b, rt);
  inspect_post(&b, rt);
  size_t parked_n = 0;
  for (parked *pk = rt->parked; pk; pk = pk->next) parked_n++;
  jb(&b, ", \"open_grants\": %zu, \"parked_requests\": %zu", rt->grants.n, parked_n);
  jb(&b, ", \"gpu_direct\": \"%s\", \"bounce\": {\"grants\": %llu, \"sends\": %llu, \"waited_for_slots\": %llu, "
         "\"pools\": [", kvfd.cfg.gpu_direct == KVF__GDR_OFF ? "off" : "auto", (unsigned long long)rt->bounce.grants,
     (unsigned long long)rt->bounce.sends, (unsigned long long)rt->bounce.waits);
  for (size_t i = 0, k = 0; i < rt->n_pool_slots; i++) {
    const kvf__pool *p = kvf__pool_get((uint32_t)i);
    if (p && rt->pool_bounce[i]) jb(&b, "%s\"%s\"", k++ ? ", " : "", p->name);
  }
  jb(&b, "]}");
  jb(&b, ", \"staging\": {\"bytes\": %zu, \"slices\": %zu, \"grants\": %llu, \"no_room\": %llu, "
         "\"staged_parts\": %llu, \"chunks\": %llu, \"passes\": %llu, \"pass_bytes\": %llu, \"pass_ms\": %.3f, "
         "\"tail_ms\": %.3f, \"gpu_passes\": %llu, \"cuda_mapped\": %s, \"strided_parts\": %llu}",
     rt->stage.len, rt->stage.n_used, (unsigned long long)rt->stage.grants, (unsigned long long)rt->stage.refused,
     (unsigned long long)rt->stage.staged_parts, (unsigned long long)rt->stage.chunks,
     (unsigned long long)rt->stage.passes, (unsigned long long)rt->stage.bytes, rt->stage.pass_ns / 1e6,
     rt->stage.tail_ns / 1e6, (unsigned long long)rt->stage.gpu_passes, rt->stage.alias ? "true" : "false",
     (unsigned long long)rt->stage.strided_parts);
  inspect_windows(&b, rt);
}

