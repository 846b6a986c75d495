/* pool_engine.h - engine memory (kvf_mem_register) as pools.
 *
 * An engine hands the daemon memory it allocated: a host file by fd (memfd,
 * tmpfs, hugetlbfs), or GPU memory by CUDA IPC handle or VMM fd. It becomes
 * a pool with the next free id, usable by its owner only, until the owner
 * unregisters it or goes away. Transfers hold the engine pools they name
 * (kvf__pool_engine_hold); a pool leaves the table only when none does, so
 * no transport ever touches memory the daemon has let go of. */
#ifndef KVF_POOL_ENGINE_H
#define KVF_POOL_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvferry.pb-c.h"
#include "kvferryd.h"
#include "pool.h"

/* Per client at once; more is refused with KVF_ELIMIT. */
#define KVF__ENGINE_POOLS_PER_CLIENT 64

typedef struct kvf__mem_timing {
  uint64_t import_ns;   /* mapping or importing the memory */
  uint64_t nic_ns;      /* the transports' pool_added (NIC registration) */
} kvf__mem_timing;

/* Registers q for owner. fd (-1: none came) is the file or VMM handle that
 * rode with the request; it is always consumed. */
int kvf__pool_engine_add(kvf__session *owner, const Kvf__MemRegisterReq *q, int fd, kvf__pool **out,
                         kvf__mem_timing *t, char *err, size_t errlen);
/* 0 when owner's pool id can go now, else as kvf__pool_engine_remove. */
int kvf__pool_engine_removable(kvf__session *owner, uint32_t id, char *err, size_t errlen);
/* Drops owner's pool id: KVF_ENOPOOL (not owner's), KVF_EBUSY (a transfer
 * holds it; nothing changes). */
int kvf__pool_engine_remove(kvf__session *owner, uint32_t id, char *err, size_t errlen);
/* The owner is gone: each of its pools goes once no transfer holds it. */
void kvf__pool_engine_session_gone(kvf__session *owner);

/* Whether s may name pool p in descriptors and layouts: daemon pools
 * anyone, engine memory its owner only. */
static inline bool kvf__pool_usable_by(const kvf__pool *p, const kvf__session *s) {
  return p && (!p->owner || p->owner == s);
}

/* A transfer names pool id / is done with it. Only engine pools count;
 * daemon pools are there for the daemon's life. */
void kvf__pool_engine_hold(uint32_t id);
void kvf__pool_engine_release(uint32_t id);
/* Whether id is an engine pool (what transfers hold). */
bool kvf__pool_is_engine(uint32_t id);

/* For NIC registration of a GPU engine pool by dmabuf: as kvf__pool_dmabuf
 * (pool.h), which calls it for engine pools. */
int kvf__pool_engine_dmabuf(const kvf__pool *p, int *fd, uint64_t *offset);
/* memcpy that survives a file shrinking under a mapping of engine memory
 * (see pool_engine.c): 0, or -EFAULT (part of the copy may have happened). */
int kvf__pool_copy(void *dst, const void *src, size_t n);

/* What registering engine pool p cost; false for daemon pools. */
bool kvf__pool_engine_timing(const kvf__pool *p, kvf__mem_timing *t);

/* Engine pools in the table now (status, metrics, tests). */
size_t kvf__pool_engine_count(void);
/* Drops every engine pool at shutdown, held or not (no transfer runs). */
void kvf__pool_engine_shutdown(void);

#endif
