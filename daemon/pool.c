/* pool.c - host pools: memfd (hugetlb when available), MAP_SHARED, mlocked
 * best effort. The fd is what clients map; wire addresses are offsets. */
#include "pool.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvferry.h"
#include "log.h"

#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif
#define HUGE_2M (2ull << 20)

/* memfd with hugetlb when asked and the size is a multiple of 2 MiB. Huge
 * pages must be reserved by the admin (vm.nr_hugepages); when they are not,
 * ftruncate or the first touch fails, so we fall back to normal pages. */
static int make_memfd(const char *name, uint64_t size, int hugepages, char *backing, size_t blen) {
  if (hugepages != KVF__OFF && size % HUGE_2M == 0) {
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_HUGETLB);
    if (fd >= 0 && ftruncate(fd, (off_t)size) == 0) {
      void *probe = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
      if (probe != MAP_FAILED) {
        munmap(probe, size);
        snprintf(backing, blen, "memfd-hugetlb");
        return fd;
      }
    }
    if (fd >= 0) close(fd);
    if (hugepages == KVF__ON) return -ENOMEM;
  }
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return -errno;
  if (ftruncate(fd, (off_t)size) != 0) {
    int e = -errno;
    close(fd);
    return e;
  }
  snprintf(backing, blen, "memfd");
  return fd;
}

int kvf__pool_create(const kvf__pool_cfg *pc, uint32_t id, int hugepages, bool want_mlock,
                     kvf__pool **out, char *err, size_t errlen) {
  if (strcmp(pc->kind, "host") != 0) {
    snprintf(err, errlen, "pool %s: kind %s is not supported by this build (GPU pools need the CUDA support)",
             pc->name, pc->kind);
    return -ENOTSUP;
  }
  kvf__pool *p = calloc(1, sizeof(*p));
  if (!p) return -ENOMEM;
  p->id = id;
  p->size = pc->size;
  snprintf(p->name, sizeof(p->name), "%s", pc->name);
  snprintf(p->kind, sizeof(p->kind), "%s", pc->kind);
  char memname[96];
  snprintf(memname, sizeof(memname), "kvferry-pool-%s", pc->name);
  p->fd = make_memfd(memname, p->size, hugepages, p->backing, sizeof(p->backing));
  if (p->fd < 0) {
    int e = p->fd;
    snprintf(err, errlen, "pool %s: cannot allocate %llu bytes: %s", pc->name,
             (unsigned long long)pc->size, strerror(-e));
    free(p);
    return e;
  }
  p->base = mmap(NULL, p->size, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, 0);
  if (p->base == MAP_FAILED) {
    int e = -errno;
    snprintf(err, errlen, "pool %s: mmap: %s", pc->name, strerror(errno));
    close(p->fd);
    free(p);
    return e;
  }
  /* Pinned memory keeps the data path free of page faults and is what NIC
   * registration needs; without the privilege we still run, and say so. */
  if (want_mlock) {
    p->locked = mlock(p->base, p->size) == 0;
    if (!p->locked)
      kvf__warn("pool %s: mlock of %llu bytes failed (%s); raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity)",
                p->name, (unsigned long long)p->size, strerror(errno));
  }
  *out = p;
  return 0;
}

void kvf__pool_destroy(kvf__pool *p) {
  if (!p) return;
  munmap(p->base, p->size);
  close(p->fd);
  free(p);
}

int kvf__pool_check_range(const kvf__pool *p, uint64_t offset, uint64_t len) {
  if (len == 0) return KVF_EINVAL;
  if (offset > p->size || len > p->size - offset) return KVF_ERANGE;
  return 0;
}
