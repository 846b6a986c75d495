/* bench_hetero.c - kvferry-bench's heterogeneous-layout mode (see
 * bench_hetero.h). */
#include "bench_hetero.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_gpu.h"
#include "kvferry.h"

#define MAX_TP 64u

typedef struct rank {
  const char *role;
  kvf_client *c;
  const char *node;
  kvf_pool_info pool;
  uint8_t *base;               /* a host pool, mapped */
  int gpu;                     /* a cuda:N pool: N (else -1), at dptr; the bench */
  uint64_t dptr;               /* fills and checks a host shadow of the rank's */
  uint8_t *shadow;             /* slice, copied to the GPU and back around */
  uint64_t extent;             /* each request, untimed (mem, sync_rank) */
  uint64_t slice;              /* this rank's part of it starts here */
  uint32_t tpb, heads, h0, order, n_kv;
  uint64_t unit, bb, nb;       /* unit: one token of one head; nb: blocks per region */
  uint64_t *offsets;
  uint32_t layout;
  uint32_t *ids;               /* this request's */
  size_t n;
} rank;

typedef struct het {
  const kvfb_het_run *r;
  kvfb_het h;
  rank *pre, *dec;
  bool fan;                    /* one id per request over KV heads (TPs differ) */
  uint64_t tokens;             /* per request: whole decode blocks */
  uint64_t rng;
  char err[512];
  double *lat_us;
  uint64_t done;
  char path[32];
  char transform[sizeof(((kvf_event *)0)->transform)]; /* the last RECV_DONE's */
} het;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int fail(het *t, const char *fmt, ...) {
  if (t->err[0]) return -1;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t->err, sizeof(t->err), fmt, ap);
  va_end(ap);
  return -1;
}

static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int kvfb_het_opt(const char *name, const char *arg, kvfb_het *h) {
  char *end;
  unsigned long v = strtoul(arg, &end, 10);
  h->on = true;
  if (strcmp(name, "prefill-order") == 0 || strcmp(name, "decode-order") == 0) {
    uint32_t o = strcmp(arg, "nhd") == 0 ? KVF_LAYOUT_NHD : strcmp(arg, "hnd") == 0 ? KVF_LAYOUT_HND : 9;
    if (o == 9) {
      fprintf(stderr, "kvferry-bench: --%s: nhd or hnd, not '%s'\n", name, arg);
      return -1;
    }
    *(name[0] == 'p' ? &h->porder : &h->dorder) = o;
    return 0;
  }
  if (*end || v == 0 || v > 65536) {
    fprintf(stderr, "kvferry-bench: --%s: a number from 1 to 65536, not '%s'\n", name, arg);
    return -1;
  }
  if (strcmp(name, "prefill-tp") == 0) h->ptp = (uint32_t)v;
  else if (strcmp(name, "decode-tp") == 0) h->dtp = (uint32_t)v;
  else if (strcmp(name, "prefill-block-tokens") == 0) h->pts = (uint32_t)v;
  else h->dts = (uint32_t)v;
  return 0;
}

/* ------------------------------------------------------------ ranks */

static int open_rank(het *t, rank *k, const char *sock, const char *pool_name) {
  int rc = kvf_connect(sock, &k->c);
  if (rc < 0) return fail(t, "connect to %s daemon at %s: %s", k->role, sock, kvf_err_name(rc));
  k->node = kvf_node(k->c);
  kvf_pool_info pools[32];
  int n = kvf_pools(k->c, pools, 32);
  for (int i = 0; i < n && i < 32 && !k->pool.name[0]; i++)
    if (pool_name ? strcmp(pools[i].name, pool_name) == 0 : strcmp(pools[i].kind, "host") == 0) k->pool = pools[i];
  if (!k->pool.name[0]) return fail(t, "%s node %s has no %s pool", k->role, k->node, pool_name ? pool_name : "host");
  bool cuda = strncmp(k->pool.kind, "cuda:", 5) == 0;
  if (strcmp(k->pool.kind, "host") != 0 && !cuda)
    return fail(t, "the heterogeneous mode takes host and cuda:N pools (%s)", k->pool.kind);
  void *addr;
  uint64_t size;
  rc = kvf_pool_map(k->c, k->pool.id, &addr, &size);
  if (rc < 0) return fail(t, "map pool '%s': %s", k->pool.name, kvf_err_name(rc));
  k->gpu = cuda ? atoi(k->pool.kind + 5) : -1;
  if (cuda) k->dptr = (uint64_t)(uintptr_t)addr; /* a device pointer: the shadow comes with the layout */
  else k->base = addr;
  return 0;
}

