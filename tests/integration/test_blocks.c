/* test_blocks.c - black-box transfers by KV layout and block ids between
 * two real daemons (tcp, or rdma with TRANSPORT=rdma) and between two
 * clients of one daemon (local): whole and in layer parts, grant or send
 * first, layer events in order, a layout per-layer on one side and
 * cross-layer on the other, and the errors (unknown layout, ids and layers
 * outside it, layouts that leave the pool or overlap, geometries that do
 * not match, a part after its transfer ended). Every transfer checks every
 * granted byte and that the blocks around them are untouched. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define KIB (1ull << 10)
#define MIB (1ull << 20)

static h_fixture F;
static h_client dec2; /* a second client of "decode": the local sender */

static int group_setup(void **state) {
  (void)state;
  return h_fixture_start(&F, "64M") || h_client_open(&dec2, &F.p.decode) ? -1 : 0;
}

static int group_teardown(void **state) {
  (void)state;
  h_client_close(&dec2);
  return h_fixture_stop(&F);
}

/* ---------------------------------------------------------------- layouts */

/* A cache of n_layers x n_kv regions of n_blocks blocks at base: vLLM's
 * per-layer tensors (region after region) or cross-layer (a block holds
 * every region of every layer). */
typedef struct cache {
  h_client *hc;
  kvf_layout l;
  uint64_t offsets[2 * 64];
  uint64_t base, span;
  uint32_t id;
} cache;

static void cache_init(cache *c, h_client *hc, uint64_t base, uint32_t layers, uint32_t n_kv, uint32_t blocks,
                       uint64_t block_bytes, bool cross_layer) {
  memset(c, 0, sizeof(*c));
  c->hc = hc;
  c->base = base;
  uint32_t regions = layers * n_kv;
  for (uint32_t r = 0; r < regions; r++)
    c->offsets[r] = base + (cross_layer ? r * block_bytes : (uint64_t)r * blocks * block_bytes);
  c->l = (kvf_layout){.pool = hc->pool, .n_layers = layers, .n_kv = n_kv, .n_blocks = blocks,
                      .block_bytes = block_bytes,
                      .block_stride = cross_layer ? regions * block_bytes : block_bytes,
                      .offsets = c->offsets, .tokens_per_block = 16, .dtype_bytes = 2};
  c->span = (uint64_t)regions * blocks * block_bytes;
}

static uint8_t *piece(const cache *c, uint32_t layer, uint32_t kv, uint32_t block) {
  return c->hc->base + c->offsets[layer * c->l.n_kv + kv] + (uint64_t)block * c->l.block_stride;
}

/* The pattern index of (layer, kv, i): the same on both sides. */
static uint64_t piece_index(const cache *c, uint32_t layer, uint32_t kv, size_t i, size_t n) {
  return ((uint64_t)layer * c->l.n_kv + kv) * n + i;
}

static void cache_register(cache *c) { H_OK(kvf_layout_register(c->hc->c, &c->l, &c->id)); }

static void fill_src(const cache *c, const uint32_t *ids, size_t n, uint64_t seed) {
  for (uint32_t layer = 0; layer < c->l.n_layers; layer++)
    for (uint32_t kv = 0; kv < c->l.n_kv; kv++)
      for (size_t i = 0; i < n; i++)
        h_fill(piece(c, layer, kv, ids[i]), c->l.block_bytes, seed, piece_index(c, layer, kv, i, n));
}

