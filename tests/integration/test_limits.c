/* test_limits.c - black-box tests of kvferryd's limits and of who may use
 * it, against real daemons:
 *
 *   local: one daemon ("solo") with max-clients 3 (no operator slots: the
 *   tests run as root; test_api_slots.py has them), max-transfers-per-client
 *   2, max-frame 64K and max-descs 1000, allowing uid 65533 and gid 4242:
 *   the client beyond max-clients, the transfer beyond the quota, frames
 *   over max-frame, a client that stops reading, clients of other uids
 *   (SO_PEERCRED; those cases need root and skip loudly without it), and
 *   configurations whose limits contradict each other.
 *
 *   peers: "prefill" (max-frame 64K, max-descs 1000) peered with "decode"
 *   (max-pending-peers 8) and "other": a grant with more descriptors than
 *   the sender's max-descs, a grant frame over its max-frame, and
 *   connections to the peer port that never say Hello.
 *
 * Every refusal is checked where it lands: the code and text the one who
 * asked gets, the daemon's log line, and that everybody else goes on (a
 * verified transfer between the others). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define KIB (1ull << 10)
#define MIB (1ull << 20)
#define SOLO_FRAME 65536u    /* max-frame of "solo" and "prefill" */
#define SOLO_DESCS 1000u     /* max-descs of "solo" and "prefill" */
#define NOBODY 65534u
#define ALLOWED_UID 65533u   /* in solo's api-allow-users */
#define ALLOWED_GID 4242u    /* in solo's api-allow-groups */
#define PENDING_MAX 8u       /* decode's max-pending-peers */

/* ============================================================ raw sockets */

/* Connections a case opens are remembered until it closes them, so that a
 * failing case (cmocka jumps out of it) does not leave them to trip the
 * cases after it: each case's setup closes what is left. */
#define T_MAX 128
static int t_fds[T_MAX];
static kvf_client *t_clients[T_MAX];

static int track_fd(int fd) {
  for (int i = 0; fd >= 0 && i < T_MAX; i++)
    if (!t_fds[i]) {
      t_fds[i] = fd + 1;
      break;
    }
  return fd;
}

static void raw_close(int fd) {
  for (int i = 0; i < T_MAX; i++)
    if (t_fds[i] == fd + 1) t_fds[i] = 0;
  close(fd);
}

static int track_connect(const char *sock, kvf_client **out) {
  int rc = kvf_connect(sock, out);
  for (int i = 0; rc == 0 && i < T_MAX; i++)
    if (!t_clients[i]) {
      t_clients[i] = *out;
      break;
    }
  return rc;
}

static void client_close(kvf_client *c) {
  for (int i = 0; i < T_MAX; i++)
    if (t_clients[i] == c) t_clients[i] = NULL;
  kvf_close(c);
}

static void release_leftovers(void) {
  for (int i = 0; i < T_MAX; i++) {
    if (t_fds[i]) close(t_fds[i] - 1);
    if (t_clients[i]) kvf_close(t_clients[i]);
    t_fds[i] = 0;
    t_clients[i] = NULL;
  }
}

static int raw_unix(const char *path) { return track_fd(h_raw_unix(path)); }

static int raw_tcp(uint16_t port) { return track_fd(h_raw_tcp(port)); }

/* Writes what it can: the daemon may close before taking it all. */

/* Exactly n bytes within ms: 0, 1 at EOF, -1 on timeout or error. */
static int read_exact(int fd, void *p, size_t n, int ms) {
  uint64_t end = h_now_ms() + (uint64_t)ms;
  uint8_t *b = p;
  while (n > 0) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int r = poll(&pfd, 1, h_left_ms(end));
    if (r == 0) return h_fail("nothing to read within %d ms", ms);
    if (r < 0) continue;
    ssize_t got = recv(fd, b, n, 0);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got <= 0) return 1;
    b += got;
    n -= (size_t)got;
  }
  return 0;
}

/* Fails when the daemon closed fd or said anything on it within ms. */
static int expect_open(int fd, int ms, const char *what) {
  struct pollfd pfd = {.fd = fd, .events = POLLIN};
  if (poll(&pfd, 1, ms) == 0) return 0;
  return h_fail("%s: the daemon closed or wrote to the connection (revents 0x%x)", what,
                pfd.revents);
}

/* ================================================ the local API, by hand */

/* Just enough protobuf to speak the API without libkvferry (field numbers
 * from proto/kvferry.proto): a client that misbehaves on purpose. */
typedef struct pbuf {
  uint8_t b[256];
  size_t n;
} pbuf;

