/* registry.c - membership through etcd (registry.h).
 *
 * etcd's v3 API is gRPC; its JSON gateway (POST /v3/...) serves the same
 * calls over plain HTTP/1.1, which libcurl speaks, so the daemon needs no
 * gRPC stack. Keys and values are base64 in that JSON, 64-bit integers are
 * strings.
 *
 * Why a thread, and how it meets the loop: the loop must never wait on the
 * network, and libcurl's multi interface could be driven from libuv's
 * poll handles, but that couples curl's socket callbacks to every loop
 * turn for a few requests a second. Instead one registry thread owns a
 * curl multi handle holding the long-lived watch stream and, one at a
 * time, the short requests (lease grant, keepalive, txn, range); it
 * blocks in curl_multi_poll, never the loop. What the loop must know
 * (members that appeared, changed or went) travels as mails through a
 * mailbox of its own (mailbox.h), in the order etcd reported it; status
 * (reachable, registered, errors) is a small struct under a mutex that
 * status, doctor and metrics copy. The thread touches no loop state.
 *
 * Registration is a transaction: create PREFIX/nodes/NODE only if absent
 * (create_revision == 0), with our lease. When the key exists and names
 * another incarnation, it is either a live daemon (it keeps its lease
 * alive) or a dead one's (kill -9: the lease runs out within its TTL): at
 * start we retry until that lease's granted TTL (plus a second) has
 * passed, then refuse to start. When etcd cannot be reached, the members
 * stay as they were (transfers go on), requests are retried with backoff
 * (100 ms doubling to 2 s) across the configured endpoints, and once etcd
 * answers, a lease it no longer knows means a new registration, and a
 * fresh range of the prefix (then a watch from its revision) reconciles
 * the members. */
#include "registry.h"

#include <curl/curl.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "json.h"
#include "kvferryd.h"
#include "mailbox.h"
#include "metrics.h"
#include "sbuf.h"
#include "peer.h"
#ifdef KVF_FAILPOINTS
#include "failpoint.h"
#endif

#define MAX_ENDPOINTS 8
#define BACKOFF_MIN_MS 100u
#define BACKOFF_MAX_MS 2000u
#define CONNECT_TIMEOUT_MS 1000L
#define RECORD_MAX 1024
#define RESP_MAX (16u << 20) /* a range of 256 records is ~100 KiB */

/* One change for the loop. */
typedef struct member {
  bool put;                /* else the record went */
  kvf__peer_cfg cfg;
  uint64_t incarnation;
} member;

typedef struct reg_mail {
  kvf__mail mail;
  bool snapshot;           /* the whole membership: members not in it go */
  size_t n;
  member m[];
} reg_mail;

typedef struct buf {
  char *p;
  size_t n, cap;
} buf;

static struct {
  /* set before the thread starts, then read-only */
  char endpoints[MAX_ENDPOINTS][300];
  size_t n_ep;
  char prefix[600];       /* PREFIX/nodes/ */
  char key[700];          /* PREFIX/nodes/NODE */
  char node[KVF__NAME_MAX + 1];
  char listen_host[256];
  int listen_port;
  char transports[64];
  uint64_t incarnation, started_unix_ms;
  uint32_t ttl_s;
  bool on;
  /* the thread's own */
  size_t ep;
  CURLM *multi;
  CURL *watch;
  buf wbuf;               /* watch bytes not yet split into lines */
  bool watching;
  uint64_t lease;
  bool registered;
  uint64_t rev;
  uint32_t backoff_ms;
  char local_ip[64];
  pthread_t th;
  bool th_started;
  atomic_bool stop;
  /* the loop's */
  kvf__mailbox mb;
  bool mb_open;
  /* shared */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  kvf__registry_info info;  /* under lock */
  int first;                /* under lock: 1 until the first outcome, then its rc */
  char conflict[300];       /* under lock: who holds our name */
} R = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER, .first = 1};

/* ------------------------------------------------------------- base64 */

static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

void kvf__b64_encode(const void *in, size_t n, char *out) {
  const unsigned char *s = in;
  size_t o = 0;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = (uint32_t)s[i] << 16;
    if (i + 1 < n) v |= (uint32_t)s[i + 1] << 8;
    if (i + 2 < n) v |= s[i + 2];
    out[o++] = b64[v >> 18];
    out[o++] = b64[(v >> 12) & 63];
    out[o++] = i + 1 < n ? b64[(v >> 6) & 63] : '=';
    out[o++] = i + 2 < n ? b64[v & 63] : '=';
  }
  out[o] = '\0';
}

