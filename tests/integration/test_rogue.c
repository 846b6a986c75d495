/* test_rogue.c - a peer that writes outside what it was granted. The
 * sending daemon is $BUILD/tests/kvferryd-rogue (kvferryd built with
 * -DKVF_FAILPOINTS, daemon/failpoint.h), made to misbehave by KVF_FAILPOINT;
 * the receiving daemon is the ordinary kvferryd. Runs in `make check` (tcp)
 * and in `make check-rdma` (tests/rdma/run.sh runs every integration test
 * with KVF_TEST_TRANSPORT=rdma).
 *
 *   write_outside_grant  the rogue moves one write of the transfer to the
 *     block just past the grant (inside the pool). tcp: the receiver refuses
 *     it (KVF_EPERM on both sides, naming the reason) and the bytes there
 *     stay poison. rdma: what the receiver's status says decides what must
 *     happen: memory windows whose bounds the devices enforce must refuse
 *     it (KVF_EPERM, bytes unchanged, QPs rebuilt); where the status says
 *     the bounds are not enforced (rxe on Linux 6.1) or there are no
 *     windows, the write lands, and the test checks that it did (a status
 *     that claims more than the device does fails the test). Then both
 *     daemons are alive and exit cleanly, and an ordinary pair carries a
 *     verified transfer.
 *   late_write (rdma, memory windows)  after a verified transfer the rogue
 *     writes once more through the transfer's window, 1 s later: the
 *     receiver invalidated it when the transfer ended, so the write must
 *     fail (the sender's QPs reset) and the bytes stay as the client left
 *     them; no window stays allocated.
 *   grant_across_reset (rdma, memory windows)  a grant made (its windows
 *     bound and sent) before the late write of an earlier transfer resets
 *     the QPs fails at once with KVF_EPEERLOST, saying to grant again; its
 *     send ends by its deadline, and a grant made again carries the data.
 *   window_of_another_qp (rdma, memory windows)  the last write goes on
 *     another QP than its window's: refused (KVF_EPERM on both sides), the
 *     block unchanged, the sender's QPs rebuilt.
 *   windows_merged (rdma)  more ranges than rdma-mw-max-windows: merged.
 *   window_index (rdma, memory windows)  the sender finds each write's
 *     window by the Grant's window_of, without a search; a sender that
 *     reads it wrong (bad-window-index) searches and loses nothing.
 *   windows_off (rdma)  with rdma-memory-windows off, status and doctor say
 *     that a peer can write any byte of a pool; transfers still work. */
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
#define LEN (32 * KIB)
#define N 8
#define BASE (1ull << 20)
#define ROGUE "tests/kvferryd-rogue"

typedef struct rig {
  h_pair p;
  h_client pre, dec;
  bool up;
} rig;

static rig E;

static bool over_rdma(void) {
  const char *t = getenv("KVF_TEST_TRANSPORT");
  return t && strcmp(t, "rdma") == 0;
}

static int rig_up(const char *exe, const char *failpoint, const char *extra) {
  if (failpoint) setenv("KVF_FAILPOINT", failpoint, 1);
  int rc = h_pair_start_ex(&E.p, "64M", exe, extra);
  unsetenv("KVF_FAILPOINT");
  if (rc || h_client_open(&E.pre, &E.p.prefill) || h_client_open(&E.dec, &E.p.decode)) return -1;
  E.up = true;
  return 0;
}

/* Both daemons must still answer, then exit 0 on SIGTERM. */
static int rig_down(void) {
  if (!E.up) return 0;
  char *a = NULL, *b = NULL;
  int rc = h_inspect(E.dec.c, KVF_INSPECT_STATUS, &a) || h_inspect(E.pre.c, KVF_INSPECT_STATUS, &b);
  free(a);
  free(b);
  h_client_close(&E.pre);
  h_client_close(&E.dec);
  E.up = false;
  int st = h_pair_stop(&E.p);
  return rc ? h_fail("a daemon stopped answering") : st;
}

