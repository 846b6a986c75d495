/* ctl_doctor.c - `kvferryctl doctor`: checks the node for what kvferryd
 * needs, one row per check, and `kvferryctl metrics`.
 *
 * A check is one entry of checks[] below: a name, what it verifies, and a
 * function that gets the daemon's documents (fetched once) and returns a
 * result with one line of detail. GPU and RDMA checks are added the same
 * way, in the marked place. A check that needs the daemon skips itself
 * when the daemon did not answer. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "ctl.h"
#include "ctl_gpu.h"

#define HTTP_TIMEOUT_MS 5000

enum result { R_OK, R_WARN, R_FAIL, R_SKIP };
static const char *const result_names[] = {"ok", "warn", "FAIL", "skip"};

/* What the checks look at; documents are NULL when the daemon did not
 * answer. */
struct doctor {
  const char *socket;
  int connect_rc;   /* kvf_connect's result */
  char *status;     /* STATUS, POOLS and PEERS as JSON */
  char *pools;
  char *peers;
};

typedef enum result check_fn(const struct doctor *d, char *detail, size_t cap);

/* ------------------------------------------------------------ helpers */

static uint64_t host_pool_bytes(const struct doctor *d, size_t *n_host, size_t *n_huge,
                                size_t *n_unlocked, char *unlocked, size_t cap) {
  const char *it = kvf__json_get(d->pools, "pools"), *e;
  uint64_t total = 0;
  *n_host = *n_huge = *n_unlocked = 0;
  if (cap) unlocked[0] = '\0';
  while (it && (e = kvf__json_next(&it))) {
    char kind[32] = "", backing[32] = "", name[64] = "";
    uint64_t size = 0;
    kvf__json_get_str(e, "kind", kind, sizeof kind);
    if (strcmp(kind, "host") != 0) continue;
    kvf__json_get_str(e, "backing", backing, sizeof backing);
    kvf__json_get_str(e, "name", name, sizeof name);
    kvf__json_get_u64(e, "size", &size);
    total += size;
    (*n_host)++;
    if (strstr(backing, "hugetlb")) (*n_huge)++;
    if (!kvf__json_get_bool(e, "locked", false)) {
      size_t used = strlen(unlocked);
      snprintf(unlocked + used, cap - used, "%s%s", (*n_unlocked)++ ? ", " : "", name);
    }
  }
  return total;
}

/* The soft RLIMIT_MEMLOCK of pid from /proc (UINT64_MAX: unlimited); -1
 * when it cannot be read or pid is not a kvferryd we can see. */
