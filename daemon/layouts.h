/* layouts.h - the KV layouts clients registered (layout.h has what a layout
 * is): ids, owners, freeing with the client, and listing. A transfer holds
 * a layout while it uses it, so a client may free one under a transfer.
 * Loop thread. */
#ifndef KVF_LAYOUTS_H
#define KVF_LAYOUTS_H

#include "layout.h"

#define KVF__LAYOUTS_PER_CLIENT 256u

/* Validates *l against its pool and registers it (taking l->offsets):
 * KVF_ENOPOOL, KVF_ERANGE, KVF_EINVAL (err says why), KVF_ELIMIT past
 * KVF__LAYOUTS_PER_CLIENT of owner's. */
int kvf__layouts_add(kvf__session *owner, kvf__layout *l, uint32_t *id, char *err, size_t errlen);
/* owner's layout id, or NULL. */
kvf__layout *kvf__layouts_get(const kvf__session *owner, uint32_t id);
/* KVF_ENOENT when owner has no layout id. */
int kvf__layouts_free(kvf__session *owner, uint32_t id);
void kvf__layouts_session_gone(kvf__session *owner);
/* owner's layouts on pool: freed (the pool goes, kvf_mem_unregister). */
void kvf__layouts_pool_gone(kvf__session *owner, uint32_t pool);
void kvf__layout_hold(kvf__layout *l);
void kvf__layout_release(kvf__layout *l);
/* Registered layouts, oldest first (freed ones still held are not listed). */
kvf__layout *kvf__layouts_first(void);
kvf__layout *kvf__layouts_next(const kvf__layout *l);

#endif
