/* harness.c - see harness.h. Test-only code: clarity over speed, except in
 * the pattern loops, which touch hundreds of MiB per test file. */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>

/* ================================================================ errors */

static _Thread_local char lasterr[2048];

const char *h_lasterr(void) { return lasterr[0] ? lasterr : "(no detail)"; }

int h_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(lasterr, sizeof lasterr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "kvf-harness: %s\n", lasterr);
  return -1;
}

uint64_t h_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

int h_left_ms(uint64_t end) {
  uint64_t now = h_now_ms();
  return now >= end ? 0 : (int)(end - now);
}

void h_sleep_ms(unsigned ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* ================================================================ process */

#define H_MAX_DIRS 16
static char dirs[H_MAX_DIRS][H_PATH_MAX];
static size_t ndirs;

void h_init(void) {
  /* Line-buffered so that the TAP lines already printed survive when the
   * runner's timeout kills us. */
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* A daemon closing a socket under us must give EPIPE, not kill the test. */
  signal(SIGPIPE, SIG_IGN);
}

int h_mkdtemp(char *out, size_t cap) {
  const char *tmp = getenv("TMPDIR");
  /* The daemons' sockets live in the dir; keep room for sun_path. */
  if (!tmp || !*tmp || strlen(tmp) > 60) tmp = "/tmp";
  if ((size_t)snprintf(out, cap, "%s/kvferry-test.XXXXXX", tmp) >= cap)
    return h_fail("temp dir path too long");
  if (!mkdtemp(out)) return h_fail("mkdtemp(%s): %s", out, strerror(errno));
  if (ndirs < H_MAX_DIRS) snprintf(dirs[ndirs++], H_PATH_MAX, "%s", out);
  /* tests/run.sh looks for this line to show the logs of a failed run. */
  fprintf(stderr, "kvf-harness: temp dir %s\n", out);
  return 0;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  remove(path);
  return 0;
}

int h_cleanup(int failed) {
  const char *keep = getenv("KVF_TEST_KEEP");
  for (size_t i = 0; i < ndirs; i++) {
    if (failed || (keep && *keep && strcmp(keep, "0") != 0))
      fprintf(stderr, "kvf-harness: kept %s (daemon logs: %s/*.log)\n", dirs[i], dirs[i]);
    else
      nftw(dirs[i], rm_one, 16, FTW_DEPTH | FTW_PHYS);
  }
  ndirs = 0;
  return failed;
}

int h_free_ports(uint16_t *ports, size_t n) {
  int fds[8];
  int rc = 0;
  size_t opened = 0;
  if (n > 8) return h_fail("h_free_ports: at most 8");
  for (; opened < n; opened++) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &al) != 0) {
      rc = h_fail("picking a free port: %s", strerror(errno));
      if (fd >= 0) close(fd);
      break;
    }
    fds[opened] = fd;
    ports[opened] = ntohs(a.sin_port);
  }
  for (size_t i = 0; i < opened; i++) close(fds[i]);
  return rc;
}

void h_daemon_init(h_daemon *d, const char *dir, const char *name, uint16_t port,
                   const char *pool_size) {
  memset(d, 0, sizeof *d);
  snprintf(d->name, sizeof d->name, "%s", name);
  snprintf(d->dir, sizeof d->dir, "%s", dir);
  snprintf(d->conf, sizeof d->conf, "%s/%s.conf", dir, name);
  snprintf(d->sock, sizeof d->sock, "%s/%s.sock", dir, name);
  snprintf(d->log, sizeof d->log, "%s/%s.log", dir, name);
  snprintf(d->pool_size, sizeof d->pool_size, "%s", pool_size);
  d->port = port;
}

int h_daemon_add_peer(h_daemon *d, const h_daemon *peer) {
  if (d->npeers == H_MAX_PEERS) return h_fail("too many peers");
  snprintf(d->peer_name[d->npeers], sizeof d->peer_name[0], "%s", peer->name);
  d->peer_port[d->npeers] = peer->port;
  d->npeers++;
  return 0;
}

/* KVF_TEST_TRANSPORT (default tcp) is what the daemons carry data with:
 * with rdma (make check-rdma, in the soft-RoCE VM) control stays on
 * loopback and each daemon's RDMA CM listener binds the next address of
 * KVF_TEST_RDMA_IPS (space separated, in the order daemons are first
 * written: prefill, decode, ...), on the devices of the same position in
 * KVF_TEST_RDMA_DEVICES when set (e.g. "rxe0,rxe2 rxe1,rxe3"). */
static const char *test_transport(void) {
  const char *t = getenv("KVF_TEST_TRANSPORT");
  return t && *t ? t : "tcp";
}

/* The word at position i of a space separated list, or "" past its end. */
static void nth_word(const char *list, size_t i, char *out, size_t cap) {
  out[0] = 0;
  for (const char *p = list ? list : ""; *p;) {
    size_t n = strcspn(p, " ");
    if (n && i-- == 0) {
      snprintf(out, cap, "%.*s", (int)n, p);
      return;
    }
    p += n + (p[n] == ' ');
  }
}

static void write_rdma_conf(FILE *f, const h_daemon *d) {
  static char names[16][64];
  static size_t n_names;
  size_t i = 0;
  char ip[64], devs[256];
  while (i < n_names && strcmp(names[i], d->name)) i++;
  if (i == n_names && n_names < 16) snprintf(names[n_names++], sizeof names[0], "%s", d->name);
  nth_word(getenv("KVF_TEST_RDMA_IPS"), i, ip, sizeof ip);
  nth_word(getenv("KVF_TEST_RDMA_DEVICES"), i, devs, sizeof devs);
  if (ip[0]) fprintf(f, "rdma-listen %s:0\n", ip);
  if (devs[0]) fprintf(f, "rdma-devices %s\n", devs);
}

