/* registry.h - cluster membership through etcd (the `registry` key).
 *
 * This daemon's record lives under PREFIX/nodes/NODE with a lease that a
 * registry thread keeps alive; the same thread watches PREFIX/nodes/ and
 * hands every change to the loop (mailbox.h), which adds and removes the
 * peers concerned (kvf__peers_member_put/_gone in peer.h). Static peer
 * lines live beside it: a name configured statically ignores the
 * registry. */
#ifndef KVF_REGISTRY_H
#define KVF_REGISTRY_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

/* What status, doctor and metrics show (a copy, taken under the lock). */
typedef struct kvf__registry_info {
  bool on;                 /* registry is configured */
  bool reachable;          /* the last request to etcd succeeded */
  bool registered;         /* our record is in etcd under a live lease */
  char state[16];          /* registered, registering, unreachable, conflict, off */
  char endpoint[300];      /* the etcd endpoint in use */
  uint64_t lease;
  uint64_t failures;       /* requests to etcd that failed */
  uint64_t registrations;  /* records written (1 + re-registrations) */
  uint64_t since_ns;       /* when state last changed */
  uint64_t rev;            /* the last etcd revision seen */
  char last_error[200];
} kvf__registry_info;

/* Loop thread, after kvf__peers_start (the peer port is known). Registers
 * (waiting up to registry-ttl-ms + 2 s for an earlier incarnation's record
 * to expire) and starts the thread. Fails, with err, only when the node
 * name is held by a live daemon of another incarnation; an unreachable
 * etcd is a warning (the thread keeps trying). No-op with registry off. */
int kvf__registry_start(uv_loop_t *loop, char *err, size_t errlen);
/* Loop thread: revokes our lease (peers see us leave at once), stops the
 * thread. */
void kvf__registry_stop(void);
/* Any thread. */
void kvf__registry_get(kvf__registry_info *out);
struct kvf__sbuf;
/* Loop thread: status's registry object (json: `, "registry": {...}` or
 * null) or its text line. */
void kvf__registry_render(struct kvf__sbuf *b, bool json);
/* Peers that the registry brought (loop thread). */
size_t kvf__registry_members(void);

/* base64 (RFC 4648, with padding), as the etcd gateway wants keys and
 * values: exposed for tests/unit/test_registry.c. encode: out needs
 * 4 * ceil(n / 3) + 1 bytes. decode: -EINVAL on bad input, else the
 * length (out NUL-terminated; needs 3 * (strlen(in) / 4) + 1 bytes). */
void kvf__b64_encode(const void *in, size_t n, char *out);
int kvf__b64_decode(const char *in, size_t len, char *out, size_t cap);

#endif
