/* gpu.h - the daemon's CUDA side: driver (dlopen), devices and peer access,
 * cuda:N pool memory (cuMemCreate, POSIX fd, GPUDirect RDMA capable), the
 * batched copy kernel, and pinned staging.
 *
 * Without a driver or GPU everything here reports so (kvf__gpu_ready() is
 * false, kvf__gpu_why() says why) and the daemon runs with host pools only.
 *
 * Thread safety: every function may be called from any thread (the loop,
 * libuv's workers, the tcp threads); each sets the device's primary context
 * current on the calling thread itself. A kvf__gpu_batch is used by one
 * thread at a time. */
#ifndef KVF_GPU_H
#define KVF_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "copy_args.h"

#define KVF__GPU_MAX_DEV 16

/* ---------------------------------------------------------------- init */

/* Loads the driver and the kernel; mode is enum kvf__tristate (auto: use a
 * GPU when there is one; on: fail without; off: never touch CUDA). Logs one
 * line saying what it found. Returns 0, or an error only when mode is on
 * and CUDA is unusable. Idempotent. */
int kvf__gpu_init(int mode);
void kvf__gpu_shutdown(void);
bool kvf__gpu_ready(void);
/* Why there is no CUDA, or a summary of what there is ("2 GPUs, kernel sm_90"). */
const char *kvf__gpu_why(void);
int kvf__gpu_count(void);
/* Device facts for status, doctor and the start line. */
typedef struct kvf__gpu_info {
  char name[96];
  char bdf[32];           /* PCI bus id, "0000:19:00.0" */
  int sms;
  int cc_major, cc_minor;
  bool dmabuf;            /* CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED */
  bool gdr;               /* GPUDirect RDMA supported */
  bool gdr_vmm;           /* ... for cuMemCreate memory */
  uint64_t total_mem;
} kvf__gpu_info;
int kvf__gpu_info_get(int dev, kvf__gpu_info *out);
/* Whether kernels on device a can read and write device b's pool memory
 * (a == b, or peer access enabled). */
bool kvf__gpu_peer(int a, int b);
/* How devices a and b are linked for copies: "same-gpu", "nvlink" (peer
 * access with NVLink), "pcie-p2p", or "staged" (through host memory). */
const char *kvf__gpu_link(int a, int b);

/* ---------------------------------------------------------------- pools */

typedef struct kvf__gpu_mem {
  int dev;
  uint64_t size;          /* rounded up to the allocation granularity */
  uint64_t dptr;          /* the daemon's mapping */
  unsigned long long handle;
  int fd;                 /* POSIX fd of the allocation, for clients */
  bool gdr_flag;          /* allocated with gpuDirectRDMACapable */
} kvf__gpu_mem;

/* Allocates size bytes (rounded up) on dev, maps them in the daemon with
 * read-write access for dev and every device with peer access to it, and
 * exports a POSIX fd. */
int kvf__gpu_mem_alloc(int dev, uint64_t size, kvf__gpu_mem *m, char *err, size_t errlen);
void kvf__gpu_mem_free(kvf__gpu_mem *m);
/* A dmabuf fd for [dptr, dptr+len) (page aligned), for ibv_reg_dmabuf_mr:
 * 0, or -ENOTSUP (driver/kernel without dmabuf), or -EIO. The caller closes
 * *fd. */
int kvf__gpu_mem_dmabuf(const kvf__gpu_mem *m, int *fd, uint64_t *offset);
/* ------------------------------------------------------- engine memory
 * GPU memory an engine allocated and exported (kvf_mem_register): imported
 * into the daemon for its copies (implemented in gpu_import.c). */
typedef struct kvf__gpu_import {
  int dev;
  uint64_t dptr;          /* the daemon's address of the allocation's first byte */
  uint64_t size;          /* the allocation's size */
  int kind;               /* internal: how it was imported (for the release) */
  unsigned long long handle; /* VMM imports: the allocation handle */
} kvf__gpu_import;
/* dev is the engine's guess (its own device numbering, which differs from
 * the daemon's under CUDA_VISIBLE_DEVICES): tried first; im->dev is where
 * the allocation really is, in the daemon's numbering. alloc_size is the
 * engine's size of the allocation (cuMemGetAddressRange there); a size the
 * imported memory does not have is refused (-EINVAL). Errors: -ENODEV (no
 * CUDA here), -ENOTSUP (the driver cannot), -EINVAL (a bad handle, fd or
 * size), -EIO; err says which step failed and why.
 *
 * A cudaMalloc allocation by its 64-byte CUipcMemHandle
 * (cuIpcOpenMemHandle, with lazy peer access), opened in its GPU's primary
 * context. The same handle imported again (two ranges of one allocation)
 * shares the first open; each import is released on its own. */