static int b64_value(char c) {
  const char *p = c ? strchr(b64, c) : NULL;
  return p ? (int)(p - b64) : -1;
}

int kvf__b64_decode(const char *in, size_t len, char *out, size_t cap) {
  if (len % 4) return -EINVAL;
  size_t o = 0;
  for (size_t i = 0; i < len; i += 4) {
    int v[4], pad = 0;
    for (int k = 0; k < 4; k++) {
      if (in[i + k] == '=' && i + 4 == len && k >= 2) {
        v[k] = 0;
        pad++;
        continue;
      }
      if (pad || (v[k] = b64_value(in[i + k])) < 0) return -EINVAL;
    }
    uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
    for (int k = 0; k < 3 - pad; k++) {
      if (o + 1 >= cap) return -ENOSPC;
      out[o++] = (char)((w >> (16 - 8 * k)) & 0xff);
    }
  }
  if (cap == 0) return -ENOSPC;
  out[o] = '\0';
  return (int)o;
}

/* ------------------------------------------------------------- status */

static void set_state(const char *state, const char *error) {
  pthread_mutex_lock(&R.lock);
  if (strcmp(R.info.state, state) != 0) R.info.since_ns = kvf__now_ns();
  snprintf(R.info.state, sizeof R.info.state, "%s", state);
  R.info.reachable = strcmp(state, "unreachable") != 0;
  R.info.registered = R.registered;
  R.info.lease = R.lease;
  R.info.rev = R.rev;
  snprintf(R.info.endpoint, sizeof R.info.endpoint, "%s", R.endpoints[R.ep]);
  if (error) snprintf(R.info.last_error, sizeof R.info.last_error, "%s", error);
  pthread_mutex_unlock(&R.lock);
}

void kvf__registry_get(kvf__registry_info *out) {
  pthread_mutex_lock(&R.lock);
  *out = R.info;
  pthread_mutex_unlock(&R.lock);
  if (!out->on) snprintf(out->state, sizeof out->state, "off");
}

/* The first outcome, for kvf__registry_start (waiting on cond). */
static void first_outcome(int rc) {
  pthread_mutex_lock(&R.lock);
  if (R.first == 1) {
    R.first = rc;
    pthread_cond_broadcast(&R.cond);
  }
  pthread_mutex_unlock(&R.lock);
}

/* ------------------------------------------------------------- curl */

static int buf_add(buf *b, const char *p, size_t n) {
  if (b->n + n + 1 > RESP_MAX) return -EFBIG;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + n + 1) cap *= 2;
    char *q = realloc(b->p, cap);
    if (!q) return -ENOMEM;
    b->p = q;
    b->cap = cap;
  }
  memcpy(b->p + b->n, p, n);
  b->n += n;
  b->p[b->n] = '\0';
  return 0;
}

static size_t on_body(char *p, size_t size, size_t n, void *arg) {
  return buf_add(arg, p, size * n) == 0 ? size * n : 0;
}

static void process_watch(void);

/* Runs the multi handle until e is done (the watch, if any, is served
 * meanwhile); its CURLcode, or CURLE_ABORTED_BY_CALLBACK when stopping. */
static CURLcode run_until(CURL *e) {
  CURLcode result = CURLE_OK;
  for (bool done = false; !done;) {
    int running;
    curl_multi_perform(R.multi, &running);
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(R.multi, &left)) != NULL) {
      if (msg->msg != CURLMSG_DONE) continue;
      if (msg->easy_handle == e) {
        done = true;
        result = msg->data.result;
      } else if (msg->easy_handle == R.watch) {
        R.watching = false; /* the stream ended: resync */
      }
    }
    process_watch();
    if (done || !e) break;
    if (atomic_load(&R.stop)) return CURLE_ABORTED_BY_CALLBACK;
    curl_multi_poll(R.multi, NULL, 0, 100, NULL);
  }
  return result;
}

static CURL *easy(const char *path, const char *body, buf *out, long timeout_ms) {
  char url[400];
  snprintf(url, sizeof url, "%s%s", R.endpoints[R.ep], path);
  CURL *e = curl_easy_init();
  if (!e) return NULL;
  curl_easy_setopt(e, CURLOPT_URL, url);
  curl_easy_setopt(e, CURLOPT_COPYPOSTFIELDS, body);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, out);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, CONNECT_TIMEOUT_MS);
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, timeout_ms);
  return e;
}