static int teardown(void **state) { return rig_down(); }

/* ------------------------------------------------------------ status */

typedef struct windows {
  bool rdma, in_use, enforced;
  uint64_t live;
  uint64_t lookups, searches;   /* sender: runs' windows looked up; not by Grant.window_of */
  char protection[512];
} windows;

static bool is_true(const char *v) { return v && strncmp(v, "true", 4) == 0; }

/* The "memory_windows" object of a daemon's rdma status. */
static int get_windows(h_client *hc, windows *w) {
  char *json = NULL;
  memset(w, 0, sizeof *w);
  if (h_inspect(hc->c, KVF_INSPECT_STATUS, &json)) return -1;
  const char *r = hj_get(json, "rdma"), *mw = r && *r == '{' ? hj_get(r, "memory_windows") : NULL;
  if (mw) {
    w->rdma = true;
    w->in_use = is_true(hj_get(mw, "in_use"));
    w->enforced = is_true(hj_get(mw, "bounds_enforced"));
    hj_u64(mw, "live", &w->live);
    hj_u64(mw, "lookups", &w->lookups);
    hj_u64(mw, "searches", &w->searches);
    hj_str(mw, "protection", w->protection, sizeof w->protection);
  }
  free(json);
  return 0;
}

/* Windows of grants that ended must all be gone. */
/* The rdma-only cases skip, loudly, elsewhere. */
static void need_rdma(void) {
  if (!over_rdma()) {
    fprintf(stderr, "note: SKIPPED: rdma only (make check-rdma)\n");
    skip();
  }
}

/* Starts the pair (as rig_up) for a case that needs memory windows in use;
 * skips, saying why, where the devices have none. */
static void rig_up_windows(const char *exe, const char *failpoint, const char *extra, windows *w) {
  need_rdma();
  H_OK(rig_up(exe, failpoint, extra));
  H_OK(get_windows(&E.dec, w));
  if (!w->in_use) {
    fprintf(stderr, "note: SKIPPED: no memory windows here (%s)\n", w->protection);
    skip();
  }
}

static int wait_no_windows(h_client *hc) {
  windows w;
  uint64_t end = h_now_ms() + 5000;
  do {
    if (get_windows(hc, &w)) return -1;
    if (w.live == 0) return 0;
    h_sleep_ms(50);
  } while (h_now_ms() < end);
  return h_fail("%s keeps %llu memory windows of transfers that ended", hc->node, (unsigned long long)w.live);
}

/* kvferryctl doctor's result for check on daemon d ("ok", "warn", ...). */
static int doctor_result(const h_daemon *d, const char *check, char *out, size_t cap) {
  static char buf[65536];
  char cmd[512];
  const char *b = getenv("BUILD");
  snprintf(cmd, sizeof cmd, "%s/kvferryctl -s %s --json doctor", b && *b ? b : "build", d->sock);
  FILE *f = popen(cmd, "r");
  if (!f) return h_fail("cannot run %s", cmd);
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  pclose(f);
  buf[n] = 0;
  /* kvferryctl writes each check as {"name":..,"what":..,"result":..} */
  char key[96];
  snprintf(key, sizeof key, "{\"name\":\"%s\",", check);
  const char *c = strstr(buf, key), *r = c ? strstr(c, "\"result\":\"") : NULL;
  if (!r) return h_fail("doctor has no check %s: %.300s", check, buf);
  r += strlen("\"result\":\"");
  size_t k = strcspn(r, "\"");
  snprintf(out, cap, "%.*s", (int)k, r);
  return 0;
}

/* ------------------------------------------------------------ helpers */

static uint64_t end_of(const kvf_desc *d, size_t n) {
  uint64_t e = 0;
  for (size_t i = 0; i < n; i++)
    if (d[i].offset + d[i].len > e) e = d[i].offset + d[i].len;
  return e;
}

