/* libkvferry_cuda.h - the library's CUDA side (libkvferry_cuda.c): mapping
 * cuda:N pools into the client process, and exporting the engine's own GPU
 * memory for kvf_mem_register. Internal to libkvferry. */
#ifndef KVF_LIBKVFERRY_CUDA_H
#define KVF_LIBKVFERRY_CUDA_H

#include <stdint.h>

/* Imports the pool's POSIX fd (cuMemImportFromShareableHandle), maps size
 * bytes of it at a fresh device address with read-write access for its GPU
 * and every GPU with peer access to it, and returns that address in *addr.
 * *state is what kvf__cuda_unmap takes. The caller keeps fd (and closes
 * it). Returns 0, -ENODEV (no CUDA driver in this process), KVF_EPROTO (the
 * daemon's size does not fit the allocation) or -EIO. The calling thread's
 * current CUDA context is left as it was. */
int kvf__cuda_map_fd(int fd, uint64_t size, void **addr, void **state);
void kvf__cuda_unmap(void *state);
/* After a daemon restart: the pool's new fd mapped at the same addresses as
 * state's mapping (the engine's pointers stay valid; the memory is the new
 * daemon's). 0; KVF_EPROTO when the new pool has another size or GPU (the
 * old mapping is left as it was); -EIO when the driver refuses (the range
 * may then be unmapped: the engine must map the pool anew). */
int kvf__cuda_remap_fd(void *state, int fd, uint64_t size);

/* How a device pointer's allocation can be handed to the daemon
 * (kvf_mem_register). Implemented in libkvferry_cuda.c. */
typedef struct kvf__cuda_export {
  int dev;                 /* the allocation's device ordinal */
  int dmabuf_fd;           /* ipc route: a dmabuf of the whole allocation for
                              the daemon's NICs (a process that imported an
                              IPC handle cannot make one), or -1 */
  uint64_t alloc_base;     /* the allocation's first byte (cuMemGetAddressRange) */
  uint64_t alloc_size;
  int fd;                  /* VMM allocation exported as a POSIX fd, or -1 */
  uint8_t ipc[64];         /* else its CUipcMemHandle */
  char bus_id[32];         /* dev's PCI bus id ("0000:19:00.0"), or "" */
} kvf__cuda_export;
/* Fills *ex for the allocation holding [dptr, dptr + size): the VMM fd when
 * the allocation allows it (cuMemRetainAllocationHandle +
 * cuMemExportToShareableHandle), else cuIpcGetMemHandle. ex->dev is in this
 * process's numbering (the daemon finds the GPU itself). Returns 0, -ENODEV
 * (no CUDA driver), KVF_EINVAL (not device memory of this process, managed
 * memory, or the range leaves device memory), -ENOTSUP (it cannot be
 * shared as one allocation: the range spans several, as a large tensor
 * does under PyTorch's expandable_segments; a VMM allocation made without
 * the POSIX fd handle type; a cudaMallocAsync pool's memory; a driver
 * without these calls) or -EIO. The calling thread's current context is left as it was.
 * The caller closes ex->fd when >= 0. */
int kvf__cuda_export_range(const void *dptr, uint64_t size, kvf__cuda_export *ex);

#endif
