/* grant_index.c - overlapping destinations: within a grant, and against
 * the open grants of a pool (see grant_index.h). */
#include "grant_index.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvferry.h"
#include "kvferryd.h"
#include "xfer.h"

/* ------------------------------------------------------------ one grant */

static bool item_before(const kvf__gi_item *a, const kvf__gi_item *b) {
  return a->pool < b->pool || (a->pool == b->pool && a->start < b->start);
}

static bool in_order(const kvf__gi_item *v, size_t n) {
  for (size_t i = 1; i < n; i++)
    if (item_before(&v[i], &v[i - 1])) return false;
  return true;
}

static int item_cmp(const void *pa, const void *pb) {
  const kvf__gi_item *a = pa, *b = pb;
  return item_before(a, b) ? -1 : item_before(b, a) ? 1 : 0;
}

#define RADIX_BITS 11
#define RADIX (1u << RADIX_BITS)

/* Stable LSD radix sort of v by start (the bits below max_start's top
 * one), then by pool when there are several: a counting pass over pool
 * ids when they are small, else qsort (never seen: pools are few). */
static int radix_sort(kvf__gi_item *v, size_t n) {
  uint64_t max_start = 0;
  uint32_t max_pool = 0, min_pool = UINT32_MAX;
  for (size_t i = 0; i < n; i++) {
    if (v[i].start > max_start) max_start = v[i].start;
    if (v[i].pool > max_pool) max_pool = v[i].pool;
    if (v[i].pool < min_pool) min_pool = v[i].pool;
  }
  if (max_pool - min_pool >= RADIX) {
    qsort(v, n, sizeof(*v), item_cmp);
    return 0;
  }
  kvf__gi_item *tmp = malloc(n * sizeof(*tmp));
  size_t *count = malloc(RADIX * sizeof(*count));
  if (!tmp || !count) {
    free(tmp);
    free(count);
    return -ENOMEM;
  }
  kvf__gi_item *src = v, *dst = tmp;
  for (unsigned shift = 0; shift < 64 && (max_start >> shift) != 0; shift += RADIX_BITS) {
    memset(count, 0, RADIX * sizeof(*count));
    for (size_t i = 0; i < n; i++) count[(src[i].start >> shift) & (RADIX - 1)]++;
    size_t sum = 0;
    for (size_t k = 0; k < RADIX; k++) sum += count[k], count[k] = sum - count[k];
    for (size_t i = 0; i < n; i++) dst[count[(src[i].start >> shift) & (RADIX - 1)]++] = src[i];
    kvf__gi_item *t = src;
    src = dst, dst = t;
  }
  if (max_pool != min_pool) {
    memset(count, 0, RADIX * sizeof(*count));
    for (size_t i = 0; i < n; i++) count[src[i].pool - min_pool]++;
    size_t sum = 0;
    for (size_t k = 0; k < RADIX; k++) sum += count[k], count[k] = sum - count[k];
    for (size_t i = 0; i < n; i++) dst[count[src[i].pool - min_pool]++] = src[i];
    src = dst;
  }
  if (src != v) memcpy(v, src, n * sizeof(*v));
  free(tmp);
  free(count);
  return 0;
}

static void clash_set(kvf__gi_clash *c, const kvf__gi_item *a, const kvf__gi_item *b) {
  if (!c) return;
  if (a->idx > b->idx) { /* the message names the earlier one first */
    const kvf__gi_item *t = a;
    a = b, b = t;
  }
  *c = (kvf__gi_clash){.pool = a->pool, .a = a->idx, .b = b->idx, .a_start = a->start, .a_end = a->end,
                       .b_start = b->start, .b_end = b->end};
}

int kvf__gi_runs(kvf__gi_item *v, size_t n, size_t *nruns, kvf__gi_clash *c) {
  *nruns = 0;
  if (!in_order(v, n)) {
    int rc = radix_sort(v, n);
    if (rc) return rc;
  }
  size_t w = 0;
  kvf__gi_item prev = {0}; /* the last non-empty range: in order and disjoint so far, it ends last */
  bool have = false;
  for (size_t i = 0; i < n; i++) {
    kvf__gi_item it = v[i];
    if (it.start >= it.end) continue; /* empty: holds no byte */
    if (have && prev.pool == it.pool && it.start < prev.end) {
      clash_set(c, &prev, &it);
      return KVF_EINVAL;
    }
    if (w > 0 && v[w - 1].pool == it.pool && v[w - 1].end == it.start) v[w - 1].end = it.end;
    else v[w++] = it;
    prev = it;
    have = true;
  }
  *nruns = w;
  return 0;
}

/* ------------------------------------------------------- the open grants */

static kvf__gi_pool *pool_get(const kvf__gindex *g, uint32_t pool) {
  for (size_t i = 0; i < g->n; i++)
    if (g->p[i].pool == pool) return &g->p[i];
  return NULL;
}

