/* test_config.c - the config table: parsing, bounds, validation, --help,
 * dump round trips, and hostile input; plus the log line format. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "desc.h"
#include "kvferry.h"
#include "log.h"

#define ERRLEN 512

/* Every key the daemon documents; --help, the dump and kvferryd.conf must
 * all know each of them. */
static const char *const all_keys[] = {
    "node", "api-socket", "api-allow-users", "api-allow-groups", "peer-listen", "peer",
    "registry", "peer-connect", "peer-idle-close-ms", "registry-ttl-ms",
    "cluster-key-file", "pool", "default-deadline-ms", "heartbeat-ms", "peer-timeout-ms",
    "reconnect-min-ms", "reconnect-max-ms", "tcp-streams", "tcp-threads", "tcp-pollers", "max-frame",
    "max-descs",
    "max-clients", "api-hello-timeout-ms", "api-operator-slots", "api-output-budget", "max-transfers-per-client", "max-peers", "max-pending-peers", "max-pending-per-address",
    "peer-handshake-timeout-ms", "peer-address-check", "max-peer-waiting", "grant-overlap", "hugepages",
    "mlock", "cuda", "log-level", "transports", "metrics-listen", "stop-timeout-ms",
    "rdma-devices", "rdma-gid-index", "rdma-listen", "rdma-qps-per-peer", "rdma-queue-depth",
    "rdma-inline", "rdma-slice", "rdma-poll-us", "busy-poll", "spin-us", "spin-grant-us", "spin-cadence-us", "rdma-memory-windows", "rdma-mw-max-windows",
    "gpu-direct", "rdma-bounce-size", "rdma-staging-size",
};
#define N_KEYS (sizeof all_keys / sizeof all_keys[0])

#define assert_contains(hay, needle)                                                      \
  do {                                                                                    \
    if (!strstr((hay), (needle))) fail_msg("'%s' does not contain '%s'", (hay), (needle)); \
  } while (0)

/* Parses text over fresh defaults into *cfg; returns the parse's rc. */
static int parse_str(kvf__config *cfg, const char *text, char *err) {
  kvf__config_defaults(cfg);
  return kvf__config_parse(cfg, text, strlen(text), "test.conf", err, ERRLEN);
}

/* Expects text to fail with rc and an error naming test.conf:line. */
static void expect_error(const char *text, int rc, unsigned line, const char *what) {
  static kvf__config cfg_store; /* static: a failing assert longjmps past any free */
  kvf__config *cfg = &cfg_store;
  char err[ERRLEN], where[32];
  int got = parse_str(cfg, text, err);
  if (got != rc) fail_msg("'%s': rc %d, want %d (%s)", text, got, rc, err);
  snprintf(where, sizeof where, "test.conf:%u: ", line);
  assert_contains(err, where);
  if (what) assert_contains(err, what);
}

static char *capture(void (*fn)(FILE *, const void *), const void *arg) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  assert_non_null(f);
  fn(f, arg);
  fclose(f);
  return buf;
}

static void help_fn(FILE *f, const void *arg) { kvf__config_print_help(f); }
static void dump_text_fn(FILE *f, const void *cfg) { kvf__config_dump(cfg, f, false); }
static void dump_json_fn(FILE *f, const void *cfg) { kvf__config_dump(cfg, f, true); }

static int setup_cfg(void **state) {
  kvf__config *cfg = calloc(1, sizeof *cfg);
  if (!cfg) return -1;
  kvf__config_defaults(cfg);
  *state = cfg;
  return 0;
}

static int teardown_cfg(void **state) {
  free(*state);
  return 0;
}

/* ---- tests ---------------------------------------------------------------- */

static void test_defaults(void **state) {
  kvf__config *c = *state;
  assert_string_equal(c->node, "");
  assert_string_equal(c->api_socket, "/run/kvferry/kvferryd.sock");
  assert_int_equal(c->n_allow_uids, 0);
  assert_int_equal(c->n_allow_gids, 0);
  assert_string_equal(c->listen_host, "0.0.0.0");
  assert_int_equal(c->listen_port, 7470);
  assert_int_equal(c->n_peers, 0);
  assert_int_equal(c->n_pools, 0);
  assert_int_equal(c->default_deadline_ms, 30000);
  assert_int_equal(c->heartbeat_ms, 200);
  assert_int_equal(c->peer_timeout_ms, 700);
  assert_int_equal(c->reconnect_min_ms, 100);
  assert_int_equal(c->reconnect_max_ms, 5000);
  assert_int_equal(c->tcp_streams, 4);
  assert_int_equal(c->tcp_threads, 0); /* from the core count */
  assert_int_equal(c->max_frame, 64u << 20);
  assert_int_equal(c->max_descs, 1048576);
  assert_int_equal(c->max_clients, 256);
  assert_int_equal(c->max_transfers_per_client, 4096);
  assert_int_equal(c->max_peers, 64);
  assert_int_equal(c->max_pending_peers, 1024);
  assert_int_equal(c->hugepages, KVF__AUTO);
  assert_true(c->mlock);
  assert_int_equal(c->log_level, KVF__LOG_INFO);
  assert_string_equal(c->transports, "tcp");
}

