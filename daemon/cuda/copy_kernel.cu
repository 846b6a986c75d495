// copy_kernel.cu - the batched gather/scatter copy: one launch moves every
// chunk of a batch (copy_args.h), whatever mix of devices, peers (NVLink or
// PCIe peer access) and mapped host memory the addresses point at.
//
// Built by nvcc at build time (sm_90 SASS plus compute_90 PTX, so newer GPUs
// JIT it), embedded in kvferryd (kernel_image.c) and loaded with
// cuModuleLoadData. Entry points differ only in how many loads each thread
// keeps in flight and in cache hints; gpu.c picks one (KVF_CUDA_KERNEL
// overrides it for experiments).
//
// Grid: any number of CTAs, each walks chunks blockIdx.x, +gridDim.x, ...
// All threads of a CTA work on one chunk at a time: thread t copies units
// t, t+blockDim, ... so a warp's accesses are contiguous (coalesced).
// kvf_copy_w8 instead gives each warp a chunk of its own.
//
// Measured on an H200 NVLink pair (bench/RESULTS.md, `gpu_copy sweep`):
// every entry point, launch shape and push/pull split lands within about 1%
// of the others, at 0.91-0.93 of the copy engines' contiguous rate: the SMs'
// NVLink traffic, not the kernel, sets the ceiling. The default is
// kvf_copy_u8, 256 threads, 2 CTAs per SM, copies split half pushed by the
// source GPU and half pulled by the destination GPU.
#include "copy_args.h"

// Cache policies (P): 0 = L2 only (ld/st.global.cg), 1 = streaming, evict
// first (.cs), 2 = read-only path for loads (ld.global.nc) and write-back
// stores, 3 = plain loads and stores (generic, default caching). The
// addresses come in as integers, so without 0-2 the compiler emits generic
// ld/st; each of those is an ld.global/st.global.
template <typename T, int P>
__device__ __forceinline__ T load(const T *p) {
  if (P == 1) return __ldcs(p);
  if (P == 2) return __ldg(p);
  if (P == 3) return *p;
  return __ldcg(p);
}

template <typename T, int P>
__device__ __forceinline__ void store(T *p, const T &v) {
  if (P == 1) __stcs(p, v);
  else if (P == 2) __stwb(p, v);
  else if (P == 3) *p = v;
  else __stcg(p, v);
}

// Thread t of a group of `stride` threads copies units t, t+stride, ...; U
// loads are issued before their stores so that U are in flight per thread.
template <typename T, int U, int CS>
__device__ __forceinline__ void copy_units(const T *__restrict__ s, T *__restrict__ d, unsigned n, unsigned t,
                                           unsigned stride) {
  unsigned i = t;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    T r[U];
#pragma unroll
    for (int k = 0; k < U; k++) r[k] = load<T, CS>(s + i + k * stride);
#pragma unroll
    for (int k = 0; k < U; k++) store<T, CS>(d + i + k * stride, r[k]);
  }
  for (; i < n; i += stride) store<T, CS>(d + i, load<T, CS>(s + i));
}

// One chunk, by a group of nt >= 32 threads (a CTA or a warp); t is the
// thread's index in the group.
template <int U, int CS>
__device__ __forceinline__ void copy_one(const kvf_chunk &ch, const kvf_split &sp, unsigned t, unsigned nt) {
  const unsigned char *s = (const unsigned char *)ch.src;
  unsigned char *d = (unsigned char *)ch.dst;
  // head and tail are < 16 bytes and nt >= 32
  if (t < sp.head) d[t] = s[t];
  const unsigned tail_off = sp.head + sp.units * sp.width;
  if (t < sp.tail) d[tail_off + t] = s[tail_off + t];
  s += sp.head;
  d += sp.head;
  switch (sp.width) {
  case 16: copy_units<uint4, U, CS>((const uint4 *)s, (uint4 *)d, sp.units, t, nt); break;
  case 8: copy_units<unsigned long long, U, CS>((const unsigned long long *)s, (unsigned long long *)d, sp.units, t, nt); break;
  case 4: copy_units<unsigned, U, CS>((const unsigned *)s, (unsigned *)d, sp.units, t, nt); break;
  case 2: copy_units<unsigned short, U, CS>((const unsigned short *)s, (unsigned short *)d, sp.units, t, nt); break;
  default: copy_units<unsigned char, U, CS>(s, d, sp.units, t, nt); break;
  }
}

