/* kvferry-bench - hands realistic KV caches from a prefill client of one
 * kvferryd to a decode client of another (or the same) and verifies every
 * byte that arrives.
 *
 * The pools are laid out like a paged KV cache (vLLM): per layer and per K/V
 * an array of num_blocks blocks. A request owns a random set of block ids on
 * each side, so its descriptors are scattered the way a real engine's are,
 * not one contiguous range that would flatter the transport.
 *
 * Only the public API (client/kvferry.h) is used. One thread: both clients'
 * event fds are polled together.
 *
 * --blocks hands the same requests off by layout and block ids
 * (kvf_grant_blocks / kvf_send_blocks) instead of descriptors: each side
 * registers its pool's paged layout once, and the bytes are checked the
 * same way, so both APIs can be compared in one run.
 *
 * --compute-us-per-layer N with --layerwise or --whole emulates prefill:
 * the grant goes first (decode admits the request), then each layer takes
 * N us of "compute" (to absolute deadlines, so waits do not drift); with
 * --layerwise each layer's send part is posted as its compute ends, with
 * --whole the whole request is sent after the last layer. What the decode
 * side still waits for once the compute is over is the exposed time: from
 * the end of the last layer's compute, when its send is due, to RECV_DONE.
 * A last send call that earlier calls made late counts: an engine's GPU
 * would have finished then, whatever its CPU thread was doing. The bench
 * sleeps through a layer's compute but its last millisecond, which it
 * spends awake, as an engine's thread is when a layer ends.
 *
 * cuda:N pools (--pool-from/--pool-to naming one): kvf_pool_map returns a
 * device pointer; the bench keeps a host shadow of the pool, fills and
 * poisons it there, and copies it to the GPU before each wave and back
 * after it (CUDA driver API, loaded with dlopen as the library does), all
 * outside the timed window.
 */
/* getopt_long and CLOCK_MONOTONIC; the Makefile passes it too. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "bench_gpu.h"
#include "bench_hetero.h"
#include "json.h"
#include "kvferry.h"

#define GOLDEN 0x9e3779b97f4a7c15ULL
/* Time allowed past a transfer's deadline for its failure event to arrive;
 * the daemon reports expiry itself, the bench only guards against a hang. */
#define WAIT_MARGIN_MS 5000
/* With --deadline-ms 0 the daemon's default applies; the bench does not know
 * it, so it bounds waits by this instead. */
#define WAIT_DEFAULT_MS 300000
/* Block ids beyond this are not used: the free list is an array of ids and a
 * huge pool of tiny blocks should not cost gigabytes of it. */
#define MAX_BLOCK_IDS (1u << 24)
#define EV_BATCH 64

/* ------------------------------------------------------------ options */

typedef struct geom {
  const char *model;
  uint64_t layers, kv_heads, head_dim, block_tokens, dtype_bytes;
  uint64_t kv_count;  /* 2: separate K and V per layer; 1: one MLA latent */
} geom;

static const geom presets[] = {
  {"llama3-8b", 32, 8, 128, 16, 2, 2},
  {"llama3-70b-tp8", 80, 1, 128, 16, 2, 2},  /* 8 kv heads over 8 GPUs */
  {"deepseek-v3", 61, 1, 576, 64, 2, 1},     /* MLA: 512 latent + 64 rope */
};

typedef struct opts {
  const char *from, *to, *pool_from, *pool_to;
  geom g;
  uint64_t tokens, requests, concurrency, seed;
  uint64_t waves_per_check; /* waves sent back to back before the bench verifies them (default 1) */
  uint32_t deadline_ms;
  bool layerwise, send_first, grant_any, json, quiet;
  bool time_from_send;   /* latency starts at the send (the grant is posted before, untimed) */
  uint32_t grant_lead_ms; /* with it: how long before the send the grant is posted */
  bool busy_poll;         /* wait for events by polling without blocking */
  bool blocks;            /* by layout and block ids, not descriptors */
  bool layer_events;      /* grants ask for KVF_EV_LAYER_DONE (with --blocks) */
  bool whole;             /* with compute: one send after the last layer */
  bool compute;           /* --compute-us-per-layer given: emulate prefill */
  bool nowait;            /* every send call (each part) with KVF_NOWAIT */
  bool window;            /* a check's requests go through a sliding window of --concurrency */
  kvfb_het het;           /* --prefill-tp and the rest: heterogeneous layouts (bench_hetero.c) */
  uint64_t compute_us;    /* per layer */
  bool latency;           /* --latency: the p50 handoff's hops from the daemons' traces */
} opts;

/* ------------------------------------------------------------ state */

typedef struct side {
  const char *role;      /* "prefill" or "decode", for messages */
  const char *sock;
  kvf_client *c;
  const char *node;
  kvf_pool_info pool;
  uint8_t *base;         /* this process's mapping of the pool (the shadow for GPU pools) */
  uint64_t size;
  int gpu;               /* cuda:N pool: N, else -1 */
  uint64_t dptr;         /* its device pointer */
  uint64_t num_blocks;   /* per (layer, K/V) array */
  uint32_t layout;       /* --blocks: the pool's paged layout, registered by this side's client */
  uint32_t *ids;         /* the free list, reshuffled each wave */
  uint64_t rng;
  int fd;
} side;

typedef struct req {
  char id[48];
  uint64_t index;        /* request number in the run */
  const uint32_t *src_ids, *dst_ids;
  kvf_desc *src, *dst;
  int64_t t_post, t_recv;
  int64_t post_ns;       /* spent in the grant and send calls */
  int64_t t_last_send;   /* the last send call was made */
  int64_t t_due;         /* compute mode: the last layer's compute ended (exposed time starts) */
  bool got_recv, got_send;
  uint32_t layers_done;  /* KVF_EV_LAYER_DONE taken */
  uint32_t next_layer;   /* the layer expected next, for the order check */
  uint8_t *layer_seen;   /* per layer: its LAYER_DONE came */
} req;

typedef struct bench {
  opts o;
  side src, dst;
  bool shared;           /* one daemon, one pool: keep src and dst apart */
  uint64_t block_bytes, blocks, ndesc, req_bytes;
  req *slots;            /* one per request of a check (--waves-per-check waves of --concurrency) */
  size_t n_slots;
  req *wave;             /* the wave in flight: slots [wave, wave + n) */
  double kernel_us[2];   /* the decode daemon's GPU time in block copies before and after the run; -1: none */
  double *lat_us;        /* per completed request */
  double *post_us;       /* time in the grant and send calls, per request */
  double *exposed_us;    /* compute mode: compute ended -> RECV_DONE */
  double *late_us;       /* compute mode: compute ended -> the last send call */
  uint64_t layer_events; /* LAYER_DONE events taken and checked */
  bool layers_in_order;  /* every request's layer events came in layer order */
  uint64_t done;
  int64_t timed_ns;
  char path[32];
  char err[768];
  bool failed_verify;
  bool warned_bytes;
} bench;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Records the first error only: later ones are usually its consequences. */
__attribute__((format(printf, 2, 3)))
static int fail(bench *b, const char *fmt, ...) {
  if (b->err[0] == '\0') {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->err, sizeof b->err, fmt, ap);
    va_end(ap);
  }
  return -1;
}

static int fail_api(bench *b, const char *what, int rc) {
  return fail(b, "%s: %s (%s)", what, kvf_err_name(rc), kvf_strerror(rc));
}

