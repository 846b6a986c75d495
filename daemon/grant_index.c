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
#include "log.h"
#include "pool.h"
#include "xfer.h"

struct kvf__gi_cell {
  uint64_t start, end;
  const void *owner;
  uint32_t idx;
  uint32_t next;                /* the next cell of its granule's list + 1; 0: none */
};

struct kvf__gi_pool {
  uint32_t pool;
  uint64_t size;
  unsigned shift;               /* granule = 1 << shift bytes */
  uint32_t *head;               /* per granule: its first cell + 1; 0: none. A list
                                   runs from the highest start down */
  size_t held;                  /* cells in this pool */
  bool mixed;                   /* some of its ranges overlap (grant-overlap allow) */
};

#define GRANULE_MIN_SHIFT 12
#define GRANULE_MAX_SHIFT 16
#define MAX_GRANULES (1ull << 20)

typedef struct owner_rec {
  kvf__gi_item *v;
  size_t n;
  size_t ranges;                /* of v, those not empty */
} owner_rec;

static void owner_key(char *buf, size_t len, const void *owner) { snprintf(buf, len, "%p", owner); }

/* The granule for a pool of size bytes whose grants' smallest range is
 * min_len: about that range (one list entry per range, a short list per
 * granule), within [4 KiB, 64 KiB], and no more than 2^20 granules. */
static unsigned granule_shift(uint64_t size, uint64_t min_len) {
  unsigned shift = GRANULE_MIN_SHIFT;
  while (shift < GRANULE_MAX_SHIFT && (2ull << shift) <= min_len) shift++;
  while ((size >> shift) >= MAX_GRANULES) shift++;
  return shift;
}

static kvf__gi_pool *pool_find(const kvf__gindex *g, uint32_t id) {
  for (size_t i = 0; i < g->n_pools; i++)
    if (g->p[i].pool == id) return &g->p[i];
  return NULL;
}

/* The granule map of pool id, made (or remade, for a pool id that now
 * names another pool, or ranges of another size by 4x or more) while it
 * holds nothing. */
static kvf__gi_pool *pool_for(kvf__gindex *g, uint32_t id, uint64_t min_len, int *rc) {
  kvf__gi_pool *p = pool_find(g, id);
  uint64_t size = g->size_of ? g->size_of(id) : 0;
  unsigned shift = granule_shift(size, min_len);
  if (p && (p->held > 0 || (p->size == size && shift < p->shift + 2 && shift + 2 > p->shift))) return p;
  if (size == 0) {
    *rc = KVF_ENOPOOL;
    return NULL;
  }
  if (!p) {
    kvf__gi_pool *np = realloc(g->p, (g->n_pools + 1) * sizeof(*np));
    if (!np) goto oom;
    g->p = np;
    p = &g->p[g->n_pools++];
    *p = (kvf__gi_pool){.pool = id};
  }
  uint32_t *head = calloc((size_t)((size + (1ull << shift) - 1) >> shift), sizeof(*head));
  if (!head) goto oom;
  free(p->head);
  p->head = head;
  p->size = size;
  p->shift = shift;
  return p;
oom:
  *rc = -ENOMEM;
  return NULL;
}

static uint32_t cell_new(kvf__gindex *g) {
  if (g->free_cell) {
    uint32_t k = g->free_cell;
    g->free_cell = g->cells[k - 1].next;
    return k;
  }
  if (g->n_cells == g->cap_cells) {
    if (g->cap_cells >= UINT32_MAX / 2) return 0;
    uint32_t cap = g->cap_cells ? 2 * g->cap_cells : 1024;
    kvf__gi_cell *nc = realloc(g->cells, (size_t)cap * sizeof(*nc));
    if (!nc) return 0;
    g->cells = nc;
    g->cap_cells = cap;
  }
  return ++g->n_cells;
}

/* Whether e overlapping r counts: its own grant's always, another owner's
 * when others; *c says which. */
static int clash(const kvf__gi_cell *e, const kvf__gi_item *r, const void *owner, kvf__gi_clash *c) {
  bool own = e->owner == owner;
  /* a: the earlier descriptor of a grant, or the new grant's; b: the other */
  bool e_first = own && e->idx < r->idx;
  const kvf__gi_item ei = {.start = e->start, .end = e->end, .idx = e->idx};
  const kvf__gi_item *a = e_first ? &ei : r, *b = e_first ? r : &ei;
  *c = (kvf__gi_clash){.pool = r->pool, .a = a->idx, .b = b->idx, .a_start = a->start, .a_end = a->end,
                       .b_start = b->start, .b_end = b->end, .owner = own ? NULL : e->owner};
  return own ? KVF_EINVAL : KVF_EBUSY;
}

