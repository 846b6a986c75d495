/* test_frame.c - length-prefixed frames and fd passing (proto/frame.c):
 * the frame accumulator at every split point, the size limit, the header
 * helpers, and sendmsg/recvmsg with SCM_RIGHTS over a socketpair. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "frame.h"

/* ---- helpers ------------------------------------------------------------ */

/* Appends one frame (header + payload) to buf at *len. */
static void put_frame(uint8_t *buf, size_t *len, const void *payload, uint32_t n) {
  kvf__frame_put_header(buf + *len, n);
  if (n) memcpy(buf + *len + KVF__FRAME_HDR, payload, n);
  *len += KVF__FRAME_HDR + n;
}

static void fill(uint8_t *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(seed * 131 + i * 7 + (i >> 8));
}

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  assert_non_null(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n; /* includes the DIR's own fd, consistently */
}

static ino_t ino_of(int fd) {
  struct stat st;
  assert_int_equal(fstat(fd, &st), 0);
  return st.st_ino;
}

static int tmpfile_fd(void) {
  char path[] = "/tmp/kvf-test-frame-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  unlink(path);
  return fd;
}

/* sendmsg with n fds in one SCM_RIGHTS message (kvf__send_all sends one). */
static void send_fds(int sock, const void *buf, size_t len, const int *fds, int n) {
  struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
  union {
    char buf[CMSG_SPACE(sizeof(int) * 16)];
    struct cmsghdr align;
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n)};
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
  memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)n);
  assert_int_equal(sendmsg(sock, &msg, 0), (ssize_t)len);
}

/* ---- header ------------------------------------------------------------ */

static void test_header(void **state) {
  uint8_t h[KVF__FRAME_HDR];
  kvf__frame_put_header(h, 0x01020304u);
  assert_int_equal(h[0], 0x04); /* little-endian */
  assert_int_equal(h[1], 0x03);
  assert_int_equal(h[2], 0x02);
  assert_int_equal(h[3], 0x01);
  assert_int_equal(kvf__frame_get_u32(h), 0x01020304u);
  const uint32_t vals[] = {0, 1, 255, 256, 65535, 65536, 0x7fffffffu, 0x80000000u, 0xffffffffu};
  for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
    kvf__frame_put_header(h, vals[i]);
    assert_int_equal(kvf__frame_get_u32(h), vals[i]);
  }
  kvf__frame_put_header(h, 0xffffffffu);
  assert_int_equal(h[0] & h[1] & h[2] & h[3], 0xff);
}

/* ---- framebuf ------------------------------------------------------------ */

static void test_init_default(void **state) {
  kvf__framebuf fb;
  kvf__framebuf_init(&fb, 0);
  assert_int_equal(fb.max, KVF__FRAME_MAX_DEFAULT);
  assert_int_equal(fb.len, 0);
  const uint8_t *p;
  uint32_t n;
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 0); /* empty: needs more */
  kvf__framebuf_free(&fb);
  kvf__framebuf_init(&fb, 1234);
  assert_int_equal(fb.max, 1234);
  kvf__framebuf_free(&fb);
}

static void test_whole_frame(void **state) {
  uint8_t payload[300], buf[400];
  size_t len = 0;
  fill(payload, sizeof payload, 1);
  put_frame(buf, &len, payload, sizeof payload);
  kvf__framebuf fb;
  kvf__framebuf_init(&fb, 1024);
  assert_int_equal(kvf__framebuf_append(&fb, buf, len), 0);
  const uint8_t *p;
  uint32_t n;
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 1);
  assert_int_equal(n, sizeof payload);
  assert_memory_equal(p, payload, sizeof payload);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 0); /* consumed */
  kvf__framebuf_free(&fb);
}

static void test_zero_length(void **state) {
  uint8_t buf[16];
  size_t len = 0;
  put_frame(buf, &len, NULL, 0);
  put_frame(buf, &len, "x", 1);
  kvf__framebuf fb;
  kvf__framebuf_init(&fb, 16);
  assert_int_equal(kvf__framebuf_append(&fb, buf, 4), 0);
  const uint8_t *p = NULL;
  uint32_t n = 99;
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 1);
  assert_int_equal(n, 0);
  assert_non_null(p);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 0);
  assert_int_equal(kvf__framebuf_append(&fb, buf + 4, len - 4), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 1);
  assert_int_equal(n, 1);
  assert_int_equal(p[0], 'x');
  kvf__framebuf_free(&fb);
}

