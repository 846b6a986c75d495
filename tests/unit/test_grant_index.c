/* test_grant_index.c - overlapping destinations (daemon/grant_index.c):
 * one grant's ranges (touching, overlapping by a byte, unsorted, empty,
 * several pools), the open grants (adjacent, released, per pool, allow),
 * granule edges, failures that leave nothing held, and a brute-force model
 * of random grants; grants of blocks (sets of block ids per layout, spilled
 * into ranges when ranges meet them) against a model of their bytes. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grant_index.h"
#include "kvferry.h"
#include "kvferryd.h"
#include "layout.h"
#include "xfer.h"

#define POOL_SIZE (1ull << 22) /* 4 MiB: 4 KiB granules */

static uint64_t sizes(uint32_t pool) { return pool < 3 ? POOL_SIZE : pool == 7 ? 1ull << 42 : 0; }

static kvf__gi_item it(uint32_t pool, uint64_t start, uint64_t end, uint32_t idx) {
  return (kvf__gi_item){.start = start, .end = end, .pool = pool, .idx = idx};
}

#define OWNER(k) ((const void *)(uintptr_t)(0x1000 + (k)))

static kvf__gindex G;

static int setup(void **state) {
  memset(&G, 0, sizeof(G));
  G.size_of = sizes;
  return 0;
}

static int teardown(void **state) {
  kvf__gi_free(&G);
  return 0;
}

/* kvf__gi_claim of a copy of v (which it takes on success). */
static int gclaim(const kvf__gi_item *v, size_t n, int owner, bool others, kvf__gi_clash *c) {
  kvf__gi_clash scratch;
  kvf__gi_item *copy = malloc((n ? n : 1) * sizeof(*copy));
  assert_non_null(copy);
  memcpy(copy, v, n * sizeof(*v));
  int rc = kvf__gi_claim(&G, copy, n, OWNER(owner), others, c ? c : &scratch);
  if (rc) free(copy);
  return rc;
}

static int claim(const kvf__gi_item *v, size_t n, int owner, kvf__gi_clash *c) {
  return gclaim(v, n, owner, true, c);
}

/* Ascending, touching ranges of one grant are fine; one byte over is not,
 * and the two descriptors are named, the earlier first. */
static void test_touching_and_overlap(void **state) {
  kvf__gi_item v[] = {it(0, 0, 100, 0), it(0, 100, 200, 1), it(0, 300, 400, 2), it(0, 400, 401, 3)};
  assert_int_equal(claim(v, 4, 1, NULL), 0);
  assert_int_equal(kvf__gi_count(&G), 4);
  kvf__gi_item w[] = {it(0, 5000, 5100, 0), it(0, 5100, 5200, 1), it(0, 5199, 5300, 2)};
  kvf__gi_clash c;
  assert_int_equal(claim(w, 3, 2, &c), KVF_EINVAL);
  assert_int_equal(c.a, 1);
  assert_int_equal(c.b, 2);
  assert_true(c.a_start == 5100 && c.a_end == 5200 && c.b_start == 5199 && c.b_end == 5300);
  assert_null(c.owner);
  assert_int_equal(kvf__gi_count(&G), 4); /* the refused grant holds nothing */
  kvf__gi_item again[] = {it(0, 5000, 5100, 0)};
  assert_int_equal(claim(again, 1, 3, NULL), 0);
}

/* Unsorted: found whatever the order; a range inside a larger one, and the
 * same range twice apart, count. */
static void test_unsorted(void **state) {
  kvf__gi_item v[] = {it(0, 500, 600, 0), it(0, 0, 100, 1), it(0, 200, 300, 2), it(0, 100, 200, 3)};
  assert_int_equal(claim(v, 4, 1, NULL), 0);
  kvf__gi_item w[] = {it(0, 9000, 9100, 0), it(0, 8200, 12000, 1), it(0, 20000, 20100, 2)};
  kvf__gi_clash c;
  assert_int_equal(claim(w, 3, 2, &c), KVF_EINVAL);
  assert_int_equal(c.a, 0);
  assert_int_equal(c.b, 1);
  assert_true(c.a_start == 9000 && c.b_start == 8200 && c.b_end == 12000);
  kvf__gi_item dup[] = {it(0, 64 + 40960, 128 + 40960, 0), it(0, 40960, 40960 + 64, 1),
                        it(0, 64 + 40960, 128 + 40960, 2)};
  assert_int_equal(claim(dup, 3, 3, &c), KVF_EINVAL);
  assert_int_equal(c.a, 0);
  assert_int_equal(c.b, 2);
}

