/* test_mailbox.c - threads to the loop (daemon/mailbox.c): mails from
 * several threads all run on the loop thread, each thread's in the order it
 * posted them; drain runs what is queued without a wake-up; hold decides
 * whether the mailbox keeps the loop running; close drains first, then
 * calls back once the handle is closed. Every test closes its loop. */
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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_threads_in_order_on_the_loop),
      cmocka_unit_test(test_drain_and_close_run_what_is_queued),
      cmocka_unit_test(test_unheld_mailbox_lets_the_loop_end),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
