/* gpu_copy.c - the daemon's CUDA module on a real GPU, without daemons.
 *
 *   gpu_copy test    every route kvf__gpu_copy_all takes (same GPU, peer
 *                    GPU, staged between GPUs, registered and unregistered
 *                    host memory), odd geometries, every byte checked and
 *                    nothing outside the destination ranges touched
 *   gpu_copy bench [N BLOCK REPS REFS]
 *                    the copy kernel alone on N scattered blocks GPU0 ->
 *                    GPU1 (default 16384 x 32 KiB = 512 MiB), and with REFS
 *                    (default 1) cuMemcpyPeerAsync of the same bytes
 *                    contiguous, one cuMemcpyAsync per block, and pinned H2D
 *                    / D2H; one JSON line per figure
 *   gpu_copy sweep [N BLOCK REPS]
 *                    the same scattered blocks with every kernel entry point,
 *                    launch shape and push/pull split in one process, and
 *                    the copy engines on the same blocks (one
 *                    cuMemcpyBatchAsync); each run verified
 *   gpu_copy kvlayout [T M BLOCK NB REPS]
 *                    a paged KV cache in one pool per GPU (T segments of NB
 *                    blocks); M scattered block pairs moved by the kernel
 *                    (T * M descriptors) and by the copy engines as one 2D
 *                    copy per pair (rows of BLOCK at a pitch of NB blocks)
 *   gpu_copy pinned [BYTES REPS]
 *                    pinned H2D and D2H on GPU 0 alone (one-GPU machines)
 *
 * Exit 0 when everything passed. Environment as the daemon's
 * (KVF_CUDA_KERNEL, KVF_CUDA_PULL, KVF_CUDA_NO_PEER, KVF_CUDA_THREADS,
 * KVF_CUDA_CTAS_PER_SM). */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "config.h"
#include "cuda/cudrv.h"
#include "cuda/gpu.h"
#include "gpu_test.h"
#include "log.h"

static kvf_cu cu;
static int failures;

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { return gt_xorshift(&rng); }

static void set_ctx(int dev) {
  CUdevice d;
  CUcontext c;
  cu.DeviceGet(&d, dev);
  cu.DevicePrimaryCtxRetain(&c, d);
  cu.CtxSetCurrent(c);
  cu.DevicePrimaryCtxRelease(d);
}

/* A region of memory as the test sees it: a device pool or host memory. */
typedef struct region {
  const char *name;
  int dev;                 /* -1 host */
  bool mapped;
  uint8_t *host;           /* host memory */
  uint64_t addr;           /* device address (or host alias) */
  uint64_t size;
  kvf__gpu_mem mem;
} region;

static int region_dev(region *r, const char *name, int dev, uint64_t size) {
  char err[300];
  memset(r, 0, sizeof(*r));
  r->name = name;
  r->dev = dev;
  int rc = kvf__gpu_mem_alloc(dev, size, &r->mem, err, sizeof(err));
  CHECK(rc == 0, "alloc %s: %s", name, err);
  r->addr = r->mem.dptr;
  r->size = r->mem.size;
  r->mapped = true;
  return 0;
}

static int region_host(region *r, const char *name, uint64_t size, bool do_register) {
  memset(r, 0, sizeof(*r));
  r->name = name;
  r->dev = -1;
  r->size = size;
  r->host = aligned_alloc(4096, size);
  CHECK(r->host, "malloc");
  memset(r->host, 0, size);
  if (do_register) {
    CHECK(kvf__gpu_host_register(r->host, size, &r->addr) == 0, "register %s", name);
    r->mapped = true;
  }
  return 0;
}

static void region_free(region *r) {
  if (r->dev >= 0) kvf__gpu_mem_free(&r->mem);
  else {
    if (r->mapped) kvf__gpu_host_unregister(r->host);
    free(r->host);
  }
}

static int region_write(region *r, const uint8_t *src) {
  if (r->dev < 0) {
    memcpy(r->host, src, r->size);
    return 0;
  }
  set_ctx(r->dev);
  CHECK(cu.MemcpyHtoD(r->addr, src, r->size) == 0, "HtoD %s", r->name);
  return 0;
}

static int region_read(region *r, uint8_t *dst) {
  if (r->dev < 0) {
    memcpy(dst, r->host, r->size);
    return 0;
  }
  set_ctx(r->dev);
  CHECK(cu.MemcpyDtoH(dst, r->addr, r->size) == 0, "DtoH %s", r->name);
  return 0;
}

/* Fills r (size a multiple of 8) with random data, not zeros, through
 * buf, which keeps a copy for verification. */
static int fill_random(region *r, uint8_t *buf) {
  for (uint64_t i = 0; i < r->size; i += 8) {
    uint64_t v = rnd();
    memcpy(buf + i, &v, 8);
  }
  return region_write(r, buf);
}

static kvf__gpu_end end_of(const region *r, uint64_t off) {
  kvf__gpu_end e = {r->dev, r->mapped, r->addr + off, r->host ? r->host + off : NULL};
  return e;
}

/* Copies n random blocks of random odd sizes (or block bytes when
 * block != 0) from src to disjoint places in dst and checks dst whole. */
