/* test_grant_index.c - overlapping destinations (daemon/grant_index.c):
 * runs of one grant (in order, shuffled, touching, empty, several pools,
 * the radix sort against a plain sort), and the open grants' index (find,
 * add, remove, adjacency, per pool), against a brute-force model. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "grant_index.h"
#include "kvferry.h"

static kvf__gi_item it(uint32_t pool, uint64_t start, uint64_t end, uint32_t idx) {
  return (kvf__gi_item){.start = start, .end = end, .pool = pool, .idx = idx};
}

static int runs(kvf__gi_item *v, size_t n, size_t *nr, kvf__gi_clash *c) { return kvf__gi_runs(v, n, nr, c); }

/* Ascending, touching ranges merge into one run; a gap keeps two. */
static void test_sorted_touching(void **state) {
  kvf__gi_item v[] = {it(0, 0, 100, 0), it(0, 100, 200, 1), it(0, 300, 400, 2), it(0, 400, 401, 3)};
  size_t nr;
  assert_int_equal(runs(v, 4, &nr, NULL), 0);
  assert_int_equal(nr, 2);
  assert_true(v[0].start == 0 && v[0].end == 200);
  assert_true(v[1].start == 300 && v[1].end == 401);
}

/* Overlap by one byte, in order: the two descriptors are named. */
static void test_sorted_overlap(void **state) {
  kvf__gi_item v[] = {it(0, 0, 100, 0), it(0, 100, 200, 1), it(0, 199, 300, 2)};
  size_t nr;
  kvf__gi_clash c;
  assert_int_equal(runs(v, 3, &nr, &c), KVF_EINVAL);
  assert_int_equal(c.a, 1);
  assert_int_equal(c.b, 2);
  assert_true(c.a_start == 100 && c.a_end == 200 && c.b_start == 199 && c.b_end == 300);
}

/* Unsorted input: sorted, and the overlap found whatever the order; a
 * range inside another (not only its neighbour) counts. */
static void test_unsorted(void **state) {
  kvf__gi_item v[] = {it(0, 500, 600, 0), it(0, 0, 100, 1), it(0, 200, 300, 2), it(0, 100, 200, 3)};
  size_t nr;
  assert_int_equal(runs(v, 4, &nr, NULL), 0);
  assert_int_equal(nr, 2); /* [0,300) and [500,600) */
  assert_true(v[0].start == 0 && v[0].end == 300 && v[1].start == 500);
  kvf__gi_item w[] = {it(0, 900, 1000, 0), it(0, 0, 1000, 1), it(0, 2000, 2100, 2)};
  kvf__gi_clash c;
  assert_int_equal(runs(w, 3, &nr, &c), KVF_EINVAL);
  assert_int_equal(c.a, 0);
  assert_int_equal(c.b, 1);
  kvf__gi_item dup[] = {it(0, 64, 128, 0), it(0, 0, 64, 1), it(0, 64, 128, 2)};
  assert_int_equal(runs(dup, 3, &nr, &c), KVF_EINVAL);
  assert_int_equal(c.a, 0);
  assert_int_equal(c.b, 2);
}

/* Empty ranges hold no byte: never an overlap, never a run. */
static void test_zero_length(void **state) {
  kvf__gi_item v[] = {it(0, 0, 100, 0), it(0, 50, 50, 1), it(0, 100, 100, 2), it(0, 100, 200, 3)};
  size_t nr;
  assert_int_equal(runs(v, 4, &nr, NULL), 0);
  assert_int_equal(nr, 1);
  assert_true(v[0].start == 0 && v[0].end == 200);
  kvf__gindex g = {0};
  assert_int_equal(kvf__gi_add(&g, v, nr, (void *)1), 0);
  kvf__gi_item e = it(0, 150, 150, 0);
  assert_int_equal(kvf__gi_find(&g, &e, 1, NULL), 0);
  kvf__gi_free(&g);
}

/* The same bytes of two pools are different memory; pools interleaved
 * come out sorted by pool. */
