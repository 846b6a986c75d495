/* config.h - kvferryd's configuration: one typed table (config.c) drives
 * parsing, validation, --help and the status dump. */
#ifndef KVF_CONFIG_H
#define KVF_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#define KVF__NAME_MAX 63
#define KVF__MAX_PEERS_CFG 256
#define KVF__MAX_POOLS_CFG 64
#define KVF__MAX_IDS_CFG 64
/* Bytes of a request, grant or send frame besides its descriptors (ids,
 * node name, seq, deadline, protobuf tags): max-frame must hold
 * max-descs x 20 + this (config validation; tests/unit/test_config.c
 * packs the largest such frames to prove it). */
#define KVF__FRAME_SLACK 512u

typedef struct kvf__peer_cfg {
  char name[KVF__NAME_MAX + 1];
  char host[256];        /* numeric IPv4/IPv6 address or host name */
  uint16_t port;
} kvf__peer_cfg;

typedef struct kvf__pool_cfg {
  char name[KVF__NAME_MAX + 1];
  char kind[16];         /* "host" or "cuda:N" */
  uint64_t size;         /* bytes */
  int gpu_direct;        /* enum kvf__gdr: "gpu-direct=off" forces the rdma bounce */
} kvf__pool_cfg;

enum kvf__tristate { KVF__AUTO = 0, KVF__ON = 1, KVF__OFF = 2 };
enum kvf__gdr { KVF__GDR_AUTO = 0, KVF__GDR_OFF = 1 }; /* gpu-direct */
enum kvf__grant_overlap { KVF__GRANT_OVERLAP_REFUSE = 0, KVF__GRANT_OVERLAP_ALLOW = 1 };
enum kvf__peer_connect { KVF__CONNECT_EAGER = 0, KVF__CONNECT_ON_DEMAND = 1 }; /* peer-connect */
enum kvf__log_level { KVF__LOG_ERR = 0, KVF__LOG_WARN, KVF__LOG_INFO, KVF__LOG_DEBUG };

typedef struct kvf__config {
  char node[KVF__NAME_MAX + 1];
  char api_socket[108];            /* sun_path */
  uid_t allow_uids[KVF__MAX_IDS_CFG];
  size_t n_allow_uids;
  gid_t allow_gids[KVF__MAX_IDS_CFG];
  size_t n_allow_gids;
  char listen_host[256];           /* peer-listen; empty port 0 = no peers */
  uint16_t listen_port;
  kvf__peer_cfg peers[KVF__MAX_PEERS_CFG];
  size_t n_peers;
  char registry[512];              /* "etcd://HOST:PORT[,...]/PREFIX"; "" = off */
  uint32_t registry_ttl_ms;        /* our record's etcd lease */
  int peer_connect;                /* enum kvf__peer_connect: static peers (members: on demand) */
  uint32_t peer_idle_close_ms;     /* on-demand links with no transfer this long close; 0 = never */
  kvf__pool_cfg pools[KVF__MAX_POOLS_CFG];
  size_t n_pools;
  uint32_t default_deadline_ms;
  uint32_t heartbeat_ms;
  uint32_t peer_timeout_ms;
  uint32_t reconnect_min_ms;
  uint32_t reconnect_max_ms;
  uint32_t tcp_streams;
  uint32_t tcp_threads;             /* 0: from the core count (tcp_int.h) */
  uint32_t tcp_pollers;            /* tcp: sender workers that may poll at once; 0: from the cores */
  uint32_t max_frame;
  uint32_t max_descs;
  uint32_t max_clients;
  uint32_t api_hello_timeout_ms;   /* a client that has not said Hello by then is closed */
  uint32_t api_operator_slots;     /* on top of max_clients, for root and our user */
  uint32_t api_output_budget;      /* unread replies and events, all clients together */
  uint32_t max_transfers_per_client;
  uint32_t max_peers;
  uint32_t max_pending_peers;      /* inbound peer connections before their Hello */
  uint32_t max_pending_per_address; /* of those, from one source address */
  uint32_t peer_handshake_timeout_ms; /* a peer connection's Hello (and proofs) within this */
  bool peer_address_check;         /* a Hello must come from the claimed peer's address */
  uint32_t max_peer_waiting;       /* send intents + pushed grants one peer leaves with us */
  int grant_overlap;               /* enum kvf__grant_overlap (grant_index.h) */
  int hugepages;                   /* enum kvf__tristate */
  bool mlock;
  int cuda;                        /* enum kvf__tristate: GPU support */
  int log_level;                   /* enum kvf__log_level */
  char transports[64];             /* e.g. "tcp" (later "rdma,tcp"), in preference order */
  char metrics_host[256];          /* metrics-listen; empty = no metrics endpoint */
  uint16_t metrics_port;
  uint32_t stop_timeout_ms;        /* SIGTERM: how long in-flight transfers may finish */
  /* rdma transport (daemon/transport/rdma/) */
  char rdma_devices[256];          /* "" = auto, else "name[:port],..." */
  int32_t rdma_gid_index;          /* -1 = auto (the RoCE v2 IPv4 GID) */
  char rdma_listen_host[256];      /* rdma-listen; empty or wildcard = auto */
  uint16_t rdma_listen_port;
  uint32_t rdma_qps_per_peer;
  uint32_t rdma_queue_depth;
  uint32_t rdma_inline;
  uint32_t rdma_slice;
  uint32_t rdma_poll_us;
  bool busy_poll;                  /* the loop, tcp and rdma threads never sleep */
  uint32_t spin_us;                /* spin.h: poll this long after activity */
  uint32_t spin_grant_us;          /* spin.h: and this long after a grant ahead */
  uint32_t spin_cadence_us;        /* spin.h: and this long around a layer part's due time */
  int rdma_memory_windows;         /* enum kvf__tristate: a type 2 memory window per grant range */
  uint32_t rdma_mw_max_windows;    /* windows per grant; more ranges are merged across gaps */
  int gpu_direct;                  /* enum kvf__gdr: off = every pool bounces */
  uint32_t rdma_bounce_size;       /* pinned staging per device for the rdma bounce path */
  uint32_t rdma_staging_size;      /* the arena of transforms' staging slices (rdma_stage.c); 0: off */
  /* peer authentication (daemon/auth.c) */
  char cluster_key_file[256];      /* "" = off: peers are not authenticated */
} kvf__config;