/* Every granted piece holds the sender's; every other block is poison. */
static int verify_dst(const cache *c, const uint32_t *ids, size_t n, uint64_t seed) {
  uint8_t *granted = calloc(c->l.n_blocks, 1);
  if (!granted) return h_fail("out of memory");
  for (size_t i = 0; i < n; i++) granted[ids[i]] = 1;
  int rc = 0;
  for (uint32_t layer = 0; layer < c->l.n_layers && rc == 0; layer++)
    for (uint32_t kv = 0; kv < c->l.n_kv && rc == 0; kv++) {
      for (size_t i = 0; i < n && rc == 0; i++) {
        int64_t bad = h_verify(piece(c, layer, kv, ids[i]), c->l.block_bytes, seed, piece_index(c, layer, kv, i, n));
        if (bad >= 0) rc = h_fail("layer %u kv %u block %u (grant index %zu): byte %lld wrong", layer, kv, ids[i], i,
                                  (long long)bad);
      }
      for (uint32_t b = 0; b < c->l.n_blocks && rc == 0; b++) {
        int64_t bad = granted[b] ? -1 : h_verify_poison(piece(c, layer, kv, b), c->l.block_bytes);
        if (bad >= 0) rc = h_fail("layer %u kv %u block %u was not granted but byte %lld changed", layer, kv, b,
                                  (long long)bad);
      }
    }
  free(granted);
  return rc;
}

/* n distinct ids below max, shuffled by seed. */
static void pick_ids(uint32_t *ids, size_t n, uint32_t max, uint64_t seed) {
  uint32_t *all = malloc(max * sizeof(*all));
  assert_non_null(all);
  for (uint32_t i = 0; i < max; i++) all[i] = i;
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint32_t i = max - 1; i > 0; i--) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    uint32_t j = (uint32_t)(s % (i + 1)), t = all[i];
    all[i] = all[j], all[j] = t;
  }
  memcpy(ids, all, n * sizeof(*ids));
  free(all);
}

/* ------------------------------------------------------------ a handoff */

typedef struct handoff {
  cache *src, *dst;
  const char *dst_node, *src_node;
  size_t n;
  uint32_t parts;            /* layer groups the send comes in (0: whole) */
  bool send_first, layer_events;
  bool nowait;               /* later parts with KVF_SEND_NOWAIT */
  uint64_t seed;
  const char *path;          /* expected path of the events */
} handoff;

static int post_send(const handoff *h, const char *id, const uint32_t *sids) {
  uint32_t layers = h->src->l.n_layers, parts = h->parts ? h->parts : 1;
  uint32_t per = (layers + parts - 1) / parts;
  for (uint32_t first = 0; first < layers; first += per) {
    uint32_t n = first + per > layers ? layers - first : per;
    kvf_blocks b = {.layout = h->src->id, .ids = first ? NULL : sids, .n = first ? 0 : h->n,
                    .first_layer = first, .n_layers = n};
    unsigned flags = (first + n < layers ? KVF_SEND_MORE : 0) | (first && h->nowait ? KVF_SEND_NOWAIT : 0);
    int rc = kvf_send_blocks(h->src->hc->c, id, h->dst_node, &b, flags, 0);
    if (rc) return h_fail("kvf_send_blocks(layers %u-%u): %s", first, first + n - 1, kvf_strerror(rc));
  }
  return 0;
}

static int post_grant(const handoff *h, const char *id, const uint32_t *dids) {
  kvf_blocks b = {.layout = h->dst->id, .ids = dids, .n = h->n};
  int rc = kvf_grant_blocks(h->dst->hc->c, id, h->src_node, &b, h->layer_events ? KVF_GRANT_LAYER_EVENTS : 0, 0);
  return rc ? h_fail("kvf_grant_blocks: %s", kvf_strerror(rc)) : 0;
}

/* Layer layer of every granted block holds the sender's bytes. */
static int verify_layer(const cache *c, const uint32_t *ids, size_t n, uint64_t seed, uint32_t layer) {
  for (uint32_t kv = 0; kv < c->l.n_kv; kv++)
    for (size_t i = 0; i < n; i++) {
      int64_t bad = h_verify(piece(c, layer, kv, ids[i]), c->l.block_bytes, seed, piece_index(c, layer, kv, i, n));
      if (bad >= 0) return h_fail("LAYER_DONE of layer %u came before its kv %u block %u (byte %lld) landed", layer,
                                  kv, ids[i], (long long)bad);
    }
  return 0;
}

