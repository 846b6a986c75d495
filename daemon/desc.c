/* desc.c - descriptor lists, pairing, coalescing, range sets (see desc.h). */
#include "desc.h"

#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "kvferry.h"

static int descs_alloc(kvf__descs *d, size_t n) {
  memset(d, 0, sizeof(*d));
  if (n == 0) return 0;
  d->pool = malloc(n * sizeof(*d->pool));
  d->offset = malloc(n * sizeof(*d->offset));
  d->length = malloc(n * sizeof(*d->length));
  if (!d->pool || !d->offset || !d->length) {
    kvf__descs_free(d);
    return -ENOMEM;
  }
  return 0;
}

void kvf__descs_free(kvf__descs *d) {
  free(d->pool);
  free(d->offset);
  free(d->length);
  memset(d, 0, sizeof(*d));
}

int kvf__descs_from_wire(kvf__descs *d, const Kvf__DescList *w, size_t max) {
  memset(d, 0, sizeof(*d));
  if (!w) return KVF_EINVAL;
  if (w->packed.len % KVF__DESC_WIRE_SIZE) return KVF_EPROTO;
  size_t n = w->packed.len / KVF__DESC_WIRE_SIZE;
  if (n == 0) return KVF_EINVAL;
  if (n > max) return KVF_ELIMIT;
  int rc = descs_alloc(d, n);
  if (rc) return rc;
  d->n = n;
  const uint8_t *p = w->packed.data;
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++, p += KVF__DESC_WIRE_SIZE) {
    uint64_t len = kvf__le64_get(p + 12);
    /* Zero-length descriptors pair ambiguously and an overflowing total
     * would defeat every later size check. */
    if (len == 0 || total + len < total) {
      kvf__descs_free(d);
      return KVF_EINVAL;
    }
    total += len;
    d->pool[i] = kvf__le32_get(p);
    d->offset[i] = kvf__le64_get(p + 4);
    d->length[i] = len;
  }
  d->total = total;
  return 0;
}

int kvf__descs_check(const kvf__descs *d, kvf__range_check_fn fn, void *ctx, size_t *bad) {
  for (size_t i = 0; i < d->n; i++) {
    int rc = fn(ctx, d->pool[i], d->offset[i], d->length[i]);
    if (rc) {
      if (bad) *bad = i;
      return rc;
    }
  }
  return 0;
}

int kvf__descs_append(kvf__descs *dst, const kvf__descs *src) {
  size_t n = dst->n + src->n;
  uint32_t *p = realloc(dst->pool, n * sizeof(*p));
  if (!p) return -ENOMEM;
  dst->pool = p;
  uint64_t *o = realloc(dst->offset, n * sizeof(*o));
  if (!o) return -ENOMEM;
  dst->offset = o;
  uint64_t *l = realloc(dst->length, n * sizeof(*l));
  if (!l) return -ENOMEM;
  dst->length = l;
  memcpy(dst->pool + dst->n, src->pool, src->n * sizeof(*p));
  memcpy(dst->offset + dst->n, src->offset, src->n * sizeof(*o));
  memcpy(dst->length + dst->n, src->length, src->n * sizeof(*l));
  dst->n = n;
  dst->total += src->total;
  return 0;
}

int kvf__descs_to_wire(const kvf__descs *d, Kvf__DescList *w) {
  kvf__desc_list__init(w);
  if (d->n == 0) return 0;
  if (d->n > SIZE_MAX / KVF__DESC_WIRE_SIZE) return KVF_ELIMIT;
  uint8_t *p = malloc(d->n * KVF__DESC_WIRE_SIZE);
  if (!p) return -ENOMEM;
  w->packed.data = p;
  w->packed.len = d->n * KVF__DESC_WIRE_SIZE;
  for (size_t i = 0; i < d->n; i++, p += KVF__DESC_WIRE_SIZE) {
    kvf__le32_put(p, d->pool[i]);
    kvf__le64_put(p + 4, d->offset[i]);
    kvf__le64_put(p + 12, d->length[i]);
  }
  return 0;
}

void kvf__descs_wire_free(Kvf__DescList *w) {
  free(w->packed.data);
  w->packed.data = NULL;
  w->packed.len = 0;
}

static int runs_push(kvf__runs *r, const kvf__run *run) {
  if (r->n > 0) {
    kvf__run *last = &r->v[r->n - 1];
    /* Blocks that sit back to back on both sides become one copy. */
    if (last->src_pool == run->src_pool && last->dst_pool == run->dst_pool &&
        last->src_off + last->len == run->src_off && last->dst_off + last->len == run->dst_off) {
      last->len += run->len;
      r->bytes += run->len;
      return 0;
    }
  }
  if (r->n == r->cap) {
    size_t ncap = r->cap ? r->cap * 2 : 64;
    kvf__run *nv = realloc(r->v, ncap * sizeof(*nv));
    if (!nv) return -ENOMEM;
    r->v = nv;
    r->cap = ncap;
  }
  r->v[r->n++] = *run;
  r->bytes += run->len;
  return 0;
}

