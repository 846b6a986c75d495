/* pool_engine.c - engine memory (kvf_mem_register) as pools (pool_engine.h).
 *
 * Host memory comes as a file: the daemon maps the engine's range of it
 * MAP_SHARED, so both processes see the same pages. A file that shrank
 * under a mapping would turn the daemon's next touch into SIGBUS, so a
 * memfd is sealed against shrinking (F_SEAL_SHRINK, permanent: documented
 * in kvferry.h); files that cannot be sealed (tmpfs, hugetlbfs, memfds
 * made without MFD_ALLOW_SEALING) are accepted too, and the one place the
 * daemon's CPU touches pool memory itself (the local transport's host copy)
 * goes through kvf__pool_copy, which turns that SIGBUS into an error. The
 * kernel's own copies (tcp's readv/writev) fail with EFAULT instead, and
 * NICs and GPUs hold their pages pinned. */
#include "pool_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "cuda/gpu.h"
#include "api.h"
#include "log.h"
#include "transport/transport.h"

typedef struct engine_rec {
  bool cuda;
  uint8_t *map;           /* host: the daemon's mapping (page aligned) */
  uint64_t map_len;
  kvf__gpu_import im;     /* cuda */
  int dmabuf_fd;          /* cuda by IPC handle: the engine's dmabuf of the */
                          /* allocation (for NICs), or -1 */
  kvf__mem_timing timing; /* what registering it cost (status) */
  uint32_t holds;         /* transfers naming the pool */
  bool orphan;            /* its owner went away or unregistered it: */
                          /* it goes when holds reaches 0 */
} engine_rec;

static engine_rec *rec_of(const kvf__pool *p) { return p ? p->engine : NULL; }

bool kvf__pool_engine_timing(const kvf__pool *p, kvf__mem_timing *t) {
  const engine_rec *r = rec_of(p);
  if (r) *t = r->timing;
  return r != NULL;
}

bool kvf__pool_is_engine(uint32_t id) { return rec_of(kvf__pool_get(id)) != NULL; }

size_t kvf__pool_engine_count(void) {
  size_t n = 0;
  for (uint32_t i = 0; i < kvfd.n_pools; i++) n += kvf__pool_is_engine(i);
  return n;
}

static size_t owned_by(const kvf__session *s) {
  size_t n = 0;
  for (uint32_t i = 0; i < kvfd.n_pools; i++) {
    const kvf__pool *p = kvf__pool_get(i);
    n += p && p->owner == s && !rec_of(p)->orphan;
  }
  return n;
}

static bool name_taken(const char *name) {
  for (uint32_t i = 0; i < kvfd.n_pools; i++) {
    const kvf__pool *p = kvf__pool_get(i);
    if (p && strcmp(p->name, name) == 0) return true;
  }
  return false;
}

/* The lowest free id above the config's pools. */
static int free_id(uint32_t *id) {
  for (uint32_t i = (uint32_t)kvfd.cfg.n_pools; i < KVF__POOLS_MAX; i++)
    if (!kvf__pool_get(i)) {
      *id = i;
      return 0;
    }
  return KVF_ELIMIT;
}

/* ------------------------------------------------------------ host memory */

static bool is_memfd(int fd) {
  char link[64], target[96];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof(target) - 1);
  return n > 7 && strncmp(target, "/memfd:", 7) == 0;
}

/* What the file is, and its mapping granularity: only memory files can be
 * shared safely (a disk file would page to disk under the engine's cache). */
static int check_file(int fd, struct stat *st, const char **backing, uint64_t *align, char *err, size_t errlen) {
  struct statfs sf;
  if (fstat(fd, st) != 0 || fstatfs(fd, &sf) != 0 || !S_ISREG(st->st_mode)) {
    snprintf(err, errlen, "the fd that came with the request is not a file");
    return KVF_EINVAL;
  }
  bool huge = sf.f_type == HUGETLBFS_MAGIC;
  if (!huge && sf.f_type != TMPFS_MAGIC) {
    snprintf(err, errlen, "the region's file is not memory (a memfd, or a file on tmpfs or hugetlbfs)");
    return KVF_EINVAL;
  }
  *align = huge ? (uint64_t)sf.f_bsize : (uint64_t)sysconf(_SC_PAGESIZE);
  *backing = is_memfd(fd) ? (huge ? "engine-memfd-huge" : "engine-memfd") : (huge ? "engine-hugetlbfs" : "engine-tmpfs");
  return 0;
}

/* Seals a memfd against shrinking when it can be (see the top); whether
 * the file is sealed so now. */
static bool seal_shrink(int fd) {
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals >= 0 && !(seals & F_SEAL_SHRINK)) seals = fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0 ? F_SEAL_SHRINK : 0;
  return seals > 0 && (seals & F_SEAL_SHRINK);
}

