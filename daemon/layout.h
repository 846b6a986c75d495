/* layout.h - KV-cache layouts: how an engine's cache sits in a pool, so
 * that transfers name block ids and layers instead of byte ranges.
 *
 * A layout has n_layers layers; each layer has n_kv regions (2: K and V,
 * or 1: one latent region, MLA); region r (= layer * n_kv + kv) holds
 * n_blocks blocks of block_bytes each, block b at
 *
 *     offsets[r] + b * block_stride
 *
 * of the pool. That covers vLLM's per-layer tensors ([2, blocks, ...]: K
 * then V, stride = block_bytes), FlashInfer's ([blocks, 2, ...]: V at
 * K + block_bytes, stride = 2 * block_bytes) and cross-layer caches (one
 * block holds every layer: stride = the whole block, offsets inside it).
 * Regions never overlap one another, and every block of every region lies
 * inside the pool (kvf__layout_validate).
 *
 * A transfer's blocks on one side are a view (kvf__lview) of a layout for a
 * range of layers, plus a list of block ids; the view is all the other
 * daemon needs to compute addresses (a Grant carries the receiver's). Block
 * i of the send lands in block i of the grant, for every layer and region:
 * kvf__blocks_pair walks both views straight into coalesced runs, without
 * descriptor lists. Pure logic; loop thread. */
#ifndef KVF_LAYOUT_H
#define KVF_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "desc.h"
#include "kvferry.h"
#include "kvferry.pb-c.h"

#define KVF__LAYOUT_MAX_LAYERS 1024u
#define KVF__LAYOUT_MAX_KV 2u

/* What a layout says of the tensors in its blocks (0: not stated). Two
 * sides that state all of it may differ in heads, order and tokens per
 * block: kv_xform.h reconciles them. */
typedef struct kvf__lgeom {
  uint32_t tokens_per_block;
  uint32_t kv_heads;
  uint32_t head_dim;
  uint32_t dtype_bytes;
  uint32_t order;               /* KVF_LAYOUT_NHD or KVF_LAYOUT_HND */
  uint32_t first_head;          /* heads [first_head, first_head + kv_heads) */
  uint32_t model_heads;         /* of the model's; 0: every head (first_head 0) */
} kvf__lgeom;

/* Layers [first_layer, first_layer + n_layers) of a layout. */
typedef struct kvf__lview {
  uint32_t pool;
  uint32_t n_kv;
  uint32_t n_blocks;            /* valid block ids: [0, n_blocks) */
  uint32_t first_layer, n_layers;
  uint64_t block_bytes, block_stride;
  const uint64_t *offsets;      /* [(layer - first_layer) * n_kv + kv] */
  kvf__lgeom geom;
} kvf__lview;

typedef struct kvf__session kvf__session;

/* A registered layout (one client's; freed with it). Transfers hold a
 * reference while they use it. */
typedef struct kvf__layout {
  uint32_t id;
  kvf__session *owner;          /* NULL once freed by its client */
  unsigned refs;
  uint32_t pool;
  uint32_t n_layers, n_kv, n_blocks;
  uint64_t block_bytes, block_stride;
  uint64_t *offsets;            /* n_layers * n_kv, owned */
  kvf__lgeom geom;
  void *gpu;                    /* cuda pools: the offsets on the GPU (cuda/gpu.h) */
} kvf__layout;

/* Checks l against a pool of pool_size bytes: KVF_EINVAL (shape: counts,
 * sizes, stride, geometry), KVF_ERANGE (a block outside the pool) or
 * KVF_EINVAL for two regions that overlap; err says which and where. */
int kvf__layout_validate(const kvf__layout *l, uint64_t pool_size, char *err, size_t errlen);

/* The view of layers [first, first + n) of l (n 0: to the last layer):
 * KVF_ERANGE when that leaves the layout. */
int kvf__layout_view(const kvf__layout *l, uint32_t first, uint32_t n, kvf__lview *v);

