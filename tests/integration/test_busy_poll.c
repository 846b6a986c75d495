/* test_busy_poll.c - busy-poll yes: two daemons that spin instead of
 * sleeping still carry verified transfers, really spin, and still stop
 * cleanly on SIGTERM; without it an idle daemon sleeps. Runs in
 * `make check` (tcp: the loop spins) and in `make check-rdma` (the rdma
 * progress threads spin too).
 *
 * What is measured, and why it does not depend on the machine's load: for
 * each thread of an idle daemon, over a window of wall clock,
 *
 * - how often it went to sleep (voluntary_ctxt_switches in
 *   /proc/PID/task/TID/status). A thread that spins never blocks, so it
 *   never sleeps however little CPU a loaded machine gives it (it is only
 *   preempted, which is an involuntary switch); an idle loop that sleeps
 *   in epoll_wait sleeps once per wakeup, i.e. per heartbeat (the harness
 *   sets heartbeat-ms 100), loaded machine or not.
 * - the share of the window in which it was runnable: on a CPU or waiting
 *   in the run queue for one (/proc/PID/task/TID/schedstat). A spinning
 *   thread is runnable all the time: what it loses on the CPU to the load
 *   it spends in the run queue. A sleeping one only around its wakeups.
 *
 * CPU time alone (what this test used to measure) falls with the load and
 * made a spinning daemon on two busy cores look idle. So now: with
 * busy-poll the loop thread (the main thread, tid == pid) must not sleep
 * (at most SPIN_MAX_SLEEPS in the window) and be runnable at least
 * RUNNABLE_SPLIT_PCT of it: catches a loop that sleeps, even briefly at
 * each heartbeat. Without busy-poll the loop must sleep (at least
 * IDLE_MIN_SLEEPS: it waits for its timers) but not wake more than
 * IDLE_MAX_SLEEPS times (a loop that idles badly, e.g. a runaway timer),
 * and no thread may be runnable more than RUNNABLE_SPLIT_PCT (catches a
 * thread that spins). The runnable share is only read at the window's
 * ends, so a wait in the run queue under way there is cut short or counted
 * whole: on a loaded machine it is seen off by a few tens of %, hence the
 * split in the middle; the sleep counts are exact. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

#define WINDOW_MS 1000
#define SPIN_MAX_SLEEPS 2
#define IDLE_MIN_SLEEPS 3
#define IDLE_MAX_SLEEPS 200
#define RUNNABLE_SPLIT_PCT 50
#define MAX_THREADS 64

static h_pair P;
static bool up;

/* The runnable time (on a CPU + waiting for one) of each thread of a
 * process, at one moment. */
typedef struct sample {
  size_t n;
  pid_t tid[MAX_THREADS];
  uint64_t run_ns[MAX_THREADS];   /* on a CPU */
  uint64_t wait_ns[MAX_THREADS];  /* runnable, waiting in the run queue */
  uint64_t sleeps[MAX_THREADS];   /* voluntary context switches */
  uint64_t at_ms;
} sample;

/* 1 when read, 0 when the thread is gone, -1 (said) when unreadable. */
static int read_schedstat(pid_t pid, pid_t tid, uint64_t *run, uint64_t *wait) {
  char path[96];
  unsigned long long r, w;
  snprintf(path, sizeof path, "/proc/%d/task/%d/schedstat", (int)pid, (int)tid);
  FILE *f = fopen(path, "r");
  if (!f && errno == ENOENT) return 0; /* the thread ended meanwhile */
  if (!f) return h_fail("cannot read %s: %s", path, strerror(errno));
  int n = fscanf(f, "%llu %llu", &r, &w);
  fclose(f);
  if (n != 2) return h_fail("cannot parse %s", path);
  *run = r;
  *wait = w;
  return 1;
}

/* The times the thread went to sleep (voluntary_ctxt_switches); 0 when
 * it is gone. */
static uint64_t read_sleeps(pid_t pid, pid_t tid) {
  char path[96], line[256];
  unsigned long long v = 0;
  snprintf(path, sizeof path, "/proc/%d/task/%d/status", (int)pid, (int)tid);
  FILE *f = fopen(path, "r");
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "voluntary_ctxt_switches: %llu", &v) == 1) break;
  if (f) fclose(f);
  return v;
}

static int take_sample(pid_t pid, sample *s) {
  char path[64];
  struct dirent *e;
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  if (!d) return h_fail("cannot list %s: %s", path, strerror(errno));
  s->n = 0;
  s->at_ms = h_now_ms();
  while ((e = readdir(d)) && s->n < MAX_THREADS) {
    pid_t tid = (pid_t)atoi(e->d_name);
    if (tid <= 0) continue;
    int rc = read_schedstat(pid, tid, &s->run_ns[s->n], &s->wait_ns[s->n]);
    if (rc < 0) {
      closedir(d);
      return -1;
    }
    if (rc) {
      s->sleeps[s->n] = read_sleeps(pid, tid);
      s->tid[s->n++] = tid;
    }
  }
  closedir(d);
  return 0;
}

/* Per thread of a daemon over a window: the shares of the wall clock it
 * was runnable and on a CPU, in %. */
typedef struct shares {
  size_t n;
  pid_t tid[MAX_THREADS];
  unsigned runnable[MAX_THREADS];
  unsigned cpu[MAX_THREADS];
  uint64_t sleeps[MAX_THREADS];   /* in the window */
} shares;

