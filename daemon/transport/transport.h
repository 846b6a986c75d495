/* transport.h - the data-path vtable. One file per backend (tcp.c,
 * local.c; rdma and CUDA paths slot in here). The transfer state machine
 * (xfer.c) pairs and coalesces descriptors and hands runs to a transport; the
 * transport moves the bytes and reports back on the loop thread. */
#ifndef KVF_TRANSPORT_H
#define KVF_TRANSPORT_H

#include <stdbool.h>

#include "desc.h"
#include "kvferryd.h"

typedef struct kvf__transport_ops {
  const char *name;            /* reported as the transfer's path */
  /* Receiver: writes land without this side taking part (one-sided), so
   * closing a grant under them fails the sender's connection (rdma: its
   * memory windows invalidated), or lets them land after the memory went
   * back. A grant its client cancels is then closed only once the sender
   * says its writes are back (Cancel.ack, CancelDone). */
  bool one_sided;
  /* Whether this transport can carry data to p, judged from p->hello (the
   * peer's Hello). NULL: always. The first usable one in the config's
   * transports order is chosen when the peer comes up. */
  bool (*usable)(kvf__transport *t, kvf__peer *p);
  /* Sender: move runs (ownership passes to the transport). When the bytes of
   * this call are handed off (and, for last, all of the transfer), call
   * kvf__xfer_on_posted(x, status, last) on the loop. Returns 0 or an error,
   * in which case no callback follows. */
  int (*post)(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last);
  /* Sender: stop the transfer's queued work. The outstanding
   * kvf__xfer_on_posted callbacks still come, once nothing touches the
   * source memory any more. */
  void (*abort)(kvf__transport *t, kvf__xfer *x);
  /* Optional: the transfer is gone (every post of it was called back);
   * frees what the transport kept for it in x->tp_state. */
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
  /* Peer lifecycle: set up / tear down data connections. peer_down returns
   * after every thread stopped touching memory for that peer. */
  int (*peer_up)(kvf__transport *t, kvf__peer *p);
  void (*peer_down)(kvf__transport *t, kvf__peer *p);
  /* Writes a JSON fragment (no braces) describing the transport's state. */
  void (*inspect)(kvf__transport *t, char *buf, size_t len);
  void (*destroy)(kvf__transport *t);
} kvf__transport_ops;

struct kvf__transport {
  const kvf__transport_ops *ops;
};

int kvf__tcp_create(kvf__transport **out);
int kvf__local_create(kvf__transport **out);
/* tcp: a peer connection that opened with DataHello becomes a data stream. */
int kvf__tcp_adopt_stream(kvf__transport *t, kvf__peer *p, int fd, uint32_t stream);
/* tcp data batches: a 16-byte header (magic "KVFD", count, grant handle),
 * count 16-byte entries (pool, length, offset), then the payloads. The
 * checks a receiver makes before it reads a payload byte, as a pure function
 * (tests/fuzz): buf holds a header and its entries, rs the grant's ranges.
 * 0 with *handle, *count, *bytes (the payload that follows) and, when ents
 * is not NULL, ents[0..count) filled; KVF_EPROTO for a bad magic, count or
 * entry length, or buf too short; KVF_EPERM when an entry leaves rs (with
 * the same outputs set: the payload to skip). */
#define KVF__TCP_BATCH_HDR 16u
#define KVF__TCP_BATCH_ENT 16u
#define KVF__TCP_BATCH_MAX 256
int kvf__tcp_batch_check(const uint8_t *buf, size_t len, const kvf__rangeset *rs, uint64_t *handle,
                         uint32_t *count, uint64_t *bytes, kvf__range *ents);
/* rdma (rdma.c): discovers devices, registers every pool with each, starts
 * the CM listeners and progress threads. -ENODEV when no usable device (err
 * says why; the daemon goes on without rdma); other errors are fatal. */
int kvf__rdma_create(kvf__transport **out, char *err, size_t errlen);
/* What our Hello carries for rdma (NULL when rdma is not running). */
const Kvf__RdmaInfo *kvf__rdma_hello_info(void);
/* The running rdma transport, for status; NULL when there is none. */
kvf__transport *kvf__rdma_transport(void);
/* One line on what a peer can write into our pools over rdma (memory
 * windows or not); NULL when rdma is not running. */
const char *kvf__rdma_protection(void);
/* The tcp transport, for status; NULL before it is created. */
kvf__transport *kvf__tcp_transport(void);

#endif
