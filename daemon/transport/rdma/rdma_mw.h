/* rdma_mw.h - memory windows of the rdma transport (rdma_mw.c): the window
 * records a Grant carries, finding the window a write goes through,
 * planning the windows of a grant, and the start-time check of whether a
 * device enforces a window's bounds.
 *
 * Why windows: with pool-wide rkeys a peer can write any byte of a
 * registered pool at any time. With type 2 memory windows the pools are
 * registered without remote access; the receiver binds one window per range
 * of a grant on one of the peer's queue pairs, the Grant tells the sender
 * which (records below), and the windows are invalidated when the transfer
 * ends. A type 2 window is usable only through the QP it was bound on. */
#ifndef KVF_RDMA_MW_H
#define KVF_RDMA_MW_H

#include <endian.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "desc.h"

struct ibv_context;
struct ibv_pd;

/* One record of Grant.windows (proto/kvferry.proto): 32 bytes, LE. */
#define KVF__MW_REC 32u

typedef struct kvf__mw_rec {
  uint32_t pool;
  uint64_t off, len;     /* the window: [off, off + len) of the pool */
  uint32_t rkey;
  uint32_t qpn;          /* the sender's QP whose receiving end holds it */
  uint16_t dev;          /* the sender's device, by index in its Hello */
} kvf__mw_rec;

void kvf__mw_rec_put(uint8_t *p, const kvf__mw_rec *r);
void kvf__mw_rec_get(const uint8_t *p, kvf__mw_rec *r);
/* 0 when b holds whole records, sorted by (pool, off), none empty, wrapping
 * or overlapping the next; else KVF_EPROTO. */
int kvf__mw_recs_check(const uint8_t *b, size_t len);
/* Decodes the n records of b (checked) into v. */
void kvf__mw_recs_decode(const uint8_t *b, size_t n, kvf__mw_rec *v);
/* Whether window w holds [off, off + len) of pool. Inline: the sender
 * checks each write it posts against its window. */
static inline bool kvf__mw_holds(const kvf__mw_rec *w, uint32_t pool, uint64_t off, uint64_t len) {
  return w->pool == pool && off >= w->off && len <= w->len && off - w->off <= w->len - len;
}

/* The index of the record of v[0..n) (decoded, checked) that holds all of
 * [off, off + len) of pool, or -1. With nearest, when none does: pool's
 * last record starting at or before off, else its first (a rogue sender of
 * the failpoint build writes outside its windows with one it holds). */
long kvf__mw_find(const kvf__mw_rec *v, size_t n, uint32_t pool, uint64_t off, uint64_t len, bool nearest);

/* The windows of a grant: the ranges of rs (sorted and merged, as
 * kvf__rangeset_build makes them), merged across the smallest gaps within a
 * pool until at most max remain (or no two of a pool are left). *out is
 * malloc'ed (NULL when rs is empty); *merged: how many gaps were spanned.
 * 0 or -ENOMEM. */
int kvf__mw_plan(const kvf__rangeset *rs, size_t max, kvf__range **out, size_t *n, size_t *merged);

/* Grant.window_of: each descriptor's window, 4 bytes (u32 LE) per
 * descriptor of the grant, in its order. */
#define KVF__MW_OF 4u

/* Fills of (d->n * KVF__MW_OF bytes) with the index in win[0..n) (planned
 * by kvf__mw_plan from d's ranges) of the window that holds each
 * descriptor of d. 0, or KVF_EINVAL when one lies in none. */
int kvf__mw_index(const kvf__descs *d, const kvf__range *win, size_t n, uint8_t *of);
/* Entry k of a Grant.window_of of len bytes; UINT32_MAX past its end.
 * Inline: the sender reads one per write it posts. */
static inline uint32_t kvf__mw_index_get(const uint8_t *of, size_t len, size_t k) {
  uint32_t v;
  if (k >= len / KVF__MW_OF) return UINT32_MAX;
  memcpy(&v, of + k * KVF__MW_OF, sizeof(v));
  return le32toh(v);
}

/* What a device does with a write that leaves a type 2 window. */
enum kvf__mw_bounds {
  KVF__MW_BOUNDS_UNKNOWN = 0,  /* the check could not run */
  KVF__MW_BOUNDS_ENFORCED,     /* refused with a remote access error */
  KVF__MW_BOUNDS_IGNORED,      /* it lands (checked against the MR only) */
  KVF__MW_BROKEN,              /* even a write inside the window failed */
};
/* Binds a type 2 window over one page of a scratch buffer on a loopback RC
 * QP pair of (ctx, port, gid_index) in pd, writes inside it, then across
 * its end. Takes a few ms (at most about 2 s when the loopback path does
 * not work). Returns an enum kvf__mw_bounds; why says what happened. */
int kvf__mw_check_bounds(struct ibv_context *ctx, struct ibv_pd *pd, uint8_t port, uint32_t gid_index,
                         char *why, size_t len);
const char *kvf__mw_bounds_name(int b);

#endif