static int proc_memlock(uint64_t pid, uint64_t *limit) {
  char path[64], comm[32] = "", line[256];
  snprintf(path, sizeof path, "/proc/%" PRIu64 "/comm", pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  bool ours = fgets(comm, sizeof comm, f) && strncmp(comm, "kvferryd", 8) == 0;
  fclose(f);
  if (!ours) return -1; /* another PID namespace, or a recycled pid */
  snprintf(path, sizeof path, "/proc/%" PRIu64 "/limits", pid);
  if (!(f = fopen(path, "r"))) return -1;
  int rc = -1;
  while (fgets(line, sizeof line, f)) {
    char soft[32];
    if (sscanf(line, "Max locked memory %31s", soft) != 1) continue;
    *limit = strcmp(soft, "unlimited") == 0 ? UINT64_MAX : strtoull(soft, NULL, 10);
    rc = 0;
  }
  fclose(f);
  return rc;
}

static void format_bytes(uint64_t v, char *buf, size_t cap) {
  if (v == UINT64_MAX) snprintf(buf, cap, "unlimited");
  else if (v >= (1ull << 30)) snprintf(buf, cap, "%.1f GiB", (double)v / (1ull << 30));
  else snprintf(buf, cap, "%.1f MiB", (double)v / (1ull << 20));
}

/* ------------------------------------------------------------ checks */

static enum result check_socket(const struct doctor *d, char *detail, size_t cap) {
  if (!d->status) {
    snprintf(detail, cap, "%s: %s (is kvferryd running? systemctl status kvferryd)", d->socket,
             kvf_strerror(d->connect_rc));
    return R_FAIL;
  }
  char node[64] = "?", version[32] = "?";
  kvf__json_get_str(d->status, "node", node, sizeof node);
  kvf__json_get_str(d->status, "version", version, sizeof version);
  snprintf(detail, cap, "%s answers: kvferryd %s, node %s", d->socket, version, node);
  return R_OK;
}

static enum result check_memlock(const struct doctor *d, char *detail, size_t cap) {
  size_t n_host, n_huge, n_unlocked;
  char names[256], have[32], need[32];
  uint64_t limit, pid = 0;
  if (!d->status) {
    /* No daemon: what a daemon started from this shell would get. */
    struct rlimit rl;
    getrlimit(RLIMIT_MEMLOCK, &rl);
    format_bytes(rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : rl.rlim_cur, have, sizeof have);
    snprintf(detail, cap, "daemon not reachable; this shell's limit is %s (the unit sets "
             "LimitMEMLOCK=infinity)", have);
    return rl.rlim_cur == RLIM_INFINITY ? R_OK : R_WARN;
  }
  uint64_t want = host_pool_bytes(d, &n_host, &n_huge, &n_unlocked, names, sizeof names);
  if (kvf__json_get_u64(d->status, "pid", &pid) != 0 || proc_memlock(pid, &limit) != 0) {
    snprintf(detail, cap, "cannot read the limits of kvferryd (pid %" PRIu64 ") from /proc", pid);
    return R_WARN;
  }
  format_bytes(limit, have, sizeof have);
  format_bytes(want, need, sizeof need);
  if (limit != UINT64_MAX && limit < want && n_unlocked == 0) {
    /* root (CAP_IPC_LOCK) locks beyond the limit */
    snprintf(detail, cap, "%s, below the %s of host pools, but they are locked (CAP_IPC_LOCK)",
             have, need);
    return R_OK;
  }
  if (limit != UINT64_MAX && limit < want) {
    snprintf(detail, cap, "RLIMIT_MEMLOCK is %s but the host pools need %s: set "
             "LimitMEMLOCK=infinity", have, need);
    return R_FAIL;
  }
  snprintf(detail, cap, "%s (host pools: %s)", have, need);
  return R_OK;
}

static enum result check_pools_locked(const struct doctor *d, char *detail, size_t cap) {
  size_t n_host, n_huge, n_unlocked;
  char names[256];
  if (!d->status) return R_SKIP;
  host_pool_bytes(d, &n_host, &n_huge, &n_unlocked, names, sizeof names);
  if (n_host == 0) {
    snprintf(detail, cap, "no host pools");
    return R_SKIP;
  }
  if (n_unlocked) {
    snprintf(detail, cap, "not locked in RAM: %s (mlock failed; see memlock and the log)", names);
    return R_FAIL;
  }
  snprintf(detail, cap, "%zu host pools locked", n_host);
  return R_OK;
}

/* HugePages_Total from /proc/meminfo, or -1. */
static long huge_pages_reserved(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  char line[128];
  long total = -1;
  if (!f) return -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "HugePages_Total: %ld", &total) == 1) break;
  fclose(f);
  return total;
}

static enum result check_hugepages(const struct doctor *d, char *detail, size_t cap) {
  size_t n_host = 0, n_huge = 0, n_unlocked;
  char names[8];
  long reserved = huge_pages_reserved();
  if (d->status) host_pool_bytes(d, &n_host, &n_huge, &n_unlocked, names, sizeof names);
  if (d->status && n_host > 0 && n_huge == n_host) {
    snprintf(detail, cap, "all %zu host pools on huge pages", n_host);
    return R_OK;
  }
  if (reserved <= 0) {
    snprintf(detail, cap, "no huge pages reserved (vm.nr_hugepages); host pools use 4 KiB "
             "pages: more TLB misses and slower registration");
    return R_WARN;
  }
  if (d->status && n_host > 0) {
    snprintf(detail, cap, "%ld huge pages reserved, but %zu of %zu host pools use 4 KiB pages "
             "(too few free, or a size not a multiple of 2 MiB)", reserved, n_host - n_huge, n_host);
    return R_WARN;
  }
  snprintf(detail, cap, "%ld huge pages reserved", reserved);
  return R_OK;
}

static enum result check_peers(const struct doctor *d, char *detail, size_t cap) {
  if (!d->peers) return R_SKIP;
  const char *it = kvf__json_get(d->peers, "peers"), *e;
  size_t n = 0, down = 0, used = 0;
  detail[0] = '\0';
  while (it && (e = kvf__json_next(&it))) {
    char name[64] = "", state[32] = "", err[128] = "";
    n++;
    kvf__json_get_str(e, "name", name, sizeof name);
    kvf__json_get_str(e, "state", state, sizeof state);
    if (strcmp(state, "up") == 0 || strcmp(state, "idle") == 0) continue; /* idle: on demand */
    kvf__json_get_str(e, "last_error", err, sizeof err);
    if (used < cap)
      used += (size_t)snprintf(detail + used, cap - used, "%s%s %s%s%s%s", down++ ? "; " : "",
                               name, state, err[0] ? " (" : "", err, err[0] ? ")" : "");
  }
  if (n == 0) {
    snprintf(detail, cap, "no peers configured");
    return R_SKIP;
  }
  if (down) return R_FAIL;
  snprintf(detail, cap, "%zu of %zu peers up", n, n);
  return R_OK;
}