static int check_route(region *src, region *dst, size_t n, uint64_t block, const char *want_route) {
  uint64_t size = src->size < dst->size ? src->size : dst->size;
  uint8_t *s = malloc(src->size), *d = malloc(dst->size), *want = malloc(dst->size);
  kvf__gpu_copy *v = calloc(n, sizeof(*v));
  CHECK(s && d && want && v, "malloc");
  for (uint64_t i = 0; i < src->size; i++) s[i] = (uint8_t)rnd();
  memset(want, 0xa7, dst->size);
  int rc = region_write(src, s);
  if (rc == 0) rc = region_write(dst, want);
  uint64_t slot = size / n;
  for (size_t i = 0; i < n && rc == 0; i++) {
    uint64_t len = block ? block : n == 1 ? slot - 64 : 1 + rnd() % (slot - 32 < 70000 ? slot - 32 : 70000);
    if (len > slot - 16) len = slot - 16;
    uint64_t doff = (uint64_t)i * slot + rnd() % 16;                   /* disjoint */
    uint64_t soff = block ? ((rnd() % (src->size / block)) * block) : rnd() % (src->size - len);
    v[i] = (kvf__gpu_copy){end_of(src, soff), end_of(dst, doff), len};
    memcpy(want + doff, s + soff, len);
  }
  const char *route = "?";
  if (rc == 0) {
    rc = kvf__gpu_copy_all(v, n, &route);
    if (rc) fprintf(stderr, "FAIL: copy_all %s -> %s: %d\n", src->name, dst->name, rc), failures++;
  }
  if (rc == 0) rc = region_read(dst, d);
  if (rc == 0) {
    uint64_t bad = 0;
    while (bad < dst->size && d[bad] == want[bad]) bad++;
    if (bad < dst->size) {
      fprintf(stderr, "FAIL: %s -> %s (%zu copies, route %s): byte %" PRIu64 " is 0x%02x, want 0x%02x\n", src->name,
              dst->name, n, route, bad, d[bad], want[bad]);
      failures++;
      rc = -1;
    }
  }
  if (rc == 0 && want_route && strcmp(route, want_route) != 0) {
    fprintf(stderr, "FAIL: %s -> %s took route %s, expected %s\n", src->name, dst->name, route, want_route);
    failures++;
    rc = -1;
  }
  printf("%s %s -> %s: %zu copies%s, route %s\n", rc ? "FAIL" : "ok  ", src->name, dst->name, n,
         block ? "" : " of odd sizes", route);
  free(s);
  free(d);
  free(want);
  free(v);
  return rc;
}

static int run_tests(void) {
  int n = kvf__gpu_count();
  region g0, g0b, g1, hm, hu;
  const uint64_t SZ = 64ull << 20;
  if (region_dev(&g0, "cuda:0", 0, SZ) || region_dev(&g0b, "cuda:0(b)", 0, SZ) || region_host(&hm, "host(registered)", SZ, true) ||
      region_host(&hu, "host(unregistered)", SZ, false))
    return -1;
  check_route(&g0, &g0b, 5000, 0, "same-gpu");
  check_route(&g0, &g0b, 1, 0, "same-gpu");
  check_route(&g0, &g0b, 2048, 32768, "same-gpu");
  check_route(&hm, &g0, 3000, 0, "h2d");
  check_route(&g0, &hm, 3000, 0, "d2h");
  check_route(&hu, &g0, 300, 0, "h2d");
  check_route(&g0, &hu, 300, 0, "d2h");
  check_route(&hm, &hu, 100, 0, "host");
  if (n >= 2) {
    if (region_dev(&g1, "cuda:1", 1, SZ)) return -1;
    const char *link = kvf__gpu_link(0, 1);
    check_route(&g0, &g1, 5000, 0, link);
    check_route(&g1, &g0, 5000, 0, link);
    check_route(&g0, &g1, 2048, 32768, link);
    /* one run longer than the staging half (32 MiB): cut across halves */
    check_route(&g0, &g1, 1, 0, link);
    region_free(&g1);
  } else {
    printf("skip GPU->GPU: one GPU\n");
  }
  region_free(&g0);
  region_free(&g0b);
  region_free(&hm);
  region_free(&hu);
  return failures ? -1 : 0;
}

/* ------------------------------------------------------------ bench */

static bool two_gpus(const char *mode) {
  if (kvf__gpu_count() >= 2) return true;
  fprintf(stderr, "%s needs 2 GPUs\n", mode);
  return false;
}