static int expect_failed(h_client *hc, const char *id, int type, int want, const char *reason) {
  kvf_event ev;
  if (h_wait_event(hc, id, type, 20000, &ev)) return -1;
  if (ev.status != want)
    return h_fail("%s: %s ended with %s (%s), expected %s", hc->node, id, kvf_err_name(ev.status), ev.error,
                  kvf_err_name(want));
  if (reason && !strstr(ev.error, reason))
    return h_fail("%s: %s failed with \"%s\", which does not say \"%s\"", hc->node, id, ev.error, reason);
  fprintf(stderr, "note: %s: %s: %s (%s)\n", hc->node, id, kvf_err_name(ev.status), ev.error);
  return 0;
}

/* ------------------------------------------------------------ cases */

static void test_write_outside_grant(void **state) {
  kvf_desc src[N], dst[N];
  char id[64];
  windows w;
  H_OK(rig_up(ROGUE, "write-outside-grant", NULL));
  H_OK(get_windows(&E.dec, &w));
  h_id(id, sizeof id, "rogue");
  h_layout(src, N, E.pre.pool, 0, LEN, true, 5);
  h_layout(dst, N, E.dec.pool, BASE, LEN, true, 6);
  uint64_t past = end_of(dst, N); /* where the rogue writes: the block after the grant */
  h_xfer x = {.id = id, .src = src, .nsrc = N, .dst = dst, .ndst = N, .seed = 7};
  H_OK(h_prepare(&E.pre, &E.dec, &x));
  h_poison(E.dec.base + past, 2 * LEN);
  H_OK(h_post_grant(&E.dec, &x, "prefill"));
  H_OK(h_post_send(&E.pre, &x, "decode"));
  bool refuses = !over_rdma() || (w.in_use && w.enforced);
  if (refuses) {
    H_OK(expect_failed(&E.dec, id, KVF_EV_RECV_DONE, KVF_EPERM, over_rdma() ? NULL : "outside the grant"));
    H_OK(expect_failed(&E.pre, id, KVF_EV_SEND_DONE, KVF_EPERM, NULL));
    int64_t bad = h_verify_poison(E.dec.base + past, 2 * LEN);
    if (bad >= 0) fail_msg("the refused write changed byte %lld past the grant", (long long)bad);
  } else {
    /* No windows, or a device that does not check their bounds: the
     * status must say so, and the write lands. */
    kvf_event ev;
    fprintf(stderr, "note: rdma: %s\n", w.protection);
    assert_true(strstr(w.protection, "any byte") != NULL);
    H_OK(h_wait_event(&E.dec, id, KVF_EV_RECV_DONE, 20000, &ev));
    H_OK(h_wait_event(&E.pre, id, KVF_EV_SEND_DONE, 20000, &ev));
    int64_t bad = h_verify_poison(E.dec.base + past, 2 * LEN);
    if (bad < 0) fail_msg("the status says peers can write outside their grants, but the write past the grant "
                          "did not land: the status is wrong");
    fprintf(stderr, "note: as the status says, the rogue write past the grant landed (unprotected here)\n");
  }
  if (over_rdma()) H_OK(wait_no_windows(&E.dec));
  H_OK(rig_down());
  /* An ordinary pair carries a verified transfer. */
  H_OK(rig_up(NULL, NULL, NULL));
  H_OK(h_quick(&E.pre, &E.dec));
  H_OK(rig_down());
}

/* Waits up to ms for the sending daemon's rdma resets to pass `before`;
 * *after: its count then (the caller judges whether it did). */
static int wait_resets(uint64_t before, uint64_t *after, int ms) {
  uint64_t end = h_now_ms() + (uint64_t)ms;
  *after = before;
  while (h_now_ms() < end && *after <= before) {
    h_sleep_ms(50);
    if (h_rdma_resets(&E.pre, after)) return -1;
  }
  return 0;
}