static void compare(const sample *a, const sample *b, shares *out) {
  uint64_t wall_ns = (b->at_ms - a->at_ms) * 1000000ull;
  out->n = 0;
  if (wall_ns == 0) wall_ns = 1;
  for (size_t i = 0; i < b->n; i++)
    for (size_t j = 0; j < a->n; j++) {
      if (a->tid[j] != b->tid[i]) continue;
      uint64_t run = b->run_ns[i] - a->run_ns[j], wait = b->wait_ns[i] - a->wait_ns[j];
      out->tid[out->n] = b->tid[i];
      out->runnable[out->n] = (unsigned)((run + wait) * 100 / wall_ns);
      out->cpu[out->n] = (unsigned)(run * 100 / wall_ns);
      out->sleeps[out->n] = b->sleeps[i] - a->sleeps[j];
      out->n++;
    }
}

/* Both daemons' threads over one window in which they are idle. The wait
 * here is the measurement's window, not a synchronisation. */
static int measure(h_pair *p, shares *pre, shares *dec) {
  static sample a1, b1, a2, b2;
  if (take_sample(p->prefill.pid, &a1) || take_sample(p->decode.pid, &b1)) return -1;
  h_sleep_ms(WINDOW_MS);
  if (take_sample(p->prefill.pid, &a2) || take_sample(p->decode.pid, &b2)) return -1;
  compare(&a1, &a2, pre);
  compare(&b1, &b2, dec);
  return 0;
}

static void report(const char *name, const char *mode, pid_t pid, const shares *s) {
  fprintf(stderr, "note: %s, busy-poll %s, per thread runnable%%/on-CPU%%/sleeps in %d ms:", name,
          mode, WINDOW_MS);
  for (size_t i = 0; i < s->n; i++)
    fprintf(stderr, " %s%d %u/%u/%llu", s->tid[i] == pid ? "loop:" : "", (int)s->tid[i],
            s->runnable[i], s->cpu[i], (unsigned long long)s->sleeps[i]);
  fprintf(stderr, "\n");
}

/* The index of the loop thread (tid == pid) in s, or -1 (said). */
static int loop_thread(const char *name, pid_t pid, const shares *s) {
  for (size_t i = 0; i < s->n; i++)
    if (s->tid[i] == pid) return (int)i;
  return h_fail("%s's loop thread %d not found in /proc", name, (int)pid);
}

/* Fails unless an idle daemon without busy-poll sleeps (see the top). */
static int check_sleeps(const char *name, pid_t pid, const shares *s) {
  int l = loop_thread(name, pid, s);
  if (l < 0) return -1;
  if (s->sleeps[l] < IDLE_MIN_SLEEPS || s->sleeps[l] > IDLE_MAX_SLEEPS)
    return h_fail("busy-poll no: %s's idle loop slept %llu times in %d ms (expected %d to %d: "
                  "once per timer)",
                  name, (unsigned long long)s->sleeps[l], WINDOW_MS, IDLE_MIN_SLEEPS,
                  IDLE_MAX_SLEEPS);
  for (size_t i = 0; i < s->n; i++)
    if (s->runnable[i] > RUNNABLE_SPLIT_PCT)
      return h_fail("busy-poll no: %s's thread %d was runnable %u%% of %d idle ms (at most %d%% "
                    "expected: it should sleep)",
                    name, (int)s->tid[i], s->runnable[i], WINDOW_MS, RUNNABLE_SPLIT_PCT);
  return 0;
}

/* Fails unless the loop of an idle busy-poll daemon spins (see the top). */
static int check_spins(const char *name, pid_t pid, const shares *s) {
  int l = loop_thread(name, pid, s);
  if (l < 0) return -1;
  if (s->sleeps[l] > SPIN_MAX_SLEEPS)
    return h_fail("busy-poll yes: %s's idle loop slept %llu times in %d ms (at most %d expected: "
                  "it should spin)",
                  name, (unsigned long long)s->sleeps[l], WINDOW_MS, SPIN_MAX_SLEEPS);
  if (s->runnable[l] < RUNNABLE_SPLIT_PCT)
    return h_fail("busy-poll yes: %s's idle loop was runnable only %u%% of %d ms (at least %d%% "
                  "expected: it should spin)",
                  name, s->runnable[l], WINDOW_MS, RUNNABLE_SPLIT_PCT);
  return 0;
}

static int pair_down(void **state) {
  if (!up) return 0;
  up = false;
  return h_pair_stop(&P);
}

/* One verified transfer, then both daemons' threads while idle. */
static void run_pair(const char *extra, shares *pre, shares *dec) {
  h_client cp, cd;
  H_OK(h_pair_start_ex(&P, "16M", NULL, extra));
  up = true;
  H_OK(h_client_open(&cp, &P.prefill));
  H_OK(h_client_open(&cd, &P.decode));
  H_OK(h_quick(&cp, &cd));
  h_client_close(&cp);
  h_client_close(&cd);
  H_OK(measure(&P, pre, dec));
  const char *mode = extra ? "yes" : "no";
  report("prefill", mode, P.prefill.pid, pre);
  report("decode", mode, P.decode.pid, dec);
  if (extra) {
    H_OK(check_spins("prefill", P.prefill.pid, pre));
    H_OK(check_spins("decode", P.decode.pid, dec));
  } else {
    H_OK(check_sleeps("prefill", P.prefill.pid, pre));
    H_OK(check_sleeps("decode", P.decode.pid, dec));
  }
  up = false;
  H_OK(h_pair_stop(&P)); /* exit 0 on SIGTERM, spinning or not */
}

static void test_busy_poll(void **state) {
  static shares pre, dec;
  if (access("/proc/self/schedstat", R_OK) != 0) {
    fprintf(stderr, "note: SKIPPED: no /proc/PID/schedstat (kernel without CONFIG_SCHED_INFO)\n");
    skip();
  }
  run_pair(NULL, &pre, &dec);
  run_pair("busy-poll yes", &pre, &dec);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_busy_poll, pair_down),
  };
  h_init();
  return h_cleanup(cmocka_run_group_tests_name("busy poll", tests, NULL, NULL));
}