static int cmp_f(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

static float median(float *v, int n) {
  qsort(v, (size_t)n, sizeof(float), cmp_f);
  return v[n / 2];
}

static void report(const char *what, uint64_t bytes, float ms, const char *extra) {
  printf("{\"what\": \"%s\", \"bytes\": %" PRIu64 ", \"ms\": %.4f, \"gbps\": %.2f%s%s}\n", what, bytes, ms,
         (double)bytes / (ms * 1e-3) / 1e9, extra ? ", " : "", extra ? extra : "");
  fflush(stdout);
}

static int run_pinned(uint64_t bytes, int reps) {
  region a;
  if (region_dev(&a, "cuda:0", 0, bytes)) return -1;
  set_ctx(0);
  CUstream st;
  CUevent e0, e1;
  cu.StreamCreate(&st, KVF_CU_STREAM_NON_BLOCKING);
  cu.EventCreate(&e0, 0);
  cu.EventCreate(&e1, 0);
  void *pinned = NULL;
  if (cu.MemHostAlloc(&pinned, bytes, KVF_CU_MEMHOSTALLOC_PORTABLE) != 0) return -1;
  memset(pinned, 0x3c, bytes);
  float *ms = calloc((size_t)reps, sizeof(float));
  for (int dir = 0; dir < 2; dir++) {
    for (int r = -2; r < reps; r++) {
      cu.EventRecord(e0, st);
      if (dir == 0) cu.MemcpyHtoDAsync(a.addr, pinned, bytes, st);
      else cu.MemcpyDtoHAsync(pinned, a.addr, bytes, st);
      cu.EventRecord(e1, st);
      cu.StreamSynchronize(st);
      if (r >= 0) cu.EventElapsedTime(&ms[r], e0, e1);
    }
    report(dir == 0 ? "pinned_h2d" : "pinned_d2h", bytes, median(ms, reps), NULL);
  }
  cu.MemFreeHost(pinned);
  free(ms);
  region_free(&a);
  return 0;
}

static int run_bench(size_t nblocks, uint64_t block, int reps, int refs) {
  if (!two_gpus("bench")) return -1;
  uint64_t bytes = nblocks * block;
  region a, b;
  /* pools twice the data: blocks land scattered, as in a paged KV cache */
  if (region_dev(&a, "cuda:0", 0, 2 * bytes) || region_dev(&b, "cuda:1", 1, 2 * bytes)) return -1;
  uint64_t slots = a.size / block;
  uint64_t *perm_s = malloc(slots * sizeof(uint64_t)), *perm_d = malloc(slots * sizeof(uint64_t));
  for (uint64_t i = 0; i < slots; i++) perm_s[i] = perm_d[i] = i;
  for (uint64_t i = 0; i < slots; i++) {
    uint64_t j = i + rnd() % (slots - i), t = perm_s[i];
    perm_s[i] = perm_s[j];
    perm_s[j] = t;
    j = i + rnd() % (slots - i);
    t = perm_d[i];
    perm_d[i] = perm_d[j];
    perm_d[j] = t;
  }
  uint8_t *h = malloc(a.size);
  if (!h || fill_random(&a, h)) return -1;
  kvf__gpu_batch *bt;
  if (kvf__gpu_batch_new(&bt)) return -1;
  bool pull = getenv("KVF_CUDA_PULL") && atoi(getenv("KVF_CUDA_PULL"));
  int exec = pull ? 1 : 0;
  kvf__gpu_tuning tu;
  kvf__gpu_tuning_get(&tu);
  bool split = tu.split; /* as the daemon */
  float *ms = calloc((size_t)reps, sizeof(float));
  char extra[200];
  const char *kname = getenv("KVF_CUDA_KERNEL") ? getenv("KVF_CUDA_KERNEL") : "default";
  /* 1. the copy kernel alone, scattered blocks */
  for (int r = -3; r < reps; r++) {
    kvf__gpu_batch_reset(bt);
    for (size_t i = 0; i < nblocks; i++)
      kvf__gpu_batch_add(bt, split ? (kvf__gpu_plan_push(i, tu.split_pct) ? 0 : 1) : exec, a.addr + perm_s[i] * block, b.addr + perm_d[i] * block, block);
    if (kvf__gpu_batch_launch(bt) || kvf__gpu_batch_wait(bt)) return -1;
    if (r >= 0) ms[r] = kvf__gpu_batch_ms(bt);
  }
  snprintf(extra, sizeof(extra), "\"blocks\": %zu, \"block\": %" PRIu64 ", \"kernel\": \"%s\", \"exec\": \"%s\"", nblocks,
           block, kname, split ? "split" : pull ? "dst (pull)" : "src (push)");
  report("kernel_scattered", bytes, median(ms, reps), extra);
  /* verify the last copy */
  uint8_t *got = malloc(b.size);
  region_read(&b, got);
  for (size_t i = 0; i < nblocks; i++)
    if (memcmp(got + perm_d[i] * block, h + perm_s[i] * block, block) != 0) {
      fprintf(stderr, "FAIL: bench block %zu differs\n", i);
      failures++;
      break;
    }
  /* 2. the kernel on one contiguous run of the same bytes */
  for (int r = -3; r < reps; r++) {
    kvf__gpu_batch_reset(bt);
    kvf__gpu_batch_add(bt, exec, a.addr, b.addr, bytes);
    if (kvf__gpu_batch_launch(bt) || kvf__gpu_batch_wait(bt)) return -1;
    if (r >= 0) ms[r] = kvf__gpu_batch_ms(bt);
  }
  report("kernel_contiguous", bytes, median(ms, reps), extra);
  if (!refs) {
    kvf__gpu_batch_free(bt);
    region_free(&a);
    region_free(&b);
    free(h);
    free(got);
    free(ms);
    free(perm_s);
    free(perm_d);
    return failures ? -1 : 0;
  }
  /* 3. cuMemcpyPeerAsync, contiguous (the copy engines) */
  set_ctx(0);
  CUstream st;
  CUevent e0, e1;
  cu.StreamCreate(&st, KVF_CU_STREAM_NON_BLOCKING);
  cu.EventCreate(&e0, 0);
  cu.EventCreate(&e1, 0);
  CUcontext c0, c1;
  CUdevice d0, d1;
  cu.DeviceGet(&d0, 0);
  cu.DeviceGet(&d1, 1);
  cu.DevicePrimaryCtxRetain(&c0, d0);
  cu.DevicePrimaryCtxRetain(&c1, d1);
  for (int r = -3; r < reps; r++) {
    cu.EventRecord(e0, st);
    cu.MemcpyPeerAsync(b.addr, c1, a.addr, c0, bytes, st);
    cu.EventRecord(e1, st);
    cu.StreamSynchronize(st);
    if (r >= 0) cu.EventElapsedTime(&ms[r], e0, e1);
  }
  report("memcpy_peer_contiguous", bytes, median(ms, reps), NULL);
  /* 4. one cuMemcpyAsync per block (what a naive engine does) */
  int few = reps < 5 ? reps : 5;
  for (int r = -1; r < few; r++) {
    cu.EventRecord(e0, st);
    for (size_t i = 0; i < nblocks; i++) cu.MemcpyAsync(b.addr + perm_d[i] * block, a.addr + perm_s[i] * block, block, st);
    cu.EventRecord(e1, st);
    cu.StreamSynchronize(st);
    if (r >= 0) cu.EventElapsedTime(&ms[r], e0, e1);
  }
  report("memcpy_async_per_block", bytes, median(ms, few), NULL);
  /* 5. pinned host <-> device (the tcp-bounce path's other ceiling) */
  void *pinned = NULL;
  cu.MemHostAlloc(&pinned, bytes, KVF_CU_MEMHOSTALLOC_PORTABLE);
  if (pinned) {
    for (int r = -2; r < reps; r++) {
      cu.EventRecord(e0, st);
      cu.MemcpyHtoDAsync(a.addr, pinned, bytes, st);
      cu.EventRecord(e1, st);
      cu.StreamSynchronize(st);
      if (r >= 0) cu.EventElapsedTime(&ms[r], e0, e1);
    }
    report("pinned_h2d", bytes, median(ms, reps), NULL);
    for (int r = -2; r < reps; r++) {
      cu.EventRecord(e0, st);
      cu.MemcpyDtoHAsync(pinned, a.addr, bytes, st);
      cu.EventRecord(e1, st);
      cu.StreamSynchronize(st);
      if (r >= 0) cu.EventElapsedTime(&ms[r], e0, e1);
    }
    report("pinned_d2h", bytes, median(ms, reps), NULL);
    cu.MemFreeHost(pinned);
  }
  cu.DevicePrimaryCtxRelease(d0);
  cu.DevicePrimaryCtxRelease(d1);
  kvf__gpu_batch_free(bt);
  region_free(&a);
  region_free(&b);
  free(h);
  free(got);
  free(ms);
  free(perm_s);
  free(perm_d);
  return failures ? -1 : 0;
}

/* ------------------------------------------------------------ sweep */

/* The scattered-block bench's setup, shared by every shape of a sweep. */
typedef struct scatter {
  region a, b;
  uint64_t block;
  size_t n;
  uint64_t *src_off, *dst_off;
  uint8_t *want;          /* a's contents */
  uint8_t *got;
} scatter;

static int scatter_setup(scatter *x, size_t n, uint64_t block) {
  memset(x, 0, sizeof(*x));
  x->n = n;
  x->block = block;
  uint64_t bytes = n * block;
  if (region_dev(&x->a, "cuda:0", 0, 2 * bytes) || region_dev(&x->b, "cuda:1", 1, 2 * bytes)) return -1;
  uint64_t slots = x->a.size / block;
  uint64_t *ps = malloc(slots * sizeof(uint64_t)), *pd = malloc(slots * sizeof(uint64_t));
  x->src_off = malloc(n * sizeof(uint64_t));
  x->dst_off = malloc(n * sizeof(uint64_t));
  x->want = malloc(x->a.size);
  x->got = malloc(x->b.size);
  CHECK(ps && pd && x->src_off && x->dst_off && x->want && x->got, "malloc");
  for (uint64_t i = 0; i < slots; i++) ps[i] = pd[i] = i;
  for (uint64_t i = 0; i < n; i++) { /* partial Fisher-Yates: n distinct slots each side */
    uint64_t j = i + rnd() % (slots - i), t = ps[i];
    ps[i] = ps[j];
    ps[j] = t;
    j = i + rnd() % (slots - i);
    t = pd[i];
    pd[i] = pd[j];
    pd[j] = t;
    x->src_off[i] = ps[i] * block;
    x->dst_off[i] = pd[i] * block;
  }
  free(ps);
  free(pd);
  return fill_random(&x->a, x->want);
}

static void scatter_free(scatter *x) {
  region_free(&x->a);
  region_free(&x->b);
  free(x->src_off);
  free(x->dst_off);
  free(x->want);
  free(x->got);
}

/* Zeroes b before a run, so that verify sees only what the run wrote. */
static int scatter_clear(scatter *x) {
  set_ctx(1);
  CHECK(cu.MemsetD8(x->b.addr, 0, x->b.size) == 0, "memset");
  return 0;
}

static int scatter_verify(scatter *x, const char *what) {
  if (region_read(&x->b, x->got)) return -1;
  for (size_t i = 0; i < x->n; i++)
    CHECK(memcmp(x->got + x->dst_off[i], x->want + x->src_off[i], x->block) == 0, "%s: block %zu differs", what, i);
  return 0;
}

/* cuMemcpyBatchAsync (CUDA 12.8+), for the copy-engine experiments. */
typedef struct {
  int srcAccessOrder;
  kvf_cu_mem_location srcLocHint, dstLocHint;
  unsigned flags;
} ce_attrs;
typedef CUresult (*batch_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, ce_attrs *, size_t *, size_t, CUstream);

/* Times REPS runs of the kernel on blocks [0, nk) (split by the current
 * tuning) and, on nce_streams streams of GPU 0, the copy engines on blocks
 * [nk, n) with one cuMemcpyBatchAsync per stream, all at once; the span runs
 * from an event before every launch to one after every end. Verifies. */
static int time_mix(scatter *x, size_t nk, int nce_streams, int reps, float *out_ms) {
  static batch_fn batch;
  static CUstream ce_st[8];
  static CUevent ce_end[8], t0, t1;
  static CUstream lead;
  if (!lead) {
    set_ctx(0);
    batch = (batch_fn)dlsym(cu.lib, "cuMemcpyBatchAsync_v2");
    cu.StreamCreate(&lead, KVF_CU_STREAM_NON_BLOCKING);
    cu.EventCreate(&t0, 0);
    cu.EventCreate(&t1, 0);
    for (int k = 0; k < 8; k++) {
      cu.StreamCreate(&ce_st[k], KVF_CU_STREAM_NON_BLOCKING);
      cu.EventCreate(&ce_end[k], KVF_CU_EVENT_DISABLE_TIMING);
    }
  }
  size_t nce = x->n - nk;
  if (nce && (!batch || nce_streams < 1 || nce_streams > 8)) return 1; /* not available: skipped */
  kvf__gpu_batch *bt;
  if (kvf__gpu_batch_new(&bt)) return -1;
  kvf__gpu_tuning tu;
  kvf__gpu_tuning_get(&tu);
  CUdeviceptr *dsts = malloc((nce + 1) * sizeof(CUdeviceptr)), *srcs = malloc((nce + 1) * sizeof(CUdeviceptr));
  size_t *sizes = malloc((nce + 1) * sizeof(size_t));
  for (size_t i = 0; i < nce; i++) {
    srcs[i] = x->a.addr + x->src_off[nk + i];
    dsts[i] = x->b.addr + x->dst_off[nk + i];
    sizes[i] = x->block;
  }
  ce_attrs attr = {.srcAccessOrder = 1 /* STREAM */, .srcLocHint = {1, 0}, .dstLocHint = {1, 1}};
  size_t zero = 0;
  float *ms = calloc((size_t)reps, sizeof(float));
  int rc = scatter_clear(x);
  for (int r = -3; r < reps && rc == 0; r++) {
    kvf__gpu_batch_reset(bt);
    for (size_t i = 0; i < nk; i++) {
      int exec = tu.split ? (kvf__gpu_plan_push(i, tu.split_pct) ? 0 : 1) : tu.pull ? 1 : 0;
      kvf__gpu_batch_add(bt, exec, x->a.addr + x->src_off[i], x->b.addr + x->dst_off[i], x->block);
    }
    set_ctx(0);
    cu.StreamSynchronize(lead);
    cu.EventRecord(t0, lead);
    size_t per = nce_streams > 0 ? (nce + (size_t)nce_streams - 1) / (size_t)nce_streams : 0;
    for (int k = 0; k < nce_streams && nce; k++) {
      size_t lo = (size_t)k * per, hi = lo + per < nce ? lo + per : nce;
      if (lo >= hi) continue;
      cu.StreamWaitEvent(ce_st[k], t0, 0);
      CUresult cr = batch(dsts + lo, srcs + lo, sizes + lo, hi - lo, &attr, &zero, 1, ce_st[k]);
      if (cr != KVF_CU_SUCCESS) {
        fprintf(stderr, "cuMemcpyBatchAsync: %d\n", cr);
        rc = -1;
        break;
      }
      cu.EventRecord(ce_end[k], ce_st[k]);
    }
    if (rc) break;
    if (nk && (kvf__gpu_batch_launch(bt) || kvf__gpu_batch_wait(bt))) rc = -1;
    set_ctx(0);
    for (int k = 0; k < nce_streams && nce; k++) cu.StreamWaitEvent(lead, ce_end[k], 0);
    cu.EventRecord(t1, lead);
    cu.StreamSynchronize(lead);
    float span = 0;
    cu.EventElapsedTime(&span, t0, t1);
    /* the kernel's own span may start before t0's stream saw it: take the larger */
    float k_ms = nk ? kvf__gpu_batch_ms(bt) : 0;
    if (r >= 0) ms[r] = span > k_ms ? span : k_ms;
  }
  if (rc == 0) rc = scatter_verify(x, "mix");
  if (rc == 0) *out_ms = median(ms, reps);
  free(ms);
  free(dsts);
  free(srcs);
  free(sizes);
  kvf__gpu_batch_free(bt);
  return rc;
}

/* Every kernel shape in one process, then copy engines and kernel+engines
 * together; one JSON line per figure. */
static int run_sweep(size_t n, uint64_t block, int reps) {
  if (!two_gpus("sweep")) return -1;
  scatter x;
  if (scatter_setup(&x, n, block)) return -1;
  uint64_t bytes = n * block;
  char extra[256];
  float ms = 0;
  /* the ceiling: copy engines, contiguous */
  {
    set_ctx(0);
    CUstream st;
    CUevent e0, e1;
    cu.StreamCreate(&st, KVF_CU_STREAM_NON_BLOCKING);
    cu.EventCreate(&e0, 0);
    cu.EventCreate(&e1, 0);
    float *v = calloc((size_t)reps, sizeof(float));
    for (int r = -3; r < reps; r++) {
      cu.EventRecord(e0, st);
      cu.MemcpyAsync(x.b.addr, x.a.addr, bytes, st);
      cu.EventRecord(e1, st);
      cu.StreamSynchronize(st);
      if (r >= 0) cu.EventElapsedTime(&v[r], e0, e1);
    }
    report("memcpy_peer_contiguous", bytes, median(v, reps), NULL);
    free(v);
  }
  static const char *kernels[] = {"kvf_copy_u8", "kvf_copy_u4", "kvf_copy_u8cs", "kvf_copy_u8nc", "kvf_copy_u8wb",
                                  "kvf_copy_w8", "kvf_copy_tma"};
  static const unsigned shapes[][2] = {{256, 2}, {512, 2}, {256, 4}, {1024, 1}, {128, 8}, {512, 1}};
  static const unsigned tma_shapes[][2] = {{32, 6}, {32, 8}, {32, 16}, {64, 8}, {32, 4}, {128, 4}};
  static const int pcts[] = {50, 0, 100, 40, 60};
  kvf__gpu_tuning def;
  kvf__gpu_tuning_get(&def);
  char def_kernel[32];
  snprintf(def_kernel, sizeof(def_kernel), "%s", def.kernel);
  int rc = 0;
  for (size_t k = 0; k < sizeof(kernels) / sizeof(kernels[0]); k++)
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
      for (size_t p = 0; p < sizeof(pcts) / sizeof(pcts[0]); p++) {
        /* the full grid for the default shape; the other shapes at 50% only */
        if (s > 0 && pcts[p] != 50) continue;
        bool tma = strcmp(kernels[k], "kvf_copy_tma") == 0; /* issued by one thread per CTA */
        const unsigned *shape = tma ? tma_shapes[s] : shapes[s];
        kvf__gpu_tuning t = {kernels[k], shape[0], shape[1], true, (unsigned)pcts[p], false};
        if (kvf__gpu_tune(&t) != 0) continue;
        if ((rc = time_mix(&x, n, 0, reps, &ms)) != 0) goto out;
        snprintf(extra, sizeof(extra), "\"kernel\": \"%s\", \"threads\": %u, \"ctas_per_sm\": %u, \"push_pct\": %d",
                 kernels[k], shape[0], shape[1], pcts[p]);
        report("sweep_kernel", bytes, ms, extra);
      }
  def.kernel = def_kernel;
  kvf__gpu_tune(&def);
  /* the copy engines on the same blocks (cuMemcpyBatchAsync), for scale */
  for (int k = 1; k <= 1; k++) {
    rc = time_mix(&x, 0, k, reps, &ms);
    if (rc == 1) {
      printf("{\"what\": \"ce_batch\", \"skipped\": \"no cuMemcpyBatchAsync_v2\"}\n");
      rc = 0;
      break;
    }
    if (rc) goto out;
    snprintf(extra, sizeof(extra), "\"streams\": %d", k);
    report("ce_batch", bytes, ms, extra);
  }
out:
  scatter_free(&x);
  return rc;
}

/* ------------------------------------------------------------ parts */

/* The local transport's pattern: a send arrives in parts (chained frames of
 * 256, 512, ... 4096 descriptors) and each part is launched on its own as
 * it comes (kvf__gpu_copy_start). Host wall time from the first launch to
 * the last completion callback, against one launch of everything; pace_ns
 * spins that long per descriptor before each launch, as the daemon's loop
 * spends unpacking and pairing a frame. */
static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  size_t left;
  int rc;
  uint64_t last_ns;
} PW = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0};

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void part_done(void *arg, int rc, float ms) {
  pthread_mutex_lock(&PW.mu);
  if (rc) PW.rc = rc;
  PW.last_ns = now_ns();
  if (--PW.left == 0) pthread_cond_signal(&PW.cv);
  pthread_mutex_unlock(&PW.mu);
}

