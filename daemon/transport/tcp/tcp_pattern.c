/* tcp_pattern.c - pattern batches of the tcp transport: encoding, the
 * receiver's checks and piece walk, the sender's grouping of runs (see
 * tcp_pattern.h). Pure: no sockets, no threads. */
#include "tcp_pattern.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "kvferryd.h"
#include "pool.h"
#include "pool_engine.h"

#include "transport/tcp/tcp.h"
#include "transport/transport.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

/* On a little-endian host the struct is the wire entry (the fields in
 * wire order, no padding): one copy instead of 40 byte stores, which cost
 * the sender 1.5% of a TP 8 -> 4 handoff's CPU (an entry a 4 KiB chunk). */
#define PAT_AS_WIRE (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)
_Static_assert(sizeof(kvf__tcp_pat) == KVF__TCP_PAT_ENT && offsetof(kvf__tcp_pat, off) == 16 &&
                   offsetof(kvf__tcp_pat, s2) == 32,
               "kvf__tcp_pat is laid out as its wire entry");

void kvf__tcp_pat_encode(uint8_t out[KVF__TCP_PAT_ENT], const kvf__tcp_pat *p) {
  if (PAT_AS_WIRE) {
    memcpy(out, p, KVF__TCP_PAT_ENT);
    return;
  }
  kvf__frame_put_header(out, p->pool);
  kvf__frame_put_header(out + 4, p->len);
  kvf__frame_put_header(out + 8, p->n1);
  kvf__frame_put_header(out + 12, p->n2);
  put64(out + 16, p->off);
  put64(out + 24, p->s1);
  put64(out + 32, p->s2);
}

int kvf__tcp_pat_decode(const uint8_t *raw, uint32_t count, kvf__tcp_pat *e, uint64_t *bytes) {
  *bytes = 0;
  for (uint32_t i = 0; i < count; i++, raw += KVF__TCP_PAT_ENT) {
    kvf__tcp_pat *p = &e[i];
    if (PAT_AS_WIRE) memcpy(p, raw, KVF__TCP_PAT_ENT);
    else *p = (kvf__tcp_pat){kvf__frame_get_u32(raw), kvf__frame_get_u32(raw + 4), kvf__frame_get_u32(raw + 8),
                        kvf__frame_get_u32(raw + 12), get64(raw + 16), get64(raw + 24), get64(raw + 32)};
    /* each factor is below 2^32: the product of two fits, then the bound */
    uint64_t pieces = (uint64_t)p->n1 * p->n2;
    if (p->len == 0 || pieces == 0 || pieces > KVF__TCP_PAT_MAX || pieces * p->len > KVF__TCP_PAT_MAX)
      return KVF_EPROTO;
    *bytes += pieces * p->len;
  }
  return 0;
}

/* The end of p's box (tcp_pattern.h), false when it overflows. */
static bool box_end(const kvf__tcp_pat *p, uint64_t *end) {
  uint64_t a, b;
  return !__builtin_mul_overflow((uint64_t)(p->n2 - 1), p->s2, &a) &&
         !__builtin_mul_overflow((uint64_t)(p->n1 - 1), p->s1, &b) && !__builtin_add_overflow(a, b, &a) &&
         !__builtin_add_overflow(a, (uint64_t)p->len, &a) && !__builtin_add_overflow(a, p->off, end);
}

/* Granules per range at most: a table of 4 bytes a granule stays within
 * 8 bytes a range, the set's own size is 24. */
#define RINDEX_SPREAD 2u
/* Ranges a lookup steps over before it searches instead. */
#define RINDEX_STEPS 8u

