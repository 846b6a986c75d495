/* test_mailbox.c - threads to the loop (daemon/mailbox.c): mails from
 * several threads all run on the loop thread, each thread's in the order it
 * posted them; drain runs what is queued without a wake-up; hold decides
 * whether the mailbox keeps the loop running; close drains first, then
 * calls back once the handle is closed; while the loop polls (spin.c) a
 * post wakes nobody and kvf__mailbox_poll runs it, and a loop that stops
 * polling never strands a mail posted meanwhile. Every test closes its
 * loop. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdlib.h>

#include "mailbox.h"

#define THREADS 4
#define PER_THREAD 5000

typedef struct note {
  kvf__mail mail;
  int thread, seq;
} note;

typedef struct box {
  kvf__mailbox mb;
  pthread_t loop_thread;
  int next[THREADS];      /* per thread: the seq expected next */
  int ran;
  bool out_of_order, off_loop;
  bool closed;
} box;

static box B;

static void on_note(kvf__mail *m) {
  note *n = kvf__container_of(m, note, mail);
  if (!pthread_equal(pthread_self(), B.loop_thread)) B.off_loop = true;
  if (n->seq != B.next[n->thread]) B.out_of_order = true;
  B.next[n->thread] = n->seq + 1;
  if (++B.ran == THREADS * PER_THREAD) kvf__mailbox_hold(&B.mb, false);
  free(n);
}

static void *poster(void *arg) {
  int t = (int)(intptr_t)arg;
  for (int i = 0; i < PER_THREAD; i++) {
    note *n = calloc(1, sizeof(*n));
    n->thread = t;
    n->seq = i;
    kvf__mailbox_post(&B.mb, &n->mail, on_note);
  }
  return NULL;
}

static void on_closed(kvf__mailbox *mb) { B.closed = true; }

static void test_threads_in_order_on_the_loop(void **state) {
  uv_loop_t loop;
  B = (box){.loop_thread = pthread_self()};
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(kvf__mailbox_init(&B.mb, &loop), 0);
  pthread_t th[THREADS];
  for (int i = 0; i < THREADS; i++) assert_int_equal(pthread_create(&th[i], NULL, poster, (void *)(intptr_t)i), 0);
  /* The held mailbox keeps the loop running until the last mail lets go. */
  uv_run(&loop, UV_RUN_DEFAULT);
  for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
  assert_int_equal(B.ran, THREADS * PER_THREAD);
  assert_false(B.out_of_order);
  assert_false(B.off_loop);
  kvf__mailbox_close(&B.mb, on_closed);
  assert_false(B.closed); /* only once the handle is closed */
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_true(B.closed);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_drain_and_close_run_what_is_queued(void **state) {
  uv_loop_t loop;
  B = (box){.loop_thread = pthread_self()};
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(kvf__mailbox_init(&B.mb, &loop), 0);
  for (int i = 0; i < 3; i++) {
    note *n = calloc(1, sizeof(*n));
    n->seq = i;
    kvf__mailbox_post(&B.mb, &n->mail, on_note);
  }
  kvf__mailbox_drain(&B.mb); /* no loop turn needed */
  assert_int_equal(B.ran, 3);
  note *last = calloc(1, sizeof(*last));
  last->seq = 3;
  kvf__mailbox_post(&B.mb, &last->mail, on_note);
  kvf__mailbox_close(&B.mb, on_closed);
  assert_int_equal(B.ran, 4); /* close delivered it */
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_true(B.closed);
  assert_false(B.out_of_order);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_unheld_mailbox_lets_the_loop_end(void **state) {
  uv_loop_t loop;
  B = (box){.loop_thread = pthread_self()};
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(kvf__mailbox_init(&B.mb, &loop), 0);
  kvf__mailbox_hold(&B.mb, false);
  assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0); /* returns at once: nothing alive */
  kvf__mailbox_close(&B.mb, on_closed);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_true(B.closed);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* While the loop polls, a post sends no wake-up: a non-blocking pass of
 * the loop does not run it, kvf__mailbox_poll does. Turning polling off
 * with mail queued says so; once off, posts wake the loop again. */
static void test_polling_loop_takes_mail_without_wakeup(void **state) {
  uv_loop_t loop;
  B = (box){.loop_thread = pthread_self()};
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(kvf__mailbox_init(&B.mb, &loop), 0);
  kvf__mailbox_polling(true);
  note *n = calloc(1, sizeof(*n));
  kvf__mailbox_post(&B.mb, &n->mail, on_note);
  uv_run(&loop, UV_RUN_NOWAIT);
  assert_int_equal(B.ran, 0); /* no wake-up was sent */
  assert_true(kvf__mailbox_poll());
  assert_int_equal(B.ran, 1);
  assert_false(kvf__mailbox_poll());
  n = calloc(1, sizeof(*n));
  n->seq = 1;
  kvf__mailbox_post(&B.mb, &n->mail, on_note);
  assert_true(kvf__mailbox_polling(false)); /* the loop must not block yet */
  assert_true(kvf__mailbox_poll());
  assert_int_equal(B.ran, 2);
  assert_false(kvf__mailbox_polling(false));
  n = calloc(1, sizeof(*n));
  n->seq = 2;
  kvf__mailbox_post(&B.mb, &n->mail, on_note);
  uv_run(&loop, UV_RUN_NOWAIT); /* polling off: the post woke the loop */
  assert_int_equal(B.ran, 3);
  assert_false(B.out_of_order);
  kvf__mailbox_close(&B.mb, on_closed);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_true(B.closed);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* A loop that switches between polling and blocking while threads post:
 * every mail runs, in order, and no blocking pass waits for a mail posted
 * as polling ended (a timer would fire: the test fails, not hangs). */
static bool stranded;
static void on_stranded(uv_timer_t *t) { stranded = true; }

static void test_polling_on_and_off_strands_nothing(void **state) {
  uv_loop_t loop;
  B = (box){.loop_thread = pthread_self()};
  stranded = false;
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(kvf__mailbox_init(&B.mb, &loop), 0);
  uv_timer_t watch;
  uv_timer_init(&loop, &watch);
  pthread_t th[THREADS];
  for (int i = 0; i < THREADS; i++) assert_int_equal(pthread_create(&th[i], NULL, poster, (void *)(intptr_t)i), 0);
  for (unsigned turn = 0; B.ran < THREADS * PER_THREAD && !stranded; turn++) {
    if (turn % 2) {
      kvf__mailbox_polling(true);
      for (int k = 0; k < 16; k++) kvf__mailbox_poll();
    } else if (!kvf__mailbox_polling(false)) {
      if (B.ran == THREADS * PER_THREAD) break;
      /* Blocks until a wake-up: a mail missed by both sides never sends one. */
      uv_timer_start(&watch, on_stranded, 5000, 0);
      uv_run(&loop, UV_RUN_ONCE);
      uv_timer_stop(&watch);
    }
  }
  for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
  kvf__mailbox_polling(false);
  kvf__mailbox_poll();
  assert_false(stranded);
  assert_int_equal(B.ran, THREADS * PER_THREAD);
  assert_false(B.out_of_order);
  assert_false(B.off_loop);
  uv_close((uv_handle_t *)&watch, NULL);
  kvf__mailbox_close(&B.mb, on_closed);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_true(B.closed);
  assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_threads_in_order_on_the_loop),
      cmocka_unit_test(test_drain_and_close_run_what_is_queued),
      cmocka_unit_test(test_unheld_mailbox_lets_the_loop_end),
      cmocka_unit_test(test_polling_loop_takes_mail_without_wakeup),
      cmocka_unit_test(test_polling_on_and_off_strands_nothing),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
