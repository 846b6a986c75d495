/* test_cuda_args.c - the CUDA side without a GPU: descriptor -> kernel
 * argument logic (chunk cutting, the head/body/tail split the kernel uses,
 * which device runs a copy, the grid), checked by running the kernel's
 * exact per-chunk rule on the CPU against memcpy; the driver ABI we declare
 * ourselves (cudrv.h) against cuda.h when a toolkit is installed; and the
 * no-driver path of the daemon and of the client library. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#if defined(__has_include)
#if __has_include("/usr/local/cuda/include/cuda.h")
#include "/usr/local/cuda/include/cuda.h"
#define HAVE_CUDA_H 1
#endif
#endif

#include "cuda/copy_args.h"
#include "cuda/cudrv.h"
#include "cuda/gpu.h"
#include "libkvferry_cuda.h"
#include "config.h"
#include "kvferry.h"
#include "layout.h"
#include "log.h"
#include "pool.h"

static uint64_t rng = 0x243f6a8885a308d3ull;
static uint64_t rnd(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

/* ------------------------------------------------------------ the split */

/* Runs one chunk the way copy_kernel.cu does (blockDim threads, unit
 * t, t + blockDim, ...), checking that every unit access is aligned to its
 * width on both sides, as the GPU requires. */
static void emulate_chunk(const kvf_chunk *ch, unsigned block_dim) {
  kvf_split sp = kvf_chunk_split(ch->src, ch->dst, ch->len);
  const uint8_t *s = (const uint8_t *)(uintptr_t)ch->src;
  uint8_t *d = (uint8_t *)(uintptr_t)ch->dst;
  assert_true(sp.width == 1 || sp.width == 2 || sp.width == 4 || sp.width == 8 || sp.width == 16);
  assert_true(sp.head < 16 && sp.tail < 16);
  assert_int_equal(sp.head + sp.units * sp.width + sp.tail, ch->len);
  for (unsigned t = 0; t < block_dim; t++) {
    if (t < sp.head) d[t] = s[t];
    unsigned tail_off = sp.head + sp.units * sp.width;
    if (t < sp.tail) d[tail_off + t] = s[tail_off + t];
    for (unsigned i = t; i < sp.units; i += block_dim) {
      uint64_t so = ch->src + sp.head + (uint64_t)i * sp.width, dof = ch->dst + sp.head + (uint64_t)i * sp.width;
      if (so % sp.width || dof % sp.width) fail_msg("unaligned unit: src %llx dst %llx width %u", (unsigned long long)so,
                                                    (unsigned long long)dof, sp.width);
      memcpy((void *)(uintptr_t)dof, (const void *)(uintptr_t)so, sp.width);
    }
  }
}

static void test_split_widths(void **state) {
  /* both 16-aligned: all body */
  kvf_split s = kvf_chunk_split(0x1000, 0x2000, 32768);
  assert_int_equal(s.width, 16);
  assert_int_equal(s.head, 0);
  assert_int_equal(s.units, 2048);
  assert_int_equal(s.tail, 0);
  /* same misalignment: head aligns both */
  s = kvf_chunk_split(0x1003, 0x2003, 100);
  assert_int_equal(s.width, 16);
  assert_int_equal(s.head, 13);
  assert_int_equal(s.units, 5);
  assert_int_equal(s.tail, 7);
  /* differ by 8: 8-byte units */
  s = kvf_chunk_split(0x1000, 0x2008, 64);
  assert_int_equal(s.width, 8);
  /* odd difference: bytes */
  s = kvf_chunk_split(0x1000, 0x2001, 64);
  assert_int_equal(s.width, 1);
  assert_int_equal(s.units, 64);
  /* shorter than the head */
  s = kvf_chunk_split(0x1001, 0x2001, 3);
  assert_int_equal(s.head, 3);
  assert_int_equal(s.units, 0);
  assert_int_equal(s.tail, 0);
}

