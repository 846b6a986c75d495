/* xfer_trace.h - where a transfer's time went: a timeline per transfer
 * (CLOCK_MONOTONIC stamps, one clock_gettime each), the last TRACE_RING
 * finished ones for `kvferryctl transfers --trace`, and one histogram per
 * hop in the metrics.
 *
 * Each daemon records its own side. The hops, for both roles:
 *   post_to_pair   the request read (a send's first part, or the grant) to
 *                  the pairing: a sender learns its grant; a receiver binds
 *                  its grant to a sender (pushed ahead, or met an intent)
 *   pair_to_first  to the first byte: handed to the wire by a transport
 *                  thread (sender), read off it (receiver)
 *   first_to_last  to the last byte: written (sender), landed (receiver)
 *   last_to_event  to the completion event queued to the client: a sender
 *                  waits there for the receiver's result, a receiver for the
 *                  sender's SendDone and the landing's trip to the loop
 *   total          post to event (the sum of the four)
 * plus "result": when the other side's word came (sender: RecvResult;
 * receiver: SendDone), as an offset from post. A stamp a transport does not
 * give (or a transfer that never got there) takes the one before it, so
 * stamps stay monotone and the hops sum to the total. Loop thread, except
 * that transports take their stamps on their threads (kvf__now_ns) and
 * hand them over on the loop. */
#ifndef KVF_XFER_TRACE_H
#define KVF_XFER_TRACE_H

#include "sbuf.h"
#include "xfer.h"

/* Sets stamp `which` of x to ns (0: now). FIRST keeps the earliest, LAST
 * the latest, the others the first one set. */
void kvf__xtrace_stamp(kvf__xfer *x, int which, uint64_t ns);
/* A part of send x came (the first too); more follow unless last, and
 * next_last says the next one should be the last (its layers are all that
 * is left). Stamps it (the last part's arrival: "last_part_to_event" in
 * the trace) and tells spin.h its cadence; before a local receiver's last
 * part, the window that opens ahead of it tells that receiver's engine
 * Soon (its threads poll while the part comes and is copied). */
void kvf__xtrace_part(kvf__xfer *x, bool last, bool next_last);
/* A local receive: its bytes moved when its sender's did. */
void kvf__xtrace_twin(kvf__xfer *recv, const kvf__xfer *send);
/* x ended with status (its event was queued, or it failed): its timeline
 * goes into the ring, and, when it succeeded, into the histograms. */
void kvf__xtrace_finish(const kvf__xfer *x, int status);
/* The ring, oldest first: a table or {"transfers": [...]}. */
void kvf__xtrace_render(kvf__sbuf *b, int json);
/* The kvferry_transfer_hop_seconds families (metrics.c). */
void kvf__xtrace_metrics(kvf__sbuf *b);
/* Drops the ring and the histograms (daemon stop, tests). */
void kvf__xtrace_reset(void);

#endif
