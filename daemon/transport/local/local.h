/* local.h - the local transport (local.c): both ends are clients of this
 * daemon; a transfer is a copy from pool to pool. */
#ifndef KVF_LOCAL_H
#define KVF_LOCAL_H

#include "transport/transport.h"

int kvf__local_create(uv_loop_t *loop, unsigned slot, kvf__transport **out, char *err, size_t errlen);

#endif
