/* notify.h - tells the service manager how the daemon is doing (sd_notify):
 * STATUS= while starting, READY=1 once the API socket listens and pools
 * and devices are up, RELOADING=1 around a SIGHUP, STOPPING=1 on the way
 * down, and WATCHDOG=1 pings when the unit sets WatchdogSec=. Without
 * NOTIFY_SOCKET (not started by systemd) every call does nothing. */
#ifndef KVF_NOTIFY_H
#define KVF_NOTIFY_H

#include <uv.h>

/* STATUS=text: one line for `systemctl status`. */
void kvf__notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* READY=1 with a STATUS line; also ends a reload. */
void kvf__notify_ready(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* RELOADING=1 (with MONOTONIC_USEC, which systemd 253+ wants). */
void kvf__notify_reloading(void);
/* STOPPING=1 with a STATUS line. */
void kvf__notify_stopping(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Start failed: STATUS line and ERRNO= (err: a negative errno or kvf
 * code; only errnos are passed on). */
void kvf__notify_failed(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Pings WATCHDOG=1 at half of WATCHDOG_USEC when the unit asks for it.
 * The timer does not keep the loop alive. */
void kvf__notify_watchdog_start(uv_loop_t *loop);
void kvf__notify_watchdog_stop(void);

#endif
