/* libkvferry_cuda.c - kvf_pool_map for cuda:N pools, and the export of the
 * engine's own GPU memory for kvf_mem_register (see libkvferry_cuda.h).
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
#include <unistd.h>

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

/* Read-write for its own GPU, and every GPU that can reach it (a
 * tensor-parallel engine may read a neighbour's pool over NVLink). */
static int set_access(const struct cuda_map *m) {
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
  return cu.MemSetAccess(m->ptr, m->size, acc, na) == KVF_CU_SUCCESS ? 0 : -EIO;
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
  if (set_access(m) != 0) {
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

/* The new allocation replaces the old one under the same reserved
 * addresses: unmap, map, grant access again. */
static int remap(struct cuda_map *m, int fd, uint64_t size) {
  CUmemGenericAllocationHandle h = 0;
  if (size != m->size) return KVF_EPROTO;
  if (cu.MemImportFromShareableHandle(&h, (void *)(intptr_t)fd, KVF_CU_MEM_HANDLE_TYPE_POSIX_FD) != KVF_CU_SUCCESS)
    return -EIO;
  kvf_cu_mem_prop prop;
  memset(&prop, 0, sizeof(prop));
  CUdevice dev;
  int rc = -EIO;
  if (cu.MemGetAllocationPropertiesFromHandle(&prop, h) != KVF_CU_SUCCESS ||
      cu.DeviceGet(&dev, prop.location.id) != KVF_CU_SUCCESS)
    goto release;
  rc = KVF_EPROTO;
  if (dev != m->dev) goto release; /* another GPU now: not the same pool */
  rc = -EIO;
  cu.MemUnmap(m->ptr, m->size);
  if (cu.MemMap(m->ptr, size, 0, h, 0) == KVF_CU_SUCCESS) rc = set_access(m);
release:
  cu.MemRelease(h);
  return rc;
}

int kvf__cuda_remap_fd(void *state, int fd, uint64_t size) {
  struct cuda_map *m = state;
  if (!m || fd < 0) return KVF_EPROTO;
  CUcontext old = NULL, ctx = NULL;
  cu.CtxGetCurrent(&old);
  if (cu.DevicePrimaryCtxRetain(&ctx, m->dev) != KVF_CU_SUCCESS) return -EIO;
  int rc = cu.CtxSetCurrent(ctx) == KVF_CU_SUCCESS ? remap(m, fd, size) : -EIO;
  cu.DevicePrimaryCtxRelease(m->dev);
  cu.CtxSetCurrent(old);
  return rc;
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

/* ------------------------------------------------------------ export */

/* A context to ask the driver about pointers in, when the calling thread
 * has none: an active primary context (the engine's memory lives in one;
 * retaining an inactive one would create a context, and take GPU memory,
 * on a GPU the engine never used). *dev is the device retained, or -1. */
static int borrow_context(CUdevice *dev) {
  *dev = -1;
  int n = 0;
  if (!cu.DevicePrimaryCtxGetState || cu.DeviceGetCount(&n) != KVF_CU_SUCCESS) return -EIO;
  for (int i = 0; i < n; i++) {
    CUdevice d;
    unsigned flags = 0;
    int active = 0;
    CUcontext ctx = NULL;
    if (cu.DeviceGet(&d, i) != KVF_CU_SUCCESS || cu.DevicePrimaryCtxGetState(d, &flags, &active) != KVF_CU_SUCCESS ||
        !active || cu.DevicePrimaryCtxRetain(&ctx, d) != KVF_CU_SUCCESS)
      continue;
    if (cu.CtxSetCurrent(ctx) == KVF_CU_SUCCESS) {
      *dev = d;
      return 0;
    }
    cu.DevicePrimaryCtxRelease(d);
  }
  return KVF_EINVAL; /* no active context: the pointer cannot be device memory of this process */
}

/* A dmabuf of cudaMalloc memory, made here because only its own process
 * can: the driver refuses memory imported by IPC handle (seen on an H200,
 * driver 13.0). -1 where the driver or GPU has none; NICs then take the
 * daemon's other ways (peermem, bounce). */
static int allocation_dmabuf(CUdeviceptr base, uint64_t size) {
  int fd = -1;
  if (!cu.MemGetHandleForAddressRange || base % 4096 || size % 4096) return -1;
  if (cu.MemGetHandleForAddressRange(&fd, base, size, KVF_CU_MEM_RANGE_HANDLE_DMA_BUF_FD, 0) != KVF_CU_SUCCESS)
    return -1;
  return fd;
}

/* The allocation's handle as a POSIX fd (VMM), or its IPC handle
 * (cudaMalloc). A VMM allocation created without the POSIX fd handle type
 * cannot be shared: -ENOTSUP. So cannot memory from a stream-ordered pool
 * (cudaMallocAsync), which refuses cuIpcGetMemHandle. */
static int export_handle(CUdeviceptr base, kvf__cuda_export *ex) {
  CUmemGenericAllocationHandle h = 0;
  if (cu.MemRetainAllocationHandle && cu.MemRetainAllocationHandle(&h, (void *)(uintptr_t)base) == KVF_CU_SUCCESS) {
    int fd = -1;
    CUresult r = cu.MemExportToShareableHandle(&fd, h, KVF_CU_MEM_HANDLE_TYPE_POSIX_FD, 0);
    cu.MemRelease(h); /* the retain's reference; the engine's mapping keeps the memory */
    if (r != KVF_CU_SUCCESS) return -ENOTSUP;
    ex->fd = fd;
    return 0;
  }
  if (!cu.IpcGetMemHandle) return -ENOTSUP;
  kvf_cu_ipc_handle ipc;
  if (cu.IpcGetMemHandle(&ipc, base) != KVF_CU_SUCCESS) return -ENOTSUP;
  memcpy(ex->ipc, ipc.reserved, sizeof(ex->ipc));
  ex->dmabuf_fd = allocation_dmabuf(base, ex->alloc_size);
  return 0;
}

/* With some context current: what p is, and the export, in the
 * allocation's own context (or its GPU's primary one: VMM memory belongs
 * to no context). */
static int export_in_context(CUdeviceptr p, uint64_t size, kvf__cuda_export *ex) {
  unsigned mtype = 0, managed = 0;
  int ord = -1;
  CUcontext owner = NULL;
  if (cu.PointerGetAttribute(&mtype, KVF_CU_POINTER_ATTR_MEMORY_TYPE, p) != KVF_CU_SUCCESS ||
      mtype != KVF_CU_MEMORYTYPE_DEVICE)
    return KVF_EINVAL; /* host memory, or not CUDA's at all */
  if (cu.PointerGetAttribute(&managed, KVF_CU_POINTER_ATTR_IS_MANAGED, p) != KVF_CU_SUCCESS || managed)
    return KVF_EINVAL; /* managed memory cannot be shared between processes */
  if (cu.PointerGetAttribute(&ord, KVF_CU_POINTER_ATTR_DEVICE_ORDINAL, p) != KVF_CU_SUCCESS) return -EIO;
  if (cu.PointerGetAttribute(&owner, KVF_CU_POINTER_ATTR_CONTEXT, p) != KVF_CU_SUCCESS) owner = NULL;
  /* The primary context only when the memory has no context of its own:
   * retaining an inactive one would create it. */
  CUdevice d = -1;
  CUcontext primary = NULL;
  if (!owner && (cu.DeviceGet(&d, ord) != KVF_CU_SUCCESS || cu.DevicePrimaryCtxRetain(&primary, d) != KVF_CU_SUCCESS))
    return -EIO;
  int rc = cu.CtxSetCurrent(owner ? owner : primary) == KVF_CU_SUCCESS ? 0 : -EIO;
  CUdeviceptr base = 0;
  size_t asz = 0;
  if (rc == 0 && cu.MemGetAddressRange(&base, &asz, p) != KVF_CU_SUCCESS) rc = -EIO;
  /* One allocation only: for VMM memory the address range is one handle's
   * mapping, so a range over several (PyTorch's expandable segments map
   * many) ends here: -ENOTSUP when its last byte is device memory too (it
   * spans allocations), KVF_EINVAL when it leaves device memory. */
  if (rc == 0 && (p < base || size > asz - (p - base))) {
    unsigned last = 0;
    rc = cu.PointerGetAttribute(&last, KVF_CU_POINTER_ATTR_MEMORY_TYPE, p + size - 1) == KVF_CU_SUCCESS &&
                 last == KVF_CU_MEMORYTYPE_DEVICE
             ? -ENOTSUP
             : KVF_EINVAL;
  }
  if (rc == 0) {
    ex->dev = ord;
    CUdevice od;
    if (cu.DeviceGet(&od, ord) != KVF_CU_SUCCESS ||
        cu.DeviceGetPCIBusId(ex->bus_id, (int)sizeof(ex->bus_id), od) != KVF_CU_SUCCESS)
      ex->bus_id[0] = 0; /* the daemon then goes by the ordinal alone */
    ex->alloc_base = base;
    ex->alloc_size = asz;
    rc = export_handle(base, ex);
  }
  if (primary) cu.DevicePrimaryCtxRelease(d);
  return rc;
}

int kvf__cuda_export_range(const void *dptr, uint64_t size, kvf__cuda_export *ex) {
  memset(ex, 0, sizeof(*ex));
  ex->dev = -1;
  ex->fd = -1;
  ex->dmabuf_fd = -1;
  pthread_once(&cu_once, load_once);
  if (cu_state) return cu_state;
  if (!cu.PointerGetAttribute || !cu.MemGetAddressRange) return -ENOTSUP;
  if (!dptr || size == 0) return KVF_EINVAL;
  CUcontext old = NULL;
  cu.CtxGetCurrent(&old);
  CUdevice borrowed = -1;
  int rc = old ? 0 : borrow_context(&borrowed);
  if (rc == 0) rc = export_in_context((CUdeviceptr)(uintptr_t)dptr, size, ex);
  cu.CtxSetCurrent(old);
  if (borrowed >= 0) cu.DevicePrimaryCtxRelease(borrowed);
  if (rc) {
    if (ex->fd >= 0) close(ex->fd);
    if (ex->dmabuf_fd >= 0) close(ex->dmabuf_fd);
    ex->dev = -1;
    ex->fd = ex->dmabuf_fd = -1;
  }
  return rc;
}
