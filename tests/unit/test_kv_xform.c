/* test_kv_xform.c - transforms between KV layouts (daemon/kv_xform.c):
 * for every combination of head ranges (same, superset, subset, partial
 * overlap), orders (NHD, HND both ways), tokens per block (the same, a
 * factor either way) and MLA, the plan's runs applied to a pool produce
 * exactly what a reference computes element by element from the layouts'
 * index math (written here from the definitions, not from the plan), and
 * nothing else in the pool changes; runs name the grant's piece they start
 * in and coalesce what is contiguous; layouts that cannot be reconciled
 * are refused with KVF_ESIZE and a reason naming the mismatch. The GPU
 * transform kernel's address math (cuda/copy_args.h: kvf_xblocks_locate,
 * _piece, _word, and the walk, kvf_xwalk) is run here on the CPU over the
 * same cases, its pieces split in two launches as two GPUs would, against
 * the same reference. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/copy_args.h"
#include "kv_xform.h"

#define L 3          /* layers */
#define HEAD_DIM 3   /* odd, so that a unit is not a power of two */
#define DTYPE 2
#define UNIT (HEAD_DIM * DTYPE)
#define MAXB 64

typedef struct side {
  kvf__lview v;
  uint64_t off[2 * L];
  uint32_t ids[MAXB];
  size_t n;
  uint8_t *mem;
  size_t size;
  uint32_t tpb, heads, h0, order, n_kv;
} side;

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)rng;
}

/* A per-layer layout ([n_kv][n_blocks] per layer, regions back to back)
 * of n blocks named by the transfer out of nb in the pool; ids shuffled
 * unless contiguous. */
static void make_side(side *x, uint32_t n_kv, uint32_t tpb, uint32_t heads, uint32_t h0, uint32_t model,
                      uint32_t order, size_t n, uint32_t nb, bool contiguous) {
  memset(x, 0, sizeof(*x));
  uint64_t bb = (uint64_t)tpb * heads * UNIT;
  x->n_kv = n_kv, x->tpb = tpb, x->heads = heads, x->h0 = h0, x->order = order, x->n = n;
  for (uint32_t r = 0; r < L * n_kv; r++) x->off[r] = 16 + r * nb * bb; /* 16: the pool's first bytes unused */
  x->v = (kvf__lview){.pool = 1, .n_kv = n_kv, .n_blocks = nb, .first_layer = 0, .n_layers = L, .block_bytes = bb,
                      .block_stride = bb, .offsets = x->off,
                      .geom = {tpb, heads, HEAD_DIM, DTYPE, order, h0, model}};
  uint32_t perm[MAXB];
  for (uint32_t i = 0; i < nb; i++) perm[i] = i;
  if (!contiguous)
    for (uint32_t i = nb - 1; i > 0; i--) {
      uint32_t j = rnd() % (i + 1), t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
  memcpy(x->ids, perm, n * sizeof(uint32_t));
  x->size = 16 + (size_t)L * n_kv * nb * bb + 16;
  x->mem = malloc(x->size);
  assert_non_null(x->mem);
  for (size_t i = 0; i < x->size; i++) x->mem[i] = (uint8_t)rnd();
}

/* Where token t (of the transfer) of model head h of region (l, kv) sits
 * in x's pool: the definitions of NHD and HND, nothing else. */
static size_t ref_addr(const side *x, uint32_t l, uint32_t kv, uint64_t t, uint32_t h) {
  uint64_t block = x->ids[t / x->tpb], slot = t % x->tpb, hh = h - x->h0;
  uint64_t in = x->order == KVF_LAYOUT_NHD ? (slot * x->heads + hh) : (hh * x->tpb + slot);
  return (size_t)(x->off[l * x->n_kv + kv] + block * x->v.block_bytes + in * UNIT);
}

/* What d's pool must hold: every granted token of every shared head. */
static uint8_t *reference(const side *s, const side *d) {
  uint8_t *out = malloc(d->size);
  assert_non_null(out);
  memcpy(out, d->mem, d->size);
  uint32_t lo = s->h0 > d->h0 ? s->h0 : d->h0;
  uint32_t hi = s->h0 + s->heads < d->h0 + d->heads ? s->h0 + s->heads : d->h0 + d->heads;
  uint64_t tokens = (uint64_t)d->n * d->tpb;
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t kv = 0; kv < d->n_kv; kv++)
      for (uint64_t t = 0; t < tokens; t++)
        for (uint32_t h = lo; h < hi; h++)
          for (size_t b = 0; b < UNIT; b++) out[ref_addr(d, l, kv, t, h) + b] = s->mem[ref_addr(s, l, kv, t, h) + b];
  return out;
}

