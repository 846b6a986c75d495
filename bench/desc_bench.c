/* desc_bench - what the daemon spends per descriptor of a SendReq frame
 * before a transport sees it: protobuf unpack, kvf__descs_from_wire, the
 * range check against the pools, and kvf__pair against a grant, on a
 * frame of N scattered 32 KiB descriptors, REPS times; the same process
 * allocates and frees as the daemon does for each request.
 *
 *   desc-bench [N REPS] [--keep]
 *   desc-bench --overlap [N REPS [OTHERS OTHER_DESCS]]
 *
 * --keep applies the daemon's heap policy (kvf__keep_freed_memory);
 * without it, glibc's defaults. Prints ns per descriptor for each step.
 *
 * --overlap: what a receive grant of N descriptors costs in overlap checks
 * (daemon/grant_index.c, issue 15 item 10), as kvf__xfer_claim spends it:
 * its ranges as items, each checked against the granule map of the pool
 * (the grant's own earlier ranges and the open grants') and added to it
 * (claim_ns); and taken out again when it ends (release_ns).
 * Four lines: ascending and shuffled offsets, with no other grant open and
 * with OTHERS (100) open grants of OTHER_DESCS (1024) descriptors each.
 * Every descriptor is 4 KiB at its own 8 KiB slot (nothing coalesces);
 * the slots of all grants are interleaved at random over the pool, the
 * worst case for the index. Each figure is the median over REPS (50) of
 * one grant's time divided by N; check_ns = claim + release. before_ns is what a grant's descriptors cost
 * without the check (kvf__descs_from_wire and the pools' range check).
 * Then two lines for a grant of 256 blocks of a 32-layer K/V layout
 * (16,384 pieces) through kvf__xfer_claim, with 0 and 100 other open
 * grants of 16 blocks: ns per piece. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "desc.h"
#include "grant_index.h"
#include "kvferry.pb-c.h"
#include "kvferryd.h"
#include "pool.h"
#include "xfer.h"

#define POOL_BYTES (2ull << 30)
#define BLOCK 32768u

static int in_pool(void *ctx, uint32_t pool, uint64_t off, uint64_t len) {
  return pool == 0 && off <= POOL_BYTES && len <= POOL_BYTES - off ? 0 : -1;
}

static uint64_t lcg(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

static uint64_t pool_bytes(uint32_t pool) { return pool == 0 ? POOL_BYTES : 0; }

static void shuffle(uint64_t *v, size_t n, uint64_t *seed) {
  for (size_t i = n - 1; i > 0; i--) {
    size_t j = lcg(seed) % (i + 1);
    uint64_t t = v[i];
    v[i] = v[j], v[j] = t;
  }
}

static int u64_cmp(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static double median(uint64_t *v, int n) {
  qsort(v, (size_t)n, sizeof(*v), u64_cmp);
  return n % 2 ? (double)v[n / 2] : ((double)v[n / 2 - 1] + (double)v[n / 2]) / 2;
}

/* n descriptors of 4 KiB at slots[0..n) (8 KiB apart), in that order. */
static int descs_at(kvf__descs *d, const uint64_t *slots, size_t n) {
  uint8_t *packed = malloc(n * KVF__DESC_WIRE_SIZE);
  if (!packed) return -1;
  for (size_t i = 0; i < n; i++) {
    uint32_t pool = 0;
    uint64_t off = slots[i] * 8192, len = 4096;
    memcpy(packed + i * KVF__DESC_WIRE_SIZE, &pool, 4);
    memcpy(packed + i * KVF__DESC_WIRE_SIZE + 4, &off, 8);
    memcpy(packed + i * KVF__DESC_WIRE_SIZE + 12, &len, 8);
  }
  Kvf__DescList dl = KVF__DESC_LIST__INIT;
  dl.packed.data = packed;
  dl.packed.len = n * KVF__DESC_WIRE_SIZE;
  int rc = kvf__descs_from_wire(d, &dl, n);
  free(packed);
  return rc;
}

