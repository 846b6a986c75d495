/* libkvferry.c - the client side of the local API (see kvferry.h).
 *
 * One Unix stream connection to the node's kvferryd. Callers write request
 * frames (whole, under write_mu) and sleep until the response with their seq
 * arrives. One reader thread owns the inbound stream: it hands responses to
 * their waiters, queues events for kvf_wait_events / kvf_event_fd, and keeps
 * the fds that arrive by SCM_RIGHTS until the MapResp they belong to is read.
 * When the connection breaks, everything waiting wakes up with KVF_EDAEMON,
 * every transfer in flight gets its DONE event with KVF_EDAEMON, and the
 * reader reconnects (within reconnect_ms): it re-registers engine memory
 * and layouts and remaps daemon pools at the same addresses before calls
 * are taken again. The ids the engine holds are translated to the new
 * daemon's (client_int.h) wherever they go out.
 */
#include "kvferry.h"

#include "client_int.h"
#include "frame.h"
#include "kvferry.pb-c.h"
#include "libkvferry_cuda.h"

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <linux/sockios.h>
#include <unistd.h>

#define KVF_API __attribute__((visibility("default")))

#define DEFAULT_SOCKET "/run/kvferry/kvferryd.sock"
/* $KVFERRY_SPIN_US above this is taken as this (10 ms). */
#define KVF__SPIN_US_MAX 10000
/* $KVFERRY_GRANT_SPIN_US above this is taken as this (1 s). */
#define KVF__GRANT_SPIN_US_MAX 1000000
/* A daemon that accepts but never answers must not hang kvf_connect. */
#define HELLO_TIMEOUT_S 10
#define READ_CHUNK (64u * 1024)
/* DescList.packed (proto/kvferry.proto): one 20-byte little-endian record
 * per descriptor, u32 pool then u64 offset then u64 length. */
#define DESC_WIRE_SIZE 20u
/* fds received but not yet claimed by their frame: at most one per frame in
 * flight, so a handful is plenty; extras are closed, never leaked. */
#define INBOUND_FDS_MAX 16

/* A caller waiting for the response to its request; lives on its stack and
 * is linked into kvf_client.waiting while the request is in flight. */
struct pending {
  uint64_t seq;
  uint64_t gen;         /* the connection it went out on */
  bool done;
  Kvf__ApiMessage *msg; /* the response, once done */
  int fd;               /* the fd passed with it, or -1 */
  struct pending *next;
};

struct queued_event {
  kvf_event ev;
  struct queued_event *next;
};

/* The ids of this client's sends from their first part until their
 * SEND_DONE is taken (kvferry.h, "Transfer ids"): a part for one of them
 * continues that send (SendReq.continues), so that the daemon refuses it
 * once the send ended instead of starting a new one. A chained hash set. */
struct open_send {
  struct open_send *next;
  int count;            /* inflight: calls that opened it (a refused one undoes its own) */
  char id[];
};

#define OPEN_SENDS_BUCKETS 1024u

struct mapping {
  uint32_t pool;        /* the id the engine holds */
  void *addr;           /* host address, or a CUDA device pointer (gpu set) */
  uint64_t size;
  void *gpu;            /* cuda:N pools: libkvferry_cuda.c's state */
  struct mapping *next;
};

static void unmap(void *addr, uint64_t size, void *gpu) {
  if (gpu) kvf__cuda_unmap(gpu);
  else munmap(addr, size);
}

/* An fd received by SCM_RIGHTS. The daemon attaches it to the first byte of
 * its frame, so it belongs to a frame that starts inside the stream range
 * [first, end) of the read that brought it. */
struct passed_fd {
  int fd;
  uint64_t first, end;
};

/* The inbound stream. Touched only by the thread that reads the socket:
 * kvf_connect during hello, then the reader thread, then kvf_close after
 * joining it; so it needs no lock. */
struct inbound {
  kvf__framebuf fb;
  uint64_t received; /* stream bytes read so far */
  uint64_t consumed; /* stream offset where the next frame starts */
  struct passed_fd fds[INBOUND_FDS_MAX];
  size_t nfds;
};

/* Engine memory (kvf_mem_register), kept to register it again with a
 * daemon that restarted: the same memory, by the fd or export kept here. */
struct engine_mem {
  int kind;
  uintptr_t addr;
  uint64_t size;
  int fd;               /* host: the file; cuda: the VMM fd, else the
                           allocation's dmabuf (ex.dmabuf_fd) or -1 */
  bool vmm;             /* cuda: exported as a VMM fd, not an IPC handle */
  uint64_t offset;      /* in the fd (host) or the allocation (cuda) */
  kvf__cuda_export ex;  /* cuda */
};

/* A layout, kept to register it again after a restart; pool is the
 * engine's id. */
struct layout_copy {
  kvf_layout l;
  uint64_t offsets[];
};

enum conn_state {
  CONN_UP,   /* calls are taken */
  CONN_DOWN, /* broken; the reader is reconnecting: calls fail with KVF_EDAEMON */
  CONN_GONE, /* for good (kvf_close, no reconnect, or past reconnect_ms) */
};

struct kvf_client {
  /* Set up by kvf_connect before the reader starts; afterwards changed
   * only by the reader while it reconnects (sock under write_mu and mu). */
  int sock;
  uint64_t sock_gen;  /* under write_mu: the connection sock belongs to */
  int event_fd;
  char *socket_path;
  int reconnect_ms;   /* 0: never */
  char node[KVF_NAME_MAX + 1];
  uint32_t max_frame; /* largest frame either way */
  uint32_t max_descs; /* 0: the daemon set no limit */
  bool send_chains;   /* the daemon takes a send in chained frames */
  uint32_t chain_first, chain_max; /* descriptors per frame of a chained send */
  pthread_t reader;
  bool reader_started;
  struct inbound in;

  pthread_mutex_t write_mu; /* a request frame is written whole */
  uint8_t *wbuf;            /* under write_mu: frame buffer kept for the next request */
  size_t wcap;
  uint8_t *dbuf;            /* under write_mu: packed descriptors, kept likewise */
  size_t dcap;
  uint8_t *bbuf;            /* under write_mu: the frames of one kvf_submit, kept likewise */
  size_t bcap;

  pthread_mutex_t mu;        /* guards every field below */
  pthread_cond_t responded;  /* a response arrived, or the connection died */
  pthread_cond_t evented;    /* an event was queued, or the connection died */
  pthread_cond_t state_cv;   /* conn changed, or kvf_close began */
  enum conn_state conn;
  uint64_t gen;              /* counts connections: a break starts the next */
  bool closing;              /* kvf_close: stop reconnecting */
  bool event_fd_raised;      /* event_fd currently polls readable */
  uint64_t last_seq;
  struct pending *waiting;
  struct queued_event *ev_head, **ev_tail;
  struct mapping *maps;
  struct open_send *open_sends[OPEN_SENDS_BUCKETS];
  /* Grants ("g" + id) and sends ("s" + id) of this client whose DONE event
   * has not come: the ones that get KVF_EDAEMON when the connection breaks. */
  struct open_send *inflight[OPEN_SENDS_BUCKETS];
  kvf__ids pools;            /* data: struct engine_mem for engine memory */
  kvf__ids layouts;          /* data: struct layout_copy */
  uint32_t mem_seq;          /* default names of engine memory */
  /* kvf_wait_events spins this long for an event before it sleeps
   * ($KVFERRY_SPIN_US, read at connect); ev_count counts events told to
   * spinners once queued and mu released (events_told), so that a
   * spinning waiter sees one come without blocking on mu. */
  unsigned spin_us;
  bool soon_polls;              /* a Soon makes the reader and a waiter poll (soon_polls_here) */
  bool watch_spins;             /* a waiter woken by the socket spins for the reader (watch_for_event) */
  atomic_uint_fast64_t ev_count;
  /* Events queued (counted under mu, before the event fd is raised) and
   * taken, and conn as seen without mu: kvf_wait_events with no timeout
   * returns 0 without taking mu when nothing is queued (an engine polling
   * it in a busy loop would fight the reader thread for mu and sleep on
   * it). */
  atomic_uint_fast64_t ev_queued, ev_taken;
  atomic_int conn_seen;
  /* The reader thread polls the socket instead of sleeping in recv until
   * this time (CLOCK_MONOTONIC ns): spin_us after each read and after each
   * request written, so that the events a request leads to reach a waiter
   * without the reader being woken first (0: never spins). */
  atomic_uint_fast64_t spin_until;
  atomic_bool reader_asleep; /* in poll, past its spin window */
  /* The grant window (grant_opened_locked): while a grant of this client
   * waits for its RECV_DONE, the reader and a waiter poll until
   * grant_until, grant_spin_us after the last grant posted
   * ($KVFERRY_GRANT_SPIN_US); none opens before grant_off_until, set when
   * a polling thread found its CPU taken (spin_lost_cpu). grants_open
   * counts the 'g' entries of inflight (changed under mu). */
  unsigned grant_spin_us;
  atomic_uint_fast64_t grant_until, grant_off_until;
  atomic_int grants_open;
  /* The transfer whose Soon opened the window (reader thread; "": none):
   * its RECV_DONE or SEND_DONE ends the window (end_soon). */
  char soon_id[KVF_XFER_ID_MAX + 1];
  /* Counts `responded` broadcasts, so that a caller spinning for its
   * response sees one come without taking mu. */
  atomic_uint_fast64_t answers;
  int wake_fd;               /* eventfd: a request written wakes it to spin */
};

/* ------------------------------------------------------------ small helpers */

/* Copies src into dst[cap], truncating; NULL reads as "". */
static void copy_string(char *dst, size_t cap, const char *src) {
  size_t n = src ? strnlen(src, cap - 1) : 0;
  memcpy(dst, src ? src : "", n);
  dst[n] = '\0';
}

static void close_fds(const int *fds, int n) {
  for (int i = 0; i < n; i++) close(fds[i]);
}

/* The daemon's status as a library return value: 0 or negative. */
static int status_code(int32_t status) { return status > 0 ? KVF_EPROTO : status; }

static int check_xfer_id(const char *xfer_id) {
  if (!xfer_id) return KVF_EINVAL;
  size_t n = strnlen(xfer_id, KVF_XFER_ID_MAX + 1);
  return n > 0 && n <= KVF_XFER_ID_MAX && kvf__xfer_id_chars_valid(xfer_id, n) ? 0 : KVF_EINVAL;
}

/* A node name; NULL and "" pass only when the name is optional. */
static int check_node_name(const char *node, bool required) {
  size_t n = node ? strnlen(node, KVF_NAME_MAX + 1) : 0;
  if (n > KVF_NAME_MAX || (required && n == 0)) return KVF_EINVAL;
  return 0;
}

/* A block send's destination: one node name, or up to KVF_DST_NODES_MAX
 * comma-separated (a fan-out over nodes, kvferry.h), each a node name. */
static int check_dst_nodes(const char *list) {
  if (!list) return KVF_EINVAL;
  for (unsigned k = 0;; k++) {
    const char *comma = strchr(list, ',');
    size_t n = comma ? (size_t)(comma - list) : strnlen(list, KVF_NAME_MAX + 1);
    if (k == KVF_DST_NODES_MAX || n == 0 || n > KVF_NAME_MAX) return KVF_EINVAL;
    if (!comma) return 0;
    list = comma + 1;
  }
}

static int check_descs(const kvf_client *c, const kvf_desc *descs, size_t n) {
  if (!descs || n == 0) return KVF_EINVAL;
  if (c->max_descs && n > c->max_descs) return KVF_ELIMIT;
  return 0;
}

static struct timespec deadline_after_ms(int ms) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  t.tv_sec += ms / 1000;
  t.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (t.tv_nsec >= 1000000000L) {
    t.tv_sec++;
    t.tv_nsec -= 1000000000L;
  }
  return t;
}

/* ------------------------------------------------------------ open sends */

/* All under mu. */
static struct open_send **table_slot(struct open_send **table, const char *id) {
  uint32_t h = 2166136261u; /* FNV-1a */
  for (const char *p = id; *p; p++) h = (h ^ (uint8_t)*p) * 16777619u;
  struct open_send **pp = &table[h % OPEN_SENDS_BUCKETS];
  while (*pp && strcmp((*pp)->id, id) != 0) pp = &(*pp)->next;
  return pp;
}

static struct open_send **open_send_slot(kvf_client *c, const char *id) { return table_slot(c->open_sends, id); }

static bool send_is_open(kvf_client *c, const char *id) { return *open_send_slot(c, id) != NULL; }

static struct open_send *open_send_new(const char *id) {
  size_t n = strlen(id) + 1;
  struct open_send *o = malloc(sizeof(*o) + n);
  if (o) {
    memcpy(o->id, id, n);
    o->next = NULL;
    o->count = 1;
  }
  return o;
}

/* Takes o (NULL when id is open already). */
static void open_send(kvf_client *c, struct open_send *o) {
  if (!o) return;
  struct open_send **pp = open_send_slot(c, o->id);
  if (*pp) free(o);
  else *pp = o;
}

static void close_send(kvf_client *c, const char *id) {
  struct open_send **pp = open_send_slot(c, id), *o = *pp;
  if (!o) return;
  *pp = o->next;
  free(o);
}

static void free_table(struct open_send **table) {
  for (size_t b = 0; b < OPEN_SENDS_BUCKETS; b++)
    while (table[b]) {
      struct open_send *o = table[b];
      table[b] = o->next;
      free(o);
    }
}

/* ------------------------------------------------------------ transfers in flight */

/* The key of a grant ('g') or send ('s') of xfer_id. */
static void inflight_key(char *key, char type, const char *xfer_id) {
  key[0] = type;
  copy_string(key + 1, KVF_XFER_ID_MAX + 1, xfer_id);
}

static void grant_opened_locked(kvf_client *c);

/* Frees the entry at *pp (mu held). */
static void inflight_unlink_locked(kvf_client *c, struct open_send **pp) {
  struct open_send *o = *pp;
  *pp = o->next;
  if (o->id[0] == 'g') atomic_fetch_sub(&c->grants_open, 1);
  free(o);
}

/* inflight_add with mu held. */
static int inflight_add_locked(kvf_client *c, char type, const char *xfer_id) {
  char key[KVF_XFER_ID_MAX + 2];
  inflight_key(key, type, xfer_id);
  struct open_send **pp = table_slot(c->inflight, key);
  if (*pp) {
    (*pp)->count++;
    return 0;
  }
  if ((*pp = open_send_new(key)) == NULL) return -ENOMEM;
  if (type == 'g') grant_opened_locked(c);
  return 0;
}

/* Takes back one count of inflight_add (mu held). */
static void inflight_undo_locked(kvf_client *c, char type, const char *xfer_id) {
  char key[KVF_XFER_ID_MAX + 2];
  inflight_key(key, type, xfer_id);
  struct open_send **pp = table_slot(c->inflight, key), *o = *pp;
  if (o && --o->count <= 0) inflight_unlink_locked(c, pp);
}

/* Whether a grant or send of xfer_id waits for its DONE event (mu held). */
static bool inflight_has(kvf_client *c, char type, const char *xfer_id) {
  char key[KVF_XFER_ID_MAX + 2];
  inflight_key(key, type, xfer_id);
  return *table_slot(c->inflight, key) != NULL;
}