typedef struct apply_ctx {
  const side *s, *d;
  uint8_t *out;
  size_t runs;
  uint64_t max_len, min_len;
  bool bad_piece;
} apply_ctx;

static void apply(void *arg, uint64_t so, uint64_t dof, uint64_t len, uint32_t piece) {
  apply_ctx *c = arg;
  assert_true(so + len <= c->s->size && dof + len <= c->d->size);
  memcpy(c->out + dof, c->s->mem + so, len);
  c->runs++;
  if (len > c->max_len) c->max_len = len;
  if (len < c->min_len) c->min_len = len;
  /* piece = (layer * n_kv + kv) * nd + i: the run starts in that block */
  size_t nd = c->d->n, i = piece % nd, r = piece / nd;
  uint64_t start = c->d->off[r] + (uint64_t)c->d->ids[i] * c->d->v.block_bytes;
  if (dof < start || dof >= start + c->d->v.block_bytes) c->bad_piece = true;
}

/* The transform kernel's loops, on the CPU: pieces [p0, p1) as a launch
 * covers them, each word copied at the address kvf_xblocks_word gives. */
static void kernel_range(const kvf_xblocks_args *a, const side *s, const side *d, uint8_t *out, unsigned p0,
                         unsigned p1) {
  for (unsigned p = p0; p < p1; p++) {
    kvf_xloc l = kvf_xblocks_locate(a, p);
    unsigned sid = a->inline_ids[l.si], did = a->inline_ids[a->ns + l.di];
    unsigned long long sb = a->e.src_base + s->off[l.r] + sid * a->e.src_stride;
    unsigned long long db = a->e.dst_base + d->off[l.r] + did * a->e.dst_stride;
    kvf_xpiece x = kvf_xblocks_piece(a, &l, sb, db);
    assert_int_equal(x.width * x.upw, a->unit);
    assert_int_equal(sb % x.width, 0);
    for (unsigned w = 0; w < x.words; w++) {
      unsigned long long so, dof;
      kvf_xblocks_word(a, &x, w, &so, &dof);
      assert_true(so % x.width == 0 && dof % x.width == 0);
      assert_true(so >= a->e.src_base && so + x.width <= a->e.src_base + s->size);
      assert_true(dof >= a->e.dst_base && dof + x.width <= a->e.dst_base + d->size);
      memcpy((void *)(uintptr_t)dof, (const void *)(uintptr_t)so, x.width);
    }
  }
}

/* The kernel's walk (cuda/copy_args.h, kvf_xwalk) on the CPU: each thread
 * t < gs of a group on each piece of [p0, p1), its loads and its stores
 * each stepped on their own as the kernel steps them; the group copies
 * every word of the piece, once. */
static void walk_range(const kvf_xblocks_args *a, const side *s, const side *d, unsigned width, unsigned gs,
                       unsigned p0, unsigned p1) {
  for (unsigned p = p0; p < p1; p++) {
    kvf_xloc l = kvf_xblocks_locate(a, p);
    unsigned sid = a->inline_ids[l.si], did = a->inline_ids[a->ns + l.di];
    kvf_xpiece x = kvf_xblocks_piece(a, &l, a->e.src_base + s->off[l.r] + sid * a->e.src_stride,
                                     a->e.dst_base + d->off[l.r] + did * a->e.dst_stride);
    unsigned long long sb, db;
    kvf_xwalk_bases(a, &x, &sb, &db);
    uint64_t words = 0;
    for (unsigned t = 0; t < gs; t++) {
      kvf_xwalk w;
      assert_true(kvf_xwalk_init(a, width, gs, t, &w));
      unsigned so = w.so, si = w.in, dof = w.dof, di = w.in;
      for (unsigned n = 0; n < w.count; n++) {
        assert_true(sb + so >= x.src && sb + so + width <= x.src + s->v.block_bytes);
        assert_true(db + dof >= x.dst && db + dof + width <= x.dst + d->v.block_bytes);
        memcpy((void *)(uintptr_t)(db + dof), (const void *)(uintptr_t)(sb + so), width);
        kvf_xwalk_next(&w, &so, &si, w.s_step, w.s_wrap);
        kvf_xwalk_next(&w, &dof, &di, w.d_step, w.d_wrap);
      }
      words += w.count;
    }
    assert_int_equal(words, (uint64_t)a->g * a->nh * (a->unit / width));
  }
}