static int time_parts(scatter *x, size_t first, size_t max, unsigned pace_ns, int reps, float *out_ms,
                      float *launch_us) {
  kvf__gpu_copy *v = malloc(x->n * sizeof(*v));
  float *ms = calloc((size_t)reps, sizeof(float)), *lu = calloc((size_t)reps, sizeof(float));
  for (size_t i = 0; i < x->n; i++)
    v[i] = (kvf__gpu_copy){.src = end_of(&x->a, x->src_off[i]), .dst = end_of(&x->b, x->dst_off[i]), .len = x->block};
  int rc = scatter_clear(x);
  for (int r = -3; r < reps && rc == 0; r++) {
    size_t nparts = 0;
    for (size_t at = 0, k = first; at < x->n; at += k, k = k * 2 < max ? k * 2 : max) nparts++;
    PW.left = nparts;
    PW.rc = 0;
    uint64_t t0 = now_ns(), in_launch = 0;
    for (size_t at = 0, k = first; at < x->n && rc == 0; at += k, k = k * 2 < max ? k * 2 : max) {
      size_t take = x->n - at < k ? x->n - at : k;
      uint64_t until = now_ns() + (uint64_t)pace_ns * take;
      while (pace_ns && now_ns() < until) {
      }
      uint64_t l0 = now_ns();
      rc = kvf__gpu_copy_start(v + at, take, part_done, NULL);
      in_launch += now_ns() - l0;
    }
    pthread_mutex_lock(&PW.mu);
    while (PW.left) pthread_cond_wait(&PW.cv, &PW.mu);
    if (PW.rc) rc = PW.rc;
    pthread_mutex_unlock(&PW.mu);
    if (r >= 0) {
      ms[r] = (float)((double)(PW.last_ns - t0) / 1e6);
      lu[r] = (float)((double)in_launch / 1e3);
    }
  }
  if (rc == 0) rc = scatter_verify(x, "parts");
  *out_ms = median(ms, reps);
  *launch_us = median(lu, reps);
  free(ms);
  free(lu);
  free(v);
  return rc;
}

