/* config.c - kvferryd's configuration (see config.h).
 *
 * One static table (opts[] below) is the single source of truth: each entry
 * names a key, its type, the kvf__config field it fills, its bounds, its
 * default (as config text) and its help. Parsing, the defaults (which are
 * parsed from that text), the bound checks in validate, --help and the dump
 * all walk the same table, so a key cannot be documented but not parsed, or
 * parsed but not dumped. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "config.h"
#include "desc.h"
#include "json.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LINE_MAX_LEN 4096       /* longer lines are an error, not a crash */
#define MAX_WORDS 128           /* key + arguments on one line */
#define MAX_ITEMS 128           /* comma/space separated list items */
#define FILE_MAX_LEN (16u << 20) /* a config file is small; refuse a runaway */
#define POOL_ALIGN 4096u        /* pools are mapped and registered in pages */
#define CUDA_DEV_MAX 63

enum opt_type {
  OPT_NAME,       /* 1..63 of [A-Za-z0-9._-] */
  OPT_PATH,       /* one word, at most .max bytes */
  OPT_U32,        /* decimal, .min...max */
  OPT_SIZE32,     /* kvf__parse_size, .min...max, stored as uint32_t */
  OPT_BOOL,       /* yes|no */
  OPT_ENUM,       /* one of .words, stored as the int index */
  OPT_UIDS,       /* user names or uids; .off array, .off2 count */
  OPT_GIDS,       /* group names or gids; .off array, .off2 count */
  OPT_ADDR,       /* HOST:PORT or off; .off host, .off2 port */
  OPT_TRANSPORTS, /* comma list of transport names, normalized */
  OPT_PEER,       /* repeatable: NAME HOST:PORT */
  OPT_POOL,       /* repeatable: NAME KIND SIZE */
  OPT_DEVICES,    /* auto or a comma list of NAME[:PORT] (RDMA devices) */
  OPT_AUTO_U32,   /* auto or decimal .min...max, stored as int32_t (-1 = auto) */
  OPT_FILE,       /* an absolute path of at most .max bytes, or off (stored as "") */
  OPT_REGISTRY,   /* etcd://HOST:PORT[,HOST:PORT...]/PREFIX or off (stored as "") */
  OPT_NTYPES
};

struct opt {
  const char *name;
  enum opt_type type;
  size_t off, off2;
  uint64_t min, max;
  const char *const *words;
  const char *def;  /* default as config text; "" = empty / none */
  const char *json; /* key in the JSON dump when not .name */
  const char *help;
  bool reload;      /* SIGHUP applies it at run time; else it needs a restart */
};

/* Where a parse is: for "FILE:LINE: message" errors. */
struct pctx {
  const char *name;
  unsigned line;
  char *err;
  size_t errlen;
  char shown[96]; /* a user value made printable for a message */
};

typedef int parse_fn(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                     struct pctx *pc);
typedef void dump_fn(const struct opt *o, const kvf__config *cfg, FILE *out);

struct opt_kind {
  const char *arg; /* argument shown in --help and arity errors */
  int min_args, max_args;
  bool repeatable;
  parse_fn *parse;
  dump_fn *dump; /* whole "key value" lines */
  dump_fn *json; /* the JSON value */
};

#define F(field) offsetof(kvf__config, field)
#define CAP(field) (sizeof(((kvf__config *)0)->field))

static const char *const tristate_words[] = {"auto", "on", "off", NULL};
static const char *const gdr_words[] = {"auto", "off", NULL}; /* enum kvf__gdr */
static const char *const level_words[] = {"err", "warn", "info", "debug", NULL};
static const char *const transport_words[] = {"tcp", "rdma", NULL};
static const char *const connect_words[] = {"eager", "on-demand", NULL}; /* enum kvf__peer_connect */
static const char *const overlap_words[] = {"refuse", "allow", NULL}; /* enum kvf__grant_overlap */

