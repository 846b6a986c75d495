/* test_bounce.c - the rdma bounce path (daemon/transport/rdma/rdma_bounce.c)
 * in the soft-RoCE VM: host pools forced to bounce (gpu-direct off, for
 * the daemon or on the pool line) on the sender only, the receiver only,
 * and both; transfers many times larger than the staging area
 * (rdma-bounce-size 2M: 8 sending chunks and 8 receiving slots of 128 KiB),
 * in one part and in several; many small scattered descriptors; a deadline
 * and a cancel in the middle of a bounced transfer, and either daemon
 * killed in the middle of one, after which the pair carries verified
 * transfers again. Every transfer's path must be
 * "rdma-bounce" on both sides (but the receiver's when only the sender
 * stages: "rdma", it cannot tell) and every byte is verified (harness
 * h_transfer: the gaps between destinations are checked to be untouched).
 * tests/rdma/run.sh also runs test_blocks and test_e2e with both sides
 * bouncing (KVF_TEST_PATH=rdma-bounce).
 *
 * Environment (from run.sh): KVF_TEST_TRANSPORT=rdma, KVF_TEST_RDMA_IPS. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define KIB (1ull << 10)
#define MIB (1ull << 20)
#define STAGING "rdma-bounce-size 2M"

static h_fixture E;
static bool up;

/* The pair with these extra lines (prefill, decode) and pool words. */
static int pair_up(const char *conf_pre, const char *pool_pre, const char *conf_dec, const char *pool_dec) {
  char a[256], b[256];
  snprintf(a, sizeof a, STAGING ";%s", conf_pre);
  snprintf(b, sizeof b, STAGING ";%s", conf_dec);
  setenv("KVF_TEST_CONF_PREFILL", a, 1);
  setenv("KVF_TEST_CONF_DECODE", b, 1);
  setenv("KVF_TEST_POOL_PREFILL", pool_pre, 1);
  setenv("KVF_TEST_POOL_DECODE", pool_dec, 1);
  setenv("KVF_TEST_PATH", "rdma-bounce", 1);
  /* Only the sender stages: the receiver's writes land as on the direct
   * path, and it cannot tell (its events say "rdma"). */
  if (*conf_dec || *pool_dec) unsetenv("KVF_TEST_RECV_PATH");
  else setenv("KVF_TEST_RECV_PATH", "rdma", 1);
  if (h_fixture_start(&E, "512M")) return -1;
  up = true;
  return 0;
}

static int pair_down(void **state) {
  if (!up) return 0;
  up = false;
  return h_fixture_stop(&E);
}

static int setup_sender(void **state) { return pair_up("gpu-direct off", "", "", ""); }
static int setup_receiver(void **state) { return pair_up("", "", "", "gpu-direct=off"); }
static int setup_both(void **state) { return pair_up("", "gpu-direct=off", "gpu-direct off", ""); }

/* What the status says of the pool and the staging: nic_reg "bounce" where
 * it bounces; the staging of the device moved bytes. */
static void expect_nic_reg(h_client *hc, const char *want) {
  char *json = NULL, reg[32] = "";
  H_OK(h_inspect(hc->c, KVF_INSPECT_STATUS, &json));
  const char *pools = hj_get(json, "pools"), *p;
  if (pools && *pools != '[') pools = NULL;
  while (pools && (p = hj_next(&pools)))
    if (!hj_str(p, "registration", reg, sizeof reg)) break;
  free(json);
  if (strcmp(reg, want)) fail_msg("%s: pool registration \"%s\", expected \"%s\"", hc->node, reg, want);
}

static uint64_t bounce_bytes(h_client *hc, const char *key) {
  char *json = NULL;
  uint64_t sum = 0, v;
  H_OK(h_inspect(hc->c, KVF_INSPECT_STATUS, &json));
  const char *r = hj_get(json, "rdma"), *devs = r ? hj_get(r, "devices") : NULL, *d;
  if (devs && *devs != '[') devs = NULL;
  while (devs && (d = hj_next(&devs))) {
    const char *b = hj_get(d, "bounce");
    if (b && !hj_u64(b, key, &v)) sum += v;
  }
  free(json);
  return sum;
}

/* 32 MiB in 1 MiB descriptors (16 times the staging area), one part; then
 * in four parts; then 2000 scattered 4 KiB descriptors. */
static void transfers(const char *tag) {
  char t[64];
  snprintf(t, sizeof t, "%s-big", tag);
  H_OK(h_scattered(&E, t, 32, MIB, 0, 11, 120000));
  snprintf(t, sizeof t, "%s-parts", tag);
  H_OK(h_scattered(&E, t, 48, 512 * KIB, 4, 12, 120000));
  snprintf(t, sizeof t, "%s-small", tag);
  H_OK(h_scattered(&E, t, 2000, 4 * KIB, 0, 13, 120000));
}

static void test_sender(void **state) {
  expect_nic_reg(&E.pre, "bounce");
  expect_nic_reg(&E.dec, "host");
  transfers("snd");
  if (bounce_bytes(&E.pre, "sent_bytes") < 32 * MIB) fail_msg("prefill's staging carried too little");
  if (bounce_bytes(&E.dec, "received_bytes") != 0) fail_msg("decode staged though its pool is registered");
}

static void test_receiver(void **state) {
  expect_nic_reg(&E.pre, "host");
  expect_nic_reg(&E.dec, "bounce");
  transfers("rcv");
  if (bounce_bytes(&E.dec, "received_bytes") < 32 * MIB) fail_msg("decode's staging carried too little");
}

