/* mailbox.c - threads to the loop (mailbox.h). */
#include "mailbox.h"

#include "spin.h"

/* Loop thread: every open mailbox, for the polling loop. */
static kvf__mailbox *polled;
/* The loop polls the mailboxes now: posts need not wake it. */
static atomic_bool loop_polls;

static void on_wake(uv_async_t *a) {
  kvf__spin_loop_active(); /* more mail is likely soon: the loop polls a while */
  kvf__mailbox_drain(a->data);
}

int kvf__mailbox_init(kvf__mailbox *mb, uv_loop_t *loop) {
  mb->head = mb->tail = NULL;
  pthread_mutex_init(&mb->lock, NULL);
  int rc = uv_async_init(loop, &mb->async, on_wake);
  if (rc) {
    pthread_mutex_destroy(&mb->lock);
    return rc;
  }
  mb->async.data = mb;
  mb->open = true;
  atomic_init(&mb->queued, false);
  mb->poll_next = polled;
  mb->poll_prev = &polled;
  if (polled) polled->poll_prev = &mb->poll_next;
  polled = mb;
  return 0;
}

void kvf__mailbox_post(kvf__mailbox *mb, kvf__mail *m, kvf__mail_cb cb) {
  m->next = NULL;
  m->cb = cb;
  pthread_mutex_lock(&mb->lock);
  if (mb->tail) mb->tail->next = m;
  else mb->head = m;
  mb->tail = m;
  atomic_store_explicit(&mb->queued, true, memory_order_relaxed);
  pthread_mutex_unlock(&mb->lock);
  /* Pairs with the fence in kvf__mailbox_polling(false): either this sees
   * the loop about to block, or the loop sees queued. */
  atomic_thread_fence(memory_order_seq_cst);
  if (!atomic_load_explicit(&loop_polls, memory_order_relaxed)) uv_async_send(&mb->async);
}

void kvf__mailbox_drain(kvf__mailbox *mb) {
  pthread_mutex_lock(&mb->lock);
  kvf__mail *m = mb->head;
  mb->head = mb->tail = NULL;
  atomic_store_explicit(&mb->queued, false, memory_order_relaxed);
  pthread_mutex_unlock(&mb->lock);
  while (m) {
    kvf__mail *next = m->next; /* cb may free m */
    m->cb(m);
    m = next;
  }
}

bool kvf__mailbox_polling(bool on) {
  atomic_store_explicit(&loop_polls, on, memory_order_relaxed);
  if (on) return false;
  atomic_thread_fence(memory_order_seq_cst);
  for (kvf__mailbox *mb = polled; mb; mb = mb->poll_next)
    if (atomic_load_explicit(&mb->queued, memory_order_relaxed)) return true;
  return false;
}

bool kvf__mailbox_poll(void) {
  bool any = false;
  for (kvf__mailbox *mb = polled, *next; mb; mb = next) {
    next = mb->poll_next; /* a mail may close its own mailbox, never another's */
    if (!mb->open || !atomic_load_explicit(&mb->queued, memory_order_acquire)) continue;
    any = true;
    kvf__mailbox_drain(mb);
  }
  return any;
}

void kvf__mailbox_hold(kvf__mailbox *mb, bool hold) {
  if (hold) uv_ref((uv_handle_t *)&mb->async);
  else uv_unref((uv_handle_t *)&mb->async);
}

static void on_closed(uv_handle_t *h) {
  kvf__mailbox *mb = h->data;
  pthread_mutex_destroy(&mb->lock);
  if (mb->closed) mb->closed(mb);
}

void kvf__mailbox_close(kvf__mailbox *mb, void (*closed)(kvf__mailbox *mb)) {
  if (!mb->open) {
    if (closed) closed(mb);
    return;
  }
  kvf__mailbox_drain(mb);
  mb->open = false;
  *mb->poll_prev = mb->poll_next;
  if (mb->poll_next) mb->poll_next->poll_prev = mb->poll_prev;
  mb->closed = closed;
  uv_close((uv_handle_t *)&mb->async, on_closed);
}