/* Takes a double so that a size computed from absurd flags cannot wrap. */
static const char *fmt_size(double v, char buf[32]) {
  static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  size_t u = 0;
  while (v >= 1024 && u + 1 < sizeof units / sizeof units[0]) {
    v /= 1024;
    u++;
  }
  snprintf(buf, 32, u ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

/* ------------------------------------------------------------ data pattern */

/* splitmix64's finalizer: one call per 8 bytes keeps fill and verify far
 * faster than the transfer, and any two (request, descriptor, offset)
 * positions get unrelated bytes, so misplaced data never passes. */
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static uint64_t pattern_key(uint64_t seed, uint64_t r, uint64_t d) {
  return mix64(mix64(mix64(seed + GOLDEN) ^ (r + GOLDEN)) ^ (d * GOLDEN));
}

/* Blocks sit at any byte offset (block_bytes need not be a multiple of 8):
 * memcpy does the unaligned stores. */
static void fill_pattern(uint8_t *p, uint64_t len, uint64_t key) {
  uint64_t s = key, off = 0, v;
  for (; off + 8 <= len; off += 8) {
    s += GOLDEN;
    v = mix64(s);
    memcpy(p + off, &v, 8);
  }
  if (off < len) {
    s += GOLDEN;
    v = mix64(s);
    memcpy(p + off, &v, len - off);
  }
}

static uint64_t first_diff(const uint8_t *a, const uint8_t *b, uint64_t n) {
  uint64_t i = 0;
  while (i < n && a[i] == b[i]) i++;
  return i;
}

/* Returns the offset of the first wrong byte, or len when all are right;
 * *want gets the byte that was expected there. */
static uint64_t check_pattern(const uint8_t *p, uint64_t len, uint64_t key, uint8_t *want) {
  uint64_t s = key, off = 0, v, got;
  for (; off < len; off += 8) {
    uint64_t n = len - off < 8 ? len - off : 8;
    s += GOLDEN;
    v = mix64(s);
    got = v;
    memcpy(&got, p + off, n);
    if (got != v) {
      uint8_t vb[8];
      memcpy(vb, &v, 8);
      uint64_t i = first_diff(p + off, vb, n);
      *want = vb[i];
      return off + i;
    }
  }
  return len;
}

/* A different byte per request: data left over from an earlier request, or
 * never written, cannot match the pattern. 0x9d is odd, so 256 requests
 * pass before a value repeats. */
static uint8_t poison_byte(uint64_t r) {
  return (uint8_t)(0x5bu + 0x9du * (unsigned)(r & 0xff));
}

/* ------------------------------------------------------------ layout */

static uint64_t rng_next(uint64_t *s) {
  *s += GOLDEN;
  return mix64(*s);
}

/* Partial Fisher-Yates: only the first k ids need to be random; the array
 * stays a permutation, so the next wave reshuffles from where this one left. */
static void shuffle_ids(side *s, uint64_t k) {
  for (uint64_t i = 0; i < k; i++) {
    uint64_t j = i + rng_next(&s->rng) % (s->num_blocks - i);
    uint32_t t = s->ids[i];
    s->ids[i] = s->ids[j];
    s->ids[j] = t;
  }
}

static uint64_t desc_offset(const bench *b, const side *s, uint64_t l, uint64_t k, uint32_t id) {
  return ((l * b->o.g.kv_count + k) * s->num_blocks + id) * b->block_bytes;
}

/* Descriptors go layer by layer (then K/V, then block), so --layerwise can
 * send layer l as one contiguous slice of the array. */
static void build_descs(const bench *b, const side *s, const uint32_t *ids, kvf_desc *d) {
  uint64_t i = 0;
  for (uint64_t l = 0; l < b->o.g.layers; l++)
    for (uint64_t k = 0; k < b->o.g.kv_count; k++)
      for (uint64_t j = 0; j < b->blocks; j++, i++) {
        d[i].pool = s->pool.id;
        d[i].offset = desc_offset(b, s, l, k, ids[j]);
        d[i].len = b->block_bytes;
      }
}

/* Assigns blocks to the n requests of a check (its waves) and writes their
 * data: pattern in the sources, poison in the destinations. Outside the
 * timed window. */
static void prepare_check(bench *b, uint64_t first, size_t n) {
  size_t w = b->n_slots;
  shuffle_ids(&b->src, (b->shared ? 2 * w : w) * b->blocks);
  if (!b->shared) shuffle_ids(&b->dst, w * b->blocks);
  for (size_t i = 0; i < n; i++) {
    req *r = &b->slots[i];
    r->index = first + i;
    snprintf(r->id, sizeof r->id, "bench-%ld-%" PRIu64, (long)getpid(), r->index);
    r->src_ids = b->src.ids + i * b->blocks;
    /* Same pool on both ends: the decode blocks come from the second half of
     * the shuffled list, disjoint from every source block of the wave. */
    r->dst_ids = b->shared ? b->src.ids + (w + i) * b->blocks : b->dst.ids + i * b->blocks;
    build_descs(b, &b->src, r->src_ids, r->src);
    build_descs(b, &b->dst, r->dst_ids, r->dst);
    for (uint64_t d = 0; d < b->ndesc; d++) {
      fill_pattern(b->src.base + r->src[d].offset, b->block_bytes,
                   pattern_key(b->o.seed, r->index, d));
      memset(b->dst.base + r->dst[d].offset, poison_byte(r->index), b->block_bytes);
    }
    r->t_post = r->t_recv = r->t_last_send = r->t_due = r->post_ns = 0;
    r->got_recv = r->got_send = false;
    r->layers_done = r->next_layer = 0;
    if (r->layer_seen) memset(r->layer_seen, 0, b->o.g.layers);
  }
}

static int verify_request(bench *b, const req *r) {
  for (uint64_t d = 0; d < b->ndesc; d++) {
    const uint8_t *p = b->dst.base + r->dst[d].offset;
    uint8_t want = 0;
    uint64_t bad = check_pattern(p, b->block_bytes, pattern_key(b->o.seed, r->index, d), &want);
    if (bad == b->block_bytes) continue;
    uint64_t per_layer = b->o.g.kv_count * b->blocks;
    uint64_t k = d % per_layer / b->blocks;
    b->failed_verify = true;
    return fail(b,
                "request %" PRIu64 " (%s): descriptor %" PRIu64 " (layer %" PRIu64
                ", %s, decode block %u, pool offset %" PRIu64 "): byte %" PRIu64
                " is 0x%02x, expected 0x%02x%s",
                r->index, r->id, d, d / per_layer,
                b->o.g.kv_count == 1 ? "latent" : (k ? "V" : "K"),
                r->dst_ids[d % b->blocks], r->dst[d].offset, bad, p[bad], want,
                p[bad] == poison_byte(r->index) ? " (still the poison: never written)" : "");
  }
  return 0;
}

/* ------------------------------------------------------------ setup */

static int pick_pool(bench *b, side *s, const char *name) {
  int rc;
  if (name) {
    rc = kvf_pool_find(s->c, name, &s->pool);
    if (rc < 0)
      return fail(b, "pool '%s' on %s node %s: %s (%s)", name, s->role, s->node,
                  kvf_err_name(rc), kvf_strerror(rc));
    return 0;
  }
  kvf_pool_info *pools = NULL;
  int n = 0;
  for (size_t cap = 16;; cap = (size_t)n) {
    kvf_pool_info *p = realloc(pools, cap * sizeof *p);
    if (!p) { free(pools); return fail(b, "out of memory"); }
    pools = p;
    if ((n = kvf_pools(s->c, pools, cap)) < 0) { free(pools); return fail_api(b, "kvf_pools", n); }
    if ((size_t)n <= cap) break;
  }
  for (int i = 0; i < n; i++)
    if (strcmp(pools[i].kind, "host") == 0) {
      s->pool = pools[i];
      free(pools);
      return 0;
    }
  free(pools);
  return fail(b, "%s node %s has no pool of kind \"host\" (name one with --pool-%s)",
              s->role, s->node, s == &b->src ? "from" : "to");
}

static int open_side(bench *b, side *s, const char *pool_name) {
  int rc = kvf_connect(s->sock, &s->c);
  if (rc < 0)
    return fail(b, "connect to %s daemon at %s: %s (%s)", s->role, s->sock, kvf_err_name(rc),
                kvf_strerror(rc));
  s->node = kvf_node(s->c);
  if (pick_pool(b, s, pool_name) < 0) return -1;
  void *addr = NULL;
  rc = kvf_pool_map(s->c, s->pool.id, &addr, &s->size);
  if (rc < 0)
    return fail(b, "map pool '%s' (kind %s) of %s node %s: %s (%s)", s->pool.name, s->pool.kind, s->role,
                s->node, kvf_err_name(rc), kvf_strerror(rc));
  s->gpu = -1;
  if (strncmp(s->pool.kind, "cuda:", 5) == 0) {
    s->gpu = atoi(s->pool.kind + 5);
    s->dptr = (uint64_t)(uintptr_t)addr;
    addr = calloc(1, s->size);
    if (!addr) return fail(b, "out of memory for the host shadow of pool '%s'", s->pool.name);
  }
  s->base = addr;
  s->fd = kvf_event_fd(s->c);
  if (s->fd < 0) return fail_api(b, "kvf_event_fd", s->fd);
  return 0;
}

/* --blocks: the paged layout of size_side as a kvf_layout (region r =
 * layer * kv + k starts at r * num_blocks blocks), registered by this
 * side's client. */
static int register_layout(bench *b, side *s) {
  const geom *g = &b->o.g;
  uint64_t n = g->layers * g->kv_count;
  uint64_t *off = malloc(n * sizeof *off);
  if (!off) return fail(b, "out of memory");
  for (uint64_t r = 0; r < n; r++) off[r] = r * s->num_blocks * b->block_bytes;
  kvf_layout l = {.pool = s->pool.id, .n_layers = (uint32_t)g->layers, .n_kv = (uint32_t)g->kv_count,
                  .n_blocks = (uint32_t)s->num_blocks, .block_bytes = b->block_bytes,
                  .block_stride = b->block_bytes, .offsets = off,
                  .tokens_per_block = (uint32_t)g->block_tokens, .kv_heads = (uint32_t)g->kv_heads,
                  .head_dim = (uint32_t)g->head_dim, .dtype_bytes = (uint32_t)g->dtype_bytes,
                  .order = KVF_LAYOUT_NHD};
  int rc = kvf_layout_register(s->c, &l, &s->layout);
  free(off);
  if (rc < 0) {
    char what[160];
    snprintf(what, sizeof what, "kvf_layout_register (pool '%s' of %s node %s)", s->pool.name, s->role,
             s->node);
    return fail_api(b, what, rc);
  }
  return 0;
}

/* Fits the paged layout into the pool, or says how big a pool is needed. */
static int size_side(bench *b, side *s, uint64_t need_blocks) {
  uint64_t per_id = b->o.g.layers * b->o.g.kv_count * b->block_bytes;
  s->num_blocks = s->size / per_id;
  if (s->num_blocks > MAX_BLOCK_IDS) s->num_blocks = MAX_BLOCK_IDS;
  if (s->num_blocks < need_blocks) {
    char have[32], need[32];
    return fail(b,
                "pool '%s' of %s node %s is too small: %s holds %" PRIu64 " blocks of %" PRIu64
                " layers x %" PRIu64 " x %" PRIu64 " B; %zu requests of a check%s x %" PRIu64
                " blocks need a pool of at least %s (or lower --tokens / --concurrency / --waves-per-check)",
                s->pool.name, s->role, s->node, fmt_size((double)s->size, have), s->num_blocks,
                b->o.g.layers, b->o.g.kv_count, b->block_bytes, b->n_slots,
                b->shared ? " x 2 (same pool sends and receives)" : "", b->blocks,
                fmt_size((double)need_blocks * (double)per_id, need));
  }
  s->ids = malloc(s->num_blocks * sizeof *s->ids);
  if (!s->ids) return fail(b, "out of memory");
  for (uint64_t i = 0; i < s->num_blocks; i++) s->ids[i] = (uint32_t)i;
  return 0;
}

static int setup(bench *b) {
  const geom *g = &b->o.g;
  b->block_bytes = g->block_tokens * g->kv_heads * g->head_dim * g->dtype_bytes;
  b->blocks = (b->o.tokens + g->block_tokens - 1) / g->block_tokens;
  b->ndesc = g->layers * g->kv_count * b->blocks;
  b->req_bytes = b->ndesc * b->block_bytes;
  b->src = (side){.role = "prefill", .sock = b->o.from, .fd = -1, .gpu = -1,
                  .rng = mix64(b->o.seed ^ 0x707265666c6c ^ GOLDEN)};
  b->dst = (side){.role = "decode", .sock = b->o.to, .fd = -1, .gpu = -1,
                  .rng = mix64(b->o.seed ^ 0x6465636f6465 ^ (GOLDEN << 1))};
  if (open_side(b, &b->src, b->o.pool_from) < 0 || open_side(b, &b->dst, b->o.pool_to) < 0)
    return -1;
  /* Node names are unique in a cluster: same node and pool id means the
   * same memory, mapped twice. */
  b->shared = strcmp(b->src.node, b->dst.node) == 0 && b->src.pool.id == b->dst.pool.id;
  if (b->shared && b->dst.gpu >= 0) { /* one pool: one shadow */
    free(b->dst.base);
    b->dst.base = b->src.base;
  }
  b->n_slots = (size_t)(b->o.concurrency * b->o.waves_per_check);
  uint64_t need = b->n_slots * b->blocks;
  if (size_side(b, &b->src, b->shared ? 2 * need : need) < 0) return -1;
  if (!b->shared && size_side(b, &b->dst, need) < 0) return -1;
  if (b->shared) b->dst.num_blocks = b->src.num_blocks;
  if (b->o.blocks && (register_layout(b, &b->src) < 0 || register_layout(b, &b->dst) < 0)) return -1;
  size_t w = b->n_slots;
  b->slots = calloc(w, sizeof *b->slots);
  b->lat_us = calloc((size_t)b->o.requests, sizeof *b->lat_us);
  b->post_us = calloc((size_t)b->o.requests, sizeof *b->post_us);
  b->exposed_us = calloc((size_t)b->o.requests, sizeof *b->exposed_us);
  b->late_us = calloc((size_t)b->o.requests, sizeof *b->late_us);
  if (!b->slots || !b->lat_us || !b->post_us || !b->exposed_us || !b->late_us) return fail(b, "out of memory");
  for (size_t i = 0; i < w; i++) {
    b->slots[i].src = malloc(b->ndesc * sizeof(kvf_desc));
    b->slots[i].dst = malloc(b->ndesc * sizeof(kvf_desc));
    if (!b->slots[i].src || !b->slots[i].dst) return fail(b, "out of memory");
    if (b->o.layer_events && !(b->slots[i].layer_seen = calloc(g->layers, 1))) return fail(b, "out of memory");
  }
  b->layers_in_order = true;
  /* The emulated compute waits to absolute deadlines; the default 50 us
   * of timer slack would add to every layer. */
  if (b->o.compute) prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  return 0;
}

static void teardown(bench *b) {
  if (b->slots)
    for (size_t i = 0; i < b->n_slots; i++) {
      free(b->slots[i].src);
      free(b->slots[i].dst);
      free(b->slots[i].layer_seen);
    }
  free(b->slots);
  free(b->lat_us);
  free(b->post_us);
  free(b->exposed_us);
  free(b->late_us);
  free(b->src.ids);
  free(b->dst.ids);
  if (b->src.gpu >= 0) free(b->src.base);
  if (b->dst.gpu >= 0 && !b->shared) free(b->dst.base);
  /* Closing cancels whatever a failed run left in flight. */
  if (b->src.c) kvf_close(b->src.c);
  if (b->dst.c) kvf_close(b->dst.c);
}

/* ------------------------------------------------------------ transfers */

static int drain_both(bench *b, size_t n);
static void latency_note(const bench *b, const req *r); /* --latency */

/* Adds the time of one API call to the request's posting cost. */
static void count_call(req *r, int64_t t0) { r->post_ns += now_ns() - t0; }

static int post_grant(bench *b, req *r) {
  const char *src_node = b->o.grant_any ? NULL : b->src.node;
  int64_t t0 = now_ns();
  int rc;
  if (b->o.blocks) {
    kvf_blocks blk = {.layout = b->dst.layout, .ids = r->dst_ids, .n = b->blocks};
    rc = kvf_grant_blocks(b->dst.c, r->id, src_node, &blk, b->o.layer_events ? KVF_GRANT_LAYER_EVENTS : 0,
                          b->o.deadline_ms);
  } else {
    rc = kvf_grant(b->dst.c, r->id, src_node, r->dst, b->ndesc, b->o.deadline_ms);
  }
  count_call(r, t0);
  if (rc < 0) {
    char what[160];
    snprintf(what, sizeof what, "%s(%s) on decode node %s", b->o.blocks ? "kvf_grant_blocks" : "kvf_grant",
             r->id, b->dst.node);
    return fail_api(b, what, rc);
  }
  return 0;
}

/* Part l of parts: layers [l * per, (l + 1) * per) of the request. By
 * blocks, the first part names the ids and later ones continue with them. */
static int send_part(bench *b, req *r, uint64_t l, uint64_t parts) {
  unsigned flags = l + 1 < parts ? KVF_SEND_MORE : 0;
  if (b->o.nowait) flags |= KVF_NOWAIT; /* refusals come in SEND_DONE */
  int64_t t0 = now_ns();
  if (!(flags & KVF_SEND_MORE)) r->t_last_send = t0;
  int rc;
  if (b->o.blocks) {
    uint64_t per = b->o.g.layers / parts;
    kvf_blocks blk = {.layout = b->src.layout, .ids = l ? NULL : r->src_ids, .n = l ? 0 : b->blocks,
                      .first_layer = (uint32_t)(l * per), .n_layers = (uint32_t)per};
    rc = kvf_send_blocks(b->src.c, r->id, b->dst.node, &blk, flags, b->o.deadline_ms);
  } else {
    uint64_t per = b->ndesc / parts;
    rc = kvf_send(b->src.c, r->id, b->dst.node, r->src + l * per, per, flags, b->o.deadline_ms);
  }
  count_call(r, t0);
  if (rc < 0) {
    char what[200];
    snprintf(what, sizeof what, "%s(%s, part %" PRIu64 "/%" PRIu64 ") to node %s",
             b->o.blocks ? "kvf_send_blocks" : "kvf_send", r->id, l + 1, parts, b->dst.node);
    return fail_api(b, what, rc);
  }
  return 0;
}

/* The last stretch of a layer's emulated compute that the bench spends
 * awake (polling for events without sleeping), as an engine's thread is
 * when a layer ends: it is launching the next layer and waits on the GPU
 * by spinning (CUDA's default where cores outnumber GPUs). Slept through
 * instead, the compute would end at a timer's wake-up: 120-170 us late
 * after a 57.7 ms layer on the GPU host (bench/RESULTS.md), the
 * emulator's own delay, not the transfer's. */
#define COMPUTE_AWAKE_NS 1000000

/* Emulated compute until the absolute time `until`: the bench keeps taking
 * the events of earlier requests meanwhile, so their RECV_DONE is timed
 * when it comes, not when this request's compute ends. */
static int compute_until(bench *b, size_t n, int64_t until) {
  for (;;) {
    int64_t left = until - now_ns();
    if (left <= 0) return 0;
    if (!b->o.busy_poll && left > COMPUTE_AWAKE_NS) {
      left -= COMPUTE_AWAKE_NS;
      struct pollfd pf[2] = {{.fd = b->dst.fd, .events = POLLIN}, {.fd = b->src.fd, .events = POLLIN}};
      struct timespec ts = {left / 1000000000, left % 1000000000};
      if (ppoll(pf, 2, &ts, NULL) < 0 && errno != EINTR) return fail(b, "ppoll: %s", strerror(errno));
    }
    if (drain_both(b, n) < 0) return -1;
  }
}

/* One send, or with --layerwise one part per layer as an engine would post
 * them while the forward pass produces each layer's KV. With
 * --compute-us-per-layer each layer's compute ends at t0 + (l + 1) * N us. */
static int post_send(bench *b, req *r, size_t n) {
  uint64_t layers = b->o.g.layers, parts = b->o.layerwise ? layers : 1;
  int64_t t0 = now_ns(), step = (int64_t)b->o.compute_us * 1000;
  for (uint64_t l = 0; l < parts; l++) {
    if (b->o.compute) {
      uint64_t upto = b->o.layerwise ? l + 1 : layers; /* whole: after every layer */
      r->t_due = t0 + (int64_t)upto * step;
      if (compute_until(b, n, r->t_due) < 0) return -1;
    }
    if (send_part(b, r, l, parts) < 0) return -1;
  }
  return 0;
}

/* granted: run_wave posted r's grant already (--time-from-send with
 * several in flight). */
static int post_request(bench *b, req *r, size_t n, bool granted) {
  r->t_post = now_ns();
  int rc;
  if (b->o.time_from_send || b->o.compute) { /* decode posted its grant ahead, as engines do */
    if (!granted && post_grant(b, r) < 0) return -1;
    /* An engine grants when it admits the request, a whole prefill before
     * the send: the grant is in place (windows bound, pushed to the
     * sender) and only the handoff is timed. Meanwhile the prefill engine
     * computes: with --busy-poll this thread stays busy (as an engine
     * whose CUDA synchronisation spins), without it sleeps in poll. */
    uint32_t lead = b->o.grant_lead_ms;
    if (lead && compute_until(b, n, now_ns() + (int64_t)lead * 1000000) < 0) return -1;
    if (b->o.time_from_send) {
      r->t_post = now_ns();
      r->post_ns = 0; /* the send calls only */
    }
    rc = post_send(b, r, n);
  } else if (b->o.send_first) rc = post_send(b, r, n) < 0 || post_grant(b, r) < 0 ? -1 : 0;
  else rc = post_grant(b, r) < 0 || post_send(b, r, n) < 0 ? -1 : 0;
  return rc;
}

static req *find_req(bench *b, size_t n, const char *id) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(b->wave[i].id, id) == 0) return &b->wave[i];
  return NULL;
}

