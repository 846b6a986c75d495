/* test_rdma.c - what only the rdma transport has, against real kvferryd
 * daemons in the soft-RoCE VM (tests/rdma/run.sh sets it up; make
 * check-rdma): a 100k-descriptor transfer, striping over two devices per
 * node, a link taken down mid-transfer (one rail, then the second of two),
 * the receiving or the sending daemon killed mid-transfer, and a pair with
 * a cluster key (proofs in the CM private data). Every
 * transfer that succeeds has every byte verified (harness h_transfer); every
 * failure must be KVF_EPEERLOST well before the transfer's deadline, and the
 * peers must carry verified transfers again afterwards.
 *
 * Environment (from run.sh): KVF_TEST_TRANSPORT=rdma, KVF_TEST_RDMA_IPS,
 * KVF_TEST_LINK (the netdev of node 1's first device, e.g. n1),
 * KVF_TEST_RAIL2_DEVICES ("rxe0,rxe2 rxe1,rxe3": two devices per node) and
 * KVF_TEST_LINK2 (the netdev of node 1's second device). Cases whose
 * environment is missing are skipped. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "harness.h"

#define KIB (1ull << 10)
#define MIB (1ull << 20)
#define FAIL_MS 10000      /* a lost path must fail transfers within this */
#define DEADLINE_MS 120000 /* ...long before their deadline */
#define READY_MS 30000

static h_fixture E;
static bool up; /* E is started */

/* ---------------------------------------------------------------- status */

/* Waits until both daemons have want QPs, all connected (control up is not
 * enough: the QPs connect after the Hello). */
static int wait_qps(size_t want, int ms, bool quiet) {
  uint64_t end = h_now_ms() + (uint64_t)ms;
  size_t a1 = 0, c1 = 0, a2 = 0, c2 = 0;
  while (h_now_ms() < end) {
    if (h_rdma_qps(&E.pre, &a1, &c1) || h_rdma_qps(&E.dec, &a2, &c2)) return -1;
    if (c1 >= want && c2 >= want && (quiet || (a1 == want && a2 == want))) return 0;
    h_sleep_ms(50);
  }
  if (quiet) return -1;
  return h_fail("rdma QPs not ready after %d ms: prefill %zu/%zu, decode %zu/%zu connected, want %zu", ms,
                c1, a1, c2, a2, want);
}

static int wait_rdma_ready(size_t want) { return wait_qps(want, READY_MS, false); }

/* A dead peer leaves no QP behind: once its daemon is seen gone (at most a
 * heartbeat timeout), the status lists none. */
static int wait_no_qps(h_client *hc, size_t *all) {
  size_t connected = 0;
  uint64_t end = h_now_ms() + 5000;
  do {
    if (h_rdma_qps(hc, all, &connected)) return -1;
    if (*all == 0) return 0;
    h_sleep_ms(50);
  } while (h_now_ms() < end);
  return h_fail("%s keeps %zu QPs of a dead peer", hc->node, *all);
}

/* A number inside the "rdma" object of the status: path like "post.last_build_ns_per_wr". */
static double rdma_number(h_client *hc, const char *obj, const char *key) {
  char *json = NULL;
  double v = -1;
  if (h_inspect(hc->c, KVF_INSPECT_STATUS, &json)) return -1;
  const char *r = hj_get(json, "rdma"), *o = r ? hj_get(r, obj) : NULL, *k = o ? hj_get(o, key) : NULL;
  if (k) v = strtod(k, NULL);
  free(json);
  return v;
}

/* Work requests each device of a daemon posted, in status order. */
static int device_wrs(h_client *hc, uint64_t *wrs, size_t cap, size_t *n) {
  char *json = NULL;
  *n = 0;
  if (h_inspect(hc->c, KVF_INSPECT_STATUS, &json)) return -1;
  const char *r = hj_get(json, "rdma"), *devs = r ? hj_get(r, "devices") : NULL, *d;
  if (devs && *devs != '[') devs = NULL;
  while (devs && *n < cap && (d = hj_next(&devs)))
    if (hj_u64(d, "work_requests", &wrs[(*n)++])) break;
  free(json);
  return *n ? 0 : h_fail("%s: no rdma devices in status", hc->node);
}

