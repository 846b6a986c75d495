/* rdma_bounce.c - the rdma bounce path: transfers of pools that the NICs
 * do not reach (GPU memory without dmabuf or nvidia-peermem, or any pool
 * with gpu-direct off), staged through pinned host memory that each device
 * registers once, at start (rdma-bounce-size: half in sending chunks, half
 * in receiving slots).
 *
 * Sender. A post whose source or destination pool bounces becomes a bounce
 * ticket: its runs are claimed a chunk at a time by the progress thread of
 * its lane's QP, when that device has a free sending chunk (and, when the
 * receiver stages too, a credit). The thread copies the runs into the chunk
 * (memcpy for host pools, a GPU copy for cuda pools: the only difference)
 * and posts the writes from it; the chunk is free again when they
 * complete, so that copies of the next chunks overlap the writes of the
 * previous ones. The transfer's last write is then a zero-length
 * WRITE_WITH_IMM, after every chunk completed, as on the direct path.
 *
 * Receiver. A grant to a pool that bounces gets a few receiving slots of a
 * device (the Grant names them in a record of Grant.windows with pool
 * BOUNCE_REC_POOL: addr, rkey, slot size, device). Every chunk goes, in
 * order, on one QP to the next slot as one WRITE_WITH_IMM carrying the
 * grant's token: a header (where each run goes, and the sender's credit
 * token) and the data. The device's thread checks every run against the
 * grant's ranges, copies the slot into the pool and gives the slot back to
 * the sender with a zero-length WRITE_WITH_IMM carrying the sender's
 * credit token (a token the sender keeps in its own table of grant tokens,
 * so the two never clash). The final notice comes on the same QP after the
 * last chunk: RC order and one CQ put it after every copy.
 *
 * What a peer can reach: the staging area is registered with remote write
 * access; nothing of a bounced pool is reachable but through a grant's
 * ranges (checked before every copy). */
#include "rdma_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cuda/gpu.h"
#include "pool.h"
#include "pool_engine.h"

#define RX_SLOTS_PER_GRANT 4u
#define HDR_FIXED 16u
#define HDR_RUN 16u
#define HDR_MAX_RUNS ((BOUNCE_HDR - HDR_FIXED) / HDR_RUN)

