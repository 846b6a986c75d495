/* libkvferry_cuda.h - the library's CUDA side (libkvferry_cuda.c): mapping
 * cuda:N pools into the client process. Internal to libkvferry. */
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

#endif
