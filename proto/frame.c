/* frame.c - length-prefixed frames and fd passing (see frame.h). */
#include "frame.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

void kvf__framebuf_init(kvf__framebuf *fb, uint32_t max_payload) {
  memset(fb, 0, sizeof(*fb));
  fb->max = max_payload ? max_payload : KVF__FRAME_MAX_DEFAULT;
}

void kvf__framebuf_free(kvf__framebuf *fb) {
  free(fb->data);
  memset(fb, 0, sizeof(*fb));
}

/* Moves the unconsumed tail to the front so that the buffer never grows
 * beyond one maximal frame plus a read's worth. */
static void compact(kvf__framebuf *fb) {
  if (fb->off == 0) return;
  memmove(fb->data, fb->data + fb->off, fb->len - fb->off);
  fb->len -= fb->off;
  fb->off = 0;
}

int kvf__framebuf_space(kvf__framebuf *fb, size_t want, uint8_t **p, size_t *avail) {
  compact(fb);
  if (fb->cap - fb->len < want) {
    size_t ncap = fb->cap ? fb->cap : 4096;
    while (ncap - fb->len < want) ncap *= 2;
    uint8_t *nd = realloc(fb->data, ncap);
    if (!nd) return -ENOMEM;
    fb->data = nd;
    fb->cap = ncap;
  }
  *p = fb->data + fb->len;
  *avail = fb->cap - fb->len;
  return 0;
}

void kvf__framebuf_commit(kvf__framebuf *fb, size_t n) { fb->len += n; }

int kvf__framebuf_append(kvf__framebuf *fb, const void *p, size_t n) {
  if (n == 0) return 0;
  uint8_t *dst;
  size_t avail;
  int rc = kvf__framebuf_space(fb, n, &dst, &avail);
  if (rc) return rc;
  memcpy(dst, p, n);
  kvf__framebuf_commit(fb, n);
  return 0;
}

uint32_t kvf__frame_get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

void kvf__frame_put_header(uint8_t hdr[KVF__FRAME_HDR], uint32_t len) {
  hdr[0] = (uint8_t)len;
  hdr[1] = (uint8_t)(len >> 8);
  hdr[2] = (uint8_t)(len >> 16);
  hdr[3] = (uint8_t)(len >> 24);
}

int kvf__framebuf_next(kvf__framebuf *fb, const uint8_t **payload, uint32_t *len) {
  size_t held = fb->len - fb->off;
  if (held < KVF__FRAME_HDR) return 0;
  uint32_t n = kvf__frame_get_u32(fb->data + fb->off);
  if (n > fb->max) return -EMSGSIZE;
  if (held < KVF__FRAME_HDR + (size_t)n) return 0;
  *payload = fb->data + fb->off + KVF__FRAME_HDR;
  *len = n;
  fb->off += KVF__FRAME_HDR + n;
  return 1;
}

int kvf__send_all(int sock, const void *buf, size_t len, int fd) {
  const char *p = buf;
  while (len > 0) {
    struct iovec iov = {.iov_base = (void *)p, .iov_len = len};
    union {
      char buf[CMSG_SPACE(sizeof(int))];
      struct cmsghdr align;
    } ctl;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
      memset(&ctl, 0, sizeof(ctl));
      msg.msg_control = ctl.buf;
      msg.msg_controllen = sizeof(ctl.buf);
      struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    fd = -1; /* the fd rides with the first byte only */
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

long kvf__recv_fds(int sock, void *buf, size_t len, int *fds, int *nfds, int nfds_cap) {
  struct iovec iov = {.iov_base = buf, .iov_len = len};
  union {
    char buf[CMSG_SPACE(sizeof(int) * KVF__FRAME_MAX_FDS)];
    struct cmsghdr align;
  } ctl;
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1,
                       .msg_control = ctl.buf, .msg_controllen = sizeof(ctl.buf)};
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -errno;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int f;
      memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (*nfds < nfds_cap) fds[(*nfds)++] = f;
      else close(f); /* more than we asked for: never leak it */
    }
  }
  return n;
}

/* The length of the sequence that lead byte c begins, and the smallest
 * code point it may encode (shorter forms are overlong); 0: not a lead. */
static int utf8_lead(unsigned char c, uint32_t *min, uint32_t *cp) {
  if (c < 0x80) return *cp = c, *min = 0, 1;
  if (c >= 0xC2 && c <= 0xDF) return *cp = c & 0x1F, *min = 0x80, 2;
  if (c >= 0xE0 && c <= 0xEF) return *cp = c & 0x0F, *min = 0x800, 3;
  if (c >= 0xF0 && c <= 0xF4) return *cp = c & 0x07, *min = 0x10000, 4;
  return 0;
}

int kvf__utf8_valid(const char *s, size_t n) {
  const unsigned char *p = (const unsigned char *)s;
  for (size_t i = 0; i < n;) {
    uint32_t min, cp;
    int len = utf8_lead(p[i], &min, &cp);
    if (len == 0 || (size_t)len > n - i) return 0;
    for (int k = 1; k < len; k++) {
      if ((p[i + k] & 0xC0) != 0x80) return 0;
      cp = cp << 6 | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    i += (size_t)len;
  }
  return 1;
}

int kvf__xfer_id_chars_valid(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) return 0;
  return kvf__utf8_valid(s, n);
}