/* One request; 0 with *out the body of a 200 answer, else -EIO and err. */
static int call(const char *path, const char *body, buf *out, char *err, size_t errlen) {
  out->n = 0;
  long timeout = (long)R.ttl_s * 1000 / 3;
  CURL *e = easy(path, body, out, timeout < 2000 ? timeout : 2000);
  if (!e) return -ENOMEM;
  curl_multi_add_handle(R.multi, e);
  CURLcode cc = run_until(e);
  long code = 0;
  curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code);
  char *ip = NULL;
  if (cc == CURLE_OK && curl_easy_getinfo(e, CURLINFO_LOCAL_IP, &ip) == CURLE_OK && ip)
    snprintf(R.local_ip, sizeof R.local_ip, "%s", ip);
  curl_multi_remove_handle(R.multi, e);
  curl_easy_cleanup(e);
  if (cc != CURLE_OK) {
    snprintf(err, errlen, "%s%s: %s", R.endpoints[R.ep], path, curl_easy_strerror(cc));
    return -EIO;
  }
  if (code != 200 || !out->p) {
    snprintf(err, errlen, "%s%s: HTTP %ld %.80s", R.endpoints[R.ep], path, code,
             out->p ? out->p : "");
    return -EIO;
  }
  return 0;
}

/* A JSON string holding a decimal (etcd's int64s); 0 when missing. */
static uint64_t json_num(const char *obj, const char *key) {
  char s[32] = "";
  uint64_t v = 0;
  if (kvf__json_get_str(obj, key, s, sizeof s) == 0) return strtoull(s, NULL, 10);
  if (kvf__json_get_u64(obj, key, &v) == 0) return v;
  return 0;
}

/* ------------------------------------------------------------- records */

static void b64_of(const char *s, char *out, size_t cap) {
  size_t n = strlen(s);
  if (4 * ((n + 2) / 3) + 1 > cap) n = 0; /* callers size out for their strings */
  kvf__b64_encode(s, n, out);
}

static void our_record(char *out, size_t cap) {
  const char *host = R.listen_host;
  if (!host[0] || !strcmp(host, "0.0.0.0") || !strcmp(host, "::")) host = R.local_ip;
  char qnode[200], qhost[300];
  kvf__json_quote(qnode, sizeof qnode, R.node);
  kvf__json_quote(qhost, sizeof qhost, host);
  snprintf(out, cap,
           "{\"node\":%s,\"host\":%s,\"port\":%d,\"transports\":\"%s\",\"incarnation\":\"%" PRIu64
           "\",\"started_unix_ms\":%" PRIu64 "}",
           qnode, qhost, R.listen_port, R.transports, R.incarnation, R.started_unix_ms);
}

/* A record (value decoded) into m; -EINVAL when it is not one. */
static int parse_record(const char *name, const char *v, member *m) {
  char inc[32] = "";
  uint64_t port = 0;
  memset(m, 0, sizeof *m);
  m->put = true;
  if (!kvf__config_valid_name(name) || kvf__json_get_str(v, "host", m->cfg.host, sizeof m->cfg.host) ||
      kvf__json_get_u64(v, "port", &port) || port == 0 || port > 65535 ||
      kvf__json_get_str(v, "incarnation", inc, sizeof inc))
    return -EINVAL;
  snprintf(m->cfg.name, sizeof m->cfg.name, "%s", name);
  m->cfg.port = (uint16_t)port;
  m->incarnation = strtoull(inc, NULL, 10);
  return m->cfg.host[0] ? 0 : -EINVAL;
}

/* One kv of a range or watch event into m: 0, or -EINVAL (skip it). */
static int kv_member(const char *kv, bool put, member *m) {
  char key64[1024], key[768], val64[4096], val[3072];
  if (!kv || kvf__json_get_str(kv, "key", key64, sizeof key64)) return -EINVAL;
  if (kvf__b64_decode(key64, strlen(key64), key, sizeof key) < 0) return -EINVAL;
  size_t pl = strlen(R.prefix);
  if (strncmp(key, R.prefix, pl) != 0) return -EINVAL;
  const char *name = key + pl;
  if (!strcmp(name, R.node)) return -EINVAL; /* ourselves */
  if (!put) {
    memset(m, 0, sizeof *m);
    snprintf(m->cfg.name, sizeof m->cfg.name, "%.63s", name);
    return kvf__config_valid_name(name) ? 0 : -EINVAL;
  }
  if (kvf__json_get_str(kv, "value", val64, sizeof val64) ||
      kvf__b64_decode(val64, strlen(val64), val, sizeof val) < 0)
    return -EINVAL;
  if (parse_record(name, val, m)) {
    kvf__warn("registry: ignoring the malformed record of '%.63s'", name);
    return -EINVAL;
  }
  return 0;
}

