/* local.c - the local transport: both ends are clients of this daemon, so a
 * transfer is a copy from one pool to another. Host to host is memcpy on
 * libuv's thread pool, so the loop keeps serving. Anything touching a cuda
 * pool goes to daemon/cuda/gpu.c, which moves all of a post's scattered
 * blocks with one batched gather/scatter kernel launch (over NVLink/PCIe
 * peer access, or to and from host pools registered with CUDA), or stages
 * through pinned host memory when two GPUs cannot reach each other. A post
 * that one launch moves is launched right here on the loop, so its first
 * block moves without a thread hop, and completes through gpu.c's
 * completion thread and an async handle; the others run on the thread
 * pool. The transfer's path says which way: local-nvlink, local-staged,
 * local-h2d, ...
 *
 * Blocks (KV layouts) between two cuda pools that a GPU reaches go to the
 * block kernel (kvf__gpu_blocks_start) with the two layouts' offset tables,
 * uploaded at registration, and the block ids: the GPU computes every
 * address, so posting does not grow with the number of layers. Such a
 * copy launches at the end of the loop turn that posted it, so that the
 * following parts of the same transfer that the turn read (an engine
 * sending layer by layer faster than one launch a layer) go in the same
 * launch: a layer's kernel takes about as long as a launch's host work,
 * and one launch per part would leave the GPU waiting for the host. Other
 * blocks (host pools, GPUs without peer access) are walked into runs. */
#include "local.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "cuda/gpu.h"
#include "pool.h"
#include "pool_engine.h"
#include "spin.h"
#include "xfer.h"

typedef struct local_transport local_transport;

typedef struct copy_job {
  uv_work_t req;
  kvf__mail mail;         /* launched on the loop: the GPU's completion */
  local_transport *lt;
  kvf__xfer *x;
  kvf__runs runs;
  bool last;
  bool gpu;               /* a run touches a cuda pool */
  bool blocks;            /* a block copy (no runs): pieces and bytes below */
  uint64_t pieces, bytes;
  kvf__gpu_copy *v;       /* gpu: the runs as copies, built once on the loop */
  bool xform;             /* host pools, a transform: walked on the thread pool, no run list */
  kvf__bpart part;        /* ... its part (views and ids: the transfer's, alive until the callback) */
  kvf__gpu_blocks g;      /* blocks: the launch, held until the end of the loop turn */
  unsigned parts;         /* blocks: the transfer's parts it moves (consecutive layers) */
  int rc;
  uint64_t t_post, t_start, t_built, t_copied; /* for the debug trace */
  float kernel_ms;
} copy_job;

struct local_transport {
  kvf__transport base;
  kvf__mailbox mb;        /* posts launched on the loop, finished by the GPU */
  size_t in_flight;       /* launched, not yet back on the loop */
  bool closing;           /* destroy came: close the mailbox once idle */
  uv_check_t turn_end;    /* launches held: */
  copy_job *held;         /* a block copy waiting for the end of the loop turn */
  bool mb_closed, turn_closed; /* destroy: freed once both handles closed */
  double kernel_ns_per_byte; /* the last GPU copy measured; 0: none yet */
};

static local_transport *to_local(kvf__transport *t) { return kvf__container_of(t, local_transport, base); }

/* The copies of a post's runs, built once, whichever way they then go
 * (launched from the loop, or on the thread pool). */
static kvf__gpu_copy *gpu_copies(const kvf__runs *runs) {
  kvf__gpu_copy *v = malloc((runs->n ? runs->n : 1) * sizeof(*v));
  if (!v) return NULL;
  /* The ends at offset 0 of the pools of the previous run, reused. */
  uint32_t sp = UINT32_MAX, dp = UINT32_MAX;
  kvf__gpu_end s0 = {0}, d0 = {0};
  for (size_t i = 0; i < runs->n; i++) {
    const kvf__run *r = &runs->v[i];
    kvf__gpu_copy *c = &v[i];
    if (r->src_pool != sp) kvf__pool_gpu_end(kvfd.pools[sp = r->src_pool], 0, &s0);
    if (r->dst_pool != dp) kvf__pool_gpu_end(kvfd.pools[dp = r->dst_pool], 0, &d0);
    c->src = s0;
    c->src.addr += r->src_off;
    if (s0.host) c->src.host += r->src_off;
    c->dst = d0;
    c->dst.addr += r->dst_off;
    if (d0.host) c->dst.host += r->dst_off;
    c->len = r->len;
  }
  return v;
}