static const char every_key[] =
    "node alpha-1\n"
    "api-socket /tmp/kvf.sock\n"
    "api-allow-users root 12345,0\n"
    "api-allow-groups root,4242\n"
    "peer-listen [::1]:7000\n"
    "peer beta 10.0.0.2:7470\n"
    "cluster-key-file /etc/kvferry/cluster.key\n"
    "pool kv cuda:3 1G\n"
    "default-deadline-ms 1000\n"
    "heartbeat-ms 100\n"
    "peer-timeout-ms 1000\n"
    "reconnect-min-ms 10\n"
    "reconnect-max-ms 20\n"
    "tcp-streams 8\n"
    "tcp-threads 3\n"
    "max-frame 1M\n"
    "max-descs 77\n"
    "max-clients 5\n"
    "max-transfers-per-client 6\n"
    "max-peers 7\n"
    "max-pending-peers 9\n"
    "hugepages off\n"
    "mlock no\n"
    "log-level debug\n"
    "transports rdma, tcp\n";

static void test_every_key(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  assert_int_equal(parse_str(c, every_key, err), 0);
  assert_string_equal(c->node, "alpha-1");
  assert_string_equal(c->api_socket, "/tmp/kvf.sock");
  assert_int_equal(c->n_allow_uids, 2); /* root and 0 are the same uid */
  assert_int_equal(c->allow_uids[0], 0);
  assert_int_equal(c->allow_uids[1], 12345);
  assert_int_equal(c->n_allow_gids, 2);
  assert_int_equal(c->allow_gids[0], 0);
  assert_int_equal(c->allow_gids[1], 4242);
  assert_string_equal(c->listen_host, "::1");
  assert_int_equal(c->listen_port, 7000);
  assert_int_equal(c->n_peers, 1);
  assert_string_equal(c->peers[0].name, "beta");
  assert_string_equal(c->peers[0].host, "10.0.0.2");
  assert_int_equal(c->peers[0].port, 7470);
  assert_string_equal(c->cluster_key_file, "/etc/kvferry/cluster.key");
  assert_int_equal(c->n_pools, 1);
  assert_string_equal(c->pools[0].name, "kv");
  assert_string_equal(c->pools[0].kind, "cuda:3");
  assert_int_equal(c->pools[0].size, 1ull << 30);
  assert_int_equal(c->default_deadline_ms, 1000);
  assert_int_equal(c->heartbeat_ms, 100);
  assert_int_equal(c->peer_timeout_ms, 1000);
  assert_int_equal(c->reconnect_min_ms, 10);
  assert_int_equal(c->reconnect_max_ms, 20);
  assert_int_equal(c->tcp_streams, 8);
  assert_int_equal(c->tcp_threads, 3);
  assert_int_equal(c->max_frame, 1u << 20);
  assert_int_equal(c->max_descs, 77);
  assert_int_equal(c->max_clients, 5);
  assert_int_equal(c->max_transfers_per_client, 6);
  assert_int_equal(c->max_peers, 7);
  assert_int_equal(c->max_pending_peers, 9);
  assert_int_equal(c->hugepages, KVF__OFF);
  assert_false(c->mlock);
  assert_int_equal(c->log_level, KVF__LOG_DEBUG);
  assert_string_equal(c->transports, "rdma,tcp");
  assert_int_equal(kvf__config_validate(c, err, sizeof err), 0);
}