// A CTA per chunk: CTA b copies chunks b, b + gridDim.x, ...
template <int U, int CS>
__device__ __forceinline__ void copy_chunks(const kvf_chunk *__restrict__ chunks, unsigned n) {
  for (unsigned c = blockIdx.x; c < n; c += gridDim.x) {
    const kvf_chunk ch = chunks[c];
    copy_one<U, CS>(ch, kvf_chunk_split(ch.src, ch.dst, ch.len), threadIdx.x, blockDim.x);
  }
}

// A warp per chunk: more chunks in flight at once, each streamed by one warp.
template <int U, int CS>
__device__ __forceinline__ void copy_chunks_warp(const kvf_chunk *__restrict__ chunks, unsigned n) {
  const unsigned wpc = blockDim.x / 32, lane = threadIdx.x & 31;
  for (unsigned c = blockIdx.x * wpc + threadIdx.x / 32; c < n; c += gridDim.x * wpc) {
    const kvf_chunk ch = chunks[c];
    copy_one<U, CS>(ch, kvf_chunk_split(ch.src, ch.dst, ch.len), lane, 32);
  }
}

// ---------------------------------------------------------------- bulk (TMA)
// The 16-byte-aligned body of each chunk moves global -> shared -> global
// with cp.async.bulk (Hopper's bulk copy engine), issued by one thread, two
// shared stages so that the store of one overlaps the load of the next;
// heads, tails and chunks whose two sides differ in alignment take the
// thread path above. Launch with few threads and several CTAs per SM.
#define KVF_TMA_STAGE 16384u

__device__ __forceinline__ unsigned smem_u32(const void *p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void tma_wait(unsigned bar, unsigned phase) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "KVF_WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra KVF_WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(phase)
      : "memory");
}

extern "C" __global__ void __launch_bounds__(1024) kvf_copy_tma(const kvf_chunk *__restrict__ chunks, unsigned n) {
  __shared__ __align__(128) unsigned char buf[2][KVF_TMA_STAGE];
  __shared__ __align__(8) unsigned long long bar[2];
  unsigned phases = 0; // bit i: the parity stage i waits for next
  int stage = 0;
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; i++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar[i])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  for (unsigned c = blockIdx.x; c < n; c += gridDim.x) {
    const kvf_chunk ch = chunks[c];
    const kvf_split sp = kvf_chunk_split(ch.src, ch.dst, ch.len);
    if (sp.width != 16 || sp.units == 0) {
      copy_one<4, 0>(ch, sp, threadIdx.x, blockDim.x);
      continue;
    }
    const unsigned char *s = (const unsigned char *)ch.src;
    unsigned char *d = (unsigned char *)ch.dst;
    if (threadIdx.x < sp.head) d[threadIdx.x] = s[threadIdx.x];
    const unsigned tail_off = sp.head + sp.units * 16;
    if (threadIdx.x < sp.tail) d[tail_off + threadIdx.x] = s[tail_off + threadIdx.x];
    if (threadIdx.x != 0) continue;
    const unsigned long long src = ch.src + sp.head, dst = ch.dst + sp.head;
    const unsigned bytes = sp.units * 16;
    for (unsigned off = 0; off < bytes; off += KVF_TMA_STAGE) {
      const unsigned k = bytes - off < KVF_TMA_STAGE ? bytes - off : KVF_TMA_STAGE;
      const unsigned b = smem_u32(buf[stage]), m = smem_u32(&bar[stage]);
      // the store that last read this stage must have read it
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(m), "r"(k) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(b),
                   "l"(src + off), "r"(k), "r"(m)
                   : "memory");
      tma_wait(m, (phases >> stage) & 1u);
      phases ^= 1u << stage;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + off), "r"(b), "r"(k) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      stage ^= 1;
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