static int map_host(int fd, const Kvf__MemRegisterReq *q, kvf__pool *p, engine_rec *r, char *err, size_t errlen) {
  const char *backing;
  uint64_t align;
  struct stat st;
  int rc = check_file(fd, &st, &backing, &align, err, errlen);
  if (rc) return rc;
  if (q->offset > (uint64_t)st.st_size || q->size > (uint64_t)st.st_size - q->offset) {
    snprintf(err, errlen, "offset %llu + size %llu passes the end of the file (%llu bytes)",
             (unsigned long long)q->offset, (unsigned long long)q->size, (unsigned long long)st.st_size);
    return KVF_ERANGE;
  }
  uint64_t skew = q->offset % align;
  r->map_len = (q->size + skew + align - 1) / align * align;
  r->map = mmap(NULL, r->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)(q->offset - skew));
  if (r->map == MAP_FAILED) {
    r->map = NULL;
    snprintf(err, errlen, "cannot map the region: %s", strerror(errno));
    return -errno;
  }
  p->sealed = seal_shrink(fd);
  p->base = r->map + skew;
  snprintf(p->backing, sizeof(p->backing), "%s", backing);
  /* As for host pools (pool.c): with GPUs here, kernels reach it directly. */
  if (kvf__gpu_ready() && kvf__gpu_host_register(p->base, p->size, &p->dev_alias) != 0) p->dev_alias = 0;
  return 0;
}

/* ------------------------------------------------------------- GPU memory */

static int cuda_dev_of(const char *kind) {
  char *end;
  if (strncmp(kind, "cuda:", 5) != 0 || !kind[5]) return -1;
  long d = strtol(kind + 5, &end, 10);
  return *end || d < 0 || d >= KVF__GPU_MAX_DEV ? -1 : (int)d;
}

static int import_cuda(int fd, const Kvf__MemRegisterReq *q, kvf__pool *p, engine_rec *r, char *err,
                       size_t errlen) {
  if (!kvf__gpu_ready()) {
    snprintf(err, errlen, "kind %s needs CUDA, which is unavailable to kvferryd: %s", q->kind, kvf__gpu_why());
    return -ENODEV;
  }
  /* the engine's device number is a first guess (see below); its GPU's
   * bus id, when it sent one, says where the allocation is */
  p->cuda_dev = kvf__gpu_resolve_dev(p->cuda_dev, q->cuda_pci_bus_id);
  if (q->offset > q->alloc_size || q->size > q->alloc_size - q->offset) {
    snprintf(err, errlen, "offset %llu + size %llu passes the end of the allocation (%llu bytes)",
             (unsigned long long)q->offset, (unsigned long long)q->size, (unsigned long long)q->alloc_size);
    return KVF_ERANGE;
  }
  int rc;
  if (q->cuda_ipc_handle.len == 64) {
    rc = kvf__gpu_import_ipc(p->cuda_dev, q->cuda_ipc_handle.data, q->alloc_size, &r->im, err, errlen);
    snprintf(p->backing, sizeof(p->backing), "engine-cuipc");
    /* the fd with an IPC handle: the allocation's dmabuf, which only the
     * engine's process could make (kept for the NICs' registration) */
    if (rc == 0 && fd >= 0) r->dmabuf_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  } else if (fd >= 0) {
    rc = kvf__gpu_import_fd(p->cuda_dev, fd, q->alloc_size, &r->im, err, errlen);
    snprintf(p->backing, sizeof(p->backing), "engine-cumem");
  } else {
    snprintf(err, errlen, "GPU memory comes with a CUDA IPC handle (64 bytes) or a VMM fd");
    return KVF_EINVAL;
  }
  if (rc) return rc;
  r->cuda = true;
  /* the engine's cuda:N may count GPUs differently (CUDA_VISIBLE_DEVICES):
   * the import found the allocation's device in our numbering */
  p->cuda_dev = r->im.dev;
  snprintf(p->kind, sizeof(p->kind), "cuda:%d", r->im.dev);
  p->base = (uint8_t *)(uintptr_t)(r->im.dptr + q->offset);
  p->locked = true; /* device memory is never paged */
  p->sealed = true;  /* the import holds the allocation */
  return 0;
}

/* ---------------------------------------------------------- registering */

static void release_memory(kvf__pool *p) {
  engine_rec *r = rec_of(p);
  if (r->dmabuf_fd >= 0) close(r->dmabuf_fd);
  if (r->cuda) {
    kvf__gpu_import_release(&r->im);
  } else if (r->map) {
    if (p->dev_alias) kvf__gpu_host_unregister(p->base);
    munmap(r->map, r->map_len);
  }
  free(r);
  free(p);
}

