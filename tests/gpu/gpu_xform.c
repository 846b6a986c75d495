/* gpu_xform.c - the transform kernel (kvf_xblocks, through
 * kvf__gpu_blocks_start with a plan) on a real GPU, without daemons: KV
 * blocks between layouts of other heads (tensor parallelism), order (NHD,
 * HND) and tokens per block (16 <-> 64), MLA, in two cuda pools.
 *
 *   gpu_xform test     llama3-8b geometry (32 layers, 8 KV heads of 128 x 2
 *                      bytes), each case's whole destination pool read back
 *                      and compared byte for byte with a reference the host
 *                      computes element by element from the definitions
 *                      (NHD [block, token, head, dim], HND [block, head,
 *                      token, dim]; token t in block t / T slot t % T), so
 *                      nothing outside the moved heads and tokens changes;
 *                      ids inline and in device memory; an unaligned case
 *   gpu_xform bench [REPS]
 *                      the tests, then the kernel time (events, median of
 *                      REPS, default 20) of NHD -> HND and of the TP 8 -> 4
 *                      pieces against the block kernel moving the same
 *                      bytes as whole blocks (same layout), as a ratio
 *                      (1.0: as fast as a same-layout handoff); JSON lines
 *
 * KVF_CUDA_BLOCKS=memcpy runs the checks on the fallback (runs, cuMemcpy
 * each). Exit 0: passed; 77: no GPU here (skipped); 1: failed. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "cuda/cudrv.h"
#include "cuda/gpu.h"
#include "gpu_pool.h"
#include "kv_xform.h"
#include "log.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

#define POOL_BYTES (1100ull << 20)
#define LAYERS 32

/* One side: a per-layer layout ([n_kv][nb] blocks per layer) from pad,
 * its geometry, its ids. */
typedef struct side {
  uint32_t n_kv, nb, tpb, heads, h0, model, order, head_dim, dtype;
  uint64_t pad, bb, offsets[2 * LAYERS];
  kvf__lview v;
  void *gpu;
  uint32_t *ids;
  size_t n;
} side;

static int side_make(side *x) {
  x->bb = (uint64_t)x->tpb * x->heads * x->head_dim * x->dtype;
  for (uint32_t r = 0; r < LAYERS * x->n_kv; r++) x->offsets[r] = x->pad + (uint64_t)r * x->nb * x->bb;
  CHECK(x->pad + (uint64_t)LAYERS * x->n_kv * x->nb * x->bb <= POOL_BYTES, "layout does not fit the pool");
  x->v = (kvf__lview){.pool = 0, .n_kv = x->n_kv, .n_blocks = x->nb, .first_layer = 0, .n_layers = LAYERS,
                      .block_bytes = x->bb, .block_stride = x->bb, .offsets = x->offsets,
                      .geom = {x->tpb, x->heads, x->head_dim, x->dtype, x->order, x->h0, x->model}};
  CHECK(kvf__gpu_layout_upload(0, x->offsets, (size_t)LAYERS * x->n_kv, &x->gpu) == 0, "layout upload");
  /* distinct ids, shuffled */
  x->ids = malloc(x->nb * sizeof(uint32_t));
  CHECK(x->ids && x->n <= x->nb, "ids");
  for (uint32_t i = 0; i < x->nb; i++) x->ids[i] = i;
  for (uint32_t i = x->nb - 1; i > 0; i--) {
    uint32_t k = (uint32_t)(gt_xorshift(&rng) % (i + 1)), t = x->ids[i];
    x->ids[i] = x->ids[k];
    x->ids[k] = t;
  }
  return 0;
}

static void side_free(side *x) {
  kvf__gpu_layout_free(x->gpu);
  free(x->ids);
}

/* Token t, model head h of region r: the definitions, nothing else. */
static uint64_t ref_addr(const side *x, uint32_t r, uint64_t t, uint32_t h) {
  uint64_t slot = t % x->tpb, hh = h - x->h0, unit = (uint64_t)x->head_dim * x->dtype;
  uint64_t in = x->order == KVF_LAYOUT_NHD ? slot * x->heads + hh : hh * x->tpb + slot;
  return x->offsets[r] + (uint64_t)x->ids[t / x->tpb] * x->bb + in * unit;
}

static void reference(const side *s, const side *d, uint64_t tokens, const gt_pool *ps, gt_pool *pd) {
  uint32_t lo = s->h0 > d->h0 ? s->h0 : d->h0;
  uint32_t hi = s->h0 + s->heads < d->h0 + d->heads ? s->h0 + s->heads : d->h0 + d->heads;
  uint64_t unit = (uint64_t)s->head_dim * s->dtype;
  for (uint32_t r = 0; r < LAYERS * s->n_kv; r++)
    for (uint64_t t = 0; t < tokens; t++)
      for (uint32_t h = lo; h < hi; h++) memcpy(pd->want + ref_addr(d, r, t, h), ps->want + ref_addr(s, r, t, h), unit);
}