/* ------------------------------------------------------------- the loop's side */

static void apply(const member *m) {
  if (m->put) kvf__peers_member_put(&m->cfg, m->incarnation);
  else kvf__peers_member_gone(m->cfg.name, "its registry record went: it left, or its lease expired");
}

static bool in_snapshot(const reg_mail *rm, const char *name) {
  for (size_t i = 0; i < rm->n; i++)
    if (!strcmp(rm->m[i].cfg.name, name)) return true;
  return false;
}

static void on_mail(kvf__mail *mail) {
  reg_mail *rm = kvf__container_of(mail, reg_mail, mail);
  if (rm->snapshot && !kvfd.stopping) {
    for (size_t i = 0; i < kvf__peer_count();) {
      kvf__peer *p = kvf__peer_at(i);
      if (p->registered && !in_snapshot(rm, p->cfg.name))
        kvf__peers_member_gone(p->cfg.name, "not in the registry any more");
      else i++;
    }
  }
  for (size_t i = 0; i < rm->n && !kvfd.stopping; i++) apply(&rm->m[i]);
  free(rm);
}

size_t kvf__registry_members(void) {
  size_t n = 0;
  for (size_t i = 0; i < kvf__peer_count(); i++) n += kvf__peer_at(i)->registered;
  return n;
}

/* The registry's state as one JSON object (status), or a text line. */
void kvf__registry_render(kvf__sbuf *b, bool json) {
  kvf__registry_info ri;
  kvf__registry_get(&ri);
  double since = ri.since_ns ? (double)(kvf__now_ns() - ri.since_ns) / 1e9 : 0;
  if (!json) {
    if (!ri.on) {
      kvf__sb_printf(b, "registry        off\n");
      return;
    }
    kvf__sb_printf(b, "registry        %s for %.1f s (%s, %zu members, %llu failed requests)%s%s\n",
                   ri.state, since, ri.endpoint, kvf__registry_members(),
                   (unsigned long long)ri.failures, ri.reachable ? "" : ": ",
                   ri.reachable ? "" : ri.last_error);
    return;
  }
  if (!ri.on) {
    kvf__sb_printf(b, ", \"registry\": null");
    return;
  }
  kvf__sb_printf(b, ", \"registry\": {\"state\": \"%s\", \"reachable\": %s, \"registered\": %s, "
                    "\"state_for_s\": %.3f, \"members\": %zu, \"failures\": %llu, "
                    "\"registrations\": %llu, \"revision\": %llu, \"endpoint\": ",
                 ri.state, ri.reachable ? "true" : "false", ri.registered ? "true" : "false", since,
                 kvf__registry_members(), (unsigned long long)ri.failures,
                 (unsigned long long)ri.registrations, (unsigned long long)ri.rev);
  kvf__sb_json_str(b, ri.endpoint);
  kvf__sb_printf(b, ", \"last_error\": ");
  kvf__sb_json_str(b, ri.last_error);
  kvf__sb_printf(b, "}");
}

static void metrics(kvf__sbuf *b) {
  kvf__registry_info ri;
  kvf__registry_get(&ri);
  kvf__metrics_family(b, "kvferry_registry_reachable", "gauge",
                      "1 while etcd (the registry) answers; 0 while the last known members are kept.");
  kvf__sb_printf(b, "kvferry_registry_reachable %d\n", ri.reachable);
  kvf__metrics_family(b, "kvferry_registry_registered", "gauge",
                      "1 while this daemon's record is in etcd under a live lease.");
  kvf__sb_printf(b, "kvferry_registry_registered %d\n", ri.registered);
  kvf__metrics_family(b, "kvferry_registry_members", "gauge", "Peers known through the registry.");
  kvf__sb_printf(b, "kvferry_registry_members %zu\n", kvf__registry_members());
  kvf__metrics_family(b, "kvferry_registry_failures_total", "counter", "Requests to etcd that failed.");
  kvf__sb_printf(b, "kvferry_registry_failures_total %llu\n", (unsigned long long)ri.failures);
  kvf__metrics_family(b, "kvferry_registry_registrations_total", "counter",
                      "Records written to etcd: 1, plus one per registration after a lost lease.");
  kvf__sb_printf(b, "kvferry_registry_registrations_total %llu\n", (unsigned long long)ri.registrations);
}

