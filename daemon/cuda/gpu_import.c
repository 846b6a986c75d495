/* gpu_import.c - engine-owned GPU memory brought into the daemon (see
 * gpu.h, "engine memory"): cudaMalloc allocations by CUDA IPC handle, VMM
 * allocations (cuMemCreate) by POSIX fd, and dmabuf fds of any device range
 * for NIC registration.
 *
 * Device numbers: an engine names its GPU in its own numbering, which
 * differs from the daemon's when the engine runs under
 * CUDA_VISIBLE_DEVICES. The imports therefore take the engine's device as a
 * first guess only and return the allocation's device in the daemon's
 * numbering, as the driver reports it after the import. */
#include <errno.h>
#include <stdbool.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "gpu.h"
#include "gpu_int.h"
#include "log.h"

enum { IMPORT_IPC = 1, IMPORT_VMM = 2 }; /* kvf__gpu_import.kind */

static const char *cu_err(const kvf_cu *cu, CUresult r, char *buf, size_t len) {
  return kvf__cu_errstr(cu, r, buf, len);
}

/* The daemon's device holding mapped device address p, or -1. */
static int dev_of(const kvf_cu *cu, CUdeviceptr p) {
  int ord = -1;
  if (!cu->PointerGetAttribute || cu->PointerGetAttribute(&ord, KVF_CU_POINTER_ATTR_DEVICE_ORDINAL, p) != KVF_CU_SUCCESS)
    return -1;
  return ord >= 0 && ord < kvf__gpu_count() ? ord : -1;
}

static int ready_driver(const kvf_cu **cu, char *err, size_t errlen) {
  *cu = kvf__gpu_driver();
  if (*cu) return 0;
  snprintf(err, errlen, "no CUDA in the daemon: %s", kvf__gpu_why());
  return -ENODEV;
}

int kvf__gpu_resolve_dev(int guess, const char *bus_id) {
  int n = kvf__gpu_count();
  kvf__gpu_info info;
  for (int i = 0; bus_id && *bus_id && i < n; i++)
    if (kvf__gpu_info_get(i, &info) == 0 && strcasecmp(info.bdf, bus_id) == 0) return i;
  return guess >= 0 && guess < n ? guess : 0;
}

/* ------------------------------------------------------------ CUDA IPC */