static kvf__gi_pool *pool_make(kvf__gindex *g, uint32_t pool) {
  kvf__gi_pool *p = pool_get(g, pool);
  if (p) return p;
  if (g->n == g->cap) {
    size_t cap = g->cap ? 2 * g->cap : 4;
    kvf__gi_pool *np = realloc(g->p, cap * sizeof(*np));
    if (!np) return NULL;
    g->p = np;
    g->cap = cap;
  }
  p = &g->p[g->n++];
  *p = (kvf__gi_pool){.pool = pool};
  return p;
}

/* The smallest j in [lo, n] whose range ends after s (ends ascend: the
 * ranges are sorted and disjoint); galloping from lo, since the runs
 * asked about come in order. */
static size_t first_end_after(const kvf__gi_ent *v, size_t lo, size_t n, uint64_t s) {
  size_t hi = lo, step = 1;
  while (hi < n && v[hi].end <= s) {
    lo = hi + 1;
    hi += step;
    step *= 2;
  }
  if (hi > n) hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (v[mid].end <= s) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

int kvf__gi_find(const kvf__gindex *g, const kvf__gi_item *r, size_t n, kvf__gi_clash *c) {
  size_t i = 0;
  while (i < n) {
    const kvf__gi_pool *p = pool_get(g, r[i].pool);
    size_t j = 0;
    for (uint32_t pool = r[i].pool; i < n && r[i].pool == pool; i++) {
      if (!p || p->n == 0 || r[i].start >= r[i].end) continue; /* an empty range holds no byte */
      j = first_end_after(p->v, j, p->n, r[i].start);
      if (j < p->n && p->v[j].start < r[i].end) {
        if (c)
          *c = (kvf__gi_clash){.pool = pool, .a = r[i].idx, .a_start = r[i].start, .a_end = r[i].end,
                               .b_start = p->v[j].start, .b_end = p->v[j].end, .owner = p->v[j].owner};
        return KVF_EBUSY;
      }
    }
  }
  return 0;
}

static int reserve(kvf__gi_pool *p, size_t more) {
  if (p->cap - p->n >= more) return 0;
  size_t cap = p->cap ? p->cap : 16;
  while (cap - p->n < more) cap *= 2;
  kvf__gi_ent *v = realloc(p->v, cap * sizeof(*v));
  if (!v) return -ENOMEM;
  p->v = v;
  p->cap = cap;
  return 0;
}

/* Merges r[0..k) (one pool, sorted) into p from the back: the entries
 * before the first new one do not move. */
static void merge_in(kvf__gi_pool *p, const kvf__gi_item *r, size_t k, const void *owner) {
  size_t i = p->n, j = k, w = p->n + k;
  while (j > 0) {
    if (i > 0 && p->v[i - 1].start > r[j - 1].start) p->v[--w] = p->v[--i];
    else {
      --j;
      p->v[--w] = (kvf__gi_ent){.start = r[j].start, .end = r[j].end, .owner = owner};
    }
  }
  p->n += k;
}

int kvf__gi_add(kvf__gindex *g, const kvf__gi_item *r, size_t n, const void *owner) {
  for (size_t i = 0, k; i < n; i += k) { /* room first: a failure adds nothing */
    for (k = 1; i + k < n && r[i + k].pool == r[i].pool; k++) {}
    kvf__gi_pool *p = pool_make(g, r[i].pool);
    if (!p || reserve(p, k) != 0) return -ENOMEM;
  }
  for (size_t i = 0, k; i < n; i += k) {
    for (k = 1; i + k < n && r[i + k].pool == r[i].pool; k++) {}
    merge_in(pool_get(g, r[i].pool), r + i, k, owner);
  }
  return 0;
}

void kvf__gi_remove(kvf__gindex *g, const void *owner) {
  for (size_t i = 0; i < g->n;) {
    kvf__gi_pool *p = &g->p[i];
    size_t w = 0;
    for (size_t k = 0; k < p->n; k++)
      if (p->v[k].owner != owner) p->v[w++] = p->v[k];
    p->n = w;
    if (w > 0) {
      i++;
      continue;
    }
    free(p->v); /* an idle pool keeps nothing */
    g->p[i] = g->p[--g->n];
  }
  if (g->n == 0) kvf__gi_free(g);
}

int kvf__gi_claim(kvf__gindex *g, kvf__gi_item *v, size_t n, const void *owner, bool index, kvf__gi_clash *c) {
  size_t nruns;
  int rc = kvf__gi_runs(v, n, &nruns, c);
  if (rc == 0 && index) rc = kvf__gi_find(g, v, nruns, c);
  if (rc == 0 && index) rc = kvf__gi_add(g, v, nruns, owner);
  return rc;
}

size_t kvf__gi_count(const kvf__gindex *g) {
  size_t n = 0;
  for (size_t i = 0; i < g->n; i++) n += g->p[i].n;
  return n;
}

void kvf__gi_free(kvf__gindex *g) {
  for (size_t i = 0; i < g->n; i++) free(g->p[i].v);
  free(g->p);
  memset(g, 0, sizeof(*g));
}

/* ------------------------------------------------------------ transfers */

static kvf__gindex open_grants;

int kvf__gi_items_of_descs(const kvf__descs *d, kvf__gi_item **out) {
  kvf__gi_item *v = malloc((d->n ? d->n : 1) * sizeof(*v));
  if (!v) return -ENOMEM;
  for (size_t i = 0; i < d->n; i++)
    v[i] = (kvf__gi_item){.start = d->offset[i], .end = d->offset[i] + d->length[i], .pool = d->pool[i],
                          .idx = (uint32_t)i};
  *out = v;
  return 0;
}

/* KVF_EINVAL when an id repeats (err names it): its blocks would overlap
 * in every layer. Ascending ids need one pass; others a bitmap. */
static int ids_unique(const kvf__xblocks *b, char *err, size_t errlen) {
  size_t i = 1;
  while (i < b->n && b->ids[i] > b->ids[i - 1]) i++;
  if (i >= b->n) return 0;
  uint64_t *seen = calloc(((size_t)b->view.n_blocks + 63) / 64, sizeof(*seen));
  if (!seen) return -ENOMEM;
  int rc = 0;
  for (i = 0; i < b->n && rc == 0; i++) {
    uint32_t id = b->ids[i]; /* below n_blocks: checked by kvf__xblocks_view */
    if (seen[id / 64] >> (id % 64) & 1) {
      size_t first = 0;
      while (b->ids[first] != id) first++;
      snprintf(err, errlen, "block id %" PRIu32 " appears twice in the grant (blocks %zu and %zu): its bytes "
               "would be written twice", id, first, i);
      rc = KVF_EINVAL;
    }
    seen[id / 64] |= 1ull << (id % 64);
  }
  free(seen);
  return rc;
}

/* The pieces of a grant of blocks, in canonical order (layer, region,
 * block; kvf__blocks_descs). */
static int items_of_blocks(const kvf__xblocks *b, kvf__gi_item **out, size_t *n) {
  const kvf__lview *v = &b->view;
  uint64_t total = (uint64_t)b->n * v->n_layers * v->n_kv;
  if (total > UINT32_MAX) return KVF_ELIMIT;
  kvf__gi_item *it = malloc((total ? total : 1) * sizeof(*it));
  if (!it) return -ENOMEM;
  size_t k = 0;
  for (uint32_t l = v->first_layer; l < v->first_layer + v->n_layers; l++)
    for (uint32_t kv = 0; kv < v->n_kv; kv++) {
      uint64_t base = kvf__lview_addr(v, l, kv, 0);
      for (size_t i = 0; i < b->n; i++, k++) {
        uint64_t off = base + (uint64_t)b->ids[i] * v->block_stride;
        it[k] = (kvf__gi_item){.start = off, .end = off + v->block_bytes, .pool = v->pool, .idx = (uint32_t)k};
      }
    }
  *out = it;
  *n = k;
  return 0;
}

/* What piece idx of a grant is, for messages. */
static void piece_name(const kvf__xfer *x, uint32_t idx, char *buf, size_t len) {
  if (!x->blocks) {
    snprintf(buf, len, "descriptor %" PRIu32, idx);
    return;
  }
  const kvf__xblocks *b = &x->mine;
  size_t r = idx / b->n;
  snprintf(buf, len, "block id %" PRIu32 " of layer %zu", b->ids[idx % b->n],
           b->view.first_layer + r / b->view.n_kv);
}

static void say_clash(const kvf__xfer *x, const kvf__gi_clash *c, int rc, char *err, size_t errlen) {
  char a[64], b[64];
  piece_name(x, c->a, a, sizeof(a));
  if (rc == KVF_EINVAL) {
    piece_name(x, c->b, b, sizeof(b));
    snprintf(err, errlen, "%s (pool %" PRIu32 " [%" PRIu64 ", %" PRIu64 ")) and %s ([%" PRIu64 ", %" PRIu64
             ")) of the grant overlap: a byte would be written twice", a, c->pool, c->a_start, c->a_end, b,
             c->b_start, c->b_end);
    return;
  }
  const kvf__xfer *other = c->owner;
  snprintf(err, errlen, "%s (pool %" PRIu32 " [%" PRIu64 ", %" PRIu64 ")) overlaps [%" PRIu64 ", %" PRIu64
           ") of the open grant '%.40s' (grant-overlap refuse)", a, c->pool, c->a_start, c->a_end, c->b_start,
           c->b_end, other->id);
}

int kvf__xfer_claim(kvf__xfer *x, char *err, size_t errlen) {
  kvf__gi_item *v = NULL;
  size_t n = x->dst.n;
  int rc = x->blocks ? ids_unique(&x->mine, err, errlen) : 0;
  if (rc == 0) rc = x->blocks ? items_of_blocks(&x->mine, &v, &n) : kvf__gi_items_of_descs(&x->dst, &v);
  if (rc) return rc;
  kvf__gi_clash c;
  rc = kvf__gi_claim(&open_grants, v, n, x, kvfd.cfg.grant_overlap == KVF__GRANT_OVERLAP_REFUSE, &c);
  if (rc == KVF_EINVAL || rc == KVF_EBUSY) say_clash(x, &c, rc, err, errlen);
  free(v);
  return rc;
}

void kvf__xfer_unclaim(kvf__xfer *x) {
  if (x->role == KVF__RECV && open_grants.n > 0) kvf__gi_remove(&open_grants, x);
}
