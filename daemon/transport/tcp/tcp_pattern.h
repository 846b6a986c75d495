/* tcp_pattern.h - pattern batches of the tcp transport (issue 17): one
 * entry stands for a strided set of pieces in the receiver's space, so a
 * transform between KV layouts (NHD <-> HND, other heads) moves a chunk of
 * many small pieces under one 40-byte entry instead of one entry each.
 *
 * A pattern batch is the 16-byte batch header with PAT_MAGIC ("KVFP"),
 * count (1..KVF__TCP_BATCH_MAX) and the grant handle, count 40-byte entries
 *
 *     pool u32, len u32, n1 u32, n2 u32, off u64, s1 u64, s2 u64
 *
 * (little-endian), then each entry's payload, len * n1 * n2 bytes (1 ..
 * KVF__TCP_PAT_MAX), in piece order: piece (i2, i1), i2 < n2 outer, i1 < n1
 * inner, lands at off + i2 * s2 + i1 * s1 of pool.
 *
 * The receiver's check, before it reads a payload byte. Every piece lies
 * in [off, end) with end = off + (n2 - 1) * s2 + (n1 - 1) * s1 + len: the
 * strides are unsigned, so a piece starts at or after off, and it ends at
 * off + i2 * s2 + i1 * s1 + len <= end since i2 <= n2 - 1 and i1 <= n1 - 1.
 * The receiver computes end (refusing an entry where it overflows 64 bits)
 * and checks that [off, end) lies in the grant's ranges, as a plain entry's
 * [offset, offset + len) is (KVF_EPERM otherwise): then no piece can reach
 * outside. The sender keeps a pattern within one piece of the grant (one
 * block of one region) so that its box is granted memory.
 *
 * Negotiated: a daemon that reads pattern batches lists "tcp-pattern" among
 * its Hello's transports (a name no daemon chooses a transport by; older
 * daemons ignore it); a sender sends them only to a peer that does. */
#ifndef KVF_TCP_PATTERN_H
#define KVF_TCP_PATTERN_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "desc.h"
#include "transport/tcp/tcp.h"

#define KVF__TCP_PAT_MAGIC 0x5046564bu  /* "KVFP" */
#define KVF__TCP_PAT_ENT 40u
#define KVF__TCP_PAT_MAX (1u << 20)     /* an entry's payload at most (SLICE) */
#define KVF__TCP_PAT_PIECES 4096u      /* pieces a sender puts in one entry at most */
#define KVF__TCP_PAT_CAP "tcp-pattern"  /* the capability's name in Hello.transports */

typedef struct kvf__tcp_pat {
  uint32_t pool, len, n1, n2;
  uint64_t off, s1, s2;
} kvf__tcp_pat;

void kvf__tcp_pat_encode(uint8_t out[KVF__TCP_PAT_ENT], const kvf__tcp_pat *p);

/* Decodes count entries; *bytes is the payload that follows. KVF_EPROTO for
 * a zero length or count, or a payload over KVF__TCP_PAT_MAX. */
int kvf__tcp_pat_decode(const uint8_t *raw, uint32_t count, kvf__tcp_pat *e, uint64_t *bytes);

/* The first entry with a piece outside rs (its box, above), count when
 * none. */
uint32_t kvf__tcp_pat_first_outside(const kvf__rangeset *rs, const kvf__tcp_pat *e, uint32_t count);

/* A receiver's lookup table over a grant's range set, for the boxes of
 * pattern entries: a grant of blocks in an engine's order has ranges at
 * random places (16,384 for a llama3-8b rank of 4,096 tokens), and a
 * batch's 4 KiB chunks land in as many different blocks, so each box was
 * a binary search through a few hundred KiB of ranges (3% of a TP 8 -> 4
 * handoff's CPU, perf). The table maps a granule of the ranges' span to
 * the last range starting at or before it; a lookup then steps over the
 * few ranges starting within the granule. Without a table (small sets,
 * several pools, out of memory) it is the binary search. */