static void note_path(bench *b, const char *path) {
  if (b->path[0] == '\0')
    snprintf(b->path, sizeof b->path, "%s", path[0] ? path : "unknown");
  else if (path[0] && strcmp(b->path, path) != 0)
    snprintf(b->path, sizeof b->path, "mixed");
}

/* KVF_EV_LAYER_DONE (--layer-events): each layer once, before RECV_DONE. */
static int handle_layer(bench *b, req *r, const kvf_event *ev) {
  if (!b->o.layer_events) return fail(b, "LAYER_DONE for %s, whose grant asked for none", r->id);
  if (ev->layer >= b->o.g.layers)
    return fail(b, "LAYER_DONE for %s names layer %u of %" PRIu64, r->id, ev->layer, b->o.g.layers);
  if (r->got_recv) return fail(b, "LAYER_DONE (layer %u) for %s after its RECV_DONE", ev->layer, r->id);
  if (r->layer_seen[ev->layer]) return fail(b, "a second LAYER_DONE for layer %u of %s", ev->layer, r->id);
  r->layer_seen[ev->layer] = 1;
  /* Layers may land out of order (parts may come in any order, tcp streams
   * race); counted, not failed. */
  if (ev->layer != r->next_layer) b->layers_in_order = false;
  r->next_layer = ev->layer + 1;
  r->layers_done++;
  b->layer_events++;
  return 0;
}

