/* cudrv.h - the CUDA driver API, loaded at run time with dlopen.
 *
 * kvferry never links libcuda: one build runs on hosts with and without an
 * NVIDIA driver. This header declares the few types and constants we use
 * (values and layouts as in CUDA 12/13's cuda.h; tests/unit/test_cuda_args.c
 * checks them against cuda.h wherever a toolkit is installed) and a table of
 * entry points filled by kvf__cu_load().
 *
 * Header-only on purpose: the daemon (daemon/cuda/gpu.c), the client library
 * (client/libkvferry_cuda.c) and the tools each include it and get their own
 * static copy, so no symbol crosses the library boundary. */
#ifndef KVF_CUDRV_H
#define KVF_CUDRV_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* When cuda.h came first (the ABI test does that), its types serve. */
#ifndef __cuda_cuda_h__
typedef int CUresult;                 /* 0 = CUDA_SUCCESS */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
#endif

#define KVF_CU_SUCCESS 0
#define KVF_CU_ERROR_NOT_READY 600
#define KVF_CU_ERROR_PEER_ACCESS_ALREADY_ENABLED 704
#define KVF_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712
#define KVF_CU_ERROR_NOT_SUPPORTED 801

/* CUipcMemHandle: 64 opaque bytes, passed by value to cuIpcOpenMemHandle. */
typedef struct kvf_cu_ipc_handle {
  char reserved[64];
} kvf_cu_ipc_handle;
_Static_assert(sizeof(kvf_cu_ipc_handle) == 64, "CU_IPC_HANDLE_SIZE is 64");
#define KVF_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1

/* CUpointer_attribute values we read, and CUmemorytype's device. */
enum {
  KVF_CU_POINTER_ATTR_CONTEXT = 1,
  KVF_CU_POINTER_ATTR_MEMORY_TYPE = 2,
  KVF_CU_POINTER_ATTR_IS_MANAGED = 8,
  KVF_CU_POINTER_ATTR_DEVICE_ORDINAL = 9,
};

typedef struct kvf_cu_mem_location {
  int type;                           /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
  int id;
} kvf_cu_mem_location;

typedef struct kvf_cu_mem_prop {      /* CUmemAllocationProp */
  int type;                           /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int requestedHandleTypes;           /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 */
  kvf_cu_mem_location location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} kvf_cu_mem_prop;

typedef struct kvf_cu_access_desc {   /* CUmemAccessDesc */
  kvf_cu_mem_location location;
  int flags;                          /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} kvf_cu_access_desc;

enum {
  KVF_CU_MEM_ALLOCATION_TYPE_PINNED = 1,
  KVF_CU_MEM_HANDLE_TYPE_POSIX_FD = 1,
  KVF_CU_MEM_LOCATION_TYPE_DEVICE = 1,
  KVF_CU_MEM_ACCESS_RW = 3,
  KVF_CU_MEM_GRANULARITY_MINIMUM = 0,
  KVF_CU_MEM_RANGE_HANDLE_DMA_BUF_FD = 1,
  KVF_CU_MEMHOSTALLOC_PORTABLE = 1,
  KVF_CU_MEMHOSTALLOC_DEVICEMAP = 2,
  KVF_CU_MEMHOSTREGISTER_PORTABLE = 1,
  KVF_CU_MEMHOSTREGISTER_DEVICEMAP = 2,
  KVF_CU_STREAM_NON_BLOCKING = 1,
  KVF_CU_EVENT_DEFAULT = 0,
  KVF_CU_EVENT_DISABLE_TIMING = 2,
};

typedef struct kvf_cu_memcpy2d {     /* CUDA_MEMCPY2D */
  size_t srcXInBytes, srcY;
  int srcMemoryType;                  /* CU_MEMORYTYPE_DEVICE = 2 */
  const void *srcHost;
  CUdeviceptr srcDevice;
  void *srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  int dstMemoryType;
  void *dstHost;
  CUdeviceptr dstDevice;
  void *dstArray;
  size_t dstPitch;
  size_t WidthInBytes, Height;
} kvf_cu_memcpy2d;

#define KVF_CU_MEMORYTYPE_DEVICE 2