static void test_late_write(void **state) {
  kvf_desc src[N], dst[N];
  char id[64];
  windows w;
  uint64_t before, after = 0;
  rig_up_windows(ROGUE, "late-write", NULL, &w);
  H_OK(h_rdma_resets(&E.pre, &before));
  h_id(id, sizeof id, "late");
  h_layout(src, N, E.pre.pool, 0, LEN, true, 15);
  h_layout(dst, N, E.dec.pool, BASE, LEN, true, 16);
  h_xfer x = {.id = id, .src = src, .nsrc = N, .dst = dst, .ndst = N, .seed = 17, .path = "rdma"};
  H_OK(h_transfer(&E.pre, &E.dec, &x));
  /* The client reuses the blocks; the late write (1 s after the end) must
   * not reach them. */
  for (size_t i = 0; i < N; i++) h_poison(E.dec.base + dst[i].offset, dst[i].len);
  H_OK(wait_resets(before, &after, 10000));
  for (size_t i = 0; i < N; i++) {
    int64_t bad = h_verify_poison(E.dec.base + dst[i].offset, dst[i].len);
    if (bad >= 0) fail_msg("a write through the window of a finished transfer changed block %zu", i);
  }
  if (after <= before) fail_msg("the late write was not refused (no QP reset within 10 s)");
  fprintf(stderr, "note: the late write through an invalidated window was refused (%llu QP reset(s))\n",
          (unsigned long long)(after - before));
  H_OK(wait_no_windows(&E.dec));
  H_OK(rig_down());
}

/* A grant whose Grant (with its windows) already went to the sender when
 * the QPs those windows are bound on go (here the late write of an earlier
 * transfer resets them): the receiver fails it at once with KVF_EPEERLOST,
 * saying to grant again, instead of waiting for data that can no longer
 * come through those windows. A send of it posted afterwards ends by its
 * deadline (the grant is gone: KVF_EDEADLINE, or KVF_EPEERLOST where the
 * sender still held the Grant), and a grant made again carries the data,
 * every byte checked. */
static void test_grant_across_reset(void **state) {
  kvf_desc src[N], dst[N], src2[N], dst2[N];
  char id[64], id2[64];
  windows w;
  kvf_event rev, sev;
  uint64_t before, after = 0;
  rig_up_windows(ROGUE, "late-write", NULL, &w);
  H_OK(h_rdma_resets(&E.pre, &before));
  h_id(id, sizeof id, "reset-first");
  h_layout(src, N, E.pre.pool, 0, LEN, true, 41);
  h_layout(dst, N, E.dec.pool, BASE, LEN, true, 42);
  h_xfer x = {.id = id, .src = src, .nsrc = N, .dst = dst, .ndst = N, .seed = 43, .path = "rdma"};
  H_OK(h_transfer(&E.pre, &E.dec, &x));
  /* Granted now, on the QPs the late write (1 s after x) resets. */
  h_id(id2, sizeof id2, "reset-then");
  h_layout(src2, N, E.pre.pool, 2 * BASE, LEN, true, 44);
  h_layout(dst2, N, E.dec.pool, 3 * BASE, LEN, true, 45);
  h_xfer y = {.id = id2, .src = src2, .nsrc = N, .dst = dst2, .ndst = N, .seed = 46, .deadline_ms = 2000};
  H_OK(h_prepare(&E.pre, &E.dec, &y));
  H_OK(h_post_grant(&E.dec, &y, "prefill"));
  H_OK(wait_resets(before, &after, 10000));
  if (after <= before) fail_msg("the late write did not reset the QPs within 10 s");
  H_OK(h_wait_event(&E.dec, id2, KVF_EV_RECV_DONE, 3000, &rev));
  fprintf(stderr, "note: a grant across a QP reset: %s (%s)\n", kvf_err_name(rev.status), rev.error);
  if (rev.status != KVF_EPEERLOST || !strstr(rev.error, "grant again"))
    fail_msg("a grant whose windows went with a reset should fail at once with KVF_EPEERLOST, saying to grant "
             "again");
  H_OK(h_post_send(&E.pre, &y, "decode"));
  H_OK(h_wait_event(&E.pre, id2, KVF_EV_SEND_DONE, 5000, &sev));
  fprintf(stderr, "note: its send: %s (%s)\n", kvf_err_name(sev.status), sev.error);
  if (sev.status != KVF_EDEADLINE && sev.status != KVF_EPEERLOST) fail_msg("the send of a lost grant: %s",
                                                                           kvf_err_name(sev.status));
  H_OK(h_quick_settled(&E.pre, &E.dec)); /* granted again, the data flows */
  H_OK(wait_no_windows(&E.dec));
  H_OK(rig_down());
}

