/* bench_gpu.h - the benchmarks' copies between a host shadow and a cuda
 * pool they mapped (kvf_pool_map gives a device pointer): the CUDA driver
 * API, loaded with dlopen as the library does, on the device's primary
 * context. */
#ifndef KVF_BENCH_GPU_H
#define KVF_BENCH_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Copies len bytes from host to device address dptr on GPU dev (to_dev)
 * or back, and returns once they landed (from pageable memory
 * cuMemcpyHtoD may return before its DMA did, and the daemon, another
 * process, must not copy ahead of it). 0, or -1 with err. */
int kvfb_gpu_copy(int dev, uint64_t dptr, void *host, uint64_t len, bool to_dev, char *err, size_t errlen);

#endif