/* One run of a host transform's walk. */
static void xform_copy(void *arg, uint64_t so, uint64_t dof, uint64_t len, uint32_t piece) {
  copy_job *j = arg;
  if (j->rc == 0)
    j->rc = kvf__pool_copy(kvfd.pools[j->part.dst->pool]->base + dof, kvfd.pools[j->part.src->pool]->base + so, len);
}

static void do_copy(uv_work_t *req) {
  copy_job *j = req->data;
  if (j->xform) { /* the plan's runs straight into memcpy, off the loop */
    j->t_start = kvf__now_ns();
    int rc = kvf__xform_walk(&j->part.xf, j->part.src, j->part.sids, j->part.dst, j->part.dids, j->part.first,
                             j->part.n_layers, xform_copy, j);
    if (rc) j->rc = rc;
    return;
  }
  if (!j->gpu) {
    j->t_start = kvf__now_ns();
    /* guarded: engine memory may be a file its engine shrinks (pool_engine.c) */
    for (size_t i = 0; i < j->runs.n && j->rc == 0; i++) {
      const kvf__run *r = &j->runs.v[i];
      j->rc = kvf__pool_copy(kvfd.pools[r->dst_pool]->base + r->dst_off, kvfd.pools[r->src_pool]->base + r->src_off,
                             r->len);
    }
    return;
  }
  const char *route; /* j->v was built on the loop (local_post) */
  j->rc = kvf__gpu_copy_all(j->v, j->runs.n, &route);
  j->t_copied = kvf__now_ns();
  j->kernel_ms = kvf__gpu_last_kernel_ms();
}

/* "local-<link>" for a link of kvf__gpu_link (or h2d, d2h); NULL for none. */
static const char *link_path(const char *link) {
  static const struct { const char *link, *path; } names[] = {
      {"nvlink", "local-nvlink"}, {"pcie-p2p", "local-pcie-p2p"}, {"same-gpu", "local-same-gpu"},
      {"staged", "local-staged"}, {"h2d", "local-h2d"}, {"d2h", "local-d2h"},
  };
  for (size_t k = 0; link && k < sizeof(names) / sizeof(names[0]); k++)
    if (strcmp(names[k].link, link) == 0) return names[k].path;
  return NULL;
}

/* "local-<how>" for a post's runs: how the first run touching a GPU moves,
 * or "local-mixed" when runs differ. */
static const char *gpu_path(const kvf__runs *runs) {
  const char *link = NULL;
  uint32_t sp = UINT32_MAX, dp = UINT32_MAX;
  for (size_t i = 0; i < runs->n; i++) {
    if (runs->v[i].src_pool == sp && runs->v[i].dst_pool == dp) continue; /* judged already */
    sp = runs->v[i].src_pool;
    dp = runs->v[i].dst_pool;
    const kvf__pool *s = kvfd.pools[sp], *d = kvfd.pools[dp];
    const char *l;
    if (kvf__pool_gpu(s) && kvf__pool_gpu(d)) l = kvf__gpu_link(s->cuda_dev, d->cuda_dev);
    else if (kvf__pool_gpu(d)) l = "h2d";
    else if (kvf__pool_gpu(s)) l = "d2h";
    else continue;
    if (link && strcmp(link, l) != 0) return "local-mixed";
    link = l;
  }
  return link_path(link);
}

/* The bytes j moves (blocks or runs). */
static uint64_t job_bytes(const copy_job *j) { return j->blocks ? j->bytes : j->runs.bytes; }

/* Back on the loop: the post is done (status: the thread pool's own). */
static void finish_job(copy_job *j, int status) {
  if (j->gpu)
    kvf__debug("local %s: %llu %s, %llu bytes: queued %.0f us, built %.0f us, copied %.0f us (kernel %.0f us), "
               "back on the loop %.0f us", j->x->path ? j->x->path : "local",
               (unsigned long long)(j->blocks ? j->pieces : j->runs.n), j->blocks ? "block pieces" : "runs",
               (unsigned long long)job_bytes(j), (double)(j->t_start - j->t_post) / 1e3,
               (double)(j->t_built - j->t_start) / 1e3, (double)(j->t_copied - j->t_built) / 1e3,
               (double)j->kernel_ms * 1e3, (double)(kvf__now_ns() - j->t_copied) / 1e3);
  int st = status ? KVF_ECANCELED : j->rc;
  for (unsigned k = 1; k < j->parts; k++) kvf__xfer_on_posted(j->x, st, false); /* x lives until the last */
  kvf__xfer_on_posted(j->x, st, j->last);
  kvf__runs_free(&j->runs);
  free(j->v);
  free(j);
}

