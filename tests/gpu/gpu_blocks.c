/* gpu_blocks.c - the block-copy kernel (kvf__gpu_blocks_start) on a real
 * GPU, without daemons: KV blocks by id between two layouts in two cuda
 * pools, every address computed on the GPU.
 *
 *   gpu_blocks test    vLLM per-layer K/V layouts and cross-layer layouts
 *                      (one block holds every layer), llama3-8b geometry
 *                      (32 layers, K and V) with 32 KiB and 4 KiB blocks,
 *                      random block ids, whole and in layer ranges, ids in
 *                      the launch's parameters and in device memory, an
 *                      unaligned geometry; after each copy the whole
 *                      destination pool is read back and checked byte for
 *                      byte against the host's expectation (so nothing
 *                      outside the blocks is touched either)
 *   gpu_blocks bench [REPS]
 *                      the tests, then per case the kernel's time (events,
 *                      median of REPS, default 20) against cuMemcpyAsync
 *                      of the same bytes contiguous, as a ratio (memcpy
 *                      time / kernel time: 1.0 is copy-engine speed), a few
 *                      launch shapes, and the host's time per start against
 *                      the number of layers (8, 32, 128); one JSON line per
 *                      figure
 *
 * KVF_CUDA_BLOCKS=memcpy runs the same checks on the fallback (cuMemcpy
 * per run). Exit 0: passed; 77: no GPU here (skipped); 1: failed. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "config.h"
#include "cuda/cudrv.h"
#include "cuda/gpu.h"
#include "gpu_pool.h"
#include "log.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void) { return gt_xorshift(&rng); }


/* ------------------------------------------------------------ layouts */

typedef struct layout {
  const char *kind;
  uint32_t n_layers, n_kv, n_blocks;
  uint64_t bb, stride;
  uint64_t offsets[2 * 128];
  uint64_t end;            /* bytes of the pool it spans */
  void *gpu;               /* the offsets on the GPU */
} layout;

/* vLLM: per layer one tensor [2, n_blocks, block], K then V; pad bytes
 * before the first (an unaligned start when odd). */
static void layout_vllm(layout *l, uint32_t layers, uint32_t nb, uint64_t bb, uint64_t pad) {
  *l = (layout){.kind = "per-layer", .n_layers = layers, .n_kv = 2, .n_blocks = nb, .bb = bb, .stride = bb};
  for (uint32_t r = 0; r < layers * 2; r++) l->offsets[r] = pad + (uint64_t)r * nb * bb;
  l->end = pad + (uint64_t)layers * 2 * nb * bb;
}

/* Cross-layer: one block holds every layer's K and V, gap bytes between
 * blocks. */
static void layout_cross(layout *l, uint32_t layers, uint32_t nb, uint64_t bb, uint64_t pad, uint64_t gap) {
  *l = (layout){.kind = "cross-layer", .n_layers = layers, .n_kv = 2, .n_blocks = nb, .bb = bb};
  l->stride = (uint64_t)layers * 2 * bb + gap;
  for (uint32_t r = 0; r < layers * 2; r++) l->offsets[r] = pad + (uint64_t)r * bb;
  l->end = pad + (uint64_t)nb * l->stride;
}

static int layout_upload(layout *l) {
  int rc = kvf__gpu_layout_upload(0, l->offsets, (size_t)l->n_layers * l->n_kv, &l->gpu);
  CHECK(rc == 0, "kvf__gpu_layout_upload: %d", rc);
  return 0;
}

/* ------------------------------------------------------------ one copy */

/* A copy of n blocks over layers [first, first + nl). */
typedef struct copy {
  const char *name;
  layout *s, *d;
  uint32_t first, nl;
  size_t n;
  uint32_t *sids, *dids;
} copy;