/* Three frames (one empty) fed in two chunks split at every byte. */
static void test_split_everywhere(void **state) {
  uint8_t a[37], c[200], buf[512];
  fill(a, sizeof a, 2);
  fill(c, sizeof c, 3);
  size_t len = 0;
  put_frame(buf, &len, a, sizeof a);
  put_frame(buf, &len, NULL, 0);
  put_frame(buf, &len, c, sizeof c);
  for (size_t cut = 0; cut <= len; cut++) {
    kvf__framebuf fb;
    kvf__framebuf_init(&fb, 256);
    const uint8_t *p;
    uint32_t n;
    size_t got = 0;
    const size_t sizes[] = {sizeof a, 0, sizeof c};
    const uint8_t *want[] = {a, NULL, c};
    size_t pieces[2][2] = {{0, cut}, {cut, len}};
    for (int k = 0; k < 2; k++) {
      size_t piece = pieces[k][1] - pieces[k][0];
      /* Empty appends have their own test (test_append_empty). */
      if (piece) assert_int_equal(kvf__framebuf_append(&fb, buf + pieces[k][0], piece), 0);
      int rc;
      while ((rc = kvf__framebuf_next(&fb, &p, &n)) == 1) {
        assert_true(got < 3);
        assert_int_equal(n, sizes[got]);
        if (n) assert_memory_equal(p, want[got], n);
        got++;
      }
      assert_int_equal(rc, 0);
    }
    if (got != 3) fail_msg("cut at %zu: %zu frames", cut, got);
    kvf__framebuf_free(&fb);
  }
}

/* One byte at a time, through space/commit (the read path). */
static void test_byte_at_a_time(void **state) {
  uint8_t a[100], buf[256];
  fill(a, sizeof a, 4);
  size_t len = 0;
  put_frame(buf, &len, a, sizeof a);
  put_frame(buf, &len, a, 10);
  kvf__framebuf fb;
  kvf__framebuf_init(&fb, 100);
  const uint8_t *p;
  uint32_t n;
  int frames = 0;
  for (size_t i = 0; i < len; i++) {
    uint8_t *dst;
    size_t avail;
    assert_int_equal(kvf__framebuf_space(&fb, 1, &dst, &avail), 0);
    assert_true(avail >= 1);
    *dst = buf[i];
    kvf__framebuf_commit(&fb, 1);
    int rc = kvf__framebuf_next(&fb, &p, &n);
    if (i == KVF__FRAME_HDR + sizeof a - 1) {
      assert_int_equal(rc, 1);
      assert_int_equal(n, sizeof a);
      assert_memory_equal(p, a, sizeof a);
      frames++;
    } else if (i == len - 1) {
      assert_int_equal(rc, 1);
      assert_int_equal(n, 10);
      assert_memory_equal(p, a, 10);
      frames++;
    } else {
      assert_int_equal(rc, 0);
    }
  }
  assert_int_equal(frames, 2);
  kvf__framebuf_free(&fb);
}

static void test_several_in_one_chunk(void **state) {
  enum { K = 50 };
  uint8_t *buf = malloc(K * (KVF__FRAME_HDR + 64));
  uint8_t payload[64];
  size_t len = 0;
  assert_non_null(buf);
  for (unsigned i = 0; i < K; i++) {
    fill(payload, i + 1, i);
    put_frame(buf, &len, payload, i + 1);
  }
  /* Plus half a header of the next frame. */
  uint8_t hdr[KVF__FRAME_HDR];
  kvf__frame_put_header(hdr, 5);
  kvf__framebuf fb;
  kvf__framebuf_init(&fb, 64);
  assert_int_equal(kvf__framebuf_append(&fb, buf, len), 0);
  assert_int_equal(kvf__framebuf_append(&fb, hdr, 2), 0);
  const uint8_t *p;
  uint32_t n;
  for (unsigned i = 0; i < K; i++) {
    assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 1);
    assert_int_equal(n, i + 1);
    fill(payload, i + 1, i);
    assert_memory_equal(p, payload, n);
  }
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 0);
  assert_int_equal(kvf__framebuf_append(&fb, hdr + 2, 2), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 0);
  assert_int_equal(kvf__framebuf_append(&fb, "hello", 5), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 1);
  assert_int_equal(n, 5);
  assert_memory_equal(p, "hello", 5);
  /* Consumed data is compacted away: the buffer did not keep growing. */
  assert_true(fb.cap <= 2 * len + 4096);
  kvf__framebuf_free(&fb);
  free(buf);
}

