/* test_xfer.c - the transfer state machine (daemon/xfer.c) driven with fakes:
 * events and peer messages are recorded, peers are plain structs, and the
 * transports record what is posted and let the test complete it later. A
 * real libuv loop carries the deadline timers.
 *
 * Node names: this daemon is "A"; "B" and "C" are peers. Sessions are dummy
 * addresses: SR usually receives, SS sends, SO is a third client. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "desc.h"
#include "kvferryd.h"
#include "peer.h"
#include "transport/transport.h"
#include "xfer.h"

#define MAXREC 1024
#define DEFAULT_DEADLINE 10000u

/* ---- recorders --------------------------------------------------------- */

typedef struct ev_rec {
  kvf__session *s;
  int type;
  char id[KVF_XFER_ID_MAX + 1];
  int status;
  char path[32];
  char peer[KVF__NAME_MAX + 1];
  uint64_t bytes, descriptors;
  char error[160];
} ev_rec;

typedef struct msg_rec {
  kvf__peer *p;
  Kvf__PeerMsg *m; /* an unpacked copy of what was sent */
} msg_rec;

typedef struct post_rec {
  kvf__transport *tp;
  kvf__xfer *x;
  kvf__runs runs;
  bool last;
  bool done;
} post_rec;

#define NSESS 3
static char sess_mem[NSESS];
#define SR ((kvf__session *)&sess_mem[0])
#define SS ((kvf__session *)&sess_mem[1])
#define SO ((kvf__session *)&sess_mem[2])

static struct {
  uv_loop_t loop;
  ev_rec ev[MAXREC];
  size_t nev;
  msg_rec msg[MAXREC];
  size_t nmsg;
  post_rec post[MAXREC];
  size_t npost;
  kvf__xfer *opened[MAXREC];
  size_t nopened;
  kvf__xfer *closed[MAXREC];
  size_t nclosed;
  kvf__xfer *aborted[MAXREC];
  size_t naborted;
  int post_rc, grant_open_rc;
  int append_fails;        /* xfer.c's next kvf__descs_append calls to fail */
  bool one_sided;          /* peers' transport is one_sided (rdma-like) */
  int sess[NSESS];
  bool sess_bad; /* a count went negative or named an unknown session */
  kvf__peer *pb, *pc;
} F;

/* ---- fake environment --------------------------------------------------- */

static void f_emit(kvf__session *s, const Kvf__Event *ev) {
  if (F.nev >= MAXREC) fail_msg("too many events");
  ev_rec *r = &F.ev[F.nev++];
  memset(r, 0, sizeof(*r));
  r->s = s;
  r->type = ev->type;
  snprintf(r->id, sizeof(r->id), "%s", ev->xfer_id ? ev->xfer_id : "");
  r->status = ev->status;
  snprintf(r->path, sizeof(r->path), "%s", ev->path ? ev->path : "");
  snprintf(r->peer, sizeof(r->peer), "%s", ev->peer ? ev->peer : "");
  r->bytes = ev->bytes;
  r->descriptors = ev->descriptors;
  snprintf(r->error, sizeof(r->error), "%s", ev->error ? ev->error : "");
}

static int f_peer_send(kvf__peer *p, const Kvf__PeerMsg *m) {
  if (F.nmsg >= MAXREC) fail_msg("too many peer messages");
  size_t n = kvf__peer_msg__get_packed_size(m);
  uint8_t *buf = malloc(n ? n : 1);
  assert_non_null(buf);
  assert_int_equal(kvf__peer_msg__pack(m, buf), n);
  Kvf__PeerMsg *copy = kvf__peer_msg__unpack(NULL, n, buf);
  free(buf);
  assert_non_null(copy);
  F.msg[F.nmsg++] = (msg_rec){.p = p, .m = copy};
  return 0;
}

static kvf__peer *f_peer_find(const char *node) {
  if (strcmp(node, F.pb->cfg.name) == 0) return F.pb;
  if (strcmp(node, F.pc->cfg.name) == 0) return F.pc;
  return NULL;
}

static bool f_peer_up(const kvf__peer *p) { return p->state == KVF__PEER_UP; }
static const char *f_peer_name(const kvf__peer *p) { return p->cfg.name; }

static void f_session_xfers(kvf__session *s, int delta) {
  ptrdiff_t i = (char *)s - sess_mem;
  if (i < 0 || i >= NSESS) {
    F.sess_bad = true;
    return;
  }
  F.sess[i] += delta;
  if (F.sess[i] < 0) F.sess_bad = true;
}

static int f_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) {
  if (F.post_rc) return F.post_rc;
  if (F.npost >= MAXREC) fail_msg("too many posts");
  post_rec *r = &F.post[F.npost++];
  r->tp = t;
  r->x = x;
  r->runs = *runs; /* ownership passes to the transport */
  memset(runs, 0, sizeof(*runs));
  r->last = last;
  r->done = false;
  return 0;
}

static void f_abort(kvf__transport *t, kvf__xfer *x) {
  if (F.naborted < MAXREC) F.aborted[F.naborted++] = x;
}

static int f_grant_open(kvf__transport *t, kvf__xfer *x) {
  if (F.grant_open_rc) return F.grant_open_rc;
  if (F.nopened < MAXREC) F.opened[F.nopened++] = x;
  return 0;
}

static void f_grant_close(kvf__transport *t, kvf__xfer *x) {
  if (F.nclosed < MAXREC) F.closed[F.nclosed++] = x;
}

/* The fake transports share their ops; name and one_sided tell them apart.
 * kvf__transport_init copies them (and fills in the defaults). */
static void fake_init(kvf__transport *t, const char *name, bool one_sided, unsigned slot) {
  kvf__transport_ops o = {.name = name, .one_sided = one_sided, .post = f_post, .abort = f_abort,
                          .grant_open = f_grant_open, .grant_close = f_grant_close};
  kvf__transport_init(t, &o, &F.loop, slot);
}/* Made with kvf__transport_init (group_setup): the ops left out get the
 * defaults, as a real transport's do. */
static kvf__transport TL, TN, TO;

static kvf__transport *f_peer_transport(kvf__peer *p) { return F.one_sided ? &TO : &TN; }

/* ---- helpers ---------------------------------------------------------- */

/* A list from caller arrays through the wire form (DescList.packed: 20-byte
 * little-endian records, encoded here byte by byte), as a client sends it. */
static kvf__descs from_arrays(const uint32_t *p, const uint64_t *o, const uint64_t *l, size_t n) {
  uint8_t *buf = malloc(n ? n * 20 : 1);
  assert_non_null(buf);
  for (size_t i = 0; i < n; i++) {
    uint8_t *r = buf + i * 20;
    for (int b = 0; b < 4; b++) r[b] = (uint8_t)(p[i] >> (8 * b));
    for (int b = 0; b < 8; b++) r[4 + b] = (uint8_t)(o[i] >> (8 * b));
    for (int b = 0; b < 8; b++) r[12 + b] = (uint8_t)(l[i] >> (8 * b));
  }
  Kvf__DescList w = KVF__DESC_LIST__INIT;
  w.packed.data = buf;
  w.packed.len = n * 20;
  kvf__descs d;
  assert_int_equal(kvf__descs_from_wire(&d, &w, 1u << 20), 0);
  free(buf);
  return d;
}

/* n blocks of len in pool at base + i*stride. */
static kvf__descs mkd(size_t n, uint32_t pool, uint64_t base, uint64_t stride, uint64_t len) {
  uint32_t *p = calloc(n, sizeof(*p));
  uint64_t *o = calloc(n, sizeof(*o));
  uint64_t *l = calloc(n, sizeof(*l));
  assert_non_null(p);
  assert_non_null(o);
  assert_non_null(l);
  for (size_t i = 0; i < n; i++) {
    p[i] = pool;
    o[i] = base + i * stride;
    l[i] = len;
  }
  kvf__descs d = from_arrays(p, o, l, n);
  free(p);
  free(o);
  free(l);
  return d;
}

static kvf__descs mkd_len(size_t n, const uint64_t *len) {
  uint32_t p[16] = {0};
  uint64_t o[16];
  assert_true(n <= 16);
  uint64_t off = 0;
  for (size_t i = 0; i < n; i++) {
    o[i] = off;
    off += len[i] + 4096;
  }
  return from_arrays(p, o, len, n);
}

static char errbuf[512];

static int do_grant(kvf__session *s, const char *id, const char *src, kvf__descs d, uint32_t dl) {
  errbuf[0] = 0;
  int rc = kvf__xfer_grant(s, id, src, &d, dl, errbuf, sizeof errbuf);
  kvf__descs_free(&d); /* consumed (zeroed) on success, still ours on error */
  return rc;
}

static int do_send(kvf__session *s, const char *id, const char *dst, kvf__descs d, bool more,
                   uint32_t dl) {
  errbuf[0] = 0;
  int rc = kvf__xfer_send(s, id, dst, &d, more, dl, errbuf, sizeof errbuf);
  kvf__descs_free(&d); /* send copies */
  return rc;
}

/* Incoming peer messages. */
static void in_grant(kvf__peer *p, const char *id, uint64_t handle, const kvf__descs *d) {
  Kvf__Grant g = KVF__GRANT__INIT;
  Kvf__DescList dl;
  assert_int_equal(kvf__descs_to_wire(d, &dl), 0);
  g.xfer_id = (char *)id;
  g.handle = handle;
  g.descs = &dl;
  g.deadline_ms = 5000;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_GRANT;
  m.grant = &g;
  kvf__xfer_on_peer_msg(p, &m);
  kvf__descs_wire_free(&dl);
}

static void in_intent(kvf__peer *p, const char *id, uint32_t deadline_ms) {
  Kvf__SendIntent si = KVF__SEND_INTENT__INIT;
  si.xfer_id = (char *)id;
  si.deadline_ms = deadline_ms;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_SEND_INTENT;
  m.send_intent = &si;
  kvf__xfer_on_peer_msg(p, &m);
}

static void in_send_done_of(kvf__peer *p, uint64_t handle, uint64_t bytes, uint64_t descriptors, const char *id) {
  Kvf__SendDone d = KVF__SEND_DONE__INIT;
  d.handle = handle;
  if (id) d.xfer_id = (char *)id;
  d.bytes = bytes;
  d.descriptors = descriptors;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_SEND_DONE;
  m.send_done = &d;
  kvf__xfer_on_peer_msg(p, &m);
}

static void in_send_done(kvf__peer *p, uint64_t handle, uint64_t bytes, uint64_t descriptors) {
  in_send_done_of(p, handle, bytes, descriptors, NULL);
}

static void in_recv_result(kvf__peer *p, uint64_t handle, int status) {
  Kvf__RecvResult r = KVF__RECV_RESULT__INIT;
  r.handle = handle;
  r.status = status;
  r.error = (char *)(status ? "remote failure" : "");
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_RECV_RESULT;
  m.recv_result = &r;
  kvf__xfer_on_peer_msg(p, &m);
}

static void in_cancel_ex(kvf__peer *p, uint64_t handle, const char *id, int status, bool to_sender, bool ack) {
  Kvf__Cancel c = KVF__CANCEL__INIT;
  c.handle = handle;
  c.xfer_id = (char *)(id ? id : "");
  c.status = status;
  c.error = "";
  c.to_sender = to_sender;
  c.ack = ack;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_CANCEL;
  m.cancel = &c;
  kvf__xfer_on_peer_msg(p, &m);
}

static void in_cancel(kvf__peer *p, uint64_t handle, const char *id, int status, bool to_sender) {
  in_cancel_ex(p, handle, id, status, to_sender, false);
}

/* A Cancel to our sending side that asks for a CancelDone. */
static void in_cancel_ack(kvf__peer *p, uint64_t handle, const char *id) {
  in_cancel_ex(p, handle, id, 0, true, true);
}

static void in_cancel_done(kvf__peer *p, uint64_t handle) {
  Kvf__CancelDone d = KVF__CANCEL_DONE__INIT;
  d.handle = handle;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_CANCEL_DONE;
  m.cancel_done = &d;
  kvf__xfer_on_peer_msg(p, &m);
}

/* Recorded peer messages. */
static size_t nmsgs(kvf__peer *p, int body) {
  size_t n = 0;
  for (size_t i = 0; i < F.nmsg; i++)
    if ((!p || F.msg[i].p == p) && (body < 0 || (int)F.msg[i].m->body_case == body)) n++;
  return n;
}

static Kvf__PeerMsg *last_msg(kvf__peer *p, int body) {
  for (size_t i = F.nmsg; i-- > 0;)
    if (F.msg[i].p == p && (int)F.msg[i].m->body_case == body) return F.msg[i].m;
  fail_msg("no message of body %d to %s", body, p ? p->cfg.name : "?");
  return NULL;
}

/* Recorded events. */
static size_t nevents(kvf__session *s) {
  size_t n = 0;
  for (size_t i = 0; i < F.nev; i++)
    if (F.ev[i].s == s) n++;
  return n;
}

/* The one event of type for id; fails when there are none or several. */
static const ev_rec *event_for(const char *id, int type) {
  const ev_rec *hit = NULL;
  for (size_t i = 0; i < F.nev; i++) {
    if (F.ev[i].type == type && strcmp(F.ev[i].id, id) == 0) {
      if (hit) fail_msg("two events of type %d for '%s'", type, id);
      hit = &F.ev[i];
    }
  }
  if (!hit) fail_msg("no event of type %d for '%s'", type, id);
  return hit;
}

static size_t nevents_for(const char *id) {
  size_t n = 0;
  for (size_t i = 0; i < F.nev; i++)
    if (strcmp(F.ev[i].id, id) == 0) n++;
  return n;
}

#define RECV_DONE KVF__EVENT_TYPE__EVENT_RECV_DONE
#define SEND_DONE KVF__EVENT_TYPE__EVENT_SEND_DONE

static void expect_event(const char *id, int type, kvf__session *s, int status) {
  const ev_rec *e = event_for(id, type);
  assert_ptr_equal(e->s, s);
  if (e->status != status)
    fail_msg("'%s' type %d: status %d, want %d (%s)", id, type, e->status, status, e->error);
}

/* Live transfers. */
static kvf__xfer *find_x(const char *id, int role) {
  for (kvf__xfer *x = kvf__xfer_first(); x; x = x->next)
    if (x->role == role && strcmp(x->id, id) == 0) return x;
  return NULL;
}

static size_t nclosed_of(const kvf__xfer *x) {
  size_t n = 0;
  for (size_t i = 0; i < F.nclosed; i++)
    if (F.closed[i] == x) n++;
  return n;
}

static size_t naborted_of(const kvf__xfer *x) {
  size_t n = 0;
  for (size_t i = 0; i < F.naborted; i++)
    if (F.aborted[i] == x) n++;
  return n;
}

static void complete_post(size_t i, int status) {
  assert_true(i < F.npost);
  assert_false(F.post[i].done);
  F.post[i].done = true;
  kvf__xfer_on_posted(F.post[i].x, status, F.post[i].last);
}

