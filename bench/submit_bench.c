/* submit_bench - how long the send calls take to return (issue 16), against
 * running daemons: the prefill client on --from, the decode client on --to
 * (the same socket: the local path; two peered daemons: tcp or rdma).
 *
 *   part   one layer part: kvf_send_blocks of one layer of 8 blocks with
 *          KVF_SEND_MORE (but the last), every layer of a request back to
 *          back, KVF_NOWAIT against waiting for the daemon's answer, the
 *          requests alternating between the two (same run, same daemons);
 *   batch  the parts of 16 requests x 32 layers (512 parts) in one
 *          kvf_submit, against the same 512 parts as 512 waiting calls;
 *          batch-done: from that call to the last RECV_DONE taken.
 *
 *   handoff  (--handoffs N, instead of the two above) one layer of 8 blocks
 *          granted, then sent in one part with KVF_NOWAIT: from the send
 *          call to RECV_DONE taken by kvf_wait_events on the decode client,
 *          whose $KVFERRY_SPIN_US (read at connect) is its spinning.
 *
 * Every request's grant (kvf_grant_blocks) is posted before its parts; its
 * source blocks hold fresh random bytes and its destination blocks poison;
 * after both DONE events every byte of every block is compared.
 *
 *   submit-bench --from SOCK --to SOCK [--reps N] [--batches N]
 *                [--block-bytes B] [--pool NAME] [--pool-to NAME] [--handoffs N]
 *
 * Defaults: 64 requests per mode (part), 16 batches per mode, 4 KiB blocks
 * (the call's cost does not depend on them; 32 KiB is llama3-8b's K or V
 * of a 16-token block), pool "kv" on both sides (--pool-to: the decode
 * side's; one daemon needs two): each needs 2 x 32 x 128 x block bytes
 * (32 MiB at 4 KiB). Prints one JSON line per mode and api:
 * the call's return time p50/p90/p99/max in us (part: per call; batch: per
 * kvf_submit of 512, or the sum of the 512 waiting calls). */
#include "kvferry.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LAYERS 32u
#define PER_REQ 8u           /* blocks per request */
#define REQS 16u             /* requests per batch */
#define NB (REQS * PER_REQ)  /* blocks per region */
#define POISON 0xA5

typedef struct side {
  kvf_client *c;
  uint8_t *base;
  uint64_t size;
  uint32_t pool, layout;
  const char *node;
} side;

typedef struct bench {
  side src, dst;
  uint64_t bb;
  uint64_t seed;
  uint32_t seq;
} bench;

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int die(const char *what, int rc) {
  fprintf(stderr, "submit-bench: %s: %s (%s)\n", what, kvf_strerror(rc), kvf_err_name(rc));
  exit(1);
}