static void test_max_size(void **state) {
  enum { MAX = 4096 };
  uint8_t *buf = malloc(MAX + 2 * KVF__FRAME_HDR + 1);
  uint8_t *payload = malloc(MAX + 1);
  assert_non_null(buf);
  assert_non_null(payload);
  fill(payload, MAX + 1, 9);
  kvf__framebuf fb;
  const uint8_t *p;
  uint32_t n;

  /* Exactly max: accepted. */
  size_t len = 0;
  put_frame(buf, &len, payload, MAX);
  kvf__framebuf_init(&fb, MAX);
  assert_int_equal(kvf__framebuf_append(&fb, buf, len), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 1);
  assert_int_equal(n, MAX);
  assert_memory_equal(p, payload, MAX);
  kvf__framebuf_free(&fb);

  /* max + 1: refused as soon as the header is in, before the payload. */
  kvf__framebuf_init(&fb, MAX);
  uint8_t hdr[KVF__FRAME_HDR];
  kvf__frame_put_header(hdr, MAX + 1);
  assert_int_equal(kvf__framebuf_append(&fb, hdr, 3), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 0);
  assert_int_equal(kvf__framebuf_append(&fb, hdr + 3, 1), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), -EMSGSIZE);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), -EMSGSIZE); /* and stays refused */
  kvf__framebuf_free(&fb);

  /* A huge announced length is refused without waiting for or allocating it. */
  kvf__framebuf_init(&fb, 0);
  kvf__frame_put_header(hdr, 0xffffffffu);
  assert_int_equal(kvf__framebuf_append(&fb, hdr, 4), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), -EMSGSIZE);
  kvf__framebuf_free(&fb);
  kvf__framebuf_init(&fb, 0);
  kvf__frame_put_header(hdr, KVF__FRAME_MAX_DEFAULT + 1);
  assert_int_equal(kvf__framebuf_append(&fb, hdr, 4), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), -EMSGSIZE);
  kvf__framebuf_free(&fb);

  /* A good frame ahead of an oversize one is still delivered. */
  len = 0;
  put_frame(buf, &len, payload, 10);
  kvf__frame_put_header(buf + len, MAX + 1);
  len += KVF__FRAME_HDR;
  kvf__framebuf_init(&fb, MAX);
  assert_int_equal(kvf__framebuf_append(&fb, buf, len), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 1);
  assert_int_equal(n, 10);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), -EMSGSIZE);
  kvf__framebuf_free(&fb);
  free(buf);
  free(payload);
}

/* The payload pointer stays valid until the next call on fb. */
static void test_payload_stable(void **state) {
  uint8_t a[1000], buf[2048];
  fill(a, sizeof a, 5);
  size_t len = 0;
  put_frame(buf, &len, a, sizeof a);
  kvf__framebuf fb;
  kvf__framebuf_init(&fb, 4096);
  assert_int_equal(kvf__framebuf_append(&fb, buf, len), 0);
  const uint8_t *p;
  uint32_t n;
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 1);
  assert_memory_equal(p, a, n);
  /* After next, the frame's bytes are still in place (not compacted yet). */
  assert_memory_equal(p, a, sizeof a);
  kvf__framebuf_free(&fb);
}

/* ---- send_all / recv_fds --------------------------------------------------- */

static void test_send_recv_no_fd(void **state) {
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  assert_int_equal(kvf__send_all(sv[0], "abcdef", 6, -1), 0);
  char buf[16];
  int fds[4] = {-1, -1, -1, -1}, nfds = 0;
  long n = kvf__recv_fds(sv[1], buf, sizeof buf, fds, &nfds, 4);
  assert_int_equal(n, 6);
  assert_memory_equal(buf, "abcdef", 6);
  assert_int_equal(nfds, 0);
  assert_int_equal(fds[0], -1);
  /* EOF */
  close(sv[0]);
  assert_int_equal(kvf__recv_fds(sv[1], buf, sizeof buf, fds, &nfds, 4), 0);
  close(sv[1]);
}