/* Thread: hands the changes of a range or watch answer to the loop. */
static void post(const char *arr, bool snapshot, bool events) {
  size_t n = 0;
  for (const char *it = arr, *e; it && (e = kvf__json_next(&it));) n++;
  reg_mail *rm = calloc(1, sizeof *rm + (n ? n : 1) * sizeof(member));
  if (!rm) return; /* the next resync catches up */
  rm->snapshot = snapshot;
  for (const char *it = arr, *e; it && (e = kvf__json_next(&it));) {
    char type[16] = "PUT";
    const char *kv = e;
    if (events) {
      kvf__json_get_str(e, "type", type, sizeof type);
      kv = kvf__json_get(e, "kv");
      uint64_t rev = json_num(kv, "mod_revision");
      if (rev > R.rev) R.rev = rev;
    }
    if (kv_member(kv, strcmp(type, "DELETE") != 0, &rm->m[rm->n]) == 0) rm->n++;
  }
  kvf__mailbox_post(&R.mb, &rm->mail, on_mail);
}

/* ------------------------------------------------------------- etcd calls */

static void range_end_of(const char *prefix, char *out, size_t cap) {
  char end[700];
  snprintf(end, sizeof end, "%s", prefix);
  end[strlen(end) - 1]++; /* PREFIX/nodes/ .. PREFIX/nodes0: every key under it */
  b64_of(end, out, cap);
}

static void watch_stop(void) {
  if (!R.watch) return;
  curl_multi_remove_handle(R.multi, R.watch);
  curl_easy_cleanup(R.watch);
  R.watch = NULL;
  R.watching = false;
  R.wbuf.n = 0;
}

/* Thread: complete lines of the watch stream, one JSON object each. */
static void process_watch(void) {
  char *nl;
  while (R.wbuf.n && (nl = memchr(R.wbuf.p, '\n', R.wbuf.n)) != NULL) {
    *nl = '\0';
    const char *res = kvf__json_get(R.wbuf.p, "result");
    if (!res || kvf__json_get_bool(res, "canceled", false) || json_num(res, "compact_revision"))
      R.watching = false; /* an error, or our revision was compacted: resync */
    else if (kvf__json_get(res, "events"))
      post(kvf__json_get(res, "events"), false, true);
    size_t used = (size_t)(nl + 1 - R.wbuf.p);
    memmove(R.wbuf.p, nl + 1, R.wbuf.n - used);
    R.wbuf.n -= used;
  }
}

static void pause_ms(uint32_t ms);

/* Range of the prefix (the whole membership), then a watch from there. */
static int sync_members(char *err, size_t errlen) {
  char key64[1024], end64[1024], body[2200];
  buf out = {0};
  watch_stop();
#ifdef KVF_FAILPOINTS
  if (kvf__failpoint(KVF__FP_REGISTRY_SLOW_SYNC)) pause_ms(1000);
#endif
  b64_of(R.prefix, key64, sizeof key64);
  range_end_of(R.prefix, end64, sizeof end64);
  snprintf(body, sizeof body, "{\"key\":\"%s\",\"range_end\":\"%s\"}", key64, end64);
  int rc = call("/v3/kv/range", body, &out, err, errlen);
  if (rc == 0) {
    R.rev = json_num(kvf__json_get(out.p, "header"), "revision");
    post(kvf__json_get(out.p, "kvs"), true, false);
    snprintf(body, sizeof body,
             "{\"create_request\":{\"key\":\"%s\",\"range_end\":\"%s\",\"start_revision\":\"%" PRIu64 "\"}}",
             key64, end64, R.rev + 1);
    R.watch = easy("/v3/watch", body, &R.wbuf, 0);
    if (R.watch && curl_multi_add_handle(R.multi, R.watch) == CURLM_OK) R.watching = true;
    else rc = -ENOMEM;
  }
  free(out.p);
  return rc;
}

static int grant(char *err, size_t errlen) {
  char body[64];
  buf out = {0};
  snprintf(body, sizeof body, "{\"TTL\":\"%" PRIu32 "\"}", R.ttl_s);
  int rc = call("/v3/lease/grant", body, &out, err, errlen);
  if (rc == 0 && !(R.lease = json_num(out.p, "ID"))) {
    snprintf(err, errlen, "lease grant: no lease in the answer");
    rc = -EIO;
  }
  free(out.p);
  return rc;
}