static void test_split_random_vs_memcpy(void **state) {
  enum { N = 1 << 16 };
  uint8_t *src = malloc(N), *dst = malloc(N), *ref = malloc(N);
  assert_non_null(src);
  for (int iter = 0; iter < 20000; iter++) {
    for (int i = 0; i < N; i++) src[i] = (uint8_t)rnd();
    memset(dst, 0xa5, N);
    memcpy(ref, dst, N);
    unsigned len = 1 + (unsigned)(rnd() % (iter % 3 ? 200 : KVF__CHUNK_BYTES));
    uint64_t so = rnd() % (N - len), dof = rnd() % (N - len);
    kvf_chunk ch = {(uintptr_t)(src + so), (uintptr_t)(dst + dof), len, 0};
    emulate_chunk(&ch, iter % 2 ? 32 : 512);
    memcpy(ref + dof, src + so, len);
    if (memcmp(dst, ref, N) != 0) fail_msg("iteration %d: src+%llu dst+%llu len %u differs", iter,
                                           (unsigned long long)so, (unsigned long long)dof, len);
    if (iter == 200) iter = 19900; /* the full-buffer refill is slow; keep it short */
  }
  free(src);
  free(dst);
  free(ref);
}

/* ------------------------------------------------------------ cutting runs */

static void test_cut(void **state) {
  kvf_chunk out[64];
  size_t n = 0;
  /* 100 KiB + 5: four chunks, the last of 4 KiB + 5 */
  uint64_t len = 100 * 1024 + 5;
  assert_int_equal(kvf__gpu_plan_cut(0x10003, 0x20003, len, out, &n, 64), 4);
  assert_int_equal(n, 4);
  uint64_t sum = 0;
  for (size_t i = 0; i < n; i++) {
    assert_true(out[i].len >= 1 && out[i].len <= KVF__CHUNK_BYTES);
    assert_int_equal(out[i].src, 0x10003 + sum);
    assert_int_equal(out[i].dst, 0x20003 + sum);
    /* the relative alignment is kept: every chunk gets the same width */
    assert_int_equal(kvf_chunk_split(out[i].src, out[i].dst, out[i].len).width, 16);
    sum += out[i].len;
  }
  assert_int_equal(sum, len);
  /* not enough room: nothing appended, the need is returned */
  size_t m = 62;
  assert_int_equal(kvf__gpu_plan_cut(0, 0, 3 * KVF__CHUNK_BYTES, out, &m, 64), 3);
  assert_int_equal(m, 62);
  /* zero length: nothing */
  m = 0;
  kvf__gpu_plan_cut(0, 0, 0, out, &m, 64);
  assert_int_equal(m, 0);
}

/* A whole batch, as local.c builds it: scattered runs of odd sizes between
 * two "pools", cut, then executed chunk by chunk in grid-stride order. */
static void test_batch_vs_memcpy(void **state) {
  enum { POOL = 4 << 20, RUNS = 2000 }; /* slots end at 2.4 MB; the big run after */
  uint8_t *a = malloc(POOL), *b = malloc(POOL), *ref = malloc(POOL);
  kvf_chunk *chunks = malloc(sizeof(kvf_chunk) * 65536);
  assert_non_null(chunks);
  for (size_t i = 0; i < POOL; i++) a[i] = (uint8_t)rnd();
  memset(b, 0x5b, POOL);
  memcpy(ref, b, POOL);
  size_t n = 0;
  /* disjoint destination slots of 1200 bytes; lengths 1..1200 or one big run */
  for (int r = 0; r < RUNS; r++) {
    uint64_t len = r == 7 ? 1000000 : 1 + rnd() % 1200;
    uint64_t dof = r == 7 ? 2500013 : (uint64_t)r * 1200 + rnd() % 16;
    if (r != 7 && dof + len > (uint64_t)(r + 1) * 1200) len = (uint64_t)(r + 1) * 1200 - dof;
    uint64_t so = rnd() % (POOL - len);
    kvf__gpu_plan_cut((uintptr_t)(a + so), (uintptr_t)(b + dof), len, chunks, &n, 65536);
    memcpy(ref + dof, a + so, len);
  }
  unsigned grid = kvf__gpu_plan_grid(n, 132, 2);
  assert_int_equal(grid, 264);
  for (unsigned blk = 0; blk < grid; blk++)
    for (size_t c = blk; c < n; c += grid) emulate_chunk(&chunks[c], 256);
  assert_memory_equal(b, ref, POOL);
  free(a);
  free(b);
  free(ref);
  free(chunks);
}

static void test_grid(void **state) {
  assert_int_equal(kvf__gpu_plan_grid(0, 132, 2), 1);
  assert_int_equal(kvf__gpu_plan_grid(5, 132, 2), 5);
  assert_int_equal(kvf__gpu_plan_grid(16384, 132, 2), 264);
  assert_int_equal(kvf__gpu_plan_grid(16384, 0, 0), 1);
}

/* ------------------------------------------------------------ blocks */