static void test_send_recv_fd(void **state) {
  int before = count_fds();
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  int f = tmpfile_fd();
  assert_int_equal(write(f, "data", 4), 4);
  assert_int_equal(kvf__send_all(sv[0], "M", 1, f), 0);
  char buf[8];
  int fds[4] = {-1, -1, -1, -1}, nfds = 0;
  long n = kvf__recv_fds(sv[1], buf, sizeof buf, fds, &nfds, 4);
  assert_int_equal(n, 1);
  assert_int_equal(buf[0], 'M');
  assert_int_equal(nfds, 1);
  assert_true(fds[0] >= 0);
  assert_int_not_equal(fds[0], f);
  assert_int_equal(ino_of(fds[0]), ino_of(f)); /* the same file */
  /* Received with close-on-exec. */
  assert_true(fcntl(fds[0], F_GETFD) & FD_CLOEXEC);
  /* Same open file description: shared offset. */
  assert_int_equal(lseek(fds[0], 0, SEEK_CUR), 4);
  close(fds[0]);
  close(f);
  close(sv[0]);
  close(sv[1]);
  assert_int_equal(count_fds(), before);
}

/* A fd appended after ones already held (fds is appended to). */
static void test_recv_fds_appends(void **state) {
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  int f = tmpfile_fd();
  int fds[4] = {1234, -1, -1, -1}, nfds = 1;
  assert_int_equal(kvf__send_all(sv[0], "x", 1, f), 0);
  char c;
  assert_int_equal(kvf__recv_fds(sv[1], &c, 1, fds, &nfds, 4), 1);
  assert_int_equal(nfds, 2);
  assert_int_equal(fds[0], 1234);
  assert_int_equal(ino_of(fds[1]), ino_of(f));
  close(fds[1]);
  close(f);
  close(sv[0]);
  close(sv[1]);
}

static void test_fds_beyond_cap_closed(void **state) {
  int before = count_fds();
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  int f[3] = {tmpfile_fd(), tmpfile_fd(), tmpfile_fd()};
  send_fds(sv[0], "abc", 3, f, 3);
  int fds[4] = {-1, -1, -1, -1}, nfds = 0;
  char buf[8];
  int mid = count_fds(); /* before receiving */
  assert_int_equal(kvf__recv_fds(sv[1], buf, sizeof buf, fds, &nfds, 1), 3);
  assert_int_equal(nfds, 1);
  assert_int_equal(ino_of(fds[0]), ino_of(f[0]));
  assert_int_equal(fds[1], -1);
  /* Only the kept one is new: the other two were closed. */
  assert_int_equal(count_fds(), mid + 1);
  close(fds[0]);

  /* Cap 0: nothing kept, nothing leaked. */
  send_fds(sv[0], "d", 1, f, 2);
  nfds = 0;
  assert_int_equal(kvf__recv_fds(sv[1], buf, sizeof buf, fds, &nfds, 0), 1);
  assert_int_equal(nfds, 0);
  assert_int_equal(count_fds(), mid);

  /* More than the control buffer takes (KVF__FRAME_MAX_FDS): the kernel
   * drops what does not fit; still no leak. */
  int many[8];
  for (int i = 0; i < 8; i++) many[i] = f[i % 3];
  send_fds(sv[0], "e", 1, many, 8);
  nfds = 0;
  assert_int_equal(kvf__recv_fds(sv[1], buf, sizeof buf, fds, &nfds, 4), 1);
  assert_true(nfds <= KVF__FRAME_MAX_FDS);
  assert_int_equal(count_fds(), mid + nfds);
  for (int i = 0; i < nfds; i++) close(fds[i]);

  for (int i = 0; i < 3; i++) close(f[i]);
  close(sv[0]);
  close(sv[1]);
  assert_int_equal(count_fds(), before);
}

/* A payload larger than the socket buffer: partial writes are continued, the
 * fd rides once with the first bytes. */
typedef struct reader_arg {
  int sock;
  size_t want;
  uint8_t *got;
  int fds[8];
  int nfds;
  int calls_with_fd;
} reader_arg;

static void *reader(void *arg) {
  reader_arg *r = arg;
  size_t off = 0;
  while (off < r->want) {
    int before = r->nfds;
    long n = kvf__recv_fds(r->sock, r->got + off, r->want - off, r->fds, &r->nfds, 8);
    if (n <= 0) break;
    if (r->nfds > before) r->calls_with_fd++;
    off += (size_t)n;
  }
  r->want = off;
  return NULL;
}

