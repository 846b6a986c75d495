/* desc.h - descriptor lists: validation against pools, in-order pairing of
 * send and grant descriptors, coalescing of contiguous runs, and the sorted
 * range set a receiver checks incoming writes against. Pure logic. */
#ifndef KVF_DESC_H
#define KVF_DESC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvferry.pb-c.h"

/* Parallel arrays (the wire carries packed records: DescList.packed). */
typedef struct kvf__descs {
  uint32_t *pool;
  uint64_t *offset;
  uint64_t *length;
  size_t n;
  uint64_t total;   /* sum of lengths */
} kvf__descs;

/* One coalesced copy: src (local pool) -> dst (pool of the receiving node). */
typedef struct kvf__run {
  uint32_t src_pool;
  uint32_t dst_pool;
  uint64_t src_off;
  uint64_t dst_off;
  uint64_t len;
  uint32_t dst_desc;   /* the grant's descriptor its first byte goes to (kvf__pair):
                          rdma finds the run's memory window by it */
} kvf__run;

typedef struct kvf__runs {
  kvf__run *v;
  size_t n, cap;
  uint64_t bytes;
  /* Strided runs (rdma only, kvf__xform_runs_strided; 0: plain): each run
   * is len / unit pieces of unit bytes, back to back at dst_off, piece i
   * read from src_off + i * step. */
  uint64_t unit, step;
} kvf__runs;

/* A range the receiver accepts writes into. */
typedef struct kvf__range {
  uint32_t pool;
  uint64_t start, end;   /* [start, end) */
} kvf__range;

typedef struct kvf__rangeset {
  kvf__range *v;
  size_t n;
} kvf__rangeset;

/* One descriptor in DescList.packed (proto/kvferry.proto): u32 pool,
 * u64 offset, u64 length, little-endian, no padding. */
#define KVF__DESC_WIRE_SIZE 20u

/* Decodes DescList.packed into d: KVF_EPROTO when its length is not a
 * multiple of KVF__DESC_WIRE_SIZE, KVF_EINVAL when w is NULL or empty or a
 * length is 0 or the total overflows, KVF_ELIMIT when n > max. */
int kvf__descs_from_wire(kvf__descs *d, const Kvf__DescList *w, size_t max);
/* Checks every descriptor against the pools of this daemon: KVF_ENOPOOL,
 * KVF_ERANGE; *bad is the first offending index. */
typedef int (*kvf__range_check_fn)(void *ctx, uint32_t pool, uint64_t off, uint64_t len);
int kvf__descs_check(const kvf__descs *d, kvf__range_check_fn fn, void *ctx, size_t *bad);
/* Appends src to dst (for parts). */
int kvf__descs_append(kvf__descs *dst, const kvf__descs *src);
void kvf__descs_free(kvf__descs *d);
/* Encodes d into w->packed, a buffer this allocates (none when d is empty);
 * release it with kvf__descs_wire_free. 0, -ENOMEM or KVF_ELIMIT. */
int kvf__descs_to_wire(const kvf__descs *d, Kvf__DescList *w);
void kvf__descs_wire_free(Kvf__DescList *w);

/* Pairs src[0..src->n) with dst[*cursor..] in order and appends coalesced
 * runs. KVF_ESIZE when a length differs or dst runs out; *cursor advances
 * only on success. */
int kvf__pair(const kvf__descs *src, const kvf__descs *dst, size_t *cursor, kvf__runs *out);
void kvf__runs_free(kvf__runs *r);

/* Builds the sorted, merged set of dst ranges; checks a write against it. */
int kvf__rangeset_build(kvf__rangeset *rs, const kvf__descs *d);
int kvf__rangeset_contains(const kvf__rangeset *rs, uint32_t pool, uint64_t off, uint64_t len);
/* Whether r holds all of [off, off + len) of pool. */
static inline bool kvf__range_holds(const kvf__range *r, uint32_t pool, uint64_t off, uint64_t len) {
  return r->pool == pool && off >= r->start && off <= r->end && len <= r->end - off;
}
/* The index of the range of v[0..n) (sorted by (pool, start), not
 * overlapping) that holds all of [off, off + len) of pool, or -1. */
long kvf__ranges_find(const kvf__range *v, size_t n, uint32_t pool, uint64_t off, uint64_t len);
void kvf__rangeset_free(kvf__rangeset *rs);

#endif