/* Layer events come one per layer, in order, all before RECV_DONE, each
 * once every byte of its layer landed. */
static int wait_layers(const handoff *h, const char *id, const uint32_t *dids) {
  for (uint32_t layer = 0; layer < h->dst->l.n_layers; layer++) {
    kvf_event ev;
    int rc = h_wait_event(h->dst->hc, id, 0, H_XFER_MS, &ev);
    if (rc) return h_fail("waiting for layer %u: %s", layer, kvf_strerror(rc));
    if (ev.type != KVF_EV_LAYER_DONE) return h_fail("event %d before layer %u's LAYER_DONE", ev.type, layer);
    if (ev.status || ev.layer != layer) return h_fail("LAYER_DONE of layer %u (status %d), want %u", ev.layer,
                                                      ev.status, layer);
    if (ev.bytes != h->n * h->dst->l.n_kv * h->dst->l.block_bytes) return h_fail("LAYER_DONE bytes %llu",
                                                                               (unsigned long long)ev.bytes);
    rc = verify_layer(h->dst, dids, h->n, h->seed, layer);
    if (rc) return rc;
  }
  return 0;
}

static int handoff_run(const handoff *h) {
  uint32_t *sids = malloc(h->n * 4), *dids = malloc(h->n * 4);
  char id[96];
  if (!sids || !dids) return h_fail("out of memory");
  pick_ids(sids, h->n, h->src->l.n_blocks, h->seed);
  pick_ids(dids, h->n, h->dst->l.n_blocks, h->seed + 7);
  h_id(id, sizeof(id), "blocks");
  fill_src(h->src, sids, h->n, h->seed);
  h_poison(h->dst->hc->base + h->dst->base, h->dst->span);
  int rc = h->send_first ? post_send(h, id, sids) : post_grant(h, id, dids);
  if (rc == 0) rc = h->send_first ? post_grant(h, id, dids) : post_send(h, id, sids);
  if (rc == 0 && h->layer_events) rc = wait_layers(h, id, dids);
  uint64_t pieces = (uint64_t)h->n * h->dst->l.n_kv * h->dst->l.n_layers;
  uint64_t bytes = pieces * h->dst->l.block_bytes;
  kvf_event ev;
  if (rc == 0) rc = h_wait_event(h->dst->hc, id, KVF_EV_RECV_DONE, H_XFER_MS, &ev);
  if (rc == 0) rc = h_check_event(&ev, KVF_EV_RECV_DONE, h->path, NULL, bytes, pieces);
  if (rc == 0) rc = h_wait_event(h->src->hc, id, KVF_EV_SEND_DONE, H_XFER_MS, &ev);
  if (rc == 0) rc = h_check_event(&ev, KVF_EV_SEND_DONE, h->path, NULL, bytes, pieces);
  if (rc == 0) rc = verify_dst(h->dst, dids, h->n, h->seed);
  free(sids);
  free(dids);
  return rc;
}

/* The usual pair of caches: llama-like, 8 layers of K and V, 96 blocks of
 * 4 KiB; prefill's per-layer, decode's cross-layer (or as asked). */
static void two_caches(cache *src, cache *dst, uint64_t block_bytes, bool dst_cross) {
  cache_init(src, &F.pre, 0, 8, 2, 96, block_bytes, false);
  cache_init(dst, &F.dec, 0, 8, 2, 96, block_bytes, dst_cross);
  cache_register(src);
  cache_register(dst);
}

static void free_caches(cache *a, cache *b) {
  H_OK(kvf_layout_free(a->hc->c, a->id));
  H_OK(kvf_layout_free(b->hc->c, b->id));
}

/* The harness reads "tcp" as the remote transport under test. */
static const char *remote_path(void) { return "tcp"; }

/* ------------------------------------------------------------ transfers */

