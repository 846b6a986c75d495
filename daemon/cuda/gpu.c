/* gpu.c - see gpu.h. The CUDA driver comes in through cudrv.h (dlopen); the
 * copy kernel through kernel_image.c (nvcc's fatbin, embedded at build
 * time) and cuModuleLoadData. */
#include "gpu.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "cudrv.h"
#include "gpu_int.h"
#include "kernel_image.h"
#include "kv_xform.h"
#include "kvferryd.h"
#include "layout.h"
#include "log.h"
#include "spin.h"

#define STAGE_BYTES (64u << 20)     /* copy_all's staging, two halves */
#define DEFAULT_THREADS 256u
#define DEFAULT_CTAS_PER_SM 2u
#define DEFAULT_KERNEL "kvf_copy_u8"
#define DEFAULT_SPLIT_PCT 50u

typedef struct gdev {
  CUdevice d;
  CUcontext ctx;
  kvf__gpu_info info;
  CUmodule mod;
  CUfunction fn;
  CUfunction bfn;            /* kvf_blocks */
  CUfunction xfn;            /* kvf_xblocks */
  CUstream bst;              /* block copies, in order (block_stream) */
} gdev;

static struct {
  pthread_mutex_t mu;
  bool inited;
  bool ready;
  char why[512];
  kvf_cu cu;
  int n;
  gdev dev[KVF__GPU_MAX_DEV];
  bool peer[KVF__GPU_MAX_DEV][KVF__GPU_MAX_DEV];
  bool atomics[KVF__GPU_MAX_DEV][KVF__GPU_MAX_DEV];
  bool kernel;               /* the copy kernel is loaded on every device */
  bool blocks;               /* ... and the block kernel */
  bool xblocks;              /* ... and the transform kernel */
  bool block_own_streams;    /* KVF_CUDA_BLOCK_STREAM=own: each block copy on its copier's stream */
  char kernel_name[32];
  unsigned threads, ctas_per_sm;
  bool pull;
  bool split;                /* GPU<->GPU: part of the copies pushed, the rest pulled */
  unsigned split_pct;        /* ... this percentage pushed by the source GPU */
  atomic_uint_fast64_t launches, chunks, bytes_kernel, bytes_staged, bytes_fallback, errors;
  atomic_uint_fast64_t block_launches, block_pieces, block_bytes;
  atomic_uint_fast64_t block_kernel_ns; /* the GPU's time in block copies, from their events */
  struct copier *free_copiers;
} G = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* ------------------------------------------------------------ helpers */

