/* gpu_blocks_client.c - block transfers through a daemon on one node, as an
 * engine makes them: two clients (the sender and the receiver) register KV
 * layouts in cuda pools, grant and send by block ids, and check every byte
 * of the receiver's cache afterwards (tests/gpu/run.sh).
 *
 *   gpu_blocks_client SOCKET NODE SRC_POOL DST_POOL PATH [bench REPS]
 *
 * llama3-8b geometry (32 layers, K and V, 32 KiB blocks): the sender's
 * cache per-layer (vLLM), the receiver's cross-layer; whole, grant first,
 * and in 32 layer parts, send first; then 4 KiB blocks, 1,000 of them (ids
 * past what a launch's parameters hold). Every event must say PATH (e.g.
 * local-same-gpu). With bench, the llama3-8b request (4,096 tokens, 512
 * MiB in 256 blocks) is then timed (median of REPS): one at a time, send
 * call to RECV_DONE, whole and in 32 layer parts, and 4 in flight (the
 * same blocks, so the result stays checkable); the receiver's cache is
 * checked after all of them. One JSON line. Exit 0: passed; 77: no CUDA
 * driver; 1: failed. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/cudrv.h"
#include "gpu_test.h"
#include "kvferry.h"

#define MIB (1ull << 20)

static kvf_cu cu;

static uint64_t rng = 0x853c49e6748fea9bull;
static uint64_t rnd(void) { return gt_xorshift(&rng); }

static int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "FAIL: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  return -1;
}

/* A mapped cuda pool and the host's picture of the part of it in use. */
typedef struct side {
  kvf_client *c;
  kvf_pool_info pi;
  CUdeviceptr base;
  uint64_t size;
} side;

static int side_open(side *s, const char *sock, const char *pool) {
  int rc = kvf_connect(sock, &s->c);
  if (rc == 0) rc = kvf_pool_find(s->c, pool, &s->pi);
  void *addr = NULL;
  if (rc == 0) rc = kvf_pool_map(s->c, s->pi.id, &addr, &s->size);
  if (rc) return fail("pool %s: %s", pool, kvf_strerror(rc));
  if (strncmp(s->pi.kind, "cuda:", 5) != 0) return fail("pool %s is %s, not a cuda pool", pool, s->pi.kind);
  s->base = (CUdeviceptr)(uintptr_t)addr;
  return 0;
}

/* A cache of 32 layers of K and V at off in a side's pool. */
typedef struct cache {
  side *s;
  kvf_layout l;
  uint64_t offsets[64];
  uint64_t off, span;
  uint32_t id;
} cache;

static int cache_new(cache *k, side *s, uint64_t off, uint32_t blocks, uint64_t bb, bool cross) {
  memset(k, 0, sizeof(*k));
  k->s = s;
  k->off = off;
  for (uint32_t r = 0; r < 64; r++) k->offsets[r] = off + (cross ? r * bb : (uint64_t)r * blocks * bb);
  k->span = 64ull * blocks * bb;
  k->l = (kvf_layout){.pool = s->pi.id, .n_layers = 32, .n_kv = 2, .n_blocks = blocks, .block_bytes = bb,
                      .block_stride = cross ? 64 * bb : bb, .offsets = k->offsets, .tokens_per_block = 16,
                      .kv_heads = (uint32_t)(bb / 4096), .head_dim = 128, .dtype_bytes = 2};
  if (off + k->span > s->size) return fail("a cache does not fit pool %s (%" PRIu64 " bytes)", s->pi.name, s->size);
  int rc = kvf_layout_register(s->c, &k->l, &k->id);
  return rc ? fail("kvf_layout_register in %s: %s", s->pi.name, kvf_strerror(rc)) : 0;
}

static uint64_t addr(const cache *k, uint32_t layer, uint32_t kv, uint32_t b) {
  return k->offsets[layer * 2 + kv] + (uint64_t)b * k->l.block_stride - k->off;
}

/* Waits for x's event of type, checks it. */
static int wait_event(kvf_client *c, const char *x, int type, const char *path, uint64_t bytes) {
  for (;;) {
    kvf_event ev;
    int n = kvf_wait_events(c, &ev, 1, 60000);
    if (n <= 0) return fail("no event for %s (%s)", x, n ? kvf_strerror(n) : "timeout");
    if (strcmp(ev.xfer_id, x) != 0 || ev.type != type) continue;
    if (ev.status) return fail("%s: event %d failed: %s (%s)", x, type, kvf_strerror(ev.status), ev.error);
    if (strcmp(ev.path, path) != 0) return fail("%s: event path %s, want %s", x, ev.path, path);
    if (ev.bytes != bytes) return fail("%s: %" PRIu64 " bytes, want %" PRIu64, x, ev.bytes, bytes);
    return 0;
  }
}