static void pb_varint(pbuf *p, uint64_t v) {
  do {
    p->b[p->n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    v >>= 7;
  } while (v);
}

static void pb_bytes(pbuf *p, uint32_t field, const void *data, size_t len) {
  pb_varint(p, (uint64_t)field << 3 | 2);
  pb_varint(p, len);
  memcpy(p->b + p->n, data, len);
  p->n += len;
}

static size_t varint_len(uint64_t v) {
  size_t n = 1;
  while (v > 0x7f) v >>= 7, n++;
  return n;
}

static void put_u32le(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

/* ApiRequest{seq, body field = msg} as one frame into out; its length. */
static size_t api_frame(uint8_t *out, uint64_t seq, uint32_t body_field, const pbuf *msg) {
  pbuf q = {.n = 0};
  pb_varint(&q, 1 << 3 | 0);
  pb_varint(&q, seq);
  pb_bytes(&q, body_field, msg->b, msg->n);
  put_u32le(out, (uint32_t)q.n);
  memcpy(out + 4, q.b, q.n);
  return 4 + q.n;
}

static size_t hello_frame(uint8_t *out, uint64_t seq) {
  pbuf h = {.n = 0};
  pb_varint(&h, 1 << 3 | 0); /* HelloReq.version */
  pb_varint(&h, KVF_API_VERSION);
  pb_bytes(&h, 2, "raw-test", 8); /* HelloReq.client_name */
  return api_frame(out, seq, 10, &h);
}

/* InspectReq{what STATUS, json} */
static size_t inspect_frame(uint8_t *out, uint64_t seq) {
  pbuf i = {.n = 0};
  pb_varint(&i, 2 << 3 | 0);
  pb_varint(&i, 1);
  return api_frame(out, seq, 16, &i);
}

typedef struct reply {
  int is_response;
  uint64_t seq;
  int status;
  char error[256];
} reply;

static int pb_get_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
  *v = 0;
  for (unsigned shift = 0; *p < end && shift < 64; shift += 7) {
    uint8_t c = *(*p)++;
    *v |= (uint64_t)(c & 0x7f) << shift;
    if (!(c & 0x80)) return 0;
  }
  return -1;
}

/* Walks the fields of one message; for each, fn(field, wire type, varint
 * value or bytes). Fails on anything malformed. */
typedef void field_fn(uint32_t field, uint64_t v, const uint8_t *data, size_t len, void *arg);
static int pb_walk(const uint8_t *p, size_t n, field_fn *fn, void *arg) {
  const uint8_t *end = p + n;
  while (p < end) {
    uint64_t key, v = 0;
    if (pb_get_varint(&p, end, &key)) return -1;
    switch (key & 7) {
    case 0:
      if (pb_get_varint(&p, end, &v)) return -1;
      fn((uint32_t)(key >> 3), v, NULL, 0, arg);
      break;
    case 2:
      if (pb_get_varint(&p, end, &v) || v > (uint64_t)(end - p)) return -1;
      fn((uint32_t)(key >> 3), 0, p, (size_t)v, arg);
      p += v;
      break;
    case 1: p += 8; break;
    case 5: p += 4; break;
    default: return -1;
    }
    if (p > end) return -1;
  }
  return 0;
}

static void response_field(uint32_t f, uint64_t v, const uint8_t *d, size_t len, void *arg) {
  reply *r = arg;
  if (f == 1 && !d) r->seq = v;
  if (f == 2 && !d) r->status = (int)((v >> 1) ^ -(int64_t)(v & 1)); /* sint32 */
  if (f == 3 && d) snprintf(r->error, sizeof r->error, "%.*s", (int)len, (const char *)d);
}

static void message_field(uint32_t f, uint64_t v, const uint8_t *d, size_t len, void *arg) {
  reply *r = arg;
  if (f == 1 && d) {
    r->is_response = 1;
    pb_walk(d, len, response_field, r);
  }
}

/* Reads one ApiMessage frame: 0, 1 at EOF, -1 on error. */
static int read_reply(int fd, reply *r, int ms) {
  uint8_t hdr[4];
  memset(r, 0, sizeof *r);
  int rc = read_exact(fd, hdr, 4, ms);
  if (rc) return rc;
  uint32_t n = (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 | (uint32_t)hdr[3] << 24;
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) return h_fail("out of memory");
  rc = read_exact(fd, buf, n, ms);
  if (rc == 0 && pb_walk(buf, n, message_field, r)) rc = h_fail("undecodable reply of %u bytes", n);
  free(buf);
  return rc;
}

/* The response to request seq, skipping events: 0, 1 at EOF, -1. */
static int read_response(int fd, uint64_t seq, reply *r, int ms) {
  uint64_t end = h_now_ms() + (uint64_t)ms;
  for (;;) {
    int rc = read_reply(fd, r, h_left_ms(end));
    if (rc) return rc;
    if (r->is_response && r->seq == seq) return 0;
  }
}

/* A raw connection that said hello; -1 when refused. */
static int raw_client(const char *sock) {
  uint8_t f[64];
  reply r;
  int fd = raw_unix(sock);
  if (fd < 0) return -1;
  h_raw_write(fd, f, hello_frame(f, 1));
  if (read_response(fd, 1, &r, 5000) || r.status) {
    raw_close(fd);
    return h_fail("raw hello: status %s (%s)", kvf_err_name(r.status), r.error);
  }
  return fd;
}

/* ============================================================ daemon logs */

static size_t log_count(const h_daemon *d, const char *needle) {
  FILE *f = fopen(d->log, "r");
  char line[8192];
  size_t n = 0;
  if (!f) return 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, needle)) n++;
  fclose(f);
  return n;
}

typedef struct log_lines {
  const h_daemon *d;
  const char *needle;
  size_t want;
} log_lines;

static int log_cond(void *arg) {
  const log_lines *l = arg;
  size_t n = log_count(l->d, l->needle);
  h_wait_note("%zu such lines", n);
  return n >= l->want;
}

/* Waits until the log holds at least want lines containing needle. */
static int wait_log(const h_daemon *d, const char *needle, size_t want, int ms) {
  char what[512];
  log_lines l = {d, needle, want};
  snprintf(what, sizeof what, "%s to log %zu lines with \"%s\"", d->name, want, needle);
  if (h_wait_until(log_cond, &l, ms, what) == 0) return 0;
  h_daemon_log_tail(d, 20);
  return -1;
}

/* Waits for id's event of type; fails unless its status is want and its
 * text contains text (when given). */
static int expect_event(h_client *hc, const char *id, int type, int want, const char *text,
                        int ms) {
  kvf_event ev;
  if (h_wait_event(hc, id, type, ms, &ev)) return -1;
  if (ev.status != want)
    return h_fail("%s: %s: status %s (%s), expected %s", hc->node, id, kvf_err_name(ev.status),
                  ev.error, kvf_err_name(want));
  if (text && !strstr(ev.error, text))
    return h_fail("%s: %s: error \"%s\" lacks \"%s\"", hc->node, id, ev.error, text);
  return 0;
}