/* Every running transport takes the pool, or none keeps it. */
static int tell_transports(kvf__pool *p, char *err, size_t errlen) {
  for (unsigned i = 0; i < KVF__TRANSPORTS_MAX; i++) {
    kvf__transport *t = kvfd.transports[i];
    if (!t) continue;
    int rc = t->ops->pool_added(t, p, err, errlen);
    if (rc == 0) continue;
    while (i-- > 0)
      if (kvfd.transports[i]) kvfd.transports[i]->ops->pool_removed(kvfd.transports[i], p);
    return rc;
  }
  return 0;
}

static int check_request(kvf__session *owner, const Kvf__MemRegisterReq *q, int fd, char *err, size_t errlen) {
  const char *kind = q->kind ? q->kind : "";
  if (strcmp(kind, "host") != 0 && cuda_dev_of(kind) < 0) {
    snprintf(err, errlen, "kind '%s': engine memory is \"host\" or \"cuda:N\"", kind);
    return KVF_EINVAL;
  }
  if (q->size == 0) {
    snprintf(err, errlen, "a region of 0 bytes");
    return KVF_EINVAL;
  }
  if (!q->name || !kvf__config_valid_name(q->name)) {
    snprintf(err, errlen, "name '%s': 1 to %d of A-Z a-z 0-9 . _ -", q->name ? q->name : "", KVF__NAME_MAX);
    return KVF_EINVAL;
  }
  if (name_taken(q->name)) {
    snprintf(err, errlen, "a pool named '%s' exists", q->name);
    return KVF_EEXIST;
  }
  if (strcmp(kind, "host") == 0 && fd < 0) {
    snprintf(err, errlen, "host memory comes with its file's fd (none came with the request)");
    return KVF_EINVAL;
  }
  if (owned_by(owner) >= KVF__ENGINE_POOLS_PER_CLIENT) {
    snprintf(err, errlen, "this client has %d regions registered", KVF__ENGINE_POOLS_PER_CLIENT);
    return KVF_ELIMIT;
  }
  return 0;
}

static kvf__pool *pool_new(kvf__session *owner, const Kvf__MemRegisterReq *q, uint32_t id) {
  kvf__pool *p = calloc(1, sizeof(*p));
  engine_rec *r = calloc(1, sizeof(*r));
  if (!p || !r) {
    free(p);
    free(r);
    return NULL;
  }
  p->id = id;
  p->size = q->size;
  p->fd = -1; /* engine memory is not handed to other clients */
  p->cuda_dev = cuda_dev_of(q->kind);
  p->owner = owner;
  p->engine = r;
  r->dmabuf_fd = -1;
  snprintf(p->name, sizeof(p->name), "%s", q->name);
  snprintf(p->kind, sizeof(p->kind), "%s", q->kind);
  snprintf(p->nic_reg, sizeof(p->nic_reg), "none");
  return p;
}

static void table_put(kvf__pool *p) {
  kvfd.pools[p->id] = p;
  if (p->id >= kvfd.n_pools) kvfd.n_pools = p->id + 1;
}

static void table_drop(kvf__pool *p) {
  kvfd.pools[p->id] = NULL;
  while (kvfd.n_pools > kvfd.cfg.n_pools && !kvfd.pools[kvfd.n_pools - 1]) kvfd.n_pools--;
}

int kvf__pool_engine_add(kvf__session *owner, const Kvf__MemRegisterReq *q, int fd, kvf__pool **out,
                         kvf__mem_timing *t, char *err, size_t errlen) {
  uint32_t id = 0;
  int rc = check_request(owner, q, fd, err, errlen);
  if (rc == 0 && (rc = free_id(&id)) != 0) snprintf(err, errlen, "%d pools are registered", KVF__POOLS_MAX);
  kvf__pool *p = rc ? NULL : pool_new(owner, q, id);
  if (rc == 0 && !p) rc = -ENOMEM;
  uint64_t t0 = kvf__now_ns();
  if (rc == 0)
    rc = kvf__pool_gpu(p) ? import_cuda(fd, q, p, p->engine, err, errlen) : map_host(fd, q, p, p->engine, err, errlen);
  uint64_t t1 = kvf__now_ns();
  if (fd >= 0) close(fd); /* mapped or imported: the daemon keeps no fd */
  if (rc == 0) rc = tell_transports(p, err, errlen);
  if (rc) {
    if (p) release_memory(p);
    return rc;
  }
  t->import_ns = t1 - t0;
  t->nic_ns = kvf__now_ns() - t1;
  rec_of(p)->timing = *t;
  table_put(p);
  kvf__info("pool %s: engine memory of client pid %d, %s, %llu bytes, %s%s; NIC %s (import %.3f ms, NIC %.3f ms)",
            p->name, (int)kvf__api_session_pid(owner), p->kind, (unsigned long long)p->size, p->backing,
            rec_of(p)->dmabuf_fd >= 0 ? " with the engine's dmabuf" : "", p->nic_reg, t->import_ns / 1e6,
            t->nic_ns / 1e6);
  *out = p;
  return 0;
}

