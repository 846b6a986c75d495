/* main.c - kvferryd: arguments, config, pools, transports, the loop, and
 * signals (lifecycle.c). Foreground; logs go to stderr. Under systemd
 * (Type=notify) READY=1 goes out only once pools, transports, the API
 * socket, the peer listener and the metrics endpoint are all up. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "auth.h"
#include "cuda/gpu.h"
#include "kvferryd.h"
#include "lifecycle.h"
#include "metrics.h"
#include "notify.h"
#include "peer.h"
#include "pool.h"
#include "pool_engine.h"
#include "registry.h"
#include "spin.h"
#include "transport/transport.h"
#include "xfer.h"

static void usage(FILE *out) {
  fprintf(out, "usage: kvferryd -c FILE [--check]\n"
               "       kvferryd --help | --version\n\n"
               "  -c, --config FILE   configuration file (see kvferryd.conf(5))\n"
               "      --check         parse and validate the configuration, print it, exit\n"
               "  -h, --help          this text and every configuration key\n"
               "  -V, --version       print the version\n\n"
               "Signals: SIGTERM/SIGINT drain and stop, SIGHUP reloads the configuration.\n\n");
  if (out == stdout) kvf__config_print_help(out);
}

static int load_config(const char *path) {
  char err[512];
  kvf__config_defaults(&kvfd.cfg);
  if (kvf__config_load(&kvfd.cfg, path, err, sizeof(err)) != 0 ||
      kvf__config_validate(&kvfd.cfg, err, sizeof(err)) != 0) {
    fprintf(stderr, "kvferryd: %s\n", err);
    return -1;
  }
  return 0;
}

/* The cluster key is read once, before anything listens (a change needs a
 * restart): a bad key file stops the start, --check included. libgcrypt,
 * which computes the proofs, is initialised here, before any thread starts. */
static int load_key(void) {
  char err[512];
  if (!kvfd.cfg.cluster_key_file[0]) return 0;
  if (kvf__auth_init() != 0) {
    fprintf(stderr, "kvferryd: cluster-key-file: libgcrypt %s is older than the one kvferryd was built with\n",
            kvf__auth_crypto_version());
    return -1;
  }
  if (kvf__auth_load(kvfd.cfg.cluster_key_file, err, sizeof(err)) == 0) return 0;
  fprintf(stderr, "kvferryd: %s\n", err);
  return -1;
}

static void report_auth(void) {
  if (kvf__auth_enabled())
    kvf__info("peers authenticate with the cluster key in %s (HMAC-SHA256 by libgcrypt %s)",
              kvfd.cfg.cluster_key_file, kvf__auth_crypto_version());
  else if (kvfd.cfg.listen_host[0] || kvfd.cfg.n_peers)
    kvf__warn("cluster-key-file is off: peers are not authenticated; any host that reaches "
              "this daemon's peer port can join as a peer (see kvferryd.conf(5))");
}

static int create_pools(void) {
  /* room for engine memory (pool_engine.c) after the config's pools */
  kvfd.pools = calloc(KVF__POOLS_MAX, sizeof(kvf__pool *));
  if (!kvfd.pools) return -ENOMEM;
  for (size_t i = 0; i < kvfd.cfg.n_pools; i++) {
    char err[256];
    int rc = kvf__pool_create(&kvfd.cfg.pools[i], (uint32_t)i, kvfd.cfg.hugepages, kvfd.cfg.mlock,
                              &kvfd.pools[i], err, sizeof(err));
    if (rc) {
      kvf__err("%s", err);
      return rc;
    }
    kvfd.n_pools++;
    kvf__info("pool %s: %s, %llu bytes, %s%s", kvfd.pools[i]->name, kvfd.pools[i]->kind,
              (unsigned long long)kvfd.pools[i]->size, kvfd.pools[i]->backing,
              kvfd.pools[i]->locked ? ", locked" : "");
  }
  return 0;
}

/* One line per GPU pool saying how NICs reach it (NCCL's "GDR" line, in
 * spirit): never a silent bounce. After the transports registered pools. */