typedef struct kvf__tcp_rindex {
  const kvf__rangeset *rs;
  uint32_t pool;           /* of every range, with a table */
  uint64_t lo;             /* the first range's start */
  unsigned shift;          /* granule = 1 << shift bytes */
  uint32_t *first;         /* per granule; NULL: no table */
  uint64_t n;              /* granules */
} kvf__tcp_rindex;

/* ix over rs (which must outlive it); never fails: without memory for the
 * table, lookups search. */
void kvf__tcp_rindex_build(kvf__tcp_rindex *ix, const kvf__rangeset *rs);
void kvf__tcp_rindex_free(kvf__tcp_rindex *ix);
/* As kvf__ranges_find over ix->rs. */
long kvf__tcp_rindex_find(const kvf__tcp_rindex *ix, uint32_t pool, uint64_t off, uint64_t len);
/* kvf__tcp_pat_first_outside through ix. */
uint32_t kvf__tcp_pat_first_outside_ix(const kvf__tcp_rindex *ix, const kvf__tcp_pat *e, uint32_t count);

/* The checks a receiver makes of a pattern batch (buf: header and entries)
 * before it reads a payload byte, pure (tests, fuzz): 0 with *handle,
 * *count, *bytes; KVF_EPROTO malformed or buf short; KVF_EPERM a piece
 * outside rs (outputs set: the payload to skip). */
int kvf__tcp_pattern_check(const uint8_t *buf, size_t len, const kvf__rangeset *rs, uint64_t *handle,
                           uint32_t *count, uint64_t *bytes);

/* Receiver: iovecs for e's pieces at base (its pool's memory), from piece
 * *next on, at most cap, pieces back to back merged; advances *next.
 * Returns how many iovecs it filled (0 once every piece is out). */
int kvf__tcp_pat_iov(const kvf__tcp_pat *e, uint8_t *base, uint64_t *next, struct iovec *iov, int cap);

/* Receiver: the reads of a batch's payload. Entries whose pieces are
 * small go through a bounce buffer of the thread's (one stretch of a read,
 * then a copy a piece: the kernel's copy costs more per iovec than the
 * copy per piece; into sealed pools whole cache lines are streamed,
 * otherwise each piece is a guarded kvf__pool_copy), the others straight
 * into pool memory. A step fills iov (at most cap) for one read; after the
 * read, scatter copies what the step put in the bounce buffer where it
 * goes. */
/* 256 KiB: the kernel's copy into it and the scatter out of it stay in
 * cache with four receiver threads on two cores (1 MiB cost the kernel's
 * copy a third more, perf); entries with more payload go straight. */
#define KVF__TCP_PAT_BOUNCE (256u << 10)
#define KVF__TCP_PAT_SMALL 1024u         /* pieces shorter than this are bounced */
typedef struct kvf__tcp_rplan {
  const kvf__tcp_pat *e;
  uint32_t count, i;
  uint64_t next;                           /* the next piece of e[i] */
  uint8_t *bounce;                         /* NULL: everything straight */
  uint32_t staged[KVF__TCP_BATCH_MAX];     /* entries of this step in the bounce buffer, in order */
  uint32_t n_staged;
} kvf__tcp_rplan;

/* bounce: the reader's own buffer (a stream's: streams share threads),
 * allocated here (KVF__TCP_PAT_BOUNCE bytes) the first time a batch wants
 * it; the reader frees it. */
void kvf__tcp_rplan_init(kvf__tcp_rplan *r, const kvf__tcp_pat *e, uint32_t count, uint8_t **bounce);
/* Fills the next read's iovecs; 0 when every payload byte is planned. */
int kvf__tcp_rplan_step(kvf__tcp_rplan *r, struct iovec *iov, int cap);
static inline bool kvf__tcp_rplan_done(const kvf__tcp_rplan *r) { return r->i == r->count; }
/* After the step's read: the bounced pieces into the pools. 0, or -EFAULT
 * when pool memory went away (kvf__pool_copy). */
int kvf__tcp_rplan_scatter(kvf__tcp_rplan *r);

