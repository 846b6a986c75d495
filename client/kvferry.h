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

/* 2: kvf_event gained transform, at its end. The structure grew: programs
 * compiled against version 1's kvferry.h must be rebuilt before they use
 * this library (kvf_wait_events fills arrays of it). The daemon still
 * serves version 1 libraries (their events lack the field). */
#define KVF_API_VERSION 2
#define KVF_XFER_ID_MAX 127   /* bytes, without the terminating NUL */
#define KVF_NAME_MAX 63       /* node and pool names */
#define KVF_DST_NODES_MAX 16  /* kvf_send_blocks: node names in one dst_node list */

/* kvferry's own error codes: XX(name, code, message). Everything else is a
 * negative errno. This list is the one source: the enum below, the names and
 * messages of kvf_err_name() and kvf_strerror() (client/errors.c), and,
 * written by scripts/gen-errors.py, the Python binding's names and
 * libkvferry(3)'s RETURN VALUE section (tests/ops/test_errors.py checks
 * that they agree). Codes are part of the ABI: never renumber one. */
#define KVF_ERR_MAP(XX)                                                              \
  XX(ESIZE, -4001, "send and grant descriptors differ in size or count")            \
  XX(ENOPEER, -4002, "no such peer node")                                            \
  XX(ENOPOOL, -4003, "no such pool")                                                 \
  XX(ERANGE, -4004, "a range is outside its pool")                                   \
  XX(EPEERLOST, -4005, "the peer daemon went away")                                  \
  XX(EREMOTECANCEL, -4006, "the other side cancelled, or its client went away")      \
  XX(EDAEMON, -4007, "the connection to the local daemon is gone")                   \
  XX(EVERSION, -4008, "protocol versions do not match")                              \
  XX(EPROTO, -4009, "malformed message")                                             \
  XX(ELIMIT, -4010, "a configured limit refused the request")                        \
  XX(EPERM, -4011, "not allowed (credentials or authentication)")                    \
  XX(EDEADLINE, -4012, "the transfer's deadline expired")                            \
  XX(ECANCELED, -4013, "cancelled by this side")                                     \
  XX(EEXIST, -4014, "a transfer with this id is already active here")                \
  XX(ENOENT, -4015, "no active transfer with this id")                               \
  XX(EINVAL, -4016, "invalid argument")                                              \
  XX(EBUSY, -4017, "the memory is in use by a transfer")                             \
  XX(EUNKNOWN, -4018, "outcome unknown: the peer went away before its result came")

enum kvf_errc {
#define KVF_ERR_XX(name, code, message) KVF_##name = (code),
  KVF_ERR_MAP(KVF_ERR_XX)
#undef KVF_ERR_XX
};

const char *kvf_strerror(int err);
const char *kvf_err_name(int err);

typedef struct kvf_client kvf_client;

/* Connects to the daemon listening on socket_path (NULL: $KVFERRY_SOCKET or
 * /run/kvferry/kvferryd.sock), with the default kvf_connect_opts. */
int kvf_connect(const char *socket_path, kvf_client **out);

/* How a client waits for its daemon. A field < 0 takes its default: from
 * the environment ($KVFERRY_CONNECT_WAIT_MS, $KVFERRY_RECONNECT_MS) when
 * set, else the KVF_*_DEFAULT below.
 *
 * wait_ms: kvf_connect waits up to this long for a daemon that is starting
 *   (its socket missing or refusing connections), retrying every few ms.
 *   0: fail at once (-ENOENT, -ECONNREFUSED).
 * reconnect_ms: when the connection breaks (the daemon restarted), the
 *   library connects again by itself, retrying for up to this long: every
 *   grant and send in flight first ends with its KVF_EV_RECV_DONE /
 *   KVF_EV_SEND_DONE carrying KVF_EDAEMON (the event fd wakes); every call
 *   made while disconnected fails at once with KVF_EDAEMON (kvf_wait_events
 *   too, once no event is left), and the event fd is not raised for it
 *   (an engine polling it does not spin). Once connected again, the library
 *   registers this client's engine memory (the same memory) and layouts
 *   again and maps daemon pools it had mapped at the same addresses (host
 *   and cuda:N; now the new daemon's memory: daemon pools start empty),
 *   before it takes calls. Pool and layout ids held by the
 *   engine keep naming the same pools and layouts, whatever ids the new
 *   daemon gives them. A daemon that does not come back within
 *   reconnect_ms leaves the client as without reconnecting: every call
 *   fails with KVF_EDAEMON and the event fd stays raised; kvf_close it.
 *   0: never reconnect. */