/* Lets closed timer handles finish (transfers are freed in their close
 * callback). Never blocks. */
static void flush(void) {
  for (int i = 0; i < 4; i++) uv_run(&F.loop, UV_RUN_NOWAIT);
}

static void run_until_nev(size_t n, unsigned max_ms) {
  uint64_t t0 = uv_hrtime();
  while (F.nev < n && uv_hrtime() - t0 < (uint64_t)max_ms * 1000000ull)
    uv_run(&F.loop, UV_RUN_ONCE);
}

static bool ticked;
static void on_tick(uv_timer_t *t) { ticked = true; }

static void run_for(unsigned ms) {
  uv_timer_t t;
  uv_timer_init(&F.loop, &t);
  ticked = false;
  uv_update_time(&F.loop);
  uv_timer_start(&t, on_tick, ms, 0);
  while (!ticked) uv_run(&F.loop, UV_RUN_ONCE);
  uv_close((uv_handle_t *)&t, NULL);
  flush();
}

/* Every test ends here: nothing live, nothing counted, nothing posted and
 * forgotten. */
static void assert_clean(void) {
  flush();
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  if (c.active || c.grants || c.sends || c.pregrants || c.intents)
    fail_msg("left over: active %zu grants %zu sends %zu pregrants %zu intents %zu", c.active,
             c.grants, c.sends, c.pregrants, c.intents);
  assert_null(kvf__xfer_first());
  for (int i = 0; i < NSESS; i++)
    if (F.sess[i] != 0) fail_msg("session %d still counts %d transfers", i, F.sess[i]);
  assert_false(F.sess_bad);
  for (size_t i = 0; i < F.npost; i++)
    if (!F.post[i].done) fail_msg("post %zu was never completed", i);
}

/* ---- fixtures ------------------------------------------------------------ */

static void reset_records(void) {
  for (size_t i = 0; i < F.nmsg; i++) kvf__peer_msg__free_unpacked(F.msg[i].m, NULL);
  for (size_t i = 0; i < F.npost; i++) kvf__runs_free(&F.post[i].runs);
  F.nev = F.nmsg = F.npost = F.nopened = F.nclosed = F.naborted = 0;
  F.post_rc = F.grant_open_rc = 0;
  memset(F.sess, 0, sizeof(F.sess));
  F.sess_bad = false;
}

static int group_setup(void **state) {
  memset(&F, 0, sizeof(F));
  if (uv_loop_init(&F.loop) != 0) return -1;
  kvfd.loop = &F.loop;
  kvf__config_defaults(&kvfd.cfg);
  snprintf(kvfd.cfg.node, sizeof(kvfd.cfg.node), "A");
  kvfd.cfg.default_deadline_ms = DEFAULT_DEADLINE;
  kvfd.session = 5;
  F.pb = calloc(1, sizeof(*F.pb));
  F.pc = calloc(1, sizeof(*F.pc));
  if (!F.pb || !F.pc) return -1;
  snprintf(F.pb->cfg.name, sizeof(F.pb->cfg.name), "B");
  snprintf(F.pc->cfg.name, sizeof(F.pc->cfg.name), "C");
  fake_init(&TL, "fake-local", false, 0);
  fake_init(&TN, "fake-net", false, 1);
  fake_init(&TO, "fake-rdma", true, 1);
  kvf__xfer_env env = {
      .emit = f_emit,
      .peer_send = f_peer_send,
      .peer_find = f_peer_find,
      .peer_up = f_peer_up,
      .peer_name = f_peer_name,
      .peer_transport = f_peer_transport,
      .session_xfers = f_session_xfers,
      .local = &TL,
      .strict = true,
  };
  return kvf__xfer_init(&F.loop, &env);
}

static int group_teardown(void **state) {
  kvf__xfer_shutdown();
  uv_run(&F.loop, UV_RUN_DEFAULT);
  int rc = uv_loop_close(&F.loop);
  reset_records();
  free(F.pb);
  free(F.pc);
  return rc == 0 ? 0 : -1;
}

static int setup(void **state) {
  reset_records();
  F.one_sided = false;
  F.pb->state = KVF__PEER_UP;
  F.pc->state = KVF__PEER_UP;
  uv_update_time(&F.loop);
  return 0;
}

/* A failed test may leave transfers behind: tear them down so that the next
 * test starts clean (the test itself already failed). */
static int teardown(void **state) {
  F.post_rc = F.grant_open_rc = F.append_fails = 0;
  for (int round = 0; round < 3; round++) {
    for (size_t i = 0; i < F.npost; i++)
      if (!F.post[i].done) {
        F.post[i].done = true;
        kvf__xfer_on_posted(F.post[i].x, KVF_ECANCELED, F.post[i].last);
      }
    for (int i = 0; i < NSESS; i++) kvf__xfer_session_gone((kvf__session *)&sess_mem[i]);
    kvf__xfer_on_peer_down(F.pb);
    kvf__xfer_on_peer_down(F.pc);
    flush();
  }
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  reset_records();
  return c.active == 0 && c.pregrants == 0 && c.intents == 0 ? 0 : -1;
}

/* ---- local transfers ---------------------------------------------------- */

static void test_local_grant_then_send(void **state) {
  assert_int_equal(do_grant(SR, "L1", NULL, mkd(4, 1, 0, 4096, 4096), 0), 0);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.active, 1);
  assert_int_equal(c.grants, 1);
  assert_int_equal(F.sess[0], 1);
  assert_int_equal(F.npost, 0);

  assert_int_equal(do_send(SS, "L1", "A", mkd(4, 0, 8192, 4096, 4096), false, 0), 0);
  assert_int_equal(F.sess[1], 1);
  assert_int_equal(F.npost, 1);
  assert_ptr_equal(F.post[0].tp, &TL);
  assert_true(F.post[0].last);
  /* Contiguous on both sides: one run. */
  assert_int_equal(F.post[0].runs.n, 1);
  assert_int_equal(F.post[0].runs.v[0].src_pool, 0);
  assert_int_equal(F.post[0].runs.v[0].src_off, 8192);
  assert_int_equal(F.post[0].runs.v[0].dst_pool, 1);
  assert_int_equal(F.post[0].runs.v[0].dst_off, 0);
  assert_int_equal(F.post[0].runs.v[0].len, 16384);
  assert_int_equal(F.post[0].runs.bytes, 16384);
  assert_int_equal(F.nev, 0); /* the copy is still out */

  complete_post(0, 0);
  assert_int_equal(F.nev, 2);
  const ev_rec *r = event_for("L1", RECV_DONE);
  assert_ptr_equal(r->s, SR);
  assert_int_equal(r->status, 0);
  assert_int_equal(r->bytes, 16384);
  assert_int_equal(r->descriptors, 4);
  assert_string_equal(r->path, "fake-local");
  assert_string_equal(r->peer, "A");
  assert_string_equal(r->error, "");
  const ev_rec *s = event_for("L1", SEND_DONE);
  assert_ptr_equal(s->s, SS);
  assert_int_equal(s->status, 0);
  assert_int_equal(s->bytes, 16384);
  assert_int_equal(s->descriptors, 4);
  assert_string_equal(s->path, "fake-local");
  assert_string_equal(s->peer, "A");
  assert_int_equal(F.nmsg, 0); /* nothing goes to peers */
  assert_clean();
}

static void test_local_send_then_grant(void **state) {
  /* Two parts before the grant: they wait, then go as one post. */
  assert_int_equal(do_send(SS, "L2", "A", mkd(2, 0, 0, 1000, 100), true, 0), 0);
  assert_true(kvf__xfer_sending(SS, "L2"));
  assert_false(kvf__xfer_sending(SR, "L2"));
  assert_int_equal(do_send(SS, "L2", "A", mkd(1, 0, 5000, 1000, 300), false, 0), 0);
  assert_int_equal(F.npost, 0);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.sends, 1);
  assert_int_equal(c.grants, 0);
  /* A third part after the last: refused, no event. */
  assert_int_equal(do_send(SS, "L2", "A", mkd(1, 0, 0, 1, 1), false, 0), KVF_EEXIST);

  uint64_t gl[] = {100, 100, 300};
  assert_int_equal(do_grant(SR, "L2", "A", mkd_len(3, gl), 0), 0); /* naming ourselves */
  assert_int_equal(F.npost, 1);
  assert_ptr_equal(F.post[0].tp, &TL);
  assert_true(F.post[0].last);
  assert_int_equal(F.post[0].runs.bytes, 500);
  complete_post(0, 0);
  expect_event("L2", RECV_DONE, SR, 0);
  expect_event("L2", SEND_DONE, SS, 0);
  assert_int_equal(event_for("L2", SEND_DONE)->descriptors, 3);
  assert_int_equal(event_for("L2", SEND_DONE)->bytes, 500);
  assert_int_equal(event_for("L2", RECV_DONE)->bytes, 500);
  assert_int_equal(event_for("L2", RECV_DONE)->descriptors, 3);
  assert_int_equal(F.nev, 2);
  assert_int_equal(F.nmsg, 0);
  assert_clean();
}

/* Parts after the grant: each is posted; done only once all are back, in
 * whatever order. */
static void test_local_parts_out_of_order(void **state) {
  assert_int_equal(do_grant(SR, "L3", NULL, mkd(4, 1, 0, 8192, 4096), 0), 0);
  assert_int_equal(do_send(SS, "L3", "A", mkd(1, 0, 0, 4096, 4096), true, 0), 0);
  assert_int_equal(do_send(SS, "L3", "A", mkd(2, 0, 4096, 4096, 4096), true, 0), 0);
  assert_int_equal(do_send(SS, "L3", "A", mkd(1, 0, 12288, 4096, 4096), false, 0), 0);
  assert_int_equal(F.npost, 3);
  assert_false(F.post[0].last);
  assert_false(F.post[1].last);
  assert_true(F.post[2].last);
  /* Pairing advanced: part 2 went to grant blocks 1 and 2 (8192 apart). */
  assert_int_equal(F.post[1].runs.n, 2);
  assert_int_equal(F.post[1].runs.v[0].dst_off, 8192);
  assert_int_equal(F.post[1].runs.v[1].dst_off, 16384);
  assert_int_equal(F.post[2].runs.v[0].dst_off, 24576);
  complete_post(2, 0);
  complete_post(0, 0);
  assert_int_equal(F.nev, 0);
  complete_post(1, 0);
  assert_int_equal(F.nev, 2);
  expect_event("L3", RECV_DONE, SR, 0);
  expect_event("L3", SEND_DONE, SS, 0);
  assert_int_equal(event_for("L3", SEND_DONE)->descriptors, 4);
  assert_clean();
}

static void test_local_size_mismatch(void **state) {
  /* Length. */
  assert_int_equal(do_grant(SR, "M1", NULL, mkd(2, 1, 0, 4096, 4096), 0), 0);
  uint64_t sl[] = {4096, 4095};
  assert_int_equal(do_send(SS, "M1", "A", mkd_len(2, sl), false, 0), 0);
  assert_int_equal(F.npost, 0);
  expect_event("M1", RECV_DONE, SR, KVF_ESIZE);
  expect_event("M1", SEND_DONE, SS, KVF_ESIZE);
  assert_true(strlen(event_for("M1", SEND_DONE)->error) > 0);
  /* Count: fewer blocks in the last part. */
  assert_int_equal(do_grant(SR, "M2", NULL, mkd(3, 1, 0, 4096, 4096), 0), 0);
  assert_int_equal(do_send(SS, "M2", "A", mkd(2, 0, 0, 4096, 4096), false, 0), 0);
  expect_event("M2", RECV_DONE, SR, KVF_ESIZE);
  expect_event("M2", SEND_DONE, SS, KVF_ESIZE);
  /* Count: more blocks. */
  assert_int_equal(do_send(SS, "M3", "A", mkd(3, 0, 0, 4096, 4096), false, 0), 0);
  assert_int_equal(do_grant(SR, "M3", NULL, mkd(2, 1, 0, 4096, 4096), 0), 0);
  expect_event("M3", RECV_DONE, SR, KVF_ESIZE);
  expect_event("M3", SEND_DONE, SS, KVF_ESIZE);
  assert_int_equal(F.nev, 6);
  assert_int_equal(F.npost, 0);
  assert_int_equal(F.nmsg, 0);
  assert_clean();
}

/* A local grant that names a remote source is not taken by a local send. */
static void test_local_send_skips_grant_for_other_node(void **state) {
  F.pb->state = KVF__PEER_DOWN; /* so that the grant is not pushed */
  assert_int_equal(do_grant(SR, "N1", "B", mkd(1, 1, 0, 64, 64), 0), 0);
  assert_int_equal(do_send(SS, "N1", "A", mkd(1, 0, 0, 64, 64), false, 0), 0);
  assert_int_equal(F.npost, 0);
  assert_int_equal(F.nmsg, 0);
  assert_int_equal(kvf__xfer_cancel(SR, "N1"), 0);
  assert_int_equal(kvf__xfer_cancel(SS, "N1"), 0);
  expect_event("N1", RECV_DONE, SR, KVF_ECANCELED);
  expect_event("N1", SEND_DONE, SS, KVF_ECANCELED);
  assert_int_equal(F.nev, 2);
  assert_clean();
}

/* ---- remote: receiving side ------------------------------------------- */

/* Grant naming B: pushed to B at once. SendDone then landed. */
static void test_remote_pushed_grant(void **state) {
  kvf__descs d = mkd(3, 2, 1 << 20, 8192, 4096);
  assert_int_equal(do_grant(SR, "R1", "B", d, 0), 0);
  assert_int_equal(F.nopened, 1);
  kvf__xfer *x = F.opened[0];
  assert_string_equal(x->id, "R1");
  assert_ptr_equal(find_x("R1", KVF__RECV), x);
  assert_null(find_x("R1", KVF__SEND));
  assert_int_equal(x->state, KVF__X_ACTIVE);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 1);
  assert_int_equal(F.nmsg, 1);
  Kvf__Grant *g = last_msg(F.pb, KVF__PEER_MSG__BODY_GRANT)->grant;
  assert_string_equal(g->xfer_id, "R1");
  assert_int_not_equal(g->handle, 0);
  assert_int_equal(g->handle, x->handle);
  /* The deadline travels (the full one, or what is left of it). */
  assert_in_range(g->deadline_ms, DEFAULT_DEADLINE - 100, DEFAULT_DEADLINE);
  assert_non_null(g->descs);
  assert_int_equal(g->descs->packed.len, 3 * 20);
  kvf__descs gd;
  assert_int_equal(kvf__descs_from_wire(&gd, g->descs, 100), 0);
  assert_int_equal(gd.n, 3);
  for (size_t i = 0; i < 3; i++) {
    assert_int_equal(gd.pool[i], 2);
    assert_int_equal(gd.offset[i], (1u << 20) + i * 8192);
    assert_int_equal(gd.length[i], 4096);
  }
  kvf__descs_free(&gd);
  uint64_t h = g->handle;

  /* SendDone or Cancel from another peer with our handle: ignored. */
  in_send_done(F.pc, h, 3 * 4096, 3);
  assert_int_equal(x->recv.state, KVF__RECV_OPEN); /* still waiting for SendDone */
  in_cancel(F.pc, h, "R1", 0, false);
  assert_int_equal(x->state, KVF__X_ACTIVE);
  assert_int_equal(F.nev, 0);
  /* SendDone first: still waiting for the data. */
  in_send_done(F.pb, h, 3 * 4096, 3);
  assert_int_equal(F.nev, 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_RECV_RESULT), 0);
  kvf__xfer_on_landed(x);
  expect_event("R1", RECV_DONE, SR, 0);
  const ev_rec *e = event_for("R1", RECV_DONE);
  assert_int_equal(e->bytes, 3 * 4096);
  assert_int_equal(e->descriptors, 3);
  assert_string_equal(e->path, "fake-net");
  assert_string_equal(e->peer, "B");
  Kvf__RecvResult *rr = last_msg(F.pb, KVF__PEER_MSG__BODY_RECV_RESULT)->recv_result;
  assert_int_equal(rr->handle, h);
  assert_int_equal(rr->status, 0);
  assert_int_equal(nclosed_of(x), 1);
  assert_int_equal(nmsgs(F.pc, -1), 0);
  assert_int_equal(F.nev, 1);
  assert_clean();
}

