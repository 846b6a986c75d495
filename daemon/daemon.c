/* daemon.c - the daemon's one global context and its clock. Kept apart from
 * main.c so unit tests link every module without the program's main. */
#include <time.h>

#include "kvferryd.h"

kvf__daemon kvfd;

uint64_t kvf__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