typedef struct kvf_connect_opts {
  int wait_ms;
  int reconnect_ms;
} kvf_connect_opts;
#define KVF_CONNECT_WAIT_MS_DEFAULT 0
#define KVF_RECONNECT_MS_DEFAULT 30000
#define KVF_CONNECT_OPTS_INIT {-1, -1}

int kvf_connect_ex(const char *socket_path, const kvf_connect_opts *opts, kvf_client **out);
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
  int engine;         /* 1: engine memory (kvf_mem_register) */
  char nic_reg[16];   /* how NICs reach it: "dmabuf", "peermem", "host", "bounce", "none" */
} kvf_pool_info;

/* Fills up to cap entries; returns the number of pools (may exceed cap). */
int kvf_pools(kvf_client *c, kvf_pool_info *out, size_t cap);
/* Finds a pool by name. */
int kvf_pool_find(kvf_client *c, const char *name, kvf_pool_info *out);
/* Maps a pool into this process (once; later calls return the same
 * mapping). The mapping lives until kvf_close.
 *
 * Host pools: *addr is an ordinary pointer (mmap of the daemon's memfd,
 * sealed against resizing: ftruncate of it fails with EPERM, so no client
 * can pull its pages from under the daemon or another client).
 * cuda:N pools: *addr is a CUDA device pointer (a CUdeviceptr cast to void *)
 * valid in this process on GPU N and on every GPU with peer access to it:
 * use it with kernels, cudaMemcpy or torch (e.g. via __cuda_array_interface__);
 * the CPU cannot dereference it. The library loads the NVIDIA driver with
 * dlopen, imports the pool's fd (cuMemImportFromShareableHandle + cuMemMap),
 * holds GPU N's primary context (the CUDA runtime's) while mapped, and
 * leaves the calling thread's current context unchanged. Returns -ENODEV
 * when this process has no usable CUDA driver. */
int kvf_pool_map(kvf_client *c, uint32_t pool, void **addr, uint64_t *size);

/* ------------------------------------------------------------ engine memory
 *
 * Besides the daemon's pools, an engine may hand kvferry memory it already
 * allocated (its KV cache, from PyTorch or cudaMalloc); it becomes a pool
 * (kvf_pool_info.engine) usable in descriptors and layouts. The memory stays
 * the engine's: the daemon drops it on kvf_mem_unregister, kvf_close or when
 * the engine exits, and never while a transfer uses it.
 *
 *   KVF_MEM_HOST: addr..addr+size must lie in one MAP_SHARED mapping of a
 *     memfd (memfd_create; the daemon seals it against shrinking), or of a
 *     file on tmpfs (shm_open) or hugetlbfs. fd -1 lets the library find the
 *     file from /proc/self/maps; else fd is the file, addr is mapped from
 *     fd_offset. Anonymous or private memory (malloc, MAP_PRIVATE) has no
 *     file to hand over: KVF_EINVAL, as for a file this process holds no
 *     descriptor of and cannot open (a deleted one). The library keeps a
 *     descriptor of the file until the memory is unregistered (to register
 *     it again with a daemon that restarted).
 *   KVF_MEM_CUDA: addr is a CUDA device pointer inside one allocation
 *     (cudaMalloc, torch, or cuMemCreate with POSIX fd export). The library
 *     exports the allocation (cuIpcGetMemHandle, or its shareable fd) and the
 *     daemon imports it; NICs reach it by dmabuf or nvidia-peermem, else
 *     transfers bounce through pinned host memory (kvf_pool_info.nic_reg). */
#define KVF_MEM_HOST 0
#define KVF_MEM_CUDA 1