static int claim(kvf__gindex *g, const kvf__descs *d, const void *owner) {
  kvf__gi_item *v;
  if (kvf__gi_items_of_descs(d, &v) != 0) return -1;
  kvf__gi_clash c;
  int rc = kvf__gi_claim(g, v, d->n, owner, true, &c);
  if (rc) free(v); /* else the index keeps it */
  return rc;
}

static int overlap_case(size_t n, int reps, size_t others, size_t other_n, bool shuffled) {
  size_t total = n + others * other_n;
  uint64_t seed = 42, *slots = malloc(total * sizeof(*slots));
  if (!slots) return 1;
  for (size_t i = 0; i < total; i++) slots[i] = i;
  shuffle(slots, total, &seed); /* every grant's slots interleaved with the others' */
  kvf__gindex g = {.size_of = pool_bytes};
  static char owners[4097]; /* their addresses name the grants */
  if (others >= sizeof(owners)) return 2;
  for (size_t k = 0; k < others; k++) {
    kvf__descs o;
    uint64_t *s = slots + n + k * other_n;
    qsort(s, other_n, sizeof(*s), u64_cmp);
    if (descs_at(&o, s, other_n) != 0 || claim(&g, &o, &owners[0] + k + 1) != 0) return 1;
    kvf__descs_free(&o);
  }
  if (!shuffled) qsort(slots, n, sizeof(*slots), u64_cmp);
  kvf__descs d;
  if (descs_at(&d, slots, n) != 0) return 1;
  uint8_t *packed = malloc(n * KVF__DESC_WIRE_SIZE);
  Kvf__DescList dl = KVF__DESC_LIST__INIT;
  if (!packed || kvf__descs_to_wire(&d, &dl) != 0) return 1;
  /* Medians over the reps (the first, untimed, warms the map and the
   * heap): the host is shared, and a mean takes in every hiccup. */
  uint64_t *tb = calloc((size_t)reps, sizeof(*tb)), *tc = calloc((size_t)reps, sizeof(*tc)),
           *tr = calloc((size_t)reps, sizeof(*tr)), *tt = calloc((size_t)reps, sizeof(*tt));
  if (!tb || !tc || !tr || !tt) return 1;
  for (int r = -1; r < reps; r++) {
    uint64_t t0 = kvf__now_ns();
    kvf__descs w;
    size_t bad;
    if (kvf__descs_from_wire(&w, &dl, n) != 0 || kvf__descs_check(&w, in_pool, NULL, &bad) != 0) return 1;
    uint64_t t1 = kvf__now_ns();
    if (claim(&g, &w, &owners[0]) != 0) return 1;
    uint64_t t2 = kvf__now_ns();
    kvf__gi_release(&g, &owners[0]);
    uint64_t t3 = kvf__now_ns();
    kvf__descs_free(&w);
    if (r < 0) continue;
    tb[r] = t1 - t0, tc[r] = t2 - t1, tr[r] = t3 - t2, tt[r] = t3 - t1;
  }
  double k = (double)n;
  printf("{\"descriptors\": %zu, \"order\": \"%s\", \"open_grants\": %zu, \"open_descriptors\": %zu, "
         "\"reps\": %d, \"before_ns\": %.1f, \"claim_ns\": %.1f, \"release_ns\": %.1f, \"check_ns\": %.1f}\n",
         n, shuffled ? "shuffled" : "sorted", others, others * other_n, reps, median(tb, reps) / k,
         median(tc, reps) / k, median(tr, reps) / k, median(tt, reps) / k);
  free(tb), free(tc), free(tr), free(tt);
  if (kvf__gi_count(&g) != others * other_n) return 1;
  kvf__gi_free(&g);
  kvf__descs_wire_free(&dl);
  kvf__descs_free(&d);
  free(packed);
  free(slots);
  return 0;
}

/* A grant of blocks through the daemon's own glue (kvf__xfer_claim and
 * kvf__xfer_unclaim): a vLLM-like layout of 32 layers x K/V, 2048 blocks
 * of 16 KiB in a 2 GiB pool; the grant takes `blocks` random blocks, and
 * `others` open grants of 16 blocks each hold other random blocks. */
