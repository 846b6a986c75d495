/* desc_bench - what the daemon spends per descriptor of a SendReq frame
 * before a transport sees it: protobuf unpack, kvf__descs_from_wire, the
 * range check against the pools, and kvf__pair against a grant, on a
 * frame of N scattered 32 KiB descriptors, REPS times; the same process
 * allocates and frees as the daemon does for each request.
 *
 *   desc-bench [N REPS] [--keep]
 *
 * --keep applies the daemon's heap policy (kvf__keep_freed_memory);
 * without it, glibc's defaults. Prints ns per descriptor for each step. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "desc.h"
#include "kvferry.pb-c.h"
#include "kvferryd.h"

#define POOL_BYTES (2ull << 30)
#define BLOCK 32768u

static int in_pool(void *ctx, uint32_t pool, uint64_t off, uint64_t len) {
  return pool == 0 && off <= POOL_BYTES && len <= POOL_BYTES - off ? 0 : -1;
}

static uint64_t lcg(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

int main(int argc, char **argv) {
  size_t n = argc > 1 && argv[1][0] != '-' ? strtoull(argv[1], NULL, 10) : 4096;
  int reps = argc > 2 && argv[2][0] != '-' ? atoi(argv[2]) : 200;
  if (argc > 1 && strcmp(argv[argc - 1], "--keep") == 0) kvf__keep_freed_memory();
  if (n == 0 || reps <= 0) return 2;
  uint64_t seed = 1, slots = POOL_BYTES / BLOCK;
  uint8_t *packed = malloc(n * KVF__DESC_WIRE_SIZE);
  for (size_t i = 0; i < n; i++) {
    uint32_t pool = 0;
    uint64_t off = lcg(&seed) % slots * BLOCK, len = BLOCK;
    memcpy(packed + i * KVF__DESC_WIRE_SIZE, &pool, 4); /* little-endian hosts, as the wire */
    memcpy(packed + i * KVF__DESC_WIRE_SIZE + 4, &off, 8);
    memcpy(packed + i * KVF__DESC_WIRE_SIZE + 12, &len, 8);
  }
  Kvf__DescList dl = KVF__DESC_LIST__INIT;
  dl.packed.data = packed;
  dl.packed.len = n * KVF__DESC_WIRE_SIZE;
  Kvf__SendReq sr = KVF__SEND_REQ__INIT;
  sr.xfer_id = "req-1";
  sr.dst_node = "decode";
  sr.descs = &dl;
  Kvf__ApiRequest q = KVF__API_REQUEST__INIT;
  q.body_case = KVF__API_REQUEST__BODY_SEND;
  q.send = &sr;
  size_t len = kvf__api_request__get_packed_size(&q);
  uint8_t *frame = malloc(len);
  kvf__api_request__pack(&q, frame);
  kvf__descs grant;
  if (kvf__descs_from_wire(&grant, &dl, n) != 0) return 1;
  for (size_t i = 0; i < n; i++) grant.offset[i] = lcg(&seed) % slots * BLOCK;
  uint64_t t[4] = {0};
  for (int r = 0; r < reps; r++) {
    uint64_t t0 = kvf__now_ns();
    Kvf__ApiRequest *u = kvf__api_request__unpack(NULL, len, frame);
    uint64_t t1 = kvf__now_ns();
    kvf__descs d;
    if (!u || kvf__descs_from_wire(&d, u->send->descs, n) != 0) return 1;
    uint64_t t2 = kvf__now_ns();
    size_t bad;
    if (kvf__descs_check(&d, in_pool, NULL, &bad) != 0) return 1;
    uint64_t t3 = kvf__now_ns();
    size_t cursor = 0;
    kvf__runs runs = {0};
    if (kvf__pair(&d, &grant, &cursor, &runs) != 0) return 1;
    uint64_t t4 = kvf__now_ns();
    t[0] += t1 - t0, t[1] += t2 - t1, t[2] += t3 - t2, t[3] += t4 - t3;
    kvf__runs_free(&runs);
    kvf__descs_free(&d);
    kvf__api_request__free_unpacked(u, NULL);
  }
  double k = (double)reps * (double)n;
  printf("{\"descriptors\": %zu, \"reps\": %d, \"heap\": \"%s\", \"unpack_ns\": %.1f, \"from_wire_ns\": %.1f, "
         "\"check_ns\": %.1f, \"pair_ns\": %.1f}\n",
         n, reps, strcmp(argv[argc - 1], "--keep") == 0 ? "kept" : "glibc defaults", t[0] / k, t[1] / k, t[2] / k,
         t[3] / k);
  kvf__descs_free(&grant);
  free(frame);
  free(packed);
  return 0;
}