/* Counts a call that may start transfer xfer_id, before its request goes
 * out (its DONE event may come before the call returns). */
static int inflight_add(kvf_client *c, char type, const char *xfer_id) {
  pthread_mutex_lock(&c->mu);
  int rc = inflight_add_locked(c, type, xfer_id);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* The call of inflight_add ended: a refused one takes its count back. */
static int inflight_end(kvf_client *c, char type, const char *xfer_id, int rc) {
  if (rc == 0) return 0;
  pthread_mutex_lock(&c->mu);
  inflight_undo_locked(c, type, xfer_id);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* Its DONE event came (mu held). */
static void inflight_done(kvf_client *c, int type, const char *xfer_id) {
  char key[KVF_XFER_ID_MAX + 2];
  inflight_key(key, type == KVF_EV_RECV_DONE ? 'g' : 's', xfer_id);
  struct open_send **pp = table_slot(c->inflight, key);
  if (*pp) inflight_unlink_locked(c, pp);
}

/* ------------------------------------------------------------ events */

/* Called with mu held (or before the reader runs). */
static void set_conn(kvf_client *c, enum conn_state s) {
  c->conn = s;
  atomic_store_explicit(&c->conn_seen, (int)s, memory_order_release);
}

/* Keeps event_fd readable while events are queued or the connection is
 * gone for good (so that an engine polling only the fd still learns of
 * it). While the library reconnects it is not raised without events: an
 * engine polling it would spin. Called with mu held. */
static void sync_event_fd(kvf_client *c) {
  bool want = c->ev_head != NULL || c->conn == CONN_GONE;
  uint64_t v = 1;
  if (want && !c->event_fd_raised) {
    if (write(c->event_fd, &v, sizeof(v)) < 0) { /* cannot fail: counter < 2 */ }
  } else if (!want && c->event_fd_raised) {
    if (read(c->event_fd, &v, sizeof(v)) < 0) { /* cannot fail: it is raised */ }
  }
  c->event_fd_raised = want;
}

static void event_from_wire(kvf_event *ev, const Kvf__Event *w) {
  memset(ev, 0, sizeof(*ev));
  ev->type = (int)w->type; /* EVENT_RECV_DONE/SEND_DONE equal KVF_EV_* */
  ev->status = status_code(w->status);
  copy_string(ev->xfer_id, sizeof(ev->xfer_id), w->xfer_id);
  copy_string(ev->path, sizeof(ev->path), w->path);
  copy_string(ev->peer, sizeof(ev->peer), w->peer);
  ev->bytes = w->bytes;
  ev->descriptors = w->descriptors;
  copy_string(ev->error, sizeof(ev->error), w->error);
  ev->layer = w->layer;
  copy_string(ev->transform, sizeof(ev->transform), w->transform);
}

/* Called with mu held. Waiters spinning in kvf_wait_events are told by
 * events_told, once mu is free: told earlier, they would block on it (a
 * sleep, what they spin to avoid; the eventfd write here holds mu for a
 * system call). */
static void enqueue_locked(kvf_client *c, struct queued_event *q) {
  q->next = NULL;
  *c->ev_tail = q;
  c->ev_tail = &q->next;
  if (q->ev.type == KVF_EV_RECV_DONE || q->ev.type == KVF_EV_SEND_DONE) inflight_done(c, q->ev.type, q->ev.xfer_id);
  atomic_fetch_add_explicit(&c->ev_queued, 1, memory_order_release);
  sync_event_fd(c);
  pthread_cond_broadcast(&c->evented);
}

static void events_told(kvf_client *c) { atomic_fetch_add_explicit(&c->ev_count, 1, memory_order_release); }

static int queue_event(kvf_client *c, const Kvf__Event *w) {
  struct queued_event *q = malloc(sizeof(*q));
  if (!q) return -ENOMEM; /* losing an event silently would be worse */
  event_from_wire(&q->ev, w);
  pthread_mutex_lock(&c->mu);
  enqueue_locked(c, q);
  pthread_mutex_unlock(&c->mu);
  events_told(c);
  return 0;
}

/* The connection broke: every grant and send in flight ends with
 * KVF_EDAEMON (mu held). An event that cannot be allocated is lost with
 * its transfer's entry; kvf_wait_events still reports KVF_EDAEMON. */
static void fail_inflight(kvf_client *c) {
  for (size_t b = 0; b < OPEN_SENDS_BUCKETS; b++) {
    while (c->inflight[b]) {
      struct open_send *o = c->inflight[b];
      c->inflight[b] = o->next;
      struct queued_event *q = calloc(1, sizeof(*q));
      if (q) {
        q->ev.type = o->id[0] == 'g' ? KVF_EV_RECV_DONE : KVF_EV_SEND_DONE;
        q->ev.status = KVF_EDAEMON;
        copy_string(q->ev.xfer_id, sizeof(q->ev.xfer_id), o->id + 1);
        copy_string(q->ev.path, sizeof(q->ev.path), "daemon");
        copy_string(q->ev.error, sizeof(q->ev.error), "the connection to kvferryd broke");
        enqueue_locked(c, q);
        events_told(c); /* mu held: a broken connection may cost a spinner a sleep */
      }
      if (o->id[0] == 'g') atomic_fetch_sub(&c->grants_open, 1);
      free(o);
    }
  }
}

/* Moves up to cap queued events to out. Called with mu held. */
static int take_events(kvf_client *c, kvf_event *out, size_t cap) {
  int n = 0;
  while (c->ev_head && (size_t)n < cap && n < INT_MAX) {
    struct queued_event *q = c->ev_head;
    out[n++] = q->ev;
    /* Taken: the id may name a new send from now on. */
    if (q->ev.type == KVF_EV_SEND_DONE) close_send(c, q->ev.xfer_id);
    c->ev_head = q->next;
    free(q);
  }
  atomic_fetch_add_explicit(&c->ev_taken, (uint64_t)n, memory_order_relaxed);
  if (!c->ev_head) c->ev_tail = &c->ev_head;
  sync_event_fd(c);
  return n;
}

/* ------------------------------------------------------------ inbound */

static void remember_fd(struct inbound *in, int fd, uint64_t first, uint64_t end) {
  if (in->nfds == INBOUND_FDS_MAX) {
    close(fd);
    return;
  }
  in->fds[in->nfds++] = (struct passed_fd){.fd = fd, .first = first, .end = end};
}

static int pop_fd(struct inbound *in) {
  int fd = in->fds[0].fd;
  memmove(in->fds, in->fds + 1, (in->nfds - 1) * sizeof(in->fds[0]));
  in->nfds--;
  return fd;
}

/* Closes fds whose read ended before the frame at start: the frame they came
 * with has been dispatched without claiming them. */
static void drop_stale_fds(struct inbound *in, uint64_t start) {
  while (in->nfds && in->fds[0].end <= start) close(pop_fd(in));
}

/* The fd of the frame ending at end, if it carried one. */
static int claim_fd(struct inbound *in, uint64_t end) {
  return in->nfds && in->fds[0].first < end ? pop_fd(in) : -1;
}

/* One recvmsg into the frame buffer; fds that came along are remembered. */
/* A pause for a spinning loop: lets a sibling hyperthread run. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static uint64_t mono_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* The reader spins too (KVFERRY_SPIN_US): an event the daemon sends is
 * read by the reader thread before a waiter can take it, so a waiter that
 * spins gains little while the reader sleeps in recv and must be woken
 * first. The reader's spin window opens after each read and after each
 * request written (the answer or event it leads to comes soon); a request
 * written while the reader sleeps past its window wakes it through wake_fd
 * to spin for what comes back. Opens (or extends) the window. */
static void spin_window_open(kvf_client *c) {
  if (c->spin_us) atomic_store(&c->spin_until, mono_ns() + (uint64_t)c->spin_us * 1000);
}

/* After a request went: the reader spins for what it leads to. The store
 * of the window and the load of reader_asleep pair with the reader's store
 * of reader_asleep and load of the window (both sequentially consistent):
 * either we see it asleep and wake it, or it sees the window open. */
static void spin_reader_for_answer(kvf_client *c) {
  if (!c->spin_us) return;
  spin_window_open(c);
  if (atomic_load(&c->reader_asleep)) (void)!eventfd_write(c->wake_fd, 1);
}

/* A grant posted here ends in a RECV_DONE when the sender's data lands, a
 * prefill later or sooner: the daemons poll for it meanwhile
 * (spin-grant-us), and a reader asleep since its last read would put its
 * own wake-up on the handoff's last hop (70-90 us on a guest whose idle
 * vCPUs halt, bench/RESULTS.md). So for grant_spin_us after each grant
 * posted, while one waits for its RECV_DONE, the reader polls the socket
 * and kvf_wait_events spins; the last grant's RECV_DONE ends it. A
 * sleeping reader is woken to poll (spin_reader_for_answer's pairing).
 * Called with mu held, from inflight_add_locked. */
static void grant_opened_locked(kvf_client *c) {
  atomic_fetch_add(&c->grants_open, 1);
  if (!c->grant_spin_us) return;
  uint64_t now = mono_ns();
  if (now < atomic_load(&c->grant_off_until)) return;
  atomic_store(&c->grant_until, now + (uint64_t)c->grant_spin_us * 1000);
  if (atomic_load(&c->reader_asleep)) (void)!eventfd_write(c->wake_fd, 1);
}

/* The end of the grant window, or 0 when none is open. */
static uint64_t grant_window_end(kvf_client *c) {
  return atomic_load(&c->grants_open) > 0 ? atomic_load(&c->grant_until) : 0;
}

/* Until when the reader polls: its spin window (KVFERRY_SPIN_US, a Soon)
 * or the grant window, whichever ends later. */
static uint64_t reader_poll_until(kvf_client *c) {
  uint64_t spin = atomic_load(&c->spin_until), grant = grant_window_end(c);
  return spin > grant ? spin : grant;
}

/* When a spin began, on the clock and on this thread's CPU clock: the
 * difference since is the time other tasks had this thread's CPU. */
typedef struct spin_start {
  uint64_t wall, cpu;
} spin_start;

static uint64_t thread_cpu_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static spin_start spin_begin(void) { return (spin_start){mono_ns(), thread_cpu_ns()}; }

/* A thread polling for the grant window that lost SPIN_LOST_NS of its spin
 * to other tasks (or 1/SPIN_LOST_SHARE of a longer spin, so that the rare
 * interrupt or kernel thread adds up to no backoff over a long window)
 * lost its CPU to them: the CPUs are not spare after all, and polling on
 * competes with the engine's threads (the daemon's threads back off
 * likewise, daemon/spin.c). The spin in progress ends, the grant window
 * closes, and none opens for GRANT_BACKOFF_NS. The windows an engine asked
 * for (KVFERRY_SPIN_US) or the daemon announced (a Soon) poll on as they
 * always did: stopping them made a waiter sleep where it spun before (3
 * sleeps in 12 waits in test_e2e under the 2-vCPU rdma VM). A spin on an idle 2-CPU
 * machine loses 0-60 us in 400 ms (interrupts, kernel threads); one that
 * shares its CPU with a busy task loses a slice, 750 us or more, at once.
 * The time lost counts, not its longest piece: where only preemptions of
 * 0.5 ms or more stopped the polling, 16 busy loops on 16 CPUs held the
 * event 1.1 ms from the engine (bench/RESULTS.md). */
#define SPIN_LOST_NS 100000ull
#define SPIN_LOST_SHARE 64
#define GRANT_BACKOFF_NS 100000000ull

static bool spin_lost_cpu(kvf_client *c, const spin_start *from, uint64_t now) {
  uint64_t ran = thread_cpu_ns() - from->cpu, passed = now - from->wall;
  uint64_t allowed = passed / SPIN_LOST_SHARE > SPIN_LOST_NS ? passed / SPIN_LOST_SHARE : SPIN_LOST_NS;
  if (passed < ran + allowed) return false;
  atomic_store(&c->grant_off_until, now + GRANT_BACKOFF_NS);
  atomic_store(&c->grant_until, 0);
  return true;
}

/* A response arrived or the connection ended (mu held): wakes the
 * callers sleeping for theirs. The spinning ones are told by
 * answered_unlocked, once mu is free: told earlier, they would block on
 * it (a sleep, what they spin to avoid). */
static void answered_locked(kvf_client *c) { pthread_cond_broadcast(&c->responded); }
static void answered_unlocked(kvf_client *c) { atomic_fetch_add_explicit(&c->answers, 1, memory_order_release); }

/* A Soon from the daemon: an event is expected within about within_us.
 * The reader polls the socket until then (and a little after), whatever
 * KVFERRY_SPIN_US says: the wait is known to be short, and bounded here.
 * A waiter that the Soon's own bytes woke spins as long (watch_for_event). */
#define SOON_SLACK_US 200
#define SOON_POLL_MAX_US 3000
/* Polling on a Soon takes a CPU (two: the reader and a waiter) while the
 * data still moves, on this host too (a tcp receiver's threads, the
 * daemon's loop): on a machine of 2 CPUs that starved the transfer it
 * awaited (a 64 KiB tcp handoff went from 130-220 us to 500-1,450 us,
 * bench/RESULTS.md). So only where this process may run on SOON_MIN_CPUS or
 * more, or where KVFERRY_SPIN_US asks for spinning anyway;
 * $KVFERRY_SOON_POLL (1 or 0) decides instead where set. */
#define SOON_MIN_CPUS 4
static bool cpus_spare(unsigned spin_us) {
  cpu_set_t set;
  int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
  return spin_us > 0 || cpus >= SOON_MIN_CPUS;
}

static bool soon_polls_here(bool spare) {
  const char *v = getenv("KVFERRY_SOON_POLL");
  if (v && (!strcmp(v, "0") || !strcmp(v, "1"))) return v[0] == '1';
  return spare;
}

static void expect_soon(kvf_client *c, const char *xfer_id, uint32_t within_us) {
  if (!c->soon_polls) return;
  uint64_t us = (uint64_t)within_us + SOON_SLACK_US;
  uint64_t until = mono_ns() + (us < SOON_POLL_MAX_US ? us : SOON_POLL_MAX_US) * 1000;
  if (until > atomic_load(&c->spin_until)) atomic_store(&c->spin_until, until);
  copy_string(c->soon_id, sizeof(c->soon_id), xfer_id);
}

/* The event a Soon announced came: the window it opened closes (back to
 * KVFERRY_SPIN_US's, which the read just opened), so that the reader does
 * not poll on for a bound that estimated when the event would come. */
static void end_soon(kvf_client *c, const Kvf__Event *ev) {
  bool done = ev->type == KVF__EVENT_TYPE__EVENT_RECV_DONE || ev->type == KVF__EVENT_TYPE__EVENT_SEND_DONE;
  if (!c->soon_id[0] || !done || strcmp(ev->xfer_id, c->soon_id) != 0) return;
  c->soon_id[0] = 0;
  uint64_t normal = c->spin_us ? mono_ns() + (uint64_t)c->spin_us * 1000 : 0;
  if (atomic_load(&c->spin_until) > normal) atomic_store(&c->spin_until, normal);
}

/* Polls the socket while the spin window is open; true once readable. */
static bool spin_until_readable(kvf_client *c) {
  struct pollfd p = {.fd = c->sock, .events = POLLIN};
  spin_start from = spin_begin();
  for (unsigned i = 0;; i++) {
    if (i % 16 == 0) {
      uint64_t now = mono_ns();
      if (now >= reader_poll_until(c)) return false;
      /* past the spin window, only the grant window keeps it polling */
      if (now >= atomic_load(&c->spin_until) && spin_lost_cpu(c, &from, now)) return false;
    }
    if (poll(&p, 1, 0) != 0) return true; /* readable, closed or failed: the read says which */
    cpu_relax();
  }
}

/* On the reader thread, before it reads: spins within the window, then
 * sleeps until the socket is readable or a request wakes it to spin. */
static void await_readable(kvf_client *c) {
  for (;;) {
    if (spin_until_readable(c)) return;
    atomic_store(&c->reader_asleep, true);
    if (mono_ns() < reader_poll_until(c)) { /* a request or a grant came meanwhile */
      atomic_store(&c->reader_asleep, false);
      continue;
    }
    struct pollfd p[2] = {{.fd = c->sock, .events = POLLIN}, {.fd = c->wake_fd, .events = POLLIN}};
    int n = poll(p, 2, -1);
    atomic_store(&c->reader_asleep, false);
    if (p[1].revents & POLLIN) {
      eventfd_t v;
      (void)!eventfd_read(c->wake_fd, &v);
    }
    if (p[0].revents || (n < 0 && errno != EINTR)) return;
  }
}

static int read_inbound(int sock, struct inbound *in) {
  uint8_t *buf;
  size_t avail;
  int rc = kvf__framebuf_space(&in->fb, READ_CHUNK, &buf, &avail);
  if (rc) return rc;
  int fds[KVF__FRAME_MAX_FDS];
  int nfds = 0;
  long n = kvf__recv_fds(sock, buf, avail, fds, &nfds, KVF__FRAME_MAX_FDS);
  if (n <= 0) {
    close_fds(fds, nfds);
    return n == 0 ? KVF_EDAEMON : (int)n;
  }
  kvf__framebuf_commit(&in->fb, (size_t)n);
  for (int i = 0; i < nfds; i++) remember_fd(in, fds[i], in->received, in->received + (uint64_t)n);
  in->received += (uint64_t)n;
  return 0;
}

/* Hands a response to the caller waiting for its seq; one nobody waits for
 * (which the daemon should never send) is dropped with its fd. */
static void deliver_response(kvf_client *c, Kvf__ApiMessage *msg, int fd) {
  pthread_mutex_lock(&c->mu);
  for (struct pending *p = c->waiting; p; p = p->next) {
    if (p->seq == msg->response->seq && !p->done) {
      p->msg = msg;
      p->fd = fd;
      p->done = true;
      answered_locked(c);
      pthread_mutex_unlock(&c->mu);
      answered_unlocked(c);
      return;
    }
  }
  pthread_mutex_unlock(&c->mu);
  kvf__api_message__free_unpacked(msg, NULL);
  if (fd >= 0) close(fd);
}

static bool carries_fd(const Kvf__ApiResponse *r) {
  return r->status == 0 && r->body_case == KVF__API_RESPONSE__BODY_MAP;
}

static int dispatch_frame(kvf_client *c, const uint8_t *payload, uint32_t len, uint64_t start,
                          uint64_t end) {
  drop_stale_fds(&c->in, start);
  Kvf__ApiMessage *msg = kvf__api_message__unpack(NULL, len, payload);
  if (!msg) return KVF_EPROTO;
  int rc = 0;
  switch (msg->body_case) {
  case KVF__API_MESSAGE__BODY_RESPONSE:
    deliver_response(c, msg, carries_fd(msg->response) ? claim_fd(&c->in, end) : -1);
    return 0;
  case KVF__API_MESSAGE__BODY_EVENT:
    rc = queue_event(c, msg->event);
    end_soon(c, msg->event);
    break;
  case KVF__API_MESSAGE__BODY_SOON:
    expect_soon(c, msg->soon->xfer_id, msg->soon->within_us);
    break;
  default: /* a kind of message this version does not know: skip it */
    break;
  }
  kvf__api_message__free_unpacked(msg, NULL);
  return rc;
}

/* Reads once and dispatches every whole frame now held. Any error means the
 * stream can no longer be trusted. */
static int pump_inbound(kvf_client *c) {
  /* A reader that may be told to poll (KVFERRY_SPIN_US, a grant window)
   * sleeps in await_readable, where wake_fd reaches it, not in recv. */
  if (c->spin_us || c->grant_spin_us || mono_ns() < reader_poll_until(c)) await_readable(c);
  int rc = read_inbound(c->sock, &c->in);
  if (rc) return rc;
  spin_window_open(c);
  const uint8_t *payload;
  uint32_t len;
  while ((rc = kvf__framebuf_next(&c->in.fb, &payload, &len)) == 1) {
    uint64_t start = c->in.consumed;
    c->in.consumed += KVF__FRAME_HDR + (uint64_t)len;
    rc = dispatch_frame(c, payload, len, start, c->in.consumed);
    if (rc) return rc;
  }
  return rc == 0 ? 0 : KVF_EPROTO; /* -EMSGSIZE: a frame over max_frame */
}

/* The connection broke: callers waiting for a response wake with
 * KVF_EDAEMON, transfers in flight get their events, and a new connection
 * number starts. Returns whether to reconnect. */
static bool connection_lost(kvf_client *c) {
  pthread_mutex_lock(&c->mu);
  c->gen++;
  set_conn(c, c->closing || c->reconnect_ms == 0 ? CONN_GONE : CONN_DOWN);
  fail_inflight(c);
  sync_event_fd(c);
  answered_locked(c);
  pthread_cond_broadcast(&c->evented);
  pthread_cond_broadcast(&c->state_cv);
  bool again = c->conn == CONN_DOWN;
  pthread_mutex_unlock(&c->mu);
  answered_unlocked(c);
  return again;
}

static int reconnect(kvf_client *c);

static void *reader_main(void *arg) {
  kvf_client *c = arg;
  for (;;) {
    while (pump_inbound(c) == 0) {
    }
    if (!connection_lost(c) || reconnect(c) != 0) break;
  }
  pthread_mutex_lock(&c->mu);
  set_conn(c, CONN_GONE);
  sync_event_fd(c);
  pthread_cond_broadcast(&c->evented);
  pthread_cond_broadcast(&c->state_cv);
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

/* Starts the reader with every signal blocked, so the engine's signal
 * handlers never run on a thread the library owns. */
static int start_reader(kvf_client *c) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int rc = pthread_create(&c->reader, NULL, reader_main, c);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc) return -rc;
  pthread_setname_np(c->reader, "kvf-client"); /* for ps, top, perf; failing is harmless */
  c->reader_started = true;
  return 0;
}

/* ------------------------------------------------------------ requests */

/* Frames up to this size are packed into a buffer kept for the next request:
 * a fresh buffer of a few hundred KiB per kvf_send (descriptor lists) costs a
 * page fault per 4 KiB once malloc hands the memory back to the kernel. */
#define WBUF_KEEP (4u << 20)

/* Writes one request frame, with fd attached when >= 0, on connection gen
 * (KVF_EDAEMON when that connection is over); the caller holds write_mu. */
static int send_request_locked(kvf_client *c, Kvf__ApiRequest *req, uint64_t gen, int fd) {
  if (gen != c->sock_gen) return KVF_EDAEMON;
  size_t len = kvf__api_request__get_packed_size(req);
  if (len > c->max_frame) return KVF_ELIMIT;
  size_t total = KVF__FRAME_HDR + len;
  uint8_t *frame = c->wbuf;
  if (total > c->wcap) {
    frame = malloc(total);
    if (!frame) return -ENOMEM;
    if (total <= WBUF_KEEP) {
      free(c->wbuf);
      c->wbuf = frame;
      c->wcap = total;
    }
  }
  kvf__frame_put_header(frame, (uint32_t)len);
  kvf__api_request__pack(req, frame + KVF__FRAME_HDR);
  int rc = kvf__send_all(c->sock, frame, total, fd);
  if (frame != c->wbuf) free(frame);
  if (rc == -EAGAIN) return -ETIMEDOUT; /* only during hello (SO_SNDTIMEO) */
  if (rc) {
    /* A partly written frame leaves the stream unusable: end it, so that
     * the reader sees EOF and every caller gets KVF_EDAEMON. */
    shutdown(c->sock, SHUT_RDWR);
    return KVF_EDAEMON;
  }
  spin_reader_for_answer(c);
  return 0;
}

static int send_request(kvf_client *c, Kvf__ApiRequest *req, uint64_t gen, int fd) {
  pthread_mutex_lock(&c->write_mu);
  int rc = send_request_locked(c, req, gen, fd);
  pthread_mutex_unlock(&c->write_mu);
  return rc;
}

static void unlink_pending(kvf_client *c, struct pending *p) {
  for (struct pending **pp = &c->waiting; *pp; pp = &(*pp)->next) {
    if (*pp == p) {
      *pp = p->next;
      return;
    }
  }
}

/* Any connection (for register_pending_on): the current one, when up. */
#define ANY_GEN 0

/* Registers p before the request is written, so that the response cannot
 * arrive ahead of its waiter. gen: the connection the request was made
 * for (ids translated for it), or ANY_GEN. While the connection is down
 * only the reader's own requests (restoring, true) go out. */
static int register_pending_on(kvf_client *c, struct pending *p, uint64_t gen, bool restoring) {
  *p = (struct pending){.fd = -1};
  pthread_mutex_lock(&c->mu);
  if ((!restoring && c->conn != CONN_UP) || (gen != ANY_GEN && gen != c->gen)) {
    pthread_mutex_unlock(&c->mu);
    return KVF_EDAEMON;
  }
  p->gen = c->gen;
  p->seq = ++c->last_seq;
  p->next = c->waiting;
  c->waiting = p;
  pthread_mutex_unlock(&c->mu);
  return 0;
}

static int register_pending(kvf_client *c, struct pending *p) { return register_pending_on(c, p, ANY_GEN, false); }

/* A number for a request nobody waits the answer of, on the current
 * connection: *gen for send_request_locked. */
static int unanswered_seq(kvf_client *c, Kvf__ApiRequest *req, uint64_t *gen) {
  pthread_mutex_lock(&c->mu);
  int rc = c->conn == CONN_UP ? 0 : KVF_EDAEMON;
  req->seq = ++c->last_seq;
  *gen = c->gen;
  pthread_mutex_unlock(&c->mu);
  return rc;
}

static int begin_call_on(kvf_client *c, Kvf__ApiRequest *req, struct pending *p, uint64_t gen, bool restoring,
                         int fd) {
  int rc = register_pending_on(c, p, gen, restoring);
  if (rc) return rc;
  req->seq = p->seq;
  return send_request(c, req, p->gen, fd);
}

static int begin_call(kvf_client *c, Kvf__ApiRequest *req, struct pending *p) {
  return begin_call_on(c, req, p, ANY_GEN, false, -1);
}

/* Unregisters p and turns its outcome into a return value. rc is what went
 * wrong while sending or waiting (0: nothing). On success the response
 * (checked to carry body `expect`, unless NOT_SET) goes to *out and its fd to
 * *fd; where the caller passes NULL they are released here. */
static int end_call(kvf_client *c, struct pending *p, int rc, int expect, Kvf__ApiMessage **out,
                    int *fd) {
  pthread_mutex_lock(&c->mu);
  unlink_pending(c, p);
  pthread_mutex_unlock(&c->mu);
  if (p->done) {
    const Kvf__ApiResponse *r = p->msg->response;
    rc = status_code(r->status);
    if (rc == 0 && expect != KVF__API_RESPONSE__BODY__NOT_SET && (int)r->body_case != expect)
      rc = KVF_EPROTO;
  } else if (rc == 0) {
    rc = KVF_EDAEMON;
  }
  if (rc == 0 && out) {
    *out = p->msg;
    p->msg = NULL;
  }
  if (rc == 0 && fd) {
    *fd = p->fd;
    p->fd = -1;
  }
  if (p->msg) kvf__api_message__free_unpacked(p->msg, NULL);
  if (p->fd >= 0) close(p->fd);
  return rc;
}

/* With KVFERRY_SPIN_US, a caller spins up to that long for its response
 * (mu not held) before it sleeps on `responded`: a response within it is
 * taken without this thread being put to sleep and woken (a futex round,
 * and on an idle machine the CPU's wake-up from a deeper sleep state). */
static void spin_for_answer(kvf_client *c, const struct pending *p) {
  if (!c->spin_us) return;
  uint64_t end = mono_ns() + (uint64_t)c->spin_us * 1000;
  uint64_t seen = atomic_load_explicit(&c->answers, memory_order_acquire);
  for (unsigned i = 1;; i++) {
    uint64_t now = atomic_load_explicit(&c->answers, memory_order_acquire);
    if (now != seen) { /* someone's answer, or the connection's end */
      pthread_mutex_lock(&c->mu);
      bool over = p->done || p->gen != c->gen;
      pthread_mutex_unlock(&c->mu);
      if (over) return;
      seen = now;
    }
    if (i % 64 == 0) {
      if (mono_ns() >= end) return;
      sched_yield(); /* where cores are short, the reader and the daemon run */
    }
    cpu_relax();
  }
}

/* Waits for the response to p (registered) after its request went out. */
static int finish_call(kvf_client *c, struct pending *p, int rc, int expect, Kvf__ApiMessage **out, int *fd) {
  if (rc == 0) spin_for_answer(c, p);
  pthread_mutex_lock(&c->mu);
  while (rc == 0 && !p->done && p->gen == c->gen) pthread_cond_wait(&c->responded, &c->mu);
  pthread_mutex_unlock(&c->mu);
  return end_call(c, p, rc, expect, out, fd);
}

/* One request, one response, with the reader thread doing the reading. */
static int call(kvf_client *c, Kvf__ApiRequest *req, int expect, Kvf__ApiMessage **out, int *fd) {
  struct pending p;
  int rc = begin_call(c, req, &p);
  return finish_call(c, &p, rc, expect, out, fd);
}

/* call() for a request made for connection gen (its ids translated for
 * it), with fd_out attached when >= 0. */
static int call_on(kvf_client *c, uint64_t gen, Kvf__ApiRequest *req, int fd_out, int expect, Kvf__ApiMessage **out,
                   int *fd) {
  struct pending p;
  int rc = begin_call_on(c, req, &p, gen, false, fd_out);
  return finish_call(c, &p, rc, expect, out, fd);
}

/* One request answered on this thread, which reads the socket itself: the
 * hello, and the reader's requests while it restores a new connection. */
static int sync_call_answered(kvf_client *c, Kvf__ApiRequest *req, int fd_out, int expect, Kvf__ApiMessage **out,
                              int *fd, bool *answered) {
  struct pending p;
  int rc = begin_call_on(c, req, &p, ANY_GEN, true, fd_out);
  while (rc == 0 && !p.done) rc = pump_inbound(c);
  if (rc == -EAGAIN) rc = -ETIMEDOUT; /* SO_RCVTIMEO expired */
  if (answered) *answered = p.done;
  return end_call(c, &p, rc, expect, out, fd);
}

static int sync_call(kvf_client *c, Kvf__ApiRequest *req, int fd_out, int expect, Kvf__ApiMessage **out, int *fd) {
  return sync_call_answered(c, req, fd_out, expect, out, fd, NULL);
}

/* ------------------------------------------------------------ connect */

static const char *resolve_socket_path(const char *path) {
  if (path) return path;
  const char *env = getenv("KVFERRY_SOCKET");
  return env && *env ? env : DEFAULT_SOCKET;
}

/* Bounds blocking connect, sends and receives on sock (0: unbounded). */
static void set_socket_timeouts(int sock, time_t seconds) {
  struct timeval tv = {.tv_sec = seconds};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

static int connect_unix(const char *path, int *out) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t n = strlen(path);
  if (n == 0) return KVF_EINVAL;
  if (n >= sizeof(sa.sun_path)) return -ENAMETOOLONG;
  memcpy(sa.sun_path, path, n + 1);
  int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return -errno;
  set_socket_timeouts(sock, HELLO_TIMEOUT_S);
  if (connect(sock, (const struct sockaddr *)&sa, sizeof(sa)) < 0) {
    int err = errno == EAGAIN ? ETIMEDOUT : errno; /* backlog full past the timeout */
    close(sock);
    return -err;
  }
  *out = sock;
  return 0;
}

/* Descriptors per frame of a chained send: CHAIN_FIRST in the first frame
 * (small, so that the daemon starts soon), doubling up to CHAIN_MAX, and
 * always well inside max_frame. KVFERRY_SEND_CHAIN=FIRST:MAX overrides
 * them for measurements; 0 sends every call as one frame. */
#define CHAIN_FIRST 256u
#define CHAIN_MAX 4096u
#define CHAIN_FRAME_SLACK 1024u /* the frame around the descriptors: ids, names */

static void chain_setup(kvf_client *c, bool daemon_chains) {
  unsigned long first = CHAIN_FIRST, max = CHAIN_MAX;
  const char *env = getenv("KVFERRY_SEND_CHAIN");
  if (env && *env) {
    char *end;
    first = strtoul(env, &end, 10);
    max = *end == ':' ? strtoul(end + 1, NULL, 10) : first;
  }
  uint32_t fit = c->max_frame > CHAIN_FRAME_SLACK ? (c->max_frame - CHAIN_FRAME_SLACK) / DESC_WIRE_SIZE : 0;
  if (max > fit) max = fit;
  if (first > max) first = max;
  c->send_chains = daemon_chains && first > 0;
  c->chain_first = (uint32_t)first;
  c->chain_max = (uint32_t)max;
}

static int adopt_hello(kvf_client *c, const Kvf__HelloResp *h) {
  if (h->version != KVF_API_VERSION) return KVF_EVERSION;
  copy_string(c->node, sizeof(c->node), h->node);
  c->max_frame = h->max_frame ? h->max_frame : KVF__FRAME_MAX_DEFAULT;
  c->max_descs = h->max_descs;
  c->in.fb.max = c->max_frame;
  chain_setup(c, h->send_chains);
  return 0;
}

/* The first exchange, read on this thread: the reader starts only after. */
static int exchange_hello(kvf_client *c) {
  char name[96];
  snprintf(name, sizeof(name), "%s[%ld]", program_invocation_short_name, (long)getpid());
  Kvf__HelloReq hello = KVF__HELLO_REQ__INIT;
  hello.version = KVF_API_VERSION;
  hello.client_name = name;
  hello.no_soon = !c->soon_polls; /* the daemon spares the Soon and the reader's wake-up for it */
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_HELLO;
  req.hello = &hello;

  Kvf__ApiMessage *msg;
  int rc = sync_call(c, &req, -1, KVF__API_RESPONSE__BODY_HELLO, &msg, NULL);
  if (rc) return rc;
  rc = adopt_hello(c, msg->response->hello);
  kvf__api_message__free_unpacked(msg, NULL);
  return rc;
}

static void engine_mem_free(struct engine_mem *em) {
  if (!em) return;
  if (em->fd >= 0) close(em->fd);
  free(em);
}

static void free_ids(kvf_client *c) {
  for (size_t i = 0; i < c->pools.n; i++) engine_mem_free(c->pools.v[i].data);
  for (size_t i = 0; i < c->layouts.n; i++) free(c->layouts.v[i].data);
  kvf__ids_free(&c->pools);
  kvf__ids_free(&c->layouts);
}

/* Mutex and condvar initialisation cannot fail with glibc (NULL or clock
 * attributes), so it is not checked. */
static kvf_client *client_new(void) {
  kvf_client *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->sock = -1;
  c->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  c->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (c->event_fd < 0 || c->wake_fd < 0) {
    if (c->event_fd >= 0) close(c->event_fd);
    if (c->wake_fd >= 0) close(c->wake_fd);
    free(c);
    return NULL;
  }
  c->max_frame = KVF__FRAME_MAX_DEFAULT;
  kvf__framebuf_init(&c->in.fb, KVF__FRAME_MAX_DEFAULT);
  c->ev_tail = &c->ev_head;
  pthread_mutex_init(&c->write_mu, NULL);
  pthread_mutex_init(&c->mu, NULL);
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC); /* timeouts immune to clock steps */
  pthread_cond_init(&c->responded, &attr);
  pthread_cond_init(&c->evented, &attr);
  pthread_cond_init(&c->state_cv, &attr);
  pthread_condattr_destroy(&attr);
  set_conn(c, CONN_DOWN); /* until the hello is answered */
  c->gen = c->sock_gen = 1;
  return c;
}