int kvf__gpu_import_ipc(int dev, const uint8_t handle[64], uint64_t alloc_size, kvf__gpu_import *im, char *err,
                        size_t errlen);
/* The daemon's device for an engine's allocation: the GPU whose PCI bus id
 * is bus_id (any case) when there is one, else the engine's ordinal guess
 * (0 when out of range). An IPC handle cannot tell its GPU after the open
 * (the mapping reports the opener's), so the bus id is what finds it. */
int kvf__gpu_resolve_dev(int guess, const char *bus_id);
/* A VMM allocation by its POSIX fd (cuMemImportFromShareableHandle, then
 * mapped at a fresh address, read-write for its GPU and that GPU's peers).
 * The caller keeps fd. */
int kvf__gpu_import_fd(int dev, int fd, uint64_t alloc_size, kvf__gpu_import *im, char *err, size_t errlen);
/* Unmaps and closes what an import brought in (nothing after a failed
 * import; idempotent). The engine's memory itself stays the engine's. */
void kvf__gpu_import_release(kvf__gpu_import *im);
/* A dmabuf fd for [dptr, dptr + len) of any device memory mapped in this
 * process (cuMemGetHandleForAddressRange; len and dptr page aligned), for
 * ibv_reg_dmabuf_mr: 0 (*offset: 0, the fd starts at dptr), -ENOTSUP (the
 * driver or GPU has no dmabuf, or refuses it for this memory), -EINVAL (not
 * aligned, not device memory), -ENODEV or -EIO. The caller closes *fd. */
int kvf__gpu_range_dmabuf(uint64_t dptr, uint64_t len, int *fd, uint64_t *offset);

/* Page-locks host memory and maps it for every device; *dev_alias is the
 * address kernels use for it (equal to p on UVA systems). */
int kvf__gpu_host_register(void *p, size_t len, uint64_t *dev_alias);
void kvf__gpu_host_unregister(void *p);
/* Pinned, device-mapped host memory (staging). */
void *kvf__gpu_host_alloc(size_t len, uint64_t *dev_alias);
void kvf__gpu_host_free(void *p);

/* A KV layout's region offsets copied to GPU dev once, at registration, so
 * that block copies compute addresses there (*out: opaque; NULL frees). */
int kvf__gpu_layout_upload(int dev, const uint64_t *offsets, size_t n, void **out);
void kvf__gpu_layout_free(void *g);
/* The device address of an uploaded table. */
uint64_t kvf__gpu_layout_table(const void *g);

/* ---------------------------------------------------------------- copies */

/* One end of a copy: dev >= 0 for device memory, -1 for host memory.
 * addr is what kernels use (device address, or the host memory's device
 * alias when mapped != 0); host is the CPU's pointer to host memory. */
typedef struct kvf__gpu_end {
  int dev;
  bool mapped;            /* host memory registered with CUDA */
  uint64_t addr;
  uint8_t *host;
} kvf__gpu_end;

typedef struct kvf__gpu_copy {
  kvf__gpu_end src, dst;
  uint64_t len;
} kvf__gpu_copy;

/* A batch of copies launched together: one kernel launch per executing
 * device (normally one). Reuse it: reset, add, launch, wait. */