/* Empty ranges hold no byte: never an overlap, never held. */
static void test_zero_length(void **state) {
  kvf__gi_item v[] = {it(0, 0, 100, 0), it(0, 50, 50, 1), it(0, 100, 100, 2), it(0, 100, 200, 3)};
  assert_int_equal(claim(v, 4, 1, NULL), 0);
  assert_int_equal(kvf__gi_count(&G), 2);
  kvf__gi_item e[] = {it(0, 150, 150, 0), it(2, 7, 7, 1)};
  assert_int_equal(claim(e, 2, 2, NULL), 0);
  assert_int_equal(kvf__gi_count(&G), 2);
}

/* The same bytes of two pools are different memory; a pool that does not
 * exist, or a range past its end, is refused and leaves nothing held. */
static void test_pools(void **state) {
  kvf__gi_item v[] = {it(1, 0, 100, 0), it(0, 0, 100, 1)};
  assert_int_equal(claim(v, 2, 1, NULL), 0);
  kvf__gi_item p2[] = {it(2, 0, 100, 0)}, p0[] = {it(0, 50, 60, 0)};
  assert_int_equal(claim(p2, 1, 2, NULL), 0);
  kvf__gi_clash c;
  assert_int_equal(claim(p0, 1, 3, &c), KVF_EBUSY);
  assert_ptr_equal(c.owner, OWNER(1));
  assert_true(c.a_start == 50 && c.b_start == 0 && c.b_end == 100);
  kvf__gi_item bad[] = {it(0, 1000, 1100, 0), it(5, 0, 10, 1)};
  assert_int_equal(claim(bad, 2, 4, NULL), KVF_ENOPOOL);
  kvf__gi_item past[] = {it(0, 1000, 1100, 0), it(0, POOL_SIZE - 10, POOL_SIZE + 1, 1)};
  assert_int_equal(claim(past, 2, 4, NULL), KVF_ERANGE);
  assert_int_equal(kvf__gi_count(&G), 3);
  kvf__gi_item free_again[] = {it(0, 1000, 1100, 0)};
  assert_int_equal(claim(free_again, 1, 4, NULL), 0);
  assert_int_equal(claim(free_again, 1, 4, NULL), KVF_EEXIST); /* one claim per owner */
}

/* Open grants: touching is free, one byte over is not; released bytes are
 * free again; releasing an owner that holds nothing changes nothing. */
static void test_adjacent_and_release(void **state) {
  kvf__gi_item a[] = {it(0, 100, 200, 0), it(0, 400, 500, 1)};
  assert_int_equal(claim(a, 2, 1, NULL), 0);
  kvf__gi_item b[] = {it(0, 0, 100, 0), it(0, 200, 400, 1), it(0, 500, 600, 2)};
  assert_int_equal(claim(b, 3, 2, NULL), 0);
  assert_int_equal(kvf__gi_count(&G), 5);
  kvf__gi_item probe[] = {it(0, 199, 201, 7)};
  kvf__gi_clash c;
  assert_int_equal(claim(probe, 1, 3, &c), KVF_EBUSY);
  assert_int_equal(c.a, 7);
  assert_true(c.a_start == 199 && c.a_end == 201); /* either neighbour: it overlaps both */
  assert_true((c.owner == OWNER(1) && c.b_start == 100 && c.b_end == 200) ||
              (c.owner == OWNER(2) && c.b_start == 200 && c.b_end == 400));
  kvf__gi_release(&G, OWNER(3)); /* holds nothing */
  assert_int_equal(kvf__gi_count(&G), 5);
  kvf__gi_release(&G, OWNER(1));
  assert_int_equal(kvf__gi_count(&G), 3);
  assert_int_equal(claim(probe, 1, 3, NULL), KVF_EBUSY); /* [200, 400) of owner 2 */
  kvf__gi_item freed[] = {it(0, 100, 200, 0), it(0, 400, 500, 1)};
  assert_int_equal(claim(freed, 2, 4, NULL), 0);
  kvf__gi_release(&G, OWNER(2));
  kvf__gi_release(&G, OWNER(4));
  assert_int_equal(kvf__gi_count(&G), 0);
}