/* Checks r against granule gr's list and links a cell for it where its
 * start belongs. The cells that start after r come first; of the others
 * only the first can reach into r while the pool's ranges are disjoint
 * (each ends before the one above it starts), so ranges that come in
 * ascending order cost a step or two. A pool where grant-overlap allow let
 * ranges overlap (mixed) walks whole lists until it is empty again. */
static int take_granule(kvf__gindex *g, kvf__gi_pool *p, uint64_t gr, const kvf__gi_item *r, const void *owner,
                        bool others, kvf__gi_clash *c) {
  uint32_t prev = 0, k = p->head[gr];
  if (k == 0) goto link; /* the common case: nothing else in this granule */
  for (; k && g->cells[k - 1].start > r->start; prev = k, k = g->cells[k - 1].next) {
    const kvf__gi_cell *e = &g->cells[k - 1];
    if (e->start >= r->end) continue;
    if (e->owner == owner || others) return clash(e, r, owner, c);
    p->mixed = true;
  }
  for (uint32_t j = k; j; j = g->cells[j - 1].next) {
    const kvf__gi_cell *e = &g->cells[j - 1];
    if (e->end > r->start) {
      if (e->owner == owner || others) return clash(e, r, owner, c);
      p->mixed = true;
    }
    if (!p->mixed) break;
  }
link:;
  uint32_t nc = cell_new(g);
  if (!nc) return -ENOMEM;
  g->cells[nc - 1] = (kvf__gi_cell){.start = r->start, .end = r->end, .owner = owner, .idx = r->idx, .next = k};
  if (prev) g->cells[prev - 1].next = nc;
  else p->head[gr] = nc;
  p->held++;
  return 0;
}

/* Takes owner's cell for r out of each granule that r touches (where it
 * went in: a failed claim may have stopped half way). */
static void drop_range(kvf__gindex *g, const kvf__gi_item *r, const void *owner) {
  kvf__gi_pool *p = r->start < r->end ? pool_find(g, r->pool) : NULL;
  if (!p || r->end > p->size) return;
  for (uint64_t gr = r->start >> p->shift; gr <= (r->end - 1) >> p->shift; gr++) {
    uint32_t prev = 0, k = p->head[gr]; /* mostly the top cell: the loops stop at once */
    while (k && g->cells[k - 1].start > r->start) prev = k, k = g->cells[k - 1].next;
    while (k && g->cells[k - 1].start == r->start && g->cells[k - 1].owner != owner)
      prev = k, k = g->cells[k - 1].next;
    if (!k || g->cells[k - 1].start != r->start) continue;
    kvf__gi_cell *e = &g->cells[k - 1];
    if (prev) g->cells[prev - 1].next = e->next;
    else p->head[gr] = e->next;
    e->next = g->free_cell;
    g->free_cell = k;
    if (--p->held == 0) p->mixed = false;
  }
}

static void drop_all(kvf__gindex *g, const kvf__gi_item *v, size_t n, const void *owner) {
  for (size_t i = 0; i < n; i++) drop_range(g, &v[i], owner);
}

/* Checks r against the lists of the granules it touches, adding it to
 * each as it goes (its own grant's later ranges then see it). */
static int take_range(kvf__gindex *g, kvf__gi_pool *p, const kvf__gi_item *r, const void *owner, bool others,
                      kvf__gi_clash *c) {
  for (uint64_t gr = r->start >> p->shift; gr <= (r->end - 1) >> p->shift; gr++) {
    int rc = take_granule(g, p, gr, r, owner, others, c);
    if (rc) return rc;
  }
  return 0;
}

static bool item_before(const kvf__gi_item *a, const kvf__gi_item *b) {
  return a->pool < b->pool || (a->pool == b->pool && a->start < b->start);
}

static int item_cmp(const void *pa, const void *pb) {
  const kvf__gi_item *a = pa, *b = pb;
  return item_before(a, b) ? -1 : item_before(b, a) ? 1 : 0;
}

/* Ranges much smaller than a granule share lists: those of a grant go in
 * ascending order, so that each is linked at its list's top (in any other
 * order a list of k would cost k steps a range). */
#define DENSE_LEN 512

static void order_dense(kvf__gi_item *v, size_t n, uint64_t min_len) {
  if (min_len >= DENSE_LEN) return;
  for (size_t i = 1; i < n; i++)
    if (item_before(&v[i], &v[i - 1])) {
      qsort(v, n, sizeof(*v), item_cmp);
      return;
    }
}

