/* pool.c - host pools: memfd (hugetlb when available), MAP_SHARED, mlocked
 * best effort. cuda:N pools: cuMemCreate on GPU N, exported as a POSIX fd
 * (daemon/cuda/gpu.c). The fd is what clients map; wire addresses are
 * offsets. */
#include "pool.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda/gpu.h"
#include "kvferry.h"
#include "kvferryd.h"
#include "log.h"
#include "pool_engine.h"

#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels say EINVAL */
#endif

/* ------------------------------------------------------------ host pools
 *
 * What makes a host pool slow to start is bringing its pages in: the kernel
 * zeroes every page at its first fault, and mlock walks them all again (a 4
 * GiB pool: 3.5-5 s on 4 KiB pages, 0.7 s on huge pages, one thread on the
 * 2-core dev machine; bench/pool_start.sh). Slices are faulted in
 * (MADV_POPULATE_WRITE, else a write per page) and locked by several
 * threads at once. $KVF_POOL_FILL_THREADS caps the threads (benchmarks). */
#define FILL_SLICE_MIN (64ull << 20)
#define FILL_THREADS_MAX 16

typedef struct fill {
  uint8_t *base;
  uint64_t len;
  bool lock;
  int rc;                /* populating: 0 or -errno */
  int lock_errno;        /* mlock: 0 or errno */
  pthread_t th;
} fill;

/* Faults [base, base + len) in for writing. MADV_POPULATE_WRITE (Linux
 * 5.14+) reports a failure (no huge page left, out of memory) as an error
 * instead of a SIGBUS; older kernels get one write per page, which is safe
 * because a MAP_SHARED hugetlb mapping reserved its pages at mmap. */
static int populate(uint8_t *base, uint64_t len) {
  if (madvise(base, len, MADV_POPULATE_WRITE) == 0) return 0;
  if (errno != EINVAL) return -errno;
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  for (uint64_t off = 0; off < len; off += page) ((volatile uint8_t *)base)[off] = 0; /* fresh memory: zeros */
  return 0;
}

static void *fill_main(void *arg) {
  fill *f = arg;
  f->rc = populate(f->base, f->len);
  if (f->rc == 0 && f->lock && mlock(f->base, f->len) != 0) f->lock_errno = errno;
  return NULL;
}

static unsigned fill_threads(uint64_t len) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  unsigned n = cpus > 0 ? (unsigned)cpus : 1;
  const char *env = getenv("KVF_POOL_FILL_THREADS");
  if (env && atoi(env) > 0) n = (unsigned)atoi(env);
  if (n > FILL_THREADS_MAX) n = FILL_THREADS_MAX;
  uint64_t by_size = len / FILL_SLICE_MIN;
  if (by_size < n) n = by_size ? (unsigned)by_size : 1;
  return n;
}

/* Populates [base, base + len) and, when lock, mlocks it, in slices of a
 * multiple of align (hugetlb mappings split only at their page size; huge
 * folios of shmem are not shared between threads), one thread each
 * (the caller's thread takes the first). Returns 0 or population's -errno;
 * *lock_errno is 0 when all of it is locked, else mlock's errno (and
 * nothing stays locked). */
static int fill_range(uint8_t *base, uint64_t len, uint64_t align, bool lock, int *lock_errno) {
  fill f[FILL_THREADS_MAX];
  unsigned n = fill_threads(len);
  uint64_t slice = (len / n + align - 1) / align * align;
  unsigned used = 0;
  for (uint64_t off = 0; off < len && used < n; off += slice, used++)
    f[used] = (fill){.base = base + off, .len = len - off < slice ? len - off : slice, .lock = lock};
  /* The helpers take no signals: the daemon's loop handles them later. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  bool started[FILL_THREADS_MAX] = {false};
  for (unsigned i = 1; i < used; i++) started[i] = pthread_create(&f[i].th, NULL, fill_main, &f[i]) == 0;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  for (unsigned i = 0; i < used; i++)
    if (!started[i]) fill_main(&f[i]); /* the first slice, and any whose thread did not start */
  int rc = 0;
  *lock_errno = 0;
  for (unsigned i = 0; i < used; i++) {
    if (started[i]) pthread_join(f[i].th, NULL);
    if (f[i].rc && !rc) rc = f[i].rc;
    if (f[i].lock_errno && !*lock_errno) *lock_errno = f[i].lock_errno;
  }
  if (lock && (rc || *lock_errno)) {
    munlock(base, len); /* all or nothing: "locked" in status means all of it */
    if (!*lock_errno) *lock_errno = -rc;
  }
  return rc;
}

