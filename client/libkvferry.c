/* libkvferry.c - the client side of the local API (see kvferry.h).
 *
 * One Unix stream connection to the node's kvferryd. Callers write request
 * frames (whole, under write_mu) and sleep until the response with their seq
 * arrives. One reader thread owns the inbound stream: it hands responses to
 * their waiters, queues events for kvf_wait_events / kvf_event_fd, and keeps
 * the fds that arrive by SCM_RIGHTS until the MapResp they belong to is read.
 * When the connection breaks, everything waiting wakes up with KVF_EDAEMON.
 */
#include "kvferry.h"

#include "frame.h"
#include "kvferry.pb-c.h"
#include "libkvferry_cuda.h"

#include <endian.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define KVF_API __attribute__((visibility("default")))

#define DEFAULT_SOCKET "/run/kvferry/kvferryd.sock"
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
  char id[];
};

#define OPEN_SENDS_BUCKETS 1024u

struct mapping {
  uint32_t pool;
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

struct kvf_client {
  /* Set up by kvf_connect before the reader starts; constant afterwards. */
  int sock;
  int event_fd;
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

  pthread_mutex_t mu;        /* guards every field below */
  pthread_cond_t responded;  /* a response arrived, or the connection died */
  pthread_cond_t evented;    /* an event was queued, or the connection died */
  bool dead;                 /* the connection is gone for good */
  bool event_fd_raised;      /* event_fd currently polls readable */
  uint64_t last_seq;
  struct pending *waiting;
  struct queued_event *ev_head, **ev_tail;
  struct mapping *maps;
  struct open_send *open_sends[OPEN_SENDS_BUCKETS];
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
  return n == 0 || n > KVF_XFER_ID_MAX ? KVF_EINVAL : 0;
}

/* A node name; NULL and "" pass only when the name is optional. */
static int check_node_name(const char *node, bool required) {
  size_t n = node ? strnlen(node, KVF_NAME_MAX + 1) : 0;
  if (n > KVF_NAME_MAX || (required && n == 0)) return KVF_EINVAL;
  return 0;
}

static int check_descs(const kvf_client *c, const kvf_desc *descs, size_t n) {
  if (!descs || n == 0) return KVF_EINVAL;
  if (c->max_descs && n > c->max_descs) return KVF_ELIMIT;
  return 0;
}

/* ------------------------------------------------------------ open sends */

/* All under mu. */
static struct open_send **open_send_slot(kvf_client *c, const char *id) {
  uint32_t h = 2166136261u; /* FNV-1a */
  for (const char *p = id; *p; p++) h = (h ^ (uint8_t)*p) * 16777619u;
  struct open_send **pp = &c->open_sends[h % OPEN_SENDS_BUCKETS];
  while (*pp && strcmp((*pp)->id, id) != 0) pp = &(*pp)->next;
  return pp;
}

static bool send_is_open(kvf_client *c, const char *id) { return *open_send_slot(c, id) != NULL; }

static struct open_send *open_send_new(const char *id) {
  size_t n = strlen(id) + 1;
  struct open_send *o = malloc(sizeof(*o) + n);
  if (o) {
    memcpy(o->id, id, n);
    o->next = NULL;
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

static void free_open_sends(kvf_client *c) {
  for (size_t b = 0; b < OPEN_SENDS_BUCKETS; b++)
    while (c->open_sends[b]) {
      struct open_send *o = c->open_sends[b];
      c->open_sends[b] = o->next;
      free(o);
    }
}

/* ------------------------------------------------------------ events */

/* Keeps event_fd readable exactly while kvf_wait_events would return at
 * once: events are queued, or the connection is gone (so that an engine
 * polling only the fd still learns of it). Called with mu held. */
static void sync_event_fd(kvf_client *c) {
  bool want = c->ev_head != NULL || c->dead;
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
}

static int queue_event(kvf_client *c, const Kvf__Event *w) {
  struct queued_event *q = malloc(sizeof(*q));
  if (!q) return -ENOMEM; /* losing an event silently would be worse */
  event_from_wire(&q->ev, w);
  q->next = NULL;
  pthread_mutex_lock(&c->mu);
  *c->ev_tail = q;
  c->ev_tail = &q->next;
  sync_event_fd(c);
  pthread_cond_broadcast(&c->evented);
  pthread_mutex_unlock(&c->mu);
  return 0;
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
      pthread_cond_broadcast(&c->responded);
      pthread_mutex_unlock(&c->mu);
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
  int rc = read_inbound(c->sock, &c->in);
  if (rc) return rc;
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

static void mark_dead(kvf_client *c) {
  pthread_mutex_lock(&c->mu);
  c->dead = true;
  sync_event_fd(c);
  pthread_cond_broadcast(&c->responded);
  pthread_cond_broadcast(&c->evented);
  pthread_mutex_unlock(&c->mu);
}

static void *reader_main(void *arg) {
  kvf_client *c = arg;
  while (pump_inbound(c) == 0) {
  }
  mark_dead(c);
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
  c->reader_started = true;
  return 0;
}

/* ------------------------------------------------------------ requests */

/* Frames up to this size are packed into a buffer kept for the next request:
 * a fresh buffer of a few hundred KiB per kvf_send (descriptor lists) costs a
 * page fault per 4 KiB once malloc hands the memory back to the kernel. */
#define WBUF_KEEP (4u << 20)

/* Writes one request frame; the caller holds write_mu. */
static int send_request_locked(kvf_client *c, Kvf__ApiRequest *req) {
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
  int rc = kvf__send_all(c->sock, frame, total, -1);
  if (frame != c->wbuf) free(frame);
  if (rc == -EAGAIN) return -ETIMEDOUT; /* only during hello (SO_SNDTIMEO) */
  if (rc) {
    /* A partly written frame leaves the stream unusable: end it, so that
     * the reader sees EOF and every caller gets KVF_EDAEMON. */
    shutdown(c->sock, SHUT_RDWR);
    return KVF_EDAEMON;
  }
  return 0;
}

static int send_request(kvf_client *c, Kvf__ApiRequest *req) {
  pthread_mutex_lock(&c->write_mu);
  int rc = send_request_locked(c, req);
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

/* Registers p before the request is written, so that the response cannot
 * arrive ahead of its waiter, then writes the request. */
static int register_pending(kvf_client *c, struct pending *p) {
  *p = (struct pending){.fd = -1};
  pthread_mutex_lock(&c->mu);
  if (c->dead) {
    pthread_mutex_unlock(&c->mu);
    return KVF_EDAEMON;
  }
  p->seq = ++c->last_seq;
  p->next = c->waiting;
  c->waiting = p;
  pthread_mutex_unlock(&c->mu);
  return 0;
}

static int begin_call(kvf_client *c, Kvf__ApiRequest *req, struct pending *p) {
  int rc = register_pending(c, p);
  if (rc) return rc;
  req->seq = p->seq;
  return send_request(c, req);
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

/* Waits for the response to p (registered) after its request went out. */
static int finish_call(kvf_client *c, struct pending *p, int rc, int expect, Kvf__ApiMessage **out, int *fd) {
  pthread_mutex_lock(&c->mu);
  while (rc == 0 && !p->done && !c->dead) pthread_cond_wait(&c->responded, &c->mu);
  pthread_mutex_unlock(&c->mu);
  return end_call(c, p, rc, expect, out, fd);
}

/* One request, one response, with the reader thread doing the reading. */
static int call(kvf_client *c, Kvf__ApiRequest *req, int expect, Kvf__ApiMessage **out, int *fd) {
  struct pending p;
  int rc = begin_call(c, req, &p);
  return finish_call(c, &p, rc, expect, out, fd);
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
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_HELLO;
  req.hello = &hello;

  struct pending p;
  int rc = begin_call(c, &req, &p);
  while (rc == 0 && !p.done) rc = pump_inbound(c);
  if (rc == -EAGAIN) rc = -ETIMEDOUT; /* SO_RCVTIMEO expired */
  Kvf__ApiMessage *msg;
  rc = end_call(c, &p, rc, KVF__API_RESPONSE__BODY_HELLO, &msg, NULL);
  if (rc) return rc;
  rc = adopt_hello(c, msg->response->hello);
  kvf__api_message__free_unpacked(msg, NULL);
  return rc;
}

/* Mutex and condvar initialisation cannot fail with glibc (NULL or clock
 * attributes), so it is not checked. */
static kvf_client *client_new(void) {
  kvf_client *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->sock = -1;
  c->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (c->event_fd < 0) {
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
  pthread_condattr_destroy(&attr);
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
  free_open_sends(c);
  close(c->event_fd);
  pthread_cond_destroy(&c->evented);
  pthread_cond_destroy(&c->responded);
  pthread_mutex_destroy(&c->mu);
  pthread_mutex_destroy(&c->write_mu);
  free(c->wbuf);
  free(c->dbuf);
  free(c);
}

KVF_API int kvf_connect(const char *socket_path, kvf_client **out) {
  if (!out) return KVF_EINVAL;
  *out = NULL;
  kvf_client *c = client_new();
  if (!c) return -ENOMEM;
  int rc = connect_unix(resolve_socket_path(socket_path), &c->sock);
  if (!rc) rc = exchange_hello(c);
  if (!rc) {
    set_socket_timeouts(c->sock, 0); /* from now on a slow daemon is waited for */
    rc = start_reader(c);
  }
  if (rc) {
    client_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

KVF_API void kvf_close(kvf_client *c) {
  if (!c) return;
  if (c->reader_started) {
    shutdown(c->sock, SHUT_RDWR); /* the reader sees EOF and exits */
    pthread_join(c->reader, NULL);
  }
  client_free(c);
}

KVF_API const char *kvf_node(const kvf_client *c) { return c ? c->node : ""; }

/* ------------------------------------------------------------ pools */

static void pool_from_wire(kvf_pool_info *dst, const Kvf__PoolInfo *src) {
  memset(dst, 0, sizeof(*dst));
  dst->id = src->id;
  copy_string(dst->name, sizeof(dst->name), src->name);
  copy_string(dst->kind, sizeof(dst->kind), src->kind);
  copy_string(dst->backing, sizeof(dst->backing), src->backing);
  dst->size = src->size;
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
  for (size_t i = 0; i < pools->n_pools && i < cap; i++) pool_from_wire(&out[i], pools->pools[i]);
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
      pool_from_wire(out, pools->pools[i]);
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
  body.pool = pool;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_MAP;
  req.map = &body;
  Kvf__ApiMessage *msg;
  int fd;
  int rc = call(c, &req, KVF__API_RESPONSE__BODY_MAP, &msg, &fd);
  if (rc) return rc;
  const Kvf__PoolInfo *info = msg->response->map->pool;
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


static void pack_descs(const kvf_desc *descs, size_t n, uint8_t *p) {
  for (size_t i = 0; i < n; i++, p += DESC_WIRE_SIZE) {
    kvf__le32_put(p, descs[i].pool);
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
  c->dbuf = NULL;
  c->dcap = 0;
}

/* One request whose list is packed into dbuf under write_mu (so the
 * buffer serves every call) by pack(c, arg); answered: one response
 * awaited, else (KVF_SEND_NOWAIT) written and not awaited. */
static int call_packed(kvf_client *c, Kvf__ApiRequest *req, int (*pack)(kvf_client *, void *), void *arg,
                       bool answered) {
  struct pending p;
  pthread_mutex_lock(&c->write_mu);
  int rc = pack(c, arg);
  bool registered = false;
  if (rc == 0 && answered) {
    rc = register_pending(c, &p);
    registered = rc == 0;
    req->seq = p.seq;
  } else if (rc == 0) {
    pthread_mutex_lock(&c->mu);
    req->seq = ++c->last_seq; /* nothing answers it */
    pthread_mutex_unlock(&c->mu);
  }
  if (rc == 0) rc = send_request_locked(c, req);
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
  if (rc) return rc;
  pack_descs(d->descs, d->n, c->dbuf);
  d->list->packed.data = c->dbuf;
  d->list->packed.len = d->n * DESC_WIRE_SIZE;
  return 0;
}

static int call_with_descs(kvf_client *c, Kvf__ApiRequest *req, Kvf__DescList *list, const kvf_desc *descs,
                           size_t n, bool answered) {
  desc_list d = {list, descs, n};
  return call_packed(c, req, pack_desc_list, &d, answered);
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
  return call_with_descs(c, &req, &list, descs, n, true);
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
  int rc = reserve_dbuf(c, c->chain_max);
  uint8_t *packed = c->dbuf;
  list.packed.data = packed;
  list.packed.len = (size_t)c->chain_max * DESC_WIRE_SIZE;
  if (rc == 0) rc = reserve(&c->wbuf, &c->wcap, KVF__FRAME_HDR + kvf__api_request__get_packed_size(req));
  bool registered = false;
  for (size_t at = 0, slice = c->chain_first; rc == 0 && at < n; slice = slice * 2 < c->chain_max ? slice * 2 : c->chain_max) {
    size_t k = n - at < slice ? n - at : slice;
    pack_descs(descs + at, k, packed);
    list.packed.len = k * DESC_WIRE_SIZE;
    at += k;
    body->chained = at < n;
    body->more = at < n ? true : more;
    if (at == n) {
      rc = register_pending(c, &p);
      registered = rc == 0;
      req->seq = p.seq;
    } else {
      pthread_mutex_lock(&c->mu);
      req->seq = ++c->last_seq; /* answered by the last frame's response */
      pthread_mutex_unlock(&c->mu);
    }
    if (rc == 0) rc = send_request_locked(c, req);
  }
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
  return open || *fresh ? 0 : -ENOMEM;
}

/* A send call's result: one that succeeded opens its id (a failed first
 * part began nothing; a failed later part still ends with its event). */
static int end_send(kvf_client *c, struct open_send *fresh, int rc) {
  if (rc) {
    free(fresh);
    return rc;
  }
  pthread_mutex_lock(&c->mu);
  open_send(c, fresh);
  pthread_mutex_unlock(&c->mu);
  return 0;
}

KVF_API int kvf_send(kvf_client *c, const char *xfer_id, const char *dst_node,
                     const kvf_desc *descs, size_t n, unsigned flags, uint32_t deadline_ms) {
  int rc = check_transfer(c, xfer_id, descs, n);
  if (!rc) rc = check_node_name(dst_node, true);
  if (!rc && (flags & ~(KVF_SEND_MORE | KVF_SEND_NOWAIT))) rc = KVF_EINVAL;
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
  body.no_reply = body.continues && (flags & KVF_SEND_NOWAIT);
  return end_send(c, fresh, call_with_descs(c, &req, &list, descs, n, !body.no_reply));
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

KVF_API int kvf_layout_register(kvf_client *c, const kvf_layout *l, uint32_t *id) {
  if (!c || !l || !id || !l->offsets || l->n_kv == 0 || l->n_kv > 2 || l->n_layers == 0) return KVF_EINVAL;
  size_t n = (size_t)l->n_layers * l->n_kv;
  uint8_t *packed = malloc(n * 8);
  if (!packed) return -ENOMEM;
  for (size_t i = 0; i < n; i++) kvf__le64_put(packed + 8 * i, l->offsets[i]);
  Kvf__Layout w = KVF__LAYOUT__INIT;
  w.pool = l->pool;
  w.n_layers = l->n_layers;
  w.n_kv = l->n_kv;
  w.n_blocks = l->n_blocks;
  w.block_bytes = l->block_bytes;
  w.block_stride = l->block_stride;
  w.offsets = (ProtobufCBinaryData){n * 8, packed};
  w.tokens_per_block = l->tokens_per_block;
  w.kv_heads = l->kv_heads;
  w.head_dim = l->head_dim;
  w.dtype_bytes = l->dtype_bytes;
  w.order = l->order;
  Kvf__LayoutReq body = KVF__LAYOUT_REQ__INIT;
  body.layout = &w;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_LAYOUT;
  req.layout = &body;
  Kvf__ApiMessage *msg;
  int rc = call(c, &req, KVF__API_RESPONSE__BODY_LAYOUT, &msg, NULL);
  free(packed);
  if (rc) return rc;
  *id = msg->response->layout->id;
  kvf__api_message__free_unpacked(msg, NULL);
  return 0;
}

KVF_API int kvf_layout_free(kvf_client *c, uint32_t id) {
  if (!c) return KVF_EINVAL;
  Kvf__LayoutFreeReq body = KVF__LAYOUT_FREE_REQ__INIT;
  body.id = id;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.body_case = KVF__API_REQUEST__BODY_LAYOUT_FREE;
  req.layout_free = &body;
  return call(c, &req, KVF__API_RESPONSE__BODY__NOT_SET, NULL, NULL);
}

typedef struct block_list {
  Kvf__BlockList *list;
  const kvf_blocks *b;
} block_list;

static int pack_block_list(kvf_client *c, void *arg) {
  block_list *bl = arg;
  int rc = reserve(&c->dbuf, &c->dcap, bl->b->n * 4);
  if (rc) return rc;
  for (size_t i = 0; i < bl->b->n; i++) kvf__le32_put(c->dbuf + 4 * i, bl->b->ids[i]);
  bl->list->ids = (ProtobufCBinaryData){bl->b->n * 4, c->dbuf};
  return 0;
}

static int call_with_blocks(kvf_client *c, Kvf__ApiRequest *req, Kvf__BlockList *list, const kvf_blocks *b,
                            bool answered) {
  block_list bl = {list, b};
  return call_packed(c, req, pack_block_list, &bl, answered);
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
  return call_with_blocks(c, &req, &list, blocks, true);
}

KVF_API int kvf_send_blocks(kvf_client *c, const char *xfer_id, const char *dst_node, const kvf_blocks *blocks,
                            unsigned flags, uint32_t deadline_ms) {
  if (!c) return KVF_EINVAL;
  int rc = check_xfer_id(xfer_id);
  if (!rc) rc = check_node_name(dst_node, true);
  if (!rc) rc = check_blocks(c, blocks, true);
  if (!rc && (flags & ~(KVF_SEND_MORE | KVF_SEND_NOWAIT))) rc = KVF_EINVAL;
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
  body.no_reply = body.continues && (flags & KVF_SEND_NOWAIT);
  return end_send(c, fresh, rc ? rc : call_with_blocks(c, &req, &list, blocks, !body.no_reply));
}

/* ------------------------------------------------------------ events API */

KVF_API int kvf_event_fd(kvf_client *c) { return c ? c->event_fd : KVF_EINVAL; }

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

/* Sleeps once on `evented`; returns ETIMEDOUT when the wait is over. */
static int wait_for_event(kvf_client *c, int timeout_ms, const struct timespec *deadline) {
  if (timeout_ms == 0) return ETIMEDOUT;
  if (timeout_ms < 0) return pthread_cond_wait(&c->evented, &c->mu);
  return pthread_cond_timedwait(&c->evented, &c->mu, deadline);
}

KVF_API int kvf_wait_events(kvf_client *c, kvf_event *out, size_t cap, int timeout_ms) {
  if (!c || !out || cap == 0 || timeout_ms < -1) return KVF_EINVAL;
  struct timespec deadline = {0};
  if (timeout_ms > 0) deadline = deadline_after_ms(timeout_ms);
  pthread_mutex_lock(&c->mu);
  int waited = 0;
  while (!c->ev_head && !c->dead && waited != ETIMEDOUT)
    waited = wait_for_event(c, timeout_ms, &deadline);
  int n = take_events(c, out, cap);
  if (n == 0 && c->dead) n = KVF_EDAEMON; /* queued events first, then the loss */
  pthread_mutex_unlock(&c->mu);
  return n;
}

/* ------------------------------------------------------------ inspect */

KVF_API int kvf_inspect(kvf_client *c, int what, int json, char **out) {
  if (!c || !out || what < KVF_INSPECT_STATUS || what > KVF_INSPECT_LAYOUTS) return KVF_EINVAL;
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