/* The other order: data landed, then SendDone. */
static void test_remote_landed_then_send_done(void **state) {
  assert_int_equal(do_grant(SR, "R2", "B", mkd(2, 0, 0, 100, 100), 777), 0);
  kvf__xfer *x = F.opened[0];
  Kvf__Grant *g = last_msg(F.pb, KVF__PEER_MSG__BODY_GRANT)->grant;
  assert_in_range(g->deadline_ms, 677, 777);
  kvf__xfer_on_landed(x);
  assert_int_equal(F.nev, 0);
  in_send_done(F.pb, g->handle, 200, 2);
  expect_event("R2", RECV_DONE, SR, 0);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_RECV_RESULT)->recv_result->status, 0);
  assert_int_equal(nclosed_of(x), 1);
  assert_clean();
}

/* on_delivered (rdma's WRITE_WITH_IMM) completes without SendDone. */
static void test_remote_delivered(void **state) {
  assert_int_equal(do_grant(SR, "R3", "B", mkd(1, 0, 0, 100, 100), 0), 0);
  kvf__xfer_on_delivered(F.opened[0]);
  expect_event("R3", RECV_DONE, SR, 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_RECV_RESULT), 1);
  assert_clean();
}

/* The receiver confirms before the sender's last completion is back (as
 * with rdma's one-sided writes): the send finishes on that completion,
 * without a SendDone. */
static void test_remote_confirmed_before_last_completion(void **state) {
  kvf__descs dst = mkd(2, 1, 0, 4096, 4096);
  in_grant(F.pb, "K1", 0x1001, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, "K1", "B", mkd(2, 0, 8192, 4096, 4096), false, 0), 0);
  assert_int_equal(F.npost, 1);
  kvf__xfer *x = F.post[0].x;
  assert_true(F.post[0].last);
  assert_int_equal(F.post[0].runs.n, 1);
  assert_int_equal(F.post[0].runs.v[0].src_off, 8192);
  assert_int_equal(F.post[0].runs.v[0].dst_pool, 1);
  assert_int_equal(F.post[0].runs.v[0].dst_off, 0);
  assert_int_equal(F.post[0].runs.v[0].len, 8192);
  assert_int_equal(x->send.state, KVF__SEND_FLUSH);
  in_recv_result(F.pb, 0x1001, 0);
  assert_int_equal(x->send.state, KVF__SEND_CONFIRMED);
  assert_int_equal(x->state, KVF__X_FLUSH); /* kvferryctl still says "flushing" */
  in_recv_result(F.pb, 0x1001, 0);          /* said twice: nothing more */
  assert_int_equal(F.nev, 0);
  complete_post(0, 0);
  expect_event("K1", SEND_DONE, SS, 0);
  assert_int_equal(event_for("K1", SEND_DONE)->bytes, 8192);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_SEND_DONE), 0);
  assert_int_equal(F.nmsg, 0);
  assert_clean();
}

/* A transport that opens a grant later (rdma binding memory windows): the
 * Grant goes once it is open; until then the grant's peer cannot use it. */
static void test_grant_opened_later(void **state) {
  F.one_sided = true;
  F.grant_open_rc = 1;
  assert_int_equal(do_grant(SR, "G1", "B", mkd(2, 1, 0, 4096, 4096), 0), 0);
  kvf__xfer *x = find_x("G1", KVF__RECV);
  assert_non_null(x);
  assert_int_equal(x->recv.state, KVF__RECV_OPENING);
  assert_int_equal(x->state, KVF__X_ACTIVE);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 0);
  /* Its peer's intent waits for it; a SendDone or data for it cannot be
   * (no sender knows its handle yet). */
  in_intent(F.pb, "G1", 0);
  in_send_done(F.pb, x->handle, 8192, 2);
  kvf__xfer_on_delivered(x);
  assert_int_equal(x->recv.state, KVF__RECV_OPENING);
  assert_int_equal(nmsgs(F.pb, -1), 0);
  assert_int_equal(F.nev, 0);
  kvf__xfer_on_grant_ready(x, 0, NULL);
  assert_int_equal(x->recv.state, KVF__RECV_OPEN);
  Kvf__Grant *g = last_msg(F.pb, KVF__PEER_MSG__BODY_GRANT)->grant;
  assert_int_equal(g->handle, x->handle);
  assert_int_equal(g->descs->packed.len, 2 * 20);
  in_intent(F.pb, "G1", 0); /* crossed: the Grant again */
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 2);
  kvf__xfer_on_landed(x);
  assert_int_equal(x->recv.state, KVF__RECV_LANDED);
  in_send_done(F.pb, x->handle, 8192, 2);
  expect_event("G1", RECV_DONE, SR, 0);
  assert_int_equal(event_for("G1", RECV_DONE)->bytes, 8192);
  assert_int_equal(nclosed_of(x), 1);

  /* Cancelled while opening: no Grant went out, so no fence. */
  assert_int_equal(do_grant(SR, "G2", "B", mkd(1, 1, 0, 64, 64), 0), 0);
  kvf__xfer *x2 = find_x("G2", KVF__RECV);
  assert_int_equal(kvf__xfer_cancel(SR, "G2"), 0);
  expect_event("G2", RECV_DONE, SR, KVF_ECANCELED);
  assert_int_equal(nclosed_of(x2), 1);
  assert_false(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel->ack);
  /* The transport could not open it. */
  assert_int_equal(do_grant(SR, "G3", "B", mkd(1, 1, 0, 64, 64), 0), 0);
  kvf__xfer *x3 = find_x("G3", KVF__RECV);
  kvf__xfer_on_grant_ready(x3, KVF_EPEERLOST, "binding the grant's memory windows failed");
  expect_event("G3", RECV_DONE, SR, KVF_EPEERLOST);
  assert_string_equal(event_for("G3", RECV_DONE)->error, "binding the grant's memory windows failed");
  assert_int_equal(nclosed_of(x3), 1);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 2);
  F.grant_open_rc = 0;
  assert_clean();
}

/* SendIntent before the grant: kept; the grant then binds and answers. */
static void test_intent_before_grant(void **state) {
  in_intent(F.pb, "R4", 0);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 1);
  assert_int_equal(c.active, 0);
  assert_int_equal(F.nmsg, 0);
  assert_int_equal(do_grant(SR, "R4", NULL, mkd(2, 0, 0, 100, 100), 0), 0);
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 0);
  assert_int_equal(F.nopened, 1);
  Kvf__Grant *g = last_msg(F.pb, KVF__PEER_MSG__BODY_GRANT)->grant;
  assert_string_equal(g->xfer_id, "R4");
  assert_int_equal(g->descs->packed.len, 2 * 20);
  in_send_done(F.pb, g->handle, 200, 2);
  kvf__xfer_on_landed(F.opened[0]);
  expect_event("R4", RECV_DONE, SR, 0);
  assert_string_equal(event_for("R4", RECV_DONE)->peer, "B");
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_RECV_RESULT)->recv_result->handle, g->handle);
  assert_clean();
}

/* The grant names B and B's intent is waiting: bound to B. */
static void test_intent_before_named_grant(void **state) {
  in_intent(F.pb, "R4b", 0);
  assert_int_equal(do_grant(SR, "R4b", "B", mkd(1, 0, 0, 100, 100), 0), 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 1);
  assert_int_equal(F.nmsg, 1);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 0);
  assert_int_equal(kvf__xfer_cancel(SR, "R4b"), 0);
  expect_event("R4b", RECV_DONE, SR, KVF_ECANCELED);
  assert_clean();
}

/* SendIntent after an open grant: bound at once. */
static void test_intent_after_grant(void **state) {
  assert_int_equal(do_grant(SR, "R5", NULL, mkd(2, 0, 0, 100, 100), 0), 0);
  assert_int_equal(F.nmsg, 0);
  assert_int_equal(F.nopened, 0);
  in_intent(F.pb, "R5", 0);
  assert_int_equal(F.nopened, 1);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 1);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 0);
  /* A second intent from another peer for the bound grant is only kept. */
  in_intent(F.pc, "R5", 0);
  assert_int_equal(nmsgs(F.pc, -1), 0);
  Kvf__Grant *g = last_msg(F.pb, KVF__PEER_MSG__BODY_GRANT)->grant;
  kvf__xfer_on_landed(F.opened[0]);
  in_send_done(F.pb, g->handle, 200, 2);
  expect_event("R5", RECV_DONE, SR, 0);
  /* C's stray intent is dropped when C goes. */
  kvf__xfer_on_peer_down(F.pc);
  assert_clean();
}

/* The pushed grant crossed the sender's intent: the grant is said again. */
static void test_intent_crosses_pushed_grant(void **state) {
  assert_int_equal(do_grant(SR, "R6", "B", mkd(1, 0, 0, 100, 100), 0), 0);
  in_intent(F.pb, "R6", 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 2);
  assert_int_equal(F.msg[0].m->grant->handle, F.msg[1].m->grant->handle);
  assert_int_equal(F.nopened, 1); /* opened once */
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 0);
  assert_int_equal(kvf__xfer_cancel(SR, "R6"), 0);
  expect_event("R6", RECV_DONE, SR, KVF_ECANCELED);
  assert_clean();
}

/* The pushed grant crossed the sender's intent, and the grant ended on
 * sealed data before the intent was read (tcp's data streams are not the
 * control link): the intent is kept until the SendDone that follows it on
 * the link names it (seen in chaos, 2026-11-26: one such intent waited
 * for its deadline). A SendDone naming it from another peer, or one
 * without the id, leaves it. */
static void test_intent_after_vouched_grant(void **state) {
  assert_int_equal(do_grant(SR, "R6v", "B", mkd(1, 0, 0, 100, 100), 0), 0);
  uint64_t h = last_msg(F.pb, KVF__PEER_MSG__BODY_GRANT)->grant->handle;
  kvf__xfer_on_vouched(F.opened[0]);
  expect_event("R6v", RECV_DONE, SR, 0);
  in_intent(F.pb, "R6v", 0);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 1);
  in_send_done_of(F.pc, h, 100, 1, "R6v");
  in_send_done(F.pb, h, 100, 1);
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 1);
  in_send_done_of(F.pb, h, 100, 1, "R6v");
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 0);
  assert_int_equal(F.nev, 1);
  assert_clean();
}

/* A grant naming B does not bind to C's intent. */
static void test_intent_from_other_node(void **state) {
  F.pb->state = KVF__PEER_DOWN;
  assert_int_equal(do_grant(SR, "R7", "B", mkd(1, 0, 0, 100, 100), 0), 0);
  in_intent(F.pc, "R7", 0);
  assert_int_equal(F.nmsg, 0);
  assert_int_equal(F.nopened, 0);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 1);
  /* B's intent does bind. */
  F.pb->state = KVF__PEER_UP;
  in_intent(F.pb, "R7", 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 1);
  assert_int_equal(nmsgs(F.pc, -1), 0);
  assert_int_equal(kvf__xfer_cancel(SR, "R7"), 0);
  expect_event("R7", RECV_DONE, SR, KVF_ECANCELED);
  /* C cancels its intent: dropped. */
  in_cancel(F.pc, 0, "R7", KVF_ECANCELED, false);
  assert_clean();
}

/* SendDone with a different byte count: ESIZE here, Cancel(ESIZE) there. */
static void test_recv_size_mismatch(void **state) {
  assert_int_equal(do_grant(SR, "R8", "B", mkd(2, 0, 0, 100, 100), 0), 0);
  kvf__xfer *x = F.opened[0];
  uint64_t h = last_msg(F.pb, KVF__PEER_MSG__BODY_GRANT)->grant->handle;
  kvf__xfer_on_landed(x);
  in_send_done(F.pb, h, 199, 2);
  expect_event("R8", RECV_DONE, SR, KVF_ESIZE);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->status, KVF_ESIZE);
  assert_int_equal(c->handle, h);
  assert_true(c->to_sender);
  assert_string_equal(c->xfer_id, "R8");
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_RECV_RESULT), 0);
  assert_int_equal(nclosed_of(x), 1);
  assert_int_equal(F.nev, 1);
  assert_clean();
}

/* ---- remote: sending side ---------------------------------------------- */

/* No grant yet: SendIntent; B's Grant binds and posts; SendDone after the
 * post; RecvResult(0) is SEND_DONE(0). */