/* One handoff of n blocks src -> dst: grant first and whole, or send
 * first in one part per layer. Checks the receiver's whole cache. */
static int handoff(const char *name, cache *src, cache *dst, size_t n, bool parts, const char *node,
                   const char *path) {
  uint8_t *hs = malloc(src->span), *want = malloc(dst->span), *got = malloc(dst->span);
  uint32_t *sids = malloc(n * 4), *dids = malloc(n * 4), *perm = malloc(dst->l.n_blocks * 4);
  if (!hs || !want || !got || !sids || !dids || !perm) return fail("%s: out of memory", name);
  for (uint64_t i = 0; i + 8 <= src->span; i += 8) {
    uint64_t v = rnd();
    memcpy(hs + i, &v, 8);
  }
  memset(want, 0x5a, dst->span);
  for (uint32_t i = 0; i < dst->l.n_blocks; i++) perm[i] = i;
  for (size_t i = 0; i < n; i++) {
    size_t j = i + rnd() % (dst->l.n_blocks - i);
    uint32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
    dids[i] = perm[i];
    sids[i] = (uint32_t)(rnd() % src->l.n_blocks);
  }
  uint64_t bb = src->l.block_bytes;
  for (uint32_t l = 0; l < 32; l++)
    for (uint32_t kv = 0; kv < 2; kv++)
      for (size_t i = 0; i < n; i++) memcpy(want + addr(dst, l, kv, dids[i]), hs + addr(src, l, kv, sids[i]), bb);
  int rc = 0;
  if (cu.MemcpyHtoD(src->s->base + src->off, hs, src->span) || cu.MemsetD8(dst->s->base + dst->off, 0x5a, dst->span))
    rc = fail("%s: writing the caches", name);
  char x[64];
  snprintf(x, sizeof(x), "%s-%llu", name, (unsigned long long)rnd() % 1000000);
  kvf_blocks g = {.layout = dst->id, .ids = dids, .n = n};
  if (rc == 0 && !parts && (rc = kvf_grant_blocks(dst->s->c, x, node, &g, 0, 0)) != 0)
    rc = fail("%s: kvf_grant_blocks: %s", name, kvf_strerror(rc));
  for (uint32_t l = 0; rc == 0 && l < 32; l += parts ? 1 : 32) {
    kvf_blocks b = {.layout = src->id, .ids = l ? NULL : sids, .n = l ? 0 : n, .first_layer = l,
                    .n_layers = parts ? 1 : 32};
    rc = kvf_send_blocks(src->s->c, x, node, &b, parts && l < 31 ? KVF_SEND_MORE : 0, 0);
    if (rc) rc = fail("%s: kvf_send_blocks: %s", name, kvf_strerror(rc));
  }
  if (rc == 0 && parts && (rc = kvf_grant_blocks(dst->s->c, x, node, &g, 0, 0)) != 0)
    rc = fail("%s: kvf_grant_blocks: %s", name, kvf_strerror(rc));
  uint64_t bytes = (uint64_t)n * 64 * bb;
  if (rc == 0) rc = wait_event(dst->s->c, x, KVF_EV_RECV_DONE, path, bytes);
  if (rc == 0) rc = wait_event(src->s->c, x, KVF_EV_SEND_DONE, path, bytes);
  if (rc == 0 && cu.MemcpyDtoH(got, dst->s->base + dst->off, dst->span)) rc = fail("%s: reading back", name);
  if (rc == 0 && memcmp(got, want, dst->span) != 0) {
    uint64_t i = 0;
    while (got[i] == want[i]) i++;
    rc = fail("%s: the receiver's cache differs at byte %" PRIu64 " (0x%02x, want 0x%02x)", name, i, got[i], want[i]);
  }
  printf("%s %s: %zu x %" PRIu64 " B blocks, %s, %s, path %s\n", rc ? "FAIL" : "ok  ", name, n, bb,
         parts ? "32 layer parts, send first" : "whole, grant first", "every byte of the receiver's cache checked",
         path);
  free(hs);
  free(want);
  free(got);
  free(sids);
  free(dids);
  free(perm);
  return rc;
}

/* ------------------------------------------------------------ bench */


/* Takes count events of type (any of this wave's transfers), each good. */
static int wait_n(kvf_client *c, int type, int count, const char *path) {
  while (count > 0) {
    kvf_event ev;
    int n = kvf_wait_events(c, &ev, 1, 60000);
    if (n <= 0) return fail("waiting for %d events: %s", count, n ? kvf_strerror(n) : "timeout");
    if (ev.type != type) continue;
    if (ev.status || strcmp(ev.path, path) != 0)
      return fail("%s: %s, path %s (%s)", ev.xfer_id, kvf_strerror(ev.status), ev.path, ev.error);
    count--;
  }
  return 0;
}