/* Ranges over many granules, not aligned, in a pool of 4 KiB granules and
 * in one of 4 TiB (4 MiB granules): overlap at either end is found, and
 * the granules in between are released. */
static void test_granule_edges(void **state) {
  kvf__gi_item big[] = {it(0, 4095, 3 * 4096 + 1, 0)};
  assert_int_equal(claim(big, 1, 1, NULL), 0);
  kvf__gi_item left[] = {it(0, 0, 4096, 0)}, right[] = {it(0, 3 * 4096, 4 * 4096, 0)};
  kvf__gi_item mid[] = {it(0, 2 * 4096 + 7, 2 * 4096 + 8, 0)};
  kvf__gi_item l_ok[] = {it(0, 0, 4095, 0)}, r_ok[] = {it(0, 3 * 4096 + 1, 4 * 4096, 0)};
  assert_int_equal(claim(left, 1, 2, NULL), KVF_EBUSY);
  assert_int_equal(claim(right, 1, 2, NULL), KVF_EBUSY);
  assert_int_equal(claim(mid, 1, 2, NULL), KVF_EBUSY);
  assert_int_equal(claim(l_ok, 1, 2, NULL), 0);
  assert_int_equal(claim(r_ok, 1, 3, NULL), 0);
  kvf__gi_release(&G, OWNER(1));
  assert_int_equal(claim(mid, 1, 4, NULL), 0);
  uint64_t T = 1ull << 40;
  kvf__gi_item huge[] = {it(7, T - 5, T + (9ull << 20), 0), it(7, 3 * T, 3 * T + 10, 1)};
  assert_int_equal(claim(huge, 2, 5, NULL), 0);
  kvf__gi_item h_in[] = {it(7, T + (5ull << 20), T + (5ull << 20) + 1, 0)};
  kvf__gi_item h_out[] = {it(7, T + (9ull << 20), T + (10ull << 20), 0)};
  assert_int_equal(claim(h_in, 1, 6, NULL), KVF_EBUSY);
  assert_int_equal(claim(h_out, 1, 6, NULL), 0);
}

/* The map's granule follows the first grant's smallest range, and is
 * remade for another size once the pool holds nothing: both ways the
 * answers stay exact. */
static void test_granule_remade(void **state) {
  kvf__gi_item big[] = {it(1, 0, 65536, 0), it(1, 131072, 196608, 1)}; /* 64 KiB granules */
  assert_int_equal(claim(big, 2, 1, NULL), 0);
  kvf__gi_item tiny[] = {it(1, 65536, 65600, 0), it(1, 65600, 65700, 1), it(1, 131000, 131073, 2)};
  kvf__gi_clash c;
  assert_int_equal(claim(tiny, 3, 2, &c), KVF_EBUSY); /* the last one: a byte of big[1] */
  assert_int_equal(c.a, 2);
  tiny[2].end = 131072;
  assert_int_equal(claim(tiny, 3, 2, NULL), 0);
  kvf__gi_release(&G, OWNER(1));
  kvf__gi_release(&G, OWNER(2));
  assert_int_equal(kvf__gi_count(&G), 0);
  kvf__gi_item small[] = {it(1, 100, 164, 0), it(1, 70000, 70064, 1)}; /* remade: 4 KiB granules */
  assert_int_equal(claim(small, 2, 3, NULL), 0);
  kvf__gi_item across[] = {it(1, 0, 200000, 0)};
  assert_int_equal(claim(across, 1, 4, &c), KVF_EBUSY);
  kvf__gi_item between[] = {it(1, 164, 70000, 0), it(1, 70064, 300000, 1)};
  assert_int_equal(claim(between, 2, 4, NULL), 0);
  assert_int_equal(kvf__gi_count(&G), 4);
}