static void test_remote_send_intent_then_grant(void **state) {
  assert_int_equal(do_send(SS, "S1", "B", mkd(3, 0, 0, 4096, 4096), false, 0), 0);
  assert_int_equal(F.nmsg, 1);
  Kvf__SendIntent *si = last_msg(F.pb, KVF__PEER_MSG__BODY_SEND_INTENT)->send_intent;
  assert_string_equal(si->xfer_id, "S1");
  assert_in_range(si->deadline_ms, DEFAULT_DEADLINE - 100, DEFAULT_DEADLINE);
  assert_int_equal(F.npost, 0);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.sends, 1);

  /* A grant from C for the same id is not ours to use. */
  kvf__descs dst = mkd(3, 7, 0, 8192, 4096);
  in_grant(F.pc, "S1", 0x99, &dst);
  assert_int_equal(F.npost, 0);
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 1); /* kept as C's pre-grant */

  in_grant(F.pb, "S1", 0x55, &dst);
  assert_int_equal(F.npost, 1);
  assert_ptr_equal(F.post[0].tp, &TN);
  assert_true(F.post[0].last);
  /* Source contiguous, destination strided: three runs. */
  assert_int_equal(F.post[0].runs.n, 3);
  for (size_t i = 0; i < 3; i++) {
    assert_int_equal(F.post[0].runs.v[i].src_off, i * 4096);
    assert_int_equal(F.post[0].runs.v[i].dst_pool, 7);
    assert_int_equal(F.post[0].runs.v[i].dst_off, i * 8192);
  }
  /* A repeat of the same grant changes nothing. */
  in_grant(F.pb, "S1", 0x55, &dst);
  assert_int_equal(F.npost, 1);
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 1);

  complete_post(0, 0);
  assert_int_equal(F.nev, 0);
  Kvf__SendDone *sd = last_msg(F.pb, KVF__PEER_MSG__BODY_SEND_DONE)->send_done;
  assert_int_equal(sd->handle, 0x55);
  assert_int_equal(sd->bytes, 3 * 4096);
  assert_int_equal(sd->descriptors, 3);
  assert_string_equal(sd->xfer_id, "S1"); /* we sent an intent: the receiver may hold it */

  /* A RecvResult from C with that handle is not B's. */
  in_recv_result(F.pc, 0x55, 0);
  assert_int_equal(F.nev, 0);
  in_recv_result(F.pb, 0x55, 0);
  expect_event("S1", SEND_DONE, SS, 0);
  const ev_rec *e = event_for("S1", SEND_DONE);
  assert_int_equal(e->bytes, 3 * 4096);
  assert_int_equal(e->descriptors, 3);
  assert_string_equal(e->path, "fake-net");
  assert_string_equal(e->peer, "B");
  assert_int_equal(F.nev, 1);
  kvf__descs_free(&dst);
  kvf__xfer_on_peer_down(F.pc); /* C's pre-grant goes with C */
  assert_clean();
}

/* A pre-grant is used by the send that comes later: no SendIntent. */
static void test_remote_pregrant_consumed(void **state) {
  kvf__descs dst = mkd(2, 3, 0, 4096, 4096);
  in_grant(F.pb, "S2", 0x66, &dst);
  kvf__descs_free(&dst);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 1);
  assert_int_equal(c.active, 0);
  assert_int_equal(do_send(SS, "S2", "B", mkd(2, 0, 0, 4096, 4096), false, 0), 0);
  assert_int_equal(nmsgs(NULL, KVF__PEER_MSG__BODY_SEND_INTENT), 0);
  assert_int_equal(F.npost, 1);
  assert_int_equal(F.post[0].runs.n, 1); /* both sides contiguous */
  assert_int_equal(F.post[0].runs.v[0].len, 8192);
  assert_int_equal(F.post[0].runs.v[0].dst_pool, 3);
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 0);
  complete_post(0, 0);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_SEND_DONE)->send_done->handle, 0x66);
  assert_string_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_SEND_DONE)->send_done->xfer_id, ""); /* no intent went */
  in_recv_result(F.pb, 0x66, 0);
  expect_event("S2", SEND_DONE, SS, 0);
  assert_int_equal(F.nmsg, 1); /* just the SendDone */
  assert_clean();
}

/* Parts with MORE against a grant of 6: pairing advances part by part. */
static void test_remote_parts(void **state) {
  uint32_t gp[] = {1, 1, 2, 1, 1, 2};
  uint64_t go[] = {0, 50000, 0, 90000, 99000, 7000};
  uint64_t gl[] = {100, 200, 300, 400, 500, 600};
  kvf__descs dst = from_arrays(gp, go, gl, 6);
  in_grant(F.pb, "S3", 0x77, &dst);
  kvf__descs_free(&dst);

  assert_int_equal(do_send(SS, "S3", "B", mkd_len(2, gl), true, 0), 0);
  assert_int_equal(F.npost, 1);
  assert_false(F.post[0].last);
  assert_int_equal(F.post[0].runs.n, 2);
  assert_int_equal(F.post[0].runs.v[1].dst_off, 50000);
  assert_true(kvf__xfer_sending(SS, "S3"));
  assert_int_equal(do_send(SS, "S3", "B", mkd_len(3, gl + 2), true, 0), 0);
  assert_int_equal(F.npost, 2);
  assert_false(F.post[1].last);
  assert_int_equal(F.post[1].runs.n, 3);
  assert_int_equal(F.post[1].runs.v[0].dst_pool, 2);
  assert_int_equal(F.post[1].runs.v[0].len, 300);
  assert_int_equal(F.post[1].runs.v[1].dst_off, 90000);
  assert_int_equal(F.post[1].runs.v[2].dst_off, 99000);
  complete_post(0, 0);
  complete_post(1, 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_SEND_DONE), 0); /* not the last yet */
  assert_int_equal(do_send(SS, "S3", "B", mkd_len(1, gl + 5), false, 0), 0);
  assert_int_equal(F.npost, 3);
  assert_true(F.post[2].last);
  assert_int_equal(F.post[2].runs.v[0].dst_off, 7000);
  assert_int_equal(F.post[2].runs.v[0].len, 600);
  /* Another session cannot add to it; a different destination neither. */
  assert_int_equal(do_send(SO, "S3", "B", mkd_len(1, gl), true, 0), KVF_EEXIST);
  complete_post(2, 0);
  Kvf__SendDone *sd = last_msg(F.pb, KVF__PEER_MSG__BODY_SEND_DONE)->send_done;
  assert_int_equal(sd->bytes, 2100);
  assert_int_equal(sd->descriptors, 6);
  in_recv_result(F.pb, 0x77, 0);
  expect_event("S3", SEND_DONE, SS, 0);
  assert_int_equal(event_for("S3", SEND_DONE)->descriptors, 6);
  assert_int_equal(event_for("S3", SEND_DONE)->bytes, 2100);
  assert_int_equal(nevents(SO), 0);
  assert_clean();
}

/* A later part to another node is refused with EINVAL. */
static void test_remote_part_other_node(void **state) {
  assert_int_equal(do_send(SS, "S4", "B", mkd(1, 0, 0, 64, 64), true, 0), 0);
  assert_int_equal(do_send(SS, "S4", "C", mkd(1, 0, 0, 64, 64), false, 0), KVF_EINVAL);
  assert_int_equal(do_send(SS, "S4", "A", mkd(1, 0, 0, 64, 64), false, 0), KVF_EINVAL);
  assert_int_equal(F.nev, 0);
  assert_int_equal(kvf__xfer_cancel(SS, "S4"), 0);
  expect_event("S4", SEND_DONE, SS, KVF_ECANCELED);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->handle, 0); /* no grant yet: named by id */
  assert_string_equal(c->xfer_id, "S4");
  assert_false(c->to_sender);
  assert_int_equal(c->status, KVF_EREMOTECANCEL);
  assert_clean();
}

static void test_remote_size_mismatch(void **state) {
  kvf__descs dst = mkd(2, 1, 0, 4096, 4096);
  /* Length differs. */
  in_grant(F.pb, "E1", 0x101, &dst);
  uint64_t bad[] = {4096, 4000};
  assert_int_equal(do_send(SS, "E1", "B", mkd_len(2, bad), false, 0), 0);
  assert_int_equal(F.npost, 0);
  expect_event("E1", SEND_DONE, SS, KVF_ESIZE);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->status, KVF_ESIZE);
  assert_int_equal(c->handle, 0x101);
  assert_false(c->to_sender);
  /* Fewer descriptors in the last part. */
  in_grant(F.pb, "E2", 0x102, &dst);
  assert_int_equal(do_send(SS, "E2", "B", mkd(1, 0, 0, 4096, 4096), false, 0), 0);
  expect_event("E2", SEND_DONE, SS, KVF_ESIZE);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel->handle, 0x102);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel->status, KVF_ESIZE);
  /* More descriptors. */
  in_grant(F.pb, "E3", 0x103, &dst);
  assert_int_equal(do_send(SS, "E3", "B", mkd(3, 0, 0, 4096, 4096), false, 0), 0);
  expect_event("E3", SEND_DONE, SS, KVF_ESIZE);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel->status, KVF_ESIZE);
  /* Grant arriving after the send (the send waited in early). */
  assert_int_equal(do_send(SS, "E4", "B", mkd_len(2, bad), false, 0), 0);
  in_grant(F.pb, "E4", 0x104, &dst);
  expect_event("E4", SEND_DONE, SS, KVF_ESIZE);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel->handle, 0x104);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 4);
  assert_int_equal(F.npost, 0);
  assert_int_equal(F.nev, 4);
  kvf__descs_free(&dst);
  assert_clean();
}

/* A mismatch in a later part: earlier parts are out, so the failure waits
 * for them (DRAIN), then one event. */
static void test_remote_mismatch_in_later_part(void **state) {
  kvf__descs dst = mkd(2, 1, 0, 4096, 4096);
  in_grant(F.pb, "E5", 0x105, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, "E5", "B", mkd(1, 0, 0, 4096, 4096), true, 0), 0);
  assert_int_equal(F.npost, 1);
  kvf__xfer *x = F.post[0].x;
  assert_int_equal(do_send(SS, "E5", "B", mkd(2, 0, 0, 4096, 4096), false, 0), 0);
  assert_int_equal(F.npost, 1);
  assert_int_equal(F.nev, 0); /* part 1 is still with the transport */
  assert_int_equal(x->state, KVF__X_DRAIN);
  assert_int_equal(naborted_of(x), 1);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 0); /* not while part 1 writes */
  /* Further parts are refused while it drains. */
  assert_int_equal(do_send(SS, "E5", "B", mkd(1, 0, 0, 4096, 4096), false, 0), KVF_EEXIST);
  complete_post(0, 0);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel->status, KVF_ESIZE);
  expect_event("E5", SEND_DONE, SS, KVF_ESIZE);
  assert_int_equal(F.nev, 1);
  assert_clean();
}

/* The transport refuses a post. */
static void test_remote_post_refused(void **state) {
  kvf__descs dst = mkd(1, 1, 0, 4096, 4096);
  in_grant(F.pb, "E6", 0x106, &dst);
  kvf__descs_free(&dst);
  F.post_rc = -ENOMEM;
  assert_int_equal(do_send(SS, "E6", "B", mkd(1, 0, 0, 4096, 4096), false, 0), 0);
  F.post_rc = 0;
  expect_event("E6", SEND_DONE, SS, -ENOMEM);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel->status, -ENOMEM);
  assert_clean();
}

/* The transport fails a part: the failure waits for the other outstanding
 * part, one event, Cancel to the peer. */
static void test_remote_post_fails(void **state) {
  kvf__descs dst = mkd(3, 1, 0, 4096, 4096);
  in_grant(F.pb, "E7", 0x107, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, "E7", "B", mkd(1, 0, 0, 4096, 4096), true, 0), 0);
  assert_int_equal(do_send(SS, "E7", "B", mkd(2, 0, 4096, 4096, 4096), false, 0), 0);
  assert_int_equal(F.npost, 2);
  complete_post(0, -EIO);
  assert_int_equal(F.nev, 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 0); /* part 2 still writes */
  complete_post(1, 0);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->status, -EIO);
  assert_int_equal(c->handle, 0x107);
  expect_event("E7", SEND_DONE, SS, -EIO);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_SEND_DONE), 0);
  assert_int_equal(F.nev, 1);
  assert_clean();
}

/* RecvResult with a failure. */
static void test_remote_recv_result_failure(void **state) {
  kvf__descs dst = mkd(1, 1, 0, 4096, 4096);
  in_grant(F.pb, "E8", 0x108, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, "E8", "B", mkd(1, 0, 0, 4096, 4096), false, 0), 0);
  complete_post(0, 0);
  in_recv_result(F.pb, 0x108, KVF_ERANGE);
  expect_event("E8", SEND_DONE, SS, KVF_ERANGE);
  assert_string_equal(event_for("E8", SEND_DONE)->error, "remote failure");
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 0); /* they know */
  assert_clean();
}

/* ---- cancel --------------------------------------------------------------- */

static void test_cancel_by_receiver(void **state) {
  assert_int_equal(do_grant(SR, "C1", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  kvf__xfer *x = F.opened[0];
  uint64_t h = x->handle;
  /* Another session cannot cancel it. */
  assert_int_equal(kvf__xfer_cancel(SO, "C1"), KVF_ENOENT);
  assert_int_equal(kvf__xfer_cancel(SR, "C1"), 0);
  expect_event("C1", RECV_DONE, SR, KVF_ECANCELED);
  assert_int_equal(nclosed_of(x), 1);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->status, KVF_EREMOTECANCEL);
  assert_true(c->to_sender);
  assert_int_equal(c->handle, h);
  assert_string_equal(c->xfer_id, "C1");
  assert_int_equal(kvf__xfer_cancel(SR, "C1"), KVF_ENOENT); /* gone */
  /* A waiting grant with no peer: nobody to tell. */
  assert_int_equal(do_grant(SR, "C2", NULL, mkd(1, 0, 0, 64, 64), 0), 0);
  assert_int_equal(kvf__xfer_cancel(SR, "C2"), 0);
  expect_event("C2", RECV_DONE, SR, KVF_ECANCELED);
  assert_int_equal(nmsgs(NULL, KVF__PEER_MSG__BODY_CANCEL), 1);
  assert_int_equal(F.nev, 2);
  assert_clean();
}

static void test_cancel_by_sender(void **state) {
  kvf__descs dst = mkd(2, 1, 0, 4096, 4096);
  in_grant(F.pb, "C3", 0x301, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, "C3", "B", mkd(1, 0, 0, 4096, 4096), true, 0), 0);
  complete_post(0, 0);
  assert_int_equal(kvf__xfer_cancel(SS, "C3"), 0);
  expect_event("C3", SEND_DONE, SS, KVF_ECANCELED);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->status, KVF_EREMOTECANCEL);
  assert_false(c->to_sender);
  assert_int_equal(c->handle, 0x301);
  assert_clean();
}

/* A sender that fails with writes out tells the receiver only once they
 * are back: the receiver closes the grant on that word (rdma invalidates
 * its memory windows), which a write in flight must not meet. */
static void test_cancel_by_sender_waits_for_writes(void **state) {
  kvf__descs dst = mkd(2, 1, 0, 4096, 4096);
  in_grant(F.pb, "C7", 0x307, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, "C7", "B", mkd(1, 0, 0, 4096, 4096), true, 0), 0);
  assert_int_equal(F.npost, 1);
  assert_int_equal(kvf__xfer_cancel(SS, "C7"), 0);
  assert_int_equal(naborted_of(F.post[0].x), 1);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 0);
  assert_int_equal(F.nev, 0);
  complete_post(0, KVF_ECANCELED);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->handle, 0x307);
  assert_int_equal(c->status, KVF_EREMOTECANCEL);
  assert_false(c->to_sender);
  expect_event("C7", SEND_DONE, SS, KVF_ECANCELED);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 1);
  assert_clean();
}

/* One-sided transport (rdma): a receiver whose client cancels keeps the
 * grant open (its memory windows valid) until the sender says its writes
 * are back, so that the cancel does not fail the sender's QP; only then
 * does the memory go back to the client. */