/* The pool offset of block b of region (layer, kv): a view's layer is
 * absolute (first_layer <= layer < first_layer + n_layers). */
static inline uint64_t kvf__lview_addr(const kvf__lview *v, uint32_t layer, uint32_t kv, uint32_t block) {
  return v->offsets[(size_t)(layer - v->first_layer) * v->n_kv + kv] + (uint64_t)block * v->block_stride;
}

/* Whether every region's block b lies within one stride of its first
 * region's: then a block's layers sit together, and walks go block by
 * block (cross-layer layouts coalesce into one run per block). */
bool kvf__lview_block_major(const kvf__lview *v);

/* KVF_ERANGE when an id is not below v->n_blocks (*bad: its index). */
int kvf__blocks_check(const kvf__lview *v, const uint32_t *ids, size_t n, size_t *bad);

/* KVF_ESIZE when src's blocks cannot land in dst's as they are: block sizes,
 * regions per layer or a geometry both state differ (why says which). */
int kvf__lview_compatible(const kvf__lview *src, const kvf__lview *dst, char *why, size_t whylen);

/* Bytes and pieces (blocks x regions x layers) of n blocks of layers
 * [first, first + n_layers) of v. */
uint64_t kvf__blocks_bytes(const kvf__lview *v, size_t n, uint32_t n_layers);
uint64_t kvf__blocks_pieces(const kvf__lview *v, size_t n, uint32_t n_layers);

/* Appends the runs that move src block sids[i] to dst block dids[i], i <
 * n, for every region of layers [first, first + n_layers) (within both
 * views), coalescing pieces that sit back to back on both sides. A run's
 * dst_desc is the index of its first piece in dst's canonical order
 * (kvf__blocks_descs: layer, then region, then i). */
int kvf__blocks_pair(const kvf__lview *src, const uint32_t *sids, const kvf__lview *dst, const uint32_t *dids,
                     size_t n, uint32_t first, uint32_t n_layers, kvf__runs *out);

/* The pieces of blocks ids[0..n) over every layer of v as descriptors, in
 * canonical order: what a receiver checks writes against and binds memory
 * windows over. */
int kvf__blocks_descs(const kvf__lview *v, const uint32_t *ids, size_t n, kvf__descs *out);

/* ------------------------------------------------------------ the wire */

/* A client's LayoutReq into l (l->offsets malloc'ed; kvf__layout_clear
 * frees it): KVF_EINVAL/KVF_EPROTO with err for what does not decode. The
 * result still needs kvf__layout_validate. */
int kvf__layout_from_wire(const Kvf__Layout *w, kvf__layout *l, char *err, size_t errlen);
void kvf__layout_clear(kvf__layout *l);
/* v as a Grant's Layout; w->offsets points into buf, n_layers * n_kv * 8
 * bytes that the caller provides (KVF__LVIEW_WIRE_BYTES). */
#define KVF__LVIEW_WIRE_BYTES(v) ((size_t)(v)->n_layers * (v)->n_kv * 8u)
void kvf__lview_to_wire(const kvf__lview *v, Kvf__Layout *w, uint8_t *buf);
/* A peer's Layout into v, its offsets malloc'ed into *offsets (free them);
 * KVF_EPROTO when it does not decode or is not a sane view. */
int kvf__lview_from_wire(const Kvf__Layout *w, kvf__lview *v, uint64_t **offsets);
/* Block ids: packed u32 little-endian. from_wire: KVF_EPROTO for a length
 * that is not a multiple of 4, KVF_ELIMIT past max; *ids malloc'ed (NULL
 * when empty). to_wire writes n * 4 bytes into buf. */
int kvf__ids_from_wire(ProtobufCBinaryData w, size_t max, uint32_t **ids, size_t *n);
void kvf__ids_to_wire(const uint32_t *ids, size_t n, uint8_t *buf);

#endif