/* w transfers of src's sids to dst's dids at once, parts layer parts
 * each (1: whole; later parts with later_flags, e.g. KVF_NOWAIT; with
 * all_nowait every part, the first too, goes with KVF_NOWAIT: the call
 * returns once the request is written); the grants go first. *send_us: the send calls' time,
 * *done_us: from the first send call to the last RECV_DONE. */
static int wave(cache *src, cache *dst, const uint32_t *sids, const uint32_t *dids, size_t n, int w, uint32_t parts,
                unsigned later_flags, bool all_nowait, const char *node, const char *path, double *send_us,
                double *done_us) {
  static unsigned seq;
  char x[4][48];
  kvf_blocks g = {.layout = dst->id, .ids = dids, .n = n};
  for (int i = 0; i < w; i++) {
    snprintf(x[i], sizeof(x[i]), "bench-%u-%d", seq++, i);
    int rc = kvf_grant_blocks(dst->s->c, x[i], node, &g, 0, 0);
    if (rc) return fail("kvf_grant_blocks: %s", kvf_strerror(rc));
  }
  uint32_t per = 32 / parts;
  double t0 = gt_now_us();
  for (int i = 0; i < w; i++)
    for (uint32_t l = 0; l < 32; l += per) {
      kvf_blocks b = {.layout = src->id, .ids = l ? NULL : sids, .n = l ? 0 : n, .first_layer = l, .n_layers = per};
      unsigned flags = (l + per < 32 ? KVF_SEND_MORE : 0) | (l ? later_flags : 0) | (all_nowait ? KVF_NOWAIT : 0);
      int rc = kvf_send_blocks(src->s->c, x[i], node, &b, flags, 0);
      if (rc) return fail("kvf_send_blocks: %s", kvf_strerror(rc));
    }
  *send_us = gt_now_us() - t0;
  int rc = wait_n(dst->s->c, KVF_EV_RECV_DONE, w, path);
  *done_us = gt_now_us() - t0;
  return rc ? rc : wait_n(src->s->c, KVF_EV_SEND_DONE, w, path);
}