/* ---------------------------------------------------------------- setup */

static int qps_per_pair(size_t devices) { return (int)(devices * 4); } /* 2 dialed + 2 accepted */

static int pair_up(const char *devices, size_t ndev) {
  if (devices) setenv("KVF_TEST_RDMA_DEVICES", devices, 1);
  else unsetenv("KVF_TEST_RDMA_DEVICES");
  if (h_fixture_start(&E, "512M")) return -1;
  up = true;
  return wait_rdma_ready((size_t)qps_per_pair(ndev));
}

static int pair_down(void) {
  if (!up) return 0;
  up = false;
  return h_fixture_stop(&E);
}

static int setup_one(void **state) { return pair_up(NULL, 1); }
static int setup_two(void **state) {
  const char *devs = getenv("KVF_TEST_RAIL2_DEVICES");
  if (!devs) return 0; /* the cases skip */
  return pair_up(devs, 2);
}
static int teardown(void **state) { return pair_down(); }

/* ---------------------------------------------------------------- helpers */

/* n blocks of len, scattered on both sides; a fresh seed per call. */
static void verified(const char *tag, size_t n, uint64_t len, uint64_t seed) {
  H_OK(h_scattered(&E, tag, n, len, 0, seed, 180000));
}

static int expect_lost(h_client *hc, const char *id, int type, uint64_t t0) {
  kvf_event ev;
  if (h_wait_event(hc, id, type, FAIL_MS, &ev)) return -1;
  if (ev.status != KVF_EPEERLOST)
    return h_fail("%s: %s ended with %s (%s), expected KVF_EPEERLOST", hc->node, id,
                  kvf_err_name(ev.status), ev.error);
  fprintf(stderr, "note: %s: %s failed with KVF_EPEERLOST after %llu ms: %s\n", hc->node, id,
          (unsigned long long)(h_now_ms() - t0), ev.error);
  return 0;
}

/* A transfer long enough to be interrupted: 256 MiB in scattered 64 KiB
 * blocks (no coalescing: big contiguous writes are much faster). */
#define BIG_N 4096
typedef struct big {
  kvf_desc src[BIG_N], dst[BIG_N];
  char id[64];
  h_xfer x;
} big;

static void start_big(big *b, const char *tag) {
  h_id(b->id, sizeof b->id, tag);
  h_layout(b->src, BIG_N, E.pre.pool, 0, 64 * KIB, true, 71);
  h_layout(b->dst, BIG_N, E.dec.pool, 0, 64 * KIB, true, 72);
  b->x = (h_xfer){.id = b->id, .src = b->src, .nsrc = BIG_N, .dst = b->dst, .ndst = BIG_N,
                  .deadline_ms = DEADLINE_MS, .seed = 77};
  H_OK(h_prepare(&E.pre, &E.dec, &b->x));
  H_OK(h_post_grant(&E.dec, &b->x, "prefill"));
  H_OK(h_post_send(&E.pre, &b->x, "decode"));
  /* Into the data: prefill has posted a sixteenth of it. */
  H_OK(h_wait_xfer_bytes(E.pre.c, b->id, (uint64_t)BIG_N * 64 * KIB / 16, 10000));
}

/* KVF_TEST_LINK_CTL DEV up|down (run.sh's, which also restores the policy
 * routes a link loses when it goes down), else plain ip link. */
static void ip_link(const char *dev, const char *state) {
  char cmd[256];
  const char *ctl = getenv("KVF_TEST_LINK_CTL");
  if (ctl) snprintf(cmd, sizeof cmd, "%s %s %s", ctl, dev, state);
  else snprintf(cmd, sizeof cmd, "ip link set %s %s", dev, state);
  if (system(cmd) != 0) fail_msg("'%s' failed", cmd);
}

/* The link goes down mid-transfer: both sides fail with KVF_EPEERLOST long
 * before the deadline; after the link is back the peers reconnect their QPs
 * and carry verified transfers. */
