/* wake_bench - what one wake-up costs on this machine, the unit a 1-block
 * handoff is made of: a handoff crosses five sleeping waiters (engine ->
 * sender's loop -> its progress thread -> [the NIC] -> receiver's progress
 * thread -> its loop -> engine), each woken the way measured here:
 *
 *   thread   a thread blocked in epoll_wait on an eventfd, woken by another
 *            thread's write (the loop waking a progress thread, a progress
 *            thread's uv_async to the loop)
 *   process  a process blocked in poll on a Unix socket, woken by another
 *            process's write (engine <-> daemon)
 *
 * Each is a ping-pong: one-way = round trip / 2, p50 over N round trips,
 * back to back and again with GAP_MS of idleness before each (everything
 * asleep, as when a grant was posted a prefill ahead).
 *
 *   wake-bench [N GAP_MS]      (defaults 400 20)
 *
 * Prints one JSON line. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void nap_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static double p50_us(uint64_t *v, size_t n) {
  qsort(v, n, sizeof(*v), cmp_u64);
  return (double)v[n / 2] / 2e3; /* one way: half the round trip */
}

/* ---- thread: epoll on an eventfd, as the progress threads sleep */

typedef struct waiter {
  int in, out;            /* eventfds: woken by in, answers on out */
  size_t n;
} waiter;

static void wait_efd(int ep, int efd) {
  struct epoll_event ev;
  while (epoll_wait(ep, &ev, 1, -1) != 1) {}
  uint64_t v;
  if (read(efd, &v, sizeof(v)) != sizeof(v)) abort();
}

static void kick(int efd) {
  uint64_t one = 1;
  if (write(efd, &one, sizeof(one)) != sizeof(one)) abort();
}

static int epoll_on(int fd) {
  int ep = epoll_create1(0);
  struct epoll_event ev = {.events = EPOLLIN};
  if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) abort();
  return ep;
}

static void *echo_thread(void *arg) {
  waiter *w = arg;
  int ep = epoll_on(w->in);
  for (size_t i = 0; i < w->n; i++) {
    wait_efd(ep, w->in);
    kick(w->out);
  }
  close(ep);
  return NULL;
}

static double thread_wake(size_t n, unsigned gap_ms) {
  waiter w = {eventfd(0, 0), eventfd(0, 0), n};
  uint64_t *rt = malloc(n * sizeof(*rt));
  pthread_t t;
  if (w.in < 0 || w.out < 0 || !rt || pthread_create(&t, NULL, echo_thread, &w) != 0) abort();
  int ep = epoll_on(w.out);
  for (size_t i = 0; i < n; i++) {
    if (gap_ms) nap_ms(gap_ms);
    uint64_t t0 = now_ns();
    kick(w.in);
    wait_efd(ep, w.out);
    rt[i] = now_ns() - t0;
  }
  pthread_join(t, NULL);
  close(ep);
  close(w.in);
  close(w.out);
  double r = p50_us(rt, n);
  free(rt);
  return r;
}

/* ---- process: poll on a Unix socket, as engines and daemons sleep */

static void wait_sock(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  while (poll(&p, 1, -1) != 1) {}
  char c;
  if (read(fd, &c, 1) != 1) abort();
}

static double process_wake(size_t n, unsigned gap_ms) {
  int sv[2];
  uint64_t *rt = malloc(n * sizeof(*rt));
  if (!rt || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) abort();
  pid_t pid = fork();
  if (pid < 0) abort();
  if (pid == 0) {
    close(sv[0]);
    for (size_t i = 0; i < n; i++) {
      wait_sock(sv[1]);
      if (write(sv[1], "p", 1) != 1) _exit(1);
    }
    _exit(0);
  }
  close(sv[1]);
  for (size_t i = 0; i < n; i++) {
    if (gap_ms) nap_ms(gap_ms);
    uint64_t t0 = now_ns();
    if (write(sv[0], "p", 1) != 1) abort();
    wait_sock(sv[0]);
    rt[i] = now_ns() - t0;
  }
  int st;
  waitpid(pid, &st, 0);
  close(sv[0]);
  double r = p50_us(rt, n);
  free(rt);
  return r;
}

int main(int argc, char **argv) {
  size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 400;
  unsigned gap = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 10) : 20;
  if (n < 2 || gap > 10000) {
    fprintf(stderr, "usage: wake-bench [N (>= 2) GAP_MS (<= 10000)]\n");
    return 2;
  }
  size_t n_gap = n / 4 < 2 ? 2 : n / 4; /* the gaps make those slow: fewer */
  double th = thread_wake(n, 0), pr = process_wake(n, 0);
  double th_gap = thread_wake(n_gap, gap), pr_gap = process_wake(n_gap, gap);
  printf("{\"round_trips\": %zu, \"gap_ms\": %u, \"thread_us\": %.1f, \"process_us\": %.1f, "
         "\"thread_after_gap_us\": %.1f, \"process_after_gap_us\": %.1f}\n",
         n, gap, th, pr, th_gap, pr_gap);
  return 0;
}