static void test_cancel_by_receiver_fenced(void **state) {
  F.one_sided = true;
  assert_int_equal(do_grant(SR, "F1", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  kvf__xfer *x = F.opened[0];
  uint64_t h = x->handle;
  assert_int_equal(kvf__xfer_cancel(SR, "F1"), 0);
  assert_int_equal(F.nev, 0);
  assert_int_equal(nclosed_of(x), 0);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_true(c->to_sender);
  assert_true(c->ack);
  assert_int_equal(c->handle, h);
  assert_int_equal(kvf__xfer_cancel(SR, "F1"), KVF_ENOENT); /* already failing */
  in_cancel_done(F.pc, h);                                   /* another peer's word: ignored */
  in_cancel_done(F.pb, h + 1);                               /* another grant's: ignored */
  assert_int_equal(F.nev, 0);
  in_cancel_done(F.pb, h);
  expect_event("F1", RECV_DONE, SR, KVF_ECANCELED);
  assert_int_equal(nclosed_of(x), 1);
  /* The peer goes down instead: its connections with it, so at once. */
  assert_int_equal(do_grant(SR, "F2", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  kvf__xfer *x2 = F.opened[1];
  assert_int_equal(kvf__xfer_cancel(SR, "F2"), 0);
  assert_int_equal(nclosed_of(x2), 0);
  kvf__xfer_on_peer_down(F.pb);
  expect_event("F2", RECV_DONE, SR, KVF_ECANCELED);
  assert_int_equal(nclosed_of(x2), 1);
  /* A waiting grant (no sender bound) has nothing to wait for. */
  assert_int_equal(do_grant(SR, "F3", NULL, mkd(1, 0, 0, 64, 64), 0), 0);
  assert_int_equal(kvf__xfer_cancel(SR, "F3"), 0);
  expect_event("F3", RECV_DONE, SR, KVF_ECANCELED);
  assert_int_equal(F.nev, 3);
  assert_clean();
}

/* The sender never answers: the grant closes FENCE_MS (2 s) later. */
static void test_cancel_by_receiver_fence_times_out(void **state) {
  F.one_sided = true;
  assert_int_equal(do_grant(SR, "F4", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  kvf__xfer *x = F.opened[0];
  uint64_t t0 = uv_hrtime();
  assert_int_equal(kvf__xfer_cancel(SR, "F4"), 0);
  run_until_nev(1, 10000);
  expect_event("F4", RECV_DONE, SR, KVF_ECANCELED);
  assert_int_equal(nclosed_of(x), 1);
  assert_true(uv_hrtime() - t0 >= 1900ull * 1000000ull);
  assert_clean();
}

/* The sender's side: a Cancel with ack is answered once none of its writes
 * into the grant is in flight - at once when none is. */
static void test_cancel_ack_by_sender(void **state) {
  F.one_sided = true;
  kvf__descs dst = mkd(2, 1, 0, 4096, 4096);
  in_grant(F.pb, "F5", 0x505, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, "F5", "B", mkd(1, 0, 0, 4096, 4096), true, 0), 0);
  assert_int_equal(F.npost, 1);
  in_cancel_ack(F.pb, 0x505, "F5");
  assert_int_equal(naborted_of(F.post[0].x), 1);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL_DONE), 0);
  complete_post(0, KVF_ECANCELED);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL_DONE)->cancel_done->handle, 0x505);
  expect_event("F5", SEND_DONE, SS, KVF_EREMOTECANCEL);
  /* Nothing of ours for that grant (done, or never sent): answered at once. */
  in_cancel_ack(F.pb, 0x777, "F6");
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL_DONE)->cancel_done->handle, 0x777);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL_DONE), 2);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 0); /* the receiver knows */
  assert_clean();
}

/* Local: the receiver cancels while the copy is out; both wait for it. */
static void test_cancel_local_while_copying(void **state) {
  assert_int_equal(do_grant(SR, "C4", NULL, mkd(1, 1, 0, 64, 64), 0), 0);
  assert_int_equal(do_send(SS, "C4", "A", mkd(1, 0, 0, 64, 64), false, 0), 0);
  assert_int_equal(F.npost, 1);
  kvf__xfer *sx = F.post[0].x;
  assert_int_equal(kvf__xfer_cancel(SR, "C4"), 0);
  assert_int_equal(F.nev, 0); /* the copy still writes into the grant */
  assert_int_equal(naborted_of(sx), 1);
  assert_int_equal(kvf__xfer_cancel(SR, "C4"), KVF_ENOENT); /* already failing */
  complete_post(0, 0);
  expect_event("C4", RECV_DONE, SR, KVF_ECANCELED);
  expect_event("C4", SEND_DONE, SS, KVF_EREMOTECANCEL);
  assert_int_equal(F.nev, 2);
  assert_int_equal(F.nmsg, 0);
  assert_clean();
}

/* Local: cancelled between parts (no copy out): both events at once. */
static void test_cancel_local_between_parts(void **state) {
  assert_int_equal(do_grant(SR, "C5", NULL, mkd(2, 1, 0, 64, 64), 0), 0);
  assert_int_equal(do_send(SS, "C5", "A", mkd(1, 0, 0, 64, 64), true, 0), 0);
  complete_post(0, 0);
  assert_int_equal(F.nev, 0);
  assert_int_equal(kvf__xfer_cancel(SS, "C5"), 0);
  expect_event("C5", SEND_DONE, SS, KVF_ECANCELED);
  expect_event("C5", RECV_DONE, SR, KVF_EREMOTECANCEL);
  assert_int_equal(F.nev, 2);
  /* And the receiver's way round. */
  assert_int_equal(do_grant(SR, "C6", NULL, mkd(2, 1, 0, 64, 64), 0), 0);
  assert_int_equal(do_send(SS, "C6", "A", mkd(1, 0, 0, 64, 64), true, 0), 0);
  complete_post(1, 0);
  assert_int_equal(kvf__xfer_cancel(SR, "C6"), 0);
  expect_event("C6", RECV_DONE, SR, KVF_ECANCELED);
  expect_event("C6", SEND_DONE, SS, KVF_EREMOTECANCEL);
  assert_int_equal(F.nev, 4);
  assert_int_equal(F.nmsg, 0);
  assert_clean();
}

/* Incoming Cancel messages, each direction. */
static void test_incoming_cancel(void **state) {
  /* To a bound sender, by handle. */
  kvf__descs dst = mkd(1, 1, 0, 4096, 4096);
  in_grant(F.pb, "I1", 0x401, &dst);
  assert_int_equal(do_send(SS, "I1", "B", mkd(1, 0, 0, 4096, 4096), false, 0), 0);
  complete_post(0, 0);
  in_cancel(F.pc, 0x401, "I1", 0, true); /* wrong peer: ignored */
  assert_int_equal(F.nev, 0);
  in_cancel(F.pb, 0x401, "I1", 0, true);
  expect_event("I1", SEND_DONE, SS, KVF_EREMOTECANCEL);
  /* To a sender still waiting for its grant, by id; the status is kept. */
  assert_int_equal(do_send(SS, "I2", "B", mkd(1, 0, 0, 4096, 4096), false, 0), 0);
  in_cancel(F.pb, 0, "I2", KVF_EDEADLINE, true);
  expect_event("I2", SEND_DONE, SS, KVF_EDEADLINE);
  /* To a bound receiver, by handle. */
  assert_int_equal(do_grant(SR, "I3", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  kvf__xfer *rx = F.opened[0];
  uint64_t h = rx->handle;
  in_cancel(F.pb, h, "I3", 0, false);
  expect_event("I3", RECV_DONE, SR, KVF_EREMOTECANCEL);
  assert_int_equal(nclosed_of(rx), 1);
  /* To a receiver whose pushed grant the sender had not seen (it has no
   * handle), by id: only from the peer the grant is bound to. */
  assert_int_equal(do_grant(SR, "I6", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  kvf__xfer *r6 = find_x("I6", KVF__RECV);
  uint64_t h6 = r6->handle;
  in_cancel(F.pc, 0, "I6", 0, false);
  assert_int_equal(F.nev, 3);
  in_cancel(F.pb, 0, "I6", KVF_EREMOTECANCEL, false);
  expect_event("I6", RECV_DONE, SR, KVF_EREMOTECANCEL);
  assert_int_equal(nclosed_of(r6), 1);
  /* ...and the pushed grant, which reaches the sender after its send is
   * gone, is revoked there: a later send of I6 must not take it. */
  Kvf__Cancel *back = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_true(back->to_sender);
  assert_false(back->ack);
  assert_int_equal(back->handle, h6);
  assert_string_equal(back->xfer_id, "I6");
  /* To a pre-grant not yet used: dropped. */
  in_grant(F.pb, "I4", 0x404, &dst);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 1);
  in_cancel(F.pb, 0x404, "I4", 0, true);
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 0);
  /* To an intent not yet granted: dropped. */
  in_intent(F.pb, "I5", 0);
  in_cancel(F.pb, 0, "I5", 0, false);
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.intents, 0);
  /* No other Cancel is sent back for a Cancel. */
  assert_int_equal(nmsgs(NULL, KVF__PEER_MSG__BODY_CANCEL), 1);
  assert_int_equal(F.nev, 4);
  kvf__descs_free(&dst);
  assert_clean();
}

/* A send withdrawn before the receiver's pushed grant reached it: the
 * grant arrives after the send is gone and waits as a pre-grant; the
 * receiver's Cancel for it (sent when our Cancel by id crossed it) drops
 * it, so a later send of the same id waits for a fresh grant instead of
 * writing through the dead one's windows; and a Cancel naming that old
 * grant does not fail the later send. */
static void test_crossed_pushed_grant_dropped(void **state) {
  kvf__descs dst = mkd(1, 1, 0, 4096, 4096);
  assert_int_equal(do_send(SS, "X1", "B", mkd(1, 0, 0, 4096, 4096), false, 0), 0);
  assert_int_equal(kvf__xfer_cancel(SS, "X1"), 0);
  expect_event("X1", SEND_DONE, SS, KVF_ECANCELED);
  in_grant(F.pb, "X1", 0x901, &dst);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 1);
  in_cancel(F.pb, 0x901, "X1", KVF_EREMOTECANCEL, true);
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 0);
  assert_int_equal(do_send(SS, "X1", "B", mkd(1, 0, 0, 4096, 4096), false, 0), 0);
  assert_int_equal(F.npost, 0); /* waits for a grant */
  in_cancel(F.pb, 0x901, "X1", KVF_EREMOTECANCEL, true);
  assert_int_equal(F.nev, 1);
  assert_int_equal(kvf__xfer_cancel(SS, "X1"), 0); /* the later send was still alive */
  assert_int_equal(F.nev, 2);
  assert_string_equal(F.ev[1].id, "X1");
  assert_int_equal(F.ev[1].status, KVF_ECANCELED);
  kvf__descs_free(&dst);
  assert_clean();
}

/* A peer may leave at most max-peer-waiting intents and pushed grants
 * here; past that, the next is refused to it (KVF_ELIMIT on its send or
 * grant) and nothing else changes. Every way out of the tables counts. */
static void test_peer_waiting_limit(void **state) {
  uint32_t saved = kvfd.cfg.max_peer_waiting;
  kvfd.cfg.max_peer_waiting = 2;
  kvf__descs dst = mkd(1, 1, 0, 4096, 4096);
  in_grant(F.pb, "W1", 0x501, &dst);
  in_grant(F.pb, "W2", 0x502, &dst);
  assert_int_equal(F.pb->waiting, 2);
  in_grant(F.pb, "W3", 0x503, &dst); /* one too many */
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->handle, 0x503);
  assert_int_equal(c->status, KVF_ELIMIT);
  assert_false(c->to_sender);
  in_intent(F.pb, "W4", 0); /* an intent counts the same */
  c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_string_equal(c->xfer_id, "W4");
  assert_int_equal(c->status, KVF_ELIMIT);
  assert_true(c->to_sender);
  kvf__xfer_counts cnt;
  kvf__xfer_counts_get(&cnt);
  assert_int_equal(cnt.pregrants, 2);
  assert_int_equal(cnt.intents, 0);
  /* The grant said again replaces itself; another peer is not held back. */
  in_grant(F.pb, "W1", 0x501, &dst);
  assert_int_equal(F.pb->waiting, 2);
  in_intent(F.pc, "W5", 0);
  assert_int_equal(F.pc->waiting, 1);
  /* A send takes its pregrant: room again. */
  assert_int_equal(do_send(SS, "W1", "B", mkd(1, 0, 0, 4096, 4096), false, 0), 0);
  assert_int_equal(F.pb->waiting, 1);
  in_intent(F.pb, "W6", 0);
  assert_int_equal(F.pb->waiting, 2);
  /* A Cancel, the grant that meets an intent, and the peer going all let go. */
  in_cancel(F.pb, 0, "W6", 0, false);
  assert_int_equal(F.pb->waiting, 1);
  assert_int_equal(do_grant(SR, "W5", "C", mkd(1, 0, 0, 64, 64), 0), 0);
  assert_int_equal(F.pc->waiting, 0);
  kvf__xfer_on_peer_down(F.pb);
  assert_int_equal(F.pb->waiting, 0);
  /* Tidy the transfers this made. */
  complete_post(0, 0);
  in_recv_result(F.pb, 0x501, 0);
  assert_int_equal(kvf__xfer_cancel(SR, "W5"), 0);
  kvf__xfer_on_peer_down(F.pc);
  kvfd.cfg.max_peer_waiting = saved;
  kvf__descs_free(&dst);
  flush();
  F.nev = 0;
  assert_clean();
}

/* ---- deadlines ------------------------------------------------------------ */

static void test_deadline_grant(void **state) {
  assert_int_equal(do_grant(SR, "D1", "B", mkd(1, 0, 0, 64, 64), 30), 0);
  kvf__xfer *x = F.opened[0];
  uint64_t h = x->handle;
  assert_in_range(last_msg(F.pb, KVF__PEER_MSG__BODY_GRANT)->grant->deadline_ms, 1, 30);
  assert_int_equal(F.nev, 0);
  run_until_nev(1, 3000);
  expect_event("D1", RECV_DONE, SR, KVF_EDEADLINE);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->status, KVF_EDEADLINE);
  assert_int_equal(c->handle, h);
  assert_true(c->to_sender);
  assert_int_equal(nclosed_of(x), 1);
  assert_clean();
}

static void test_deadline_send(void **state) {
  /* Waiting for a grant. */
  assert_int_equal(do_send(SS, "D2", "B", mkd(1, 0, 0, 64, 64), false, 20), 0);
  assert_in_range(last_msg(F.pb, KVF__PEER_MSG__BODY_SEND_INTENT)->send_intent->deadline_ms, 1, 20);
  run_until_nev(1, 3000);
  expect_event("D2", SEND_DONE, SS, KVF_EDEADLINE);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->status, KVF_EDEADLINE);
  assert_false(c->to_sender);
  assert_string_equal(c->xfer_id, "D2");
  /* With a part out: the deadline aborts, the event waits for the post. */
  kvf__descs dst = mkd(1, 1, 0, 64, 64);
  in_grant(F.pb, "D3", 0x501, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, "D3", "B", mkd(1, 0, 0, 64, 64), false, 20), 0);
  assert_int_equal(F.npost, 1);
  kvf__xfer *x = F.post[0].x;
  run_for(100);
  assert_int_equal(naborted_of(x), 1);
  assert_int_equal(nevents_for("D3"), 0);
  complete_post(0, KVF_ECANCELED);
  expect_event("D3", SEND_DONE, SS, KVF_EDEADLINE);
  assert_int_equal(F.nev, 2);
  assert_clean();
}