static int handle_event(bench *b, side *s, size_t n, const kvf_event *ev, int64_t t) {
  int want = s == &b->dst ? KVF_EV_RECV_DONE : KVF_EV_SEND_DONE;
  const char *name = ev->type == KVF_EV_RECV_DONE ? "RECV_DONE"
                     : ev->type == KVF_EV_SEND_DONE ? "SEND_DONE"
                     : ev->type == KVF_EV_LAYER_DONE ? "LAYER_DONE" : "unknown event";
  req *r = find_req(b, n, ev->xfer_id);
  if (!r) return fail(b, "%s for unknown transfer '%s' on the %s client", name, ev->xfer_id, s->role);
  if (ev->type == KVF_EV_LAYER_DONE && ev->status == 0 && s == &b->dst) return handle_layer(b, r, ev);
  if (ev->status != 0)
    return fail(b, "%s %s on %s node %s (peer %s, path %s): %s (%s)%s%s", r->id, name, s->role,
                s->node, ev->peer, ev->path, kvf_err_name(ev->status), kvf_strerror(ev->status),
                ev->error[0] ? ": " : "", ev->error);
  if (ev->type != want)
    return fail(b, "unexpected %s for %s on the %s client", name, r->id, s->role);
  bool *got = want == KVF_EV_RECV_DONE ? &r->got_recv : &r->got_send;
  if (*got) return fail(b, "a second %s for %s", name, r->id);
  *got = true;
  if (want == KVF_EV_RECV_DONE) {
    r->t_recv = t;
    note_path(b, ev->path);
    if (b->o.layer_events && r->layers_done != b->o.g.layers)
      return fail(b, "RECV_DONE for %s after %u LAYER_DONE events of %" PRIu64, r->id, r->layers_done,
                  b->o.g.layers);
  }
  /* Every byte is verified anyway; a wrong count is the daemon's
   * bookkeeping, worth one warning, not a failed run. */
  if (ev->bytes != b->req_bytes && !b->o.quiet && !b->warned_bytes) {
    b->warned_bytes = true;
    fprintf(stderr, "kvferry-bench: warning: %s %s reports %" PRIu64 " bytes, expected %" PRIu64 "\n",
            r->id, name, ev->bytes, b->req_bytes);
  }
  return 0;
}

/* Takes every waiting event of one client; the first call may wait up to
 * ms for one (kvf_wait_events: with $KVFERRY_SPIN_US it spins first). */
static int take_events(bench *b, side *s, size_t n, int ms) {
  kvf_event ev[EV_BATCH];
  for (;; ms = 0) {
    int got = kvf_wait_events(s->c, ev, EV_BATCH, ms);
    int64_t t = now_ns();
    if (got < 0) return fail_api(b, s == &b->dst ? "kvf_wait_events (decode)" : "kvf_wait_events (prefill)", got);
    for (int i = 0; i < got; i++)
      if (handle_event(b, s, n, &ev[i], t) < 0) return -1;
    if (got < EV_BATCH) return 0;
  }
}

static int drain(bench *b, side *s, size_t n) { return take_events(b, s, n, 0); }

static bool wave_done(const bench *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!b->wave[i].got_recv || !b->wave[i].got_send) return false;
  return true;
}

static int wave_timeout(bench *b, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const req *r = &b->wave[i];
    if (!r->got_recv || !r->got_send)
      return fail(b, "%s: no %s after the deadline (%u ms) plus %d ms; the daemon never reported it",
                  r->id, r->got_recv ? "SEND_DONE" : "RECV_DONE", b->o.deadline_ms, WAIT_MARGIN_MS);
  }
  return 0;
}

/* Decode first: RECV_DONE ends the timed window, so take its time first. */
static int drain_both(bench *b, size_t n) {
  return drain(b, &b->dst, n) < 0 || drain(b, &b->src, n) < 0 ? -1 : 0;
}

static bool recv_pending(const bench *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!b->wave[i].got_recv) return true;
  return false;
}

/* Waits as the engines do, each in the library's own wait: the decode
 * side for its RECV_DONEs (which end the timed window), then the prefill
 * side for its SEND_DONEs; the other side's events are taken after each
 * wait. With $KVFERRY_SPIN_US the library spins before it sleeps. */
static int wait_wave(bench *b, size_t n, int64_t limit) {
  while (!wave_done(b, n)) {
    int64_t left = limit - now_ns();
    if (left <= 0) return wave_timeout(b, n);
    /* Capped so that the other side's failure is seen within it. */
    int ms = left / 1000000 + 1 > 100 ? 100 : (int)(left / 1000000 + 1);
    if (b->o.busy_poll) ms = 0; /* as an engine whose event wait spins */
    side *s = recv_pending(b, n) ? &b->dst : &b->src;
    if (take_events(b, s, n, ms) < 0 || drain_both(b, n) < 0) return -1;
  }
  return 0;
}

/* ------------------------------------------------------------ GPU pools */

/* Copies a GPU pool's shadow to the GPU (to_dev) or back. */
static int gpu_sync(bench *b, side *s, bool to_dev) {
  char err[256];
  if (s->gpu < 0 || kvfb_gpu_copy(s->gpu, s->dptr, s->base, s->size, to_dev, err, sizeof(err)) == 0) return 0;
  return fail(b, "copying the %s pool %s the GPU: %s", s->role, to_dev ? "to" : "from", err);
}

/* Records the n requests at b->wave (latency, exposed and late times) and
 * returns their timed window: the first send to the last RECV_DONE. */
static int64_t note_times(bench *b, size_t n) {
  int64_t t0 = b->wave[0].t_post, t1 = 0;
  for (size_t i = 0; i < n; i++) {
    const req *r = &b->wave[i];
    if (r->t_recv > t1) t1 = r->t_recv;
    b->lat_us[r->index] = (double)(r->t_recv - r->t_post) / 1e3;
    b->post_us[r->index] = (double)r->post_ns / 1e3;
    int64_t due = b->o.compute ? r->t_due : r->t_last_send;
    b->exposed_us[r->index] = (double)(r->t_recv - due) / 1e3;
    b->late_us[r->index] = (double)(r->t_last_send - due) / 1e3;
    latency_note(b, r);
  }
  return t1 - t0;
}

/* One wave: the n requests at b->wave sent and waited for; *ns: its
 * timed window (first send to last RECV_DONE). */
static int run_wave(bench *b, size_t n, int64_t *ns) {
  /* Timed from the sends, a wave's grants go first, all of them, as the
   * decode engine admitted those requests before their prefill: the timed
   * window then holds the sends alone, not a grant's round trip between
   * two sends. */
  bool grants_first = b->o.time_from_send && !b->o.compute && !b->o.grant_lead_ms && n > 1;
  for (size_t i = 0; grants_first && i < n; i++)
    if (post_grant(b, &b->wave[i]) < 0) return -1;
  for (size_t i = 0; i < n; i++) {
    if (post_request(b, &b->wave[i], n, grants_first) < 0) return -1;
    /* Completions of earlier requests must not wait for the posting loop. */
    if (drain_both(b, n) < 0) return -1;
  }
  int64_t bound = b->o.deadline_ms ? b->o.deadline_ms : WAIT_DEFAULT_MS;
  if (wait_wave(b, n, now_ns() + (bound + WAIT_MARGIN_MS) * 1000000) < 0) return -1;
  *ns = note_times(b, n);
  return 0;
}

static size_t count_received(const bench *b, size_t n) {
  size_t got = 0;
  for (size_t i = 0; i < n; i++) got += b->wave[i].got_recv;
  return got;
}

/* Waits until a RECV_DONE beyond the `had` already counted, or every event
 * of the n requests, came (the window's next request may go). */
static int wait_progress(bench *b, size_t n, size_t had, int64_t limit) {
  while (!wave_done(b, n) && count_received(b, n) == had) {
    int64_t left = limit - now_ns();
    if (left <= 0) return wave_timeout(b, n);
    int ms = left / 1000000 + 1 > 100 ? 100 : (int)(left / 1000000 + 1);
    if (b->o.busy_poll) ms = 0;
    side *s = recv_pending(b, n) ? &b->dst : &b->src;
    if (take_events(b, s, n, ms) < 0 || drain_both(b, n) < 0) return -1;
  }
  return 0;
}