/* ============================================================ solo */

static struct {
  char dir[H_PATH_MAX];
  h_daemon d;
  h_client a, b; /* two clients always connected: 2 of max-clients 3 */
} S;

/* The daemon's dir must let another uid reach the socket: SO_PEERCRED,
 * not file modes, is what refuses it (api.c). */
static int solo_setup(void **state) {
  uint16_t port;
  if (h_mkdtemp(S.dir, sizeof S.dir) || h_free_ports(&port, 1)) return -1;
  if (chmod(S.dir, 0755) != 0) return h_fail("chmod %s: %s", S.dir, strerror(errno));
  h_daemon_init(&S.d, S.dir, "solo", port, "16M");
  snprintf(S.d.extra, sizeof S.d.extra,
           "max-clients 3\napi-operator-slots 0\napi-hello-timeout-ms 60000\nmax-transfers-per-client 2\nmax-frame %u\nmax-descs %u\n"
           "api-allow-users %u\napi-allow-groups %u\n",
           SOLO_FRAME, SOLO_DESCS, ALLOWED_UID, ALLOWED_GID);
  if (h_daemon_spawn(&S.d)) return -1;
  if (h_client_open(&S.a, &S.d) || h_client_open(&S.b, &S.d)) return -1;
  return 0;
}

static int solo_teardown(void **state) {
  h_client_close(&S.a);
  h_client_close(&S.b);
  return h_daemon_stop(&S.d);
}

/* Before each case: only a and b connected, nothing in flight. What an
 * earlier failed case left behind is closed; a and b are connected afresh
 * when they still have transfers or events (closing cancels those). */
static int solo_clean(void **state) {
  release_leftovers();
  if (h_wait_idle(S.a.c, 1000) || h_no_events(&S.a, 0) || h_no_events(&S.b, 0)) {
    fprintf(stderr, "kvf-harness: reconnecting solo's clients after a failed case\n");
    h_client_close(&S.a);
    h_client_close(&S.b);
    if (h_client_open(&S.a, &S.d) || h_client_open(&S.b, &S.d)) return -1;
  }
  return h_wait_clients(S.a.c, 2, 5000) || h_wait_idle(S.a.c, 5000) ? -1 : 0;
}

/* A verified transfer between a and b: "the others still work". */
static int solo_serves(void) { return h_quick(&S.a, &S.b) || h_quick(&S.b, &S.a) ? -1 : 0; }

static void test_max_clients(void **state) {
  kvf_client *c3 = NULL, *c4 = NULL, *over = NULL;
  char *txt = NULL;
  reply r;
  uint8_t f[64];
  size_t lines = log_count(&S.d, "max-clients (3) clients are connected");
  H_OK(h_expect_rc(track_connect(S.d.sock, &c3), 0, "the 3rd client"));
  /* The 4th is refused with KVF_ELIMIT, a reason, and a log line. */
  H_OK(h_expect_rc(track_connect(S.d.sock, &over), KVF_ELIMIT, "the 4th client"));
  assert_null(over);
  int fd = raw_unix(S.d.sock);
  assert_true(fd >= 0);
  h_raw_write(fd, f, hello_frame(f, 7));
  H_OK(read_response(fd, 7, &r, 5000));
  if (r.status != KVF_ELIMIT || !strstr(r.error, "max-clients (3)"))
    fail_msg("refused hello: status %s, error \"%s\"", kvf_err_name(r.status), r.error);
  H_OK(h_expect_closed(fd, 3000, "refused client", NULL));
  raw_close(fd);
  H_OK(wait_log(&S.d, "max-clients (3) clients are connected", lines + 2, 3000));
  /* A refused connection that never says hello... */
  int idle = raw_unix(S.d.sock);
  assert_true(idle >= 0);
  /* ...the first three keep working meanwhile... */
  H_OK(solo_serves());
  H_OK(h_expect_rc(kvf_inspect(c3, KVF_INSPECT_STATUS, 0, &txt), 0, "the 3rd client's inspect"));
  free(txt);
  /* ...and holds no slot: once one leaves, the next one gets in. */
  client_close(c3);
  H_OK(h_wait_clients(S.a.c, 3, 3000)); /* a, b and the idle refused one */
  H_OK(h_expect_rc(track_connect(S.d.sock, &c4), 0, "a client after one left"));
  client_close(c4);
  /* A refused client may send a hello's worth, not max-frame. */
  uint8_t hdr[8];
  put_u32le(hdr, 5000);
  h_raw_write(idle, hdr, sizeof hdr);
  H_OK(h_expect_closed(idle, 3000, "a refused client's 5000-byte frame", NULL));
  raw_close(idle);
  H_OK(wait_log(&S.d, "sent a frame of 5000 bytes, more than a refused client may send (4096)", 1,
                3000));
  H_OK(h_wait_clients(S.a.c, 2, 3000));
}

/* Refused connections that never say hello: 64 wait for their hello, the
 * next ones are closed unanswered, with a line a second at most. */
