/* frame.h - the framing shared by the local API and the peer protocol:
 * u32 little-endian length, then that many bytes of one packed protobuf
 * message. The maximum is enforced before anything is unpacked. */
#ifndef KVF_FRAME_H
#define KVF_FRAME_H

#include <stddef.h>
#include <endian.h>
#include <stdint.h>
#include <string.h>

#define KVF__FRAME_HDR 4u
#define KVF__FRAME_MAX_DEFAULT (64u << 20)
#define KVF__FRAME_MAX_FDS 4

/* Accumulates stream bytes and yields whole frames. */
typedef struct kvf__framebuf {
  uint8_t *data;
  size_t len;       /* bytes held */
  size_t off;       /* start of the first unconsumed frame */
  size_t cap;
  uint32_t max;     /* largest payload accepted */
} kvf__framebuf;

void kvf__framebuf_init(kvf__framebuf *fb, uint32_t max_payload);
void kvf__framebuf_free(kvf__framebuf *fb);
/* Returns a writable region of at least want bytes at the end (for reads
 * straight into the buffer); commit what was written. */
int kvf__framebuf_space(kvf__framebuf *fb, size_t want, uint8_t **p, size_t *avail);
void kvf__framebuf_commit(kvf__framebuf *fb, size_t n);
int kvf__framebuf_append(kvf__framebuf *fb, const void *p, size_t n);
/* 1 and the payload when a whole frame is held, 0 when more bytes are
 * needed, -EMSGSIZE when the announced length exceeds the maximum. The
 * payload stays valid until the next call on fb. */
int kvf__framebuf_next(kvf__framebuf *fb, const uint8_t **payload, uint32_t *len);

/* Writes the 4-byte header for a payload of len bytes. */
void kvf__frame_put_header(uint8_t hdr[KVF__FRAME_HDR], uint32_t len);
uint32_t kvf__frame_get_u32(const uint8_t *p);

/* Little-endian fields of the wire's packed lists (descriptors, block ids,
 * layout offsets), without unaligned loads: a 20-byte descriptor record
 * puts every other one off an 8-byte boundary. */
static inline uint32_t kvf__le32_get(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return le32toh(v);
}
static inline uint64_t kvf__le64_get(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return le64toh(v);
}
static inline void kvf__le32_put(uint8_t *p, uint32_t v) {
  v = htole32(v);
  memcpy(p, &v, sizeof v);
}
static inline void kvf__le64_put(uint8_t *p, uint64_t v) {
  v = htole64(v);
  memcpy(p, &v, sizeof v);
}

/* sendmsg of the whole buffer with an optional fd (-1 for none), retrying on
 * EINTR and partial writes; blocking socket. */
int kvf__send_all(int sock, const void *buf, size_t len, int fd);

/* Whether s[0..n) is well-formed UTF-8 (no overlong forms, no surrogates,
 * nothing past U+10FFFF): what a protobuf string must hold, and what JSON
 * renderings of ids (status, kvferryctl, Python) can carry. */
int kvf__utf8_valid(const char *s, size_t n);
/* A transfer id's n bytes: UTF-8 without control characters (ids go into
 * JSON and logs); the caller checks the length. Daemon and library alike. */
int kvf__xfer_id_chars_valid(const char *s, size_t n);
/* recvmsg into buf; received fds are appended to fds (up to *nfds_cap),
 * *nfds counts them. Returns bytes read (0 at EOF) or a negative errno. */
long kvf__recv_fds(int sock, void *buf, size_t len, int *fds, int *nfds, int nfds_cap);

#endif
