/* gpu_test.h - what the GPU test programs share: a failure check that
 * counts and returns, a seeded xorshift, a clock and a median. */
#ifndef KVF_GPU_TEST_H
#define KVF_GPU_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda/cudrv.h"

/* Says what failed, counts it in `failures` (the file's), returns -1. */
#define CHECK(cond, ...)                     \
  do {                                       \
    if (!(cond)) {                           \
      fprintf(stderr, "FAIL: " __VA_ARGS__); \
      fprintf(stderr, "\n");                 \
      failures++;                            \
      return -1;                             \
    }                                        \
  } while (0)

static inline uint64_t gt_xorshift(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static inline double gt_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static inline int gt_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Sorts v. */
static inline double gt_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof(*v), gt_cmp_double);
  return v[n / 2];
}

/* Loads the CUDA driver into *cu: 0, or 77 (the suite's skip) said on
 * stdout when there is none. */
static inline int gt_load_driver(kvf_cu *cu) {
  char err[256];
  if (kvf__cu_load(cu, err, sizeof(err)) == 0) return 0;
  printf("SKIP: no CUDA driver: %s\n", err);
  return 77;
}

#endif