static void after_copy(uv_work_t *req, int status) { finish_job(req->data, status); }

static void local_free_if_closed(local_transport *lt) {
  if (lt->mb_closed && lt->turn_closed) free(lt);
}

static void local_free(kvf__mailbox *mb) {
  local_transport *lt = kvf__container_of(mb, local_transport, mb);
  lt->mb_closed = true;
  local_free_if_closed(lt);
}

static void on_turn_end_closed(uv_handle_t *h) {
  local_transport *lt = kvf__container_of((uv_check_t *)h, local_transport, turn_end);
  lt->turn_closed = true;
  local_free_if_closed(lt);
}

/* Back on the loop from the GPU. The mailbox keeps the loop running only
 * while launches are in flight. */
static void on_launch_done(kvf__mail *m) {
  copy_job *j = kvf__container_of(m, copy_job, mail);
  local_transport *lt = j->lt;
  if (j->rc == 0 && j->kernel_ms > 0 && job_bytes(j))
    lt->kernel_ns_per_byte = (double)j->kernel_ms * 1e6 / (double)job_bytes(j);
  finish_job(j, 0);
  if (--lt->in_flight == 0) kvf__mailbox_hold(&lt->mb, false);
  if (lt->closing && lt->in_flight == 0) kvf__mailbox_close(&lt->mb, local_free);
}

/* The GPU finished a post launched on the loop (gpu.c's completion
 * thread): hand it to the loop. */
static void on_gpu_done(void *arg, int rc, float kernel_ms) {
  copy_job *j = arg;
  j->rc = rc;
  j->kernel_ms = kernel_ms;
  j->t_copied = kvf__now_ns();
  kvf__mailbox_post(&j->lt->mb, &j->mail, on_launch_done);
}

/* j, the copy of a send's last part, was launched: a local receiver's
 * engine is told its event is near when the copy should take at most
 * KVF__SOON_MAX_US (at the rate of the last copy measured), so that its
 * library polls for the event instead of sleeping: after a long layer's
 * compute its threads slept, and the event would pay their wake-up. */
static void tell_soon(local_transport *lt, const copy_job *j) {
  const kvf__xfer *r = j->x->twin;
  if (!j->last || !r || !r->owner || lt->kernel_ns_per_byte <= 0) return;
  kvf__api_soon_estimated(r->owner, r->id, (double)job_bytes(j) * lt->kernel_ns_per_byte / 1e3);
}

/* Launches j's copies from the loop when one launch moves them all; else
 * (or on any failure to launch) the caller runs j on the thread pool. */
static int start_on_loop(copy_job *j) {
  local_transport *lt = j->lt;
  if (lt->closing) return -EAGAIN;
  int rc = kvf__gpu_copy_start(j->v, j->runs.n, on_gpu_done, j);
  if (rc) return rc;
  tell_soon(lt, j);
  kvf__spin_expect_gpu();
  if (lt->in_flight++ == 0) kvf__mailbox_hold(&lt->mb, true);
  return 0;
}

static int local_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) {
  copy_job *j = calloc(1, sizeof(*j));
  if (!j) return -ENOMEM;
  j->lt = to_local(t);
  j->x = x;
  j->runs = *runs; /* take the runs: the caller frees an empty shell */
  memset(runs, 0, sizeof(*runs));
  j->last = last;
  j->req.data = j;
  j->t_post = kvf__now_ns();
  const char *path = gpu_path(&j->runs);
  if (path) {
    j->gpu = true;
    x->path = path;
    if (x->twin) x->twin->path = path;
    j->t_start = kvf__now_ns();
    j->v = gpu_copies(&j->runs);
    j->t_built = kvf__now_ns();
    if (!j->v) {
      *runs = j->runs;
      free(j);
      return -ENOMEM;
    }
  }
  if (j->gpu && start_on_loop(j) == 0) return 0;
  int rc = uv_queue_work(t->loop, &j->req, do_copy, after_copy);
  if (rc) {
    *runs = j->runs;
    free(j->v);
    free(j);
  }
  return rc;
}