/* KVF_TEST_CONF_<NAME> (NAME upper-cased: PREFILL, DECODE): more config
 * lines for that daemon, separated by ';' (e.g. "gpu-direct off", for the
 * rdma bounce path); KVF_TEST_POOL_<NAME>: words appended to its pool line
 * (e.g. "gpu-direct=off"). */
static const char *role_env(const char *what, const char *name, char *buf, size_t cap) {
  char key[96];
  size_t n = (size_t)snprintf(key, sizeof key, "KVF_TEST_%s_", what);
  for (const char *p = name; *p && n + 1 < sizeof key; p++) key[n++] = (char)(*p >= 'a' && *p <= 'z' ? *p - 32 : *p);
  key[n] = 0;
  const char *v = getenv(key);
  snprintf(buf, cap, "%s", v ? v : "");
  for (char *p = buf; *p; p++)
    if (*p == ';') *p = '\n';
  return buf;
}

int h_daemon_write_conf(const h_daemon *d) {
  char conf_env[512], pool_env[128];
  const char *lvl = getenv("KVF_TEST_LOG_LEVEL");
  FILE *f = fopen(d->conf, "w");
  if (!f) return h_fail("%s: %s", d->conf, strerror(errno));
  fprintf(f, "# written by tests/integration/harness.c\n"
             "node %s\napi-socket %s\npeer-listen 127.0.0.1:%u\n",
          d->name, d->sock, d->port);
  for (size_t i = 0; i < d->npeers; i++)
    fprintf(f, "peer %s 127.0.0.1:%u\n", d->peer_name[i], d->peer_port[i]);
  /* Fast heartbeats and reconnects keep the crash tests short; max-descs
   * above the 20000-descriptor case. */
  if (strcmp(test_transport(), "rdma") == 0) write_rdma_conf(f, d);
  fprintf(f, "pool kv host %s %s\n"
             "heartbeat-ms 100\npeer-timeout-ms 1000\n"
             "reconnect-min-ms 50\nreconnect-max-ms 500\n"
             "transports %s\nmax-descs 100000\nlog-level %s\n%s\n%s\n",
          d->pool_size, role_env("POOL", d->name, pool_env, sizeof pool_env), test_transport(),
          lvl && *lvl ? lvl : "info", d->extra, role_env("CONF", d->name, conf_env, sizeof conf_env));
  if (fclose(f) != 0) return h_fail("%s: %s", d->conf, strerror(errno));
  return 0;
}

static const char *build_dir(void) {
  const char *b = getenv("BUILD");
  return b && *b ? b : "build";
}

/* In the child: output to the log, nothing inherited but 0-2, and death
 * with the test (a killed test binary must not leave daemons behind). */