static int run_parts(size_t n, uint64_t block, int reps) {
  if (!two_gpus("parts")) return -1;
  scatter x;
  if (scatter_setup(&x, n, block)) return -1;
  static const struct { size_t first, max; unsigned pace; } v[] = {
      {16384, 16384, 0}, {256, 4096, 0}, {256, 4096, 60}, {1024, 4096, 0}, {1024, 4096, 60}, {4096, 4096, 0}, {128, 2048, 60},
  };
  int rc = 0;
  for (size_t i = 0; i < sizeof(v) / sizeof(v[0]) && rc == 0; i++) {
    float ms, lu;
    rc = time_parts(&x, v[i].first, v[i].max, v[i].pace, reps, &ms, &lu);
    char extra[160];
    snprintf(extra, sizeof(extra), "\"first\": %zu, \"max\": %zu, \"pace_ns\": %u, \"launch_us\": %.1f", v[i].first,
             v[i].max, v[i].pace, lu);
    if (rc == 0) report("parts_wall", (uint64_t)n * block, ms, extra);
  }
  scatter_free(&x);
  return rc;
}

/* ------------------------------------------------------------ kvlayout */

/* A paged KV cache laid out in one pool per GPU, as an engine keeps it in a
 * kvferry pool: T (layer, K/V) segments, each an array of nb blocks of bs
 * bytes. A request holds m block ids on each side (random); its T * m
 * descriptors go layer-major (for each segment, each block), as engines and
 * kvferry-bench post them. Block pair j's T segments lie at one stride
 * (nb * bs) on both sides, so the copy engines can move each pair as one 2D
 * copy instead of T copies of bs bytes. */