int kvf__gi_claim(kvf__gindex *g, kvf__gi_item *v, size_t n, const void *owner, bool others, kvf__gi_clash *c) {
  char key[32];
  owner_key(key, sizeof(key), owner);
  if (kvf__map_get(&g->owners, key)) return KVF_EEXIST;
  owner_rec *rec = malloc(sizeof(*rec));
  int rc = rec ? 0 : -ENOMEM;
  size_t i = 0, ranges = 0;
  uint64_t min_len = UINT64_MAX;
  kvf__gi_pool *p = NULL;
  for (size_t k = 0; k < n; k++)
    if (v[k].end > v[k].start && v[k].end - v[k].start < min_len) min_len = v[k].end - v[k].start;
  order_dense(v, n, min_len);
  for (; i < n && rc == 0; i++) {
    const kvf__gi_item *r = &v[i];
    if (r->start >= r->end) continue; /* empty: holds no byte */
    ranges++;
    if (!p || p->pool != r->pool) p = pool_for(g, r->pool, min_len, &rc); /* pools are few: mostly one */
    if (p && r->end > p->size) rc = KVF_ERANGE;
    if (rc == 0) rc = take_range(g, p, r, owner, others, c);
  }
  if (rc == 0) {
    *rec = (owner_rec){.v = v, .n = n, .ranges = ranges};
    rc = kvf__map_put(&g->owners, key, rec);
    if (rc == 0) {
      g->held += ranges;
      return 0;
    }
  }
  drop_all(g, v, i, owner); /* what went in before the failure */
  free(rec);
  return rc;
}

void kvf__gi_release(kvf__gindex *g, const void *owner) {
  char key[32];
  owner_key(key, sizeof(key), owner);
  owner_rec *rec = kvf__map_del(&g->owners, key);
  if (!rec) return;
  drop_all(g, rec->v, rec->n, owner);
  g->held -= rec->ranges;
  free(rec->v);
  free(rec);
}

size_t kvf__gi_count(const kvf__gindex *g) { return g->held; }

void kvf__gi_free(kvf__gindex *g) {
  for (size_t b = 0; b < g->owners.nb; b++)
    for (kvf__map_ent *e = g->owners.b[b]; e; e = e->next) {
      owner_rec *rec = e->val;
      free(rec->v);
      free(rec);
    }
  kvf__map_free(&g->owners);
  for (size_t i = 0; i < g->n_pools; i++) free(g->p[i].head);
  free(g->p);
  free(g->cells);
  uint64_t (*size_of)(uint32_t) = g->size_of;
  memset(g, 0, sizeof(*g));
  g->size_of = size_of;
}

/* ------------------------------------------------------------ transfers */

/* Every range reaching here was checked against its pool; a pool this
 * daemon does not have (the state machine's unit tests use none) counts
 * as 1 TiB. */
static uint64_t pool_size(uint32_t id) {
  const kvf__pool *p = kvf__pool_get(id);
  return p ? p->size : 1ull << 40;
}

static kvf__gindex open_grants = {.size_of = pool_size};

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
  piece_name(other, c->b, b, sizeof(b));
  snprintf(err, errlen, "%s (pool %" PRIu32 " [%" PRIu64 ", %" PRIu64 ")) overlaps %s ([%" PRIu64 ", %" PRIu64
           ")) of the open grant '%.40s' (grant-overlap refuse)", a, c->pool, c->a_start, c->a_end, b, c->b_start,
           c->b_end, other->id);
}

/* ------------------------------------------------------------ block sets
 *
 * A grant of blocks as ranges is one range per piece (layers x K/V x
 * blocks: 16,384 for 4,096 tokens of llama3-8b), tens of ns each to claim
 * and again to release, on the loop, for every request. But a registered
 * layout's pieces never overlap (kvf__layout_validate) and neither do a
 * grant's ids (ids_unique), so grants of the same layout and layers only
 * need to know which block ids are taken: a set of counts per id, one step
 * per block. A set stands for every byte of its span (from its lowest
 * piece to the end of its highest), so it is used only where nothing else
 * open could reach into that span: a set is made only while the pool holds
 * no ranges and no other set's span meets its own; a grant that claims
 * ranges (descriptors, or blocks that found no set) first turns every set
 * whose span its ranges meet into ranges (spills it). Counts, not bits:
 * under grant-overlap allow open grants may share blocks. */