static kvf__gpu_blocks job_of(const copy *c, gt_pool *ps, gt_pool *pd) {
  size_t skip = (size_t)c->first * 2;
  kvf__gpu_blocks j = {
      .src = {.dev = 0, .base = ps->mem.dptr, .table = kvf__gpu_layout_table(c->s->gpu) + skip * 8,
              .offsets = c->s->offsets + skip, .stride = c->s->stride, .ids = c->sids},
      .dst = {.dev = 0, .base = pd->mem.dptr, .table = kvf__gpu_layout_table(c->d->gpu) + skip * 8,
              .offsets = c->d->offsets + skip, .stride = c->d->stride, .ids = c->dids},
      .block_bytes = c->s->bb, .n_layers = c->nl, .n_kv = 2, .n = c->n};
  return j;
}

/* Random ids: the destination's distinct (a permutation's prefix), the
 * source's with repeats allowed. */
static int pick_ids(copy *c) {
  c->sids = malloc(c->n * sizeof(uint32_t));
  c->dids = malloc(c->n * sizeof(uint32_t));
  uint32_t *perm = malloc(c->d->n_blocks * sizeof(uint32_t));
  CHECK(c->sids && c->dids && perm && c->n <= c->d->n_blocks, "ids");
  for (uint32_t i = 0; i < c->d->n_blocks; i++) perm[i] = i;
  for (size_t i = 0; i < c->n; i++) {
    size_t k = i + rnd() % (c->d->n_blocks - i);
    uint32_t t = perm[i];
    perm[i] = perm[k];
    perm[k] = t;
    c->dids[i] = perm[i];
    c->sids[i] = (uint32_t)(rnd() % c->s->n_blocks);
  }
  free(perm);
  return 0;
}

/* Starts c, waits for its callback; *host_us: the start call's time. */
static int run_copy(const copy *c, gt_pool *ps, gt_pool *pd, float *ms, double *host_us) {
  kvf__gpu_blocks j = job_of(c, ps, pd);
  return gt_blocks_run(&j, c->name, ms, host_us);
}

/* What c must do to the destination's picture. */
static void expect(const copy *c, const gt_pool *ps, gt_pool *pd) {
  for (uint32_t l = c->first; l < c->first + c->nl; l++)
    for (uint32_t kv = 0; kv < 2; kv++)
      for (size_t i = 0; i < c->n; i++)
        memcpy(pd->want + c->d->offsets[l * 2 + kv] + (uint64_t)c->dids[i] * c->d->stride,
               ps->want + c->s->offsets[l * 2 + kv] + (uint64_t)c->sids[i] * c->s->stride, c->s->bb);
}

/* Runs c once and checks the whole destination pool. */
static int check_copy(copy *c, gt_pool *ps, gt_pool *pd) {
  kvf__gpu_stats before, after;
  kvf__gpu_stats_get(&before);
  if (pick_ids(c)) return -1;
  int rc = run_copy(c, ps, pd, NULL, NULL);
  expect(c, ps, pd);
  if (rc == 0) rc = gt_pool_verify(pd, c->name);
  kvf__gpu_stats_get(&after);
  uint64_t bytes = (uint64_t)c->n * c->nl * 2 * c->s->bb;
  bool kernel = kvf__gpu_blocks_kernel();
  if (rc == 0 && (after.block_bytes - before.block_bytes != bytes ||
                  (kernel ? after.bytes_kernel - before.bytes_kernel : after.bytes_fallback - before.bytes_fallback) !=
                      bytes)) {
    fprintf(stderr, "FAIL: %s: stats count %" PRIu64 " block bytes, want %" PRIu64 "\n", c->name,
            after.block_bytes - before.block_bytes, bytes);
    failures++;
    rc = -1;
  }
  printf("%s %s: %s -> %s, %zu x %" PRIu64 " B blocks, layers [%u, %u), ids %s, %s\n", rc ? "FAIL" : "ok  ", c->name,
         c->s->kind, c->d->kind, c->n, c->s->bb, c->first, c->first + c->nl,
         2 * c->n <= KVF__BLOCKS_INLINE_IDS ? "inline" : "in device memory", kernel ? "kernel" : "cuMemcpy per run");
  return rc;
}