/* Sender: the longest pattern at the start of runs v[0..n) (v[0].len at
 * most KVF__TCP_PAT_MAX: the caller cuts longer runs): runs of one
 * destination pool and grant piece, one length, whose destinations follow
 * off + i2 * s2 + i1 * s1 with positive strides, at most KVF__TCP_PAT_MAX
 * bytes in all; normalised (pieces back to back merged into one). Returns
 * how many runs it takes (>= 1). */
size_t kvf__tcp_pat_take(const kvf__run *v, size_t n, kvf__tcp_pat *p);

/* Sender: a stream's share of a post as patterns, each with its payload's
 * source memory (iovecs, back-to-back ones merged). */
typedef struct kvf__tcp_pshare {
  kvf__tcp_pat *p;
  size_t *iov_end;       /* pattern i's payload: iov[iov_end[i - 1] (0 for i = 0), iov_end[i]) */
  size_t n, cap;
  struct iovec *iov;
  size_t n_iov, cap_iov;
} kvf__tcp_pshare;

/* Deals runs v[0..n) (host source memory) as patterns over shares
 * sh[0..n_sh) round robin from *rr (all on sh[*rr] when small), as
 * tcp.c's deal_frames does frames. 0 or -ENOMEM. */
int kvf__tcp_pat_deal(const kvf__run *v, size_t n, kvf__tcp_pshare *sh, uint32_t n_sh, uint32_t *rr, bool small);
void kvf__tcp_pshare_free(kvf__tcp_pshare *s);

/* Spare pshare arrays, kept when an item is done and handed to the next
 * deal: a TP 8 -> 4 request deals 131,072 patterns (8 MiB of entries and
 * iovecs), and arrays grown afresh for every post cost the sending
 * daemon's main thread a page fault (and a page cleared) every 4 KiB of
 * them, 5% of the handoff's CPU on the dev machine (perf). At most
 * KVF__TCP_PSPARES sets, none over KVF__TCP_PSPARE_BIG bytes, are kept. */
#define KVF__TCP_PSPARES 32u
#define KVF__TCP_PSPARE_BIG (4u << 20)
typedef struct kvf__tcp_pspare {
  pthread_mutex_t lock;
  kvf__tcp_pshare v[KVF__TCP_PSPARES];
  unsigned n;
} kvf__tcp_pspare;

void kvf__tcp_pspare_init(kvf__tcp_pspare *sp);
void kvf__tcp_pspare_destroy(kvf__tcp_pspare *sp);
/* *s becomes an empty share, with a spare's arrays when there is one. */
void kvf__tcp_pspare_take(kvf__tcp_pspare *sp, kvf__tcp_pshare *s);
/* s's arrays go back to the spares (or are freed); s is emptied. */
void kvf__tcp_pspare_give(kvf__tcp_pspare *sp, kvf__tcp_pshare *s);

/* The same for a part of blocks with a transform (b->xf), straight from
 * the plan: each chunk of kv_xform's walk (g tokens of one region in one
 * block on each side) is one pattern, its pieces in the source's order so
 * that the source is read in few stretches. The chunks go in the order of
 * the source's block ids, 256 KiB to a stream at a time, so that a stream
 * reads neighbouring blocks. -E2BIG when a chunk would not fit one entry
 * (the caller walks runs instead). */
struct kvf__bpart;
int kvf__tcp_pat_deal_plan(const struct kvf__bpart *b, kvf__tcp_pshare *sh, uint32_t n_sh, uint32_t *rr,
                           bool small);

/* The iovecs a batch carries at most (IOV_MAX a writev: the writer cuts). */
#define KVF__TCP_PAT_IOVS (2 * KVF__TCP_PAT_PIECES + 2)

/* The next batch of s from pattern *next on: header into hdr, entries into
 * ents, iov[0..ret) = header, entries, payloads; at most
 * KVF__TCP_BATCH_MAX patterns and KVF__TCP_PAT_IOVS iovecs. *bytes: its
 * payload. */
int kvf__tcp_pat_batch(const kvf__tcp_pshare *s, size_t *next, uint64_t handle, uint8_t *hdr, uint8_t *ents,
                       struct iovec *iov, uint64_t *bytes);

#endif