/* The granted TTL of a lease, in ms (ours when etcd does not say). */
static uint64_t lease_ttl_ms(uint64_t lease) {
  char body[64], err[64];
  buf out = {0};
  uint64_t ttl = R.ttl_s;
  snprintf(body, sizeof body, "{\"ID\":\"%" PRIu64 "\"}", lease);
  if (lease && call("/v3/lease/timetolive", body, &out, err, sizeof err) == 0 &&
      json_num(out.p, "grantedTTL"))
    ttl = json_num(out.p, "grantedTTL");
  free(out.p);
  return ttl * 1000;
}

static int put_ours(const char *key64, const char *val64, char *err, size_t errlen) {
  char body[RECORD_MAX * 2 + 1200];
  buf out = {0};
  snprintf(body, sizeof body, "{\"key\":\"%s\",\"value\":\"%s\",\"lease\":\"%" PRIu64 "\"}", key64,
           val64, R.lease);
  int rc = call("/v3/kv/put", body, &out, err, errlen);
  free(out.p);
  return rc;
}

/* Creates our record if absent: 0; -EEXIST (R.conflict says who, *holder
 * its lease) when another incarnation holds the name; -EIO. */
static int try_register(uint64_t *holder, char *err, size_t errlen) {
  char rec[RECORD_MAX], key64[1024], val64[RECORD_MAX * 2], body[RECORD_MAX * 2 + 4096];
  int rc = grant(err, errlen);
  if (rc) return rc;
  our_record(rec, sizeof rec);
  b64_of(R.key, key64, sizeof key64);
  b64_of(rec, val64, sizeof val64);
  snprintf(body, sizeof body,
           "{\"compare\":[{\"key\":\"%s\",\"target\":\"CREATE\",\"create_revision\":\"0\"}],"
           "\"success\":[{\"request_put\":{\"key\":\"%s\",\"value\":\"%s\",\"lease\":\"%" PRIu64 "\"}}],"
           "\"failure\":[{\"request_range\":{\"key\":\"%s\"}}]}",
           key64, key64, val64, R.lease, key64);
  buf out = {0};
  rc = call("/v3/kv/txn", body, &out, err, errlen);
  if (rc == 0 && !kvf__json_get_bool(out.p, "succeeded", false)) {
    const char *it = kvf__json_get(out.p, "responses"), *resp = it ? kvf__json_next(&it) : NULL;
    const char *kvs = kvf__json_get(kvf__json_get(resp, "response_range"), "kvs");
    const char *kv = kvs ? kvf__json_next(&kvs) : NULL;
    char v64[RECORD_MAX * 2] = "", v[RECORD_MAX * 2] = "";
    member m;
    kvf__json_get_str(kv, "value", v64, sizeof v64);
    kvf__b64_decode(v64, strlen(v64), v, sizeof v);
    if (kv && parse_record(R.node, v, &m) == 0 && m.incarnation == R.incarnation) {
      rc = put_ours(key64, val64, err, errlen); /* ours, from a lease etcd forgot */
    } else {
      *holder = json_num(kv, "lease");
      pthread_mutex_lock(&R.lock);
      snprintf(R.conflict, sizeof R.conflict, "%.250s", v[0] ? v : "(unreadable record)");
      pthread_mutex_unlock(&R.lock);
      snprintf(err, errlen, "node name '%s' is held in etcd by another incarnation: %.150s", R.node, v);
      rc = -EEXIST;
    }
  }
  free(out.p);
  if (rc == 0) {
    R.registered = true;
    pthread_mutex_lock(&R.lock);
    R.info.registrations++;
    pthread_mutex_unlock(&R.lock);
    kvf__info("registry: registered %s (lease %" PRIx64 ", %s)", R.key, R.lease, rec);
  }
  return rc;
}

/* 0: alive; -ENOENT: etcd no longer knows our lease; -EIO. */
static int keepalive(char *err, size_t errlen) {
  char body[64];
  buf out = {0};
  snprintf(body, sizeof body, "{\"ID\":\"%" PRIu64 "\"}", R.lease);
  int rc = call("/v3/lease/keepalive", body, &out, err, errlen);
  if (rc == 0) {
    const char *res = kvf__json_get(out.p, "result");
    if (!res) {
      snprintf(err, errlen, "lease keepalive: %.100s", out.p);
      rc = -EIO;
    } else if (!json_num(res, "TTL")) {
      snprintf(err, errlen, "etcd no longer knows our lease (expired)");
      rc = -ENOENT;
    }
  }
  free(out.p);
  return rc;
}

/* ------------------------------------------------------------- the thread */