static void copy_free(copy *c) {
  free(c->sids);
  free(c->dids);
  c->sids = c->dids = NULL;
}

/* ------------------------------------------------------------ cases */

#define POOL_BYTES (1100ull << 20)

typedef struct cases {
  layout v32, x32, v4, x4, vodd, xodd;
} cases;

static int make_layouts(cases *k) {
  /* llama3-8b: 32 layers, K and V, 32 KiB blocks (16 tokens x 8 heads x
   * 128 x 2 bytes); 4 KiB blocks as at TP 8. 1 GiB of blocks each. */
  layout_vllm(&k->v32, 32, 512, 32768, 0);
  layout_cross(&k->x32, 32, 512, 32768, 4096, 0);
  layout_vllm(&k->v4, 32, 4096, 4096, 0);
  layout_cross(&k->x4, 32, 4096, 4096, 0, 256);
  /* Unaligned: 4100-byte blocks, starts 3 and 7 bytes off (the kernel's
   * head, narrow body and tail). */
  layout_vllm(&k->vodd, 32, 300, 4100, 3);
  layout_cross(&k->xodd, 32, 300, 4100, 7, 5);
  layout *all[] = {&k->v32, &k->x32, &k->v4, &k->x4, &k->vodd, &k->xodd};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
    CHECK(all[i]->end <= POOL_BYTES, "layout %zu does not fit the pool", i);
    if (layout_upload(all[i])) return -1;
  }
  return 0;
}

static void free_layouts(cases *k) {
  layout *all[] = {&k->v32, &k->x32, &k->v4, &k->x4, &k->vodd, &k->xodd};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) kvf__gpu_layout_free(all[i]->gpu);
}

static int run_tests(cases *k, gt_pool *ps, gt_pool *pd) {
  copy v[] = {
      {"32k-vllm-vllm", &k->v32, &k->v32, 0, 32, 256, NULL, NULL},
      {"32k-vllm-cross", &k->v32, &k->x32, 0, 32, 256, NULL, NULL},
      {"32k-cross-vllm", &k->x32, &k->v32, 0, 32, 300, NULL, NULL},
      {"32k-cross-cross-layers", &k->x32, &k->x32, 5, 7, 100, NULL, NULL},
      {"32k-one-layer", &k->v32, &k->x32, 31, 1, 1, NULL, NULL},
      {"4k-vllm-vllm", &k->v4, &k->v4, 0, 32, 256, NULL, NULL},
      {"4k-vllm-vllm-many", &k->v4, &k->v4, 0, 32, 2048, NULL, NULL},
      {"4k-cross-vllm-many", &k->x4, &k->v4, 0, 32, 1500, NULL, NULL},
      {"4k-vllm-cross-layers", &k->v4, &k->x4, 10, 3, 777, NULL, NULL},
      {"odd-vllm-cross", &k->vodd, &k->xodd, 0, 32, 200, NULL, NULL},
      {"odd-cross-vllm-layers", &k->xodd, &k->vodd, 1, 30, 299, NULL, NULL},
  };
  int rc = 0;
  for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
    if (check_copy(&v[i], ps, pd)) rc = -1;
    copy_free(&v[i]);
  }
  /* Host pools are not the kernel's: the caller walks runs. */
  kvf__gpu_blocks h = {.src = {.dev = -1}, .dst = {.dev = 0}, .block_bytes = 4096, .n_layers = 1, .n_kv = 2, .n = 1};
  int r = kvf__gpu_blocks_start(&h, gt_on_done, &gt_W);
  if (r != -EAGAIN) {
    fprintf(stderr, "FAIL: a host source gave %d, want -EAGAIN\n", r);
    failures++;
    rc = -1;
  } else {
    printf("ok   a host pool is refused with -EAGAIN (runs instead)\n");
  }
  return rc;
}

/* ------------------------------------------------------------ bench */

