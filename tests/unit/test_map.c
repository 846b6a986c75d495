/* test_map.c - the string-keyed hash map (daemon/map.c): put/get/del,
 * duplicates, growth to 100k keys, and deleting the current entry while
 * walking the buckets (the pattern xfer.c's sweep uses). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "map.h"

/* Distinct, stable values to store. */
static int vals[8];

static void test_empty(void **state) {
  kvf__map m = {0};
  assert_null(kvf__map_get(&m, "nope"));
  assert_null(kvf__map_del(&m, "nope"));
  assert_int_equal(m.n, 0);
  kvf__map_free(&m);
  kvf__map_free(&m); /* freeing twice is harmless: free zeroes the map */
  assert_null(m.b);
  assert_int_equal(m.nb, 0);
}

static void test_put_get_del(void **state) {
  kvf__map m = {0};
  assert_int_equal(kvf__map_put(&m, "a", &vals[0]), 0);
  assert_int_equal(kvf__map_put(&m, "b", &vals[1]), 0);
  assert_int_equal(kvf__map_put(&m, "", &vals[2]), 0); /* empty key is a key */
  assert_int_equal(m.n, 3);
  assert_ptr_equal(kvf__map_get(&m, "a"), &vals[0]);
  assert_ptr_equal(kvf__map_get(&m, "b"), &vals[1]);
  assert_ptr_equal(kvf__map_get(&m, ""), &vals[2]);
  assert_null(kvf__map_get(&m, "c"));
  assert_null(kvf__map_get(&m, "ab"));

  /* Keys are copied: the caller's buffer may change afterwards. */
  char buf[16] = "key";
  assert_int_equal(kvf__map_put(&m, buf, &vals[3]), 0);
  strcpy(buf, "xxx");
  assert_ptr_equal(kvf__map_get(&m, "key"), &vals[3]);
  assert_null(kvf__map_get(&m, "xxx"));

  assert_ptr_equal(kvf__map_del(&m, "a"), &vals[0]);
  assert_null(kvf__map_get(&m, "a"));
  assert_null(kvf__map_del(&m, "a"));
  assert_int_equal(m.n, 3);
  assert_ptr_equal(kvf__map_get(&m, "b"), &vals[1]);

  /* Re-put after delete works. */
  assert_int_equal(kvf__map_put(&m, "a", &vals[4]), 0);
  assert_ptr_equal(kvf__map_get(&m, "a"), &vals[4]);
  /* NULL is a storable value; get then cannot tell it from absence, del
   * still removes it. */
  assert_int_equal(kvf__map_put(&m, "null", NULL), 0);
  assert_int_equal(m.n, 5);
  assert_null(kvf__map_del(&m, "null"));
  assert_int_equal(m.n, 4);
  kvf__map_free(&m);
  assert_int_equal(m.n, 0);
}

static void test_duplicate(void **state) {
  kvf__map m = {0};
  assert_int_equal(kvf__map_put(&m, "dup", &vals[0]), 0);
  assert_int_equal(kvf__map_put(&m, "dup", &vals[1]), -EEXIST);
  assert_int_equal(m.n, 1);
  /* The first value stays. */
  assert_ptr_equal(kvf__map_get(&m, "dup"), &vals[0]);
  assert_ptr_equal(kvf__map_del(&m, "dup"), &vals[0]);
  assert_int_equal(kvf__map_put(&m, "dup", &vals[1]), 0);
  assert_ptr_equal(kvf__map_get(&m, "dup"), &vals[1]);
  kvf__map_free(&m);
}

/* Keys that share a prefix and keys containing the separator byte xfer.c
 * uses for composite keys. */
static void test_similar_keys(void **state) {
  kvf__map m = {0};
  assert_int_equal(kvf__map_put(&m, "peer\x1fid", &vals[0]), 0);
  assert_int_equal(kvf__map_put(&m, "peer\x1fid2", &vals[1]), 0);
  assert_int_equal(kvf__map_put(&m, "peer", &vals[2]), 0);
  assert_ptr_equal(kvf__map_get(&m, "peer\x1fid"), &vals[0]);
  assert_ptr_equal(kvf__map_get(&m, "peer\x1fid2"), &vals[1]);
  assert_ptr_equal(kvf__map_get(&m, "peer"), &vals[2]);
  assert_null(kvf__map_get(&m, "peer\x1f"));
  kvf__map_free(&m);
}

