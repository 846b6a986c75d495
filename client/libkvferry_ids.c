/* libkvferry_ids.c - the id tables of client_int.h: the pool and layout ids
 * an engine holds stay valid when a restarted daemon numbers them anew. */
#include "client_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

kvf__idrec *kvf__ids_by_vid(kvf__ids *t, uint32_t vid) {
  for (size_t i = 0; i < t->n; i++)
    if (t->v[i].vid == vid) return &t->v[i];
  return NULL;
}

kvf__idrec *kvf__ids_by_did(kvf__ids *t, uint32_t did) {
  if (did == KVF__NO_ID) return NULL;
  for (size_t i = 0; i < t->n; i++)
    if (t->v[i].did == did) return &t->v[i];
  return NULL;
}

kvf__idrec *kvf__ids_by_name(kvf__ids *t, const char *name) {
  if (!name || !*name) return NULL;
  for (size_t i = 0; i < t->n; i++)
    if (strcmp(t->v[i].name, name) == 0) return &t->v[i];
  return NULL;
}

/* The did itself while no entry holds it as its vid (so that ids are the
 * daemon's own until a restart renumbers them), else one past the largest. */
static uint32_t fresh_vid(kvf__ids *t, uint32_t did) {
  if (did != KVF__NO_ID && !kvf__ids_by_vid(t, did)) return did;
  uint32_t max = 0;
  for (size_t i = 0; i < t->n; i++)
    if (t->v[i].vid > max) max = t->v[i].vid;
  return max + 1;
}

kvf__idrec *kvf__ids_add(kvf__ids *t, uint32_t did, const char *name, void *data) {
  if (t->n == t->cap) {
    size_t cap = t->cap ? 2 * t->cap : 8;
    kvf__idrec *v = realloc(t->v, cap * sizeof(*v));
    if (!v) return NULL;
    t->v = v;
    t->cap = cap;
  }
  kvf__idrec *r = &t->v[t->n];
  memset(r, 0, sizeof(*r));
  r->vid = fresh_vid(t, did);
  r->did = did;
  if (name) {
    size_t n = strnlen(name, sizeof(r->name) - 1);
    memcpy(r->name, name, n);
  }
  r->data = data;
  t->n++;
  return r;
}

void kvf__ids_drop(kvf__ids *t, uint32_t vid) {
  kvf__idrec *r = kvf__ids_by_vid(t, vid);
  if (!r) return;
  size_t i = (size_t)(r - t->v);
  memmove(r, r + 1, (t->n - i - 1) * sizeof(*r));
  t->n--;
}

uint32_t kvf__ids_out(const kvf__ids *t, uint32_t vid) {
  for (size_t i = 0; i < t->n; i++)
    if (t->v[i].vid == vid) return t->v[i].did;
  return vid;
}

bool kvf__ids_identity(const kvf__ids *t) {
  for (size_t i = 0; i < t->n; i++)
    if (t->v[i].vid != t->v[i].did) return false;
  return true;
}

void kvf__ids_free(kvf__ids *t) {
  free(t->v);
  *t = (kvf__ids){0};
}

int kvf__ids_snap(const kvf__ids *t, kvf__idsnap *s) {
  s->n = 0;
  s->identity = kvf__ids_identity(t);
  s->vid = s->inl;
  s->did = s->inl + KVF__IDSNAP_INLINE;
  if (s->identity) return 0;
  if (t->n > KVF__IDSNAP_INLINE) {
    s->vid = malloc(2 * t->n * sizeof(uint32_t));
    if (!s->vid) return -ENOMEM;
    s->did = s->vid + t->n;
  }
  for (size_t i = 0; i < t->n; i++) {
    s->vid[i] = t->v[i].vid;
    s->did[i] = t->v[i].did;
  }
  s->n = t->n;
  return 0;
}

uint32_t kvf__idsnap_out(const kvf__idsnap *s, uint32_t vid) {
  if (s->identity) return vid;
  for (size_t i = 0; i < s->n; i++)
    if (s->vid[i] == vid) return s->did[i];
  return vid;
}

void kvf__idsnap_free(kvf__idsnap *s) {
  if (s->vid != s->inl) free(s->vid);
  s->vid = s->did = NULL;
}
