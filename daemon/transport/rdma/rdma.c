/* rdma.c - the rdma transport: one-sided RDMA WRITE over reliable-connected
 * queue pairs, set up through librdmacm (rdma-core). This file holds the
 * ops table, the instance's start and its teardown; the rest is split by
 * concern, over one private header (rdma_int.h):
 *
 *   rdma_dev.c     devices: discovery, registration of the pools, CM
 *                  listeners, progress threads, device async events
 *   rdma_conn.c    connections: the CM, queue pairs, peers, the Hello
 *   rdma_post.c    the data path: posting, the progress threads, and what
 *                  they hand back to the loop
 *   rdma_mw.c      memory windows: deciding on them, binding them per
 *                  grant (receiver), writing through them (sender)
 *   rdma_status.c  status (inspect) and metrics
 *
 * Setup. At start each device (named by rdma-devices, or every active RoCE
 * port whose address matches ours) is opened, every pool is registered with
 * it once (never on the transfer path), and a CM listener is bound to the IP
 * of the device's GID - never a wildcard, as several daemons may share one
 * host. The Hello carries, per device, that address and port and, per pool,
 * its address (and rkey without memory windows). When a peer comes up, this
 * daemon dials rdma-qps-per-peer QPs from each of its devices and uses them
 * only to write; the peer dials its own QPs to us.
 *
 * Data path. ops->post turns the coalesced runs into a ticket queued on the
 * peer; one progress thread per device claims chunks of it for each of its
 * QPs that has room and rings the doorbell once per chain. The last write of
 * a transfer goes once every other write completed, as WRITE_WITH_IMM
 * carrying the grant's token: its completion at the receiver proves that
 * all the data is placed (kvf__xfer_on_delivered there).
 *
 * Threads. The loop owns the CM, the peers and the grants; the progress
 * threads own the QPs and CQs of their device; they hand results to the loop
 * through the instance's mailbox (mailbox.h). A reaper thread destroys dead
 * links, which can block.
 *
 * Memory. Which bytes a peer can write depends on rdma-memory-windows
 * (decided at start, said by ops->protection in status and doctor): with
 * memory windows the pools are registered without remote access and a
 * grant's ranges are reachable only through the type 2 windows bound for
 * it, from the QP each is bound on, until grant_close invalidates them
 * (rdma_mw.c); without them, through each pool's rkey, any byte of a
 * registered pool at any time. MRs belong to the pools and live until the
 * transport is destroyed. */
#include "rdma_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "pool.h"

/* ------------------------------------------------------------ start */

/* The loop's handles: the mailbox, the CM channel, the sweep and memory
 * window timers, each device's async events. */
static int start_handles(rdma_transport *rt, char *err, size_t errlen) {
  uv_loop_t *loop = rt->base.loop;
  int rc = kvf__mailbox_init(&rt->mb, loop);
  if (rc) {
    snprintf(err, errlen, "cannot set up the rdma transport's mailbox: %s", uv_strerror(rc));
    return rc;
  }
  uv_poll_init(loop, &rt->cm_poll, rt->cm->fd);
  uv_poll_start(&rt->cm_poll, UV_READABLE, kvf__rdma_on_cm_readable);
  uv_timer_init(loop, &rt->sweep);
  uv_timer_start(&rt->sweep, kvf__rdma_on_sweep, 250, 250);
  uv_unref((uv_handle_t *)&rt->sweep);
  uv_timer_init(loop, &rt->mw.timer);
  uv_timer_init(loop, &rt->bounce.timer);
  for (int i = 0; i < rt->n_devs; i++) {
    rdev *d = &rt->devs[i];
    uv_poll_init(loop, &d->async_poll, d->ctx->async_fd);
    d->async_poll.data = d;
    uv_poll_start(&d->async_poll, UV_READABLE, kvf__rdma_on_dev_async);
    d->async_on = true;
  }
  rt->handles = true;
  return 0;
}

/* Devices, pools, windows, the CM, then the threads; on error the caller
 * tears down what was made. */