/* grant-overlap allow: another owner's ranges do not count, one grant's
 * own still do; releasing one of two overlapping grants leaves the other's
 * ranges held. */
static void test_allow(void **state) {
  kvf__gi_item a[] = {it(0, 0, 8192, 0)}, b[] = {it(0, 4096, 12288, 0)};
  kvf__gi_clash c;
  assert_int_equal(gclaim(a, 1, 1, false, &c), 0);
  assert_int_equal(gclaim(b, 1, 2, false, &c), 0);
  kvf__gi_item self[] = {it(0, 0, 10, 0), it(0, 5, 15, 1)};
  assert_int_equal(gclaim(self, 2, 3, false, &c), KVF_EINVAL);
  kvf__gi_release(&G, OWNER(1));
  kvf__gi_item probe[] = {it(0, 8000, 8001, 0)}, gone[] = {it(0, 0, 4096, 0)};
  assert_int_equal(claim(probe, 1, 4, &c), KVF_EBUSY);
  assert_ptr_equal(c.owner, OWNER(2));
  assert_int_equal(claim(gone, 1, 5, NULL), 0);
}

static uint64_t lcg(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

static bool share(const kvf__gi_item *x, const kvf__gi_item *y) {
  return x->pool == y->pool && x->start < y->end && y->start < x->end && x->start < x->end && y->start < y->end;
}

/* The brute-force model of a claim of v[0..n) by grant t: *self when two
 * of its ranges share a byte, *other when one shares a byte with a range
 * an earlier grant holds (held: rows of stride items, nheld of each). */
static void model(const kvf__gi_item *v, size_t n, const kvf__gi_item *held, size_t stride, const size_t *nheld,
                  int t, bool *self, bool *other) {
  *self = *other = false;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n; j++) *self |= share(&v[i], &v[j]);
  for (int o = 0; o < t; o++)
    for (size_t i = 0; i < nheld[o]; i++)
      for (size_t j = 0; j < n; j++) *other |= share(&held[(size_t)o * stride + i], &v[j]);
}

/* One time in three, a grant of the first t + 1 ends. */
static void maybe_end_one(uint64_t *seed, int t, size_t *nheld) {
  if (lcg(seed) % 3) return;
  int o = (int)(lcg(seed) % (t + 1));
  kvf__gi_release(&G, OWNER(o));
  nheld[o] = 0;
}

/* Random grants over three pools (dense, so that many overlap; some
 * ranges span granules) against a brute-force model: a claim fails with
 * KVF_EINVAL iff two of its ranges share a byte (and the two named do),
 * with KVF_EBUSY iff one shares a byte with a held range of another owner
 * (the one named does); grants end at random. */
static void test_random_model(void **state) {
  uint64_t seed = 7;
  enum { N = 24, GRANTS = 600 };
  static kvf__gi_item held[GRANTS][N];
  size_t nheld[GRANTS] = {0};
  for (int t = 0; t < GRANTS; t++) {
    size_t n = 1 + lcg(&seed) % N;
    kvf__gi_item v[N];
    for (size_t i = 0; i < n; i++) {
      uint64_t s = lcg(&seed) % (POOL_SIZE - 20000), len = lcg(&seed) % 3 ? lcg(&seed) % 300 : lcg(&seed) % 20000;
      v[i] = it((uint32_t)(lcg(&seed) % 3), s, s + len, (uint32_t)i);
    }
    bool self, other;
    model(v, n, &held[0][0], N, nheld, t, &self, &other);
    kvf__gi_clash c;
    int rc = claim(v, n, t, &c);
    if (!self && !other) {
      assert_int_equal(rc, 0);
      memcpy(held[t], v, n * sizeof(*v));
      nheld[t] = n;
    } else if (rc == KVF_EINVAL) {
      assert_true(self && c.a < c.b && share(&v[c.a], &v[c.b]));
    } else {
      assert_int_equal(rc, KVF_EBUSY);
      assert_true(other);
      int o = (int)((uintptr_t)c.owner - 0x1000);
      assert_true(o >= 0 && o < t && nheld[o] > 0);
      kvf__gi_item theirs = it(c.pool, c.b_start, c.b_end, 0);
      assert_true(share(&v[c.a], &theirs));
    }
    maybe_end_one(&seed, t, nheld);
  }
  size_t total = 0;
  for (int t = 0; t < GRANTS; t++)
    for (size_t i = 0; i < nheld[t]; i++) total += held[t][i].start < held[t][i].end;
  assert_int_equal(kvf__gi_count(&G), total);
  for (int t = 0; t < GRANTS; t++) kvf__gi_release(&G, OWNER(t));
  assert_int_equal(kvf__gi_count(&G), 0);
}

