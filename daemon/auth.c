/* auth.c - SHA-256, HMAC-SHA256, the proofs of auth.h and the daemon's
 * cluster key. Written from FIPS 180-4 and RFC 2104; checked against their
 * test vectors in tests/unit/test_auth.c. */
#include "auth.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------ SHA-256 */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static uint32_t rotr(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

static uint32_t be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* One 64-byte block into the state (FIPS 180-4, 6.2.2). */
static void sha256_block(uint32_t h[8], const uint8_t *blk) {
  uint32_t w[64];
  for (int t = 0; t < 16; t++) w[t] = be32(blk + 4 * t);
  for (int t = 16; t < 64; t++) {
    uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int t = 0; t < 64; t++) {
    uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
  h[4] += e;
  h[5] += f;
  h[6] += g;
  h[7] += k;
}

void kvf__sha256_init(kvf__sha256_ctx *s) {
  static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(s->h, h0, sizeof h0);
  s->bytes = 0;
  s->n = 0;
}

void kvf__sha256_update(kvf__sha256_ctx *s, const void *data, size_t len) {
  const uint8_t *p = data;
  s->bytes += len;
  while (len) {
    size_t take = 64 - s->n < len ? 64 - s->n : len;
    memcpy(s->buf + s->n, p, take);
    s->n += take;
    p += take;
    len -= take;
    if (s->n == 64) {
      sha256_block(s->h, s->buf);
      s->n = 0;
    }
  }
}

/* Padding (5.1.1): 0x80, zeros to 56 mod 64, the length in bits big-endian. */
void kvf__sha256_final(kvf__sha256_ctx *s, uint8_t out[KVF__SHA256_LEN]) {
  uint64_t bits = s->bytes * 8;
  uint8_t pad[72] = {0x80};
  size_t padlen = (s->n < 56 ? 56 : 120) - s->n;
  for (int i = 0; i < 8; i++) pad[padlen + i] = (uint8_t)(bits >> (56 - 8 * i));
  kvf__sha256_update(s, pad, padlen + 8);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (uint8_t)(s->h[i] >> 24);
    out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
    out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
    out[4 * i + 3] = (uint8_t)s->h[i];
  }
  explicit_bzero(s, sizeof *s);
}

void kvf__sha256(const void *data, size_t len, uint8_t out[KVF__SHA256_LEN]) {
  kvf__sha256_ctx s;
  kvf__sha256_init(&s);
  kvf__sha256_update(&s, data, len);
  kvf__sha256_final(&s, out);
}

/* ------------------------------------------------------------ HMAC */

/* RFC 2104: H((K ^ opad) || H((K ^ ipad) || m)), K hashed first when longer
 * than the block, then zero-padded to 64 bytes. */
void kvf__hmac_init(kvf__hmac_ctx *h, const uint8_t *key, size_t keylen) {
  uint8_t k[64] = {0}, pad[64];
  if (keylen > 64) kvf__sha256(key, keylen, k);
  else if (keylen) memcpy(k, key, keylen);
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
  kvf__sha256_init(&h->inner);
  kvf__sha256_update(&h->inner, pad, 64);
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
  kvf__sha256_init(&h->outer);
  kvf__sha256_update(&h->outer, pad, 64);
  explicit_bzero(k, sizeof k);
  explicit_bzero(pad, sizeof pad);
}

void kvf__hmac_update(kvf__hmac_ctx *h, const void *data, size_t len) {
  kvf__sha256_update(&h->inner, data, len);
}

void kvf__hmac_final(kvf__hmac_ctx *h, uint8_t out[KVF__SHA256_LEN]) {
  uint8_t ih[KVF__SHA256_LEN];
  kvf__sha256_final(&h->inner, ih);
  kvf__sha256_update(&h->outer, ih, sizeof ih);
  kvf__sha256_final(&h->outer, out);
  explicit_bzero(ih, sizeof ih);
}

void kvf__hmac_sha256(const uint8_t *key, size_t keylen, const void *data, size_t len,
                      uint8_t out[KVF__SHA256_LEN]) {
  kvf__hmac_ctx h;
  kvf__hmac_init(&h, key, keylen);
  kvf__hmac_update(&h, data, len);
  kvf__hmac_final(&h, out);
}

bool kvf__auth_equal(const void *a, const void *b, size_t n) {
  const volatile uint8_t *x = a, *y = b;
  uint8_t diff = 0;
  for (size_t i = 0; i < n; i++) diff |= x[i] ^ y[i];
  return diff == 0;
}

/* ------------------------------------------------------------ proofs */

#define LABEL_PREFIX "kvferry-auth-v1 "

/* The label with its NUL: no label is a prefix of another. */
static void put_label(kvf__hmac_ctx *h, const char *role) {
  kvf__hmac_update(h, LABEL_PREFIX, sizeof LABEL_PREFIX - 1);
  kvf__hmac_update(h, role, strlen(role) + 1);
}

/* A length byte, then the bytes: "ab"+"c" and "a"+"bc" differ. Node names
 * are at most 63 bytes; anything longer is cut at 255 on both sides alike. */
static void put_str(kvf__hmac_ctx *h, const char *s) {
  size_t n = strnlen(s, 255);
  uint8_t len = (uint8_t)n;
  kvf__hmac_update(h, &len, 1);
  kvf__hmac_update(h, s, n);
}

static void put_le(kvf__hmac_ctx *h, uint64_t v, size_t bytes) {
  uint8_t b[8];
  for (size_t i = 0; i < bytes; i++) b[i] = (uint8_t)(v >> (8 * i));
  kvf__hmac_update(h, b, bytes);
}

