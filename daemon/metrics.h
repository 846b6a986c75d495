/* metrics.h - Prometheus metrics: counters fed by hooks in the transfer
 * state machine and the API, gauges read from the daemon's state at scrape
 * time, rendered in the text exposition format (version 0.0.4) and served
 * over HTTP on metrics-listen (metrics_http.c). Loop thread only. */
#ifndef KVF_METRICS_H
#define KVF_METRICS_H

#include <stdbool.h>
#include <stddef.h>

#include "kvferryd.h"
#include "sbuf.h"

/* Hooks. A transfer's event went out with status (0: done); once per
 * transfer, from xfer.c's succeed() and finish_failure(). */
void kvf__metrics_transfer(const kvf__xfer *x, int status);
/* A local API request was answered with error status. */
void kvf__metrics_api_error(int status);
/* A SIGHUP reload was applied (ok) or refused. */
void kvf__metrics_reload(bool ok);

/* Transports and other modules add their own families (e.g. rdma's queue
 * pairs as kvferry_rdma_queue_pairs) with a collector, called on every
 * scrape. Returns 0 or -ENOSPC. */
typedef void kvf__metrics_collector(kvf__sbuf *b);
int kvf__metrics_add_collector(kvf__metrics_collector *fn);
/* Writes the # HELP and # TYPE lines of a family. */
void kvf__metrics_family(kvf__sbuf *b, const char *name, const char *type, const char *help);
/* Writes a label value, escaped as the format wants, quotes included. */
void kvf__metrics_label(kvf__sbuf *b, const char *value);

/* The whole exposition; malloc'd, NULL when out of memory. */
char *kvf__metrics_render(size_t *len);
/* Drops the counters (daemon stop, tests). */
void kvf__metrics_reset(void);

/* The HTTP endpoint (metrics_http.c). start does nothing when
 * metrics-listen is off; an address it cannot bind is an error. */
int kvf__metrics_http_start(uv_loop_t *loop, char *err, size_t errlen);
void kvf__metrics_http_stop(void);
/* Open scrape connections, for kvferry_connections. */
size_t kvf__metrics_http_conns(void);
/* "http://127.0.0.1:9464/metrics", or "" when off; a wildcard listen
 * address becomes the loopback address of its family. */
const char *kvf__metrics_url(void);

#endif