typedef struct kvf_mem {
  int kind;                /* KVF_MEM_HOST or KVF_MEM_CUDA */
  void *addr;
  uint64_t size;
  int fd;                  /* KVF_MEM_HOST: the file, or -1 (found for you) */
  uint64_t fd_offset;      /* KVF_MEM_HOST with fd: the file offset of addr */
  const char *name;        /* shown in status; NULL: "<pid>-mem<n>" */
} kvf_mem;

/* Registers m; *pool names it wherever a pool id goes. Descriptor and
 * layout offsets in it count from m->addr. */
int kvf_mem_register(kvf_client *c, const kvf_mem *m, uint32_t *pool);
/* Drops memory this client registered. KVF_EBUSY while a transfer uses
 * it (nothing changes; retry once it ended); this client's layouts on it
 * are freed with it. */
int kvf_mem_unregister(kvf_client *c, uint32_t pool);

typedef struct kvf_desc {
  uint32_t pool;
  uint64_t offset;
  uint64_t len;
} kvf_desc;

/* Decode side: blocks of transfer xfer_id go to descs. src_node NULL or ""
 * accepts the send from any node; naming it lets the daemon push the grant
 * ahead to that node (no round trip when the send comes). deadline_ms 0 uses
 * the daemon's default. Completion: one KVF_EV_RECV_DONE.
 * Destinations must not overlap: two descs sharing a byte are KVF_EINVAL
 * (touching ones are fine), and descs sharing a byte with a grant still
 * open in the same pool (any client's) are KVF_EBUSY, unless the daemon
 * runs with grant-overlap allow; a grant's bytes are free again once its
 * KVF_EV_RECV_DONE is out. The daemon's answer names the two ranges (the
 * library returns only the code; the daemon logs it at debug level). The same holds for
 * kvf_grant_blocks: an id twice in one grant is KVF_EINVAL, and blocks
 * whose bytes an open grant holds (the same layout on shared layers, or
 * another layout over the same memory) KVF_EBUSY. */
int kvf_grant(kvf_client *c, const char *xfer_id, const char *src_node,
              const kvf_desc *descs, size_t n, uint32_t deadline_ms);

#define KVF_SEND_MORE 0x1u   /* more parts of this transfer follow */

/* ------------------------------------------------------ calls that do not wait
 *
 * KVF_NOWAIT (kvf_send, kvf_send_blocks, kvf_grant_blocks; kvf_grant and
 * kvf_cancel through kvf_submit, whose entries all go this way): the call
 * checks what the library can check itself, writes the request to the
 * daemon and returns without waiting for its answer (a few microseconds
 * instead of a round trip). Every error is reported exactly once:
 *
 * At once, by the return value, queuing nothing (as for every call that
 * fails): KVF_EINVAL (client, id syntax, node name syntax, flags, no
 * descriptors or blocks, a first send_blocks part without ids), KVF_ELIMIT
 * (more descriptors or block ids than the daemon's max-descs, a frame over
 * its max-frame), KVF_EEXIST (a grant whose id names a grant of this client
 * whose KVF_EV_RECV_DONE has not come yet), KVF_ENOENT (a layout this client
 * did not register; a cancel of an id with no grant or send of this client
 * whose DONE event is still to come), KVF_EDAEMON (the connection is down),
 * -ENOMEM, and -EAGAIN under KVF_NOBLOCK.
 *
 * As the transfer's one DONE event, whatever the daemon refuses: grants as
 * KVF_EV_RECV_DONE, send parts as KVF_EV_SEND_DONE, with the status a
 * waiting call would have returned (KVF_ENOPEER, KVF_EEXIST, KVF_ESIZE,
 * KVF_ENOPOOL, KVF_ERANGE, KVF_EBUSY, KVF_ELIMIT, ...) and the daemon's
 * detail in ev.error; its path is "none" when the request began nothing. A
 * refused first part ends the send: its later parts, queued or not, are
 * then refused by the daemon silently (the one SEND_DONE already said
 * why), exactly as a refused later part fails the send. A nowait cancel
 * that finds its transfer already ended does nothing (that transfer's own
 * event says how it ended).
 *
 * A nowait send part opens its id at once (kvferry.h, "Transfer ids"):
 * later parts continue it, in the order they are submitted, whatever the
 * daemon makes of the first. Descriptor sends go in one frame however long
 * (never chained). KVF_SEND_NOWAIT is the former name, same value; before
 * it made only parts after the first unanswered.
 *
 * Backpressure: requests are written whole to the daemon's socket; a client
 * that submits faster than the daemon takes them waits in that write (the
 * daemon reads a client's requests only in its turns, one read of at most
 * 256 KiB or one max-frame frame at a time: the rest wait in the socket).
 * With KVF_NOBLOCK the call instead returns -EAGAIN, having queued
 * nothing, when the socket's send buffer cannot take the whole request
 * now (it may still wait briefly when the kernel's estimate of the room
 * was short, and a request larger than the whole buffer goes once the
 * buffer is empty, waiting while the daemon reads it). Events wait in the
 * library until taken, whoever is slow. */
