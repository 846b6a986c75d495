/* mailbox.c - threads to the loop (mailbox.h). */
#include "mailbox.h"

#include "spin.h"

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
  return 0;
}

void kvf__mailbox_post(kvf__mailbox *mb, kvf__mail *m, kvf__mail_cb cb) {
  m->next = NULL;
  m->cb = cb;
  pthread_mutex_lock(&mb->lock);
  if (mb->tail) mb->tail->next = m;
  else mb->head = m;
  mb->tail = m;
  pthread_mutex_unlock(&mb->lock);
  uv_async_send(&mb->async);
}

void kvf__mailbox_drain(kvf__mailbox *mb) {
  pthread_mutex_lock(&mb->lock);
  kvf__mail *m = mb->head;
  mb->head = mb->tail = NULL;
  pthread_mutex_unlock(&mb->lock);
  while (m) {
    kvf__mail *next = m->next; /* cb may free m */
    m->cb(m);
    m = next;
  }
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
  mb->closed = closed;
  uv_close((uv_handle_t *)&mb->async, on_closed);
}