typedef struct kvf__gpu_batch kvf__gpu_batch;
int kvf__gpu_batch_new(kvf__gpu_batch **out);
void kvf__gpu_batch_free(kvf__gpu_batch *b);
void kvf__gpu_batch_reset(kvf__gpu_batch *b);
/* Adds src -> dst (device-visible addresses), run on device exec. */
int kvf__gpu_batch_add(kvf__gpu_batch *b, int exec, uint64_t src, uint64_t dst, uint64_t len);
size_t kvf__gpu_batch_chunks(const kvf__gpu_batch *b);
/* Starts the copies (asynchronously); kvf__gpu_batch_wait completes them. */
int kvf__gpu_batch_launch(kvf__gpu_batch *b);
int kvf__gpu_batch_wait(kvf__gpu_batch *b);
/* Kernel time of the last launch in ms (events), for benchmarks; -1 if unknown. */
float kvf__gpu_batch_ms(kvf__gpu_batch *b);

/* Copies everything, synchronously, by the best route for each pair:
 * host->host by memcpy; one batched launch for everything a device can
 * reach directly (peer access, mapped host memory); through pinned host
 * staging otherwise. Fills *route with a name for the transfer's path
 * ("nvlink", "pcie-p2p", "same-gpu", "staged", "h2d", "d2h", "host").
 * Returns 0 or a negative errno (-EIO for CUDA failures, logged). */
int kvf__gpu_copy_all(const kvf__gpu_copy *v, size_t n, const char **route);

/* Asynchronously, when one launch moves all of v (kvf__gpu_copy_all's fast
 * path: the same two ends, a GPU reaching both): launches from the calling
 * thread and returns 0; done(arg, rc, kernel_ms) follows exactly once, on
 * the daemon's CUDA completion thread, after every kernel finished (rc 0
 * or -EIO), and must only hand the result on. -EAGAIN when v is not such a
 * batch (use kvf__gpu_copy_all); other errors: nothing runs, no callback. */
typedef void (*kvf__gpu_done_fn)(void *arg, int rc, float kernel_ms);
int kvf__gpu_copy_start(const kvf__gpu_copy *v, size_t n, kvf__gpu_done_fn done, void *arg);

/* ---------------------------------------------------------------- block copies */

/* One side of a block copy: a layout's regions of the copied layers in a
 * cuda pool (base: the pool's device address) and the block ids. table is
 * the device copy of the regions' offsets (kvf__gpu_layout_table, from the
 * first copied layer), offsets the host's, with the same indexing (region
 * r = (layer - first) * n_kv + kv; block b at offsets[r] + b * stride). */
typedef struct kvf__gpu_bside {
  int dev;
  uint64_t base;
  uint64_t table;
  const uint64_t *offsets;
  uint64_t stride;
  const uint32_t *ids;
} kvf__gpu_bside;

/* Source block src.ids[i] of every region lands in destination block
 * dst.ids[i] of the same region, i < n. With xf (kv_xform.h: the two
 * layouts differ in heads, order or tokens per block), the plan's tokens
 * and heads instead, src.ids[0..xf->ns) into dst.ids[0..xf->nd), by the
 * transform kernel (kvf_xblocks); n and block_bytes are then not used. */
struct kvf__xplan;
typedef struct kvf__gpu_blocks {
  kvf__gpu_bside src, dst;
  uint64_t block_bytes;
  uint32_t n_layers, n_kv;
  size_t n;
  const struct kvf__xplan *xf; /* NULL: whole blocks */
} kvf__gpu_blocks;

/* Starts a block copy asynchronously from the calling thread: one launch of
 * the block kernel (copy_kernel.cu, kvf_blocks) on the GPU that reaches
 * both pools (two, half each, between two GPUs with peer access both ways
 * when copies are split), the ids in the launch's parameters or in one
 * host-to-device copy: the work here does not grow with the number of
 * layers. Without the kernel (a build without nvcc), one cuMemcpyAsync per
 * run of kvf__blocks_pair's walk, counted as fallback bytes. done(arg, rc,
 * kernel_ms) follows exactly once, as for kvf__gpu_copy_start, and the job
 * (not the ids) may go when this returns. -EAGAIN: no GPU reaches both
 * pools (copy runs instead); -EINVAL: sizes the kernel cannot take (a
 * block of 4 GiB or more, more than 2^32 pieces); other errors: nothing
 * runs, no callback. */
int kvf__gpu_blocks_start(const kvf__gpu_blocks *job, kvf__gpu_done_fn done, void *arg);
/* What kvf__gpu_blocks_start would refuse before running anything
 * (-ENODEV, -EAGAIN, -EINVAL as there), without starting: 0 when it takes
 * job's shape and pools. */