static int start(rdma_transport *rt, char *err, size_t errlen) {
  int rc = kvf__rdma_open_devices(rt, err, errlen);
  if (rc == 0) rc = kvf__rdma_check_memlock(rt, err, errlen);
  if (rc) return rc;
  kvf__rdma_calibrate_clock();
  rt->n_pool_slots = KVF__RDMA_SLOTS; /* the pools', then the staging arena's (rdma_stage.c) */
  rt->n_hello_pools = kvfd.n_pools;
  rt->pool_base = calloc(KVF__RDMA_SLOTS, sizeof(*rt->pool_base));
  rt->pool_bounce = calloc(KVF__RDMA_SLOTS, sizeof(*rt->pool_bounce));
  if (!rt->pool_base || !rt->pool_bounce) return -ENOMEM;
  for (size_t i = 0; i < kvfd.n_pools; i++) {
    const kvf__pool *p = kvf__pool_get((uint32_t)i);
    if (!p) continue;
    rt->pool_base[i] = p->base;
    rt->any_gpu |= kvf__pool_gpu(p);
  }
  for (int i = 0; rc == 0 && i < rt->n_devs; i++) rc = kvf__rdma_setup_device(&rt->devs[i], err, errlen);
  if (rc == 0) rc = kvf__rdma_decide_windows(rt, err, errlen);
  for (int i = 0; rc == 0 && i < rt->n_devs; i++) rc = kvf__rdma_register_pools(&rt->devs[i], err, errlen);
  if (rc == 0) rc = kvf__rdma_stage_setup(rt, err, errlen);
  if (rc) return rc;
  rt->cm = rdma_create_event_channel();
  if (!rt->cm || set_nonblock(rt->cm->fd)) {
    snprintf(err, errlen, "cannot open the RDMA CM (rdma_ucm loaded?)");
    return -ENODEV;
  }
  for (int i = 0; rc == 0 && i < rt->n_devs; i++) rc = kvf__rdma_start_listener(&rt->devs[i], kvfd.cfg.rdma_listen_port, err, errlen);
  if (rc == 0) rc = start_handles(rt, err, errlen);
  for (int i = 0; rc == 0 && i < rt->n_devs; i++) rc = kvf__rdma_start_thread(&rt->devs[i], err, errlen);
  if (rc == 0 && pthread_create(&rt->reaper.thr, NULL, kvf__rdma_reaper_main, rt) != 0) {
    snprintf(err, errlen, "cannot start the reaper thread");
    rc = -EAGAIN;
  }
  rt->reaper.on = rc == 0;
  if (rc == 0) rc = kvf__spin_wakers_add(KVF__SPIN_SEND, kvf__rdma_threads_wake, rt);
  if (rc == 0) rc = kvf__spin_wakers_add(KVF__SPIN_RECV, kvf__rdma_threads_wake, rt);
  if (rc == 0) kvf__metrics_add_collector(kvf__rdma_metrics);
  return rc;
}

/* ------------------------------------------------------------ teardown */

static void stop_reaper(rdma_transport *rt) {
  if (!rt->reaper.on) return;
  pthread_mutex_lock(&rt->reaper.lock);
  rt->reaper.stop = true;
  pthread_cond_signal(&rt->reaper.cond);
  pthread_mutex_unlock(&rt->reaper.lock);
  pthread_join(rt->reaper.thr, NULL); /* it destroys what is queued first */
  rt->reaper.on = false;
}

/* The instance is freed once its teardown is over and every handle it
 * closed is closed: libuv touches a handle until its close callback ran. */
static void unref(rdma_transport *rt) {
  if (--rt->closing == 0) free(rt);
}

static void on_closed(uv_handle_t *h) { unref(h->data); }
static void on_mailbox_closed(kvf__mailbox *mb) { unref(kvf__container_of(mb, rdma_transport, mb)); }

static void close_handle(rdma_transport *rt, uv_handle_t *h) {
  h->data = rt;
  rt->closing++;
  uv_close(h, on_closed);
}

static void stop_device(rdev *d) {
  if (d->started) {
    kvf__rdma_send_cmd(d, CMD_STOP, NULL);
    pthread_join(d->thr, NULL);
    d->started = false;
  }
  if (d->listener) rdma_destroy_id(d->listener);
  d->listener = NULL;
  if (d->async_on) {
    uv_poll_stop(&d->async_poll);
    close_handle(d->rt, (uv_handle_t *)&d->async_poll);
    d->async_on = false;
  }
}

/* Everything, in the order the libraries need: threads off the QPs, QPs and
 * ids before the event channel, MRs before the PD. */