static void report_gpu_pools(void) {
  for (size_t i = 0; i < kvfd.n_pools; i++) {
    kvf__pool *p = kvfd.pools[i];
    /* registrations of an rdma transport that then did not start are gone */
    if (!kvf__transport_find("rdma") && strcmp(p->nic_reg, "bounce") != 0) snprintf(p->nic_reg, sizeof(p->nic_reg), "none");
    if (!kvf__pool_gpu(p)) continue;
    kvf__gpu_info gi;
    if (kvf__gpu_info_get(p->cuda_dev, &gi) != 0) continue;
    bool direct = strcmp(p->nic_reg, "dmabuf") == 0 || strcmp(p->nic_reg, "peermem") == 0;
    if (strcmp(p->nic_reg, "none") == 0)
      kvf__info("pool %s: %s %s (%s): no rdma transport: remote transfers bounce through pinned host memory "
                "(tcp-bounce); GPU dmabuf %s",
                p->name, p->kind, gi.name, gi.bdf, gi.dmabuf ? "supported" : "unsupported");
    else
      kvf__log(direct ? KVF__LOG_INFO : KVF__LOG_WARN, "pool %s: %s %s (%s): NIC registration %s%s", p->name,
               p->kind, gi.name, gi.bdf, p->nic_reg,
               direct ? " (GPUDirect RDMA)" : ": remote transfers bounce through pinned host memory (rdma-bounce)");
  }
}

static void close_walk(uv_handle_t *h, void *arg) {
  if (!uv_is_closing(h)) uv_close(h, NULL);
}

/* Stops accepting, fails what is in flight (peers and clients hear of it),
 * and lets the loop run dry. */
static void stop(void) {
  if (kvfd.stopping) return;
  kvfd.stopping = true;
  kvf__info("stopping");
  kvf__api_stop();
  kvf__registry_stop(); /* peers see us leave now */
  kvf__peers_stop();
  kvf__xfer_shutdown();
  kvf__metrics_http_stop();
  kvf__notify_watchdog_stop();
  kvf__lifecycle_close();
  kvf__transports_stop();
}


static void env_emit(kvf__session *s, const Kvf__Event *ev) { kvf__api_emit(s, ev); }
static bool env_peer_up(const kvf__peer *p) { return p->state == KVF__PEER_UP; }
static const char *env_peer_name(const kvf__peer *p) { return p->cfg.name; }
static kvf__transport *env_peer_transport(kvf__peer *p) { return p->tp; }

/* The transports first (rdma registers every pool with its devices here, at
 * start, never on the transfer path), then what uses them. */
static int start(void) {
  char err[512] = "";
  int rc = kvf__transports_start(kvfd.loop);
  if (rc) return rc;
  kvf__xfer_env env = {
      .emit = env_emit,
      .peer_send = kvf__peer_send,
      .peer_find = kvf__peer_find,
      .peer_up = env_peer_up,
      .peer_name = env_peer_name,
      .peer_transport = env_peer_transport,
      .session_xfers = kvf__api_session_xfers,
      .local = kvf__transport_find("local"),
      /* The black-box tests run their daemons with KVF_STRICT=1: a state
       * change the transfer tables do not allow then aborts, so a test
       * fails on it instead of a log line nobody reads. */
      .strict = getenv("KVF_STRICT") && strcmp(getenv("KVF_STRICT"), "1") == 0,
  };
  kvf__xfer_init(kvfd.loop, &env);
  kvf__transport *data_tps[KVF__TRANSPORTS_MAX];
  size_t n_data_tps = kvf__transports_for_peers(data_tps, KVF__TRANSPORTS_MAX);
  if ((rc = kvf__api_start(kvfd.loop, err, sizeof(err))) != 0 ||
      (rc = kvf__peers_start(kvfd.loop, data_tps, n_data_tps, kvf__transport_find("tcp"), err, sizeof(err))) != 0 ||
      (rc = kvf__registry_start(kvfd.loop, err, sizeof(err))) != 0 ||
      (rc = kvf__metrics_http_start(kvfd.loop, err, sizeof(err))) != 0) {
    kvf__err("%s", err);
    return rc;
  }
  return 0;
}

