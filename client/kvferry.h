/* kvferry.h - the one public header of libkvferry.
 *
 * A serving engine talks to the kvferryd of its node over a Unix socket.
 * The daemon owns memory pools; the engine maps them (kvf_pool_map) and keeps
 * its KV cache there. A transfer moves blocks from pools on one node to pools
 * on another (or the same) node:
 *
 *   decode side:   kvf_grant(c, "req-42", "prefill", dst, n, 0);
 *   prefill side:  kvf_send(c, "req-42", "decode", src, n, 0, 0);
 *   both sides:    kvf_wait_events(...) -> KVF_EV_RECV_DONE / KVF_EV_SEND_DONE
 *
 * Descriptor i of the send lands in descriptor i of the grant; their lengths
 * must match. A send may come in parts (KVF_SEND_MORE on all but the last).
 *
 * Conventions (libuv's): every fallible call returns 0 (or a count) on
 * success and a negative error code on failure; kvf_strerror() and
 * kvf_err_name() describe it. A call that returns an error queues no event.
 * All calls are safe to use from several threads at once.
 */
#ifndef KVFERRY_H
#define KVFERRY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_API_VERSION 1
#define KVF_XFER_ID_MAX 127   /* bytes, without the terminating NUL */
#define KVF_NAME_MAX 63       /* node and pool names */

/* kvferry's own error codes. Everything else is a negative errno. */
enum kvf_errc {
  KVF_ESIZE = -4001,          /* send and grant descriptors differ in size or count */
  KVF_ENOPEER = -4002,        /* no such peer node */
  KVF_ENOPOOL = -4003,        /* no such pool */
  KVF_ERANGE = -4004,         /* a range is outside its pool */
  KVF_EPEERLOST = -4005,      /* the peer daemon went away */
  KVF_EREMOTECANCEL = -4006,  /* the other side cancelled (or its client went away) */
  KVF_EDAEMON = -4007,        /* the connection to the local daemon is gone */
  KVF_EVERSION = -4008,       /* protocol versions do not match */
  KVF_EPROTO = -4009,         /* malformed message */
  KVF_ELIMIT = -4010,         /* a configured limit refused the request */
  KVF_EPERM = -4011,          /* not allowed (credentials, authentication) */
  KVF_EDEADLINE = -4012,      /* the transfer's deadline expired */
  KVF_ECANCELED = -4013,      /* cancelled by this side */
  KVF_EEXIST = -4014,         /* a transfer with this id is already active here */
  KVF_ENOENT = -4015,         /* no active transfer with this id */
  KVF_EINVAL = -4016,         /* invalid argument */
};

const char *kvf_strerror(int err);
const char *kvf_err_name(int err);

typedef struct kvf_client kvf_client;

/* Connects to the daemon listening on socket_path (NULL: $KVFERRY_SOCKET or
 * /run/kvferry/kvferryd.sock). */
int kvf_connect(const char *socket_path, kvf_client **out);
/* Closes the connection. The daemon cancels this client's transfers. */
void kvf_close(kvf_client *c);
/* The daemon's node name. */
const char *kvf_node(const kvf_client *c);

typedef struct kvf_pool_info {
  uint32_t id;
  char name[KVF_NAME_MAX + 1];
  char kind[16];      /* "host" or "cuda:N" */
  char backing[32];   /* how the daemon allocated it */
  uint64_t size;
} kvf_pool_info;

/* Fills up to cap entries; returns the number of pools (may exceed cap). */
int kvf_pools(kvf_client *c, kvf_pool_info *out, size_t cap);
/* Finds a pool by name. */
int kvf_pool_find(kvf_client *c, const char *name, kvf_pool_info *out);
/* Maps a pool into this process (once; later calls return the same
 * mapping). The mapping lives until kvf_close.
 *
 * Host pools: *addr is an ordinary pointer (mmap of the daemon's memfd).
 * cuda:N pools: *addr is a CUDA device pointer (a CUdeviceptr cast to void *)
 * valid in this process on GPU N and on every GPU with peer access to it:
 * use it with kernels, cudaMemcpy or torch (e.g. via __cuda_array_interface__);
 * the CPU cannot dereference it. The library loads the NVIDIA driver with
 * dlopen, imports the pool's fd (cuMemImportFromShareableHandle + cuMemMap),
 * holds GPU N's primary context (the CUDA runtime's) while mapped, and
 * leaves the calling thread's current context unchanged. Returns -ENODEV
 * when this process has no usable CUDA driver. */
int kvf_pool_map(kvf_client *c, uint32_t pool, void **addr, uint64_t *size);

typedef struct kvf_desc {
  uint32_t pool;
  uint64_t offset;
  uint64_t len;
} kvf_desc;

/* Decode side: blocks of transfer xfer_id go to descs. src_node NULL or ""
 * accepts the send from any node; naming it lets the daemon push the grant
 * ahead to that node (no round trip when the send comes). deadline_ms 0 uses
 * the daemon's default. Completion: one KVF_EV_RECV_DONE. */
int kvf_grant(kvf_client *c, const char *xfer_id, const char *src_node,
              const kvf_desc *descs, size_t n, uint32_t deadline_ms);

#define KVF_SEND_MORE 0x1u   /* more parts of this transfer follow */

/* Prefill side: send descs to dst_node (which may be this node). Parts after
 * the first continue the pairing where the previous part stopped.
 * Completion: one KVF_EV_SEND_DONE after the last part. */
int kvf_send(kvf_client *c, const char *xfer_id, const char *dst_node,
             const kvf_desc *descs, size_t n, unsigned flags, uint32_t deadline_ms);

/* Cancels this client's grant or send xfer_id. Both sides get their event
 * with KVF_ECANCELED (here) or KVF_EREMOTECANCEL (there). */
int kvf_cancel(kvf_client *c, const char *xfer_id);

enum kvf_event_type { KVF_EV_RECV_DONE = 1, KVF_EV_SEND_DONE = 2 };

typedef struct kvf_event {
  int type;                            /* enum kvf_event_type */
  int status;                          /* 0 or a negative error code */
  char xfer_id[KVF_XFER_ID_MAX + 1];
  char path[32];                       /* "tcp", "local", "rdma", ... */
  char peer[KVF_NAME_MAX + 1];         /* the node at the other end */
  uint64_t bytes;
  uint64_t descriptors;
  char error[128];                     /* detail when status != 0 */
} kvf_event;

/* A file descriptor that polls readable while events are waiting; for an
 * engine's own event loop. Do not read or close it. */
int kvf_event_fd(kvf_client *c);
/* Takes up to cap waiting events. timeout_ms: 0 returns at once, -1 waits
 * without bound. Returns the number taken (0 on timeout) or an error. */
int kvf_wait_events(kvf_client *c, kvf_event *out, size_t cap, int timeout_ms);

/* Introspection, rendered by the daemon: a human table or a JSON document.
 * *out is malloc'ed; free() it. */
enum kvf_inspect { KVF_INSPECT_STATUS, KVF_INSPECT_POOLS, KVF_INSPECT_PEERS,
                   KVF_INSPECT_TRANSFERS };
int kvf_inspect(kvf_client *c, int what, int json, char **out);

#ifdef __cplusplus
}
#endif
#endif
