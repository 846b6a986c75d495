/* map.h - a string-keyed hash map (chained, grows by doubling). Keys are
 * copied. Used for transfers by id and by handle; never on the per-byte path. */
#ifndef KVF_MAP_H
#define KVF_MAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvf__map_ent {
  struct kvf__map_ent *next;
  void *val;
  char key[];
} kvf__map_ent;

typedef struct kvf__map {
  kvf__map_ent **b;
  size_t nb, n;
} kvf__map;

void *kvf__map_get(const kvf__map *m, const char *key);
/* -EEXIST when the key is present, -ENOMEM. */
int kvf__map_put(kvf__map *m, const char *key, void *val);
/* Returns the removed value or NULL. */
void *kvf__map_del(kvf__map *m, const char *key);
void kvf__map_free(kvf__map *m);

/* A 64-bit number (a grant handle) as a key: 16 hex digits. */
#define KVF__MAP_KEY_U64 17
void kvf__map_key_u64(char key[KVF__MAP_KEY_U64], uint64_t v);

#endif
