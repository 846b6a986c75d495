/* notify.c - sd_notify messages for systemd (see notify.h).
 *
 * The service manager reads each datagram as "KEY=value" lines, so every
 * STATUS text is flattened to one line here. A failing sd_notify is logged
 * once at debug level and otherwise ignored: a daemon that cannot report its
 * status must still serve. */
#include "notify.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <time.h>

#include "log.h"

#define MSG_MAX 1024

static uv_timer_t watchdog;
static bool watchdog_on;
static bool complained;

static void send_msg(const char *msg) {
  int rc = sd_notify(0, msg);
  if (rc < 0 && !complained) {
    complained = true;
    kvf__debug("sd_notify: %s (further failures are not logged)", strerror(-rc));
  }
}

/* "HEAD\nSTATUS=text" with text on one line; HEAD may be empty. */
static void send_status(const char *head, const char *fmt, va_list ap) {
  char msg[MSG_MAX];
  int n = snprintf(msg, sizeof msg, "%s%sSTATUS=", head, head[0] ? "\n" : "");
  if (n < 0 || (size_t)n >= sizeof msg) return;
  vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
  for (char *p = msg + n; *p; p++)
    if (*p == '\n' || *p == '\r') *p = ' ';
  send_msg(msg);
}

void kvf__notify_status(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  send_status("", fmt, ap);
  va_end(ap);
}

void kvf__notify_ready(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  send_status("READY=1", fmt, ap);
  va_end(ap);
}

void kvf__notify_stopping(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  send_status("STOPPING=1", fmt, ap);
  va_end(ap);
}

void kvf__notify_failed(int err, const char *fmt, ...) {
  char head[32] = "";
  /* ERRNO= is for errno values; kvferry's own codes mean nothing to systemd. */
  if (err < 0 && err > -4096) snprintf(head, sizeof head, "ERRNO=%d", -err);
  va_list ap;
  va_start(ap, fmt);
  send_status(head, fmt, ap);
  va_end(ap);
}

void kvf__notify_reloading(void) {
  struct timespec ts;
  char msg[96];
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t usec = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
  snprintf(msg, sizeof msg, "RELOADING=1\nMONOTONIC_USEC=%" PRIu64 "\nSTATUS=reloading configuration",
           usec);
  send_msg(msg);
}

static void on_watchdog(uv_timer_t *t) { send_msg("WATCHDOG=1"); }

void kvf__notify_watchdog_start(uv_loop_t *loop) {
  uint64_t usec = 0;
  if (watchdog_on || sd_watchdog_enabled(0, &usec) <= 0 || usec < 2000) return;
  uint64_t ms = usec / 2000; /* half the interval, in ms */
  uv_timer_init(loop, &watchdog);
  uv_timer_start(&watchdog, on_watchdog, ms, ms);
  uv_unref((uv_handle_t *)&watchdog);
  watchdog_on = true;
  kvf__info("systemd watchdog: pinging every %" PRIu64 " ms", ms);
}

void kvf__notify_watchdog_stop(void) {
  if (!watchdog_on) return;
  uv_timer_stop(&watchdog);
  uv_close((uv_handle_t *)&watchdog, NULL);
  watchdog_on = false;
}