/* The table. Order is the order of --help, the dump and kvferryd.conf. */
static const struct opt opts[] = {
    {.name = "node", .type = OPT_NAME, .off = F(node), .def = "",
     .help = "This node's name as peers and clients see it: 1..63 of A-Z a-z 0-9 . _ -"},
    {.name = "api-socket", .type = OPT_PATH, .off = F(api_socket),
     .max = CAP(api_socket) - 1, .def = "/run/kvferry/kvferryd.sock",
     .help = "Unix socket of the local client API (at most 107 bytes)."},
    {.name = "api-allow-users", .reload = true, .type = OPT_UIDS, .off = F(allow_uids),
     .off2 = F(n_allow_uids), .def = "",
     .help = "Users (names or uids) allowed on the API socket besides root and "
             "kvferryd's own user; empty = only those two."},
    {.name = "api-allow-groups", .reload = true, .type = OPT_GIDS, .off = F(allow_gids),
     .off2 = F(n_allow_gids), .def = "",
     .help = "Groups (names or gids) whose members may use the API socket; "
             "empty = none."},
    {.name = "peer-listen", .type = OPT_ADDR, .off = F(listen_host),
     .off2 = F(listen_port), .def = "0.0.0.0:7470",
     .help = "Address for peer daemons; IPv6 as [::1]:7470, port 0 = any, "
             "off = accept no peers."},
    {.name = "peer", .reload = true, .type = OPT_PEER, .json = "peers", .def = "",
     .help = "A static peer daemon; repeat the line for each peer."},
    {.name = "registry", .type = OPT_REGISTRY, .off = F(registry), .max = CAP(registry) - 1,
     .def = "off",
     .help = "Membership through etcd (v3 JSON gateway): our record (node, address, transports, "
             "incarnation, start) under PREFIX/nodes/NODE with a lease kept alive; the others, "
             "watched, become peers without a reload (peer lines still work). A name held by a "
             "live daemon stops the start; while etcd is away the members stay (status, doctor, "
             "metrics say so). Address: peer-listen's, or the local address towards etcd."},
    {.name = "peer-connect", .reload = true, .type = OPT_ENUM, .off = F(peer_connect),
     .words = connect_words, .def = "eager",
     .help = "Static peers: eager = dialed at start and whenever the link drops; on-demand = "
             "on first need (a send, a pushed grant), closed when idle. Registry members are "
             "always on demand; sends wait for the link within their deadlines."},
    {.name = "peer-idle-close-ms", .reload = true, .type = OPT_U32, .off = F(peer_idle_close_ms),
     .min = 0, .max = 86400000, .def = "30000",
     .help = "An on-demand link that carried no transfer this long closes; 0 = never."},
    {.name = "registry-ttl-ms", .type = OPT_U32, .off = F(registry_ttl_ms),
     .min = 2000, .max = 600000, .def = "5000",
     .help = "TTL of our etcd lease (whole seconds): a dead daemon leaves the membership this "
             "long after its last keepalive. One value on every node."},
    {.name = "cluster-key-file", .type = OPT_FILE, .off = F(cluster_key_file),
     .max = CAP(cluster_key_file) - 1, .def = "off",
     .help = "File holding the cluster key, the same bytes on every node (16..4096 bytes, "
             "e.g. head -c 32 /dev/urandom). It must be a regular file owned by kvferryd's "
             "user with mode 0600, else kvferryd does not start. Peers prove that they hold "
             "the key (HMAC-SHA256 challenge-response; the key never crosses the network) "
             "before they are up and on every data connection; a peer with another key, or "
             "none, is refused and logged. off = peers are not authenticated (warned at "
             "start). A change needs a restart."},
    {.name = "pool", .type = OPT_POOL, .json = "pools", .def = "",
     .help = "A memory pool allocated at start, in host RAM or on GPU N; SIZE is a "
             "multiple of 4K. gpu-direct=off: the NICs do not reach this pool, its rdma "
             "transfers are staged through pinned host memory (path rdma-bounce; see "
             "gpu-direct). Repeat the line for each pool."},
    {.name = "default-deadline-ms", .reload = true, .type = OPT_U32, .off = F(default_deadline_ms),
     .min = 1, .max = 86400000, .def = "30000",
     .help = "Deadline of a transfer whose client gave none."},
    {.name = "heartbeat-ms", .reload = true, .type = OPT_U32, .off = F(heartbeat_ms),
     .min = 10, .max = 60000, .def = "200",
     .help = "Interval of heartbeats to each connected peer."},
    {.name = "peer-timeout-ms", .reload = true, .type = OPT_U32, .off = F(peer_timeout_ms),
     .min = 50, .max = 600000, .def = "700",
     .help = "A peer silent this long is dead (its transfers with data under way "
             "fail; sends not started wait for it within their deadlines); must exceed "
             "2 x heartbeat-ms. The default notices a dead peer within 1 s."},
    {.name = "reconnect-min-ms", .reload = true, .type = OPT_U32, .off = F(reconnect_min_ms),
     .min = 1, .max = 60000, .def = "100",
     .help = "First delay before reconnecting to a lost peer (then doubled)."},
    {.name = "reconnect-max-ms", .reload = true, .type = OPT_U32, .off = F(reconnect_max_ms),
     .min = 1, .max = 600000, .def = "5000",
     .help = "Longest delay between reconnect attempts; >= reconnect-min-ms."},
    {.name = "tcp-streams", .type = OPT_U32, .off = F(tcp_streams),
     .min = 1, .max = 64, .def = "4",
     .help = "TCP connections per peer that the tcp transport stripes data over."},
    {.name = "tcp-threads", .type = OPT_U32, .off = F(tcp_threads),
     .min = 0, .max = 256, .def = "0",
     .help = "Worker threads of the tcp transport on each side (sending, receiving): they "
             "multiplex every peer's data streams, so a daemon's thread count does not grow "
             "with its peers. 0 = from the core count: half the cores, at least 4 and at most 16."},
    {.name = "tcp-pollers", .type = OPT_U32, .off = F(tcp_pollers), .min = 0, .max = 256, .def = "0",
     .help = "How many of the tcp transport's sending workers may poll for work at once while "
             "spin-us, spin-grant-us or busy-poll keep them awake (the rest sleep): with as many as "
             "a peer has tcp-streams, a striped part starts on every stream at once instead of "
             "waiting for a sleeping worker's wake-up on all but one. 0 = a quarter of the CPUs the "
             "daemon may run on, at least 1, at most tcp-streams and tcp-threads. Pollers beyond the "
             "CPUs to spare take them from the data's other threads (8 on 16 CPUs, with 8 streams: "
             "a 64 KiB handoff took 1.4 ms instead of 55 us)."},
    {.name = "max-frame", .type = OPT_SIZE32, .off = F(max_frame),
     .min = 4096, .max = 1u << 30, .def = "64M",
     .help = "Largest control message accepted (checked before unpacking); must hold "
             "max-descs descriptors (20 bytes each) plus 512. A client that leaves more "
             "than 4 x max-frame of replies and events unread is disconnected."},
    {.name = "max-descs", .reload = true, .type = OPT_U32, .off = F(max_descs),
     .min = 1, .max = 16777216, .def = "1048576",
     .help = "Most block descriptors in one send or receive grant."},
    {.name = "max-clients", .reload = true, .type = OPT_U32, .off = F(max_clients),
     .min = 1, .max = 65536, .def = "256",
     .help = "Most simultaneous local API connections (root and kvferryd's own user "
             "also have api-operator-slots)."},
    {.name = "api-operator-slots", .reload = true, .type = OPT_U32, .off = F(api_operator_slots),
     .min = 0, .max = 64, .def = "4",
     .help = "Local API connections on top of max-clients that only root and "
             "kvferryd's own user may take, so that an operator can always inspect "
             "a daemon whose slots are taken."},
    {.name = "api-hello-timeout-ms", .reload = true, .type = OPT_U32, .off = F(api_hello_timeout_ms),
     .min = 10, .max = 600000, .def = "5000",
     .help = "A local API connection that has not completed its Hello within this "
             "long (nothing sent, or half a frame) is closed, freeing its slot."},
    {.name = "api-output-budget", .reload = true, .type = OPT_SIZE32, .off = F(api_output_budget),
     .min = 1u << 20, .max = 3u << 30, .def = "256M",
     .help = "Replies and events that local clients have not read yet, all clients together "
             "(each client also has its 4 x max-frame). Past it, the client that holds the "
             "most is disconnected (logged, counted as api_output_drops in status) and its "
             "memory given back. A client's requests are served only while it reads its "
             "replies, so this catches clients that stopped reading; the default is what one "
             "client alone could hold before (4 x the default max-frame). At least 2 x "
             "max-frame is allowed, whatever the setting."},
    {.name = "max-transfers-per-client", .reload = true, .type = OPT_U32,
     .off = F(max_transfers_per_client), .min = 1, .max = 1048576, .def = "4096",
     .help = "Most transfers one client may have in flight."},
    {.name = "max-peers", .reload = true, .type = OPT_U32, .off = F(max_peers),
     .min = 1, .max = KVF__MAX_PEERS_CFG, .def = "64",
     .help = "Most live peer links (on demand, the least recently used idle one makes room); "
             "with peer-connect eager also the most peer lines."},
    {.name = "max-pending-peers", .reload = true, .type = OPT_U32, .off = F(max_pending_peers),
     .min = 1, .max = 65536, .def = "1024",
     .help = "Most inbound peer connections (control or tcp data stream) that have "
             "not yet identified themselves; more are closed at once and logged (at "
             "most once a second), unless they come from a configured peer's address: "
             "then the oldest pending connection from another address makes room. Each "
             "waits at most peer-handshake-timeout-ms for its Hello. Keep it above "
             "max-peers x (1 + the peers' tcp-streams)."},
    {.name = "max-pending-per-address", .reload = true, .type = OPT_U32,
     .off = F(max_pending_per_address), .min = 1, .max = 65536, .def = "128",
     .help = "Most of those pending connections from one source address; a newer one "
             "from that address closes the oldest (logged at most once a second), so "
             "one host cannot fill max-pending-peers and a peer's fresh dial always "
             "gets in. An address of configured peers has room for 1 + tcp-streams "
             "more per peer there (each one's control connection and data streams)."},
    {.name = "peer-handshake-timeout-ms", .reload = true, .type = OPT_U32,
     .off = F(peer_handshake_timeout_ms), .min = 50, .max = 600000, .def = "2000",
     .help = "A peer connection (ours or theirs) that has not completed its Hello, "
             "and its cluster-key proofs, within this long is closed."},
    {.name = "peer-address-check", .reload = true, .type = OPT_BOOL,
     .off = F(peer_address_check), .def = "yes",
     .help = "yes: a peer's Hello counts only from the address configured for it (the "
             "source IP of its connection must be the peer line's resolved address; "
             "this daemon dials from its peer-listen address when that is one IP). "
             "Refusals are logged with the address. no: any address may claim any "
             "configured name (multi-homed peers dialing from another address)."},
    {.name = "max-peer-waiting", .reload = true, .type = OPT_U32, .off = F(max_peer_waiting),
     .min = 1, .max = 16777216, .def = "65536",
     .help = "Most send intents and pushed grants that one peer may leave here waiting "
             "for their other half (each waits at most its deadline). Past it, a new "
             "one is refused to the peer with KVF_ELIMIT: its send or grant fails, "
             "nothing else does. Also the most of our sends that wait for one peer "
             "that is down or reconnecting; past it a new send to it is refused "
             "(KVF_ELIMIT)."},
    {.name = "grant-overlap", .reload = true, .type = OPT_ENUM, .off = F(grant_overlap),
     .words = overlap_words, .def = "refuse",
     .help = "A receive grant whose ranges overlap those of a grant still open in the same "
             "pool: refuse = refused with KVF_EBUSY (the message names both ranges and the "
             "other grant), allow = accepted (whichever write lands last wins; for engines "
             "that reuse memory on purpose). Ranges that overlap within one grant are always "
             "refused (KVF_EINVAL). A change applies to grants posted after it."},
    {.name = "hugepages", .type = OPT_ENUM, .off = F(hugepages),
     .words = tristate_words, .def = "auto",
     .help = "Huge pages for host pools: auto = if available, on = required, "
             "off = never."},
    {.name = "mlock", .type = OPT_BOOL, .off = F(mlock), .def = "yes",
     .help = "Lock host pools in RAM (best effort: a failure is logged)."},
    {.name = "cuda", .type = OPT_ENUM, .off = F(cuda), .words = tristate_words, .def = "auto",
     .help = "GPU support (cuda:N pools, GPU copies; the driver is loaded at run time): "
             "auto = when a driver and GPU are found (said at start), on = required, "
             "off = never load CUDA."},
    {.name = "log-level", .reload = true, .type = OPT_ENUM, .off = F(log_level),
     .words = level_words, .def = "info",
     .help = "Most verbose level logged to stderr."},
    {.name = "transports", .type = OPT_TRANSPORTS, .off = F(transports),
     .words = transport_words, .def = "tcp",
     .help = "Transports to peers, in order of preference."},
    {.name = "metrics-listen", .type = OPT_ADDR, .off = F(metrics_host),
     .off2 = F(metrics_port), .def = "off",
     .help = "HTTP address of the Prometheus metrics endpoint (GET /metrics); "
             "unauthenticated, so keep it on loopback, e.g. 127.0.0.1:9464. "
             "Port 0 = any, off = no endpoint."},
    {.name = "stop-timeout-ms", .reload = true, .type = OPT_U32, .off = F(stop_timeout_ms),
     .min = 0, .max = 600000, .def = "5000",
     .help = "On SIGTERM, how long transfers in flight may still finish before they "
             "are failed; new clients and transfers are refused meanwhile. Keep it "
             "below the service's TimeoutStopSec."},
    {.name = "rdma-devices", .type = OPT_DEVICES, .off = F(rdma_devices), .def = "auto",
     .help = "RDMA devices the rdma transport uses, e.g. mlx5_0,mlx5_1 or rxe0:1 "
             "(port 1 when not named); auto = every device with an active RoCE port "
             "whose IP matches rdma-listen (or peer-listen)."},
    {.name = "rdma-gid-index", .type = OPT_AUTO_U32, .off = F(rdma_gid_index), .min = 0,
     .max = 1023, .def = "auto",
     .help = "GID index on every rdma device; its address is where the CM listener "
             "binds. auto = the RoCE v2 GID of an IPv4 address (the one matching "
             "rdma-listen when set)."},
    {.name = "rdma-listen", .type = OPT_ADDR, .off = F(rdma_listen_host),
     .off2 = F(rdma_listen_port), .def = "0.0.0.0:0",
     .help = "RDMA CM listener: HOST picks the device (auto) and GID by IP, "
             "0.0.0.0 = the peer-listen address; PORT 0 = any (peers learn it "
             "from the Hello). off = same as 0.0.0.0:0."},
    {.name = "rdma-qps-per-peer", .type = OPT_U32, .off = F(rdma_qps_per_peer),
     .min = 1, .max = 64, .def = "2",
     .help = "Reliable-connected queue pairs dialed to each peer on each device; "
             "transfers are spread over all of them."},
    {.name = "rdma-queue-depth", .type = OPT_U32, .off = F(rdma_queue_depth),
     .min = 16, .max = 16384, .def = "512",
     .help = "Work requests in flight per queue pair (send queue and the receives "
             "posted for completion notices)."},
    {.name = "rdma-inline", .type = OPT_SIZE32, .off = F(rdma_inline),
     .min = 0, .max = 4096, .def = "64",
     .help = "Writes of at most this many bytes are posted inline (copied into the "
             "work request); 0 = never. Capped by what the device supports."},
    {.name = "rdma-slice", .type = OPT_SIZE32, .off = F(rdma_slice),
     .min = 4096, .max = 1u << 30, .def = "1M",
     .help = "Largest single RDMA WRITE; longer runs are cut into slices so one "
             "big block still uses every queue pair and device."},
    {.name = "rdma-poll-us", .type = OPT_U32, .off = F(rdma_poll_us),
     .min = 0, .max = 100000, .def = "20",
     .help = "How long a progress thread keeps polling after its last completion "
             "before it sleeps on the completion channel; 0 = sleep at once."},
    {.name = "busy-poll", .type = OPT_BOOL, .off = F(busy_poll), .def = "no",
     .help = "Spin instead of sleeping: the event loop never blocks waiting for events, "
             "the tcp transport's threads poll their queues and sockets, and the rdma "
             "progress threads never sleep on their completion channels, which takes the "
             "wake-ups off a handoff's path. Each of those threads (2 x tcp-threads for tcp) then "
             "keeps a core busy all the time: for nodes with cores to spare. Without it, "
             "spin-us and spin-grant-us spin for bounded windows."},
    {.name = "spin-us", .type = OPT_U32, .off = F(spin_us), .min = 0, .max = 1000000, .def = "200",
     .help = "How long the event loop and the tcp transport's threads keep polling after their "
             "last activity before they sleep, so that the next hop of a handoff finds them awake; "
             "200 us covers the gap between the layer parts of a short prompt's prefill (145 us a "
             "layer at 128 tokens); 0 = sleep at once. busy-poll yes: always. A polling thread "
             "whose CPU is shared with busy work (a yield ran another task's slice) stops polling "
             "for 5 ms, doubling to 1 s while that lasts (status: spin_backoffs)."},
    {.name = "spin-grant-us", .type = OPT_U32, .off = F(spin_grant_us), .min = 0, .max = 10000000,
     .def = "10000",
     .help = "How long a grant keeps the data path polling: on the receiver from the grant's "
             "opening (the loop and the tcp receivers), on the sender from the peer's grant "
             "reaching it ahead of the send (the loop and the tcp senders; the rdma progress "
             "threads on both), so that a send posted a prefill after its grant is not slower than "
             "one posted back to back; threads asleep when the window opens are woken then; 0 = off."},
    {.name = "spin-cadence-us", .type = OPT_U32, .off = F(spin_cadence_us), .min = 0, .max = 1000000,
     .def = "500",
     .help = "How long before the next part of a layer-wise send is due (one gap after its last, "
             "at the cadence of its earlier parts) the loop starts polling, and how long after it "
             "keeps polling if the part is late, so that a part posted after a long layer's compute "
             "finds the loop awake instead of asleep since the last part; before a local send's "
             "last part, the window's start also tells the receiving engine Soon; 0 = off."},
    {.name = "rdma-memory-windows", .type = OPT_ENUM, .off = F(rdma_memory_windows),
     .words = tristate_words, .def = "auto",
     .help = "Limit a peer's RDMA writes to the ranges of its open grants: pools are "
             "registered without remote access, and each grant binds one type 2 memory "
             "window per range on the peer's queue pairs, invalidated when the transfer "
             "ends. auto = when every device supports them, on = required (else kvferryd "
             "does not start), off = one pool-wide rkey per pool, with which a peer can "
             "write any byte of a registered pool at any time. kvferryctl status and "
             "doctor say which is in effect, and whether each device checks writes "
             "against a window's bounds (tested at start; rxe on Linux 6.1 does not)."},
    {.name = "rdma-mw-max-windows", .type = OPT_U32, .off = F(rdma_mw_max_windows),
     .min = 1, .max = 16777216, .def = "16384",
     .help = "Most memory windows bound for one grant (each costs a bind work request "
             "and a device object; rxe in a VM binds about 40k a second). A grant with "
             "more separate ranges gets windows that also span the smallest gaps between "
             "its ranges, so the peer may write those gaps too while the grant is open; "
             "this is logged and counted (merged_grants in the status)."},
    {.name = "gpu-direct", .type = OPT_ENUM, .off = F(gpu_direct), .words = gdr_words, .def = "auto",
     .help = "Whether the NICs reach pools directly (in the spirit of NCCL_NET_GDR_LEVEL). auto = "
             "register every pool with each rdma device (GPU pools by dmabuf, else "
             "nvidia-peermem), and bounce only those that cannot be; off = register none: "
             "every pool's rdma transfers are staged through pinned host memory (path "
             "rdma-bounce), to compare GPUDirect on and off on one machine. A pool line's "
             "gpu-direct=off does the same for one pool."},
    {.name = "rdma-bounce-size", .type = OPT_SIZE32, .off = F(rdma_bounce_size),
     .min = 1u << 20, .max = 1u << 30, .def = "64M",
     .help = "Pinned host memory per rdma device, registered once, through which transfers "
             "of pools the NIC cannot reach are staged (path rdma-bounce): half for sending, "
             "half for receiving, in chunks of up to 1M, several in flight so that copies "
             "overlap the writes."},
    {.name = "rdma-staging-size", .type = OPT_SIZE32, .off = F(rdma_staging_size), .max = 1u << 31, .def = "64M",
     .help = "Host memory (pinned) a receiver lends, per grant, as staging for transforms whose direct writes would be small; 0: off."},
};
#define N_OPTS (sizeof(opts) / sizeof(opts[0]))

