/* layout.c - KV-cache layouts: validation, views, and walking two views
 * into runs (see layout.h). */
#include "layout.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"

/* ------------------------------------------------------------ validation */

static int shape_error(char *err, size_t errlen, const char *what) {
  snprintf(err, errlen, "layout: %s", what);
  return KVF_EINVAL;
}

/* The head range: inside the model's heads; a latent (n_kv 1) is
 * replicated, so it is every head there is. */
static int check_heads(const kvf__layout *l, char *err, size_t errlen) {
  const kvf__lgeom *g = &l->geom;
  if (g->model_heads == 0)
    return g->first_head ? shape_error(err, errlen, "first_head needs model_kv_heads (0: the layout holds every head)")
                         : 0;
  if (g->kv_heads == 0) return shape_error(err, errlen, "model_kv_heads needs kv_heads (the heads this layout holds)");
  if (g->first_head >= g->model_heads || g->kv_heads > g->model_heads - g->first_head) {
    snprintf(err, errlen, "layout: heads %u-%u (first_head %u, kv_heads %u) are not among the model's %u KV heads",
             g->first_head, g->first_head + g->kv_heads - 1, g->first_head, g->kv_heads, g->model_heads);
    return KVF_EINVAL;
  }
  if (l->n_kv == 1 && (g->first_head != 0 || g->kv_heads != g->model_heads))
    return shape_error(err, errlen, "a latent layout (n_kv 1, MLA) is replicated on every rank: it holds every "
                                    "head (first_head 0, kv_heads = model_kv_heads)");
  return 0;
}

static int check_shape(const kvf__layout *l, char *err, size_t errlen) {
  if (l->n_layers == 0 || l->n_layers > KVF__LAYOUT_MAX_LAYERS)
    return shape_error(err, errlen, "n_layers must be 1 to 1024");
  if (l->n_kv != 1 && l->n_kv != 2)
    return shape_error(err, errlen, "n_kv must be 2 (K and V) or 1 (one latent region, MLA)");
  if (l->n_blocks == 0) return shape_error(err, errlen, "n_blocks must be at least 1");
  if (l->block_bytes == 0) return shape_error(err, errlen, "block_bytes must be at least 1");
  if (l->n_blocks > 1 && l->block_stride < l->block_bytes)
    return shape_error(err, errlen, "block_stride is smaller than block_bytes: a region's blocks would overlap");
  if (l->geom.order != KVF_LAYOUT_NHD && l->geom.order != KVF_LAYOUT_HND)
    return shape_error(err, errlen, "order must be KVF_LAYOUT_NHD or KVF_LAYOUT_HND");
  const kvf__lgeom *g = &l->geom;
  if (g->tokens_per_block && g->kv_heads && g->head_dim && g->dtype_bytes &&
      (uint64_t)g->tokens_per_block * g->kv_heads * g->head_dim * g->dtype_bytes != l->block_bytes)
    return shape_error(err, errlen, "tokens_per_block x kv_heads x head_dim x dtype_bytes is not block_bytes");
  return check_heads(l, err, errlen);
}

/* The end of region r's last block, or 0 when it overflows. */
static uint64_t region_end(const kvf__layout *l, size_t r) {
  uint64_t span = (uint64_t)(l->n_blocks - 1) * l->block_stride;
  if (l->n_blocks > 1 && span / (l->n_blocks - 1) != l->block_stride) return 0;
  uint64_t end = l->offsets[r] + span + l->block_bytes;
  return end < l->offsets[r] ? 0 : end;
}

static void region_name(const kvf__layout *l, size_t r, char *buf, size_t len) {
  static const char *kv[] = {"K", "V"};
  if (l->n_kv == 1) snprintf(buf, len, "layer %zu", r);
  else snprintf(buf, len, "layer %zu %s", r / 2, kv[r % 2]);
}

/* Two regions with the same stride S, block size B and block count N
 * overlap when some blocks i, j have |d - (i - j) S| < B, d = c - a the
 * distance of their starts: the first k = i - j above (d - B) / S decides. */