/* Everything before the loop runs, with a STATUS= line for each step so
 * that `systemctl status` shows where a slow or failed start stands. */
static int boot(const char *path) {
  char err[256];
  /* A second daemon on a socket in use is refused before it allocates and
   * locks gigabytes of pools for nothing. */
  int rc = kvf__api_check_socket(err, sizeof(err));
  if (rc) {
    kvf__err("%s", err);
    kvf__notify_failed(rc, "start failed: %s", err);
    return rc;
  }
  kvf__notify_status("allocating %zu pools", kvfd.cfg.n_pools);
  rc = kvf__gpu_init(kvfd.cfg.cuda); /* before the pools: cuda:N needs it */
  if (rc == 0) rc = create_pools();
  if (rc == 0) {
    kvf__notify_status("starting transports, the API socket and the peers");
    rc = start();
  }
  if (rc == 0) report_gpu_pools();
  if (rc) {
    kvf__notify_failed(rc, "start failed: %s (see the log)", kvf_strerror(rc));
    return rc;
  }
  kvf__lifecycle_start(kvfd.loop, path, stop);
  kvf__notify_watchdog_start(kvfd.loop);
  kvf__info("kvferryd %s node %s ready: api %s, peers on %s:%d, %zu peers configured, metrics %s",
            KVF__VERSION, kvfd.cfg.node, kvfd.cfg.api_socket, kvfd.cfg.listen_host,
            kvf__peers_listen_port(), kvfd.cfg.n_peers,
            kvf__metrics_url()[0] ? kvf__metrics_url() : "off");
  kvf__notify_ready("ready: node %s, %zu pools, %zu peers configured", kvfd.cfg.node, kvfd.n_pools,
                    kvfd.cfg.n_peers);
  return 0;
}

int main(int argc, char **argv) {
  static const struct option opts[] = {{"config", required_argument, NULL, 'c'},
                                       {"check", no_argument, NULL, 'k'},
                                       {"help", no_argument, NULL, 'h'},
                                       {"version", no_argument, NULL, 'V'},
                                       {0}};
  const char *path = NULL;
  int check = 0, o;
  while ((o = getopt_long(argc, argv, "c:hV", opts, NULL)) != -1) {
    switch (o) {
    case 'c': path = optarg; break;
    case 'k': check = 1; break;
    case 'h': usage(stdout); return 0;
    case 'V': printf("kvferryd %s\n", KVF__VERSION); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (!path || optind != argc) {
    usage(stderr);
    return 2;
  }
  if (load_config(path) != 0 || load_key() != 0) {
    kvf__notify_failed(-EINVAL, "bad configuration in %s (see the log)", path);
    return 1;
  }
  if (check) {
    kvf__auth_forget();
    kvf__config_dump(&kvfd.cfg, stdout, false);
    return 0;
  }
  kvf__log_init(kvfd.cfg.log_level);
  report_auth();
  signal(SIGPIPE, SIG_IGN);
  if (getrandom(&kvfd.session, sizeof(kvfd.session), 0) != sizeof(kvfd.session))
    kvfd.session = kvf__now_ns() ^ (uint64_t)getpid() << 32;
  kvfd.session &= 0xffffffffffull; /* leaves room for handle counters */
  kvfd.start_ns = kvf__now_ns();
  kvfd.loop = uv_default_loop();
  kvf__keep_freed_memory();
  if (boot(path) != 0) {
    kvf__auth_forget();
    return 1;
  }
  kvf__spin_loop_start(kvfd.loop); /* busy-poll, spin-us, spin-grant-us */
  uv_run(kvfd.loop, UV_RUN_DEFAULT);
  uv_walk(kvfd.loop, close_walk, NULL);
  uv_run(kvfd.loop, UV_RUN_DEFAULT);
  uv_loop_close(kvfd.loop);
  kvf__spin_loop_stop();
  kvf__pool_engine_shutdown();
  for (size_t i = 0; i < kvfd.n_pools; i++) kvf__pool_destroy(kvfd.pools[i]);
  free(kvfd.pools);
  kvf__gpu_shutdown();
  kvf__metrics_reset();
  kvf__auth_forget();
  kvf__info("stopped");
  return 0;
}