/* ---- small helpers ---------------------------------------------------- */

static void *field(kvf__config *cfg, size_t off) { return (char *)cfg + off; }
static const void *cfield(const kvf__config *cfg, size_t off) {
  return (const char *)cfg + off;
}

static void vput_err(char *err, size_t errlen, const char *prefix, const char *fmt,
                     va_list ap) {
  if (!err || errlen == 0) return;
  int n = snprintf(err, errlen, "%s", prefix);
  if (n < 0 || (size_t)n >= errlen) return;
  vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
}

/* Writes "FILE:LINE: message" and returns rc, so that callers can
 * `return fail(pc, -EINVAL, ...)`. */
__attribute__((format(printf, 3, 4))) static int fail(struct pctx *pc, int rc,
                                                       const char *fmt, ...) {
  char prefix[320];
  snprintf(prefix, sizeof prefix, "%s:%u: ", pc->name, pc->line);
  va_list ap;
  va_start(ap, fmt);
  vput_err(pc->err, pc->errlen, prefix, fmt, ap);
  va_end(ap);
  return rc;
}

__attribute__((format(printf, 3, 4))) static int vfail(char *err, size_t errlen,
                                                        const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vput_err(err, errlen, "invalid configuration: ", fmt, ap);
  va_end(ap);
  return -EINVAL;
}

/* A user-supplied word made safe to echo in a message: garbage bytes and
 * huge values must not reach the log as they are. */
