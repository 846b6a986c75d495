/* test_layout.c - KV layouts (daemon/layout.c): validation (shapes, blocks
 * past the pool, overlapping regions, checked against brute force), views,
 * and walking two layouts into runs: every byte of every block of every
 * layer lands where block i of the other side is, pieces that sit back to
 * back coalesce, and each run names its first piece in the receiver's
 * canonical order. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"

#define MAXR 64

typedef struct lay {
  kvf__layout l;
  uint64_t off[MAXR];
} lay;

/* vLLM: per layer one [2, blocks, ...] tensor, K then V; layers back to back. */
static void vllm(lay *x, uint32_t layers, uint32_t blocks, uint64_t bb, uint64_t base) {
  memset(x, 0, sizeof(*x));
  x->l = (kvf__layout){.n_layers = layers, .n_kv = 2, .n_blocks = blocks, .block_bytes = bb,
                       .block_stride = bb, .offsets = x->off};
  for (uint32_t r = 0; r < layers * 2; r++) x->off[r] = base + r * blocks * bb;
}

/* One block holds every layer's K and V. */
static void cross_layer(lay *x, uint32_t layers, uint32_t blocks, uint64_t bb) {
  memset(x, 0, sizeof(*x));
  x->l = (kvf__layout){.n_layers = layers, .n_kv = 2, .n_blocks = blocks, .block_bytes = bb,
                       .block_stride = bb * layers * 2, .offsets = x->off};
  for (uint32_t r = 0; r < layers * 2; r++) x->off[r] = r * bb;
}

static int validate(const lay *x, uint64_t pool) {
  char err[256] = "";
  int rc = kvf__layout_validate(&x->l, pool, err, sizeof(err));
  if (rc) assert_true(strlen(err) > 0); /* every refusal says why */
  return rc;
}

static void test_valid_layouts(void **state) {
  lay x;
  vllm(&x, 4, 16, 64, 0);
  assert_int_equal(validate(&x, 4 * 2 * 16 * 64), 0);
  cross_layer(&x, 4, 16, 64);
  assert_int_equal(validate(&x, 4 * 2 * 16 * 64), 0);
  /* FlashInfer: [blocks, 2, ...] per layer: V right after K, stride 2 blocks. */
  memset(&x, 0, sizeof(x));
  x.l = (kvf__layout){.n_layers = 2, .n_kv = 2, .n_blocks = 8, .block_bytes = 32, .block_stride = 64,
                      .offsets = x.off};
  x.off[0] = 0, x.off[1] = 32, x.off[2] = 512, x.off[3] = 544;
  assert_int_equal(validate(&x, 1024), 0);
  /* MLA: one latent region per layer. */
  vllm(&x, 3, 4, 100, 0);
  x.l.n_kv = 1;
  assert_int_equal(validate(&x, 3 * 4 * 100), 0);
}

static void test_bad_shapes(void **state) {
  lay x;
  vllm(&x, 2, 4, 64, 0);
  x.l.n_layers = 0;
  assert_int_equal(validate(&x, 1 << 20), KVF_EINVAL);
  vllm(&x, 2, 4, 64, 0);
  x.l.n_kv = 3;
  assert_int_equal(validate(&x, 1 << 20), KVF_EINVAL);
  vllm(&x, 2, 4, 64, 0);
  x.l.block_stride = 63; /* blocks of one region would overlap */
  assert_int_equal(validate(&x, 1 << 20), KVF_EINVAL);
  vllm(&x, 2, 4, 64, 0);
  x.l.n_blocks = 0;
  assert_int_equal(validate(&x, 1 << 20), KVF_EINVAL);
  vllm(&x, 2, 4, 64, 0);
  x.l.geom = (kvf__lgeom){.tokens_per_block = 2, .kv_heads = 2, .head_dim = 4, .dtype_bytes = 2};
  assert_int_equal(validate(&x, 1 << 20), KVF_EINVAL); /* 2*2*4*2 = 32, not 64 */
  x.l.geom.head_dim = 8;
  assert_int_equal(validate(&x, 1 << 20), 0);
  x.l.geom.order = 2;
  assert_int_equal(validate(&x, 1 << 20), KVF_EINVAL);
}

static void test_outside_the_pool(void **state) {
  lay x;
  vllm(&x, 2, 4, 64, 0);
  uint64_t need = 2 * 2 * 4 * 64;
  assert_int_equal(validate(&x, need), 0);
  assert_int_equal(validate(&x, need - 1), KVF_ERANGE);
  x.off[3] = UINT64_MAX - 10; /* wraps */
  assert_int_equal(validate(&x, UINT64_MAX), KVF_ERANGE);
  vllm(&x, 2, 4, 64, 0);
  x.l.block_stride = UINT64_MAX / 2; /* (blocks - 1) x stride overflows */
  assert_int_equal(validate(&x, UINT64_MAX), KVF_ERANGE);
}

