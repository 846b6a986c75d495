/* test_rdma_mw.c - the pure parts of the rdma transport's memory windows
 * (daemon/transport/rdma/rdma_mw.c): the 32-byte records a Grant carries, the
 * checks a sender makes of them, finding the window of a write, the plan
 * of a grant's windows under rdma-mw-max-windows, and each descriptor's
 * window (Grant.window_of). (Binding them needs
 * a device: tests/rdma and tests/integration/test_rogue.c in the VM.) */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "kvferry.h"
#include "transport/rdma/rdma_mw.h"

/* Records from (pool, off, len) triples; rkey = 100 + i, qpn = 200 + i. */
static uint8_t *recs(const uint64_t (*w)[3], size_t n) {
  uint8_t *b = calloc(n ? n : 1, KVF__MW_REC);
  assert_non_null(b);
  for (size_t i = 0; i < n; i++) {
    kvf__mw_rec r = {.pool = (uint32_t)w[i][0], .off = w[i][1], .len = w[i][2], .rkey = 100 + (uint32_t)i,
                     .qpn = 200 + (uint32_t)i, .dev = (uint16_t)(i % 3)};
    kvf__mw_rec_put(b + i * KVF__MW_REC, &r);
  }
  return b;
}

static void test_record_layout(void **state) {
  uint8_t b[KVF__MW_REC];
  kvf__mw_rec r = {.pool = 0x01020304, .off = 0x1112131415161718ull, .len = 0x2122232425262728ull,
                   .rkey = 0x31323334, .qpn = 0x41424344, .dev = 0x5152},
              back;
  memset(b, 0xee, sizeof b);
  kvf__mw_rec_put(b, &r);
  /* little-endian, in the order proto/kvferry.proto gives */
  assert_int_equal(b[0], 0x04);
  assert_int_equal(b[4], 0x18);
  assert_int_equal(b[12], 0x28);
  assert_int_equal(b[20], 0x34);
  assert_int_equal(b[24], 0x44);
  assert_int_equal(b[28], 0x52);
  assert_int_equal(b[30], 0);
  assert_int_equal(b[31], 0);
  kvf__mw_rec_get(b, &back);
  assert_int_equal(back.pool, r.pool);
  assert_int_equal(back.off, r.off);
  assert_int_equal(back.len, r.len);
  assert_int_equal(back.rkey, r.rkey);
  assert_int_equal(back.qpn, r.qpn);
  assert_int_equal(back.dev, r.dev);
}

static void test_records_checked(void **state) {
  static const uint64_t good[][3] = {{0, 0, 10}, {0, 10, 5}, {0, 100, 1}, {1, 0, 4}};
  static const uint64_t overlap[][3] = {{0, 0, 10}, {0, 9, 5}};
  static const uint64_t unsorted[][3] = {{1, 0, 10}, {0, 20, 5}};
  static const uint64_t empty[][3] = {{0, 0, 0}};
  static const uint64_t wrap[][3] = {{0, UINT64_MAX - 2, 8}};
  uint8_t *b = recs(good, 4);
  assert_int_equal(kvf__mw_recs_check(b, 4 * KVF__MW_REC), 0);
  assert_int_equal(kvf__mw_recs_check(b, 0), 0);
  assert_int_equal(kvf__mw_recs_check(b, 4 * KVF__MW_REC - 1), KVF_EPROTO);
  free(b);
  b = recs(overlap, 2);
  assert_int_equal(kvf__mw_recs_check(b, 2 * KVF__MW_REC), KVF_EPROTO);
  free(b);
  b = recs(unsorted, 2);
  assert_int_equal(kvf__mw_recs_check(b, 2 * KVF__MW_REC), KVF_EPROTO);
  free(b);
  b = recs(empty, 1);
  assert_int_equal(kvf__mw_recs_check(b, KVF__MW_REC), KVF_EPROTO);
  free(b);
  b = recs(wrap, 1);
  assert_int_equal(kvf__mw_recs_check(b, KVF__MW_REC), KVF_EPROTO);
  free(b);
}