static const char *show(struct pctx *pc, const char *s) {
  size_t n = 0, cap = sizeof pc->shown;
  for (; *s && n + 4 < cap; s++, n++)
    pc->shown[n] = (*s >= 0x20 && *s < 0x7f) ? *s : '?';
  if (*s) n += (size_t)snprintf(pc->shown + n, cap - n, "...");
  pc->shown[n] = '\0';
  return pc->shown;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

/* Copies a string into a fixed field, zeroing the rest so that equal
 * configurations are equal byte for byte whatever their history. */
static void set_str(char *dst, size_t cap, const char *src) {
  memset(dst, 0, cap);
  memcpy(dst, src, strnlen(src, cap - 1));
}

static int word_index(const char *const *words, const char *w) {
  for (int i = 0; words[i]; i++)
    if (strcmp(words[i], w) == 0) return i;
  return -1;
}

static void join_words(const char *const *words, const char *sep, char *buf,
                       size_t cap) {
  size_t n = 0;
  buf[0] = '\0';
  for (int i = 0; words[i] && n < cap; i++)
    n += (size_t)snprintf(buf + n, cap - n, "%s%s", i ? sep : "", words[i]);
}

/* Splits words at commas into items (empty items are skipped: "a, b" is two
 * items). Modifies the words. Returns the count, or -E2BIG. */
static int split_items(char **argv, int argc, char **items) {
  int n = 0;
  for (int i = 0; i < argc; i++) {
    char *save = NULL;
    for (char *it = strtok_r(argv[i], ",", &save); it; it = strtok_r(NULL, ",", &save)) {
      if (n == MAX_ITEMS) return -E2BIG;
      items[n++] = it;
    }
  }
  return n;
}

/* ---- addresses ---------------------------------------------------------- */

/* Splits "HOST:PORT" or "[V6]:PORT"; host is written without brackets. */
static int split_hostport(const char *key, const char *s, char *host, size_t hostcap,
                          const char **port, struct pctx *pc) {
  const char *hs = s, *he;
  if (*s == '[') {
    hs = s + 1;
    he = strchr(hs, ']');
    if (!he || he[1] != ':')
      return fail(pc, -EINVAL, "%s: '%s': expected [IPV6]:PORT", key, show(pc, s));
    *port = he + 2;
  } else {
    he = strrchr(s, ':');
    if (!he) return fail(pc, -EINVAL, "%s: '%s': expected HOST:PORT", key, show(pc, s));
    if (memchr(s, ':', (size_t)(he - s)))
      return fail(pc, -EINVAL, "%s: '%s': write IPv6 addresses in brackets, e.g. [::1]:7470",
                  key, show(pc, s));
    *port = he + 1;
  }
  size_t n = (size_t)(he - hs);
  if (n == 0) return fail(pc, -EINVAL, "%s: '%s': empty host", key, show(pc, s));
  if (n >= hostcap) return fail(pc, -EINVAL, "%s: host name too long", key);
  memset(host, 0, hostcap);
  memcpy(host, hs, n);
  return 0;
}

static int parse_hostport(const char *key, const char *s, char *host, size_t hostcap,
                          uint16_t *port, bool port0_ok, struct pctx *pc) {
  const char *ps = "";
  int rc = split_hostport(key, s, host, hostcap, &ps, pc);
  if (rc) return rc;
  struct in6_addr a6;
  bool v6 = *s == '[';
  if (v6 ? inet_pton(AF_INET6, host, &a6) != 1 : !kvf__config_valid_hostname(host))
    return fail(pc, -EINVAL, "%s: '%s' is not a valid %s", key, show(pc, host),
                v6 ? "IPv6 address" : "IPv4 address or host name");
  uint64_t p;
  if (kvf__config_parse_dec(ps, &p) || p > 65535 || (p == 0 && !port0_ok))
    return fail(pc, -EINVAL, "%s: port '%s' is not in %d..65535", key, show(pc, ps),
                port0_ok ? 0 : 1);
  *port = (uint16_t)p;
  return 0;
}

static void format_addr(const char *host, uint16_t port, char *buf, size_t cap) {
  if (!host[0])
    snprintf(buf, cap, "off");
  else
    snprintf(buf, cap, strchr(host, ':') ? "[%s]:%u" : "%s:%u", host, port);
}

/* ---- parsers, one per type ------------------------------------------------ */

static int parse_name(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                      struct pctx *pc) {
  if (!kvf__config_valid_name(argv[0]))
    return fail(pc, -EINVAL, "%s: '%s' is not a valid name (1..%d of A-Z a-z 0-9 . _ -)",
                o->name, show(pc, argv[0]), KVF__NAME_MAX);
  set_str(field(cfg, o->off), KVF__NAME_MAX + 1, argv[0]);
  return 0;
}

static int parse_path(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                      struct pctx *pc) {
  size_t n = strlen(argv[0]);
  if (n > o->max)
    return fail(pc, -ERANGE, "%s: path is %zu bytes, at most %" PRIu64 " fit a Unix socket",
                o->name, n, o->max);
  for (const char *p = argv[0]; *p; p++)
    if ((unsigned char)*p < 0x20 || *p == 0x7f)
      return fail(pc, -EINVAL, "%s: control character in path", o->name);
  set_str(field(cfg, o->off), (size_t)o->max + 1, argv[0]);
  return 0;
}

static int parse_u32(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                     struct pctx *pc) {
  uint64_t v;
  int rc = kvf__config_parse_dec(argv[0], &v);
  if (rc == -EINVAL)
    return fail(pc, -EINVAL, "%s: '%s' is not a decimal number", o->name, show(pc, argv[0]));
  if (rc || v < o->min || v > o->max)
    return fail(pc, -ERANGE, "%s: %s is out of range %" PRIu64 "..%" PRIu64, o->name,
                show(pc, argv[0]), o->min, o->max);
  *(uint32_t *)field(cfg, o->off) = (uint32_t)v;
  return 0;
}

static int parse_size32(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                        struct pctx *pc) {
  uint64_t v;
  char lo[32], hi[32];
  int rc = kvf__parse_size(argv[0], &v);
  if (rc == -EINVAL)
    return fail(pc, -EINVAL, "%s: '%s' is not a size (e.g. 4096, 64K, 512M, 1G)", o->name,
                show(pc, argv[0]));
  if (rc || v < o->min || v > o->max)
    return fail(pc, -ERANGE, "%s: %s is out of range %s..%s", o->name, show(pc, argv[0]),
                kvf__config_format_size(o->min, lo), kvf__config_format_size(o->max, hi));
  *(uint32_t *)field(cfg, o->off) = (uint32_t)v;
  return 0;
}

static int parse_bool(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                      struct pctx *pc) {
  static const char *const yes_no[] = {"no", "yes", NULL};
  int i = word_index(yes_no, argv[0]);
  if (i < 0) return fail(pc, -EINVAL, "%s: '%s' is not yes or no", o->name, show(pc, argv[0]));
  *(bool *)field(cfg, o->off) = i == 1;
  return 0;
}

static int parse_enum(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                      struct pctx *pc) {
  char allowed[128];
  int i = word_index(o->words, argv[0]);
  if (i < 0) {
    join_words(o->words, "|", allowed, sizeof allowed);
    return fail(pc, -EINVAL, "%s: '%s' is not one of %s", o->name, show(pc, argv[0]), allowed);
  }
  *(int *)field(cfg, o->off) = i;
  return 0;
}

/* Resolves a user or group: all digits is a numeric id, anything else a
 * name. Config loading runs once at start, single threaded, so the
 * non-reentrant getpwnam/getgrnam are fine here. */
static int resolve_id(const char *s, bool user, unsigned *id) {
  uint64_t v;
  if (is_digit(*s)) {
    if (kvf__config_parse_dec(s, &v) || v >= (uid_t)-1) return -ERANGE;
    *id = (unsigned)v;
    return 0;
  }
  if (user) {
    struct passwd *pw = getpwnam(s);
    if (!pw) return -ENOENT;
    *id = pw->pw_uid;
  } else {
    struct group *gr = getgrnam(s);
    if (!gr) return -ENOENT;
    *id = gr->gr_gid;
  }
  return 0;
}

static bool has_id(const unsigned *ids, size_t n, unsigned id) {
  for (size_t i = 0; i < n; i++)
    if (ids[i] == id) return true;
  return false;
}

/* Collects the distinct ids of a user or group list into ids[]. */
static int collect_ids(const struct opt *o, char **items, int n_items, unsigned *ids,
                       size_t *n_ids, struct pctx *pc) {
  bool user = o->type == OPT_UIDS;
  *n_ids = 0;
  for (int i = 0; i < n_items; i++) {
    unsigned id;
    int rc = resolve_id(items[i], user, &id);
    if (rc == -ENOENT)
      return fail(pc, -EINVAL, "%s: no such %s '%s'", o->name, user ? "user" : "group",
                  show(pc, items[i]));
    if (rc) return fail(pc, -ERANGE, "%s: bad id '%s'", o->name, show(pc, items[i]));
    if (has_id(ids, *n_ids, id)) continue;
    if (*n_ids == KVF__MAX_IDS_CFG)
      return fail(pc, -ERANGE, "%s: more than %d entries", o->name, KVF__MAX_IDS_CFG);
    ids[(*n_ids)++] = id;
  }
  return 0;
}

static int parse_ids(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                     struct pctx *pc) {
  char *items[MAX_ITEMS];
  unsigned ids[KVF__MAX_IDS_CFG];
  size_t n;
  int n_items = split_items(argv, argc, items);
  if (n_items < 0) return fail(pc, -ERANGE, "%s: too many entries", o->name);
  int rc = collect_ids(o, items, n_items, ids, &n, pc);
  if (rc) return rc;
  for (size_t i = 0; i < n; i++) {
    if (o->type == OPT_UIDS)
      ((uid_t *)field(cfg, o->off))[i] = (uid_t)ids[i];
    else
      ((gid_t *)field(cfg, o->off))[i] = (gid_t)ids[i];
  }
  *(size_t *)field(cfg, o->off2) = n;
  return 0;
}

/* Every OPT_ADDR host field has this size. */
#define ADDR_HOST_CAP CAP(listen_host)
_Static_assert(CAP(metrics_host) == ADDR_HOST_CAP, "OPT_ADDR host fields differ in size");
_Static_assert(CAP(rdma_listen_host) == ADDR_HOST_CAP, "OPT_ADDR host fields differ in size");

static int parse_addr(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                      struct pctx *pc) {
  char *host = field(cfg, o->off);
  uint16_t *port = field(cfg, o->off2);
  if (strcmp(argv[0], "off") == 0) {
    memset(host, 0, ADDR_HOST_CAP);
    *port = 0;
    return 0;
  }
  return parse_hostport(o->name, argv[0], host, ADDR_HOST_CAP, port, true, pc);
}

static int parse_transports(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                            struct pctx *pc) {
  char *items[MAX_ITEMS], out[CAP(transports)] = "";
  int n = split_items(argv, argc, items);
  if (n <= 0) return fail(pc, -EINVAL, "%s: expected a list like tcp or rdma,tcp", o->name);
  for (int i = 0; i < n; i++) {
    if (word_index(o->words, items[i]) < 0)
      return fail(pc, -EINVAL, "%s: unknown transport '%s' (known: tcp, rdma)", o->name,
                  show(pc, items[i]));
    for (int j = 0; j < i; j++)
      if (strcmp(items[i], items[j]) == 0)
        return fail(pc, -EINVAL, "%s: '%s' is listed twice", o->name, items[i]);
    /* Distinct known words only, so this always fits. */
    strcat(out, i ? "," : "");
    strcat(out, items[i]);
  }
  set_str(field(cfg, o->off), CAP(transports), out);
  return 0;
}

/* One RDMA device: NAME (valid_name) with an optional :PORT (1..255). */
static bool valid_device(char *item) {
  char *colon = strchr(item, ':');
  uint64_t port;
  if (colon) *colon = '\0';
  bool ok = kvf__config_valid_name(item) && (!colon || (kvf__config_parse_dec(colon + 1, &port) == 0 && port >= 1 &&
                                            port <= 255));
  if (colon) *colon = ':';
  return ok;
}

static int parse_devices(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                         struct pctx *pc) {
  char *items[MAX_ITEMS], out[CAP(rdma_devices)] = "";
  int n = split_items(argv, argc, items);
  if (n <= 0) return fail(pc, -EINVAL, "%s: expected auto or a list like mlx5_0,mlx5_1", o->name);
  if (n == 1 && strcmp(items[0], "auto") == 0) {
    set_str(field(cfg, o->off), CAP(rdma_devices), "");
    return 0;
  }
  for (int i = 0; i < n; i++) {
    if (!valid_device(items[i]))
      return fail(pc, -EINVAL, "%s: '%s' is not NAME or NAME:PORT (port 1..255)", o->name,
                  show(pc, items[i]));
    if (strlen(out) + strlen(items[i]) + 2 > sizeof out)
      return fail(pc, -ERANGE, "%s: list longer than %zu bytes", o->name, sizeof out - 1);
    strcat(out, i ? "," : "");
    strcat(out, items[i]);
  }
  set_str(field(cfg, o->off), CAP(rdma_devices), out);
  return 0;
}

/* An absolute path (a service's working directory is nobody's business)
 * or off. */
static int parse_file(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                      struct pctx *pc) {
  size_t n = strlen(argv[0]);
  if (strcmp(argv[0], "off") == 0) {
    set_str(field(cfg, o->off), (size_t)o->max + 1, "");
    return 0;
  }
  if (argv[0][0] != '/')
    return fail(pc, -EINVAL, "%s: '%s' is not an absolute path or off", o->name, show(pc, argv[0]));
  if (n > o->max)
    return fail(pc, -ERANGE, "%s: path is %zu bytes, at most %" PRIu64, o->name, n, o->max);
  for (const char *p = argv[0]; *p; p++)
    if ((unsigned char)*p < 0x20 || *p == 0x7f)
      return fail(pc, -EINVAL, "%s: control character in path", o->name);
  set_str(field(cfg, o->off), (size_t)o->max + 1, argv[0]);
  return 0;
}

/* etcd://HOST:PORT[,HOST:PORT...]/PREFIX or off; the registry thread
 * (registry.c) splits it again, this only refuses what cannot work. */
static int parse_registry(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                          struct pctx *pc) {
  const char *s = argv[0];
  if (strcmp(s, "off") == 0) {
    set_str(field(cfg, o->off), (size_t)o->max + 1, "");
    return 0;
  }
  if (strlen(s) > o->max)
    return fail(pc, -ERANGE, "%s: %zu bytes, at most %" PRIu64, o->name, strlen(s), o->max);
  if (strncmp(s, "etcd://", 7) != 0)
    return fail(pc, -EINVAL, "%s: '%s' is not etcd://HOST:PORT[,HOST:PORT...]/PREFIX or off",
                o->name, show(pc, s));
  const char *ep = s + 7, *slash = strchr(ep, '/');
  if (!slash || !slash[1])
    return fail(pc, -EINVAL, "%s: '%s' has no /PREFIX after its endpoints", o->name, show(pc, s));
  for (const char *p = slash + 1; *p; p++)
    if ((unsigned char)*p <= 0x20 || *p == 0x7f)
      return fail(pc, -EINVAL, "%s: control character or space in the prefix", o->name);
  for (;;) {
    const char *end = memchr(ep, ',', (size_t)(slash - ep));
    if (!end) end = slash;
    char one[300], host[256];
    uint16_t port;
    if (end == ep) return fail(pc, -EINVAL, "%s: an empty endpoint in '%s'", o->name, show(pc, s));
    if ((size_t)(end - ep) >= sizeof one)
      return fail(pc, -EINVAL, "%s: an endpoint is too long", o->name);
    memcpy(one, ep, (size_t)(end - ep));
    one[end - ep] = '\0';
    int rc = parse_hostport(o->name, one, host, sizeof host, &port, false, pc);
    if (rc) return rc;
    if (end == slash) break;
    ep = end + 1;
  }
  set_str(field(cfg, o->off), (size_t)o->max + 1, s);
  return 0;
}

static int parse_auto_u32(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                          struct pctx *pc) {
  uint64_t v;
  if (strcmp(argv[0], "auto") == 0) {
    *(int32_t *)field(cfg, o->off) = -1;
    return 0;
  }
  int rc = kvf__config_parse_dec(argv[0], &v);
  if (rc == -EINVAL)
    return fail(pc, -EINVAL, "%s: '%s' is not auto or a decimal number", o->name,
                show(pc, argv[0]));
  if (rc || v < o->min || v > o->max)
    return fail(pc, -ERANGE, "%s: %s is out of range %" PRIu64 "..%" PRIu64, o->name,
                show(pc, argv[0]), o->min, o->max);
  *(int32_t *)field(cfg, o->off) = (int32_t)v;
  return 0;
}

static int parse_peer(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                      struct pctx *pc) {
  if (cfg->n_peers == KVF__MAX_PEERS_CFG)
    return fail(pc, -ERANGE, "peer: more than %d peers", KVF__MAX_PEERS_CFG);
  kvf__peer_cfg *p = &cfg->peers[cfg->n_peers];
  memset(p, 0, sizeof *p);
  if (!kvf__config_valid_name(argv[0]))
    return fail(pc, -EINVAL, "peer: '%s' is not a valid name (1..%d of A-Z a-z 0-9 . _ -)",
                show(pc, argv[0]), KVF__NAME_MAX);
  set_str(p->name, sizeof p->name, argv[0]);
  int rc = parse_hostport("peer", argv[1], p->host, sizeof p->host, &p->port, false, pc);
  if (rc) return rc;
  cfg->n_peers++;
  return 0;
}

static int parse_pool_kind(const char *s, char *kind, size_t cap) {
  uint64_t dev;
  if (strcmp(s, "host") == 0) {
    set_str(kind, cap, s);
    return 0;
  }
  if (strncmp(s, "cuda:", 5) || kvf__config_parse_dec(s + 5, &dev) || dev > CUDA_DEV_MAX) return -EINVAL;
  char norm[16];
  snprintf(norm, sizeof norm, "cuda:%u", (unsigned)dev); /* "cuda:07" -> "cuda:7" */
  set_str(kind, cap, norm);
  return 0;
}

static int parse_pool_size(const char *s, uint64_t *size, struct pctx *pc) {
  int rc = kvf__parse_size(s, size);
  if (rc == -EINVAL)
    return fail(pc, -EINVAL, "pool: '%s' is not a size (e.g. 256M, 4G)", show(pc, s));
  if (rc) return fail(pc, -ERANGE, "pool: size '%s' is too large", show(pc, s));
  if (*size < POOL_ALIGN)
    return fail(pc, -ERANGE, "pool: size %s is below the minimum 4096", show(pc, s));
  if (*size % POOL_ALIGN)
    return fail(pc, -EINVAL,
                "pool: size %s is not a multiple of 4096 (pools are mapped and "
                "registered with the NIC in whole pages)",
                show(pc, s));
  return 0;
}

static int parse_pool(const struct opt *o, kvf__config *cfg, char **argv, int argc,
                      struct pctx *pc) {
  if (cfg->n_pools == KVF__MAX_POOLS_CFG)
    return fail(pc, -ERANGE, "pool: more than %d pools", KVF__MAX_POOLS_CFG);
  kvf__pool_cfg *p = &cfg->pools[cfg->n_pools];
  memset(p, 0, sizeof *p);
  if (!kvf__config_valid_name(argv[0]))
    return fail(pc, -EINVAL, "pool: '%s' is not a valid name (1..%d of A-Z a-z 0-9 . _ -)",
                show(pc, argv[0]), KVF__NAME_MAX);
  set_str(p->name, sizeof p->name, argv[0]);
  if (parse_pool_kind(argv[1], p->kind, sizeof p->kind))
    return fail(pc, -EINVAL, "pool: kind '%s' is not host or cuda:N (N 0..%d)",
                show(pc, argv[1]), CUDA_DEV_MAX);
  int rc = parse_pool_size(argv[2], &p->size, pc);
  if (rc) return rc;
  p->gpu_direct = KVF__GDR_AUTO;
  if (argc > 3) {
    if (strcmp(argv[3], "gpu-direct=off") == 0) p->gpu_direct = KVF__GDR_OFF;
    else if (strcmp(argv[3], "gpu-direct=auto") != 0)
      return fail(pc, -EINVAL, "pool: '%s' is not gpu-direct=auto or gpu-direct=off", show(pc, argv[3]));
  }
  cfg->n_pools++;
  return 0;
}

/* ---- text dump, one per type ------------------------------------------------ */

static void dump_str(const struct opt *o, const kvf__config *cfg, FILE *out) {
  const char *s = cfield(cfg, o->off);
  if (o->type == OPT_NAME && !s[0])
    fprintf(out, "# %s (not set)\n", o->name); /* "node" alone would not parse */
  else
    fprintf(out, "%s %s\n", o->name, s);
}

static void dump_devices(const struct opt *o, const kvf__config *cfg, FILE *out) {
  const char *s = cfield(cfg, o->off);
  fprintf(out, "%s %s\n", o->name, s[0] ? s : "auto");
}

static void dump_file(const struct opt *o, const kvf__config *cfg, FILE *out) {
  const char *s = cfield(cfg, o->off);
  fprintf(out, "%s %s\n", o->name, s[0] ? s : "off");
}

static void dump_auto_u32(const struct opt *o, const kvf__config *cfg, FILE *out) {
  int32_t v = *(const int32_t *)cfield(cfg, o->off);
  if (v < 0) fprintf(out, "%s auto\n", o->name);
  else fprintf(out, "%s %" PRId32 "\n", o->name, v);
}

static void dump_u32(const struct opt *o, const kvf__config *cfg, FILE *out) {
  fprintf(out, "%s %" PRIu32 "\n", o->name, *(const uint32_t *)cfield(cfg, o->off));
}

static void dump_size32(const struct opt *o, const kvf__config *cfg, FILE *out) {
  char buf[32];
  fprintf(out, "%s %s\n", o->name, kvf__config_format_size(*(const uint32_t *)cfield(cfg, o->off), buf));
}

static void dump_bool(const struct opt *o, const kvf__config *cfg, FILE *out) {
  fprintf(out, "%s %s\n", o->name, *(const bool *)cfield(cfg, o->off) ? "yes" : "no");
}

static const char *enum_word(const struct opt *o, const kvf__config *cfg) {
  int v = *(const int *)cfield(cfg, o->off);
  for (int i = 0; o->words[i]; i++)
    if (i == v) return o->words[i];
  return "?";
}

static void dump_enum(const struct opt *o, const kvf__config *cfg, FILE *out) {
  fprintf(out, "%s %s\n", o->name, enum_word(o, cfg));
}

static unsigned id_at(const struct opt *o, const kvf__config *cfg, size_t i) {
  if (o->type == OPT_UIDS) return ((const uid_t *)cfield(cfg, o->off))[i];
  return ((const gid_t *)cfield(cfg, o->off))[i];
}

static size_t id_count(const struct opt *o, const kvf__config *cfg) {
  size_t n = *(const size_t *)cfield(cfg, o->off2);
  return n < KVF__MAX_IDS_CFG ? n : KVF__MAX_IDS_CFG;
}

/* Numeric ids, so the dump reads back the same even if names change. An
 * empty list is the bare key, which parses back to empty. */
static void dump_ids(const struct opt *o, const kvf__config *cfg, FILE *out) {
  fputs(o->name, out);
  for (size_t i = 0; i < id_count(o, cfg); i++)
    fprintf(out, "%s%u", i ? "," : " ", id_at(o, cfg, i));
  fputc('\n', out);
}

static void dump_addr(const struct opt *o, const kvf__config *cfg, FILE *out) {
  char buf[300];
  format_addr(cfield(cfg, o->off), *(const uint16_t *)cfield(cfg, o->off2), buf, sizeof buf);
  fprintf(out, "%s %s\n", o->name, buf);
}

static void dump_peers(const struct opt *o, const kvf__config *cfg, FILE *out) {
  char buf[300];
  for (size_t i = 0; i < cfg->n_peers && i < KVF__MAX_PEERS_CFG; i++) {
    format_addr(cfg->peers[i].host, cfg->peers[i].port, buf, sizeof buf);
    fprintf(out, "peer %s %s\n", cfg->peers[i].name, buf);
  }
}

static void dump_pools(const struct opt *o, const kvf__config *cfg, FILE *out) {
  char buf[32];
  for (size_t i = 0; i < cfg->n_pools && i < KVF__MAX_POOLS_CFG; i++)
    fprintf(out, "pool %s %s %s%s\n", cfg->pools[i].name, cfg->pools[i].kind,
            kvf__config_format_size(cfg->pools[i].size, buf),
            cfg->pools[i].gpu_direct == KVF__GDR_OFF ? " gpu-direct=off" : "");
}

/* ---- JSON dump ---------------------------------------------------------- */

/* proto/json.h's rule: the output is valid JSON whatever the bytes. */
static void json_str(FILE *out, const char *str) { kvf__json_fquote(out, str); }

static void json_strfield(const struct opt *o, const kvf__config *cfg, FILE *out) {
  json_str(out, cfield(cfg, o->off));
}

static void json_devices(const struct opt *o, const kvf__config *cfg, FILE *out) {
  const char *s = cfield(cfg, o->off);
  json_str(out, s[0] ? s : "auto");
}

static void json_file(const struct opt *o, const kvf__config *cfg, FILE *out) {
  const char *s = cfield(cfg, o->off);
  json_str(out, s[0] ? s : "off");
}

static void json_auto_u32(const struct opt *o, const kvf__config *cfg, FILE *out) {
  int32_t v = *(const int32_t *)cfield(cfg, o->off);
  if (v < 0) fputs("\"auto\"", out);
  else fprintf(out, "%" PRId32, v);
}

static void json_u32(const struct opt *o, const kvf__config *cfg, FILE *out) {
  fprintf(out, "%" PRIu32, *(const uint32_t *)cfield(cfg, o->off));
}

static void json_bool(const struct opt *o, const kvf__config *cfg, FILE *out) {
  fputs(*(const bool *)cfield(cfg, o->off) ? "true" : "false", out);
}

static void json_enum(const struct opt *o, const kvf__config *cfg, FILE *out) {
  json_str(out, enum_word(o, cfg));
}

static void json_ids(const struct opt *o, const kvf__config *cfg, FILE *out) {
  fputc('[', out);
  for (size_t i = 0; i < id_count(o, cfg); i++)
    fprintf(out, "%s%u", i ? "," : "", id_at(o, cfg, i));
  fputc(']', out);
}

static void json_addr(const struct opt *o, const kvf__config *cfg, FILE *out) {
  char buf[300];
  format_addr(cfield(cfg, o->off), *(const uint16_t *)cfield(cfg, o->off2), buf, sizeof buf);
  json_str(out, buf);
}

static void json_peers(const struct opt *o, const kvf__config *cfg, FILE *out) {
  fputc('[', out);
  for (size_t i = 0; i < cfg->n_peers && i < KVF__MAX_PEERS_CFG; i++) {
    fputs(i ? ",{\"name\":" : "{\"name\":", out);
    json_str(out, cfg->peers[i].name);
    fputs(",\"host\":", out);
    json_str(out, cfg->peers[i].host);
    fprintf(out, ",\"port\":%u}", cfg->peers[i].port);
  }
  fputc(']', out);
}

static void json_pools(const struct opt *o, const kvf__config *cfg, FILE *out) {
  fputc('[', out);
  for (size_t i = 0; i < cfg->n_pools && i < KVF__MAX_POOLS_CFG; i++) {
    fputs(i ? ",{\"name\":" : "{\"name\":", out);
    json_str(out, cfg->pools[i].name);
    fputs(",\"kind\":", out);
    json_str(out, cfg->pools[i].kind);
    fprintf(out, ",\"size\":%" PRIu64 ",\"gpu_direct\":\"%s\"}", cfg->pools[i].size,
            cfg->pools[i].gpu_direct == KVF__GDR_OFF ? "off" : "auto");
  }
  fputc(']', out);
}

/* ---- the types ---------------------------------------------------------- */

static const struct opt_kind kinds[OPT_NTYPES] = {
    [OPT_NAME] = {"NAME", 1, 1, false, parse_name, dump_str, json_strfield},
    [OPT_PATH] = {"PATH", 1, 1, false, parse_path, dump_str, json_strfield},
    [OPT_U32] = {"N", 1, 1, false, parse_u32, dump_u32, json_u32},
    [OPT_SIZE32] = {"SIZE", 1, 1, false, parse_size32, dump_size32, json_u32},
    [OPT_BOOL] = {"yes|no", 1, 1, false, parse_bool, dump_bool, json_bool},
    [OPT_ENUM] = {NULL, 1, 1, false, parse_enum, dump_enum, json_enum},
    [OPT_UIDS] = {"USER[,USER...]", 0, MAX_WORDS, false, parse_ids, dump_ids, json_ids},
    [OPT_GIDS] = {"GROUP[,GROUP...]", 0, MAX_WORDS, false, parse_ids, dump_ids, json_ids},
    [OPT_ADDR] = {"HOST:PORT|off", 1, 1, false, parse_addr, dump_addr, json_addr},
    [OPT_TRANSPORTS] = {"tcp|rdma[,...]", 1, MAX_WORDS, false, parse_transports, dump_str,
                        json_strfield},
    [OPT_PEER] = {"NAME HOST:PORT", 2, 2, true, parse_peer, dump_peers, json_peers},
    [OPT_POOL] = {"NAME host|cuda:N SIZE [gpu-direct=auto|off]", 3, 4, true, parse_pool, dump_pools, json_pools},
    [OPT_DEVICES] = {"auto|DEV[:PORT][,...]", 1, MAX_WORDS, false, parse_devices, dump_devices,
                     json_devices},
    [OPT_AUTO_U32] = {"auto|N", 1, 1, false, parse_auto_u32, dump_auto_u32, json_auto_u32},
    [OPT_FILE] = {"PATH|off", 1, 1, false, parse_file, dump_file, json_file},
    [OPT_REGISTRY] = {"etcd://HOST:PORT[,HOST:PORT...]/PREFIX|off", 1, 1, false, parse_registry,
                      dump_file, json_file},
};

/* The argument as --help and arity errors show it. */
static const char *arg_text(const struct opt *o, char *buf, size_t cap) {
  if (!kinds[o->type].arg) {
    join_words(o->words, "|", buf, cap);
    return buf;
  }
  return kinds[o->type].arg;
}

static const struct opt *find_opt(const char *name) {
  for (size_t i = 0; i < N_OPTS; i++)
    if (strcmp(opts[i].name, name) == 0) return &opts[i];
  return NULL;
}

/* ---- parsing ---------------------------------------------------------- */

/* Splits a line into words in place; '#' at the start of a word starts a
 * comment. Returns the word count, or -1 when there are too many. */
static int split_words(char *line, char **words) {
  int n = 0;
  char *p = line;
  for (;;) {
    while (is_space(*p)) p++;
    if (*p == '\0' || *p == '#') return n;
    if (n == MAX_WORDS) return -1;
    words[n++] = p;
    while (*p && !is_space(*p)) p++;
    if (*p) *p++ = '\0';
  }
}

static int parse_line(kvf__config *cfg, char *line, struct pctx *pc) {
  char *words[MAX_WORDS], arg[128];
  int n = split_words(line, words);
  if (n == 0) return 0;
  if (n < 0) return fail(pc, -EINVAL, "more than %d words on one line", MAX_WORDS);
  const struct opt *o = find_opt(words[0]);
  if (!o)
    return fail(pc, -EINVAL, "unknown key '%s' (kvferryd --help lists them)",
                show(pc, words[0]));
  const struct opt_kind *k = &kinds[o->type];
  if (n - 1 < k->min_args || n - 1 > k->max_args)
    return fail(pc, -EINVAL, "%s takes %s", o->name, arg_text(o, arg, sizeof arg));
  return k->parse(o, cfg, words + 1, n - 1, pc);
}

static int parse_text(kvf__config *cfg, const char *text, size_t len, struct pctx *pc) {
  char line[LINE_MAX_LEN + 1];
  const char *p = text, *end = text + len;
  if (len >= 3 && memcmp(p, "\xEF\xBB\xBF", 3) == 0) p += 3; /* editors' UTF-8 BOM */
  for (pc->line = 1; p < end; pc->line++) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    size_t n = (size_t)((nl ? nl : end) - p);
    if (n > LINE_MAX_LEN)
      return fail(pc, -EINVAL, "line longer than %d bytes", LINE_MAX_LEN);
    if (memchr(p, '\0', n)) return fail(pc, -EINVAL, "NUL byte in line");
    memcpy(line, p, n);
    line[n] = '\0';
    int rc = parse_line(cfg, line, pc);
    if (rc) return rc;
    p = nl ? nl + 1 : end;
  }
  return 0;
}