#define KVF_NOWAIT 0x2u
#define KVF_SEND_NOWAIT KVF_NOWAIT
#define KVF_NOBLOCK 0x4u

/* Prefill side: send descs to dst_node (which may be this node). Parts after
 * the first continue the pairing where the previous part stopped.
 * Completion: one KVF_EV_SEND_DONE after the last part.
 *
 * A peer daemon that is not connected (down, or reconnecting) does not
 * refuse the send: it waits, within its deadline, and starts once the link
 * is up again. It fails with KVF_EDEADLINE when the deadline comes first,
 * and with KVF_EPEERLOST at once when the peer is removed from the daemon's
 * configuration. At most max-peer-waiting sends wait for one peer; past
 * that a new one is refused with KVF_ELIMIT. A send interrupted while its
 * data moves fails with KVF_EPEERLOST (its receiver fails too). A send
 * whose every byte was handed over when the link dropped waits for the
 * receiver's word instead: when the same peer (not restarted) is back
 * within the deadline, KVF_EV_SEND_DONE reports what the receiver got;
 * KVF_EUNKNOWN when it cannot know (the peer restarted, was removed, or
 * stayed away past the deadline): the data may or may not have landed. */
int kvf_send(kvf_client *c, const char *xfer_id, const char *dst_node,
             const kvf_desc *descs, size_t n, unsigned flags, uint32_t deadline_ms);

/* Cancels this client's grant or send xfer_id. Both sides get their event
 * with KVF_ECANCELED (here) or KVF_EREMOTECANCEL (there). */
int kvf_cancel(kvf_client *c, const char *xfer_id);

/* Transfer ids: 1 to KVF_XFER_ID_MAX bytes of well-formed UTF-8 without
 * control characters (anything else: KVF_EINVAL). An id names one
 * transfer from its first grant or send call until this client has taken
 * that transfer's KVF_EV_RECV_DONE or KVF_EV_SEND_DONE with
 * kvf_wait_events. Until then a part sent with the
 * same id continues that transfer, or, once it ended (done, failed,
 * cancelled), is refused at once with KVF_ENOENT: a late part never starts
 * a new transfer. Once the event is taken the id may name a new transfer. */

/* ---------------------------------------------------------------- KV layouts
 *
 * Engines keep their KV cache as per-layer K and V tensors indexed by block
 * id, and a request is a list of block ids. Rather than one kvf_desc per
 * (layer, K/V, block), an engine registers its cache's layout once and
 * transfers name block ids and layers; the daemon computes the addresses
 * (for copies on one GPU, in the copy kernel). Region r = layer * n_kv + kv
 * holds block b at pool offset offsets[r] + b * block_stride:
 *
 *   vLLM, per layer [2, n_blocks, ...]:  offsets[2l] = K tensor - pool base,
 *       offsets[2l+1] = V tensor - pool base, block_stride = block_bytes
 *   one block holds every layer:  block_stride = n_layers * 2 * block_bytes,
 *       offsets[r] = r * block_bytes
 *   MLA (one latent per layer):  n_kv = 1
 *
 * Registration checks that every block of every region lies in the pool and
 * that no two regions overlap (KVF_ERANGE, KVF_EINVAL, with the detail in
 * the daemon's log and kvferryctl's errors). A layout belongs to the client
 * that registered it and is freed by kvf_layout_free or kvf_close; a
 * transfer under way keeps what it needs of it. */
