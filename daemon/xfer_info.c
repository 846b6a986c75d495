/* xfer_info.c - what a transfer is, for events, reports and metrics: the
 * name of its phase, its bytes and its descriptors (blocks: blocks x layers
 * x K/V), and what a transport's failure means. Pure functions; the state
 * machine is xfer.c. */
#include "xfer.h"
#include "xfer_int.h"

#include <errno.h>
#include <stddef.h>

const char *kvf__xstate_name(int state) {
  static const char *const names[] = {
#define XX(phase, name) [KVF__X_##phase] = name,
      KVF__XPHASE_MAP(XX)
#undef XX
  };
  return state > 0 && (size_t)state < sizeof(names) / sizeof(names[0]) ? names[state] : "?";
}

uint64_t kvf__xfer_bytes(const kvf__xfer *x) {
  if (x->role == KVF__SEND) return x->send.bytes_posted;
  return x->blocks ? kvf__xrecv_blocks_bytes(x) : x->dst.total;
}

uint64_t kvf__xfer_descriptors(const kvf__xfer *x) {
  if (x->role == KVF__SEND) return x->send.descs_taken;
  return x->blocks ? kvf__blocks_pieces(&x->mine.view, x->mine.n, x->mine.view.n_layers) : x->dst.n;
}

/* A grant's rdma windows are bound on the queue pairs of the moment: once
 * those are reset (a data-path error with the peer) the grant can take no
 * more data, and the engine must grant again. */
const char *kvf__xfer_post_failure(int status, const char *otherwise) {
  switch (status) {
  case KVF_EPERM: return "the receiver refused a write (outside its memory windows, or after they were invalidated)";
  case -EFAULT: return "the memory of a pool went away under the copy (an engine's memory file shrank)";
  case KVF_EPEERLOST:
    return "the data path to the peer went away (its queue pairs were reset, or the peer is down); grant again";
  default: return otherwise;
  }
}
