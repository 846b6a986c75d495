/* lifecycle.h - the daemon's signals once it is running.
 *
 *   SIGTERM, SIGINT  stop accepting clients and transfers, let the transfers
 *                    in flight finish for at most stop-timeout-ms, then fail
 *                    the rest and stop (exit 0). A second signal stops at once.
 *   SIGHUP           reread the configuration file and apply what can change
 *                    at run time (peers, log level, limits); the log names
 *                    every changed key that needs a restart instead. */
#ifndef KVF_LIFECYCLE_H
#define KVF_LIFECYCLE_H

#include <uv.h>

/* Tears the daemon down (fails what is left, closes every handle). */
typedef void kvf__stop_fn(void);

/* Installs the signal handlers. config_path is reread on SIGHUP. */
void kvf__lifecycle_start(uv_loop_t *loop, const char *config_path, kvf__stop_fn *stop);
/* Closes the lifecycle's handles; called from stop. */
void kvf__lifecycle_close(void);

#endif
