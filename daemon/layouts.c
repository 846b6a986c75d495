/* layouts.c - registered KV layouts (layouts.h). */
#include "layouts.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/gpu.h"
#include "kvferryd.h"
#include "pool.h"
#include "pool_engine.h"

typedef struct entry {
  kvf__layout l;
  struct entry *prev, *next;   /* registered and not freed, oldest first */
} entry;

static struct {
  entry *head, *tail;
  uint32_t next_id;
} Y;

static entry *entry_of(const kvf__layout *l) { return (entry *)l; }

static size_t owned_by(const kvf__session *owner) {
  size_t n = 0;
  for (entry *e = Y.head; e; e = e->next) n += e->l.owner == owner;
  return n;
}

int kvf__layouts_add(kvf__session *owner, kvf__layout *l, uint32_t *id, char *err, size_t errlen) {
  const kvf__pool *p = kvf__pool_get(l->pool);
  if (!kvf__pool_usable_by(p, owner)) {
    snprintf(err, errlen, "layout: no pool %u", l->pool);
    return KVF_ENOPOOL;
  }
  int rc = kvf__layout_validate(l, p->size, err, errlen);
  if (rc) return rc;
  if (owned_by(owner) >= KVF__LAYOUTS_PER_CLIENT) {
    snprintf(err, errlen, "this client has %u layouts registered", KVF__LAYOUTS_PER_CLIENT);
    return KVF_ELIMIT;
  }
  entry *e = calloc(1, sizeof(*e));
  if (!e) return -ENOMEM;
  e->l = *l;
  e->l.id = ++Y.next_id ? Y.next_id : ++Y.next_id; /* 0 is never an id */
  e->l.owner = owner;
  e->l.refs = 1;
  if (kvf__pool_gpu(p)) {
    rc = kvf__gpu_layout_upload(p->cuda_dev, e->l.offsets, (size_t)l->n_layers * l->n_kv,
                                &e->l.gpu);
    if (rc) {
      snprintf(err, errlen, "layout: cannot put its offsets on the GPU: %s", kvf_strerror(rc));
      free(e);
      return rc;
    }
  }
  l->offsets = NULL; /* taken */
  e->prev = Y.tail;
  if (Y.tail) Y.tail->next = e;
  else Y.head = e;
  Y.tail = e;
  *id = e->l.id;
  return 0;
}

kvf__layout *kvf__layouts_get(const kvf__session *owner, uint32_t id) {
  for (entry *e = Y.head; e; e = e->next)
    if (e->l.id == id && e->l.owner == owner) return &e->l;
  return NULL;
}

void kvf__layout_hold(kvf__layout *l) { l->refs++; }

void kvf__layout_release(kvf__layout *l) {
  if (--l->refs > 0) return;
  kvf__gpu_layout_free(l->gpu);
  free(l->offsets);
  free(entry_of(l));
}

static void unlist(entry *e) {
  if (e->prev) e->prev->next = e->next;
  else Y.head = e->next;
  if (e->next) e->next->prev = e->prev;
  else Y.tail = e->prev;
  e->l.owner = NULL;
  kvf__layout_release(&e->l);
}

int kvf__layouts_free(kvf__session *owner, uint32_t id) {
  kvf__layout *l = kvf__layouts_get(owner, id);
  if (!l) return KVF_ENOENT;
  unlist(entry_of(l));
  return 0;
}

void kvf__layouts_session_gone(kvf__session *owner) {
  for (entry *e = Y.head, *next; e; e = next) {
    next = e->next;
    if (e->l.owner == owner) unlist(e);
  }
}

void kvf__layouts_pool_gone(kvf__session *owner, uint32_t pool) {
  for (entry *e = Y.head, *next; e; e = next) {
    next = e->next;
    if (e->l.owner == owner && e->l.pool == pool) unlist(e);
  }
}

kvf__layout *kvf__layouts_first(void) { return Y.head ? &Y.head->l : NULL; }

kvf__layout *kvf__layouts_next(const kvf__layout *l) {
  entry *e = entry_of(l)->next;
  return e ? &e->l : NULL;
}
