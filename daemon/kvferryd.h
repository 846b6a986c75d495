/* kvferryd.h - the daemon's shared context and internal types. Everything
 * here runs on the libuv loop thread unless a comment says otherwise. */
#ifndef KVF_KVFERRYD_H
#define KVF_KVFERRYD_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "kvferry.h"
#include "kvferry.pb-c.h"
#include "log.h"

#define KVF__VERSION "0.1.0"
#define KVF__API_VERSION 2     /* clients of 1 are served too (api.c: on_hello) */
#define KVF__PEER_VERSION 1
#define KVF__TRANSPORTS_MAX 8   /* rows in transport.c's table, at most */

typedef struct kvf__pool kvf__pool;
typedef struct kvf__session kvf__session;
typedef struct kvf__peer kvf__peer;
typedef struct kvf__xfer kvf__xfer;
typedef struct kvf__transport kvf__transport;

/* Counters shown by status; bumped on the loop thread only. */
typedef struct kvf__stats {
  uint64_t transfers_done;
  uint64_t transfers_failed;
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t descriptors;
  uint64_t api_errors;
  uint64_t peer_errors;
  uint64_t auth_failures;   /* peers refused by the cluster key check (auth.h) */
  uint64_t api_output_drops; /* clients dropped for api-output-budget (api.c) */
  uint64_t api_soon;        /* Soon hints told to clients (api.c) */
} kvf__stats;

typedef struct kvf__daemon {
  uv_loop_t *loop;
  kvf__config cfg;
  uint64_t session;         /* random per start; peers tell incarnations apart */
  uint64_t start_ns;
  kvf__pool **pools;
  size_t n_pools;
  kvf__stats stats;
  /* The running transports, by their row in transport.c's table (NULL: not
   * running); made by kvf__transports_start. */
  kvf__transport *transports[KVF__TRANSPORTS_MAX];
  bool draining;            /* SIGTERM: no new clients or transfers; in-flight ones finish */
  bool stopping;
} kvf__daemon;

extern kvf__daemon kvfd;

uint64_t kvf__now_ns(void);
/* Freed memory stays in the heap (see daemon.c); once, at start. */
void kvf__keep_freed_memory(void);

#endif