static void drop(kvf__pool *p) {
  kvf__info("pool %s: engine memory dropped", p->name);
  for (unsigned i = 0; i < KVF__TRANSPORTS_MAX; i++)
    if (kvfd.transports[i]) kvfd.transports[i]->ops->pool_removed(kvfd.transports[i], p);
  table_drop(p);
  release_memory(p);
}

int kvf__pool_engine_removable(kvf__session *owner, uint32_t id, char *err, size_t errlen) {
  kvf__pool *p = kvf__pool_get(id);
  engine_rec *r = rec_of(p);
  if (!r || r->orphan || p->owner != owner) {
    snprintf(err, errlen, "no pool %u registered by this client", id);
    return KVF_ENOPOOL;
  }
  if (r->holds) {
    snprintf(err, errlen, "pool %s: %u transfers use it", p->name, r->holds);
    return KVF_EBUSY;
  }
  return 0;
}

int kvf__pool_engine_remove(kvf__session *owner, uint32_t id, char *err, size_t errlen) {
  int rc = kvf__pool_engine_removable(owner, id, err, errlen);
  if (rc == 0) drop(kvf__pool_get(id));
  return rc;
}

void kvf__pool_engine_session_gone(kvf__session *owner) {
  for (uint32_t i = 0; i < kvfd.n_pools; i++) {
    kvf__pool *p = kvf__pool_get(i);
    engine_rec *r = rec_of(p);
    if (!r || p->owner != owner) continue;
    p->owner = NULL;
    r->orphan = true;
    if (!r->holds) drop(p);
  }
}

void kvf__pool_engine_hold(uint32_t id) {
  engine_rec *r = rec_of(kvf__pool_get(id));
  if (r) r->holds++;
}

void kvf__pool_engine_release(uint32_t id) {
  kvf__pool *p = kvf__pool_get(id);
  engine_rec *r = rec_of(p);
  if (!r || !r->holds) return;
  if (--r->holds == 0 && r->orphan) drop(p);
}

int kvf__pool_engine_dmabuf(const kvf__pool *p, int *fd, uint64_t *offset) {
  engine_rec *r = rec_of(p);
  if (!r || !r->cuda) return -EINVAL;
  uint64_t in_alloc = (uint64_t)(uintptr_t)p->base - r->im.dptr;
  if (r->dmabuf_fd >= 0) { /* the engine's, of the whole allocation */
    *fd = fcntl(r->dmabuf_fd, F_DUPFD_CLOEXEC, 0);
    *offset = in_alloc;
    return *fd >= 0 ? 0 : -errno;
  }
  /* the whole allocation: its ends are page aligned, the region's need not be */
  int rc = kvf__gpu_range_dmabuf(r->im.dptr, r->im.size, fd, offset);
  if (rc == 0) *offset += in_alloc;
  return rc;
}

void kvf__pool_engine_shutdown(void) {
  for (uint32_t i = 0; i < kvfd.n_pools; i++) {
    kvf__pool *p = kvf__pool_get(i);
    if (rec_of(p)) drop(p);
  }
}

/* ------------------------------------------------------ guarded host copy */

/* volatile: memcpy does not read it, so the compiler would otherwise drop
 * the store before the copy as dead. */
static __thread sigjmp_buf *volatile copy_guard;

/* SIGBUS inside kvf__pool_copy: the file under a mapping shrank. Anywhere
 * else it is the bug it always was: default action. */
static void on_sigbus(int sig, siginfo_t *si, void *uc) {
  if (copy_guard) siglongjmp(*copy_guard, 1);
  signal(SIGBUS, SIG_DFL);
  raise(SIGBUS);
}

static void install_guard(void) {
  static bool done;
  if (__atomic_exchange_n(&done, true, __ATOMIC_ACQ_REL)) return;
  /* SA_NODEFER: jumping out of the handler leaves SIGBUS unblocked, so
   * sigsetjmp need not save the mask (no system call per copy). */
  struct sigaction sa = {.sa_sigaction = on_sigbus, .sa_flags = SA_SIGINFO | SA_NODEFER};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, NULL);
}

int kvf__pool_copy(void *dst, const void *src, size_t n) {
  sigjmp_buf jb;
  install_guard();
  if (sigsetjmp(jb, 0)) {
    copy_guard = NULL;
    return -EFAULT;
  }
  copy_guard = &jb;
  memcpy(dst, src, n);
  copy_guard = NULL;
  return 0;
}