static void link_down_case(const char *link, size_t ndev, const char *tag) {
  static big b;
  start_big(&b, tag);
  uint64_t t0 = h_now_ms();
  ip_link(link, "down");
  int rc = expect_lost(&E.pre, b.id, KVF_EV_SEND_DONE, t0);
  if (rc == 0) rc = expect_lost(&E.dec, b.id, KVF_EV_RECV_DONE, t0);
  ip_link(link, "up");
  H_OK(rc);
  H_OK(h_pair_wait_up(&E.p));
  /* With two rails, the one that went down may stay down (rxe on Linux 6.1
   * sometimes stops taking packets on a device whose netdev flapped while
   * the other rail was busy): the peer must then carry on over the first
   * rail, and the transfers still succeed. */
  if (ndev > 1 && wait_qps((size_t)qps_per_pair(ndev), READY_MS, true) != 0) {
    H_OK(wait_qps((size_t)qps_per_pair(1), 5000, true) == 0
             ? 0
             : h_fail("not even the first rail's QPs connected after the second rail's flap"));
    fprintf(stderr, "note: the flapped rail did not reconnect; transfers go over the other one\n");
  } else if (ndev == 1) {
    H_OK(wait_rdma_ready((size_t)qps_per_pair(ndev)));
  }
  verified("after-link", 2048, 32 * KIB, 901);
  H_OK(h_quick(&E.pre, &E.dec));
}

/* ---------------------------------------------------------------- cases */

/* One transfer of 100,000 scattered 1 KiB descriptors; prints the posting
 * cost per work request the daemon measured. */
static void test_100k_descriptors(void **state) {
  verified("100k", 100000, 1 * KIB, 301);
  double loop = rdma_number(&E.pre, "post", "last_loop_ns_per_wr");
  double build = rdma_number(&E.pre, "post", "last_build_ns_per_wr");
  double bell = rdma_number(&E.pre, "post", "last_doorbell_ns_per_wr");
  double wrs = rdma_number(&E.pre, "post", "last_work_requests");
  fprintf(stderr, "note: 100k descriptors: %.0f work requests; posting cost %.1f ns/descriptor "
                  "(loop %.1f + build %.1f); ibv_post_send %.1f ns/descriptor\n",
          wrs, loop + build, loop, build, bell);
  /* a request a descriptor, but for the few whose destination slot happens
   * to follow the one before (the sender gathers those: rdma_post.c) */
  assert_true(wrs > 99000 && wrs <= 100000);
}

/* Memory windows: a grant of 16384 separate 4 KiB ranges (every other
 * slot) gets 16384 windows, rdma-mw-max-windows' default, bound before the
 * Grant goes; prints what binding them cost. The daemons leave no window
 * behind. */
static void test_16k_windows(void **state) {
  enum { NW = 16384 };
  static kvf_desc src[NW], dst[NW];
  char id[64];
  if (rdma_number(&E.dec, "memory_windows", "live") < 0) fail_msg("decode's status has no memory_windows");
  for (size_t i = 0; i < NW; i++) {
    src[i] = (kvf_desc){.pool = E.pre.pool, .offset = i * 4 * KIB, .len = 4 * KIB};
    dst[i] = (kvf_desc){.pool = E.dec.pool, .offset = 64 * MIB + i * 8 * KIB, .len = 4 * KIB};
  }
  h_id(id, sizeof id, "16k-windows");
  h_xfer x = {.id = id, .src = src, .nsrc = NW, .dst = dst, .ndst = NW, .seed = 303, .timeout_ms = 180000};
  uint64_t t0 = h_now_ms();
  H_OK(h_transfer(&E.pre, &E.dec, &x));
  double wins = rdma_number(&E.dec, "memory_windows", "last_grant_windows");
  double ms = rdma_number(&E.dec, "memory_windows", "last_bind_ms");
  fprintf(stderr, "note: 16384 separate ranges: %.0f memory windows bound in %.1f ms (%.0f binds/s); "
                  "the transfer took %llu ms\n", wins, ms, ms > 0 ? wins / ms * 1000 : 0,
          (unsigned long long)(h_now_ms() - t0));
  char *json = NULL;
  H_OK(h_inspect(E.dec.c, KVF_INSPECT_STATUS, &json));
  const char *r = hj_get(json, "rdma"), *mw = r ? hj_get(r, "memory_windows") : NULL;
  const char *use = mw ? hj_get(mw, "in_use") : NULL;
  bool on = use && !strncmp(use, "true", 4);
  free(json);
  if (on) assert_int_equal((int)wins, NW);
  assert_true(rdma_number(&E.dec, "memory_windows", "live") == 0);
}