/* The last write goes through its window but on another QP than the one
 * the window is bound on: the receiver refuses it (rxe checks this), the
 * transfer fails with KVF_EPERM on both sides, the block stays as it was,
 * the sender rebuilds its QPs and no window stays allocated. */
static void test_window_of_another_qp(void **state) {
  kvf_desc src[N], dst[N];
  char id[64];
  windows w;
  uint64_t before, after = 0;
  rig_up_windows(ROGUE, "write-wrong-qp", NULL, &w);
  H_OK(h_rdma_resets(&E.pre, &before));
  for (size_t i = 0; i < N; i++) { /* every other slot: one run (and window) per block */
    src[i] = (kvf_desc){.pool = E.pre.pool, .offset = i * 2 * LEN, .len = LEN};
    dst[i] = (kvf_desc){.pool = E.dec.pool, .offset = BASE + i * 2 * LEN, .len = LEN};
  }
  h_id(id, sizeof id, "wrong-qp");
  h_xfer x = {.id = id, .src = src, .nsrc = N, .dst = dst, .ndst = N, .seed = 27};
  H_OK(h_prepare(&E.pre, &E.dec, &x));
  H_OK(h_post_grant(&E.dec, &x, "prefill"));
  H_OK(h_post_send(&E.pre, &x, "decode"));
  H_OK(expect_failed(&E.pre, id, KVF_EV_SEND_DONE, KVF_EPERM, "refused a write"));
  H_OK(expect_failed(&E.dec, id, KVF_EV_RECV_DONE, KVF_EPERM, NULL));
  int64_t bad = h_verify_poison(E.dec.base + dst[N - 1].offset, LEN);
  if (bad >= 0) fail_msg("the refused last write changed byte %lld of its block", (long long)bad);
  H_OK(wait_resets(before, &after, 5000));
  if (after <= before) fail_msg("the sender did not rebuild its QPs after the refused write");
  H_OK(wait_no_windows(&E.dec));
  H_OK(rig_down());
}

static void test_windows_off(void **state) {
  windows w;
  char result[16];
  need_rdma();
  H_OK(rig_up(NULL, NULL, "rdma-memory-windows off"));
  H_OK(get_windows(&E.dec, &w));
  assert_true(w.rdma);
  assert_false(w.in_use);
  fprintf(stderr, "note: rdma-memory-windows off: %s\n", w.protection);
  assert_true(strstr(w.protection, "any byte of a registered pool") != NULL);
  H_OK(doctor_result(&E.p.decode, "rdma-writes", result, sizeof result));
  assert_string_equal(result, "warn");
  H_OK(h_quick(&E.pre, &E.dec));
  H_OK(rig_down());
  /* With the default (auto), doctor agrees with the status. */
  H_OK(rig_up(NULL, NULL, NULL));
  H_OK(get_windows(&E.dec, &w));
  H_OK(doctor_result(&E.p.decode, "rdma-writes", result, sizeof result));
  fprintf(stderr, "note: rdma-memory-windows auto: doctor %s: %s\n", result, w.protection);
  assert_string_equal(result, w.in_use && w.enforced ? "ok" : "warn");
  H_OK(rig_down());
}

/* rdma-mw-max-windows 4 and a grant of 16 separate ranges: 4 windows span
 * the smallest gaps, the transfer works, the status counts it. */
