/* kv_xform.c - the plan between two KV layouts of different geometry, and
 * its walk into runs (see kv_xform.h). */
#include "kv_xform.h"

#include "cuda/copy_args.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ the plan */

static int refuse(char *why, size_t len, const char *fmt, unsigned a, unsigned b) {
  snprintf(why, len, fmt, a, b);
  return KVF_ESIZE;
}

static bool stated(const kvf__lgeom *g) { return g->tokens_per_block && g->kv_heads && g->head_dim && g->dtype_bytes; }
static bool differ(uint32_t a, uint32_t b) { return a && b && a != b; }
static uint32_t model_heads(const kvf__lgeom *g) { return g->model_heads ? g->model_heads : g->kv_heads; }
static const char *order_name(uint32_t o) { return o == KVF_LAYOUT_HND ? "HND" : "NHD"; }

/* What either side states of heads beyond its count: a range of them. */
static bool names_heads(const kvf__lgeom *g) { return g->model_heads && g->model_heads != g->kv_heads; }

/* Layouts that do not state all of their geometry: whole blocks only. */
static int whole_blocks(const kvf__lview *s, size_t ns, const kvf__lview *d, size_t nd, kvf__xplan *p, char *why,
                        size_t len) {
  int rc = kvf__lview_compatible(s, d, why, len);
  if (rc) return rc;
  if (names_heads(&s->geom) || names_heads(&d->geom))
    return refuse(why, len, "the two layouts hold other KV heads (%u and %u of them) and do not state their whole "
                            "geometry (tokens per block, heads, head dim, dtype bytes)",
                  s->geom.kv_heads, d->geom.kv_heads);
  if (ns != nd) {
    snprintf(why, len, "the send names %zu blocks and the grant %zu", ns, nd);
    return KVF_ESIZE;
  }
  *p = (kvf__xplan){.ns = ns, .nd = nd};
  return 0;
}

/* A side's geometry is its block (a peer's view is checked here too). */
static int check_side(const kvf__lview *v, const char *name, char *why, size_t len) {
  const kvf__lgeom *g = &v->geom;
  uint64_t b = (uint64_t)g->tokens_per_block * g->kv_heads * g->head_dim * g->dtype_bytes;
  if (b != v->block_bytes) {
    snprintf(why, len, "the %s layout's geometry (%u x %u x %u x %u bytes) is not its block size (%llu)", name,
             g->tokens_per_block, g->kv_heads, g->head_dim, g->dtype_bytes, (unsigned long long)v->block_bytes);
    return KVF_ESIZE;
  }
  if (g->model_heads && (g->first_head >= g->model_heads || g->kv_heads > g->model_heads - g->first_head)) {
    snprintf(why, len, "the %s layout's heads %u-%u are not among its model's %u", name, g->first_head,
             g->first_head + g->kv_heads - 1, g->model_heads);
    return KVF_ESIZE;
  }
  if (g->order != KVF_LAYOUT_NHD && g->order != KVF_LAYOUT_HND) {
    snprintf(why, len, "the %s layout's order is %u (neither NHD nor HND)", name, g->order);
    return KVF_ESIZE;
  }
  return 0;
}

/* Head ranges: their intersection, or the whole latent (MLA). */
static int plan_heads(const kvf__lview *s, const kvf__lview *d, kvf__xplan *p, char *why, size_t len) {
  const kvf__lgeom *a = &s->geom, *b = &d->geom;
  if (model_heads(a) != model_heads(b))
    return refuse(why, len, "the two layouts' models have other KV head counts (%u and %u)", model_heads(a),
                  model_heads(b));
  if (s->n_kv == 1) { /* a latent is replicated: both hold all of it */
    p->s.h0 = p->d.h0 = p->h0 = 0;
    p->nh = a->kv_heads;
    return 0;
  }
  uint32_t lo = a->first_head > b->first_head ? a->first_head : b->first_head;
  uint32_t ea = a->first_head + a->kv_heads, eb = b->first_head + b->kv_heads;
  uint32_t hi = ea < eb ? ea : eb;
  if (lo >= hi) {
    snprintf(why, len, "the two layouts have no KV head in common (the send holds heads %u-%u, the grant %u-%u)",
             a->first_head, ea - 1, b->first_head, eb - 1);
    return KVF_ESIZE;
  }
  p->h0 = lo;
  p->nh = hi - lo;
  return 0;
}