static kvf_xblocks_args kargs; /* 3.5 KiB */

/* The walk at every word width that divides the unit, in groups of 1, 2,
 * 3, 5 and 64 units' words (64: more threads than units, some idle), and
 * its refusal where the group is not a whole number of units wide. */
static void walk_on_cpu(const side *s, const side *d, uint8_t *out, const uint8_t *want, unsigned pieces) {
  static const unsigned mult[] = {1, 2, 3, 5, 64};
  for (unsigned width = 1; width <= 16; width *= 2) {
    if (UNIT % width) continue;
    unsigned upw = UNIT / width;
    for (size_t m = 0; m < sizeof(mult) / sizeof(mult[0]); m++) {
      memcpy(out, d->mem, d->size);
      kargs.e.dst_base = (uintptr_t)out;
      walk_range(&kargs, s, d, width, mult[m] * upw, pieces / 2, pieces);
      walk_range(&kargs, s, d, width, mult[m] * upw, 0, pieces / 2);
      assert_memory_equal(out, want, d->size);
    }
    kvf_xwalk w;
    if (upw > 1) assert_false(kvf_xwalk_init(&kargs, width, upw + 1, 0, &w));
  }
}

static void kernel_on_cpu(const kvf__xplan *plan, const side *s, const side *d, const uint8_t *want) {
  uint8_t *out = malloc(d->size);
  assert_non_null(out);
  memcpy(out, d->mem, d->size);
  memset(&kargs, 0, sizeof(kargs));
  kvf__xform_kargs(plan, &kargs);
  kargs.e.src_base = (uintptr_t)s->mem;
  kargs.e.dst_base = (uintptr_t)out;
  kargs.e.src_stride = s->v.block_stride;
  kargs.e.dst_stride = d->v.block_stride;
  assert_true(s->n + d->n <= KVF__BLOCKS_INLINE_IDS);
  memcpy(kargs.inline_ids, s->ids, s->n * sizeof(uint32_t));
  memcpy(kargs.inline_ids + s->n, d->ids, d->n * sizeof(uint32_t));
  unsigned pieces = L * s->n_kv * kargs.chunks, half = pieces / 2;
  kernel_range(&kargs, s, d, out, half, pieces); /* two launches, as two GPUs share one */
  kernel_range(&kargs, s, d, out, 0, half);
  assert_memory_equal(out, want, d->size);
  walk_on_cpu(s, d, out, want, pieces);
  free(out);
}

/* Strided runs (kvf__xform_runs_strided, for rdma's gathered writes),
 * cut at max_pieces, applied piece by piece: the same bytes as the walk
 * (want); each run's pieces land back to back and are read a step apart.
 * Where the plan has no fixed step they are refused. Returns the runs. */