#define KVF_LAYOUT_NHD 0   /* a block is [token, head, dim] */
#define KVF_LAYOUT_HND 1   /* a block is [head, token, dim] */

typedef struct kvf_layout {
  uint32_t pool;               /* the pool holding the cache */
  uint32_t n_layers;
  uint32_t n_kv;               /* 2: K and V regions; 1: one latent region (MLA) */
  uint32_t n_blocks;           /* blocks per region; ids are 0 .. n_blocks - 1 */
  uint64_t block_bytes;        /* one block of one region of one layer */
  uint64_t block_stride;       /* from block b to block b + 1 of a region */
  const uint64_t *offsets;     /* n_layers * n_kv pool offsets of block 0 */
  /* What a block holds. The two sides of a transfer must agree on what
   * both state (0: not stated; when all four are stated their product must
   * be block_bytes). */
  uint32_t tokens_per_block;
  uint32_t kv_heads;           /* the KV heads this layout holds */
  uint32_t head_dim;
  uint32_t dtype_bytes;
  uint32_t order;              /* KVF_LAYOUT_NHD (default) or KVF_LAYOUT_HND */
  /* Added after the fields above (zero-initialise the struct: 0 keeps the
   * old meaning). Which of the model's KV heads the blocks hold, for
   * tensor parallelism: heads [first_head, first_head + kv_heads) of
   * model_kv_heads (prefill rank r of TP 8 over 8 heads: first_head r,
   * kv_heads 1; decode rank r of TP 4: first_head 2r, kv_heads 2).
   * model_kv_heads 0: not stated, the layout holds every head (first_head
   * must then be 0). A layout with n_kv 1 (MLA's latent) is replicated on
   * every rank: any one source covers it (first_head 0). */
  uint32_t first_head;
  uint32_t model_kv_heads;
} kvf_layout;

/* Heterogeneous layouts (daemon/kv_xform.h, daemon/xfer_fan.h). When both
 * sides state their whole geometry, a send and a grant may differ in
 * order (NHD / HND), tokens per block (by a whole factor either way) and
 * KV heads; the daemon moves what they share, transformed (on the GPU in
 * the copy kernel for local cuda pools). Tokens: the transfer's token t is
 * slot t % T of block t / T on each side; it moves every slot of the
 * grant's n blocks (n x Td tokens), and the send names ceil(n x Td / Ts)
 * blocks (with Ts < Td, whole send blocks: any ids past the request).
 * Heads: layouts that state model_kv_heads move one transfer per KV head
 * ("<id>#h<head>", reported as one): every decode rank grants the
 * request's id with its layout, every prefill rank sends it with its own,
 * wherever they run (fan-in: TP 8 -> 4; fan-out: TP 2 -> 8, dst_node
 * "a,b,c,d" names several nodes, up to KVF_DST_NODES_MAX names of up to
 * KVF_NAME_MAX bytes each, that take the send's heads in order, in equal
 * shares); RECV_DONE comes once every head landed, and a failure
 * names the heads missing (e.g. "heads 1 missing: ..." at the deadline).
 * Both sides state model_kv_heads, or neither. Layouts that cannot be
 * reconciled (regions per layer, layer counts, head dims, dtypes, tokens
 * per block that are not a multiple, block counts that do not map) fail
 * the pairing with KVF_ESIZE and a message that names the mismatch. */

/* Registers a layout; *id names it in kvf_grant_blocks / kvf_send_blocks. */
int kvf_layout_register(kvf_client *c, const kvf_layout *layout, uint32_t *id);
/* Frees a layout of this client (KVF_ENOENT: no such layout). */
int kvf_layout_free(kvf_client *c, uint32_t id);

/* Blocks of a layout, over layers [first_layer, first_layer + n_layers). */
typedef struct kvf_blocks {
  uint32_t layout;
  const uint32_t *ids;         /* block ids of the layout, in transfer order */
  size_t n;
  uint32_t first_layer;
  uint32_t n_layers;           /* 0: every layer from first_layer on */
} kvf_blocks;