void kvf__tcp_rindex_build(kvf__tcp_rindex *ix, const kvf__rangeset *rs) {
  *ix = (kvf__tcp_rindex){.rs = rs};
  const kvf__range *v = rs->v;
  size_t n = rs->n;
  if (n < 64 || n > UINT32_MAX || v[0].pool != v[n - 1].pool) return; /* sorted by pool: one pool */
  uint64_t span = v[n - 1].end - v[0].start;
  unsigned shift = 0;
  while ((span >> shift) > RINDEX_SPREAD * n) shift++;
  uint64_t granules = (span >> shift) + 1;
  uint32_t *first = malloc(granules * sizeof(*first));
  if (!first) return;
  size_t i = 0;
  for (uint64_t g = 0; g < granules; g++) {
    uint64_t base = v[0].start + (g << shift);
    while (i + 1 < n && v[i + 1].start <= base) i++;
    first[g] = (uint32_t)i;
  }
  *ix = (kvf__tcp_rindex){.rs = rs, .pool = v[0].pool, .lo = v[0].start, .shift = shift, .first = first,
                          .n = granules};
}

void kvf__tcp_rindex_free(kvf__tcp_rindex *ix) {
  free(ix->first);
  *ix = (kvf__tcp_rindex){0};
}

long kvf__tcp_rindex_find(const kvf__tcp_rindex *ix, uint32_t pool, uint64_t off, uint64_t len) {
  const kvf__range *v = ix->rs->v;
  size_t n = ix->rs->n;
  if (ix->first && pool == ix->pool && off >= ix->lo && (off - ix->lo) >> ix->shift < ix->n) {
    size_t i = ix->first[(off - ix->lo) >> ix->shift]; /* v[i].start <= the granule's start <= off */
    for (unsigned k = 0; k < RINDEX_STEPS && i + 1 < n && v[i + 1].start <= off; k++) i++;
    if (i + 1 == n || v[i + 1].start > off) /* v[i]: the last range starting at or before off */
      return kvf__range_holds(&v[i], pool, off, len) ? (long)i : -1;
  }
  return kvf__ranges_find(v, n, pool, off, len);
}

uint32_t kvf__tcp_pat_first_outside_ix(const kvf__tcp_rindex *ix, const kvf__tcp_pat *e, uint32_t count) {
  const kvf__range *v = ix->rs->v;
  long at = -1; /* the range that held the last box: a batch's boxes are often in a few (its blocks) */
  for (uint32_t i = 0; i < count; i++) {
    uint64_t end;
    if (e[i].len == 0 || !box_end(&e[i], &end)) return i;
    if (at >= 0 && kvf__range_holds(&v[at], e[i].pool, e[i].off, end - e[i].off)) continue;
    at = kvf__tcp_rindex_find(ix, e[i].pool, e[i].off, end - e[i].off);
    if (at < 0) return i;
  }
  return count;
}

uint32_t kvf__tcp_pat_first_outside(const kvf__rangeset *rs, const kvf__tcp_pat *e, uint32_t count) {
  kvf__tcp_rindex ix = {.rs = rs}; /* no table: a binary search a box */
  return kvf__tcp_pat_first_outside_ix(&ix, e, count);
}

int kvf__tcp_pattern_check(const uint8_t *buf, size_t len, const kvf__rangeset *rs, uint64_t *handle,
                           uint32_t *count, uint64_t *bytes) {
  kvf__tcp_pat e[KVF__TCP_BATCH_MAX];
  if (len < KVF__TCP_BATCH_HDR || kvf__frame_get_u32(buf) != KVF__TCP_PAT_MAGIC) return KVF_EPROTO;
  uint32_t n = kvf__frame_get_u32(buf + 4);
  if (n == 0 || n > KVF__TCP_BATCH_MAX || (len - KVF__TCP_BATCH_HDR) / KVF__TCP_PAT_ENT < n) return KVF_EPROTO;
  int rc = kvf__tcp_pat_decode(buf + KVF__TCP_BATCH_HDR, n, e, bytes);
  if (rc) return rc;
  *handle = get64(buf + 8);
  *count = n;
  return kvf__tcp_pat_first_outside(rs, e, n) < n ? KVF_EPERM : 0;
}

int kvf__tcp_pat_iov(const kvf__tcp_pat *e, uint8_t *base, uint64_t *next, struct iovec *iov, int cap) {
  uint64_t total = (uint64_t)e->n1 * e->n2;
  int k = 0;
  for (; *next < total; ++*next) {
    uint8_t *at = base + e->off + (*next / e->n1) * e->s2 + (*next % e->n1) * e->s1;
    if (k > 0 && (uint8_t *)iov[k - 1].iov_base + iov[k - 1].iov_len == at) {
      iov[k - 1].iov_len += e->len;
      continue;
    }
    if (k == cap) break;
    iov[k++] = (struct iovec){at, e->len};
  }
  return k;
}