/* --window: the n requests of a check go through a sliding window of
 * --concurrency: each RECV_DONE lets the next request's send go, so that
 * as many are in flight all along, not only at a wave's start. Every grant
 * goes first (the decode engine admitted the requests before their
 * prefill). *ns: the check's first send to its last RECV_DONE. */
static int run_window(bench *b, size_t n, int64_t *ns) {
  size_t per = (size_t)b->o.concurrency, next = 0;
  int64_t bound = (b->o.deadline_ms ? b->o.deadline_ms : WAIT_DEFAULT_MS) + WAIT_MARGIN_MS;
  b->wave = b->slots;
  for (size_t i = 0; i < n; i++)
    if (post_grant(b, &b->wave[i]) < 0) return -1;
  while (!wave_done(b, n)) {
    size_t got = count_received(b, n);
    for (; next < n && next - got < per; next++)
      if (post_request(b, &b->wave[next], n, true) < 0 || drain_both(b, n) < 0) return -1;
    if (wait_progress(b, n, got, now_ns() + bound * 1000000) < 0) return -1;
  }
  *ns = note_times(b, n);
  return 0;
}

/* Requests [first, first + n): prepared (and copied to the GPU) together,
 * sent in waves of --concurrency back to back, then every byte of all of
 * them checked. With --waves-per-check 1 (the default) that is one wave,
 * and the host and the GPU idle between waves while the bench checks;
 * with more, the waves of a check follow each other as an engine's
 * steady traffic does. */
static int run_check(bench *b, uint64_t first, size_t n) {
  prepare_check(b, first, n);
  if (gpu_sync(b, &b->src, true) < 0 || (!b->shared && gpu_sync(b, &b->dst, true) < 0)) return -1;
  size_t per = (size_t)b->o.concurrency;
  int64_t timed = 0;
  if (b->o.window && run_window(b, n, &timed) < 0) return -1;
  for (size_t k = 0; !b->o.window && k < n; k += per) {
    int64_t ns;
    b->wave = b->slots + k;
    if (run_wave(b, n - k < per ? n - k : per, &ns) < 0) return -1;
    timed += ns;
  }
  if (gpu_sync(b, &b->dst, false) < 0) return -1;
  for (size_t i = 0; i < n; i++)
    if (verify_request(b, &b->slots[i]) < 0) return -1;
  /* Counted only once verified, so seconds and bytes cover the same waves. */
  b->timed_ns += timed;
  b->done += n;
  return 0;
}

/* The decode daemon's GPU time in block copies so far (status:
 * cuda.block_kernel_us), or -1 where its status has none. */
static double daemon_kernel_us(side *s) {
  char *text = NULL;
  double v = -1;
  if (kvf_inspect(s->c, KVF_INSPECT_STATUS, 1, &text) == 0 && text) {
    const char *cu = kvf__json_get(text, "cuda");
    const char *k = cu ? kvf__json_get(cu, "block_kernel_us") : NULL;
    if (k) v = strtod(k, NULL);
  }
  free(text);
  return v;
}

static int run(bench *b) {
  b->kernel_us[0] = b->o.blocks && b->dst.gpu >= 0 ? daemon_kernel_us(&b->dst) : -1;
  for (uint64_t first = 0; first < b->o.requests; first += b->n_slots) {
    uint64_t left = b->o.requests - first;
    if (run_check(b, first, (size_t)(left < b->n_slots ? left : b->n_slots)) < 0) return -1;
  }
  b->kernel_us[1] = b->kernel_us[0] >= 0 ? daemon_kernel_us(&b->dst) : -1;
  return 0;
}

/* ------------------------------------------------------------ report */

static int cmp_double(const void *a, const void *c) {
  double x = *(const double *)a, y = *(const double *)c;
  return (x > y) - (x < y);
}

/* Nearest rank: the smallest value with at least p% of the samples at or below it. */
static double percentile(const double *sorted, uint64_t n, double p) {
  if (n == 0) return 0;
  uint64_t rank = (uint64_t)ceil(p / 100.0 * (double)n);
  if (rank < 1) rank = 1;
  return sorted[(rank > n ? n : rank) - 1];
}

static void json_str(FILE *f, const char *s) { kvf__json_fquote(f, s); }

typedef struct summary {
  uint64_t bytes, descs;
  double seconds, gbps, p50, p99, post_p50, exposed_p50, exposed_p99, late_p50;
  bool ok;
} summary;

static summary summarize(bench *b) {
  summary s = {.bytes = b->done * b->req_bytes, .descs = b->done * b->ndesc,
               .seconds = (double)b->timed_ns / 1e9, .ok = b->err[0] == '\0'};
  s.gbps = s.seconds > 0 ? (double)s.bytes / s.seconds / 1e9 : 0;
  if (b->done) qsort(b->lat_us, (size_t)b->done, sizeof *b->lat_us, cmp_double);
  s.p50 = percentile(b->lat_us, b->done, 50);
  if (b->done) qsort(b->post_us, (size_t)b->done, sizeof *b->post_us, cmp_double);
  s.post_p50 = percentile(b->post_us, b->done, 50);
  s.p99 = percentile(b->lat_us, b->done, 99);
  if (b->done) qsort(b->exposed_us, (size_t)b->done, sizeof *b->exposed_us, cmp_double);
  s.exposed_p50 = percentile(b->exposed_us, b->done, 50);
  s.exposed_p99 = percentile(b->exposed_us, b->done, 99);
  if (b->done) qsort(b->late_us, (size_t)b->done, sizeof *b->late_us, cmp_double);
  s.late_p50 = percentile(b->late_us, b->done, 50);
  return s;
}

/* ------------------------------------------------------------ --latency */

/* --latency: where the time of the p50 handoff went, read back from both
 * daemons' trace rings (kvferryctl transfers --trace --json): the hops of
 * the request nearest the p50 among the last LAT_RECENT (the rings keep
 * 1,024 transfers), and the median of each hop over those requests. */
#define LAT_RECENT 512
#define LAT_HOPS 6
#define LAT_TOTAL 4 /* post to event */
/* The last: a send's last part to its event (layer-wise: the part after
 * the last layer's compute); 0 for a receiver. */
static const char *const lat_hop[LAT_HOPS] = {"post_to_pair_us", "pair_to_first_us", "first_to_last_us",
                                              "last_to_event_us", "total_us", "last_part_to_event_us"};

typedef struct lat_side {
  bool found;                 /* the p50 request's record */
  double hop[LAT_HOPS];
  double *all[LAT_HOPS];      /* per hop, every recent request's */
  size_t n;
} lat_side;

static struct {
  bool done;
  char id[48];
  double p50_us;
  lat_side send, recv;
  int64_t *t_post, *t_recv; /* per request: the timed send call, RECV_DONE taken (CLOCK_MONOTONIC) */
  uint64_t n_t;
  int64_t p50_post, p50_recv;
  uint64_t requests; /* done in the run (lat_threads_json) */
} LT;

/* Called per finished request (run_wave): the client's own times, to set
 * against the daemons' stamps (one clock: CLOCK_MONOTONIC, one machine).
 * Only where the timed window starts at the send call (--time-from-send). */
static void latency_note(const bench *b, const req *r) {
  if (!b->o.latency || !b->o.time_from_send || b->o.layerwise) return;
  if (!LT.t_post) {
    LT.n_t = b->o.requests;
    LT.t_post = calloc((size_t)LT.n_t, sizeof(int64_t));
    LT.t_recv = calloc((size_t)LT.n_t, sizeof(int64_t));
  }
  if (!LT.t_post || !LT.t_recv || r->index >= LT.n_t) return;
  LT.t_post[r->index] = r->t_post;
  LT.t_recv[r->index] = r->t_recv;
}

static double lat_num(const char *obj, const char *key) {
  const char *v = kvf__json_get(obj, key);
  return v ? strtod(v, NULL) : 0;
}

/* Whether id is one of this run's requests at index >= from. */
static bool lat_recent(const char *id, uint64_t from) {
  char prefix[32];
  int n = snprintf(prefix, sizeof prefix, "bench-%ld-", (long)getpid());
  if (strncmp(id, prefix, (size_t)n) != 0) return false;
  char *end;
  unsigned long long index = strtoull(id + n, &end, 10);
  return *end == '\0' && index >= from;
}

/* One daemon's ring: the records of role `role` of this run's recent requests. */
static void lat_read(side *s, const char *role, lat_side *ls, uint64_t from) {
  char *text = NULL;
  if (kvf_inspect(s->c, KVF_INSPECT_TRACE, 1, &text) < 0 || !text) return;
  const char *it = kvf__json_get(text, "transfers");
  for (const char *o; it && (o = kvf__json_next(&it)) != NULL;) {
    char id[160], r[8];
    if (kvf__json_get_str(o, "id", id, sizeof id) || kvf__json_get_str(o, "role", r, sizeof r)) continue;
    if (strcmp(r, role) != 0 || !lat_recent(id, from)) continue;
    bool p50 = strcmp(id, LT.id) == 0;
    for (int k = 0; k < LAT_HOPS; k++) {
      double v = lat_num(o, lat_hop[k]);
      if (ls->all[k]) ls->all[k][ls->n] = v;
      if (p50) ls->hop[k] = v;
    }
    uint64_t posted = 0;
    if (p50 && kvf__json_get_u64(o, "posted_ns", &posted) == 0) {
      if (ls == &LT.send) LT.p50_post = (int64_t)posted;
      else LT.p50_recv = (int64_t)posted + (int64_t)(ls->hop[LAT_TOTAL] * 1e3);
    }
    ls->found |= p50;
    ls->n++;
  }
  free(text);
}