static enum result check_metrics(const struct doctor *d, char *detail, size_t cap) {
  char url[320] = "", err[256];
  char *body = NULL;
  if (!d->status) return R_SKIP;
  if (kvf__json_get_str(d->status, "metrics", url, sizeof url) != 0 || !url[0]) {
    snprintf(detail, cap, "metrics-listen is off");
    return R_SKIP;
  }
  if (ctl_http_get(url, HTTP_TIMEOUT_MS, &body, err, sizeof err) != 0) {
    snprintf(detail, cap, "%s: %s", url, err);
    return R_FAIL;
  }
  bool ok = strstr(body, "kvferry_build_info") != NULL;
  snprintf(detail, cap, "%s %s", url, ok ? "answers" : "answers without kvferry metrics");
  free(body);
  return ok ? R_OK : R_FAIL;
}

/* Peers must prove the cluster key (cluster-key-file); without one any
 * host that reaches the peer port can join. */
static enum result check_cluster_key(const struct doctor *d, char *detail, size_t cap) {
  char mode[32] = "";
  uint64_t refused = 0;
  if (!d->status) return R_SKIP;
  if (kvf__json_get_str(d->status, "auth", mode, sizeof mode) != 0) {
    snprintf(detail, cap, "this kvferryd does not report peer authentication");
    return R_WARN;
  }
  kvf__json_get_u64(d->status, "auth_failures", &refused);
  if (strcmp(mode, "cluster-key") != 0) {
    snprintf(detail, cap, "cluster-key-file is off: peers are not authenticated");
    return R_WARN;
  }
  snprintf(detail, cap, "peers prove the cluster key; %" PRIu64 " refused since start", refused);
  return R_OK;
}

/* Membership through etcd (registry): registered, or why not. */
static enum result check_registry(const struct doctor *d, char *detail, size_t cap) {
  if (!d->status) return R_SKIP;
  const char *r = kvf__json_get(d->status, "registry");
  char state[32] = "", ep[300] = "", err[200] = "";
  uint64_t members = 0;
  if (!r || *r == 'n') {
    snprintf(detail, cap, "registry is off: static peers only");
    return R_SKIP;
  }
  kvf__json_get_str(r, "state", state, sizeof state);
  kvf__json_get_str(r, "endpoint", ep, sizeof ep);
  kvf__json_get_str(r, "last_error", err, sizeof err);
  kvf__json_get_u64(r, "members", &members);
  if (strcmp(state, "registered") == 0) {
    snprintf(detail, cap, "registered at %s, %" PRIu64 " members", ep, members);
    return R_OK;
  }
  snprintf(detail, cap, "%s (%s; %" PRIu64 " members kept): %s", state, ep, members, err);
  return R_FAIL;
}

/* The daemon's polling threads back off where their CPUs are shared with
 * busy work (spin.c): handoffs then pay thread wake-ups. A warning, since
 * start: a node whose engines keep every CPU busy wants kvferryd on CPUs of
 * its own. */
static enum result check_spin_backoffs(const struct doctor *d, char *detail, size_t cap) {
  if (!d->status) return R_SKIP;
  const char *b = kvf__json_get(d->status, "spin_backoffs");
  static const char *const kinds[] = {"loop", "tcp_send", "tcp_recv", "gpu"};
  uint64_t n[4] = {0}, total = 0;
  for (int i = 0; b && i < 4; i++) {
    kvf__json_get_u64(b, kinds[i], &n[i]);
    total += n[i];
  }
  if (!total) {
    snprintf(detail, cap, "no polling thread found its CPU busy since start");
    return R_OK;
  }
  snprintf(detail, cap,
           "%" PRIu64 " backoffs since start (loop %" PRIu64 ", tcp_send %" PRIu64 ", tcp_recv %" PRIu64
           ", gpu %" PRIu64 "): busy tasks shared kvferryd's CPUs and handoffs paid wake-ups; give it CPUs "
           "of its own (CPUAffinity= in its unit)",
           total, n[0], n[1], n[2], n[3]);
  return R_WARN;
}