static size_t check_strided(const kvf__xplan *plan, const side *s, const side *d, const uint8_t *want,
                            uint32_t max_pieces) {
  kvf__runs runs = {0};
  if (!kvf__xplan_strides(plan)) {
    assert_int_equal(kvf__xform_runs_strided(plan, &s->v, s->ids, &d->v, d->ids, 0, L, max_pieces, &runs), -EINVAL);
    assert_int_equal(runs.n, 0);
    return 0;
  }
  assert_true(plan->s.order == KVF_LAYOUT_NHD && plan->d.order == KVF_LAYOUT_HND);
  assert_int_equal(kvf__xform_runs_strided(plan, &s->v, s->ids, &d->v, d->ids, 0, L, max_pieces, &runs), 0);
  assert_int_equal(runs.unit, UNIT);
  assert_int_equal(runs.step, (uint64_t)s->heads * UNIT); /* a token's row of the source's heads */
  uint8_t *out = malloc(d->size);
  assert_non_null(out);
  memcpy(out, d->mem, d->size);
  uint64_t bytes = 0;
  for (size_t i = 0; i < runs.n; i++) {
    const kvf__run *r = &runs.v[i];
    assert_true(r->len % UNIT == 0 && r->len >= UNIT && r->len <= (uint64_t)max_pieces * UNIT);
    for (uint64_t k = 0; k < r->len / UNIT; k++) {
      uint64_t so = r->src_off + k * runs.step, dof = r->dst_off + k * UNIT;
      assert_true(so + UNIT <= s->size && dof + UNIT <= d->size);
      memcpy(out + dof, s->mem + so, UNIT);
    }
    bytes += r->len;
  }
  assert_int_equal(bytes, runs.bytes);
  assert_int_equal(bytes, kvf__xplan_bytes(plan, L, d->n_kv));
  assert_memory_equal(out, want, d->size);
  size_t n = runs.n;
  kvf__runs more = {.unit = UNIT, .step = runs.step + 1}; /* a list of another stride is not extended */
  assert_int_equal(kvf__xform_runs_strided(plan, &s->v, s->ids, &d->v, d->ids, 0, L, max_pieces, &more), -EINVAL);
  kvf__runs_free(&runs);
  free(out);
  return n;
}

static size_t strided_cases, strided_runs, strided_pieces;

typedef struct combo {
  uint32_t n_kv, model;
  uint32_t s_tpb, s_heads, s_h0, s_order;
  uint32_t d_tpb, d_heads, d_h0, d_order;
  size_t nd;
  bool contiguous;
} combo;

/* Runs the plan of c against the reference; returns the run count. */
static size_t check_combo(const combo *c, kvf__xplan *plan) {
  uint64_t tokens = (uint64_t)c->nd * c->d_tpb;
  size_t ns = (size_t)((tokens + c->s_tpb - 1) / c->s_tpb);
  side s, d;
  make_side(&s, c->n_kv, c->s_tpb, c->s_heads, c->s_h0, c->model, c->s_order, ns,
            c->contiguous ? (uint32_t)ns + 1 : (uint32_t)ns + 5, c->contiguous);
  make_side(&d, c->n_kv, c->d_tpb, c->d_heads, c->d_h0, c->model, c->d_order, c->nd,
            c->contiguous ? (uint32_t)c->nd + 1 : (uint32_t)c->nd + 5, c->contiguous);
  char why[256] = "";
  int rc = kvf__xplan_make(&s.v, ns, &d.v, c->nd, plan, why, sizeof(why));
  if (rc) fail_msg("plan refused: %s", why);
  uint8_t *want = reference(&s, &d);
  apply_ctx a = {&s, &d, malloc(d.size), 0, 0, UINT64_MAX, false};
  assert_non_null(a.out);
  memcpy(a.out, d.mem, d.size);
  assert_int_equal(kvf__xform_walk(plan, &s.v, s.ids, &d.v, d.ids, 0, L, apply, &a), 0);
  assert_memory_equal(a.out, want, d.size);
  assert_false(a.bad_piece);
  if (plan->transform) kernel_on_cpu(plan, &s, &d, want);
  size_t sr = check_strided(plan, &s, &d, want, 3);
  if (sr) {
    strided_cases++;
    strided_runs += sr;
    strided_pieces += kvf__xplan_bytes(plan, L, c->n_kv) / UNIT;
  }
  /* a run list says the same as the walk */
  kvf__runs runs = {0};
  assert_int_equal(kvf__xform_runs(plan, &s.v, s.ids, &d.v, d.ids, 0, L, &runs), 0);
  assert_int_equal(runs.n, a.runs);
  uint32_t lo = c->s_h0 > c->d_h0 ? c->s_h0 : c->d_h0;
  uint32_t hi = c->s_h0 + c->s_heads < c->d_h0 + c->d_heads ? c->s_h0 + c->s_heads : c->d_h0 + c->d_heads;
  assert_int_equal(runs.bytes, (uint64_t)L * c->n_kv * tokens * (hi - lo) * UNIT);
  assert_int_equal(kvf__xplan_bytes(plan, L, c->n_kv), runs.bytes);
  kvf__runs_free(&runs);
  free(want);
  free(a.out);
  free(s.mem);
  free(d.mem);
  return a.runs;
}