static int plan_tokens(size_t ns, size_t nd, kvf__xplan *p, char *why, size_t len) {
  uint32_t ts = p->s.tpb, td = p->d.tpb;
  if (ts % td && td % ts)
    return refuse(why, len, "the two layouts' tokens per block (%u and %u) are not a whole multiple of one another",
                  ts, td);
  p->tokens = (uint64_t)nd * td;
  uint64_t want = (p->tokens + ts - 1) / ts;
  if (ns != want) {
    snprintf(why, len, "block counts: the grant's %zu blocks of %u tokens take %llu tokens, %llu blocks of %u "
                       "from the send, which names %zu", nd, td, (unsigned long long)p->tokens,
             (unsigned long long)want, ts, ns);
    return KVF_ESIZE;
  }
  return 0;
}

int kvf__xplan_make(const kvf__lview *s, size_t ns, const kvf__lview *d, size_t nd, kvf__xplan *p, char *why,
                    size_t whylen) {
  const kvf__lgeom *a = &s->geom, *b = &d->geom;
  memset(p, 0, sizeof(*p));
  if (s->n_kv != d->n_kv)
    return refuse(why, whylen, "the two layouts' regions per layer differ (%u and %u: K and V, or one latent)",
                  s->n_kv, d->n_kv);
  if (differ(a->head_dim, b->head_dim))
    return refuse(why, whylen, "the two layouts' head dims differ (%u and %u)", a->head_dim, b->head_dim);
  if (differ(a->dtype_bytes, b->dtype_bytes))
    return refuse(why, whylen, "the two layouts' dtypes differ (%u and %u bytes)", a->dtype_bytes, b->dtype_bytes);
  if (!stated(a) || !stated(b)) return whole_blocks(s, ns, d, nd, p, why, whylen);
  int rc = check_side(s, "send's", why, whylen);
  if (rc == 0) rc = check_side(d, "grant's", why, whylen);
  if (rc) return rc;
  p->s = (kvf__xside){a->tokens_per_block, a->kv_heads, a->first_head, a->order};
  p->d = (kvf__xside){b->tokens_per_block, b->kv_heads, b->first_head, b->order};
  p->unit = (uint64_t)a->head_dim * a->dtype_bytes;
  p->ns = ns;
  p->nd = nd;
  rc = plan_heads(s, d, p, why, whylen);
  if (rc == 0) rc = plan_tokens(ns, nd, p, why, whylen);
  if (rc) return rc;
  /* One head, or one token, reads the same in either order. */
  bool same_order = p->s.order == p->d.order || a->kv_heads == 1 || a->tokens_per_block == 1;
  p->transform = !(p->s.tpb == p->d.tpb && p->s.h0 == p->d.h0 && p->s.heads == p->d.heads && same_order);
  if (!p->transform) p->s.order = p->d.order;
  return 0;
}

bool kvf__xplan_covers(const kvf__xplan *p, char *why, size_t whylen) {
  if (!p->transform || (p->h0 == p->d.h0 && p->nh == p->d.heads)) return true;
  char below[32] = "", above[32] = "";
  uint32_t end = p->h0 + p->nh, dend = p->d.h0 + p->d.heads;
  if (p->h0 > p->d.h0) snprintf(below, sizeof(below), "%u-%u", p->d.h0, p->h0 - 1);
  if (end < dend) snprintf(above, sizeof(above), "%s%u-%u", below[0] ? " and " : "", end, dend - 1);
  snprintf(why, whylen, "the send holds heads %u-%u of the grant's %u-%u: heads %s%s would be missing (one send "
                        "must cover its grant's heads)", p->h0, end - 1, p->d.h0, dend - 1, below, above);
  return false;
}

