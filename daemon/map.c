/* map.c - see map.h. */
#include "map.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t hash(const char *s) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static kvf__map_ent **slot(const kvf__map *m, const char *key) {
  kvf__map_ent **p = &m->b[hash(key) & (m->nb - 1)];
  while (*p && strcmp((*p)->key, key) != 0) p = &(*p)->next;
  return p;
}

void *kvf__map_get(const kvf__map *m, const char *key) {
  if (!m->nb) return NULL;
  kvf__map_ent *e = *slot(m, key);
  return e ? e->val : NULL;
}

static int grow(kvf__map *m) {
  size_t nb = m->nb ? m->nb * 2 : 64;
  kvf__map_ent **b = calloc(nb, sizeof(*b));
  if (!b) return -ENOMEM;
  for (size_t i = 0; i < m->nb; i++) {
    kvf__map_ent *e = m->b[i];
    while (e) {
      kvf__map_ent *next = e->next;
      size_t j = hash(e->key) & (nb - 1);
      e->next = b[j];
      b[j] = e;
      e = next;
    }
  }
  free(m->b);
  m->b = b;
  m->nb = nb;
  return 0;
}

int kvf__map_put(kvf__map *m, const char *key, void *val) {
  if (m->n + 1 > m->nb * 3 / 4 && grow(m)) return -ENOMEM;
  kvf__map_ent **p = slot(m, key);
  if (*p) return -EEXIST;
  size_t klen = strlen(key) + 1;
  kvf__map_ent *e = malloc(sizeof(*e) + klen);
  if (!e) return -ENOMEM;
  memcpy(e->key, key, klen);
  e->val = val;
  e->next = NULL;
  *p = e;
  m->n++;
  return 0;
}

void *kvf__map_del(kvf__map *m, const char *key) {
  if (!m->nb) return NULL;
  kvf__map_ent **p = slot(m, key);
  kvf__map_ent *e = *p;
  if (!e) return NULL;
  void *v = e->val;
  *p = e->next;
  free(e);
  m->n--;
  return v;
}

void kvf__map_free(kvf__map *m) {
  for (size_t i = 0; i < m->nb; i++) {
    kvf__map_ent *e = m->b[i];
    while (e) {
      kvf__map_ent *next = e->next;
      free(e);
      e = next;
    }
  }
  free(m->b);
  memset(m, 0, sizeof(*m));
}

void kvf__map_key_u64(char key[KVF__MAP_KEY_U64], uint64_t v) {
  snprintf(key, KVF__MAP_KEY_U64, "%016llx", (unsigned long long)v);
}
