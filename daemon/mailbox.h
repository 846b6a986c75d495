/* mailbox.h - the one way a thread hands work to the loop.
 *
 * Transport threads (tcp senders and receivers, rdma progress threads, the
 * GPU completion thread) never touch loop state. They post a kvf__mail,
 * embedded in whatever they want to hand over (a completion, an event); the
 * loop runs each mail's callback, in the order the mails were posted, after
 * a uv_async wake-up. Wake-ups coalesce (several posts, one callback run),
 * so the loop takes the whole queue under the lock and runs it unlocked, as
 * libuv's own thread pool does (uv__work_done).
 *
 * While the loop spins (spin.h), it polls every open mailbox on each pass
 * instead: a post then skips the uv_async wake-up (an eventfd write on the
 * posting thread, an epoll round and an eventfd read on the loop), which
 * lay on every handoff's path (a tcp receiver's landing, a sender's
 * completion). A loop that stops spinning says so before it blocks, and
 * looks at the mailboxes once more (both sides sequentially consistent: a
 * post either sees the loop blocking and wakes it, or is seen). The list
 * of open mailboxes is the process's: one loop (the daemon's) inits and
 * closes them.
 *
 * The mail's owner finds itself from the mail with kvf__container_of. */
#ifndef KVF_MAILBOX_H
#define KVF_MAILBOX_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <uv.h>

#define kvf__container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

typedef struct kvf__mail kvf__mail;
typedef void (*kvf__mail_cb)(kvf__mail *m);

struct kvf__mail {
  kvf__mail *next;
  kvf__mail_cb cb;              /* runs on the loop; may free the mail */
};

typedef struct kvf__mailbox {
  uv_async_t async;
  pthread_mutex_t lock;
  kvf__mail *head, *tail;       /* under lock */
  atomic_bool queued;           /* head != NULL: read by the polling loop without the lock */
  bool open;                    /* loop: the async handle is initialised, not closed */
  struct kvf__mailbox *poll_next, **poll_prev; /* loop: the open mailboxes */
  void (*closed)(struct kvf__mailbox *mb);
} kvf__mailbox;

/* Loop thread. Like any uv_async_t, the handle keeps the loop running
 * until it is closed, unless kvf__mailbox_hold(mb, false) says otherwise. */
int kvf__mailbox_init(kvf__mailbox *mb, uv_loop_t *loop);
/* Any thread: queue m; cb(m) runs on the loop. Never fails. */
void kvf__mailbox_post(kvf__mailbox *mb, kvf__mail *m, kvf__mail_cb cb);
/* Loop thread: run every mail queued now (e.g. before tearing down what
 * the mails point to). */
void kvf__mailbox_drain(kvf__mailbox *mb);
/* Loop thread: whether the handle keeps the loop running (while work whose
 * answer comes by mail is out). */
void kvf__mailbox_hold(kvf__mailbox *mb, bool hold);
/* Loop thread (spin.c): while on, the loop polls the mailboxes
 * (kvf__mailbox_poll) and posts skip the async wake-up. Turning it off
 * returns whether mail is queued somewhere (then the loop must not block
 * yet: poll again, or turn it back on). */
bool kvf__mailbox_polling(bool on);
/* Loop thread: runs the mail queued in every open mailbox; whether there
 * was any. */
bool kvf__mailbox_poll(void);
/* Loop thread: drains what is queued, then closes the handle; closed(mb),
 * when not NULL, runs once the handle is closed (the mailbox's memory may
 * go then, not before). Mails posted afterwards are never run: the caller
 * stops its threads first. */
void kvf__mailbox_close(kvf__mailbox *mb, void (*closed)(kvf__mailbox *mb));

#endif