/* Where pool offset off of k's slice is, for the bench to write or read. */
static uint8_t *mem(const rank *k, uint64_t off) { return k->gpu < 0 ? k->base + off : k->shadow + (off - k->slice); }

/* A cuda pool's slice: the shadow to the GPU (to_dev) or back. */
static int sync_rank(het *t, rank *k, bool to_dev) {
  char err[256];
  if (k->gpu < 0 || kvfb_gpu_copy(k->gpu, k->dptr + k->slice, k->shadow, k->extent, to_dev, err, sizeof(err)) == 0)
    return 0;
  return fail(t, "copying a %s rank's slice %s the GPU: %s", k->role, to_dev ? "to" : "from", err);
}

static int sync_all(het *t, rank *ks, uint32_t n, bool to_dev) {
  for (uint32_t i = 0; i < n; i++)
    if (sync_rank(t, &ks[i], to_dev)) return -1;
  return 0;
}

/* Rank i of tp: its heads, geometry and layout over its pool slice. */
static int layout_rank(het *t, rank *k, uint32_t tp, uint32_t i, uint32_t tpb, uint32_t order, uint64_t slice,
                       uint64_t slice_bytes, uint64_t need) {
  const kvfb_het_run *r = t->r;
  bool mla = r->kv_count == 1;
  k->n_kv = (uint32_t)r->kv_count;
  k->heads = mla ? (uint32_t)r->kv_heads : (uint32_t)r->kv_heads / tp;
  k->h0 = mla ? 0 : i * k->heads;
  k->tpb = tpb;
  k->order = order;
  k->unit = r->head_dim * r->dtype_bytes;
  k->bb = (uint64_t)tpb * k->heads * k->unit;
  k->slice = slice;
  k->nb = slice_bytes / (r->layers * k->n_kv * k->bb);
  if (k->nb > (1u << 24)) k->nb = 1u << 24;
  if (k->nb < need)
    return fail(t, "pool '%s' of %s node %s is too small: a rank's slice holds %" PRIu64 " blocks, a request needs %"
                   PRIu64, k->pool.name, k->role, k->node, k->nb, need);
  uint64_t n = r->layers * k->n_kv;
  k->offsets = malloc(n * sizeof(uint64_t));
  k->ids = malloc(k->nb * sizeof(uint32_t));
  k->extent = n * k->nb * k->bb;
  if (k->gpu >= 0) k->shadow = calloc(1, k->extent);
  if (!k->offsets || !k->ids || (k->gpu >= 0 && !k->shadow)) return fail(t, "out of memory");
  for (uint64_t j = 0; j < n; j++) k->offsets[j] = slice + j * k->nb * k->bb;
  for (uint64_t j = 0; j < k->nb; j++) k->ids[j] = (uint32_t)j;
  kvf_layout l = {.pool = k->pool.id, .n_layers = (uint32_t)r->layers, .n_kv = k->n_kv, .n_blocks = (uint32_t)k->nb,
                  .block_bytes = k->bb, .block_stride = k->bb, .offsets = k->offsets, .tokens_per_block = tpb,
                  .kv_heads = k->heads, .head_dim = (uint32_t)r->head_dim, .dtype_bytes = (uint32_t)r->dtype_bytes,
                  .order = order};
  if (t->fan && !mla) {
    l.first_head = k->h0;
    l.model_kv_heads = (uint32_t)r->kv_heads;
  }
  int rc = kvf_layout_register(k->c, &l, &k->layout);
  if (rc < 0) return fail(t, "kvf_layout_register (%s rank %u): %s", k->role, i, kvf_err_name(rc));
  return 0;
}

