/* test_engine_mem.c - engine memory through libkvferry (kvf_mem_register),
 * two real daemons over tcp: memfd regions at both ends (one found by the
 * library from /proc/self/maps, one handed over by fd at a file offset),
 * memory with no file refused with KVF_EINVAL before anything reaches the
 * daemon, and an engine whose daemon is killed and restarted: the library
 * reconnects by itself, registers the same memory again, and what was in
 * it before the restart is sent after it, with the pool id the engine
 * held. Every transfer verifies every byte. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "harness.h"

#define MIB (1024u * 1024u)
#define REGION (16 * MIB)
#define N 64

H_FIXTURE_GROUP(E, "16M")

/* A memfd of size bytes mapped shared; *fd stays open. */
static uint8_t *memfd_region(const char *name, uint64_t size, int *fd) {
  *fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (*fd < 0 || ftruncate(*fd, (off_t)size) != 0) return NULL;
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  return p == MAP_FAILED ? NULL : p;
}

/* An engine region standing in for a client's pool "kv" in the harness's
 * helpers (which address hc->base + offset in pool hc->pool). */
typedef struct region {
  uint8_t *base;
  uint64_t size;
  uint32_t pool;
  int fd;
  uint32_t saved_pool;
  uint8_t *saved_base;
  uint64_t saved_size;
} region;

static void use_region(h_client *hc, region *r) {
  r->saved_pool = hc->pool;
  r->saved_base = hc->base;
  r->saved_size = hc->size;
  hc->pool = r->pool;
  hc->base = r->base;
  hc->size = r->size;
}

static void restore_pool(h_client *hc, const region *r) {
  hc->pool = r->saved_pool;
  hc->base = r->saved_base;
  hc->size = r->saved_size;
}

static int pools_now(kvf_client *c) { return kvf_pools(c, NULL, 0); }

static void test_memfd_at_both_ends(void **state) {
  region a = {0}, b = {0};
  /* prefill: the library finds the file (fd -1). */
  assert_non_null(a.base = memfd_region("engine-src", REGION, &a.fd));
  a.size = REGION;
  kvf_mem m = {.kind = KVF_MEM_HOST, .addr = a.base, .size = a.size, .fd = -1, .name = "src-mem"};
  H_OK(h_expect_rc(kvf_mem_register(E.pre.c, &m, &a.pool), 0, "register src"));
  /* decode: by fd, the region at file offset 1 MiB. */
  int bfd;
  uint8_t *whole = memfd_region("engine-dst", REGION + MIB, &bfd);
  assert_non_null(whole);
  b = (region){.base = whole + MIB, .size = REGION, .fd = bfd};
  m = (kvf_mem){.kind = KVF_MEM_HOST, .addr = b.base, .size = b.size, .fd = bfd, .fd_offset = MIB};
  H_OK(h_expect_rc(kvf_mem_register(E.dec.c, &m, &b.pool), 0, "register dst"));
  kvf_pool_info info;
  H_OK(h_expect_rc(kvf_pool_find(E.pre.c, "src-mem", &info), 0, "find src-mem"));
  assert_int_equal(info.id, a.pool);
  assert_true(info.engine);
  assert_string_equal(info.kind, "host");

  kvf_desc src[N], dst[N];
  h_layout(src, N, a.pool, 0, 64 * 1024, true, 1);
  h_layout(dst, N, b.pool, 4096, 64 * 1024, true, 2);
  char id[64];
  h_id(id, sizeof id, "engine-tcp");
  h_xfer x = {.id = id, .src = src, .nsrc = N, .dst = dst, .ndst = N, .parts = 3, .seed = 3};
  use_region(&E.pre, &a);
  use_region(&E.dec, &b);
  int rc = h_transfer(&E.pre, &E.dec, &x);
  restore_pool(&E.pre, &a);
  restore_pool(&E.dec, &b);
  H_OK(rc);
  H_OK(h_expect_rc(kvf_mem_unregister(E.pre.c, a.pool), 0, "unregister src"));
  H_OK(h_expect_rc(kvf_mem_unregister(E.dec.c, b.pool), 0, "unregister dst"));
  munmap(a.base, REGION);
  munmap(whole, REGION + MIB);
  close(a.fd);
  close(bfd);
}

static void refused(void *addr, uint64_t size, const char *what) {
  int before = pools_now(E.pre.c);
  uint32_t pool;
  kvf_mem m = {.kind = KVF_MEM_HOST, .addr = addr, .size = size, .fd = -1};
  int rc = kvf_mem_register(E.pre.c, &m, &pool);
  if (rc != KVF_EINVAL) fail_msg("%s: kvf_mem_register gave %s, expected KVF_EINVAL", what, kvf_err_name(rc));
  assert_int_equal(pools_now(E.pre.c), before);
}

