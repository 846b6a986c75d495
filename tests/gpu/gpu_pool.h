/* gpu_pool.h - what the block-copy programs (gpu_blocks, gpu_xform) share:
 * a cuda pool with the host's picture of it, read back and compared whole,
 * and one block copy (kvf__gpu_blocks_start) started and waited for. A
 * program that includes this takes its driver table `cu` and its failure
 * count `failures` (gpu_test.h's CHECK) from here. */
#ifndef KVF_GPU_POOL_H
#define KVF_GPU_POOL_H

#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#include "cuda/cudrv.h"
#include "cuda/gpu.h"
#include "gpu_test.h"

static kvf_cu cu;
static int failures;

/* A cuda pool on cuda:0 and what it must hold. */
typedef struct gt_pool {
  const char *name;
  kvf__gpu_mem mem;
  uint8_t *want; /* what the pool must hold */
  uint8_t *got;  /* read back */
  uint64_t size;
} gt_pool;

/* Filled from rng, or with a pattern of its offsets when rng is NULL. */
static inline int gt_pool_new(gt_pool *p, const char *name, uint64_t size, uint64_t *rng) {
  char err[300];
  memset(p, 0, sizeof(*p));
  p->name = name;
  CHECK(kvf__gpu_mem_alloc(0, size, &p->mem, err, sizeof(err)) == 0, "alloc %s: %s", name, err);
  p->size = size;
  p->want = malloc(size);
  p->got = malloc(size);
  CHECK(p->want && p->got, "malloc %s", name);
  for (uint64_t i = 0; i + 8 <= size; i += 8) {
    uint64_t v = rng ? gt_xorshift(rng) : 0xa5a5a5a5a5a5a5a5ull ^ i;
    memcpy(p->want + i, &v, 8);
  }
  CHECK(cu.MemcpyHtoD(p->mem.dptr, p->want, size) == 0, "HtoD %s", name);
  return 0;
}

static inline void gt_pool_free(gt_pool *p) {
  kvf__gpu_mem_free(&p->mem);
  free(p->want);
  free(p->got);
}

/* Reads p back whole and compares it with p->want. */
static inline int gt_pool_verify(gt_pool *p, const char *what) {
  CHECK(cu.MemcpyDtoH(p->got, p->mem.dptr, p->size) == 0, "DtoH %s", p->name);
  if (memcmp(p->got, p->want, p->size) == 0) return 0;
  uint64_t bad = 0;
  while (p->got[bad] == p->want[bad]) bad++;
  CHECK(0, "%s: %s byte %" PRIu64 " is 0x%02x, want 0x%02x", what, p->name, bad, p->got[bad], p->want[bad]);
}

/* Block copies' callbacks. */
typedef struct gt_waiter {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int calls, rc;
  float ms;
} gt_waiter;

static gt_waiter gt_W = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static inline void gt_on_done(void *arg, int rc, float ms) {
  gt_waiter *w = arg;
  pthread_mutex_lock(&w->mu);
  w->calls++;
  w->rc = rc;
  w->ms = ms;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Starts j, waits for its callback (exactly one, rc 0); *ms: the kernel's
 * time, *host_us: the start call's (either may be NULL). */
static inline int gt_blocks_run(const kvf__gpu_blocks *j, const char *name, float *ms, double *host_us) {
  pthread_mutex_lock(&gt_W.mu);
  int before = gt_W.calls;
  pthread_mutex_unlock(&gt_W.mu);
  double t0 = gt_now_us();
  int rc = kvf__gpu_blocks_start(j, gt_on_done, &gt_W);
  if (host_us) *host_us = gt_now_us() - t0;
  CHECK(rc == 0, "%s: kvf__gpu_blocks_start: %d", name, rc);
  pthread_mutex_lock(&gt_W.mu);
  while (gt_W.calls == before) pthread_cond_wait(&gt_W.cv, &gt_W.mu);
  int calls = gt_W.calls - before;
  rc = gt_W.rc;
  if (ms) *ms = gt_W.ms;
  pthread_mutex_unlock(&gt_W.mu);
  CHECK(calls == 1 && rc == 0, "%s: %d callbacks, rc %d", name, calls, rc);
  return 0;
}

#endif
