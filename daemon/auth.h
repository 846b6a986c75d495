/* auth.h - the cluster key: daemons prove to each other that they hold the
 * same secret (cluster-key-file) without sending it.
 *
 * Primitives: HMAC-SHA256 (RFC 2104) from libgcrypt (gcry_mac; kvferryd
 * loads libgcrypt through libsystemd anyway), and a constant-time compare.
 *
 * Proofs are HMAC-SHA256(key, transcript). Every transcript starts with a
 * label naming the role of whoever computes it ("... acceptor", "... dialer",
 * "... data", "... rdma", each NUL-terminated so that none is a prefix of
 * another), so a proof made in one role is never accepted in another (no
 * reflection); it then holds fresh nonces, so a proof seen once is worth
 * nothing later (no replay), and names both ends. Strings go in with a
 * length byte, integers little-endian.
 *
 *   control (peer.c)  dialer -> Hello{nonce_d}
 *                     acceptor -> Hello{nonce_a, proof_a = P("acceptor")}
 *                     dialer checks proof_a -> Auth{proof_d = P("dialer")}
 *                     then full Hellos both ways; only then is the peer up.
 *                     P(role) = HMAC(key, label(role) || nonce_d || nonce_a ||
 *                                    acceptor node || dialer node)
 *   tcp data stream   sender -> DataHello; receiver -> Auth{nonce_r};
 *                     sender -> Auth{HMAC(key, label("data") || nonce_r ||
 *                       receiver session || stream || receiver || sender)}
 *   rdma CM request   16 bytes of HMAC(key, label("rdma") || sender session ||
 *                     receiver session) in the private data (one-shot: see
 *                     rdma/rdma_conn.c for what that does and does not
 *                     cover).
 *
 * This authenticates who may join and open data paths; it neither encrypts
 * nor protects the integrity of what follows (use a private network, IPsec
 * or WireGuard against an attacker on the path). */
#ifndef KVF_AUTH_H
#define KVF_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVF__SHA256_LEN 32
#define KVF__AUTH_NONCE 32      /* bytes of every nonce */
#define KVF__AUTH_PROOF 32      /* bytes of a full proof */
#define KVF__AUTH_RDMA_PROOF 16 /* truncated: fits the CM private data */
#define KVF__AUTH_KEY_MIN 16
#define KVF__AUTH_KEY_MAX 4096

/* Initialises libgcrypt once per process (the first call does it; any
 * thread): 0, or -ENOTSUP when the libgcrypt at run time is older than the
 * one built against. Every function below calls it; kvferryd calls it at
 * start to fail there rather than at the first peer. */
int kvf__auth_init(void);
/* libgcrypt's version, for the start-up log. */
const char *kvf__auth_crypto_version(void);

/* HMAC-SHA256 (RFC 2104) by libgcrypt: 0 or a negative errno (out of
 * memory), with random bytes in out then. */
int kvf__hmac_sha256(const uint8_t *key, size_t keylen, const void *data, size_t len,
                     uint8_t out[KVF__SHA256_LEN]);

/* Equal in time that depends on n only, never on where a and b differ. */
bool kvf__auth_equal(const void *a, const void *b, size_t n);

/* ---- proofs (pure: the key is an argument, for tests) ----
 * Each returns 0, or a negative errno when libgcrypt failed (out of
 * memory); the proof is then random bytes, which match no proof, so a
 * caller that only compares fails authentication, never passes it. */

enum kvf__auth_role { KVF__AUTH_ACCEPTOR, KVF__AUTH_DIALER };

int kvf__auth_hello_proof(const uint8_t *key, size_t keylen, enum kvf__auth_role role,
                          const uint8_t nonce_d[KVF__AUTH_NONCE],
                          const uint8_t nonce_a[KVF__AUTH_NONCE], const char *acceptor,
                          const char *dialer, uint8_t out[KVF__AUTH_PROOF]);
int kvf__auth_data_proof(const uint8_t *key, size_t keylen, const uint8_t nonce_r[KVF__AUTH_NONCE],
                         uint64_t receiver_session, uint32_t stream, const char *receiver,
                         const char *sender, uint8_t out[KVF__AUTH_PROOF]);
int kvf__auth_rdma_proof(const uint8_t *key, size_t keylen, uint64_t sender_session,
                         uint64_t receiver_session, uint8_t out[KVF__AUTH_RDMA_PROOF]);

/* ---- the daemon's key ---- */

/* Reads the key file: refused (negative errno, err says why and names the
 * file) unless it is a regular file of this process's effective uid, of
 * mode 0600 exactly, holding 16..4096 bytes. The bytes are the key. */
int kvf__auth_load(const char *path, char *err, size_t errlen);
/* Wipes the key from memory; kvf__auth_enabled() is false afterwards. */
void kvf__auth_forget(void);
bool kvf__auth_enabled(void);
/* The key and its length. Call it in a statement of its own: as
 * f(kvf__auth_key(&n), n) the n may be read before the call sets it. */
const uint8_t *kvf__auth_key(size_t *len);
/* KVF__AUTH_NONCE fresh bytes from getrandom(); 0 or a negative errno. */
int kvf__auth_nonce(uint8_t out[KVF__AUTH_NONCE]);

#endif