/* GPU checks: ctl_gpu.c (results in this file's order). */
static enum result check_cuda(const struct doctor *d, char *detail, size_t cap) {
  return (enum result)ctl_gpu_driver(detail, cap);
}
static enum result check_gpu_dmabuf(const struct doctor *d, char *detail, size_t cap) {
  return (enum result)ctl_gpu_dmabuf(detail, cap);
}
static enum result check_gpu_peermem(const struct doctor *d, char *detail, size_t cap) {
  return (enum result)ctl_gpu_peermem(detail, cap);
}
static enum result check_gpu_iommu(const struct doctor *d, char *detail, size_t cap) {
  return (enum result)ctl_gpu_iommu(detail, cap);
}
static enum result check_gpu_bar1(const struct doctor *d, char *detail, size_t cap) {
  return (enum result)ctl_gpu_bar1(detail, cap);
}
static enum result check_gpu_nic_path(const struct doctor *d, char *detail, size_t cap) {
  return (enum result)ctl_gpu_nic_path(detail, cap);
}
static enum result check_gpu_acs(const struct doctor *d, char *detail, size_t cap) {
  return (enum result)ctl_gpu_acs(detail, cap);
}
static enum result check_gpu_pools(const struct doctor *d, char *detail, size_t cap) {
  return (enum result)ctl_gpu_pools(d->pools, detail, cap);
}

/* Whether a peer can write only the ranges of its grants over rdma (memory
 * windows whose bounds the device enforces) or more (see rdma-memory-windows
 * in kvferryd.conf(5)). */
static enum result check_rdma_writes(const struct doctor *d, char *detail, size_t cap) {
  if (!d->status) return R_SKIP;
  const char *mw = kvf__json_get(kvf__json_get(d->status, "rdma"), "memory_windows");
  char what[512] = "";
  if (!mw) {
    snprintf(detail, cap, "the rdma transport is not running");
    return R_SKIP;
  }
  kvf__json_get_str(mw, "protection", what, sizeof what);
  bool ok = kvf__json_get_bool(mw, "in_use", false) && kvf__json_get_bool(mw, "bounds_enforced", false);
  snprintf(detail, cap, "%s", what[0] ? what : "the daemon does not say");
  return ok ? R_OK : R_WARN;
}

/* The checks, in the order shown. To add one: write a check_fn and add a
 * row; it gets the daemon's STATUS, POOLS and PEERS documents. */
static const struct check {
  const char *name;
  const char *what;
  check_fn *fn;
} checks[] = {
    {"socket", "the API socket answers", check_socket},
    {"memlock", "RLIMIT_MEMLOCK of kvferryd covers its host pools", check_memlock},
    {"pools-locked", "every host pool is locked in RAM", check_pools_locked},
    {"hugepages", "huge pages are reserved and back the host pools", check_hugepages},
    {"peers-up", "every configured peer daemon is connected", check_peers},
    {"metrics", "the metrics endpoint answers", check_metrics},
    {"cluster-key", "peers authenticate with a cluster key", check_cluster_key},
    {"registry", "this node is registered in etcd (registry)", check_registry},
    {"spin-backoffs", "the daemon's polling threads found spare CPUs", check_spin_backoffs},
    {"cuda", "the NVIDIA driver loads and sees the GPUs", check_cuda},
    {"gpu-dmabuf", "GPUs, driver and kernel export GPU memory as dmabuf", check_gpu_dmabuf},
    {"nvidia-peermem", "nvidia_peermem is loaded where dmabuf is not available", check_gpu_peermem},
    {"iommu", "the IOMMU is off or in passthrough for the GPUs", check_gpu_iommu},
    {"gpu-bar1", "each GPU's BAR1 aperture covers its memory", check_gpu_bar1},
    {"gpu-nic-pcie", "each GPU shares a PCIe switch with an RDMA NIC", check_gpu_nic_path},
    {"pcie-acs", "no ACS P2P redirect on the bridges between GPUs and NICs", check_gpu_acs},
    {"gpu-pools", "each cuda pool's NIC registration (dmabuf, peermem, else bounce)", check_gpu_pools},
    {"rdma-writes", "a peer can RDMA-write only the ranges of its grants (memory windows)",
     check_rdma_writes},
    /* RDMA checks (devices, ports active, GID) go here. */
};
#define N_CHECKS (sizeof checks / sizeof checks[0])

/* ------------------------------------------------------------ running */