static void test_both(void **state) {
  expect_nic_reg(&E.pre, "bounce");
  expect_nic_reg(&E.dec, "bounce");
  transfers("both");
}

/* A bounced transfer of 256 MiB that cannot end in time: both sides fail
 * with KVF_EDEADLINE, bounded; a cancel mid-transfer: KVF_ECANCELED here,
 * KVF_EREMOTECANCEL there. Afterwards the pair carries verified transfers
 * (the staging slots and chunks came back). */
#define BIG_N 1024
static kvf_desc bsrc[BIG_N], bdst[BIG_N];

static void start_big(h_xfer *x, char *id, size_t cap, const char *tag, uint32_t deadline_ms) {
  h_id(id, cap, tag);
  h_layout(bsrc, BIG_N, E.pre.pool, 0, 256 * KIB, true, 81);
  h_layout(bdst, BIG_N, E.dec.pool, 0, 256 * KIB, true, 82);
  *x = (h_xfer){.id = id, .src = bsrc, .nsrc = BIG_N, .dst = bdst, .ndst = BIG_N, .deadline_ms = deadline_ms,
                .seed = 83};
  H_OK(h_prepare(&E.pre, &E.dec, x));
  H_OK(h_post_grant(&E.dec, x, "prefill"));
  H_OK(h_post_send(&E.pre, x, "decode"));
}

static void expect_end(h_client *hc, const char *id, int status, int ms) {
  kvf_event ev;
  H_OK(h_wait_event(hc, id, 0, ms, &ev));
  if (ev.status != status)
    fail_msg("%s: %s ended with %s (%s), expected %s", hc->node, id, kvf_err_name(ev.status), ev.error,
             kvf_err_name(status));
}

static void test_deadline_cancel(void **state) {
  char id[64];
  h_xfer x;
  uint64_t t0 = h_now_ms();
  start_big(&x, id, sizeof id, "bdl", 600);
  expect_end(&E.pre, id, KVF_EDEADLINE, 5000);
  expect_end(&E.dec, id, KVF_EDEADLINE, 5000);
  fprintf(stderr, "note: deadline 600 ms: both sides failed after %llu ms\n", (unsigned long long)(h_now_ms() - t0));
  H_OK(h_quick(&E.pre, &E.dec));

  start_big(&x, id, sizeof id, "bcx", 120000);
  H_OK(h_wait_xfer_bytes(E.pre.c, id, 8 * MIB, 20000));
  H_OK(kvf_cancel(E.pre.c, id));
  expect_end(&E.pre, id, KVF_ECANCELED, 10000);
  expect_end(&E.dec, id, KVF_EREMOTECANCEL, 10000);
  H_OK(h_quick(&E.pre, &E.dec));
  transfers("after");
}

/* Connected rdma QPs of a daemon (the data path is up, not only control);
 * 0 while its status has none. */
static size_t connected_qps(h_client *hc) {
  size_t all, connected;
  return h_rdma_qps(hc, &all, &connected) ? 0 : connected;
}

static void respawn(h_daemon *d, h_client *hc) {
  h_client_close(hc);
  H_OK(h_daemon_spawn(d));
  H_OK(h_pair_wait_up(&E.p));
  H_OK(h_client_open(hc, d));
  uint64_t end = h_now_ms() + 30000;
  while ((connected_qps(&E.pre) < 4 || connected_qps(&E.dec) < 4) && h_now_ms() < end) h_sleep_ms(50);
  if (h_now_ms() >= end) fail_msg("rdma QPs not connected again within 30 s");
}

/* A daemon killed in the middle of a bounced transfer: the other side
 * fails with KVF_EPEERLOST long before the deadline (120 s), and once the
 * daemon is back the pair carries verified bounced transfers (no staging
 * slot or chunk was lost with the peer). */
static void peer_killed(bool receiver) {
  char id[64];
  h_xfer x;
  start_big(&x, id, sizeof id, receiver ? "brx-killed" : "btx-killed", 120000);
  H_OK(h_wait_xfer_bytes(E.pre.c, id, 8 * MIB, 20000));
  uint64_t t0 = h_now_ms();
  H_OK(h_daemon_kill9(receiver ? &E.p.decode : &E.p.prefill));
  expect_end(receiver ? &E.pre : &E.dec, id, KVF_EPEERLOST, 10000);
  fprintf(stderr, "note: %s killed: the %s failed after %llu ms\n", receiver ? "receiver" : "sender",
          receiver ? "send" : "grant", (unsigned long long)(h_now_ms() - t0));
  if (receiver) respawn(&E.p.decode, &E.dec);
  else respawn(&E.p.prefill, &E.pre);
  transfers(receiver ? "after-rx-kill" : "after-tx-kill");
}

static void test_receiver_killed(void **state) { peer_killed(true); }
static void test_sender_killed(void **state) { peer_killed(false); }

int main(void) {
  h_init();
  const struct CMUnitTest sender[] = {cmocka_unit_test(test_sender)};
  const struct CMUnitTest receiver[] = {cmocka_unit_test(test_receiver)};
  const struct CMUnitTest both[] = {cmocka_unit_test(test_both), cmocka_unit_test(test_deadline_cancel),
                                    cmocka_unit_test(test_receiver_killed), cmocka_unit_test(test_sender_killed)};
  int failed = cmocka_run_group_tests_name("bounce-sender", sender, setup_sender, pair_down);
  failed += cmocka_run_group_tests_name("bounce-receiver", receiver, setup_receiver, pair_down);
  failed += cmocka_run_group_tests_name("bounce-both", both, setup_both, pair_down);
  return h_cleanup(failed);
}