/* ------------------------------------------------------------ receiving */

/* Whether p's pieces are worth a bounce (small, several) and fit it. */
static bool bounceable(const kvf__tcp_pat *p) {
  uint64_t pieces = (uint64_t)p->n1 * p->n2;
  return p->len < KVF__TCP_PAT_SMALL && pieces > 1 && pieces * p->len <= KVF__TCP_PAT_BOUNCE;
}

void kvf__tcp_rplan_init(kvf__tcp_rplan *r, const kvf__tcp_pat *e, uint32_t count, uint8_t **bounce) {
  *r = (kvf__tcp_rplan){.e = e, .count = count};
  bool wanted = false;
  for (uint32_t i = 0; i < count && !wanted; i++) wanted = bounceable(&e[i]);
  if (wanted && !*bounce) *bounce = malloc(KVF__TCP_PAT_BOUNCE);
  if (wanted) r->bounce = *bounce; /* NULL (out of memory): every piece straight */
}

static bool bounced(const kvf__tcp_rplan *r, const kvf__tcp_pat *p) { return r->bounce && bounceable(p); }

int kvf__tcp_rplan_step(kvf__tcp_rplan *r, struct iovec *iov, int cap) {
  int n = 0;
  uint64_t used = 0;
  r->n_staged = 0;
  while (r->i < r->count && n < cap) {
    const kvf__tcp_pat *p = &r->e[r->i];
    uint64_t total = (uint64_t)p->n1 * p->n2;
    if (bounced(r, p)) {
      uint64_t pay = total * p->len;
      if (used + pay > KVF__TCP_PAT_BOUNCE) break; /* the next step's */
      if (n > 0 && (uint8_t *)iov[n - 1].iov_base + iov[n - 1].iov_len == r->bounce + used)
        iov[n - 1].iov_len += pay;
      else
        iov[n++] = (struct iovec){r->bounce + used, pay};
      used += pay;
      r->staged[r->n_staged++] = r->i++;
      continue;
    }
    n += kvf__tcp_pat_iov(p, kvfd.pools[p->pool]->base, &r->next, iov + n, cap - n);
    if (r->next == total) r->i++, r->next = 0;
  }
  return n;
}

/* A piece into pool memory. Whole cache lines go with non-temporal
 * stores: a bounced piece is a few lines of a destination nobody has
 * touched lately, and an ordinary store first reads each line in (the
 * scatter cost as much again as the kernel's copy of the same bytes into
 * the bounce buffer, perf on the dev machine); the kernel's own large
 * copies avoid that read, 256-byte memcpys do not. */
static void put_piece(uint8_t *dst, const uint8_t *src, size_t n) {
#if defined(__SSE2__)
  if (((uintptr_t)dst & 63) || (n & 63)) {
    memcpy(dst, src, n);
    return;
  }
  for (size_t i = 0; i < n; i += 64) {
    const __m128i *s = (const __m128i *)(src + i);
    __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1), c = _mm_loadu_si128(s + 2),
            d = _mm_loadu_si128(s + 3);
    __m128i *o = (__m128i *)(dst + i);
    _mm_stream_si128(o, a);
    _mm_stream_si128(o + 1, b);
    _mm_stream_si128(o + 2, c);
    _mm_stream_si128(o + 3, d);
  }
#else
  memcpy(dst, src, n);
#endif
}

/* The step's bounced pieces into place; guarded: through kvf__pool_copy
 * a piece (pool memory that can go away: SIGBUS becomes -EFAULT), else
 * streamed straight. */