/* Releases everything; the reader must not be running. */
static void client_free(kvf_client *c) {
  if (c->sock >= 0) close(c->sock);
  while (c->in.nfds) close(pop_fd(&c->in));
  kvf__framebuf_free(&c->in.fb);
  while (c->ev_head) {
    struct queued_event *q = c->ev_head;
    c->ev_head = q->next;
    free(q);
  }
  while (c->maps) {
    struct mapping *m = c->maps;
    c->maps = m->next;
    unmap(m->addr, m->size, m->gpu);
    free(m);
  }
  free_table(c->open_sends);
  free_table(c->inflight);
  free_ids(c);
  free(c->socket_path);
  close(c->event_fd);
  close(c->wake_fd);
  pthread_cond_destroy(&c->evented);
  pthread_cond_destroy(&c->state_cv);
  pthread_cond_destroy(&c->responded);
  pthread_mutex_destroy(&c->mu);
  pthread_mutex_destroy(&c->write_mu);
  free(c->wbuf);
  free(c->dbuf);
  free(c->bbuf);
  free(c);
}

/* A number of milliseconds from the environment, or def when unset or
 * not a number >= 0. */
static int env_ms(const char *name, int def) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  char *end;
  long ms = strtol(v, &end, 10);
  return *end || ms < 0 || ms > INT_MAX ? def : (int)ms;
}