/* The same with grant-overlap switching at random between refuse and
 * allow (SIGHUP), so that lists hold ranges that overlap (a mixed pool):
 * every answer stays exact, and once every grant has ended the pool is
 * empty. */
static void test_random_mixed(void **state) {
  uint64_t seed = 11;
  enum { N = 16, GRANTS = 500 };
  static kvf__gi_item held[GRANTS][N];
  size_t nheld[GRANTS] = {0};
  for (int t = 0; t < GRANTS; t++) {
    size_t n = 1 + lcg(&seed) % N;
    bool others = lcg(&seed) % 2;
    kvf__gi_item v[N];
    for (size_t i = 0; i < n; i++) {
      uint64_t s = lcg(&seed) % 200000, len = 1 + lcg(&seed) % 9000;
      v[i] = it(0, s, s + len, (uint32_t)i);
    }
    bool self, other;
    model(v, n, &held[0][0], N, nheld, t, &self, &other);
    kvf__gi_clash c;
    int rc = gclaim(v, n, t, others, &c);
    if (!self && !(others && other)) {
      assert_int_equal(rc, 0);
      memcpy(held[t], v, n * sizeof(*v));
      nheld[t] = n;
    } else if (rc == KVF_EINVAL) {
      assert_true(self && share(&v[c.a], &v[c.b]));
    } else {
      assert_int_equal(rc, KVF_EBUSY);
      assert_true(others && other);
      kvf__gi_item theirs = it(c.pool, c.b_start, c.b_end, 0);
      assert_true(share(&v[c.a], &theirs));
    }
    maybe_end_one(&seed, t, nheld);
  }
  for (int t = 0; t < GRANTS; t++) kvf__gi_release(&G, OWNER(t));
  assert_int_equal(kvf__gi_count(&G), 0);
  kvf__gi_item whole[] = {it(0, 0, POOL_SIZE, 0)}; /* nothing left behind */
  assert_int_equal(claim(whole, 1, GRANTS, NULL), 0);
}

/* Many tiny ranges of one grant in one granule, shuffled (they are put in
 * order first): all taken, and one more byte inside is found. */
static void test_dense_grant(void **state) {
  enum { N = 20000 };
  kvf__gi_item *v = malloc(N * sizeof(*v));
  assert_non_null(v);
  for (size_t i = 0; i < N; i++) v[i] = it(1, 3 * i, 3 * i + 2, (uint32_t)i); /* 2 bytes, 1-byte gaps */
  uint64_t seed = 5;
  for (size_t i = N - 1; i > 0; i--) {
    size_t j = lcg(&seed) % (i + 1);
    kvf__gi_item t = v[i];
    v[i] = v[j], v[j] = t;
  }
  assert_int_equal(claim(v, N, 1, NULL), 0);
  assert_int_equal(kvf__gi_count(&G), N);
  kvf__gi_item gap[] = {it(1, 3 * 777 + 2, 3 * 777 + 3, 0)}, in[] = {it(1, 3 * 778 + 1, 3 * 778 + 2, 0)};
  assert_int_equal(claim(gap, 1, 2, NULL), 0);
  kvf__gi_clash c;
  assert_int_equal(claim(in, 1, 3, &c), KVF_EBUSY);
  assert_true(c.b_start == 3 * 778 && c.b_end == 3 * 778 + 2);
  free(v);
}

/* The daemon's glue (kvf__xfer_claim): what a refused grant of blocks
 * says, and that an unclaimed grant's blocks are free again. */
