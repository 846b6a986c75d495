/* spin.c - bounded adaptive spinning (spin.h). */
#include "spin.h"

#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "kvferryd.h"
#include "log.h"
#include "mailbox.h"
#include "metrics.h"

/* Per kind, until when (CLOCK_MONOTONIC ns) a grant keeps it polling. */
static _Atomic uint64_t expect_until[KVF__SPIN_N];
/* The settings, read by the threads: taken at start (none reloads), so a
 * SIGHUP rewriting kvfd.cfg under them is no race. */
static _Atomic uint64_t own_ns, grant_ns;
static atomic_bool always;
/* Backing off where the CPUs are busy. Where other tasks wait for the CPU,
 * a poller takes it from them (the threads that move the data, the
 * engines), and on EEVDF (Linux 6.6 on) each sched_yield that lets another
 * task run moves the yielder's deadline a slice later: pollers fell behind
 * busy tasks while holding the work they polled for (2 CPUs, 2 busy loops:
 * 64 KiB handoffs at 8 ms, against 0.2 ms with spinning off). A yield that
 * took CONTENDED_NS or more ran another task's whole slice: the thread
 * stops polling for BACKOFF_NS and blocks (woken by its event, and placed
 * fairly), then polls again if its window is still open. If it meets such
 * a yield again within CALM_NS of its last backoff's end, the CPU stays
 * busy: the backoff doubles, up to BACKOFF_MAX_NS. A yield among
 * kvferry's own pollers comes back in microseconds (each yields at once),
 * and a thread alone on its CPU yields to no one (the kernel skips it):
 * those go on polling. A thread blocked by its backoff resumes at its end
 * (backoff_left_ns): one that stayed blocked for the rest of its
 * window missed the next grant's data whenever one slow yield fell into
 * it (2 CPUs under ASan, 8 pollers). */
#define CONTENDED_NS 1000000ull
#define BACKOFF_NS 5000000ull
#define BACKOFF_MAX_NS 1000000000ull
#define CALM_NS 50000000ull
static _Thread_local uint64_t backoff_until, backoff_ns;
static _Atomic uint64_t backoffs[KVF__SPIN_N];

/* The loop's last activity, and whether it polls now (loop thread only). */
static uint64_t loop_last;
static bool spinning;

static void extend(int what, uint64_t until) {
  uint64_t cur = atomic_load_explicit(&expect_until[what], memory_order_relaxed);
  while (cur < until &&
         !atomic_compare_exchange_weak_explicit(&expect_until[what], &cur, until, memory_order_relaxed,
                                                memory_order_relaxed)) {
  }
}

static struct {
  int what;
  kvf__spin_wake_fn wake;
  void *arg;
} wakers[KVF__SPIN_WAKERS];
static unsigned n_wakers;

int kvf__spin_wakers_add(int what, kvf__spin_wake_fn wake, void *arg) {
  if (n_wakers == KVF__SPIN_WAKERS) return -ENOSPC;
  wakers[n_wakers].what = what;
  wakers[n_wakers].wake = wake;
  wakers[n_wakers++].arg = arg;
  return 0;
}

void kvf__spin_wakers_remove(void *arg) {
  for (unsigned i = 0; i < n_wakers;)
    if (wakers[i].arg == arg) wakers[i] = wakers[--n_wakers];
    else i++;
}

void kvf__spin_expect(bool recv) {
  uint64_t win = atomic_load_explicit(&grant_ns, memory_order_relaxed);
  if (!win) return;
  int what = recv ? KVF__SPIN_RECV : KVF__SPIN_SEND;
  uint64_t now = kvf__now_ns(), until = now + win;
  bool was_open = atomic_load_explicit(&expect_until[what], memory_order_relaxed) > now;
  extend(KVF__SPIN_LOOP, until);
  extend(what, until);
  if (was_open || atomic_load_explicit(&always, memory_order_relaxed)) return;
  for (unsigned i = 0; i < n_wakers; i++)
    if (wakers[i].what == what) wakers[i].wake(wakers[i].arg);
}

