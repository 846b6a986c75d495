/* kernel_image.h - the copy kernel as nvcc built it (a fatbin: sm_90 SASS
 * plus compute_90 PTX), embedded in the daemon at build time. */
#ifndef KVF_KERNEL_IMAGE_H
#define KVF_KERNEL_IMAGE_H

#include <stddef.h>

/* The image for cuModuleLoadData, or NULL when the build had no nvcc.
 * *len (if len is not NULL) gets its size. */
const unsigned char *kvf__kernel_image(size_t *len);

#endif