static int setup(het *t) {
  const kvfb_het_run *r = t->r;
  kvfb_het *h = &t->h;
  if (!h->ptp) h->ptp = 1;
  if (!h->dtp) h->dtp = 1;
  if (!h->pts) h->pts = (uint32_t)r->block_tokens;
  if (!h->dts) h->dts = (uint32_t)r->block_tokens;
  if (h->ptp > MAX_TP || h->dtp > MAX_TP) return fail(t, "TP up to %u", MAX_TP);
  if (r->kv_count == 2 && (r->kv_heads % h->ptp || r->kv_heads % h->dtp))
    return fail(t, "the model's %" PRIu64 " KV heads do not split over TP %u and %u", r->kv_heads, h->ptp, h->dtp);
  if (h->pts % h->dts && h->dts % h->pts) return fail(t, "block tokens %u and %u: one must divide the other", h->pts,
                                                      h->dts);
  t->fan = h->ptp != h->dtp && r->kv_count == 2;
  uint64_t nd = (r->tokens + h->dts - 1) / h->dts;
  t->tokens = nd * h->dts;
  uint64_t ns = (t->tokens + h->pts - 1) / h->pts;
  t->pre = calloc(h->ptp, sizeof(rank));
  t->dec = calloc(h->dtp, sizeof(rank));
  t->lat_us = calloc(r->requests, sizeof(double));
  if (!t->pre || !t->dec || !t->lat_us) return fail(t, "out of memory");
  for (uint32_t i = 0; i < h->ptp; i++) {
    t->pre[i].role = "prefill";
    if (open_rank(t, &t->pre[i], r->from, r->pool_from)) return -1;
  }
  for (uint32_t i = 0; i < h->dtp; i++) {
    t->dec[i].role = "decode";
    if (open_rank(t, &t->dec[i], r->to, r->pool_to)) return -1;
  }
  /* the same pool on both ends (one daemon): the ranks of both share it */
  bool shared = strcmp(t->pre[0].node, t->dec[0].node) == 0 && t->pre[0].pool.id == t->dec[0].pool.id;
  uint64_t pslices = shared ? h->ptp + h->dtp : h->ptp, dslices = shared ? pslices : h->dtp;
  uint64_t ps = t->pre[0].pool.size / pslices / 4096 * 4096, ds = t->dec[0].pool.size / dslices / 4096 * 4096;
  for (uint32_t i = 0; i < h->ptp; i++)
    if (layout_rank(t, &t->pre[i], h->ptp, i, h->pts, h->porder, i * ps, ps, ns)) return -1;
  for (uint32_t i = 0; i < h->dtp; i++)
    if (layout_rank(t, &t->dec[i], h->dtp, i, h->dts, h->dorder, (shared ? h->ptp + i : i) * ds, ds, nd)) return -1;
  t->rng = mix64(r->seed ^ 0x686574);
  return 0;
}

/* ------------------------------------------------------------ data */

/* The pool offset of token t of model head hd of region (layer, kv). */
static uint64_t unit_off(const rank *k, uint64_t layer, uint32_t kv, uint64_t t, uint32_t hd) {
  uint64_t slot = t % k->tpb, hh = hd - k->h0;
  uint64_t in = k->order == KVF_LAYOUT_NHD ? slot * k->heads + hh : hh * k->tpb + slot;
  return k->offsets[layer * k->n_kv + kv] + (uint64_t)k->ids[t / k->tpb] * k->bb + in * k->unit;
}

static uint64_t unit_key(const het *t, uint64_t req, uint64_t layer, uint32_t kv, uint64_t tok, uint32_t hd) {
  return mix64(t->r->seed ^ req << 48 ^ layer << 36 ^ (uint64_t)kv << 35 ^ tok << 10 ^ hd);
}

