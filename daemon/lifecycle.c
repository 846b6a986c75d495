/* lifecycle.c - SIGTERM drains, SIGHUP reloads (see lifecycle.h).
 *
 * Draining polls the number of live transfers rather than hooking every
 * place one ends: a 20 ms tick is far below any stop timeout worth having,
 * and it cannot miss a path added later. */
#include "lifecycle.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "kvferryd.h"
#include "metrics.h"
#include "notify.h"
#include "peer.h"
#include "xfer.h"

#define DRAIN_TICK_MS 20

static struct {
  uv_loop_t *loop;
  const char *config_path;
  kvf__stop_fn *stop;
  uv_signal_t term, intr, hup;
  uv_timer_t drain;
  bool open;
  uint64_t drain_end_ns;
} L;

static size_t live_transfers(void) {
  kvf__xfer_counts xc;
  kvf__xfer_counts_get(&xc);
  return xc.active;
}

/* ------------------------------------------------------------ SIGTERM */

/* Fails what is left while the clients are still connected, so that each
 * owner gets its event (ESHUTDOWN) and each peer a Cancel before the
 * connections close. (A transfer freed during the walk stays readable
 * until its handle's close callback, after this loop.) */
static void fail_remaining(void) {
  for (kvf__xfer *x = kvf__xfer_first(), *next; x; x = next) {
    next = x->next;
    if (x->state != KVF__X_DRAIN)
      kvf__xfer_on_data_error(x, -ESHUTDOWN, "kvferryd stopped before the transfer finished");
  }
}

static void stop_now(const char *why) {
  uv_timer_stop(&L.drain);
  size_t left = live_transfers();
  if (left) {
    kvf__warn("%s: failing the %zu transfers still in flight", why, left);
    fail_remaining();
  }
  kvf__notify_stopping("stopping: %s", why);
  L.stop();
}

static void on_drain_tick(uv_timer_t *t) {
  size_t left = live_transfers();
  if (left == 0) {
    kvf__info("every transfer in flight finished; stopping");
    stop_now("drained");
  } else if (kvf__now_ns() >= L.drain_end_ns) {
    char why[96];
    snprintf(why, sizeof why, "stop-timeout-ms (%u) expired", kvfd.cfg.stop_timeout_ms);
    stop_now(why);
  }
}

static void begin_drain(int signum) {
  size_t left = live_transfers();
  kvfd.draining = true;
  kvf__api_stop_accepting();
  kvf__info("%s: stopping; %zu transfers in flight may finish within %u ms, no new ones start",
            signum == SIGINT ? "SIGINT" : "SIGTERM", left, kvfd.cfg.stop_timeout_ms);
  kvf__notify_stopping("stopping: draining %zu transfers", left);
  if (left == 0 || kvfd.cfg.stop_timeout_ms == 0) {
    stop_now(left ? "stop-timeout-ms is 0" : "nothing in flight");
    return;
  }
  L.drain_end_ns = kvf__now_ns() + (uint64_t)kvfd.cfg.stop_timeout_ms * 1000000u;
  uv_timer_start(&L.drain, on_drain_tick, DRAIN_TICK_MS, DRAIN_TICK_MS);
}

/* ------------------------------------------------------------ SIGHUP */

static void report_change(const char *key, const char *from, const char *to, bool applied,
                          void *arg) {
  if (applied) kvf__info("reload: %s: %s -> %s", key, from, to);
  else kvf__warn("reload: %s changed (%s -> %s) but only a restart applies it; still %s", key,
                 from, to, from);
}

/* Reads and checks the file; NULL (and a logged reason) when it is bad. */
static kvf__config *load_next(void) {
  char err[512];
  kvf__config *next = malloc(sizeof *next);
  if (!next) {
    kvf__err("reload: out of memory");
    return NULL;
  }
  kvf__config_defaults(next);
  if (kvf__config_load(next, L.config_path, err, sizeof err) != 0 ||
      kvf__config_validate(next, err, sizeof err) != 0) {
    kvf__err("reload: %s; configuration not changed", err);
    free(next);
    return NULL;
  }
  return next;
}

static int reload(void) {
  char err[512];
  kvf__config *next = load_next();
  if (!next) return -1;
  kvf__config_prepare_reload(next, &kvfd.cfg, report_change, NULL);
  /* Kept keys and new ones together must still make sense (e.g. a new
   * peer named like this node, whose name did not change). */
  if (kvf__config_validate(next, err, sizeof err) != 0) {
    kvf__err("reload: %s; configuration not changed", err);
    free(next);
    return -1;
  }
  kvfd.cfg = *next;
  free(next);
  kvf__log_set_level(kvfd.cfg.log_level);
  kvf__peers_reload();
  return 0;
}

static void on_hup(void) {
  if (kvfd.draining || kvfd.stopping) {
    kvf__info("SIGHUP while stopping: ignored");
    return;
  }
  kvf__info("SIGHUP: rereading %s", L.config_path);
  kvf__notify_reloading();
  int rc = reload();
  kvf__metrics_reload(rc == 0);
  kvf__info("reload %s", rc == 0 ? "done" : "refused; the running configuration is unchanged");
  kvf__notify_ready("ready: node %s (%s)", kvfd.cfg.node,
                    rc == 0 ? "configuration reloaded" : "reload failed, see the log");
}

/* ------------------------------------------------------------ handles */

static void on_signal(uv_signal_t *s, int signum) {
  if (signum == SIGHUP) on_hup();
  else if (kvfd.draining) stop_now("second stop signal");
  else begin_drain(signum);
}

void kvf__lifecycle_start(uv_loop_t *loop, const char *config_path, kvf__stop_fn *stop) {
  L.loop = loop;
  L.config_path = config_path;
  L.stop = stop;
  uv_signal_init(loop, &L.term);
  uv_signal_init(loop, &L.intr);
  uv_signal_init(loop, &L.hup);
  uv_timer_init(loop, &L.drain);
  uv_signal_start(&L.term, on_signal, SIGTERM);
  uv_signal_start(&L.intr, on_signal, SIGINT);
  uv_signal_start(&L.hup, on_signal, SIGHUP);
  L.open = true;
}

void kvf__lifecycle_close(void) {
  if (!L.open) return;
  L.open = false;
  uv_timer_stop(&L.drain);
  uv_signal_stop(&L.term);
  uv_signal_stop(&L.intr);
  uv_signal_stop(&L.hup);
  uv_close((uv_handle_t *)&L.drain, NULL);
  uv_close((uv_handle_t *)&L.term, NULL);
  uv_close((uv_handle_t *)&L.intr, NULL);
  uv_close((uv_handle_t *)&L.hup, NULL);
}