void kvf__spin_expect_gpu(void) {
  uint64_t win = atomic_load_explicit(&grant_ns, memory_order_relaxed);
  if (!win) return;
  uint64_t until = kvf__now_ns() + win;
  extend(KVF__SPIN_LOOP, until);
  extend(KVF__SPIN_GPU, until);
}

bool kvf__spin_open(int what, uint64_t last_ns) {
  if (atomic_load_explicit(&always, memory_order_relaxed)) return true;
  uint64_t own = atomic_load_explicit(&own_ns, memory_order_relaxed);
  uint64_t grant = atomic_load_explicit(&expect_until[what], memory_order_relaxed);
  if (!own && !grant) return false;
  uint64_t now = kvf__now_ns();
  if (now < backoff_until) return false;
  return (own && last_ns && now - last_ns < own) || now < grant;
}

void kvf__spin_relax(int what) {
  uint64_t t0 = kvf__now_ns();
  sched_yield();
  uint64_t t1 = kvf__now_ns();
  if (t1 - t0 < CONTENDED_NS || atomic_load_explicit(&always, memory_order_relaxed)) return;
  bool again = backoff_ns && t0 - backoff_until < CALM_NS;
  backoff_ns = !again ? BACKOFF_NS : backoff_ns * 2 > BACKOFF_MAX_NS ? BACKOFF_MAX_NS : backoff_ns * 2;
  backoff_until = t1 + backoff_ns;
  atomic_fetch_add_explicit(&backoffs[what], 1, memory_order_relaxed);
}

/* How long a blocking wait of kind `what` (its last activity at last_ns)
 * that would otherwise poll may block before it polls again: the rest of
 * this thread's backoff, where only the backoff keeps it from polling;
 * 0: block until the event. */
static uint64_t backoff_left_ns(int what, uint64_t last_ns) {
  uint64_t now = kvf__now_ns();
  if (!backoff_until || now >= backoff_until) return 0;
  uint64_t own = atomic_load_explicit(&own_ns, memory_order_relaxed);
  uint64_t open_until = atomic_load_explicit(&expect_until[what], memory_order_relaxed);
  if (own && last_ns && last_ns + own > open_until) open_until = last_ns + own;
  return open_until > backoff_until ? backoff_until - now : 0;
}

int kvf__spin_wait_ms(int what, uint64_t last_ns, int timeout_ms) {
  uint64_t left = backoff_left_ns(what, last_ns);
  if (!left) return timeout_ms;
  uint64_t ms = (left + 999999) / 1000000;
  return timeout_ms >= 0 && (uint64_t)timeout_ms < ms ? timeout_ms : (int)ms;
}