#define KVF_COPY_ENTRY(name, body)                                                               \
  extern "C" __global__ void __launch_bounds__(1024) name(const kvf_chunk *__restrict__ chunks, unsigned n) { \
    body;                                                                                        \
  }

KVF_COPY_ENTRY(kvf_copy_u8wb, (copy_chunks<8, 3>(chunks, n)))
KVF_COPY_ENTRY(kvf_copy_w8, (copy_chunks_warp<8, 0>(chunks, n)))

extern "C" __global__ void __launch_bounds__(1024) kvf_copy_u4(const kvf_chunk *__restrict__ chunks, unsigned n) {
  copy_chunks<4, 0>(chunks, n);
}

extern "C" __global__ void __launch_bounds__(1024) kvf_copy_u8(const kvf_chunk *__restrict__ chunks, unsigned n) {
  copy_chunks<8, 0>(chunks, n);
}

extern "C" __global__ void __launch_bounds__(1024) kvf_copy_u8cs(const kvf_chunk *__restrict__ chunks, unsigned n) {
  copy_chunks<8, 1>(chunks, n);
}

extern "C" __global__ void __launch_bounds__(1024) kvf_copy_u8nc(const kvf_chunk *__restrict__ chunks, unsigned n) {
  copy_chunks<8, 2>(chunks, n);
}

// ---------------------------------------------------------------- blocks
// KV blocks by id between two layouts (copy_args.h, kvf_blocks_args): each
// group of a.group threads computes its piece's two addresses from the
// layouts' offset tables and the block ids, then copies it as copy_one
// does. Within a group the id and the table entry are uniform, so reads of
// the inline ids from the parameter space are broadcasts; consecutive
// groups take consecutive ids of one region, so the table entry stays in
// cache. __grid_constant__: the ids are read where the launch put them,
// never copied per thread.
extern "C" __global__ void __launch_bounds__(1024) kvf_blocks(const __grid_constant__ kvf_blocks_args a) {
  const unsigned gs = a.group, gpc = blockDim.x / gs, t = threadIdx.x & (gs - 1);
  const unsigned *gids = (const unsigned *)a.ids;
  const unsigned long long *st = (const unsigned long long *)a.e.src_table;
  const unsigned long long *dt = (const unsigned long long *)a.e.dst_table;
  for (unsigned p = a.piece0 + blockIdx.x * gpc + threadIdx.x / gs; p < a.piece1; p += gridDim.x * gpc) {
    const unsigned r = p / a.n, i = p - r * a.n;
    const unsigned sid = gids ? gids[i] : a.inline_ids[i];
    const unsigned did = gids ? gids[a.n + i] : a.inline_ids[a.n + i];
    kvf_chunk ch;
    ch.src = a.e.src_base + st[r] + sid * a.e.src_stride;
    ch.dst = a.e.dst_base + dt[r] + did * a.e.dst_stride;
    ch.len = a.block_bytes;
    copy_one<8, 0>(ch, kvf_chunk_split(ch.src, ch.dst, ch.len), t, gs);
  }
}

// ---------------------------------------------------------------- transforms
// KV blocks between layouts of other heads, order or tokens per block
// (copy_args.h, kvf_xblocks_args): each group of a.group threads takes a
// piece (the g tokens of one chunk of one region), finds its two blocks
// from the tables and the ids, and copies its words in the destination's
// order, so consecutive threads store consecutive words (coalesced stores;
// the loads are whole units of a head, 256 bytes at llama's geometry). Each
// thread keeps up to 8 loads in flight, as kvf_blocks does: with one load
// at a time (a divmod per word) the transform ran at 0.65-0.70x of
// kvf_blocks on an H200, with 8 and the walk at 0.96-1.04x (bench/RESULTS.md,
// gpu_xform bench). The word width is uniform within a piece: no divergence.