/* CUdevice_attribute values we read. */
enum {
  KVF_CU_ATTR_MULTIPROCESSOR_COUNT = 16,
  KVF_CU_ATTR_PCI_BUS_ID = 33,
  KVF_CU_ATTR_PCI_DEVICE_ID = 34,
  KVF_CU_ATTR_UNIFIED_ADDRESSING = 41,
  KVF_CU_ATTR_PCI_DOMAIN_ID = 50,
  KVF_CU_ATTR_CC_MAJOR = 75,
  KVF_CU_ATTR_CC_MINOR = 76,
  KVF_CU_ATTR_HOST_REGISTER_SAME_VA = 91,   /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM */
  KVF_CU_ATTR_VMM_SUPPORTED = 102,
  KVF_CU_ATTR_POSIX_FD_SUPPORTED = 103,
  KVF_CU_ATTR_GDR_WITH_VMM_SUPPORTED = 110,
  KVF_CU_ATTR_GDR_SUPPORTED = 116,
  KVF_CU_ATTR_DMA_BUF_SUPPORTED = 124,
};

/* The entry points; names are the ABI symbols (some _v2). */
typedef struct kvf_cu {
  void *lib;
  int driver_version;
  CUresult (*Init)(unsigned);
  CUresult (*DriverGetVersion)(int *);
  CUresult (*GetErrorName)(CUresult, const char **);
  CUresult (*GetErrorString)(CUresult, const char **);
  CUresult (*DeviceGetCount)(int *);
  CUresult (*DeviceGet)(CUdevice *, int);
  CUresult (*DeviceGetName)(char *, int, CUdevice);
  CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
  CUresult (*DeviceGetPCIBusId)(char *, int, CUdevice);
  CUresult (*DeviceTotalMem)(size_t *, CUdevice);
  CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*DevicePrimaryCtxRelease)(CUdevice);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*CtxGetCurrent)(CUcontext *);
  CUresult (*CtxEnablePeerAccess)(CUcontext, unsigned);
  CUresult (*MemGetAllocationGranularity)(size_t *, const kvf_cu_mem_prop *, int);
  CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const kvf_cu_mem_prop *, unsigned long long);
  CUresult (*MemRelease)(CUmemGenericAllocationHandle);
  CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
  CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
  CUresult (*MemGetAllocationPropertiesFromHandle)(kvf_cu_mem_prop *, CUmemGenericAllocationHandle);
  CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*MemAddressFree)(CUdeviceptr, size_t);
  CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*MemUnmap)(CUdeviceptr, size_t);
  CUresult (*MemSetAccess)(CUdeviceptr, size_t, const kvf_cu_access_desc *, size_t);
  CUresult (*MemGetHandleForAddressRange)(void *, CUdeviceptr, size_t, int, unsigned long long);
  CUresult (*MemAlloc)(CUdeviceptr *, size_t);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*MemHostAlloc)(void **, size_t, unsigned);
  CUresult (*MemFreeHost)(void *);
  CUresult (*MemHostRegister)(void *, size_t, unsigned);
  CUresult (*MemHostUnregister)(void *);
  CUresult (*MemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned);
  CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
  CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*MemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*MemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
  CUresult (*MemsetD8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*ModuleLoadData)(CUmodule *, const void *);
  CUresult (*ModuleUnload)(CUmodule);
  CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void **, void **);
  CUresult (*StreamCreate)(CUstream *, unsigned);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*StreamSynchronize)(CUstream);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*EventCreate)(CUevent *, unsigned);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventSynchronize)(CUevent);
  CUresult (*EventQuery)(CUevent);
  CUresult (*EventElapsedTime)(float *, CUevent, CUevent);
  CUresult (*Memcpy2DAsync)(const kvf_cu_memcpy2d *, CUstream);
  /* Optional (NULL when the driver lacks them): engine memory, exported by
   * the library and imported by the daemon (kvf_mem_register). */
  CUresult (*PointerGetAttribute)(void *, int, CUdeviceptr);
  CUresult (*MemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
  CUresult (*MemRetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
  CUresult (*IpcGetMemHandle)(kvf_cu_ipc_handle *, CUdeviceptr);
  CUresult (*IpcOpenMemHandle)(CUdeviceptr *, kvf_cu_ipc_handle, unsigned);
  CUresult (*IpcCloseMemHandle)(CUdeviceptr);
  CUresult (*DevicePrimaryCtxGetState)(CUdevice, unsigned *, int *);
} kvf_cu;

/* "CUDA_ERROR_X: text" for a CUresult, into buf. */
static inline const char *kvf__cu_errstr(const kvf_cu *cu, CUresult r, char *buf, size_t len) {
  const char *name = NULL, *text = NULL;
  if (cu && cu->GetErrorName) cu->GetErrorName(r, &name);
  if (cu && cu->GetErrorString) cu->GetErrorString(r, &text);
  snprintf(buf, len, "%s (%d)%s%s", name ? name : "CUDA error", r, text ? ": " : "", text ? text : "");
  return buf;
}

/* Where libcuda may live when the loader's path does not find it. */
static const char *const kvf__cu_lib_paths[] = {
    "libcuda.so.1",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/wsl/lib/libcuda.so.1",
    NULL,
};

/* Loads the driver and initializes it. $KVF_LIBCUDA names the library to
 * use instead (tests point it at a missing file to take the no-GPU path).
 * Returns 0, or -1 with why written to err ("no NVIDIA driver: ...", "cuInit
 * failed: ..."). */
static inline int kvf__cu_load(kvf_cu *cu, char *err, size_t errlen) {
  memset(cu, 0, sizeof(*cu));
  const char *forced = getenv("KVF_LIBCUDA");
  const char *last = NULL;
  char first_err[200] = "";
  if (forced && *forced) {
    cu->lib = dlopen(forced, RTLD_NOW | RTLD_LOCAL);
    last = forced;
    if (!cu->lib) snprintf(first_err, sizeof(first_err), "%s", dlerror());
  } else {
    for (const char *const *p = kvf__cu_lib_paths; *p && !cu->lib; p++) {
      cu->lib = dlopen(*p, RTLD_NOW | RTLD_LOCAL);
      last = *p;
      if (!cu->lib && !first_err[0]) snprintf(first_err, sizeof(first_err), "%s", dlerror());
    }
  }
  if (!cu->lib) {
    snprintf(err, errlen, "no NVIDIA driver (%s)", first_err[0] ? first_err : "libcuda.so.1 not found");
    return -1;
  }
  struct { void **slot; const char *name; const char *alt; } syms[] = {
#define KVF_CU_SYM(field, sym, alt) {(void **)&cu->field, sym, alt}
      KVF_CU_SYM(Init, "cuInit", NULL),
      KVF_CU_SYM(DriverGetVersion, "cuDriverGetVersion", NULL),
      KVF_CU_SYM(GetErrorName, "cuGetErrorName", NULL),
      KVF_CU_SYM(GetErrorString, "cuGetErrorString", NULL),
      KVF_CU_SYM(DeviceGetCount, "cuDeviceGetCount", NULL),
      KVF_CU_SYM(DeviceGet, "cuDeviceGet", NULL),
      KVF_CU_SYM(DeviceGetName, "cuDeviceGetName", NULL),
      KVF_CU_SYM(DeviceGetAttribute, "cuDeviceGetAttribute", NULL),
      KVF_CU_SYM(DeviceGetPCIBusId, "cuDeviceGetPCIBusId", NULL),
      KVF_CU_SYM(DeviceTotalMem, "cuDeviceTotalMem_v2", NULL),
      KVF_CU_SYM(DeviceCanAccessPeer, "cuDeviceCanAccessPeer", NULL),
      KVF_CU_SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL),
      KVF_CU_SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
      KVF_CU_SYM(CtxSetCurrent, "cuCtxSetCurrent", NULL),
      KVF_CU_SYM(CtxGetCurrent, "cuCtxGetCurrent", NULL),
      KVF_CU_SYM(CtxEnablePeerAccess, "cuCtxEnablePeerAccess", NULL),
      KVF_CU_SYM(MemGetAllocationGranularity, "cuMemGetAllocationGranularity", NULL),
      KVF_CU_SYM(MemCreate, "cuMemCreate", NULL),
      KVF_CU_SYM(MemRelease, "cuMemRelease", NULL),
      KVF_CU_SYM(MemExportToShareableHandle, "cuMemExportToShareableHandle", NULL),
      KVF_CU_SYM(MemImportFromShareableHandle, "cuMemImportFromShareableHandle", NULL),
      KVF_CU_SYM(MemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle", NULL),
      KVF_CU_SYM(MemAddressReserve, "cuMemAddressReserve", NULL),
      KVF_CU_SYM(MemAddressFree, "cuMemAddressFree", NULL),
      KVF_CU_SYM(MemMap, "cuMemMap", NULL),
      KVF_CU_SYM(MemUnmap, "cuMemUnmap", NULL),
      KVF_CU_SYM(MemSetAccess, "cuMemSetAccess", NULL),
      KVF_CU_SYM(MemAlloc, "cuMemAlloc_v2", NULL),
      KVF_CU_SYM(MemFree, "cuMemFree_v2", NULL),
      KVF_CU_SYM(MemHostAlloc, "cuMemHostAlloc", NULL),
      KVF_CU_SYM(MemFreeHost, "cuMemFreeHost", NULL),
      KVF_CU_SYM(MemHostRegister, "cuMemHostRegister_v2", "cuMemHostRegister"),
      KVF_CU_SYM(MemHostUnregister, "cuMemHostUnregister", NULL),
      KVF_CU_SYM(MemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2", NULL),
      KVF_CU_SYM(MemcpyHtoD, "cuMemcpyHtoD_v2", NULL),
      KVF_CU_SYM(MemcpyDtoH, "cuMemcpyDtoH_v2", NULL),
      KVF_CU_SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", NULL),
      KVF_CU_SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", NULL),
      KVF_CU_SYM(MemcpyAsync, "cuMemcpyAsync", NULL),
      KVF_CU_SYM(MemcpyPeerAsync, "cuMemcpyPeerAsync", NULL),
      KVF_CU_SYM(MemsetD8, "cuMemsetD8_v2", NULL),
      KVF_CU_SYM(ModuleLoadData, "cuModuleLoadData", NULL),
      KVF_CU_SYM(ModuleUnload, "cuModuleUnload", NULL),
      KVF_CU_SYM(ModuleGetFunction, "cuModuleGetFunction", NULL),
      KVF_CU_SYM(LaunchKernel, "cuLaunchKernel", NULL),
      KVF_CU_SYM(StreamCreate, "cuStreamCreate", NULL),
      KVF_CU_SYM(StreamDestroy, "cuStreamDestroy_v2", NULL),
      KVF_CU_SYM(StreamSynchronize, "cuStreamSynchronize", NULL),
      KVF_CU_SYM(StreamWaitEvent, "cuStreamWaitEvent", NULL),
      KVF_CU_SYM(EventCreate, "cuEventCreate", NULL),
      KVF_CU_SYM(EventDestroy, "cuEventDestroy_v2", NULL),
      KVF_CU_SYM(EventRecord, "cuEventRecord", NULL),
      KVF_CU_SYM(EventSynchronize, "cuEventSynchronize", NULL),
      KVF_CU_SYM(EventQuery, "cuEventQuery", NULL),
      KVF_CU_SYM(EventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime"),
      KVF_CU_SYM(Memcpy2DAsync, "cuMemcpy2DAsync_v2", NULL),
#undef KVF_CU_SYM
  };
  for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
    *syms[i].slot = dlsym(cu->lib, syms[i].name);
    if (!*syms[i].slot && syms[i].alt) *syms[i].slot = dlsym(cu->lib, syms[i].alt);
    if (!*syms[i].slot) {
      snprintf(err, errlen, "the NVIDIA driver is too old: %s lacks %s (CUDA 12 or newer needed)", last,
               syms[i].name);
      dlclose(cu->lib);
      memset(cu, 0, sizeof(*cu));
      return -1;
    }
  }
  /* Optional: only dmabuf registration needs it (CUDA 11.7+ drivers). */
  cu->MemGetHandleForAddressRange =
      (CUresult(*)(void *, CUdeviceptr, size_t, int, unsigned long long))dlsym(cu->lib, "cuMemGetHandleForAddressRange");
  /* Optional too: engine memory (the functions that need them say
   * -ENOTSUP without them). cuIpc* exist on every Linux driver but may
   * refuse at run time (e.g. under some virtualization). */
  struct { void **slot; const char *name; } opt[] = {
      {(void **)&cu->PointerGetAttribute, "cuPointerGetAttribute"},
      {(void **)&cu->MemGetAddressRange, "cuMemGetAddressRange_v2"},
      {(void **)&cu->MemRetainAllocationHandle, "cuMemRetainAllocationHandle"},
      {(void **)&cu->IpcGetMemHandle, "cuIpcGetMemHandle"},
      {(void **)&cu->IpcOpenMemHandle, "cuIpcOpenMemHandle_v2"},
      {(void **)&cu->IpcCloseMemHandle, "cuIpcCloseMemHandle"},
      {(void **)&cu->DevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState"},
  };
  for (size_t i = 0; i < sizeof(opt) / sizeof(opt[0]); i++) *opt[i].slot = dlsym(cu->lib, opt[i].name);
  CUresult r = cu->Init(0);
  if (r != KVF_CU_SUCCESS) {
    char buf[160];
    snprintf(err, errlen, "cuInit failed: %s", kvf__cu_errstr(cu, r, buf, sizeof(buf)));
    dlclose(cu->lib);
    memset(cu, 0, sizeof(*cu));
    return -1;
  }
  cu->DriverGetVersion(&cu->driver_version);
  return 0;
}

static inline void kvf__cu_unload(kvf_cu *cu) {
  if (cu->lib) dlclose(cu->lib);
  memset(cu, 0, sizeof(*cu));
}

#endif