static int blocks_case(size_t blocks, int reps, size_t others) {
  enum { LAYERS = 32, KV = 2, NB = 2048, BB = 16384, OTHER_BLOCKS = 16 };
  if (blocks + others * OTHER_BLOCKS > NB) return 2;
  static kvf__pool pool;
  static kvf__pool *pools[1] = {&pool};
  pool.size = (uint64_t)LAYERS * KV * NB * BB;
  kvfd.pools = pools;
  kvfd.n_pools = 1;
  uint64_t offsets[LAYERS * KV], seed = 9, ids[NB];
  for (size_t r = 0; r < LAYERS * KV; r++) offsets[r] = r * (uint64_t)NB * BB;
  for (size_t i = 0; i < NB; i++) ids[i] = i;
  shuffle(ids, NB, &seed);
  kvf__xfer *x = calloc(others + 1, sizeof(*x));
  if (!x) return 1;
  char err[256];
  for (size_t k = 0; k <= others; k++) {
    size_t n = k == 0 ? blocks : OTHER_BLOCKS, at = k == 0 ? 0 : blocks + (k - 1) * OTHER_BLOCKS;
    kvf__xfer *g = &x[k];
    snprintf(g->id, sizeof(g->id), "g%zu", k);
    g->role = KVF__RECV;
    g->blocks = true;
    g->mine.view = (kvf__lview){.pool = 0, .n_kv = KV, .n_blocks = NB, .first_layer = 0, .n_layers = LAYERS,
                                .block_bytes = BB, .block_stride = BB, .offsets = offsets};
    g->mine.ids = malloc(n * sizeof(uint32_t));
    if (!g->mine.ids) return 1;
    for (size_t i = 0; i < n; i++) g->mine.ids[i] = (uint32_t)ids[at + i];
    g->mine.n = n;
    if (k > 0 && kvf__xfer_claim(g, err, sizeof(err)) != 0) return 1;
  }
  uint64_t *tc = calloc((size_t)reps, sizeof(*tc)), *tr = calloc((size_t)reps, sizeof(*tr));
  if (!tc || !tr) return 1;
  for (int r = -1; r < reps; r++) {
    uint64_t t0 = kvf__now_ns();
    if (kvf__xfer_claim(&x[0], err, sizeof(err)) != 0) return 1;
    uint64_t t1 = kvf__now_ns();
    kvf__xfer_unclaim(&x[0]);
    uint64_t t2 = kvf__now_ns();
    if (r >= 0) tc[r] = t1 - t0, tr[r] = t2 - t1;
  }
  double pieces = (double)blocks * LAYERS * KV;
  printf("{\"blocks\": %zu, \"pieces\": %.0f, \"open_grants\": %zu, \"reps\": %d, \"claim_ns_per_piece\": %.1f, "
         "\"release_ns_per_piece\": %.1f, \"grant_us\": %.1f}\n",
         blocks, pieces, others, reps, median(tc, reps) / pieces, median(tr, reps) / pieces,
         (median(tc, reps) + median(tr, reps)) / 1e3);
  for (size_t k = 0; k <= others; k++) {
    kvf__xfer_unclaim(&x[k]);
    free(x[k].mine.ids);
  }
  free(x), free(tc), free(tr);
  kvfd.pools = NULL;
  kvfd.n_pools = 0;
  return 0;
}