int kvf__pair(const kvf__descs *src, const kvf__descs *dst, size_t *cursor, kvf__runs *out) {
  size_t c = *cursor;
  if (src->n > dst->n - c) return KVF_ESIZE;
  for (size_t i = 0; i < src->n; i++)
    if (src->length[i] != dst->length[c + i]) return KVF_ESIZE;
  if (out->cap - out->n < src->n) { /* room for the worst case at once, not by doubling */
    kvf__run *nv = realloc(out->v, (out->n + src->n) * sizeof(*nv));
    if (!nv) return -ENOMEM;
    out->v = nv;
    out->cap = out->n + src->n;
  }
  for (size_t i = 0; i < src->n; i++) {
    kvf__run run = {.src_pool = src->pool[i], .dst_pool = dst->pool[c + i],
                    .src_off = src->offset[i], .dst_off = dst->offset[c + i],
                    .len = src->length[i], .dst_desc = (uint32_t)(c + i)};
    int rc = runs_push(out, &run);
    if (rc) return rc;
  }
  *cursor = c + src->n;
  return 0;
}

void kvf__runs_free(kvf__runs *r) {
  free(r->v);
  memset(r, 0, sizeof(*r));
}

static int range_cmp(const void *a, const void *b) {
  const kvf__range *x = a, *y = b;
  if (x->pool != y->pool) return x->pool < y->pool ? -1 : 1;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  return 0;
}

static bool range_before(const kvf__range *x, const kvf__range *y) {
  return x->pool < y->pool || (x->pool == y->pool && x->start < y->start);
}

/* Sorts v[0..n) of one pool by start: a stable LSD radix sort, a pass per
 * byte in which some starts differ, through tmp (n ranges). A grant of
 * blocks in an engine's order (ids at random) has a range per block and
 * region, 16,384 for a llama3-8b rank of 4,096 tokens: qsort's compares
 * through a pointer cost the receiving daemon's main thread about 3% of
 * the CPU of a TP 8 -> 4 handoff (perf), this a few passes. */
static void radix_by_start(kvf__range *v, kvf__range *tmp, size_t n, uint64_t differ) {
  size_t count[256];
  for (unsigned shift = 0; shift < 64; shift += 8) {
    if (((differ >> shift) & 0xff) == 0) continue;
    memset(count, 0, sizeof(count));
    for (size_t i = 0; i < n; i++) count[(v[i].start >> shift) & 0xff]++;
    size_t at = 0;
    for (unsigned b = 0; b < 256; b++) {
      size_t c = count[b];
      count[b] = at;
      at += c;
    }
    for (size_t i = 0; i < n; i++) tmp[count[(v[i].start >> shift) & 0xff]++] = v[i];
    memcpy(v, tmp, n * sizeof(*v));
  }
}

/* v by (pool, start): nothing to do when in order already (a sender's
 * or engine's order often is), radix when one pool, else qsort. */
static void ranges_sort(kvf__range *v, size_t n) {
  bool sorted = true, one_pool = true;
  uint64_t differ = 0;
  for (size_t i = 1; i < n; i++) {
    if (range_before(&v[i], &v[i - 1])) sorted = false;
    if (v[i].pool != v[0].pool) one_pool = false;
    differ |= v[i].start ^ v[0].start;
  }
  if (sorted) return;
  kvf__range *tmp = one_pool && n >= 64 ? malloc(n * sizeof(*tmp)) : NULL;
  if (tmp) radix_by_start(v, tmp, n, differ);
  else qsort(v, n, sizeof(*v), range_cmp);
  free(tmp);
}

int kvf__rangeset_build(kvf__rangeset *rs, const kvf__descs *d) {
  memset(rs, 0, sizeof(*rs));
  if (d->n == 0) return 0;
  kvf__range *v = malloc(d->n * sizeof(*v));
  if (!v) return -ENOMEM;
  for (size_t i = 0; i < d->n; i++)
    v[i] = (kvf__range){.pool = d->pool[i], .start = d->offset[i],
                        .end = d->offset[i] + d->length[i]};
  ranges_sort(v, d->n);
  size_t n = 0;
  for (size_t i = 0; i < d->n; i++) {
    if (n > 0 && v[n - 1].pool == v[i].pool && v[i].start <= v[n - 1].end) {
      if (v[i].end > v[n - 1].end) v[n - 1].end = v[i].end;
    } else {
      v[n++] = v[i];
    }
  }
  rs->v = v;
  rs->n = n;
  return 0;
}

long kvf__ranges_find(const kvf__range *v, size_t n, uint32_t pool, uint64_t off, uint64_t len) {
  size_t lo = 0, hi = n;
  while (lo < hi) { /* ranges [0, lo) start at or before (pool, off) */
    size_t mid = lo + (hi - lo) / 2;
    if (v[mid].pool < pool || (v[mid].pool == pool && v[mid].start <= off)) lo = mid + 1;
    else hi = mid;
  }
  return lo && kvf__range_holds(&v[lo - 1], pool, off, len) ? (long)(lo - 1) : -1;
}

int kvf__rangeset_contains(const kvf__rangeset *rs, uint32_t pool, uint64_t off, uint64_t len) {
  return len > 0 && kvf__ranges_find(rs->v, rs->n, pool, off, len) >= 0;
}

void kvf__rangeset_free(kvf__rangeset *rs) {
  free(rs->v);
  memset(rs, 0, sizeof(*rs));
}