/* Fixes a pool memfd's size for good: the clients it is shared with get
 * the fd read-write, and one that shrank it would pull pages from under the
 * daemon's mapping (SIGBUS, EFAULT in tcp's writev). Whether it held. */
static bool seal_size(int fd) {
  return fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0;
}

/* A memfd of size bytes, mapped MAP_SHARED, populated and locked as asked:
 * on huge pages when hugepages allows and the kernel has enough reserved
 * (vm.nr_hugepages; else normal pages, unless hugepages is on). Normal
 * pages are brought in at start only when they are to be locked (as
 * before: unlocked pools fill lazily). */
static int map_memfd(kvf__pool *p, const char *name, int hugepages, bool want_mlock, int *lock_errno) {
  *lock_errno = 0;
  if (hugepages != KVF__OFF) {
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_HUGETLB | MFD_ALLOW_SEALING);
    struct stat st;
    void *base = MAP_FAILED;
    if (fd >= 0 && fstat(fd, &st) == 0 && st.st_blksize > 0 && p->size % (uint64_t)st.st_blksize == 0 &&
        ftruncate(fd, (off_t)p->size) == 0)
      base = mmap(NULL, p->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base != MAP_FAILED && fill_range(base, p->size, (uint64_t)st.st_blksize, want_mlock, lock_errno) == 0) {
      p->fd = fd;
      p->base = base;
      p->sealed = seal_size(fd);
      snprintf(p->backing, sizeof(p->backing), "memfd-hugetlb");
      return 0;
    }
    if (base != MAP_FAILED) munmap(base, p->size);
    if (fd >= 0) close(fd);
    if (hugepages == KVF__ON) return -ENOMEM;
  }
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -errno;
  void *base = MAP_FAILED;
  if (ftruncate(fd, (off_t)p->size) == 0)
    base = mmap(NULL, p->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int e = -errno;
    close(fd);
    return e;
  }
  /* Transparent huge pages for the pool where the admin allows them for
   * shmem on request (shmem_enabled=advise): 512 times fewer faults to
   * bring it in (4 GiB: 0.8 s instead of 3.5-5 s on the dev machine) and
   * fewer TLB misses. A no-op where shmem_enabled is never (the default). */
  madvise(base, p->size, MADV_HUGEPAGE);
  if (want_mlock) {
    int rc = fill_range(base, p->size, 2ull << 20, true, lock_errno);
    if (rc) {
      munmap(base, p->size);
      close(fd);
      return rc;
    }
  }
  p->fd = fd;
  p->base = base;
  p->sealed = seal_size(fd);
  snprintf(p->backing, sizeof(p->backing), "memfd");
  return 0;
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
  p->sealed = true;
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
  int lock_errno = 0;
  int rc = map_memfd(p, memname, hugepages, want_mlock, &lock_errno);
  if (rc) {
    snprintf(err, errlen, "pool %s: cannot allocate %llu bytes: %s", pc->name,
             (unsigned long long)pc->size, strerror(-rc));
    free(p);
    return rc;
  }
  /* Pinned memory keeps the data path free of page faults and is what NIC
   * registration needs; without the privilege we still run, and say so. */
  p->locked = want_mlock && lock_errno == 0;
  if (want_mlock && !p->locked)
    kvf__warn("pool %s: mlock of %llu bytes failed (%s); raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity)",
              p->name, (unsigned long long)p->size, strerror(lock_errno));
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