static int bench(cache *src, cache *dst, const char *node, const char *path, int reps) {
  const size_t n = 256;
  uint64_t bytes = n * 64 * src->l.block_bytes;
  uint8_t *hs = malloc(src->span), *want = malloc(dst->span), *got = malloc(dst->span);
  uint32_t sids[256], dids[256];
  enum { NV = 10 };
  double *v[NV];
  bool have = hs && want && got;
  for (int k = 0; k < NV; k++) have = (v[k] = calloc((size_t)reps, sizeof(double))) != NULL && have;
  if (!have) return fail("out of memory");
  for (uint64_t i = 0; i + 8 <= src->span; i += 8) {
    uint64_t r = rnd();
    memcpy(hs + i, &r, 8);
  }
  for (size_t i = 0; i < n; i++) sids[i] = dids[i] = (uint32_t)i;
  for (size_t i = n - 1; i > 0; i--) { /* shuffled: scattered blocks */
    size_t j = rnd() % (i + 1);
    uint32_t t = sids[i];
    sids[i] = sids[j], sids[j] = t;
    j = rnd() % (i + 1);
    t = dids[i];
    dids[i] = dids[j], dids[j] = t;
  }
  memset(want, 0x5a, dst->span);
  for (uint32_t l = 0; l < 32; l++)
    for (uint32_t kv = 0; kv < 2; kv++)
      for (size_t i = 0; i < n; i++)
        memcpy(want + addr(dst, l, kv, dids[i]), hs + addr(src, l, kv, sids[i]), src->l.block_bytes);
  int rc = 0;
  if (cu.MemcpyHtoD(src->s->base + src->off, hs, src->span) || cu.MemsetD8(dst->s->base + dst->off, 0x5a, dst->span))
    rc = fail("bench: writing the caches");
  double s, d;
  if (rc == 0) rc = wave(src, dst, sids, dids, n, 1, 1, 0, false, node, path, &s, &d); /* warm-up */
  for (int r = 0; r < reps && rc == 0; r++) {
    rc = wave(src, dst, sids, dids, n, 1, 1, 0, false, node, path, &v[0][r], &v[1][r]);
    if (rc == 0) rc = wave(src, dst, sids, dids, n, 1, 32, 0, false, node, path, &s, &v[2][r]);
    if (rc == 0) rc = wave(src, dst, sids, dids, n, 1, 32, KVF_NOWAIT, false, node, path, &s, &v[5][r]);
    if (rc == 0) rc = wave(src, dst, sids, dids, n, 4, 1, 0, false, node, path, &s, &v[3][r]);
    v[4][r] = s;
    /* the same with every call not waiting (issue 16's submission) */
    if (rc == 0) rc = wave(src, dst, sids, dids, n, 1, 1, 0, true, node, path, &v[6][r], &v[7][r]);
    if (rc == 0) rc = wave(src, dst, sids, dids, n, 1, 32, 0, true, node, path, &s, &v[8][r]);
    if (rc == 0) rc = wave(src, dst, sids, dids, n, 4, 1, 0, true, node, path, &s, &v[9][r]);
  }
  if (rc == 0 && cu.MemcpyDtoH(got, dst->s->base + dst->off, dst->span)) rc = fail("bench: reading back");
  if (rc == 0 && memcmp(got, want, dst->span) != 0) rc = fail("bench: the receiver's cache differs");
  if (rc == 0) {
    double send = gt_median(v[0], reps), whole = gt_median(v[1], reps), p32 = gt_median(v[2], reps), w4 = gt_median(v[3], reps);
    double p32nw = gt_median(v[5], reps);
    printf("{\"what\": \"blocks_daemon\", \"path\": \"%s\", \"bytes\": %" PRIu64 ", \"blocks\": %zu, "
           "\"send_call_us_p50\": %.1f, \"whole_us_p50\": %.1f, \"whole_gbps\": %.1f, \"parts32_us_p50\": %.1f, "
           "\"parts32_vs_whole\": %.3f, \"parts32_nowait_us_p50\": %.1f, \"parts32_nowait_vs_whole\": %.3f, "
           "\"inflight4_us_p50\": %.1f, \"inflight4_gbps\": %.1f, "
           "\"inflight4_send_calls_us_p50\": %.1f, \"verified\": true}\n",
           path, bytes, n, send, whole, (double)bytes / whole / 1e3, p32, whole / p32, p32nw, whole / p32nw, w4,
           4.0 * (double)bytes / w4 / 1e3, gt_median(v[4], reps));
    double nw_whole = gt_median(v[7], reps), nw_p32 = gt_median(v[8], reps), nw_w4 = gt_median(v[9], reps);
    printf("{\"what\": \"blocks_daemon_nowait\", \"path\": \"%s\", \"bytes\": %" PRIu64 ", \"blocks\": %zu, "
           "\"send_call_us_p50\": %.1f, \"whole_us_p50\": %.1f, \"whole_gbps\": %.1f, \"parts32_us_p50\": %.1f, "
           "\"parts32_vs_whole\": %.3f, \"inflight4_us_p50\": %.1f, \"inflight4_gbps\": %.1f, \"verified\": true}\n",
           path, bytes, n, gt_median(v[6], reps), nw_whole, (double)bytes / nw_whole / 1e3, nw_p32, nw_whole / nw_p32,
           nw_w4, 4.0 * (double)bytes / nw_w4 / 1e3);
  }
  free(hs);
  free(want);
  free(got);
  for (int k = 0; k < NV; k++) free(v[k]);
  return rc;
}

int main(int argc, char **argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: gpu_blocks_client SOCKET NODE SRC_POOL DST_POOL PATH\n");
    return 2;
  }
  if (gt_load_driver(&cu)) return 77;
  side s, d;
  if (side_open(&s, argv[1], argv[3]) || side_open(&d, argv[1], argv[4])) return 1;
  CUdevice dev;
  CUcontext ctx;
  if (cu.DeviceGet(&dev, atoi(s.pi.kind + 5)) || cu.DevicePrimaryCtxRetain(&ctx, dev) || cu.CtxSetCurrent(ctx))
    return fail("no CUDA context on %s", s.pi.kind) ? 1 : 1;
  cache s32, d32, s4, d4;
  int rc = cache_new(&s32, &s, 0, 256, 32768, false);
  if (rc == 0) rc = cache_new(&d32, &d, 0, 256, 32768, true);
  if (rc == 0) rc = cache_new(&s4, &s, 512 * MIB, 1024, 4096, false);
  if (rc == 0) rc = cache_new(&d4, &d, 512 * MIB, 1024, 4096, true);
  if (rc == 0) rc = handoff("llama3-8b-whole", &s32, &d32, 256, false, argv[2], argv[5]);
  if (rc == 0) rc = handoff("llama3-8b-parts", &s32, &d32, 200, true, argv[2], argv[5]);
  if (rc == 0) rc = handoff("4k-1000-whole", &s4, &d4, 1000, false, argv[2], argv[5]);
  if (rc == 0 && argc > 7 && strcmp(argv[6], "bench") == 0) rc = bench(&s32, &d32, argv[2], argv[5], atoi(argv[7]) > 0 ? atoi(argv[7]) : 20);
  cu.DevicePrimaryCtxRelease(dev);
  kvf_close(s.c);
  kvf_close(d.c);
  return rc ? 1 : 0;
}