static void exec_daemon(const h_daemon *d, const char *exe, pid_t parent) {
  int log = open(d->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
  int null = open("/dev/null", O_RDONLY);
  if (log < 0 || null < 0) _exit(126);
  dup2(null, 0);
  dup2(log, 1);
  dup2(log, 2);
  long maxfd = sysconf(_SC_OPEN_MAX);
  for (long fd = 3; fd < (maxfd > 0 && maxfd < 65536 ? maxfd : 65536); fd++) close((int)fd);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(125);
  setenv("KVF_STRICT", "1", 1); /* a transfer state-table violation aborts the daemon */
  execl(exe, exe, "-c", d->conf, (char *)NULL);
  fprintf(stderr, "kvf-harness: exec %s: %s\n", exe, strerror(errno));
  _exit(127);
}

static void log_marker(const h_daemon *d, const char *what) {
  FILE *f = fopen(d->log, "a");
  if (!f) return;
  fprintf(f, "=== kvf-harness: %s %s (start %u) ===\n", what, d->name, d->starts);
  fclose(f);
}

/* Reaps d if it exited; returns 1 and fills *st when it did. */
static int reaped(h_daemon *d, int *st) {
  if (d->pid <= 0) return 0;
  pid_t r = waitpid(d->pid, st, WNOHANG);
  if (r == d->pid) {
    d->pid = 0;
    return 1;
  }
  return 0;
}

static int wait_api(h_daemon *d, int timeout_ms) {
  uint64_t end = h_now_ms() + (uint64_t)timeout_ms;
  int st, rc = 0;
  for (;;) {
    kvf_client *c = NULL;
    if (reaped(d, &st)) {
      h_daemon_log_tail(d, 30);
      return h_fail("%s exited during start (status 0x%x); log %s", d->name, st, d->log);
    }
    rc = kvf_connect(d->sock, &c);
    if (rc == 0) {
      kvf_close(c);
      return 0;
    }
    if (h_now_ms() > end) break;
    h_sleep_ms(20);
  }
  h_daemon_log_tail(d, 30);
  return h_fail("%s: API socket %s not answering after %d ms (last: %s); log %s", d->name,
                d->sock, timeout_ms, kvf_err_name(rc), d->log);
}

int h_daemon_spawn(h_daemon *d) {
  char exe[H_PATH_MAX];
  snprintf(exe, sizeof exe, "%s/%s", build_dir(), d->exe[0] ? d->exe : "kvferryd");
  if (access(exe, X_OK) != 0)
    return h_fail("%s not found (run from the repository root, or set BUILD)", exe);
  if (h_daemon_write_conf(d) != 0) return -1;
  d->starts++;
  log_marker(d, "starting");
  fflush(NULL);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return h_fail("fork: %s", strerror(errno));
  if (pid == 0) exec_daemon(d, exe, parent);
  d->pid = pid;
  return wait_api(d, H_READY_MS);
}

/* 1 when every configured peer of d shows "state": "up" in json. */
static int peers_up(const h_daemon *d, const char *json) {
  const char *it = hj_get(json, "peers"), *e;
  size_t up = 0;
  if (!it || *it != '[') return 0;
  while ((e = hj_next(&it))) {
    char name[64], state[32];
    if (hj_str(e, "name", name, sizeof name) || hj_str(e, "state", state, sizeof state))
      continue;
    for (size_t i = 0; i < d->npeers; i++)
      if (!strcmp(name, d->peer_name[i]) && !strcmp(state, "up")) up++;
  }
  return up == d->npeers;
}

int h_daemon_wait_peers(h_daemon *d, int timeout_ms) {
  kvf_client *c = NULL;
  char *json = NULL;
  int rc = kvf_connect(d->sock, &c), st;
  if (rc) return h_fail("%s: connect %s: %s", d->name, d->sock, kvf_err_name(rc));
  uint64_t end = h_now_ms() + (uint64_t)timeout_ms;
  for (;;) {
    free(json);
    json = NULL;
    rc = kvf_inspect(c, KVF_INSPECT_PEERS, 1, &json);
    if (rc == 0 && peers_up(d, json)) break;
    if (h_now_ms() > end || reaped(d, &st)) {
      h_daemon_log_tail(d, 30);
      rc = h_fail("%s: peers not all up after %d ms (inspect: %s): %s; log %s", d->name,
                  timeout_ms, kvf_err_name(rc), json ? json : "-", d->log);
      break;
    }
    h_sleep_ms(20);
  }
  free(json);
  kvf_close(c);
  return rc ? -1 : 0;
}

int h_daemon_stop(h_daemon *d) {
  int st = 0;
  if (d->pid <= 0) return 0;
  log_marker(d, "SIGTERM to");
  kill(d->pid, SIGTERM);
  uint64_t end = h_now_ms() + H_STOP_MS;
  while (!reaped(d, &st)) {
    if (h_now_ms() > end) {
      kill(d->pid, SIGKILL);
      waitpid(d->pid, &st, 0);
      d->pid = 0;
      h_daemon_log_tail(d, 30);
      return h_fail("%s did not exit within %d ms of SIGTERM; log %s", d->name, H_STOP_MS,
                    d->log);
    }
    h_sleep_ms(10);
  }
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
  h_daemon_log_tail(d, 40);
  if (WIFSIGNALED(st))
    return h_fail("%s died of signal %d after SIGTERM; log %s", d->name, WTERMSIG(st), d->log);
  return h_fail("%s exited %d after SIGTERM (sanitizer report?); log %s", d->name,
                WEXITSTATUS(st), d->log);
}

int h_daemon_kill9(h_daemon *d) {
  int st;
  if (d->pid <= 0) return h_fail("%s is not running", d->name);
  log_marker(d, "SIGKILL to");
  if (kill(d->pid, SIGKILL) != 0) return h_fail("kill: %s", strerror(errno));
  waitpid(d->pid, &st, 0);
  d->pid = 0;
  return 0;
}

void h_daemon_log_tail(const h_daemon *d, int lines) {
  static char buf[64 * 1024];
  FILE *f = fopen(d->log, "r");
  size_t n = 0;
  int ok = f != NULL;
  if (f) {
    /* The last 64 KiB hold far more than the lines asked for. */
    if (fseek(f, -(long)sizeof buf + 1, SEEK_END) != 0) rewind(f);
    n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
  }
  buf[n] = 0;
  const char *p = buf + n;
  for (int seen = 0; p > buf; p--)
    if (p[-1] == '\n' && p != buf + n && ++seen >= lines) break;
  fprintf(stderr, "---- last %d lines of %s ----\n%s%s---- end of %s ----\n", lines, d->log,
          ok ? p : "(unreadable)\n", n && buf[n - 1] != '\n' ? "\n" : "", d->log);
}

int h_pair_start(h_pair *p, const char *pool_size) { return h_pair_start_ex(p, pool_size, NULL, NULL); }

int h_pair_start_ex(h_pair *p, const char *pool_size, const char *prefill_exe, const char *extra) {
  uint16_t ports[2];
  memset(p, 0, sizeof *p);
  if (h_mkdtemp(p->dir, sizeof p->dir) || h_free_ports(ports, 2)) return -1;
  h_daemon_init(&p->prefill, p->dir, "prefill", ports[0], pool_size);
  h_daemon_init(&p->decode, p->dir, "decode", ports[1], pool_size);
  h_daemon_add_peer(&p->prefill, &p->decode);
  h_daemon_add_peer(&p->decode, &p->prefill);
  snprintf(p->prefill.exe, sizeof p->prefill.exe, "%s", prefill_exe ? prefill_exe : "");
  snprintf(p->prefill.extra, sizeof p->prefill.extra, "%s", extra ? extra : "");
  snprintf(p->decode.extra, sizeof p->decode.extra, "%s", extra ? extra : "");
  if (h_daemon_spawn(&p->prefill) || h_daemon_spawn(&p->decode)) return -1;
  return h_pair_wait_up(p);
}

int h_pair_wait_up(h_pair *p) {
  if (h_daemon_wait_peers(&p->prefill, H_READY_MS)) return -1;
  return h_daemon_wait_peers(&p->decode, H_READY_MS);
}

int h_pair_stop(h_pair *p) {
  /* Stop both even when the first fails; report the first failure. */
  int a = h_daemon_stop(&p->prefill);
  int b = h_daemon_stop(&p->decode);
  return a ? a : b;
}

/* ================================================================ clients */

int h_client_open(h_client *hc, const h_daemon *d) {
  kvf_pool_info info;
  void *addr = NULL;
  int rc;
  memset(hc, 0, sizeof *hc);
  if ((rc = kvf_connect(d->sock, &hc->c)))
    return h_fail("connect to %s (%s): %s", d->name, d->sock, kvf_err_name(rc));
  snprintf(hc->node, sizeof hc->node, "%s", kvf_node(hc->c));
  if (strcmp(hc->node, d->name))
    rc = h_fail("kvf_node says %s, expected %s", hc->node, d->name);
  else if ((rc = kvf_pool_find(hc->c, "kv", &info)))
    rc = h_fail("%s: kvf_pool_find(kv): %s", d->name, kvf_err_name(rc));
  else if ((rc = kvf_pool_map(hc->c, info.id, &addr, &hc->size)))
    rc = h_fail("%s: kvf_pool_map(%u): %s", d->name, info.id, kvf_err_name(rc));
  else if (hc->size != info.size)
    rc = h_fail("%s: mapped %" PRIu64 " bytes, pool is %" PRIu64, d->name, hc->size, info.size);
  if (rc) {
    kvf_close(hc->c);
    hc->c = NULL;
    return -1;
  }
  hc->pool = info.id;
  hc->base = addr;
  return 0;
}

void h_client_close(h_client *hc) {
  if (hc->c) kvf_close(hc->c);
  memset(hc, 0, sizeof *hc);
}

static const char *ev_name(int type) {
  return type == KVF_EV_RECV_DONE ? "RECV_DONE" : type == KVF_EV_SEND_DONE ? "SEND_DONE" : "?";
}

static int ev_match(const kvf_event *ev, const char *id, int type) {
  return !strcmp(ev->xfer_id, id) && (type == 0 || ev->type == type);
}

static int take_stashed(h_client *hc, const char *id, int type, kvf_event *out) {
  for (size_t i = 0; i < hc->nstash; i++) {
    if (!ev_match(&hc->stash[i], id, type)) continue;
    *out = hc->stash[i];
    memmove(&hc->stash[i], &hc->stash[i + 1], (hc->nstash - i - 1) * sizeof hc->stash[0]);
    hc->nstash--;
    return 1;
  }
  return 0;
}

static int stash_or_take(h_client *hc, const kvf_event *ev, const char *id, int type,
                         kvf_event *out, int *found) {
  if (!*found && ev_match(ev, id, type)) {
    *out = *ev;
    *found = 1;
  } else if (hc->nstash < H_STASH) {
    hc->stash[hc->nstash++] = *ev;
  } else {
    return h_fail("%s: event stash full (stray events?)", hc->node);
  }
  return 0;
}

int h_wait_event(h_client *hc, const char *xfer_id, int type, int timeout_ms,
                 kvf_event *out) {
  kvf_event evs[16];
  int found = take_stashed(hc, xfer_id, type, out);
  uint64_t end = h_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
  while (!found) {
    int left = h_left_ms(end);
    int n = kvf_wait_events(hc->c, evs, 16, left);
    if (n < 0) {
      h_fail("%s: kvf_wait_events: %s", hc->node, kvf_err_name(n));
      return n;
    }
    for (int i = 0; i < n; i++)
      if (stash_or_take(hc, &evs[i], xfer_id, type, out, &found)) return -1;
    if (!found && left == 0) {
      h_fail("%s: no %s event for %s within %d ms (%zu other events waiting)", hc->node,
             type ? ev_name(type) : "any", xfer_id, timeout_ms, hc->nstash);
      return -ETIMEDOUT;
    }
  }
  return 0;
}

int h_no_events(h_client *hc, int ms) {
  kvf_event ev;
  int n = 0;
  if (hc->nstash) {
    ev = hc->stash[0];
  } else {
    n = kvf_wait_events(hc->c, &ev, 1, ms);
    if (n < 0) return h_fail("%s: kvf_wait_events: %s", hc->node, kvf_err_name(n));
    if (n == 0) return 0;
  }
  return h_fail("%s: stray event type %d for %s status %s (%zu stashed)", hc->node, ev.type,
                ev.xfer_id, kvf_err_name(ev.status), hc->nstash);
}

int h_inspect(kvf_client *c, int what, char **json) {
  int rc = kvf_inspect(c, what, 1, json);
  if (rc) return h_fail("kvf_inspect(%d): %s", what, kvf_err_name(rc));
  return 0;
}

int h_rdma_resets(h_client *hc, uint64_t *n) {
  char *json = NULL;
  *n = 0;
  if (h_inspect(hc->c, KVF_INSPECT_STATUS, &json)) return -1;
  const char *r = hj_get(json, "rdma"), *peers = r && *r == '{' ? hj_get(r, "peers") : NULL, *p;
  while (peers && *peers == '[' && (p = hj_next(&peers))) {
    uint64_t k = 0;
    hj_u64(p, "resets", &k);
    *n += k;
  }
  free(json);
  return 0;
}

int h_rdma_qps(h_client *hc, size_t *all, size_t *connected) {
  char *json = NULL;
  *all = *connected = 0;
  if (h_inspect(hc->c, KVF_INSPECT_STATUS, &json)) return -1;
  const char *r = hj_get(json, "rdma"), *peers = r ? hj_get(r, "peers") : NULL, *p;
  if (peers && *peers != '[') peers = NULL;
  while (peers && (p = hj_next(&peers))) {
    const char *qps = hj_get(p, "qps"), *q;
    if (qps && *qps != '[') qps = NULL;
    while (qps && (q = hj_next(&qps))) {
      char state[32];
      (*all)++;
      if (!hj_str(q, "state", state, sizeof state) && !strcmp(state, "connected")) (*connected)++;
    }
  }
  free(json);
  return r ? 0 : h_fail("%s: status has no rdma section", hc->node);
}

int h_status_u64(kvf_client *c, const char *key, uint64_t *out) {
  char *json = NULL;
  if (h_inspect(c, KVF_INSPECT_STATUS, &json)) return -1;
  int rc = hj_u64(json, key, out);
  if (rc) h_fail("STATUS has no number \"%s\": %s", key, json);
  free(json);
  return rc;
}

/* 1 when the STATUS document shows no active grant, send or transfer. */
static int idle(const char *json) {
  static const char *keys[] = {"grants_active", "sends_active", "transfers_active"};
  for (size_t i = 0; i < 3; i++) {
    uint64_t v;
    if (hj_u64(json, keys[i], &v) || v != 0) return 0;
  }
  return 1;
}

int h_wait_idle(kvf_client *c, int timeout_ms) {
  uint64_t end = h_now_ms() + (uint64_t)timeout_ms;
  char *json = NULL, *xfers = NULL;
  for (;;) {
    free(json);
    json = NULL;
    if (h_inspect(c, KVF_INSPECT_STATUS, &json)) return -1;
    if (idle(json)) break;
    if (h_now_ms() > end) {
      h_inspect(c, KVF_INSPECT_TRANSFERS, &xfers);
      h_fail("%s still busy after %d ms (leak?): STATUS %s TRANSFERS %s", kvf_node(c),
             timeout_ms, json, xfers ? xfers : "-");
      free(xfers);
      free(json);
      return -1;
    }
    h_sleep_ms(20);
  }
  free(json);
  return 0;
}

/* ================================================================ patterns */

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static inline uint64_t block_key(uint64_t seed, uint64_t index) {
  return mix64(seed * 0x9e3779b97f4a7c15ull ^ mix64(index + 0x5bd1e995u));
}

/* Word j of a block: splitmix64 at position j, so any word is computable
 * alone and a shifted copy never matches. */
static inline uint64_t word_at(uint64_t key, uint64_t j) {
  return mix64(key + (j + 1) * 0x9e3779b97f4a7c15ull);
}

void h_fill(void *p, uint64_t len, uint64_t seed, uint64_t index) {
  uint8_t *b = p;
  uint64_t key = block_key(seed, index), j;
  for (j = 0; j < len / 8; j++) {
    uint64_t w = word_at(key, j);
    memcpy(b + j * 8, &w, 8);
  }
  if (len % 8) {
    uint64_t w = word_at(key, j);
    memcpy(b + j * 8, &w, len % 8);
  }
}

#define H_POISON 0xA5

void h_poison(void *p, uint64_t len) { memset(p, H_POISON, len); }

int64_t h_verify(const void *p, uint64_t len, uint64_t seed, uint64_t index) {
  const uint8_t *b = p;
  uint64_t key = block_key(seed, index);
  for (uint64_t j = 0; j * 8 < len; j++) {
    uint64_t w = word_at(key, j), n = len - j * 8 < 8 ? len - j * 8 : 8;
    if (memcmp(b + j * 8, &w, n) == 0) continue;
    for (uint64_t k = 0; k < n; k++)
      if (b[j * 8 + k] != ((const uint8_t *)&w)[k]) return (int64_t)(j * 8 + k);
  }
  return -1;
}

int64_t h_verify_poison(const void *p, uint64_t len) {
  const uint8_t *b = p;
  for (uint64_t i = 0; i < len; i++)
    if (b[i] != H_POISON) return (int64_t)i;
  return -1;
}

uint64_t h_layout(kvf_desc *d, size_t n, uint32_t pool, uint64_t base, uint64_t len,
                  bool scatter, uint64_t seed) {
  size_t slots = scatter ? n + n / 8 + 1 : n;
  size_t *perm = malloc(slots * sizeof *perm);
  uint64_t s = seed | 1;
  if (!perm) abort();
  for (size_t i = 0; i < slots; i++) perm[i] = i;
  for (size_t i = slots; scatter && i > 1; i--) {
    s = mix64(s + 0x9e3779b97f4a7c15ull);
    size_t j = (size_t)(s % i), t = perm[i - 1];
    perm[i - 1] = perm[j];
    perm[j] = t;
  }
  for (size_t i = 0; i < n; i++)
    d[i] = (kvf_desc){.pool = pool, .offset = base + perm[i] * len, .len = len};
  free(perm);
  return base + slots * len;
}

uint64_t h_desc_bytes(const kvf_desc *d, size_t n) {
  uint64_t t = 0;
  for (size_t i = 0; i < n; i++) t += d[i].len;
  return t;
}

void h_id(char *out, size_t cap, const char *prefix) {
  static atomic_ulong counter;
  snprintf(out, cap, "%s-%d-%lu", prefix, (int)getpid(), atomic_fetch_add(&counter, 1) + 1);
}

/* ================================================================ transfers */

int h_post_grant(h_client *rcv, const h_xfer *x, const char *src_node) {
  int rc = kvf_grant(rcv->c, x->id, x->anon_src ? NULL : src_node, x->dst, x->ndst,
                     x->deadline_ms);
  if (rc) return h_fail("%s: kvf_grant(%s, %zu descs): %s", rcv->node, x->id, x->ndst,
                        kvf_err_name(rc));
  return 0;
}

int h_post_send(h_client *snd, const h_xfer *x, const char *dst_node) {
  size_t parts = x->parts ? x->parts : 1;
  if (parts > x->nsrc) return h_fail("test bug: %zu parts for %zu descs", parts, x->nsrc);
  for (size_t k = 0; k < parts; k++) {
    size_t a = k * x->nsrc / parts, b = (k + 1) * x->nsrc / parts;
    unsigned flags = k + 1 < parts ? KVF_SEND_MORE : 0;
    int rc = kvf_send(snd->c, x->id, dst_node, x->src + a, b - a, flags, x->deadline_ms);
    if (rc) return h_fail("%s: kvf_send(%s, part %zu/%zu): %s", snd->node, x->id, k + 1,
                          parts, kvf_err_name(rc));
  }
  return 0;
}

/* Fails unless every descriptor lies inside the client's mapping (the test
 * itself must not fault on a bad layout). */
static int check_inside(const h_client *hc, const kvf_desc *d, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (d[i].pool != hc->pool || d[i].offset > hc->size || d[i].len > hc->size - d[i].offset)
      return h_fail("test bug: desc %zu (%" PRIu64 "+%" PRIu64 ") outside %s's pool", i,
                    d[i].offset, d[i].len, hc->node);
  return 0;
}

static void span(const kvf_desc *d, size_t n, uint64_t *lo, uint64_t *hi) {
  *lo = UINT64_MAX;
  *hi = 0;
  for (size_t i = 0; i < n; i++) {
    if (d[i].offset < *lo) *lo = d[i].offset;
    if (d[i].offset + d[i].len > *hi) *hi = d[i].offset + d[i].len;
  }
}

int h_prepare(h_client *snd, h_client *rcv, const h_xfer *x) {
  uint64_t lo, hi;
  if (check_inside(snd, x->src, x->nsrc) || check_inside(rcv, x->dst, x->ndst)) return -1;
  span(x->dst, x->ndst, &lo, &hi);
  /* Same node: one pool; poisoning the span must not hit the sources. */
  for (size_t i = 0; !strcmp(snd->node, rcv->node) && i < x->nsrc; i++)
    if (x->src[i].offset < hi && x->src[i].offset + x->src[i].len > lo)
      return h_fail("test bug: source %zu overlaps the destination span", i);
  for (size_t i = 0; i < x->nsrc; i++)
    h_fill(snd->base + x->src[i].offset, x->src[i].len, x->seed, i);
  if (x->ndst) h_poison(rcv->base + lo, hi - lo);
  return 0;
}

static int by_offset(const void *a, const void *b) {
  uint64_t x = ((const kvf_desc *)a)->offset, y = ((const kvf_desc *)b)->offset;
  return x < y ? -1 : x > y;
}

/* The bytes of the destination span not covered by any descriptor must
 * still be poison: catches writes past a descriptor's end. */
static int verify_gaps(h_client *rcv, const h_xfer *x) {
  kvf_desc *sorted = malloc(x->ndst * sizeof *sorted);
  uint64_t lo, hi, cur;
  int rc = 0;
  if (!sorted) abort();
  memcpy(sorted, x->dst, x->ndst * sizeof *sorted);
  qsort(sorted, x->ndst, sizeof *sorted, by_offset);
  span(x->dst, x->ndst, &lo, &hi);
  cur = lo;
  for (size_t k = 0; k < x->ndst && !rc; k++) {
    const kvf_desc *d = &sorted[k];
    if (d->offset > cur) {
      int64_t bad = h_verify_poison(rcv->base + cur, d->offset - cur);
      if (bad >= 0)
        rc = h_fail("%s: %s wrote outside its grant at pool offset %" PRIu64, rcv->node,
                    x->id, cur + (uint64_t)bad);
    }
    if (d->offset + d->len > cur) cur = d->offset + d->len;
  }
  free(sorted);
  return rc;
}

int h_verify_dst(h_client *rcv, const h_xfer *x) {
  for (size_t i = 0; i < x->ndst; i++) {
    int64_t bad = h_verify(rcv->base + x->dst[i].offset, x->dst[i].len, x->seed, i);
    if (bad >= 0)
      return h_fail("%s: %s: descriptor %zu/%zu (offset %" PRIu64 ", len %" PRIu64
                    ") wrong at byte %" PRId64 " (got 0x%02x)",
                    rcv->node, x->id, i, x->ndst, x->dst[i].offset, x->dst[i].len, bad,
                    rcv->base[x->dst[i].offset + (uint64_t)bad]);
  }
  return verify_gaps(rcv, x);
}

int h_check_event(const kvf_event *ev, int type, const char *path, const char *peer,
                  uint64_t bytes, uint64_t ndesc) {
  if (ev->type != type)
    return h_fail("%s: event type %d, expected %s", ev->xfer_id, ev->type, ev_name(type));
  if (ev->status != 0)
    return h_fail("%s: %s failed: %s (%s)", ev->xfer_id, ev_name(type),
                  kvf_err_name(ev->status), ev->error);
  /* The suite names the remote path "tcp"; it means the one under test
   * (KVF_TEST_PATH when that is more precise: "rdma-bounce"). */
  const char *want = getenv("KVF_TEST_PATH"), *recv = getenv("KVF_TEST_RECV_PATH");
  if (path && !strcmp(path, "tcp")) path = want && *want ? want : test_transport();
  /* The receiver's word when it differs (rdma: only the sender stages) */
  if (path && type == KVF_EV_RECV_DONE && recv && *recv) path = recv;
  if (path && strcmp(ev->path, path))
    return h_fail("%s: %s path \"%s\", expected \"%s\"", ev->xfer_id, ev_name(type), ev->path,
                  path);
  if (peer && strcmp(ev->peer, peer))
    return h_fail("%s: %s peer \"%s\", expected \"%s\"", ev->xfer_id, ev_name(type), ev->peer,
                  peer);
  if (ev->bytes != bytes || ev->descriptors != ndesc)
    return h_fail("%s: %s says %" PRIu64 " bytes / %" PRIu64 " descriptors, expected %" PRIu64
                  " / %" PRIu64,
                  ev->xfer_id, ev_name(type), ev->bytes, ev->descriptors, bytes, ndesc);
  return 0;
}

static int post_both(h_client *snd, h_client *rcv, const h_xfer *x) {
  if (x->send_first)
    return h_post_send(snd, x, rcv->node) || h_post_grant(rcv, x, snd->node) ? -1 : 0;
  return h_post_grant(rcv, x, snd->node) || h_post_send(snd, x, rcv->node) ? -1 : 0;
}

/* After a failed handoff: cancels whatever is still active on either side
 * and swallows the events that follow, so that one failure does not leave
 * work behind that later checks (idle, no stray events) would trip on. The
 * first failure's detail is kept. */
static void abandon(h_client *snd, h_client *rcv, const char *id) {
  char keep[sizeof lasterr];
  kvf_event ev;
  memcpy(keep, lasterr, sizeof keep);
  if (kvf_cancel(rcv->c, id) == 0) h_wait_event(rcv, id, KVF_EV_RECV_DONE, 2000, &ev);
  if (kvf_cancel(snd->c, id) == 0) h_wait_event(snd, id, KVF_EV_SEND_DONE, 2000, &ev);
  memcpy(lasterr, keep, sizeof keep);
}

/* x granted and sent, and both its events taken (whatever their status). */
static int transfer_events(h_client *snd, h_client *rcv, const h_xfer *x, kvf_event *rev, kvf_event *sev) {
  uint64_t end = h_now_ms() + (uint64_t)(x->timeout_ms ? x->timeout_ms : H_XFER_MS);
  if (h_prepare(snd, rcv, x)) return -1;
  if (post_both(snd, rcv, x) || h_wait_event(rcv, x->id, KVF_EV_RECV_DONE, h_left_ms(end), rev) ||
      h_wait_event(snd, x->id, KVF_EV_SEND_DONE, h_left_ms(end), sev)) {
    abandon(snd, rcv, x->id);
    return -1;
  }
  return 0;
}

static int transfer_checked(h_client *snd, h_client *rcv, const h_xfer *x, const kvf_event *rev,
                            const kvf_event *sev) {
  int local = !strcmp(snd->node, rcv->node);
  const char *path = x->any_path ? NULL : x->path ? x->path : local ? "local" : "tcp";
  uint64_t bytes = h_desc_bytes(x->dst, x->ndst);
  if (h_check_event(rev, KVF_EV_RECV_DONE, path, snd->node, bytes, x->ndst) ||
      h_check_event(sev, KVF_EV_SEND_DONE, path, rcv->node, bytes, x->nsrc))
    return -1;
  return h_verify_dst(rcv, x);
}

int h_transfer(h_client *snd, h_client *rcv, const h_xfer *x) {
  kvf_event rev, sev;
  return transfer_events(snd, rcv, x, &rev, &sev) || transfer_checked(snd, rcv, x, &rev, &sev) ? -1 : 0;
}

/* tries: how many times a transfer that both sides fail with KVF_EPEERLOST
 * (its grant's data path was reset) is granted again under a new id. */
static int quick(h_client *snd, h_client *rcv, bool any_path, int tries) {
  enum { N = 16, LEN = 4096 };
  kvf_desc src[N], dst[N];
  char id[64];
  static atomic_ulong seed = 1000;
  for (int t = 1;; t++) {
    kvf_event rev, sev;
    h_id(id, sizeof id, "quick");
    h_layout(src, N, snd->pool, snd->size - (2u << 20), LEN, true, 7);
    h_layout(dst, N, rcv->pool, rcv->size - (1u << 20), LEN, true, 11);
    h_xfer x = {.id = id, .src = src, .nsrc = N, .dst = dst, .ndst = N,
                .seed = atomic_fetch_add(&seed, 1), .timeout_ms = 10000, .any_path = any_path};
    if (transfer_events(snd, rcv, &x, &rev, &sev)) return -1;
    if (t < tries && rev.status == KVF_EPEERLOST && sev.status == KVF_EPEERLOST) {
      fprintf(stderr, "kvf-harness: %s: KVF_EPEERLOST (%s); granting again\n", id, rev.error);
      continue;
    }
    return transfer_checked(snd, rcv, &x, &rev, &sev);
  }
}

int h_quick(h_client *snd, h_client *rcv) { return quick(snd, rcv, false, 1); }
int h_quick_any_path(h_client *snd, h_client *rcv) { return quick(snd, rcv, true, 1); }
int h_quick_settled(h_client *snd, h_client *rcv) { return quick(snd, rcv, false, 3); }

/* ------------------------------------------------------------ raw sockets */

int h_raw_unix(const char *path) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    int e = errno; /* before close() can change it */
    if (fd >= 0) close(fd);
    return h_fail("connect %s: %s", path, strerror(e));
  }
  return fd;
}

