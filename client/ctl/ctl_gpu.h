/* ctl_gpu.h - `kvferryctl doctor`'s GPU checks (ctl_gpu.c), after the
 * GPUDirect field guides. Each returns a result in ctl_doctor.c's order
 * (0 ok, 1 warn, 2 fail, 3 skip) and writes one line of detail that says
 * what to do when it is not ok. They read sysfs/procfs and load the CUDA
 * driver with dlopen; none needs the daemon except ctl_gpu_pools. */
#ifndef KVF_CTL_GPU_H
#define KVF_CTL_GPU_H

#include <stddef.h>

enum { CTL_GPU_OK = 0, CTL_GPU_WARN = 1, CTL_GPU_FAIL = 2, CTL_GPU_SKIP = 3 };

int ctl_gpu_driver(char *detail, size_t cap);   /* the driver loads and sees GPUs */
int ctl_gpu_dmabuf(char *detail, size_t cap);   /* GPUs and kernel can export dmabuf */
int ctl_gpu_peermem(char *detail, size_t cap);  /* nvidia_peermem loaded (or not needed) */
int ctl_gpu_iommu(char *detail, size_t cap);    /* IOMMU off or passthrough for the GPUs */
int ctl_gpu_bar1(char *detail, size_t cap);     /* BAR1 covers GPU memory */
int ctl_gpu_nic_path(char *detail, size_t cap); /* GPU and nearest RDMA NIC share a PCIe switch */
int ctl_gpu_acs(char *detail, size_t cap);      /* no ACS redirect on the bridges between them */
/* pools: the daemon's POOLS document (JSON) or NULL when it did not answer. */
int ctl_gpu_pools(const char *pools, char *detail, size_t cap);

#endif