/* A local grant nobody sends to; the default deadline when 0 is given. */
static void test_deadline_local(void **state) {
  kvfd.cfg.default_deadline_ms = 25;
  assert_int_equal(do_grant(SR, "D4", NULL, mkd(1, 0, 0, 64, 64), 0), 0);
  kvfd.cfg.default_deadline_ms = DEFAULT_DEADLINE;
  assert_int_equal(do_grant(SR, "D5", NULL, mkd(1, 0, 4096, 64, 64), 0), 0);
  run_until_nev(1, 3000);
  expect_event("D4", RECV_DONE, SR, KVF_EDEADLINE);
  assert_int_equal(nevents_for("D5"), 0);
  assert_int_equal(F.nmsg, 0);
  assert_int_equal(kvf__xfer_cancel(SR, "D5"), 0);
  expect_event("D5", RECV_DONE, SR, KVF_ECANCELED);
  assert_clean();
}

/* Pre-grants and intents nobody claims expire in the periodic sweep. */
static void test_sweep_expires_tables(void **state) {
  kvf__descs dst = mkd(1, 1, 0, 64, 64);
  Kvf__Grant g = KVF__GRANT__INIT;
  Kvf__DescList dl;
  assert_int_equal(kvf__descs_to_wire(&dst, &dl), 0);
  g.xfer_id = "W1";
  g.handle = 0x601;
  g.descs = &dl;
  g.deadline_ms = 10;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_GRANT;
  m.grant = &g;
  kvf__xfer_on_peer_msg(F.pb, &m);
  kvf__descs_wire_free(&dl);
  kvf__descs_free(&dst);
  in_intent(F.pb, "W2", 10);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 1);
  assert_int_equal(c.intents, 1);
  run_for(1300); /* the sweep runs every second */
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 0);
  assert_int_equal(c.intents, 0);
  assert_int_equal(F.nev, 0);
  assert_clean();
}

/* ---- lost peers and clients ----------------------------------------------- */

static void test_peer_down(void **state) {
  kvf__descs dst = mkd(1, 1, 0, 64, 64);
  /* B: pushed grant, waiting send, bound send with a post out, a pre-grant
   * and an intent. */
  assert_int_equal(do_grant(SR, "P1", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  assert_int_equal(do_send(SS, "P2", "B", mkd(1, 0, 0, 64, 64), false, 0), 0);
  in_grant(F.pb, "P3", 0x701, &dst);
  assert_int_equal(do_send(SS, "P3", "B", mkd(1, 0, 0, 64, 64), false, 0), 0);
  assert_int_equal(F.npost, 1);
  in_grant(F.pb, "P4", 0x702, &dst);
  in_intent(F.pb, "P5", 0);
  /* C: the same kinds. */
  assert_int_equal(do_grant(SR, "Q1", "C", mkd(1, 0, 4096, 64, 64), 0), 0);
  assert_int_equal(do_send(SS, "Q2", "C", mkd(1, 0, 0, 64, 64), false, 0), 0);
  in_grant(F.pc, "Q4", 0x703, &dst);
  in_intent(F.pc, "Q5", 0);
  /* Local. */
  assert_int_equal(do_grant(SO, "L9", NULL, mkd(1, 0, 8192, 64, 64), 0), 0);
  kvf__descs_free(&dst);
  size_t msgs_before = F.nmsg;

  kvf__xfer *p1 = F.opened[0];
  F.pb->state = KVF__PEER_DOWN;
  kvf__xfer_on_peer_down(F.pb);
  expect_event("P1", RECV_DONE, SR, KVF_EPEERLOST);
  assert_int_equal(nclosed_of(p1), 1); /* the grant is revoked */
  assert_int_equal(nevents_for("P2"), 0); /* no grant yet: it waits for B */
  assert_int_equal(nevents_for("P3"), 0); /* its post is still out */
  assert_int_equal(naborted_of(F.post[0].x), 1);
  assert_int_equal(F.nev, 1);
  assert_int_equal(F.nmsg, msgs_before); /* nobody to tell */
  assert_int_equal(F.pb->queued, 1);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.pregrants, 1); /* C's */
  assert_int_equal(c.intents, 1);   /* C's */
  assert_int_equal(c.grants, 2);    /* Q1, L9 */
  assert_int_equal(c.sends, 3);     /* Q2, P2 waiting, P3 draining */
  complete_post(0, KVF_ECANCELED);
  expect_event("P3", SEND_DONE, SS, KVF_EPEERLOST);
  assert_int_equal(F.nev, 2);
  assert_int_equal(nevents_for("Q1") + nevents_for("Q2") + nevents_for("L9"), 0);

  /* While B is down: a new send waits for it too (no refusal, nothing
   * sent); a grant naming it waits (it is not pushed). */
  assert_int_equal(do_send(SS, "P6", "B", mkd(1, 0, 0, 64, 64), false, 0), 0);
  assert_int_equal(F.pb->queued, 2);
  assert_int_equal(do_grant(SR, "P7", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  assert_int_equal(F.nmsg, msgs_before);

  /* B is back: the two sends say their intents again, the grant is pushed. */
  F.pb->state = KVF__PEER_UP;
  kvf__xfer_on_peer_up(F.pb);
  assert_int_equal(F.pb->queued, 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_SEND_INTENT), 3); /* P2 before, P2 and P6 now */
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 2);       /* P1 before, P7 now */
  assert_int_equal(kvf__xfer_cancel(SS, "P2"), 0);
  assert_int_equal(kvf__xfer_cancel(SS, "P6"), 0);
  assert_int_equal(kvf__xfer_cancel(SR, "P7"), 0);
  expect_event("P2", SEND_DONE, SS, KVF_ECANCELED);
  expect_event("P6", SEND_DONE, SS, KVF_ECANCELED);
  expect_event("P7", RECV_DONE, SR, KVF_ECANCELED);

  /* Then C goes: its grant fails, its send waits; the local one stays.
   * C is removed from the configuration: the send fails at once. */
  F.pc->state = KVF__PEER_DOWN;
  kvf__xfer_on_peer_down(F.pc);
  expect_event("Q1", RECV_DONE, SR, KVF_EPEERLOST);
  assert_int_equal(nevents_for("Q2"), 0);
  F.pc->removed = true;
  kvf__xfer_on_peer_removed(F.pc);
  F.pc->removed = false;
  expect_event("Q2", SEND_DONE, SS, KVF_EPEERLOST);
  assert_true(strstr(event_for("Q2", SEND_DONE)->error, "removed") != NULL);
  assert_int_equal(F.pc->queued, 0);
  F.pc->state = KVF__PEER_UP;
  assert_int_equal(nevents_for("L9"), 0);
  assert_int_equal(kvf__xfer_cancel(SO, "L9"), 0);
  expect_event("L9", RECV_DONE, SO, KVF_ECANCELED);
  assert_int_equal(F.nev, 8);
  assert_clean();
}

/* Outcomes across a dropped link (issue 15, item 7). */
static void in_outcome_query(kvf__peer *p, uint64_t handle, uint64_t bytes) {
  Kvf__OutcomeQuery q = KVF__OUTCOME_QUERY__INIT;
  q.handle = handle;
  q.xfer_id = "";
  q.bytes = bytes;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_OUTCOME_QUERY;
  m.outcome_query = &q;
  kvf__xfer_on_peer_msg(p, &m);
}

static void in_outcome_reply(kvf__peer *p, uint64_t handle, Kvf__OutcomeReply__Outcome what, int status) {
  Kvf__OutcomeReply r = KVF__OUTCOME_REPLY__INIT;
  r.handle = handle;
  r.outcome = what;
  r.status = status;
  r.error = status ? "the receiver failed it" : "";
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_OUTCOME_REPLY;
  m.outcome_reply = &r;
  kvf__xfer_on_peer_msg(p, &m);
}

/* A send of id to B that met B's grant handle and posted its one part
 * (its posts are out: FLUSH, or still coming with more). */
static void send_granted(const char *id, uint64_t handle, bool more, uint32_t deadline_ms) {
  kvf__descs dst = mkd(1, 1, 0, 64, 64);
  in_grant(F.pb, id, handle, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, id, "B", mkd(1, 0, 0, 64, 64), more, deadline_ms), 0);
}

/* A send of id to B with every byte posted and SendDone said: it waits for
 * B's RecvResult (RESULT). */
static kvf__xfer *send_to_result(const char *id, uint64_t handle, uint32_t deadline_ms) {
  send_granted(id, handle, false, deadline_ms);
  kvf__xfer *x = F.post[F.npost - 1].x;
  complete_post(F.npost - 1, 0);
  assert_int_equal(x->send.state, KVF__SEND_RESULT);
  return x;
}

static void link_drops(void) {
  F.pb->state = KVF__PEER_DOWN;
  kvf__xfer_on_peer_down(F.pb);
}

/* The link is back, to the incarnation session of B. */
static void link_returns(uint64_t session) {
  F.pb->remote_session = session;
  F.pb->state = KVF__PEER_UP;
  kvf__xfer_on_peer_up(F.pb);
}

static void link_drops_and_returns(uint64_t session) {
  link_drops();
  link_returns(session);
}

static void test_outcome_sender(void **state) {
  F.pb->remote_session = 71;
  /* The same incarnation is back: the send asks, and reports the answer. */
  send_to_result("O1", 0x901, 0);
  send_to_result("O2", 0x902, 0);
  send_to_result("O3", 0x903, 0);
  send_to_result("O4", 0x904, 0);
  link_drops();
  assert_int_equal(F.nev, 0);
  assert_int_equal(F.pb->queued, 4);
  link_returns(71);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_OUTCOME_QUERY), 4);
  Kvf__OutcomeQuery *q = last_msg(F.pb, KVF__PEER_MSG__BODY_OUTCOME_QUERY)->outcome_query;
  assert_int_equal(q->handle, 0x901);
  assert_int_equal(q->bytes, 64);
  in_outcome_reply(F.pb, 0x901, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN, 0);
  expect_event("O1", SEND_DONE, SS, 0);
  in_outcome_reply(F.pb, 0x902, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN, KVF_EPEERLOST);
  expect_event("O2", SEND_DONE, SS, KVF_EPEERLOST);
  in_outcome_reply(F.pb, 0x903, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_UNKNOWN, 0);
  expect_event("O3", SEND_DONE, SS, KVF_EUNKNOWN);
  in_outcome_reply(F.pb, 0x904, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_PENDING, 0);
  assert_int_equal(nevents_for("O4"), 0);
  in_recv_result(F.pb, 0x904, 0); /* the RecvResult that follows */
  expect_event("O4", SEND_DONE, SS, 0);
  assert_int_equal(F.pb->queued, 0);

  /* B restarted (a new session): its memory is gone, the outcome unknown. */
  send_to_result("O5", 0x905, 0);
  link_drops_and_returns(72);
  expect_event("O5", SEND_DONE, SS, KVF_EUNKNOWN);
  assert_true(strstr(event_for("O5", SEND_DONE)->error, "restarted") != NULL);

  /* B stays away past the deadline: unknown too, not a plain loss. */
  send_to_result("O6", 0x906, 150);
  link_drops();
  run_for(200);
  expect_event("O6", SEND_DONE, SS, KVF_EUNKNOWN);
  F.pb->state = KVF__PEER_UP;

  /* Data under way when the link drops: a loss, as before. */
  send_granted("O7", 0x907, false, 0);
  link_drops();
  F.pb->state = KVF__PEER_UP;
  complete_post(F.npost - 1, KVF_ECANCELED);
  expect_event("O7", SEND_DONE, SS, KVF_EPEERLOST);
  assert_int_equal(F.pb->queued, 0);
  assert_clean();
}

/* Whether an OutcomeQuery for handle went to p. */
static bool asked(kvf__peer *p, uint64_t handle) {
  for (size_t i = 0; i < F.nmsg; i++)
    if (F.msg[i].p == p && F.msg[i].m->body_case == KVF__PEER_MSG__BODY_OUTCOME_QUERY &&
        F.msg[i].m->outcome_query->handle == handle)
      return true;
  return false;
}

/* One-sided writes (rdma): the receiver finishes on the last write alone.
 * When the link drops, a send the receiver already confirmed succeeds
 * whatever its late completions say; one in the middle of its parts fails
 * with the loss; one whose every part was posted fails with the loss if
 * its last write never went (the transport says KVF_EPEERLOST), and asks
 * the receiver once the same incarnation of it is back if that write was
 * out (KVF_EUNKNOWN: it may have landed), as does one that had said
 * SendDone; the receiver's word is what it reports. */
static void test_outcome_one_sided(void **state) {
  F.one_sided = true;
  F.pb->remote_session = 91;
  send_to_result("U1", 0xa01, 0); /* SendDone said (RESULT) */
  send_granted("U2", 0xa02, false, 0);
  send_granted("U3", 0xa03, true, 0); /* more parts come */
  send_granted("U4", 0xa04, false, 0); /* FLUSH */
  send_granted("U5", 0xa05, false, 0); /* FLUSH */
  send_granted("U6", 0xa06, false, 0); /* FLUSH */
  in_recv_result(F.pb, 0xa02, 0); /* U2: CONFIRMED */
  size_t before = F.nmsg;
  link_drops();
  complete_post(1, KVF_ECANCELED); /* the link's writes come back flushed */
  complete_post(2, KVF_ECANCELED);
  complete_post(3, KVF_EUNKNOWN);   /* U4, U5: the last write was out */
  complete_post(4, KVF_EUNKNOWN);
  complete_post(5, KVF_EPEERLOST);  /* U6: it never went */
  expect_event("U2", SEND_DONE, SS, 0);             /* the receiver had confirmed it */
  expect_event("U3", SEND_DONE, SS, KVF_EPEERLOST); /* mid-parts: a loss */
  expect_event("U6", SEND_DONE, SS, KVF_EPEERLOST); /* the receiver cannot have finished */
  assert_int_equal(nevents_for("U1"), 0);           /* these wait for the receiver's word */
  assert_int_equal(nevents_for("U4"), 0);
  assert_int_equal(nevents_for("U5"), 0);
  assert_int_equal(F.nmsg, before);                 /* no SendDone into a dead link */
  link_returns(91);
  assert_true(asked(F.pb, 0xa01));
  assert_true(asked(F.pb, 0xa04));
  assert_true(asked(F.pb, 0xa05));
  in_outcome_reply(F.pb, 0xa01, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN, 0);
  in_outcome_reply(F.pb, 0xa04, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN, 0); /* its last write landed */
  in_outcome_reply(F.pb, 0xa05, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN, KVF_EPEERLOST);
  expect_event("U1", SEND_DONE, SS, 0);
  expect_event("U4", SEND_DONE, SS, 0);
  expect_event("U5", SEND_DONE, SS, KVF_EPEERLOST);
  assert_int_equal(F.pb->queued, 0);
  assert_clean();
}