static uint64_t rnd(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static uint64_t region_off(const bench *b, uint32_t r) { return (uint64_t)r * NB * b->bb; }

static void setup_side(bench *b, side *s, const char *sock, const char *pool) {
  int rc = kvf_connect(sock, &s->c);
  if (rc) die(sock, rc);
  kvf_pool_info pi;
  if ((rc = kvf_pool_find(s->c, pool, &pi)) != 0) die("kvf_pool_find", rc);
  void *addr;
  if ((rc = kvf_pool_map(s->c, pi.id, &addr, &s->size)) != 0) die("kvf_pool_map", rc);
  s->base = addr;
  s->pool = pi.id;
  s->node = kvf_node(s->c);
  if (2ull * LAYERS * NB * b->bb > s->size) {
    fprintf(stderr, "submit-bench: pool %s of %" PRIu64 " bytes is smaller than %" PRIu64 "\n", pool, s->size,
            (uint64_t)(2ull * LAYERS * NB * b->bb));
    exit(1);
  }
  uint64_t offs[2 * LAYERS];
  for (uint32_t r = 0; r < 2 * LAYERS; r++) offs[r] = region_off(b, r);
  kvf_layout l = {.pool = s->pool, .n_layers = LAYERS, .n_kv = 2, .n_blocks = NB, .block_bytes = b->bb,
                  .block_stride = b->bb, .offsets = offs};
  if ((rc = kvf_layout_register(s->c, &l, &s->layout)) != 0) die("kvf_layout_register", rc);
}

/* Request q's blocks: source q*8.., destination the mirror image. */
static void req_ids(uint32_t q, uint32_t *src, uint32_t *dst) {
  for (uint32_t i = 0; i < PER_REQ; i++) {
    src[i] = q * PER_REQ + i;
    dst[i] = NB - 1 - (q * PER_REQ + i);
  }
}

/* Fresh bytes in requests [0, n)'s source blocks, poison in their
 * destination blocks. */
static void prepare(bench *b, uint32_t n) {
  uint32_t src[PER_REQ], dst[PER_REQ];
  for (uint32_t q = 0; q < n; q++) {
    req_ids(q, src, dst);
    for (uint32_t r = 0; r < 2 * LAYERS; r++)
      for (uint32_t i = 0; i < PER_REQ; i++) {
        uint64_t *p = (uint64_t *)(b->src.base + region_off(b, r) + src[i] * b->bb);
        for (uint64_t w = 0; w < b->bb / 8; w++) p[w] = rnd(&b->seed);
        memset(b->dst.base + region_off(b, r) + dst[i] * b->bb, POISON, b->bb);
      }
  }
}

static void verify(bench *b, uint32_t n) {
  uint32_t src[PER_REQ], dst[PER_REQ];
  for (uint32_t q = 0; q < n; q++) {
    req_ids(q, src, dst);
    for (uint32_t r = 0; r < 2 * LAYERS; r++)
      for (uint32_t i = 0; i < PER_REQ; i++)
        if (memcmp(b->src.base + region_off(b, r) + src[i] * b->bb,
                   b->dst.base + region_off(b, r) + dst[i] * b->bb, b->bb) != 0) {
          fprintf(stderr, "submit-bench: request %u region %u block %u -> %u: bytes differ\n", q, r, src[i],
                  dst[i]);
          exit(1);
        }
  }
}

/* Waits for n DONE events of type on c, every one a success. */
static void wait_done(kvf_client *c, int type, uint32_t n) {
  kvf_event ev[64];
  uint32_t got = 0;
  while (got < n) {
    int k = kvf_wait_events(c, ev, 64, 30000);
    if (k < 0) die("kvf_wait_events", k);
    if (k == 0) {
      fprintf(stderr, "submit-bench: %u of %u events after 30 s\n", got, n);
      exit(1);
    }
    for (int i = 0; i < k; i++) {
      if (ev[i].type != type) continue;
      if (ev[i].status) {
        fprintf(stderr, "submit-bench: %s: %s (%s)\n", ev[i].xfer_id, kvf_err_name(ev[i].status), ev[i].error);
        exit(1);
      }
      got++;
    }
  }
}

static void grant_all(bench *b, uint32_t n, char ids[][32]) {
  kvf_sub subs[REQS];
  kvf_blocks blk[REQS];
  uint32_t src[REQS][PER_REQ], dst[REQS][PER_REQ];
  for (uint32_t q = 0; q < n; q++) {
    snprintf(ids[q], 32, "sb-%u", ++b->seq);
    req_ids(q, src[q], dst[q]);
    blk[q] = (kvf_blocks){.layout = b->dst.layout, .ids = dst[q], .n = PER_REQ};
    subs[q] = (kvf_sub){.op = KVF_SUB_GRANT_BLOCKS, .xfer_id = ids[q], .node = b->src.node, .blocks = &blk[q]};
  }
  int err = 0, rc = kvf_submit(b->dst.c, subs, n, 0, &err);
  if (rc != (int)n) die("kvf_submit (grants)", rc < 0 ? rc : err);
  /* A round trip behind them: the decode daemon has taken the grants
   * (an engine grants ahead, on another node), so that the calls timed
   * next do not share the CPU with that work (2-core machines). */
  kvf_pool_info pi;
  if ((rc = kvf_pools(b->dst.c, &pi, 1)) < 0) die("kvf_pools", rc);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void report(const char *mode, const char *api, double *v, size_t n, uint32_t parts) {
  qsort(v, n, sizeof(*v), cmp_double);
  double p50 = v[n / 2], p90 = v[n * 9 / 10], p99 = v[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1];
  printf("{\"mode\": \"%s\", \"api\": \"%s\", \"parts_per_call\": %u, \"samples\": %zu, \"p50_us\": %.2f, "
         "\"p90_us\": %.2f, \"p99_us\": %.2f, \"max_us\": %.2f}\n",
         mode, api, parts, n, p50, p90, p99, v[n - 1]);
  fflush(stdout);
}

/* One request sent layer by layer, each call timed into t[LAYERS]. */
static void one_request(bench *b, bool nowait, double *t) {
  char ids[1][32];
  prepare(b, 1);
  grant_all(b, 1, ids);
  uint32_t src[PER_REQ], dst[PER_REQ];
  req_ids(0, src, dst);
  for (uint32_t l = 0; l < LAYERS; l++) {
    kvf_blocks blk = {.layout = b->src.layout, .ids = l == 0 ? src : NULL, .n = l == 0 ? PER_REQ : 0,
                      .first_layer = l, .n_layers = 1};
    unsigned flags = (l + 1 < LAYERS ? KVF_SEND_MORE : 0) | (nowait ? KVF_NOWAIT : 0);
    double t0 = now_us();
    int rc = kvf_send_blocks(b->src.c, ids[0], b->dst.node, &blk, flags, 0);
    t[l] = now_us() - t0;
    if (rc) die("kvf_send_blocks", rc);
  }
  wait_done(b->dst.c, KVF_EV_RECV_DONE, 1);
  wait_done(b->src.c, KVF_EV_SEND_DONE, 1);
  verify(b, 1);
}

static void bench_parts(bench *b, uint32_t reps) {
  size_t n = (size_t)reps * LAYERS;
  double *tw = malloc(n * sizeof(double)), *tn = malloc(n * sizeof(double));
  if (!tw || !tn) exit(1);
  for (uint32_t r = 0; r < 2 * reps; r++) one_request(b, r % 2 == 0, (r % 2 == 0 ? tn : tw) + (r / 2) * LAYERS);
  report("part", "nowait", tn, n, 1);
  report("part", "wait", tw, n, 1);
  free(tw);
  free(tn);
}

/* 16 requests' 512 layer parts: one kvf_submit, or 512 waiting calls;
 * *done: from the call to the last RECV_DONE taken. */
static double one_batch(bench *b, bool batched, double *done) {
  char ids[REQS][32];
  prepare(b, REQS);
  grant_all(b, REQS, ids);
  static kvf_sub subs[REQS * LAYERS];
  static kvf_blocks blk[REQS * LAYERS];
  uint32_t src[REQS][PER_REQ], dst[PER_REQ];
  size_t k = 0;
  for (uint32_t l = 0; l < LAYERS; l++)
    for (uint32_t q = 0; q < REQS; q++, k++) {
      if (l == 0) req_ids(q, src[q], dst);
      blk[k] = (kvf_blocks){.layout = b->src.layout, .ids = l == 0 ? src[q] : NULL, .n = l == 0 ? PER_REQ : 0,
                            .first_layer = l, .n_layers = 1};
      subs[k] = (kvf_sub){.op = KVF_SUB_SEND_BLOCKS, .xfer_id = ids[q], .node = b->dst.node, .blocks = &blk[k],
                          .flags = l + 1 < LAYERS ? KVF_SEND_MORE : 0};
    }
  double t0 = now_us();
  if (batched) {
    int err = 0, rc = kvf_submit(b->src.c, subs, k, 0, &err);
    if (rc != (int)k) die("kvf_submit (parts)", rc < 0 ? rc : err);
  } else {
    for (size_t i = 0; i < k; i++) {
      int rc = kvf_send_blocks(b->src.c, subs[i].xfer_id, subs[i].node, subs[i].blocks, subs[i].flags, 0);
      if (rc) die("kvf_send_blocks", rc);
    }
  }
  double t = now_us() - t0;
  wait_done(b->dst.c, KVF_EV_RECV_DONE, REQS);
  *done = now_us() - t0;
  wait_done(b->src.c, KVF_EV_SEND_DONE, REQS);
  verify(b, REQS);
  return t;
}

static void bench_batches(bench *b, uint32_t reps) {
  double *tb = malloc(reps * sizeof(double)), *tw = malloc(reps * sizeof(double));
  double *db = malloc(reps * sizeof(double)), *dw = malloc(reps * sizeof(double));
  if (!tb || !tw || !db || !dw) exit(1);
  for (uint32_t r = 0; r < 2 * reps; r++) {
    double done, t = one_batch(b, r % 2 == 0, &done);
    (r % 2 == 0 ? tb : tw)[r / 2] = t;
    (r % 2 == 0 ? db : dw)[r / 2] = done;
  }
  report("batch", "submit", tb, reps, REQS * LAYERS);
  report("batch", "wait", tw, reps, REQS * LAYERS);
  report("batch-done", "submit", db, reps, REQS * LAYERS);
  report("batch-done", "wait", dw, reps, REQS * LAYERS);
  free(tb);
  free(tw);
  free(db);
  free(dw);
}

/* Handoff: one layer of 8 blocks granted, then sent in one part (with
 * KVF_NOWAIT); from the send call to RECV_DONE taken by kvf_wait_events on
 * the decode client ($KVFERRY_SPIN_US of that client: its spinning). */
static double one_handoff(bench *b) {
  char ids[1][32];
  uint32_t src[PER_REQ], dst[PER_REQ];
  req_ids(0, src, dst);
  prepare(b, 1);
  snprintf(ids[0], 32, "sh-%u", ++b->seq);
  kvf_blocks g = {.layout = b->dst.layout, .ids = dst, .n = PER_REQ, .first_layer = 0, .n_layers = 1};
  int rc = kvf_grant_blocks(b->dst.c, ids[0], b->src.node, &g, 0, 0);
  if (rc) die("kvf_grant_blocks", rc);
  kvf_pool_info pi;
  if ((rc = kvf_pools(b->dst.c, &pi, 1)) < 0) die("kvf_pools", rc);
  kvf_blocks s = {.layout = b->src.layout, .ids = src, .n = PER_REQ, .first_layer = 0, .n_layers = 1};
  double t0 = now_us();
  if ((rc = kvf_send_blocks(b->src.c, ids[0], b->dst.node, &s, KVF_NOWAIT, 0)) != 0) die("kvf_send_blocks", rc);
  wait_done(b->dst.c, KVF_EV_RECV_DONE, 1);
  double t = now_us() - t0;
  wait_done(b->src.c, KVF_EV_SEND_DONE, 1);
  for (uint32_t kv = 0; kv < 2; kv++)
    for (uint32_t i = 0; i < PER_REQ; i++)
      if (memcmp(b->src.base + region_off(b, kv) + src[i] * b->bb, b->dst.base + region_off(b, kv) + dst[i] * b->bb,
                 b->bb) != 0) {
        fprintf(stderr, "submit-bench: handoff region %u block %u -> %u: bytes differ\n", kv, src[i], dst[i]);
        exit(1);
      }
  return t;
}

static void bench_handoffs(bench *b, uint32_t reps) {
  double *t = malloc(reps * sizeof(double));
  if (!t) exit(1);
  for (uint32_t r = 0; r < reps; r++) t[r] = one_handoff(b);
  const char *spin = getenv("KVFERRY_SPIN_US");
  char api[48];
  snprintf(api, sizeof(api), "nowait, spin %s us", spin && *spin ? spin : "0");
  report("handoff", api, t, reps, 1);
  free(t);
}

int main(int argc, char **argv) {
  const char *from = NULL, *to = NULL, *pool = "kv", *pool_to = NULL;
  uint32_t reps = 64, batches = 16, handoffs = 0;
  bench b = {.bb = 4096, .seed = 0x9E3779B97F4A7C15ull};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) goto usage;
    if (strcmp(a, "--from") == 0) from = v;
    else if (strcmp(a, "--to") == 0) to = v;
    else if (strcmp(a, "--pool") == 0) pool = v;
    else if (strcmp(a, "--pool-to") == 0) pool_to = v;
    else if (strcmp(a, "--reps") == 0) reps = (uint32_t)strtoul(v, NULL, 10);
    else if (strcmp(a, "--batches") == 0) batches = (uint32_t)strtoul(v, NULL, 10);
    else if (strcmp(a, "--handoffs") == 0) handoffs = (uint32_t)strtoul(v, NULL, 10);
    else if (strcmp(a, "--block-bytes") == 0) b.bb = strtoull(v, NULL, 10);
    else goto usage;
    i++;
  }
  if (!from || !to || reps == 0 || batches == 0 || b.bb == 0 || b.bb % 8) goto usage;
  if (!pool_to) pool_to = pool;
  if (strcmp(from, to) == 0 && strcmp(pool, pool_to) == 0) {
    fprintf(stderr, "submit-bench: one daemon needs two pools (--pool and --pool-to)\n");
    return 2;
  }
  setup_side(&b, &b.src, from, pool);
  setup_side(&b, &b.dst, to, pool_to);
  if (handoffs) {
    bench_handoffs(&b, handoffs);
  } else {
    bench_parts(&b, reps);
    bench_batches(&b, batches);
  }
  kvf_close(b.src.c);
  kvf_close(b.dst.c);
  return 0;
usage:
  fprintf(stderr, "usage: submit-bench --from SOCK --to SOCK [--reps N] [--batches N] [--block-bytes B] "
                  "[--pool NAME] [--pool-to NAME] [--handoffs N]\n");
  return 2;
}