/* Big single descriptors are sliced (rdma-slice) so they too use every QP. */
static void test_large_descriptors(void **state) { verified("large", 8, 24 * MIB + 4096, 302); }

static void test_link_down_mid_transfer(void **state) {
  const char *link = getenv("KVF_TEST_LINK");
  if (!link) skip();
  link_down_case(link, 1, "link-down");
}

/* The receiving daemon dies mid-transfer: the sender fails with
 * KVF_EPEERLOST, keeps no QP of it, and transfers again once it is back. */
static void test_receiver_killed(void **state) {
  static big b;
  size_t all = 0;
  start_big(&b, "rx-killed");
  uint64_t t0 = h_now_ms();
  H_OK(h_daemon_kill9(&E.p.decode));
  H_OK(expect_lost(&E.pre, b.id, KVF_EV_SEND_DONE, t0));
  H_OK(wait_no_qps(&E.pre, &all));
  h_client_close(&E.dec);
  H_OK(h_daemon_spawn(&E.p.decode));
  H_OK(h_pair_wait_up(&E.p));
  H_OK(h_client_open(&E.dec, &E.p.decode));
  H_OK(wait_rdma_ready(4));
  verified("after-rx-kill", 2048, 32 * KIB, 902);
}

static void test_sender_killed(void **state) {
  static big b;
  size_t all = 0;
  start_big(&b, "tx-killed");
  uint64_t t0 = h_now_ms();
  H_OK(h_daemon_kill9(&E.p.prefill));
  H_OK(expect_lost(&E.dec, b.id, KVF_EV_RECV_DONE, t0));
  H_OK(wait_no_qps(&E.dec, &all));
  /* nor any memory window of its grants */
  assert_true(rdma_number(&E.dec, "memory_windows", "live") == 0);
  h_client_close(&E.pre);
  H_OK(h_daemon_spawn(&E.p.prefill));
  H_OK(h_pair_wait_up(&E.p));
  H_OK(h_client_open(&E.pre, &E.p.prefill));
  H_OK(wait_rdma_ready(4));
  verified("after-tx-kill", 2048, 32 * KIB, 903);
}

/* Two devices per node: a transfer is striped over both. */
static void test_two_devices_striping(void **state) {
  uint64_t before[2] = {0}, after[2] = {0};
  size_t n = 0;
  if (!getenv("KVF_TEST_RAIL2_DEVICES")) skip();
  H_OK(device_wrs(&E.pre, before, 2, &n));
  assert_int_equal(n, 2);
  verified("striped", 4096, 32 * KIB, 401);      /* 128 MiB of 32 KiB blocks */
  verified("striped-big", 4, 16 * MIB, 402);     /* sliced, then striped */
  H_OK(device_wrs(&E.pre, after, 2, &n));
  uint64_t d0 = after[0] - before[0], d1 = after[1] - before[1];
  fprintf(stderr, "note: striping: %llu work requests on the first device, %llu on the second\n",
          (unsigned long long)d0, (unsigned long long)d1);
  /* Both carry a real share: at least a tenth each. */
  assert_true(d0 * 10 >= d0 + d1);
  assert_true(d1 * 10 >= d0 + d1);
}

/* One rail of two goes down mid-transfer. */
static void test_second_rail_down(void **state) {
  const char *link = getenv("KVF_TEST_LINK2");
  if (!getenv("KVF_TEST_RAIL2_DEVICES") || !link) skip();
  link_down_case(link, 2, "rail2-down");
}