static void test_find(void **state) {
  static const uint64_t w[][3] = {{0, 100, 50}, {0, 200, 10}, {2, 0, 4096}, {2, 8192, 4096}};
  uint8_t *b = recs(w, 4);
  kvf__mw_rec v[4];
  kvf__mw_recs_decode(b, 4, v);
  assert_int_equal(v[3].rkey, 103);
  assert_int_equal(v[3].qpn, 203);
  assert_int_equal(kvf__mw_find(v, 4, 0, 100, 50, false), 0);   /* all of it */
  assert_int_equal(kvf__mw_find(v, 4, 0, 120, 30, false), 0);   /* up to its end */
  assert_int_equal(kvf__mw_find(v, 4, 0, 120, 31, false), -1);  /* one byte past */
  assert_int_equal(kvf__mw_find(v, 4, 0, 99, 2, false), -1);    /* one byte before */
  assert_int_equal(kvf__mw_find(v, 4, 0, 150, 1, false), -1);   /* the gap */
  assert_int_equal(kvf__mw_find(v, 4, 0, 205, 5, false), 1);
  assert_int_equal(kvf__mw_find(v, 4, 1, 0, 1, false), -1);     /* no window in pool 1 */
  assert_int_equal(kvf__mw_find(v, 4, 2, 8192, 4096, false), 3);
  assert_int_equal(kvf__mw_find(v, 4, 2, 4096, 4096, false), -1);
  assert_int_equal(kvf__mw_find(v, 4, 2, 0, 8192, false), -1);  /* spans two windows */
  assert_int_equal(kvf__mw_find(v, 4, 2, 0, UINT64_MAX, false), -1);
  assert_int_equal(kvf__mw_find(v, 0, 0, 100, 1, false), -1);
  /* the nearest window of the pool, for the rogue build */
  assert_int_equal(kvf__mw_find(v, 4, 0, 500, 8, true), 1);
  assert_int_equal(kvf__mw_find(v, 4, 0, 0, 8, true), 0);
  assert_int_equal(kvf__mw_find(v, 4, 2, 100000, 8, true), 3);
  assert_int_equal(kvf__mw_find(v, 4, 1, 0, 8, true), -1);
  assert_int_equal(kvf__mw_find(v, 4, 0, 120, 8, true), 0);     /* held: the same as without */
  free(b);
}

/* Field by field: the structs have padding. */
static void same_ranges(const kvf__range *a, const kvf__range *b, size_t n) {
  for (size_t i = 0; i < n; i++) {
    assert_int_equal(a[i].pool, b[i].pool);
    assert_int_equal(a[i].start, b[i].start);
    assert_int_equal(a[i].end, b[i].end);
  }
}

static kvf__rangeset set(const uint64_t (*r)[3], size_t n) {
  kvf__rangeset rs = {malloc(n * sizeof(kvf__range)), n};
  assert_non_null(rs.v);
  for (size_t i = 0; i < n; i++) rs.v[i] = (kvf__range){(uint32_t)r[i][0], r[i][1], r[i][2]};
  return rs;
}

static void test_plan_within_cap(void **state) {
  static const uint64_t r[][3] = {{0, 0, 10}, {0, 20, 30}, {1, 0, 5}};
  kvf__rangeset rs = set(r, 3);
  kvf__range *w;
  size_t n, merged;
  assert_int_equal(kvf__mw_plan(&rs, 3, &w, &n, &merged), 0);
  assert_int_equal(n, 3);
  assert_int_equal(merged, 0);
  same_ranges(w, rs.v, 3);
  free(w);
  rs.n = 0;
  assert_int_equal(kvf__mw_plan(&rs, 3, &w, &n, &merged), 0);
  assert_int_equal(n, 0);
  assert_null(w);
  kvf__rangeset_free(&rs);
}

/* Over the cap: the smallest gaps within a pool are spanned first. */
static void test_plan_merges_smallest_gaps(void **state) {
  /* pool 0 gaps: 10 (0-1), 2 (1-2), 50 (2-3); pool 1 gap: 1 (4-5); none across pools */
  static const uint64_t r[][3] = {{0, 0, 10}, {0, 20, 30}, {0, 32, 40}, {0, 90, 100}, {1, 0, 5}, {1, 6, 9}};
  kvf__rangeset rs = set(r, 6);
  kvf__range *w;
  size_t n, merged;
  assert_int_equal(kvf__mw_plan(&rs, 4, &w, &n, &merged), 0);
  assert_int_equal(n, 4);
  assert_int_equal(merged, 2);
  kvf__range want[] = {{0, 0, 10}, {0, 20, 40}, {0, 90, 100}, {1, 0, 9}};
  same_ranges(w, want, 4);
  free(w);
  /* a cap of 1 can only merge within each pool: one window per pool */
  assert_int_equal(kvf__mw_plan(&rs, 1, &w, &n, &merged), 0);
  assert_int_equal(n, 2);
  assert_int_equal(merged, 4);
  kvf__range one[] = {{0, 0, 100}, {1, 0, 9}};
  same_ranges(w, one, 2);
  free(w);
  kvf__rangeset_free(&rs);
}

