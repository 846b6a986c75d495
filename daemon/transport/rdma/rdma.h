/* rdma.h - the rdma transport (this folder), as the daemon sees it: one-
 * sided RDMA WRITE over RC queue pairs set up through librdmacm. Everything
 * else goes through its kvf__transport_ops (transport.h); the folder's own
 * types and functions are in its private header, rdma_int.h. */
#ifndef KVF_RDMA_H
#define KVF_RDMA_H

#include "transport/transport.h"

/* Discovers devices, registers every pool with each, starts the CM
 * listeners and progress threads. -ENODEV when no usable device (err says
 * why; the daemon goes on without rdma); other errors are fatal. */
int kvf__rdma_create(uv_loop_t *loop, unsigned slot, kvf__transport **out, char *err, size_t errlen);

#endif