/* cuMemcpyAsync of bytes contiguous, median of reps (ms). */
static double memcpy_ms(uint64_t dst, uint64_t src, uint64_t bytes, int reps) {
  CUstream st;
  CUevent e0, e1;
  double *v = calloc((size_t)reps, sizeof(double));
  if (!v || cu.StreamCreate(&st, KVF_CU_STREAM_NON_BLOCKING) || cu.EventCreate(&e0, KVF_CU_EVENT_DEFAULT) ||
      cu.EventCreate(&e1, KVF_CU_EVENT_DEFAULT)) {
    free(v);
    return -1;
  }
  for (int r = 0; r < reps; r++) {
    float ms = -1;
    cu.EventRecord(e0, st);
    cu.MemcpyAsync(dst, src, bytes, st);
    cu.EventRecord(e1, st);
    cu.EventSynchronize(e1);
    cu.EventElapsedTime(&ms, e0, e1);
    v[r] = ms;
  }
  double m = gt_median(v, reps);
  cu.EventDestroy(e0);
  cu.EventDestroy(e1);
  cu.StreamDestroy(st);
  free(v);
  return m;
}

/* The kernel on c, reps times (after a warm-up), then checked; one JSON
 * line with the ratio to a contiguous copy of the same bytes. */
static int bench_copy(copy *c, gt_pool *ps, gt_pool *pd, uint64_t scratch, int reps, const char *shape) {
  if (pick_ids(c)) return -1;
  double *ms = calloc((size_t)reps, sizeof(double)), *host = calloc((size_t)reps, sizeof(double));
  CHECK(ms && host, "malloc");
  int rc = run_copy(c, ps, pd, NULL, NULL);
  for (int r = 0; r < reps && rc == 0; r++) {
    float k;
    rc = run_copy(c, ps, pd, &k, &host[r]);
    ms[r] = k;
  }
  expect(c, ps, pd);
  if (rc == 0) rc = gt_pool_verify(pd, c->name);
  uint64_t bytes = (uint64_t)c->n * c->nl * 2 * c->s->bb;
  if (rc == 0) {
    double km = gt_median(ms, reps), hu = gt_median(host, reps);
    double mm = memcpy_ms(scratch, ps->mem.dptr, bytes, reps);
    printf("{\"what\": \"blocks\", \"case\": \"%s\", \"shape\": \"%s\", \"src\": \"%s\", \"dst\": \"%s\", "
           "\"block_bytes\": %" PRIu64 ", \"blocks\": %zu, \"layers\": %u, \"pieces\": %zu, \"bytes\": %" PRIu64 ", "
           "\"kernel_ms\": %.4f, \"kernel_gbps\": %.1f, \"memcpy_ms\": %.4f, \"memcpy_gbps\": %.1f, "
           "\"ratio_vs_memcpy\": %.3f, \"host_start_us\": %.1f, \"verified\": true}\n",
           c->name, shape, c->s->kind, c->d->kind, c->s->bb, c->n, c->nl, c->n * c->nl * 2, bytes, km,
           (double)bytes / km / 1e6, mm, (double)bytes / mm / 1e6, mm / km, hu);
  }
  free(ms);
  free(host);
  copy_free(c);
  return rc;
}

/* The host's time per start, against the number of layers (4 KiB blocks,
 * 256 of them, per-layer layouts of 8, 32 and 128 layers). */
static int bench_host(gt_pool *ps, gt_pool *pd, int reps) {
  static const uint32_t layers[] = {8, 32, 128};
  for (size_t k = 0; k < sizeof(layers) / sizeof(layers[0]); k++) {
    layout l;
    layout_vllm(&l, layers[k], 256, 4096, 0);
    if (layout_upload(&l)) return -1;
    copy c = {"host-time", &l, &l, 0, layers[k], 256, NULL, NULL};
    if (pick_ids(&c)) return -1;
    double *host = calloc((size_t)reps, sizeof(double));
    int rc = host ? 0 : -1;
    for (int r = 0; r < reps && rc == 0; r++) rc = run_copy(&c, ps, pd, NULL, &host[r]);
    expect(&c, ps, pd);
    if (rc == 0) rc = gt_pool_verify(pd, "host-time");
    if (rc == 0)
      printf("{\"what\": \"blocks_host\", \"layers\": %u, \"blocks\": 256, \"pieces\": %u, \"host_start_us_p50\": %.1f}\n",
             layers[k], 256 * 2 * layers[k], gt_median(host, reps));
    free(host);
    copy_free(&c);
    kvf__gpu_layout_free(l.gpu);
    if (rc) return rc;
  }
  return 0;
}