static void test_overlapping_regions(void **state) {
  lay x;
  vllm(&x, 2, 4, 64, 0);
  x.off[2] = x.off[1] + 3 * 64; /* layer 1 K starts in layer 0 V's last block */
  assert_int_equal(validate(&x, 1 << 20), KVF_EINVAL);
  cross_layer(&x, 2, 4, 64);
  x.off[3] = x.off[2] + 32; /* interleaved, half a block apart */
  assert_int_equal(validate(&x, 1 << 20), KVF_EINVAL);
  cross_layer(&x, 2, 4, 64);
  x.off[3] = x.off[0] + 4 * 256; /* one stride of 4 blocks further: block 0 of one is block 4... past the end: fine */
  assert_int_equal(validate(&x, 1 << 20), 0);
  x.off[3] = x.off[0] + 3 * 256; /* lands on block 3 of region 0 */
  assert_int_equal(validate(&x, 1 << 20), KVF_EINVAL);
}

/* The overlap test against every pair of blocks, on random small shapes. */
static void test_overlap_matches_brute_force(void **state) {
  srand(7);
  for (int trial = 0; trial < 20000; trial++) {
    lay x;
    memset(&x, 0, sizeof(x));
    uint32_t blocks = 1 + (uint32_t)(rand() % 5);
    uint64_t bb = 1 + (uint64_t)(rand() % 8), stride = bb + (uint64_t)(rand() % 8);
    x.l = (kvf__layout){.n_layers = 1, .n_kv = 2, .n_blocks = blocks, .block_bytes = bb, .block_stride = stride,
                        .offsets = x.off};
    x.off[0] = (uint64_t)(rand() % 40);
    x.off[1] = (uint64_t)(rand() % 40);
    bool brute = false;
    for (uint32_t i = 0; i < blocks; i++)
      for (uint32_t j = 0; j < blocks; j++) {
        uint64_t a = x.off[0] + i * stride, c = x.off[1] + j * stride;
        if (a < c + bb && c < a + bb) brute = true;
      }
    int rc = validate(&x, 1000);
    if (rc != (brute ? KVF_EINVAL : 0))
      fail_msg("blocks %u bb %llu stride %llu offsets %llu %llu: brute %d rc %d", blocks, (unsigned long long)bb,
               (unsigned long long)stride, (unsigned long long)x.off[0], (unsigned long long)x.off[1], brute, rc);
  }
}

static void test_views(void **state) {
  lay x;
  vllm(&x, 8, 4, 64, 0);
  kvf__lview v;
  assert_int_equal(kvf__layout_view(&x.l, 0, 0, &v), 0);
  assert_int_equal(v.n_layers, 8);
  assert_int_equal(kvf__layout_view(&x.l, 3, 2, &v), 0);
  assert_int_equal(v.first_layer, 3);
  assert_int_equal(kvf__lview_addr(&v, 4, 1, 2), x.off[9] + 2 * 64);
  assert_int_equal(kvf__layout_view(&x.l, 8, 0, &v), KVF_ERANGE);
  assert_int_equal(kvf__layout_view(&x.l, 7, 2, &v), KVF_ERANGE);
  uint32_t ids[] = {0, 3, 4};
  size_t bad = 99;
  assert_int_equal(kvf__blocks_check(&v, ids, 2, &bad), 0);
  assert_int_equal(kvf__blocks_check(&v, ids, 3, &bad), KVF_ERANGE);
  assert_int_equal(bad, 2);
  assert_false(kvf__lview_block_major(&v));
  cross_layer(&x, 8, 4, 64);
  assert_int_equal(kvf__layout_view(&x.l, 0, 0, &v), 0);
  assert_true(kvf__lview_block_major(&v));
}

static void test_compatible(void **state) {
  lay a, b;
  vllm(&a, 2, 4, 64, 0);
  vllm(&b, 2, 8, 64, 0);
  kvf__lview va, vb;
  kvf__layout_view(&a.l, 0, 0, &va);
  kvf__layout_view(&b.l, 0, 0, &vb);
  char why[128];
  assert_int_equal(kvf__lview_compatible(&va, &vb, why, sizeof(why)), 0);
  vb.block_bytes = 32;
  assert_int_equal(kvf__lview_compatible(&va, &vb, why, sizeof(why)), KVF_ESIZE);
  assert_non_null(strstr(why, "block sizes"));
  vb.block_bytes = 64;
  va.geom.kv_heads = 8;
  assert_int_equal(kvf__lview_compatible(&va, &vb, why, sizeof(why)), 0); /* only one side states it */
  vb.geom.kv_heads = 4;
  assert_int_equal(kvf__lview_compatible(&va, &vb, why, sizeof(why)), KVF_ESIZE);
  vb.geom.kv_heads = 8;
  vb.n_kv = 1;
  assert_int_equal(kvf__lview_compatible(&va, &vb, why, sizeof(why)), KVF_ESIZE);
}