typedef struct kvlay {
  region a, b;
  unsigned T, m, nb;
  uint64_t bs, pitch;
  uint32_t *sid, *did;    /* the request's block ids, m each */
  uint8_t *want, *got;
} kvlay;

static int kvlay_setup(kvlay *k, unsigned T, unsigned m, uint64_t bs, unsigned nb) {
  memset(k, 0, sizeof(*k));
  k->T = T, k->m = m, k->bs = bs, k->nb = nb, k->pitch = (uint64_t)nb * bs;
  uint64_t size = (uint64_t)T * k->pitch;
  if (region_dev(&k->a, "cuda:0", 0, size) || region_dev(&k->b, "cuda:1", 1, size)) return -1;
  k->sid = malloc(nb * sizeof(uint32_t));
  k->did = malloc(nb * sizeof(uint32_t));
  k->want = malloc(k->a.size);
  k->got = malloc(k->b.size);
  CHECK(k->sid && k->did && k->want && k->got, "malloc");
  for (unsigned i = 0; i < nb; i++) k->sid[i] = k->did[i] = i;
  for (unsigned i = 0; i < m; i++) {
    unsigned j = i + (unsigned)(rnd() % (nb - i)), t = k->sid[i];
    k->sid[i] = k->sid[j], k->sid[j] = t;
    j = i + (unsigned)(rnd() % (nb - i)), t = k->did[i];
    k->did[i] = k->did[j], k->did[j] = t;
  }
  return fill_random(&k->a, k->want);
}