int h_raw_tcp(uint16_t port) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    int e = errno;
    if (fd >= 0) close(fd);
    return h_fail("connect 127.0.0.1:%u: %s", port, strerror(e));
  }
  return fd;
}

void h_raw_write(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w <= 0) return;
    b += w;
    n -= (size_t)w;
  }
}

int h_expect_rc(int got, int want, const char *what) {
  if (got == want) return 0;
  return h_fail("%s returned %s, expected %s", what, kvf_err_name(got), kvf_err_name(want));
}

int h_wait_clients(kvf_client *c, uint64_t want, int ms) {
  uint64_t end = h_now_ms() + (uint64_t)ms, n = 0;
  do {
    if (h_status_u64(c, "clients", &n)) return -1;
    if (n == want) return 0;
    h_sleep_ms(20);
  } while (h_now_ms() < end);
  return h_fail("%s: %llu clients, expected %llu", kvf_node(c), (unsigned long long)n,
                (unsigned long long)want);
}

/* ================================================================ waiting */

static _Thread_local char wait_note[512];

void h_wait_note(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(wait_note, sizeof wait_note, fmt, ap);
  va_end(ap);
}

int h_wait_until(h_cond_fn cond, void *arg, int timeout_ms, const char *what) {
  uint64_t end = h_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
  unsigned step = 1;
  wait_note[0] = 0;
  for (;;) {
    /* The deadline is read before the check, so that a condition that
     * holds by the deadline is seen even when checking it is slow. */
    int late = h_left_ms(end) == 0, rc = cond(arg);
    if (rc > 0) return 0;
    if (rc < 0) {
      char why[sizeof lasterr];
      snprintf(why, sizeof why, "%s", h_lasterr()); /* h_fail writes lasterr */
      return h_fail("while waiting for %s: %s", what, why);
    }
    if (late)
      return h_fail("timed out after %d ms waiting for %s%s%s%s", timeout_ms, what,
                    wait_note[0] ? " (last seen: " : "", wait_note, wait_note[0] ? ")" : "");
    /* From 1 ms up to 20: quick for what is nearly there, light on a
     * daemon that takes long. */
    unsigned left = (unsigned)h_left_ms(end);
    h_sleep_ms(step < left ? step : left);
    if (step < 20) step *= 2;
  }
}