typedef struct kvf__bset {
  struct kvf__bset *next;
  const kvf__layout *layout;
  uint32_t pool, first_layer, n_layers, n_blocks;
  uint64_t lo, hi;              /* its span: [lo, hi) */
  uint16_t *count;              /* per block id: the open grants that hold it */
  kvf__xfer **owner;            /* those grants */
  size_t n_owner, cap_owner;
} kvf__bset;

static kvf__bset *bsets;

static void view_span(const kvf__lview *v, uint64_t *lo, uint64_t *hi) {
  uint64_t tail = (uint64_t)(v->n_blocks - 1) * v->block_stride + v->block_bytes;
  *lo = UINT64_MAX;
  *hi = 0;
  for (size_t r = 0; r < (size_t)v->n_layers * v->n_kv; r++) {
    if (v->offsets[r] < *lo) *lo = v->offsets[r];
    if (v->offsets[r] + tail > *hi) *hi = v->offsets[r] + tail;
  }
}

static kvf__bset *bset_find(const kvf__lview *v, const kvf__layout *l) {
  for (kvf__bset *b = bsets; b; b = b->next)
    if (b->layout == l && b->first_layer == v->first_layer && b->n_layers == v->n_layers) return b;
  return NULL;
}

/* Whether a new set of span [lo, hi) in pool may be made (see above). */
static bool bset_may_start(uint32_t pool, uint64_t lo, uint64_t hi) {
  const kvf__gi_pool *p = pool_find(&open_grants, pool);
  if (p && p->held > 0) return false;
  for (const kvf__bset *b = bsets; b; b = b->next)
    if (b->pool == pool && b->lo < hi && lo < b->hi) return false;
  return true;
}

static kvf__bset *bset_new(const kvf__lview *v, const kvf__layout *l, uint64_t lo, uint64_t hi) {
  kvf__bset *b = calloc(1, sizeof(*b));
  if (!b || !(b->count = calloc(v->n_blocks, sizeof(*b->count)))) {
    free(b);
    return NULL;
  }
  *b = (kvf__bset){.next = bsets, .layout = l, .pool = v->pool, .first_layer = v->first_layer,
                   .n_layers = v->n_layers, .n_blocks = v->n_blocks, .lo = lo, .hi = hi, .count = b->count};
  bsets = b;
  return b;
}

static void bset_free_if_empty(kvf__bset *b) {
  if (b->n_owner) return;
  for (kvf__bset **p = &bsets; *p; p = &(*p)->next)
    if (*p == b) {
      *p = b->next;
      break;
    }
  free(b->count);
  free(b->owner);
  free(b);
}

/* The refusal when x's i-th block id is held already, in say_clash's
 * words: that id's first piece in x and in the grant that holds it (a
 * count above 0 is always an owner's id). */
static void bset_clash(const kvf__bset *b, const kvf__xfer *x, size_t i, char *err, size_t errlen) {
  uint32_t id = x->mine.ids[i];
  const kvf__xfer *other = NULL;
  size_t j = 0;
  for (size_t k = 0; k < b->n_owner && !other; k++)
    for (j = 0; j < b->owner[k]->mine.n; j++)
      if (b->owner[k]->mine.ids[j] == id) {
        other = b->owner[k];
        break;
      }
  const kvf__lview *v = &x->mine.view;
  uint64_t at = kvf__lview_addr(v, v->first_layer, 0, id);
  kvf__gi_clash c = {.pool = v->pool, .a = (uint32_t)i, .b = (uint32_t)j, .a_start = at,
                     .a_end = at + v->block_bytes, .b_start = at, .b_end = at + v->block_bytes, .owner = other};
  say_clash(x, &c, KVF_EBUSY, err, errlen);
}

#define BSET_NONE 1 /* bset_claim: no set can take it; claim ranges */

/* Claims x's ids in its layout's set (made if it may be): 0, KVF_EBUSY
 * (refuse: an id is held), KVF_ELIMIT (an id held by 65,535 grants),
 * -ENOMEM, or BSET_NONE. */