static void test_remote_whole(void **state) {
  (void)state;
  cache src, dst;
  two_caches(&src, &dst, 4 * KIB, true);
  handoff h = {.src = &src, .dst = &dst, .dst_node = "decode", .src_node = "prefill", .n = 40, .seed = 11,
               .path = remote_path()};
  H_OK(handoff_run(&h));
  free_caches(&src, &dst);
}

static void test_remote_layer_parts_events(void **state) {
  (void)state;
  cache src, dst;
  two_caches(&src, &dst, 4 * KIB, false);
  handoff h = {.src = &src, .dst = &dst, .dst_node = "decode", .src_node = "prefill", .n = 33, .parts = 8,
               .layer_events = true, .seed = 12, .path = remote_path()};
  H_OK(handoff_run(&h));
  h.parts = 3; /* groups of 3, 3 and 2 layers */
  h.seed = 13;
  H_OK(handoff_run(&h));
  free_caches(&src, &dst);
}

static void test_remote_send_first(void **state) {
  (void)state;
  cache src, dst;
  two_caches(&src, &dst, 8 * KIB, true);
  handoff h = {.src = &src, .dst = &dst, .dst_node = "decode", .src_node = "prefill", .n = 96, .parts = 4,
               .send_first = true, .layer_events = true, .seed = 14, .path = remote_path()};
  H_OK(handoff_run(&h));
  free_caches(&src, &dst);
}

/* Two clients of "decode": the same-node path. */
static void test_local(void **state) {
  (void)state;
  cache src, dst;
  cache_init(&src, &dec2, 16 * MIB, 8, 2, 64, 4 * KIB, true);
  cache_init(&dst, &F.dec, 0, 8, 2, 64, 4 * KIB, false);
  cache_register(&src);
  cache_register(&dst);
  handoff h = {.src = &src, .dst = &dst, .dst_node = "decode", .src_node = "decode", .n = 50, .seed = 15,
               .path = "local"};
  H_OK(handoff_run(&h));
  h.parts = 8;
  h.layer_events = true;
  h.send_first = true;
  h.seed = 16;
  H_OK(handoff_run(&h));
  free_caches(&src, &dst);
}

/* MLA: one latent region per layer. */
static void test_remote_mla(void **state) {
  (void)state;
  cache src, dst;
  cache_init(&src, &F.pre, 0, 6, 1, 40, 9 * KIB, false);
  cache_init(&dst, &F.dec, 0, 6, 1, 40, 9 * KIB, true);
  cache_register(&src);
  cache_register(&dst);
  handoff h = {.src = &src, .dst = &dst, .dst_node = "decode", .src_node = "prefill", .n = 17, .parts = 6,
               .seed = 17, .path = remote_path()};
  H_OK(handoff_run(&h));
  free_caches(&src, &dst);
}

/* Later parts that do not wait for their answer; one that is refused
 * fails the send with its event. */
static void test_nowait_parts(void **state) {
  (void)state;
  cache src, dst;
  two_caches(&src, &dst, 4 * KIB, false);
  handoff h = {.src = &src, .dst = &dst, .dst_node = "decode", .src_node = "prefill", .n = 30, .parts = 8,
               .layer_events = true, .nowait = true, .seed = 21, .path = remote_path()};
  H_OK(handoff_run(&h));
  uint32_t ids[4] = {3, 1, 4, 2};
  char id[96];
  h_id(id, sizeof(id), "nowait-refused");
  kvf_blocks g = {.layout = dst.id, .ids = ids, .n = 4};
  H_OK(kvf_grant_blocks(F.dec.c, id, "prefill", &g, 0, 0));
  kvf_blocks s = {.layout = src.id, .ids = ids, .n = 4, .first_layer = 0, .n_layers = 2};
  H_OK(kvf_send_blocks(F.pre.c, id, "decode", &s, KVF_SEND_MORE, 0));
  s = (kvf_blocks){.layout = src.id, .first_layer = 1, .n_layers = 2}; /* layer 1 again */
  H_OK(kvf_send_blocks(F.pre.c, id, "decode", &s, KVF_SEND_MORE | KVF_SEND_NOWAIT, 0));
  kvf_event ev;
  H_OK(h_wait_event(&F.pre, id, KVF_EV_SEND_DONE, H_XFER_MS, &ev));
  H_OK(h_expect_rc(ev.status, KVF_EINVAL, "a refused part without an answer"));
  if (!strstr(ev.error, "layer 1")) fail_msg("the event says \"%s\", not which layer", ev.error);
  H_OK(h_wait_event(&F.dec, id, KVF_EV_RECV_DONE, H_XFER_MS, &ev));
  if (ev.status == 0) fail_msg("the grant of a failed send succeeded");
  H_OK(h_no_events(&F.pre, 50));
  free_caches(&src, &dst);
}