static void put32(uint8_t *p, uint32_t v) { v = htole32(v); memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { v = htole64(v); memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }

/* gpu-direct off, for the daemon or for this pool's config line. */
bool kvf__rdma_pool_wants_bounce(const kvf__pool *p) {
  if (kvfd.cfg.gpu_direct == KVF__GDR_OFF) return true;
  return !p->owner && p->id < kvfd.cfg.n_pools && kvfd.cfg.pools[p->id].gpu_direct == KVF__GDR_OFF;
}

/* ------------------------------------------------------------ staging */

int kvf__rdma_bounce_setup(rdev *d, char *err, size_t errlen) {
  size_t len = kvfd.cfg.rdma_bounce_size, chunk = len / 16;
  if (chunk > (1u << 20)) chunk = 1u << 20;
  chunk &= ~(size_t)4095;
  if (chunk < 2 * BOUNCE_HDR) chunk = 2 * BOUNCE_HDR;
  uint32_t n = (uint32_t)(len / chunk);
  d->bb.chunk = chunk;
  d->bb.len = (size_t)n * chunk;
  d->bb.n_tx = n / 2;
  d->bb.n_rx = n - d->bb.n_tx;
  /* GPU copies reach pinned, device-mapped memory directly. */
  if (kvf__gpu_ready()) d->bb.mem = kvf__gpu_host_alloc(d->bb.len, &d->bb.alias);
  if (!d->bb.mem) {
    d->bb.alias = 0;
    void *m = mmap(NULL, d->bb.len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return snprintf(err, errlen, "%s: no memory for rdma-bounce-size", d->name), -ENOMEM;
    d->bb.mem = m;
  }
  d->bb.free_tx = calloc(d->bb.n_tx, sizeof(*d->bb.free_tx));
  d->bb.rx_used = calloc(d->bb.n_rx, 1);
  if (!d->bb.free_tx || !d->bb.rx_used) return -ENOMEM;
  for (uint32_t i = 0; i < d->bb.n_tx; i++) d->bb.free_tx[i] = (int32_t)(d->bb.n_tx - 1 - i);
  d->bb.n_free = d->bb.n_tx;
  d->bb.mr = ibv_reg_mr(d->pd, d->bb.mem, d->bb.len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!d->bb.mr) {
    int e = errno;
    snprintf(err, errlen, "registering %zu bytes of bounce staging (rdma-bounce-size) with %s failed: %s",
             d->bb.len, d->name, strerror(e));
    return -e;
  }
  return 0;
}

void kvf__rdma_bounce_free(rdev *d) {
  if (d->bb.mr) ibv_dereg_mr(d->bb.mr);
  if (d->bb.mem && d->bb.alias) kvf__gpu_host_free(d->bb.mem);
  else if (d->bb.mem) munmap(d->bb.mem, d->bb.len);
  free(d->bb.free_tx);
  free(d->bb.rx_used);
  memset(&d->bb, 0, sizeof(d->bb));
}

void kvf__rdma_bounce_chunk_free(rdev *d, int32_t chunk) {
  if (chunk >= 0) d->bb.free_tx[d->bb.n_free++] = chunk;
}

/* The copy: the one step that differs between host and GPU pools. */
static int bounce_copy(const kvf__pool *p, uint64_t off, uint8_t *stage, uint64_t alias, uint64_t len,
                       bool to_pool) {
  if (!kvf__pool_gpu(p)) /* guarded: engine memory may be a file that shrinks (pool_engine.c) */
    return to_pool ? kvf__pool_copy(p->base + off, stage, len) : kvf__pool_copy(stage, p->base + off, len);
  kvf__gpu_end pe, se = {.dev = -1, .mapped = alias != 0, .addr = alias ? alias : (uint64_t)(uintptr_t)stage,
                         .host = stage};
  kvf__pool_gpu_end(p, off, &pe);
  kvf__gpu_copy c = {.src = to_pool ? se : pe, .dst = to_pool ? pe : se, .len = len};
  const char *route;
  return kvf__gpu_copy_all(&c, 1, &route);
}

/* ------------------------------------------------------------ receiver: grants */

static bool grant_bounces(const rdma_transport *rt, const kvf__xfer *x) {
  for (size_t i = 0; i < x->dst.n; i++)
    if (x->dst.pool[i] < rt->n_pool_slots && rt->pool_bounce[x->dst.pool[i]]) return true;
  return false;
}

/* The longest run of free slots of d, up to want: its first slot in *first. */
static uint32_t free_run(const rdev *d, uint32_t want, uint32_t *first) {
  uint32_t best = 0;
  for (uint32_t i = 0; i < d->bb.n_rx;) {
    if (d->bb.rx_used[i]) {
      i++;
      continue;
    }
    uint32_t j = i;
    while (j < d->bb.n_rx && !d->bb.rx_used[j] && j - i < want) j++;
    if (j - i > best) {
      best = j - i;
      *first = i;
    }
    i = j;
  }
  return best;
}

static int reserve(rdma_transport *rt, bgrant *b);

/* The first waiting grant, b, takes slots, if there are. */
static int reserve_again(rdma_transport *rt, bgrant *b) {
  bgrant *next = b->next;
  if (reserve(rt, b) != 0) return KVF_EBUSY;
  rt->bounce.waiting = next;
  b->waiting = false;
  return 0;
}

static int reserve(rdma_transport *rt, bgrant *b) {
  uint32_t best = 0, first = 0;
  pthread_mutex_lock(&rt->bounce.lock);
  for (int i = 0; i < rt->n_devs; i++) {
    uint32_t f = 0, n = free_run(&rt->devs[i], RX_SLOTS_PER_GRANT, &f);
    if (n > best) {
      best = n;
      first = f;
      b->dev = &rt->devs[i];
    }
  }
  if (best) {
    b->first = first;
    b->n = best;
    memset(b->dev->bb.rx_used + first, 1, best);
    b->next = rt->bounce.rx;
    rt->bounce.rx = b;
    atomic_fetch_add(&rt->bounce.n_rx, 1);
  }
  pthread_mutex_unlock(&rt->bounce.lock);
  return best ? 0 : KVF_EBUSY;
}

/* The Grant's record of b's slots. */
static int fill_grant(bgrant *b, kvf__xfer *x) {
  int rc = kvf__rdma_grant_part_alloc(&x->tp_grant, 1, 0);
  if (rc) return rc; /* the caller closes the grant */
  rdev *d = b->dev;
  kvf__mw_rec r = {.pool = BOUNCE_REC_POOL,
                   .off = (uint64_t)(uintptr_t)(d->bb.mem + (size_t)(d->bb.n_tx + b->first) * d->bb.chunk),
                   .len = (uint64_t)b->n * d->bb.chunk,
                   .rkey = d->bb.mr->rkey,
                   .qpn = (uint32_t)d->bb.chunk,
                   .dev = (uint16_t)d->index};
  kvf__mw_rec_put(x->tp_grant.win, &r);
  return 0;
}

int kvf__rdma_bounce_grant_open(rgrant *g, kvf__xfer *x) {
  rdma_transport *rt = g->rt;
  if (!grant_bounces(rt, x)) return 0;
  bgrant *b = calloc(1, sizeof(*b));
  if (!b) return -ENOMEM;
  b->g = g;
  b->x = x;
  b->peer = x->peer;
  b->token = (uint32_t)x->handle;
  int rc = kvf__rangeset_build(&b->rs, &x->dst);
  if (rc) {
    free(b);
    return rc;
  }
  g->bg = b;
  x->path = "rdma-bounce";
  rt->bounce.grants++;
  if (reserve(rt, b) == 0) return fill_grant(b, x) ?: 1;
  /* Every slot is taken: the grant waits (its deadline runs) for one. */
  rt->bounce.waits++;
  b->waiting = true;
  bgrant **pp = &rt->bounce.waiting;
  while (*pp) pp = &(*pp)->next;
  *pp = b;
  return 2;
}

/* Slots came free: the waiting grants take them, oldest first. */
void kvf__rdma_on_bounce_timer(uv_timer_t *tm) {
  rdma_transport *rt = kvf__container_of(tm, rdma_transport, bounce.timer);
  while (rt->bounce.waiting) {
    bgrant *b = rt->bounce.waiting;
    if (reserve_again(rt, b) != 0) break;
    int rc = fill_grant(b, b->x);
    kvf__xfer_on_grant_ready(b->x, rc, rc ? "out of memory" : NULL);
  }
}

/* After this no thread copies into the grant's memory. */
void kvf__rdma_bounce_grant_close(rgrant *g) {
  bgrant *b = g->bg;
  if (!b) return;
  rdma_transport *rt = g->rt;
  if (b->waiting) {
    for (bgrant **pp = &rt->bounce.waiting; *pp; pp = &(*pp)->next)
      if (*pp == b) {
        *pp = b->next;
        break;
      }
  } else {
    pthread_mutex_lock(&rt->bounce.lock);
    for (bgrant **pp = &rt->bounce.rx; *pp; pp = &(*pp)->next)
      if (*pp == b) {
        *pp = b->next;
        atomic_fetch_sub(&rt->bounce.n_rx, 1);
        memset(b->dev->bb.rx_used + b->first, 0, b->n);
        break;
      }
    pthread_mutex_unlock(&rt->bounce.lock);
    /* not from inside the close: the grant that takes them goes on */
    if (rt->bounce.waiting && rt->handles) uv_timer_start(&rt->bounce.timer, kvf__rdma_on_bounce_timer, 0, 0);
  }
  kvf__rangeset_free(&b->rs);
  free(b);
  g->bg = NULL;
}

/* ------------------------------------------------------------ receiver: chunks (device thread) */

/* A zero-length WRITE_WITH_IMM with the sender's credit token, on one of
 * our dialed QPs of lk. -EAGAIN: none has room now. */
static int post_credit(rlink *lk, uint32_t token) {
  unsigned n = atomic_load(&lk->n_qps);
  for (unsigned i = 0; i < n; i++) {
    rqp *q = atomic_load(&lk->qps[i]);
    if (!q || !q->outbound || q->dead || !atomic_load(&q->ready) || q->sq_used >= q->sq_cap) continue;
    struct ibv_send_wr w = {.wr_id = q->seq + 1,
                            .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
                            .send_flags = IBV_SEND_SIGNALED,
                            .imm_data = htonl(token)},
                       *bad = NULL;
    w.wr.rdma.remote_addr = lk->n_rpools ? lk->raddr[0] : 0;
    w.wr.rdma.rkey = lk->n_rpools ? lk->rkey[0] : 0;
    if (ibv_post_send(q->qp, &w, &bad) != 0) continue;
    q->seq++;
    kvf__rdma_ring_push(q, NULL, 1, 0, false, 0, -1);
    atomic_fetch_add_explicit(&lk->dev->bb.credits, 1, memory_order_relaxed);
    return 0;
  }
  return -EAGAIN;
}

/* Checks the slot's header against b and copies its runs into place. */
static int unpack(bgrant *b, const uint8_t *s, uint8_t *data, uint64_t alias, size_t room, uint64_t *bytes) {
  if (get32(s) != BOUNCE_MAGIC) return KVF_EPROTO;
  uint32_t n = get32(s + 4), credit = get32(s + 8);
  if (n == 0 || n > HDR_MAX_RUNS || credit == 0 || (b->credit && credit != b->credit)) return KVF_EPROTO;
  b->credit = credit;
  uint64_t pos = 0;
  for (uint32_t i = 0; i < n; i++) {
    const uint8_t *h = s + HDR_FIXED + (size_t)i * HDR_RUN;
    uint32_t pool = get32(h), len = get32(h + 4);
    uint64_t off = get64(h + 8);
    const kvf__pool *p = kvf__pool_get(pool);
    if (!p || len > room - pos || !kvf__rangeset_contains(&b->rs, pool, off, len)) return KVF_ERANGE;
    int rc = bounce_copy(p, off, data + pos, alias ? alias + pos : 0, len, true);
    if (rc) return rc;
    pos += len;
  }
  *bytes = pos;
  return 0;
}

bool kvf__rdma_bounce_chunk(rlink *lk, uint32_t imm) {
  rdma_transport *rt = lk->rp->rt;
  if (atomic_load(&rt->bounce.n_rx) == 0) return false;
  pthread_mutex_lock(&rt->bounce.lock);
  bgrant *b = rt->bounce.rx;
  while (b && (b->token != imm || b->peer != lk->rp->p)) b = b->next;
  if (!b) {
    pthread_mutex_unlock(&rt->bounce.lock);
    return false;
  }
  rdev *d = b->dev;
  int rc = KVF_EPROTO;
  uint64_t bytes = 0;
  if (d == lk->dev) {
    size_t at = (size_t)(d->bb.n_tx + b->first + b->next_slot) * d->bb.chunk;
    b->next_slot = (b->next_slot + 1) % b->n;
    rc = unpack(b, d->bb.mem + at, d->bb.mem + at + BOUNCE_HDR, d->bb.alias ? d->bb.alias + at + BOUNCE_HDR : 0,
                d->bb.chunk - BOUNCE_HDR, &bytes);
  }
  if (rc == 0 && post_credit(lk, b->credit) != 0) b->owed++;
  pthread_mutex_unlock(&rt->bounce.lock);
  if (rc) {
    kvf__rdma_fail_peer_soon(lk->rp, "rdma: a bounce chunk from %s for grant %08x cannot be placed (%s)",
                             peer_name(lk->rp), imm, rc == KVF_ERANGE ? "outside the grant" : "bad header");
    return true;
  }
  atomic_fetch_add_explicit(&d->bb.rx_bytes, bytes, memory_order_relaxed);
  atomic_fetch_add_explicit(&d->bb.rx_chunks, 1, memory_order_relaxed);
  return true;
}

/* Credits that found no room on a QP when their chunk was placed. */
void kvf__rdma_bounce_pay_credits(rlink *lk) {
  rdma_transport *rt = lk->rp->rt;
  if (atomic_load(&rt->bounce.n_rx) == 0) return;
  pthread_mutex_lock(&rt->bounce.lock);
  for (bgrant *b = rt->bounce.rx; b; b = b->next)
    while (b->owed && b->dev == lk->dev && b->peer == lk->rp->p && post_credit(lk, b->credit) == 0) b->owed--;
  pthread_mutex_unlock(&rt->bounce.lock);
}

/* ------------------------------------------------------------ sender */

void kvf__rdma_bounce_credit(rdma_transport *rt, rgrant *marker) {
  xbounce *xb = marker->credit_of;
  atomic_fetch_add(&xb->credits, 1);
  rpeer *rp = rpeer_of(rt, marker->peer);
  for (int i = 0; rp && i < rp->n_links; i++) kvf__rdma_wake(rp->links[i]->dev);
}

static bool rx_record(const kvf__xfer *x, kvf__mw_rec *r) {
  size_t n = x->tp_grant.win_len / KVF__MW_REC;
  if (n == 0) return false;
  kvf__mw_rec_get(x->tp_grant.win + (n - 1) * KVF__MW_REC, r);
  return r->pool == BOUNCE_REC_POOL;
}

bool kvf__rdma_bounce_staged(const kvf__xfer *x) {
  kvf__mw_rec r;
  return rx_record(x, &r);
}

/* Our dialed QP, ready, on a link to the peer's device dev (by index in
 * its Hello; -1: any), the k-th such. */
static rqp *pick_qp(const rpeer *rp, int dev, unsigned k) {
  const Kvf__RdmaInfo *ri = rp->p->hello ? rp->p->hello->rdma : NULL;
  rqp *v[64];
  unsigned n = 0;
  for (int i = 0; i < rp->n_links; i++) {
    rlink *lk = rp->links[i];
    if (dev >= 0 && (!ri || (size_t)dev >= ri->n_devices || !ri->devices[dev]->name ||
                     strcmp(ri->devices[dev]->name, lk->peer_dev) != 0))
      continue;
    for (unsigned j = 0; j < lk->n_all && n < 64; j++) {
      rqp *q = lk->all[j];
      if (q->outbound && !q->gone && q->qp && atomic_load(&q->ready)) v[n++] = q;
    }
  }
  return n ? v[k % n] : NULL;
}

static rqp *qp_by_id(const rpeer *rp, int dev, uint32_t qpn) {
  for (int i = 0; i < rp->n_links; i++) {
    rlink *lk = rp->links[i];
    if (lk->dev->index != dev) continue;
    for (unsigned j = 0; j < lk->n_all; j++) {
      rqp *q = lk->all[j];
      if (q->outbound && !q->gone && q->qp && q->qp_num == qpn) return q;
    }
  }
  return NULL;
}

/* The transfer's staging at the receiver, and our credit token (kept in
 * our table of grant tokens, so that no grant of ours can take it). */
static int xbounce_make(rdma_transport *rt, rpeer *rp, kvf__xfer *x, const kvf__mw_rec *r, xstate *xs) {
  if (r->qpn <= BOUNCE_HDR || r->len < r->qpn) return KVF_EPROTO;
  xbounce *xb = calloc(1, sizeof(*xb));
  rgrant *m = calloc(1, sizeof(*m));
  if (!xb || !m) {
    free(xb);
    free(m);
    return -ENOMEM;
  }
  xb->rt = rt;
  xb->addr = r->off;
  xb->rkey = r->rkey;
  xb->slot = r->qpn;
  xb->n_slots = (uint32_t)(r->len / r->qpn);
  xb->dev = r->dev;
  xb->token = (uint32_t)x->handle;
  atomic_store(&xb->credits, (int)xb->n_slots);
  xb->q = pick_qp(rp, r->dev, (unsigned)rt->bounce.sends);
  if (!xb->q) {
    free(xb);
    free(m);
    return KVF_EPEERLOST;
  }
  xb->qdev = xb->q->lk->dev->index;
  xb->qpn = xb->q->qp_num;
  m->rt = rt;
  m->peer = x->peer;
  m->credit_of = xb;
  char key[16];
  int rc;
  do {
    xb->credit = (uint32_t)random() ^ ((uint32_t)random() << 16);
    grant_key(key, sizeof(key), xb->credit);
  } while (xb->credit == 0 || (rc = kvf__map_put(&rt->grants, key, m)) == -EEXIST);
  if (rc) {
    free(xb);
    free(m);
    return rc;
  }
  xs->xb = xb;
  return 0;
}

void kvf__rdma_bounce_xstate_free(rdma_transport *rt, xstate *xs) {
  xbounce *xb = xs->xb;
  if (!xb) return;
  char key[16];
  grant_key(key, sizeof(key), xb->credit);
  free(kvf__map_del(&rt->grants, key));
  free(xb);
  xs->xb = NULL;
}

/* Whether the post bounces: a source pool of ours or a destination pool of
 * the peer's that the NICs do not reach. */
bool kvf__rdma_bounce_wanted(const rpeer *rp, const kvf__xfer *x, const kvf__runs *runs, uint64_t *cap) {
  const rdma_transport *rt = rp->rt;
  kvf__mw_rec r;
  bool rx = rx_record(x, &r), any = rx;
  for (size_t i = 0; !any && i < runs->n; i++)
    any = (runs->v[i].src_pool < rt->n_pool_slots && rt->pool_bounce[runs->v[i].src_pool]) ||
          (runs->v[i].dst_pool < rp->n_pools && rp->pool_bounce[runs->v[i].dst_pool]);
  size_t chunk = rt->devs[0].bb.chunk;
  *cap = rx ? (r.qpn < chunk ? r.qpn : chunk) - BOUNCE_HDR : chunk;
  return any;
}

int kvf__rdma_bounce_ticket(ticket *tk, rpeer *rp, kvf__xfer *x, xstate *xs, bool *windows) {
  rdma_transport *rt = rp->rt;
  kvf__mw_rec r;
  bool rx = rx_record(x, &r);
  *windows = false;
  for (size_t i = 0; !rx && i < tk->n_runs; i++)
    if (rp->pool_bounce[tk->runs[i].dst_pool]) return KVF_ENOPOOL; /* its grant named no staging */
  tk->bounce = true;
  x->path = "rdma-bounce";
  if (tk->has_tail) { /* every run is a chunk's; the notice goes alone, after them */
    tk->n_body = tk->n_runs;
    memset(&tk->tail, 0, sizeof(tk->tail));
    tk->total = tk->n_body + 1;
  }
  if (!rx && x->tp_grant.win_len) {
    *windows = true; /* the lanes of the grant's memory windows */
    return 0;
  }
  rqp *q;
  if (rx) {
    int rc = xs->xb ? 0 : xbounce_make(rt, rp, x, &r, xs);
    if (rc) return rc;
    /* a later post of the transfer: its QP, if it is still there */
    q = qp_by_id(rp, xs->xb->qdev, xs->xb->qpn);
    if (!q) return KVF_EPEERLOST;
    xs->xb->q = q;
    tk->xb = xs->xb;
    tk->tail_q = q;
    tk->tail_dev = q->lk->dev;
    tk->tail_qpn = q->qp_num;
    tk->tail_devi = (uint16_t)q->lk->dev->index;
  } else {
    q = pick_qp(rp, -1, (unsigned)rt->bounce.sends);
    if (!q) return KVF_EPEERLOST;
  }
  rt->bounce.sends++;
  tk->lanes = calloc(1, sizeof(*tk->lanes));
  if (!tk->lanes) return -ENOMEM;
  tk->lanes[0] = (lane){q, 0, tk->n_body};
  tk->n_lanes = 1;
  tk->left = tk->n_body;
  return 0;
}

/* ------------------------------------------------------------ sender (device thread) */

size_t kvf__rdma_bounce_fit(const rdev *d, const ticket *tk, size_t first, size_t avail) {
  uint64_t cap = tk->xb ? (tk->xb->slot < d->bb.chunk ? tk->xb->slot : d->bb.chunk) - BOUNCE_HDR : d->bb.chunk;
  size_t max = tk->xb ? HDR_MAX_RUNS : CHAIN_MAX, n = 0;
  uint64_t bytes = 0;
  while (n < avail && n < max) {
    const kvf__run *r = &tk->runs[tk->order ? tk->order[first + n] : first + n];
    if (bytes + r->len > cap) break;
    bytes += r->len;
    n++;
  }
  return n ? n : 1; /* runs are sliced to fit a chunk */
}

int kvf__rdma_bounce_post(rlink *lk, rqp *q, ticket *tk, size_t first, size_t cnt) {
  uint64_t t0 = kvf__rdma_fast_ns();
  rdev *d = lk->dev;
  int32_t c = d->bb.free_tx[--d->bb.n_free];
  size_t at = (size_t)c * d->bb.chunk;
  uint8_t *mem = d->bb.mem + at;
  uint64_t alias = d->bb.alias ? d->bb.alias + at : 0;
  xbounce *xb = tk->xb;
  uint64_t pos = xb ? BOUNCE_HDR : 0;
  for (size_t i = 0; i < cnt; i++) {
    size_t j = tk->order ? tk->order[first + i] : first + i;
    const kvf__run *r = &tk->runs[j];
    const kvf__pool *p = kvf__pool_get(r->src_pool);
    int rc = p ? bounce_copy(p, r->src_off, mem + pos, alias ? alias + pos : 0, r->len, false) : KVF_ENOPOOL;
    if (rc) {
      kvf__rdma_bounce_chunk_free(d, c);
      kvf__rdma_credit(tk, cnt, rc < 0 ? rc : -EIO);
      kvf__rdma_fail_peer_soon(lk->rp, "rdma: copying a bounce chunk for %s failed: %s", peer_name(lk->rp),
                               strerror(rc < 0 ? -rc : EIO));
      return rc;
    }
    if (xb) {
      uint8_t *h = mem + HDR_FIXED + i * HDR_RUN;
      put32(h, r->dst_pool);
      put32(h + 4, (uint32_t)r->len);
      put64(h + 8, r->dst_off);
    } else {
      struct ibv_sge *s = &q->sge[i];
      struct ibv_send_wr *w = &q->wr[i];
      w->sg_list = s; /* a gathered chain before may have left others */
      w->num_sge = 1;
      s->addr = (uintptr_t)(mem + pos);
      s->length = (uint32_t)r->len;
      s->lkey = d->bb.mr->lkey;
      w->send_flags = 0;
      w->wr.rdma.remote_addr = lk->raddr[r->dst_pool] + r->dst_off;
      w->wr.rdma.rkey = tk->rkeys ? tk->rkeys[j] : lk->rkey[r->dst_pool];
    }
    pos += r->len;
  }
  size_t n = cnt;
  if (xb) { /* one write of header and data to the next slot, with the grant's token */
    put32(mem, BOUNCE_MAGIC);
    put32(mem + 4, (uint32_t)cnt);
    put32(mem + 8, xb->credit);
    put32(mem + 12, (uint32_t)(pos - BOUNCE_HDR));
    struct ibv_send_wr *w = &q->wr[0];
    q->sge[0] = (struct ibv_sge){.addr = (uintptr_t)mem, .length = (uint32_t)pos, .lkey = d->bb.mr->lkey};
    w->sg_list = &q->sge[0];
    w->num_sge = 1;
    w->send_flags = 0;
    w->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    w->imm_data = htonl(xb->token);
    w->wr.rdma.remote_addr = xb->addr + (uint64_t)(xb->next++ % xb->n_slots) * xb->slot;
    w->wr.rdma.rkey = xb->rkey;
    n = 1;
  }
  q->wr[n - 1].next = NULL;
  uint64_t bytes = pos - (xb ? BOUNCE_HDR : 0);
  atomic_fetch_add_explicit(&d->bb.tx_bytes, bytes, memory_order_relaxed);
  atomic_fetch_add_explicit(&d->bb.tx_chunks, 1, memory_order_relaxed);
  return kvf__rdma_doorbell(lk, q, tk, n, (uint32_t)cnt, false, t0, pos, c);
}