static const uint32_t tokens[][2] = {{4, 4}, {4, 16}, {16, 4}, {2, 8}, {8, 2}, {1, 4}};
static const uint32_t orders[][2] = {
    {KVF_LAYOUT_NHD, KVF_LAYOUT_NHD}, {KVF_LAYOUT_NHD, KVF_LAYOUT_HND},
    {KVF_LAYOUT_HND, KVF_LAYOUT_NHD}, {KVF_LAYOUT_HND, KVF_LAYOUT_HND}};
/* (model, s_h0, s_heads, d_h0, d_heads) */
static const uint32_t heads[][5] = {
    {4, 0, 4, 0, 4},   /* the same heads */
    {8, 0, 2, 0, 2},   /* the same TP rank */
    {8, 0, 4, 2, 2},   /* send holds more: TP 2 -> TP 4 (fan-out's piece) */
    {8, 4, 4, 6, 1},   /* TP 2 -> TP 8 */
    {8, 3, 1, 2, 2},   /* send holds fewer: TP 8 -> TP 4 (fan-in's piece) */
    {8, 1, 3, 2, 4},   /* partial overlap: heads 2-3 */
    {4, 0, 4, 1, 1},   /* TP 1 -> TP 4 */
    {0, 0, 3, 0, 3},   /* heads not stated: every head */
};

/* Every combination of heads, orders and tokens per block, and the
 * contiguous case of each (ids back to back on both sides). */
static void test_every_combination(void **state) {
  size_t n = 0;
  for (size_t h = 0; h < sizeof(heads) / sizeof(heads[0]); h++)
    for (size_t o = 0; o < 4; o++)
      for (size_t t = 0; t < sizeof(tokens) / sizeof(tokens[0]); t++)
        for (int contiguous = 0; contiguous < 2; contiguous++) {
          combo c = {.n_kv = 2, .model = heads[h][0], .s_tpb = tokens[t][0], .s_heads = heads[h][2],
                     .s_h0 = heads[h][1], .s_order = orders[o][0], .d_tpb = tokens[t][1], .d_heads = heads[h][4],
                     .d_h0 = heads[h][3], .d_order = orders[o][1], .nd = 5, .contiguous = contiguous};
          kvf__xplan p;
          check_combo(&c, &p);
          n++;
        }
  assert_int_equal(n, 8 * 4 * 6 * 2);
  /* NHD -> HND with more than one source head and token a block: 7 of the
   * 8 head cases x 5 of the 6 token pairs x 2; a run gathers up to 3 pieces */
  assert_int_equal(strided_cases, 7 * 5 * 2);
  assert_true(strided_runs * 2 < strided_pieces);
}

/* MLA: one latent region per layer, replicated; any order and tokens. */
static void test_mla(void **state) {
  for (size_t o = 0; o < 4; o++)
    for (size_t t = 0; t < sizeof(tokens) / sizeof(tokens[0]); t++)
      for (uint32_t model = 0; model < 2; model++) {
        combo c = {.n_kv = 1, .model = model, .s_tpb = tokens[t][0], .s_heads = 1, .s_order = orders[o][0],
                   .d_tpb = tokens[t][1], .d_heads = 1, .d_order = orders[o][1], .nd = 3};
        kvf__xplan p;
        check_combo(&c, &p);
        assert_true(kvf__xplan_covers(&p, (char[64]){0}, 64));
        /* one head reads the same in either order: whole blocks unless the tokens differ */
        assert_int_equal(p.transform, tokens[t][0] != tokens[t][1]);
      }
}