static int scatter(const kvf__tcp_rplan *r, bool guarded) {
  const uint8_t *from = r->bounce;
  int rc = 0;
  for (uint32_t k = 0; k < r->n_staged; k++) {
    const kvf__tcp_pat *p = &r->e[r->staged[k]];
    uint8_t *base = kvfd.pools[p->pool]->base + p->off;
    for (uint64_t i2 = 0; i2 < p->n2; i2++)
      for (uint64_t i1 = 0; i1 < p->n1; i1++, from += p->len) {
        uint8_t *to = base + i2 * p->s2 + i1 * p->s1;
        if (!guarded) put_piece(to, from, p->len);
        else if (rc == 0) rc = kvf__pool_copy(to, from, p->len);
      }
  }
#if defined(__SSE2__)
  _mm_sfence(); /* the streamed lines are out before the grant hears of them */
#endif
  return rc;
}

/* Sealed pools (pool.h: their memory cannot go away) take the pieces
 * without a guard: a kvf__pool_copy a 256-byte piece (its sigsetjmp and
 * atomic exchange) cost about a quarter of both daemons' CPU in TP 8 -> 4
 * NHD (perf on the dev machine). */
int kvf__tcp_rplan_scatter(kvf__tcp_rplan *r) {
  bool guarded = false;
  for (uint32_t k = 0; k < r->n_staged && !guarded; k++) guarded = !kvfd.pools[r->e[r->staged[k]].pool]->sealed;
  int rc = r->n_staged ? scatter(r, guarded) : 0;
  r->n_staged = 0;
  return rc;
}

/* ------------------------------------------------------------ grouping */

/* Whether run r may join a pattern started by v0, landing at dst. */
static bool fits(const kvf__run *v0, const kvf__run *r, uint64_t dst) {
  return r->dst_pool == v0->dst_pool && r->dst_desc == v0->dst_desc && r->len == v0->len && r->dst_off == dst;
}

/* Pieces back to back become one longer piece. */
static void normalise(kvf__tcp_pat *p) {
  if (p->n1 > 1 && p->s1 == p->len) {
    p->len *= p->n1;
    p->n1 = 1;
  }
  if (p->n1 == 1) { /* rows of one piece: the rows are the pieces */
    p->n1 = p->n2, p->s1 = p->s2;
    p->n2 = 1;
  }
  if (p->n1 > 1 && p->s1 == p->len) {
    p->len *= p->n1;
    p->n1 = 1;
  }
  if (p->n1 == 1) p->s1 = 0;
  if (p->n2 == 1) p->s2 = 0;
}

size_t kvf__tcp_pat_take(const kvf__run *v, size_t n, kvf__tcp_pat *p) {
  const kvf__run *v0 = &v[0];
  uint64_t len = v0->len, most = KVF__TCP_PAT_MAX / len;
  if (most > KVF__TCP_PAT_PIECES) most = KVF__TCP_PAT_PIECES;
  *p = (kvf__tcp_pat){.pool = v0->dst_pool, .len = (uint32_t)len, .n1 = 1, .n2 = 1, .off = v0->dst_off};
  size_t j = 1;
  /* the first row: positive stride s1, as long as the runs follow it */
  if (j < n && most > 1 && v[j].dst_off > p->off && fits(v0, &v[j], v[j].dst_off)) {
    p->s1 = v[j].dst_off - p->off;
    while (j < n && j < most && fits(v0, &v[j], p->off + j * p->s1)) j++;
    p->n1 = (uint32_t)j;
  }
  /* whole rows of n1 more, at a positive stride s2 */
  if (j < n && v[j].dst_off > p->off && fits(v0, &v[j], v[j].dst_off)) {
    p->s2 = v[j].dst_off - p->off;
    for (;;) {
      uint64_t row = (uint64_t)p->n2 * p->n1;
      if (row + p->n1 > most || j + p->n1 > n) break;
      uint32_t k = 0;
      while (k < p->n1 && fits(v0, &v[j + k], p->off + p->n2 * p->s2 + k * p->s1)) k++;
      if (k < p->n1) break;
      j += p->n1;
      p->n2++;
    }
  }
  normalise(p);
  return j;
}

/* ------------------------------------------------------------ the sender */

