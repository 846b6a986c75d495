/* harness.h - black-box test helpers: real kvferryd processes in a temp
 * dir, clients through libkvferry, byte patterns and verified transfers.
 *
 * Every helper returns 0 on success and a negative value on failure; the
 * failure's detail is in h_lasterr() (per thread, so worker threads can use
 * the same helpers) and is also printed on stderr. Tests wrap calls in H_OK,
 * which turns a failure into a cmocka failure carrying that detail. Every
 * wait is bounded. */
#ifndef KVF_TEST_HARNESS_H
#define KVF_TEST_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "json.h"
#include "kvferry.h"

#define H_PATH_MAX 256
#define H_SOCK_MAX 108        /* sun_path */
#define H_MAX_PEERS 4
#define H_STASH 256           /* events kept per client for later waits */
#define H_READY_MS 30000      /* bound on daemon start and peers up (a loaded VM sets up pools slowly) */
#define H_STOP_MS 10000       /* SIGTERM grace before SIGKILL (the daemon drains for up to 5 s) */
#define H_XFER_MS 30000       /* default bound on a transfer's two events */

/* Fails the current cmocka test with the harness's detail. */
#define H_OK(expr)                                                      \
  do {                                                                  \
    if ((expr) != 0)                                                    \
      fail_msg("%s failed: %s", #expr, h_lasterr());                    \
  } while (0)

/* ------------------------------------------------------------ errors */

const char *h_lasterr(void);
/* Records (and prints) a failure; returns -1 for `return h_fail(...)`. */
int h_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
uint64_t h_now_ms(void);
/* Milliseconds until the h_now_ms() time end, 0 when past. */
int h_left_ms(uint64_t end);
void h_sleep_ms(unsigned ms);

/* ------------------------------------------------------------ process */

/* Once from main: line-buffered stdout (TAP survives a kill), SIGPIPE off. */
void h_init(void);
/* A fresh dir under $TMPDIR (or /tmp), remembered for h_cleanup. */
int h_mkdtemp(char *out, size_t cap);
/* From main after the tests: removes the temp dirs when nothing failed,
 * else keeps them and says where they are. Returns failed unchanged. */
int h_cleanup(int failed);
/* n distinct free TCP ports on 127.0.0.1 (held open together while picked
 * so they differ; another process may still take one before the daemon). */
int h_free_ports(uint16_t *ports, size_t n);

typedef struct h_daemon {
  char name[64];
  char dir[H_PATH_MAX];
  char conf[H_PATH_MAX];
  char sock[H_SOCK_MAX];
  char log[H_PATH_MAX];
  uint16_t port;                       /* peer-listen port */
  pid_t pid;                           /* 0 when not running */
  size_t npeers;
  char peer_name[H_MAX_PEERS][64];
  uint16_t peer_port[H_MAX_PEERS];
  char pool_size[32];                  /* of the host pool "kv" */
  char extra[1024];                    /* more config lines, verbatim */
  unsigned starts;
  char exe[64];                        /* the binary under $BUILD; "" = kvferryd */
} h_daemon;

void h_daemon_init(h_daemon *d, const char *dir, const char *name, uint16_t port,
                   const char *pool_size);
int h_daemon_add_peer(h_daemon *d, const h_daemon *peer);
int h_daemon_write_conf(const h_daemon *d);
/* Writes the config, spawns $BUILD/kvferryd (output to d->log, appended
 * across restarts) and waits until its API socket answers. */
int h_daemon_spawn(h_daemon *d);
/* Waits until kvf_inspect(PEERS) shows every configured peer "up". */
int h_daemon_wait_peers(h_daemon *d, int timeout_ms);
/* SIGTERM, SIGKILL after H_STOP_MS. Fails unless it exited 0 by itself
 * (a sanitizer report or a hang on shutdown is a failure). */
int h_daemon_stop(h_daemon *d);
/* Raw SIGKILL, for the crash tests; reaps it. */
int h_daemon_kill9(h_daemon *d);
/* Prints the last lines of the daemon's log on stderr. */
void h_daemon_log_tail(const h_daemon *d, int lines);

/* The usual topology: "prefill" and "decode" peered on loopback, each with
 * a host pool "kv" of pool_size, both up and connected. */
typedef struct h_pair {
  char dir[H_PATH_MAX];
  h_daemon prefill;
  h_daemon decode;
} h_pair;

int h_pair_start(h_pair *p, const char *pool_size);
/* The same, with prefill running $BUILD/prefill_exe (NULL: kvferryd; e.g.
 * "tests/kvferryd-rogue") and extra config lines (NULL: none) for both. */
int h_pair_start_ex(h_pair *p, const char *pool_size, const char *prefill_exe, const char *extra);
int h_pair_wait_up(h_pair *p);
int h_pair_stop(h_pair *p);

/* What most suites share for a whole group: the usual pair and one
 * client of each daemon (pre: of "prefill", the usual sender; dec: of
 * "decode", the usual receiver). stop closes both clients and stops the
 * pair even when one step fails; it returns the first failure. */
typedef struct h_client h_client;
typedef struct h_fixture h_fixture;
int h_fixture_start(h_fixture *f, const char *pool_size);
int h_fixture_stop(h_fixture *f);
/* n descriptors of len bytes, scattered on both sides (different
 * shuffles by seed), from f's prefill to its decode in parts sends,
 * every byte verified (h_transfer) within timeout_ms. */
int h_scattered(h_fixture *f, const char *tag, size_t n, uint64_t len, size_t parts, uint64_t seed, int timeout_ms);
/* The cmocka group functions of a suite whose group shares one fixture
 * var (pools of pool_size): group_setup and group_teardown. */
#define H_FIXTURE_GROUP(var, pool_size)                                    \
  static h_fixture var;                                                    \
  static int group_setup(void **state) {                                   \
    (void)state;                                                           \
    return h_fixture_start(&var, pool_size);                               \
  }                                                                        \
  static int group_teardown(void **state) {                                \
    (void)state;                                                           \
    return h_fixture_stop(&var);                                           \
  }

/* ------------------------------------------------------------ clients */

struct h_client {
  kvf_client *c;
  char node[64];
  uint32_t pool;                       /* id of pool "kv" */
  uint8_t *base;                       /* its mapping here */
  uint64_t size;
  kvf_event stash[H_STASH];            /* events taken but not yet asked for */
  size_t nstash;
};

struct h_fixture {
  h_pair p;
  h_client pre, dec;
};

/* Connects, finds pool "kv" and maps it. */
int h_client_open(h_client *hc, const h_daemon *d);
void h_client_close(h_client *hc);
/* Waits for the event of xfer_id (type 0: either type). Other events are
 * stashed for later calls. Returns 0, -ETIMEDOUT, or kvf_wait_events's
 * error (e.g. KVF_EDAEMON) unchanged. */
int h_wait_event(h_client *hc, const char *xfer_id, int type, int timeout_ms,
                 kvf_event *out);
/* Fails when any event is stashed or arrives within ms (stray events). */
int h_no_events(h_client *hc, int ms);

/* The JSON document of kvf_inspect, malloc'ed. */
int h_inspect(kvf_client *c, int what, char **json);
/* The rdma QP resets hc's daemon made toward its peers (0 without rdma). */
int h_rdma_resets(h_client *hc, uint64_t *n);
/* The rdma QPs of hc's daemon toward its peers: all, and those connected.
 * Fails (said) when its status has no rdma section. */
int h_rdma_qps(h_client *hc, size_t *all, size_t *connected);
/* A top-level number of the STATUS document. */
int h_status_u64(kvf_client *c, const char *key, uint64_t *out);
/* Waits until grants_active, sends_active and transfers_active are all 0. */
int h_wait_idle(kvf_client *c, int timeout_ms);

/* ------------------------------------------------------------ JSON */

/* proto/json.h's reader, under the names the tests use. */
static inline const char *hj_get(const char *obj, const char *key) { return kvf__json_get(obj, key); }
static inline const char *hj_skip(const char *p) { return kvf__json_skip(p); }
static inline int hj_str(const char *obj, const char *key, char *out, size_t cap) {
  return kvf__json_get_str(obj, key, out, cap);
}
static inline int hj_u64(const char *obj, const char *key, uint64_t *out) {
  return kvf__json_get_u64(obj, key, out);
}
/* Array iteration: *it points at '[' initially; returns each element's
 * start, then NULL. */
static inline const char *hj_next(const char **it) { return kvf__json_next(it); }

/* ------------------------------------------------------------ patterns */

/* A deterministic pattern from (seed, index); byte k of block index is the
 * same whatever the block's placement, so a misplaced block is caught. */
void h_fill(void *p, uint64_t len, uint64_t seed, uint64_t index);
void h_poison(void *p, uint64_t len);
/* Offset of the first wrong byte, or -1 when all len bytes match. */
int64_t h_verify(const void *p, uint64_t len, uint64_t seed, uint64_t index);
int64_t h_verify_poison(const void *p, uint64_t len);

/* n descriptors of len bytes in pool from offset base. scatter: shuffled
 * over n + n/8 + 1 slots (gaps included) by seed; else back to back in
 * order. Returns the end of the span used. */
uint64_t h_layout(kvf_desc *d, size_t n, uint32_t pool, uint64_t base, uint64_t len,
                  bool scatter, uint64_t seed);
uint64_t h_desc_bytes(const kvf_desc *d, size_t n);
/* A unique transfer id "prefix-PID-N". */
void h_id(char *out, size_t cap, const char *prefix);

/* ------------------------------------------------------------ transfers */

typedef struct h_xfer {
  const char *id;
  const kvf_desc *src;        /* in the sender's pool */
  size_t nsrc;
  const kvf_desc *dst;        /* in the receiver's pool */
  size_t ndst;
  size_t parts;               /* sends (KVF_SEND_MORE on all but last); 0 = 1 */
  bool send_first;            /* post the send before the grant */
  bool anon_src;              /* grant without src_node */
  uint32_t deadline_ms;       /* 0: the daemon's default */
  uint64_t seed;
  const char *path;           /* expected event path; NULL: "tcp" or "local" */
  bool any_path;              /* do not check the path (a daemon the VM gives no rdma) */
  int timeout_ms;             /* bound on both events; 0: H_XFER_MS */
} h_xfer;

/* Posts the grant / all parts of the send. */
int h_post_grant(h_client *rcv, const h_xfer *x, const char *src_node);
int h_post_send(h_client *snd, const h_xfer *x, const char *dst_node);
/* Fills the sources and poisons the destinations' whole span. */
int h_prepare(h_client *snd, h_client *rcv, const h_xfer *x);
/* Checks every destination byte, and that the gaps of the span between
 * destinations are still poison (no write outside the grant). */
int h_verify_dst(h_client *rcv, const h_xfer *x);
/* Checks a successful event's fields. */
int h_check_event(const kvf_event *ev, int type, const char *path, const char *peer,
                  uint64_t bytes, uint64_t ndesc);
/* The whole handoff: prepare, post in the order asked, wait both events,
 * check them and verify every byte. */
int h_transfer(h_client *snd, h_client *rcv, const h_xfer *x);
/* A small verified transfer (16 x 4 KiB, scattered) in the last MiB of the
 * pools: "the daemons still serve". */
int h_quick(h_client *snd, h_client *rcv);
/* The same, whatever path the daemons chose. */
int h_quick_any_path(h_client *snd, h_client *rcv);
/* h_quick right after a data-path reset (rdma: a QP failed): a reset may
 * still be under way, and a grant whose memory windows it takes fails at
 * once on both sides with KVF_EPEERLOST, saying to grant again; so does
 * this, up to 3 times, each under a new id. Any other outcome counts. */
int h_quick_settled(h_client *snd, h_client *rcv);

/* Raw connections for abuse tests: a connected fd, or -1 (said). */
int h_raw_unix(const char *path);
int h_raw_tcp(uint16_t port);
/* Writes what the socket takes; stops quietly when the peer closes. */
void h_raw_write(int fd, const void *p, size_t n);
/* Succeeds when the peer closes fd within ms; anything said first is
 * ignored (its bytes counted in *bytes_seen when not NULL). */
int h_expect_closed(int fd, int ms, const char *what, size_t *bytes_seen);
/* 0 when got == want, else says what returned what. */
int h_expect_rc(int got, int want, const char *what);
/* Waits until the daemon of c counts want clients (nothing kept for dead
 * sockets). */
int h_wait_clients(kvf_client *c, uint64_t want, int ms);

/* ------------------------------------------------------------ waiting */

/* Tests wait on the condition they need (a status counter, an inspect
 * field, an event), polled under a deadline as Redis's wait_for_condition
 * does, never for a fixed time: a slow or loaded machine then makes a test
 * slower, not flaky or silently weaker.
 *
 * A condition returns 1 when it holds, 0 when not yet, negative when it
 * could not be checked (detail recorded with h_fail). It may describe what
 * it saw with h_wait_note, which the timeout's message then quotes. */
typedef int (*h_cond_fn)(void *arg);

/* Polls cond(arg) until it holds, for at most timeout_ms. Fails with
 * "timed out after N ms waiting for <what> (last seen: <note>)", or at
 * once with the condition's own error. */
int h_wait_until(h_cond_fn cond, void *arg, int timeout_ms, const char *what);
/* What the running condition last saw, for h_wait_until's message. */
void h_wait_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Waits until the top-level number key of c's STATUS is at least min. */
int h_wait_status(kvf_client *c, const char *key, uint64_t min, int timeout_ms);
/* The number key (e.g. "bytes": what a sender has posted) of transfer id
 * in c's TRANSFERS; fails when id is not listed. */
int h_xfer_u64(kvf_client *c, const char *id, const char *key, uint64_t *out);
/* Waits until transfer id on c shows "bytes" of at least min (fails at
 * once when it is no longer listed: it ended). */
int h_wait_xfer_bytes(kvf_client *c, const char *id, uint64_t min, int timeout_ms);

#endif