static bool regions_overlap(uint64_t a, uint64_t c, uint64_t S, uint64_t B, uint32_t N) {
  if (c < a) {
    uint64_t t = a;
    a = c;
    c = t;
  }
  int64_t d = (int64_t)(c - a), b = (int64_t)B, n = (int64_t)N;
  if (N == 1 || S == 0) return d < b;
  int64_t s = (int64_t)S, lo = d - b; /* need k * s > lo */
  int64_t k = lo >= 0 ? lo / s + 1 : -((-lo - 1) / s); /* the smallest k with k * s > lo */
  if (k < -(n - 1)) k = -(n - 1);
  return k <= n - 1 && k * s < d + b;
}

typedef struct extent {
  uint64_t start, end;
  size_t r;
} extent;

static int extent_cmp(const void *x, const void *y) {
  const extent *a = x, *b = y;
  return a->start < b->start ? -1 : a->start > b->start;
}

/* Regions are checked pairwise only where their extents meet: per-layer
 * tensors never do (one pass), interleaved ones need the exact test. */
static int check_overlap(const kvf__layout *l, extent *e, size_t n, char *err, size_t errlen) {
  qsort(e, n, sizeof(*e), extent_cmp);
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n && e[j].start < e[i].end; j++) {
      if (!regions_overlap(l->offsets[e[i].r], l->offsets[e[j].r], l->block_stride, l->block_bytes,
                           l->n_blocks))
        continue;
      char a[48], b[48];
      region_name(l, e[i].r, a, sizeof(a));
      region_name(l, e[j].r, b, sizeof(b));
      snprintf(err, errlen, "layout: the blocks of %s (offset %llu) and %s (offset %llu) overlap", a,
               (unsigned long long)l->offsets[e[i].r], b, (unsigned long long)l->offsets[e[j].r]);
      return KVF_EINVAL;
    }
  return 0;
}

int kvf__layout_validate(const kvf__layout *l, uint64_t pool_size, char *err, size_t errlen) {
  int rc = check_shape(l, err, errlen);
  if (rc) return rc;
  size_t n = (size_t)l->n_layers * l->n_kv;
  extent *e = malloc(n * sizeof(*e));
  if (!e) return -ENOMEM;
  for (size_t r = 0; r < n; r++) {
    uint64_t end = region_end(l, r);
    if (end == 0 || end > pool_size) {
      char name[48];
      region_name(l, r, name, sizeof(name));
      snprintf(err, errlen, "layout: the blocks of %s (offset %llu, %u blocks of %llu bytes every %llu) end past "
                            "the pool's %llu bytes", name, (unsigned long long)l->offsets[r], l->n_blocks,
               (unsigned long long)l->block_bytes, (unsigned long long)l->block_stride,
               (unsigned long long)pool_size);
      free(e);
      return KVF_ERANGE;
    }
    e[r] = (extent){l->offsets[r], end, r};
  }
  rc = check_overlap(l, e, n, err, errlen);
  free(e);
  return rc;
}

/* ------------------------------------------------------------ views */

int kvf__layout_view(const kvf__layout *l, uint32_t first, uint32_t n, kvf__lview *v) {
  if (first >= l->n_layers) return KVF_ERANGE;
  if (n == 0) n = l->n_layers - first;
  if (n > l->n_layers - first) return KVF_ERANGE;
  *v = (kvf__lview){.pool = l->pool, .n_kv = l->n_kv, .n_blocks = l->n_blocks, .first_layer = first,
                    .n_layers = n, .block_bytes = l->block_bytes, .block_stride = l->block_stride,
                    .offsets = l->offsets + (size_t)first * l->n_kv, .geom = l->geom};
  return 0;
}

