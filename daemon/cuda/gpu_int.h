/* gpu_int.h - what gpu.c shares with the module's other files
 * (gpu_import.c): the loaded driver and the devices' primary contexts.
 * Not for use outside daemon/cuda/. */
#ifndef KVF_GPU_INT_H
#define KVF_GPU_INT_H

#include "cudrv.h"

/* The driver's entry points; NULL until kvf__gpu_init found a GPU. */
const kvf_cu *kvf__gpu_driver(void);
/* Makes device dev's primary context current on the calling thread: 0,
 * -ENODEV (no such device) or -EIO (logged). */
int kvf__gpu_use(int dev);
/* The CUdevice of the daemon's device ordinal dev (dev < kvf__gpu_count()). */
CUdevice kvf__gpu_cudev(int dev);

#endif
