/* grant_index.h - destinations that must not overlap (issue 15, item 10).
 * Two descriptors (or blocks) of one grant over the same bytes, or two open
 * grants over the same bytes of a pool, end with whichever write lands
 * last: a grant is refused when its own ranges overlap (KVF_EINVAL), and,
 * with grant-overlap refuse (the default), when they overlap a grant still
 * open in the same pool (KVF_EBUSY). Touching ranges ([a, b) and [b, c))
 * and empty ones never overlap.
 *
 * Cost: a grant's ranges are put in (pool, start) order once: one pass when
 * they already are (engines mostly post ascending offsets), else a radix
 * sort; overlap within the grant is then one pass. The open grants of a
 * pool are one sorted array of disjoint ranges (disjoint because overlap is
 * refused), so their ends are sorted too and a new grant's sorted ranges
 * are checked by one galloping walk: O(n log(m / n)) for n ranges against
 * m open ones. Adding merges in place from the back, removing compacts:
 * O(n + m) moves of 24 bytes, sequential. With grant-overlap allow nothing
 * is indexed. Pure logic but for the kvf__xfer glue at the end; loop
 * thread. */
#ifndef KVF_GRANT_INDEX_H
#define KVF_GRANT_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "desc.h"

/* A range of a grant, and which of the grant's descriptors (or pieces) it
 * came from; after kvf__gi_runs, a run of back-to-back ranges. */
typedef struct kvf__gi_item {
  uint64_t start, end;          /* [start, end) */
  uint32_t pool;
  uint32_t idx;
} kvf__gi_item;

/* Where two ranges overlap: a and b of one grant (their descriptor
 * indexes, a < b), or one of a new grant and one of an open grant (owner). */
typedef struct kvf__gi_clash {
  uint32_t pool;
  uint32_t a, b;
  uint64_t a_start, a_end, b_start, b_end;
  const void *owner;
} kvf__gi_clash;

/* Sorts v[0..n) by (pool, start) (nothing to do when it is in order),
 * drops empty ranges and merges back-to-back ones: *nruns runs remain at
 * the front of v. KVF_EINVAL when two ranges overlap (*c says which), or
 * -ENOMEM. */
int kvf__gi_runs(kvf__gi_item *v, size_t n, size_t *nruns, kvf__gi_clash *c);

typedef struct kvf__gi_ent {
  uint64_t start, end;
  const void *owner;
} kvf__gi_ent;

typedef struct kvf__gi_pool {
  uint32_t pool;
  kvf__gi_ent *v;               /* sorted by start, disjoint */
  size_t n, cap;
} kvf__gi_pool;

/* The ranges of the open grants, per pool. Zeroed = empty. */
typedef struct kvf__gindex {
  kvf__gi_pool *p;
  size_t n, cap;
} kvf__gindex;

/* Whether runs r[0..n) (from kvf__gi_runs) overlap an open grant:
 * KVF_EBUSY with *c (a: the run of r, b: the open range), else 0. */
int kvf__gi_find(const kvf__gindex *g, const kvf__gi_item *r, size_t n, kvf__gi_clash *c);
/* Adds runs r[0..n) (checked with kvf__gi_find) for owner: 0 or -ENOMEM
 * (then nothing was added). */
int kvf__gi_add(kvf__gindex *g, const kvf__gi_item *r, size_t n, const void *owner);
/* Removes owner's ranges (none: nothing happens). */
void kvf__gi_remove(kvf__gindex *g, const void *owner);
/* What a grant does: kvf__gi_runs over v[0..n) (reordered), then, when
 * index, kvf__gi_find and kvf__gi_add for owner. */
int kvf__gi_claim(kvf__gindex *g, kvf__gi_item *v, size_t n, const void *owner, bool index, kvf__gi_clash *c);
/* d's ranges as items (*out malloc'ed; idx: the descriptor's index). */
int kvf__gi_items_of_descs(const kvf__descs *d, kvf__gi_item **out);
/* Ranges held in all pools. */
size_t kvf__gi_count(const kvf__gindex *g);
void kvf__gi_free(kvf__gindex *g);

/* ------------------------------------------------------ transfers (xfer.c) */

typedef struct kvf__xfer kvf__xfer;
/* A new grant x (its descriptors in x->dst, or its blocks in x->mine):
 * KVF_EINVAL when its ranges overlap (or a block id repeats), KVF_EBUSY
 * when they overlap another open grant (grant-overlap refuse); err says
 * which ranges. On 0 its ranges stay claimed until kvf__xfer_unclaim. */
int kvf__xfer_claim(kvf__xfer *x, char *err, size_t errlen);
/* x's ranges are free again (no-op for a sender or an unclaimed grant). */
void kvf__xfer_unclaim(kvf__xfer *x);

#endif
