/* test_auth.c - the cluster key (daemon/auth.c): HMAC-SHA256 (libgcrypt's)
 * against RFC 4231 cases 1-4, 6 and 7, the proofs (known answers computed
 * independently with Python's hmac, role separation, nonces, names, keys),
 * the constant-time compare, nonces, and the key file checks. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "auth.h"

#define assert_contains(hay, needle)                                                      \
  do {                                                                                    \
    if (!strstr((hay), (needle))) fail_msg("'%s' does not contain '%s'", (hay), (needle)); \
  } while (0)

static void hex(const char *s, uint8_t *out, size_t n) {
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    assert_int_equal(sscanf(s + 2 * i, "%2x", &v), 1);
    out[i] = (uint8_t)v;
  }
}

static void assert_digest(const uint8_t *got, const char *want_hex, size_t n) {
  uint8_t want[64];
  hex(want_hex, want, n);
  if (memcmp(got, want, n) != 0) {
    char g[129];
    for (size_t i = 0; i < n; i++) snprintf(g + 2 * i, 3, "%02x", got[i]);
    fail_msg("digest %s, want %s", g, want_hex);
  }
}

/* libgcrypt is initialised once, whoever asks first, and says which it is. */
static void test_init(void **state) {
  assert_int_equal(kvf__auth_init(), 0);
  assert_int_equal(kvf__auth_init(), 0);
  assert_non_null(kvf__auth_crypto_version());
}

/* ---- HMAC-SHA256 (RFC 4231) --------------------------------------------- */

static void check_hmac(const uint8_t *key, size_t klen, const void *data, size_t len,
                       const char *want) {
  uint8_t d[32];
  assert_int_equal(kvf__hmac_sha256(key, klen, data, len, d), 0);
  assert_digest(d, want, 32);
}