static int bset_claim(kvf__xfer *x, bool refuse, char *err, size_t errlen) {
  const kvf__lview *v = &x->mine.view;
  kvf__bset *b = bset_find(v, x->mine.layout);
  if (!b) {
    uint64_t lo, hi;
    view_span(v, &lo, &hi);
    if (!bset_may_start(v->pool, lo, hi)) return BSET_NONE;
    if (!(b = bset_new(v, x->mine.layout, lo, hi))) return -ENOMEM;
  }
  int rc = 0;
  for (size_t i = 0; i < x->mine.n && rc == 0; i++) {
    uint32_t id = x->mine.ids[i];
    if (b->count[id] && refuse) rc = KVF_EBUSY, bset_clash(b, x, i, err, errlen);
    else if (b->count[id] == UINT16_MAX) rc = KVF_ELIMIT, snprintf(err, errlen, "block id %" PRIu32 " is held "
                                                                    "by too many open grants", id);
  }
  if (rc == 0 && b->n_owner == b->cap_owner) {
    size_t cap = b->cap_owner ? 2 * b->cap_owner : 8;
    kvf__xfer **no = realloc(b->owner, cap * sizeof(*no));
    if (no) b->owner = no, b->cap_owner = cap;
    else rc = -ENOMEM;
  }
  if (rc) {
    bset_free_if_empty(b);
    return rc;
  }
  b->owner[b->n_owner++] = x;
  for (size_t i = 0; i < x->mine.n; i++) b->count[x->mine.ids[i]]++;
  x->bset = b;
  return 0;
}

static void bset_unclaim(kvf__xfer *x) {
  kvf__bset *b = x->bset;
  for (size_t i = 0; i < x->mine.n; i++) b->count[x->mine.ids[i]]--;
  for (size_t k = 0; k < b->n_owner; k++)
    if (b->owner[k] == x) {
      b->owner[k] = b->owner[--b->n_owner];
      break;
    }
  x->bset = NULL;
  bset_free_if_empty(b);
}

/* Turns set b into ranges, grant by grant: each then holds its pieces in
 * the index as if it had claimed them so. On an error none is turned. */
static int bset_spill(kvf__bset *b) {
  size_t k = 0;
  int rc = 0;
  for (; k < b->n_owner && rc == 0; k++) {
    kvf__gi_item *v;
    size_t n;
    kvf__gi_clash c;
    rc = items_of_blocks(&b->owner[k]->mine, &v, &n);
    if (rc == 0 && (rc = kvf__gi_claim(&open_grants, v, n, b->owner[k], false, &c)) != 0) free(v);
  }
  if (rc) {
    for (size_t j = 0; j + 1 < k; j++) kvf__gi_release(&open_grants, b->owner[j]);
    return rc;
  }
  for (k = 0; k < b->n_owner; k++) b->owner[k]->bset = NULL;
  b->n_owner = 0;
  bset_free_if_empty(b);
  return 0;
}

/* Before ranges v[0..n) are claimed: spills each set they could meet. */
static int spill_sets_meeting(const kvf__gi_item *v, size_t n) {
  for (kvf__bset *b = bsets, *next; b; b = next) {
    next = b->next;
    bool meets = false;
    for (size_t i = 0; i < n && !meets; i++)
      meets = v[i].pool == b->pool && v[i].start < b->hi && b->lo < v[i].end && v[i].start < v[i].end;
    int rc = meets ? bset_spill(b) : 0;
    if (rc) return rc;
  }
  return 0;
}

int kvf__xfer_claim(kvf__xfer *x, char *err, size_t errlen) {
  kvf__gi_item *v = NULL;
  size_t n = x->dst.n;
  bool refuse = kvfd.cfg.grant_overlap == KVF__GRANT_OVERLAP_REFUSE;
  int rc = x->blocks ? ids_unique(&x->mine, err, errlen) : 0;
  if (rc) return rc;
  if (x->blocks && x->mine.layout && (rc = bset_claim(x, refuse, err, errlen)) != BSET_NONE) {
    if (rc == KVF_EBUSY) kvf__debug("grant '%s' refused: %s", x->id, err);
    return rc;
  }
  rc = x->blocks ? items_of_blocks(&x->mine, &v, &n) : kvf__gi_items_of_descs(&x->dst, &v);
  if (rc == 0 && bsets) rc = spill_sets_meeting(v, n);
  if (rc) {
    free(v);
    return rc;
  }
  kvf__gi_clash c;
  rc = kvf__gi_claim(&open_grants, v, n, x, refuse, &c);
  if (rc == KVF_EINVAL || rc == KVF_EBUSY) {
    say_clash(x, &c, rc, err, errlen);
    kvf__debug("grant '%s' refused: %s", x->id, err);
  }
  if (rc) free(v); /* else the index keeps it */
  return rc;
}

void kvf__xfer_unclaim(kvf__xfer *x) {
  if (x->role != KVF__RECV) return;
  if (x->bset) bset_unclaim(x);
  else if (open_grants.owners.n > 0) kvf__gi_release(&open_grants, x);
}