/* ------------------------------------------------------------ errors */

static void test_register_errors(void **state) {
  (void)state;
  cache c;
  uint32_t id;
  cache_init(&c, &F.pre, F.pre.size - 64 * KIB, 4, 2, 8, 4 * KIB, false); /* 256 KiB past the pool's end */
  H_OK(h_expect_rc(kvf_layout_register(F.pre.c, &c.l, &id), KVF_ERANGE, "a layout leaving the pool"));
  cache_init(&c, &F.pre, 0, 4, 2, 8, 4 * KIB, false);
  c.offsets[3] = c.offsets[2] + 4 * KIB; /* layer 1's V overlaps its K */
  H_OK(h_expect_rc(kvf_layout_register(F.pre.c, &c.l, &id), KVF_EINVAL, "overlapping regions"));
  cache_init(&c, &F.pre, 0, 4, 2, 8, 4 * KIB, false);
  c.l.pool = 999;
  H_OK(h_expect_rc(kvf_layout_register(F.pre.c, &c.l, &id), KVF_ENOPOOL, "an unknown pool"));
  H_OK(h_expect_rc(kvf_layout_free(F.pre.c, 123456), KVF_ENOENT, "freeing an unknown layout"));
}

static void test_request_errors(void **state) {
  (void)state;
  cache src, dst;
  two_caches(&src, &dst, 4 * KIB, false);
  uint32_t ids[2] = {1, 2}, bad[2] = {1, 96};
  kvf_blocks b = {.layout = 4242, .ids = ids, .n = 2};
  H_OK(h_expect_rc(kvf_grant_blocks(F.dec.c, "e1", "prefill", &b, 0, 0), KVF_ENOENT, "grant, unknown layout"));
  H_OK(h_expect_rc(kvf_send_blocks(F.pre.c, "e1", "decode", &b, 0, 0), KVF_ENOENT, "send, unknown layout"));
  /* another client's layout is unknown to this one */
  b.layout = src.id;
  H_OK(h_expect_rc(kvf_grant_blocks(dec2.c, "e1", "prefill", &b, 0, 0), KVF_ENOENT, "a layout of another client"));
  b = (kvf_blocks){.layout = dst.id, .ids = bad, .n = 2};
  H_OK(h_expect_rc(kvf_grant_blocks(F.dec.c, "e1", "prefill", &b, 0, 0), KVF_ERANGE, "a block id past the layout"));
  b = (kvf_blocks){.layout = src.id, .ids = bad, .n = 2};
  H_OK(h_expect_rc(kvf_send_blocks(F.pre.c, "e1", "decode", &b, 0, 0), KVF_ERANGE, "send, a block id past it"));
  b = (kvf_blocks){.layout = src.id, .ids = ids, .n = 2, .first_layer = 6, .n_layers = 3};
  H_OK(h_expect_rc(kvf_send_blocks(F.pre.c, "e1", "decode", &b, 0, 0), KVF_ERANGE, "layers past the layout"));
  b = (kvf_blocks){.layout = dst.id, .ids = ids, .n = 0};
  H_OK(h_expect_rc(kvf_grant_blocks(F.dec.c, "e1", "prefill", &b, 0, 0), KVF_EINVAL, "a grant of no blocks"));
  H_OK(h_no_events(&F.dec, 50));
  H_OK(h_no_events(&F.pre, 0));
  free_caches(&src, &dst);
}