void kvf__config_defaults(kvf__config *cfg) {
  memset(cfg, 0, sizeof *cfg); /* the empty defaults: "", no peers, no pools */
  for (size_t i = 0; i < N_OPTS; i++) {
    char line[256];
    struct pctx pc = {.name = "<defaults>", .line = 1};
    if (!opts[i].def[0]) continue;
    snprintf(line, sizeof line, "%s %s", opts[i].name, opts[i].def);
    /* A default that does not parse is a bug in opts[]; the unit tests
     * parse them all, so this cannot happen in a released build. */
    if (parse_line(cfg, line, &pc)) abort();
  }
}

/* Parses into a copy and commits only on success, so that a bad file (or a
 * bad reload) leaves the current configuration untouched. */
int kvf__config_parse(kvf__config *cfg, const char *text, size_t len, const char *name,
                      char *err, size_t errlen) {
  struct pctx pc = {.name = name ? name : "<config>", .err = err, .errlen = errlen};
  if (err && errlen) err[0] = '\0';
  if (!text && len) return fail(&pc, -EINVAL, "no text");
  kvf__config *tmp = malloc(sizeof *tmp);
  if (!tmp) return fail(&pc, -ENOMEM, "out of memory");
  *tmp = *cfg;
  int rc = parse_text(tmp, text ? text : "", len, &pc);
  if (rc == 0) *cfg = *tmp;
  free(tmp);
  return rc;
}