// A thread's words of a piece by the walk (copy_args.h, kvf_xwalk): fixed
// steps, no division per word.
template <typename T, bool WRAP>
__device__ __forceinline__ void xwalk_copy(unsigned long long sb, unsigned long long db, const kvf_xwalk &w) {
  unsigned so = w.so, si = w.in, dof = w.dof, di = w.in;
  for (unsigned n = w.count; n;) {
    const unsigned m = n < 8 ? n : 8;
    T r[8];
    // the loads walk ahead, the stores follow: no offsets held in between
#pragma unroll
    for (unsigned k = 0; k < 8; k++)
      if (k < m) {
        r[k] = load<T, 0>((const T *)(sb + so));
        if (WRAP) kvf_xwalk_next(&w, &so, &si, w.s_step, w.s_wrap);
        else so += w.s_step;
      }
#pragma unroll
    for (unsigned k = 0; k < 8; k++)
      if (k < m) {
        store<T, 0>((T *)(db + dof), r[k]);
        if (WRAP) kvf_xwalk_next(&w, &dof, &di, w.d_step, w.d_wrap);
        else dof += w.d_step;
      }
    n -= m;
  }
}

// Word by word, where the walk does not fit (a unit that is no whole
// number of a group's widths: MLA's 1,152 bytes, odd head dims).
template <typename T>
__device__ __forceinline__ void xwords(const kvf_xblocks_args &a, const kvf_xpiece &x, unsigned t, unsigned gs) {
  for (unsigned w = t; w < x.words; w += gs) {
    unsigned long long s, d;
    kvf_xblocks_word(&a, &x, w, &s, &d);
    store<T, 0>((T *)d, load<T, 0>((const T *)s));
  }
}

// Piece p's two blocks.
__device__ __forceinline__ kvf_xpiece xblocks_piece(const kvf_xblocks_args &a, unsigned p) {
  const unsigned *gids = (const unsigned *)a.ids;
  const unsigned long long *st = (const unsigned long long *)a.e.src_table;
  const unsigned long long *dt = (const unsigned long long *)a.e.dst_table;
  const kvf_xloc l = kvf_xblocks_locate(&a, p);
  const unsigned sid = gids ? gids[l.si] : a.inline_ids[l.si];
  const unsigned did = gids ? gids[a.ns + l.di] : a.inline_ids[a.ns + l.di];
  return kvf_xblocks_piece(&a, &l, a.e.src_base + st[l.r] + sid * a.e.src_stride,
                           a.e.dst_base + dt[l.r] + did * a.e.dst_stride);
}

// Two loops, one per launch (a.walk is the host's): the walk's registers
// and the word-by-word path's are never live together, so neither spills.
extern "C" __global__ void __launch_bounds__(1024) kvf_xblocks(const __grid_constant__ kvf_xblocks_args a) {
  const unsigned gs = a.group, gpc = blockDim.x / gs, t = threadIdx.x & (gs - 1);
  const unsigned p0 = a.piece0 + blockIdx.x * gpc + threadIdx.x / gs, step = gridDim.x * gpc;
  if (a.walk) {
    kvf_xwalk w;
    kvf_xwalk_init(&a, 16, gs, t, &w); // the same in every piece
    for (unsigned p = p0; p < a.piece1; p += step) {
      const kvf_xpiece x = xblocks_piece(a, p);
      unsigned long long sb, db;
      kvf_xwalk_bases(&a, &x, &sb, &db);
      if (w.in_step) xwalk_copy<uint4, true>(sb, db, w);
      else xwalk_copy<uint4, false>(sb, db, w);
    }
    return;
  }
  for (unsigned p = p0; p < a.piece1; p += step) {
    const kvf_xpiece x = xblocks_piece(a, p);
    switch (x.width) {
    case 16: xwords<uint4>(a, x, t, gs); break;
    case 8: xwords<unsigned long long>(a, x, t, gs); break;
    case 4: xwords<unsigned>(a, x, t, gs); break;
    case 2: xwords<unsigned short>(a, x, t, gs); break;
    default: xwords<unsigned char>(a, x, t, gs); break;
    }
  }
}