static void test_blocks_group(void **state) {
  assert_int_equal(kvf_blocks_group(4096 / 16, 256), 32);    /* a warp per 4 KiB block */
  assert_int_equal(kvf_blocks_group(32768 / 16, 256), 256);  /* a CTA per 32 KiB block */
  assert_int_equal(kvf_blocks_group(73728 / 16, 256), 256);  /* capped by the CTA */
  assert_int_equal(kvf_blocks_group(73728 / 16, 1024), 512);
  assert_int_equal(kvf_blocks_group(1, 256), 32);
  assert_int_equal(kvf_blocks_group(8192 / 16, 32), 32);
  assert_true(sizeof(kvf_blocks_args) <= 4096); /* a launch's parameters */
}

/* Runs the block kernel's loop (copy_kernel.cu, kvf_blocks) on the CPU:
 * grid CTAs of `threads`, groups of a->group threads per piece, each
 * piece's addresses from the tables and the inline ids. */
static void emulate_blocks(const kvf_blocks_args *a, unsigned grid, unsigned threads) {
  const unsigned gpc = threads / a->group;
  const uint64_t *st = (const uint64_t *)(uintptr_t)a->e.src_table, *dt = (const uint64_t *)(uintptr_t)a->e.dst_table;
  for (unsigned b = 0; b < grid; b++)
    for (unsigned g = 0; g < gpc; g++)
      for (unsigned p = a->piece0 + b * gpc + g; p < a->piece1; p += grid * gpc) {
        unsigned r = p / a->n, i = p - r * a->n;
        assert_true(r < a->n_regions);
        kvf_chunk ch = {a->e.src_base + st[r] + a->inline_ids[i] * a->e.src_stride,
                        a->e.dst_base + dt[r] + a->inline_ids[a->n + i] * a->e.dst_stride, a->block_bytes, 0};
        emulate_chunk(&ch, a->group);
      }
}

/* The kernel's addressing against kvf__blocks_pair's runs: a per-layer
 * (vLLM) source, a cross-layer destination, odd sizes and offsets, layers
 * [2, 7) of 8, the pieces in two halves (two GPUs). */
static void test_blocks_vs_pair(void **state) {
  enum { L = 8, KV = 2, NB = 40, BB = 1000, N = 23, FIRST = 2, NL = 5 };
  static uint64_t so[L * KV], dof[L * KV];
  uint64_t dstride = L * KV * BB + 24;
  for (unsigned r = 0; r < L * KV; r++) {
    so[r] = 3 + (uint64_t)r * NB * BB;
    dof[r] = 8 + (uint64_t)r * BB;
  }
  size_t ssize = 3 + (size_t)L * KV * NB * BB, dsize = 8 + (size_t)NB * dstride;
  uint8_t *sp = malloc(ssize), *dp = malloc(dsize), *ref = malloc(dsize);
  assert_true(sp && dp && ref);
  for (size_t i = 0; i < ssize; i++) sp[i] = (uint8_t)rnd();
  memset(dp, 0x33, dsize);
  memcpy(ref, dp, dsize);
  kvf_blocks_args a;
  memset(&a, 0, sizeof(a));
  for (unsigned i = 0; i < N; i++) {
    a.inline_ids[i] = (unsigned)(rnd() % NB);
    a.inline_ids[N + i] = (i * 7 + 3) % NB; /* distinct */
  }
  kvf__lview sv = {.n_kv = KV, .n_blocks = NB, .n_layers = L, .block_bytes = BB, .block_stride = BB, .offsets = so};
  kvf__lview dv = {.n_kv = KV, .n_blocks = NB, .n_layers = L, .block_bytes = BB, .block_stride = dstride,
                   .offsets = dof};
  kvf__runs runs = {0};
  assert_int_equal(kvf__blocks_pair(&sv, a.inline_ids, &dv, a.inline_ids + N, N, FIRST, NL, &runs), 0);
  for (size_t i = 0; i < runs.n; i++) memcpy(ref + runs.v[i].dst_off, sp + runs.v[i].src_off, runs.v[i].len);
  assert_int_equal(runs.bytes, (uint64_t)N * NL * KV * BB);
  kvf__runs_free(&runs);
  a.e.src_base = (uintptr_t)sp;
  a.e.dst_base = (uintptr_t)dp;
  a.e.src_table = (uintptr_t)(so + FIRST * KV); /* from the first copied layer */
  a.e.dst_table = (uintptr_t)(dof + FIRST * KV);
  a.e.src_stride = BB;
  a.e.dst_stride = dstride;
  a.block_bytes = BB;
  a.n = N;
  a.n_regions = NL * KV;
  a.group = kvf_blocks_group((BB + 15) / 16, 256);
  unsigned pieces = N * NL * KV;
  a.piece1 = pieces / 2;
  emulate_blocks(&a, 3, 256);
  a.piece0 = a.piece1;
  a.piece1 = pieces;
  emulate_blocks(&a, 5, 256);
  assert_memory_equal(dp, ref, dsize);
  free(sp);
  free(dp);
  free(ref);
}