/* Different block sizes: both sides fail with KVF_ESIZE (the receiver by
 * the sender's word), nothing lands. */
static void test_geometry_mismatch(void **state) {
  (void)state;
  cache src, dst;
  cache_init(&src, &F.pre, 0, 8, 2, 96, 8 * KIB, false);
  cache_init(&dst, &F.dec, 0, 8, 2, 96, 4 * KIB, false);
  cache_register(&src);
  cache_register(&dst);
  uint32_t ids[4] = {0, 5, 9, 3};
  char id[96];
  h_id(id, sizeof(id), "mismatch");
  h_poison(F.dec.base, dst.span);
  kvf_blocks g = {.layout = dst.id, .ids = ids, .n = 4}, s = {.layout = src.id, .ids = ids, .n = 4};
  H_OK(kvf_grant_blocks(F.dec.c, id, "prefill", &g, 0, 0));
  H_OK(kvf_send_blocks(F.pre.c, id, "decode", &s, 0, 0));
  kvf_event ev;
  H_OK(h_wait_event(&F.pre, id, KVF_EV_SEND_DONE, H_XFER_MS, &ev));
  H_OK(h_expect_rc(ev.status, KVF_ESIZE, "the sender's event"));
  H_OK(h_wait_event(&F.dec, id, KVF_EV_RECV_DONE, H_XFER_MS, &ev));
  if (ev.status == 0) fail_msg("the receiver succeeded with a mismatched geometry");
  assert_int_equal(h_verify_poison(F.dec.base, dst.span), -1);
  /* the same with blocks against descriptors */
  h_id(id, sizeof(id), "mixed");
  kvf_desc d = {.pool = F.dec.pool, .offset = 0, .len = 4 * KIB};
  H_OK(kvf_grant(F.dec.c, id, "prefill", &d, 1, 0));
  H_OK(kvf_send_blocks(F.pre.c, id, "decode", &s, 0, 0));
  H_OK(h_wait_event(&F.pre, id, KVF_EV_SEND_DONE, H_XFER_MS, &ev));
  H_OK(h_expect_rc(ev.status, KVF_EINVAL, "blocks sent into a grant of descriptors"));
  H_OK(h_wait_event(&F.dec, id, KVF_EV_RECV_DONE, H_XFER_MS, &ev));
  if (ev.status == 0) fail_msg("a grant of descriptors took blocks");
  H_OK(h_wait_idle(F.pre.c, 10000));
  H_OK(h_wait_idle(F.dec.c, 10000));
  free_caches(&src, &dst);
}