static void test_pools(void **state) {
  kvf__gi_item v[] = {it(1, 0, 100, 0), it(0, 0, 100, 1), it(1, 100, 200, 2), it(0, 100, 200, 3)};
  size_t nr;
  assert_int_equal(runs(v, 4, &nr, NULL), 0);
  assert_int_equal(nr, 2);
  assert_true(v[0].pool == 0 && v[0].end == 200 && v[1].pool == 1 && v[1].end == 200);
  kvf__gindex g = {0};
  assert_int_equal(kvf__gi_add(&g, v, 1, (void *)1), 0); /* pool 0 only */
  kvf__gi_item p1 = it(1, 0, 100, 0), p0 = it(0, 50, 60, 0);
  assert_int_equal(kvf__gi_find(&g, &p1, 1, NULL), 0);
  kvf__gi_clash c;
  assert_int_equal(kvf__gi_find(&g, &p0, 1, &c), KVF_EBUSY);
  assert_ptr_equal(c.owner, (void *)1);
  kvf__gi_free(&g);
}

/* Open grants: touching is free, one byte over is not; a removed grant's
 * bytes are free again; removing an owner that holds nothing changes
 * nothing. */
static void test_index_adjacent_and_remove(void **state) {
  kvf__gindex g = {0};
  kvf__gi_item a[] = {it(0, 100, 200, 0), it(0, 400, 500, 1)};
  assert_int_equal(kvf__gi_add(&g, a, 2, (void *)1), 0);
  kvf__gi_item b[] = {it(0, 0, 100, 0), it(0, 200, 400, 1), it(0, 500, 600, 2)};
  assert_int_equal(kvf__gi_find(&g, b, 3, NULL), 0);
  assert_int_equal(kvf__gi_add(&g, b, 3, (void *)2), 0);
  assert_int_equal(kvf__gi_count(&g), 5);
  kvf__gi_item probe[] = {it(0, 199, 201, 7)};
  kvf__gi_clash c;
  assert_int_equal(kvf__gi_find(&g, probe, 1, &c), KVF_EBUSY);
  assert_int_equal(c.a, 7);
  assert_true(c.b_start == 100 && c.b_end == 200);
  assert_ptr_equal(c.owner, (void *)1);
  kvf__gi_remove(&g, (void *)3); /* holds nothing */
  assert_int_equal(kvf__gi_count(&g), 5);
  kvf__gi_remove(&g, (void *)1);
  assert_int_equal(kvf__gi_count(&g), 3);
  assert_int_equal(kvf__gi_find(&g, probe, 1, NULL), KVF_EBUSY); /* [200,400) of owner 2 */
  kvf__gi_item freed[] = {it(0, 100, 200, 0), it(0, 400, 500, 1)};
  assert_int_equal(kvf__gi_find(&g, freed, 2, NULL), 0);
  kvf__gi_remove(&g, (void *)2);
  assert_int_equal(kvf__gi_count(&g), 0);
  assert_null(g.p); /* nothing kept once empty */
}