bool kvf__lview_block_major(const kvf__lview *v) {
  size_t n = (size_t)v->n_layers * v->n_kv;
  uint64_t lo = UINT64_MAX, hi = 0;
  for (size_t r = 0; r < n; r++) {
    if (v->offsets[r] < lo) lo = v->offsets[r];
    if (v->offsets[r] + v->block_bytes > hi) hi = v->offsets[r] + v->block_bytes;
  }
  return v->n_blocks == 1 || hi - lo <= v->block_stride;
}

int kvf__blocks_check(const kvf__lview *v, const uint32_t *ids, size_t n, size_t *bad) {
  for (size_t i = 0; i < n; i++)
    if (ids[i] >= v->n_blocks) {
      *bad = i;
      return KVF_ERANGE;
    }
  return 0;
}

static bool differ(uint32_t a, uint32_t b) { return a && b && a != b; }

int kvf__lview_compatible(const kvf__lview *s, const kvf__lview *d, char *why, size_t whylen) {
  const char *what = NULL;
  if (s->block_bytes != d->block_bytes) what = "block sizes";
  else if (s->n_kv != d->n_kv) what = "regions per layer (K and V, or one latent)";
  else if (differ(s->geom.tokens_per_block, d->geom.tokens_per_block)) what = "tokens per block";
  else if (differ(s->geom.kv_heads, d->geom.kv_heads)) what = "KV heads";
  else if (differ(s->geom.head_dim, d->geom.head_dim)) what = "head dims";
  else if (differ(s->geom.dtype_bytes, d->geom.dtype_bytes)) what = "dtype sizes";
  else if (s->geom.order != d->geom.order && s->geom.kv_heads > 1 && s->geom.tokens_per_block > 1)
    what = "head orders (NHD, HND)";
  if (!what) return 0;
  snprintf(why, whylen, "the two layouts' %s differ", what);
  return KVF_ESIZE;
}

uint64_t kvf__blocks_pieces(const kvf__lview *v, size_t n, uint32_t n_layers) {
  return (uint64_t)n * n_layers * v->n_kv;
}

uint64_t kvf__blocks_bytes(const kvf__lview *v, size_t n, uint32_t n_layers) {
  return kvf__blocks_pieces(v, n, n_layers) * v->block_bytes;
}

/* ------------------------------------------------------------ walks */

/* The index of piece (layer, kv, i) in v's canonical order over n blocks. */
static uint32_t canonical(const kvf__lview *v, uint32_t layer, uint32_t kv, size_t i, size_t n) {
  return (uint32_t)(((size_t)(layer - v->first_layer) * v->n_kv + kv) * n + i);
}

static int reserve_runs(kvf__runs *out, size_t more) {
  if (out->cap - out->n >= more) return 0;
  kvf__run *nv = realloc(out->v, (out->n + more) * sizeof(*nv));
  if (!nv) return -ENOMEM;
  out->v = nv;
  out->cap = out->n + more;
  return 0;
}

/* Runs for one piece; coalesced with the last one when back to back. */
static void push_piece(kvf__runs *out, const kvf__lview *s, const kvf__lview *d, uint64_t so, uint64_t dof,
                       uint32_t dst_desc) {
  if (out->n > 0) {
    kvf__run *last = &out->v[out->n - 1];
    if (last->src_off + last->len == so && last->dst_off + last->len == dof) {
      last->len += s->block_bytes;
      out->bytes += s->block_bytes;
      return;
    }
  }
  out->v[out->n++] = (kvf__run){.src_pool = s->pool, .dst_pool = d->pool, .src_off = so, .dst_off = dof,
                                .len = s->block_bytes, .dst_desc = dst_desc};
  out->bytes += s->block_bytes;
}

