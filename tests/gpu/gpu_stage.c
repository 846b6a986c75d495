/* gpu_stage.c - the rdma receiver's GPU pass (rdma_stage.c) on a real GPU,
 * without daemons or NICs: a staging slice in host memory that CUDA maps
 * (as the daemon maps its rdma staging arena), filled in the staged layout
 * a sender writes over rdma, moved into a grant's blocks in a cuda pool by
 * the functions the receiver uses (kvf__rdma_sgpu_make, kvf__rdma_sgpu_job,
 * kvf__gpu_xblocks_from_host: the transform kernel reading the host memory
 * over the bus), chunk by chunk of layers as the sender's notes come.
 *
 * The staged layout, from its definition (rdma_stage.c, kvf__xstaged): per
 * layer and K/V region, packed in that order, the grant's nd blocks in
 * order, each of the grant's T tokens per block holding only the staged
 * heads [h0, h0 + nh) in the staged order (NHD: [token, head, dim], HND:
 * [head, token, dim]); the transfer's token t is staged block t / T slot
 * t % T, and grant block ids[t / T] slot t % T. The reference here is
 * computed element by element from that and the grant's layout alone, and
 * the whole cuda pool is read back and compared byte for byte (so nothing
 * outside the staged heads of the granted blocks changes).
 *
 *   gpu_stage          every case; exit 0 passed, 77 no GPU, 1 failed */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "config.h"
#include "gpu_pool.h"
#include "log.h"
#include "transport/rdma/rdma_int.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;

#define POOL_BYTES (256ull << 20)
#define SLICE_MAX (160ull << 20)
#define SLICE_AT 12288u /* the slice's offset in the arena: a grant's is a multiple of 4 KiB */
#define LAYERS 8
#define NKV 2

/* The grant's layout: [LAYERS][NKV] regions of nb blocks from pad. */
typedef struct grant {
  uint32_t nb, tpb, heads, h0, order;
  uint64_t pad, bb, offsets[LAYERS * NKV];
  uint32_t *ids;
  size_t nd;
  void *gpu;
  kvf__lview v;
} grant;

typedef struct scase {
  const char *name;
  grant g;
  kvf__xstaged st;
  size_t nd;
  uint32_t chunk; /* layers per launch, as the sender's chunks */
} scase;

#define HEAD_DIM 128u
#define DTYPE 2u
#define UNIT (HEAD_DIM * DTYPE)

static int grant_make(grant *g, size_t nd) {
  g->bb = (uint64_t)g->tpb * g->heads * UNIT;
  for (uint32_t r = 0; r < LAYERS * NKV; r++) g->offsets[r] = g->pad + (uint64_t)r * g->nb * g->bb;
  CHECK(g->pad + (uint64_t)LAYERS * NKV * g->nb * g->bb <= POOL_BYTES, "grant layout does not fit the pool");
  CHECK(kvf__gpu_layout_upload(0, g->offsets, LAYERS * NKV, &g->gpu) == 0, "layout upload");
  g->ids = malloc(g->nb * sizeof(uint32_t));
  CHECK(g->ids && nd <= g->nb, "ids");
  for (uint32_t i = 0; i < g->nb; i++) g->ids[i] = i;
  for (uint32_t i = g->nb - 1; i > 0; i--) { /* distinct, shuffled */
    uint32_t k = (uint32_t)(gt_xorshift(&rng) % (i + 1)), t = g->ids[i];
    g->ids[i] = g->ids[k];
    g->ids[k] = t;
  }
  g->nd = nd;
  g->v = (kvf__lview){.pool = 0, .n_kv = NKV, .n_blocks = g->nb, .first_layer = 0, .n_layers = LAYERS,
                      .block_bytes = g->bb, .block_stride = g->bb, .offsets = g->offsets,
                      .geom = {g->tpb, g->heads, HEAD_DIM, DTYPE, g->order, g->h0, 8}};
  return 0;
}

/* Where token t of model head h of region r is: in the grant's pool, and
 * in the slice. */