static void fill_unit(uint8_t *p, uint64_t len, uint64_t key) {
  for (uint64_t i = 0; i < len; i += 8) {
    uint64_t v = mix64(key + i);
    memcpy(p + i, &v, len - i < 8 ? len - i : 8);
  }
}

static void pick_ids(het *t, rank *k, size_t n) {
  for (size_t i = 0; i < n; i++) {
    size_t j = i + mix64(t->rng++) % (k->nb - i);
    uint32_t x = k->ids[i];
    k->ids[i] = k->ids[j];
    k->ids[j] = x;
  }
  k->n = n;
}

static void prepare(het *t, uint64_t req) {
  for (uint32_t i = 0; i < t->h.ptp; i++) {
    rank *k = &t->pre[i];
    pick_ids(t, k, (t->tokens + k->tpb - 1) / k->tpb);
    for (uint64_t l = 0; l < t->r->layers; l++)
      for (uint32_t kv = 0; kv < k->n_kv; kv++)
        for (uint64_t tok = 0; tok < t->tokens; tok++)
          for (uint32_t hd = k->h0; hd < k->h0 + k->heads; hd++)
            fill_unit(mem(k, unit_off(k, l, kv, tok, hd)), k->unit, unit_key(t, req, l, kv, tok, hd));
  }
  for (uint32_t i = 0; i < t->h.dtp; i++) {
    rank *k = &t->dec[i];
    pick_ids(t, k, t->tokens / k->tpb);
    for (size_t b = 0; b < k->n; b++) /* poison what is granted */
      for (uint64_t j = 0; j < t->r->layers * k->n_kv; j++) memset(mem(k, k->offsets[j] + k->ids[b] * k->bb), 0xa5, k->bb);
  }
}

/* Where in k's slice the unit want landed instead (a failure's detail):
 * its pool offset, or UINT64_MAX when nowhere. */
static uint64_t find_unit(const rank *k, const uint8_t *want) {
  uint64_t len = k->unit < 16 ? k->unit : 16;
  for (uint64_t o = 0; o + len <= k->extent; o++)
    if (memcmp(mem(k, k->slice + o), want, len) == 0) return k->slice + o;
  return UINT64_MAX;
}

static int verify(het *t, uint64_t req) {
  uint8_t want[4096];
  for (uint32_t i = 0; i < t->h.dtp; i++) {
    rank *k = &t->dec[i];
    if (k->unit > sizeof(want)) return fail(t, "head dim too large to verify");
    for (uint64_t l = 0; l < t->r->layers; l++)
      for (uint32_t kv = 0; kv < k->n_kv; kv++)
        for (uint64_t tok = 0; tok < t->tokens; tok++)
          for (uint32_t hd = k->h0; hd < k->h0 + k->heads; hd++) {
            fill_unit(want, k->unit, unit_key(t, req, l, kv, tok, hd));
            const uint8_t *got = mem(k, unit_off(k, l, kv, tok, hd));
            if (memcmp(got, want, k->unit) != 0) {
              uint64_t at = k->extent ? find_unit(k, want) : UINT64_MAX;
              return fail(t, "request %" PRIu64 ": decode rank %u layer %" PRIu64 " %s token %" PRIu64
                             " head %u differs from what prefill wrote (%s there; it is at pool offset %" PRId64
                             ", expected at %" PRIu64 "; transform: %s)", req, i, l, kv ? "V" : "K", tok, hd,
                          got[0] == 0xa5 && got[1] == 0xa5 ? "poison" : "other bytes",
                          at == UINT64_MAX ? (int64_t)-1 : (int64_t)at, unit_off(k, l, kv, tok, hd), t->transform);
            }
          }
  }
  return 0;
}

/* ------------------------------------------------------------ transfers */

