/* bench_hetero.h - kvferry-bench --blocks with heterogeneous layouts
 * (issue 17): --prefill-tp N --decode-tp M, --prefill-order / --decode-order
 * nhd|hnd, --prefill-block-tokens / --decode-block-tokens. Every rank the
 * two TPs imply is a client of its daemon with its own layout (its share of
 * the model's KV heads, its order and block size) over its slice of the
 * pool; each request is one transfer id that every decode rank grants and
 * every prefill rank sends (fan-in / fan-out over KV heads, xfer_fan.h);
 * with equal TPs, rank r hands to rank r one to one (the layouts then do
 * not state their heads: a same-layout handoff is the plain one). Every
 * byte of every decode rank is checked against the pattern the prefill
 * ranks wrote. Host pools are written and read in place; in a cuda:N pool
 * each rank keeps a host shadow of its slice, copied to the GPU before
 * each request and back after it, outside the timed window. With --nowait
 * the grants and sends are queued (KVF_NOWAIT), as many engines' ranks
 * would post them at once, and a refusal fails the run from its event. */
#ifndef KVF_BENCH_HETERO_H
#define KVF_BENCH_HETERO_H

#include <stdbool.h>
#include <stdint.h>

typedef struct kvfb_het {
  bool on;                      /* any of the options was given */
  uint32_t ptp, dtp;            /* default 1 */
  uint32_t porder, dorder;      /* KVF_LAYOUT_NHD / _HND */
  uint32_t pts, dts;            /* tokens per block; 0: the model's */
} kvfb_het;

/* What the run takes from the bench's own options. */
typedef struct kvfb_het_run {
  const char *from, *to, *pool_from, *pool_to, *model;
  uint64_t layers, kv_heads, head_dim, dtype_bytes, block_tokens, kv_count;
  uint64_t tokens, requests, seed;
  uint32_t deadline_ms;
  bool nowait;                  /* every grant and send with KVF_NOWAIT, as engines that do not wait */
  bool json, quiet;
} kvfb_het_run;

/* One of the options (name without "--"): 0, or -1 with a message. */
int kvfb_het_opt(const char *name, const char *arg, kvfb_het *h);
/* Runs it; prints the JSON line (json) or a summary. Exit status. */
int kvfb_het_main(const kvfb_het_run *r, const kvfb_het *h);

#endif