/* ------------------------------------------------------------ routes */

static bool peer01(int a, int b) { return a == b || (a <= 1 && b <= 1); } /* 0<->1 linked, 2 alone */

static void test_exec(void **state) {
  kvf__gpu_end g0 = {0, true, 0, NULL}, g1 = {1, true, 0, NULL}, g2 = {2, true, 0, NULL};
  kvf__gpu_end hm = {-1, true, 0, NULL}, hu = {-1, false, 0, NULL};
  assert_int_equal(kvf__gpu_plan_exec(&g0, &g1, peer01, false), 0); /* push */
  assert_int_equal(kvf__gpu_plan_exec(&g0, &g1, peer01, true), 1);  /* pull */
  assert_int_equal(kvf__gpu_plan_exec(&g1, &g1, peer01, false), 1);
  assert_int_equal(kvf__gpu_plan_exec(&g0, &g2, peer01, false), -1); /* stage */
  assert_int_equal(kvf__gpu_plan_exec(&hm, &g2, peer01, false), 2);  /* h2d on the GPU */
  assert_int_equal(kvf__gpu_plan_exec(&g1, &hm, peer01, false), 1);  /* d2h */
  assert_int_equal(kvf__gpu_plan_exec(&hu, &g1, peer01, false), -1); /* unregistered host */
  assert_int_equal(kvf__gpu_plan_exec(&hm, &hm, peer01, false), -1); /* host: memcpy */
}

/* ------------------------------------------------------------ driver ABI */