/* One-sided, all parts posted when the link drops, and the receiver comes
 * back as a new incarnation: nobody can say, so KVF_EUNKNOWN. */
static void test_outcome_one_sided_restart(void **state) {
  F.one_sided = true;
  F.pb->remote_session = 92;
  send_granted("V1", 0xb01, false, 0);
  link_drops();
  complete_post(0, KVF_EUNKNOWN);
  assert_int_equal(nevents_for("V1"), 0);
  link_returns(93);
  expect_event("V1", SEND_DONE, SS, KVF_EUNKNOWN);
  assert_false(asked(F.pb, 0xb01));
  assert_int_equal(F.pb->queued, 0);
  assert_clean();
}

/* One-sided: the queue pair fails with the last write out before the
 * control link says anything: the send asks at once, and asks again after
 * the link's drop and return if the answer was lost with it. */
static void test_outcome_one_sided_qp_first(void **state) {
  F.one_sided = true;
  F.pb->remote_session = 94;
  send_granted("W1", 0xc01, false, 0);
  complete_post(0, KVF_EUNKNOWN);
  assert_int_equal(nevents_for("W1"), 0);
  assert_true(asked(F.pb, 0xc01));
  size_t before = F.nmsg;
  link_drops();
  assert_int_equal(nevents_for("W1"), 0);
  link_returns(94);
  assert_true(F.nmsg > before); /* asked again */
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_OUTCOME_QUERY)->outcome_query->handle, 0xc01);
  in_outcome_reply(F.pb, 0xc01, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN, 0);
  expect_event("W1", SEND_DONE, SS, 0);
  assert_int_equal(F.pb->queued, 0);
  assert_clean();
}

/* The receiver remembers how its grants ended, for their sender. */
static void test_outcome_receiver(void **state) {
  F.pb->remote_session = 81;
  assert_int_equal(do_grant(SR, "Q1", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  kvf__xfer *x = F.opened[F.nopened - 1];
  uint64_t h1 = x->handle;
  in_send_done(F.pb, h1, 64, 1);
  kvf__xfer_on_landed(x);
  expect_event("Q1", RECV_DONE, SR, 0);
  assert_int_equal(do_grant(SR, "Q2", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  uint64_t h2 = F.opened[F.nopened - 1]->handle;
  assert_int_equal(kvf__xfer_cancel(SR, "Q2"), 0);
  expect_event("Q2", RECV_DONE, SR, KVF_ECANCELED);
  /* A grant still open takes the query as its SendDone. */
  assert_int_equal(do_grant(SR, "Q3", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  kvf__xfer *x3 = F.opened[F.nopened - 1];
  kvf__xfer_on_landed(x3);
  size_t before = F.nmsg;

  in_outcome_query(F.pb, h1, 64);
  in_outcome_query(F.pb, h2, 64);
  in_outcome_query(F.pb, 0x12345, 64);
  in_outcome_query(F.pb, x3->handle, 64);
  expect_event("Q3", RECV_DONE, SR, 0);
  assert_int_equal(F.nmsg, before + 5); /* four replies and Q3's RecvResult */
  Kvf__OutcomeReply *r[4];
  size_t k = 0;
  for (size_t i = before; i < F.nmsg; i++)
    if (F.msg[i].m->body_case == KVF__PEER_MSG__BODY_OUTCOME_REPLY) r[k++] = F.msg[i].m->outcome_reply;
  assert_int_equal(k, 4);
  assert_int_equal(r[0]->outcome, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN);
  assert_int_equal(r[0]->status, 0);
  assert_int_equal(r[1]->outcome, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_KNOWN);
  assert_int_equal(r[1]->status, KVF_EREMOTECANCEL); /* its client cancelled: the other side's cancel there */
  assert_int_equal(r[2]->outcome, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_UNKNOWN);
  assert_int_equal(r[3]->outcome, KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_PENDING);
  /* Asked by another incarnation of B: it knows nothing of it. */
  F.pb->remote_session = 82;
  in_outcome_query(F.pb, h1, 64);
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_OUTCOME_REPLY)->outcome_reply->outcome,
                   KVF__OUTCOME_REPLY__OUTCOME__OUTCOME_UNKNOWN);
  assert_clean();
}

/* The client goes: its transfers are dropped without events to it, peers
 * hear of it, other clients' transfers go on. */
static void test_session_gone(void **state) {
  kvf__descs dst = mkd(1, 1, 0, 64, 64);
  assert_int_equal(do_grant(SR, "G1", NULL, mkd(1, 0, 0, 64, 64), 0), 0);   /* waiting */
  assert_int_equal(do_grant(SR, "G2", "B", mkd(1, 0, 4096, 64, 64), 0), 0);    /* pushed */
  in_grant(F.pb, "G3", 0x801, &dst);
  assert_int_equal(do_send(SR, "G3", "B", mkd(1, 0, 0, 64, 64), false, 0), 0); /* post out */
  assert_int_equal(do_send(SR, "G4", "C", mkd(1, 0, 0, 64, 64), false, 0), 0); /* intent */
  assert_int_equal(do_send(SS, "G5", "C", mkd(1, 0, 0, 64, 64), false, 0), 0); /* other client */
  kvf__descs_free(&dst);
  assert_int_equal(F.sess[0], 4);
  uint64_t h2 = F.opened[0]->handle;
  size_t before = F.nmsg;

  kvf__xfer_session_gone(SR);
  assert_int_equal(F.sess[0], 0);
  assert_false(F.sess_bad);
  assert_int_equal(nevents(SR), 0);
  assert_int_equal(F.nev, 0);
  /* B hears of the pushed grant, C of the intent; B of the send once its
   * post is back. */
  assert_int_equal(F.nmsg, before + 2);
  assert_int_equal(naborted_of(F.post[0].x), 1);
  complete_post(0, 0);
  assert_int_equal(F.nmsg, before + 3);
  size_t to_sender = 0, to_receiver = 0;
  for (size_t i = before; i < F.nmsg; i++) {
    assert_int_equal(F.msg[i].m->body_case, KVF__PEER_MSG__BODY_CANCEL);
    Kvf__Cancel *c = F.msg[i].m->cancel;
    assert_int_equal(c->status, KVF_EREMOTECANCEL);
    if (c->to_sender) {
      to_sender++;
      assert_ptr_equal(F.msg[i].p, F.pb);
      assert_int_equal(c->handle, h2);
    } else {
      to_receiver++;
      if (F.msg[i].p == F.pb) assert_int_equal(c->handle, 0x801);
      else assert_string_equal(c->xfer_id, "G4");
    }
  }
  assert_int_equal(to_sender, 1);
  assert_int_equal(to_receiver, 2);
  assert_int_equal(F.nev, 0); /* still nobody to tell */
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.active, 1); /* G5 */
  assert_int_equal(kvf__xfer_cancel(SR, "G1"), KVF_ENOENT);
  assert_int_equal(kvf__xfer_cancel(SS, "G5"), 0);
  expect_event("G5", SEND_DONE, SS, KVF_ECANCELED);
  assert_int_equal(F.nev, 1);
  assert_clean();
}

/* After kvf__xfer_session_gone(s): no event reached s and its transfer
 * count is exactly 0 and never went below. */
static void expect_quiet_gone(kvf__session *s, int idx) {
  size_t n = nevents(s);
  if (n != 0 || F.sess[idx] != 0 || F.sess_bad)
    fail_msg("gone session got %zu event(s) (first: type %d status %d), its transfer count "
             "is %d%s",
             n, n ? F.ev[0].type : 0, n ? F.ev[0].status : 0, F.sess[idx],
             F.sess_bad ? " (went negative)" : "");
}

/* Both halves of a local transfer belong to the client that goes, between
 * parts (no copy out). Expected: no event to the gone client, its transfer
 * count back to exactly 0.
 *
 * DAEMON BUG (reported to the lead, not fixed here): kvf__xfer_session_gone
 * (daemon/xfer.c, ~line 475) clears the owner of one transfer at a time and
 * fails it; fail() fails the local twin through its twin branch (~line 215)
 * while the twin's owner is still the gone session, so finish_failure()
 * (~line 200) emits RECV_DONE/SEND_DONE(KVF_EREMOTECANCEL) to the gone
 * session and xfer_destroy() (~line 121) decrements its count. The walk
 * then reaches the destroyed twin through the saved next pointer (~line
 * 478; still readable only because the free waits for uv_close) and
 * decrements the count again (~line 480): the count ends at -1 (the real
 * n_xfers is a uint32_t and wraps). This test and the next fail until that
 * is fixed. */
static void test_session_gone_local_pair(void **state) {
  assert_int_equal(do_grant(SR, "G6", NULL, mkd(2, 1, 0, 64, 64), 0), 0);
  assert_int_equal(do_send(SR, "G6", "A", mkd(1, 0, 0, 64, 64), true, 0), 0);
  assert_int_equal(F.npost, 1);
  complete_post(0, 0); /* first part copied; the second is not posted yet */
  assert_int_equal(F.sess[0], 2);
  kvf__xfer_session_gone(SR);
  expect_quiet_gone(SR, 0);
  assert_int_equal(F.nmsg, 0);
  assert_clean();
}

/* The same with the send created first (the other walk order). */
static void test_session_gone_local_pair_send_first(void **state) {
  assert_int_equal(do_send(SR, "G7", "A", mkd(1, 0, 0, 64, 64), true, 0), 0);
  assert_int_equal(do_grant(SR, "G7", NULL, mkd(2, 1, 0, 64, 64), 0), 0);
  assert_int_equal(F.npost, 1);
  complete_post(0, 0);
  assert_int_equal(F.sess[0], 2);
  kvf__xfer_session_gone(SR);
  expect_quiet_gone(SR, 0);
  assert_clean();
}

/* With the copy out, both halves wait and then go quietly. */
static void test_session_gone_local_pair_copying(void **state) {
  assert_int_equal(do_grant(SR, "G8", NULL, mkd(1, 1, 0, 64, 64), 0), 0);
  assert_int_equal(do_send(SR, "G8", "A", mkd(1, 0, 0, 64, 64), false, 0), 0);
  assert_int_equal(F.npost, 1);
  kvf__xfer_session_gone(SR);
  assert_int_equal(F.nev, 0);
  complete_post(0, 0);
  assert_int_equal(F.nev, 0);
  assert_int_equal(F.sess[0], 0);
  assert_false(F.sess_bad);
  assert_clean();
}

/* Local pair across two clients: the sender goes, the receiver hears. */
static void test_session_gone_local_other_side(void **state) {
  assert_int_equal(do_grant(SR, "G9", NULL, mkd(2, 1, 0, 64, 64), 0), 0);
  assert_int_equal(do_send(SS, "G9", "A", mkd(1, 0, 0, 64, 64), true, 0), 0);
  complete_post(0, 0);
  kvf__xfer_session_gone(SS);
  assert_int_equal(nevents(SS), 0);
  expect_event("G9", RECV_DONE, SR, KVF_EREMOTECANCEL);
  assert_int_equal(F.nev, 1);
  assert_clean();
}

/* ---- DRAIN: one event, after the transport let go ------------------------- */

static void test_drain_single_event(void **state) {
  kvf__descs dst = mkd(2, 1, 0, 4096, 4096);
  in_grant(F.pb, "X1", 0x901, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(do_send(SS, "X1", "B", mkd(1, 0, 0, 4096, 4096), true, 0), 0);
  assert_int_equal(do_send(SS, "X1", "B", mkd(1, 0, 4096, 4096, 4096), false, 0), 0);
  assert_int_equal(F.npost, 2);
  kvf__xfer *x = F.post[0].x;
  assert_int_equal(kvf__xfer_cancel(SS, "X1"), 0);
  assert_int_equal(x->state, KVF__X_DRAIN);
  assert_int_equal(naborted_of(x), 1);
  assert_int_equal(F.nev, 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 0); /* owed until the writes stop */
  /* Everything else that would fail it changes nothing now. */
  in_recv_result(F.pb, 0x901, 0);
  in_cancel(F.pb, 0x901, "X1", 0, true);
  kvf__xfer_on_peer_down(F.pb);
  assert_int_equal(kvf__xfer_cancel(SS, "X1"), KVF_ENOENT);
  assert_int_equal(F.nev, 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 0);
  complete_post(1, KVF_ECANCELED);
  assert_int_equal(F.nev, 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 0);
  complete_post(0, 0);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 1);
  expect_event("X1", SEND_DONE, SS, KVF_ECANCELED);
  assert_int_equal(F.nev, 1);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_SEND_DONE), 0);
  assert_clean();
}

/* A receiver whose data path fails (a write outside the grant). */
static void test_data_error(void **state) {
  assert_int_equal(do_grant(SR, "X2", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  kvf__xfer *x = F.opened[0];
  kvf__xfer_on_data_error(x, KVF_ERANGE, "the peer wrote outside the grant");
  expect_event("X2", RECV_DONE, SR, KVF_ERANGE);
  assert_string_equal(event_for("X2", RECV_DONE)->error, "the peer wrote outside the grant");
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel->status, KVF_ERANGE);
  assert_int_equal(nclosed_of(x), 1);
  assert_clean();
}

/* ---- refused requests: an error, and no event ---------------------------- */

static void test_errors(void **state) {
  /* Duplicate grant. */
  assert_int_equal(do_grant(SR, "Y1", NULL, mkd(1, 0, 0, 64, 64), 0), 0);
  assert_int_equal(do_grant(SR, "Y1", NULL, mkd(1, 0, 0, 64, 64), 0), KVF_EEXIST);
  assert_true(strstr(errbuf, "Y1") != NULL);
  assert_int_equal(do_grant(SO, "Y1", NULL, mkd(1, 0, 0, 64, 64), 0), KVF_EEXIST);
  /* Duplicate send from another client. */
  assert_int_equal(do_send(SS, "Y2", "B", mkd(1, 0, 0, 64, 64), true, 0), 0);
  assert_int_equal(do_send(SO, "Y2", "B", mkd(1, 0, 0, 64, 64), true, 0), KVF_EEXIST);
  /* Unknown. */
  assert_int_equal(kvf__xfer_cancel(SR, "nope"), KVF_ENOENT);
  assert_int_equal(kvf__xfer_cancel(SO, "Y2"), KVF_ENOENT);
  /* Unknown peers. */
  assert_int_equal(do_grant(SR, "Y3", "Z", mkd(1, 0, 0, 64, 64), 0), KVF_ENOPEER);
  assert_true(strstr(errbuf, "'Z'") != NULL);
  assert_int_equal(do_send(SS, "Y3", "Z", mkd(1, 0, 0, 64, 64), false, 0), KVF_ENOPEER);
  assert_true(strstr(errbuf, "'Z'") != NULL);
  /* Bad ids. */
  char longid[KVF_XFER_ID_MAX + 2];
  memset(longid, 'x', sizeof longid);
  longid[KVF_XFER_ID_MAX + 1] = 0;
  assert_int_equal(do_grant(SR, "", NULL, mkd(1, 0, 0, 64, 64), 0), KVF_EINVAL);
  assert_int_equal(do_grant(SR, NULL, NULL, mkd(1, 0, 0, 64, 64), 0), KVF_EINVAL);
  assert_int_equal(do_grant(SR, "a\nb", NULL, mkd(1, 0, 0, 64, 64), 0), KVF_EINVAL);
  assert_int_equal(do_grant(SR, "a\x7f", NULL, mkd(1, 0, 0, 64, 64), 0), KVF_EINVAL);
  assert_int_equal(do_grant(SR, longid, NULL, mkd(1, 0, 0, 64, 64), 0), KVF_EINVAL);
  assert_int_equal(do_send(SS, longid, "A", mkd(1, 0, 0, 64, 64), false, 0), KVF_EINVAL);
  assert_int_equal(do_send(SS, "Y4", "", mkd(1, 0, 0, 64, 64), false, 0), KVF_EINVAL);
  assert_int_equal(do_send(SS, "Y4", NULL, mkd(1, 0, 0, 64, 64), false, 0), KVF_EINVAL);
  assert_int_equal(kvf__xfer_cancel(SR, ""), KVF_EINVAL);
  longid[KVF_XFER_ID_MAX] = 0; /* exactly the maximum is fine */
  assert_int_equal(do_grant(SR, longid, NULL, mkd(1, 0, 4096, 64, 64), 0), 0);
  assert_int_equal(kvf__xfer_cancel(SR, longid), 0);
  /* Nothing above made an event except that cancel. */
  assert_int_equal(F.nev, 1);
  expect_event(longid, RECV_DONE, SR, KVF_ECANCELED);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.active, 2);
  assert_int_equal(kvf__xfer_cancel(SR, "Y1"), 0);
  assert_int_equal(kvf__xfer_cancel(SS, "Y2"), 0);
  assert_int_equal(F.nev, 3);
  assert_clean();
}

/* Peer messages that make no sense are ignored. */
static void test_bogus_peer_messages(void **state) {
  kvf__descs dst = mkd(1, 1, 0, 64, 64);
  in_grant(F.pb, "", 0x1, &dst);      /* bad id */
  in_grant(F.pb, "B1", 0, &dst);      /* no handle */
  in_intent(F.pb, "", 0);
  in_send_done(F.pb, 0x12345, 1, 1);  /* unknown handle */
  in_recv_result(F.pb, 0x12345, 0);
  in_cancel(F.pb, 0x12345, "zz", 0, true);
  in_cancel(F.pb, 0x12345, "zz", 0, false);
  /* A grant with an empty descriptor list. */
  Kvf__Grant g = KVF__GRANT__INIT;
  Kvf__DescList dl = KVF__DESC_LIST__INIT;
  g.xfer_id = "B2";
  g.handle = 0x2;
  g.descs = &dl;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_GRANT;
  m.grant = &g;
  kvf__xfer_on_peer_msg(F.pb, &m);
  g.descs = NULL;
  kvf__xfer_on_peer_msg(F.pb, &m);
  /* A grant whose descriptor bytes are not whole 20-byte records. */
  uint8_t junk[2 * 20 - 1] = {0};
  dl.packed.data = junk;
  dl.packed.len = sizeof junk;
  g.descs = &dl;
  kvf__xfer_on_peer_msg(F.pb, &m);
  /* Not for xfer.c. */
  Kvf__Heartbeat hb = KVF__HEARTBEAT__INIT;
  m.body_case = KVF__PEER_MSG__BODY_HEARTBEAT;
  m.heartbeat = &hb;
  kvf__xfer_on_peer_msg(F.pb, &m);
  kvf__descs_free(&dst);
  assert_int_equal(F.nev, 0);
  assert_int_equal(F.nmsg, 0);
  assert_clean();
}

/* A grant with more descriptors than our max-descs (the receiver's may be
 * larger): Cancel(KVF_ELIMIT) on its handle tells the receiver, and our
 * send fails with the same reason, whether it came first or comes later. */
static void test_grant_over_max_descs(void **state) {
  kvf__descs dst = mkd(3, 7, 0, 8192, 4096);
  assert_int_equal(do_send(SS, "M1", "B", mkd(2, 0, 0, 4096, 4096), true, 0), 0);
  uint32_t saved = kvfd.cfg.max_descs;
  kvfd.cfg.max_descs = 2;
  in_grant(F.pb, "M1", 0x71, &dst);
  in_grant(F.pb, "M2", 0x72, &dst); /* pushed ahead of its send */
  kvfd.cfg.max_descs = saved;
  kvf__descs_free(&dst);
  expect_event("M1", SEND_DONE, SS, KVF_ELIMIT);
  assert_non_null(strstr(event_for("M1", SEND_DONE)->error, "grant of 3 descriptors refused by A"));
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_CANCEL), 2);
  Kvf__Cancel *c = F.msg[1].m->cancel;
  assert_int_equal(c->status, KVF_ELIMIT);
  assert_int_equal(c->handle, 0x71);
  assert_false(c->to_sender);
  assert_non_null(strstr(c->error, "its max-descs is 2"));
  assert_int_equal(last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel->handle, 0x72);
  assert_int_equal(F.npost, 0);
  /* M2's send fails at once: no SendIntent, no wait for its deadline. */
  assert_int_equal(do_send(SS, "M2", "B", mkd(2, 0, 0, 4096, 4096), true, 0), 0);
  expect_event("M2", SEND_DONE, SS, KVF_ELIMIT);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_SEND_INTENT), 1);
  assert_int_equal(F.nev, 2);
  assert_clean();
}