static void test_refused_flood(void **state) {
  enum { HELD = 64 };
  kvf_client *c3 = NULL;
  int held[HELD];
  size_t lines = log_count(&S.d, "refused connections are still open");
  H_OK(h_expect_rc(track_connect(S.d.sock, &c3), 0, "the 3rd client"));
  for (int i = 0; i < HELD; i++) {
    held[i] = raw_unix(S.d.sock);
    assert_true(held[i] >= 0);
  }
  H_OK(h_wait_clients(S.a.c, 3 + HELD, 3000));
  int extra = raw_unix(S.d.sock);
  assert_true(extra >= 0);
  H_OK(h_expect_closed(extra, 2000, "a refused connection past 64", NULL));
  raw_close(extra);
  H_OK(wait_log(&S.d, "refused connections are still open", lines + 1, 3000));
  H_OK(expect_open(held[0], 0, "a refused connection within 64"));
  H_OK(solo_serves());
  for (int i = 0; i < HELD; i++) raw_close(held[i]);
  client_close(c3);
  H_OK(h_wait_clients(S.a.c, 2, 3000));
  H_OK(h_expect_rc(track_connect(S.d.sock, &c3), 0, "a client after the flood"));
  client_close(c3);
}

/* ids and regions of the quota case; each transfer its own 512 KiB. */
typedef struct qx {
  char id[64];
  kvf_desc src[8], dst[8];
  h_xfer x;
} qx;

static void qx_init(qx *q, const char *prefix, h_client *snd, h_client *rcv, unsigned slot) {
  h_id(q->id, sizeof q->id, prefix);
  h_layout(q->src, 8, snd->pool, slot * 1 * MIB, 16 * KIB, true, slot);
  h_layout(q->dst, 8, rcv->pool, slot * 1 * MIB + 512 * KIB, 16 * KIB, true, slot + 100);
  q->x = (h_xfer){.id = q->id, .src = q->src, .nsrc = 8, .dst = q->dst, .ndst = 8,
                  .seed = 4000 + slot, .timeout_ms = 10000};
}

/* The local handoff of q, grant already posted: send, both events, bytes. */
static int qx_finish(qx *q, h_client *snd, h_client *rcv) {
  kvf_event rev, sev;
  uint64_t bytes = h_desc_bytes(q->dst, 8);
  if (h_post_send(snd, &q->x, rcv->node) ||
      h_wait_event(rcv, q->id, KVF_EV_RECV_DONE, 10000, &rev) ||
      h_wait_event(snd, q->id, KVF_EV_SEND_DONE, 10000, &sev) ||
      h_check_event(&rev, KVF_EV_RECV_DONE, "local", snd->node, bytes, 8) ||
      h_check_event(&sev, KVF_EV_SEND_DONE, "local", rcv->node, bytes, 8))
    return -1;
  return h_verify_dst(rcv, &q->x);
}

static void test_transfers_per_client(void **state) {
  qx g1, g2, g3, s1, bq;
  qx_init(&g1, "quota-g1", &S.b, &S.a, 0);
  qx_init(&g2, "quota-g2", &S.b, &S.a, 1);
  qx_init(&g3, "quota-g3", &S.b, &S.a, 2);
  qx_init(&s1, "quota-s1", &S.a, &S.b, 3);
  qx_init(&bq, "quota-b", &S.a, &S.b, 4);
  H_OK(h_prepare(&S.b, &S.a, &g1.x));
  H_OK(h_prepare(&S.b, &S.a, &g2.x));
  H_OK(h_prepare(&S.b, &S.a, &g3.x));
  H_OK(h_prepare(&S.a, &S.b, &s1.x));
  H_OK(h_prepare(&S.a, &S.b, &bq.x));
  H_OK(h_post_grant(&S.a, &g1.x, S.d.name));
  H_OK(h_post_grant(&S.a, &g2.x, S.d.name));
  /* a has max-transfers-per-client (2) in flight: a third grant or a new
   * send is refused at once... */
  H_OK(h_expect_rc(kvf_grant(S.a.c, g3.id, S.d.name, g3.dst, 8, 0), KVF_ELIMIT, "a's 3rd grant"));
  H_OK(h_expect_rc(kvf_send(S.a.c, s1.id, S.d.name, s1.src, 8, 0, 0), KVF_ELIMIT, "a's send"));
  /* ...b is not held by a's quota... */
  H_OK(h_post_grant(&S.b, &bq.x, S.d.name));
  /* ...and once one of a's transfers is done, a may start another. */
  H_OK(qx_finish(&g1, &S.b, &S.a));
  H_OK(h_post_grant(&S.a, &g3.x, S.d.name));
  H_OK(h_expect_rc(kvf_send(S.a.c, s1.id, S.d.name, s1.src, 8, 0, 0), KVF_ELIMIT, "a's send at 2"));
  /* The later parts of a send a client already has need no new slot. */
  H_OK(kvf_cancel(S.a.c, g3.id));
  H_OK(expect_event(&S.a, g3.id, KVF_EV_RECV_DONE, KVF_ECANCELED, NULL, 5000));
  s1.x.parts = 2;
  H_OK(h_post_grant(&S.b, &s1.x, S.d.name));
  H_OK(qx_finish(&s1, &S.a, &S.b));
  H_OK(qx_finish(&g2, &S.b, &S.a));
  H_OK(qx_finish(&bq, &S.a, &S.b));
  H_OK(h_no_events(&S.a, 100));
  H_OK(h_no_events(&S.b, 0));
}