void kvf__auth_hello_proof(const uint8_t *key, size_t keylen, enum kvf__auth_role role,
                           const uint8_t nonce_d[KVF__AUTH_NONCE],
                           const uint8_t nonce_a[KVF__AUTH_NONCE], const char *acceptor,
                           const char *dialer, uint8_t out[KVF__AUTH_PROOF]) {
  kvf__hmac_ctx h;
  kvf__hmac_init(&h, key, keylen);
  put_label(&h, role == KVF__AUTH_ACCEPTOR ? "acceptor" : "dialer");
  kvf__hmac_update(&h, nonce_d, KVF__AUTH_NONCE);
  kvf__hmac_update(&h, nonce_a, KVF__AUTH_NONCE);
  put_str(&h, acceptor);
  put_str(&h, dialer);
  kvf__hmac_final(&h, out);
}

void kvf__auth_data_proof(const uint8_t *key, size_t keylen, const uint8_t nonce_r[KVF__AUTH_NONCE],
                          uint64_t receiver_session, uint32_t stream, const char *receiver,
                          const char *sender, uint8_t out[KVF__AUTH_PROOF]) {
  kvf__hmac_ctx h;
  kvf__hmac_init(&h, key, keylen);
  put_label(&h, "data");
  kvf__hmac_update(&h, nonce_r, KVF__AUTH_NONCE);
  put_le(&h, receiver_session, 8);
  put_le(&h, stream, 4);
  put_str(&h, receiver);
  put_str(&h, sender);
  kvf__hmac_final(&h, out);
}

void kvf__auth_rdma_proof(const uint8_t *key, size_t keylen, uint64_t sender_session,
                          uint64_t receiver_session, uint8_t out[KVF__AUTH_RDMA_PROOF]) {
  kvf__hmac_ctx h;
  uint8_t full[KVF__SHA256_LEN];
  kvf__hmac_init(&h, key, keylen);
  put_label(&h, "rdma");
  put_le(&h, sender_session, 8);
  put_le(&h, receiver_session, 8);
  kvf__hmac_final(&h, full);
  memcpy(out, full, KVF__AUTH_RDMA_PROOF);
  explicit_bzero(full, sizeof full);
}

/* ------------------------------------------------------------ the key */

static struct {
  uint8_t key[KVF__AUTH_KEY_MAX + 1]; /* one more: a longer file is refused */
  size_t len;
  bool on;
} A;

bool kvf__auth_enabled(void) { return A.on; }

const uint8_t *kvf__auth_key(size_t *len) {
  *len = A.len;
  return A.key;
}

void kvf__auth_forget(void) {
  explicit_bzero(&A, sizeof A);
}

int kvf__auth_nonce(uint8_t out[KVF__AUTH_NONCE]) {
  size_t have = 0;
  while (have < KVF__AUTH_NONCE) {
    ssize_t r = getrandom(out + have, KVF__AUTH_NONCE - have, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -errno;
    have += (size_t)r;
  }
  return 0;
}

/* Who may read the key and what it is: refused with a reason otherwise. */
static int check_file(const char *path, const struct stat *st, char *err, size_t errlen) {
  unsigned mode = (unsigned)st->st_mode & 07777;
  if (!S_ISREG(st->st_mode)) {
    snprintf(err, errlen, "cluster-key-file %s: not a regular file", path);
    return -EINVAL;
  }
  if (st->st_uid != geteuid()) {
    snprintf(err, errlen,
             "cluster-key-file %s: owned by uid %u but kvferryd runs as uid %u; the key file "
             "must belong to the daemon's user (another owner could change or read the key)",
             path, (unsigned)st->st_uid, (unsigned)geteuid());
    return -EPERM;
  }
  if (mode != 0600) {
    snprintf(err, errlen,
             "cluster-key-file %s: mode %04o; it must be 0600 (readable and writable by its "
             "owner only): chmod 600 %s",
             path, mode, path);
    return -EPERM;
  }
  return 0;
}

static int read_key(int fd, const char *path, char *err, size_t errlen) {
  size_t n = 0;
  while (n < sizeof A.key) {
    ssize_t r = read(fd, A.key + n, sizeof A.key - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      snprintf(err, errlen, "cluster-key-file %s: %s", path, strerror(e));
      return -e;
    }
    if (r == 0) break;
    n += (size_t)r;
  }
  if (n < KVF__AUTH_KEY_MIN || n > KVF__AUTH_KEY_MAX) {
    snprintf(err, errlen,
             "cluster-key-file %s: %s%zu bytes; a key is %d..%d bytes (make one with: head -c 32 "
             "/dev/urandom > %s)",
             path, n > KVF__AUTH_KEY_MAX ? "more than " : "", n > KVF__AUTH_KEY_MAX ? (size_t)KVF__AUTH_KEY_MAX : n,
             KVF__AUTH_KEY_MIN, KVF__AUTH_KEY_MAX, path);
    return -EINVAL;
  }
  A.len = n;
  return 0;
}

int kvf__auth_load(const char *path, char *err, size_t errlen) {
  struct stat st;
  kvf__auth_forget();
  /* fstat of the opened file, not stat of the path: what is checked is
   * what is read. O_NONBLOCK: a FIFO must not hang the start. */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    int e = errno;
    snprintf(err, errlen, "cluster-key-file %s: %s", path, strerror(e));
    return -e;
  }
  int rc = fstat(fd, &st) != 0 ? -errno : 0;
  if (rc) snprintf(err, errlen, "cluster-key-file %s: %s", path, strerror(-rc));
  if (rc == 0) rc = check_file(path, &st, err, errlen);
  if (rc == 0) rc = read_key(fd, path, err, errlen);
  close(fd);
  if (rc) {
    kvf__auth_forget();
    return rc;
  }
  A.on = true;
  return 0;
}