/* Reads a whole file (at most FILE_MAX_LEN bytes) into a malloc'd buffer. */
static int read_file(int fd, char **buf, size_t *len) {
  size_t cap = 4096, n = 0;
  char *b = malloc(cap);
  for (;;) {
    if (!b) return -ENOMEM;
    if (n == cap) {
      if (cap >= FILE_MAX_LEN) break;
      char *nb = realloc(b, cap *= 2);
      if (!nb) free(b);
      b = nb;
      continue;
    }
    ssize_t r = read(fd, b + n, cap - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      free(b);
      return -e;
    }
    if (r == 0) {
      *buf = b;
      *len = n;
      return 0;
    }
    n += (size_t)r;
  }
  free(b);
  return -EFBIG;
}

int kvf__config_load(kvf__config *cfg, const char *path, char *err, size_t errlen) {
  char *text = NULL;
  size_t len = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  int rc = fd < 0 ? -errno : read_file(fd, &text, &len);
  if (fd >= 0) close(fd);
  if (rc) {
    if (err && errlen)
      snprintf(err, errlen, "%s: %s", path,
               rc == -EFBIG ? "file of 16 MiB or more" : strerror(-rc));
    return rc;
  }
  rc = kvf__config_parse(cfg, text, len, path, err, errlen);
  free(text);
  return rc;
}

