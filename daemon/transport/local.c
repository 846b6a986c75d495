/* local.c - the local transport: both ends are clients of this daemon, so a
 * transfer is a memcpy from one pool to another. The copies run on libuv's
 * thread pool so the loop keeps serving; CUDA pools will add a batched
 * gather/scatter kernel here. */
#include "transport.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "xfer.h"

typedef struct copy_job {
  uv_work_t req;
  kvf__xfer *x;
  kvf__runs runs;
  bool last;
} copy_job;

static void do_copy(uv_work_t *req) {
  copy_job *j = req->data;
  for (size_t i = 0; i < j->runs.n; i++) {
    const kvf__run *r = &j->runs.v[i];
    memcpy(kvfd.pools[r->dst_pool]->base + r->dst_off, kvfd.pools[r->src_pool]->base + r->src_off, r->len);
  }
}

static void after_copy(uv_work_t *req, int status) {
  copy_job *j = req->data;
  kvf__xfer_on_posted(j->x, status ? KVF_ECANCELED : 0, j->last);
  kvf__runs_free(&j->runs);
  free(j);
}

static int local_post(kvf__transport *t, kvf__xfer *x, kvf__runs *runs, bool last) {
  copy_job *j = calloc(1, sizeof(*j));
  if (!j) return -ENOMEM;
  j->x = x;
  j->runs = *runs; /* take the runs: the caller frees an empty shell */
  memset(runs, 0, sizeof(*runs));
  j->last = last;
  j->req.data = j;
  int rc = uv_queue_work(kvfd.loop, &j->req, do_copy, after_copy);
  if (rc) {
    *runs = j->runs;
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
  snprintf(buf, len, "\"name\": \"local\", \"engine\": \"memcpy\"");
}
static void local_destroy(kvf__transport *t) {}

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