#define BIG 100000

static void test_growth(void **state) {
  kvf__map m = {0};
  char key[32];
  for (uintptr_t i = 0; i < BIG; i++) {
    snprintf(key, sizeof key, "k%lu", (unsigned long)i);
    assert_int_equal(kvf__map_put(&m, key, (void *)(i + 1)), 0);
  }
  assert_int_equal(m.n, BIG);
  /* Power of two, load factor at most 3/4. */
  assert_int_equal(m.nb & (m.nb - 1), 0);
  assert_true(m.n <= m.nb * 3 / 4);
  for (uintptr_t i = 0; i < BIG; i++) {
    snprintf(key, sizeof key, "k%lu", (unsigned long)i);
    assert_ptr_equal(kvf__map_get(&m, key), (void *)(i + 1));
  }
  snprintf(key, sizeof key, "k%d", BIG);
  assert_null(kvf__map_get(&m, key));
  /* Every entry sits in the bucket its hash names: count by walking. */
  size_t walked = 0;
  for (size_t b = 0; b < m.nb; b++)
    for (kvf__map_ent *e = m.b[b]; e; e = e->next) walked++;
  assert_int_equal(walked, BIG);
  /* Duplicates still refused after growth. */
  assert_int_equal(kvf__map_put(&m, "k77777", NULL), -EEXIST);
  /* Delete the odd ones. */
  for (uintptr_t i = 1; i < BIG; i += 2) {
    snprintf(key, sizeof key, "k%lu", (unsigned long)i);
    assert_ptr_equal(kvf__map_del(&m, key), (void *)(i + 1));
  }
  assert_int_equal(m.n, BIG / 2);
  for (uintptr_t i = 0; i < BIG; i++) {
    snprintf(key, sizeof key, "k%lu", (unsigned long)i);
    if (i % 2) assert_null(kvf__map_get(&m, key));
    else assert_ptr_equal(kvf__map_get(&m, key), (void *)(i + 1));
  }
  kvf__map_free(&m);
}

/* xfer.c's sweep_tables: for each bucket, remember next, maybe delete the
 * current entry by its own key (whose storage del frees), move on. */
static void test_delete_while_walking(void **state) {
  kvf__map m = {0};
  char key[32];
  const uintptr_t n = 5000;
  for (uintptr_t i = 0; i < n; i++) {
    snprintf(key, sizeof key, "w%lu", (unsigned long)i);
    assert_int_equal(kvf__map_put(&m, key, (void *)i), 0);
  }
  size_t nb_before = m.nb;
  size_t seen = 0, deleted = 0;
  for (size_t b = 0; b < m.nb; b++) {
    kvf__map_ent *e = m.b[b];
    while (e) {
      kvf__map_ent *next = e->next;
      seen++;
      if ((uintptr_t)e->val % 3 == 0) {
        void *v = kvf__map_del(&m, e->key);
        assert_true((uintptr_t)v % 3 == 0);
        deleted++;
      }
      e = next;
    }
  }
  assert_int_equal(seen, n);              /* every entry visited exactly once */
  assert_int_equal(deleted, (n + 2) / 3); /* 0, 3, 6, ... */
  assert_int_equal(m.n, n - deleted);
  assert_int_equal(m.nb, nb_before);      /* del never rehashes */
  for (uintptr_t i = 0; i < n; i++) {
    snprintf(key, sizeof key, "w%lu", (unsigned long)i);
    if (i % 3 == 0) assert_null(kvf__map_get(&m, key));
    else assert_ptr_equal(kvf__map_get(&m, key), (void *)i);
  }
  /* Delete everything the same way. */
  for (size_t b = 0; b < m.nb; b++) {
    kvf__map_ent *e = m.b[b];
    while (e) {
      kvf__map_ent *next = e->next;
      kvf__map_del(&m, e->key);
      e = next;
    }
  }
  assert_int_equal(m.n, 0);
  for (size_t b = 0; b < m.nb; b++) assert_null(m.b[b]);
  kvf__map_free(&m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_empty),
      cmocka_unit_test(test_put_get_del),
      cmocka_unit_test(test_duplicate),
      cmocka_unit_test(test_similar_keys),
      cmocka_unit_test(test_growth),
      cmocka_unit_test(test_delete_while_walking),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