/* ---- validation ---------------------------------------------------------- */

/* Rechecks every table bound, for configurations built in code rather
 * than parsed. */
static int validate_bounds(const kvf__config *cfg, char *err, size_t errlen) {
  for (size_t i = 0; i < N_OPTS; i++) {
    const struct opt *o = &opts[i];
    if (o->type == OPT_U32 || o->type == OPT_SIZE32) {
      uint32_t v = *(const uint32_t *)cfield(cfg, o->off);
      if (v < o->min || v > o->max)
        return vfail(err, errlen, "%s %" PRIu32 " is out of range %" PRIu64 "..%" PRIu64,
                     o->name, v, o->min, o->max);
    } else if (o->type == OPT_ENUM && !strcmp(enum_word(o, cfg), "?")) {
      return vfail(err, errlen, "%s has an unknown value", o->name);
    } else if (o->type == OPT_AUTO_U32) {
      int32_t v = *(const int32_t *)cfield(cfg, o->off);
      if (v < -1 || (v >= 0 && ((uint64_t)v < o->min || (uint64_t)v > o->max)))
        return vfail(err, errlen, "%s %" PRId32 " is out of range auto or %" PRIu64 "..%" PRIu64,
                     o->name, v, o->min, o->max);
    }
  }
  return 0;
}

static int validate_names(const kvf__config *cfg, char *err, size_t errlen) {
  if (!cfg->node[0]) return vfail(err, errlen, "node is not set (add a line 'node NAME')");
  if (cfg->n_peers > cfg->max_peers && cfg->peer_connect == KVF__CONNECT_EAGER)
    return vfail(err, errlen, "%zu static peers but max-peers is %" PRIu32, cfg->n_peers,
                 cfg->max_peers);
  if (cfg->n_pools > KVF__MAX_POOLS_CFG)
    return vfail(err, errlen, "more than %d pools", KVF__MAX_POOLS_CFG);
  for (size_t i = 0; i < cfg->n_peers; i++) {
    if (strcmp(cfg->peers[i].name, cfg->node) == 0)
      return vfail(err, errlen, "peer '%s' has this node's own name", cfg->node);
    for (size_t j = 0; j < i; j++)
      if (strcmp(cfg->peers[i].name, cfg->peers[j].name) == 0)
        return vfail(err, errlen, "two peers named '%s'", cfg->peers[i].name);
  }
  for (size_t i = 0; i < cfg->n_pools; i++)
    for (size_t j = 0; j < i; j++)
      if (strcmp(cfg->pools[i].name, cfg->pools[j].name) == 0)
        return vfail(err, errlen, "two pools named '%s'", cfg->pools[i].name);
  return 0;
}