int kvf__xplan_only(kvf__xplan *p, uint32_t h, char *why, size_t whylen) {
  if (!p->unit || h < p->h0 || h >= p->h0 + p->nh) {
    snprintf(why, whylen, "head %u is not held by both layouts (or their geometry is not stated)", h);
    return KVF_ESIZE;
  }
  p->h0 = h;
  p->nh = 1;
  p->transform = true;
  return 0;
}

void kvf__xplan_describe(const kvf__xplan *p, char *buf, size_t len) {
  if (!p->transform) {
    snprintf(buf, len, "whole blocks");
    return;
  }
  snprintf(buf, len, "heads %u-%u, %s %u/%uh -> %s %u/%uh", p->h0, p->h0 + p->nh - 1, order_name(p->s.order),
           p->s.tpb, p->s.heads, order_name(p->d.order), p->d.tpb, p->d.heads);
}

uint64_t kvf__xplan_bytes(const kvf__xplan *p, uint32_t n_layers, uint32_t n_kv) {
  return p->tokens * p->nh * p->unit * n_layers * n_kv;
}

/* ------------------------------------------------------------ the walk */

typedef struct walker {
  kvf__xrun_fn fn;
  void *ctx;
  bool pieces;                  /* each piece on its own (strided runs coalesce them their way) */
  bool on;
  uint64_t so, dof, len;
  uint32_t piece;
} walker;

/* One piece; coalesced with the pending run when back to back on both
 * sides. */
static void emit(walker *w, uint64_t so, uint64_t dof, uint64_t len, uint32_t piece) {
  if (w->on && w->so + w->len == so && w->dof + w->len == dof && !w->pieces) {
    w->len += len;
    return;
  }
  if (w->on) w->fn(w->ctx, w->so, w->dof, w->len, w->piece);
  *w = (walker){w->fn, w->ctx, w->pieces, true, so, dof, len, piece};
}

static void flush(walker *w) {
  if (w->on) w->fn(w->ctx, w->so, w->dof, w->len, w->piece);
  w->on = false;
}

/* Token t, head h (counted from the side's first) from its block's start. */
static uint64_t elem(const kvf__xside *x, uint64_t t, uint32_t h, uint64_t unit) {
  return x->order == KVF_LAYOUT_HND ? ((uint64_t)h * x->tpb + t) * unit : (t * x->heads + h) * unit;
}

/* g tokens from slot st of a source block at sb, to slot dt of a
 * destination block at db: the inner loop runs along what is contiguous. */
static void chunk(walker *w, const kvf__xplan *p, uint64_t sb, uint64_t st, uint64_t db, uint64_t dt, uint32_t g,
                  uint32_t piece) {
  const kvf__xside *s = &p->s, *d = &p->d;
  uint32_t hs = p->h0 - s->h0, hd = p->h0 - d->h0;
  uint64_t u = p->unit;
  if (s->order == KVF_LAYOUT_NHD && d->order == KVF_LAYOUT_NHD) {
    for (uint32_t k = 0; k < g; k++) /* a token's heads sit together on both sides */
      emit(w, sb + elem(s, st + k, hs, u), db + elem(d, dt + k, hd, u), p->nh * u, piece);
  } else if (s->order == KVF_LAYOUT_HND && d->order == KVF_LAYOUT_HND) {
    for (uint32_t h = 0; h < p->nh; h++) /* a head's tokens sit together on both sides */
      emit(w, sb + elem(s, st, hs + h, u), db + elem(d, dt, hd + h, u), g * u, piece);
  } else if (d->order == KVF_LAYOUT_HND) { /* NHD -> HND: write in the destination's order */
    for (uint32_t h = 0; h < p->nh; h++)
      for (uint32_t k = 0; k < g; k++)
        emit(w, sb + elem(s, st + k, hs + h, u), db + elem(d, dt + k, hd + h, u), u, piece);
  } else {
    for (uint32_t k = 0; k < g; k++)
      for (uint32_t h = 0; h < p->nh; h++)
        emit(w, sb + elem(s, st + k, hs + h, u), db + elem(d, dt + k, hd + h, u), u, piece);
  }
}

