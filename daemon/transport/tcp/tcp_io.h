/* tcp_io.h - blocking socket helpers of the tcp transport (tcp_io.c),
 * private to daemon/transport/tcp/. */
#ifndef KVF_TCP_IO_H
#define KVF_TCP_IO_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/uio.h>

#include "frame.h"
#include "peer.h"

/* The receiver's answer to a DataHello once a thread owns the stream. */
extern const uint8_t KVF__TCP_ACK[KVF__FRAME_HDR];

/* Writes iov[0..n) whole (IOV_MAX at a time; iov is consumed). With
 * faulted: payload whose memory faults goes out as zeros and *faulted says
 * so (the receiver's framing never sees the difference). */
int kvf__tcp_writev_all(int fd, struct iovec *iov, int n, bool *faulted);

/* The data stream's handshake, sender side: one small framed PeerMsg, the
 * cluster key's challenge answered (auth.h), the receiver's ACK awaited. */
int kvf__tcp_send_msg(int fd, const Kvf__PeerMsg *m);
int kvf__tcp_answer_challenge(int fd, kvf__peer *p, uint32_t index);
int kvf__tcp_await_ack(int fd);

#endif
