/* spin.c - bounded adaptive spinning (spin.h). */
#include "spin.h"

#include <sched.h>
#include <stdatomic.h>

#include "kvferryd.h"
#include "mailbox.h"

/* Per kind, until when (CLOCK_MONOTONIC ns) a grant keeps it polling. */
static _Atomic uint64_t expect_until[KVF__SPIN_N];
/* The settings, read by the threads: taken at start (none reloads), so a
 * SIGHUP rewriting kvfd.cfg under them is no race. */
static _Atomic uint64_t own_ns, grant_ns;
static atomic_bool always;
/* The loop's last activity (loop thread only). */
static uint64_t loop_last;

static void extend(int what, uint64_t until) {
  uint64_t cur = atomic_load_explicit(&expect_until[what], memory_order_relaxed);
  while (cur < until &&
         !atomic_compare_exchange_weak_explicit(&expect_until[what], &cur, until, memory_order_relaxed,
                                                memory_order_relaxed)) {
  }
}

void kvf__spin_expect(bool recv) {
  uint64_t win = atomic_load_explicit(&grant_ns, memory_order_relaxed);
  if (!win) return;
  uint64_t until = kvf__now_ns() + win;
  extend(KVF__SPIN_LOOP, until);
  extend(recv ? KVF__SPIN_RECV : KVF__SPIN_SEND, until);
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
  return (own && last_ns && now - last_ns < own) || now < grant;
}

void kvf__spin_relax(void) { sched_yield(); }

void kvf__spin_loop_active(void) { loop_last = kvf__now_ns(); }

static uv_idle_t idle;
static uv_prepare_t prepare;
static uv_check_t check;
static bool spinning;

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
  }
}

/* After the wait: a blocking wait that returned means something happened
 * (a request, a peer's message, a timer): the loop is active. */
static void on_check(uv_check_t *h) {
  if (!spinning) loop_last = kvf__now_ns();
  else kvf__spin_relax();
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
  uv_prepare_start(&prepare, on_prepare);
  uv_check_start(&check, on_check);
  if (kvfd.cfg.busy_poll) kvf__info("busy-poll: the loop, the tcp threads and the rdma progress threads spin");
}