static void test_max_frame_api(void **state) {
  static uint8_t big[SOLO_FRAME + 64];
  uint8_t f[64];
  reply r;
  size_t seen;
  char needle[128];
  int fd = raw_client(S.d.sock);
  assert_true(fd >= 0);
  /* A request of exactly max-frame bytes is read and answered (it is no
   * request the daemon knows: seq, then an unknown field as padding)... */
  size_t pad = SOLO_FRAME - 2 - 2;
  while (pad + varint_len(pad) > SOLO_FRAME - 4) pad--;
  uint8_t *p = big;
  put_u32le(p, SOLO_FRAME);
  p += 4;
  *p++ = 0x08, *p++ = 0x05;             /* seq 5 */
  *p++ = 0xa2, *p++ = 0x06;             /* field 100, length-delimited */
  pbuf lv = {.n = 0};
  pb_varint(&lv, pad);
  memcpy(p, lv.b, lv.n);
  p += lv.n;
  memset(p, 0x5a, pad);
  p += pad;
  assert_int_equal(p - big, 4 + SOLO_FRAME);
  h_raw_write(fd, big, (size_t)(p - big));
  H_OK(read_response(fd, 5, &r, 5000));
  if (r.status != KVF_EPROTO) fail_msg("max-frame request: status %s", kvf_err_name(r.status));
  h_raw_write(fd, f, inspect_frame(f, 6));
  H_OK(read_response(fd, 6, &r, 5000));
  assert_int_equal(r.status, 0);
  /* ...one byte more and the client is dropped unanswered, with a line. */
  put_u32le(big, SOLO_FRAME + 1);
  h_raw_write(fd, big, 4 + SOLO_FRAME + 1);
  H_OK(h_expect_closed(fd, 3000, "frame over max-frame", &seen));
  raw_close(fd);
  if (seen) fail_msg("the daemon answered an oversized frame (%zu bytes)", seen);
  snprintf(needle, sizeof needle, "sent a frame of %u bytes, more than max-frame (%u)",
           SOLO_FRAME + 1, SOLO_FRAME);
  H_OK(wait_log(&S.d, needle, 1, 3000));
  H_OK(solo_serves());
}

/* A client that sends requests and does not read the replies: the daemon
 * stops serving it once it leaves 256 KiB unread (api.c, OUT_MARK), so it
 * holds no more for it, and serves the others meanwhile; when the client
 * reads at last, every reply is there, in order (issue 15, item 2: the
 * daemon used to queue 4 x max-frame of them and drop the client). */
static void test_slow_reader(void **state) {
  enum { N = 4000 };
  static uint8_t reqs[N * 16];
  size_t len = 0;
  reply r;
  int fd = raw_client(S.d.sock);
  assert_true(fd >= 0);
  for (uint64_t i = 0; i < N; i++) len += inspect_frame(reqs + len, 100 + i);
  h_raw_write(fd, reqs, len);
  /* The others are served all along. */
  H_OK(solo_serves());
  for (uint64_t i = 0; i < N; i++) {
    H_OK(read_reply(fd, &r, 5000));
    if (!r.is_response || r.seq != 100 + i || r.status)
      fail_msg("reply %llu: seq %llu, status %s", (unsigned long long)(100 + i), (unsigned long long)r.seq,
               kvf_err_name(r.status));
  }
  raw_close(fd);
  H_OK(solo_serves());
}

/* ------------------------------------------------------------ uids */

typedef struct as_result {
  int connect_rc;   /* kvf_connect as that user */
  int inspect_rc;   /* kvf_inspect on that connection, when admitted */
  int hello_status; /* a raw hello's status */
  char error[256];  /* ...and its text */
} as_result;

/* Connects as uid:gid from a child process (setgid, then setuid); *child
 * gets its pid, for the daemon's log line. */
static int connect_as(uid_t uid, gid_t gid, as_result *res, pid_t *child) {
  int pfd[2];
  memset(res, 0, sizeof *res);
  if (pipe(pfd)) return h_fail("pipe: %s", strerror(errno));
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) return h_fail("fork: %s", strerror(errno));
  if (pid == 0) {
    as_result r = {.connect_rc = -EPERM};
    kvf_client *c = NULL;
    close(pfd[0]);
    if (setgroups(0, NULL) == 0 && setgid(gid) == 0 && setuid(uid) == 0 && geteuid() == uid) {
      r.connect_rc = kvf_connect(S.d.sock, &c);
      if (c) {
        char *txt = NULL;
        r.inspect_rc = kvf_inspect(c, KVF_INSPECT_STATUS, 0, &txt);
        free(txt);
        kvf_close(c);
      }
      /* Refused: the reason a client gets, read by hand (an admitted
       * client needs no second look, and would take a second slot). */
      int fd = r.connect_rc ? raw_unix(S.d.sock) : -1;
      reply rep;
      uint8_t f[64];
      if (r.connect_rc == 0) {
        r.hello_status = 0;
      } else if (fd >= 0) {
        h_raw_write(fd, f, hello_frame(f, 1));
        if (read_response(fd, 1, &rep, 5000) == 0) {
          r.hello_status = rep.status;
          snprintf(r.error, sizeof r.error, "%s", rep.error);
        }
        close(fd);
      } else {
        r.hello_status = fd;
      }
    }
    (void)!write(pfd[1], &r, sizeof r);
    _exit(0);
  }
  close(pfd[1]);
  *child = pid;
  ssize_t n = read(pfd[0], res, sizeof *res);
  close(pfd[0]);
  int st;
  waitpid(pid, &st, 0);
  if (n != (ssize_t)sizeof *res) return h_fail("child as uid %u: no result", (unsigned)uid);
  if (res->connect_rc == -EACCES || res->connect_rc == -ENOENT)
    return h_fail("uid %u cannot reach %s at all (%s): the test's dir modes are wrong",
                  (unsigned)uid, S.d.sock, kvf_err_name(res->connect_rc));
  return 0;
}

static void need_root(void) {
  if (geteuid() != 0) {
    fprintf(stderr, "SKIP: not root: cannot connect as other uids (run the suite as root)\n");
    skip();
  }
}