static void kvlay_free(kvlay *k) {
  region_free(&k->a);
  region_free(&k->b);
  free(k->sid);
  free(k->did);
  free(k->want);
  free(k->got);
}

static int kvlay_verify(kvlay *k, const char *what) {
  if (region_read(&k->b, k->got)) return -1;
  for (unsigned t = 0; t < k->T; t++)
    for (unsigned j = 0; j < k->m; j++)
      CHECK(memcmp(k->got + t * k->pitch + k->did[j] * k->bs, k->want + t * k->pitch + k->sid[j] * k->bs, k->bs) == 0,
            "%s: segment %u block %u differs", what, t, j);
  set_ctx(1);
  CHECK(cu.MemsetD8(k->b.addr, 0, k->b.size) == 0, "memset");
  return 0;
}

/* The kernel on the T * m descriptors (current tuning, split as the daemon). */
static int kvlay_kernel(kvlay *k, int reps, float *out) {
  kvf__gpu_batch *bt;
  if (kvf__gpu_batch_new(&bt)) return -1;
  kvf__gpu_tuning tu;
  kvf__gpu_tuning_get(&tu);
  float *ms = calloc((size_t)reps, sizeof(float));
  int rc = 0;
  for (int r = -3; r < reps && rc == 0; r++) {
    kvf__gpu_batch_reset(bt);
    size_t i = 0;
    for (unsigned t = 0; t < k->T; t++)
      for (unsigned j = 0; j < k->m; j++, i++)
        kvf__gpu_batch_add(bt, tu.split ? (kvf__gpu_plan_push(i, tu.split_pct) ? 0 : 1) : 0,
                           k->a.addr + t * k->pitch + k->sid[j] * k->bs, k->b.addr + t * k->pitch + k->did[j] * k->bs, k->bs);
    if (kvf__gpu_batch_launch(bt) || kvf__gpu_batch_wait(bt)) rc = -1;
    if (r >= 0) ms[r] = kvf__gpu_batch_ms(bt);
  }
  if (rc == 0) rc = kvlay_verify(k, "kernel");
  *out = median(ms, reps);
  free(ms);
  kvf__gpu_batch_free(bt);
  return rc;
}

/* Each block pair's segments as 2D copies of `height` rows, spread round
 * robin over s0 streams of GPU 0 (its copy engines push) and s1 of GPU 1
 * (they pull); the span runs from one event before all to one after all. */
