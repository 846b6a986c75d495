/* kv_xform.h - transfers between KV layouts of different geometry: other
 * KV heads (tensor parallelism), other order (NHD / HND), other tokens per
 * block (by a whole factor either way).
 *
 * A block of a layout whose geometry is stated (layout.h) holds
 * tokens_per_block tokens of kv_heads heads [first_head, first_head +
 * kv_heads) of head_dim elements of dtype_bytes each; one token of one head
 * (head_dim * dtype_bytes bytes, the unit) sits at
 *
 *     NHD: (token * kv_heads + head) * unit      [token, head, dim]
 *     HND: (head * tokens_per_block + token) * unit   [head, token, dim]
 *
 * from the block's start (head counted from first_head).
 *
 * Tokens. The transfer's token t is slot t % Ts of the send's block
 * t / Ts and slot t % Td of the grant's block t / Td (Ts, Td: the two
 * sides' tokens per block, one a whole multiple of the other): four
 * prefill 16-token blocks fill one decode 64-token block, and one 64-token
 * block fills four 16-token ones. The transfer moves every slot of the
 * grant's blocks, T = nd * Td tokens, and the send names ns = ceil(T / Ts)
 * blocks: with Ts > Td the send's last block may be partly used; with
 * Ts < Td a request that ends inside the grant's last block still names
 * whole send blocks to fill it (any of its block ids: their tokens land in
 * slots past the request). With Ts == Td that is ns == nd, as before.
 *
 * Heads. The transfer moves the heads both sides hold (their
 * intersection); a latent layout (n_kv 1, MLA) is replicated: any source
 * covers it. A send must hold every head of the grant (kvf__xplan_covers).
 *
 * The plan is pure index math; kvf__xform_walk enumerates its copies as
 * runs of (src offset, dst offset, length) per layer and K/V, coalescing
 * what is contiguous on both sides: same order and same heads give whole
 * blocks, NHD with the grant's heads per-token runs, HND per-head runs of
 * tokens, NHD <-> HND one unit per run. */
#ifndef KVF_KV_XFORM_H
#define KVF_KV_XFORM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "desc.h"
#include "layout.h"

/* One side of a transform. */
typedef struct kvf__xside {
  uint32_t tpb;      /* tokens per block */
  uint32_t heads;    /* heads a block holds */
  uint32_t h0;       /* the first of them, of the model's */
  uint32_t order;    /* KVF_LAYOUT_NHD or KVF_LAYOUT_HND */
} kvf__xside;

typedef struct kvf__xplan {
  bool transform;    /* false: whole blocks, send block i to grant block i */
  kvf__xside s, d;
  uint32_t h0, nh;   /* the heads moved: [h0, h0 + nh) of the model's */
  uint64_t unit;     /* one token of one head: head_dim * dtype_bytes */
  uint64_t tokens;   /* T = nd * Td */
  size_t ns, nd;     /* the send's and the grant's block counts */
} kvf__xplan;

/* The plan that moves ns blocks of s into nd blocks of d, or KVF_ESIZE
 * with why naming what cannot be reconciled: regions per layer, head
 * dims, dtypes, the model's head count, tokens per block that are not a
 * whole multiple, no head in common, block counts that do not map, a
 * geometry that is not the block size. Layouts that do not state their
 * whole geometry take only whole blocks (same block size, ns == nd). */
int kvf__xplan_make(const kvf__lview *s, size_t ns, const kvf__lview *d, size_t nd, kvf__xplan *p, char *why,
                    size_t whylen);

/* Whether the send holds every head of the grant; else why says which it
 * lacks. */
bool kvf__xplan_covers(const kvf__xplan *p, char *why, size_t whylen);

/* Restricts p to model head h (a fan's sub-transfer, xfer_fan.h):
 * KVF_ESIZE when not both sides hold it. */
int kvf__xplan_only(kvf__xplan *p, uint32_t h, char *why, size_t whylen);

/* A short name of what the plan does ("whole blocks", "heads 2-3 of NHD
 * 16 -> HND 64"), for events and kvferryctl. */
void kvf__xplan_describe(const kvf__xplan *p, char *buf, size_t len);

/* Calls fn for each coalesced run of the plan over layers [first, first +
 * n_layers) (within both views), src block sids[i / Ts], dst block
 * dids[i / Td]; dst_piece is the index, in d's canonical order (layer,
 * region, block: kvf__blocks_descs), of the grant's block piece the run
 * starts in. Runs come layer by layer, region by region, in token order.
 * KVF_ERANGE for layers outside a view. */
typedef void (*kvf__xrun_fn)(void *ctx, uint64_t src_off, uint64_t dst_off, uint64_t len, uint32_t dst_piece);
int kvf__xform_walk(const kvf__xplan *p, const kvf__lview *s, const uint32_t *sids, const kvf__lview *d,
                    const uint32_t *dids, uint32_t first, uint32_t n_layers, kvf__xrun_fn fn, void *ctx);

/* The same walk appended to out as runs (pools from the views). */
int kvf__xform_runs(const kvf__xplan *p, const kvf__lview *s, const uint32_t *sids, const kvf__lview *d,
                    const uint32_t *dids, uint32_t first, uint32_t n_layers, kvf__runs *out);

/* Whether every piece of p's walk is one head's token (unit bytes) read
 * at a fixed step (the source's heads x unit) into a destination head
 * slice that is contiguous: NHD (more than one head) into HND. Then its
 * runs can be strided (desc.h), a destination head slice's pieces in one
 * run, as a gathered RDMA WRITE reads them. */
bool kvf__xplan_strides(const kvf__xplan *p);
/* The walk appended to out as strided runs of at most max_pieces pieces
 * (out->unit, out->step set; out must hold none or the same stride). */
int kvf__xform_runs_strided(const kvf__xplan *p, const kvf__lview *s, const uint32_t *sids, const kvf__lview *d,
                            const uint32_t *dids, uint32_t first, uint32_t n_layers, uint32_t max_pieces,
                            kvf__runs *out);

/* The transform kernel's geometry for p (cuda/copy_args.h: unit, sides,
 * heads, chunks, ids per side); the caller sets addresses, ids and pieces. */
struct kvf_xblocks_args;
void kvf__xform_kargs(const kvf__xplan *p, struct kvf_xblocks_args *a);

/* The bytes the plan moves over n_layers layers of n_kv regions. */
uint64_t kvf__xplan_bytes(const kvf__xplan *p, uint32_t n_layers, uint32_t n_kv);

#endif
