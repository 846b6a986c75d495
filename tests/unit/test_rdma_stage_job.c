/* test_rdma_stage_job.c - the jobs of the rdma receiver's GPU passes
 * (rdma_stage.c: kvf__rdma_sgpu_plan, kvf__rdma_sgpu_job) run on the CPU:
 * each job's plan, views, ids and the regions it skips to reach its first
 * layer, moved as gpu.c's fallback moves a block job (kvf__xform_runs over
 * the job's offsets and strides, a memcpy per run), chunk by chunk of
 * layers as the sender's notes come, against a reference computed element
 * by element from the staged layout's definition (rdma_stage.c,
 * kvf__xstaged) and the grant's layout: per layer and K/V region, packed,
 * the grant's nd blocks in order, each of its T tokens holding the staged
 * heads in the staged order. The whole pool is compared (nothing outside
 * the staged heads of the granted blocks changes). The kernel itself is
 * tested on a GPU (tests/gpu/gpu_xform, tests/gpu/gpu_stage). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "transport/rdma/rdma_int.h"

#define LAYERS 6
#define NKV 2
#define UNIT 16u /* head_dim 8 x 2 bytes */

typedef struct scase {
  uint32_t nb, tpb, heads, h0, order; /* the grant */
  kvf__xstaged st;
  size_t nd;
  uint32_t chunk;
} scase;

static uint64_t rng = 88172645463325252ull;
static uint64_t next(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

static void run_case(const scase *c) {
  uint64_t bb = (uint64_t)c->tpb * c->heads * UNIT, offsets[LAYERS * NKV], pad = 48;
  for (uint32_t r = 0; r < LAYERS * NKV; r++) offsets[r] = pad + (uint64_t)r * c->nb * bb;
  uint64_t pool_bytes = pad + (uint64_t)LAYERS * NKV * c->nb * bb + 64;
  uint32_t *ids = malloc(c->nb * sizeof(*ids));
  assert_non_null(ids);
  for (uint32_t i = 0; i < c->nb; i++) ids[i] = i;
  for (uint32_t i = c->nb - 1; i > 0; i--) {
    uint32_t k = (uint32_t)(next() % (i + 1)), t = ids[i];
    ids[i] = ids[k];
    ids[k] = t;
  }
  kvf__lview gv = {.pool = 0, .n_kv = NKV, .n_blocks = c->nb, .first_layer = 0, .n_layers = LAYERS,
                   .block_bytes = bb, .block_stride = bb, .offsets = offsets,
                   .geom = {c->tpb, c->heads, UNIT / 2, 2, c->order, c->h0, 8}};
  uint64_t tokens = (uint64_t)c->nd * c->tpb, bbs = (uint64_t)c->tpb * c->st.nh * UNIT;
  uint64_t slice_bytes = (uint64_t)LAYERS * NKV * c->nd * bbs;
  uint8_t *slice = malloc(slice_bytes), *pool = malloc(pool_bytes), *want = malloc(pool_bytes);
  assert_true(slice && pool && want);
  for (uint64_t i = 0; i < slice_bytes; i++) slice[i] = (uint8_t)next();
  for (uint64_t i = 0; i < pool_bytes; i++) pool[i] = want[i] = (uint8_t)(0xa5 ^ i);
  /* the reference, from the definitions */
  for (uint32_t r = 0; r < LAYERS * NKV; r++)
    for (uint64_t t = 0; t < tokens; t++)
      for (uint32_t h = c->st.h0; h < c->st.h0 + c->st.nh; h++) {
        uint64_t slot = t % c->tpb, hg = h - c->h0, hs = h - c->st.h0;
        uint64_t in_g = c->order == KVF_LAYOUT_NHD ? slot * c->heads + hg : hg * c->tpb + slot;
        uint64_t in_s = c->st.order == KVF_LAYOUT_NHD ? slot * c->st.nh + hs : hs * c->tpb + slot;
        memcpy(want + offsets[r] + (uint64_t)ids[t / c->tpb] * bb + in_g * UNIT,
               slice + (uint64_t)r * c->nd * bbs + (t / c->tpb) * bbs + in_s * UNIT, UNIT);
      }
  /* the receiver's jobs, one per chunk, moved as gpu.c's fallback would */
  kvf__sgpu sg;
  assert_int_equal(kvf__rdma_sgpu_plan(&gv, c->nd, &c->st, &sg), 0);
  for (uint32_t first = 0; first < LAYERS; first += c->chunk) {
    uint32_t n = LAYERS - first < c->chunk ? LAYERS - first : c->chunk;
    kvf__gpu_bside dst = {.dev = 0, .base = 0, .offsets = offsets + (size_t)first * NKV, .stride = bb, .ids = ids};
    kvf__gpu_blocks j;
    kvf__rdma_sgpu_job(&sg, 0, &dst, first, n, &j);
    assert_int_equal(j.src.dev, -1);
    assert_int_equal(j.n_layers, n);
    assert_non_null(j.xf);
    kvf__lview s = {.n_kv = j.n_kv, .n_blocks = UINT32_MAX, .n_layers = j.n_layers, .block_bytes = j.block_bytes,
                    .block_stride = j.src.stride, .offsets = j.src.offsets};
    kvf__lview d = s;
    d.block_stride = j.dst.stride;
    d.offsets = j.dst.offsets;
    kvf__runs runs = {0};
    assert_int_equal(kvf__xform_runs(j.xf, &s, j.src.ids, &d, j.dst.ids, 0, j.n_layers, &runs), 0);
    for (size_t i = 0; i < runs.n; i++) {
      const kvf__run *r = &runs.v[i];
      assert_true(r->src_off + r->len <= slice_bytes && r->dst_off + r->len <= pool_bytes);
      memcpy(pool + r->dst_off, slice + r->src_off, r->len);
    }
    kvf__runs_free(&runs);
  }
  kvf__rdma_sgpu_free(&sg);
  assert_memory_equal(pool, want, pool_bytes);
  free(slice);
  free(pool);
  free(want);
  free(ids);
}

#define NHD KVF_LAYOUT_NHD
#define HND KVF_LAYOUT_HND

static void test_fan_in_halves(void **state) {
  run_case(&(scase){20, 16, 2, 0, NHD, {NHD, 1, 1}, 12, 4}); /* TP 8 -> 4: prefill rank 1's head */
  run_case(&(scase){20, 16, 2, 2, HND, {NHD, 2, 1}, 12, 2});
}

static void test_orders(void **state) {
  run_case(&(scase){20, 16, 8, 0, HND, {NHD, 0, 8}, 16, 3}); /* NHD -> HND, every head */
  run_case(&(scase){10, 64, 4, 4, NHD, {HND, 4, 2}, 6, 1});  /* HND heads 4-5 into NHD heads 4-7 */
}

static void test_one_chunk(void **state) { run_case(&(scase){30, 16, 4, 0, NHD, {HND, 0, 4}, 30, LAYERS}); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fan_in_halves),
      cmocka_unit_test(test_orders),
      cmocka_unit_test(test_one_chunk),
  };
  return cmocka_run_group_tests_name("rdma GPU pass jobs, on the CPU", tests, NULL, NULL);
}
