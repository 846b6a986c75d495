/* rdma_engine.c - pools that come after start (engine memory,
 * kvf_mem_register): registered with every device when they come
 * (pool_added), deregistered when they go (pool_removed), and made known to
 * the peers, whose Hello came before them, by the grants that name them.
 *
 * The per-pool arrays of the instance and its devices (pool_base,
 * pool_bounce, mrs, lkey) and of the peers' links (raddr, rkey) hold
 * KVF__POOLS_MAX slots from the start, so that a pool that comes never
 * moves what a progress thread reads.
 *
 * Grants. A grant to one of our pools that our Hello did not list carries,
 * after its memory windows (Grant.windows, sorted last), one MR record per
 * (pool, device): pool KVF__MR_REC_POOL, off the pool's address on that
 * device, len its size, rkey its rkey (0 with memory windows), qpn the
 * pool's id, dev the device's index in our Hello. The sender reads them
 * before it posts (kvf__rdma_learn_mrs) into the same tables the Hello
 * filled. */
#include "rdma_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

/* ------------------------------------------------------------ pool_added / pool_removed */

static void unregister_pool(rdma_transport *rt, uint32_t id) {
  for (int i = 0; i < rt->n_devs; i++) {
    rdev *d = &rt->devs[i];
    if (d->mrs[id]) ibv_dereg_mr(d->mrs[id]);
    d->mrs[id] = NULL;
    d->lkey[id] = 0;
  }
  rt->pool_base[id] = NULL;
  rt->pool_bounce[id] = false;
}

int kvf__rdma_pool_added(kvf__transport *t, kvf__pool *p, char *err, size_t errlen) {
  rdma_transport *rt = to_rdma(t);
  if (p->id >= rt->n_pool_slots) return snprintf(err, errlen, "pool id %u is past the rdma tables", p->id), -E2BIG;
  unregister_pool(rt, p->id); /* a slot used before: nothing of the last pool stays */
  for (int i = 0; i < rt->n_devs; i++) {
    int rc = kvf__rdma_register_pool(&rt->devs[i], p, err, errlen);
    if (rc) {
      unregister_pool(rt, p->id);
      return rc;
    }
  }
  rt->pool_base[p->id] = p->base;
  rt->any_gpu |= kvf__pool_gpu(p);
  return 0;
}

/* The transfers that named p are gone (they hold engine pools), so no post
 * and no bounce copy touches it any more. */
void kvf__rdma_pool_removed(kvf__transport *t, kvf__pool *p) {
  rdma_transport *rt = to_rdma(t);
  if (p->id < rt->n_pool_slots) unregister_pool(rt, p->id);
}

/* ------------------------------------------------------------ receiver: the MRs a grant carries */

/* Our pools of x's grant that our Hello did not list, and are registered. */
static size_t unlisted_pools(const rdma_transport *rt, const kvf__xfer *x, uint32_t *ids, size_t cap) {
  static uint8_t seen[KVF__POOLS_MAX];
  size_t n = 0;
  for (size_t i = 0; i < x->dst.n && n < cap; i++) {
    uint32_t id = x->dst.pool[i];
    if (id < rt->n_hello_pools || id >= rt->n_pool_slots || seen[id] || rt->pool_bounce[id] || !rt->devs[0].mrs[id])
      continue;
    seen[id] = 1;
    ids[n++] = id;
  }
  for (size_t i = 0; i < n; i++) seen[ids[i]] = 0;
  return n;
}

int kvf__rdma_grant_add_mrs(rdma_transport *rt, kvf__xfer *x) {
  uint32_t ids[64];
  size_t n = unlisted_pools(rt, x, ids, 64);
  if (n == 0) return 0;
  size_t k = n * (size_t)rt->n_devs, old = x->tp_grant.win_len;
  uint8_t *w = realloc(x->tp_grant.win, old + k * KVF__MW_REC);
  if (!w) return -ENOMEM;
  x->tp_grant.win = w;
  if (!x->tp_grant.of) x->tp_grant.of = malloc(1); /* window_of stays empty */
  if (!x->tp_grant.of) return -ENOMEM;
  for (size_t i = 0; i < n; i++)
    for (int j = 0; j < rt->n_devs; j++) {
      const kvf__pool *p = kvf__pool_get(ids[i]);
      const struct ibv_mr *mr = rt->devs[j].mrs[ids[i]];
      kvf__mw_rec r = {.pool = KVF__MR_REC_POOL,
                       .off = (uint64_t)(uintptr_t)p->base,
                       .len = p->size,
                       .rkey = rt->mw.on ? 0 : mr->rkey,
                       .qpn = ids[i],
                       .dev = (uint16_t)j};
      kvf__mw_rec_put(w + old + (i * (size_t)rt->n_devs + (size_t)j) * KVF__MW_REC, &r);
    }
  x->tp_grant.win_len = old + k * KVF__MW_REC;
  return 0;
}

/* ------------------------------------------------------------ sender */

size_t kvf__rdma_window_records(const kvf__tp_grant *g) {
  size_t n = g->win_len / KVF__MW_REC;
  while (n > 0) {
    kvf__mw_rec r;
    kvf__mw_rec_get(g->win + (n - 1) * KVF__MW_REC, &r);
    if (r.pool < KVF__MR_REC_POOL) break;
    n--;
  }
  return n;
}

int kvf__rdma_learn_mrs(rpeer *rp, const kvf__xfer *x) {
  const Kvf__RdmaInfo *ri = rp->p->hello ? rp->p->hello->rdma : NULL;
  size_t n = x->tp_grant.win_len / KVF__MW_REC;
  for (size_t i = kvf__rdma_window_records(&x->tp_grant); i < n; i++) {
    kvf__mw_rec r;
    kvf__mw_rec_get(x->tp_grant.win + i * KVF__MW_REC, &r);
    if (r.pool != KVF__MR_REC_POOL) continue; /* the bounce record */
    if (r.qpn >= KVF__POOLS_MAX || !ri || r.dev >= ri->n_devices || !ri->devices[r.dev]->name) return KVF_EPROTO;
    rp->pool_size[r.qpn] = r.len;
    rp->pool_bounce[r.qpn] = false;
    if (r.qpn >= rp->n_pools) rp->n_pools = r.qpn + 1;
    for (int l = 0; l < rp->n_links; l++) {
      rlink *lk = rp->links[l];
      if (strcmp(lk->peer_dev, ri->devices[r.dev]->name) != 0) continue;
      lk->raddr[r.qpn] = r.off;
      lk->rkey[r.qpn] = r.rkey;
    }
  }
  return 0;
}