static kvf__xfer *layout_grant(const char *id, const kvf__layout *l, const uint64_t *offsets, uint64_t stride,
                               const uint32_t *ids, size_t n, uint32_t first, uint32_t n_layers) {
  kvf__xfer *x = calloc(1, sizeof(*x));
  assert_non_null(x);
  snprintf(x->id, sizeof(x->id), "%s", id);
  x->role = KVF__RECV;
  x->blocks = true;
  x->mine.layout = (kvf__layout *)l;
  x->mine.view = (kvf__lview){.pool = 0, .n_kv = 2, .n_blocks = 16, .first_layer = first, .n_layers = n_layers,
                              .block_bytes = 4096, .block_stride = stride, .offsets = offsets + 2 * first};
  x->mine.ids = malloc((n ? n : 1) * sizeof(*ids));
  assert_non_null(x->mine.ids);
  memcpy(x->mine.ids, ids, n * sizeof(*ids));
  x->mine.n = n;
  return x;
}

static kvf__xfer *blocks_grant(const char *id, const uint64_t *offsets, const uint32_t *ids, size_t n,
                               uint32_t first, uint32_t n_layers) {
  return layout_grant(id, NULL, offsets, 4096, ids, n, first, n_layers);
}

static void drop_grant(kvf__xfer *x) {
  kvf__xfer_unclaim(x);
  free(x->mine.ids);
  free(x->dst.pool);
  free(x->dst.offset);
  free(x->dst.length);
  free(x);
}

static void test_xfer_blocks_messages(void **state) {
  uint64_t offsets[8]; /* 4 layers x K/V regions of 16 blocks */
  for (int r = 0; r < 8; r++) offsets[r] = (uint64_t)r * 16 * 4096;
  char err[256];
  uint32_t dup[] = {3, 5, 3};
  kvf__xfer *d = blocks_grant("dup", offsets, dup, 3, 0, 4);
  assert_int_equal(kvf__xfer_claim(d, err, sizeof(err)), KVF_EINVAL);
  assert_string_equal(err, "block id 3 appears twice in the grant (blocks 0 and 2): its bytes would be written twice");
  drop_grant(d);
  uint32_t a_ids[] = {1, 2, 3}, b_ids[] = {7, 3};
  kvf__xfer *a = blocks_grant("a", offsets, a_ids, 3, 0, 2);
  assert_int_equal(kvf__xfer_claim(a, err, sizeof(err)), 0);
  kvf__xfer *b = blocks_grant("b", offsets, b_ids, 2, 1, 1);
  assert_int_equal(kvf__xfer_claim(b, err, sizeof(err)), KVF_EBUSY);
  assert_non_null(strstr(err, "block id 3 of layer 1 (pool 0 ["));
  assert_non_null(strstr(err, "overlaps block id 3 of layer 1 ("));
  assert_non_null(strstr(err, "of the open grant 'a' (grant-overlap refuse)"));
  drop_grant(b);
  kvf__xfer *c = blocks_grant("c", offsets, b_ids, 2, 2, 2); /* the same ids, other layers */
  assert_int_equal(kvf__xfer_claim(c, err, sizeof(err)), 0);
  drop_grant(a);
  kvf__xfer *b2 = blocks_grant("b2", offsets, b_ids, 2, 1, 1); /* a is gone */
  assert_int_equal(kvf__xfer_claim(b2, err, sizeof(err)), 0);
  drop_grant(b2);
  drop_grant(c);
}

/* A grant of one descriptor: [start, start + len) of pool 0. */
static kvf__xfer *range_grant(const char *id, uint64_t start, uint64_t len) {
  kvf__xfer *x = calloc(1, sizeof(*x));
  assert_non_null(x);
  snprintf(x->id, sizeof(x->id), "%s", id);
  x->role = KVF__RECV;
  x->dst.pool = calloc(1, sizeof(uint32_t));
  x->dst.offset = malloc(sizeof(uint64_t));
  x->dst.length = malloc(sizeof(uint64_t));
  assert_true(x->dst.pool && x->dst.offset && x->dst.length);
  x->dst.offset[0] = start;
  x->dst.length[0] = len;
  x->dst.n = 1;
  x->dst.total = len;
  return x;
}