/* The held copy launches: at the end of the loop turn, or when another
 * transfer's copy is to be held. A transfer that failed meanwhile waits
 * for it as for any copy in flight (its memory stays until the callback). */
static void launch_held(local_transport *lt) {
  copy_job *j = lt->held;
  if (!j) return;
  lt->held = NULL;
  uv_check_stop(&lt->turn_end);
  j->t_start = j->t_built = kvf__now_ns();
  int rc = kvf__gpu_blocks_start(&j->g, on_gpu_done, j);
  if (rc) { /* its parts were taken: they end here, failed */
    j->rc = rc;
    j->gpu = false; /* nothing ran: no kernel figures */
    finish_job(j, 0);
    return;
  }
  tell_soon(lt, j);
  kvf__spin_expect_gpu();
  if (lt->in_flight++ == 0) kvf__mailbox_hold(&lt->mb, true);
}

static void on_turn_end(uv_check_t *h) { launch_held(kvf__container_of(h, local_transport, turn_end)); }

/* Part b of x joins the held copy when it continues it: the same
 * transfer, blocks and layouts, the next layers, whole blocks, and the
 * kernel still takes the sum. */
static bool join_held(local_transport *lt, kvf__xfer *x, const kvf__bpart *b, bool last) {
  copy_job *j = lt->held;
  if (!j || j->x != x || j->last || b->xf.transform || j->part.xf.transform || b->src != j->part.src ||
      b->dst != j->part.dst || b->src_layout != j->part.src_layout || b->dst_layout != j->part.dst_layout ||
      b->sids != j->part.sids || b->dids != j->part.dids || b->n != j->part.n ||
      b->first != j->part.first + j->part.n_layers)
    return false;
  kvf__gpu_blocks g = j->g;
  g.n_layers += b->n_layers;
  if (kvf__gpu_blocks_check(&g) != 0) return false;
  j->g = g;
  j->part.n_layers += b->n_layers;
  j->parts++;
  j->last = last;
  j->pieces += (uint64_t)b->n * b->n_layers * b->src->n_kv;
  j->bytes += (uint64_t)b->n * b->n_layers * b->src->n_kv * b->src->block_bytes;
  return true;
}

/* Holds g (part b of x) for the end of the loop turn; a copy held for
 * another transfer launches now. */
static int hold_blocks(local_transport *lt, kvf__xfer *x, const kvf__bpart *b, const kvf__gpu_blocks *g, bool last) {
  copy_job *j = calloc(1, sizeof(*j));
  if (!j) return -ENOMEM;
  launch_held(lt);
  j->lt = lt;
  j->x = x;
  j->last = last;
  j->gpu = j->blocks = true;
  j->part = *b;
  j->g = *g;
  if (j->g.xf) j->g.xf = &j->part.xf; /* b is the caller's */
  j->parts = 1;
  j->pieces = (uint64_t)b->n * b->n_layers * b->src->n_kv;
  j->bytes = g->xf ? kvf__xplan_bytes(g->xf, b->n_layers, b->src->n_kv) : j->pieces * b->src->block_bytes;
  j->t_post = kvf__now_ns();
  lt->held = j;
  uv_check_start(&lt->turn_end, on_turn_end);
  return 0;
}

/* b by the block kernel when both layouts sit in cuda pools with their
 * tables on the GPU; -EAGAIN when it cannot take them (the caller walks
 * runs). Completes as local_post's launches do. */