/* The windows always cover every granted byte. */
static void test_plan_covers(void **state) {
  enum { M = 997 };
  uint64_t (*r)[3] = calloc(M, sizeof *r), off = 0, s = 12345;
  assert_non_null(r);
  for (size_t i = 0; i < M; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    off += 1 + (s >> 54);
    r[i][0] = i * 3 / M;
    r[i][1] = off;
    off += 1 + ((s >> 40) & 1023);
    r[i][2] = off;
  }
  kvf__rangeset rs = set((const uint64_t (*)[3])r, M);
  for (size_t cap = 1; cap <= M + 1; cap = cap * 3 + 1) {
    kvf__range *w;
    size_t n, merged;
    assert_int_equal(kvf__mw_plan(&rs, cap, &w, &n, &merged), 0);
    assert_true(n <= (cap < 3 ? 3 : cap));
    assert_int_equal(n + merged, M);
    uint8_t *b = calloc(n, KVF__MW_REC);
    for (size_t i = 0; i < n; i++) {
      kvf__mw_rec rec = {.pool = w[i].pool, .off = w[i].start, .len = w[i].end - w[i].start};
      kvf__mw_rec_put(b + i * KVF__MW_REC, &rec);
    }
    assert_int_equal(kvf__mw_recs_check(b, n * KVF__MW_REC), 0);
    kvf__mw_rec *v = malloc(n * sizeof *v);
    kvf__mw_recs_decode(b, n, v);
    for (size_t i = 0; i < M; i++)
      assert_true(kvf__mw_find(v, n, rs.v[i].pool, rs.v[i].start, rs.v[i].end - rs.v[i].start, false) >= 0);
    free(v);
    free(b);
    free(w);
  }
  kvf__rangeset_free(&rs);
  free(r);
}

/* Grant.window_of: for descriptors in random order, some adjacent, some
 * overlapping, each entry names a window that holds its descriptor, under
 * any cap on the number of windows. */
static void test_index(void **state) {
  enum { M = 2000 };
  kvf__descs d = {malloc(M * sizeof(uint32_t)), malloc(M * sizeof(uint64_t)), malloc(M * sizeof(uint64_t)), M, 0};
  assert_non_null(d.pool);
  uint64_t s = 777;
  for (size_t i = 0; i < M; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    d.pool[i] = (uint32_t)(s >> 62);
    d.offset[i] = (s >> 30) % (1u << 22);
    d.length[i] = 1 + ((s >> 8) & 16383);
    if (i && (s & 3) == 0) { /* the block right after the last one: a run */
      d.pool[i] = d.pool[i - 1];
      d.offset[i] = d.offset[i - 1] + d.length[i - 1];
    }
  }
  kvf__rangeset rs;
  assert_int_equal(kvf__rangeset_build(&rs, &d), 0);
  uint8_t *of = malloc(M * KVF__MW_OF);
  assert_non_null(of);
  for (size_t cap = 1; cap <= rs.n + 1; cap = cap * 5 + 2) {
    kvf__range *w;
    size_t n, merged;
    assert_int_equal(kvf__mw_plan(&rs, cap, &w, &n, &merged), 0);
    assert_int_equal(kvf__mw_index(&d, w, n, of), 0);
    for (size_t i = 0; i < M; i++) {
      uint32_t k = kvf__mw_index_get(of, M * KVF__MW_OF, i);
      assert_true(k < n);
      assert_int_equal(w[k].pool, d.pool[i]);
      assert_true(w[k].start <= d.offset[i] && d.offset[i] + d.length[i] <= w[k].end);
    }
    free(w);
  }
  /* Past the end of window_of (a short one from a faulty peer): none. */
  assert_int_equal(kvf__mw_index_get(of, 3 * KVF__MW_OF + 2, 3), UINT32_MAX);
  assert_true(kvf__mw_index_get(of, 3 * KVF__MW_OF + 2, 2) != UINT32_MAX);
  /* A descriptor no window holds (a plan of other ranges) is refused. */
  kvf__range one = {.pool = 9, .start = 0, .end = 10};
  assert_int_equal(kvf__mw_index(&d, &one, 1, of), KVF_EINVAL);
  free(of);
  kvf__rangeset_free(&rs);
  kvf__descs_free(&d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_record_layout),
      cmocka_unit_test(test_records_checked),
      cmocka_unit_test(test_find),
      cmocka_unit_test(test_plan_within_cap),
      cmocka_unit_test(test_plan_merges_smallest_gaps),
      cmocka_unit_test(test_plan_covers),
      cmocka_unit_test(test_index),
  };
  return cmocka_run_group_tests_name("rdma memory windows", tests, NULL, NULL);
}
