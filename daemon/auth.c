/* auth.c - the proofs of auth.h over libgcrypt's HMAC-SHA256, and the
 * daemon's cluster key. tests/unit/test_auth.c checks the HMAC against RFC
 * 4231 and the proofs against known answers. */
#include "auth.h"

#include <errno.h>
#include <fcntl.h>
#include <gcrypt.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------ libgcrypt */

/* libgcrypt wants gcry_check_version before any other call, once per
 * process. libsystemd may have initialised it already (journal sealing);
 * then its choices stand. Secure memory is off: the key itself lives in
 * ordinary memory (A below), so locking libgcrypt's copy would buy nothing
 * and would need RLIMIT_MEMLOCK. */
static pthread_once_t gcrypt_once = PTHREAD_ONCE_INIT;
static int gcrypt_rc;

static void gcrypt_init(void) {
  if (!gcry_check_version(GCRYPT_VERSION)) {
    gcrypt_rc = -ENOTSUP; /* the library at run time is older than its headers */
    return;
  }
  if (gcry_control(GCRYCTL_INITIALIZATION_FINISHED_P)) return;
  gcry_control(GCRYCTL_DISABLE_SECMEM, 0);
  gcry_control(GCRYCTL_INITIALIZATION_FINISHED, 0);
}

int kvf__auth_init(void) {
  pthread_once(&gcrypt_once, gcrypt_init);
  return gcrypt_rc;
}

const char *kvf__auth_crypto_version(void) { return gcry_check_version(NULL); }

/* An HMAC-SHA256 under way. rc is the first error: a writer after a failure
 * does nothing, and mac_final reports it. */
typedef struct {
  gcry_mac_hd_t hd;
  int rc;
} mac_ctx;

static void mac_init(mac_ctx *m, const uint8_t *key, size_t keylen) {
  m->hd = NULL;
  m->rc = kvf__auth_init();
  if (m->rc == 0 && gcry_mac_open(&m->hd, GCRY_MAC_HMAC_SHA256, 0, NULL)) m->rc = -ENOMEM;
  if (m->rc == 0 && gcry_mac_setkey(m->hd, key, keylen)) m->rc = -EINVAL;
}

static void mac_write(mac_ctx *m, const void *data, size_t len) {
  if (m->rc == 0 && len && gcry_mac_write(m->hd, data, len)) m->rc = -EINVAL;
}

/* Writes n <= 32 bytes of the MAC (truncated on the left as RFC 2104
 * section 5 says). On a failure, n fresh random bytes instead: a proof that
 * could not be computed then matches nothing, so it fails authentication
 * rather than passing it. */
static int mac_final(mac_ctx *m, uint8_t *out, size_t n) {
  uint8_t full[KVF__SHA256_LEN];
  size_t len = sizeof full;
  if (m->rc == 0 && (gcry_mac_read(m->hd, full, &len) || len != sizeof full)) m->rc = -EINVAL;
  if (m->rc == 0) memcpy(out, full, n);
  else gcry_create_nonce(out, n);
  explicit_bzero(full, sizeof full);
  gcry_mac_close(m->hd); /* NULL is fine */
  return m->rc;
}

int kvf__hmac_sha256(const uint8_t *key, size_t keylen, const void *data, size_t len,
                     uint8_t out[KVF__SHA256_LEN]) {
  mac_ctx m;
  mac_init(&m, key, keylen);
  mac_write(&m, data, len);
  return mac_final(&m, out, KVF__SHA256_LEN);
}

/* Not in libgcrypt's API (its own is internal to gcry_mac_verify, which
 * would need the MAC handle at the compare): the usual OR of XORs. */
bool kvf__auth_equal(const void *a, const void *b, size_t n) {
  const volatile uint8_t *x = a, *y = b;
  uint8_t diff = 0;
  for (size_t i = 0; i < n; i++) diff |= x[i] ^ y[i];
  return diff == 0;
}

/* ------------------------------------------------------------ proofs */

#define LABEL_PREFIX "kvferry-auth-v1 "

/* The label with its NUL: no label is a prefix of another. */
static void put_label(mac_ctx *h, const char *role) {
  mac_write(h, LABEL_PREFIX, sizeof LABEL_PREFIX - 1);
  mac_write(h, role, strlen(role) + 1);
}

/* A length byte, then the bytes: "ab"+"c" and "a"+"bc" differ. Node names
 * are at most 63 bytes; anything longer is cut at 255 on both sides alike. */
static void put_str(mac_ctx *h, const char *s) {
  size_t n = strnlen(s, 255);
  uint8_t len = (uint8_t)n;
  mac_write(h, &len, 1);
  mac_write(h, s, n);
}

static void put_le(mac_ctx *h, uint64_t v, size_t bytes) {
  uint8_t b[8];
  for (size_t i = 0; i < bytes; i++) b[i] = (uint8_t)(v >> (8 * i));
  mac_write(h, b, bytes);
}

int kvf__auth_hello_proof(const uint8_t *key, size_t keylen, enum kvf__auth_role role,
                          const uint8_t nonce_d[KVF__AUTH_NONCE],
                          const uint8_t nonce_a[KVF__AUTH_NONCE], const char *acceptor,
                          const char *dialer, uint8_t out[KVF__AUTH_PROOF]) {
  mac_ctx h;
  mac_init(&h, key, keylen);
  put_label(&h, role == KVF__AUTH_ACCEPTOR ? "acceptor" : "dialer");
  mac_write(&h, nonce_d, KVF__AUTH_NONCE);
  mac_write(&h, nonce_a, KVF__AUTH_NONCE);
  put_str(&h, acceptor);
  put_str(&h, dialer);
  return mac_final(&h, out, KVF__AUTH_PROOF);
}

int kvf__auth_data_proof(const uint8_t *key, size_t keylen, const uint8_t nonce_r[KVF__AUTH_NONCE],
                         uint64_t receiver_session, uint32_t stream, const char *receiver,
                         const char *sender, uint8_t out[KVF__AUTH_PROOF]) {
  mac_ctx h;
  mac_init(&h, key, keylen);
  put_label(&h, "data");
  mac_write(&h, nonce_r, KVF__AUTH_NONCE);
  put_le(&h, receiver_session, 8);
  put_le(&h, stream, 4);
  put_str(&h, receiver);
  put_str(&h, sender);
  return mac_final(&h, out, KVF__AUTH_PROOF);
}

int kvf__auth_rdma_proof(const uint8_t *key, size_t keylen, uint64_t sender_session,
                         uint64_t receiver_session, uint8_t out[KVF__AUTH_RDMA_PROOF]) {
  mac_ctx h;
  mac_init(&h, key, keylen);
  put_label(&h, "rdma");
  put_le(&h, sender_session, 8);
  put_le(&h, receiver_session, 8);
  return mac_final(&h, out, KVF__AUTH_RDMA_PROOF);
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