static int grow(void **v, size_t *cap, size_t want, size_t each) {
  if (want <= *cap) return 0;
  size_t c = *cap ? *cap : 64;
  while (c < want) c *= 2;
  void *nv = realloc(*v, c * each);
  if (!nv) return -ENOMEM;
  *v = nv;
  *cap = c;
  return 0;
}

/* A pattern is built as its source stretches (src_add, merging those back
 * to back), then closed with its entry (src_close). */
static int src_add(kvf__tcp_pshare *s, const uint8_t *src, uint64_t len) {
  size_t first = s->n ? s->iov_end[s->n - 1] : 0;
  struct iovec *last = s->n_iov > first ? &s->iov[s->n_iov - 1] : NULL;
  if (last && (const uint8_t *)last->iov_base + last->iov_len == src) {
    last->iov_len += len;
    return 0;
  }
  if (grow((void **)&s->iov, &s->cap_iov, s->n_iov + 1, sizeof(*s->iov))) return -ENOMEM;
  s->iov[s->n_iov++] = (struct iovec){(void *)src, len};
  return 0;
}

static int src_close(kvf__tcp_pshare *s, const kvf__tcp_pat *p) {
  size_t cap = s->cap;
  if (grow((void **)&s->p, &cap, s->n + 1, sizeof(*s->p))) return -ENOMEM;
  cap = s->cap;
  if (grow((void **)&s->iov_end, &cap, s->n + 1, sizeof(*s->iov_end))) return -ENOMEM;
  s->cap = cap;
  s->p[s->n] = *p;
  s->iov_end[s->n++] = s->n_iov;
  return 0;
}

/* Pattern p with the source memory of runs v[0..k) (or, cut, len bytes at
 * cut). */
static int add(kvf__tcp_pshare *s, const kvf__tcp_pat *p, const kvf__run *v, size_t k, const uint8_t *cut) {
  int rc = cut ? src_add(s, cut, p->len) : 0;
  for (size_t i = 0; rc == 0 && i < k; i++)
    rc = src_add(s, kvfd.pools[v[i].src_pool]->base + v[i].src_off, v[i].len);
  return rc ? rc : src_close(s, p);
}

int kvf__tcp_pat_deal(const kvf__run *v, size_t n, kvf__tcp_pshare *sh, uint32_t n_sh, uint32_t *rr, bool small) {
  uint32_t k = *rr;
  for (size_t r = 0; r < n;) {
    kvf__tcp_pat p;
    int rc = 0;
    if (v[r].len > KVF__TCP_PAT_MAX) { /* a long run: single pieces of the most */
      const uint8_t *src = kvfd.pools[v[r].src_pool]->base + v[r].src_off;
      for (uint64_t done = 0; rc == 0 && done < v[r].len; done += p.len) {
        uint64_t len = v[r].len - done < KVF__TCP_PAT_MAX ? v[r].len - done : KVF__TCP_PAT_MAX;
        p = (kvf__tcp_pat){.pool = v[r].dst_pool, .len = (uint32_t)len, .n1 = 1, .n2 = 1, .off = v[r].dst_off + done};
        rc = add(&sh[k], &p, NULL, 0, src + done);
        if (!small) k = (k + 1) % n_sh;
      }
      r++;
    } else {
      size_t took = kvf__tcp_pat_take(v + r, n - r, &p);
      rc = add(&sh[k], &p, v + r, took, NULL);
      if (!small) k = (k + 1) % n_sh;
      r += took;
    }
    if (rc) return rc;
  }
  *rr = small ? (k + 1) % n_sh : k;
  return 0;
}

void kvf__tcp_pshare_free(kvf__tcp_pshare *s) {
  free(s->p);
  free(s->iov_end);
  free(s->iov);
  *s = (kvf__tcp_pshare){0};
}

void kvf__tcp_pspare_init(kvf__tcp_pspare *sp) {
  *sp = (kvf__tcp_pspare){.n = 0};
  pthread_mutex_init(&sp->lock, NULL);
}

void kvf__tcp_pspare_destroy(kvf__tcp_pspare *sp) {
  for (unsigned i = 0; i < sp->n; i++) kvf__tcp_pshare_free(&sp->v[i]);
  sp->n = 0;
  pthread_mutex_destroy(&sp->lock);
}