/* The pieces of a grant, from first principles (not items_of_blocks). */
static size_t pieces_of(const kvf__xfer *x, kvf__gi_item *out) {
  if (!x->blocks) {
    out[0] = it(0, x->dst.offset[0], x->dst.offset[0] + x->dst.length[0], 0);
    return 1;
  }
  const kvf__lview *v = &x->mine.view;
  size_t k = 0;
  for (uint32_t r = 0; r < v->n_layers * 2; r++)
    for (size_t i = 0; i < x->mine.n; i++) {
      uint64_t at = v->offsets[r] + x->mine.ids[i] * v->block_stride;
      out[k++] = it(0, at, at + v->block_bytes, 0);
    }
  return k;
}

/* Random grants of blocks of three layouts (B apart from A, C over A's
 * bytes in another order) and of single ranges, some released, with
 * grant-overlap switching between refuse and allow, against a model of
 * their pieces: each answer exact (a set made, joined, refused or spilled
 * into ranges when a range or an overlapping layout meets it), and once
 * every grant ended the whole pool can be granted again. */
static void test_xfer_block_sets_model(void **state) {
  enum { GRANTS = 700, MAXP = 8 * 5 };
  uint64_t off_a[8], off_b[8], off_c[8];
  for (int r = 0; r < 8; r++) {
    off_a[r] = (uint64_t)r * 16 * 4096;               /* layer-major: [0, 512 KiB) */
    off_b[r] = (1u << 20) + (uint64_t)r * 16 * 4096;  /* [1 MiB, 1.5 MiB) */
    off_c[r] = (uint64_t)r * 4096;                    /* block-major over A's bytes */
  }
  static const kvf__layout la, lb, lc;
  const kvf__layout *lays[] = {&la, &lb, &lc};
  const uint64_t *offs[] = {off_a, off_b, off_c};
  const uint64_t strides[] = {4096, 4096, 8 * 4096};
  static kvf__xfer *open[GRANTS];
  static kvf__gi_item mine[MAXP], theirs[MAXP];
  uint64_t seed = 23;
  int held_before = 0, refused = 0;
  for (int t = 0; t < GRANTS; t++) {
    bool refuse = lcg(&seed) % 4 != 0;
    kvfd.cfg.grant_overlap = refuse ? KVF__GRANT_OVERLAP_REFUSE : KVF__GRANT_OVERLAP_ALLOW;
    char id[16];
    snprintf(id, sizeof(id), "g%d", t);
    kvf__xfer *x;
    if (lcg(&seed) % 5 == 0) {
      uint64_t s = lcg(&seed) % (1600u << 10), len = 1 + lcg(&seed) % 20000;
      x = range_grant(id, s, len);
    } else {
      int w = (int)(lcg(&seed) % 3);
      uint32_t first = (uint32_t)(lcg(&seed) % 4), nl = 1 + (uint32_t)(lcg(&seed) % (4 - first)), ids[5];
      size_t n = 1 + lcg(&seed) % 5;
      for (size_t i = 0; i < n; i++) { /* distinct ids */
        ids[i] = (uint32_t)(lcg(&seed) % 16);
        for (size_t j = 0; j < i; j++)
          if (ids[j] == ids[i]) ids[i] = (ids[i] + 1) % 16, j = (size_t)-1;
      }
      x = layout_grant(id, lays[w], offs[w], strides[w], ids, n, first, nl);
    }
    size_t np = pieces_of(x, mine);
    bool clash = false;
    for (int o = 0; o < t && !clash; o++) {
      if (!open[o]) continue;
      size_t nt = pieces_of(open[o], theirs);
      for (size_t i = 0; i < np && !clash; i++)
        for (size_t j = 0; j < nt && !clash; j++) clash = share(&mine[i], &theirs[j]);
    }
    char err[256];
    int rc = kvf__xfer_claim(x, err, sizeof(err));
    if (refuse && clash) {
      assert_int_equal(rc, KVF_EBUSY);
      assert_non_null(strstr(err, "of the open grant 'g"));
      drop_grant(x);
      refused++;
    } else {
      assert_int_equal(rc, 0);
      open[t] = x;
      held_before++;
    }
    if (lcg(&seed) % 3 == 0) { /* one ends */
      int o = (int)(lcg(&seed) % (t + 1));
      if (open[o]) drop_grant(open[o]), open[o] = NULL;
    }
  }
  assert_true(held_before > GRANTS / 4 && refused > GRANTS / 4); /* the model saw both answers */
  for (int t = 0; t < GRANTS; t++)
    if (open[t]) drop_grant(open[t]), open[t] = NULL;
  kvfd.cfg.grant_overlap = KVF__GRANT_OVERLAP_REFUSE;
  kvf__xfer *whole = range_grant("whole", 0, 2u << 20); /* nothing left behind, in ranges or sets */
  assert_int_equal(kvf__xfer_claim(whole, NULL, 0), 0);
  drop_grant(whole);
  uint32_t all[16];
  for (uint32_t i = 0; i < 16; i++) all[i] = i;
  kvf__xfer *a = layout_grant("a", &la, off_a, 4096, all, 16, 0, 4), *c = layout_grant("c", &lc, off_c, 8 * 4096,
                                                                                          all, 1, 0, 1);
  assert_int_equal(kvf__xfer_claim(a, NULL, 0), 0);
  char err[256];
  assert_int_equal(kvf__xfer_claim(c, err, sizeof(err)), KVF_EBUSY); /* C's block 0 is A's blocks 0-7 of layer 0 */
  assert_non_null(strstr(err, "of the open grant 'a'"));
  drop_grant(c);
  drop_grant(a);
}

