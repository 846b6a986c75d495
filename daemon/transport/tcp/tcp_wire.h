/* tcp_wire.h - the tcp transport's data batches on the wire: constants,
 * encoding and the receiver's pure checks. Private to tcp.c (static
 * inline: one user). */
#ifndef KVF_TCP_WIRE_H
#define KVF_TCP_WIRE_H

#include <stdbool.h>
#include <stdint.h>

#include "desc.h"
#include "frame.h"
#include "kvferryd.h"
#include "map.h"
#include "pool.h"

#define DATA_MAGIC 0x4446564bu      /* "KVFD" little-endian */
#define LAYER_MAGIC 0x4c46564bu     /* "KVFL": a layer marker (tcp_mark_layers) */
#define BHDR_LEN 16u                /* batch header: magic, count, handle */
#define ENT_LEN 16u                 /* per frame: pool, len, offset */
#define SLICE (1u << 20)            /* one frame carries at most this */
#define BATCH_FRAMES 256            /* frames per batch (one writev, one readv) */
#define BATCH_SEALED 0x80000000u    /* in a data batch's count: its source cannot fault */
#define KVF__TCP_SEALED_CAP "tcp-sealed" /* Hello.transports: we read BATCH_SEALED */

/* ------------------------------------------------------------ data frames
 *
 * A batch is a 16-byte header (magic, count, grant handle), count 16-byte
 * entries (pool, length, offset in the receiver's space), then the count
 * payloads back to back. The receiver checks every entry against the grant
 * before it reads a byte, then reads all payloads with one readv straight
 * into pool memory: a few syscalls per batch instead of two per block.
 *
 * A layer marker (grants with layer events) has the same 16-byte header
 * with LAYER_MAGIC, count = the number of streams it was sent on, and one
 * entry (pool = first layer, len = number of layers, offset 0). The sender
 * puts one behind a part's data on every stream; a stream's data lands in
 * order, so once the receiver has seen the marker on every stream (and
 * landed what each stream staged for a GPU before it), the part's layers
 * are in.
 *
 * BATCH_SEALED, the count's top bit (to peers that offered "tcp-sealed"),
 * says that the sender's source memory cannot fault (a sealed memfd, GPU
 * memory): its payload is what the source held. A source that can fault
 * goes out as zeros where it faulted (the stream stays in step) and only
 * the sender's SendDone says so; a grant whose every batch came sealed can
 * complete on its bytes alone, a control-link hop sooner. */

static inline void put32(uint8_t *p, uint32_t v) { kvf__frame_put_header(p, v); }
static inline void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

typedef struct batch_hdr {
  uint32_t magic;
  uint32_t count;
  uint64_t handle;
  bool sealed;           /* BATCH_SEALED was set */
} batch_hdr;

typedef struct batch_ent {
  uint32_t pool;
  uint32_t len;
  uint64_t offset;
} batch_ent;

static inline void bhdr_encode(uint8_t out[BHDR_LEN], uint32_t count, uint64_t handle, bool sealed) {
  put32(out, DATA_MAGIC);
  put32(out + 4, count | (sealed ? BATCH_SEALED : 0));
  put64(out + 8, handle);
}

static inline void bhdr_decode(const uint8_t in[BHDR_LEN], batch_hdr *h) {
  h->magic = kvf__frame_get_u32(in);
  uint32_t count = kvf__frame_get_u32(in + 4);
  h->sealed = h->magic == DATA_MAGIC && (count & BATCH_SEALED);
  h->count = h->magic == DATA_MAGIC ? count & ~BATCH_SEALED : count;
  h->handle = get64(in + 8);
}

static inline void ent_encode(uint8_t out[ENT_LEN], uint32_t pool, uint32_t len, uint64_t offset) {
  put32(out, pool);
  put32(out + 4, len);
  put64(out + 8, offset);
}

static inline void ent_decode(const uint8_t in[ENT_LEN], batch_ent *e) {
  e->pool = kvf__frame_get_u32(in);
  e->len = kvf__frame_get_u32(in + 4);
  e->offset = get64(in + 8);
}

/* The receiver's checks, before it reads a payload byte (pure: also
 * kvf__tcp_batch_check's). The header's own fields: */
static inline int check_header(const batch_hdr *h) {
  return h->magic != DATA_MAGIC || h->count == 0 || h->count > BATCH_FRAMES ? KVF_EPROTO : 0;
}

/* count raw entries, each 1..SLICE bytes; *bytes is the payload that follows. */
static inline int decode_entries(const uint8_t *raw, uint32_t count, batch_ent *e, uint64_t *bytes) {
  *bytes = 0;
  for (uint32_t i = 0; i < count; i++) {
    ent_decode(raw + (size_t)i * ENT_LEN, &e[i]);
    if (e[i].len == 0 || e[i].len > SLICE) return KVF_EPROTO;
    *bytes += e[i].len;
  }
  return 0;
}

/* The first entry outside the grant's ranges; count when all lie inside. */
static inline uint32_t first_outside(const kvf__rangeset *rs, const batch_ent *e, uint32_t count) {
  uint32_t i = 0;
  while (i < count && kvf__rangeset_contains(rs, e[i].pool, e[i].offset, e[i].len)) i++;
  return i;
}

#endif
