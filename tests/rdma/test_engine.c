/* test_engine.c - engine memory over rdma through the library
 * (kvf_mem_register with a memfd), in the soft-RoCE VM (tests/rdma/run.sh):
 * each side registers memory of its own after the daemons started (the
 * rdma transport's pool_added registers it with the NIC; the peer learns
 * of it from the grants that name it), 8 MiB in 64 scattered 128 KiB
 * blocks from prefill to decode and back, every byte verified (and the
 * gaps between destinations untouched), then unregistered. Once with the
 * pools registered (path "rdma"), once with gpu-direct off on both
 * daemons (path "rdma-bounce", through 2 MiB of staging). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "harness.h"

#define KIB (1ull << 10)
#define MIB (1ull << 20)
#define REGION (16 * MIB)
#define N 64
#define BLOCK (128 * KIB)

static h_fixture E;
static bool up;
static const char *want_path;

static int pair_up(const char *conf, const char *path) {
  setenv("KVF_TEST_CONF_PREFILL", conf, 1);
  setenv("KVF_TEST_CONF_DECODE", conf, 1);
  unsetenv("KVF_TEST_POOL_PREFILL");
  unsetenv("KVF_TEST_POOL_DECODE");
  unsetenv("KVF_TEST_PATH");
  unsetenv("KVF_TEST_RECV_PATH");
  want_path = path;
  if (h_fixture_start(&E, "64M")) return -1;
  up = true;
  return 0;
}

static int setup_direct(void **state) { return pair_up("", "rdma"); }
static int setup_bounce(void **state) { return pair_up("gpu-direct off;rdma-bounce-size 2M", "rdma-bounce"); }
static int teardown(void **state) {
  if (!up) return 0;
  up = false;
  return h_fixture_stop(&E);
}

typedef struct region {
  int fd;
  uint8_t *p;
  uint32_t pool;
} region;

static void region_new(region *r, h_client *hc, const char *name) {
  r->fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  assert_true(r->fd >= 0);
  assert_int_equal(ftruncate(r->fd, REGION), 0);
  r->p = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
  assert_true(r->p != MAP_FAILED);
  kvf_mem m = {.kind = KVF_MEM_HOST, .addr = r->p, .size = REGION, .fd = r->fd, .name = name};
  H_OK(kvf_mem_register(hc->c, &m, &r->pool));
}

static void region_free(region *r, h_client *hc) {
  H_OK(kvf_mem_unregister(hc->c, r->pool));
  munmap(r->p, REGION);
  close(r->fd);
}

static void expect_ok(h_client *hc, const char *id, int type) {
  kvf_event ev;
  H_OK(h_wait_event(hc, id, type, 60000, &ev));
  H_OK(h_check_event(&ev, type, want_path, NULL, N * BLOCK, N));
}

/* N blocks of snd's region to scattered blocks of rcv's, verified. */
static void one_way(h_client *snd, region *src, h_client *rcv, region *dst, const char *tag, uint64_t seed) {
  kvf_desc s[N], d[N];
  char id[64];
  h_id(id, sizeof id, tag);
  h_layout(s, N, src->pool, 0, BLOCK, true, seed);
  h_layout(d, N, dst->pool, 0, BLOCK, true, seed + 1);
  for (size_t i = 0; i < N; i++) h_fill(src->p + s[i].offset, BLOCK, seed, i);
  h_poison(dst->p, REGION);
  H_OK(kvf_grant(rcv->c, id, snd->node, d, N, 60000));
  H_OK(kvf_send(snd->c, id, rcv->node, s, N, 0, 60000));
  expect_ok(rcv, id, KVF_EV_RECV_DONE);
  expect_ok(snd, id, KVF_EV_SEND_DONE);
  uint64_t left = REGION;
  for (size_t i = 0; i < N; i++) {
    int64_t bad = h_verify(dst->p + d[i].offset, BLOCK, seed, i);
    if (bad >= 0) fail_msg("%s: block %zu differs at byte %lld", id, i, (long long)bad);
    left -= BLOCK;
  }
  /* nothing outside the destinations: the rest of the region is poison */
  uint64_t poison = 0;
  for (uint64_t off = 0; off < REGION; off += BLOCK) {
    bool used = false;
    for (size_t i = 0; i < N && !used; i++) used = d[i].offset == off;
    if (!used) {
      if (h_verify_poison(dst->p + off, BLOCK) >= 0) fail_msg("%s: a write outside the grant at %llu", id,
                                                              (unsigned long long)off);
      poison += BLOCK;
    }
  }
  assert_int_equal(poison, left);
}

static void test_both_directions(void **state) {
  region a, b;
  region_new(&a, &E.pre, "kvf-engine-a");
  region_new(&b, &E.dec, "kvf-engine-b");
  one_way(&E.pre, &a, &E.dec, &b, "eng-fwd", 501);
  one_way(&E.dec, &b, &E.pre, &a, "eng-back", 601);
  region_free(&a, &E.pre);
  region_free(&b, &E.dec);
  /* the same slots again, with new memory behind them */
  region_new(&a, &E.pre, "kvf-engine-c");
  region_new(&b, &E.dec, "kvf-engine-d");
  one_way(&E.pre, &a, &E.dec, &b, "eng-again", 701);
  region_free(&a, &E.pre);
  region_free(&b, &E.dec);
}

int main(void) {
  h_init();
  const struct CMUnitTest t[] = {cmocka_unit_test(test_both_directions)};
  int failed = cmocka_run_group_tests_name("engine memory over rdma", t, setup_direct, teardown);
  failed += cmocka_run_group_tests_name("engine memory over rdma-bounce", t, setup_bounce, teardown);
  return h_cleanup(failed);
}