static void test_unshareable_memory_refused(void **state) {
  void *heap = malloc(MIB);
  assert_non_null(heap);
  refused(heap, MIB, "malloc");
  free(heap);
  void *anon = mmap(NULL, MIB, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  assert_true(anon != MAP_FAILED);
  refused(anon, MIB, "MAP_SHARED|MAP_ANONYMOUS");
  munmap(anon, MIB);
  int fd = memfd_create("private", MFD_CLOEXEC);
  assert_true(fd >= 0 && ftruncate(fd, 2 * MIB) == 0);
  void *priv = mmap(NULL, MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  assert_true(priv != MAP_FAILED);
  refused(priv, MIB, "MAP_PRIVATE of a memfd");
  munmap(priv, MIB);
  /* A shared mapping, but the range runs past it. */
  void *shared = mmap(NULL, MIB, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  assert_true(shared != MAP_FAILED);
  refused(shared, 2 * MIB, "a range past its mapping");
  munmap(shared, MIB);
  close(fd);
}

/* Waits until the client's calls are taken again (it reconnects by
 * itself); polls, bounded. */
static int wait_reconnected(kvf_client *c, int timeout_ms) {
  uint64_t end = h_now_ms() + (uint64_t)timeout_ms;
  int rc;
  while ((rc = pools_now(c)) == KVF_EDAEMON && h_left_ms(end) > 0) h_sleep_ms(2);
  return rc >= 0 ? 0 : h_fail("the client did not reconnect: %s", kvf_err_name(rc));
}

static void test_restart_keeps_engine_memory(void **state) {
  region a = {0};
  assert_non_null(a.base = memfd_region("engine-kept", REGION, &a.fd));
  a.size = REGION;
  kvf_mem m = {.kind = KVF_MEM_HOST, .addr = a.base, .size = a.size, .fd = -1, .name = "kept"};
  H_OK(h_expect_rc(kvf_mem_register(E.pre.c, &m, &a.pool), 0, "register"));
  close(a.fd); /* the library keeps its own descriptor of the file */
  kvf_desc src[N], dst[N];
  h_layout(src, N, a.pool, 0, 32 * 1024, true, 7);
  h_layout(dst, N, E.dec.pool, 0, 32 * 1024, true, 8);
  char id[64];
  h_id(id, sizeof id, "kept");
  h_xfer x = {.id = id, .src = src, .nsrc = N, .dst = dst, .ndst = N, .seed = 9};
  use_region(&E.pre, &a);
  H_OK(h_prepare(&E.pre, &E.dec, &x)); /* the "KV cache", written once */

  H_OK(h_daemon_kill9(&E.p.prefill));
  H_OK(h_daemon_spawn(&E.p.prefill));
  H_OK(h_pair_wait_up(&E.p));
  H_OK(wait_reconnected(E.pre.c, 10000));
  kvf_pool_info info;
  H_OK(h_expect_rc(kvf_pool_find(E.pre.c, "kept", &info), 0, "find kept"));
  assert_int_equal(info.id, a.pool); /* the id the engine holds */
  assert_true(info.engine);

  /* Nothing written again: what goes is what was there before. */
  H_OK(h_post_grant(&E.dec, &x, "prefill"));
  H_OK(h_post_send(&E.pre, &x, "decode"));
  kvf_event ev;
  H_OK(h_wait_event(&E.dec, id, KVF_EV_RECV_DONE, H_XFER_MS, &ev));
  H_OK(h_check_event(&ev, KVF_EV_RECV_DONE, "tcp", "prefill", h_desc_bytes(dst, N), N));
  H_OK(h_wait_event(&E.pre, id, KVF_EV_SEND_DONE, H_XFER_MS, &ev));
  H_OK(h_check_event(&ev, KVF_EV_SEND_DONE, "tcp", "decode", h_desc_bytes(src, N), N));
  H_OK(h_verify_dst(&E.dec, &x));
  restore_pool(&E.pre, &a);
  /* The daemon pool "kv" came back too, mapped where it was. */
  H_OK(h_quick(&E.pre, &E.dec));
  H_OK(h_expect_rc(kvf_mem_unregister(E.pre.c, a.pool), 0, "unregister"));
  munmap(a.base, REGION);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_memfd_at_both_ends),
      cmocka_unit_test(test_unshareable_memory_refused),
      cmocka_unit_test(test_restart_keeps_engine_memory),
  };
  h_init();
  return h_cleanup(cmocka_run_group_tests_name("engine memory", tests, group_setup, group_teardown));
}