static void test_sizes(void **state) {
  static const struct {
    const char *s;
    int rc;
    uint64_t v;
  } cases[] = {
      {"0", 0, 0},          {"4096", 0, 4096},
      {"64K", 0, 64 << 10}, {"64k", 0, 64 << 10},
      {"64KB", 0, 64 << 10}, {"64KiB", 0, 64 << 10},
      {"64kib", 0, 64 << 10}, {"512M", 0, 512ull << 20},
      {"2G", 0, 2ull << 30}, {"3T", 0, 3ull << 40},
      {"100B", 0, 100},     {"18446744073709551615", 0, UINT64_MAX},
      {"16777215T", 0, 16777215ull << 40},
      {"", -EINVAL, 0},     {"-1", -EINVAL, 0},
      {"+1", -EINVAL, 0},   {" 1", -EINVAL, 0},
      {"1 ", -EINVAL, 0},   {"K", -EINVAL, 0},
      {"1.5G", -EINVAL, 0}, {"1X", -EINVAL, 0},
      {"1Gx", -EINVAL, 0},  {"1iB", -EINVAL, 0},
      {"1KBB", -EINVAL, 0}, {"0x10", -EINVAL, 0},
      {"18446744073709551616", -ERANGE, 0}, {"16777216T", -ERANGE, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint64_t v = 12345;
    int rc = kvf__parse_size(cases[i].s, &v);
    if (rc != cases[i].rc) fail_msg("'%s': rc %d, want %d", cases[i].s, rc, cases[i].rc);
    if (rc == 0 && v != cases[i].v) fail_msg("'%s': %llu", cases[i].s, (unsigned long long)v);
  }
  assert_int_equal(kvf__parse_size(NULL, NULL), -EINVAL);
}

static void test_bounds(void **state) {
  expect_error("node a\n\ntcp-streams 65\n", -ERANGE, 3, "tcp-streams");
  expect_error("tcp-streams 0\n", -ERANGE, 1, "1..64");
  expect_error("tcp-threads 257\n", -ERANGE, 1, "0..256");
  expect_error("heartbeat-ms 9\n", -ERANGE, 1, "heartbeat-ms");
  expect_error("heartbeat-ms 99999999999999999999999\n", -ERANGE, 1, NULL);
  expect_error("default-deadline-ms 86400001\n", -ERANGE, 1, NULL);
  expect_error("max-peers 257\n", -ERANGE, 1, NULL);
  expect_error("max-frame 2G\n", -ERANGE, 1, "4K..1G");
  expect_error("max-frame 4095\n", -ERANGE, 1, NULL);
  expect_error("max-frame lots\n", -EINVAL, 1, "not a size");
  expect_error("max-clients 12abc\n", -EINVAL, 1, "decimal");
  expect_error("max-clients -1\n", -EINVAL, 1, NULL);
  expect_error("# c\npool a host 1000\n", -ERANGE, 2, "minimum");
  expect_error("pool a host 5000\n", -EINVAL, 1, "multiple of 4096");
  expect_error("pool a cuda:64 4K\n", -EINVAL, 1, "cuda:N");
  expect_error("pool a cuda: 4K\n", -EINVAL, 1, NULL);
  expect_error("pool a gpu 4K\n", -EINVAL, 1, NULL);
  expect_error("pool a host 99999999999T\n", -ERANGE, 1, NULL);
  expect_error("pool bad/name host 4K\n", -EINVAL, 1, "valid name");
  expect_error("pool a host 4K gpu-direct=on\n", -EINVAL, 1, "gpu-direct=off");
  expect_error("pool a host 4K gpu-direct=off x\n", -EINVAL, 1, NULL);
  expect_error("gpu-direct on\n", -EINVAL, 1, "auto|off");
  expect_error("rdma-bounce-size 64K\n", -ERANGE, 1, NULL);
  expect_error("node a b\n", -EINVAL, 1, "node takes NAME");
  expect_error("node\n", -EINVAL, 1, NULL);
  expect_error("node 0123456789012345678901234567890123456789012345678901234567890123\n",
               -EINVAL, 1, NULL);
  expect_error("hugepages maybe\n", -EINVAL, 1, "auto|on|off");
  expect_error("mlock true\n", -EINVAL, 1, "yes or no");
  expect_error("log-level verbose\n", -EINVAL, 1, "err|warn|info|debug");
  expect_error("transports udp\n", -EINVAL, 1, "udp");
  expect_error("transports tcp,tcp\n", -EINVAL, 1, "twice");
  expect_error("transports ,\n", -EINVAL, 1, NULL);
  expect_error("api-allow-users no-such-user-kvferry\n", -EINVAL, 1, "no such user");
  expect_error("api-allow-groups no-such-group-kvferry\n", -EINVAL, 1, "no such group");
  expect_error("api-allow-users 4294967295\n", -ERANGE, 1, NULL);
}

static void test_limits_of_names(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN], line[256];
  /* sun_path holds 107 bytes and the NUL. */
  memset(line, 'x', sizeof line);
  memcpy(line, "api-socket /", 12);
  strcpy(line + 11 + 107, "\n");
  assert_int_equal(parse_str(c, line, err), 0);
  assert_int_equal(strlen(c->api_socket), 107);
  line[11 + 107] = 'x';
  strcpy(line + 11 + 108, "\n");
  expect_error(line, -ERANGE, 1, "at most 107");
  assert_int_equal(parse_str(c, "node 012345678901234567890123456789012345678901234567890"
                                "123456789012\n", err), 0);
  assert_int_equal(strlen(c->node), 63);
  assert_int_equal(parse_str(c, "pool a cuda:63 4K\npool b cuda:007 4096\n", err), 0);
  assert_string_equal(c->pools[1].kind, "cuda:7");
}