static kvf__gpu_blocks job_of(const side *s, const side *d, const gt_pool *ps, const gt_pool *pd, const kvf__xplan *xf) {
  return (kvf__gpu_blocks){
      .src = {.dev = 0, .base = ps->mem.dptr, .table = kvf__gpu_layout_table(s->gpu), .offsets = s->offsets,
              .stride = s->bb, .ids = s->ids},
      .dst = {.dev = 0, .base = pd->mem.dptr, .table = kvf__gpu_layout_table(d->gpu), .offsets = d->offsets,
              .stride = d->bb, .ids = d->ids},
      .block_bytes = s->bb, .n_layers = LAYERS, .n_kv = s->n_kv, .n = d->n, .xf = xf};
}

typedef struct xcase {
  const char *name;
  side s, d;
  uint64_t tokens;
} xcase;

/* Runs c through the transform kernel and checks the whole destination. */
static int check_case(xcase *c, gt_pool *ps, gt_pool *pd, kvf__xplan *plan) {
  c->d.n = c->tokens / c->d.tpb;
  c->s.n = (c->tokens + c->s.tpb - 1) / c->s.tpb;
  if (side_make(&c->s) || side_make(&c->d)) return -1;
  char why[256];
  CHECK(kvf__xplan_make(&c->s.v, c->s.n, &c->d.v, c->d.n, plan, why, sizeof(why)) == 0, "%s: plan: %s", c->name,
        why);
  CHECK(plan->transform, "%s: not a transform", c->name);
  kvf__gpu_blocks j = job_of(&c->s, &c->d, ps, pd, plan);
  if (gt_blocks_run(&j, c->name, NULL, NULL)) return -1;
  reference(&c->s, &c->d, c->tokens, ps, pd);
  if (gt_pool_verify(pd, c->name)) return -1;
  printf("ok   %s: %" PRIu64 " tokens, %zu -> %zu blocks, ids %s\n", c->name, c->tokens, c->s.n, c->d.n,
         c->s.n + c->d.n <= KVF__BLOCKS_INLINE_IDS ? "inline" : "in device memory");
  return 0;
}

#define NHD KVF_LAYOUT_NHD
#define HND KVF_LAYOUT_HND
/* side: n_kv, nb, tpb, heads, h0, model, order, head_dim, dtype, pad */
#define SIDE(nkv, nb, tpb, heads, h0, order) {nkv, nb, tpb, heads, h0, 8, order, 128, 2, 0, 0, {0}, {0}, NULL, NULL, 0}

static xcase cases[] = {
    {"nhd16-all -> hnd16-all (order)", SIDE(2, 300, 16, 8, 0, NHD), SIDE(2, 300, 16, 8, 0, HND), 4096},
    {"tp8 nhd16 head 1 -> tp4 hnd16 heads 0-1", SIDE(2, 300, 16, 1, 1, NHD), SIDE(2, 300, 16, 2, 0, HND), 4096},
    {"tp2 hnd16 heads 4-7 -> tp8 nhd64 head 5", SIDE(2, 300, 16, 4, 4, HND), SIDE(2, 80, 64, 1, 5, NHD), 4096},
    {"tp1 nhd16 -> tp4 nhd64 heads 2-3", SIDE(2, 300, 16, 8, 0, NHD), SIDE(2, 80, 64, 2, 2, NHD), 4096},
    {"tp4 hnd64 heads 4-5 -> tp4 hnd16", SIDE(2, 80, 64, 2, 4, HND), SIDE(2, 300, 16, 2, 4, HND), 4096},
    {"tp4 nhd64 -> tp4 hnd16 heads 2-3, ids in device memory", SIDE(2, 260, 64, 2, 2, NHD),
     SIDE(2, 1030, 16, 2, 2, HND), 16384},
    {"mla 16 -> 64", {1, 300, 16, 1, 0, 1, NHD, 576, 2, 0, 0, {0}, {0}, NULL, NULL, 0},
     {1, 80, 64, 1, 0, 1, NHD, 576, 2, 0, 0, {0}, {0}, NULL, NULL, 0}, 4096},
    {"unaligned: head_dim 3, starts 3 and 5 bytes in", {2, 70, 4, 4, 0, 8, NHD, 3, 2, 3, 0, {0}, {0}, NULL, NULL, 0},
     {2, 20, 16, 2, 2, 8, HND, 3, 2, 5, 0, {0}, {0}, NULL, NULL, 0}, 256},
};