static bool selected[N_CHECKS];
static bool any_selected;

bool ctl_doctor_select(const char *list) {
  for (const char *p = list; *p;) {
    size_t n = strcspn(p, ",");
    size_t i = 0;
    while (i < N_CHECKS && (strlen(checks[i].name) != n || strncmp(checks[i].name, p, n) != 0)) i++;
    if (i == N_CHECKS) return false;
    selected[i] = any_selected = true;
    p += n + (p[n] == ',');
  }
  return any_selected;
}

static void fetch(struct doctor *d) {
  kvf_client *c;
  d->connect_rc = kvf_connect(d->socket, &c);
  if (d->connect_rc != 0) return;
  if (kvf_inspect(c, KVF_INSPECT_STATUS, 1, &d->status) != 0 ||
      kvf_inspect(c, KVF_INSPECT_POOLS, 1, &d->pools) != 0 ||
      kvf_inspect(c, KVF_INSPECT_PEERS, 1, &d->peers) != 0) {
    free(d->status);
    free(d->pools);
    d->status = d->pools = NULL;
    d->connect_rc = KVF_EPROTO;
  }
  kvf_close(c);
}

static void print_row(bool json, bool first, const struct check *ck, enum result r,
                      const char *detail) {
  if (!json) {
    printf("%-14s %-5s %s\n", ck->name, result_names[r], detail[0] ? detail : ck->what);
    return;
  }
  printf("%s{\"name\":", first ? "" : ",");
  kvf__json_fquote(stdout, ck->name);
  printf(",\"what\":");
  kvf__json_fquote(stdout, ck->what);
  printf(",\"result\":\"%s\",\"detail\":", r == R_FAIL ? "fail" : result_names[r]);
  kvf__json_fquote(stdout, detail);
  printf("}");
}

int ctl_doctor(const char *socket, bool json) {
  struct doctor d = {.socket = socket};
  size_t failed = 0, warned = 0;
  fetch(&d);
  if (json) printf("{\"checks\":[");
  else printf("%-14s %-5s %s\n", "CHECK", "RESULT", "DETAIL");
  bool first = true;
  for (size_t i = 0; i < N_CHECKS; i++) {
    char detail[1024] = "";
    if (any_selected && !selected[i]) continue;
    enum result r = checks[i].fn(&d, detail, sizeof detail);
    if (r == R_SKIP && !detail[0]) snprintf(detail, sizeof detail, "daemon not reachable");
    failed += r == R_FAIL;
    warned += r == R_WARN;
    print_row(json, first, &checks[i], r, detail);
    first = false;
  }
  if (json) printf("],\"failed\":%zu,\"warnings\":%zu}\n", failed, warned);
  else printf("\n%zu failed, %zu warnings\n", failed, warned);
  free(d.status);
  free(d.pools);
  free(d.peers);
  if (fflush(stdout) != 0) return CTL_ERROR;
  return failed ? CTL_CHECK_FAILED : CTL_OK;
}

/* ------------------------------------------------------------ metrics */

int ctl_metrics(const char *socket, bool json) {
  kvf_client *c;
  char *status = NULL, url[320] = "", err[256], *body = NULL;
  int rc = kvf_connect(socket, &c);
  if (rc) {
    fprintf(stderr, "kvferryctl: cannot reach kvferryd at %s: %s\n", socket, kvf_strerror(rc));
    return CTL_UNREACHABLE;
  }
  rc = kvf_inspect(c, KVF_INSPECT_STATUS, 1, &status);
  kvf_close(c);
  if (rc) {
    fprintf(stderr, "kvferryctl: status: %s (%s)\n", kvf_strerror(rc), kvf_err_name(rc));
    return CTL_ERROR;
  }
  kvf__json_get_str(status, "metrics", url, sizeof url);
  free(status);
  if (!url[0]) {
    fprintf(stderr, "kvferryctl: this kvferryd serves no metrics (set metrics-listen in "
                    "kvferryd.conf, e.g. 127.0.0.1:9464)\n");
    return CTL_ERROR;
  }
  if (ctl_http_get(url, HTTP_TIMEOUT_MS, &body, err, sizeof err) != 0) {
    fprintf(stderr, "kvferryctl: %s: %s\n", url, err);
    return CTL_ERROR;
  }
  if (json) rc = ctl_metrics_json(body, stdout) == 0 ? CTL_OK : CTL_ERROR;
  else rc = ctl_print(body);
  if (json && fflush(stdout) != 0) rc = CTL_ERROR;
  free(body);
  return rc;
}