/* After the run, before the report sorts the latencies. */
static void latency_collect(bench *b) {
  uint64_t from = b->done > LAT_RECENT ? b->done - LAT_RECENT : 0, n = b->done - from;
  if (n == 0) return;
  double *v = malloc(n * sizeof *v);
  if (!v) return;
  memcpy(v, b->lat_us + from, n * sizeof *v);
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  LT.p50_us = percentile(v, n, 50);
  free(v);
  uint64_t pick = from;
  for (uint64_t i = from; i < b->done; i++)
    if (fabs(b->lat_us[i] - LT.p50_us) < fabs(b->lat_us[pick] - LT.p50_us)) pick = i;
  snprintf(LT.id, sizeof LT.id, "bench-%ld-%" PRIu64, (long)getpid(), pick);
  LT.p50_post = LT.p50_recv = 0;
  lat_side *sides[2] = {&LT.send, &LT.recv};
  for (int s = 0; s < 2; s++)
    for (int k = 0; k < LAT_HOPS; k++) sides[s]->all[k] = calloc((size_t)n, sizeof(double));
  lat_read(&b->src, "send", &LT.send, from);
  lat_read(&b->dst, "recv", &LT.recv, from);
  LT.done = true;
}

/* --latency: the bench process's own sleeps (voluntary context switches)
 * and preemptions per thread name over the run, from /proc/self/task: the
 * engine thread and the library's reader threads ("kvf-client"). */
#define LAT_THREADS 16
typedef struct lat_thr {
  char comm[24];
  uint64_t vol, inv;
} lat_thr;
static lat_thr lat_thr0[LAT_THREADS], lat_thr1[LAT_THREADS];

static uint64_t lat_status_num(const char *text, const char *key) {
  const char *p = strstr(text, key);
  return p ? strtoull(p + strlen(key), NULL, 10) : 0;
}

/* Per thread name (summed), up to LAT_THREADS names. */
static void lat_threads(lat_thr *t) {
  memset(t, 0, LAT_THREADS * sizeof *t);
  DIR *d = opendir("/proc/self/task");
  if (!d) return;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.') continue;
    char path[300], comm[24] = "", st[4096];
    snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
    fclose(f);
    comm[strcspn(comm, "\n")] = 0;
    snprintf(path, sizeof path, "/proc/self/task/%s/status", e->d_name);
    if (!(f = fopen(path, "r"))) continue;
    size_t n = fread(st, 1, sizeof st - 1, f);
    fclose(f);
    st[n] = 0;
    for (int i = 0; i < LAT_THREADS; i++) {
      if (t[i].comm[0] && strcmp(t[i].comm, comm) != 0) continue;
      snprintf(t[i].comm, sizeof t[i].comm, "%s", comm);
      t[i].vol += lat_status_num(st, "voluntary_ctxt_switches:");
      t[i].inv += lat_status_num(st, "nonvoluntary_ctxt_switches:");
      break;
    }
  }
  closedir(d);
}

static void lat_threads_json(uint64_t requests) {
  printf(", \"sleeps\": {");
  for (int i = 0, k = 0; i < LAT_THREADS && lat_thr1[i].comm[0]; i++) {
    uint64_t v0 = 0, i0 = 0;
    for (int j = 0; j < LAT_THREADS; j++)
      if (strcmp(lat_thr0[j].comm, lat_thr1[i].comm) == 0) v0 = lat_thr0[j].vol, i0 = lat_thr0[j].inv;
    double n = requests ? (double)requests : 1;
    printf("%s", k++ ? ", " : "");
    json_str(stdout, lat_thr1[i].comm);
    printf(": [%.2f, %.2f]", (double)(lat_thr1[i].vol - v0) / n, (double)(lat_thr1[i].inv - i0) / n);
  }
  printf("}");
}

static void latency_side_json(const char *name, lat_side *ls) {
  printf(", \"%s\": {\"found\": %s", name, ls->found ? "true" : "false");
  for (int k = 0; k < LAT_HOPS; k++) printf(", \"%s\": %.1f", lat_hop[k], ls->hop[k]);
  printf(", \"records\": %zu, \"hop_p50\": {", ls->n);
  for (int k = 0; k < LAT_HOPS; k++) {
    double med = 0;
    if (ls->n && ls->all[k]) {
      qsort(ls->all[k], ls->n, sizeof(double), cmp_double);
      med = percentile(ls->all[k], ls->n, 50);
    }
    printf("%s\"%s\": %.1f", k ? ", " : "", lat_hop[k], med);
    free(ls->all[k]);
    ls->all[k] = NULL;
  }
  printf("}}");
}

/* The "trace" member of the JSON line. */
static void latency_report_json(void) {
  if (!LT.done) return;
  printf(", \"trace\": {\"p50_id\": ");
  json_str(stdout, LT.id);
  printf(", \"p50_recent_us\": %.1f", LT.p50_us);
  /* The hops outside the daemons: the send call to the sending daemon's
   * post stamp, and the receiving daemon's event to RECV_DONE taken. */
  const char *dash = strrchr(LT.id, '-');
  uint64_t i = dash ? strtoull(dash + 1, NULL, 10) : LT.n_t;
  if (i < LT.n_t && LT.t_post && LT.p50_post && LT.p50_recv)
    printf(", \"client_to_daemon_us\": %.1f, \"daemon_to_client_us\": %.1f",
           (double)(LT.p50_post - LT.t_post[i]) / 1e3, (double)(LT.t_recv[i] - LT.p50_recv) / 1e3);
  latency_side_json("send", &LT.send);
  latency_side_json("recv", &LT.recv);
  printf("}");
  lat_threads_json(LT.requests);
  free(LT.t_post);
  free(LT.t_recv);
}

static void latency_report_human(void) {
  if (!LT.done) return;
  printf("  p50 handoff %s (%.1f us), hops in us (post>pair, pair>first, first>last, last>event, total, "
         "last part>event):\n",
         LT.id, LT.p50_us);
  lat_side *sides[2] = {&LT.send, &LT.recv};
  for (int s = 0; s < 2; s++) {
    lat_side *ls = sides[s];
    printf("    %s:", s ? "recv" : "send");
    if (!ls->found) printf(" not in the daemon's trace");
    for (int k = 0; ls->found && k < LAT_HOPS; k++) printf(" %.1f", ls->hop[k]);
    printf("\n");
    for (int k = 0; k < LAT_HOPS; k++) free(ls->all[k]);
  }
  free(LT.t_post);
  free(LT.t_recv);
}

static void report_json(const bench *b, const summary *s) {
  printf("{\"path\": ");
  json_str(stdout, b->path[0] ? b->path : "none");
  printf(", \"bytes\": %" PRIu64 ", \"descriptors\": %" PRIu64 ", \"requests\": %" PRIu64
         ", \"seconds\": %.6f, \"gbps\": %.3f, \"gbit_s\": %.3f, \"p50_us\": %.1f, \"p99_us\": %.1f"
         ", \"post_p50_us\": %.1f, \"verified\": %s, \"model\": ",
         s->bytes, s->descs, b->done, s->seconds, s->gbps, s->gbps * 8, s->p50, s->p99, s->post_p50,
         s->ok ? "true" : "false");
  json_str(stdout, b->o.g.model);
  printf(", \"block_bytes\": %" PRIu64 ", \"concurrency\": %" PRIu64 ", \"tokens\": %" PRIu64
         ", \"api\": \"%s\"", b->block_bytes, b->o.concurrency, b->o.tokens, b->o.blocks ? "blocks" : "descs");
  if (b->o.nowait) printf(", \"nowait\": true");
  if (b->o.waves_per_check > 1) printf(", \"waves_per_check\": %" PRIu64, b->o.waves_per_check);
  if (b->o.window) printf(", \"window\": true");
  /* The GPU's own time in this run's block copies (the daemon's events
   * around each): the copy kernel alone on the same blocks, and the share
   * of the timed windows it fills. Only this run's copies may run meanwhile. */
  double kus = b->kernel_us[1] - b->kernel_us[0];
  if (b->kernel_us[0] >= 0 && b->kernel_us[1] >= 0 && kus > 0 && s->seconds > 0)
    printf(", \"gpu_kernel_us\": %.1f, \"gpu_kernel_gbps\": %.3f, \"vs_gpu_kernel\": %.3f", kus,
           (double)s->bytes / kus / 1e3, s->gbps / ((double)s->bytes / kus / 1e3));
  if (b->o.compute)
    printf(", \"mode\": \"%s\", \"compute_us_per_layer\": %" PRIu64
           ", \"exposed_p50_us\": %.1f, \"exposed_p99_us\": %.1f, \"last_send_late_p50_us\": %.1f",
           b->o.layerwise ? "layerwise" : "whole", b->o.compute_us, s->exposed_p50, s->exposed_p99, s->late_p50);
  if (b->o.layer_events)
    printf(", \"layer_events\": %" PRIu64 ", \"layer_events_in_order\": %s", b->layer_events,
           b->layers_in_order ? "true" : "false");
  latency_report_json();
  if (!s->ok) {
    printf(", \"error\": ");
    json_str(stdout, b->err);
  }
  printf("}\n");
}