static void test_hmac_rfc4231(void **state) {
  uint8_t key[131], data[160];
  memset(key, 0x0b, 20); /* case 1 */
  check_hmac(key, 20, "Hi There", 8,
             "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  const char *d2 = "what do ya want for nothing?"; /* case 2 */
  check_hmac((const uint8_t *)"Jefe", 4, d2, strlen(d2),
             "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  memset(key, 0xaa, 20); /* case 3 */
  memset(data, 0xdd, 50);
  check_hmac(key, 20, data, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  for (int i = 0; i < 25; i++) key[i] = (uint8_t)(i + 1); /* case 4 */
  memset(data, 0xcd, 50);
  check_hmac(key, 25, data, 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  memset(key, 0xaa, 131); /* case 6: a key longer than the block is hashed */
  const char *d6 = "Test Using Larger Than Block-Size Key - Hash Key First";
  check_hmac(key, 131, d6, strlen(d6),
             "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  const char *d7 = "This is a test using a larger than block-size key and a larger than "
                   "block-size data. The key needs to be hashed before being used by the "
                   "HMAC algorithm."; /* case 7 */
  check_hmac(key, 131, d7, strlen(d7),
             "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

static void test_equal(void **state) {
  uint8_t a[32], b[32];
  memset(a, 7, sizeof a);
  memcpy(b, a, sizeof b);
  assert_true(kvf__auth_equal(a, b, 32));
  b[0] ^= 1;
  assert_false(kvf__auth_equal(a, b, 32));
  b[0] ^= 1;
  b[31] ^= 0x80;
  assert_false(kvf__auth_equal(a, b, 32));
  assert_true(kvf__auth_equal(a, b, 31));
  assert_true(kvf__auth_equal(a, b, 0));
}

/* ---- proofs ------------------------------------------------------------- */

static const uint8_t KEY[] = "0123456789abcdef";
#define KLEN 16

static void nonces(uint8_t nd[32], uint8_t na[32]) {
  for (int i = 0; i < 32; i++) {
    nd[i] = (uint8_t)i;
    na[i] = (uint8_t)(32 + i);
  }
}

/* Known answers computed with Python's hmac over the transcripts auth.h
 * describes, so that the encoding is pinned (and other implementations,
 * like tests/ops/test_auth.py, agree). */
static void test_proof_known_answers(void **state) {
  uint8_t nd[32], na[32], p[32];
  nonces(nd, na);
  assert_int_equal(kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_ACCEPTOR, nd, na, "decode", "prefill", p), 0);
  assert_digest(p, "dda73e0a6e1deae3229073826f212f189dc0ff4112daf7df5f39b82c1ee50b8b", 32);
  assert_int_equal(kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_DIALER, nd, na, "decode", "prefill", p), 0);
  assert_digest(p, "69ec3eefce9c60afe27e02de67195ad05db8dfddca08845762bd5e5f4bb28ed2", 32);
  assert_int_equal(kvf__auth_data_proof(KEY, KLEN, na, 0x123456789aull, 3, "decode", "prefill", p), 0);
  assert_digest(p, "e8e948bc17d06c50c6f35213c78330f4ee57a3d10a5ae2256318bfc62351ffa2", 32);
  uint8_t r[KVF__AUTH_RDMA_PROOF];
  assert_int_equal(kvf__auth_rdma_proof(KEY, KLEN, 0x1111, 0x2222, r), 0);
  assert_digest(r, "238fb932fde805f411d0a2dff6b0cd2d", 16);
}

/* The acceptor's proof is never the dialer's: a proof cannot be reflected
 * back at the one who made it. */
static void test_proof_roles(void **state) {
  uint8_t nd[32], na[32], acc[32], dia[32];
  nonces(nd, na);
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_ACCEPTOR, nd, na, "a", "b", acc);
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_DIALER, nd, na, "a", "b", dia);
  assert_false(kvf__auth_equal(acc, dia, 32));
  /* Nor is it the proof with the ends swapped. */
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_DIALER, na, nd, "b", "a", dia);
  assert_false(kvf__auth_equal(acc, dia, 32));
  /* The same inputs give the same proof (what the other side checks). */
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_ACCEPTOR, nd, na, "a", "b", dia);
  assert_true(kvf__auth_equal(acc, dia, 32));
}

/* Fresh nonces make a proof seen once worthless later (no replay). */
static void test_proof_nonces(void **state) {
  uint8_t nd[32], na[32], p1[32], p2[32];
  nonces(nd, na);
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_DIALER, nd, na, "a", "b", p1);
  nd[31] ^= 1;
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_DIALER, nd, na, "a", "b", p2);
  assert_false(kvf__auth_equal(p1, p2, 32));
  nd[31] ^= 1;
  na[0] ^= 1;
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_DIALER, nd, na, "a", "b", p2);
  assert_false(kvf__auth_equal(p1, p2, 32));
  kvf__auth_data_proof(KEY, KLEN, nd, 5, 0, "a", "b", p1);
  kvf__auth_data_proof(KEY, KLEN, na, 5, 0, "a", "b", p2);
  assert_false(kvf__auth_equal(p1, p2, 32));
  kvf__auth_data_proof(KEY, KLEN, nd, 5, 1, "a", "b", p2); /* another stream */
  assert_false(kvf__auth_equal(p1, p2, 32));
  kvf__auth_data_proof(KEY, KLEN, nd, 6, 0, "a", "b", p2); /* another session */
  assert_false(kvf__auth_equal(p1, p2, 32));
}

/* Names go in with their lengths: "ab"+"c" is not "a"+"bc". */
static void test_proof_names(void **state) {
  uint8_t nd[32], na[32], p1[32], p2[32];
  nonces(nd, na);
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_ACCEPTOR, nd, na, "ab", "c", p1);
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_ACCEPTOR, nd, na, "a", "bc", p2);
  assert_false(kvf__auth_equal(p1, p2, 32));
  kvf__auth_data_proof(KEY, KLEN, nd, 1, 0, "ab", "c", p1);
  kvf__auth_data_proof(KEY, KLEN, nd, 1, 0, "a", "bc", p2);
  assert_false(kvf__auth_equal(p1, p2, 32));
}

/* Another key, even one bit off or one byte longer, gives another proof. */
static void test_proof_wrong_key(void **state) {
  uint8_t nd[32], na[32], p1[32], p2[32], other[17];
  nonces(nd, na);
  memcpy(other, KEY, 16);
  kvf__auth_hello_proof(KEY, KLEN, KVF__AUTH_DIALER, nd, na, "a", "b", p1);
  other[5] ^= 4;
  kvf__auth_hello_proof(other, 16, KVF__AUTH_DIALER, nd, na, "a", "b", p2);
  assert_false(kvf__auth_equal(p1, p2, 32));
  other[5] ^= 4;
  other[16] = 'x'; /* (a trailing NUL would be the same HMAC key: RFC 2104 pads with zeros) */
  kvf__auth_hello_proof(other, 17, KVF__AUTH_DIALER, nd, na, "a", "b", p2);
  assert_false(kvf__auth_equal(p1, p2, 32));
  uint8_t r1[16], r2[16];
  kvf__auth_rdma_proof(KEY, KLEN, 1, 2, r1);
  kvf__auth_rdma_proof(other, 17, 1, 2, r2);
  assert_false(kvf__auth_equal(r1, r2, 16));
  kvf__auth_rdma_proof(KEY, KLEN, 2, 1, r2); /* the sessions' order counts */
  assert_false(kvf__auth_equal(r1, r2, 16));
}