/* Ask for one KVF_EV_LAYER_DONE per layer as it lands, before RECV_DONE. */
#define KVF_GRANT_LAYER_EVENTS 0x1u

/* Decode side: the blocks of transfer xfer_id go to blocks->ids of the
 * layout, for blocks' layers. Otherwise as kvf_grant. */
int kvf_grant_blocks(kvf_client *c, const char *xfer_id, const char *src_node, const kvf_blocks *blocks,
                     unsigned flags, uint32_t deadline_ms);
/* Prefill side: sends blocks' layers of blocks->ids. Block i lands in the
 * grant's block i, for every layer and K/V; the block counts and block
 * sizes of the two layouts must match (KVF_ESIZE). Parts (KVF_SEND_MORE)
 * go layer by layer or by groups of layers, in any order, each layer of the
 * grant once; the first part names the blocks, a later one the same ids or
 * none (ids NULL, n 0). A transfer is either blocks or descriptors. */
int kvf_send_blocks(kvf_client *c, const char *xfer_id, const char *dst_node, const kvf_blocks *blocks,
                    unsigned flags, uint32_t deadline_ms);

/* ------------------------------------------------------------ batches
 *
 * Many requests' grants, send parts and cancels in one call: the library
 * checks and encodes them in order and writes them with one write. Every
 * entry goes as with KVF_NOWAIT (above: what fails at once, what comes as
 * an event). Returns the number of entries queued, from the first; a
 * return k < n means entry k was refused at once, *error (when not NULL)
 * says why, and no entry after it was looked at (so parts of one transfer
 * keep their order). A negative return queued nothing: KVF_EINVAL (c,
 * subs), KVF_EDAEMON, -ENOMEM, or -EAGAIN with KVF_NOBLOCK in flags (the
 * whole batch did not fit the socket's send buffer now). */
enum kvf_sub_op {
  KVF_SUB_GRANT = 1,       /* kvf_grant: node = src_node, descs, n */
  KVF_SUB_SEND = 2,        /* kvf_send: node = dst_node, descs, n, flags KVF_SEND_MORE */
  KVF_SUB_GRANT_BLOCKS = 3,/* kvf_grant_blocks: node = src_node, blocks, flags KVF_GRANT_LAYER_EVENTS */
  KVF_SUB_SEND_BLOCKS = 4, /* kvf_send_blocks: node = dst_node, blocks, flags KVF_SEND_MORE */
  KVF_SUB_CANCEL = 5,      /* kvf_cancel */
};

typedef struct kvf_sub {
  int op;                  /* enum kvf_sub_op */
  const char *xfer_id;
  const char *node;
  const kvf_desc *descs;
  size_t n;
  const kvf_blocks *blocks;
  unsigned flags;          /* KVF_NOWAIT may be set too; it is implied */
  uint32_t deadline_ms;
} kvf_sub;

int kvf_submit(kvf_client *c, const kvf_sub *subs, size_t n, unsigned flags, int *error);

enum kvf_event_type { KVF_EV_RECV_DONE = 1, KVF_EV_SEND_DONE = 2, KVF_EV_LAYER_DONE = 3 };

typedef struct kvf_event {
  int type;                            /* enum kvf_event_type */
  int status;                          /* 0 or a negative error code */
  char xfer_id[KVF_XFER_ID_MAX + 1];
  char path[32];                       /* "tcp", "local", "rdma", ... */
  char peer[KVF_NAME_MAX + 1];         /* the node at the other end */
  /* RECV_DONE: the grant's size (also when it failed: what landed of it
   * is not known to the receiver; with KVF_GRANT_LAYER_EVENTS the
   * LAYER_DONE events say which layers did). SEND_DONE: what this side
   * handed to the transport. */
  uint64_t bytes;
  uint64_t descriptors;                /* blocks: blocks x layers x K/V */
  char error[128];                     /* detail when status != 0 */
  uint32_t layer;                      /* KVF_EV_LAYER_DONE: the layer that landed */
  /* RECV_DONE / SEND_DONE of blocks: what was done to them and where:
   * "whole blocks", or the transform (kv heads moved, each side's order,
   * tokens per block and heads: "heads 0-1, NHD 16/1h -> HND 64/2h"), then
   * how the transport placed it when it says (rdma: ", staged" through the
   * receiver's staging and a transform pass there, ", direct" written run
   * by run, or ", direct, gathered" a destination head slice a write
   * gathering its tokens, with why). Empty: descriptors, or not known. */
  char transform[112];
} kvf_event;