/* desc-bench --overlap [N REPS [OTHERS OTHER_DESCS]] */
static int overlap_main(int argc, char **argv) {
  size_t n = argc > 2 ? strtoull(argv[2], NULL, 10) : 16384;
  int reps = argc > 3 ? atoi(argv[3]) : 50;
  size_t others = argc > 4 ? strtoull(argv[4], NULL, 10) : 100;
  size_t other_n = argc > 5 ? strtoull(argv[5], NULL, 10) : 1024;
  if (n == 0 || reps <= 0 || (others && !other_n)) return 2;
  kvf__keep_freed_memory(); /* as the daemon runs */
  for (int o = 0; o < 2; o++)
    for (int sh = 0; sh < 2; sh++)
      if (overlap_case(n, reps, o ? others : 0, other_n, sh) != 0) return 1;
  for (int o = 0; o < 2; o++)
    if (blocks_case(256, reps, o ? 100 : 0) != 0) return 1;
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--overlap") == 0) return overlap_main(argc, argv);
  size_t n = argc > 1 && argv[1][0] != '-' ? strtoull(argv[1], NULL, 10) : 4096;
  int reps = argc > 2 && argv[2][0] != '-' ? atoi(argv[2]) : 200;
  if (argc > 1 && strcmp(argv[argc - 1], "--keep") == 0) kvf__keep_freed_memory();
  if (n == 0 || reps <= 0) return 2;
  uint64_t seed = 1, slots = POOL_BYTES / BLOCK;
  uint8_t *packed = malloc(n * KVF__DESC_WIRE_SIZE);
  for (size_t i = 0; i < n; i++) {
    uint32_t pool = 0;
    uint64_t off = lcg(&seed) % slots * BLOCK, len = BLOCK;
    memcpy(packed + i * KVF__DESC_WIRE_SIZE, &pool, 4); /* little-endian hosts, as the wire */
    memcpy(packed + i * KVF__DESC_WIRE_SIZE + 4, &off, 8);
    memcpy(packed + i * KVF__DESC_WIRE_SIZE + 12, &len, 8);
  }
  Kvf__DescList dl = KVF__DESC_LIST__INIT;
  dl.packed.data = packed;
  dl.packed.len = n * KVF__DESC_WIRE_SIZE;
  Kvf__SendReq sr = KVF__SEND_REQ__INIT;
  sr.xfer_id = "req-1";
  sr.dst_node = "decode";
  sr.descs = &dl;
  Kvf__ApiRequest q = KVF__API_REQUEST__INIT;
  q.body_case = KVF__API_REQUEST__BODY_SEND;
  q.send = &sr;
  size_t len = kvf__api_request__get_packed_size(&q);
  uint8_t *frame = malloc(len);
  kvf__api_request__pack(&q, frame);
  kvf__descs grant;
  if (kvf__descs_from_wire(&grant, &dl, n) != 0) return 1;
  for (size_t i = 0; i < n; i++) grant.offset[i] = lcg(&seed) % slots * BLOCK;
  uint64_t t[4] = {0};
  for (int r = 0; r < reps; r++) {
    uint64_t t0 = kvf__now_ns();
    Kvf__ApiRequest *u = kvf__api_request__unpack(NULL, len, frame);
    uint64_t t1 = kvf__now_ns();
    kvf__descs d;
    if (!u || kvf__descs_from_wire(&d, u->send->descs, n) != 0) return 1;
    uint64_t t2 = kvf__now_ns();
    size_t bad;
    if (kvf__descs_check(&d, in_pool, NULL, &bad) != 0) return 1;
    uint64_t t3 = kvf__now_ns();
    size_t cursor = 0;
    kvf__runs runs = {0};
    if (kvf__pair(&d, &grant, &cursor, &runs) != 0) return 1;
    uint64_t t4 = kvf__now_ns();
    t[0] += t1 - t0, t[1] += t2 - t1, t[2] += t3 - t2, t[3] += t4 - t3;
    kvf__runs_free(&runs);
    kvf__descs_free(&d);
    kvf__api_request__free_unpacked(u, NULL);
  }
  double k = (double)reps * (double)n;
  printf("{\"descriptors\": %zu, \"reps\": %d, \"heap\": \"%s\", \"unpack_ns\": %.1f, \"from_wire_ns\": %.1f, "
         "\"check_ns\": %.1f, \"pair_ns\": %.1f}\n",
         n, reps, strcmp(argv[argc - 1], "--keep") == 0 ? "kept" : "glibc defaults", t[0] / k, t[1] / k, t[2] / k,
         t[3] / k);
  kvf__descs_free(&grant);
  free(frame);
  free(packed);
  return 0;
}
