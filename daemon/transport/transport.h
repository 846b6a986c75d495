/* transport.h - the data-path interface: what the transfer state machine
 * (xfer.c) and the peers (peer.c) ask of a transport, and nothing else.
 *
 * A transport is a type and an instance, as a connection is in Redis and a
 * provider's context in rdma-core: each backend lives in its own folder
 * (tcp/, rdma/, local/), defines one const kvf__transport_ops, and embeds a
 * struct kvf__transport in its own instance struct, which every op reaches
 * from its first argument with kvf__container_of (no file-scope state). Its
 * per-peer state hangs in the peer's slot for that transport
 * (kvf__transport_peer). Ops a backend leaves NULL get the defaults of
 * transport.c (do nothing, or -EOPNOTSUPP), so callers never test for NULL.
 *
 * Adding a transport is a folder and a row in the table of transport.c.
 * Everything here runs on the loop thread. */
#ifndef KVF_TRANSPORT_H
#define KVF_TRANSPORT_H

#include <stdbool.h>

#include "desc.h"
#include "kv_xform.h"
#include "kvferryd.h"
#include "layout.h"
#include "mailbox.h"
#include "peer.h"

/* A part of a transfer of blocks (KV layouts): src block sids[i] lands in
 * dst block dids[i], for every region of layers [first, first + n_layers).
 * The layouts (NULL for a peer's) let a transport reach what it registered
 * for them (the GPU copies of their offsets). Owned by the transfer, alive
 * until the post is called back. With xf.transform the two layouts differ
 * in heads, order or tokens per block: xf maps them (kv_xform.h), the send
 * has xf.ns blocks and the grant xf.nd, and n is not used. */
typedef struct kvf__bpart {
  const kvf__lview *src, *dst;
  const kvf__layout *src_layout, *dst_layout;
  const uint32_t *sids, *dids;
  size_t n;
  uint32_t first, n_layers;
  kvf__xplan xf;               /* zero: whole blocks, as without it */
} kvf__bpart;

struct kvf__xstaged; /* xfer.h */

typedef struct kvf__transport_ops {
  const char *name;            /* reported as the transfer's path */
  /* Receiver: writes land without this side taking part (one-sided), so
   * closing a grant under them fails the sender's connection (rdma: its
   * memory windows invalidated), or lets them land after the memory went
   * back. A grant its client cancels is then closed only once the sender
   * says its writes are back (Cancel.ack, CancelDone). */
  bool one_sided;
  /* Whether this transport can carry data to p, judged from p->hello (the
   * peer's Hello). Default: always. The first usable one in the config's
   * transports order is chosen when the peer comes up. */
  bool (*usable)(kvf__transport *t, kvf__peer *p);
  /* Sender: move runs (ownership passes to the transport). When the bytes of
   * this call are handed off (and, for last, all of the transfer), call
   * kvf__xfer_on_posted(x, status, last) on the loop. Returns 0 or an error,
   * in which case no callback follows. */
  int (*post)(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last);
  /* Sender: the same for a part of blocks, with the same callback. Default:
   * the layouts walked into runs (kvf__blocks_pair), then post. The local
   * transport computes addresses on the GPU instead. */
  int (*post_blocks)(kvf__transport *t, kvf__xfer *x, const kvf__bpart *part, bool last);
  /* Sender, a grant that wants layer events: the part of layers [first,
   * first + n) is posted; tell the receiver when all of it has landed
   * (tcp: a marker behind it on every stream; the receiving transport then
   * calls kvf__xfer_on_layers_landed). Returns false when the transport
   * cannot: the transfer then says so itself (LayersDone) once the part's
   * post is called back, which for a transport whose callback means "the
   * writes completed" (rdma) is when they landed. Default: false. */
  bool (*mark_layers)(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n);
  /* Receiver: the sender says layers [first, first + n) of x's grant sit in
   * the staging this transport gave the grant, as st says (rdma): place
   * them in the grant's blocks before they are reported. 0 (placed), a
   * positive count of passes started off the loop (each then calls
   * kvf__xrecv_unstaged on the loop; x's SendDone waits for them), or an
   * error with why (x then fails). Default: KVF_EPROTO (we gave no staging). */
  int (*unstage)(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n, const struct kvf__xstaged *st,
                 char *why, size_t len);
  /* Sender: stop the transfer's queued work. The outstanding
   * kvf__xfer_on_posted callbacks still come, once nothing touches the
   * source memory any more. */
  void (*abort)(kvf__transport *t, kvf__xfer *x);
  /* The transfer is gone (every post of it was called back); frees what the
   * transport kept for it in x->tp_state. */
  void (*xfer_done)(kvf__transport *t, kvf__xfer *x);
  /* Receiver: accept writes for x's grant from x->peer / stop accepting.
   * grant_open returns 0 (open: the Grant may go), a positive value (open,
   * but the Grant waits: kvf__xfer_on_grant_ready(x, status, why) follows on
   * the loop unless grant_close comes first; rdma binds memory windows) or
   * an error. It may set x->tp_grant, which the Grant carries to the
   * sender's transport. grant_close returns once no write into the grant is
   * in progress and none can start (rdma: its memory windows invalidated). */
  int (*grant_open)(kvf__transport *t, kvf__xfer *x);
  void (*grant_close)(kvf__transport *t, kvf__xfer *x);
  /* Peer lifecycle: set up / tear down data connections (the state goes in
   * the peer's slot). peer_down returns after every thread stopped touching
   * memory for that peer. */
  int (*peer_up)(kvf__transport *t, kvf__peer *p);
  void (*peer_down)(kvf__transport *t, kvf__peer *p);
  /* Engine memory (kvf_mem_register): pool p came after start / is going
   * (no transfer uses it any more; the transport's threads must be done
   * with it when pool_removed returns). pool_added returns 0, or an error
   * with err, and the registration fails; a transport that registers pools
   * with NICs sets p->nic_reg. Default: -EOPNOTSUPP (a transport that
   * cannot take pools after start refuses engine memory). */
  int (*pool_added)(kvf__transport *t, kvf__pool *p, char *err, size_t errlen);
  void (*pool_removed)(kvf__transport *t, kvf__pool *p);
  /* Our Hello: what a peer needs to reach us over this transport (rdma: its
   * devices, CM addresses and keys). */
  void (*hello)(kvf__transport *t, Kvf__Hello *h);
  /* One line on what a peer may write into our pools through this
   * transport (status, doctor); NULL when there is nothing to say. */
  const char *(*protection)(kvf__transport *t);
  /* Writes a JSON fragment (no braces) describing the transport's state. */
  void (*inspect)(kvf__transport *t, char *buf, size_t len);
  void (*destroy)(kvf__transport *t);
} kvf__transport_ops;