/* A number that must reach min: a top-level one of STATUS (id NULL), or
 * one of transfer id in TRANSFERS. */
typedef struct {
  kvf_client *c;
  const char *id, *key;
  uint64_t min;
} at_least;

static int at_least_cond(void *arg) {
  at_least *a = arg;
  uint64_t v;
  if (a->id ? h_xfer_u64(a->c, a->id, a->key, &v) : h_status_u64(a->c, a->key, &v)) return -1;
  h_wait_note("%s %llu", a->key, (unsigned long long)v);
  return v >= a->min;
}

int h_wait_status(kvf_client *c, const char *key, uint64_t min, int timeout_ms) {
  char what[192];
  at_least a = {c, NULL, key, min};
  snprintf(what, sizeof what, "%s's STATUS %s >= %llu", kvf_node(c), key,
           (unsigned long long)min);
  return h_wait_until(at_least_cond, &a, timeout_ms, what);
}

int h_xfer_u64(kvf_client *c, const char *id, const char *key, uint64_t *out) {
  char *json = NULL, got[KVF_XFER_ID_MAX + 1];
  const char *it, *e;
  int rc = 1;
  if (h_inspect(c, KVF_INSPECT_TRANSFERS, &json)) return -1;
  it = hj_get(json, "transfers");
  while (rc > 0 && it && *it == '[' && (e = hj_next(&it)))
    if (!hj_str(e, "id", got, sizeof got) && !strcmp(got, id))
      rc = hj_u64(e, key, out) ? h_fail("%s: transfer %s has no number \"%s\": %s", kvf_node(c),
                                        id, key, json)
                               : 0;
  if (rc > 0) rc = h_fail("%s does not list transfer %s: %s", kvf_node(c), id, json);
  free(json);
  return rc;
}