/* A part after its transfer was cancelled is refused at once. */
static void test_stray_part(void **state) {
  (void)state;
  cache src, dst;
  two_caches(&src, &dst, 4 * KIB, false);
  uint32_t ids[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  char id[96];
  h_id(id, sizeof(id), "stray");
  kvf_blocks g = {.layout = dst.id, .ids = ids, .n = 8};
  H_OK(kvf_grant_blocks(F.dec.c, id, "prefill", &g, 0, 0));
  kvf_blocks s = {.layout = src.id, .ids = ids, .n = 8, .first_layer = 0, .n_layers = 2};
  H_OK(kvf_send_blocks(F.pre.c, id, "decode", &s, KVF_SEND_MORE, 0));
  H_OK(kvf_cancel(F.pre.c, id));
  s = (kvf_blocks){.layout = src.id, .first_layer = 2, .n_layers = 2};
  H_OK(h_expect_rc(kvf_send_blocks(F.pre.c, id, "decode", &s, KVF_SEND_MORE, 0), KVF_ENOENT,
                   "a part after the send was cancelled"));
  kvf_event ev;
  H_OK(h_wait_event(&F.pre, id, KVF_EV_SEND_DONE, H_XFER_MS, &ev));
  H_OK(h_expect_rc(ev.status, KVF_ECANCELED, "the cancelled send's event"));
  H_OK(h_wait_event(&F.dec, id, KVF_EV_RECV_DONE, H_XFER_MS, &ev));
  if (ev.status == 0) fail_msg("the grant of a cancelled send succeeded");
  /* once its event is taken the id is free for a new transfer */
  handoff h = {.src = &src, .dst = &dst, .dst_node = "decode", .src_node = "prefill", .n = 8, .seed = 18,
               .path = remote_path()};
  H_OK(handoff_run(&h));
  H_OK(h_no_events(&F.pre, 50));
  free_caches(&src, &dst);
}

/* A layout freed (or its client gone) while a transfer uses it: the
 * transfer completes; the registry forgets it. */
static void test_layout_lifetime(void **state) {
  (void)state;
  h_client tmp;
  H_OK(h_client_open(&tmp, &F.p.decode));
  cache src, dst;
  cache_init(&src, &F.pre, 0, 8, 2, 96, 4 * KIB, false);
  cache_init(&dst, &tmp, 0, 8, 2, 96, 4 * KIB, false);
  cache_register(&src);
  cache_register(&dst);
  uint32_t ids[12];
  pick_ids(ids, 12, 96, 19);
  char id[96];
  h_id(id, sizeof(id), "lifetime");
  fill_src(&src, ids, 12, 19);
  h_poison(tmp.base, dst.span);
  kvf_blocks g = {.layout = dst.id, .ids = ids, .n = 12};
  H_OK(kvf_grant_blocks(tmp.c, id, "prefill", &g, 0, 0));
  H_OK(kvf_layout_free(tmp.c, dst.id));
  kvf_blocks s = {.layout = src.id, .ids = ids, .n = 12};
  H_OK(kvf_send_blocks(F.pre.c, id, "decode", &s, 0, 0));
  kvf_event ev;
  H_OK(h_wait_event(&tmp, id, KVF_EV_RECV_DONE, H_XFER_MS, &ev));
  H_OK(h_expect_rc(ev.status, 0, "a grant whose layout its client freed"));
  H_OK(verify_dst(&dst, ids, 12, 19));
  H_OK(h_wait_event(&F.pre, id, KVF_EV_SEND_DONE, H_XFER_MS, &ev));
  H_OK(h_expect_rc(ev.status, 0, "its send"));
  /* a client that closes with layouts registered leaves none behind */
  cache_register(&dst);
  h_client_close(&tmp);
  H_OK(h_wait_clients(F.dec.c, 2, 10000));
  char *json, key[32];
  H_OK(h_inspect(F.dec.c, KVF_INSPECT_LAYOUTS, &json));
  snprintf(key, sizeof(key), "{\"id\": %u,", dst.id);
  bool gone = strstr(json, key) == NULL;
  if (!gone) fprintf(stderr, "layout %u outlived its client: %s\n", dst.id, json);
  free(json);
  assert_true(gone);
  H_OK(kvf_layout_free(F.pre.c, src.id));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_remote_whole),
      cmocka_unit_test(test_remote_layer_parts_events),
      cmocka_unit_test(test_remote_send_first),
      cmocka_unit_test(test_local),
      cmocka_unit_test(test_remote_mla),
      cmocka_unit_test(test_nowait_parts),
      cmocka_unit_test(test_register_errors),
      cmocka_unit_test(test_request_errors),
      cmocka_unit_test(test_geometry_mismatch),
      cmocka_unit_test(test_stray_part),
      cmocka_unit_test(test_layout_lifetime),
  };
  h_init();
  return h_cleanup(cmocka_run_group_tests_name("blocks", tests, group_setup, group_teardown));
}