static void report_human(const bench *b, const summary *s) {
  char rb[32], tb[32];
  printf("kvferry-bench: %s, %" PRIu64 " tokens = %" PRIu64 " blocks x %" PRIu64 " layers x %"
         PRIu64 " of %" PRIu64 " B = %s per request\n",
         b->o.g.model, b->o.tokens, b->blocks, b->o.g.layers, b->o.g.kv_count, b->block_bytes,
         fmt_size((double)b->req_bytes, rb));
  printf("  %s (%s) -> %s (%s), path %s, %" PRIu64 " requests, %" PRIu64 " in flight%s%s%s\n",
         b->src.node, b->src.pool.name, b->dst.node, b->dst.pool.name, b->path[0] ? b->path : "-",
         b->done, b->o.concurrency, b->o.layerwise ? ", layerwise" : "",
         b->o.send_first ? ", send first" : "", b->o.window ? ", a sliding window" : "");
  printf("  moved %s (%" PRIu64 " descriptors) in %.3f s: %.3f GB/s (%.2f Gbit/s)\n",
         fmt_size((double)s->bytes, tb), s->descs, s->seconds, s->gbps, s->gbps * 8);
  printf("  latency p50 %.1f us, p99 %.1f us (api %s)\n", s->p50, s->p99, b->o.blocks ? "blocks" : "descs");
  if (b->o.compute)
    printf("  %s after %" PRIu64 " us of compute per layer: exposed p50 %.1f us, p99 %.1f us"
           " (the last send call %.1f us after the compute, p50)\n",
           b->o.layerwise ? "sent layer by layer" : "sent whole", b->o.compute_us, s->exposed_p50,
           s->exposed_p99, s->late_p50);
  if (b->o.layer_events)
    printf("  layer events: %" PRIu64 ", %s\n", b->layer_events,
           b->layers_in_order ? "each request's in layer order" : "some out of layer order");
  latency_report_human();
  printf("  verified: %s\n", s->ok ? "every byte" : "NO");
}

/* ------------------------------------------------------------ arguments */

static void usage(FILE *f) {
  fprintf(f,
    "usage: kvferry-bench --from SOCKET --to SOCKET [options]\n"
    "Hands KV caches from a prefill client (--from daemon) to a decode client\n"
    "(--to daemon; may be the same) and verifies every byte. With --blocks into a\n"
    "cuda:N pool, the JSON line adds gpu_kernel_us (the decode daemon's GPU time\n"
    "in this run's block copies), gpu_kernel_gbps and vs_gpu_kernel (gbps\n"
    "against it: the copy kernel alone on the same blocks).\n\n"
    "  --model NAME         llama3-8b (default), llama3-70b-tp8, deepseek-v3\n"
    "  --layers N --kv-heads N --head-dim N --block-tokens N --dtype-bytes N\n"
    "                       custom geometry, overriding the model's\n"
    "  --mla                one latent per layer-block (no separate V);\n"
    "                       kv-heads 1 and head-dim 576 unless given\n"
    "  --tokens N           tokens per request (default 4096)\n"
    "  --requests N         requests in the run (default 1)\n"
    "  --concurrency N      requests in flight at once (default 1): a wave\n"
    "  --waves-per-check K  send K waves back to back, then check every byte of\n"
    "                       all of them (default 1: each wave is checked before\n"
    "                       the next, and the host and GPU idle meanwhile); the\n"
    "                       pools hold K x --concurrency requests\n"
    "  --window             with --time-from-send: a check's requests go through a\n"
    "                       sliding window of --concurrency (each RECV_DONE lets\n"
    "                       the next send go) instead of waves, timed from the\n"
    "                       check's first send to its last RECV_DONE\n"
    "  --pool-from NAME     prefill pool (default: first host pool; cuda:N pools\n"
    "                       are filled and checked through a host shadow)\n"
    "  --pool-to NAME       decode pool (default: first host pool)\n"
    "  --layerwise          send each request in parts, one per layer\n"
    "  --blocks             hand off by layout and block ids (kvf_grant_blocks,\n"
    "                       kvf_send_blocks) instead of descriptors\n"
    "  --prefill-tp N --decode-tp M   with --blocks: every rank of both TPs, each\n"
    "                       a client with its own layout (its KV heads)\n"
    "  --prefill-order nhd|hnd --decode-order nhd|hnd\n"
    "  --prefill-block-tokens N --decode-block-tokens M\n"
    "                       with --blocks: heterogeneous layouts, one request at\n"
    "                       a time, every byte of every decode rank checked (host\n"
    "                       or cuda:N pools: a rank's slice of a cuda pool is\n"
    "                       copied to the GPU and back around each request)\n"
    "  --layer-events       with --blocks: grants ask for one LAYER_DONE per\n"
    "                       layer; the bench checks each comes once, before RECV_DONE\n"
    "  --compute-us-per-layer N\n"
    "                       emulate prefill: the grant first, then N us of compute\n"
    "                       per layer; with --layerwise each layer's part is sent\n"
    "                       as its compute ends, with --whole the request after the\n"
    "                       last; adds exposed_p50_us / exposed_p99_us (end of\n"
    "                       the compute to RECV_DONE) and last_send_late_p50_us\n"
    "                       (end of the compute to the last send call)\n"
    "  --whole              with --compute-us-per-layer: one send after all layers\n"
    "  --nowait             send calls (every part) do not wait for the daemon's\n"
    "                       answer (KVF_NOWAIT); a refusal comes as the SEND_DONE\n"
    "                       and fails the run; with --prefill-tp and the other\n"
    "                       layout options, every rank's grant and send\n"
    "  --send-first         post the send before the grant\n"
    "  --time-from-send     post the grant first, untimed; latency runs from the\n"
    "                       send to RECV_DONE (with --concurrency, every grant\n"
    "                       of a wave goes before its first send)\n"
    "  --grant-lead-ms N    with --time-from-send: post each grant N ms before\n"
    "                       its send (as an engine grants a prefill ahead)\n"
    "  --busy-poll          wait for events without blocking (spin a core); pair\n"
    "                       with the daemons' busy-poll for the lowest latency\n"
    "  --grant-any          grant without naming the prefill node\n"
    "  --deadline-ms N      per-transfer deadline (default 30000; 0: the daemon's)\n"
    "  --seed N             data and layout seed (default 1)\n"
    "  --json               one JSON line on stdout; its \"gbps\" is GB/s (10^9 bytes\n"
    "                       per second; the name stays for scripts), \"gbit_s\" the same in Gbit/s\n"
    "  --latency            after the run, read both daemons' transfer traces\n"
    "                       (kvferryctl transfers --trace) and report where the p50\n"
    "                       handoff's time went, hop by hop (JSON: \"trace\")\n"
    "  --quiet              no summary and no warnings; the exit status tells\n"
    "  --help\n"
    "Exit 0 only when every request transferred and verified.\n");
}

static int parse_u64(const char *name, const char *s, uint64_t min, uint64_t max, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s || *end || s[0] == '-' || v < min || v > max) {
    fprintf(stderr, "kvferry-bench: --%s: '%s' is not a number in [%" PRIu64 ", %" PRIu64 "]\n",
            name, s, min, max);
    return -1;
  }
  *out = v;
  return 0;
}

enum { O_FROM = 256, O_TO, O_MODEL, O_LAYERS, O_KVH, O_HDIM, O_BTOK, O_DTYPE, O_MLA, O_TOKENS,
       O_REQS, O_CONC, O_PFROM, O_PTO, O_LAYERWISE, O_SENDFIRST, O_GRANTANY, O_DEADLINE, O_SEED,
       O_JSON, O_QUIET, O_HELP, O_TFS, O_LEAD, O_BUSY, O_BLOCKS, O_LAYEREV, O_COMPUTE, O_WHOLE,
       O_NOWAIT, O_HET_PTP, O_HET_DTP, O_HET_PORD, O_HET_DORD, O_HET_PBT, O_HET_DBT, O_LATENCY, O_WAVES,
       O_WINDOW };

static const struct option long_opts[] = {
  {"from", required_argument, 0, O_FROM}, {"to", required_argument, 0, O_TO},
  {"model", required_argument, 0, O_MODEL}, {"layers", required_argument, 0, O_LAYERS},
  {"kv-heads", required_argument, 0, O_KVH}, {"head-dim", required_argument, 0, O_HDIM},
  {"block-tokens", required_argument, 0, O_BTOK}, {"dtype-bytes", required_argument, 0, O_DTYPE},
  {"mla", no_argument, 0, O_MLA}, {"tokens", required_argument, 0, O_TOKENS},
  {"requests", required_argument, 0, O_REQS}, {"concurrency", required_argument, 0, O_CONC},
  {"waves-per-check", required_argument, 0, O_WAVES}, {"window", no_argument, 0, O_WINDOW},
  {"pool-from", required_argument, 0, O_PFROM}, {"pool-to", required_argument, 0, O_PTO},
  {"layerwise", no_argument, 0, O_LAYERWISE}, {"send-first", no_argument, 0, O_SENDFIRST},
  {"grant-any", no_argument, 0, O_GRANTANY}, {"deadline-ms", required_argument, 0, O_DEADLINE},
  {"seed", required_argument, 0, O_SEED}, {"json", no_argument, 0, O_JSON},
  {"quiet", no_argument, 0, O_QUIET}, {"help", no_argument, 0, O_HELP},
  {"time-from-send", no_argument, 0, O_TFS}, {"grant-lead-ms", required_argument, 0, O_LEAD},
  {"busy-poll", no_argument, 0, O_BUSY}, {"blocks", no_argument, 0, O_BLOCKS},
  {"layer-events", no_argument, 0, O_LAYEREV}, {"compute-us-per-layer", required_argument, 0, O_COMPUTE},
  {"whole", no_argument, 0, O_WHOLE}, {"nowait", no_argument, 0, O_NOWAIT},
  /* heterogeneous layouts (bench_hetero.c) */
  {"prefill-tp", required_argument, 0, O_HET_PTP}, {"decode-tp", required_argument, 0, O_HET_DTP},
  {"prefill-order", required_argument, 0, O_HET_PORD}, {"decode-order", required_argument, 0, O_HET_DORD},
  {"prefill-block-tokens", required_argument, 0, O_HET_PBT}, {"decode-block-tokens", required_argument, 0, O_HET_DBT},
  {"latency", no_argument, 0, O_LATENCY},
  {0, 0, 0, 0},
};