/* Fills src with a pattern, applies runs, and checks dst block by block. */
static void check_moves(const lay *s, const uint32_t *sids, const lay *d, const uint32_t *dids, size_t n,
                        uint32_t first, uint32_t nl, size_t *n_runs) {
  kvf__lview vs, vd;
  assert_int_equal(kvf__layout_view(&s->l, 0, 0, &vs), 0);
  assert_int_equal(kvf__layout_view(&d->l, 0, 0, &vd), 0);
  size_t psize = 1 << 16;
  uint8_t *src = malloc(psize), *dst = calloc(1, psize), *want = calloc(1, psize);
  for (size_t i = 0; i < psize; i++) src[i] = (uint8_t)(i * 31 + 7);
  kvf__runs runs = {0};
  assert_int_equal(kvf__blocks_pair(&vs, sids, &vd, dids, n, first, nl, &runs), 0);
  kvf__descs canon;
  assert_int_equal(kvf__blocks_descs(&vd, dids, n, &canon), 0);
  uint64_t bytes = 0;
  for (size_t r = 0; r < runs.n; r++) {
    const kvf__run *run = &runs.v[r];
    assert_true(run->src_off + run->len <= psize && run->dst_off + run->len <= psize);
    memcpy(dst + run->dst_off, src + run->src_off, run->len);
    assert_true(run->dst_desc < canon.n);
    assert_int_equal(canon.offset[run->dst_desc], run->dst_off); /* its first piece */
    bytes += run->len;
  }
  assert_int_equal(bytes, runs.bytes);
  assert_int_equal(bytes, kvf__blocks_bytes(&vs, n, nl));
  for (uint32_t l = first; l < first + nl; l++)
    for (uint32_t kv = 0; kv < 2; kv++)
      for (size_t i = 0; i < n; i++)
        memcpy(want + kvf__lview_addr(&vd, l, kv, dids[i]), src + kvf__lview_addr(&vs, l, kv, sids[i]),
               vs.block_bytes);
  assert_memory_equal(dst, want, psize);
  *n_runs = runs.n;
  kvf__runs_free(&runs);
  kvf__descs_free(&canon);
  free(src);
  free(dst);
  free(want);
}

static void test_pair_scattered(void **state) {
  lay s, d;
  vllm(&s, 4, 32, 64, 0);
  vllm(&d, 4, 32, 64, 0);
  uint32_t sids[] = {5, 1, 30, 2, 17}, dids[] = {0, 31, 3, 9, 8};
  size_t n_runs;
  check_moves(&s, sids, &d, dids, 5, 0, 4, &n_runs);
  assert_int_equal(n_runs, 5 * 4 * 2);
  check_moves(&s, sids, &d, dids, 5, 2, 1, &n_runs); /* one layer part */
  assert_int_equal(n_runs, 5 * 2);
}

static void test_pair_coalesces(void **state) {
  lay s, d;
  vllm(&s, 4, 32, 64, 0);
  vllm(&d, 4, 32, 64, 4096);
  uint32_t sids[] = {4, 5, 6, 7}, dids[] = {10, 11, 12, 13};
  size_t n_runs;
  check_moves(&s, sids, &d, dids, 4, 0, 4, &n_runs);
  assert_int_equal(n_runs, 4 * 2); /* one run per region */
  /* Cross-layer on both sides: one run per block, whatever the ids. */
  cross_layer(&s, 4, 8, 64);
  cross_layer(&d, 4, 8, 64);
  uint32_t a[] = {3, 0, 6}, b[] = {1, 7, 2};
  check_moves(&s, a, &d, b, 3, 0, 4, &n_runs);
  assert_int_equal(n_runs, 3);
  /* Cross-layer into per-layer: still every byte in place. */
  vllm(&d, 4, 8, 64, 0);
  check_moves(&s, a, &d, b, 3, 0, 4, &n_runs);
}

static void test_pair_refuses(void **state) {
  lay s, d;
  vllm(&s, 4, 8, 64, 0);
  vllm(&d, 2, 8, 64, 0);
  kvf__lview vs, vd;
  kvf__layout_view(&s.l, 0, 0, &vs);
  kvf__layout_view(&d.l, 0, 0, &vd);
  uint32_t ids[] = {1};
  kvf__runs runs = {0};
  assert_int_equal(kvf__blocks_pair(&vs, ids, &vd, ids, 1, 1, 2, &runs), KVF_ERANGE); /* layer 2 not in dst */
  assert_int_equal(kvf__blocks_pair(&vs, ids, &vd, ids, 1, 0, 0, &runs), KVF_ERANGE);
  vd.block_bytes = 32;
  assert_int_equal(kvf__blocks_pair(&vs, ids, &vd, ids, 1, 0, 1, &runs), KVF_ESIZE);
  assert_int_equal(runs.n, 0);
  kvf__runs_free(&runs);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_valid_layouts),
      cmocka_unit_test(test_bad_shapes),
      cmocka_unit_test(test_outside_the_pool),
      cmocka_unit_test(test_overlapping_regions),
      cmocka_unit_test(test_overlap_matches_brute_force),
      cmocka_unit_test(test_views),
      cmocka_unit_test(test_compatible),
      cmocka_unit_test(test_pair_scattered),
      cmocka_unit_test(test_pair_coalesces),
      cmocka_unit_test(test_pair_refuses),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