void kvf__spin_cond_wait(pthread_cond_t *cv, pthread_mutex_t *mu, int what, uint64_t last_ns) {
  uint64_t left = backoff_left_ns(what, last_ns);
  if (!left) {
    pthread_cond_wait(cv, mu);
    return;
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t at = (uint64_t)ts.tv_nsec + left;
  ts.tv_sec += (time_t)(at / 1000000000ull);
  ts.tv_nsec = (long)(at % 1000000000ull);
  pthread_cond_timedwait(cv, mu, &ts);
}

uint64_t kvf__spin_backoffs(int what) { return atomic_load_explicit(&backoffs[what], memory_order_relaxed); }

const char *kvf__spin_kind_name(int what) {
  static const char *const names[KVF__SPIN_N] = {"loop", "tcp_send", "tcp_recv", "gpu"};
  return what >= 0 && what < KVF__SPIN_N ? names[what] : "?";
}

void kvf__spin_loop_active(void) { loop_last = kvf__now_ns(); }

/* Layer-wise sends' next parts: windows [start, end] around the moment
 * each is due, in which the loop should poll (loop thread). At most
 * CADENCE_SLOTS wait for their start; a send beyond them goes without (its
 * parts still come, a wake-up later). A timerfd, not a libuv timer (whole
 * milliseconds), wakes the loop at the earliest start. */
enum { CADENCE_SLOTS = 64 };
/* A longer gap is an engine that stalled, not a layer's compute. */
#define CADENCE_MAX_GAP_NS (10ull * 1000000000ull)
static struct {
  uint64_t start, end;
  kvf__spin_ahead_fn ahead;
  uint64_t arg;
} pending[CADENCE_SLOTS];
static unsigned n_pending;
static uint64_t cadence_ns;   /* spin-cadence-us; 0: off */
static uint64_t armed_ns;     /* the timerfd's expiry; 0: disarmed */
static int cadence_fd = -1;
static uv_poll_t cadence_poll;
/* kvferry_spin_cadence_*: windows opened, and the parts that a cadence
 * announced, by how they found the loop. */
static uint64_t n_windows, n_polled, n_woken;

static void cadence_arm(void) {
  uint64_t first = n_pending ? UINT64_MAX : 0;
  for (unsigned i = 0; i < n_pending; i++)
    if (pending[i].start < first) first = pending[i].start;
  if (first == armed_ns) return;
  struct itimerspec its = {0}; /* all zero disarms it */
  its.it_value.tv_sec = (time_t)(first / 1000000000ull);
  its.it_value.tv_nsec = (long)(first % 1000000000ull);
  if (timerfd_settime(cadence_fd, TFD_TIMER_ABSTIME, &its, NULL) == 0) armed_ns = first;
}

/* The timerfd fired: the windows that started open the loop's. */
static void cadence_fired(uv_poll_t *h, int status, int events) {
  uint64_t expirations;
  (void)!read(cadence_fd, &expirations, sizeof expirations);
  uint64_t now = kvf__now_ns();
  for (unsigned i = 0; i < n_pending;) {
    if (pending[i].start > now) {
      i++;
      continue;
    }
    kvf__spin_ahead_fn ahead = pending[i].ahead;
    uint64_t arg = pending[i].arg, end = pending[i].end;
    extend(KVF__SPIN_LOOP, end);
    pending[i] = pending[--n_pending];
    if (ahead) ahead(arg, (uint32_t)((end - now) / 1000));
  }
  armed_ns = 0;
  cadence_arm();
}

static void cadence_expect(uint64_t start, uint64_t end, kvf__spin_ahead_fn ahead, uint64_t arg) {
  uint64_t now = kvf__now_ns();
  if (start <= now) {
    extend(KVF__SPIN_LOOP, end);
    n_windows++;
    if (ahead) ahead(arg, (uint32_t)((end - now) / 1000));
    return;
  }
  if (n_pending == CADENCE_SLOTS || cadence_fd < 0) return;
  n_windows++;
  pending[n_pending].start = start;
  pending[n_pending].end = end;
  pending[n_pending].ahead = ahead;
  pending[n_pending++].arg = arg;
  cadence_arm();
}

static void cadence_metrics(kvf__sbuf *b) {
  kvf__metrics_family(b, "kvferry_spin_cadence_windows_total", "counter",
                      "Polling windows opened ahead of the next part of a layer-wise send (spin-cadence-us).");
  kvf__sb_printf(b, "kvferry_spin_cadence_windows_total %llu\n", (unsigned long long)n_windows);
  kvf__metrics_family(b, "kvferry_spin_cadence_parts_total", "counter",
                      "Parts of layer-wise sends that came at a known cadence (the third part on), by whether "
                      "the loop was polling or had to be woken.");
  kvf__sb_printf(b, "kvferry_spin_cadence_parts_total{loop=\"polling\"} %llu\n", (unsigned long long)n_polled);
  kvf__sb_printf(b, "kvferry_spin_cadence_parts_total{loop=\"woken\"} %llu\n", (unsigned long long)n_woken);
  kvf__metrics_family(b, "kvferry_spin_backoffs_total", "counter",
                      "Times a polling thread found its CPU shared with busy work (a yield ran another task's "
                      "slice) and stopped polling for a while, by thread.");
  for (int i = 0; i < KVF__SPIN_N; i++)
    kvf__sb_printf(b, "kvferry_spin_backoffs_total{thread=\"%s\"} %llu\n", kvf__spin_kind_name(i),
                   (unsigned long long)kvf__spin_backoffs(i));
}

void kvf__spin_part(kvf__cadence *c, bool last, uint64_t now, kvf__spin_ahead_fn ahead, uint64_t arg) {
  if (c->gap_ns) ++*(spinning ? &n_polled : &n_woken);
  c->gap_ns = c->last_ns ? now - c->last_ns : 0;
  c->last_ns = last ? 0 : now;
  if (last || !c->gap_ns || c->gap_ns > CADENCE_MAX_GAP_NS || !cadence_ns ||
      atomic_load_explicit(&always, memory_order_relaxed))
    return;
  uint64_t due = now + c->gap_ns;
  cadence_expect(due - (cadence_ns < c->gap_ns ? cadence_ns : c->gap_ns), due + cadence_ns, ahead, arg);
}

static void cadence_start(uv_loop_t *loop) {
  kvf__metrics_add_collector(cadence_metrics);
  cadence_ns = (uint64_t)kvfd.cfg.spin_cadence_us * 1000;
  if (!cadence_ns || kvfd.cfg.busy_poll) return;
  cadence_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (cadence_fd < 0 || uv_poll_init(loop, &cadence_poll, cadence_fd) != 0) {
    kvf__warn("spin-cadence-us: no timerfd (%s): layer-wise parts find the loop asleep", strerror(errno));
    if (cadence_fd >= 0) close(cadence_fd);
    cadence_fd = -1;
    return;
  }
  uv_unref((uv_handle_t *)&cadence_poll);
  uv_poll_start(&cadence_poll, UV_READABLE, cadence_fired);
}

void kvf__spin_loop_stop(void) {
  if (cadence_fd >= 0) close(cadence_fd);
  cadence_fd = -1;
}

static uv_idle_t idle;
static uv_prepare_t prepare;
static uv_check_t check;
static uv_timer_t resume_timer;

/* The loop backed off with its window still open: the timer wakes it at the
 * backoff's end, and its next pass polls again (on_prepare). */
static void on_resume(uv_timer_t *h) {}

static void arm_resume(void) {
  int ms = kvf__spin_wait_ms(KVF__SPIN_LOOP, loop_last, -1);
  if (ms >= 0) uv_timer_start(&resume_timer, on_resume, (uint64_t)ms, 0);
}

/* Each pass while spinning: the threads' mail, without their wake-ups
 * (mailbox.h). */
static void spin_once(uv_idle_t *h) {
  if (kvf__mailbox_poll()) kvf__spin_loop_active();
}

/* Before each wait for events: poll (an active idle handle makes libuv's
 * wait non-blocking) while the window is open, else block. */
static void on_prepare(uv_prepare_t *h) {
  bool want = kvf__spin_open(KVF__SPIN_LOOP, loop_last);
  if (want == spinning) return;
  if (!want && kvf__mailbox_polling(false)) { /* mail came as the window closed */
    kvf__mailbox_polling(true);
    return; /* spin_once takes it on the next pass */
  }
  spinning = want;
  if (want) {
    kvf__mailbox_polling(true);
    uv_idle_start(&idle, spin_once);
  } else {
    uv_idle_stop(&idle);
    arm_resume();
  }
}

/* After the wait: a blocking wait that returned means something happened
 * (a request, a peer's message, a timer): the loop is active. */
static void on_check(uv_check_t *h) {
  if (!spinning) loop_last = kvf__now_ns();
  else kvf__spin_relax(KVF__SPIN_LOOP);
}

void kvf__spin_loop_start(uv_loop_t *loop) {
  atomic_store(&own_ns, (uint64_t)kvfd.cfg.spin_us * 1000);
  atomic_store(&grant_ns, (uint64_t)kvfd.cfg.spin_grant_us * 1000);
  atomic_store(&always, kvfd.cfg.busy_poll);
  uv_idle_init(loop, &idle);
  uv_prepare_init(loop, &prepare);
  uv_check_init(loop, &check);
  uv_unref((uv_handle_t *)&idle);
  uv_unref((uv_handle_t *)&prepare);
  uv_unref((uv_handle_t *)&check);
  uv_timer_init(loop, &resume_timer);
  uv_unref((uv_handle_t *)&resume_timer);
  uv_prepare_start(&prepare, on_prepare);
  uv_check_start(&check, on_check);
  cadence_start(loop);
  if (kvfd.cfg.busy_poll) kvf__info("busy-poll: the loop, the tcp threads and the rdma progress threads spin");
}