/* A node, pool or peer name: 1..KVF__NAME_MAX of [A-Za-z0-9._-]. */
bool kvf__config_valid_name(const char *s);
/* Sets every key to its default. */
void kvf__config_defaults(kvf__config *cfg);
/* Parses a config file over the current values. On error returns a negative
 * errno and writes "FILE:LINE: message" into err. */
int kvf__config_load(kvf__config *cfg, const char *path, char *err, size_t errlen);
/* Same, from a string (name is used in messages); the fuzzer's entry point. */
int kvf__config_parse(kvf__config *cfg, const char *text, size_t len,
                      const char *name, char *err, size_t errlen);
/* Checks cross-key constraints (e.g. node set, timeouts ordered, unique
 * pool and peer names). */
int kvf__config_validate(const kvf__config *cfg, char *err, size_t errlen);
/* Writes every key, its type, default and help (kvferryd --help). */
void kvf__config_print_help(FILE *out);
/* Writes the effective configuration as "key value" lines, or as a JSON
 * object when json is true. */
void kvf__config_dump(const kvf__config *cfg, FILE *out, bool json);
/* SIGHUP: next is a freshly loaded and validated configuration that is to
 * replace cur. Keys that cannot change at run time (the table says which)
 * get cur's value back in next. report, when not NULL, is called for every
 * key whose value differs, with both values as one line of text and
 * applied = false for the keys that were kept. */
typedef void kvf__config_change_fn(const char *key, const char *from, const char *to,
                                   bool applied, void *arg);
void kvf__config_prepare_reload(kvf__config *next, const kvf__config *cur,
                                kvf__config_change_fn *report, void *arg);
/* Whether SIGHUP applies key (false for unknown keys). */
bool kvf__config_key_reloadable(const char *key);
/* Parses sizes like 4096, 64K, 512M, 2G (binary units). */
int kvf__parse_size(const char *s, uint64_t *out);
/* config_syntax.c: a decimal number (digits only, 0 or -EINVAL/-ERANGE);
 * the shortest exact form of a size (64M rather than 67108864); an IPv4
 * address or host name. */
int kvf__config_parse_dec(const char *s, uint64_t *out);
const char *kvf__config_format_size(uint64_t v, char buf[static 32]);
bool kvf__config_valid_hostname(const char *h);

#endif