struct kvf__transport {
  const kvf__transport_ops *ops; /* = &merged */
  kvf__transport_ops merged;     /* the backend's ops over the defaults */
  unsigned slot;                 /* its index in kvf__peer.tp_slot */
  uv_loop_t *loop;
};

/* A backend's create: fills its embedded kvf__transport with
 * kvf__transport_init. -ENODEV: it cannot run here (err says why) and the
 * daemon goes on without it; any other error stops the start. */
typedef int (*kvf__transport_create_fn)(uv_loop_t *loop, unsigned slot, kvf__transport **out, char *err,
                                        size_t errlen);

void kvf__transport_init(kvf__transport *t, const kvf__transport_ops *ops, uv_loop_t *loop, unsigned slot);

/* The default post_blocks: the part's two layouts walked into runs
 * (kvf__blocks_pair), then t's post. A backend that takes only some parts
 * its own way hands it the others. */
int kvf__transport_post_block_runs(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last);

/* One side of a block copy as the block kernels see it (cuda/gpu.h): the
 * table of l (view v's layout, its offsets on the GPU) and v's offsets
 * from layer first, v's cuda pool's device address, the block ids. */
struct kvf__gpu_bside;
void kvf__transport_block_side(const kvf__lview *v, const kvf__layout *l, const uint32_t *ids, uint32_t first,
                               struct kvf__gpu_bside *out);

/* pool_added for a transport that reaches every pool through the daemon's
 * own mapping (tcp, local): nothing to register. */
int kvf__transport_pool_mapped(kvf__transport *t, kvf__pool *p, char *err, size_t errlen);

/* t's state for peer p (NULL when it has none), and setting it. */
static inline void *kvf__transport_peer(const kvf__transport *t, const kvf__peer *p) {
  return p->tp_slot[t->slot];
}
static inline void kvf__transport_set_peer(const kvf__transport *t, kvf__peer *p, void *state) {
  p->tp_slot[t->slot] = state;
}

/* The daemon's transports (kvfd.transports), made from the table in
 * transport.c: those that always run (local, tcp) and those the config's
 * `transports` names. kvf__transports_for_peers gives, in the config's
 * order of preference, those that carry data to peers; when none of the
 * configured ones runs here, tcp (the daemon says so). */
int kvf__transports_start(uv_loop_t *loop);
void kvf__transports_stop(void);
kvf__transport *kvf__transport_find(const char *name);
size_t kvf__transports_for_peers(kvf__transport **out, size_t cap);

#endif
