/* xfer_int.h - what xfer.c and xfer_blocks.c share: the state machine's
 * core operations and the blocks' half of it. Private to the two files. */
#ifndef KVF_XFER_INT_H
#define KVF_XFER_INT_H

#include "xfer.h"

/* xfer.c: the core. */
void kvf__xfer_fail(kvf__xfer *x, int status, const char *why, bool notify, int remote_status);
void kvf__xfer_set_state(kvf__xfer *x, int to);
bool kvf__xfer_live(const kvf__xfer *x);
int kvf__xfer_peer_send(kvf__peer *p, Kvf__PeerMsg *m);
void kvf__xfer_emit(kvf__session *s, const Kvf__Event *ev);

/* xfer_blocks.c: both sides. */
void kvf__xblocks_free(kvf__xblocks *b);
/* Checks a request's blocks against its layout: the view of its layers in
 * *v, KVF_ERANGE (err says which) for layers or ids outside it. */
int kvf__xblocks_view(const kvf__blockreq *b, kvf__lview *v, char *err, size_t errlen);
/* Our side's blocks: the layout held, the ids taken from b. */
void kvf__xblocks_take(kvf__xblocks *mine, const kvf__blockreq *b, const kvf__lview *v);
/* A grant of blocks on the wire: the receiver's view of the granted layers
 * and its ids, in *buf (freed by the caller). */
int kvf__xblocks_to_grant(kvf__xfer *x, Kvf__Grant *g, Kvf__Layout *lw, uint8_t **buf);
/* A Grant's blocks into *gb (owned); KVF_EPROTO when they do not decode,
 * KVF_ELIMIT past our max-descs. */
int kvf__xblocks_from_grant(const Kvf__Grant *g, kvf__xblocks *gb);

/* Receiver: the receive is complete; the layers not reported yet landed. */
void kvf__xrecv_flush_layers(kvf__xfer *x);

/* Sender. */
bool kvf__xsend_grant_is_blocks(const kvf__xfer *x);
/* A new send of blocks takes b (its first part). */
int kvf__xsend_blocks_begin(kvf__xfer *x, const kvf__blockreq *b);
/* A later part: same layout and blocks, layers no earlier part named. */
int kvf__xsend_part_check(const kvf__xfer *x, const kvf__blockreq *b, const kvf__lview *v, char *err,
                          size_t errlen);
/* Takes a checked part of layers v: queued until the grant is known, posted
 * after. An error takes nothing. */
int kvf__xsend_part_take(kvf__xfer *x, const kvf__lview *v, bool last);
/* The grant is known: check that the blocks fit, post the early parts. */
void kvf__xsend_blocks_start(kvf__xfer *x);
/* Owed layer events, once none of the parts posted is out. */
void kvf__xsend_announce_layers(kvf__xfer *x);

#endif