static void teardown(rdma_transport *rt) {
  kvf__spin_wakers_remove(rt);
  while (rt->n_peers) kvf__rdma_peer_down(&rt->base, rt->peers[0]->p);
  stop_reaper(rt);
  kvf__rdma_sweep_parked(rt, NULL, true);
  for (int i = 0; i < rt->n_devs; i++) stop_device(&rt->devs[i]);
  if (rt->handles) {
    uv_poll_stop(&rt->cm_poll);
    close_handle(rt, (uv_handle_t *)&rt->cm_poll);
    rt->closing++;
    kvf__mailbox_close(&rt->mb, on_mailbox_closed); /* delivers what is left first */
    uv_timer_stop(&rt->sweep);
    close_handle(rt, (uv_handle_t *)&rt->sweep);
    uv_timer_stop(&rt->mw.timer);
    close_handle(rt, (uv_handle_t *)&rt->mw.timer);
    uv_timer_stop(&rt->bounce.timer);
    close_handle(rt, (uv_handle_t *)&rt->bounce.timer);
    rt->handles = false;
  }
  kvf__rdma_free_grants(rt);
  for (int i = 0; i < rt->n_devs; i++) kvf__rdma_free_device(&rt->devs[i]);
  kvf__rdma_stage_free(rt);
  if (rt->cm) rdma_destroy_event_channel(rt->cm);
  if (rt->all) rdma_free_devices(rt->all);
  free(rt->pool_base);
  free(rt->pool_bounce);
  free(rt->hello.mr);
  free(rt->hello.mr_ptr);
  pthread_mutex_destroy(&rt->reaper.lock);
  pthread_cond_destroy(&rt->reaper.cond);
  pthread_mutex_destroy(&rt->bounce.lock);
}

static void rdma_destroy(kvf__transport *t) {
  rdma_transport *rt = to_rdma(t);
  teardown(rt);
  unref(rt);
}

/* ------------------------------------------------------------ the transport */

static const char *rdma_protection(kvf__transport *t) { return to_rdma(t)->protection; }

static const kvf__transport_ops rdma_ops = {
    .name = "rdma",
    .one_sided = true,
    .usable = kvf__rdma_usable,
    .post = kvf__rdma_post,
    .post_blocks = kvf__rdma_post_blocks,
    .mark_layers = kvf__rdma_mark_layers,
    .unstage = kvf__rdma_unstage,
    .abort = kvf__rdma_abort,
    .xfer_done = kvf__rdma_xfer_done,
    .grant_open = kvf__rdma_grant_open,
    .grant_close = kvf__rdma_grant_close,
    .peer_up = kvf__rdma_peer_up,
    .peer_down = kvf__rdma_peer_down,
    .pool_added = kvf__rdma_pool_added,
    .pool_removed = kvf__rdma_pool_removed,
    .hello = kvf__rdma_hello,
    .protection = rdma_protection,
    .inspect = kvf__rdma_inspect,
    .destroy = rdma_destroy,
};

static void log_devices(const rdma_transport *rt) {
  size_t bounced = 0;
  for (size_t i = 0; i < kvfd.n_pools; i++) bounced += rt->pool_bounce[i];
  for (int i = 0; i < rt->n_devs; i++) {
    const rdev *d = &rt->devs[i];
    kvf__info("rdma: device %s port %u, GID[%u] %s, CM listening on %s:%u, %zu pool(s) registered, %zu "
              "bounced (gpu-direct %s; staging %zu MiB: %u chunks of %zu KiB)", d->name, d->port, d->gid_index,
              d->ip, d->ip, d->cm_port, kvfd.n_pools - bounced, bounced,
              kvfd.cfg.gpu_direct == KVF__GDR_OFF ? "off" : "auto", d->bb.len >> 20, d->bb.n_tx + d->bb.n_rx,
              d->bb.chunk >> 10);
  }
  if (rt->mw.on) kvf__info("rdma: writes: %s", rt->protection);
  else kvf__warn("rdma: writes: %s", rt->protection);
}

int kvf__rdma_create(uv_loop_t *loop, unsigned slot, kvf__transport **out, char *err, size_t errlen) {
  rdma_transport *rt = calloc(1, sizeof(*rt));
  if (!rt) return -ENOMEM;
  rt->closing = 1; /* the instance's own, dropped by destroy */
  kvf__transport_init(&rt->base, &rdma_ops, loop, slot);
  pthread_mutex_init(&rt->reaper.lock, NULL);
  pthread_cond_init(&rt->reaper.cond, NULL);
  pthread_mutex_init(&rt->bounce.lock, NULL);
  int rc = start(rt, err, errlen);
  if (rc == 0) rc = kvf__rdma_build_hello(rt);
  if (rc) {
    teardown(rt);
    unref(rt);
    return rc;
  }
  log_devices(rt);
  *out = &rt->base;
  return 0;
}