static int64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Whether a failed connect means "no daemon listening yet": its socket is
 * not there, or nobody accepts on it. */
static bool daemon_not_up(int rc) { return rc == -ENOENT || rc == -ECONNREFUSED; }

/* Sleeps ms (or until kvf_close); returns false when closing. */
static bool backoff_sleep(kvf_client *c, int ms) {
  struct timespec until = deadline_after_ms(ms);
  pthread_mutex_lock(&c->mu);
  while (!c->closing && pthread_cond_timedwait(&c->state_cv, &c->mu, &until) != ETIMEDOUT) {
  }
  bool go_on = !c->closing;
  pthread_mutex_unlock(&c->mu);
  return go_on;
}

/* Retries after RETRY_FIRST_MS, doubling up to RETRY_MAX_MS: a daemon
 * that comes back is found within RETRY_MAX_MS (the 100 ms goal of the
 * first transfer after a restart), and a connect to a socket nobody
 * listens on costs microseconds. */
#define RETRY_FIRST_MS 1
#define RETRY_MAX_MS 10

/* connect_unix, retried while the daemon is not up, for up to wait_ms. */
static int connect_waiting(kvf_client *c, int wait_ms, int *sock) {
  int64_t end = now_ms() + wait_ms;
  int delay = RETRY_FIRST_MS;
  for (;;) {
    int rc = connect_unix(c->socket_path, sock);
    if (!daemon_not_up(rc)) return rc;
    int64_t left = end - now_ms();
    if (left <= 0) return rc;
    if (!backoff_sleep(c, delay < left ? delay : (int)left)) return rc;
    delay = delay * 2 < RETRY_MAX_MS ? delay * 2 : RETRY_MAX_MS;
  }
}

