/* bench_gpu.c - see bench_gpu.h. */
#include "bench_gpu.h"

#include <stdio.h>

#include "cuda/cudrv.h"

int kvfb_gpu_copy(int dev, uint64_t dptr, void *host, uint64_t len, bool to_dev, char *err, size_t errlen) {
  static kvf_cu cu;
  static bool loaded;
  if (!loaded && kvf__cu_load(&cu, err, errlen) != 0) return -1;
  loaded = true;
  CUdevice d;
  CUcontext ctx, old = NULL;
  cu.CtxGetCurrent(&old);
  CUresult r = cu.DeviceGet(&d, dev);
  if (r == 0) r = cu.DevicePrimaryCtxRetain(&ctx, d);
  if (r == 0) {
    cu.CtxSetCurrent(ctx);
    r = to_dev ? cu.MemcpyHtoD((CUdeviceptr)dptr, host, len) : cu.MemcpyDtoH(host, (CUdeviceptr)dptr, len);
    if (r == 0) r = cu.StreamSynchronize(NULL);
    cu.CtxSetCurrent(old);
    cu.DevicePrimaryCtxRelease(d);
  }
  if (r == 0) return 0;
  char buf[200];
  snprintf(err, errlen, "%s", kvf__cu_errstr(&cu, r, buf, sizeof(buf)));
  return -1;
}