static uint64_t lcg(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

static int item_cmp(const void *pa, const void *pb) {
  const kvf__gi_item *a = pa, *b = pb;
  if (a->pool != b->pool) return a->pool < b->pool ? -1 : 1;
  return a->start < b->start ? -1 : a->start > b->start;
}

/* Random grants (several pools, offsets up to 2^40 so the radix sort takes
 * four passes) against a brute-force model: kvf__gi_runs says overlap iff
 * two ranges share a byte; kvf__gi_find iff a range shares a byte with an
 * open grant's; runs cover exactly the bytes of the ranges. */
static bool share(const kvf__gi_item *x, const kvf__gi_item *y) {
  return x->pool == y->pool && x->start < y->end && y->start < x->end && x->start < x->end && y->start < y->end;
}

static void test_random_model(void **state) {
  uint64_t seed = 7;
  enum { N = 40, GRANTS = 400 };
  kvf__gi_item held[GRANTS][N];
  size_t nheld[GRANTS] = {0};
  kvf__gindex g = {0};
  for (int t = 0; t < GRANTS; t++) {
    size_t n = 1 + lcg(&seed) % N;
    kvf__gi_item v[N], orig[N];
    uint64_t scale = t % 2 ? 1ull << 28 : 1; /* wide offsets, or dense and likely to overlap */
    for (size_t i = 0; i < n; i++) {
      uint64_t s = (lcg(&seed) % 4000) * scale, len = lcg(&seed) % 64 * (scale > 1 ? 4096 : 1);
      v[i] = orig[i] = it((uint32_t)(lcg(&seed) % 3), s, s + len, (uint32_t)i);
    }
    bool self = false;
    for (size_t i = 0; i < n; i++)
      for (size_t j = i + 1; j < n; j++) self |= share(&orig[i], &orig[j]);
    size_t nr;
    kvf__gi_clash c;
    int rc = kvf__gi_runs(v, n, &nr, &c);
    assert_int_equal(rc, self ? KVF_EINVAL : 0);
    if (self) {
      assert_true(c.a < c.b && share(&orig[c.a], &orig[c.b]));
      continue;
    }
    /* runs: sorted, disjoint, not touching, covering the same bytes */
    uint64_t bytes = 0, rbytes = 0;
    for (size_t i = 0; i < n; i++) bytes += orig[i].end - orig[i].start;
    for (size_t i = 0; i < nr; i++) {
      rbytes += v[i].end - v[i].start;
      if (i) assert_true(v[i - 1].pool < v[i].pool || v[i - 1].end < v[i].start);
    }
    assert_int_equal(bytes, rbytes);
    bool other = false;
    for (int o = 0; o < t; o++)
      for (size_t i = 0; i < nheld[o]; i++)
        for (size_t j = 0; j < n; j++) other |= share(&held[o][i], &orig[j]);
    rc = kvf__gi_find(&g, v, nr, &c);
    assert_int_equal(rc, other ? KVF_EBUSY : 0);
    if (!other) {
      assert_int_equal(kvf__gi_add(&g, v, nr, &held[t]), 0);
      memcpy(held[t], v, nr * sizeof(*v));
      nheld[t] = nr;
    }
    if (lcg(&seed) % 3 == 0) { /* a grant ends */
      int o = (int)(lcg(&seed) % (t + 1));
      kvf__gi_remove(&g, &held[o]);
      nheld[o] = 0;
    }
  }
  size_t total = 0;
  for (int t = 0; t < GRANTS; t++) total += nheld[t];
  assert_int_equal(kvf__gi_count(&g), total);
  kvf__gi_free(&g);
}

/* The radix sort agrees with qsort on large shuffled inputs. */
static void test_radix_matches_qsort(void **state) {
  enum { N = 100000 };
  kvf__gi_item *v = malloc(N * sizeof(*v)), *w = malloc(N * sizeof(*w));
  assert_non_null(v);
  assert_non_null(w);
  uint64_t seed = 3;
  for (size_t i = 0; i < N; i++) { /* distinct blocks of 4 KiB, shuffled, two pools */
    v[i] = it((uint32_t)(i % 2), (uint64_t)(i / 2) * 8192, (uint64_t)(i / 2) * 8192 + 4096, (uint32_t)i);
  }
  for (size_t i = N - 1; i > 0; i--) {
    size_t j = lcg(&seed) % (i + 1);
    kvf__gi_item t = v[i];
    v[i] = v[j], v[j] = t;
  }
  memcpy(w, v, N * sizeof(*v));
  qsort(w, N, sizeof(*w), item_cmp);
  size_t nr;
  assert_int_equal(kvf__gi_runs(v, N, &nr, NULL), 0);
  assert_int_equal(nr, N); /* gaps between blocks: nothing merges */
  for (size_t i = 0; i < N; i++) assert_true(v[i].pool == w[i].pool && v[i].start == w[i].start);
  free(v);
  free(w);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sorted_touching),
      cmocka_unit_test(test_sorted_overlap),
      cmocka_unit_test(test_unsorted),
      cmocka_unit_test(test_zero_length),
      cmocka_unit_test(test_pools),
      cmocka_unit_test(test_index_adjacent_and_remove),
      cmocka_unit_test(test_random_model),
      cmocka_unit_test(test_radix_matches_qsort),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
