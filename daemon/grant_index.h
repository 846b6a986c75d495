/* grant_index.h - destinations that must not overlap (issue 15, item 10).
 * Two descriptors (or blocks) of one grant over the same bytes, or two open
 * grants over the same bytes of a pool, end with whichever write lands
 * last: a grant is refused when its own ranges overlap (KVF_EINVAL), and,
 * with grant-overlap refuse (the default), when they overlap a grant still
 * open in the same pool (KVF_EBUSY). Touching ranges ([a, b) and [b, c))
 * and empty ones never overlap.
 *
 * The index is a granule map per pool: the pool is cut into granules
 * (about the size of the smallest range of the grant that made the map,
 * within [4 KiB, 64 KiB], and larger when the pool would have more than
 * 2^20 of them; remade for another size when the pool holds nothing), and
 * each granule heads a list of the open ranges that touch it, highest
 * start first. A range is checked against the lists of the granules it
 * touches and linked into them; its own grant's earlier ranges are there
 * too, so one pass finds both kinds of overlap. The ranges held are
 * disjoint, so a check stops at the first range that starts below its
 * own: ranges in ascending order cost a step or two each, and a grant of
 * ranges much smaller than a granule is put in order first. The cost per
 * descriptor does not grow with the number of open grants. Where
 * grant-overlap allow let ranges overlap, the pool's lists are walked
 * whole until it is empty again. A range spanning g granules costs g list
 * entries (a 2 MiB block in 64 KiB granules: 32), paid per byte, not per
 * descriptor. Releasing takes the grant's ranges (kept with it) out again.
 * Loop thread. */
#ifndef KVF_GRANT_INDEX_H
#define KVF_GRANT_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "desc.h"
#include "map.h"

/* A range of a grant and which of its descriptors (or pieces) it is. */
typedef struct kvf__gi_item {
  uint64_t start, end;          /* [start, end) */
  uint32_t pool;
  uint32_t idx;
} kvf__gi_item;

/* Where two ranges overlap: a and b of one grant (their indexes, a < b),
 * or a of the new grant and one of an open grant (owner; b unused). */
typedef struct kvf__gi_clash {
  uint32_t pool;
  uint32_t a, b;
  uint64_t a_start, a_end, b_start, b_end;
  const void *owner;
} kvf__gi_clash;

typedef struct kvf__gi_cell kvf__gi_cell;
typedef struct kvf__gi_pool kvf__gi_pool;

/* The open grants' ranges. Zeroed, with size_of set = empty. */
typedef struct kvf__gindex {
  uint64_t (*size_of)(uint32_t pool); /* a pool's size; 0: no such pool */
  kvf__gi_pool *p;
  size_t n_pools;
  kvf__gi_cell *cells;                /* list entries; 0 ends a list */
  uint32_t n_cells, cap_cells, free_cell;
  size_t held;                        /* ranges held */
  kvf__map owners;                    /* owner -> its ranges */
} kvf__gindex;

/* Holds ranges v[0..n) (malloc'ed) of one grant for owner, and takes v
 * (freed by kvf__gi_release). KVF_EINVAL when two of them overlap,
 * KVF_EBUSY when others and one overlaps a range another owner holds (*c
 * says which, for either), KVF_ENOPOOL/KVF_ERANGE for a range outside its
 * pool, -ENOMEM, KVF_EEXIST when owner holds ranges already; on an error
 * nothing is held and v stays the caller's. */
int kvf__gi_claim(kvf__gindex *g, kvf__gi_item *v, size_t n, const void *owner, bool others, kvf__gi_clash *c);
/* Lets go of owner's ranges (none: nothing happens). */
void kvf__gi_release(kvf__gindex *g, const void *owner);
/* Ranges held, of all owners. */
size_t kvf__gi_count(const kvf__gindex *g);
void kvf__gi_free(kvf__gindex *g);
/* d's ranges as items (*out malloc'ed; idx: the descriptor's index). */
int kvf__gi_items_of_descs(const kvf__descs *d, kvf__gi_item **out);

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
