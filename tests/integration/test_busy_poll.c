/* test_busy_poll.c - busy-poll yes: two daemons that spin instead of
 * sleeping still carry verified transfers, really spin (an idle daemon's
 * CPU time grows at a sizeable share of the wall clock, where an ordinary
 * idle daemon's barely moves) and still stop cleanly on SIGTERM. Runs in
 * `make check` (tcp: the loop spins) and in `make check-rdma` (the rdma
 * progress threads spin too). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "harness.h"

#define IDLE_MS 1000

static h_pair P;
static bool up;

/* utime + stime of pid, in ms. */
static int cpu_ms(pid_t pid, uint64_t *ms) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return h_fail("cannot read %s", path);
  unsigned long long ut = 0, st = 0;
  /* pid (comm) state, then 10 fields to skip before utime and stime; comm
   * ("kvferryd") has no spaces. */
  int n = fscanf(f, "%*d %*s %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st);
  fclose(f);
  if (n != 2) return h_fail("cannot parse %s", path);
  *ms = (ut + st) * 1000ull / (uint64_t)sysconf(_SC_CLK_TCK);
  return 0;
}

/* The share of IDLE_MS of wall clock the daemon spent on a CPU, in %. */
static int idle_share(const h_daemon *d, unsigned *pct) {
  uint64_t a, b, t0 = h_now_ms();
  if (cpu_ms(d->pid, &a)) return -1;
  h_sleep_ms(IDLE_MS);
  if (cpu_ms(d->pid, &b)) return -1;
  *pct = (unsigned)((b - a) * 100 / (h_now_ms() - t0));
  return 0;
}

static int pair_down(void **state) {
  if (!up) return 0;
  up = false;
  return h_pair_stop(&P);
}

/* One verified transfer, then the idle share of both daemons. */
static void run_pair(const char *extra, unsigned *pct_pre, unsigned *pct_dec) {
  h_client pre, dec;
  H_OK(h_pair_start_ex(&P, "16M", NULL, extra));
  up = true;
  H_OK(h_client_open(&pre, &P.prefill));
  H_OK(h_client_open(&dec, &P.decode));
  H_OK(h_quick(&pre, &dec));
  h_client_close(&pre);
  h_client_close(&dec);
  H_OK(idle_share(&P.prefill, pct_pre));
  H_OK(idle_share(&P.decode, pct_dec));
  up = false;
  H_OK(h_pair_stop(&P)); /* exit 0 on SIGTERM, spinning or not */
}

static void test_busy_poll(void **state) {
  unsigned a, b;
  run_pair(NULL, &a, &b);
  fprintf(stderr, "note: idle daemons, busy-poll no: %u%% and %u%% of a CPU\n", a, b);
  if (a > 10 || b > 10) fail_msg("idle daemons without busy-poll used %u%% and %u%% of a CPU", a, b);
  run_pair("busy-poll yes", &a, &b);
  fprintf(stderr, "note: idle daemons, busy-poll yes: %u%% and %u%% of a CPU\n", a, b);
  /* Two spinning daemons (and, over rdma, their progress threads) share
   * the machine's cores with everything else: a quarter of a CPU each is
   * far above what a sleeping daemon takes, and safe on two loaded cores. */
  if (a < 25 || b < 25) fail_msg("busy-poll yes: idle daemons used only %u%% and %u%% of a CPU", a, b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_busy_poll, pair_down),
  };
  h_init();
  return h_cleanup(cmocka_run_group_tests_name("busy poll", tests, NULL, NULL));
}
