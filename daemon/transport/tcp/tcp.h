/* tcp.h - the tcp transport (tcp.c): one-sided writes over plain TCP. What
 * the rest of the daemon needs of it beyond the transport interface. */
#ifndef KVF_TCP_H
#define KVF_TCP_H

#include "transport/transport.h"

int kvf__tcp_create(uv_loop_t *loop, unsigned slot, kvf__transport **out, char *err, size_t errlen);
/* A peer connection that opened with DataHello becomes a data stream of t
 * (peer.c hands it over; fd is ours from then on, also on error). */
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

#endif