static void test_unknown_key(void **state) {
  expect_error("node a\nbogus-key 1\n", -EINVAL, 2, "unknown key 'bogus-key'");
  expect_error("Node a\n", -EINVAL, 1, "unknown key");
  expect_error("node_name a\n", -EINVAL, 1, NULL);
}

static void test_duplicates_rejected_by_validate(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  assert_int_equal(parse_str(c, "node a\npool p host 4K\npool p cuda:0 4K\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "two pools named 'p'");
  assert_int_equal(parse_str(c, "node a\npeer b h1:1\npeer b h2:2\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "two peers named 'b'");
  assert_int_equal(parse_str(c, "node a\npeer a h1:1\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "own name");
}

static void test_timing_validated(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  assert_int_equal(parse_str(c, "node a\nheartbeat-ms 1000\npeer-timeout-ms 2000\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "peer-timeout-ms");
  assert_int_equal(parse_str(c, "node a\nheartbeat-ms 1000\npeer-timeout-ms 2001\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), 0);
  assert_int_equal(parse_str(c, "node a\nreconnect-min-ms 6000\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "reconnect-min-ms");
  assert_int_equal(parse_str(c, "node a\nmax-peers 1\npeer b h:1\npeer c h:2\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "max-peers");
  /* max-descs descriptors must fit in one frame: 20 bytes each plus the
   * slack. The defaults fit; 4K holds 179 of them and not 180. */
  assert_int_equal(parse_str(c, "node a\nmax-descs 16777216\nmax-frame 1G\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), 0);
  assert_int_equal(parse_str(c, "node a\nmax-descs 16777216\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "max-descs 16777216 needs max-frame of at least 335544832");
  assert_contains(err, "lower max-descs to at most 3355417");
  assert_int_equal(parse_str(c, "node a\nmax-frame 4K\nmax-descs 179\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), 0);
  assert_int_equal(parse_str(c, "node a\nmax-frame 4K\nmax-descs 180\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "max-frame");
  /* Configurations built in code get the table's bounds too. */
  assert_int_equal(parse_str(c, "node a\n", err), 0);
  c->tcp_streams = 0;
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "tcp-streams");
}

/* The frames that carry descriptor lists, at their largest (longest id
 * and node name, every field set): what KVF__FRAME_SLACK must cover. */
static void test_frame_slack(void **state) {
  enum { N = 1000 };
  static uint8_t packed[N * KVF__DESC_WIRE_SIZE];
  char id[KVF_XFER_ID_MAX + 1] = {0}, node[KVF__NAME_MAX + 1] = {0};
  memset(id, 'i', sizeof id - 1);
  memset(node, 'n', sizeof node - 1);
  Kvf__DescList dl = KVF__DESC_LIST__INIT;
  dl.packed.data = packed;
  dl.packed.len = sizeof packed;
  Kvf__GrantReq gr = KVF__GRANT_REQ__INIT;
  gr.xfer_id = id;
  gr.src_node = node;
  gr.descs = &dl;
  gr.deadline_ms = UINT32_MAX;
  Kvf__SendReq sr = KVF__SEND_REQ__INIT;
  sr.xfer_id = id;
  sr.dst_node = node;
  sr.descs = &dl;
  sr.more = 1;
  sr.deadline_ms = UINT32_MAX;
  Kvf__ApiRequest q = KVF__API_REQUEST__INIT;
  q.seq = UINT64_MAX;
  q.body_case = KVF__API_REQUEST__BODY_GRANT;
  q.grant = &gr;
  size_t grant_req = kvf__api_request__get_packed_size(&q);
  q.body_case = KVF__API_REQUEST__BODY_SEND;
  q.send = &sr;
  size_t send_req = kvf__api_request__get_packed_size(&q);
  Kvf__Grant g = KVF__GRANT__INIT;
  g.xfer_id = id;
  g.handle = UINT64_MAX;
  g.descs = &dl;
  g.deadline_ms = UINT32_MAX;
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  m.body_case = KVF__PEER_MSG__BODY_GRANT;
  m.grant = &g;
  size_t peer_grant = kvf__peer_msg__get_packed_size(&m);
  size_t limit = sizeof packed + KVF__FRAME_SLACK;
  if (grant_req > limit || send_req > limit || peer_grant > limit)
    fail_msg("frames of %u descriptors: grant %zu, send %zu, peer grant %zu bytes; limit %zu", N,
             grant_req, send_req, peer_grant, limit);
  /* ...with room to spare: a field added later must not quietly eat it. */
  assert_true(grant_req + 128 < limit && send_req + 128 < limit && peer_grant + 128 < limit);
}

static void test_addresses(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  static const char *const bad[] = {
      "peer b host\n",        "peer b host:\n",       "peer b :80\n",
      "peer b host:0\n",      "peer b host:65536\n",  "peer b host:-1\n",
      "peer b ::1:80\n",      "peer b [::1]\n",       "peer b [::1]80\n",
      "peer b [zz::]:80\n",   "peer b []:80\n",       "peer b 999.1.1.1:80\n",
      "peer b 1.2.3:80\n",    "peer b ho_st:80\n",    "peer b -host:80\n",
      "peer b [1.2.3.4]:80\n", "peer-listen on\n",    "peer-listen 1.2.3.4\n",
      "peer-listen [::1:7\n", "peer b h:1x\n",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    expect_error(bad[i], -EINVAL, 1, NULL);
  assert_int_equal(parse_str(c, "peer-listen 127.0.0.1:0\npeer b node-b.example:1\n"
                                "peer c [fe80::1]:65535\n", err), 0);
  assert_string_equal(c->listen_host, "127.0.0.1");
  assert_int_equal(c->listen_port, 0);
  assert_string_equal(c->peers[0].host, "node-b.example");
  assert_string_equal(c->peers[1].host, "fe80::1");
  assert_int_equal(c->peers[1].port, 65535);
  assert_int_equal(parse_str(c, "peer-listen off\n", err), 0);
  assert_string_equal(c->listen_host, "");
  assert_int_equal(c->listen_port, 0);
}

/* cluster-key-file: an absolute path or off (the file itself is checked
 * at start: tests/unit/test_auth.c). */
static void test_cluster_key_file(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  assert_int_equal(parse_str(c, "node a\n", err), 0);
  assert_string_equal(c->cluster_key_file, ""); /* off by default */
  assert_int_equal(parse_str(c, "cluster-key-file /k\ncluster-key-file off\n", err), 0);
  assert_string_equal(c->cluster_key_file, "");
  expect_error("cluster-key-file cluster.key\n", -EINVAL, 1, "not an absolute path or off");
  expect_error("cluster-key-file\n", -EINVAL, 1, "PATH|off");
  expect_error("cluster-key-file /a /b\n", -EINVAL, 1, NULL);
  char long_path[400] = "cluster-key-file /";
  memset(long_path + strlen(long_path), 'k', 300);
  strcat(long_path, "\n");
  expect_error(long_path, -ERANGE, 1, "at most 255");
}

static void test_comments_and_blanks(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  const char *text = "\xEF\xBB\xBF# a comment\n"
                     "\n"
                     "   \t  \n"
                     "    # an indented comment\n"
                     "node a   # trailing comment\n"
                     "tcp-streams\t7\r\n"
                     "api-socket /tmp/a#b.sock\n" /* '#' inside a word is not a comment */
                     "#tcp-streams 9\n"
                     "mlock no"; /* no final newline */
  assert_int_equal(parse_str(c, text, err), 0);
  assert_string_equal(c->node, "a");
  assert_int_equal(c->tcp_streams, 7);
  assert_string_equal(c->api_socket, "/tmp/a#b.sock");
  assert_false(c->mlock);
  assert_int_equal(parse_str(c, "", err), 0);
}

static void test_repeated_keys(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  const char *text = "peer b 10.0.0.2:7470\npeer c 10.0.0.3:7470\npeer d [::2]:1\n"
                     "pool p0 host 4K\npool p1 cuda:0 8K\n"
                     "tcp-streams 2\ntcp-streams 3\n"          /* scalars: last wins */
                     "api-allow-users 1,2\napi-allow-users 3\n"; /* lists: replaced */
  assert_int_equal(parse_str(c, text, err), 0);
  assert_int_equal(c->n_peers, 3);
  assert_string_equal(c->peers[2].name, "d");
  assert_int_equal(c->n_pools, 2);
  assert_int_equal(c->pools[1].size, 8192);
  assert_int_equal(c->tcp_streams, 3);
  assert_int_equal(c->n_allow_uids, 1);
  assert_int_equal(c->allow_uids[0], 3);
  assert_int_equal(kvf__config_parse(c, "api-allow-users\n", 16, "x", err, sizeof err), 0);
  assert_int_equal(c->n_allow_uids, 0);
}

static void test_too_many_repeats(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN], line[64];
  kvf__config_defaults(c);
  for (int i = 0; i < KVF__MAX_POOLS_CFG; i++) {
    snprintf(line, sizeof line, "pool p%d host 4K\n", i);
    assert_int_equal(kvf__config_parse(c, line, strlen(line), "x", err, sizeof err), 0);
  }
  assert_int_equal(kvf__config_parse(c, line, strlen(line), "x", err, sizeof err), -ERANGE);
  assert_contains(err, "more than 64 pools");
}

static void test_missing_node(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  assert_int_equal(kvf__config_validate(c, err, sizeof err), -EINVAL);
  assert_contains(err, "node");
  assert_int_equal(parse_str(c, "node a\n", err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), 0);
}

static void test_help_lists_every_key(void **state) {
  char *help = capture(help_fn, NULL);
  for (size_t i = 0; i < N_KEYS; i++) {
    char want[64];
    snprintf(want, sizeof want, "\n  %s ", all_keys[i]);
    assert_contains(help, want);
  }
  /* ...and nothing else: a key added to the table must be added here. */
  size_t n = 0;
  for (const char *p = help; (p = strstr(p, "\n  ")) != NULL; p++)
    if (p[3] >= 'a' && p[3] <= 'z') n++;
  assert_int_equal(n, N_KEYS);
  assert_contains(help, "(1..64)");       /* bounds */
  assert_contains(help, "default: 64M");  /* defaults */
  assert_contains(help, "auto|on|off");   /* enum words */
  assert_contains(help, "root");          /* empty api-allow-users explained */
  free(help);
}

/* The scalar keys, compared field by field (padding is not compared). */
static void assert_same_config(const kvf__config *a, const kvf__config *b) {
  assert_memory_equal(a->node, b->node, sizeof a->node);
  assert_memory_equal(a->api_socket, b->api_socket, sizeof a->api_socket);
  assert_int_equal(a->n_allow_uids, b->n_allow_uids);
  assert_memory_equal(a->allow_uids, b->allow_uids, sizeof a->allow_uids);
  assert_int_equal(a->n_allow_gids, b->n_allow_gids);
  assert_memory_equal(a->allow_gids, b->allow_gids, sizeof a->allow_gids);
  assert_string_equal(a->listen_host, b->listen_host);
  assert_int_equal(a->listen_port, b->listen_port);
  assert_int_equal(a->n_peers, b->n_peers);
  for (size_t i = 0; i < a->n_peers; i++) {
    assert_string_equal(a->peers[i].name, b->peers[i].name);
    assert_string_equal(a->peers[i].host, b->peers[i].host);
    assert_int_equal(a->peers[i].port, b->peers[i].port);
  }
  assert_int_equal(a->n_pools, b->n_pools);
  for (size_t i = 0; i < a->n_pools; i++) {
    assert_string_equal(a->pools[i].name, b->pools[i].name);
    assert_string_equal(a->pools[i].kind, b->pools[i].kind);
    assert_int_equal(a->pools[i].size, b->pools[i].size);
  }
  assert_int_equal(a->default_deadline_ms, b->default_deadline_ms);
  assert_int_equal(a->heartbeat_ms, b->heartbeat_ms);
  assert_int_equal(a->peer_timeout_ms, b->peer_timeout_ms);
  assert_int_equal(a->reconnect_min_ms, b->reconnect_min_ms);
  assert_int_equal(a->reconnect_max_ms, b->reconnect_max_ms);
  assert_int_equal(a->tcp_streams, b->tcp_streams);
  assert_int_equal(a->max_frame, b->max_frame);
  assert_int_equal(a->max_descs, b->max_descs);
  assert_int_equal(a->max_clients, b->max_clients);
  assert_int_equal(a->max_transfers_per_client, b->max_transfers_per_client);
  assert_int_equal(a->max_peers, b->max_peers);
  assert_int_equal(a->hugepages, b->hugepages);
  assert_int_equal(a->mlock, b->mlock);
  assert_int_equal(a->log_level, b->log_level);
  assert_string_equal(a->transports, b->transports);
}

static void round_trip(const kvf__config *orig) {
  kvf__config *back = malloc(sizeof *back);
  char err[ERRLEN];
  assert_non_null(back);
  char *text = capture(dump_text_fn, orig);
  kvf__config_defaults(back);
  int rc = kvf__config_parse(back, text, strlen(text), "dump", err, sizeof err);
  if (rc) fail_msg("dump does not parse back: %s\n%s", err, text);
  assert_same_config(orig, back);
  for (size_t i = 0; i < sizeof all_keys / sizeof all_keys[0]; i++)
    if (strcmp(all_keys[i], "peer") && strcmp(all_keys[i], "pool"))
      assert_contains(text, all_keys[i]);
  free(text);
  free(back);
}

static void test_dump_round_trip(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  round_trip(c); /* the defaults, node unset */
  assert_int_equal(parse_str(c, every_key, err), 0);
  round_trip(c);
  const char *odd = "node n\npeer-listen off\npeer x [::1]:9\n"
                    "pool a host 12K\npool b host 3G gpu-direct=off\nmax-frame 1052672\n"
                    "gpu-direct off\nrdma-bounce-size 3M\n";
  assert_int_equal(parse_str(c, odd, err), 0);
  assert_int_equal(c->pools[0].gpu_direct, KVF__GDR_AUTO);
  assert_int_equal(c->pools[1].gpu_direct, KVF__GDR_OFF);
  assert_int_equal(c->gpu_direct, KVF__GDR_OFF);
  assert_int_equal(c->rdma_bounce_size, 3u << 20);
  round_trip(c);
}

static void test_dump_json(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  assert_int_equal(parse_str(c, "node n\napi-socket /tmp/q\"b\\s\xff\xc3\xa9\n"
                                "api-allow-users 1,2\npeer x [::1]:9\npeer y h:1\n"
                                "pool a host 4K\n", err), 0);
  char *json = capture(dump_json_fn, c);
  assert_int_equal(json[0], '{');
  assert_string_equal(json + strlen(json) - 2, "}\n");
  assert_contains(json, "\"node\":\"n\"");
  assert_contains(json, "\"api-socket\":\"/tmp/q\\\"b\\\\s\\ufffd\xc3\xa9\"");
  assert_contains(json, "\"api-allow-users\":[1,2]");
  assert_contains(json, "\"peers\":[{\"name\":\"x\",\"host\":\"::1\",\"port\":9},"
                        "{\"name\":\"y\",\"host\":\"h\",\"port\":1}]");
  assert_contains(json, "\"pools\":[{\"name\":\"a\",\"kind\":\"host\",\"size\":4096,\"gpu_direct\":\"auto\"}]");
  assert_contains(json, "\"mlock\":true");
  assert_contains(json, "\"max-frame\":67108864");
  assert_contains(json, "\"hugepages\":\"auto\"");
  free(json);
}

static void test_error_leaves_config_untouched(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  const char *text = "node changed\ntcp-streams 9\npool a host 4K\nbogus\n";
  assert_int_equal(kvf__config_parse(c, text, strlen(text), "t", err, sizeof err), -EINVAL);
  assert_string_equal(c->node, "");
  assert_int_equal(c->tcp_streams, 4);
  assert_int_equal(c->n_pools, 0);
  /* A tiny or absent error buffer is fine. */
  assert_int_equal(kvf__config_parse(c, "bogus", 5, "t", err, 4), -EINVAL);
  assert_int_equal(strlen(err), 3);
  assert_int_equal(kvf__config_parse(c, "bogus", 5, "t", NULL, 0), -EINVAL);
}

static void test_long_lines_and_garbage(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  size_t big = 5000;
  char *text = malloc(big + 32);
  assert_non_null(text);
  /* Exactly 4096 bytes is a (bad) line; 4097 is too long. */
  memset(text, 'a', big);
  memcpy(text, "node ", 5);
  assert_int_equal(kvf__config_parse(c, text, 4096, "t", err, sizeof err), -EINVAL);
  assert_contains(err, "not a valid name");
  assert_int_equal(kvf__config_parse(c, text, 4097, "t", err, sizeof err), -EINVAL);
  assert_contains(err, "t:1: line longer than 4096");
  memcpy(text, "# ok\n", 5);
  assert_int_equal(kvf__config_parse(c, text, big, "t", err, sizeof err), -EINVAL);
  assert_contains(err, "t:2: line longer");
  /* A word list longer than any line may carry. */
  for (size_t i = 0; i + 2 < 4000; i += 2) memcpy(text + i, "a ", 2);
  assert_int_equal(kvf__config_parse(c, text, 4000, "t", err, sizeof err), -EINVAL);
  assert_int_equal(kvf__config_parse(c, "node a\0b\n", 9, "t", err, sizeof err), -EINVAL);
  assert_contains(err, "NUL");
  /* Random bytes, biased to the bytes the parser cares about. */
  static const char alphabet[] = "node peer pool 0123456789KMG:[]#,\n\t \r\xff\x80 host cuda:";
  unsigned seed = 12345;
  for (int round = 0; round < 3000; round++) {
    size_t n = (size_t)(rand_r(&seed) % 300);
    for (size_t i = 0; i < n; i++)
      text[i] = (char)(rand_r(&seed) % 4 ? alphabet[rand_r(&seed) % (sizeof alphabet - 1)]
                                         : rand_r(&seed));
    kvf__config_defaults(c);
    int rc = kvf__config_parse(c, text, n, "fuzz", err, sizeof err);
    assert_true(rc == 0 || (rc < 0 && strncmp(err, "fuzz:", 5) == 0));
    char *dump = capture(dump_text_fn, c);
    free(dump);
  }
  free(text);
}

static void test_load(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN], path[] = "/tmp/kvf-test-config-XXXXXX";
  assert_int_equal(kvf__config_load(c, "/nonexistent/kvferryd.conf", err, sizeof err), -ENOENT);
  assert_contains(err, "/nonexistent/kvferryd.conf");
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  const char *text = "node from-file\n\ntcp-streams 99\n";
  assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
  close(fd);
  assert_int_equal(kvf__config_load(c, path, err, sizeof err), -ERANGE);
  char want[64];
  snprintf(want, sizeof want, "%s:3: ", path);
  assert_contains(err, want);
  unlink(path);
}

/* The documented example must be a valid configuration. */
static void test_example_file(void **state) {
  kvf__config *c = *state;
  char err[ERRLEN];
  const char *path = "config/kvferryd.conf";
  if (access(path, R_OK) != 0) path = "../../config/kvferryd.conf";
  if (access(path, R_OK) != 0) skip();
  assert_int_equal(kvf__config_load(c, path, err, sizeof err), 0);
  assert_int_equal(kvf__config_validate(c, err, sizeof err), 0);
  /* ...and document every key, as "# key ARGS" heading its paragraph. */
  FILE *f = fopen(path, "r");
  static char text[65536];
  assert_non_null(f);
  text[fread(text, 1, sizeof text - 1, f)] = '\0';
  fclose(f);
  for (size_t i = 0; i < sizeof all_keys / sizeof all_keys[0]; i++) {
    char want[64];
    snprintf(want, sizeof want, "\n# %s ", all_keys[i]);
    assert_contains(text, want);
  }
  assert_int_equal(c->n_pools, 1);
  assert_string_equal(c->pools[0].kind, "host");
  assert_int_equal(c->pools[0].size, 256u << 20);
}

/* Runs fn with stderr redirected into a pipe; returns what was written. */
static char *capture_stderr(void (*fn)(void)) {
  static char buf[8192];
  int fds[2], saved = dup(2);
  assert_int_equal(pipe(fds), 0);
  dup2(fds[1], 2);
  close(fds[1]);
  fn();
  dup2(saved, 2);
  close(saved);
  ssize_t n = read(fds[0], buf, sizeof buf - 1);
  close(fds[0]);
  buf[n > 0 ? n : 0] = '\0';
  return buf;
}

static void log_some(void) {
  kvf__log_set_level(KVF__LOG_WARN);
  kvf__info("dropped");
  kvf__warn("kept %d\nsecond half\n", 7);
  kvf__err("bad");
  kvf__log_set_level(KVF__LOG_INFO);
}

static void log_huge(void) {
  static char big[10000];
  memset(big, 'x', sizeof big - 1);
  kvf__info("%s", big);
}

static void test_log(void **state) {
  setenv("JOURNAL_STREAM", "8:1234", 1);
  kvf__log_init(KVF__LOG_INFO);
  assert_string_equal(capture_stderr(log_some), "<4>warn: kept 7 second half\n<3>err: bad\n");
  unsetenv("JOURNAL_STREAM");
  kvf__log_init(KVF__LOG_INFO);
  char *out = capture_stderr(log_some);
  assert_contains(out, "Z kvferryd[");
  assert_contains(out, "]: warn: kept 7 second half\n");
  assert_null(strstr(out, "dropped"));
  out = capture_stderr(log_huge);
  assert_int_equal(strlen(out), 4096);
  assert_string_equal(out + 4092, "...\n");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_defaults, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_every_key, setup_cfg, teardown_cfg),
      cmocka_unit_test(test_sizes),
      cmocka_unit_test(test_bounds),
      cmocka_unit_test_setup_teardown(test_limits_of_names, setup_cfg, teardown_cfg),
      cmocka_unit_test(test_unknown_key),
      cmocka_unit_test_setup_teardown(test_duplicates_rejected_by_validate, setup_cfg,
                                      teardown_cfg),
      cmocka_unit_test_setup_teardown(test_timing_validated, setup_cfg, teardown_cfg),
      cmocka_unit_test(test_frame_slack),
      cmocka_unit_test_setup_teardown(test_addresses, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_cluster_key_file, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_comments_and_blanks, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_repeated_keys, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_too_many_repeats, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_missing_node, setup_cfg, teardown_cfg),
      cmocka_unit_test(test_help_lists_every_key),
      cmocka_unit_test_setup_teardown(test_dump_round_trip, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_dump_json, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_error_leaves_config_untouched, setup_cfg,
                                      teardown_cfg),
      cmocka_unit_test_setup_teardown(test_long_lines_and_garbage, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_load, setup_cfg, teardown_cfg),
      cmocka_unit_test_setup_teardown(test_example_file, setup_cfg, teardown_cfg),
      cmocka_unit_test(test_log),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