/* Waits ms (or until stopped), serving the watch meanwhile. */
static void pause_ms(uint32_t ms) {
  uint64_t until = kvf__now_ns() + (uint64_t)ms * 1000000ull;
  while (!atomic_load(&R.stop)) {
    uint64_t now = kvf__now_ns();
    if (now >= until) break;
    int left = (int)((until - now) / 1000000ull) + 1;
    curl_multi_poll(R.multi, NULL, 0, left, NULL);
    run_until(NULL);
  }
}

static void failed(int rc, const char *err) {
  if (atomic_load(&R.stop)) return; /* the request was cut short by our stop, not by etcd */
  pthread_mutex_lock(&R.lock);
  R.info.failures++;
  bool was_reachable = R.info.reachable;
  pthread_mutex_unlock(&R.lock);
  if (rc == -EEXIST) {
    set_state("conflict", err);
    kvf__err("registry: %s", err);
  } else {
    if (was_reachable) kvf__warn("registry: etcd unreachable (%s); keeping the last known members", err);
    set_state("unreachable", err);
    watch_stop();
    if (R.n_ep > 1) R.ep = (R.ep + 1) % R.n_ep;
  }
  R.backoff_ms = R.backoff_ms ? R.backoff_ms * 2 : BACKOFF_MIN_MS;
  if (R.backoff_ms > BACKOFF_MAX_MS) R.backoff_ms = BACKOFF_MAX_MS;
  pause_ms(R.backoff_ms);
}

static void succeeded(void) {
  bool was;
  pthread_mutex_lock(&R.lock);
  was = R.info.reachable;
  pthread_mutex_unlock(&R.lock);
  if (!was) kvf__info("registry: etcd answers again (%s)", R.endpoints[R.ep]);
  R.backoff_ms = 0;
  set_state(R.registered ? "registered" : "registering", NULL);
}

/* At start: retries a held name until the holder's lease would have run
 * out (a dead incarnation's record goes by then); -EEXIST past that. */
static int register_first(char *err, size_t errlen) {
  uint64_t deadline = 0;
  for (;;) {
    uint64_t holder = 0;
    int rc = try_register(&holder, err, errlen);
    if (rc != -EEXIST || atomic_load(&R.stop)) return rc;
    uint64_t now = kvf__now_ns();
    if (!deadline) deadline = now + (lease_ttl_ms(holder) + 1000) * 1000000ull;
    if (now >= deadline) return rc;
    kvf__info("registry: node name '%s' still held in etcd; waiting for that lease to expire", R.node);
    pause_ms(250);
  }
}

static void *thread_main(void *arg) {
  char err[300];
  uint64_t next_ka = 0;
  char serr[300];
  int rc = register_first(err, sizeof err);
  /* The members too before the daemon serves (kvf__registry_start applies
   * them): an engine's first send may name any of them, and must not be
   * refused with KVF_ENOPEER for coming early. Failing, it is retried. */
  int synced = rc == 0 ? sync_members(serr, sizeof serr) : 0;
  first_outcome(rc);
  if (rc == -EEXIST) return NULL; /* the daemon stops */
  if (rc) failed(rc, err);
  else if (synced) failed(synced, serr);
  else succeeded();
  while (!atomic_load(&R.stop)) {
    if (!R.registered) {
      uint64_t holder;
      if ((rc = try_register(&holder, err, sizeof err)) != 0) {
        failed(rc, err);
        continue;
      }
      next_ka = kvf__now_ns() + (uint64_t)R.ttl_s * 1000000000ull / 3;
      succeeded();
    }
    if (!R.watching) {
      if ((rc = sync_members(err, sizeof err)) != 0) {
        failed(rc, err);
        continue;
      }
      succeeded();
    }
    uint64_t now = kvf__now_ns();
    if (now >= next_ka) {
      rc = keepalive(err, sizeof err);
      if (rc == -ENOENT) {
        kvf__warn("registry: %s; registering again", err);
        R.registered = false;
        succeeded();
        continue;
      }
      if (rc) {
        failed(rc, err);
        continue;
      }
      succeeded();
      next_ka = now + (uint64_t)R.ttl_s * 1000000000ull / 3;
      continue;
    }
    pause_ms((uint32_t)((next_ka - now) / 1000000ull) + 1);
  }
  pthread_mutex_lock(&R.lock);
  bool reachable = R.info.reachable;
  pthread_mutex_unlock(&R.lock);
  if (R.registered && reachable) { /* leave now rather than when the lease runs out */
    char body[64];
    buf out = {0};
    snprintf(body, sizeof body, "{\"ID\":\"%" PRIu64 "\"}", R.lease);
    atomic_store(&R.stop, false); /* let this one request run */
    call("/v3/lease/revoke", body, &out, err, sizeof err);
    free(out.p);
  }
  return NULL;
}