static uint64_t grant_addr(const grant *g, uint32_t r, uint64_t t, uint32_t h) {
  uint64_t slot = t % g->tpb, hh = h - g->h0;
  uint64_t in = g->order == KVF_LAYOUT_NHD ? slot * g->heads + hh : hh * g->tpb + slot;
  return g->offsets[r] + (uint64_t)g->ids[t / g->tpb] * g->bb + in * UNIT;
}

static uint64_t slice_addr(const scase *c, uint32_t r, uint64_t t, uint32_t h) {
  uint64_t tpb = c->g.tpb, nh = c->st.nh, slot = t % tpb, hh = h - c->st.h0;
  uint64_t bbs = tpb * nh * UNIT;
  uint64_t in = c->st.order == KVF_LAYOUT_NHD ? slot * nh + hh : hh * tpb + slot;
  return (uint64_t)r * c->nd * bbs + (t / tpb) * bbs + in * UNIT;
}

/* Starts j by the receiver's GPU pass function, waits for its callback;
 * adds the kernel's time to *ms. */
static int run_job(const kvf__gpu_blocks *j, const char *name, double *ms) {
  pthread_mutex_lock(&gt_W.mu);
  int before = gt_W.calls;
  pthread_mutex_unlock(&gt_W.mu);
  int rc = kvf__gpu_xblocks_from_host(j, gt_on_done, &gt_W);
  CHECK(rc == 0, "%s: kvf__gpu_xblocks_from_host: %d", name, rc);
  pthread_mutex_lock(&gt_W.mu);
  while (gt_W.calls == before) pthread_cond_wait(&gt_W.cv, &gt_W.mu);
  int calls = gt_W.calls - before;
  rc = gt_W.rc;
  if (gt_W.ms > 0) *ms += gt_W.ms;
  pthread_mutex_unlock(&gt_W.mu);
  CHECK(calls == 1 && rc == 0, "%s: %d callbacks, rc %d", name, calls, rc);
  return 0;
}

static int check_case(scase *c, uint8_t *arena, uint64_t alias, gt_pool *pd) {
  grant *g = &c->g;
  if (grant_make(g, c->nd)) return -1;
  uint64_t slice_bytes = (uint64_t)LAYERS * NKV * c->nd * g->tpb * c->st.nh * UNIT;
  CHECK(SLICE_AT + slice_bytes <= SLICE_MAX, "%s: slice too large", c->name);
  uint8_t *slice = arena + SLICE_AT;
  for (uint64_t i = 0; i + 8 <= slice_bytes; i += 8) {
    uint64_t v = gt_xorshift(&rng);
    memcpy(slice + i, &v, 8);
  }
  /* the reference: every staged head of every token of every region */
  uint64_t tokens = (uint64_t)c->nd * g->tpb;
  for (uint32_t r = 0; r < LAYERS * NKV; r++)
    for (uint64_t t = 0; t < tokens; t++)
      for (uint32_t h = c->st.h0; h < c->st.h0 + c->st.nh; h++)
        memcpy(pd->want + grant_addr(g, r, t, h), slice + slice_addr(c, r, t, h), UNIT);
  /* the receiver's pass, chunk by chunk */
  kvf__sgpu sg;
  int rc = kvf__rdma_sgpu_make(&g->v, c->nd, &c->st, 0, &sg);
  CHECK(rc == 0, "%s: kvf__rdma_sgpu_make: %d", c->name, rc);
  unsigned launches = 0;
  double ms = 0;
  for (uint32_t first = 0; first < LAYERS && rc == 0; first += c->chunk, launches++) {
    uint32_t n = LAYERS - first < c->chunk ? LAYERS - first : c->chunk;
    kvf__gpu_bside dst = {.dev = 0, .base = pd->mem.dptr,
                          .table = kvf__gpu_layout_table(g->gpu) + (uint64_t)first * NKV * 8,
                          .offsets = g->offsets + (size_t)first * NKV, .stride = g->bb, .ids = g->ids};
    kvf__gpu_blocks j;
    kvf__rdma_sgpu_job(&sg, alias + SLICE_AT, &dst, first, n, &j);
    rc = run_job(&j, c->name, &ms);
  }
  kvf__rdma_sgpu_free(&sg);
  if (rc || gt_pool_verify(pd, c->name)) return -1;
  printf("ok   %s: %" PRIu64 " tokens, %zu blocks, %u launches, %" PRIu64 " staged bytes, kernels %.3f ms (%.1f GB/s "
         "from mapped host memory)\n", c->name, tokens, c->nd, launches, slice_bytes, ms,
         ms > 0 ? (double)slice_bytes / ms / 1e6 : 0.0);
  return 0;
}