int kvf__gpu_blocks_check(const kvf__gpu_blocks *job);
/* A transform (j->xf set) out of host memory that CUDA maps
 * (kvf__gpu_host_register) into a cuda pool: j->src.dev is -1, src.base
 * the host memory's device alias, src.table its regions' offsets on the
 * destination's GPU; one launch of the transform kernel (kvf_xblocks) on
 * the destination pool's GPU, which reads the host memory over the bus
 * (rdma staging: the receiver's pass from its staging slice into a grant
 * of a cuda pool). done(arg, rc, kernel_ms) as for kvf__gpu_blocks_start.
 * -EAGAIN: no transform kernel in this build (nothing runs); -EINVAL:
 * sizes the kernel cannot take, or not such a job. */
int kvf__gpu_xblocks_from_host(const kvf__gpu_blocks *j, kvf__gpu_done_fn done, void *arg);
/* Whether block copies run in the kernel (else cuMemcpy per run). */
bool kvf__gpu_blocks_kernel(void);

/* The kernel time (ms, events) of this thread's last kvf__gpu_copy_all
 * launch on the main batch; -1 when none. For traces. */
float kvf__gpu_last_kernel_ms(void);

/* Counters for status and metrics (monotonic, any thread). */
typedef struct kvf__gpu_stats {
  uint64_t launches;
  uint64_t chunks;
  uint64_t bytes_kernel;   /* moved by the copy kernel */
  uint64_t bytes_staged;   /* moved through pinned host staging */
  uint64_t bytes_fallback; /* moved by cuMemcpy (no kernel or unmapped host memory) */
  uint64_t errors;
  uint64_t block_launches;   /* block copies started (kvf__gpu_blocks_start) */
  uint64_t block_pieces;     /* ... their pieces (blocks x regions) */
  uint64_t block_bytes;      /* ... their bytes, by the kernel or (without it) cuMemcpy */
  uint64_t block_kernel_ns;  /* ... the GPU's time in them, between the events around each (lead GPU) */
} kvf__gpu_stats;
void kvf__gpu_stats_get(kvf__gpu_stats *s);

/* The copy kernel's launch shape, from the environment at start
 * (KVF_CUDA_KERNEL, _THREADS, _CTAS_PER_SM, _SPLIT, _SPLIT_PCT, _PULL);
 * kvf__gpu_tune changes it for benchmarks that try many shapes in one
 * process. Not for use while copies run. */
typedef struct kvf__gpu_tuning {
  const char *kernel;     /* entry point in copy_kernel.cu; NULL: keep */
  unsigned threads, ctas_per_sm;
  bool split;             /* GPU<->GPU work on both GPUs */
  unsigned split_pct;     /* ... this percentage pushed by the source */
  bool pull;              /* without split: the destination GPU copies */
} kvf__gpu_tuning;
int kvf__gpu_tune(const kvf__gpu_tuning *t);
void kvf__gpu_tuning_get(kvf__gpu_tuning *t);

/* ---------------------------------------------------------------- planning (pure) */

/* Cuts [src, dst, len) into chunks of at most KVF__CHUNK_BYTES, appended to
 * out[*n..cap). Returns the number of chunks needed (appends only if they
 * fit; *n advances then). */
size_t kvf__gpu_plan_cut(uint64_t src, uint64_t dst, uint64_t len, kvf_chunk *out, size_t *n, size_t cap);
/* Which device runs a copy between the two ends, or -1 when no device can
 * reach both (host->host, or devices without peer access: stage).
 * pull: prefer the destination device for device->device. */
int kvf__gpu_plan_exec(const kvf__gpu_end *src, const kvf__gpu_end *dst, bool (*peer)(int, int), bool pull);
/* GPU<->GPU copies split between both GPUs: whether copy i of a batch is
 * pushed by the source GPU (else pulled by the destination), so that pct
 * percent of them are pushed, evenly spread. */
bool kvf__gpu_plan_push(size_t i, unsigned pct);
/* Grid size for n chunks on a device with sms multiprocessors. */
unsigned kvf__gpu_plan_grid(size_t n, int sms, unsigned ctas_per_sm);

#endif