static int wait_for(het *t, rank *k, const char *id, int type) {
  for (;;) {
    kvf_event ev;
    int n = kvf_wait_events(k->c, &ev, 1, (int)(t->r->deadline_ms ? t->r->deadline_ms : 300000) + 5000);
    if (n < 0) return fail(t, "kvf_wait_events: %s", kvf_err_name(n));
    if (n == 0) return fail(t, "no event for %s on %s", id, k->role);
    if (strcmp(ev.xfer_id, id) != 0 || ev.type != type) continue;
    if (ev.status) return fail(t, "%s %s: %s (%s)", k->role, id, kvf_err_name(ev.status), ev.error);
    if (type == KVF_EV_RECV_DONE) snprintf(t->path, sizeof(t->path), "%s", ev.path);
    if (type == KVF_EV_RECV_DONE) snprintf(t->transform, sizeof(t->transform), "%s", ev.transform);
    return 0;
  }
}

static void xid(char *buf, size_t len, uint64_t req, int rank_i) {
  if (rank_i < 0) snprintf(buf, len, "het-%" PRIu64, req);
  else snprintf(buf, len, "het-%" PRIu64 "-%d", req, rank_i);
}

/* One request: every grant, every send, every RECV_DONE; its time. */
static int one(het *t, uint64_t req) {
  const kvfb_het *h = &t->h;
  char id[64];
  unsigned flags = t->r->nowait ? KVF_NOWAIT : 0; /* a refusal then comes as the DONE event wait_for reads */
  int64_t t0 = now_ns();
  for (uint32_t i = 0; i < h->dtp; i++) {
    rank *k = &t->dec[i];
    xid(id, sizeof(id), req, t->fan ? -1 : (int)i);
    kvf_blocks b = {.layout = k->layout, .ids = k->ids, .n = k->n};
    int rc = kvf_grant_blocks(k->c, id, t->pre[0].node, &b, flags, t->r->deadline_ms);
    if (rc < 0) return fail(t, "kvf_grant_blocks(%s): %s", id, kvf_err_name(rc));
  }
  /* one to one: decode rank i from prefill rank i % ptp (MLA: any one source) */
  uint32_t sends = t->fan ? h->ptp : h->dtp;
  for (uint32_t i = 0; i < sends; i++) {
    rank *k = &t->pre[t->fan ? i : i % h->ptp];
    xid(id, sizeof(id), req, t->fan ? -1 : (int)i);
    kvf_blocks b = {.layout = k->layout, .ids = k->ids, .n = k->n};
    int rc = kvf_send_blocks(k->c, id, t->dec[0].node, &b, flags, t->r->deadline_ms);
    if (rc < 0) return fail(t, "kvf_send_blocks(%s): %s", id, kvf_err_name(rc));
  }
  for (uint32_t i = 0; i < h->dtp; i++) {
    xid(id, sizeof(id), req, t->fan ? -1 : (int)i);
    if (wait_for(t, &t->dec[i], id, KVF_EV_RECV_DONE)) return -1;
  }
  t->lat_us[t->done] = (double)(now_ns() - t0) / 1e3; /* the request's time: to its last RECV_DONE */
  for (uint32_t i = 0; i < sends; i++) {
    xid(id, sizeof(id), req, t->fan ? -1 : (int)i);
    if (wait_for(t, &t->pre[t->fan ? i : i % h->ptp], id, KVF_EV_SEND_DONE)) return -1;
  }
  return 0;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void report(het *t, double seconds) {
  const kvfb_het_run *r = t->r;
  const kvfb_het *h = &t->h;
  uint64_t per = t->tokens * r->kv_heads * r->head_dim * r->dtype_bytes * r->layers * r->kv_count;
  if (r->kv_count == 1) per *= h->dtp; /* a latent lands on every decode rank */
  uint64_t bytes = per * t->done;
  double gbps = seconds > 0 ? (double)bytes / seconds / 1e9 : 0;
  qsort(t->lat_us, t->done, sizeof(double), cmp_d);
  double p50 = t->done ? t->lat_us[t->done / 2] : 0, p99 = t->done ? t->lat_us[(t->done * 99) / 100] : 0;
  static const char *on[] = {"nhd", "hnd"};
  if (!r->json) {
    printf("kvferry-bench: %s, TP %u (%s, %u tokens/block) -> TP %u (%s, %u tokens/block), %" PRIu64
           " requests of %" PRIu64 " tokens, path %s: %.3f GB/s, p50 %.1f us; verified: %s\n", r->model, h->ptp,
           on[h->porder], h->pts, h->dtp, on[h->dorder], h->dts, t->done, t->tokens, t->path, gbps, p50,
           t->err[0] ? "NO" : "every byte");
    return;
  }
  printf("{\"path\": \"%s\", \"bytes\": %" PRIu64 ", \"descriptors\": 0, \"requests\": %" PRIu64
         ", \"seconds\": %.6f, \"gbps\": %.3f, \"gbit_s\": %.3f, \"p50_us\": %.1f, \"p99_us\": %.1f"
         ", \"post_p50_us\": 0.0, \"verified\": %s, \"model\": \"%s\", \"block_bytes\": %" PRIu64
         ", \"concurrency\": 1, \"tokens\": %" PRIu64 ", \"api\": \"blocks\", \"prefill_tp\": %u, \"decode_tp\": %u"
         ", \"prefill_order\": \"%s\", \"decode_order\": \"%s\", \"prefill_block_tokens\": %u"
         ", \"decode_block_tokens\": %u, \"fan\": %s",
         t->path[0] ? t->path : "none", bytes, t->done, seconds, gbps, gbps * 8, p50, p99,
         t->err[0] ? "false" : "true", r->model, t->dec ? t->dec[0].bb : 0, t->tokens, h->ptp, h->dtp, on[h->porder],
         on[h->dorder], h->pts, h->dts, t->fan ? "true" : "false");
  if (r->nowait) printf(", \"nowait\": true");
  printf(", \"transform\": \"");
  for (const char *c = t->transform; *c; c++) printf(*c == '"' || *c == '\\' ? "\\%c" : "%c", *c);
  printf("\"");
  if (t->err[0]) {
    printf(", \"error\": \"");
    for (const char *c = t->err; *c; c++) printf(*c == '"' || *c == '\\' ? "\\%c" : "%c", *c);
    printf("\"");
  }
  printf("}\n");
}

static void teardown(het *t) {
  for (uint32_t i = 0; t->pre && i < t->h.ptp; i++) {
    if (t->pre[i].c) kvf_close(t->pre[i].c);
    free(t->pre[i].offsets);
    free(t->pre[i].ids);
    free(t->pre[i].shadow);
  }
  for (uint32_t i = 0; t->dec && i < t->h.dtp; i++) {
    if (t->dec[i].c) kvf_close(t->dec[i].c);
    free(t->dec[i].offsets);
    free(t->dec[i].ids);
    free(t->dec[i].shadow);
  }
  free(t->pre);
  free(t->dec);
  free(t->lat_us);
}

int kvfb_het_main(const kvfb_het_run *r, const kvfb_het *h) {
  het t = {.r = r, .h = *h};
  int64_t timed = 0;
  if (setup(&t) == 0)
    for (uint64_t q = 0; q < r->requests; q++) {
      prepare(&t, q);
      /* t.h: the options as setup completed them (a TP not given is 1) */
      if (sync_all(&t, t.pre, t.h.ptp, true) || sync_all(&t, t.dec, t.h.dtp, true) || one(&t, q)) break;
      timed += (int64_t)(t.lat_us[t.done] * 1e3);
      if (sync_all(&t, t.dec, t.h.dtp, false) || verify(&t, q)) break;
      t.done++;
    }
  if (t.err[0]) fprintf(stderr, "kvferry-bench: %s\n", t.err);
  if (!r->quiet || r->json) report(&t, (double)timed / 1e9);
  teardown(&t);
  return t.err[0] ? 1 : 0;
}