/* Opens h in device dev's primary context: 0 or the driver's error. */
static CUresult ipc_open(const kvf_cu *cu, int dev, const kvf_cu_ipc_handle *h, CUdeviceptr *d) {
  if (kvf__gpu_use(dev)) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
  return cu->IpcOpenMemHandle(d, *h, KVF_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}

static void ipc_close(const kvf_cu *cu, int opener, CUdeviceptr d) {
  if (kvf__gpu_use(opener) == 0) cu->IpcCloseMemHandle(d);
}

/* The handle is opened in its own GPU's context when that can be found:
 * first in dev's (the engine's guess), and if the memory turns out to live
 * on another GPU, again there. Any GPU with peer access could open it, but
 * the owner's context keeps kernels and copies on the GPU that holds it. */
static int ipc_open_any(const kvf_cu *cu, int dev, const kvf_cu_ipc_handle *h, CUdeviceptr *d, int *opener,
                        char *err, size_t errlen) {
  int n = kvf__gpu_count();
  CUresult first = KVF_CU_SUCCESS;
  *opener = -1;
  for (int k = -1; k < n && *opener < 0; k++) {
    int c = k < 0 ? dev : k;
    if (c < 0 || c >= n || (k >= 0 && k == dev)) continue;
    CUresult r = ipc_open(cu, c, h, d);
    if (r == KVF_CU_SUCCESS) *opener = c;
    else if (first == KVF_CU_SUCCESS) first = r;
  }
  if (*opener < 0) {
    char buf[200];
    snprintf(err, errlen, "cuIpcOpenMemHandle: %s", cu_err(cu, first, buf, sizeof(buf)));
    return first == KVF_CU_ERROR_NOT_SUPPORTED ? -ENOTSUP : -EINVAL;
  }
  /* Closed before the reopen: a handle open twice in one process is
   * something drivers have refused or reference-counted. */
  int owner = dev_of(cu, *d);
  if (owner >= 0 && owner != *opener) {
    ipc_close(cu, *opener, *d);
    if (ipc_open(cu, owner, h, d) == KVF_CU_SUCCESS) {
      *opener = owner;
    } else if (ipc_open(cu, *opener, h, d) != KVF_CU_SUCCESS) {
      snprintf(err, errlen, "cuIpcOpenMemHandle: the handle opened once, then not again");
      return -EIO;
    }
  }
  return 0;
}

/* Every IPC handle open in this process, counted: an engine may register
 * two ranges of one allocation (K and V caches in one PyTorch segment), and
 * drivers refuse or share a second cuIpcOpenMemHandle of a handle; one open
 * per handle, shared, closed with its last import. */
typedef struct ipc_open_rec {
  struct ipc_open_rec *next;
  uint8_t handle[64];
  CUdeviceptr d;
  uint64_t have;             /* what the handle maps */
  int dev, opener;
  unsigned refs;
} ipc_open_rec;

static pthread_mutex_t ipc_mu = PTHREAD_MUTEX_INITIALIZER;
static ipc_open_rec *ipc_opens;

static ipc_open_rec *ipc_find(const uint8_t *handle, CUdeviceptr d) {
  for (ipc_open_rec *o = ipc_opens; o; o = o->next)
    if (handle ? memcmp(o->handle, handle, sizeof(o->handle)) == 0 : o->d == d) return o;
  return NULL;
}

/* Opens the handle (or finds it open) and checks what it maps; ipc_mu
 * held. */
static int ipc_get(const kvf_cu *cu, int dev, const uint8_t handle[64], ipc_open_rec **out, char *err,
                   size_t errlen) {
  ipc_open_rec *o = ipc_find(handle, 0);
  if (o) {
    o->refs++;
    *out = o;
    return 0;
  }
  kvf_cu_ipc_handle h;
  memcpy(h.reserved, handle, sizeof(h.reserved));
  CUdeviceptr d = 0;
  int opener;
  int rc = ipc_open_any(cu, dev, &h, &d, &opener, err, errlen);
  if (rc) return rc;
  CUdeviceptr base = 0;
  size_t have = 0;
  CUresult r = cu->MemGetAddressRange(&base, &have, d);
  if (r != KVF_CU_SUCCESS || base != d || !(o = calloc(1, sizeof(*o)))) {
    char buf[200];
    if (r != KVF_CU_SUCCESS) snprintf(err, errlen, "cuMemGetAddressRange of the imported memory: %s", cu_err(cu, r, buf, sizeof(buf)));
    else snprintf(err, errlen, "the imported memory starts %llu bytes into its range", (unsigned long long)(d - base));
    ipc_close(cu, opener, d);
    return r != KVF_CU_SUCCESS || base != d ? -EIO : -ENOMEM;
  }
  memcpy(o->handle, handle, sizeof(o->handle));
  o->d = d;
  o->have = have;
  int owner = dev_of(cu, d);
  o->dev = owner >= 0 ? owner : opener;
  o->opener = opener;
  o->refs = 1;
  o->next = ipc_opens;
  ipc_opens = o;
  *out = o;
  return 0;
}

static void ipc_put(const kvf_cu *cu, ipc_open_rec *o) {
  if (--o->refs) return;
  for (ipc_open_rec **pp = &ipc_opens; *pp; pp = &(*pp)->next)
    if (*pp == o) {
      *pp = o->next;
      break;
    }
  ipc_close(cu, o->opener, o->d);
  free(o);
}

int kvf__gpu_import_ipc(int dev, const uint8_t handle[64], uint64_t alloc_size, kvf__gpu_import *im, char *err,
                        size_t errlen) {
  memset(im, 0, sizeof(*im));
  im->dev = -1;
  const kvf_cu *cu;
  int rc = ready_driver(&cu, err, errlen);
  if (rc) return rc;
  if (!cu->IpcOpenMemHandle || !cu->IpcCloseMemHandle || !cu->MemGetAddressRange) {
    snprintf(err, errlen, "this NVIDIA driver lacks CUDA IPC (cuIpcOpenMemHandle)");
    return -ENOTSUP;
  }
  if (alloc_size == 0) {
    snprintf(err, errlen, "CUDA IPC import: allocation size 0");
    return -EINVAL;
  }
  pthread_mutex_lock(&ipc_mu);
  ipc_open_rec *o = NULL;
  rc = ipc_get(cu, dev, handle, &o, err, errlen);
  /* The engine's size must not exceed what the handle maps: every later
   * range check trusts im->size. */
  if (rc == 0 && alloc_size > o->have) {
    snprintf(err, errlen, "the engine says its allocation has %llu bytes; the handle maps %llu",
             (unsigned long long)alloc_size, (unsigned long long)o->have);
    ipc_put(cu, o);
    rc = -EINVAL;
  }
  if (rc == 0) {
    im->dev = o->dev;
    im->dptr = o->d;
    im->size = alloc_size;
    im->kind = IMPORT_IPC;
  }
  pthread_mutex_unlock(&ipc_mu);
  return rc;
}

/* ------------------------------------------------------------ VMM (POSIX fd) */

/* Maps alloc_size bytes of h at a fresh address, read-write for dev and the
 * GPUs with peer access to it (as kvf__gpu_mem_alloc maps pools). */
static int vmm_map(const kvf_cu *cu, int dev, CUmemGenericAllocationHandle h, const kvf_cu_mem_prop *prop,
                   uint64_t alloc_size, CUdeviceptr *out, char *err, size_t errlen) {
  char buf[200];
  size_t gran = 0;
  CUresult r = cu->MemGetAllocationGranularity(&gran, prop, KVF_CU_MEM_GRANULARITY_MINIMUM);
  if (r != KVF_CU_SUCCESS || gran == 0) {
    snprintf(err, errlen, "cuMemGetAllocationGranularity: %s", cu_err(cu, r, buf, sizeof(buf)));
    return -EIO;
  }
  if (alloc_size % gran) {
    snprintf(err, errlen, "allocation size %llu is not a multiple of the GPU's granularity %zu",
             (unsigned long long)alloc_size, gran);
    return -EINVAL;
  }
  CUdeviceptr va = 0;
  const char *step = "cuMemAddressReserve";
  r = cu->MemAddressReserve(&va, alloc_size, gran, 0, 0);
  if (r == KVF_CU_SUCCESS) {
    step = "cuMemMap"; /* fails when alloc_size exceeds the allocation */
    r = cu->MemMap(va, alloc_size, 0, h, 0);
    if (r != KVF_CU_SUCCESS) cu->MemAddressFree(va, alloc_size);
  }
  if (r == KVF_CU_SUCCESS) {
    kvf_cu_access_desc acc[KVF__GPU_MAX_DEV];
    size_t na = 0;
    for (int j = 0; j < kvf__gpu_count(); j++)
      if (kvf__gpu_peer(j, dev))
        acc[na++] = (kvf_cu_access_desc){{KVF_CU_MEM_LOCATION_TYPE_DEVICE, kvf__gpu_cudev(j)}, KVF_CU_MEM_ACCESS_RW};
    step = "cuMemSetAccess";
    r = cu->MemSetAccess(va, alloc_size, acc, na);
    if (r != KVF_CU_SUCCESS) {
      cu->MemUnmap(va, alloc_size);
      cu->MemAddressFree(va, alloc_size);
    }
  }
  if (r != KVF_CU_SUCCESS) {
    snprintf(err, errlen, "%s of %llu bytes on cuda:%d: %s", step, (unsigned long long)alloc_size, dev,
             cu_err(cu, r, buf, sizeof(buf)));
    /* a map the allocation refuses is the engine's size being wrong (larger
     * than the allocation: INVALID_VALUE, or another code on some drivers,
     * seen on an H200 with driver 13.0) */
    return r == 1 || strcmp(step, "cuMemMap") == 0 ? -EINVAL : -EIO;
  }
  *out = va;
  return 0;
}

int kvf__gpu_import_fd(int dev, int fd, uint64_t alloc_size, kvf__gpu_import *im, char *err, size_t errlen) {
  memset(im, 0, sizeof(*im));
  im->dev = -1;
  const kvf_cu *cu;
  int rc = ready_driver(&cu, err, errlen);
  if (rc) return rc;
  if (fd < 0 || alloc_size == 0) {
    snprintf(err, errlen, "VMM import: no fd or size 0");
    return -EINVAL;
  }
  char buf[200];
  /* Any context will do for the import; the allocation then says its GPU. */
  int guess = dev >= 0 && dev < kvf__gpu_count() ? dev : 0;
  if ((rc = kvf__gpu_use(guess)) != 0) return rc;
  CUmemGenericAllocationHandle h = 0;
  CUresult r = cu->MemImportFromShareableHandle(&h, (void *)(intptr_t)fd, KVF_CU_MEM_HANDLE_TYPE_POSIX_FD);
  if (r != KVF_CU_SUCCESS) {
    snprintf(err, errlen, "cuMemImportFromShareableHandle: %s (not a CUDA memory fd?)", cu_err(cu, r, buf, sizeof(buf)));
    return -EINVAL;
  }
  kvf_cu_mem_prop prop;
  memset(&prop, 0, sizeof(prop));
  r = cu->MemGetAllocationPropertiesFromHandle(&prop, h);
  int owner = -1;
  for (int j = 0; r == KVF_CU_SUCCESS && j < kvf__gpu_count(); j++)
    if (kvf__gpu_cudev(j) == prop.location.id) owner = j;
  if (r != KVF_CU_SUCCESS || prop.location.type != KVF_CU_MEM_LOCATION_TYPE_DEVICE || owner < 0) {
    snprintf(err, errlen, "the imported allocation is not on one of this daemon's GPUs%s%s",
             r != KVF_CU_SUCCESS ? ": " : "", r != KVF_CU_SUCCESS ? cu_err(cu, r, buf, sizeof(buf)) : "");
    cu->MemRelease(h);
    return -EINVAL;
  }
  CUdeviceptr va = 0;
  if ((rc = kvf__gpu_use(owner)) == 0) rc = vmm_map(cu, owner, h, &prop, alloc_size, &va, err, errlen);
  if (rc) {
    cu->MemRelease(h);
    return rc;
  }
  im->dev = owner;
  im->dptr = va;
  im->size = alloc_size;
  im->handle = h;
  im->kind = IMPORT_VMM;
  return 0;
}

void kvf__gpu_import_release(kvf__gpu_import *im) {
  const kvf_cu *cu = kvf__gpu_driver();
  if (!cu || !im->kind) return;
  if (im->kind == IMPORT_IPC) {
    pthread_mutex_lock(&ipc_mu);
    ipc_open_rec *o = ipc_find(NULL, im->dptr);
    if (o) ipc_put(cu, o);
    pthread_mutex_unlock(&ipc_mu);
  } else if (kvf__gpu_use(im->dev) == 0) {
    cu->MemUnmap(im->dptr, im->size);
    cu->MemAddressFree(im->dptr, im->size);
    cu->MemRelease(im->handle);
  }
  memset(im, 0, sizeof(*im));
  im->dev = -1;
}

/* ------------------------------------------------------------ dmabuf */

int kvf__gpu_range_dmabuf(uint64_t dptr, uint64_t len, int *fd, uint64_t *offset) {
  const kvf_cu *cu = kvf__gpu_driver();
  if (!cu) return -ENODEV;
  if (!cu->MemGetHandleForAddressRange || !cu->PointerGetAttribute) return -ENOTSUP;
  if (len == 0 || dptr % 4096 || len % 4096) return -EINVAL;
  int dev = dev_of(cu, dptr);
  if (dev < 0) return -EINVAL;
  kvf__gpu_info gi;
  if (kvf__gpu_info_get(dev, &gi) != 0 || !gi.dmabuf) return -ENOTSUP;
  int rc = kvf__gpu_use(dev);
  if (rc) return rc;
  int f = -1;
  CUresult r = cu->MemGetHandleForAddressRange(&f, dptr, len, KVF_CU_MEM_RANGE_HANDLE_DMA_BUF_FD, 0);
  if (r != KVF_CU_SUCCESS) {
    /* Refusals (memory the driver will not export, e.g. some imported
     * memory) send the caller to its next way (peermem, bounce); the line
     * says why. */
    bool refused = r == 1 /* INVALID_VALUE */ || r == 800 /* NOT_PERMITTED */ || r == KVF_CU_ERROR_NOT_SUPPORTED;
    char buf[200];
    kvf__log(refused ? KVF__LOG_INFO : KVF__LOG_WARN, "cuda: dmabuf export of %llu bytes of cuda:%d memory %s: %s",
             (unsigned long long)len, dev, refused ? "refused" : "failed", cu_err(cu, r, buf, sizeof(buf)));
    return refused ? -ENOTSUP : -EIO;
  }
  *fd = f;
  *offset = 0;
  return 0;
}