int kvf__blocks_pair(const kvf__lview *s, const uint32_t *sids, const kvf__lview *d, const uint32_t *dids,
                     size_t n, uint32_t first, uint32_t n_layers, kvf__runs *out) {
  if (n_layers == 0 || first < s->first_layer || first < d->first_layer ||
      first + n_layers > s->first_layer + s->n_layers || first + n_layers > d->first_layer + d->n_layers)
    return KVF_ERANGE;
  if (s->block_bytes != d->block_bytes || s->n_kv != d->n_kv) return KVF_ESIZE;
  if (n == 0) return 0;
  size_t worst = n * n_layers * s->n_kv;
  if (worst / n / n_layers != s->n_kv) return -ENOMEM;
  int rc = reserve_runs(out, worst);
  if (rc) return rc;
  uint32_t end = first + n_layers;
  /* Block-major on both sides: a block's layers are together, so walking
   * them innermost coalesces each block into one run. */
  if (kvf__lview_block_major(s) && kvf__lview_block_major(d)) {
    for (size_t i = 0; i < n; i++)
      for (uint32_t l = first; l < end; l++)
        for (uint32_t kv = 0; kv < s->n_kv; kv++)
          push_piece(out, s, d, kvf__lview_addr(s, l, kv, sids[i]), kvf__lview_addr(d, l, kv, dids[i]),
                     canonical(d, l, kv, i, n));
    return 0;
  }
  for (uint32_t l = first; l < end; l++)
    for (uint32_t kv = 0; kv < s->n_kv; kv++) {
      uint64_t sb = kvf__lview_addr(s, l, kv, 0), db = kvf__lview_addr(d, l, kv, 0);
      uint32_t c0 = canonical(d, l, kv, 0, n);
      for (size_t i = 0; i < n; i++)
        push_piece(out, s, d, sb + (uint64_t)sids[i] * s->block_stride, db + (uint64_t)dids[i] * d->block_stride,
                   c0 + (uint32_t)i);
    }
  return 0;
}

int kvf__blocks_descs(const kvf__lview *v, const uint32_t *ids, size_t n, kvf__descs *out) {
  memset(out, 0, sizeof(*out));
  size_t total = n * v->n_layers * v->n_kv;
  if (total == 0) return 0;
  out->pool = malloc(total * sizeof(*out->pool));
  out->offset = malloc(total * sizeof(*out->offset));
  out->length = malloc(total * sizeof(*out->length));
  if (!out->pool || !out->offset || !out->length) {
    kvf__descs_free(out);
    return -ENOMEM;
  }
  size_t k = 0;
  for (uint32_t l = v->first_layer; l < v->first_layer + v->n_layers; l++)
    for (uint32_t kv = 0; kv < v->n_kv; kv++) {
      uint64_t base = kvf__lview_addr(v, l, kv, 0);
      for (size_t i = 0; i < n; i++, k++) {
        out->pool[k] = v->pool;
        out->offset[k] = base + (uint64_t)ids[i] * v->block_stride;
        out->length[k] = v->block_bytes;
      }
    }
  out->n = total;
  out->total = total * v->block_bytes;
  return 0;
}

/* ------------------------------------------------------------ the wire */

static int offsets_from_wire(ProtobufCBinaryData w, size_t n, uint64_t **out) {
  if (w.len != n * 8) return KVF_EPROTO;
  uint64_t *v = malloc((n ? n : 1) * sizeof(*v));
  if (!v) return -ENOMEM;
  for (size_t i = 0; i < n; i++) v[i] = kvf__le64_get(w.data + 8 * i);
  *out = v;
  return 0;
}

int kvf__layout_from_wire(const Kvf__Layout *w, kvf__layout *l, char *err, size_t errlen) {
  memset(l, 0, sizeof(*l));
  if (!w) {
    snprintf(err, errlen, "layout: missing");
    return KVF_EINVAL;
  }
  if (w->n_layers == 0 || w->n_layers > KVF__LAYOUT_MAX_LAYERS || w->n_kv == 0 || w->n_kv > KVF__LAYOUT_MAX_KV) {
    snprintf(err, errlen, "layout: n_layers must be 1 to %u and n_kv 1 or 2", KVF__LAYOUT_MAX_LAYERS);
    return KVF_EINVAL;
  }
  *l = (kvf__layout){.pool = w->pool, .n_layers = w->n_layers, .n_kv = w->n_kv, .n_blocks = w->n_blocks,
                     .block_bytes = w->block_bytes, .block_stride = w->block_stride,
                     .geom = {w->tokens_per_block, w->kv_heads, w->head_dim, w->dtype_bytes, w->order,
                              w->first_head, w->model_kv_heads}};
  int rc = offsets_from_wire(w->offsets, (size_t)w->n_layers * w->n_kv, &l->offsets);
  if (rc == KVF_EPROTO)
    snprintf(err, errlen, "layout: %zu bytes of offsets for %u layers x %u regions (8 bytes each)",
             w->offsets.len, w->n_layers, w->n_kv);
  return rc;
}

