/* tcp_io.c - the tcp transport's blocking socket helpers (tcp_io.h): the
 * sender's writev that survives faulting source memory, the data stream's
 * handshake, and the receiver's pure check of a batch (tcp.h). */
#include "tcp_io.h"

#include <errno.h>
#include <limits.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "auth.h"
#include "peer.h"
#include "tcp.h"
#include "tcp_wire.h"

static int write_zeros(int fd, size_t len) {
  static const uint8_t zeros[64 << 10];
  while (len > 0) {
    ssize_t w = write(fd, zeros, len < sizeof(zeros) ? len : sizeof(zeros));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return -errno;
    len -= (size_t)w;
  }
  return 0;
}

/* The elements of iov one write at a time, what faults (EFAULT: nothing
 * of that write was taken) replaced by zeros. */
static int write_each(int fd, const struct iovec *iov, int n, bool *faulted) {
  for (int i = 0; i < n; i++) {
    const uint8_t *p = iov[i].iov_base;
    size_t len = iov[i].iov_len;
    while (len > 0) {
      ssize_t w = write(fd, p, len);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && errno == EFAULT) {
        *faulted = true;
        int rc = write_zeros(fd, len);
        if (rc) return rc;
        break;
      }
      if (w < 0) return -errno;
      p += w;
      len -= (size_t)w;
    }
  }
  return 0;
}

/* With faulted: payload that faults (pool memory gone: EFAULT, the whole
 * call refused, whichever element it was) goes out as zeros, and *faulted
 * says so; the receiver's framing never sees the difference. */
int kvf__tcp_writev_all(int fd, struct iovec *iov, int n, bool *faulted) {
  while (n > 0) {
    ssize_t w = writev(fd, iov, n < IOV_MAX ? n : IOV_MAX);
    if (w < 0 && errno == EFAULT && faulted) return write_each(fd, iov, n, faulted);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    while (n > 0 && (size_t)w >= iov->iov_len) {
      w -= (ssize_t)iov->iov_len;
      iov++;
      n--;
    }
    if (n > 0) {
      iov->iov_base = (uint8_t *)iov->iov_base + w;
      iov->iov_len -= (size_t)w;
    }
  }
  return 0;
}

/* The receiver acknowledges a DataHello once a thread owns the stream, so
 * no data byte is ever read by the loop's connection handler. */
const uint8_t KVF__TCP_ACK[KVF__FRAME_HDR] = {0, 0, 0, 0};

int kvf__tcp_await_ack(int fd) {
  uint8_t got[KVF__FRAME_HDR];
  size_t have = 0;
  while (have < sizeof(got)) {
    ssize_t r = recv(fd, got + have, sizeof(got) - have, 0);
    if (r == 0) return KVF_EPEERLOST;
    if (r < 0 && errno != EINTR) return -errno;
    if (r > 0) have += (size_t)r;
  }
  return memcmp(got, KVF__TCP_ACK, KVF__FRAME_HDR) == 0 ? 0 : KVF_EPROTO;
}

/* One small framed PeerMsg on a blocking socket. */
int kvf__tcp_send_msg(int fd, const Kvf__PeerMsg *m) {
  uint8_t buf[256];
  size_t n = kvf__peer_msg__get_packed_size(m);
  if (n + KVF__FRAME_HDR > sizeof(buf)) return KVF_EPROTO;
  kvf__frame_put_header(buf, (uint32_t)n);
  kvf__peer_msg__pack(m, buf + KVF__FRAME_HDR);
  return kvf__send_all(fd, buf, n + KVF__FRAME_HDR, -1);
}

static int recv_exact(int fd, uint8_t *buf, size_t len) {
  size_t have = 0;
  while (have < len) {
    ssize_t r = recv(fd, buf + have, len - have, 0);
    if (r == 0) return KVF_EPEERLOST;
    if (r < 0 && errno != EINTR) return -errno;
    if (r > 0) have += (size_t)r;
  }
  return 0;
}

/* Cluster key (auth.h): the receiver answers our DataHello with a nonce;
 * it adopts the stream only once our proof over that nonce checks out. */
int kvf__tcp_answer_challenge(int fd, kvf__peer *p, uint32_t index) {
  uint8_t buf[256], proof[KVF__AUTH_PROOF];
  int rc = recv_exact(fd, buf, KVF__FRAME_HDR);
  uint32_t n = rc ? 0 : kvf__frame_get_u32(buf);
  if (rc == 0 && (n == 0 || n > sizeof(buf))) rc = KVF_EPROTO; /* an ACK: the peer has no key */
  if (rc == 0) rc = recv_exact(fd, buf, n);
  if (rc) return rc;
  Kvf__PeerMsg *m = kvf__peer_msg__unpack(NULL, n, buf);
  if (!m || m->body_case != KVF__PEER_MSG__BODY_AUTH || m->auth->nonce.len != KVF__AUTH_NONCE) {
    if (m) kvf__peer_msg__free_unpacked(m, NULL);
    return KVF_EPROTO;
  }
  size_t klen;
  const uint8_t *key = kvf__auth_key(&klen);
  kvf__auth_data_proof(key, klen, m->auth->nonce.data, p->remote_session, index, p->cfg.name,
                       kvfd.cfg.node, proof);
  kvf__peer_msg__free_unpacked(m, NULL);
  Kvf__Auth a = KVF__AUTH__INIT;
  a.proof = (ProtobufCBinaryData){sizeof(proof), proof};
  Kvf__PeerMsg out = KVF__PEER_MSG__INIT;
  out.body_case = KVF__PEER_MSG__BODY_AUTH;
  out.auth = &a;
  return kvf__tcp_send_msg(fd, &out);
}

int kvf__tcp_batch_check(const uint8_t *buf, size_t len, const kvf__rangeset *rs, uint64_t *handle,
                         uint32_t *count, uint64_t *bytes, kvf__range *ents) {
  batch_hdr h;
  batch_ent e[BATCH_FRAMES];
  if (len < BHDR_LEN) return KVF_EPROTO;
  bhdr_decode(buf, &h);
  int rc = check_header(&h);
  if (rc == 0 && len - BHDR_LEN < (size_t)h.count * ENT_LEN) rc = KVF_EPROTO;
  if (rc == 0) rc = decode_entries(buf + BHDR_LEN, h.count, e, bytes);
  if (rc) return rc;
  *handle = h.handle;
  *count = h.count;
  for (uint32_t i = 0; ents && i < h.count; i++) /* end may wrap when outside */
    ents[i] = (kvf__range){.pool = e[i].pool, .start = e[i].offset, .end = e[i].offset + e[i].len};
  return first_outside(rs, e, h.count) < h.count ? KVF_EPERM : 0;
}