KVF_API int kvf_connect_ex(const char *socket_path, const kvf_connect_opts *o, kvf_client **out) {
  if (!out) return KVF_EINVAL;
  *out = NULL;
  int wait_ms = o && o->wait_ms >= 0 ? o->wait_ms : env_ms("KVFERRY_CONNECT_WAIT_MS", KVF_CONNECT_WAIT_MS_DEFAULT);
  int reconnect_ms = o && o->reconnect_ms >= 0 ? o->reconnect_ms
                                               : env_ms("KVFERRY_RECONNECT_MS", KVF_RECONNECT_MS_DEFAULT);
  kvf_client *c = client_new();
  if (!c) return -ENOMEM;
  c->reconnect_ms = reconnect_ms;
  c->spin_us = (unsigned)env_ms("KVFERRY_SPIN_US", KVF_SPIN_US_DEFAULT);
  if (c->spin_us > KVF__SPIN_US_MAX) c->spin_us = KVF__SPIN_US_MAX;
  bool spare = cpus_spare(c->spin_us);
  c->watch_spins = spare;
  c->soon_polls = soon_polls_here(spare);
  c->grant_spin_us = (unsigned)env_ms("KVFERRY_GRANT_SPIN_US", spare ? KVF_GRANT_SPIN_US_DEFAULT : 0);
  if (c->grant_spin_us > KVF__GRANT_SPIN_US_MAX) c->grant_spin_us = KVF__GRANT_SPIN_US_MAX;
  c->socket_path = strdup(resolve_socket_path(socket_path));
  int rc = c->socket_path ? connect_waiting(c, wait_ms, &c->sock) : -ENOMEM;
  if (!rc) rc = exchange_hello(c);
  if (!rc) {
    set_socket_timeouts(c->sock, 0); /* from now on a slow daemon is waited for */
    set_conn(c, CONN_UP);
    rc = start_reader(c);
  }
  if (rc) {
    client_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

KVF_API int kvf_connect(const char *socket_path, kvf_client **out) {
  return kvf_connect_ex(socket_path, NULL, out);
}

KVF_API void kvf_close(kvf_client *c) {
  if (!c) return;
  if (c->reader_started) {
    pthread_mutex_lock(&c->mu);
    c->closing = true;
    pthread_cond_broadcast(&c->state_cv);
    shutdown(c->sock, SHUT_RDWR); /* the reader sees EOF and exits */
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->reader, NULL);
  }
  client_free(c);
}

KVF_API const char *kvf_node(const kvf_client *c) { return c ? c->node : ""; }

/* ------------------------------------------------------------ pools */

/* The engine's id of a pool the daemon reports (by its name: the id a
 * restarted daemon gives it may differ). Learns pools seen for the first
 * time; called with mu held. */
static uint32_t learn_pool_locked(kvf_client *c, const Kvf__PoolInfo *w) {
  kvf__idrec *r = kvf__ids_by_name(&c->pools, w->name);
  if (!r) r = kvf__ids_by_did(&c->pools, w->id);
  if (!r) r = kvf__ids_add(&c->pools, w->id, w->name, NULL);
  if (!r) return w->id; /* out of memory: the daemon's id, untranslated */
  r->did = w->id;
  return r->vid;
}

static void pool_from_wire(kvf_client *c, kvf_pool_info *dst, const Kvf__PoolInfo *src) {
  memset(dst, 0, sizeof(*dst));
  pthread_mutex_lock(&c->mu);
  dst->id = learn_pool_locked(c, src);
  pthread_mutex_unlock(&c->mu);
  copy_string(dst->name, sizeof(dst->name), src->name);
  copy_string(dst->kind, sizeof(dst->kind), src->kind);
  copy_string(dst->backing, sizeof(dst->backing), src->backing);
  dst->size = src->size;
  dst->engine = src->engine;
  copy_string(dst->nic_reg, sizeof(dst->nic_reg), src->nic_reg);
}

/* The daemon's id of the engine's pool (or layout, ids) for a request on
 * the connection *gen: translated only while the connection is up, so
 * that a request never carries ids of one daemon to the next. */
static int id_out_on(kvf_client *c, kvf__ids *ids, uint32_t vid, uint32_t *did, uint64_t *gen) {
  pthread_mutex_lock(&c->mu);
  int rc = c->conn == CONN_UP ? 0 : KVF_EDAEMON;
  *did = kvf__ids_out(ids, vid);
  *gen = c->gen;
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* Asks the daemon for its pools; *msg holds them until freed. */
static int fetch_pools(kvf_client *c, Kvf__ApiMessage **msg) {
  Kvf__PoolsReq body = KVF__POOLS_REQ__INIT;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_POOLS;
  req.pools = &body;
  return call(c, &req, KVF__API_RESPONSE__BODY_POOLS, msg, NULL);
}

KVF_API int kvf_pools(kvf_client *c, kvf_pool_info *out, size_t cap) {
  if (!c || (!out && cap)) return KVF_EINVAL;
  Kvf__ApiMessage *msg;
  int rc = fetch_pools(c, &msg);
  if (rc) return rc;
  const Kvf__PoolsResp *pools = msg->response->pools;
  for (size_t i = 0; i < pools->n_pools && i < cap; i++) pool_from_wire(c, &out[i], pools->pools[i]);
  int count = pools->n_pools > INT_MAX ? INT_MAX : (int)pools->n_pools;
  kvf__api_message__free_unpacked(msg, NULL);
  return count;
}

KVF_API int kvf_pool_find(kvf_client *c, const char *name, kvf_pool_info *out) {
  if (!c || !name || !out) return KVF_EINVAL;
  Kvf__ApiMessage *msg;
  int rc = fetch_pools(c, &msg);
  if (rc) return rc;
  const Kvf__PoolsResp *pools = msg->response->pools;
  rc = KVF_ENOPOOL;
  for (size_t i = 0; i < pools->n_pools && rc; i++) {
    if (strcmp(pools->pools[i]->name, name) == 0) {
      pool_from_wire(c, out, pools->pools[i]);
      rc = 0;
    }
  }
  kvf__api_message__free_unpacked(msg, NULL);
  return rc;
}

/* The cached mapping of pool, or NULL. Called with mu held. */
static struct mapping *find_mapping(kvf_client *c, uint32_t pool) {
  for (struct mapping *m = c->maps; m; m = m->next)
    if (m->pool == pool) return m;
  return NULL;
}

static bool lookup_mapping(kvf_client *c, uint32_t pool, void **addr, uint64_t *size) {
  pthread_mutex_lock(&c->mu);
  struct mapping *m = find_mapping(c, pool);
  if (m) {
    *addr = m->addr;
    if (size) *size = m->size;
  }
  pthread_mutex_unlock(&c->mu);
  return m != NULL;
}

/* Caches a fresh mapping. If another thread mapped the same pool meanwhile,
 * its mapping wins and ours is undone, so every caller sees one address. */
static int cache_mapping(kvf_client *c, uint32_t pool, void *addr, uint64_t size, void *gpu) {
  struct mapping *fresh = malloc(sizeof(*fresh));
  if (!fresh) {
    unmap(addr, size, gpu);
    return -ENOMEM;
  }
  *fresh = (struct mapping){.pool = pool, .addr = addr, .size = size, .gpu = gpu};
  pthread_mutex_lock(&c->mu);
  if (find_mapping(c, pool)) {
    pthread_mutex_unlock(&c->mu);
    unmap(addr, size, gpu);
    free(fresh);
    return 0;
  }
  fresh->next = c->maps;
  c->maps = fresh;
  pthread_mutex_unlock(&c->mu);
  return 0;
}

static int map_pool_fd(int fd, uint64_t size, void **addr) {
  if (fd < 0 || size == 0) return KVF_EPROTO; /* a MapResp must carry both */
  /* Pages past the end of a file fault with SIGBUS later, in the engine:
   * refuse a size the file does not back now. */
  struct stat st;
  if (fstat(fd, &st) < 0) return -errno;
  if (S_ISREG(st.st_mode) && (uint64_t)st.st_size < size) return KVF_EPROTO;
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return -errno;
  *addr = p;
  return 0;
}

KVF_API int kvf_pool_map(kvf_client *c, uint32_t pool, void **addr, uint64_t *size) {
  if (!c || !addr) return KVF_EINVAL;
  if (lookup_mapping(c, pool, addr, size)) return 0;
  Kvf__MapReq body = KVF__MAP_REQ__INIT;
  uint64_t gen;
  int rc = id_out_on(c, &c->pools, pool, &body.pool, &gen);
  if (rc) return rc;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_MAP;
  req.map = &body;
  Kvf__ApiMessage *msg;
  int fd;
  rc = call_on(c, gen, &req, -1, KVF__API_RESPONSE__BODY_MAP, &msg, &fd);
  if (rc) return rc;
  const Kvf__PoolInfo *info = msg->response->map->pool;
  if (info) {
    pthread_mutex_lock(&c->mu);
    learn_pool_locked(c, info);
    pthread_mutex_unlock(&c->mu);
  }
  uint64_t pool_size = info ? info->size : 0;
  bool gpu = info && info->kind && strncmp(info->kind, "cuda:", 5) == 0;
  kvf__api_message__free_unpacked(msg, NULL);
  void *p = NULL, *gpu_state = NULL;
  rc = gpu ? kvf__cuda_map_fd(fd, pool_size, &p, &gpu_state) : map_pool_fd(fd, pool_size, &p);
  if (fd >= 0) close(fd); /* the mapping keeps the memory alive */
  if (!rc) rc = cache_mapping(c, pool, p, pool_size, gpu_state);
  if (rc) return rc;
  return lookup_mapping(c, pool, addr, size) ? 0 : KVF_EPROTO;
}

/* ------------------------------------------------------------ transfers */


/* The current daemon's ids for the engine's pools, copied so that a long
 * list is translated without holding mu. */
static int snap_pools(kvf_client *c, kvf__idsnap *s) {
  pthread_mutex_lock(&c->mu);
  int rc = kvf__ids_snap(&c->pools, s);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

static uint32_t layout_out(kvf_client *c, uint32_t layout) {
  pthread_mutex_lock(&c->mu);
  uint32_t did = kvf__ids_out(&c->layouts, layout);
  pthread_mutex_unlock(&c->mu);
  return did;
}

static void pack_descs(const kvf_desc *descs, size_t n, uint8_t *p, const kvf__idsnap *ids) {
  uint32_t last_v = 0, last_d = kvf__idsnap_out(ids, 0);
  for (size_t i = 0; i < n; i++, p += DESC_WIRE_SIZE) {
    if (descs[i].pool != last_v) { /* runs of one pool: one lookup */
      last_v = descs[i].pool;
      last_d = kvf__idsnap_out(ids, last_v);
    }
    kvf__le32_put(p, last_d);
    kvf__le64_put(p + 4, descs[i].offset);
    kvf__le64_put(p + 12, descs[i].len);
  }
}

/* Room for need bytes in *buf (write_mu held), which is kept for the next
 * call like wbuf: a fresh buffer of a few hundred KiB per call costs a page
 * fault per 4 KiB. */
static int reserve(uint8_t **buf, size_t *cap, size_t need) {
  if (need <= *cap) return 0;
  uint8_t *b = malloc(need); /* not realloc: the old contents are not needed */
  if (!b) return -ENOMEM;
  free(*buf);
  *buf = b;
  *cap = need;
  return 0;
}

/* Room for n packed descriptors in dbuf. */
static int reserve_dbuf(kvf_client *c, size_t n) {
  if (n > SIZE_MAX / DESC_WIRE_SIZE) return KVF_ELIMIT;
  return reserve(&c->dbuf, &c->dcap, n * DESC_WIRE_SIZE);
}

/* A buffer past WBUF_KEEP (a call of 200k descriptors) is not kept. */
static void trim_dbuf(kvf_client *c) {
  if (c->dcap <= WBUF_KEEP) return;
  free(c->dbuf);
  free(c->bbuf);
  c->dbuf = NULL;
  c->dcap = 0;
}

/* One request whose list is packed into dbuf under write_mu (so the
 * buffer serves every call) by pack(c, arg), and its response awaited
 * (unanswered requests go by kvf_submit). The ids are translated after
 * the request is numbered for a connection, so that a list translated for
 * one daemon never reaches the next. */
static int call_packed(kvf_client *c, Kvf__ApiRequest *req, int (*pack)(kvf_client *, void *), void *arg) {
  struct pending p;
  pthread_mutex_lock(&c->write_mu);
  int rc = register_pending(c, &p);
  bool registered = rc == 0;
  req->seq = p.seq;
  if (rc == 0) rc = pack(c, arg);
  if (rc == 0) rc = send_request_locked(c, req, p.gen, -1);
  trim_dbuf(c);
  pthread_mutex_unlock(&c->write_mu);
  return registered ? finish_call(c, &p, rc, KVF__API_RESPONSE__BODY__NOT_SET, NULL, NULL) : rc;
}

typedef struct desc_list {
  Kvf__DescList *list;
  const kvf_desc *descs;
  size_t n;
} desc_list;

static int pack_desc_list(kvf_client *c, void *arg) {
  desc_list *d = arg;
  int rc = reserve_dbuf(c, d->n);
  kvf__idsnap ids;
  if (!rc) rc = snap_pools(c, &ids);
  if (rc) return rc;
  pack_descs(d->descs, d->n, c->dbuf, &ids);
  kvf__idsnap_free(&ids);
  d->list->packed.data = c->dbuf;
  d->list->packed.len = d->n * DESC_WIRE_SIZE;
  return 0;
}

static int call_with_descs(kvf_client *c, Kvf__ApiRequest *req, Kvf__DescList *list, const kvf_desc *descs,
                           size_t n) {
  desc_list d = {list, descs, n};
  return call_packed(c, req, pack_desc_list, &d);
}

static int check_transfer(const kvf_client *c, const char *xfer_id, const kvf_desc *descs,
                          size_t n) {
  if (!c) return KVF_EINVAL;
  int rc = check_xfer_id(xfer_id);
  return rc ? rc : check_descs(c, descs, n);
}

KVF_API int kvf_grant(kvf_client *c, const char *xfer_id, const char *src_node,
                      const kvf_desc *descs, size_t n, uint32_t deadline_ms) {
  int rc = check_transfer(c, xfer_id, descs, n);
  if (!rc) rc = check_node_name(src_node, false);
  if (rc) return rc;
  Kvf__DescList list = KVF__DESC_LIST__INIT;
  Kvf__GrantReq body = KVF__GRANT_REQ__INIT;
  body.xfer_id = (char *)xfer_id;
  body.src_node = (char *)(src_node ? src_node : "");
  body.descs = &list;
  body.deadline_ms = deadline_ms;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_GRANT;
  req.grant = &body;
  if ((rc = inflight_add(c, 'g', xfer_id)) != 0) return rc;
  return inflight_end(c, 'g', xfer_id, call_with_descs(c, &req, &list, descs, n));
}

/* A send of more than chain_first descriptors goes out as chained frames
 * of chain_first descriptors, then twice as many each frame up to
 * chain_max: the daemon starts moving the first blocks while the later
 * frames are still being packed and read. Only the last frame is answered,
 * for the whole call. Everything that can fail locally is allocated before
 * the first frame leaves; a write that fails halfway ends the connection. */
static int send_chained(kvf_client *c, Kvf__ApiRequest *req, const kvf_desc *descs, size_t n) {
  Kvf__SendReq *body = req->send;
  bool more = body->more;
  Kvf__DescList list = KVF__DESC_LIST__INIT;
  body->descs = &list;
  body->chained = true;
  struct pending p;
  pthread_mutex_lock(&c->write_mu);
  uint64_t gen;
  kvf__idsnap ids = {.identity = true};
  int rc = unanswered_seq(c, req, &gen); /* every frame goes to this connection */
  if (rc == 0) rc = reserve_dbuf(c, c->chain_max);
  if (rc == 0) rc = snap_pools(c, &ids);
  uint8_t *packed = c->dbuf;
  list.packed.data = packed;
  list.packed.len = (size_t)c->chain_max * DESC_WIRE_SIZE;
  if (rc == 0) rc = reserve(&c->wbuf, &c->wcap, KVF__FRAME_HDR + kvf__api_request__get_packed_size(req));
  bool registered = false;
  for (size_t at = 0, slice = c->chain_first; rc == 0 && at < n; slice = slice * 2 < c->chain_max ? slice * 2 : c->chain_max) {
    size_t k = n - at < slice ? n - at : slice;
    pack_descs(descs + at, k, packed, &ids);
    list.packed.len = k * DESC_WIRE_SIZE;
    at += k;
    body->chained = at < n;
    body->more = at < n ? true : more;
    if (at == n) {
      rc = register_pending_on(c, &p, gen, false);
      registered = rc == 0;
      req->seq = p.seq;
    } else {
      rc = unanswered_seq(c, req, &gen); /* answered by the last frame's response */
    }
    if (rc == 0) rc = send_request_locked(c, req, gen, -1);
  }
  kvf__idsnap_free(&ids);
  pthread_mutex_unlock(&c->write_mu);
  return registered ? finish_call(c, &p, rc, KVF__API_RESPONSE__BODY__NOT_SET, NULL, NULL) : rc;
}

/* Whether a send of xfer_id is open here (then this call continues it);
 * else *fresh is the entry that opens it when the call succeeds, made
 * before the call so that nothing can fail after the daemon took it. */
static int begin_send(kvf_client *c, const char *xfer_id, protobuf_c_boolean *continues,
                      struct open_send **fresh) {
  pthread_mutex_lock(&c->mu);
  bool open = send_is_open(c, xfer_id);
  pthread_mutex_unlock(&c->mu);
  *continues = open;
  *fresh = open ? NULL : open_send_new(xfer_id);
  if (!open && !*fresh) return -ENOMEM;
  int rc = open ? 0 : inflight_add(c, 's', xfer_id); /* a first part starts a transfer */
  if (rc) {
    free(*fresh);
    *fresh = NULL;
  }
  return rc;
}

/* A send call's result: one that succeeded opens its id (a failed first
 * part began nothing; a failed later part still ends with its event). */
static int end_send(kvf_client *c, struct open_send *fresh, int rc) {
  if (rc) {
    if (fresh) inflight_end(c, 's', fresh->id, rc);
    free(fresh);
    return rc;
  }
  pthread_mutex_lock(&c->mu);
  open_send(c, fresh);
  pthread_mutex_unlock(&c->mu);
  return 0;
}

static int submit_one(kvf_client *c, const kvf_sub *sub, unsigned flags);

KVF_API int kvf_send(kvf_client *c, const char *xfer_id, const char *dst_node,
                     const kvf_desc *descs, size_t n, unsigned flags, uint32_t deadline_ms) {
  if (flags & KVF_NOWAIT) {
    kvf_sub sub = {KVF_SUB_SEND, xfer_id, dst_node, descs, n, NULL, flags & KVF_SEND_MORE, deadline_ms};
    return (flags & ~(KVF_SEND_MORE | KVF_NOWAIT | KVF_NOBLOCK)) ? KVF_EINVAL : submit_one(c, &sub, flags);
  }
  int rc = check_transfer(c, xfer_id, descs, n);
  if (!rc) rc = check_node_name(dst_node, true);
  if (!rc && (flags & ~KVF_SEND_MORE)) rc = KVF_EINVAL;
  if (rc) return rc;
  Kvf__SendReq body = KVF__SEND_REQ__INIT;
  body.xfer_id = (char *)xfer_id;
  body.dst_node = (char *)dst_node;
  body.more = (flags & KVF_SEND_MORE) != 0;
  body.deadline_ms = deadline_ms;
  struct open_send *fresh;
  if ((rc = begin_send(c, xfer_id, &body.continues, &fresh)) != 0) return rc;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_SEND;
  req.send = &body;
  if (c->send_chains && n > c->chain_first) return end_send(c, fresh, send_chained(c, &req, descs, n));
  Kvf__DescList list = KVF__DESC_LIST__INIT;
  body.descs = &list;
  return end_send(c, fresh, call_with_descs(c, &req, &list, descs, n));
}

KVF_API int kvf_cancel(kvf_client *c, const char *xfer_id) {
  if (!c) return KVF_EINVAL;
  int rc = check_xfer_id(xfer_id);
  if (rc) return rc;
  Kvf__CancelReq body = KVF__CANCEL_REQ__INIT;
  body.xfer_id = (char *)xfer_id;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_CANCEL;
  req.cancel = &body;
  return call(c, &req, KVF__API_RESPONSE__BODY__NOT_SET, NULL, NULL);
}

/* ------------------------------------------------------------ layouts and blocks */

/* The wire form of l, its pool given as the daemon's id; *packed holds
 * the offsets until freed. */
static int layout_to_wire(const kvf_layout *l, uint32_t pool, Kvf__Layout *w, uint8_t **packed) {
  size_t n = (size_t)l->n_layers * l->n_kv;
  *packed = malloc(n * 8);
  if (!*packed) return -ENOMEM;
  for (size_t i = 0; i < n; i++) kvf__le64_put(*packed + 8 * i, l->offsets[i]);
  *w = (Kvf__Layout)KVF__LAYOUT__INIT;
  w->pool = pool;
  w->n_layers = l->n_layers;
  w->n_kv = l->n_kv;
  w->n_blocks = l->n_blocks;
  w->block_bytes = l->block_bytes;
  w->block_stride = l->block_stride;
  w->offsets = (ProtobufCBinaryData){n * 8, *packed};
  w->tokens_per_block = l->tokens_per_block;
  w->kv_heads = l->kv_heads;
  w->head_dim = l->head_dim;
  w->dtype_bytes = l->dtype_bytes;
  w->order = l->order;
  w->first_head = l->first_head;
  w->model_kv_heads = l->model_kv_heads;
  return 0;
}

/* Registers l with its pool as the daemon's id pool; *did: the layout's.
 * restoring: on the reader thread, which reads the answer itself, and
 * *answered says whether it came (a refusal, not a broken stream). */
static int layout_request(kvf_client *c, const kvf_layout *l, uint32_t pool, uint64_t gen, bool *restoring,
                          uint32_t *did) {
  Kvf__Layout w;
  uint8_t *packed;
  int rc = layout_to_wire(l, pool, &w, &packed);
  if (rc) return rc;
  Kvf__LayoutReq body = KVF__LAYOUT_REQ__INIT;
  body.layout = &w;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_LAYOUT;
  req.layout = &body;
  Kvf__ApiMessage *msg;
  rc = restoring ? sync_call_answered(c, &req, -1, KVF__API_RESPONSE__BODY_LAYOUT, &msg, NULL, restoring)
                 : call_on(c, gen, &req, -1, KVF__API_RESPONSE__BODY_LAYOUT, &msg, NULL);
  free(packed);
  if (rc) return rc;
  *did = msg->response->layout->id;
  kvf__api_message__free_unpacked(msg, NULL);
  return 0;
}

static struct layout_copy *layout_copy_new(const kvf_layout *l) {
  size_t n = (size_t)l->n_layers * l->n_kv;
  struct layout_copy *lc = malloc(sizeof(*lc) + n * sizeof(uint64_t));
  if (!lc) return NULL;
  lc->l = *l;
  memcpy(lc->offsets, l->offsets, n * sizeof(uint64_t));
  lc->l.offsets = lc->offsets;
  return lc;
}

KVF_API int kvf_layout_register(kvf_client *c, const kvf_layout *l, uint32_t *id) {
  if (!c || !l || !id || !l->offsets || l->n_kv == 0 || l->n_kv > 2 || l->n_layers == 0) return KVF_EINVAL;
  struct layout_copy *lc = layout_copy_new(l); /* kept to register it again after a restart */
  if (!lc) return -ENOMEM;
  uint32_t pool, did;
  uint64_t gen;
  int rc = id_out_on(c, &c->pools, l->pool, &pool, &gen);
  if (!rc) rc = layout_request(c, l, pool, gen, NULL, &did);
  if (rc) {
    free(lc);
    return rc;
  }
  pthread_mutex_lock(&c->mu);
  kvf__idrec *r = kvf__ids_add(&c->layouts, did, NULL, lc);
  *id = r ? r->vid : did; /* out of memory: not kept across a restart */
  pthread_mutex_unlock(&c->mu);
  if (!r) free(lc);
  return 0;
}

/* Forgets a layout (mu held). */
static void drop_layout_locked(kvf_client *c, uint32_t vid) {
  kvf__idrec *r = kvf__ids_by_vid(&c->layouts, vid);
  if (!r) return;
  free(r->data);
  kvf__ids_drop(&c->layouts, vid);
}

KVF_API int kvf_layout_free(kvf_client *c, uint32_t id) {
  if (!c) return KVF_EINVAL;
  Kvf__LayoutFreeReq body = KVF__LAYOUT_FREE_REQ__INIT;
  uint64_t gen;
  int rc = id_out_on(c, &c->layouts, id, &body.id, &gen);
  if (rc) return rc;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_LAYOUT_FREE;
  req.layout_free = &body;
  rc = call_on(c, gen, &req, -1, KVF__API_RESPONSE__BODY__NOT_SET, NULL, NULL);
  if (rc == 0) {
    pthread_mutex_lock(&c->mu);
    drop_layout_locked(c, id);
    pthread_mutex_unlock(&c->mu);
  }
  return rc;
}

typedef struct block_list {
  Kvf__BlockList *list;
  const kvf_blocks *b;
} block_list;

static int pack_block_list(kvf_client *c, void *arg) {
  block_list *bl = arg;
  bl->list->layout = layout_out(c, bl->b->layout);
  int rc = reserve(&c->dbuf, &c->dcap, bl->b->n * 4);
  if (rc) return rc;
  for (size_t i = 0; i < bl->b->n; i++) kvf__le32_put(c->dbuf + 4 * i, bl->b->ids[i]);
  bl->list->ids = (ProtobufCBinaryData){bl->b->n * 4, c->dbuf};
  return 0;
}

static int call_with_blocks(kvf_client *c, Kvf__ApiRequest *req, Kvf__BlockList *list, const kvf_blocks *b) {
  block_list bl = {list, b};
  return call_packed(c, req, pack_block_list, &bl);
}

/* ids may be absent only where allowed (a later part of a send). */
static int check_blocks(const kvf_client *c, const kvf_blocks *b, bool ids_optional) {
  if (!b || (b->n && !b->ids) || (!b->n && !ids_optional)) return KVF_EINVAL;
  if (c->max_descs && b->n > c->max_descs) return KVF_ELIMIT;
  return 0;
}

static void blocks_to_wire(const kvf_blocks *b, Kvf__BlockList *w) {
  w->layout = b->layout;
  w->first_layer = b->first_layer;
  w->n_layers = b->n_layers;
}

KVF_API int kvf_grant_blocks(kvf_client *c, const char *xfer_id, const char *src_node, const kvf_blocks *blocks,
                             unsigned flags, uint32_t deadline_ms) {
  if (flags & KVF_NOWAIT) {
    kvf_sub sub = {KVF_SUB_GRANT_BLOCKS, xfer_id, src_node, NULL, 0, blocks, flags & KVF_GRANT_LAYER_EVENTS,
                   deadline_ms};
    return (flags & ~(KVF_GRANT_LAYER_EVENTS | KVF_NOWAIT | KVF_NOBLOCK)) ? KVF_EINVAL : submit_one(c, &sub, flags);
  }
  if (!c) return KVF_EINVAL;
  int rc = check_xfer_id(xfer_id);
  if (!rc) rc = check_node_name(src_node, false);
  if (!rc) rc = check_blocks(c, blocks, false);
  if (!rc && (flags & ~KVF_GRANT_LAYER_EVENTS)) rc = KVF_EINVAL;
  if (rc) return rc;
  Kvf__BlockList list = KVF__BLOCK_LIST__INIT;
  blocks_to_wire(blocks, &list);
  Kvf__GrantReq body = KVF__GRANT_REQ__INIT;
  body.xfer_id = (char *)xfer_id;
  body.src_node = (char *)(src_node ? src_node : "");
  body.blocks = &list;
  body.deadline_ms = deadline_ms;
  body.layer_events = (flags & KVF_GRANT_LAYER_EVENTS) != 0;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_GRANT;
  req.grant = &body;
  if ((rc = inflight_add(c, 'g', xfer_id)) != 0) return rc;
  return inflight_end(c, 'g', xfer_id, call_with_blocks(c, &req, &list, blocks));
}

KVF_API int kvf_send_blocks(kvf_client *c, const char *xfer_id, const char *dst_node, const kvf_blocks *blocks,
                            unsigned flags, uint32_t deadline_ms) {
  if (flags & KVF_NOWAIT) {
    kvf_sub sub = {KVF_SUB_SEND_BLOCKS, xfer_id, dst_node, NULL, 0, blocks, flags & KVF_SEND_MORE, deadline_ms};
    return (flags & ~(KVF_SEND_MORE | KVF_NOWAIT | KVF_NOBLOCK)) ? KVF_EINVAL : submit_one(c, &sub, flags);
  }
  if (!c) return KVF_EINVAL;
  int rc = check_xfer_id(xfer_id);
  if (!rc) rc = check_dst_nodes(dst_node);
  if (!rc) rc = check_blocks(c, blocks, true);
  if (!rc && (flags & ~KVF_SEND_MORE)) rc = KVF_EINVAL;
  if (rc) return rc;
  Kvf__BlockList list = KVF__BLOCK_LIST__INIT;
  blocks_to_wire(blocks, &list);
  Kvf__SendReq body = KVF__SEND_REQ__INIT;
  body.xfer_id = (char *)xfer_id;
  body.dst_node = (char *)dst_node;
  body.blocks = &list;
  body.more = (flags & KVF_SEND_MORE) != 0;
  body.deadline_ms = deadline_ms;
  struct open_send *fresh;
  if ((rc = begin_send(c, xfer_id, &body.continues, &fresh)) != 0) return rc;
  if (!body.continues && blocks->n == 0) rc = KVF_EINVAL; /* a first part names its blocks */
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_SEND;
  req.send = &body;
  return end_send(c, fresh, rc ? rc : call_with_blocks(c, &req, &list, blocks));
}

/* ------------------------------------------------------------ submission without waiting
 *
 * kvf_submit and the KVF_NOWAIT calls (kvferry.h): each entry is checked
 * here, marked in the tables (its id open, its transfer in flight) as if
 * the daemon had taken it, and encoded with no_reply; the frames leave in
 * one write. Whatever the daemon refuses then comes as the entry's DONE
 * event (daemon/api.c, refusal_event), so an error is reported once. */

/* What a queued entry changed in the tables, undone when its frame never
 * leaves. */
typedef struct sub_mark {
  const char *id;
  char inflight;        /* 'g' or 's': a count it added; 0: none */
  bool opened;          /* it opened its send */
} sub_mark;

/* What a transfer's request names, checked without the daemon. */
static int sub_check_args(const kvf_client *c, const kvf_sub *s) {
  int rc = check_xfer_id(s->xfer_id);
  unsigned f = s->flags & ~KVF_NOWAIT, allowed = 0;
  switch (s->op) {
  case KVF_SUB_GRANT:
    if (!rc) rc = check_descs(c, s->descs, s->n);
    if (!rc) rc = check_node_name(s->node, false);
    break;
  case KVF_SUB_SEND:
    if (!rc) rc = check_descs(c, s->descs, s->n);
    if (!rc) rc = check_node_name(s->node, true);
    allowed = KVF_SEND_MORE;
    break;
  case KVF_SUB_GRANT_BLOCKS:
    if (!rc) rc = check_blocks(c, s->blocks, false);
    if (!rc) rc = check_node_name(s->node, false);
    allowed = KVF_GRANT_LAYER_EVENTS;
    break;
  case KVF_SUB_SEND_BLOCKS:
    if (!rc) rc = check_blocks(c, s->blocks, true);
    if (!rc) rc = check_dst_nodes(s->node);
    allowed = KVF_SEND_MORE;
    break;
  case KVF_SUB_CANCEL:
    break;
  default:
    return KVF_EINVAL;
  }
  return rc ? rc : (f & ~allowed) ? KVF_EINVAL : 0;
}

static bool sub_blocks(const kvf_sub *s) { return s->op == KVF_SUB_GRANT_BLOCKS || s->op == KVF_SUB_SEND_BLOCKS; }

/* What the tables say of entry s (mu held): refusals the library makes
 * itself; *continues: a send part continues a send open here. */
static int sub_check_state(kvf_client *c, const kvf_sub *s, bool *continues) {
  *continues = false;
  if (sub_blocks(s) && !kvf__ids_by_vid(&c->layouts, s->blocks->layout)) return KVF_ENOENT;
  switch (s->op) {
  case KVF_SUB_GRANT:
  case KVF_SUB_GRANT_BLOCKS:
    return inflight_has(c, 'g', s->xfer_id) ? KVF_EEXIST : 0;
  case KVF_SUB_SEND:
  case KVF_SUB_SEND_BLOCKS:
    *continues = send_is_open(c, s->xfer_id);
    return s->op == KVF_SUB_SEND_BLOCKS && !*continues && s->blocks->n == 0 ? KVF_EINVAL : 0;
  default: /* cancel */
    return inflight_has(c, 'g', s->xfer_id) || inflight_has(c, 's', s->xfer_id) ? 0 : KVF_ENOENT;
  }
}

/* Marks entry s taken (mu held): a grant or a first send part in flight,
 * a first part's id open for the parts after it. */
static int sub_mark_locked(kvf_client *c, const kvf_sub *s, bool continues, sub_mark *m) {
  *m = (sub_mark){.id = s->xfer_id};
  if (s->op == KVF_SUB_CANCEL || continues) return 0;
  char type = s->op == KVF_SUB_GRANT || s->op == KVF_SUB_GRANT_BLOCKS ? 'g' : 's';
  if (type == 's') {
    struct open_send *o = open_send_new(s->xfer_id);
    if (!o) return -ENOMEM;
    open_send(c, o);
    m->opened = true;
  }
  int rc = inflight_add_locked(c, type, s->xfer_id);
  if (rc == 0) m->inflight = type;
  else if (m->opened) close_send(c, s->xfer_id);
  return rc;
}

static void sub_undo_locked(kvf_client *c, const sub_mark *m) {
  if (m->inflight) inflight_undo_locked(c, m->inflight, m->id);
  if (m->opened) close_send(c, m->id);
}

/* The part of entry s the daemon needs from the tables, taken under mu
 * with its mark: its seq on connection gen and its layout's daemon id. */
typedef struct sub_take {
  bool continues;
  uint32_t layout;
  uint64_t seq;
} sub_take;

static int sub_take_locked(kvf_client *c, const kvf_sub *s, uint64_t gen, sub_mark *m, sub_take *t) {
  if (c->conn != CONN_UP || c->gen != gen) return KVF_EDAEMON;
  int rc = sub_check_state(c, s, &t->continues);
  if (rc == 0) rc = sub_mark_locked(c, s, t->continues, m);
  if (rc) return rc;
  t->layout = sub_blocks(s) ? kvf__ids_out(&c->layouts, s->blocks->layout) : 0;
  t->seq = ++c->last_seq;
  return 0;
}

/* Room for need bytes in *buf, keeping its first keep bytes. */
static int reserve_keep(uint8_t **buf, size_t *cap, size_t keep, size_t need) {
  if (need <= *cap) return 0;
  size_t ncap = *cap ? *cap : 4096;
  while (ncap < need) ncap *= 2;
  uint8_t *b = malloc(ncap);
  if (!b) return -ENOMEM;
  if (keep) memcpy(b, *buf, keep);
  free(*buf);
  *buf = b;
  *cap = ncap;
  return 0;
}

/* The list of entry s packed into dbuf (write_mu held), named in w. */
static int sub_pack_list(kvf_client *c, const kvf_sub *s, const kvf__idsnap *ids, const sub_take *t,
                         kvf__wire_req *w) {
  if (s->op == KVF_SUB_GRANT || s->op == KVF_SUB_SEND) {
    int rc = reserve_dbuf(c, s->n);
    if (rc) return rc;
    pack_descs(s->descs, s->n, c->dbuf, ids);
    w->has_descs = true;
    w->descs = c->dbuf;
    w->descs_len = s->n * DESC_WIRE_SIZE;
  } else if (sub_blocks(s)) {
    int rc = reserve(&c->dbuf, &c->dcap, s->blocks->n * 4);
    if (rc) return rc;
    for (size_t i = 0; i < s->blocks->n; i++) kvf__le32_put(c->dbuf + 4 * i, s->blocks->ids[i]);
    w->has_blocks = true;
    w->layout = t->layout;
    w->ids = c->dbuf;
    w->ids_len = s->blocks->n * 4;
    w->first_layer = s->blocks->first_layer;
    w->n_layers = s->blocks->n_layers;
  }
  return 0;
}

/* Appends entry s's frame to bbuf at *at (write_mu held). */
static int sub_encode(kvf_client *c, const kvf_sub *s, const kvf__idsnap *ids, const sub_take *t, size_t *at) {
  kvf__wire_req w = {.seq = t->seq, .xfer_id = s->xfer_id, .node = s->node, .deadline_ms = s->deadline_ms,
                     .no_reply = true};
  int rc = sub_pack_list(c, s, ids, t, &w);
  if (rc) return rc;
  if (s->op == KVF_SUB_GRANT || s->op == KVF_SUB_GRANT_BLOCKS) {
    w.kind = KVF__WIRE_GRANT;
    w.layer_events = (s->flags & KVF_GRANT_LAYER_EVENTS) != 0;
  } else if (s->op == KVF_SUB_CANCEL) {
    w.kind = KVF__WIRE_CANCEL;
  } else {
    w.kind = KVF__WIRE_SEND;
    w.more = (s->flags & KVF_SEND_MORE) != 0;
    w.continues = t->continues;
  }
  size_t len = kvf__wire_size(&w);
  if (len > c->max_frame) return KVF_ELIMIT;
  rc = reserve_keep(&c->bbuf, &c->bcap, *at, *at + KVF__FRAME_HDR + len);
  if (rc) return rc;
  kvf__frame_put_header(c->bbuf + *at, (uint32_t)len);
  kvf__wire_pack(&w, c->bbuf + *at + KVF__FRAME_HDR);
  *at += KVF__FRAME_HDR + len;
  return 0;
}

/* The kernel charges each buffer it queues on a Unix socket with its
 * overhead; this much per 16 KiB of data covers it. */
#define SOCK_SLACK 4096u

/* Whether the socket's send buffer takes len more bytes without waiting
 * (KVF_NOBLOCK). When the kernel cannot say, the write goes ahead; so does
 * a request larger than the whole buffer once the buffer is empty (it
 * could never go otherwise: it waits while the daemon reads it). */
static bool socket_room(int sock, size_t len) {
  int queued = 0, sndbuf = 0;
  socklen_t l = sizeof(sndbuf);
  if (ioctl(sock, SIOCOUTQ, &queued) != 0 || getsockopt(sock, SOL_SOCKET, SO_SNDBUF, &sndbuf, &l) != 0)
    return true;
  return queued == 0 || (size_t)queued + len + SOCK_SLACK * (1 + len / 16384) <= (size_t)sndbuf;
}

/* Writes bbuf's len bytes on connection gen (write_mu held). */
static int write_batch(kvf_client *c, size_t len, uint64_t gen, bool noblock) {
  if (gen != c->sock_gen) return KVF_EDAEMON;
  if (noblock && !socket_room(c->sock, len)) return -EAGAIN;
  if (kvf__send_all(c->sock, c->bbuf, len, -1) == 0) {
    spin_reader_for_answer(c);
    return 0;
  }
  shutdown(c->sock, SHUT_RDWR); /* a partly written frame ends the stream (send_request_locked) */
  return KVF_EDAEMON;
}

/* The batch's frames did not leave: the marks go, unless the connection
 * broke meanwhile and its end already reported every transfer in flight
 * (then the entries count as queued: their events say KVF_EDAEMON). */
static int sub_unwind(kvf_client *c, const sub_mark *marks, size_t k, uint64_t gen, int rc) {
  pthread_mutex_lock(&c->mu);
  bool reported = rc == KVF_EDAEMON && c->gen != gen;
  if (!reported)
    for (size_t i = k; i-- > 0;) sub_undo_locked(c, &marks[i]);
  pthread_mutex_unlock(&c->mu);
  return reported ? 0 : rc;
}

static void trim_bbuf(kvf_client *c) {
  if (c->bcap <= WBUF_KEEP) return;
  free(c->bbuf);
  c->bbuf = NULL;
  c->bcap = 0;
}

/* Takes entries from the first until one is refused; *at: their frames'
 * bytes in bbuf. Returns how many, *refused the refusal (write_mu held).
 * One hold of mu for the batch: encoding an entry takes a fraction of a
 * microsecond, less than taking the lock twice for it. */
static size_t sub_take_all(kvf_client *c, const kvf_sub *subs, size_t n, uint64_t gen, const kvf__idsnap *ids,
                           sub_mark *marks, size_t *at, int *refused) {
  size_t k = 0;
  pthread_mutex_lock(&c->mu);
  for (; k < n; k++) {
    sub_take t;
    int rc = sub_check_args(c, &subs[k]);
    if (rc == 0) rc = sub_take_locked(c, &subs[k], gen, &marks[k], &t);
    if (rc == 0 && (rc = sub_encode(c, &subs[k], ids, &t, at)) != 0) sub_undo_locked(c, &marks[k]);
    if (rc) {
      *refused = rc;
      break;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return k;
}

#define SUB_MARKS_INLINE 16

KVF_API int kvf_submit(kvf_client *c, const kvf_sub *subs, size_t n, unsigned flags, int *error) {
  if (error) *error = 0;
  if (!c || (!subs && n) || n > INT_MAX || (flags & ~(KVF_NOWAIT | KVF_NOBLOCK))) return KVF_EINVAL;
  if (n == 0) return 0;
  sub_mark inl[SUB_MARKS_INLINE], *marks = n <= SUB_MARKS_INLINE ? inl : malloc(n * sizeof(*marks));
  if (!marks) return -ENOMEM;
  pthread_mutex_lock(&c->write_mu);
  pthread_mutex_lock(&c->mu);
  uint64_t gen = c->gen;
  int rc = c->conn == CONN_UP ? 0 : KVF_EDAEMON;
  pthread_mutex_unlock(&c->mu);
  kvf__idsnap ids = {.identity = true};
  if (rc == 0) rc = snap_pools(c, &ids);
  size_t at = 0, k = 0;
  int refused = 0;
  if (rc == 0) k = sub_take_all(c, subs, n, gen, &ids, marks, &at, &refused);
  if (rc == 0 && k > 0 && (rc = write_batch(c, at, gen, flags & KVF_NOBLOCK)) != 0) rc = sub_unwind(c, marks, k, gen, rc);
  kvf__idsnap_free(&ids);
  trim_bbuf(c);
  trim_dbuf(c);
  pthread_mutex_unlock(&c->write_mu);
  if (marks != inl) free(marks);
  if (rc) return rc;
  if (k < n && error) *error = refused;
  return (int)k;
}

/* One call with KVF_NOWAIT: 0 or its refusal. */
static int submit_one(kvf_client *c, const kvf_sub *sub, unsigned flags) {
  int err = 0;
  int rc = kvf_submit(c, sub, 1, flags & KVF_NOBLOCK, &err);
  return rc < 0 ? rc : rc == 1 ? 0 : err;
}

/* ------------------------------------------------------------ engine memory */

/* The MemRegisterReq of em, named name; *fd_out: the fd to attach or -1. */
static void mem_request(const struct engine_mem *em, const char *name, Kvf__MemRegisterReq *body, char *kind,
                        size_t kind_cap, int *fd_out) {
  *body = (Kvf__MemRegisterReq)KVF__MEM_REGISTER_REQ__INIT;
  body->name = (char *)name;
  body->size = em->size;
  body->offset = em->offset;
  if (em->kind == KVF_MEM_HOST) {
    copy_string(kind, kind_cap, "host");
    *fd_out = em->fd;
  } else {
    snprintf(kind, kind_cap, "cuda:%d", em->ex.dev);
    body->alloc_size = em->ex.alloc_size;
    /* the VMM fd; or, with the IPC handle, the allocation's dmabuf */
    *fd_out = em->fd;
    if (!em->vmm) body->cuda_ipc_handle = (ProtobufCBinaryData){sizeof(em->ex.ipc), (uint8_t *)em->ex.ipc};
    body->cuda_pci_bus_id = (char *)em->ex.bus_id;
  }
  body->kind = kind;
  body->has_fd = *fd_out >= 0;
}

/* Registers em with the daemon; *msg: the answer, with the pool it became. */
static int mem_register_call(kvf_client *c, const struct engine_mem *em, const char *name, Kvf__ApiMessage **msg) {
  Kvf__MemRegisterReq body;
  char kind[24];
  int fd;
  mem_request(em, name, &body, kind, sizeof(kind), &fd);
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_MEM_REGISTER;
  req.mem_register = &body;
  int rc = call_on(c, ANY_GEN, &req, fd, KVF__API_RESPONSE__BODY_MEM_REGISTER, msg, NULL);
  if (rc == 0 && !(*msg)->response->mem_register->pool) {
    kvf__api_message__free_unpacked(*msg, NULL);
    rc = KVF_EPROTO;
  }
  return rc;
}

/* What the library keeps of m: the file (host) or the export (cuda). */
static int engine_mem_new(const kvf_mem *m, struct engine_mem **out) {
  struct engine_mem *em = calloc(1, sizeof(*em));
  if (!em) return -ENOMEM;
  em->kind = m->kind;
  em->addr = (uintptr_t)m->addr;
  em->size = m->size;
  em->fd = -1;
  int rc;
  if (m->kind == KVF_MEM_HOST && m->fd >= 0) {
    em->fd = fcntl(m->fd, F_DUPFD_CLOEXEC, 0); /* ours, for a restarted daemon */
    em->offset = m->fd_offset;
    rc = em->fd >= 0 ? 0 : -errno;
  } else if (m->kind == KVF_MEM_HOST) {
    rc = kvf__host_mem_fd(m->addr, m->size, &em->fd, &em->offset);
  } else {
    rc = kvf__cuda_export_range(m->addr, m->size, &em->ex);
    em->vmm = em->ex.fd >= 0;
    em->fd = em->vmm ? em->ex.fd : em->ex.dmabuf_fd;
    em->ex.fd = em->ex.dmabuf_fd = -1; /* kept once, as em->fd */
    em->offset = (uintptr_t)m->addr - em->ex.alloc_base;
  }
  if (rc) {
    engine_mem_free(em);
    return rc;
  }
  *out = em;
  return 0;
}

KVF_API int kvf_mem_register(kvf_client *c, const kvf_mem *m, uint32_t *pool) {
  if (!c || !m || !pool || !m->addr || m->size == 0) return KVF_EINVAL;
  if (m->kind != KVF_MEM_HOST && m->kind != KVF_MEM_CUDA) return KVF_EINVAL;
  if (m->name && (!*m->name || strnlen(m->name, KVF_NAME_MAX + 1) > KVF_NAME_MAX)) return KVF_EINVAL;
  char name[KVF_NAME_MAX + 1];
  if (m->name) {
    copy_string(name, sizeof(name), m->name);
  } else {
    pthread_mutex_lock(&c->mu);
    uint32_t n = ++c->mem_seq;
    pthread_mutex_unlock(&c->mu);
    snprintf(name, sizeof(name), "%ld-mem%u", (long)getpid(), n);
  }
  struct engine_mem *em;
  int rc = engine_mem_new(m, &em);
  if (rc) return rc;
  Kvf__ApiMessage *msg;
  rc = mem_register_call(c, em, name, &msg);
  if (rc) {
    engine_mem_free(em);
    return rc;
  }
  const Kvf__PoolInfo *info = msg->response->mem_register->pool;
  pthread_mutex_lock(&c->mu);
  kvf__idrec *r = kvf__ids_by_name(&c->pools, info->name);
  if (!r) r = kvf__ids_add(&c->pools, info->id, info->name, NULL);
  if (r) {
    r->did = info->id;
    engine_mem_free(r->data); /* a stale entry of the same name */
    r->data = em;
    *pool = r->vid;
  } else {
    *pool = info->id; /* out of memory: not registered again after a restart */
    engine_mem_free(em);
  }
  pthread_mutex_unlock(&c->mu);
  kvf__api_message__free_unpacked(msg, NULL);
  return 0;
}

KVF_API int kvf_mem_unregister(kvf_client *c, uint32_t pool) {
  if (!c) return KVF_EINVAL;
  Kvf__MemUnregisterReq body = KVF__MEM_UNREGISTER_REQ__INIT;
  uint64_t gen;
  int rc = id_out_on(c, &c->pools, pool, &body.pool, &gen);
  if (rc) return rc;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_MEM_UNREGISTER;
  req.mem_unregister = &body;
  rc = call_on(c, gen, &req, -1, KVF__API_RESPONSE__BODY__NOT_SET, NULL, NULL);
  if (rc) return rc;
  /* The daemon dropped the memory and this client's layouts on it. */
  pthread_mutex_lock(&c->mu);
  kvf__idrec *r = kvf__ids_by_vid(&c->pools, pool);
  if (r) {
    engine_mem_free(r->data);
    kvf__ids_drop(&c->pools, pool);
  }
  for (size_t i = c->layouts.n; i-- > 0;) {
    const struct layout_copy *lc = c->layouts.v[i].data;
    if (lc && lc->l.pool == pool) drop_layout_locked(c, c->layouts.v[i].vid);
  }
  pthread_mutex_unlock(&c->mu);
  return 0;
}

/* ------------------------------------------------------------ reconnect
 *
 * All on the reader thread, which reads the new socket itself (sync_call)
 * while the connection is down: engine calls fail with KVF_EDAEMON until
 * the engine's memory, layouts and mappings are back. A refusal by the new
 * daemon leaves that one pool or layout with no id there (KVF__NO_ID);
 * a broken stream fails the attempt. */

/* Engine memory, registered again from the fd or export kept. */
static int restore_mems(kvf_client *c) {
  for (size_t i = 0;; i++) {
    /* A copy with an fd of its own: an unregister that succeeded just
     * before the break may free the entry meanwhile. */
    pthread_mutex_lock(&c->mu);
    bool more = i < c->pools.n;
    const struct engine_mem *kept = more ? c->pools.v[i].data : NULL;
    struct engine_mem copy = kept ? *kept : (struct engine_mem){0};
    if (kept && kept->fd >= 0) copy.fd = fcntl(kept->fd, F_DUPFD_CLOEXEC, 0);
    uint32_t vid = more ? c->pools.v[i].vid : 0;
    char name[64];
    if (more) copy_string(name, sizeof(name), c->pools.v[i].name);
    pthread_mutex_unlock(&c->mu);
    if (!more) return 0;
    if (!kept) continue;
    if (kept->fd >= 0 && copy.fd < 0) return -errno;
    const struct engine_mem *em = &copy;
    Kvf__ApiMessage *msg;
    bool answered;
    Kvf__MemRegisterReq body;
    char kind[24];
    int fd;
    mem_request(em, name, &body, kind, sizeof(kind), &fd);
    Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
    req.body_case = KVF__API_REQUEST__BODY_MEM_REGISTER;
    req.mem_register = &body;
    int rc = sync_call_answered(c, &req, fd, KVF__API_RESPONSE__BODY_MEM_REGISTER, &msg, NULL, &answered);
    if (copy.fd >= 0) close(copy.fd);
    if (rc && !answered) return rc;
    const Kvf__PoolInfo *info = rc == 0 ? msg->response->mem_register->pool : NULL;
    pthread_mutex_lock(&c->mu);
    kvf__idrec *r = kvf__ids_by_vid(&c->pools, vid);
    if (r) r->did = info ? info->id : KVF__NO_ID;
    pthread_mutex_unlock(&c->mu);
    if (rc == 0) kvf__api_message__free_unpacked(msg, NULL);
  }
}

/* Daemon pools, found again by name. */
static int restore_pools(kvf_client *c) {
  Kvf__PoolsReq body = KVF__POOLS_REQ__INIT;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_POOLS;
  req.pools = &body;
  Kvf__ApiMessage *msg;
  int rc = sync_call(c, &req, -1, KVF__API_RESPONSE__BODY_POOLS, &msg, NULL);
  if (rc) return rc;
  const Kvf__PoolsResp *pools = msg->response->pools;
  pthread_mutex_lock(&c->mu);
  for (size_t i = 0; i < c->pools.n; i++) {
    kvf__idrec *r = &c->pools.v[i];
    if (r->data) continue; /* engine memory: restore_mems */
    r->did = KVF__NO_ID;
    for (size_t k = 0; k < pools->n_pools; k++)
      if (strcmp(pools->pools[k]->name, r->name) == 0) r->did = pools->pools[k]->id;
  }
  pthread_mutex_unlock(&c->mu);
  kvf__api_message__free_unpacked(msg, NULL);
  return 0;
}

static int restore_layouts(kvf_client *c) {
  for (size_t i = 0;; i++) {
    pthread_mutex_lock(&c->mu);
    bool more = i < c->layouts.n;
    struct layout_copy *lc = NULL;
    uint32_t vid = 0, pool = 0;
    if (more) {
      vid = c->layouts.v[i].vid;
      lc = layout_copy_new(&((struct layout_copy *)c->layouts.v[i].data)->l);
      pool = lc ? kvf__ids_out(&c->pools, lc->l.pool) : 0;
    }
    pthread_mutex_unlock(&c->mu);
    if (!more) return 0;
    if (!lc) return -ENOMEM;
    uint32_t did = KVF__NO_ID;
    bool answered = false;
    int rc = layout_request(c, &lc->l, pool, ANY_GEN, &answered, &did);
    free(lc);
    if (rc && !answered) return rc;
    pthread_mutex_lock(&c->mu);
    kvf__idrec *r = kvf__ids_by_vid(&c->layouts, vid);
    if (r) r->did = rc == 0 ? did : KVF__NO_ID;
    pthread_mutex_unlock(&c->mu);
  }
}

/* Pools this engine mapped: the new daemon's memory at the same addresses
 * (host: MAP_FIXED over the old mapping; cuda:N: the new allocation mapped
 * under the same reserved device addresses), so pointers the engine holds
 * stay valid. */
static int restore_maps(kvf_client *c) {
  for (size_t i = 0;; i++) {
    pthread_mutex_lock(&c->mu);
    struct mapping *m = c->maps;
    for (size_t k = 0; m && k < i; k++) m = m->next;
    uint32_t pool = m ? kvf__ids_out(&c->pools, m->pool) : 0;
    void *gpu = m ? m->gpu : NULL;
    void *addr = m ? m->addr : NULL;
    uint64_t size = m ? m->size : 0;
    pthread_mutex_unlock(&c->mu);
    if (!m) return 0;
    if (pool == KVF__NO_ID) continue;
    Kvf__MapReq body = KVF__MAP_REQ__INIT;
    body.pool = pool;
    Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
    req.body_case = KVF__API_REQUEST__BODY_MAP;
    req.map = &body;
    Kvf__ApiMessage *msg;
    int fd = -1;
    bool answered;
    int rc = sync_call_answered(c, &req, -1, KVF__API_RESPONSE__BODY_MAP, &msg, &fd, &answered);
    if (rc && !answered) return rc;
    if (rc) continue;
    const Kvf__PoolInfo *info = msg->response->map->pool;
    struct stat st;
    /* Only a file that backs the whole old mapping: beyond it the engine
     * would take SIGBUS. Otherwise the old daemon's memory stays. */
    if (gpu && info && fd >= 0)
      kvf__cuda_remap_fd(gpu, fd, size);
    else if (info && info->size >= size && fd >= 0 && fstat(fd, &st) == 0 && (uint64_t)st.st_size >= size)
      mmap(addr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    if (fd >= 0) close(fd);
    kvf__api_message__free_unpacked(msg, NULL);
  }
}

static int restore(kvf_client *c) {
  int rc = restore_mems(c);
  if (!rc) rc = restore_pools(c);
  if (!rc) rc = restore_layouts(c);
  if (!rc) rc = restore_maps(c);
  return rc;
}

/* Makes sock the connection, numbered as the current gen; refused once
 * kvf_close began (it shuts down whatever sock is then). */
static int install_socket(kvf_client *c, int sock) {
  pthread_mutex_lock(&c->write_mu);
  pthread_mutex_lock(&c->mu);
  int rc = c->closing ? KVF_EDAEMON : 0;
  if (rc == 0) {
    close(c->sock);
    c->sock = sock;
    c->sock_gen = c->gen;
    while (c->in.nfds) close(pop_fd(&c->in));
    kvf__framebuf_free(&c->in.fb);
    kvf__framebuf_init(&c->in.fb, KVF__FRAME_MAX_DEFAULT);
    c->in.received = c->in.consumed = 0;
  }
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_unlock(&c->write_mu);
  if (rc) close(sock);
  return rc;
}

/* A failed attempt: what went out on it is over. */
static void next_gen(kvf_client *c) {
  pthread_mutex_lock(&c->mu);
  c->gen++;
  answered_locked(c);
  pthread_mutex_unlock(&c->mu);
  answered_unlocked(c);
}

static void mark_up(kvf_client *c) {
  set_socket_timeouts(c->sock, 0);
  pthread_mutex_lock(&c->mu);
  set_conn(c, CONN_UP);
  sync_event_fd(c);
  pthread_cond_broadcast(&c->state_cv);
  pthread_mutex_unlock(&c->mu);
}

/* Connects again, for up to reconnect_ms; 0 once calls are taken again. */
static int reconnect(kvf_client *c) {
  int64_t end = now_ms() + c->reconnect_ms;
  int delay = RETRY_FIRST_MS;
  for (;;) {
    int sock;
    int rc = connect_unix(c->socket_path, &sock);
    if (rc == 0 && (rc = install_socket(c, sock)) == 0) {
      rc = exchange_hello(c);
      if (rc == 0) rc = restore(c);
      if (rc == 0) {
        mark_up(c);
        return 0;
      }
      next_gen(c);
      shutdown(c->sock, SHUT_RDWR);
    }
    /* Back off only while nobody listens: a daemon that refused the hello
     * (starting up, or full) is asked again at the longest interval. */
    int64_t left = end - now_ms();
    if (left <= 0) return rc;
    int ms = daemon_not_up(rc) ? delay : RETRY_MAX_MS;
    if (!backoff_sleep(c, ms < left ? ms : (int)left)) return KVF_EDAEMON;
    delay = delay * 2 < RETRY_MAX_MS ? delay * 2 : RETRY_MAX_MS;
  }
}

/* ------------------------------------------------------------ events API */

KVF_API int kvf_event_fd(kvf_client *c) { return c ? c->event_fd : KVF_EINVAL; }


/* Sleeps once on `evented`; returns ETIMEDOUT when the wait is over. */
static int wait_for_event(kvf_client *c, int timeout_ms, const struct timespec *deadline) {
  if (timeout_ms == 0) return ETIMEDOUT;
  if (timeout_ms < 0) return pthread_cond_wait(&c->evented, &c->mu);
  return pthread_cond_timedwait(&c->evented, &c->mu, deadline);
}

/* Spins up to us microseconds for an event after `seen` (mu not held):
 * an event that comes within them is taken without this thread going to
 * sleep and being woken (a futex round, 5-50 us on a busy machine). Past
 * its first firm_us (a window the engine asked for or a Soon), the spin is
 * the grant window's, and ends where the thread lost its CPU
 * (spin_lost_cpu). */
static void spin_for_event(kvf_client *c, uint64_t seen, uint64_t us, uint64_t firm_us) {
  spin_start from = spin_begin();
  uint64_t end = from.wall + us * 1000, firm_end = from.wall + firm_us * 1000;
  for (unsigned i = 1;; i++) {
    if (atomic_load_explicit(&c->ev_count, memory_order_acquire) != seen) return;
    if (i % 64 == 0) {
      uint64_t now = mono_ns();
      if (now >= end || (now >= firm_end && spin_lost_cpu(c, &from, now))) return;
    }
    cpu_relax();
  }
}

/* Takes mu for a waiter that wants an event now: the reader holds mu
 * briefly while it queues one (and writes the event fd), and a waiter
 * blocking on mu then would sleep and be woken, the cost it polls or
 * spins to avoid. Tries for a bounded time (about 100 us), then blocks. */
static void lock_for_event(kvf_client *c) {
  for (unsigned i = 0; i < 1024; i++) {
    if (pthread_mutex_trylock(&c->mu) == 0) return;
    cpu_relax();
  }
  pthread_mutex_lock(&c->mu);
}

/* How long a waiter woken by the socket spins for the event the reader is
 * dispatching (it woke with the reader, not after it); where no CPU is
 * spare, only as long as a reader awake on another CPU takes. */
#define WATCH_SPIN_US 500
#define WATCH_SPIN_SHORT_US 30

enum { WATCH_EVENT, WATCH_TIMEOUT, WATCH_OFF };

/* Sleeps until an event may be waiting, on the daemon's socket and the
 * event fd at once (mu released, retaken): an event then wakes this thread
 * and the reader thread together, and this one spins the few microseconds
 * the reader takes to queue it, instead of sleeping until the reader,
 * itself just woken, wakes it: one wake-up on the way to the engine
 * instead of two (after an idle gap each costs tens of microseconds, more
 * on a guest whose idle vCPUs halt). The socket is only watched: the
 * reader alone reads it. Where the process has no CPU to spare
 * (cpus_spare), the spin would hold off the reader it waits for (2 CPUs:
 * the reader waited for this thread's CPU through two 500 us spins, and a
 * 64 KiB handoff's event reached the engine 1 ms late in whole runs of the
 * dev machine's bench), so this thread spins only briefly, then waits for
 * the reader's signal. WATCH_OFF: the socket failed or closed, or woke this thread
 * twice in this call (once without spinning) for what was not an event
 * (responses to other threads' calls): wait on the condition variable
 * instead. */
static int watch_for_event(kvf_client *c, int timeout_ms, const struct timespec *deadline, int *idle_wakes) {
  struct pollfd p[2] = {{.fd = c->sock, .events = POLLIN}, {.fd = c->event_fd, .events = POLLIN}};
  uint64_t seen = atomic_load_explicit(&c->ev_count, memory_order_relaxed);
  int ms = timeout_ms;
  if (timeout_ms > 0) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); /* deadline_after_ms's clock */
    int64_t left = (int64_t)(deadline->tv_sec - now.tv_sec) * 1000 + (deadline->tv_nsec - now.tv_nsec) / 1000000;
    ms = left > 0 ? (int)left + 1 : 0;
  }
  pthread_mutex_unlock(&c->mu);
  int n = poll(p, 2, ms);
  int rc = WATCH_EVENT;
  if (n == 0) rc = WATCH_TIMEOUT;
  else if ((n < 0 && errno != EINTR) || (p[0].revents & (POLLERR | POLLHUP | POLLNVAL))) rc = WATCH_OFF;
  else if (n > 0 && !(p[1].revents & POLLIN)) { /* the socket: the reader is about to queue what came */
    uint64_t us = c->watch_spins ? WATCH_SPIN_US : WATCH_SPIN_SHORT_US;
    spin_for_event(c, seen, us, us);
    uint64_t until = atomic_load(&c->spin_until), now = mono_ns(); /* a Soon read meanwhile: its window */
    if (c->watch_spins && until > now && atomic_load_explicit(&c->ev_count, memory_order_acquire) == seen)
      spin_for_event(c, seen, (until - now) / 1000, (until - now) / 1000);
    if (atomic_load_explicit(&c->ev_count, memory_order_acquire) == seen && (++*idle_wakes >= 2 || !c->watch_spins))
      rc = WATCH_OFF;
  }
  lock_for_event(c);
  return rc;
}

/* How long a wait spins before it sleeps: $KVFERRY_SPIN_US, or to the
 * grant window's end where that is later. */
static uint64_t wait_spin_us(kvf_client *c) {
  uint64_t end = grant_window_end(c), now = mono_ns();
  uint64_t grant = end > now ? (end - now) / 1000 : 0;
  return grant > c->spin_us ? grant : c->spin_us;
}

KVF_API int kvf_wait_events(kvf_client *c, kvf_event *out, size_t cap, int timeout_ms) {
  if (!c || !out || cap == 0 || timeout_ms < -1) return KVF_EINVAL;
  if (timeout_ms == 0 && atomic_load_explicit(&c->conn_seen, memory_order_acquire) == CONN_UP &&
      atomic_load_explicit(&c->ev_queued, memory_order_acquire) ==
          atomic_load_explicit(&c->ev_taken, memory_order_relaxed))
    return 0; /* nothing queued: no lock (both move only under mu, with ev_head) */
  struct timespec deadline = {0};
  if (timeout_ms > 0) deadline = deadline_after_ms(timeout_ms);
  lock_for_event(c);
  uint64_t spin = timeout_ms != 0 ? wait_spin_us(c) : 0;
  if (!c->ev_head && c->conn == CONN_UP && spin) {
    uint64_t seen = atomic_load_explicit(&c->ev_count, memory_order_relaxed);
    uint64_t us = timeout_ms > 0 && (uint64_t)timeout_ms * 1000 < spin ? (uint64_t)timeout_ms * 1000 : spin;
    pthread_mutex_unlock(&c->mu);
    /* The event comes through the reader: one asleep since its last read
     * would cost this spin a wake-up anyway, so it spins as long. */
    spin_reader_for_answer(c);
    spin_for_event(c, seen, us, c->spin_us);
    lock_for_event(c);
  }
  int waited = 0, watch = timeout_ms != 0 ? WATCH_EVENT : WATCH_OFF, idle_wakes = 0;
  while (!c->ev_head && c->conn == CONN_UP && waited != ETIMEDOUT) {
    if (watch == WATCH_OFF) { /* checked again after every wake-up, as a watch is */
      waited = wait_for_event(c, timeout_ms, &deadline);
      continue;
    }
    watch = watch_for_event(c, timeout_ms, &deadline, &idle_wakes);
    if (watch == WATCH_TIMEOUT) waited = ETIMEDOUT;
  }
  int n = take_events(c, out, cap);
  /* Queued events first, then the loss (while reconnecting too: a call
   * made while disconnected fails at once). */
  if (n == 0 && c->conn != CONN_UP) n = KVF_EDAEMON;
  pthread_mutex_unlock(&c->mu);
  return n;
}

/* ------------------------------------------------------------ inspect */

KVF_API int kvf_inspect(kvf_client *c, int what, int json, char **out) {
  if (!c || !out || what < KVF_INSPECT_STATUS || what > KVF_INSPECT_TRACE) return KVF_EINVAL;
  *out = NULL;
  Kvf__InspectReq body = KVF__INSPECT_REQ__INIT;
  body.what = (Kvf__InspectWhat)what; /* enum kvf_inspect mirrors InspectWhat */
  body.json = json != 0;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_INSPECT;
  req.inspect = &body;
  Kvf__ApiMessage *msg;
  int rc = call(c, &req, KVF__API_RESPONSE__BODY_INSPECT, &msg, NULL);
  if (rc) return rc;
  *out = strdup(msg->response->inspect->text);
  kvf__api_message__free_unpacked(msg, NULL);
  return *out ? 0 : -ENOMEM;
}