void kvf__layout_clear(kvf__layout *l) {
  free(l->offsets);
  l->offsets = NULL;
}

void kvf__lview_to_wire(const kvf__lview *v, Kvf__Layout *w, uint8_t *buf) {
  kvf__layout__init(w);
  w->pool = v->pool;
  w->n_layers = v->n_layers;
  w->n_kv = v->n_kv;
  w->n_blocks = v->n_blocks;
  w->block_bytes = v->block_bytes;
  w->block_stride = v->block_stride;
  w->first_layer = v->first_layer;
  w->tokens_per_block = v->geom.tokens_per_block;
  w->kv_heads = v->geom.kv_heads;
  w->head_dim = v->geom.head_dim;
  w->dtype_bytes = v->geom.dtype_bytes;
  w->order = v->geom.order;
  w->first_head = v->geom.first_head;
  w->model_kv_heads = v->geom.model_heads;
  size_t n = (size_t)v->n_layers * v->n_kv;
  for (size_t i = 0; i < n; i++) kvf__le64_put(buf + 8 * i, v->offsets[i]);
  w->offsets = (ProtobufCBinaryData){n * 8, buf};
}

int kvf__lview_from_wire(const Kvf__Layout *w, kvf__lview *v, uint64_t **offsets) {
  *offsets = NULL;
  if (!w || w->n_layers == 0 || w->n_layers > KVF__LAYOUT_MAX_LAYERS || w->n_kv == 0 ||
      w->n_kv > KVF__LAYOUT_MAX_KV || w->block_bytes == 0 || w->n_blocks == 0 ||
      w->first_layer > KVF__LAYOUT_MAX_LAYERS - w->n_layers)
    return KVF_EPROTO;
  int rc = offsets_from_wire(w->offsets, (size_t)w->n_layers * w->n_kv, offsets);
  if (rc) return rc;
  *v = (kvf__lview){.pool = w->pool, .n_kv = w->n_kv, .n_blocks = w->n_blocks, .first_layer = w->first_layer,
                    .n_layers = w->n_layers, .block_bytes = w->block_bytes, .block_stride = w->block_stride,
                    .offsets = *offsets,
                    .geom = {w->tokens_per_block, w->kv_heads, w->head_dim, w->dtype_bytes, w->order,
                             w->first_head, w->model_kv_heads}};
  return 0;
}

int kvf__ids_from_wire(ProtobufCBinaryData w, size_t max, uint32_t **ids, size_t *n) {
  *ids = NULL;
  *n = 0;
  if (w.len % 4) return KVF_EPROTO;
  size_t k = w.len / 4;
  if (k > max) return KVF_ELIMIT;
  if (k == 0) return 0;
  uint32_t *v = malloc(k * sizeof(*v));
  if (!v) return -ENOMEM;
  for (size_t i = 0; i < k; i++) {
    const uint8_t *p = w.data + 4 * i;
    v[i] = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
  }
  *ids = v;
  *n = k;
  return 0;
}

void kvf__ids_to_wire(const uint32_t *ids, size_t n, uint8_t *buf) {
  for (size_t i = 0; i < n; i++)
    for (int b = 0; b < 4; b++) buf[4 * i + b] = (uint8_t)(ids[i] >> (8 * b));
}