/* What coalesces: the same geometry is whole blocks (one run per region
 * when ids are back to back); NHD with the grant's heads runs of tokens;
 * HND runs of one head's tokens; NHD <-> HND one unit per run. */
static void test_coalescing(void **state) {
  kvf__xplan p;
  combo same = {.n_kv = 2, .model = 8, .s_tpb = 4, .s_heads = 2, .s_h0 = 2, .d_tpb = 4, .d_heads = 2, .d_h0 = 2,
                .nd = 6, .contiguous = true};
  assert_int_equal(check_combo(&same, &p), L * 2);
  assert_false(p.transform);
  same.contiguous = false; /* shuffled: at most one run per block */
  assert_true(check_combo(&same, &p) <= L * 2 * 6);
  combo nhd = same;
  nhd.s_tpb = 4, nhd.d_tpb = 16, nhd.nd = 2, nhd.contiguous = true; /* 16 -> 64 in small */
  assert_int_equal(check_combo(&nhd, &p), L * 2);
  assert_true(p.transform);
  combo sub = nhd;
  sub.s_heads = 4, sub.s_h0 = 0, sub.d_tpb = 4, sub.nd = 6; /* a token's heads 2-3 out of 0-3: per token */
  assert_int_equal(check_combo(&sub, &p), L * 2 * 6 * 4);
  combo hnd = nhd;
  hnd.s_order = hnd.d_order = KVF_LAYOUT_HND; /* 4-token chunks of each head; where the grant's */
  /* block 0 ends (head 1, token 15) and block 1 starts, both sides are back to back: one merge per region */
  assert_int_equal(check_combo(&hnd, &p), L * 2 * ((2 * 16 / 4) * 2 - 1));
  combo mix = nhd;
  mix.d_order = KVF_LAYOUT_HND; /* units, one merge per region where the grant's blocks meet */
  assert_int_equal(check_combo(&mix, &p), L * 2 * (32 * 2 - 1));
  mix.s_order = KVF_LAYOUT_HND, mix.d_order = KVF_LAYOUT_NHD; /* where the send's blocks meet */
  assert_int_equal(check_combo(&mix, &p), L * 2 * (32 * 2 - 7));
}

/* Block counts: T = nd * Td tokens, the send names ceil(T / Ts) blocks. */
static void test_block_counts(void **state) {
  side s, d;
  kvf__xplan p;
  char why[256];
  make_side(&d, 2, 16, 2, 0, 2, KVF_LAYOUT_NHD, 5, 8, false);  /* 80 tokens */
  make_side(&s, 2, 4, 2, 0, 2, KVF_LAYOUT_NHD, 20, 24, false);
  assert_int_equal(kvf__xplan_make(&s.v, 20, &d.v, 5, &p, why, sizeof(why)), 0);
  assert_int_equal(p.tokens, 80);
  assert_int_equal(kvf__xplan_make(&s.v, 19, &d.v, 5, &p, why, sizeof(why)), KVF_ESIZE);
  assert_non_null(strstr(why, "block counts"));
  assert_int_equal(kvf__xplan_make(&s.v, 21, &d.v, 5, &p, why, sizeof(why)), KVF_ESIZE);
  free(s.mem);
  make_side(&s, 2, 64, 2, 0, 2, KVF_LAYOUT_NHD, 2, 4, false);  /* 64 -> 16: 5 blocks take 2 of 64 */
  assert_int_equal(kvf__xplan_make(&s.v, 2, &d.v, 5, &p, why, sizeof(why)), 0);
  assert_int_equal(kvf__xplan_make(&s.v, 3, &d.v, 5, &p, why, sizeof(why)), KVF_ESIZE);
  free(s.mem);
  free(d.mem);
}

static void expect_refusal(const side *s, size_t ns, const side *d, size_t nd, const char *what) {
  kvf__xplan p;
  char why[256] = "";
  assert_int_equal(kvf__xplan_make(&s->v, ns, &d->v, nd, &p, why, sizeof(why)), KVF_ESIZE);
  if (!strstr(why, what)) fail_msg("'%s' does not name '%s'", why, what);
}

