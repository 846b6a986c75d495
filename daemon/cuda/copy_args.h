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

/* ---------------------------------------------------------------- blocks
 *
 * The block-copy kernel (kvf_blocks): KV blocks between two layouts, with
 * every address computed on the GPU, so that the host's work per request
 * does not grow with the number of layers. Region r (= (layer - first) *
 * n_kv + kv, r < n_regions) of a side starts at base + table[r], its block
 * b at base + table[r] + b * stride. Piece p (r = p / n, i = p % n) copies
 * source block sids[i] of region r to destination block dids[i] of region
 * r, block_bytes each. A launch copies pieces [piece0, piece1): two GPUs
 * share a transfer by launching halves. Each group of `group` threads (a
 * power of two from 32 to the CTA's size) copies one piece at a time in
 * kvf_chunk_split's parts, 16 bytes a load where both sides allow.
 *
 * The ids travel in the launch's parameters (inline_ids: sids then dids)
 * when 2 n fit, else in device memory at ids (one copy per request). */
#define KVF__BLOCKS_INLINE_IDS 864u

typedef struct kvf_blocks_args {
  unsigned long long src_base, dst_base;    /* device addresses of the pools */
  unsigned long long src_table, dst_table;  /* device: u64 offset of each region */
  unsigned long long src_stride, dst_stride;
  unsigned long long ids;                   /* device: sids[n], dids[n]; 0: inline_ids */
  unsigned int block_bytes;
  unsigned int n;                           /* block ids per side */
  unsigned int n_regions;                   /* layers x regions per layer */
  unsigned int piece0, piece1;
  unsigned int group;
  unsigned int inline_ids[KVF__BLOCKS_INLINE_IDS];
} kvf_blocks_args;

/* Threads per piece for blocks of `units` 16-byte units and CTAs of
 * `threads`: enough pieces at once that each thread keeps about 8 loads in
 * flight (a warp per 4 KiB block, a CTA of 256 per 32 KiB one). */
KVF_HD unsigned int kvf_blocks_group(unsigned long long units, unsigned int threads) {
  unsigned int g = 32;
  while (g * 2 <= threads && (unsigned long long)g * 2 * 8 <= units) g *= 2;
  return g;
}

/* ---------------------------------------------------------------- transforms
 *
 * The transform kernel (kvf_xblocks): KV blocks between two layouts of
 * other heads, order (NHD / HND) or tokens per block (daemon/kv_xform.h),
 * every address computed on the GPU from the two geometries and the block
 * ids. The transfer's token t is source block t / s_tpb slot t % s_tpb and
 * destination block t / d_tpb slot t % d_tpb; a chunk of g = min(s_tpb,
 * d_tpb) tokens lies in one block on each side. Piece p (region r = p /
 * chunks, chunk c = p % chunks) copies the g tokens of chunk c of the nh
 * moved heads of region r, as words of `width` bytes in the destination's
 * order, so that a group's stores are contiguous. Tables, strides and ids
 * as kvf_blocks' (sids[ns] then dids[nd], inline when they fit). The word
 * math is here, shared with the CPU tests. */
typedef struct kvf_xblocks_args {
  unsigned long long src_base, dst_base;
  unsigned long long src_table, dst_table;
  unsigned long long src_stride, dst_stride;
  unsigned long long ids;                   /* device: sids[ns], dids[nd]; 0: inline_ids */
  unsigned int unit;                        /* one token of one head: head_dim x dtype bytes */
  unsigned int s_tpb, s_heads, s_order, s_h; /* s_h: the first moved head, from the side's first */
  unsigned int d_tpb, d_heads, d_order, d_h;
  unsigned int nh;                          /* heads moved */
  unsigned int g;                           /* tokens per chunk */
  unsigned int chunks;                      /* per region */
  unsigned int ns, nd;
  unsigned int n_regions;
  unsigned int piece0, piece1;
  unsigned int group;
  unsigned int inline_ids[KVF__BLOCKS_INLINE_IDS];
} kvf_xblocks_args;

/* Where piece p's chunk is: its region, the index of its block on each
 * side (into sids and dids) and the slots its first token takes. */
typedef struct kvf_xloc {
  unsigned int r, si, di, st, dt;
} kvf_xloc;

KVF_HD kvf_xloc kvf_xblocks_locate(const kvf_xblocks_args *a, unsigned int p) {
  kvf_xloc l;
  l.r = p / a->chunks;
  unsigned long long t = (unsigned long long)(p - l.r * a->chunks) * a->g;
  l.si = (unsigned int)(t / a->s_tpb);
  l.st = (unsigned int)(t - (unsigned long long)l.si * a->s_tpb);
  l.di = (unsigned int)(t / a->d_tpb);
  l.dt = (unsigned int)(t - (unsigned long long)l.di * a->d_tpb);
  return l;
}

/* One piece once its two blocks' addresses are known: the widest word (16
 * bytes down to 1) that the unit and both blocks' alignment allow, and the
 * word count. */
typedef struct kvf_xpiece {
  unsigned long long src, dst;              /* the two blocks' first bytes */
  unsigned int st, dt;
  unsigned int width, upw, words;
} kvf_xpiece;

KVF_HD kvf_xpiece kvf_xblocks_piece(const kvf_xblocks_args *a, const kvf_xloc *l, unsigned long long src,
                                    unsigned long long dst) {
  kvf_xpiece x;
  unsigned int w = 16;
  while (w > 1 && ((src | dst | a->unit) & (w - 1))) w >>= 1;
  x.src = src;
  x.dst = dst;
  x.st = l->st;
  x.dt = l->dt;
  x.width = w;
  x.upw = a->unit / w;
  x.words = a->g * a->nh * x.upw;
  return x;
}

/* Token t, head h (from the side's first) from its block's start, in units. */
KVF_HD unsigned long long kvf_xelem(unsigned int order, unsigned int tpb, unsigned int heads, unsigned int t,
                                    unsigned int h) {
  return order == 1 /* KVF_LAYOUT_HND */ ? (unsigned long long)h * tpb + t : (unsigned long long)t * heads + h;
}

/* v / d, and v % d in *rem. Every word of a transform takes two of these,
 * and a GPU has no divider (a 32-bit division is some twenty instructions):
 * the divisors (words per unit, tokens per chunk, heads moved) are powers of
 * two in every real geometry, so those go by shift and mask; the test is
 * the same for every thread of a launch, so it does not diverge. */
KVF_HD unsigned int kvf_divmod(unsigned int v, unsigned int d, unsigned int *rem) {
  if ((d & (d - 1)) == 0) {
    *rem = v & (d - 1);
#ifdef __CUDA_ARCH__
    return v >> (__ffs((int)d) - 1);
#else
    return v >> __builtin_ctz(d);
#endif
  }
  unsigned int q = v / d;
  *rem = v - q * d;
  return q;
}

/* Word w of piece x: its source and destination addresses. */
KVF_HD void kvf_xblocks_word(const kvf_xblocks_args *a, const kvf_xpiece *x, unsigned int w,
                             unsigned long long *src, unsigned long long *dst) {
  unsigned int j, k, h;
  unsigned int q = kvf_divmod(w, x->upw, &j);
  if (a->d_order == 1) h = kvf_divmod(q, a->g, &k);
  else k = kvf_divmod(q, a->nh, &h);
  *src = x->src + kvf_xelem(a->s_order, a->s_tpb, a->s_heads, x->st + k, a->s_h + h) * a->unit + j * x->width;
  *dst = x->dst + kvf_xelem(a->d_order, a->d_tpb, a->d_heads, x->dt + k, a->d_h + h) * a->unit + j * x->width;
}

#endif