static uint32_t canonical(const kvf__lview *v, uint32_t layer, uint32_t kv, size_t i, size_t n) {
  return (uint32_t)(((size_t)(layer - v->first_layer) * v->n_kv + kv) * n + i);
}

/* One region of one layer, chunk by chunk: a chunk of g = min(Ts, Td)
 * tokens lies in one block on each side (one is a multiple of the other). */
static void walk_region(walker *w, const kvf__xplan *p, const kvf__lview *s, const uint32_t *sids,
                        const kvf__lview *d, const uint32_t *dids, uint32_t l, uint32_t kv) {
  if (!p->transform) {
    for (size_t i = 0; i < p->nd; i++)
      emit(w, kvf__lview_addr(s, l, kv, sids[i]), kvf__lview_addr(d, l, kv, dids[i]), d->block_bytes,
           canonical(d, l, kv, i, p->nd));
    return;
  }
  uint32_t g = p->s.tpb < p->d.tpb ? p->s.tpb : p->d.tpb;
  uint64_t s0 = kvf__lview_addr(s, l, kv, 0), d0 = kvf__lview_addr(d, l, kv, 0);
  for (uint64_t t = 0; t < p->tokens; t += g) {
    size_t si = t / p->s.tpb, di = t / p->d.tpb;
    chunk(w, p, s0 + (uint64_t)sids[si] * s->block_stride, t % p->s.tpb, d0 + (uint64_t)dids[di] * d->block_stride,
          t % p->d.tpb, g, canonical(d, l, kv, di, p->nd));
  }
}

static int walk(const kvf__xplan *p, const kvf__lview *s, const uint32_t *sids, const kvf__lview *d,
                const uint32_t *dids, uint32_t first, uint32_t n_layers, kvf__xrun_fn fn, void *ctx, bool pieces) {
  if (n_layers == 0 || first < s->first_layer || first < d->first_layer ||
      first + n_layers > s->first_layer + s->n_layers || first + n_layers > d->first_layer + d->n_layers)
    return KVF_ERANGE;
  if (s->n_kv != d->n_kv) return KVF_ESIZE;
  walker w = {fn, ctx, pieces, false, 0, 0, 0, 0};
  for (uint32_t l = first; l < first + n_layers; l++)
    for (uint32_t kv = 0; kv < s->n_kv; kv++) walk_region(&w, p, s, sids, d, dids, l, kv);
  flush(&w);
  return 0;
}

int kvf__xform_walk(const kvf__xplan *p, const kvf__lview *s, const uint32_t *sids, const kvf__lview *d,
                    const uint32_t *dids, uint32_t first, uint32_t n_layers, kvf__xrun_fn fn, void *ctx) {
  return walk(p, s, sids, d, dids, first, n_layers, fn, ctx, false);
}

typedef struct run_sink {
  kvf__runs *out;
  uint32_t src_pool, dst_pool;
  uint64_t max_len;             /* strided: a run's pieces at most, in bytes */
  int rc;
} run_sink;

/* Strided: piece (so, dof) continues the last run, a step further on the
 * source and right after it on the destination, with room to spare. */
static bool continues(const run_sink *k, uint64_t so, uint64_t dof, uint64_t len) {
  const kvf__runs *o = k->out;
  if (!o->step || !o->n || len != o->unit) return false;
  const kvf__run *r = &o->v[o->n - 1];
  return r->dst_off + r->len == dof && r->src_off + r->len / o->unit * o->step == so && r->len + len <= k->max_len;
}

static void to_run(void *ctx, uint64_t so, uint64_t dof, uint64_t len, uint32_t piece) {
  run_sink *k = ctx;
  kvf__runs *o = k->out;
  if (k->rc) return;
  if (continues(k, so, dof, len)) {
    o->v[o->n - 1].len += len;
    o->bytes += len;
    return;
  }
  if (o->step && len != o->unit) { /* a piece of other length: kvf__xplan_strides rules it out */
    k->rc = -EINVAL;
    return;
  }
  if (o->n == o->cap) {
    size_t cap = o->cap ? 2 * o->cap : 64;
    kvf__run *nv = realloc(o->v, cap * sizeof(*nv));
    if (!nv) {
      k->rc = -ENOMEM;
      return;
    }
    o->v = nv;
    o->cap = cap;
  }
  o->v[o->n++] = (kvf__run){.src_pool = k->src_pool, .dst_pool = k->dst_pool, .src_off = so, .dst_off = dof,
                            .len = len, .dst_desc = piece};
  o->bytes += len;
}