/* Geometry flags as given; 0 = not given, the preset's value stands. */
typedef struct geom_over {
  uint64_t layers, kv_heads, head_dim, block_tokens, dtype_bytes;
  bool mla;
} geom_over;

static int parse_geom_opt(int c, const char *arg, geom_over *ov) {
  switch (c) {
  case O_LAYERS: return parse_u64("layers", arg, 1, 4096, &ov->layers);
  case O_KVH: return parse_u64("kv-heads", arg, 1, 1024, &ov->kv_heads);
  case O_HDIM: return parse_u64("head-dim", arg, 1, 65536, &ov->head_dim);
  case O_BTOK: return parse_u64("block-tokens", arg, 1, 65536, &ov->block_tokens);
  case O_DTYPE: return parse_u64("dtype-bytes", arg, 1, 8, &ov->dtype_bytes);
  default: ov->mla = true; return 0;
  }
}

static int parse_run_opt(int c, const char *arg, opts *o) {
  uint64_t v;
  switch (c) {
  case O_TOKENS: return parse_u64("tokens", arg, 1, 1u << 24, &o->tokens);
  case O_REQS: return parse_u64("requests", arg, 1, 1u << 24, &o->requests);
  case O_CONC: return parse_u64("concurrency", arg, 1, 1u << 16, &o->concurrency);
  case O_WAVES: return parse_u64("waves-per-check", arg, 1, 1024, &o->waves_per_check);
  case O_SEED: return parse_u64("seed", arg, 0, UINT64_MAX, &o->seed);
  case O_DEADLINE:
    if (parse_u64("deadline-ms", arg, 0, UINT32_MAX, &v) < 0) return -1;
    o->deadline_ms = (uint32_t)v;
    return 0;
  case O_LEAD:
    if (parse_u64("grant-lead-ms", arg, 0, 60000, &v) < 0) return -1;
    o->grant_lead_ms = (uint32_t)v;
    o->time_from_send = true;
    return 0;
  case O_COMPUTE:
    o->compute = true;
    return parse_u64("compute-us-per-layer", arg, 0, 10000000, &o->compute_us);
  }
  return -1;
}

static int set_model(const char *name, opts *o) {
  for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
    if (strcmp(presets[i].model, name) == 0) {
      o->g = presets[i];
      return 0;
    }
  fprintf(stderr, "kvferry-bench: --model: unknown '%s' (llama3-8b, llama3-70b-tp8, deepseek-v3)\n",
          name);
  return -1;
}

/* Custom flags win over the preset; any of them makes the model "custom". */
static void apply_geom(opts *o, const geom_over *ov) {
  geom *g = &o->g;
  bool custom = ov->layers || ov->kv_heads || ov->head_dim || ov->block_tokens ||
                ov->dtype_bytes || (ov->mla && g->kv_count != 1);
  if (ov->mla && g->kv_count != 1) {
    g->kv_count = 1;
    g->kv_heads = 1;
    g->head_dim = 576;
  }
  if (ov->layers) g->layers = ov->layers;
  if (ov->kv_heads) g->kv_heads = ov->kv_heads;
  if (ov->head_dim) g->head_dim = ov->head_dim;
  if (ov->block_tokens) g->block_tokens = ov->block_tokens;
  if (ov->dtype_bytes) g->dtype_bytes = ov->dtype_bytes;
  if (custom) g->model = "custom";
}

static int check_opts(const opts *o) {
  if (!o->from || !o->to) {
    fprintf(stderr, "kvferry-bench: --from and --to are required\n");
    usage(stderr);
    return -1;
  }
  const char *bad = NULL;
  if (o->layer_events && !o->blocks) bad = "--layer-events needs --blocks (descriptor grants have no layers)";
  else if (o->whole && o->layerwise) bad = "--whole and --layerwise exclude each other";
  else if (o->whole && !o->compute) bad = "--whole needs --compute-us-per-layer";
  else if (o->compute && !o->whole && !o->layerwise)
    bad = "--compute-us-per-layer needs --layerwise or --whole";
  else if (o->compute && o->send_first) bad = "--send-first and --compute-us-per-layer exclude each other";
  else if (o->window && (!o->time_from_send || o->compute || o->grant_lead_ms))
    bad = "--window needs --time-from-send, and takes neither --compute-us-per-layer nor --grant-lead-ms";
  if (bad) {
    fprintf(stderr, "kvferry-bench: %s\n", bad);
    return -1;
  }
  /* Offsets are computed in 64 bits; keep one block addressable in a pool. */
  const geom *g = &o->g;
  if (g->block_tokens * g->kv_heads * g->head_dim * g->dtype_bytes > (1ull << 32)) {
    fprintf(stderr, "kvferry-bench: a block of more than 4 GiB is not a KV cache\n");
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------ heterogeneous layouts */

static int het_opt(int c, const char *arg, opts *o) {
  static const char *names[] = {"prefill-tp", "decode-tp", "prefill-order", "decode-order",
                                "prefill-block-tokens", "decode-block-tokens"};
  return kvfb_het_opt(names[c - O_HET_PTP], arg, &o->het);
}

/* --blocks with heterogeneous layouts: its own run (bench_hetero.c). */
static int het_run(const opts *o) {
  if (!o->blocks || o->layerwise || o->compute || o->send_first || o->concurrency > 1 || o->layer_events ||
      o->waves_per_check > 1 || o->window) {
    fprintf(stderr, "kvferry-bench: --prefill-tp and the other layout options need --blocks, and take none of "
                    "--layerwise, --compute-us-per-layer, --send-first, --concurrency, --waves-per-check, "
                    "--window, --layer-events\n");
    return 2;
  }
  const geom *g = &o->g;
  kvfb_het_run r = {.from = o->from, .to = o->to, .pool_from = o->pool_from, .pool_to = o->pool_to,
                    .model = g->model, .layers = g->layers, .kv_heads = g->kv_heads, .head_dim = g->head_dim,
                    .dtype_bytes = g->dtype_bytes, .block_tokens = g->block_tokens, .kv_count = g->kv_count,
                    .tokens = o->tokens, .requests = o->requests, .seed = o->seed, .deadline_ms = o->deadline_ms,
                    .nowait = o->nowait, .json = o->json, .quiet = o->quiet};
  return kvfb_het_main(&r, &o->het);
}

/* Returns 0 to run, 1 after --help, -1 on a usage error. */
static int parse_args(int argc, char **argv, opts *o) {
  geom_over ov = {0};
  *o = (opts){.g = presets[0], .tokens = 4096, .requests = 1, .concurrency = 1, .waves_per_check = 1, .seed = 1,
              .deadline_ms = 30000};
  int c;
  while ((c = getopt_long(argc, argv, "", long_opts, NULL)) != -1) {
    int rc = 0;
    if (c == O_FROM) o->from = optarg;
    else if (c == O_TO) o->to = optarg;
    else if (c == O_PFROM) o->pool_from = optarg;
    else if (c == O_PTO) o->pool_to = optarg;
    else if (c == O_MODEL) rc = set_model(optarg, o);
    else if (c >= O_LAYERS && c <= O_MLA) rc = parse_geom_opt(c, optarg, &ov);
    else if (c >= O_TOKENS && c <= O_CONC) rc = parse_run_opt(c, optarg, o);
    else if (c == O_DEADLINE || c == O_SEED || c == O_LEAD || c == O_COMPUTE || c == O_WAVES)
      rc = parse_run_opt(c, optarg, o);
    else if (c == O_LAYERWISE) o->layerwise = true;
    else if (c == O_SENDFIRST) o->send_first = true;
    else if (c == O_GRANTANY) o->grant_any = true;
    else if (c == O_JSON) o->json = true;
    else if (c == O_QUIET) o->quiet = true;
    else if (c == O_TFS) o->time_from_send = true;
    else if (c == O_BUSY) o->busy_poll = true;
    else if (c == O_BLOCKS) o->blocks = true;
    else if (c == O_LAYEREV) o->layer_events = true;
    else if (c == O_WHOLE) o->whole = true;
    else if (c == O_NOWAIT) o->nowait = true;
    else if (c == O_WINDOW) o->window = true;
    else if (c >= O_HET_PTP && c <= O_HET_DBT) rc = het_opt(c, optarg, o);
    else if (c == O_LATENCY) o->latency = true;
    else if (c == O_HELP) { usage(stdout); return 1; }
    else { usage(stderr); return -1; }
    if (rc < 0) return -1;
  }
  if (optind < argc) {
    fprintf(stderr, "kvferry-bench: unexpected argument '%s'\n", argv[optind]);
    return -1;
  }
  apply_geom(o, &ov);
  /* A wave never holds more requests than the run has. */
  if (o->concurrency > o->requests) o->concurrency = o->requests;
  if (o->concurrency * o->waves_per_check > o->requests)
    o->waves_per_check = (o->requests + o->concurrency - 1) / o->concurrency;
  return check_opts(o);
}

int main(int argc, char **argv) {
  bench b = {0};
  int rc = parse_args(argc, argv, &b.o);
  if (rc) return rc > 0 ? 0 : 2;
  if (b.o.het.on) return het_run(&b.o);
  bool ready = setup(&b) == 0;
  if (ready && b.o.latency) lat_threads(lat_thr0);
  if (ready && run(&b) == 0 && b.o.latency) {
    lat_threads(lat_thr1);
    LT.requests = b.done;
    latency_collect(&b);
  }
  summary s = summarize(&b);
  if (!s.ok) fprintf(stderr, "kvferry-bench: %s\n", b.err);
  if (b.o.json) report_json(&b, &s);
  else if (!b.o.quiet && ready) report_human(&b, &s);
  teardown(&b);
  return s.ok ? 0 : 1;
}
