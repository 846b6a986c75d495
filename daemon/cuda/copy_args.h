/* copy_args.h - the batched copy kernel's arguments, shared by the C side
 * (which builds them) and the kernel (copy_kernel.cu, which reads them).
 *
 * A batch is an array of chunks in device-visible memory; one launch copies
 * all of them. Each chunk is at most KVF__CHUNK_BYTES, cut from a run at
 * multiples of that size, so the relative alignment of source and
 * destination is the same in every chunk of a run. The kernel copies a
 * chunk in three parts: head bytes one by one until the source is aligned
 * to the widest unit both pointers share (16, 8, 4, 2 or 1 bytes), a body in
 * that unit, and the tail. kvf_chunk_split() is that rule; the CPU tests run
 * it against memcpy. */
#ifndef KVF_COPY_ARGS_H
#define KVF_COPY_ARGS_H

#ifdef __CUDACC__
#define KVF_HD static __host__ __device__ __forceinline__
#else
#include <stdint.h>
#define KVF_HD static inline
#endif

/* Chunks bigger than this are cut; 32 KiB is one KV block of most models and
 * keeps a CTA's work in one pass of 16-byte loads. */
#define KVF__CHUNK_BYTES (32u << 10)

typedef struct kvf_chunk {
  unsigned long long src;   /* device-visible addresses */
  unsigned long long dst;
  unsigned int len;         /* 1..KVF__CHUNK_BYTES */
  unsigned int pad;
} kvf_chunk;

typedef struct kvf_split {
  unsigned int width;       /* bytes per unit of the body: 16, 8, 4, 2 or 1 */
  unsigned int head;        /* bytes copied singly before the body */
  unsigned int units;       /* units in the body */
  unsigned int tail;        /* bytes copied singly after it */
} kvf_split;

KVF_HD kvf_split kvf_chunk_split(unsigned long long src, unsigned long long dst, unsigned int len) {
  kvf_split s;
  unsigned int w = 16;
  while (w > 1 && ((src ^ dst) & (w - 1))) w >>= 1;
  unsigned int head = (unsigned int)((w - (src & (w - 1))) & (w - 1));
  if (head > len) head = len;
  s.width = w;
  s.head = head;
  s.units = (len - head) / w;
  s.tail = len - head - s.units * w;
  return s;
}

#endif
