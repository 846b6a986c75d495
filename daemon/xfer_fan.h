/* xfer_fan.h - fan-in and fan-out between engines of other tensor
 * parallelism, as transfers of one KV head each.
 *
 * A layout that states model_kv_heads (and K and V: MLA's latent is
 * replicated and never fans) holds heads [first_head, first_head +
 * kv_heads) of the model's. A grant or send of blocks of such a layout
 * with id X is a fan: one sub-transfer per head h it holds, named
 * "X#h<h>", each moving head h alone (kv_xform.h restricted to it), paired
 * one to one by the daemons as any transfer is. So a grant of heads 0-1
 * (decode TP 4, rank 0) takes head 0 from prefill TP 8's rank 0 and head 1
 * from its rank 1, wherever they run (fan-in); a send of heads 0-3
 * (prefill TP 2) feeds grants of heads 0, 1, 2, 3 (fan-out): its dst_node
 * may name several nodes, comma-separated, that take its heads in order,
 * in equal shares ("d0,d1,d2,d3": head 0 to d0, ...). Both sides of a
 * transfer state model_kv_heads, or neither.
 *
 * The client sees one transfer: the fan reports RECV_DONE (SEND_DONE) once
 * every sub-transfer ended, with their bytes summed; a failure names the
 * heads that did not land ("heads 1 missing: ..."), e.g. at the deadline
 * when a source never sent. Layer events come per layer once every head's
 * sub-grant has it. Cancelling X cancels every head. The first sub-grant
 * holds the granted blocks against other grants (grant_index); each
 * sub-transfer counts against the client's transfer quota. */
#ifndef KVF_XFER_FAN_H
#define KVF_XFER_FAN_H

#include <stdbool.h>
#include <stddef.h>

#include "kvferry.pb-c.h"
#include "xfer.h"

/* The API's grant, send and cancel of blocks: a fan when the layout says
 * so, else kvf__xfer_grant_blocks / kvf__xfer_send_blocks / _cancel. */
int kvf__xfan_grant_blocks(kvf__session *s, const char *id, const char *src_node, const kvf__blockreq *b,
                           uint32_t deadline_ms, char *err, size_t errlen);
int kvf__xfan_send_blocks(kvf__session *s, const char *id, const char *dst_node, const kvf__blockreq *b,
                          bool more, uint32_t deadline_ms, char *err, size_t errlen);
int kvf__xfan_cancel(kvf__session *s, const char *id);
/* kvf__xfer_sending, for a fan's id too. */
/* Fails a send (every head of a fan's) whose later part was refused. */
void kvf__xfan_withdraw_send(kvf__session *s, const char *id, int status, const char *why);
bool kvf__xfan_sending(kvf__session *s, const char *id);
/* The session is gone: its fans go (kvf__xfer_session_gone first). */
void kvf__xfan_session_gone(kvf__session *s);
/* An event of s's: true when it is a fan's sub-transfer's, taken here
 * (xfer.c's kvf__xfer_emit asks before it reports). */
bool kvf__xfan_event(kvf__session *s, const Kvf__Event *ev);

#endif