/* At most this many runs (before coalescing) over n_layers layers: the
 * walk's pieces, so that the list is allocated once. */
static size_t runs_bound(const kvf__xplan *p, uint32_t n_layers, uint32_t n_kv) {
  size_t regions = (size_t)n_layers * n_kv;
  if (!p->transform) return regions * p->nd;
  uint32_t g = p->s.tpb < p->d.tpb ? p->s.tpb : p->d.tpb;
  if (p->s.order == KVF_LAYOUT_NHD && p->d.order == KVF_LAYOUT_NHD) return regions * p->tokens;
  if (p->s.order == KVF_LAYOUT_HND && p->d.order == KVF_LAYOUT_HND) return regions * (p->tokens / g) * p->nh;
  return regions * p->tokens * p->nh;
}

int kvf__xform_runs(const kvf__xplan *p, const kvf__lview *s, const uint32_t *sids, const kvf__lview *d,
                    const uint32_t *dids, uint32_t first, uint32_t n_layers, kvf__runs *out) {
  run_sink k = {out, s->pool, d->pool, 0, 0};
  size_t want = out->n + runs_bound(p, n_layers, s->n_kv);
  if (want > out->cap) {
    kvf__run *nv = realloc(out->v, want * sizeof(*nv));
    if (!nv) return -ENOMEM;
    out->v = nv;
    out->cap = want;
  }
  int rc = kvf__xform_walk(p, s, sids, d, dids, first, n_layers, to_run, &k);
  return rc ? rc : k.rc;
}

bool kvf__xplan_strides(const kvf__xplan *p) {
  /* one head or one token a block reads the same in either order: no
   * transform of order, and its pieces may be longer than a unit */
  return p->transform && p->unit && p->s.order == KVF_LAYOUT_NHD && p->d.order == KVF_LAYOUT_HND && p->s.heads > 1 &&
         p->s.tpb > 1 && p->d.tpb > 1;
}

int kvf__xform_runs_strided(const kvf__xplan *p, const kvf__lview *s, const uint32_t *sids, const kvf__lview *d,
                            const uint32_t *dids, uint32_t first, uint32_t n_layers, uint32_t max_pieces,
                            kvf__runs *out) {
  if (!kvf__xplan_strides(p) || max_pieces == 0) return -EINVAL;
  uint64_t step = (uint64_t)p->s.heads * p->unit;
  if ((out->step || out->n) && (out->unit != p->unit || out->step != step)) return -EINVAL;
  out->unit = p->unit;
  out->step = step;
  run_sink k = {out, s->pool, d->pool, (uint64_t)max_pieces * p->unit, 0};
  /* piece by piece (the walk's own coalescing could join the last piece of
   * a block to the first of the next: no fixed step); the list grows as it
   * goes, far fewer runs than pieces */
  int rc = walk(p, s, sids, d, dids, first, n_layers, to_run, &k, true);
  return rc ? rc : k.rc;
}

void kvf__xform_kargs(const kvf__xplan *x, kvf_xblocks_args *a) {
  a->unit = (unsigned)x->unit;
  a->s_tpb = x->s.tpb, a->s_heads = x->s.heads, a->s_order = x->s.order, a->s_h = x->h0 - x->s.h0;
  a->d_tpb = x->d.tpb, a->d_heads = x->d.heads, a->d_order = x->d.order, a->d_h = x->h0 - x->d.h0;
  a->nh = x->nh;
  a->g = x->s.tpb < x->d.tpb ? x->s.tpb : x->d.tpb;
  a->chunks = (unsigned)(x->tokens / a->g);
  a->ns = (unsigned)x->ns;
  a->nd = (unsigned)x->nd;
}