static int validate_timing(const kvf__config *cfg, char *err, size_t errlen) {
  /* Two heartbeats may be lost before a peer is declared dead. */
  if ((uint64_t)cfg->peer_timeout_ms <= 2 * (uint64_t)cfg->heartbeat_ms)
    return vfail(err, errlen, "peer-timeout-ms (%" PRIu32 ") must be more than 2 x "
                 "heartbeat-ms (%" PRIu32 ")", cfg->peer_timeout_ms, cfg->heartbeat_ms);
  if (cfg->reconnect_min_ms > cfg->reconnect_max_ms)
    return vfail(err, errlen, "reconnect-min-ms (%" PRIu32 ") is above reconnect-max-ms "
                 "(%" PRIu32 ")", cfg->reconnect_min_ms, cfg->reconnect_max_ms);
  return 0;
}

/* A request or grant of max-descs descriptors must fit in one frame, or a
 * grant the daemon accepted could never be sent to the sender. */
static int validate_limits(const kvf__config *cfg, char *err, size_t errlen) {
  uint64_t need = (uint64_t)cfg->max_descs * KVF__DESC_WIRE_SIZE + KVF__FRAME_SLACK;
  if (need <= cfg->max_frame) return 0;
  return vfail(err, errlen, "max-descs %" PRIu32 " needs max-frame of at least %" PRIu64
               " (%u bytes a descriptor + %u), but max-frame is %" PRIu32 "; raise max-frame "
               "or lower max-descs to at most %" PRIu64, cfg->max_descs, need, KVF__DESC_WIRE_SIZE,
               KVF__FRAME_SLACK, cfg->max_frame,
               ((uint64_t)cfg->max_frame - KVF__FRAME_SLACK) / KVF__DESC_WIRE_SIZE);
}

int kvf__config_validate(const kvf__config *cfg, char *err, size_t errlen) {
  if (err && errlen) err[0] = '\0';
  int rc = validate_bounds(cfg, err, errlen);
  if (!rc) rc = validate_names(cfg, err, errlen);
  if (!rc) rc = validate_timing(cfg, err, errlen);
  if (!rc) rc = validate_limits(cfg, err, errlen);
  return rc;
}

/* ---- help and dump ---------------------------------------------------------- */

static void help_bounds(const struct opt *o, char *buf, size_t cap) {
  char lo[32], hi[32];
  buf[0] = '\0';
  if (o->type == OPT_U32 || o->type == OPT_AUTO_U32)
    snprintf(buf, cap, " (%" PRIu64 "..%" PRIu64 ")", o->min, o->max);
  else if (o->type == OPT_SIZE32)
    snprintf(buf, cap, " (%s..%s)", kvf__config_format_size(o->min, lo), kvf__config_format_size(o->max, hi));
}

static void help_default(const struct opt *o, char *buf, size_t cap) {
  const char *reload = o->reload ? "; SIGHUP reloads" : "";
  if (kinds[o->type].repeatable)
    snprintf(buf, cap, "repeatable, none by default%s", reload);
  else if (o->type == OPT_NAME)
    snprintf(buf, cap, "required%s", reload);
  else
    snprintf(buf, cap, "default: %s%s", o->def[0] ? o->def : "empty", reload);
}

/* Writes text word-wrapped to 80 columns, each line indented by 6. */
static void print_wrapped(FILE *out, const char *text) {
  const int width = 80 - 6;
  while (*text) {
    int n = (int)strlen(text);
    if (n > width) {
      n = width;
      while (n > 0 && text[n] != ' ') n--;
      if (n == 0) n = width; /* one unbreakable word */
    }
    fprintf(out, "      %.*s\n", n, text);
    text += n;
    while (*text == ' ') text++;
  }
}

void kvf__config_print_help(FILE *out) {
  fputs("Configuration keys (kvferryd.conf: one 'key value' per line; '#' starts\n"
        "a comment; sizes take binary K/M/G/T suffixes):\n",
        out);
  for (size_t i = 0; i < N_OPTS; i++) {
    const struct opt *o = &opts[i];
    char arg[128], bounds[96], def[96], head[320];
    help_bounds(o, bounds, sizeof bounds);
    help_default(o, def, sizeof def);
    snprintf(head, sizeof head, "%s %s%s", o->name, arg_text(o, arg, sizeof arg), bounds);
    fprintf(out, "  %-40s [%s]\n", head, def);
    print_wrapped(out, o->help);
  }
}

static void dump_json(const kvf__config *cfg, FILE *out) {
  fputc('{', out);
  for (size_t i = 0; i < N_OPTS; i++) {
    const struct opt *o = &opts[i];
    fprintf(out, "%s\"%s\":", i ? "," : "", o->json ? o->json : o->name);
    kinds[o->type].json(o, cfg, out);
  }
  fputs("}\n", out);
}

void kvf__config_dump(const kvf__config *cfg, FILE *out, bool json) {
  if (json) {
    dump_json(cfg, out);
    return;
  }
  for (size_t i = 0; i < N_OPTS; i++) kinds[opts[i].type].dump(&opts[i], cfg, out);
}

/* ---- reload (SIGHUP) ---------------------------------------------------- */

bool kvf__config_key_reloadable(const char *key) {
  const struct opt *o = find_opt(key);
  return o && o->reload;
}

/* Bytes of the field at .off for the scalar and string types. */
static size_t value_size(const struct opt *o) {
  switch (o->type) {
  case OPT_NAME: return KVF__NAME_MAX + 1;
  case OPT_PATH: return (size_t)o->max + 1;
  case OPT_U32:
  case OPT_SIZE32: return sizeof(uint32_t);
  case OPT_BOOL: return sizeof(bool);
  case OPT_ENUM: return sizeof(int);
  case OPT_UIDS: return sizeof(uid_t) * KVF__MAX_IDS_CFG;
  case OPT_GIDS: return sizeof(gid_t) * KVF__MAX_IDS_CFG;
  case OPT_ADDR: return ADDR_HOST_CAP;
  case OPT_TRANSPORTS: return CAP(transports);
  case OPT_DEVICES: return CAP(rdma_devices);
  case OPT_AUTO_U32: return sizeof(int32_t);
  case OPT_FILE: return (size_t)o->max + 1;
  default: return 0;
  }
}

/* Gives dst the value src has for key o. */
static void copy_value(const struct opt *o, kvf__config *dst, const kvf__config *src) {
  if (o->type == OPT_PEER) {
    memcpy(dst->peers, src->peers, sizeof dst->peers);
    dst->n_peers = src->n_peers;
  } else if (o->type == OPT_POOL) {
    memcpy(dst->pools, src->pools, sizeof dst->pools);
    dst->n_pools = src->n_pools;
  } else {
    memcpy(field(dst, o->off), cfield(src, o->off), value_size(o));
    if (o->type == OPT_UIDS || o->type == OPT_GIDS)
      *(size_t *)field(dst, o->off2) = *(const size_t *)cfield(src, o->off2);
    else if (o->type == OPT_ADDR)
      *(uint16_t *)field(dst, o->off2) = *(const uint16_t *)cfield(src, o->off2);
  }
}

/* The key's value as its dump writes it, on one line ("; " between the
 * lines of repeatable keys, without the key names). malloc'd; NULL when out
 * of memory. */
static char *value_text(const struct opt *o, const kvf__config *cfg) {
  char *buf = NULL, *line, *save = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  if (!f) return NULL;
  kinds[o->type].dump(o, cfg, f);
  if (fclose(f) != 0) return NULL;
  char *out = calloc(1, len + sizeof "(none)");
  if (!out) {
    free(buf);
    return NULL;
  }
  size_t klen = strlen(o->name);
  for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    if (strncmp(line, o->name, klen) == 0 && (line[klen] == ' ' || line[klen] == '\0'))
      line += klen + (line[klen] == ' ');
    else if (line[0] == '#')
      line = "(not set)";
    if (!line[0]) continue;
    if (out[0]) strcat(out, "; ");
    strcat(out, line);
  }
  free(buf);
  if (!out[0]) strcpy(out, "(none)");
  return out;
}

void kvf__config_prepare_reload(kvf__config *next, const kvf__config *cur,
                                kvf__config_change_fn *report, void *arg) {
  for (size_t i = 0; i < N_OPTS; i++) {
    const struct opt *o = &opts[i];
    char *from = value_text(o, cur), *to = value_text(o, next);
    bool differs = !from || !to || strcmp(from, to) != 0;
    if (differs && !o->reload) copy_value(o, next, cur);
    if (differs && report) report(o->name, from ? from : "?", to ? to : "?", o->reload, arg);
    free(from);
    free(to);
  }
}