/* A set answers as ranges do: the same message for a block id taken. */
static void test_xfer_block_set_messages(void **state) {
  uint64_t offsets[8];
  for (int r = 0; r < 8; r++) offsets[r] = (uint64_t)r * 16 * 4096;
  static const kvf__layout l;
  char err[256];
  kvfd.cfg.grant_overlap = KVF__GRANT_OVERLAP_REFUSE;
  uint32_t a_ids[] = {1, 2, 3}, b_ids[] = {7, 3};
  kvf__xfer *a = layout_grant("a", &l, offsets, 4096, a_ids, 3, 1, 2);
  assert_int_equal(kvf__xfer_claim(a, err, sizeof(err)), 0);
  kvf__xfer *b = layout_grant("b", &l, offsets, 4096, b_ids, 2, 1, 2);
  assert_int_equal(kvf__xfer_claim(b, err, sizeof(err)), KVF_EBUSY);
  assert_string_equal(err, "block id 3 of layer 1 (pool 0 [143360, 147456)) overlaps block id 3 of layer 1 "
                           "([143360, 147456)) of the open grant 'a' (grant-overlap refuse)");
  drop_grant(b);
  kvf__xfer *r = range_grant("r", 2 * 16 * 4096 + 2 * 4096, 1); /* layer 1 K, block 2: the set is spilled */
  assert_int_equal(kvf__xfer_claim(r, err, sizeof(err)), KVF_EBUSY);
  assert_non_null(strstr(err, "overlaps block id 2 of layer 1 ("));
  assert_non_null(strstr(err, "of the open grant 'a' (grant-overlap refuse)"));
  drop_grant(r);
  kvf__xfer *b2 = layout_grant("b2", &l, offsets, 4096, b_ids, 1, 1, 2); /* block 7 alone: free */
  assert_int_equal(kvf__xfer_claim(b2, err, sizeof(err)), 0);
  drop_grant(a);
  drop_grant(b2);
}

int main(void) {
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
  const struct CMUnitTest tests[] = {
      T(test_touching_and_overlap), T(test_unsorted), T(test_zero_length), T(test_pools),
      T(test_adjacent_and_release), T(test_granule_edges), T(test_granule_remade), T(test_allow), T(test_random_model),
      T(test_random_mixed), T(test_dense_grant), cmocka_unit_test(test_xfer_blocks_messages),
      cmocka_unit_test(test_xfer_block_set_messages), cmocka_unit_test(test_xfer_block_sets_model),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