static void test_wrong_uid(void **state) {
  as_result r;
  pid_t pid;
  char needle[96];
  need_root();
  H_OK(connect_as(NOBODY, NOBODY, &r, &pid));
  H_OK(h_expect_rc(r.connect_rc, KVF_EPERM, "kvf_connect as nobody"));
  if (r.hello_status != KVF_EPERM || !strstr(r.error, "uid 65534 may not use kvferryd"))
    fail_msg("hello as nobody: status %s, error \"%s\"", kvf_err_name(r.hello_status), r.error);
  snprintf(needle, sizeof needle, "refused client pid %d uid %u", (int)pid, NOBODY);
  H_OK(wait_log(&S.d, needle, 2, 3000)); /* kvf_connect's and the raw hello's */
  H_OK(h_wait_clients(S.a.c, 2, 3000));
  H_OK(solo_serves());
}

/* A client as uid:gid is admitted; as says how it qualifies. */
static void expect_admitted(uid_t uid, gid_t gid, const char *as) {
  as_result r;
  pid_t pid;
  char what[128];
  need_root();
  H_OK(connect_as(uid, gid, &r, &pid));
  snprintf(what, sizeof what, "kvf_connect %s", as);
  H_OK(h_expect_rc(r.connect_rc, 0, what));
  snprintf(what, sizeof what, "kvf_inspect %s", as);
  H_OK(h_expect_rc(r.inspect_rc, 0, what));
  snprintf(what, sizeof what, "hello %s", as);
  H_OK(h_expect_rc(r.hello_status, 0, what));
}

static void test_allowed_user(void **state) {
  expect_admitted(ALLOWED_UID, ALLOWED_UID, "as a uid in api-allow-users");
}

static void test_allowed_group(void **state) {
  expect_admitted(NOBODY, ALLOWED_GID, "with a gid in api-allow-groups");
}

/* Limits that contradict each other stop the daemon at start, saying why. */
static void test_refused_configs(void **state) {
  h_daemon bad, peer1, peer2;
  h_daemon_init(&bad, S.dir, "bad", 0, "4M");
  snprintf(bad.extra, sizeof bad.extra, "max-frame 4K\n"); /* with max-descs 100000 */
  assert_int_not_equal(h_daemon_spawn(&bad), 0);
  H_OK(wait_log(&bad, "max-descs 100000 needs max-frame of at least 2000512", 1, 1000));
  h_daemon_init(&bad, S.dir, "bad2", 0, "4M");
  h_daemon_init(&peer1, S.dir, "p1", 1, "4M");
  h_daemon_init(&peer2, S.dir, "p2", 2, "4M");
  h_daemon_add_peer(&bad, &peer1);
  h_daemon_add_peer(&bad, &peer2);
  snprintf(bad.extra, sizeof bad.extra, "max-peers 1\n");
  assert_int_not_equal(h_daemon_spawn(&bad), 0);
  H_OK(wait_log(&bad, "2 static peers but max-peers is 1", 1, 1000));
}

/* ============================================================ peers */

static struct {
  char dir[H_PATH_MAX];
  h_daemon pre, dec, oth;
  h_client p, d, o;
} P;

static int peers_setup(void **state) {
  uint16_t ports[3];
  if (h_mkdtemp(P.dir, sizeof P.dir) || h_free_ports(ports, 3)) return -1;
  h_daemon_init(&P.pre, P.dir, "prefill", ports[0], "64M");
  h_daemon_init(&P.dec, P.dir, "decode", ports[1], "64M");
  h_daemon_init(&P.oth, P.dir, "other", ports[2], "16M");
  snprintf(P.pre.extra, sizeof P.pre.extra, "max-frame %u\nmax-descs %u\n", SOLO_FRAME,
           SOLO_DESCS);
  /* a handshake timeout well past the waits of test_pending_peers, so that
   * a connection closed there was closed by the limit */
  snprintf(P.dec.extra, sizeof P.dec.extra, "max-pending-peers %u\npeer-handshake-timeout-ms 5000\n",
           PENDING_MAX);
  h_daemon_add_peer(&P.pre, &P.dec);
  h_daemon_add_peer(&P.pre, &P.oth);
  h_daemon_add_peer(&P.dec, &P.pre);
  h_daemon_add_peer(&P.oth, &P.pre);
  if (h_daemon_spawn(&P.pre) || h_daemon_spawn(&P.dec) || h_daemon_spawn(&P.oth)) return -1;
  if (h_daemon_wait_peers(&P.pre, H_READY_MS) || h_daemon_wait_peers(&P.dec, H_READY_MS) ||
      h_daemon_wait_peers(&P.oth, H_READY_MS))
    return -1;
  return h_client_open(&P.p, &P.pre) || h_client_open(&P.d, &P.dec) ||
                 h_client_open(&P.o, &P.oth)
             ? -1
             : 0;
}

static int peers_teardown(void **state) {
  h_client_close(&P.p);
  h_client_close(&P.d);
  h_client_close(&P.o);
  int a = h_daemon_stop(&P.pre), b = h_daemon_stop(&P.dec), c = h_daemon_stop(&P.oth);
  return a ? a : b ? b : c;
}

static int peers_healthy(void **state) {
  release_leftovers();
  if (h_daemon_wait_peers(&P.pre, H_READY_MS) || h_daemon_wait_peers(&P.dec, H_READY_MS) ||
      h_daemon_wait_peers(&P.oth, H_READY_MS))
    return -1;
  if (h_wait_idle(P.p.c, 1000) || h_wait_idle(P.d.c, 1000) || h_no_events(&P.p, 0) ||
      h_no_events(&P.d, 0)) {
    fprintf(stderr, "kvf-harness: reconnecting the peers' clients after a failed case\n");
    h_client_close(&P.p);
    h_client_close(&P.d);
    if (h_client_open(&P.p, &P.pre) || h_client_open(&P.d, &P.dec)) return -1;
  }
  return h_wait_idle(P.p.c, 5000) || h_wait_idle(P.d.c, 5000) ? -1 : 0;
}

