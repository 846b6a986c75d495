/* daemon.c - the daemon's one global context, its clock and its heap
 * policy. Kept apart from main.c so unit tests and benchmarks link every
 * module without the program's main. */
#include <malloc.h>
#include <time.h>

#include "kvferryd.h"

kvf__daemon kvfd;

uint64_t kvf__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Every request allocates and frees descriptor lists and runs of up to a
 * few MiB. With glibc's defaults the larger ones are fresh mmaps and freed
 * heap tops go back to the kernel, so each request faults its memory in
 * again, a page at a time; in a VM those faults were most of the daemon's
 * cost per descriptor (bench/desc_bench.c, bench/RESULTS.md). The daemon
 * keeps what it freed instead: its peak stays bounded by max-frame and the
 * transfers in flight. */
void kvf__keep_freed_memory(void) {
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}