int h_wait_xfer_bytes(kvf_client *c, const char *id, uint64_t min, int timeout_ms) {
  char what[256];
  at_least a = {c, id, "bytes", min};
  snprintf(what, sizeof what, "%s's transfer %s to show %llu bytes", kvf_node(c), id,
           (unsigned long long)min);
  return h_wait_until(at_least_cond, &a, timeout_ms, what);
}

/* ------------------------------------------------------------ fixture */

int h_fixture_start(h_fixture *f, const char *pool_size) {
  if (h_pair_start(&f->p, pool_size)) return -1;
  return h_client_open(&f->pre, &f->p.prefill) || h_client_open(&f->dec, &f->p.decode) ? -1 : 0;
}

int h_scattered(h_fixture *f, const char *tag, size_t n, uint64_t len, size_t parts, uint64_t seed, int timeout_ms) {
  kvf_desc *src = calloc(n, sizeof *src), *dst = calloc(n, sizeof *dst);
  char id[96];
  int rc = src && dst ? 0 : h_fail("%s: out of memory for %zu descriptors", tag, n);
  if (rc == 0) {
    h_id(id, sizeof id, tag);
    h_layout(src, n, f->pre.pool, 0, len, true, seed);
    h_layout(dst, n, f->dec.pool, 0, len, true, seed * 31 + 1);
    h_xfer x = {.id = id, .src = src, .nsrc = n, .dst = dst, .ndst = n, .parts = parts,
                .seed = seed, .timeout_ms = timeout_ms};
    rc = h_transfer(&f->pre, &f->dec, &x);
  }
  free(src);
  free(dst);
  return rc;
}

int h_fixture_stop(h_fixture *f) {
  h_client_close(&f->pre);
  h_client_close(&f->dec);
  return h_pair_stop(&f->p);
}

int h_expect_closed(int fd, int ms, const char *what, size_t *bytes_seen) {
  uint64_t end = h_now_ms() + (uint64_t)ms;
  char buf[65536];
  if (bytes_seen) *bytes_seen = 0;
  for (;;) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int r = poll(&pfd, 1, h_left_ms(end));
    if (r == 0) return h_fail("%s: connection still open after %d ms", what, ms);
    if (r < 0) continue;
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) return 0;
    if (n > 0 && bytes_seen) *bytes_seen += (size_t)n;
  }
}
