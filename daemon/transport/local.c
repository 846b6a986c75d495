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
 * local-h2d, ... */
#include "transport.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/gpu.h"
#include "pool.h"
#include "xfer.h"

typedef struct copy_job {
  uv_work_t req;
  kvf__xfer *x;
  kvf__runs runs;
  bool last;
  bool gpu;               /* a run touches a cuda pool */
  kvf__gpu_copy *v;       /* gpu: the runs as copies, built once on the loop */
  int rc;
  uint64_t t_post, t_start, t_built, t_copied; /* for the debug trace */
  float kernel_ms;
  struct copy_job *next;  /* on L.done */
} copy_job;

/* Posts launched on the loop and finished by the GPU, back to the loop. */
static struct {
  uv_async_t async;
  bool async_open;
  bool closing;           /* destroy came: close the handle once idle */
  size_t in_flight;       /* launched, not yet back on the loop */
  pthread_mutex_t mu;
  copy_job *done;         /* finished, newest first (under mu) */
} L = {.mu = PTHREAD_MUTEX_INITIALIZER};

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

static void do_copy(uv_work_t *req) {
  copy_job *j = req->data;
  if (!j->gpu) {
    j->t_start = kvf__now_ns();
    for (size_t i = 0; i < j->runs.n; i++) {
      const kvf__run *r = &j->runs.v[i];
      memcpy(kvfd.pools[r->dst_pool]->base + r->dst_off, kvfd.pools[r->src_pool]->base + r->src_off, r->len);
    }
    return;
  }
  const char *route; /* j->v was built on the loop (local_post) */
  j->rc = kvf__gpu_copy_all(j->v, j->runs.n, &route);
  j->t_copied = kvf__now_ns();
  j->kernel_ms = kvf__gpu_last_kernel_ms();
}

/* "local-<how>" for a post's runs: how the first run touching a GPU moves,
 * or "local-mixed" when runs differ. */
static const char *gpu_path(const kvf__runs *runs) {
  static const struct { const char *link, *path; } names[] = {
      {"nvlink", "local-nvlink"}, {"pcie-p2p", "local-pcie-p2p"}, {"same-gpu", "local-same-gpu"},
      {"staged", "local-staged"}, {"h2d", "local-h2d"}, {"d2h", "local-d2h"},
  };
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
  for (size_t k = 0; link && k < sizeof(names) / sizeof(names[0]); k++)
    if (strcmp(names[k].link, link) == 0) return names[k].path;
  return NULL;
}

/* Back on the loop: the post is done (status: the thread pool's own). */
static void finish_job(copy_job *j, int status) {
  if (j->gpu)
    kvf__debug("local %s: %zu runs, %llu bytes: queued %.0f us, built %.0f us, copied %.0f us (kernel %.0f us), "
               "back on the loop %.0f us", j->x->path ? j->x->path : "local", j->runs.n,
               (unsigned long long)j->runs.bytes, (double)(j->t_start - j->t_post) / 1e3,
               (double)(j->t_built - j->t_start) / 1e3, (double)(j->t_copied - j->t_built) / 1e3,
               (double)j->kernel_ms * 1e3, (double)(kvf__now_ns() - j->t_copied) / 1e3);
  kvf__xfer_on_posted(j->x, status ? KVF_ECANCELED : j->rc, j->last);
  kvf__runs_free(&j->runs);
  free(j->v);
  free(j);
}

static void after_copy(uv_work_t *req, int status) { finish_job(req->data, status); }

/* The GPU finished a post launched on the loop (gpu.c's completion
 * thread): queue it for the loop. */
static void on_gpu_done(void *arg, int rc, float kernel_ms) {
  copy_job *j = arg;
  j->rc = rc;
  j->kernel_ms = kernel_ms;
  j->t_copied = kvf__now_ns();
  pthread_mutex_lock(&L.mu);
  j->next = L.done;
  L.done = j;
  pthread_mutex_unlock(&L.mu);
  uv_async_send(&L.async);
}

static void on_async_closed(uv_handle_t *h) { L.async_open = false; }

/* The handle keeps the loop running only while posts are in flight. */
static void on_async(uv_async_t *a) {
  pthread_mutex_lock(&L.mu);
  copy_job *list = L.done;
  L.done = NULL;
  pthread_mutex_unlock(&L.mu);
  copy_job *fifo = NULL; /* in the order they finished */
  while (list) {
    copy_job *next = list->next;
    list->next = fifo;
    fifo = list;
    list = next;
  }
  while (fifo) {
    copy_job *next = fifo->next;
    finish_job(fifo, 0);
    if (--L.in_flight == 0) uv_unref((uv_handle_t *)&L.async);
    fifo = next;
  }
  if (L.closing && L.in_flight == 0 && !uv_is_closing((uv_handle_t *)&L.async))
    uv_close((uv_handle_t *)&L.async, on_async_closed);
}

/* Launches j's copies from the loop when one launch moves them all; else
 * (or on any failure to launch) the caller runs j on the thread pool. */
static int start_on_loop(copy_job *j) {
  if (L.closing) return -EAGAIN;
  if (!L.async_open) {
    if (uv_async_init(kvfd.loop, &L.async, on_async) != 0) return -EAGAIN;
    L.async_open = true;
    uv_unref((uv_handle_t *)&L.async);
  }
  int rc = kvf__gpu_copy_start(j->v, j->runs.n, on_gpu_done, j);
  if (rc) return rc;
  if (L.in_flight++ == 0) uv_ref((uv_handle_t *)&L.async);
  return 0;
}

static int local_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) {
  copy_job *j = calloc(1, sizeof(*j));
  if (!j) return -ENOMEM;
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
  int rc = uv_queue_work(kvfd.loop, &j->req, do_copy, after_copy);
  if (rc) {
    *runs = j->runs;
    free(j->v);
    free(j);
  }
  return rc;
}

/* A copy in flight finishes quickly; its callback completes the abort. */
static void local_abort(kvf__transport *t, kvf__xfer *x) {}
static int local_grant_open(kvf__transport *t, kvf__xfer *x) { return 0; }
static void local_grant_close(kvf__transport *t, kvf__xfer *x) {}
static int local_peer_up(kvf__transport *t, kvf__peer *p) { return 0; }
static void local_peer_down(kvf__transport *t, kvf__peer *p) {}
static void local_inspect(kvf__transport *t, char *buf, size_t len) {
  snprintf(buf, len, "\"name\": \"local\", \"engine\": \"%s\"",
           kvf__gpu_ready() ? "memcpy, cuda batched kernel" : "memcpy");
}
static void local_destroy(kvf__transport *t) {
  L.closing = true;
  if (L.async_open && L.in_flight == 0 && !uv_is_closing((uv_handle_t *)&L.async))
    uv_close((uv_handle_t *)&L.async, on_async_closed);
}

static const kvf__transport_ops local_ops = {
    .name = "local",
    .post = local_post,
    .abort = local_abort,
    .grant_open = local_grant_open,
    .grant_close = local_grant_close,
    .peer_up = local_peer_up,
    .peer_down = local_peer_down,
    .inspect = local_inspect,
    .destroy = local_destroy,
};

int kvf__local_create(kvf__transport **out) {
  static kvf__transport t = {.ops = &local_ops};
  *out = &t;
  return 0;
}