void kvf__tcp_pspare_take(kvf__tcp_pspare *sp, kvf__tcp_pshare *s) {
  *s = (kvf__tcp_pshare){0};
  pthread_mutex_lock(&sp->lock);
  if (sp->n) *s = sp->v[--sp->n];
  pthread_mutex_unlock(&sp->lock);
}

void kvf__tcp_pspare_give(kvf__tcp_pspare *sp, kvf__tcp_pshare *s) {
  uint64_t bytes = s->cap * (sizeof(*s->p) + sizeof(*s->iov_end)) + s->cap_iov * sizeof(*s->iov);
  s->n = s->n_iov = 0;
  bool kept = false;
  if (bytes <= KVF__TCP_PSPARE_BIG && s->cap) {
    pthread_mutex_lock(&sp->lock);
    if (sp->n < KVF__TCP_PSPARES) sp->v[sp->n++] = *s, kept = true;
    pthread_mutex_unlock(&sp->lock);
  }
  if (!kept) kvf__tcp_pshare_free(s);
  *s = (kvf__tcp_pshare){0};
}

int kvf__tcp_pat_batch(const kvf__tcp_pshare *s, size_t *next, uint64_t handle, uint8_t *hdr, uint8_t *ents,
                       struct iovec *iov, uint64_t *bytes) {
  int n = 2;
  uint32_t count = 0;
  *bytes = 0;
  while (*next < s->n && count < KVF__TCP_BATCH_MAX) {
    size_t i = *next, from = i ? s->iov_end[i - 1] : 0, k = s->iov_end[i] - from;
    if (count > 0 && n + k > KVF__TCP_PAT_IOVS) break;
    kvf__tcp_pat_encode(ents + (size_t)count * KVF__TCP_PAT_ENT, &s->p[i]);
    for (size_t j = 0; j < k; j++) { /* a payload continuing the last one's memory: one iovec */
      const struct iovec *v = &s->iov[from + j];
      if (n > 2 && (uint8_t *)iov[n - 1].iov_base + iov[n - 1].iov_len == v->iov_base) iov[n - 1].iov_len += v->iov_len;
      else iov[n++] = *v;
    }
    *bytes += (uint64_t)s->p[i].len * s->p[i].n1 * s->p[i].n2;
    count++;
    ++*next;
  }
  kvf__frame_put_header(hdr, KVF__TCP_PAT_MAGIC);
  kvf__frame_put_header(hdr + 4, count);
  put64(hdr + 8, handle);
  iov[0] = (struct iovec){hdr, KVF__TCP_BATCH_HDR};
  iov[1] = (struct iovec){ents, (size_t)count * KVF__TCP_PAT_ENT};
  return n;
}

/* Token t, head h (from the side's first) from its block's start, as
 * kv_xform.c's elem. */
static uint64_t elem(const kvf__xside *x, uint64_t t, uint64_t h, uint64_t unit) {
  return x->order == KVF_LAYOUT_HND ? (h * x->tpb + t) * unit : (t * x->heads + h) * unit;
}

/* One chunk: g tokens from slot st of the source block at src, to slot dt
 * of the destination block at db: one pattern in the source's order
 * (outer tokens and inner heads for NHD, the reverse for HND). */
static int plan_chunk(kvf__tcp_pshare *s, const kvf__xplan *p, const uint8_t *src, uint32_t dpool, uint64_t db,
                      uint64_t st, uint64_t dt, uint32_t g) {
  uint64_t u = p->unit, hs = p->h0 - p->s.h0, hd = p->h0 - p->d.h0;
  uint64_t d0 = elem(&p->d, dt, hd, u), dk = elem(&p->d, dt + 1, hd, u) - d0, dh = elem(&p->d, dt, hd + 1, u) - d0;
  bool nhd = p->s.order == KVF_LAYOUT_NHD;
  kvf__tcp_pat pt = {.pool = dpool, .len = (uint32_t)u, .off = db + d0};
  pt.n1 = nhd ? p->nh : g, pt.s1 = nhd ? dh : dk; /* inner */
  pt.n2 = nhd ? g : p->nh, pt.s2 = nhd ? dk : dh; /* outer */
  int rc = 0;
  uint64_t row = (uint64_t)pt.n1 * u, s0 = elem(&p->s, st, hs, u);
  uint64_t s1 = (nhd ? elem(&p->s, st + 1, hs, u) : elem(&p->s, st, hs + 1, u)) - s0;
  if (s1 == row) /* the rows follow each other in the source (one head a rank): one stretch */
    rc = src_add(s, src + s0, row * pt.n2);
  for (uint32_t o = 0; s1 != row && rc == 0 && o < pt.n2; o++) /* the source's inner pieces sit together */
    rc = src_add(s, src + s0 + o * s1, row);
  normalise(&pt);
  return rc ? rc : src_close(s, &pt);
}