/* grant_open failing: pushed grant fails quietly; answering an intent tells
 * the sender. */
static void test_grant_open_fails(void **state) {
  F.grant_open_rc = -ENOMEM;
  assert_int_equal(do_grant(SR, "O1", "B", mkd(1, 0, 0, 64, 64), 0), 0);
  expect_event("O1", RECV_DONE, SR, -ENOMEM);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 0);
  in_intent(F.pb, "O2", 0);
  assert_int_equal(do_grant(SR, "O2", NULL, mkd(1, 0, 0, 64, 64), 0), 0);
  F.grant_open_rc = 0;
  expect_event("O2", RECV_DONE, SR, -ENOMEM);
  Kvf__Cancel *c = last_msg(F.pb, KVF__PEER_MSG__BODY_CANCEL)->cancel;
  assert_int_equal(c->status, -ENOMEM);
  assert_true(c->to_sender);
  assert_int_equal(nmsgs(F.pb, KVF__PEER_MSG__BODY_GRANT), 0);
  assert_int_equal(F.nclosed, 0); /* never opened, so never closed */
  assert_clean();
}

/* ---- out of memory: kvf__descs_append fails on demand --------------------- */

/* test_xfer is linked with -Wl,--wrap=kvf__descs_append (Makefile): xfer.c's
 * calls come here, and the next F.append_fails of them fail. */
int __real_kvf__descs_append(kvf__descs *dst, const kvf__descs *src);
int __wrap_kvf__descs_append(kvf__descs *dst, const kvf__descs *src) {
  if (F.append_fails > 0) {
    F.append_fails--;
    return -ENOMEM;
  }
  return __real_kvf__descs_append(dst, src);
}

/* A send whose first part cannot be kept fails the call and leaves nothing:
 * no transfer, no event when its deadline would have come, the grant
 * still free; the same id then goes through. */
static void test_send_nomem_leaves_nothing(void **state) {
  assert_int_equal(do_grant(SR, "N1", NULL, mkd(2, 1, 0, 4096, 4096), 0), 0);
  F.append_fails = 1;
  assert_int_equal(do_send(SS, "N1", "A", mkd(2, 0, 8192, 4096, 4096), false, 50), -ENOMEM);
  assert_int_equal(F.append_fails, 0);
  kvf__xfer_counts c;
  kvf__xfer_counts_get(&c);
  assert_int_equal(c.sends, 0);
  assert_int_equal(c.grants, 1);
  assert_int_equal(F.sess[1], 0);
  assert_false(kvf__xfer_sending(SS, "N1"));
  assert_int_equal(find_x("N1", KVF__RECV)->recv.state, KVF__RECV_WAIT);
  run_for(150); /* past the failed send's deadline */
  assert_int_equal(F.nev, 0);
  assert_int_equal(F.npost, 0);
  /* The same, to a peer: no SendIntent went out either. */
  F.append_fails = 1;
  assert_int_equal(do_send(SS, "N2", "B", mkd(1, 0, 0, 64, 64), true, 50), -ENOMEM);
  run_for(150);
  assert_int_equal(F.nev, 0);
  assert_int_equal(F.nmsg, 0);

  assert_int_equal(do_send(SS, "N1", "A", mkd(2, 0, 8192, 4096, 4096), false, 0), 0);
  assert_int_equal(F.npost, 1);
  assert_int_equal(F.post[0].runs.n, 1);
  assert_int_equal(F.post[0].runs.v[0].src_off, 8192);
  assert_int_equal(F.post[0].runs.v[0].dst_pool, 1);
  assert_int_equal(F.post[0].runs.v[0].dst_off, 0);
  assert_int_equal(F.post[0].runs.v[0].len, 8192);
  complete_post(0, 0);
  expect_event("N1", RECV_DONE, SR, 0);
  expect_event("N1", SEND_DONE, SS, 0);
  assert_int_equal(event_for("N1", SEND_DONE)->bytes, 8192);
  assert_int_equal(F.nev, 2);
  assert_clean();
}

/* A later part that cannot be kept is not taken: that call fails, the send
 * goes on without it and counts only what it took. */
static void test_send_part_nomem(void **state) {
  assert_int_equal(do_send(SS, "N3", "B", mkd(1, 0, 0, 4096, 4096), true, 0), 0);
  F.append_fails = 1;
  assert_int_equal(do_send(SS, "N3", "B", mkd(1, 0, 4096, 4096, 4096), false, 0), -ENOMEM);
  kvf__xfer *x = find_x("N3", KVF__SEND);
  assert_non_null(x);
  assert_int_equal(x->send.state, KVF__SEND_WAIT); /* still open for its last part */
  assert_int_equal(do_send(SS, "N3", "B", mkd(1, 0, 4096, 4096, 4096), false, 0), 0);
  assert_int_equal(x->send.state, KVF__SEND_QUEUED);
  kvf__descs dst = mkd(2, 1, 0, 4096, 4096);
  in_grant(F.pb, "N3", 0x903, &dst);
  kvf__descs_free(&dst);
  assert_int_equal(F.npost, 1);
  assert_true(F.post[0].last);
  assert_int_equal(F.post[0].runs.n, 1);
  assert_int_equal(F.post[0].runs.v[0].src_off, 0);
  assert_int_equal(F.post[0].runs.v[0].dst_pool, 1);
  assert_int_equal(F.post[0].runs.v[0].len, 8192);
  complete_post(0, 0);
  Kvf__SendDone *sd = last_msg(F.pb, KVF__PEER_MSG__BODY_SEND_DONE)->send_done;
  assert_int_equal(sd->descriptors, 2);
  assert_int_equal(sd->bytes, 8192);
  in_recv_result(F.pb, 0x903, 0);
  expect_event("N3", SEND_DONE, SS, 0);
  assert_int_equal(event_for("N3", SEND_DONE)->descriptors, 2);
  assert_clean();
}

/* Many transfers at once, each completing; counts back to zero. */
static void test_many(void **state) {
  enum { N = 200 };
  char id[32];
  for (int i = 0; i < N; i++) {
    snprintf(id, sizeof id, "many-%d", i);
    assert_int_equal(do_grant(SR, id, NULL, mkd(2, 1, (uint64_t)i * 8192, 4096, 4096), 0), 0);
    assert_int_equal(do_send(SS, id, "A", mkd(2, 0, (uint64_t)i * 8192, 4096, 4096), false, 0), 0);
  }
  assert_int_equal(F.npost, N);
  assert_int_equal(F.sess[0], N);
  assert_int_equal(F.sess[1], N);
  for (size_t i = 0; i < N; i++) complete_post(N - 1 - i, 0);
  assert_int_equal(F.nev, 2 * N);
  for (size_t i = 0; i < F.nev; i++) assert_int_equal(F.ev[i].status, 0);
  assert_clean();
}

int main(void) {
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
  const struct CMUnitTest tests[] = {
      T(test_local_grant_then_send),
      T(test_local_send_then_grant),
      T(test_local_parts_out_of_order),
      T(test_local_size_mismatch),
      T(test_local_send_skips_grant_for_other_node),
      T(test_remote_pushed_grant),
      T(test_remote_landed_then_send_done),
      T(test_remote_delivered),
      T(test_remote_confirmed_before_last_completion),
      T(test_grant_opened_later),
      T(test_intent_before_grant),
      T(test_intent_before_named_grant),
      T(test_intent_after_grant),
      T(test_intent_crosses_pushed_grant), T(test_intent_after_vouched_grant),
      T(test_intent_from_other_node),
      T(test_recv_size_mismatch),
      T(test_remote_send_intent_then_grant),
      T(test_remote_pregrant_consumed),
      T(test_remote_parts),
      T(test_remote_part_other_node),
      T(test_remote_size_mismatch),
      T(test_remote_mismatch_in_later_part),
      T(test_remote_post_refused),
      T(test_remote_post_fails),
      T(test_remote_recv_result_failure),
      T(test_cancel_by_receiver),
      T(test_cancel_by_receiver_fenced),
      T(test_cancel_by_receiver_fence_times_out),
      T(test_cancel_ack_by_sender),
      T(test_crossed_pushed_grant_dropped),
      T(test_cancel_by_sender),
      T(test_cancel_by_sender_waits_for_writes),
      T(test_peer_waiting_limit),
      T(test_cancel_local_while_copying),
      T(test_cancel_local_between_parts),
      T(test_incoming_cancel),
      T(test_deadline_grant),
      T(test_deadline_send),
      T(test_deadline_local),
      T(test_sweep_expires_tables),
      T(test_peer_down),
      T(test_outcome_sender),
      T(test_outcome_receiver),
      T(test_outcome_one_sided),
      T(test_outcome_one_sided_restart),
      T(test_outcome_one_sided_qp_first),
      T(test_session_gone),
      T(test_session_gone_local_pair),
      T(test_session_gone_local_pair_send_first),
      T(test_session_gone_local_pair_copying),
      T(test_session_gone_local_other_side),
      T(test_drain_single_event),
      T(test_data_error),
      T(test_errors),
      T(test_bogus_peer_messages),
      T(test_grant_over_max_descs),
      T(test_grant_open_fails),
      T(test_send_nomem_leaves_nothing),
      T(test_send_part_nomem),
      T(test_many),
  };
#undef T
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