/* How often prefill saw peer name come up (PEERS "ups"). */
static int peer_ups(const char *name, uint64_t *ups) {
  char *json = NULL, got[64];
  int rc = -1;
  if (h_inspect(P.p.c, KVF_INSPECT_PEERS, &json)) return -1;
  const char *it = hj_get(json, "peers"), *e;
  while (it && (e = hj_next(&it)))
    if (!hj_str(e, "name", got, sizeof got) && !strcmp(got, name)) rc = hj_u64(e, "ups", ups);
  if (rc) h_fail("prefill: no peer %s in %s", name, json);
  free(json);
  return rc;
}

/* decode grants n descriptors of 4 KiB from prefill. */
static void big_grant(kvf_desc *dst, size_t n, const char *id) {
  h_layout(dst, n, P.d.pool, 0, 4 * KIB, true, n);
  int rc = kvf_grant(P.d.c, id, P.pre.name, dst, n, 20000);
  if (rc) fail_msg("decode: grant of %zu descriptors: %s", n, kvf_err_name(rc));
}

/* More descriptors than prefill's max-descs in decode's grant: prefill
 * (the sender) refuses it; both clients hear why; the connection stays. */
static void test_peer_grant_over_max_descs(void **state) {
  enum { N = 2 * SOLO_DESCS };
  static kvf_desc src[N], dst[N];
  char id[64], needle[160];
  uint64_t ups0, ups1;
  H_OK(peer_ups("decode", &ups0));
  h_id(id, sizeof id, "descs");
  h_layout(src, N, P.p.pool, 0, 4 * KIB, true, 1);
  /* The send first, in parts within prefill's max-descs; then the grant. */
  H_OK(h_expect_rc(kvf_send(P.p.c, id, P.dec.name, src, SOLO_DESCS, KVF_SEND_MORE, 20000), 0,
                 "send part 1"));
  H_OK(h_expect_rc(kvf_send(P.p.c, id, P.dec.name, src + SOLO_DESCS, SOLO_DESCS, 0, 20000), 0,
                 "send part 2"));
  big_grant(dst, N, id);
  snprintf(needle, sizeof needle, "grant of %u descriptors refused by prefill: its max-descs is %u",
           N, SOLO_DESCS);
  H_OK(expect_event(&P.p, id, KVF_EV_SEND_DONE, KVF_ELIMIT, needle, 10000));
  H_OK(expect_event(&P.d, id, KVF_EV_RECV_DONE, KVF_ELIMIT, needle, 10000));
  char line[256];
  snprintf(line, sizeof line, "peer decode: transfer '%s': %s", id, needle);
  H_OK(wait_log(&P.pre, line, 1, 3000));
  /* Nothing else was touched: same connection, transfers flow. */
  H_OK(h_quick(&P.p, &P.d));
  H_OK(h_quick(&P.d, &P.p));
  H_OK(peer_ups("decode", &ups1));
  assert_int_equal(ups0, ups1);
  H_OK(h_no_events(&P.p, 100));
  H_OK(h_no_events(&P.d, 0));
}

/* The same grant pushed ahead of the send: the send fails at once when it
 * comes, with the same reason, instead of waiting for its deadline. */
static void test_peer_grant_over_max_descs_first(void **state) {
  enum { N = 2 * SOLO_DESCS };
  static kvf_desc src[N], dst[N];
  char id[64];
  h_id(id, sizeof id, "descs-first");
  big_grant(dst, N, id);
  H_OK(expect_event(&P.d, id, KVF_EV_RECV_DONE, KVF_ELIMIT, "its max-descs is 1000", 10000));
  h_layout(src, N, P.p.pool, 0, 4 * KIB, true, 2);
  uint64_t t0 = h_now_ms();
  H_OK(h_expect_rc(kvf_send(P.p.c, id, P.dec.name, src, SOLO_DESCS, KVF_SEND_MORE, 20000), 0,
                 "send part 1"));
  H_OK(expect_event(&P.p, id, KVF_EV_SEND_DONE, KVF_ELIMIT, "its max-descs is 1000", 5000));
  if (h_now_ms() - t0 > 3000) fail_msg("the send waited %llu ms", (unsigned long long)(h_now_ms() - t0));
  H_OK(h_quick(&P.p, &P.d));
  H_OK(h_no_events(&P.p, 100));
  H_OK(h_no_events(&P.d, 0));
}

/* A grant frame over prefill's max-frame (decode's is larger): prefill
 * drops that connection with a line, both sides' transfer fails, the pair
 * reconnects, and prefill's other peer never notices. */
static void test_peer_frame_over_max_frame(void **state) {
  enum { N = 4000 }; /* 80 KB of descriptors > 64 KiB; < decode's max-descs */
  static kvf_desc dst[N];
  char id[64], needle[96];
  uint64_t other0, other1;
  H_OK(peer_ups("other", &other0));
  size_t lines = log_count(&P.pre, "peer decode: frame larger than max-frame (65536)");
  h_id(id, sizeof id, "frame");
  big_grant(dst, N, id);
  H_OK(expect_event(&P.d, id, KVF_EV_RECV_DONE, KVF_EPEERLOST, NULL, 10000));
  snprintf(needle, sizeof needle, "peer decode: frame larger than max-frame (%u)", SOLO_FRAME);
  H_OK(wait_log(&P.pre, needle, lines + 1, 3000));
  H_OK(wait_log(&P.pre, "max-frame (65536): 80", lines + 1, 0)); /* the size, ~80 KB */
  /* In the two-node rdma VM the third daemon has no RDMA address of its
   * own, so its transfers fall back to tcp there: only the bytes count. */
  H_OK(h_quick_any_path(&P.p, &P.o));
  H_OK(h_quick_any_path(&P.o, &P.p));
  H_OK(peer_ups("other", &other1));
  assert_int_equal(other0, other1);
  H_OK(h_daemon_wait_peers(&P.pre, H_READY_MS));
  H_OK(h_daemon_wait_peers(&P.dec, H_READY_MS));
  H_OK(h_quick(&P.p, &P.d));
  H_OK(h_no_events(&P.d, 100));
}

