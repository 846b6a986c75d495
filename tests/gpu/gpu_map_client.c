/* gpu_map_client.c - an engine process that maps a cuda:N pool through
 * libkvferry and uses the device pointer it gets (tests/gpu/run.sh runs two
 * at once against one daemon).
 *
 *   gpu_map_client SOCKET POOL write SEED          fill the first 32 MiB
 *   gpu_map_client SOCKET POOL check SEED          verify them
 *   gpu_map_client SOCKET POOL hold SEED1 SEED2 DIR
 *       write SEED1, create DIR/ready, wait for DIR/go (30 s at most), then
 *       verify SEED2 (written meanwhile by another process) - both
 *       processes hold their mappings at once.
 * Exit 0 on success. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda/cudrv.h"
#include "kvferry.h"

#define SPAN (32u << 20)

static kvf_cu cu;

static void fill(uint8_t *p, size_t n, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n; i++) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    p[i] = (uint8_t)(s >> 24);
  }
}

static int with_ctx(int dev, CUdevice *d, CUcontext *ctx) {
  if (cu.DeviceGet(d, dev) || cu.DevicePrimaryCtxRetain(ctx, *d) || cu.CtxSetCurrent(*ctx)) return -1;
  return 0;
}

static int do_write(CUdeviceptr p, uint64_t seed) {
  uint8_t *h = malloc(SPAN);
  fill(h, SPAN, seed);
  CUresult r = cu.MemcpyHtoD(p, h, SPAN);
  free(h);
  if (r) fprintf(stderr, "gpu_map_client: cuMemcpyHtoD to the mapped pool failed: %d\n", r);
  return r ? -1 : 0;
}

static int do_check(CUdeviceptr p, uint64_t seed) {
  uint8_t *h = malloc(SPAN), *want = malloc(SPAN);
  fill(want, SPAN, seed);
  CUresult r = cu.MemcpyDtoH(h, p, SPAN);
  int rc = r ? -1 : memcmp(h, want, SPAN) ? -2 : 0;
  if (r) fprintf(stderr, "gpu_map_client: cuMemcpyDtoH from the mapped pool failed: %d\n", r);
  if (rc == -2) {
    size_t i = 0;
    while (h[i] == want[i]) i++;
    fprintf(stderr, "gpu_map_client: byte %zu is 0x%02x, want 0x%02x (seed %" PRIu64 ")\n", i, h[i], want[i], seed);
  }
  free(h);
  free(want);
  return rc;
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: gpu_map_client SOCKET POOL write|check|hold SEED [SEED2 DIR]\n");
    return 2;
  }
  char err[256];
  if (kvf__cu_load(&cu, err, sizeof(err)) != 0) {
    printf("SKIP: %s\n", err);
    return 77;
  }
  kvf_client *c;
  int rc = kvf_connect(argv[1], &c);
  if (rc) {
    fprintf(stderr, "gpu_map_client: connect: %s\n", kvf_strerror(rc));
    return 1;
  }
  kvf_pool_info pi;
  if ((rc = kvf_pool_find(c, argv[2], &pi)) != 0 || strncmp(pi.kind, "cuda:", 5) != 0) {
    fprintf(stderr, "gpu_map_client: pool %s: %s\n", argv[2], rc ? kvf_strerror(rc) : "not a cuda pool");
    return 1;
  }
  void *addr = NULL;
  uint64_t size = 0;
  if ((rc = kvf_pool_map(c, pi.id, &addr, &size)) != 0) {
    fprintf(stderr, "gpu_map_client: kvf_pool_map: %s (%s)\n", kvf_strerror(rc), kvf_err_name(rc));
    return 1;
  }
  /* kvf_pool_map must leave this thread's context as it was (none) */
  CUcontext cur = (CUcontext)1;
  cu.CtxGetCurrent(&cur);
  if (cur != NULL) {
    fprintf(stderr, "gpu_map_client: kvf_pool_map changed the current CUDA context\n");
    return 1;
  }
  printf("pid %d mapped %s (%s, %" PRIu64 " bytes) at device pointer %p\n", (int)getpid(), pi.name, pi.kind, size, addr);
  fflush(stdout);
  CUdevice d;
  CUcontext ctx;
  if (with_ctx(atoi(pi.kind + 5), &d, &ctx)) return 1;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)addr;
  uint64_t seed = strtoull(argv[4], NULL, 10);
  if (strcmp(argv[3], "write") == 0) rc = do_write(p, seed);
  else if (strcmp(argv[3], "check") == 0) rc = do_check(p, seed);
  else if (strcmp(argv[3], "hold") == 0 && argc >= 7) {
    rc = do_write(p, seed);
    char path[512];
    snprintf(path, sizeof(path), "%s/ready", argv[6]);
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
    snprintf(path, sizeof(path), "%s/go", argv[6]);
    struct stat st;
    int waited = 0;
    while (rc == 0 && stat(path, &st) != 0 && waited++ < 3000) usleep(10000);
    if (rc == 0) rc = do_check(p, strtoull(argv[5], NULL, 10));
  } else {
    fprintf(stderr, "gpu_map_client: bad mode %s\n", argv[3]);
    rc = 2;
  }
  cu.DevicePrimaryCtxRelease(d);
  kvf_close(c);
  printf("%s %s: %s\n", argv[3], pi.name, rc ? "FAILED" : "ok");
  return rc ? 1 : 0;
}
