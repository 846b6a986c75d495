/* spin.h - bounded adaptive spinning: the daemon loop and the tcp
 * transport's threads poll for a while instead of sleeping, where the next
 * event is likely to come soon, so that a handoff does not pay a thread's
 * (and an idle CPU's) wake-up at each of its hops.
 *
 * A waiting point polls while its window is open:
 *   - spin-us after its own last activity (the loop: after it woke from a
 *     blocking wait or took mail from a thread; a tcp thread: after it
 *     moved data);
 *   - spin-grant-us after a grant was opened here (the loop and the tcp
 *     receivers) or a peer's grant reached us ahead of our send (the loop
 *     and the tcp senders): an engine grants a whole prefill before the
 *     send, and the data then finds every hop of its path awake;
 *   - spin-cadence-us either side of the moment the next part of a
 *     layer-wise send is due, at the cadence of its earlier parts (a
 *     prefill posts one per layer, a layer's compute apart: tens of ms at
 *     long prompts, when every thread slept since the last part);
 *   - always with busy-poll yes.
 * Once nothing happens for those windows, every waiting point blocks
 * again: an idle daemon uses no CPU. Spinning yields the CPU on each turn
 * (sched_yield), so on a machine with fewer cores than spinning threads the
 * ones with work still run; and a thread whose yield ran another task's
 * whole slice (its CPU is shared with busy work: engines computing, a
 * loaded node) backs off: it stops polling for a while, 5 ms doubling to
 * 1 s while that keeps happening, and blocks until its event or the
 * backoff's end (spin.c says why). Thread-safe unless said otherwise. */
#ifndef KVF_SPIN_H
#define KVF_SPIN_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

enum { KVF__SPIN_LOOP, KVF__SPIN_SEND, KVF__SPIN_RECV, KVF__SPIN_GPU, KVF__SPIN_N };

/* The parts of one send, as they came (loop thread; zeroed = none yet). */
typedef struct kvf__cadence {
  uint64_t last_ns; /* the last part; 0: none, or it was the last */
  uint64_t gap_ns;  /* between the last two parts; 0: one part so far */
} kvf__cadence;

/* A grant was opened here (recv) or a peer's grant came ahead of our send
 * (!recv): the loop and that side's threads poll for spin-grant-us. */
void kvf__spin_expect(bool recv);
/* Threads of a transport that sleep while their kind's window is closed
 * (KVF__SPIN_SEND or KVF__SPIN_RECV): each time kvf__spin_expect opens
 * that window from closed, wake(arg) is called on the loop thread, so
 * that they poll through it instead of sleeping until the data itself
 * wakes them (a grant posted ahead of its send: the wake-up is paid then,
 * off the handoff's path). Loop thread; at most KVF__SPIN_WAKERS. */
enum { KVF__SPIN_WAKERS = 8 };
typedef void (*kvf__spin_wake_fn)(void *arg);
int kvf__spin_wakers_add(int what, kvf__spin_wake_fn wake, void *arg);
/* Before the threads stop: every waker of arg goes. */
void kvf__spin_wakers_remove(void *arg);
/* A GPU copy was launched from the loop: its completion thread (gpu.c's
 * reaper) and the loop poll for spin-grant-us, so that the copy's end
 * reaches the client without two wake-ups (a kernel of a layer part takes
 * microseconds; a thread that slept takes tens to wake). */
void kvf__spin_expect_gpu(void);
/* Called on the loop as the polling window before a send's next part
 * opens (kvf__spin_part), with its arg and the window's length. */
typedef void (*kvf__spin_ahead_fn)(uint64_t arg, uint32_t window_us);

/* Loop thread: a part of the send whose cadence c is came at now_ns, and
 * more follow unless `last`. Once two parts gave a gap, the loop polls from
 * spin-cadence-us before the next part is due (one gap after this one)
 * until as long after, so that a part posted after a layer's compute finds
 * it awake. A part that does not come by then costs nothing more. `ahead`
 * (NULL: none) is called with arg when that window opens; not at all
 * without one (the first two parts, spin-cadence-us 0, busy-poll, a
 * stalled engine, CADENCE_SLOTS windows waiting already). */
void kvf__spin_part(kvf__cadence *c, bool last, uint64_t now_ns, kvf__spin_ahead_fn ahead, uint64_t arg);
/* Whether a waiting point of kind `what` whose last activity was at
 * last_ns (0: none) keeps polling now. */
bool kvf__spin_open(int what, uint64_t last_ns);
/* One turn of a polling wait of kind `what`: yields the CPU. A yield that
 * ran another task for a slice backs this thread off (kvf__spin_open then
 * says no until the backoff ends). */
void kvf__spin_relax(int what);
/* The epoll timeout of a blocking wait of kind `what` (its last activity
 * at last_ns) that would otherwise poll: timeout_ms (-1: none), or less
 * where only this thread's backoff keeps it from polling, up to the
 * backoff's end, so that it polls again then. */
int kvf__spin_wait_ms(int what, uint64_t last_ns, int timeout_ms);
/* The same wait on a condition (on the default, realtime clock):
 * pthread_cond_wait, or a timed wait up to the backoff's end. */
void kvf__spin_cond_wait(pthread_cond_t *cv, pthread_mutex_t *mu, int what, uint64_t last_ns);
/* The backoffs so far, by the kind of thread (KVF__SPIN_LOOP...). */
uint64_t kvf__spin_backoffs(int what);
/* A kind's name in status and metrics: "loop", "tcp_send", "tcp_recv",
 * "gpu". */
const char *kvf__spin_kind_name(int what);
/* Loop thread, at start: takes the settings (busy-poll, spin-us,
 * spin-grant-us, spin-cadence-us; none reloads) and makes the loop spin adaptively (a
 * uv_idle handle while its window is open). Handles are unreferenced: they
 * do not keep it alive. Before it, nothing spins. */
void kvf__spin_loop_start(uv_loop_t *loop);
/* After the loop closed its handles: the cadence's timerfd. */
void kvf__spin_loop_stop(void);
/* Loop thread: it took mail from a thread (mailbox.c). */
void kvf__spin_loop_active(void);

#endif