static void test_send_all_large(void **state) {
  const size_t len = 8u << 20;
  uint8_t *src = malloc(len);
  assert_non_null(src);
  fill(src, len, 11);
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  int sz = 4096;
  setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  reader_arg r = {.sock = sv[1], .want = len, .got = malloc(len)};
  assert_non_null(r.got);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, reader, &r), 0);
  int f = tmpfile_fd();
  assert_int_equal(kvf__send_all(sv[0], src, len, f), 0);
  pthread_join(th, NULL);
  assert_int_equal(r.want, len);
  assert_memory_equal(r.got, src, len);
  assert_int_equal(r.nfds, 1);
  assert_int_equal(r.calls_with_fd, 1);
  assert_int_equal(ino_of(r.fds[0]), ino_of(f));
  close(r.fds[0]);
  close(f);
  close(sv[0]);
  close(sv[1]);
  free(src);
  free(r.got);
}

static void test_send_errors(void **state) {
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  close(sv[1]);
  /* MSG_NOSIGNAL: EPIPE comes back as a value, no SIGPIPE. */
  assert_int_equal(kvf__send_all(sv[0], "x", 1, -1), -EPIPE);
  close(sv[0]);
  assert_int_equal(kvf__send_all(sv[0], "x", 1, -1), -EBADF);
  char c;
  int fds[1], nfds = 0;
  assert_int_equal(kvf__recv_fds(sv[0], &c, 1, fds, &nfds, 1), -EBADF);
  /* Zero bytes: nothing to send, success. */
  assert_int_equal(kvf__send_all(-1, "", 0, -1), 0);
}

/* Appending nothing is a no-op, also on a buffer that never allocated.
 *
 * DAEMON BUG (reported to the lead, not fixed here): kvf__framebuf_append
 * (proto/frame.c:46-53) with n == 0 on a fresh framebuf gets dst == NULL
 * from kvf__framebuf_space (nothing allocated, fb->data + 0) and calls
 * memcpy(NULL, p, 0), which is undefined behaviour; the UBSan build
 * (make SAN=1) aborts here with "null pointer passed as argument 1". Kept
 * last in the list so that the other tests run before the abort. */
/* What a transfer id may hold: well-formed UTF-8 only (issue 15, item 6). */
static void test_utf8(void **state) {
  static const char *const good[] = {"req-42", "caf\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\xef\xbf\xbf",
                                     "\xf4\x8f\xbf\xbf", ""};
  static const char *const bad[] = {
      "\xff",             /* never a lead byte */
      "\xc0\x80",         /* overlong NUL */
      "\xe0\x80\xaf",     /* overlong '/' */
      "\xed\xa0\x80",     /* a surrogate */
      "\xf4\x90\x80\x80", /* past U+10FFFF */
      "\xe2\x82",         /* cut short */
      "a\x80" "b",        /* a lone continuation */
      "\xc3\x28",         /* a lead without its continuation */
  };
  for (size_t i = 0; i < sizeof(good) / sizeof(*good); i++) assert_true(kvf__utf8_valid(good[i], strlen(good[i])));
  for (size_t i = 0; i < sizeof(bad) / sizeof(*bad); i++) assert_false(kvf__utf8_valid(bad[i], strlen(bad[i])));
}

static void test_append_empty(void **state) {
  kvf__framebuf fb;
  kvf__framebuf_init(&fb, 16);
  assert_int_equal(kvf__framebuf_append(&fb, "", 0), 0);
  const uint8_t *p;
  uint32_t n;
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 0);
  uint8_t buf[8];
  size_t len = 0;
  put_frame(buf, &len, "ab", 2);
  assert_int_equal(kvf__framebuf_append(&fb, buf, len), 0);
  assert_int_equal(kvf__framebuf_append(&fb, buf, 0), 0);
  assert_int_equal(kvf__framebuf_next(&fb, &p, &n), 1);
  assert_int_equal(n, 2);
  assert_memory_equal(p, "ab", 2);
  kvf__framebuf_free(&fb);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_header),
      cmocka_unit_test(test_utf8),
      cmocka_unit_test(test_init_default),
      cmocka_unit_test(test_whole_frame),
      cmocka_unit_test(test_zero_length),
      cmocka_unit_test(test_split_everywhere),
      cmocka_unit_test(test_byte_at_a_time),
      cmocka_unit_test(test_several_in_one_chunk),
      cmocka_unit_test(test_max_size),
      cmocka_unit_test(test_payload_stable),
      cmocka_unit_test(test_send_recv_no_fd),
      cmocka_unit_test(test_send_recv_fd),
      cmocka_unit_test(test_recv_fds_appends),
      cmocka_unit_test(test_fds_beyond_cap_closed),
      cmocka_unit_test(test_send_all_large),
      cmocka_unit_test(test_send_errors),
      cmocka_unit_test(test_append_empty), /* last: see its comment */
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
