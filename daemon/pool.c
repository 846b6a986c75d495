/* pool.c - host pools: memfd (hugetlb when available), MAP_SHARED, mlocked
 * best effort. cuda:N pools: cuMemCreate on GPU N, exported as a POSIX fd
 * (daemon/cuda/gpu.c). The fd is what clients map; wire addresses are
 * offsets. */
#include "pool.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda/gpu.h"
#include "kvferry.h"
#include "kvferryd.h"
#include "log.h"
#include "pool_engine.h"

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

/* GPU N's memory, mapped in the daemon, exported as a POSIX fd. */
static int create_cuda(kvf__pool *p, int dev, uint64_t size, char *err, size_t errlen) {
  if (!kvf__gpu_ready()) {
    snprintf(err, errlen, "pool %s: kind %s needs CUDA, which is unavailable here: %s", p->name, p->kind,
             kvf__gpu_why());
    return -ENODEV;
  }
  kvf__gpu_mem m;
  char why[300];
  int rc = kvf__gpu_mem_alloc(dev, size, &m, why, sizeof(why));
  if (rc) {
    snprintf(err, errlen, "pool %s: %s", p->name, why);
    return rc;
  }
  if (m.size != size)
    kvf__info("pool %s: %llu bytes rounded up to %llu (the GPU's allocation granularity)", p->name,
              (unsigned long long)size, (unsigned long long)m.size);
  p->size = m.size;
  p->fd = m.fd;
  p->base = (uint8_t *)(uintptr_t)m.dptr;
  p->cu_handle = m.handle;
  p->locked = true; /* device memory is never paged */
  snprintf(p->backing, sizeof(p->backing), m.gdr_flag ? "cumem-gdr" : "cumem");
  return 0;
}

static int cuda_dev_of(const char *kind) {
  if (strncmp(kind, "cuda:", 5) != 0) return -1;
  return atoi(kind + 5); /* the config parser checked "cuda:N" */
}

int kvf__pool_create(const kvf__pool_cfg *pc, uint32_t id, int hugepages, bool want_mlock,
                     kvf__pool **out, char *err, size_t errlen) {
  int dev = cuda_dev_of(pc->kind);
  if (strcmp(pc->kind, "host") != 0 && dev < 0) {
    snprintf(err, errlen, "pool %s: kind %s is not supported", pc->name, pc->kind);
    return -ENOTSUP;
  }
  kvf__pool *p = calloc(1, sizeof(*p));
  if (!p) return -ENOMEM;
  p->id = id;
  p->size = pc->size;
  p->cuda_dev = dev;
  snprintf(p->nic_reg, sizeof(p->nic_reg), "none");
  snprintf(p->name, sizeof(p->name), "%s", pc->name);
  snprintf(p->kind, sizeof(p->kind), "%s", pc->kind);
  if (dev >= 0) {
    int rc = create_cuda(p, dev, pc->size, err, errlen);
    if (rc) {
      free(p);
      return rc;
    }
    *out = p;
    return 0;
  }
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
  /* With GPUs here, kernels read and write host pools directly (one launch
   * for host<->GPU transfers too); without registration such copies go
   * through pageable cuMemcpy, which works, slowly, and is said once. */
  if (kvf__gpu_ready() && kvf__gpu_host_register(p->base, p->size, &p->dev_alias) != 0) {
    p->dev_alias = 0;
    kvf__warn("pool %s: cannot register with CUDA; host<->GPU copies from it will be slow", p->name);
  }
  *out = p;
  return 0;
}

void kvf__pool_destroy(kvf__pool *p) {
  if (!p) return;
  if (kvf__pool_gpu(p)) {
    kvf__gpu_mem m = {.dev = p->cuda_dev, .size = p->size, .dptr = (uint64_t)(uintptr_t)p->base,
                      .handle = p->cu_handle, .fd = p->fd};
    kvf__gpu_mem_free(&m);
    free(p);
    return;
  }
  if (p->dev_alias) kvf__gpu_host_unregister(p->base);
  munmap(p->base, p->size);
  close(p->fd);
  free(p);
}

int kvf__pool_dmabuf(const kvf__pool *p, int *fd, uint64_t *offset) {
  if (!kvf__pool_gpu(p)) return -EINVAL;
  if (p->engine) return kvf__pool_engine_dmabuf(p, fd, offset);
  kvf__gpu_mem m = {.dev = p->cuda_dev, .size = p->size, .dptr = (uint64_t)(uintptr_t)p->base,
                    .handle = p->cu_handle, .fd = p->fd};
  return kvf__gpu_mem_dmabuf(&m, fd, offset);
}

void kvf__pool_gpu_end(const kvf__pool *p, uint64_t offset, struct kvf__gpu_end *e) {
  e->dev = p->cuda_dev;
  e->mapped = kvf__pool_gpu(p) || p->dev_alias != 0;
  e->host = kvf__pool_gpu(p) ? NULL : p->base + offset;
  e->addr = (kvf__pool_gpu(p) ? (uint64_t)(uintptr_t)p->base : p->dev_alias) + offset;
}

kvf__pool *kvf__pool_get(uint32_t id) { return id < kvfd.n_pools ? kvfd.pools[id] : NULL; }

int kvf__pool_check_range(const kvf__pool *p, uint64_t offset, uint64_t len) {
  if (len == 0) return KVF_EINVAL;
  if (offset > p->size || len > p->size - offset) return KVF_ERANGE;
  return 0;
}