static int start_blocks(local_transport *lt, kvf__xfer *x, const kvf__bpart *b, bool last) {
  const kvf__lview *s = b->src, *d = b->dst;
  if (lt->closing || !b->src_layout || !b->dst_layout || !b->src_layout->gpu || !b->dst_layout->gpu ||
      !kvf__pool_gpu(kvfd.pools[s->pool]) || !kvf__pool_gpu(kvfd.pools[d->pool]))
    return -EAGAIN;
  if (b->n_layers == 0 || b->first < s->first_layer || b->first < d->first_layer ||
      b->first + b->n_layers > s->first_layer + s->n_layers || b->first + b->n_layers > d->first_layer + d->n_layers)
    return KVF_ERANGE;
  if ((!b->xf.transform && s->block_bytes != d->block_bytes) || s->n_kv != d->n_kv) return KVF_ESIZE;
  /* a transform: one launch of the transform kernel, addresses on the GPU */
  kvf__gpu_blocks g = {.block_bytes = s->block_bytes, .n_layers = b->n_layers, .n_kv = s->n_kv, .n = b->n,
                       .xf = b->xf.transform ? &b->xf : NULL};
  kvf__transport_block_side(s, b->src_layout, b->sids, b->first, &g.src);
  kvf__transport_block_side(d, b->dst_layout, b->dids, b->first, &g.dst);
  if (!join_held(lt, x, b, last)) {
    int rc = kvf__gpu_blocks_check(&g);
    if (rc) return rc == -EINVAL ? -EAGAIN : rc; /* sizes the kernel does not take: runs */
    if ((rc = hold_blocks(lt, x, b, &g, last)) != 0) return rc;
  }
  const char *path = link_path(kvf__gpu_link(g.src.dev, g.dst.dev));
  x->path = path;
  if (x->twin) x->twin->path = path;
  return 0;
}

/* A transform between host pools: walked on the thread pool, each run a
 * memcpy, so the loop neither walks nor holds a run per piece (NHD <-> HND
 * is one run per token and head). -EAGAIN: not that case. */
static int start_host_xform(local_transport *lt, kvf__xfer *x, const kvf__bpart *b, bool last) {
  if (!b->xf.transform || kvf__pool_gpu(kvfd.pools[b->src->pool]) || kvf__pool_gpu(kvfd.pools[b->dst->pool]))
    return -EAGAIN;
  copy_job *j = calloc(1, sizeof(*j));
  if (!j) return -ENOMEM;
  j->lt = lt;
  j->x = x;
  j->last = last;
  j->xform = true;
  j->part = *b;
  j->req.data = j;
  j->t_post = kvf__now_ns();
  int rc = uv_queue_work(lt->base.loop, &j->req, do_copy, after_copy);
  if (rc) free(j);
  return rc;
}

static int local_post_blocks(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last) {
  int rc = start_blocks(to_local(t), x, b, last);
  if (rc == -EAGAIN) rc = start_host_xform(to_local(t), x, b, last);
  return rc == -EAGAIN ? kvf__transport_post_block_runs(t, x, b, last) : rc;
}

/* A copy in flight finishes quickly; its callback completes the abort, so
 * abort, grants and peers keep the defaults (nothing to do). */
static void local_inspect(kvf__transport *t, char *buf, size_t len) {
  snprintf(buf, len, "\"name\": \"local\", \"engine\": \"%s\"",
           kvf__gpu_ready() ? (kvf__gpu_blocks_kernel() ? "memcpy, cuda batched kernel, cuda block kernel"
                                                         : "memcpy, cuda batched kernel")
                            : "memcpy");
}
/* Launches still in flight close the mailbox when the last one is back. */
static void local_destroy(kvf__transport *t) {
  local_transport *lt = to_local(t);
  launch_held(lt);
  uv_close((uv_handle_t *)&lt->turn_end, on_turn_end_closed);
  lt->closing = true;
  if (lt->in_flight == 0) kvf__mailbox_close(&lt->mb, local_free);
}

static const kvf__transport_ops local_ops = {
    .name = "local",
    .post = local_post,
    .pool_added = kvf__transport_pool_mapped,
    .post_blocks = local_post_blocks,
    .inspect = local_inspect,
    .destroy = local_destroy,
};

int kvf__local_create(uv_loop_t *loop, unsigned slot, kvf__transport **out, char *err, size_t errlen) {
  local_transport *lt = calloc(1, sizeof(*lt));
  if (!lt) return -ENOMEM;
  kvf__transport_init(&lt->base, &local_ops, loop, slot);
  int rc = kvf__mailbox_init(&lt->mb, loop);
  if (rc) {
    snprintf(err, errlen, "cannot set up the local transport's mailbox: %s", uv_strerror(rc));
    free(lt);
    return rc;
  }
  kvf__mailbox_hold(&lt->mb, false); /* only while launches are out */
  uv_check_init(loop, &lt->turn_end);
  *out = &lt->base;
  return 0;
}