static int kvlay_ce2d(kvlay *k, int s0, int s1, unsigned height, int reps, float *out) {
  enum { MAXS = 8 };
  static CUstream st[2][MAXS];
  static CUevent done[2][MAXS], t0, t1;
  if (!t0) {
    for (int d = 0; d < 2; d++) {
      set_ctx(d);
      for (int i = 0; i < MAXS; i++) {
        cu.StreamCreate(&st[d][i], KVF_CU_STREAM_NON_BLOCKING);
        cu.EventCreate(&done[d][i], KVF_CU_EVENT_DISABLE_TIMING);
      }
    }
    set_ctx(0);
    cu.EventCreate(&t0, 0);
    cu.EventCreate(&t1, 0);
  }
  int ns = s0 + s1;
  if (ns < 1 || s0 > MAXS || s1 > MAXS || k->T % height) return -1;
  float *ms = calloc((size_t)reps, sizeof(float));
  int rc = 0;
  for (int r = -3; r < reps && rc == 0; r++) {
    set_ctx(0);
    cu.EventRecord(t0, st[0][0]);
    for (int q = 0; q < ns; q++) {
      int d = q < s0 ? 0 : 1, i = q < s0 ? q : q - s0;
      set_ctx(d);
      if (q) cu.StreamWaitEvent(st[d][i], t0, 0);
    }
    unsigned n = 0;
    for (unsigned j = 0; j < k->m && rc == 0; j++)
      for (unsigned t = 0; t < k->T && rc == 0; t += height, n++) {
        int q = (int)(n % (unsigned)ns), d = q < s0 ? 0 : 1, i = q < s0 ? q : q - s0;
        kvf_cu_memcpy2d c = {0};
        c.srcMemoryType = c.dstMemoryType = KVF_CU_MEMORYTYPE_DEVICE;
        c.srcDevice = k->a.addr + t * k->pitch + k->sid[j] * k->bs;
        c.dstDevice = k->b.addr + t * k->pitch + k->did[j] * k->bs;
        c.srcPitch = c.dstPitch = k->pitch;
        c.WidthInBytes = k->bs;
        c.Height = height;
        set_ctx(d);
        CUresult cr = cu.Memcpy2DAsync(&c, st[d][i]);
        if (cr != KVF_CU_SUCCESS) {
          fprintf(stderr, "cuMemcpy2DAsync: %d\n", cr);
          rc = -1;
        }
      }
    for (int q = 0; q < ns; q++) {
      int d = q < s0 ? 0 : 1, i = q < s0 ? q : q - s0;
      set_ctx(d);
      cu.EventRecord(done[d][i], st[d][i]);
      set_ctx(0);
      cu.StreamWaitEvent(st[0][0], done[d][i], 0);
    }
    set_ctx(0);
    cu.EventRecord(t1, st[0][0]);
    cu.StreamSynchronize(st[0][0]);
    if (r >= 0) cu.EventElapsedTime(&ms[r], t0, t1);
  }
  if (rc == 0) rc = kvlay_verify(k, "ce2d");
  *out = median(ms, reps);
  free(ms);
  return rc;
}

static int run_kvlayout(unsigned T, unsigned m, uint64_t bs, unsigned nb, int reps) {
  if (!two_gpus("kvlayout")) return -1;
  kvlay k;
  if (kvlay_setup(&k, T, m, bs, nb)) return -1;
  uint64_t bytes = (uint64_t)T * m * bs;
  char extra[160];
  float ms;
  int rc = kvlay_kernel(&k, reps, &ms);
  if (rc == 0) report("kv_kernel", bytes, ms, NULL);
  static const struct { int s0, s1; unsigned h; } v[] = {{1, 0, 0}, {0, 1, 0}, {1, 1, 0}, {2, 2, 0}, {1, 1, 16}};
  for (size_t i = 0; i < sizeof(v) / sizeof(v[0]) && rc == 0; i++) {
    unsigned h = v[i].h ? v[i].h : T;
    rc = kvlay_ce2d(&k, v[i].s0, v[i].s1, h, reps, &ms);
    snprintf(extra, sizeof(extra), "\"push_streams\": %d, \"pull_streams\": %d, \"rows\": %u", v[i].s0, v[i].s1, h);
    if (rc == 0) report("kv_ce2d", bytes, ms, extra);
  }
  kvlay_free(&k);
  return rc;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "test";
  kvf__log_init(KVF__LOG_INFO);
  if (gt_load_driver(&cu)) return 77;
  if (kvf__gpu_init(KVF__ON) != 0) return 1;
  int rc;
  if (strcmp(mode, "bench") == 0) {
    size_t n = argc > 2 ? (size_t)strtoull(argv[2], NULL, 10) : 16384;
    uint64_t block = argc > 3 ? strtoull(argv[3], NULL, 10) : 32768;
    int reps = argc > 4 ? atoi(argv[4]) : 20;
    rc = run_bench(n, block, reps > 0 ? reps : 20, argc > 5 ? atoi(argv[5]) : 1);
  } else if (strcmp(mode, "sweep") == 0) {
    size_t n = argc > 2 ? (size_t)strtoull(argv[2], NULL, 10) : 16384;
    uint64_t block = argc > 3 ? strtoull(argv[3], NULL, 10) : 32768;
    int reps = argc > 4 ? atoi(argv[4]) : 20;
    rc = run_sweep(n, block, reps > 0 ? reps : 20);
  } else if (strcmp(mode, "parts") == 0) {
    size_t n = argc > 2 ? (size_t)strtoull(argv[2], NULL, 10) : 16384;
    uint64_t block = argc > 3 ? strtoull(argv[3], NULL, 10) : 32768;
    int reps = argc > 4 ? atoi(argv[4]) : 20;
    rc = run_parts(n, block, reps > 0 ? reps : 20);
  } else if (strcmp(mode, "kvlayout") == 0) {
    unsigned T = argc > 2 ? (unsigned)atoi(argv[2]) : 64, m = argc > 3 ? (unsigned)atoi(argv[3]) : 256;
    uint64_t bs = argc > 4 ? strtoull(argv[4], NULL, 10) : 32768;
    unsigned nb = argc > 5 ? (unsigned)atoi(argv[5]) : 512;
    int reps = argc > 6 ? atoi(argv[6]) : 20;
    rc = run_kvlayout(T, m, bs, nb, reps > 0 ? reps : 20);
  } else if (strcmp(mode, "pinned") == 0) {
    uint64_t bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : 512ull << 20;
    int reps = argc > 3 ? atoi(argv[3]) : 20;
    rc = run_pinned(bytes, reps > 0 ? reps : 20);
  } else {
    rc = run_tests();
  }
  kvf__gpu_shutdown();
  printf("%s: %d failure(s)\n", mode, failures);
  return rc || failures ? 1 : 0;
}