/* The transform's kernel time against the block kernel moving the same
 * bytes as whole blocks between two same layouts. */
static int bench(gt_pool *ps, gt_pool *pd, int reps) {
  static const struct {
    const char *name;
    size_t k;
  } b[] = {{"nhd_to_hnd", 0}, {"tp8_to_tp4_piece", 1}, {"nhd16_to_nhd64_tp1_to_tp4", 3}};
  for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++) {
    xcase *c = &cases[b[i].k];
    kvf__xplan plan;
    char why[256];
    CHECK(kvf__xplan_make(&c->s.v, c->s.n, &c->d.v, c->d.n, &plan, why, sizeof(why)) == 0, "plan");
    uint64_t bytes = kvf__xplan_bytes(&plan, LAYERS, c->s.n_kv);
    /* the same bytes as whole 16-token blocks of the moved heads, same layout both sides */
    side same = {2, 300, 16, plan.nh, 0, 8, NHD, 128, 2, 0, 0, {0}, {0}, NULL, NULL, 0};
    same.n = plan.tokens / 16;
    if (side_make(&same)) return -1;
    kvf__gpu_blocks jx = job_of(&c->s, &c->d, ps, pd, &plan), jw = job_of(&same, &same, ps, pd, NULL);
    double *vx = calloc((size_t)reps, sizeof(double)), *vw = calloc((size_t)reps, sizeof(double));
    CHECK(vx && vw, "calloc");
    int rc = 0;
    for (int r = 0; r < reps && rc == 0; r++) {
      float kx = -1, kw = -1;
      rc = gt_blocks_run(&jx, b[i].name, &kx, NULL);
      if (rc == 0) rc = gt_blocks_run(&jw, "whole blocks", &kw, NULL);
      vx[r] = kx;
      vw[r] = kw;
    }
    /* the timed kernels' bytes too: the whole blocks, then the transform over them */
    if (rc == 0) rc = gt_blocks_run(&jx, b[i].name, NULL, NULL);
    if (rc == 0) {
      for (uint32_t r = 0; r < LAYERS * same.n_kv; r++)
        for (size_t k = 0; k < same.n; k++) {
          uint64_t off = same.offsets[r] + (uint64_t)same.ids[k] * same.bb;
          memcpy(pd->want + off, ps->want + off, same.bb);
        }
      reference(&c->s, &c->d, c->tokens, ps, pd);
      rc = gt_pool_verify(pd, b[i].name);
    }
    if (rc) {
      free(vx);
      free(vw);
      side_free(&same);
      return -1;
    }
    double mx = gt_median(vx, reps), mw = gt_median(vw, reps);
    printf("{\"bench\": \"gpu_xform\", \"case\": \"%s\", \"bytes\": %" PRIu64 ", \"xform_ms\": %.4f, "
           "\"whole_blocks_ms\": %.4f, \"xform_GBps\": %.1f, \"ratio\": %.3f}\n",
           b[i].name, bytes, mx, mw, bytes / mx / 1e6, mw / mx);
    free(vx);
    free(vw);
    side_free(&same);
  }
  return 0;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "test";
  kvf__log_init(KVF__LOG_INFO);
  if (gt_load_driver(&cu)) return 77;
  if (kvf__gpu_init(KVF__AUTO) != 0 || kvf__gpu_count() == 0) {
    printf("SKIP: no usable GPU: %s\n", kvf__gpu_why());
    return 77;
  }
  printf("== gpu_xform on cuda:0, transforms by %s\n",
         kvf__gpu_blocks_kernel() ? "the kernel (kvf_xblocks)" : "cuMemcpy per run (no kernel)");
  gt_pool ps, pd;
  int rc = gt_pool_new(&ps, "src", POOL_BYTES, &rng);
  if (rc == 0) rc = gt_pool_new(&pd, "dst", POOL_BYTES, NULL);
  size_t n = sizeof(cases) / sizeof(cases[0]);
  for (size_t i = 0; i < n && rc == 0; i++) {
    kvf__xplan plan;
    if (check_case(&cases[i], &ps, &pd, &plan)) rc = -1;
  }
  if (rc == 0 && strcmp(mode, "bench") == 0) rc = bench(&ps, &pd, argc > 2 && atoi(argv[2]) > 0 ? atoi(argv[2]) : 20);
  for (size_t i = 0; i < n; i++) {
    if (cases[i].s.gpu) side_free(&cases[i].s);
    if (cases[i].d.gpu) side_free(&cases[i].d);
  }
  gt_pool_free(&ps);
  gt_pool_free(&pd);
  kvf__gpu_shutdown();
  printf("%s: %d failure(s)\n", mode, failures);
  return rc || failures ? 1 : 0;
}