/* ---------------------------------------------------------------- cluster key */

/* A fresh 32-byte key file of mode 0600 in dir. */
static int write_key(const char *dir, char *path, size_t cap) {
  uint8_t key[32];
  snprintf(path, cap, "%s/cluster.key", dir);
  if (getrandom(key, sizeof key, 0) != (ssize_t)sizeof key) return h_fail("getrandom failed");
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 || write(fd, key, sizeof key) != (ssize_t)sizeof key) return h_fail("cannot write %s", path);
  close(fd);
  return 0;
}

/* Both daemons with one cluster-key-file: every CM request then carries the
 * sender's truncated proof in its private data (rdma_conn.c), which the acceptor
 * checks before rdma_accept; the QPs must connect and carry data. */
static int setup_keyed(void **state) {
  uint16_t ports[2];
  char key[H_PATH_MAX + 16];
  unsetenv("KVF_TEST_RDMA_DEVICES");
  memset(&E.p, 0, sizeof E.p);
  if (h_mkdtemp(E.p.dir, sizeof E.p.dir) || h_free_ports(ports, 2) ||
      write_key(E.p.dir, key, sizeof key))
    return -1;
  h_daemon_init(&E.p.prefill, E.p.dir, "prefill", ports[0], "512M");
  h_daemon_init(&E.p.decode, E.p.dir, "decode", ports[1], "512M");
  snprintf(E.p.prefill.extra, sizeof E.p.prefill.extra, "cluster-key-file %s", key);
  snprintf(E.p.decode.extra, sizeof E.p.decode.extra, "cluster-key-file %s", key);
  h_daemon_add_peer(&E.p.prefill, &E.p.decode);
  h_daemon_add_peer(&E.p.decode, &E.p.prefill);
  if (h_daemon_spawn(&E.p.prefill) || h_daemon_spawn(&E.p.decode) || h_pair_wait_up(&E.p) ||
      h_client_open(&E.pre, &E.p.prefill) || h_client_open(&E.dec, &E.p.decode))
    return -1;
  up = true;
  return wait_rdma_ready((size_t)qps_per_pair(1));
}

static void test_cluster_key_over_rdma(void **state) {
  h_client *both[2] = {&E.pre, &E.dec};
  for (int i = 0; i < 2; i++) {
    char *json = NULL, auth[32] = "";
    uint64_t refused = 1;
    H_OK(h_inspect(both[i]->c, KVF_INSPECT_STATUS, &json));
    hj_str(json, "auth", auth, sizeof auth);
    hj_u64(json, "auth_failures", &refused);
    free(json);
    assert_string_equal(auth, "cluster-key");
    assert_int_equal(refused, 0);
  }
  verified("keyed", 2048, 32 * KIB, 501);
  verified("keyed-big", 4, 8 * MIB, 502);
}

int main(void) {
  const struct CMUnitTest one[] = {
      cmocka_unit_test(test_100k_descriptors),
      cmocka_unit_test(test_16k_windows),
      cmocka_unit_test(test_large_descriptors),
      cmocka_unit_test(test_link_down_mid_transfer),
      cmocka_unit_test(test_receiver_killed),
      cmocka_unit_test(test_sender_killed),
  };
  const struct CMUnitTest two[] = {
      cmocka_unit_test(test_two_devices_striping),
      cmocka_unit_test(test_second_rail_down),
  };
  h_init();
  if (getenv("KVF_TEST_FILTER") && *getenv("KVF_TEST_FILTER")) cmocka_set_test_filter(getenv("KVF_TEST_FILTER")); /* e.g. "*killed*" */
  int failed = cmocka_run_group_tests_name("rdma, one device per node", one, setup_one, teardown);
  failed += cmocka_run_group_tests_name("rdma, two devices per node", two, setup_two, teardown);
  const struct CMUnitTest keyed[] = {cmocka_unit_test(test_cluster_key_over_rdma)};
  failed += cmocka_run_group_tests_name("rdma with a cluster key", keyed, setup_keyed, teardown);
  return h_cleanup(failed);
}