static int cu_fail(const char *what, CUresult r) {
  char buf[200];
  atomic_fetch_add(&G.errors, 1);
  kvf__err("cuda: %s: %s", what, kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
  return -EIO;
}

#define CU_TRY(what, call)                           \
  do {                                               \
    CUresult r_ = (call);                            \
    if (r_ != KVF_CU_SUCCESS) return cu_fail(what, r_); \
  } while (0)

static int use_dev(int dev) {
  if (dev < 0 || dev >= G.n) return -ENODEV;
  CU_TRY("cuCtxSetCurrent", G.cu.CtxSetCurrent(G.dev[dev].ctx));
  return 0;
}

const kvf_cu *kvf__gpu_driver(void) { return G.ready ? &G.cu : NULL; }
int kvf__gpu_use(int dev) { return G.ready ? use_dev(dev) : -ENODEV; }
CUdevice kvf__gpu_cudev(int dev) { return G.dev[dev].d; }

static unsigned env_uint(const char *name, unsigned def, unsigned lo, unsigned hi) {
  const char *s = getenv(name);
  if (!s || !*s) return def;
  char *end;
  unsigned long v = strtoul(s, &end, 10);
  if (*end || v < lo || v > hi) return def;
  return (unsigned)v;
}

/* ------------------------------------------------------------ planning (pure) */

size_t kvf__gpu_plan_cut(uint64_t src, uint64_t dst, uint64_t len, kvf_chunk *out, size_t *n, size_t cap) {
  size_t need = (size_t)((len + KVF__CHUNK_BYTES - 1) / KVF__CHUNK_BYTES);
  if (len == 0 || *n + need > cap) return need;
  for (uint64_t off = 0; off < len; off += KVF__CHUNK_BYTES) {
    uint64_t k = len - off < KVF__CHUNK_BYTES ? len - off : KVF__CHUNK_BYTES;
    out[(*n)++] = (kvf_chunk){.src = src + off, .dst = dst + off, .len = (unsigned)k};
  }
  return need;
}

static bool reaches(int exec, const kvf__gpu_end *e, bool (*peer)(int, int)) {
  if (e->dev < 0) return e->mapped;
  return e->dev == exec || peer(exec, e->dev);
}

int kvf__gpu_plan_exec(const kvf__gpu_end *src, const kvf__gpu_end *dst, bool (*peer)(int, int), bool pull) {
  int first = pull ? dst->dev : src->dev, second = pull ? src->dev : dst->dev;
  if (first >= 0 && reaches(first, src, peer) && reaches(first, dst, peer)) return first;
  if (second >= 0 && reaches(second, src, peer) && reaches(second, dst, peer)) return second;
  return -1;
}

bool kvf__gpu_plan_push(size_t i, unsigned pct) {
  return (uint64_t)(i + 1) * pct / 100 > (uint64_t)i * pct / 100;
}

unsigned kvf__gpu_plan_grid(size_t n, int sms, unsigned ctas_per_sm) {
  size_t cap = (size_t)(sms > 0 ? sms : 1) * (ctas_per_sm ? ctas_per_sm : 1);
  size_t g = n < cap ? n : cap;
  return (unsigned)(g ? g : 1);
}

/* ------------------------------------------------------------ init */

static void describe(char *buf, size_t len) {
  size_t o = 0;
  o += (size_t)snprintf(buf + o, len - o, "driver %d.%d, %d GPU%s:", G.cu.driver_version / 1000,
                        G.cu.driver_version % 1000 / 10, G.n, G.n == 1 ? "" : "s");
  for (int i = 0; i < G.n && o < len; i++) {
    const kvf__gpu_info *in = &G.dev[i].info;
    o += (size_t)snprintf(buf + o, len - o, "%s cuda:%d %s (%s, %d SMs, sm_%d%d, %llu MiB, dmabuf %s, gdr %s)",
                          i ? ";" : "", i, in->name, in->bdf, in->sms, in->cc_major, in->cc_minor,
                          (unsigned long long)(in->total_mem >> 20), in->dmabuf ? "yes" : "no",
                          in->gdr_vmm ? "yes" : (in->gdr ? "no-vmm" : "no"));
  }
  for (int i = 0; i < G.n && o < len; i++)
    for (int j = i + 1; j < G.n && o < len; j++)
      o += (size_t)snprintf(buf + o, len - o, "; cuda:%d<->cuda:%d %s", i, j, kvf__gpu_link(i, j));
  if (o < len)
    o += (size_t)snprintf(buf + o, len - o, "; copy kernel %s",
                          G.kernel ? G.kernel_name : "NOT BUILT (no nvcc at build time): cuMemcpy per block, slow");
  if (o < len && G.kernel)
    snprintf(buf + o, len - o, "; block kernel %s", G.blocks ? "kvf_blocks" : "MISSING: cuMemcpy per run, slow");
}

static int load_kernels(char *err, size_t errlen) {
  size_t len = 0;
  const unsigned char *img = kvf__kernel_image(&len);
  if (!img) {
    snprintf(err, errlen, "this build has no copy kernel");
    return -ENOENT;
  }
  const char *want = getenv("KVF_CUDA_KERNEL");
  snprintf(G.kernel_name, sizeof(G.kernel_name), "%s", want && *want ? want : DEFAULT_KERNEL);
  for (int i = 0; i < G.n; i++) {
    char buf[200];
    CUresult r = G.cu.CtxSetCurrent(G.dev[i].ctx);
    if (r == KVF_CU_SUCCESS) r = G.cu.ModuleLoadData(&G.dev[i].mod, img);
    if (r != KVF_CU_SUCCESS) {
      snprintf(err, errlen, "cuModuleLoadData on cuda:%d: %s", i, kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
      return -EIO;
    }
    r = G.cu.ModuleGetFunction(&G.dev[i].fn, G.dev[i].mod, G.kernel_name);
    if (r != KVF_CU_SUCCESS) {
      snprintf(err, errlen, "kernel %s: %s", G.kernel_name, kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
      return -EIO;
    }
  }
  /* An image without the block kernel still copies runs; block copies then
   * go by cuMemcpy (and the start line says so). KVF_CUDA_BLOCKS=memcpy
   * takes that path on purpose (tests of the fallback). */
  const char *bk = getenv("KVF_CUDA_BLOCKS");
  G.blocks = !(bk && strcmp(bk, "memcpy") == 0);
  const char *bs = getenv("KVF_CUDA_BLOCK_STREAM"); /* own: as before 2026-11-26, for comparisons */
  G.block_own_streams = bs && strcmp(bs, "own") == 0;
  for (int i = 0; i < G.n && G.blocks; i++)
    G.blocks = G.cu.CtxSetCurrent(G.dev[i].ctx) == KVF_CU_SUCCESS &&
               G.cu.ModuleGetFunction(&G.dev[i].bfn, G.dev[i].mod, "kvf_blocks") == KVF_CU_SUCCESS;
  /* Without the transform kernel, transforms go as runs (the batched kernel). */
  G.xblocks = G.blocks;
  for (int i = 0; i < G.n && G.xblocks; i++)
    G.xblocks = G.cu.CtxSetCurrent(G.dev[i].ctx) == KVF_CU_SUCCESS &&
                G.cu.ModuleGetFunction(&G.dev[i].xfn, G.dev[i].mod, "kvf_xblocks") == KVF_CU_SUCCESS;
  return 0;
}

static int probe_devices(char *err, size_t errlen) {
  char buf[200];
  CUresult r = G.cu.DeviceGetCount(&G.n);
  if (r != KVF_CU_SUCCESS || G.n <= 0) {
    snprintf(err, errlen, "no CUDA device (%s)", r ? kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)) : "count 0");
    G.n = 0;
    return -ENODEV;
  }
  if (G.n > KVF__GPU_MAX_DEV) G.n = KVF__GPU_MAX_DEV;
  for (int i = 0; i < G.n; i++) {
    gdev *g = &G.dev[i];
    int v = 0;
    if ((r = G.cu.DeviceGet(&g->d, i)) != KVF_CU_SUCCESS || (r = G.cu.DevicePrimaryCtxRetain(&g->ctx, g->d)) != KVF_CU_SUCCESS) {
      snprintf(err, errlen, "cuda:%d: %s", i, kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
      G.n = i;
      return -EIO;
    }
    G.cu.DeviceGetName(g->info.name, sizeof(g->info.name), g->d);
    if (G.cu.DeviceGetPCIBusId(g->info.bdf, sizeof(g->info.bdf), g->d) != KVF_CU_SUCCESS)
      snprintf(g->info.bdf, sizeof(g->info.bdf), "?");
    for (char *c = g->info.bdf; *c; c++)
      if (*c >= 'A' && *c <= 'F') *c = (char)(*c - 'A' + 'a'); /* as sysfs spells it */
    G.cu.DeviceGetAttribute(&g->info.sms, KVF_CU_ATTR_MULTIPROCESSOR_COUNT, g->d);
    G.cu.DeviceGetAttribute(&g->info.cc_major, KVF_CU_ATTR_CC_MAJOR, g->d);
    G.cu.DeviceGetAttribute(&g->info.cc_minor, KVF_CU_ATTR_CC_MINOR, g->d);
    v = 0;
    G.cu.DeviceGetAttribute(&v, KVF_CU_ATTR_DMA_BUF_SUPPORTED, g->d);
    g->info.dmabuf = v != 0;
    v = 0;
    G.cu.DeviceGetAttribute(&v, KVF_CU_ATTR_GDR_SUPPORTED, g->d);
    g->info.gdr = v != 0;
    v = 0;
    G.cu.DeviceGetAttribute(&v, KVF_CU_ATTR_GDR_WITH_VMM_SUPPORTED, g->d);
    g->info.gdr_vmm = v != 0;
    size_t tm = 0;
    G.cu.DeviceTotalMem(&tm, g->d);
    g->info.total_mem = tm;
    v = 0;
    G.cu.DeviceGetAttribute(&v, KVF_CU_ATTR_VMM_SUPPORTED, g->d);
    int fdok = 0;
    G.cu.DeviceGetAttribute(&fdok, KVF_CU_ATTR_POSIX_FD_SUPPORTED, g->d);
    if (!v || !fdok) {
      snprintf(err, errlen, "cuda:%d (%s) lacks virtual memory management or POSIX fd export", i, g->info.name);
      G.n = i + 1;
      return -ENOTSUP;
    }
  }
  /* Peer access both ways where the hardware allows; "KVF_CUDA_NO_PEER=1"
   * pretends it does not (tests of the staged path). */
  bool no_peer = getenv("KVF_CUDA_NO_PEER") && atoi(getenv("KVF_CUDA_NO_PEER"));
  for (int i = 0; i < G.n; i++)
    for (int j = 0; j < G.n; j++) {
      if (i == j) continue;
      int can = 0;
      G.cu.DeviceCanAccessPeer(&can, G.dev[i].d, G.dev[j].d);
      if (!can || no_peer) continue;
      G.cu.CtxSetCurrent(G.dev[i].ctx);
      r = G.cu.CtxEnablePeerAccess(G.dev[j].ctx, 0);
      if (r != KVF_CU_SUCCESS && r != KVF_CU_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
        kvf__warn("cuda: peer access cuda:%d -> cuda:%d refused: %s; copies between them are staged", i, j,
                  kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
        continue;
      }
      G.peer[i][j] = true;
      /* Native peer atomics exist over NVLink, not over PCIe. */
      CUresult (*p2pattr)(int *, int, CUdevice, CUdevice) =
          (CUresult(*)(int *, int, CUdevice, CUdevice))dlsym(G.cu.lib, "cuDeviceGetP2PAttribute");
      int at = 0;
      if (p2pattr) p2pattr(&at, 3 /* NATIVE_ATOMIC_SUPPORTED */, G.dev[i].d, G.dev[j].d);
      G.atomics[i][j] = at != 0;
    }
  return 0;
}

int kvf__gpu_init(int mode) {
  pthread_mutex_lock(&G.mu);
  if (G.inited) {
    pthread_mutex_unlock(&G.mu);
    return G.ready || mode != KVF__ON ? 0 : -ENODEV;
  }
  G.inited = true;
  /* The bulk (TMA) variant issues from one thread: small CTAs, several per SM. */
  bool tma = getenv("KVF_CUDA_KERNEL") && strstr(getenv("KVF_CUDA_KERNEL"), "tma");
  G.threads = env_uint("KVF_CUDA_THREADS", tma ? 32 : DEFAULT_THREADS, 32, 1024);
  G.threads -= G.threads % 32;
  G.ctas_per_sm = env_uint("KVF_CUDA_CTAS_PER_SM", tma ? 6 : DEFAULT_CTAS_PER_SM, 1, 32);
  G.pull = getenv("KVF_CUDA_PULL") && atoi(getenv("KVF_CUDA_PULL"));
  /* Split GPU<->GPU copies between both GPUs' SMs (half pushed, half
   * pulled): measured the fastest on an H200 NVLink pair; KVF_CUDA_SPLIT=0
   * keeps the work on the source GPU. */
  G.split = !getenv("KVF_CUDA_SPLIT") || atoi(getenv("KVF_CUDA_SPLIT"));
  G.split_pct = env_uint("KVF_CUDA_SPLIT_PCT", DEFAULT_SPLIT_PCT, 0, 100);
  char err[400] = "";
  int rc = 0;
  if (mode == KVF__OFF) {
    snprintf(G.why, sizeof(G.why), "disabled by the configuration (cuda off)");
    kvf__info("cuda: off by configuration; cuda:N pools are unavailable");
  } else if (kvf__cu_load(&G.cu, err, sizeof(err)) != 0 || probe_devices(err, sizeof(err)) != 0) {
    snprintf(G.why, sizeof(G.why), "%s", err);
    if (mode == KVF__ON) {
      kvf__err("cuda: %s (cuda on: GPU support is required)", err);
      rc = -ENODEV;
    } else {
      kvf__info("cuda: not available: %s; host pools only", err);
    }
  } else {
    char kerr[300];
    G.kernel = load_kernels(kerr, sizeof(kerr)) == 0;
    if (!G.kernel && kvf__kernel_image(NULL))
      kvf__warn("cuda: the copy kernel did not load (%s); GPU copies use cuMemcpy per block, far slower", kerr);
    G.ready = true;
    describe(G.why, sizeof(G.why));
    kvf__info("cuda: %s", G.why);
  }
  pthread_mutex_unlock(&G.mu);
  return rc;
}

bool kvf__gpu_ready(void) { return G.ready; }
const char *kvf__gpu_why(void) { return G.why[0] ? G.why : "not initialized"; }
int kvf__gpu_count(void) { return G.ready ? G.n : 0; }

int kvf__gpu_info_get(int dev, kvf__gpu_info *out) {
  if (!G.ready || dev < 0 || dev >= G.n) return -ENODEV;
  *out = G.dev[dev].info;
  return 0;
}

bool kvf__gpu_peer(int a, int b) {
  if (!G.ready || a < 0 || b < 0 || a >= G.n || b >= G.n) return false;
  return a == b || G.peer[a][b];
}

const char *kvf__gpu_link(int a, int b) {
  if (a == b) return "same-gpu";
  if (!kvf__gpu_peer(a, b) || !kvf__gpu_peer(b, a)) return "staged";
  return G.atomics[a][b] ? "nvlink" : "pcie-p2p";
}

int kvf__gpu_tune(const kvf__gpu_tuning *t) {
  if (!G.ready) return -ENODEV;
  if (t->threads < 32 || t->threads > 1024 || t->threads % 32 || t->ctas_per_sm < 1 || t->split_pct > 100)
    return -EINVAL;
  if (t->kernel && G.kernel) {
    CUfunction fn[KVF__GPU_MAX_DEV];
    for (int i = 0; i < G.n; i++) {
      if (use_dev(i)) return -EIO;
      if (G.cu.ModuleGetFunction(&fn[i], G.dev[i].mod, t->kernel) != KVF_CU_SUCCESS) return -ENOENT;
    }
    for (int i = 0; i < G.n; i++) G.dev[i].fn = fn[i];
    snprintf(G.kernel_name, sizeof(G.kernel_name), "%s", t->kernel);
  }
  G.threads = t->threads;
  G.ctas_per_sm = t->ctas_per_sm;
  G.split = t->split;
  G.split_pct = t->split_pct;
  G.pull = t->pull;
  return 0;
}

void kvf__gpu_tuning_get(kvf__gpu_tuning *t) {
  t->kernel = G.kernel_name;
  t->threads = G.threads;
  t->ctas_per_sm = G.ctas_per_sm;
  t->split = G.split;
  t->split_pct = G.split_pct;
  t->pull = G.pull;
}

/* ------------------------------------------------------------ memory */

int kvf__gpu_mem_alloc(int dev, uint64_t size, kvf__gpu_mem *m, char *err, size_t errlen) {
  char buf[200];
  memset(m, 0, sizeof(*m));
  m->fd = -1;
  if (!G.ready) {
    snprintf(err, errlen, "no CUDA: %s", kvf__gpu_why());
    return -ENODEV;
  }
  if (dev < 0 || dev >= G.n) {
    snprintf(err, errlen, "cuda:%d does not exist (%d GPU%s)", dev, G.n, G.n == 1 ? "" : "s");
    return -ENODEV;
  }
  gdev *g = &G.dev[dev];
  kvf_cu_mem_prop prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = KVF_CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = KVF_CU_MEM_HANDLE_TYPE_POSIX_FD;
  prop.location.type = KVF_CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = g->d;
  prop.allocFlags.gpuDirectRDMACapable = g->info.gdr_vmm ? 1 : 0;
  size_t gran = 0;
  CUresult r = G.cu.CtxSetCurrent(g->ctx);
  if (r == KVF_CU_SUCCESS) r = G.cu.MemGetAllocationGranularity(&gran, &prop, KVF_CU_MEM_GRANULARITY_MINIMUM);
  if (r != KVF_CU_SUCCESS || gran == 0) {
    snprintf(err, errlen, "cuMemGetAllocationGranularity: %s", kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
    return -EIO;
  }
  m->size = (size + gran - 1) / gran * gran;
  m->dev = dev;
  r = G.cu.MemCreate(&m->handle, m->size, &prop, 0);
  if (r != KVF_CU_SUCCESS && prop.allocFlags.gpuDirectRDMACapable) {
    prop.allocFlags.gpuDirectRDMACapable = 0;   /* said so at start (gdr no) */
    r = G.cu.MemCreate(&m->handle, m->size, &prop, 0);
  }
  if (r != KVF_CU_SUCCESS) {
    snprintf(err, errlen, "cuMemCreate of %llu bytes on cuda:%d: %s", (unsigned long long)m->size, dev,
             kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
    return r == 2 /* OUT_OF_MEMORY */ ? -ENOMEM : -EIO;
  }
  m->gdr_flag = prop.allocFlags.gpuDirectRDMACapable != 0;
  const char *step = "cuMemAddressReserve";
  CUdeviceptr va = 0;
  r = G.cu.MemAddressReserve(&va, m->size, gran, 0, 0);
  m->dptr = va;
  if (r == KVF_CU_SUCCESS) {
    step = "cuMemMap";
    r = G.cu.MemMap(m->dptr, m->size, 0, m->handle, 0);
    if (r != KVF_CU_SUCCESS) {
      G.cu.MemAddressFree(m->dptr, m->size);
      m->dptr = 0;
    }
  } else {
    m->dptr = 0;
  }
  if (r == KVF_CU_SUCCESS) {
    kvf_cu_access_desc acc[KVF__GPU_MAX_DEV];
    size_t na = 0;
    for (int j = 0; j < G.n; j++)
      if (kvf__gpu_peer(j, dev))
        acc[na++] = (kvf_cu_access_desc){{KVF_CU_MEM_LOCATION_TYPE_DEVICE, G.dev[j].d}, KVF_CU_MEM_ACCESS_RW};
    step = "cuMemSetAccess";
    r = G.cu.MemSetAccess(m->dptr, m->size, acc, na);
  }
  if (r == KVF_CU_SUCCESS) {
    step = "cuMemExportToShareableHandle";
    r = G.cu.MemExportToShareableHandle(&m->fd, m->handle, KVF_CU_MEM_HANDLE_TYPE_POSIX_FD, 0);
  }
  if (r != KVF_CU_SUCCESS) {
    snprintf(err, errlen, "%s on cuda:%d: %s", step, dev, kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
    m->fd = -1;
    kvf__gpu_mem_free(m);
    return -EIO;
  }
  return 0;
}

void kvf__gpu_mem_free(kvf__gpu_mem *m) {
  if (!G.ready || !m->handle) return;
  G.cu.CtxSetCurrent(G.dev[m->dev].ctx);
  if (m->dptr) {
    G.cu.MemUnmap(m->dptr, m->size);
    G.cu.MemAddressFree(m->dptr, m->size);
  }
  G.cu.MemRelease(m->handle);
  if (m->fd >= 0) close(m->fd);
  m->fd = -1;
  m->handle = 0;
  m->dptr = 0;
}

int kvf__gpu_mem_dmabuf(const kvf__gpu_mem *m, int *fd, uint64_t *offset) {
  if (!G.ready || !m->dptr) return -ENODEV;
  if (!G.cu.MemGetHandleForAddressRange || !G.dev[m->dev].info.dmabuf) return -ENOTSUP;
  int f = -1;
  if (use_dev(m->dev)) return -EIO;
  CUresult r = G.cu.MemGetHandleForAddressRange(&f, m->dptr, m->size, KVF_CU_MEM_RANGE_HANDLE_DMA_BUF_FD, 0);
  if (r != KVF_CU_SUCCESS) {
    char buf[200];
    kvf__warn("cuda: dmabuf export of cuda:%d memory failed: %s", m->dev, kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
    return r == 801 /* NOT_SUPPORTED */ ? -ENOTSUP : -EIO;
  }
  *fd = f;
  *offset = 0;
  return 0;
}

int kvf__gpu_host_register(void *p, size_t len, uint64_t *dev_alias) {
  if (!G.ready) return -ENODEV;
  if (use_dev(0)) return -EIO;
  CUresult r = G.cu.MemHostRegister(p, len, KVF_CU_MEMHOSTREGISTER_PORTABLE | KVF_CU_MEMHOSTREGISTER_DEVICEMAP);
  if (r != KVF_CU_SUCCESS && r != KVF_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED) {
    char buf[200];
    kvf__warn("cuda: cuMemHostRegister of %zu bytes failed: %s", len, kvf__cu_errstr(&G.cu, r, buf, sizeof(buf)));
    return -EIO;
  }
  CUdeviceptr d = 0;
  if (G.cu.MemHostGetDevicePointer(&d, p, 0) != KVF_CU_SUCCESS) {
    G.cu.MemHostUnregister(p);
    return -EIO;
  }
  *dev_alias = d;
  return 0;
}

void kvf__gpu_host_unregister(void *p) {
  if (!G.ready || use_dev(0)) return;
  G.cu.MemHostUnregister(p);
}

void *kvf__gpu_host_alloc(size_t len, uint64_t *dev_alias) {
  if (!G.ready || use_dev(0)) return NULL;
  void *p = NULL;
  CUresult r = G.cu.MemHostAlloc(&p, len, KVF_CU_MEMHOSTALLOC_PORTABLE | KVF_CU_MEMHOSTALLOC_DEVICEMAP);
  if (r != KVF_CU_SUCCESS) {
    cu_fail("cuMemHostAlloc (pinned staging)", r);
    return NULL;
  }
  CUdeviceptr d = 0;
  if (G.cu.MemHostGetDevicePointer(&d, p, 0) != KVF_CU_SUCCESS) {
    G.cu.MemFreeHost(p);
    return NULL;
  }
  *dev_alias = d;
  return p;
}

void kvf__gpu_host_free(void *p) {
  if (!G.ready || !p || use_dev(0)) return;
  G.cu.MemFreeHost(p);
}

/* ------------------------------------------------------------ layouts */

typedef struct gtable {
  int dev;
  CUdeviceptr d;
} gtable;

int kvf__gpu_layout_upload(int dev, const uint64_t *offsets, size_t n, void **out) {
  *out = NULL;
  int rc = G.ready ? use_dev(dev) : -ENODEV;
  if (rc) return rc;
  gtable *t = calloc(1, sizeof(*t));
  if (!t) return -ENOMEM;
  t->dev = dev;
  CUresult r = G.cu.MemAlloc(&t->d, n * sizeof(*offsets));
  if (r == KVF_CU_SUCCESS) r = G.cu.MemcpyHtoD(t->d, offsets, n * sizeof(*offsets));
  if (r != KVF_CU_SUCCESS) {
    if (t->d) G.cu.MemFree(t->d);
    free(t);
    return cu_fail("uploading a layout's offsets", r);
  }
  *out = t;
  return 0;
}

void kvf__gpu_layout_free(void *g) {
  gtable *t = g;
  if (!t) return;
  if (use_dev(t->dev) == 0) G.cu.MemFree(t->d);
  free(t);
}

uint64_t kvf__gpu_layout_table(const void *g) { return g ? (uint64_t)((const gtable *)g)->d : 0; }

/* ------------------------------------------------------------ batches */

typedef struct per_dev {
  kvf_chunk *h;            /* pinned host copy of the chunk list */
  size_t n, cap;
  CUdeviceptr d;           /* device copy, d_cap chunks */
  size_t d_cap;
  CUstream own;            /* its own stream */
  CUstream st;             /* the one its launch uses: own, or the device's block stream */
  CUevent ev0, ev1;
  bool launched;
  uint64_t bytes;
} per_dev;

struct kvf__gpu_batch {
  per_dev per[KVF__GPU_MAX_DEV];
  int lead;                /* the device whose events time the launch; -1 */
  float last_ms;
};

int kvf__gpu_batch_new(kvf__gpu_batch **out) {
  if (!G.ready) return -ENODEV;
  kvf__gpu_batch *b = calloc(1, sizeof(*b));
  if (!b) return -ENOMEM;
  b->last_ms = -1;
  b->lead = -1;
  *out = b;
  return 0;
}

void kvf__gpu_batch_free(kvf__gpu_batch *b) {
  if (!b) return;
  for (int i = 0; i < G.n; i++) {
    per_dev *p = &b->per[i];
    if (!p->h && !p->own) continue;
    G.cu.CtxSetCurrent(G.dev[i].ctx);
    if (p->own) {
      G.cu.StreamSynchronize(p->own);
      G.cu.StreamDestroy(p->own);
    }
    if (p->ev0) G.cu.EventDestroy(p->ev0);
    if (p->ev1) G.cu.EventDestroy(p->ev1);
    if (p->d) G.cu.MemFree(p->d);
    if (p->h) G.cu.MemFreeHost(p->h);
  }
  free(b);
}

void kvf__gpu_batch_reset(kvf__gpu_batch *b) {
  for (int i = 0; i < G.n; i++) {
    b->per[i].n = 0;
    b->per[i].bytes = 0;
    b->per[i].launched = false;
  }
  b->lead = -1;
}

size_t kvf__gpu_batch_chunks(const kvf__gpu_batch *b) {
  size_t n = 0;
  for (int i = 0; i < G.n; i++) n += b->per[i].n;
  return n;
}

static int per_dev_setup(per_dev *p, int dev) {
  p->st = p->own;
  if (p->own) return 0;
  if (use_dev(dev)) return -EIO;
  CU_TRY("cuStreamCreate", G.cu.StreamCreate(&p->own, KVF_CU_STREAM_NON_BLOCKING));
  p->st = p->own;
  CU_TRY("cuEventCreate", G.cu.EventCreate(&p->ev0, KVF_CU_EVENT_DEFAULT));
  CU_TRY("cuEventCreate", G.cu.EventCreate(&p->ev1, KVF_CU_EVENT_DEFAULT));
  return 0;
}

static int grow_host(per_dev *p, size_t need) {
  if (need <= p->cap) return 0;
  size_t cap = p->cap ? p->cap : 1024;
  while (cap < need) cap *= 2;
  void *h = NULL;
  CU_TRY("cuMemHostAlloc (chunk list)", G.cu.MemHostAlloc(&h, cap * sizeof(kvf_chunk), KVF_CU_MEMHOSTALLOC_PORTABLE));
  if (p->n) memcpy(h, p->h, p->n * sizeof(kvf_chunk));
  if (p->h) G.cu.MemFreeHost(p->h);
  p->h = h;
  p->cap = cap;
  return 0;
}

int kvf__gpu_batch_add(kvf__gpu_batch *b, int exec, uint64_t src, uint64_t dst, uint64_t len) {
  if (exec < 0 || exec >= G.n) return -EINVAL;
  if (len == 0) return 0;
  per_dev *p = &b->per[exec];
  int rc = per_dev_setup(p, exec);
  if (rc) return rc;
  size_t need = (size_t)((len + KVF__CHUNK_BYTES - 1) / KVF__CHUNK_BYTES);
  if (p->n + need > p->cap) {
    if (use_dev(exec)) return -EIO;
    if ((rc = grow_host(p, p->n + need)) != 0) return rc;
  }
  kvf__gpu_plan_cut(src, dst, len, p->h, &p->n, p->cap);
  p->bytes += len;
  return 0;
}

/* The device copy of p's list holds at least need chunks (p->cap of them). */
static int dev_list_cap(per_dev *p, size_t need) {
  if (need <= p->d_cap) return 0;
  if (p->d) {
    /* its own stream: a block copy on the shared stream that used the
     * list was reaped before its copier came back */
    G.cu.StreamSynchronize(p->own);
    G.cu.MemFree(p->d);
    p->d = 0;
    p->d_cap = 0;
  }
  size_t cap = p->cap > need ? p->cap : need;
  CU_TRY("cuMemAlloc (chunk list)", G.cu.MemAlloc(&p->d, cap * sizeof(kvf_chunk)));
  p->d_cap = cap;
  return 0;
}

static int launch_dev(per_dev *p, int dev) {
  gdev *g = &G.dev[dev];
  if (use_dev(dev)) return -EIO;
  if (!G.kernel) {
    /* No kernel in this build: one cuMemcpyAsync per chunk. */
    for (size_t i = 0; i < p->n; i++)
      CU_TRY("cuMemcpyAsync", G.cu.MemcpyAsync(p->h[i].dst, p->h[i].src, p->h[i].len, p->st));
    atomic_fetch_add(&G.bytes_fallback, p->bytes);
    p->launched = true;
    return 0;
  }
  int rc = dev_list_cap(p, p->n);
  if (rc) return rc;
  CU_TRY("cuMemcpyHtoDAsync (chunk list)", G.cu.MemcpyHtoDAsync(p->d, p->h, p->n * sizeof(kvf_chunk), p->st));
  unsigned n = (unsigned)p->n;
  void *args[] = {&p->d, &n};
  unsigned grid = kvf__gpu_plan_grid(p->n, g->info.sms, G.ctas_per_sm);
  CU_TRY("cuLaunchKernel (copy)", G.cu.LaunchKernel(g->fn, grid, 1, 1, G.threads, 1, 1, 0, p->st, args, NULL));
  atomic_fetch_add(&G.launches, 1);
  atomic_fetch_add(&G.chunks, p->n);
  atomic_fetch_add(&G.bytes_kernel, p->bytes);
  p->launched = true;
  return 0;
}

/* With work on several devices, the first (the lead) records the start
 * event, the others start after it, and the lead's end event comes after
 * every device's end: the batch's time is the span of all its kernels, not
 * the longest of them (their launches are not simultaneous). */
int kvf__gpu_batch_launch(kvf__gpu_batch *b) {
  int lead = -1;
  for (int i = 0; i < G.n; i++) {
    per_dev *p = &b->per[i];
    if (p->n == 0 || p->launched) continue;
    if (use_dev(i)) return -EIO;
    if (lead < 0) {
      lead = i;
      CU_TRY("cuEventRecord", G.cu.EventRecord(p->ev0, p->st));
    } else {
      CU_TRY("cuStreamWaitEvent", G.cu.StreamWaitEvent(p->st, b->per[lead].ev0, 0));
    }
    int rc = launch_dev(p, i);
    if (rc) return rc;
  }
  if (lead < 0) return 0;
  for (int i = lead + 1; i < G.n; i++) {
    per_dev *p = &b->per[i];
    if (!p->launched || p->n == 0) continue;
    if (use_dev(i)) return -EIO;
    CU_TRY("cuEventRecord", G.cu.EventRecord(p->ev1, p->st));
    if (use_dev(lead)) return -EIO;
    CU_TRY("cuStreamWaitEvent", G.cu.StreamWaitEvent(b->per[lead].st, p->ev1, 0));
  }
  if (use_dev(lead)) return -EIO;
  CU_TRY("cuEventRecord", G.cu.EventRecord(b->per[lead].ev1, b->per[lead].st));
  b->lead = lead;
  return 0;
}

/* Waits for b's launches. On a shared block stream, for b's end event
 * only (later copies queued behind it are not b's), unless whole_stream:
 * after a failed launch, whatever of b did start is behind that event's
 * last recording, anywhere on the stream. */
static int batch_wait(kvf__gpu_batch *b, bool whole_stream) {
  int rc = 0;
  b->last_ms = -1;
  for (int i = 0; i < G.n; i++) {
    per_dev *p = &b->per[i];
    if (!p->launched) continue;
    if (use_dev(i)) return -EIO;
    CUresult r = p->st == p->own || whole_stream ? G.cu.StreamSynchronize(p->st) : G.cu.EventSynchronize(p->ev1);
    if (r != KVF_CU_SUCCESS) rc = cu_fail("copy (cuStreamSynchronize)", r);
    p->launched = false;
  }
  if (rc == 0 && b->lead >= 0) {
    float ms = -1;
    if (use_dev(b->lead) == 0 && G.cu.EventElapsedTime(&ms, b->per[b->lead].ev0, b->per[b->lead].ev1) == KVF_CU_SUCCESS)
      b->last_ms = ms;
  }
  b->lead = -1;
  return rc;
}

int kvf__gpu_batch_wait(kvf__gpu_batch *b) { return batch_wait(b, false); }

float kvf__gpu_batch_ms(kvf__gpu_batch *b) { return b->last_ms; }

/* ------------------------------------------------------------ copy_all */

/* What copy_all needs per call, kept on a free list: creating streams and
 * pinned buffers costs milliseconds. */
typedef struct copier {
  struct copier *next;
  kvf__gpu_batch *main;
  kvf__gpu_batch *gather[2], *scatter[2];
  uint8_t *stage;          /* STAGE_BYTES pinned, mapped */
  uint64_t stage_dev;
} copier;

static copier *copier_get(void) {
  pthread_mutex_lock(&G.mu);
  copier *c = G.free_copiers;
  if (c) G.free_copiers = c->next;
  pthread_mutex_unlock(&G.mu);
  if (c) return c;
  c = calloc(1, sizeof(*c));
  if (!c || kvf__gpu_batch_new(&c->main) != 0) {
    free(c);
    return NULL;
  }
  return c;
}

static void copier_put(copier *c) {
  pthread_mutex_lock(&G.mu);
  c->next = G.free_copiers;
  G.free_copiers = c;
  pthread_mutex_unlock(&G.mu);
}

static void copier_free(copier *c) {
  kvf__gpu_batch_free(c->main);
  for (int i = 0; i < 2; i++) {
    kvf__gpu_batch_free(c->gather[i]);
    kvf__gpu_batch_free(c->scatter[i]);
  }
  kvf__gpu_host_free(c->stage);
  free(c);
}

static int staging_setup(copier *c) {
  if (c->stage) return 0;
  for (int i = 0; i < 2; i++)
    if ((!c->gather[i] && kvf__gpu_batch_new(&c->gather[i])) || (!c->scatter[i] && kvf__gpu_batch_new(&c->scatter[i])))
      return -ENOMEM;
  c->stage = kvf__gpu_host_alloc(STAGE_BYTES, &c->stage_dev);
  return c->stage ? 0 : -ENOMEM;
}

/* Gathers half k of the staging buffer, then starts its scatter; waits
 * for the scatter that last used the other half, which is filled next. */
static int stage_flush(copier *c, int *k, uint64_t *used, bool *busy) {
  int rc = kvf__gpu_batch_launch(c->gather[*k]);
  if (rc == 0) rc = kvf__gpu_batch_wait(c->gather[*k]);
  if (rc == 0) rc = kvf__gpu_batch_launch(c->scatter[*k]);
  if (rc) return rc;
  atomic_fetch_add(&G.bytes_staged, *used);
  busy[*k] = true;
  *k ^= 1;
  *used = 0;
  if (busy[*k]) {
    busy[*k] = false;
    rc = kvf__gpu_batch_wait(c->scatter[*k]);
  }
  kvf__gpu_batch_reset(c->gather[*k]);
  kvf__gpu_batch_reset(c->scatter[*k]);
  return rc;
}

/* Device -> host staging -> device, for devices without peer access. The
 * two halves of the staging buffer alternate: the scatter out of one
 * overlaps the gather into the other. */
static int copy_staged(copier *c, const kvf__gpu_copy *v, size_t n, const bool *staged) {
  int rc = staging_setup(c);
  if (rc) return rc;
  const uint64_t half = STAGE_BYTES / 2;
  int k = 0;
  uint64_t used = 0;
  bool busy[2] = {false, false};
  for (int h = 0; h < 2; h++) {
    kvf__gpu_batch_reset(c->gather[h]);
    kvf__gpu_batch_reset(c->scatter[h]);
  }
  for (size_t i = 0; i < n && rc == 0; i++) {
    if (!staged[i]) continue;
    for (uint64_t off = 0; off < v[i].len && rc == 0;) {
      uint64_t take = v[i].len - off < half - used ? v[i].len - off : half - used;
      uint64_t slot = c->stage_dev + (uint64_t)k * half + used;
      rc = kvf__gpu_batch_add(c->gather[k], v[i].src.dev, v[i].src.addr + off, slot, take);
      if (rc == 0) rc = kvf__gpu_batch_add(c->scatter[k], v[i].dst.dev, slot, v[i].dst.addr + off, take);
      used += take;
      off += take;
      if (rc == 0 && used == half) rc = stage_flush(c, &k, &used, busy);
    }
  }
  if (rc == 0 && used) rc = stage_flush(c, &k, &used, busy);
  for (int h = 0; h < 2; h++)
    if (busy[h]) {
      int r2 = kvf__gpu_batch_wait(c->scatter[h]);
      if (rc == 0) rc = r2;
    }
  return rc;
}

static const char *route_of(const kvf__gpu_copy *c) {
  if (c->src.dev < 0 && c->dst.dev < 0) return "host";
  if (c->src.dev < 0) return "h2d";
  if (c->dst.dev < 0) return "d2h";
  return kvf__gpu_link(c->src.dev, c->dst.dev);
}

/* Host memory CUDA does not know: a synchronous cuMemcpy from/to pageable
 * memory, correct but slow (and said so once). */
static int copy_unmapped(const kvf__gpu_copy *c) {
  static atomic_bool warned;
  if (!atomic_exchange(&warned, true))
    kvf__warn("cuda: a copy touches host memory not registered with CUDA; using pageable cuMemcpy (slow)");
  int dev = c->src.dev >= 0 ? c->src.dev : c->dst.dev;
  if (use_dev(dev)) return -EIO;
  atomic_fetch_add(&G.bytes_fallback, c->len);
  if (c->src.dev < 0) CU_TRY("cuMemcpyHtoD", G.cu.MemcpyHtoD(c->dst.addr, c->src.host, c->len));
  else CU_TRY("cuMemcpyDtoH", G.cu.MemcpyDtoH(c->dst.host, c->src.addr, c->len));
  return 0;
}

static _Thread_local float last_kernel_ms = -1;
float kvf__gpu_last_kernel_ms(void) { return last_kernel_ms; }

static bool same_class(const kvf__gpu_copy *a, const kvf__gpu_copy *b) {
  return a->src.dev == b->src.dev && a->dst.dev == b->dst.dev && a->src.mapped == b->src.mapped &&
         a->dst.mapped == b->dst.mapped;
}

/* The common case, fast: every copy between the same two places: chunks go
 * straight into the batch's list of device exec, or, split between two
 * GPUs, alternately into exec's and exec2's (exec2 < 0: no split). */
static int add_uniform(copier *c, const kvf__gpu_copy *v, size_t n, int exec, int exec2) {
  size_t need = 0;
  for (size_t i = 0; i < n; i++) need += (size_t)((v[i].len + KVF__CHUNK_BYTES - 1) / KVF__CHUNK_BYTES);
  int devs[2] = {exec, exec2 >= 0 ? exec2 : exec};
  kvf_chunk *h[2];
  for (int k = 0; k < 2; k++) {
    per_dev *p = &c->main->per[devs[k]];
    int rc = per_dev_setup(p, devs[k]);
    if (rc == 0 && p->n + need > p->cap) rc = use_dev(devs[k]) ? -EIO : grow_host(p, p->n + need);
    if (rc) return rc;
    h[k] = p->h + p->n;
  }
  uint64_t bytes[2] = {0, 0};
  kvf_chunk *start[2] = {h[0], h[1]};
  for (size_t i = 0; i < n; i++) {
    int k = exec2 >= 0 && !kvf__gpu_plan_push(i, G.split_pct) ? 1 : 0;
    uint64_t len = v[i].len, s = v[i].src.addr, d = v[i].dst.addr;
    bytes[k] += len;
    if (len <= KVF__CHUNK_BYTES) {
      *h[k]++ = (kvf_chunk){s, d, (unsigned)len, 0};
      continue;
    }
    for (uint64_t off = 0; off < len; off += KVF__CHUNK_BYTES)
      *h[k]++ = (kvf_chunk){s + off, d + off, (unsigned)(len - off < KVF__CHUNK_BYTES ? len - off : KVF__CHUNK_BYTES), 0};
  }
  for (int k = 0; k < (exec2 >= 0 ? 2 : 1); k++) {
    per_dev *p = &c->main->per[devs[k]];
    p->n += (size_t)(h[k] - start[k]);
    p->bytes += bytes[k];
  }
  return 0;
}

/* Whether one launch moves all of v: every copy between the same two
 * places, a GPU reaching both (exec; with exec2 >= 0 the copies are split
 * between the source GPU, pushing, and the destination GPU, pulling). */
static bool uniform_direct(const kvf__gpu_copy *v, size_t n, int *exec, int *exec2) {
  if (n == 0 || !G.ready || (v[0].src.dev < 0 && v[0].dst.dev < 0)) return false;
  for (size_t i = 1; i < n; i++)
    if (!same_class(&v[i], &v[0])) return false;
  *exec = kvf__gpu_plan_exec(&v[0].src, &v[0].dst, kvf__gpu_peer, G.pull);
  *exec2 = -1;
  if (G.split && *exec >= 0 && v[0].src.dev >= 0 && v[0].dst.dev >= 0 && v[0].src.dev != v[0].dst.dev &&
      kvf__gpu_peer(v[0].dst.dev, v[0].src.dev) && kvf__gpu_peer(v[0].src.dev, v[0].dst.dev)) {
    *exec = v[0].src.dev;
    *exec2 = v[0].dst.dev;
  }
  return *exec >= 0;
}

/* Waits for what a copier launched and gives it back; returns rc, or the
 * copies' own failure, and in *ms the kernels' span. */
static int finish_copier(copier *c, int rc, float *ms) {
  int r2 = batch_wait(c->main, rc != 0);
  if (rc == 0) rc = r2;
  *ms = kvf__gpu_batch_ms(c->main);
  kvf__gpu_batch_reset(c->main);
  if (rc == 0) copier_put(c);
  else copier_free(c); /* after an error its streams may be poisoned */
  return rc;
}

/* Builds and launches a uniform batch on a copier of its own. */
static int launch_uniform(const kvf__gpu_copy *v, size_t n, int exec, int exec2, copier **out) {
  copier *c = copier_get();
  if (!c) return -ENOMEM;
  int rc = add_uniform(c, v, n, exec, exec2);
  if (rc == 0) rc = kvf__gpu_batch_launch(c->main);
  if (rc) {
    float ms;
    return finish_copier(c, rc, &ms); /* waits for whatever did start */
  }
  *out = c;
  return 0;
}

int kvf__gpu_copy_all(const kvf__gpu_copy *v, size_t n, const char **route) {
  last_kernel_ms = -1;
  *route = n ? route_of(&v[0]) : "host";
  int exec, exec2;
  if (uniform_direct(v, n, &exec, &exec2)) {
    copier *c;
    int rc = launch_uniform(v, n, exec, exec2, &c);
    return rc ? rc : finish_copier(c, 0, &last_kernel_ms);
  }
  for (size_t i = 1; i < n; i++)
    if (!same_class(&v[i], &v[i - 1]) && strcmp(route_of(&v[i]), *route) != 0) *route = "mixed";
  if (!G.ready) {
    for (size_t i = 0; i < n; i++)
      if (v[i].src.dev >= 0 || v[i].dst.dev >= 0) return -ENODEV;
  }
  copier *c = NULL;
  bool *staged = NULL;
  size_t n_staged = 0;
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    const kvf__gpu_copy *x = &v[i];
    if (x->src.dev < 0 && x->dst.dev < 0) {
      memcpy(x->dst.host, x->src.host, x->len);
      continue;
    }
    if ((x->src.dev < 0 && !x->src.mapped) || (x->dst.dev < 0 && !x->dst.mapped)) {
      rc = copy_unmapped(x);
      continue;
    }
    if (!c && !(c = copier_get())) {
      rc = -ENOMEM;
      break;
    }
    int e = kvf__gpu_plan_exec(&x->src, &x->dst, kvf__gpu_peer, G.split ? !kvf__gpu_plan_push(i, G.split_pct) : G.pull);
    if (e >= 0) {
      rc = kvf__gpu_batch_add(c->main, e, x->src.addr, x->dst.addr, x->len);
      continue;
    }
    if (!staged && !(staged = calloc(n, sizeof(bool)))) {
      rc = -ENOMEM;
      break;
    }
    staged[i] = true;
    n_staged++;
  }
  if (c) {
    if (rc == 0) rc = kvf__gpu_batch_launch(c->main);
    if (rc == 0 && n_staged) rc = copy_staged(c, v, n, staged);
    rc = finish_copier(c, rc, &last_kernel_ms);
  }
  free(staged);
  return rc;
}

/* ------------------------------------------------------------ asynchronous copies */

/* Launched batches wait here, in launch order, for the reaper thread: it
 * blocks on each one's completion so that the thread that launched it
 * (the daemon's loop) never does. */
typedef struct job {
  struct job *next;
  bool blocks;             /* a block copy: its time counts in block_kernel_ns */
  copier *c;
  kvf__gpu_done_fn done;
  void *arg;
} job;

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t thread;
  bool running, stop;
  job *head, **tail;
} R = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* Waits for the next job: polls while the spin window is open (spin.h:
 * a launch opened it, or a job just finished), else sleeps. R.mu held. */
static void reaper_wait(uint64_t last_done) {
  while (!R.head && !R.stop) {
    if (!kvf__spin_open(KVF__SPIN_GPU, last_done)) {
      kvf__spin_cond_wait(&R.cv, &R.mu, KVF__SPIN_GPU, last_done);
      continue;
    }
    pthread_mutex_unlock(&R.mu);
    kvf__spin_relax(KVF__SPIN_GPU);
    pthread_mutex_lock(&R.mu);
  }
}

static void *reaper_main(void *unused) {
  uint64_t last_done = 0;
  pthread_mutex_lock(&R.mu);
  for (;;) {
    reaper_wait(last_done);
    job *j = R.head;
    if (!j) break;
    R.head = j->next;
    if (!R.head) R.tail = &R.head;
    pthread_mutex_unlock(&R.mu);
    float ms = -1;
    int rc = finish_copier(j->c, 0, &ms);
    if (j->blocks && rc == 0 && ms > 0) atomic_fetch_add(&G.block_kernel_ns, (uint64_t)((double)ms * 1e6));
    j->done(j->arg, rc, ms);
    free(j);
    last_done = kvf__now_ns();
    pthread_mutex_lock(&R.mu);
  }
  pthread_mutex_unlock(&R.mu);
  return NULL;
}

/* Starts the reaper once, with every signal blocked (the loop takes them). */
static int reaper_start(void) {
  if (R.running) return 0;
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  R.tail = &R.head;
  R.stop = false;
  int rc = pthread_create(&R.thread, NULL, reaper_main, NULL);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc) return -rc;
  R.running = true;
  return 0;
}

/* A job for the reaper, allocated before anything launches (so that a
 * launched copy always finds its way back), with the reaper running. */
static job *job_new(kvf__gpu_done_fn done, void *arg) {
  job *j = calloc(1, sizeof(*j));
  if (!j) return NULL;
  pthread_mutex_lock(&R.mu);
  int rc = reaper_start();
  pthread_mutex_unlock(&R.mu);
  if (rc) {
    free(j);
    return NULL;
  }
  j->done = done;
  j->arg = arg;
  return j;
}

static void job_queue(job *j) {
  pthread_mutex_lock(&R.mu);
  *R.tail = j;
  R.tail = &j->next;
  pthread_cond_signal(&R.cv);
  pthread_mutex_unlock(&R.mu);
}

int kvf__gpu_copy_start(const kvf__gpu_copy *v, size_t n, kvf__gpu_done_fn done, void *arg) {
  int exec, exec2;
  if (!uniform_direct(v, n, &exec, &exec2)) return -EAGAIN;
  job *j = job_new(done, arg);
  if (!j) return -ENOMEM;
  int rc = launch_uniform(v, n, exec, exec2, &j->c);
  if (rc) {
    free(j);
    return rc;
  }
  job_queue(j);
  return 0;
}

/* ------------------------------------------------------------ block copies */

bool kvf__gpu_blocks_kernel(void) { return G.ready && G.blocks; }

/* Puts j's ids where a launch on p's device reads them: in the launch's
 * parameters when they fit, else through p's pinned list into its device
 * list, one copy on p's stream ahead of the kernel. */
static int blocks_ids(per_dev *p, const kvf__gpu_blocks *j, unsigned *inline_ids, unsigned long long *ids) {
  size_t ns = j->xf ? j->xf->ns : j->n, nd = j->xf ? j->xf->nd : j->n;
  size_t sb = ns * sizeof(uint32_t), db = nd * sizeof(uint32_t);
  if (ns + nd <= KVF__BLOCKS_INLINE_IDS) {
    memcpy(inline_ids, j->src.ids, sb);
    memcpy(inline_ids + ns, j->dst.ids, db);
    *ids = 0;
    return 0;
  }
  size_t need = (sb + db + sizeof(kvf_chunk) - 1) / sizeof(kvf_chunk);
  p->n = 0;
  int rc = grow_host(p, need);
  if (rc == 0) rc = dev_list_cap(p, need);
  if (rc) return rc;
  memcpy(p->h, j->src.ids, sb);
  memcpy((uint8_t *)p->h + sb, j->dst.ids, db);
  CU_TRY("cuMemcpyHtoDAsync (block ids)", G.cu.MemcpyHtoDAsync(p->d, p->h, sb + db, p->st));
  *ids = p->d;
  return 0;
}

/* The pools both block kernels read. */
static kvf_blocks_ends blocks_ends(const kvf__gpu_blocks *j) {
  return (kvf_blocks_ends){.src_base = j->src.base, .dst_base = j->dst.base, .src_table = j->src.table,
                           .dst_table = j->dst.table, .src_stride = j->src.stride, .dst_stride = j->dst.stride};
}

/* One launch of fn on p's stream over pieces [p0, p1) of `bytes` each, in
 * groups of `group` threads; args: the kernel's one argument. */
static int pieces_launch(per_dev *p, int dev, CUfunction fn, const char *what, void *args, unsigned group,
                         uint64_t p0, uint64_t p1, uint64_t bytes) {
  unsigned per_cta = G.threads / group;
  unsigned grid = kvf__gpu_plan_grid((size_t)((p1 - p0 + per_cta - 1) / per_cta), G.dev[dev].info.sms, G.ctas_per_sm);
  void *argv[] = {args};
  CU_TRY(what, G.cu.LaunchKernel(fn, grid, 1, 1, G.threads, 1, 1, 0, p->st, argv, NULL));
  atomic_fetch_add(&G.launches, 1);
  atomic_fetch_add(&G.bytes_kernel, (p1 - p0) * bytes);
  return 0;
}

/* Whether every piece of j goes by the kernel's walk (copy_args.h,
 * kvf_xwalk): 16-byte words throughout (both pools' bases, regions and
 * strides and the unit 16-byte aligned) and groups a whole number of units
 * wide. Else the kernel goes word by word. */
static bool xblocks_walks(const kvf__gpu_blocks *j, const kvf_xblocks_args *a) {
  uint64_t bits = a->e.src_base | a->e.dst_base | a->e.src_stride | a->e.dst_stride | a->unit;
  for (size_t r = 0; r < a->n_regions; r++) bits |= j->src.offsets[r] | j->dst.offsets[r];
  kvf_xwalk w;
  return (bits & 15) == 0 && kvf_xwalk_init(a, 16, a->group, 0, &w);
}

/* Pieces (region x chunk) [p0, p1) of transform j by the transform kernel. */
static int xblocks_kernel(per_dev *p, int dev, const kvf__gpu_blocks *j, uint64_t p0, uint64_t p1) {
  static _Thread_local kvf_xblocks_args a; /* 3.5 KiB: off the stack */
  memset(&a, 0, offsetof(kvf_xblocks_args, inline_ids));
  int rc = blocks_ids(p, j, a.inline_ids, &a.ids);
  if (rc || p1 == p0) return rc;
  a.e = blocks_ends(j);
  kvf__xform_kargs(j->xf, &a);
  a.n_regions = j->n_layers * j->n_kv;
  a.piece0 = (unsigned)p0;
  a.piece1 = (unsigned)p1;
  a.group = kvf_blocks_group(((uint64_t)a.g * a.nh * a.unit + 15) / 16, G.threads);
  a.walk = xblocks_walks(j, &a);
  return pieces_launch(p, dev, G.dev[dev].xfn, "cuLaunchKernel (xblocks)", &a, a.group, p0, p1,
                       (uint64_t)a.g * a.nh * a.unit);
}

/* Pieces [p0, p1) of j by the block kernel on dev. */
static int blocks_kernel(per_dev *p, int dev, const kvf__gpu_blocks *j, uint64_t p0, uint64_t p1) {
  if (j->xf) return xblocks_kernel(p, dev, j, p0, p1);
  static _Thread_local kvf_blocks_args a; /* 3.5 KiB: off the stack */
  memset(&a, 0, offsetof(kvf_blocks_args, inline_ids));
  int rc = blocks_ids(p, j, a.inline_ids, &a.ids);
  if (rc || p1 == p0) return rc;
  a.e = blocks_ends(j);
  a.block_bytes = (unsigned)j->block_bytes;
  a.n = (unsigned)j->n;
  a.n_regions = j->n_layers * j->n_kv;
  a.piece0 = (unsigned)p0;
  a.piece1 = (unsigned)p1;
  a.group = kvf_blocks_group((j->block_bytes + 15) / 16, G.threads);
  return pieces_launch(p, dev, G.dev[dev].bfn, "cuLaunchKernel (blocks)", &a, a.group, p0, p1, j->block_bytes);
}

/* Without the block kernel: the layouts walked into coalesced runs
 * (kvf__blocks_pair), one cuMemcpyAsync each. */
static int blocks_memcpy(per_dev *p, const kvf__gpu_blocks *j) {
  const kvf__lview s = {.n_kv = j->n_kv, .n_blocks = UINT32_MAX, .n_layers = j->n_layers,
                        .block_bytes = j->block_bytes, .block_stride = j->src.stride, .offsets = j->src.offsets};
  kvf__lview d = s;
  d.block_stride = j->dst.stride;
  d.offsets = j->dst.offsets;
  kvf__runs runs = {0};
  int rc = j->xf ? kvf__xform_runs(j->xf, &s, j->src.ids, &d, j->dst.ids, 0, j->n_layers, &runs)
                 : kvf__blocks_pair(&s, j->src.ids, &d, j->dst.ids, j->n, 0, j->n_layers, &runs);
  for (size_t i = 0; i < runs.n && rc == 0; i++) {
    const kvf__run *r = &runs.v[i];
    CUresult cr = G.cu.MemcpyAsync(j->dst.base + r->dst_off, j->src.base + r->src_off, r->len, p->st);
    if (cr != KVF_CU_SUCCESS) rc = cu_fail("cuMemcpyAsync (blocks, no kernel)", cr);
  }
  if (rc == 0) atomic_fetch_add(&G.bytes_fallback, runs.bytes);
  kvf__runs_free(&runs);
  return rc;
}

/* Whole blocks: blocks x regions; transforms: chunks x regions. */
static uint64_t blocks_pieces(const kvf__gpu_blocks *j) {
  uint64_t regions = (uint64_t)j->n_layers * j->n_kv;
  if (!j->xf) return regions * j->n;
  uint32_t g = j->xf->s.tpb < j->xf->d.tpb ? j->xf->s.tpb : j->xf->d.tpb;
  return regions * (j->xf->tokens / g);
}

/* Block copies on a device run in order on one stream (created on first
 * use, the device current): each saturates the GPU's memory alone, so
 * requests in flight at once finish one after the other, the first after
 * its own copy's time, instead of all at the end of the lot as on a
 * stream each, sharing the GPU (and its caches) among them. */
static int block_stream(int dev, CUstream *out) {
  int rc = 0;
  pthread_mutex_lock(&G.mu);
  if (!G.dev[dev].bst) {
    CUresult r = G.cu.StreamCreate(&G.dev[dev].bst, KVF_CU_STREAM_NON_BLOCKING);
    if (r != KVF_CU_SUCCESS) rc = cu_fail("cuStreamCreate (block copies)", r);
  }
  if (rc == 0) *out = G.dev[dev].bst;
  pthread_mutex_unlock(&G.mu);
  return rc;
}

/* Launches j on devs[0..nd) (pieces split evenly), timed by the first
 * one's events over all of them, as kvf__gpu_batch_launch does. */
static int blocks_launch(copier *c, const kvf__gpu_blocks *j, const int *devs, int nd) {
  kvf__gpu_batch *b = c->main;
  const uint64_t pieces = blocks_pieces(j);
  for (int k = 0; k < nd; k++) {
    int rc = per_dev_setup(&b->per[devs[k]], devs[k]);
    if (rc == 0 && !G.block_own_streams) rc = use_dev(devs[k]) ? -EIO : block_stream(devs[k], &b->per[devs[k]].st);
    if (rc) return rc;
    b->per[devs[k]].launched = true; /* from here on, waited for */
  }
  per_dev *lead = &b->per[devs[0]];
  if (use_dev(devs[0])) return -EIO;
  CU_TRY("cuEventRecord", G.cu.EventRecord(lead->ev0, lead->st));
  b->lead = devs[0];
  for (int k = 0; k < nd; k++) {
    per_dev *p = &b->per[devs[k]];
    if (use_dev(devs[k])) return -EIO;
    if (k > 0) CU_TRY("cuStreamWaitEvent", G.cu.StreamWaitEvent(p->st, lead->ev0, 0));
    int rc = G.blocks ? blocks_kernel(p, devs[k], j, pieces * k / nd, pieces * (k + 1) / nd) : blocks_memcpy(p, j);
    if (rc) return rc;
    if (k > 0) {
      CU_TRY("cuEventRecord", G.cu.EventRecord(p->ev1, p->st));
      if (use_dev(devs[0])) return -EIO;
      CU_TRY("cuStreamWaitEvent", G.cu.StreamWaitEvent(lead->st, p->ev1, 0));
    }
  }
  if (use_dev(devs[0])) return -EIO;
  CU_TRY("cuEventRecord", G.cu.EventRecord(lead->ev1, lead->st));
  atomic_fetch_add(&G.block_launches, 1);
  atomic_fetch_add(&G.block_pieces, pieces);
  atomic_fetch_add(&G.block_bytes, j->xf ? kvf__xplan_bytes(j->xf, j->n_layers, j->n_kv) : pieces * j->block_bytes);
  return 0;
}

/* The GPUs that run j: the one reaching both pools, or (split copies
 * between two GPUs with peer access both ways) both, half each. */
static int blocks_devs(const kvf__gpu_blocks *j, int *devs) {
  kvf__gpu_end s = {.dev = j->src.dev}, d = {.dev = j->dst.dev};
  if (s.dev < 0 || d.dev < 0) return -EAGAIN; /* host pools: runs */
  devs[0] = kvf__gpu_plan_exec(&s, &d, kvf__gpu_peer, G.pull);
  if (devs[0] < 0) return -EAGAIN;
  if (G.blocks && G.split && s.dev != d.dev && kvf__gpu_peer(s.dev, d.dev) && kvf__gpu_peer(d.dev, s.dev)) {
    devs[0] = s.dev;
    devs[1] = d.dev;
    return 2;
  }
  return 1;
}

/* Whether the transform kernel takes plan j->xf over j's regions: its
 * counts and a block's bytes on either side fit its 32-bit arguments. */
static bool xf_fits(const kvf__gpu_blocks *j) {
  const struct kvf__xplan *x = j->xf;
  uint64_t regions = (uint64_t)j->n_layers * j->n_kv;
  return x->unit <= UINT32_MAX && x->ns + x->nd <= UINT32_MAX && regions != 0 && blocks_pieces(j) <= UINT32_MAX &&
         (uint64_t)x->s.tpb * x->s.heads * x->unit <= UINT32_MAX &&
         (uint64_t)x->d.tpb * x->d.heads * x->unit <= UINT32_MAX;
}

/* What kvf__gpu_blocks_start refuses before anything runs; the GPUs that
 * run j in devs. */
static int blocks_take(const kvf__gpu_blocks *j, int *devs) {
  if (!G.ready) return -ENODEV;
  uint64_t regions = (uint64_t)j->n_layers * j->n_kv;
  if (j->xf && (G.blocks && !G.xblocks)) return -EAGAIN; /* an image without the transform kernel: runs */
  if (j->xf && !xf_fits(j)) return -EINVAL;
  if (!j->xf && (j->block_bytes == 0 || j->block_bytes > UINT32_MAX || regions == 0 || j->n > UINT32_MAX ||
                 regions * j->n > UINT32_MAX))
    return -EINVAL;
  return blocks_devs(j, devs);
}

int kvf__gpu_blocks_check(const kvf__gpu_blocks *j) {
  int devs[2];
  int nd = blocks_take(j, devs);
  return nd < 0 ? nd : 0;
}

/* j launched on devs[0..nd) on a copier of its own, and queued for the
 * reaper (done follows once); an error: nothing queued, no callback. */
static int blocks_run(const kvf__gpu_blocks *j, const int *devs, int nd, kvf__gpu_done_fn done, void *arg) {
  job *jb = job_new(done, arg);
  if (!jb) return -ENOMEM;
  copier *c = copier_get();
  int rc = c ? blocks_launch(c, j, devs, nd) : -ENOMEM;
  if (rc) {
    float ms;
    if (c) finish_copier(c, rc, &ms); /* waits for whatever did start */
    free(jb);
    return rc;
  }
  jb->c = c;
  jb->blocks = true;
  job_queue(jb);
  return 0;
}

int kvf__gpu_blocks_start(const kvf__gpu_blocks *j, kvf__gpu_done_fn done, void *arg) {
  int devs[2];
  int nd = blocks_take(j, devs);
  return nd < 0 ? nd : blocks_run(j, devs, nd, done, arg);
}

int kvf__gpu_xblocks_from_host(const kvf__gpu_blocks *j, kvf__gpu_done_fn done, void *arg) {
  if (!G.ready) return -ENODEV;
  if (!G.blocks || !G.xblocks) return -EAGAIN; /* cuMemcpy per run would cross the bus per 256 bytes */
  if (!j->xf || j->src.dev >= 0 || j->dst.dev < 0 || j->dst.dev >= G.n || !j->src.table || !j->dst.table ||
      !xf_fits(j))
    return -EINVAL;
  return blocks_run(j, &j->dst.dev, 1, done, arg); /* the pool's GPU reads the mapped memory */
}

static void reaper_stop(void) {
  pthread_mutex_lock(&R.mu);
  bool was = R.running;
  R.stop = true;
  R.running = false;
  pthread_cond_broadcast(&R.cv);
  pthread_mutex_unlock(&R.mu);
  if (was) pthread_join(R.thread, NULL); /* it finishes what is queued first */
}

void kvf__gpu_stats_get(kvf__gpu_stats *s) {
  s->launches = atomic_load(&G.launches);
  s->chunks = atomic_load(&G.chunks);
  s->bytes_kernel = atomic_load(&G.bytes_kernel);
  s->bytes_staged = atomic_load(&G.bytes_staged);
  s->bytes_fallback = atomic_load(&G.bytes_fallback);
  s->errors = atomic_load(&G.errors);
  s->block_launches = atomic_load(&G.block_launches);
  s->block_pieces = atomic_load(&G.block_pieces);
  s->block_bytes = atomic_load(&G.block_bytes);
  s->block_kernel_ns = atomic_load(&G.block_kernel_ns);
}

void kvf__gpu_shutdown(void) {
  reaper_stop();
  pthread_mutex_lock(&G.mu);
  copier *c = G.free_copiers;
  G.free_copiers = NULL;
  pthread_mutex_unlock(&G.mu);
  while (c) {
    copier *next = c->next;
    copier_free(c);
    c = next;
  }
  for (int i = 0; i < G.n; i++) {
    if (!G.dev[i].bst) continue;
    G.cu.CtxSetCurrent(G.dev[i].ctx);
    G.cu.StreamSynchronize(G.dev[i].bst);
    G.cu.StreamDestroy(G.dev[i].bst);
    G.dev[i].bst = NULL;
  }
}