static void test_abi(void **state) {
#ifdef HAVE_CUDA_H
  assert_int_equal(sizeof(kvf_cu_mem_prop), sizeof(CUmemAllocationProp));
  assert_int_equal(offsetof(kvf_cu_mem_prop, location), offsetof(CUmemAllocationProp, location));
  assert_int_equal(offsetof(kvf_cu_mem_prop, allocFlags), offsetof(CUmemAllocationProp, allocFlags));
  assert_int_equal(offsetof(kvf_cu_mem_prop, allocFlags.gpuDirectRDMACapable),
                   offsetof(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable));
  assert_int_equal(sizeof(kvf_cu_access_desc), sizeof(CUmemAccessDesc));
  assert_int_equal(KVF_CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_ALLOCATION_TYPE_PINNED);
  assert_int_equal(KVF_CU_MEM_HANDLE_TYPE_POSIX_FD, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  assert_int_equal(KVF_CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_LOCATION_TYPE_DEVICE);
  assert_int_equal(KVF_CU_MEM_ACCESS_RW, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  assert_int_equal(KVF_CU_MEM_RANGE_HANDLE_DMA_BUF_FD, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD);
  assert_int_equal(KVF_CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_DEVICEMAP);
  assert_int_equal(KVF_CU_MEMHOSTREGISTER_DEVICEMAP, CU_MEMHOSTREGISTER_DEVICEMAP);
  assert_int_equal(KVF_CU_ATTR_MULTIPROCESSOR_COUNT, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  assert_int_equal(KVF_CU_ATTR_DMA_BUF_SUPPORTED, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED);
  assert_int_equal(KVF_CU_ATTR_GDR_SUPPORTED, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED);
  assert_int_equal(KVF_CU_ATTR_GDR_WITH_VMM_SUPPORTED, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED);
  assert_int_equal(KVF_CU_ATTR_VMM_SUPPORTED, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
  assert_int_equal(KVF_CU_ATTR_POSIX_FD_SUPPORTED, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
  assert_int_equal(KVF_CU_ATTR_CC_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  assert_int_equal(KVF_CU_ATTR_PCI_BUS_ID, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID);
  assert_int_equal(KVF_CU_ERROR_PEER_ACCESS_ALREADY_ENABLED, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
  assert_int_equal(KVF_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  assert_int_equal(KVF_CU_STREAM_NON_BLOCKING, CU_STREAM_NON_BLOCKING);
  assert_int_equal(sizeof(kvf_cu_memcpy2d), sizeof(CUDA_MEMCPY2D));
  assert_int_equal(offsetof(kvf_cu_memcpy2d, srcDevice), offsetof(CUDA_MEMCPY2D, srcDevice));
  assert_int_equal(offsetof(kvf_cu_memcpy2d, srcPitch), offsetof(CUDA_MEMCPY2D, srcPitch));
  assert_int_equal(offsetof(kvf_cu_memcpy2d, dstMemoryType), offsetof(CUDA_MEMCPY2D, dstMemoryType));
  assert_int_equal(offsetof(kvf_cu_memcpy2d, dstDevice), offsetof(CUDA_MEMCPY2D, dstDevice));
  assert_int_equal(offsetof(kvf_cu_memcpy2d, dstPitch), offsetof(CUDA_MEMCPY2D, dstPitch));
  assert_int_equal(offsetof(kvf_cu_memcpy2d, Height), offsetof(CUDA_MEMCPY2D, Height));
  assert_int_equal(KVF_CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_DEVICE);
#else
  skip();
#endif
}

/* ------------------------------------------------------------ no driver */

static void test_no_driver_daemon(void **state) {
  assert_int_equal(kvf__gpu_init(KVF__AUTO), 0); /* auto: fine without */
  assert_false(kvf__gpu_ready());
  assert_non_null(strstr(kvf__gpu_why(), "no NVIDIA driver"));
  assert_int_equal(kvf__gpu_count(), 0);
  assert_int_equal(kvf__gpu_init(KVF__ON), -ENODEV); /* on: refuses */
  /* a cuda pool fails the start with a reason */
  kvf__pool_cfg pc = {.name = "g", .kind = "cuda:0", .size = 1 << 20};
  kvf__pool *p = NULL;
  char err[512] = "";
  assert_int_equal(kvf__pool_create(&pc, 0, KVF__OFF, false, &p, err, sizeof(err)), -ENODEV);
  assert_null(p);
  assert_non_null(strstr(err, "needs CUDA"));
  /* host pools still work, unregistered */
  kvf__pool_cfg hc = {.name = "h", .kind = "host", .size = 1 << 20};
  assert_int_equal(kvf__pool_create(&hc, 1, KVF__OFF, false, &p, err, sizeof(err)), 0);
  assert_false(kvf__pool_gpu(p));
  assert_int_equal(p->dev_alias, 0);
  int fd;
  uint64_t off;
  assert_int_equal(kvf__pool_dmabuf(p, &fd, &off), -EINVAL);
  /* a copy that needs a GPU fails; host to host still copies */
  kvf__gpu_copy c = {.src = {-1, false, 0, p->base}, .dst = {-1, false, 0, p->base + 4096}, .len = 100};
  memset(p->base, 7, 100);
  const char *route = NULL;
  assert_int_equal(kvf__gpu_copy_all(&c, 1, &route), 0);
  assert_string_equal(route, "host");
  assert_int_equal(p->base[4096 + 99], 7);
  c.dst.dev = 0;
  assert_int_equal(kvf__gpu_copy_all(&c, 1, &route), -ENODEV);
  kvf__gpu_batch *b = NULL;
  assert_int_equal(kvf__gpu_batch_new(&b), -ENODEV);
  kvf__gpu_blocks j = {.src = {.dev = 0}, .dst = {.dev = 0}, .block_bytes = 4096, .n_layers = 1, .n_kv = 2, .n = 1};
  assert_int_equal(kvf__gpu_blocks_start(&j, NULL, NULL), -ENODEV);
  assert_false(kvf__gpu_blocks_kernel());
  kvf__pool_destroy(p);
}

static void test_no_driver_client(void **state) {
  void *addr = NULL, *st = NULL;
  assert_int_equal(kvf__cuda_map_fd(0, 1 << 21, &addr, &st), -ENODEV);
  assert_null(addr);
}

int main(void) {
  /* Force the no-driver path even on a GPU machine. */
  setenv("KVF_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  kvf__log_init(KVF__LOG_ERR);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_split_widths),     cmocka_unit_test(test_split_random_vs_memcpy),
      cmocka_unit_test(test_cut),              cmocka_unit_test(test_batch_vs_memcpy),
      cmocka_unit_test(test_grid),             cmocka_unit_test(test_exec),
      cmocka_unit_test(test_blocks_group),     cmocka_unit_test(test_blocks_vs_pair),
      cmocka_unit_test(test_abi),              cmocka_unit_test(test_no_driver_daemon),
      cmocka_unit_test(test_no_driver_client),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