static int run_bench(cases *k, gt_pool *ps, gt_pool *pd, int reps) {
  CUdeviceptr scratch = 0;
  CHECK(cu.MemAlloc(&scratch, 512ull << 20) == 0, "scratch");
  kvf__gpu_tuning t0;
  kvf__gpu_tuning_get(&t0);
  t0.kernel = NULL; /* the copy kernel stays; only the shape changes */
  int rc = 0;
  /* 512 MiB each: llama3-8b 4096 tokens at 32 KiB blocks, and the same
   * bytes at 4 KiB; then one 4 KiB request of 256 blocks (64 MiB). */
  static const unsigned ctas[] = {2, 4, 8};
  for (size_t s = 0; s < sizeof(ctas) / sizeof(ctas[0]) && rc == 0; s++) {
    kvf__gpu_tuning t = t0;
    t.ctas_per_sm = ctas[s];
    if (kvf__gpu_tune(&t)) break;
    char shape[64];
    snprintf(shape, sizeof(shape), "%u threads x %u CTAs/SM", t.threads, t.ctas_per_sm);
    copy v[] = {
        {"llama3-8b-32k-vllm", &k->v32, &k->v32, 0, 32, 256, NULL, NULL},
        {"llama3-8b-32k-cross-to-vllm", &k->x32, &k->v32, 0, 32, 256, NULL, NULL},
        {"4k-vllm", &k->v4, &k->v4, 0, 32, 2048, NULL, NULL},
        {"4k-cross-to-vllm", &k->x4, &k->v4, 0, 32, 2048, NULL, NULL},
        {"4k-vllm-256", &k->v4, &k->v4, 0, 32, 256, NULL, NULL},
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]) && rc == 0; i++)
      rc = bench_copy(&v[i], ps, pd, scratch, reps, shape);
  }
  kvf__gpu_tune(&t0);
  if (rc == 0) rc = bench_host(ps, pd, reps);
  cu.MemFree(scratch);
  return rc;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "test";
  kvf__log_init(KVF__LOG_INFO);
  if (gt_load_driver(&cu)) return 77;
  if (kvf__gpu_init(KVF__AUTO) != 0 || kvf__gpu_count() == 0) {
    printf("SKIP: no usable GPU: %s\n", kvf__gpu_why());
    return 77;
  }
  kvf__gpu_info info;
  kvf__gpu_info_get(0, &info);
  printf("== gpu_blocks on cuda:0 %s (%d SMs), block copies by %s\n", info.name, info.sms,
         kvf__gpu_blocks_kernel() ? "the kernel (kvf_blocks)" : "cuMemcpy per run (no kernel)");
  cases k;
  gt_pool ps, pd;
  int rc = gt_pool_new(&ps, "src", POOL_BYTES, &rng);
  if (rc == 0) rc = gt_pool_new(&pd, "dst", POOL_BYTES, NULL);
  if (rc == 0) rc = make_layouts(&k);
  if (rc == 0) rc = run_tests(&k, &ps, &pd);
  if (rc == 0 && strcmp(mode, "bench") == 0) {
    int reps = argc > 2 ? atoi(argv[2]) : 20;
    rc = run_bench(&k, &ps, &pd, reps > 0 ? reps : 20);
  }
  if (rc == 0) free_layouts(&k);
  gt_pool_free(&ps);
  gt_pool_free(&pd);
  kvf__gpu_shutdown();
  printf("%s: %d failure(s)\n", mode, failures);
  return rc || failures ? 1 : 0;
}
