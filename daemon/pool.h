/* pool.h - daemon-owned memory pools, shared with clients by fd. */
#ifndef KVF_POOL_H
#define KVF_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"

struct kvf__pool {
  uint32_t id;
  char name[KVF__NAME_MAX + 1];
  char kind[16];
  char backing[32];      /* "memfd-hugetlb", "memfd", "cumem" */
  uint64_t size;
  int fd;                /* shared with clients by SCM_RIGHTS */
  /* The daemon's own mapping. For cuda pools this is the DEVICE address
   * (cuMemMap'ed VA): never dereference it on the CPU; test kvf__pool_gpu().
   * It is what ibv_reg_mr takes with nvidia-peermem. */
  uint8_t *base;
  bool locked;           /* mlock succeeded (host) */
  /* Its memory cannot go away under the daemon's mappings (a memfd sealed
   * against shrinking, GPU memory): a copy out of it cannot fault, so what
   * a tcp batch carries from it is what it held (tcp_wire.h). */
  bool sealed;
  /* CUDA (daemon/cuda/gpu.h) */
  int cuda_dev;          /* -1: host memory */
  uint64_t dev_alias;    /* host pools: address kernels use (0: not registered) */
  uint64_t cu_handle;    /* cuda pools: the allocation (for kvf__gpu_mem_*) */
  /* How NICs reach this pool: "dmabuf", "peermem", "host" (ibv_reg_mr of
   * host memory), "bounce" (GPU memory NICs cannot reach: staged through
   * pinned host memory) or "none" (no rdma transport). The transport that
   * registers pools sets it; it is printed at start, in status and in
   * metrics. */
  char nic_reg[16];
  /* Engine memory (kvf_mem_register; pool_engine.c): the session that
   * registered it, and how it was brought in. NULL owner: a daemon pool. */
  struct kvf__session *owner;
  void *engine;          /* pool_engine.c's record of how it came in */
};
typedef struct kvf__pool kvf__pool;

/* The pool table: config pools take ids 0 .. n-1 at start; engine memory
 * takes the lowest free id above them. kvfd.n_pools is one past the
 * highest id in use; slots in between may be empty. */
#define KVF__POOLS_MAX 1024
/* The pool with this id, or NULL (never was, or unregistered). */
kvf__pool *kvf__pool_get(uint32_t id);

/* Allocates and maps a pool from its config entry. */
int kvf__pool_create(const kvf__pool_cfg *pc, uint32_t id, int hugepages, bool want_mlock,
                     kvf__pool **out, char *err, size_t errlen);
void kvf__pool_destroy(kvf__pool *p);
/* Whether the pool is GPU memory. */
static inline bool kvf__pool_gpu(const kvf__pool *p) { return p->cuda_dev >= 0; }
/* For NIC registration of a cuda pool by dmabuf (ibv_reg_dmabuf_mr(pd,
 * *offset, p->size, iova, *fd, access)): 0, -ENOTSUP when the GPU or driver
 * cannot export dmabuf (try ibv_reg_mr(p->base) with nvidia-peermem), -EINVAL
 * for host pools. The caller closes *fd once registered. */
int kvf__pool_dmabuf(const kvf__pool *p, int *fd, uint64_t *offset);
/* The pool as one end of a GPU copy, at offset. */
struct kvf__gpu_end;
void kvf__pool_gpu_end(const kvf__pool *p, uint64_t offset, struct kvf__gpu_end *e);

/* 0 when [offset, offset+len) lies inside the pool (overflow-safe). */
int kvf__pool_check_range(const kvf__pool *p, uint64_t offset, uint64_t len);

#endif
