/* libkvferry_cuda.c - kvf_pool_map for cuda:N pools (see libkvferry_cuda.h).
 *
 * The daemon allocates the pool with cuMemCreate and passes its POSIX fd;
 * we import it and map it into this process's unified address space, so the
 * engine gets a device pointer to the very memory the daemon (and NICs)
 * write. The driver is loaded with dlopen on first use: a process that maps
 * only host pools never touches CUDA. We retain the GPU's primary context
 * (the one the CUDA runtime and PyTorch use) for as long as the mapping
 * lives, and never change the calling thread's current context. */
#include "libkvferry_cuda.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "cuda/cudrv.h"
#include "kvferry.h"

struct cuda_map {
  CUdeviceptr ptr;
  size_t size;
  CUdevice dev;
};

static kvf_cu cu;
static int cu_state; /* 0 loaded, -ENODEV not */
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

static void load_once(void) {
  char err[256];
  cu_state = kvf__cu_load(&cu, err, sizeof(err)) == 0 ? 0 : -ENODEV;
}

static int map(int fd, uint64_t size, struct cuda_map *m) {
  CUmemGenericAllocationHandle h = 0;
  if (cu.MemImportFromShareableHandle(&h, (void *)(intptr_t)fd, KVF_CU_MEM_HANDLE_TYPE_POSIX_FD) != KVF_CU_SUCCESS)
    return -EIO;
  kvf_cu_mem_prop prop;
  memset(&prop, 0, sizeof(prop));
  int rc = -EIO;
  CUcontext ctx = NULL;
  size_t gran = 0;
  if (cu.MemGetAllocationPropertiesFromHandle(&prop, h) != KVF_CU_SUCCESS ||
      cu.DeviceGet(&m->dev, prop.location.id) != KVF_CU_SUCCESS ||
      cu.DevicePrimaryCtxRetain(&ctx, m->dev) != KVF_CU_SUCCESS)
    goto release;
  if (cu.CtxSetCurrent(ctx) != KVF_CU_SUCCESS ||
      cu.MemGetAllocationGranularity(&gran, &prop, KVF_CU_MEM_GRANULARITY_MINIMUM) != KVF_CU_SUCCESS) {
    cu.DevicePrimaryCtxRelease(m->dev);
    goto release;
  }
  if (gran == 0 || size % gran) {
    rc = KVF_EPROTO;
    cu.DevicePrimaryCtxRelease(m->dev);
    goto release;
  }
  m->size = size;
  if (cu.MemAddressReserve(&m->ptr, size, gran, 0, 0) != KVF_CU_SUCCESS) {
    cu.DevicePrimaryCtxRelease(m->dev);
    goto release;
  }
  if (cu.MemMap(m->ptr, size, 0, h, 0) != KVF_CU_SUCCESS) {
    cu.MemAddressFree(m->ptr, size);
    cu.DevicePrimaryCtxRelease(m->dev);
    goto release;
  }
  /* Its own GPU, and every GPU that can reach it (a tensor-parallel engine
   * may read a neighbour's pool over NVLink). */
  int n = 0;
  cu.DeviceGetCount(&n);
  kvf_cu_access_desc acc[64];
  size_t na = 0;
  for (int i = 0; i < n && na < 64; i++) {
    CUdevice d;
    int can = 0;
    if (cu.DeviceGet(&d, i) != KVF_CU_SUCCESS) continue;
    if (d != m->dev && (cu.DeviceCanAccessPeer(&can, d, m->dev) != KVF_CU_SUCCESS || !can)) continue;
    acc[na++] = (kvf_cu_access_desc){{KVF_CU_MEM_LOCATION_TYPE_DEVICE, d}, KVF_CU_MEM_ACCESS_RW};
  }
  if (cu.MemSetAccess(m->ptr, size, acc, na) != KVF_CU_SUCCESS) {
    cu.MemUnmap(m->ptr, size);
    cu.MemAddressFree(m->ptr, size);
    cu.DevicePrimaryCtxRelease(m->dev);
    goto release;
  }
  rc = 0;
release:
  cu.MemRelease(h); /* the mapping keeps the memory */
  return rc;
}

int kvf__cuda_map_fd(int fd, uint64_t size, void **addr, void **state) {
  pthread_once(&cu_once, load_once);
  if (cu_state) return cu_state;
  if (fd < 0 || size == 0) return KVF_EPROTO;
  struct cuda_map *m = calloc(1, sizeof(*m));
  if (!m) return -ENOMEM;
  CUcontext old = NULL;
  cu.CtxGetCurrent(&old);
  int rc = map(fd, size, m);
  cu.CtxSetCurrent(old);
  if (rc) {
    free(m);
    return rc;
  }
  *addr = (void *)(uintptr_t)m->ptr;
  *state = m;
  return 0;
}

void kvf__cuda_unmap(void *state) {
  struct cuda_map *m = state;
  if (!m) return;
  CUcontext old = NULL;
  cu.CtxGetCurrent(&old);
  CUcontext ctx = NULL;
  if (cu.DevicePrimaryCtxRetain(&ctx, m->dev) == KVF_CU_SUCCESS) {
    cu.CtxSetCurrent(ctx);
    cu.MemUnmap(m->ptr, m->size);
    cu.MemAddressFree(m->ptr, m->size);
    cu.DevicePrimaryCtxRelease(m->dev); /* the retain just above */
  }
  cu.DevicePrimaryCtxRelease(m->dev);   /* the mapping's */
  cu.CtxSetCurrent(old);
  free(m);
}