/* A file descriptor that polls readable while events are waiting; for an
 * engine's own event loop. Do not read or close it. */
int kvf_event_fd(kvf_client *c);
/* Takes up to cap waiting events. timeout_ms: 0 returns at once, -1 waits
 * without bound. Returns the number taken (0 on timeout) or an error.
 * With none waiting, the call first spins for $KVFERRY_SPIN_US
 * microseconds (read at connect; default KVF_SPIN_US_DEFAULT, at most
 * 10,000, never past timeout_ms) and only then sleeps: an event that comes
 * within them is taken without a sleep and a wake-up, at the price of one
 * busy CPU while it spins (worth it where cores are spare; never on a
 * machine with fewer cores than busy threads). With it, the library's own
 * reader thread also polls the daemon socket for that long after each read,
 * each request written and each wait that spins (one that sleeps is woken),
 * so that an event is not held behind the reader's own wake-up: a second
 * busy CPU while a transfer of this client is in flight. Calls that wait
 * for the daemon's answer (a send without KVF_NOWAIT, kvf_pools, ...)
 * spin for it as long before they sleep. A wait that sleeps sleeps on the
 * daemon's socket and the event fd together, waking with the reader thread,
 * and spins for the event the reader is queuing: up to 500 us where the
 * client may run on 4 CPUs or more or $KVFERRY_SPIN_US is set, 30 us on
 * fewer (there the reader may need this thread's CPU), then it sleeps
 * until the reader signals.
 * When the daemon says an event is near (a local layer-wise send's last
 * part due, the local GPU path's last copy or the rest of a tcp grant's
 * data expected within 2 ms), the reader and such a wait poll for it
 * until then (at most 3 ms; the transfer's RECV_DONE or SEND_DONE ends
 * it), whatever $KVFERRY_SPIN_US says; but only where the client may run
 * on 4 CPUs or more, or $KVFERRY_SPIN_US is set: on fewer, that polling
 * starves the threads that move the data (the daemon's, on this host too),
 * and the client tells the daemon at connect to send no such hint.
 * $KVFERRY_SOON_POLL=1 or 0 at connect decides instead.
 * While a grant of this client waits for its RECV_DONE, for
 * $KVFERRY_GRANT_SPIN_US microseconds after the last grant posted (read at
 * connect; default KVF_GRANT_SPIN_US_DEFAULT where the client may run on
 * 4 CPUs or more or $KVFERRY_SPIN_US is set, 0 on fewer; at most
 * 1,000,000; 0: off), the reader polls the socket and this call spins
 * instead of sleeping, as the daemons poll through the same window
 * (spin-grant-us): a handoff whose grant was posted a prefill ahead then
 * finds no thread of the engine's to wake. Where other tasks kept a
 * thread polling for this window off its CPU for 100 us of a spin (or 1/64
 * of a longer one), the CPUs are busy after all: the window closes and no
 * grant opens one for 100 ms ($KVFERRY_SPIN_US's spin and a Soon's poll
 * on regardless). */
#define KVF_SPIN_US_DEFAULT 0
#define KVF_GRANT_SPIN_US_DEFAULT 10000
int kvf_wait_events(kvf_client *c, kvf_event *out, size_t cap, int timeout_ms);

/* Introspection, rendered by the daemon: a human table or a JSON document.
 * *out is malloc'ed; free() it. */
enum kvf_inspect { KVF_INSPECT_STATUS, KVF_INSPECT_POOLS, KVF_INSPECT_PEERS,
                   KVF_INSPECT_TRANSFERS, KVF_INSPECT_LAYOUTS,
                   KVF_INSPECT_TRACE /* the last finished transfers' timelines */ };
int kvf_inspect(kvf_client *c, int what, int json, char **out);

#ifdef __cplusplus
}
#endif
#endif