/* ------------------------------------------------------------- start/stop */

static int parse_url(const char *url, char *err, size_t errlen) {
  const char *ep = url + strlen("etcd://"), *slash = strchr(ep, '/');
  R.n_ep = 0;
  while (ep < slash && R.n_ep < MAX_ENDPOINTS) {
    const char *end = memchr(ep, ',', (size_t)(slash - ep));
    if (!end) end = slash;
    snprintf(R.endpoints[R.n_ep++], sizeof R.endpoints[0], "http://%.*s", (int)(end - ep), ep);
    ep = end + 1;
  }
  const char *prefix = slash + 1;
  size_t pl = strlen(prefix);
  while (pl && prefix[pl - 1] == '/') pl--;
  snprintf(R.prefix, sizeof R.prefix, "/%.*s/nodes/", (int)pl, prefix);
  snprintf(R.key, sizeof R.key, "%s%s", R.prefix, kvfd.cfg.node);
  if (!R.n_ep) {
    snprintf(err, errlen, "registry: no endpoint in %s", url);
    return -EINVAL;
  }
  return 0;
}

int kvf__registry_start(uv_loop_t *loop, char *err, size_t errlen) {
  if (!kvfd.cfg.registry[0]) return 0;
  int rc = parse_url(kvfd.cfg.registry, err, errlen);
  if (rc) return rc;
  snprintf(R.node, sizeof R.node, "%s", kvfd.cfg.node);
  snprintf(R.listen_host, sizeof R.listen_host, "%s", kvfd.cfg.listen_host);
  snprintf(R.transports, sizeof R.transports, "%s", kvfd.cfg.transports);
  R.listen_port = kvf__peers_listen_port();
  R.incarnation = kvfd.session;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  R.started_unix_ms = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
  R.ttl_s = (kvfd.cfg.registry_ttl_ms + 999) / 1000;
  R.info.on = R.on = true;
  R.info.reachable = true; /* until a request fails */
  snprintf(R.info.state, sizeof R.info.state, "registering");
  snprintf(R.info.endpoint, sizeof R.info.endpoint, "%s", R.endpoints[0]);
  if (curl_global_init(CURL_GLOBAL_DEFAULT) != 0 || !(R.multi = curl_multi_init())) {
    snprintf(err, errlen, "registry: libcurl does not initialise");
    return -ENOMEM;
  }
  if ((rc = kvf__mailbox_init(&R.mb, loop)) != 0) {
    snprintf(err, errlen, "registry: %s", uv_strerror(rc));
    return rc;
  }
  R.mb_open = true;
  kvf__mailbox_hold(&R.mb, false);
  if ((rc = pthread_create(&R.th, NULL, thread_main, NULL)) != 0) {
    snprintf(err, errlen, "registry: no thread: %s", strerror(rc));
    return -rc;
  }
  R.th_started = true;
  kvf__metrics_add_collector(metrics);
  /* Wait for the first outcome: a held name must stop us before we serve. */
  pthread_mutex_lock(&R.lock);
  while (R.first == 1) pthread_cond_wait(&R.cond, &R.lock);
  rc = R.first;
  pthread_mutex_unlock(&R.lock);
  if (rc == -EEXIST) {
    pthread_join(R.th, NULL);
    R.th_started = false;
    snprintf(err, errlen,
             "registry: node name '%s' is held by a live kvferryd of another incarnation "
             "(its record under %s: %s); refusing to start (pick another node name, or stop that "
             "daemon)", R.node, R.key, R.conflict);
    return -EEXIST;
  }
  kvf__mailbox_drain(&R.mb); /* the first membership, on this (the loop's) thread before it serves */
  if (rc) kvf__warn("registry: etcd (%s) does not answer yet; starting with static peers only, "
                    "retrying in the background", kvfd.cfg.registry);
  return 0;
}

static void on_mb_closed(kvf__mailbox *mb) { (void)mb; }

void kvf__registry_stop(void) {
  if (!R.on) return;
  if (R.th_started) {
    atomic_store(&R.stop, true);
    curl_multi_wakeup(R.multi);
    pthread_join(R.th, NULL);
    R.th_started = false;
  }
  if (R.mb_open) {
    R.mb_open = false;
    kvf__mailbox_close(&R.mb, on_mb_closed);
  }
  watch_stop();
  if (R.multi) curl_multi_cleanup(R.multi);
  R.multi = NULL;
  free(R.wbuf.p);
  R.wbuf = (buf){0};
}