/* Connections to decode's peer port that never say Hello: max-pending-peers
 * of them are held (each until the 5 s handshake timeout set above), the
 * next is closed at once with a line; established peers are not affected,
 * and a slot is free again once one goes. */
static void test_pending_peers(void **state) {
  int idle[PENDING_MAX];
  uint64_t ups0, ups1;
  size_t lines = log_count(&P.dec, "max-pending-peers (8) connections have not said Hello");
  H_OK(h_quick(&P.p, &P.d)); /* prefill's data streams to decode are up */
  H_OK(peer_ups("decode", &ups0));
  for (unsigned i = 0; i < PENDING_MAX; i++) {
    idle[i] = raw_tcp(P.dec.port);
    assert_true(idle[i] >= 0);
  }
  /* No wait for the daemon to take them: each connect() above returned
   * with its connection in the listener's accept queue, which is FIFO, and
   * the daemon accepts (and counts) in that order on one loop; so the next
   * one is always seen after all of them. */
  uint64_t t0 = h_now_ms();
  int extra = raw_tcp(P.dec.port);
  assert_true(extra >= 0);
  H_OK(h_expect_closed(extra, 4000, "connection past max-pending-peers", NULL));
  raw_close(extra);
  if (h_now_ms() - t0 > 2000)
    fail_msg("closed after %llu ms: the handshake timeout, not the limit",
             (unsigned long long)(h_now_ms() - t0));
  H_OK(wait_log(&P.dec, "max-pending-peers (8) connections have not said Hello", lines + 1, 3000));
  H_OK(expect_open(idle[0], 0, "a pending connection within the limit"));
  /* The established peers go on. */
  H_OK(h_quick(&P.p, &P.d));
  H_OK(h_quick(&P.d, &P.p));
  H_OK(peer_ups("decode", &ups1));
  assert_int_equal(ups0, ups1);
  /* A pending connection may not send more than a Hello's worth. */
  uint8_t hdr[8];
  put_u32le(hdr, 100000);
  h_raw_write(idle[0], hdr, sizeof hdr);
  H_OK(h_expect_closed(idle[0], 2000, "a 100 KB frame before Hello", NULL));
  H_OK(wait_log(&P.dec, "a peer may send before its Hello (65536)", 1, 3000));
  /* The daemon counted idle[0] out before closing it (seen above): with
   * the other seven still pending, one more is held again. */
  int again = raw_tcp(P.dec.port);
  assert_true(again >= 0);
  H_OK(expect_open(again, 1000, "a pending connection after one left"));
  raw_close(again);
  for (unsigned i = 0; i < PENDING_MAX; i++) raw_close(idle[i]);
}

/* ============================================================ main */

/* Another uid must reach the socket dir: TMPDIR and every dir above it
 * must be searchable by others, else the temp dirs go to /tmp. */
static void world_reachable_tmpdir(void) {
  const char *t = getenv("TMPDIR");
  char path[H_PATH_MAX];
  struct stat st;
  if (!t || !*t || !realpath(t, path)) return;
  for (;;) {
    if (stat(path[0] ? path : "/", &st) != 0 || !(st.st_mode & S_IXOTH)) {
      fprintf(stderr, "kvf-harness: TMPDIR %s is not reachable by other users; using /tmp\n", t);
      setenv("TMPDIR", "/tmp", 1);
      return;
    }
    char *slash = strrchr(path, '/');
    if (!slash || !path[0]) return;
    *slash = '\0';
  }
}

int main(void) {
  const struct CMUnitTest local[] = {
      cmocka_unit_test_setup(test_max_clients, solo_clean),
      cmocka_unit_test_setup(test_refused_flood, solo_clean),
      cmocka_unit_test_setup(test_transfers_per_client, solo_clean),
      cmocka_unit_test_setup(test_max_frame_api, solo_clean),
      cmocka_unit_test_setup(test_slow_reader, solo_clean),
      cmocka_unit_test_setup(test_wrong_uid, solo_clean),
      cmocka_unit_test_setup(test_allowed_user, solo_clean),
      cmocka_unit_test_setup(test_allowed_group, solo_clean),
      cmocka_unit_test_setup(test_refused_configs, solo_clean),
  };
  const struct CMUnitTest peers[] = {
      cmocka_unit_test_setup(test_peer_grant_over_max_descs, peers_healthy),
      cmocka_unit_test_setup(test_peer_grant_over_max_descs_first, peers_healthy),
      cmocka_unit_test_setup(test_pending_peers, peers_healthy),
      cmocka_unit_test_setup(test_peer_frame_over_max_frame, peers_healthy),
  };
  h_init();
  world_reachable_tmpdir();
  int failed = cmocka_run_group_tests_name("limits-local", local, solo_setup, solo_teardown);
  /* The peer limits are transport-blind, and in the two-node rdma VM the
   * harness hands its two RDMA addresses to the daemons named first (the
   * bad-config ones here): run them on tcp only, and say so. */
  const char *t = getenv("KVF_TEST_TRANSPORT");
  if (t && strcmp(t, "rdma") == 0)
    fprintf(stderr, "SKIP limits-peers: peer limits run under tcp (make check), not under rdma\n");
  else
    failed += cmocka_run_group_tests_name("limits-peers", peers, peers_setup, peers_teardown);
  return h_cleanup(failed);
}
