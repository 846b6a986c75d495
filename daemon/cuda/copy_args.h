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

/* Both block kernels' two pools: where each is, its regions' offsets and
 * its block stride. */
typedef struct kvf_blocks_ends {
  unsigned long long src_base, dst_base;    /* device addresses of the pools */
  unsigned long long src_table, dst_table;  /* device: u64 offset of each region */
  unsigned long long src_stride, dst_stride;
} kvf_blocks_ends;

typedef struct kvf_blocks_args {
  kvf_blocks_ends e;
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
  kvf_blocks_ends e;
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
  unsigned int walk;                        /* 1: every piece by the walk in 16-byte words (kvf_xwalk) */
  unsigned int inline_ids[KVF__BLOCKS_INLINE_IDS];
} kvf_xblocks_args;

/* v / d, and v % d in *rem. A GPU has no divider (a 32-bit division is
 * some twenty instructions), and the transform kernel takes a few of these
 * per piece (and two per word where it goes word by word): the divisors
 * (tokens per block and chunk, words per unit, heads moved, chunks) are
 * powers of two in every real geometry, so those go by shift and mask; the
 * test is the same for every thread of a launch, so it does not diverge. */
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

/* Where piece p's chunk is: its region, the index of its block on each
 * side (into sids and dids) and the slots its first token takes. */
typedef struct kvf_xloc {
  unsigned int r, si, di, st, dt;
} kvf_xloc;

KVF_HD kvf_xloc kvf_xblocks_locate(const kvf_xblocks_args *a, unsigned int p) {
  kvf_xloc l;
  unsigned int c;
  l.r = kvf_divmod(p, a->chunks, &c);
  if ((unsigned long long)a->chunks * a->g <= 0xffffffffull) { /* every real transfer: 32-bit math */
    const unsigned int t = c * a->g;
    l.si = kvf_divmod(t, a->s_tpb, &l.st);
    l.di = kvf_divmod(t, a->d_tpb, &l.dt);
    return l;
  }
  unsigned long long t = (unsigned long long)c * a->g;
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

/* ---------------------------------------------------------------- the walk
 *
 * kvf_xblocks_word costs two divisions per word. The kernel's threads
 * instead walk: in destination order a piece is units q = 0 .. g nh - 1 (a
 * token of a head, upw words each), and when a group of gs threads is a
 * whole number of units wide (upw divides gs), thread t copies word j = t %
 * upw of units q0 = t / upw, q0 + Q, q0 + 2 Q, ... (Q = gs / upw): the same
 * place in every unit it copies. A unit is (outer, inner) with q = outer
 * n_in + inner (HND destination: head, token; NHD: token, head), and each
 * index moves both offsets by a fixed number of bytes, so a step of Q units
 * adds fixed steps to the two offsets and, when the inner index passes n_in
 * (at most once, Q % n_in < n_in), a fixed correction. The divisions are
 * once per thread and piece shape; consecutive threads still take
 * consecutive destination words. Offsets are 32 bits, from the first slot
 * of each piece's blocks (kvf_xwalk_bases): a block is under 4 GiB. */
typedef struct kvf_xwalk {
  unsigned int so, dof;                     /* this thread's first word, from the bases */
  unsigned int in;                          /* its unit's inner index */
  unsigned int count;                       /* its words */
  unsigned int s_step, d_step;              /* per step of Q units */
  unsigned int s_wrap, d_wrap;              /* ... plus these (mod 2^32) when in wraps */
  unsigned int in_step, n_in;
} kvf_xwalk;

/* Thread t of a group of gs on words of `width` bytes: 0 when upw does
 * not divide gs (the kernel then goes word by word). */
KVF_HD int kvf_xwalk_init(const kvf_xblocks_args *a, unsigned int width, unsigned int gs, unsigned int t,
                          kvf_xwalk *w) {
  unsigned int j, r, i0, qi;
  const unsigned int upw = a->unit / width;
  const unsigned int qs = kvf_divmod(gs, upw, &r); /* Q */
  if (r) return 0;
  const unsigned int q0 = kvf_divmod(t, upw, &j);
  /* bytes per token and per head on each side */
  const unsigned int s_tok = (a->s_order == 1 ? 1u : a->s_heads) * a->unit;
  const unsigned int s_head = (a->s_order == 1 ? a->s_tpb : 1u) * a->unit;
  const unsigned int d_tok = (a->d_order == 1 ? 1u : a->d_heads) * a->unit;
  const unsigned int d_head = (a->d_order == 1 ? a->d_tpb : 1u) * a->unit;
  const int hnd = a->d_order == 1;
  const unsigned int n_in = hnd ? a->g : a->nh;
  const unsigned int s_in = hnd ? s_tok : s_head, s_out = hnd ? s_head : s_tok;
  const unsigned int d_in = hnd ? d_tok : d_head, d_out = hnd ? d_head : d_tok;
  const unsigned int o0 = kvf_divmod(q0, n_in, &i0), qo = kvf_divmod(qs, n_in, &qi);
  const unsigned int units = a->g * a->nh;
  w->so = o0 * s_out + i0 * s_in + j * width;
  w->dof = o0 * d_out + i0 * d_in + j * width;
  w->in = i0;
  w->count = q0 < units ? kvf_divmod(units - q0 + qs - 1, qs, &r) : 0;
  w->s_step = qo * s_out + qi * s_in;
  w->d_step = qo * d_out + qi * d_in;
  w->s_wrap = s_out - n_in * s_in;
  w->d_wrap = d_out - n_in * d_in;
  w->in_step = qi;
  w->n_in = n_in;
  return 1;
}

/* One side's next unit: its offset *off advances by step, and by wrap
 * more when the inner index *in passes n_in. The kernel walks the two sides
 * apart (loads ahead of stores), so each keeps its own inner index. */
KVF_HD void kvf_xwalk_next(const kvf_xwalk *w, unsigned int *off, unsigned int *in, unsigned int step,
                           unsigned int wrap) {
  *off += step;
  *in += w->in_step;
  if (*in >= w->n_in) {
    *in -= w->n_in;
    *off += wrap;
  }
}

/* Where piece x's offsets start: its first token's slot, its first moved
 * head, in each of its two blocks. */
KVF_HD void kvf_xwalk_bases(const kvf_xblocks_args *a, const kvf_xpiece *x, unsigned long long *src,
                            unsigned long long *dst) {
  *src = x->src + kvf_xelem(a->s_order, a->s_tpb, a->s_heads, x->st, a->s_h) * a->unit;
  *dst = x->dst + kvf_xelem(a->d_order, a->d_tpb, a->d_heads, x->dt, a->d_h) * a->unit;
}

#endif