static void test_nonce(void **state) {
  uint8_t a[KVF__AUTH_NONCE], b[KVF__AUTH_NONCE];
  assert_int_equal(kvf__auth_nonce(a), 0);
  assert_int_equal(kvf__auth_nonce(b), 0);
  assert_false(kvf__auth_equal(a, b, sizeof a));
}

/* ---- the key file ------------------------------------------------------- */

static char dir[] = "/tmp/kvf-test-auth-XXXXXX";

static const char *key_file(const char *name, size_t len, mode_t mode) {
  static char path[128];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  unlink(path);
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
  assert_true(fd >= 0);
  for (size_t i = 0; i < len; i++) assert_int_equal(write(fd, "k", 1), 1);
  close(fd);
  assert_int_equal(chmod(path, mode), 0);
  return path;
}

static void test_load_good(void **state) {
  char err[512] = "";
  size_t len;
  const char *p = key_file("good", 32, 0600);
  assert_int_equal(kvf__auth_load(p, err, sizeof err), 0);
  assert_true(kvf__auth_enabled());
  const uint8_t *k = kvf__auth_key(&len);
  assert_int_equal(len, 32);
  assert_int_equal(k[0], 'k');
  kvf__auth_forget();
  assert_false(kvf__auth_enabled());
  assert_int_equal(kvf__auth_key(&len)[0], 0); /* wiped */
  assert_int_equal(len, 0);
  p = key_file("edges", KVF__AUTH_KEY_MIN, 0600);
  assert_int_equal(kvf__auth_load(p, err, sizeof err), 0);
  p = key_file("edges", KVF__AUTH_KEY_MAX, 0600);
  assert_int_equal(kvf__auth_load(p, err, sizeof err), 0);
  kvf__auth_forget();
}

static void expect_refused(const char *path, const char *why) {
  char err[512] = "";
  int rc = kvf__auth_load(path, err, sizeof err);
  if (rc >= 0) fail_msg("%s: loaded, want refused for '%s'", path, why);
  assert_contains(err, path);
  assert_contains(err, why);
  assert_false(kvf__auth_enabled());
}

static void test_load_refused(void **state) {
  expect_refused(key_file("open", 32, 0644), "mode 0644");
  expect_refused(key_file("group", 32, 0640), "mode 0640");
  expect_refused(key_file("readonly", 32, 0400), "mode 0400");
  expect_refused(key_file("exec", 32, 0700), "mode 0700");
  expect_refused(key_file("short", KVF__AUTH_KEY_MIN - 1, 0600), "15 bytes");
  expect_refused(key_file("empty", 0, 0600), "0 bytes");
  expect_refused(key_file("long", KVF__AUTH_KEY_MAX + 1, 0600), "more than 4096 bytes");
  expect_refused(dir, "not a regular file");
  char none[128];
  snprintf(none, sizeof none, "%s/none", dir);
  expect_refused(none, "No such file");
  /* A refusal wipes a key loaded before. */
  char err[512];
  assert_int_equal(kvf__auth_load(key_file("good", 32, 0600), err, sizeof err), 0);
  expect_refused(key_file("short", 3, 0600), "3 bytes");
}

static void test_load_other_owner(void **state) {
  if (geteuid() != 0) skip(); /* only root can give a file away */
  const char *p = key_file("theirs", 32, 0600);
  assert_int_equal(chown(p, 65534, 65534), 0);
  expect_refused(p, "owned by uid 65534");
}

static int setup(void **state) { return mkdtemp(dir) ? 0 : -1; }

static int teardown(void **state) {
  char cmd[160];
  kvf__auth_forget();
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_init),
      cmocka_unit_test(test_hmac_rfc4231),
      cmocka_unit_test(test_equal),
      cmocka_unit_test(test_proof_known_answers),
      cmocka_unit_test(test_proof_roles),
      cmocka_unit_test(test_proof_nonces),
      cmocka_unit_test(test_proof_names),
      cmocka_unit_test(test_proof_wrong_key),
      cmocka_unit_test(test_nonce),
      cmocka_unit_test(test_load_good),
      cmocka_unit_test(test_load_refused),
      cmocka_unit_test(test_load_other_owner),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