/* The send's blocks in the order of their ids (the source's address
 * order within a region), for qsort. */
static int id_cmp(const void *a, const void *b, void *ids) {
  const uint32_t *by_id = ids;
  uint32_t x = by_id[*(const uint32_t *)a], y = by_id[*(const uint32_t *)b];
  return x < y ? -1 : x > y;
}

/* Bytes a stream takes in a row before the deal moves on: its chunks then
 * read neighbouring source blocks, which writev takes as few long iovecs
 * (a chunk of one head is 4 KiB of llama3-8b). */
#define GROUP (256u << 10)

int kvf__tcp_pat_deal_plan(const kvf__bpart *b, kvf__tcp_pshare *sh, uint32_t n_sh, uint32_t *rr, bool small) {
  const kvf__xplan *p = &b->xf;
  const kvf__lview *s = b->src, *d = b->dst;
  uint32_t g = p->s.tpb < p->d.tpb ? p->s.tpb : p->d.tpb;
  if ((uint64_t)g * p->nh > KVF__TCP_PAT_PIECES || (uint64_t)g * p->nh * p->unit > KVF__TCP_PAT_MAX) return -E2BIG;
  if (b->n_layers == 0 || b->first < s->first_layer || b->first < d->first_layer ||
      b->first + b->n_layers > s->first_layer + s->n_layers || b->first + b->n_layers > d->first_layer + d->n_layers)
    return KVF_ERANGE;
  size_t ns = (size_t)((p->tokens + p->s.tpb - 1) / p->s.tpb); /* source blocks the tokens touch */
  uint32_t *order = malloc(ns * sizeof(*order));
  if (!order) return -ENOMEM;
  for (size_t i = 0; i < ns; i++) order[i] = (uint32_t)i;
  qsort_r(order, ns, sizeof(*order), id_cmp, (void *)b->sids);
  const uint8_t *base = kvfd.pools[s->pool]->base;
  uint64_t chunk = (uint64_t)g * p->nh * p->unit, dealt = 0;
  uint32_t k = *rr;
  int rc = 0;
  for (uint32_t l = b->first; rc == 0 && l < b->first + b->n_layers; l++)
    for (uint32_t kv = 0; rc == 0 && kv < s->n_kv; kv++) {
      uint64_t s0 = kvf__lview_addr(s, l, kv, 0), d0 = kvf__lview_addr(d, l, kv, 0);
      for (size_t j = 0; rc == 0 && j < ns; j++) {
        uint64_t t0 = (uint64_t)order[j] * p->s.tpb, t1 = t0 + p->s.tpb < p->tokens ? t0 + p->s.tpb : p->tokens;
        for (uint64_t t = t0; rc == 0 && t < t1; t += g) {
          size_t di = t / p->d.tpb;
          rc = plan_chunk(&sh[k], p, base + s0 + (uint64_t)b->sids[order[j]] * s->block_stride, d->pool,
                          d0 + (uint64_t)b->dids[di] * d->block_stride, t % p->s.tpb, t % p->d.tpb, g);
          if (!small && (dealt += chunk) >= GROUP) k = (k + 1) % n_sh, dealt = 0;
        }
      }
    }
  free(order);
  if (rc) return rc;
  *rr = small ? (k + 1) % n_sh : (dealt ? (k + 1) % n_sh : k);
  return 0;
}