#define NHD KVF_LAYOUT_NHD
#define HND KVF_LAYOUT_HND
/* grant: nb, tpb, heads, h0, order, pad */
#define GRANT(nb, tpb, heads, h0, order, pad) {nb, tpb, heads, h0, order, pad, 0, {0}, NULL, 0, NULL, {0}}

static scase cases[] = {
    /* TP 8 -> 4, a fan-in's half: prefill rank 1's head into decode rank 0 (heads 0-1) */
    {"tp8 head 1 (NHD) -> tp4 NHD heads 0-1", GRANT(80, 16, 2, 0, NHD, 0), {NHD, 1, 1}, 64, 4},
    {"tp8 head 2 (NHD) -> tp4 HND heads 2-3", GRANT(80, 16, 2, 2, HND, 4096), {NHD, 2, 1}, 64, 4},
    /* NHD -> HND, every head: the staged rows are whole source blocks */
    {"all heads NHD -> HND", GRANT(80, 16, 8, 0, HND, 0), {NHD, 0, 8}, 64, 3},
    /* a sender's HND heads 4-5 into a grant of NHD heads 4-7, 64 tokens a block, one layer a launch */
    {"heads 4-5 HND -> NHD heads 4-7, 64 tokens", GRANT(40, 64, 4, 4, NHD, 256), {HND, 4, 2}, 16, 1},
    /* more ids than a launch takes inline (in device memory) */
    {"tp8 head 0 -> tp4 NHD, 1000 blocks", GRANT(1200, 16, 2, 0, NHD, 0), {NHD, 0, 1}, 1000, 8},
};

int main(void) {
  kvf__log_init(KVF__LOG_INFO);
  if (gt_load_driver(&cu)) return 77;
  if (kvf__gpu_init(KVF__AUTO) != 0 || kvf__gpu_count() == 0) {
    printf("SKIP: no usable GPU: %s\n", kvf__gpu_why());
    return 77;
  }
  if (!kvf__gpu_blocks_kernel()) {
    printf("SKIP: this build has no transform kernel (no nvcc): GPU passes are off\n");
    return 77;
  }
  printf("== gpu_stage on cuda:0: staged slices in mapped host memory -> cuda pool, by kvf_xblocks\n");
  /* the arena: anonymous memory, as rdma_stage.c maps it, registered with CUDA */
  uint8_t *arena = mmap(NULL, SLICE_MAX, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  uint64_t alias = 0;
  int rc = arena == MAP_FAILED ? -1 : 0;
  if (rc == 0 && kvf__gpu_host_register(arena, SLICE_MAX, &alias) != 0) rc = -1;
  if (rc) {
    printf("FAIL: the arena could not be mapped for CUDA\n");
    return 1;
  }
  gt_pool pd;
  rc = gt_pool_new(&pd, "grant pool", POOL_BYTES, NULL);
  size_t n = sizeof(cases) / sizeof(cases[0]);
  for (size_t i = 0; i < n && rc == 0; i++)
    if (check_case(&cases[i], arena, alias, &pd)) rc = -1;
  for (size_t i = 0; i < n; i++) {
    kvf__gpu_layout_free(cases[i].g.gpu);
    free(cases[i].g.ids);
  }
  gt_pool_free(&pd);
  kvf__gpu_host_unregister(arena);
  munmap(arena, SLICE_MAX);
  kvf__gpu_shutdown();
  printf("gpu_stage: %d failure(s)\n", failures);
  return rc || failures ? 1 : 0;
}