static void test_windows_merged(void **state) {
  kvf_desc src[16], dst[16];
  char id[64], *json = NULL;
  windows w;
  uint64_t merged = 0, last = 0;
  rig_up_windows(NULL, NULL, "rdma-mw-max-windows 4", &w);
  for (size_t i = 0, off = BASE; i < 16; off += LEN + (i % 4 + 1) * 4 * KIB, i++) { /* gaps of 4..16 KiB */
    src[i] = (kvf_desc){.pool = E.pre.pool, .offset = i * LEN, .len = LEN};
    dst[i] = (kvf_desc){.pool = E.dec.pool, .offset = off, .len = LEN};
  }
  h_id(id, sizeof id, "merged");
  h_xfer x = {.id = id, .src = src, .nsrc = 16, .dst = dst, .ndst = 16, .seed = 21, .path = "rdma"};
  H_OK(h_transfer(&E.pre, &E.dec, &x));
  H_OK(h_inspect(E.dec.c, KVF_INSPECT_STATUS, &json));
  const char *r = hj_get(json, "rdma"), *mw = r && *r == '{' ? hj_get(r, "memory_windows") : NULL;
  assert_non_null(mw);
  hj_u64(mw, "merged_grants", &merged);
  hj_u64(mw, "last_grant_windows", &last);
  free(json);
  assert_int_equal(merged, 1);
  assert_int_equal(last, 4);
  H_OK(wait_no_windows(&E.dec));
  H_OK(rig_down());
}

/* Scattered blocks, one window each, sent and verified; what the
 * sender's status counts of its window lookups, in *w. */
static int scattered_transfer(const char *name, uint64_t seed, windows *w) {
  enum { M = 24 };
  kvf_desc src[M], dst[M];
  char id[64];
  for (size_t i = 0; i < M; i++) { /* every other slot, in a shuffled order */
    size_t k = (i * 7) % M;
    src[i] = (kvf_desc){.pool = E.pre.pool, .offset = i * LEN, .len = LEN};
    dst[i] = (kvf_desc){.pool = E.dec.pool, .offset = BASE + k * 2 * LEN, .len = LEN};
  }
  h_id(id, sizeof id, name);
  h_xfer x = {.id = id, .src = src, .nsrc = M, .dst = dst, .ndst = M, .seed = seed, .path = "rdma"};
  if (h_transfer(&E.pre, &E.dec, &x) || get_windows(&E.pre, w)) return -1;
  fprintf(stderr, "note: %s: the sender looked up %llu windows, %llu of them by search\n", name,
          (unsigned long long)w->lookups, (unsigned long long)w->searches);
  if (w->lookups < M) return h_fail("%s: the sender looked up %llu windows for %d writes", name,
                                    (unsigned long long)w->lookups, M);
  return 0;
}

/* Grant.window_of: an ordinary sender finds every write's window by the
 * receiver's index, without a search; one that reads every entry wrong
 * (failpoint bad-window-index, as from a faulty receiver) searches for each
 * and still delivers every byte. */
static void test_window_index(void **state) {
  windows w;
  rig_up_windows(NULL, NULL, NULL, &w);
  H_OK(scattered_transfer("index", 31, &w));
  assert_int_equal(w.searches, 0);
  H_OK(rig_down());
  rig_up_windows(ROGUE, "bad-window-index", NULL, &w);
  H_OK(scattered_transfer("bad-index", 32, &w));
  assert_int_equal(w.searches, w.lookups);
  H_OK(wait_no_windows(&E.dec));
  H_OK(rig_down());
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_window_index, teardown),
      cmocka_unit_test_teardown(test_windows_merged, teardown),
      cmocka_unit_test_teardown(test_write_outside_grant, teardown),
      cmocka_unit_test_teardown(test_late_write, teardown),
      cmocka_unit_test_teardown(test_grant_across_reset, teardown),
      cmocka_unit_test_teardown(test_window_of_another_qp, teardown),
      cmocka_unit_test_teardown(test_windows_off, teardown),
  };
  h_init();
  return h_cleanup(cmocka_run_group_tests_name("rogue peers", tests, NULL, NULL));
}