static void test_refusals(void **state) {
  side s, d;
  make_side(&s, 2, 4, 2, 0, 8, KVF_LAYOUT_NHD, 4, 6, false);
  make_side(&d, 2, 4, 2, 2, 8, KVF_LAYOUT_NHD, 4, 6, false);
  expect_refusal(&s, 4, &d, 4, "no KV head in common (the send holds heads 0-1, the grant 2-3)");
  d.v.geom.first_head = 0;
  d.v.geom.head_dim = 6, d.v.geom.dtype_bytes = 1; /* same bytes, other head dim */
  expect_refusal(&s, 4, &d, 4, "head dims differ (3 and 6)");
  d.v.geom.head_dim = 3, d.v.geom.dtype_bytes = 2;
  s.v.geom.head_dim = 6, s.v.geom.dtype_bytes = 1, s.v.geom.tokens_per_block = 2, s.v.geom.kv_heads = 4;
  s.v.geom.head_dim = 3; /* 2 x 4 x 3 x 1: another dtype */
  expect_refusal(&s, 4, &d, 4, "dtypes differ (1 and 2 bytes)");
  s.v.geom = d.v.geom;
  s.v.geom.model_heads = 4;
  expect_refusal(&s, 4, &d, 4, "other KV head counts (4 and 8)");
  s.v.geom = d.v.geom;
  s.v.n_kv = 1;
  expect_refusal(&s, 4, &d, 4, "regions per layer differ (1 and 2");
  s.v.n_kv = 2;
  s.v.geom.tokens_per_block = 6, s.v.block_bytes = 6 * 2 * UNIT;
  expect_refusal(&s, 4, &d, 4, "tokens per block (6 and 4) are not a whole multiple");
  s.v.geom = d.v.geom, s.v.block_bytes = d.v.block_bytes;
  s.v.block_bytes += 2;
  expect_refusal(&s, 4, &d, 4, "is not its block size");
  s.v.block_bytes = d.v.block_bytes;
  s.v.geom.first_head = 7;
  expect_refusal(&s, 4, &d, 4, "heads 7-8 are not among its model's 8");
  /* geometry not fully stated: whole blocks only, and other heads refused */
  s.v.geom = d.v.geom;
  s.v.geom.tokens_per_block = 0, s.v.geom.first_head = 2;
  expect_refusal(&s, 4, &d, 4, "other KV heads");
  s.v.geom.first_head = 0, s.v.geom.model_heads = 0, d.v.geom.model_heads = 0;
  expect_refusal(&s, 3, &d, 4, "the send names 3 blocks and the grant 4");
  kvf__xplan p;
  char why[256];
  assert_int_equal(kvf__xplan_make(&s.v, 4, &d.v, 4, &p, why, sizeof(why)), 0);
  assert_false(p.transform);
  free(s.mem);
  free(d.mem);
}

/* One send must hold every head of its grant; the reason names the missing. */
static void test_covers(void **state) {
  side s, d;
  kvf__xplan p;
  char why[256] = "";
  make_side(&s, 2, 4, 1, 3, 8, KVF_LAYOUT_NHD, 2, 4, false);
  make_side(&d, 2, 4, 2, 2, 8, KVF_LAYOUT_HND, 2, 4, false);
  assert_int_equal(kvf__xplan_make(&s.v, 2, &d.v, 2, &p, why, sizeof(why)), 0);
  assert_false(kvf__xplan_covers(&p, why, sizeof(why)));
  assert_non_null(strstr(why, "heads 2-2 would be missing"));
  s.v.geom.first_head = 2, s.v.geom.kv_heads = 4, s.v.block_bytes *= 4;
  assert_int_equal(kvf__xplan_make(&s.v, 2, &d.v, 2, &p, why, sizeof(why)), 0);
  assert_true(kvf__xplan_covers(&p, why, sizeof(why)));
  free(s.mem);
  free(d.mem);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_combination), cmocka_unit_test(test_mla),
      cmocka_unit_test(test_coalescing),        cmocka_unit_test(test_block_counts),
      cmocka_unit_test(test_refusals),          cmocka_unit_test(test_covers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
