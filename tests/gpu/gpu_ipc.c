/* gpu_ipc.c - engine-owned GPU memory across two processes: an "engine"
 * (the forked child) allocates and exports it with libkvferry's
 * kvf__cuda_export_range, a "daemon" (the parent, linking the daemon's CUDA
 * module) imports it with kvf__gpu_import_ipc / kvf__gpu_import_fd, as
 * kvf_mem_register will.
 *
 *   gpu_ipc [test]       for each route, cudaMalloc-style memory (cuMemAlloc:
 *                        CUDA IPC) and VMM memory (cuMemCreate with the
 *                        POSIX fd handle type): the engine fills the whole
 *                        allocation with a pattern and exports an unaligned
 *                        sub-range; the daemon imports it (also with a wrong
 *                        device guess when there are two GPUs), copies the
 *                        sub-range out with the daemon's copy routine and
 *                        checks every byte, writes a second pattern into it
 *                        and releases the import; the engine checks every
 *                        byte of its allocation (the second pattern inside
 *                        the range, the first outside). Also: refusals (host
 *                        memory, ranges leaving the allocation, sizes the
 *                        handle does not map), an export from a thread
 *                        without a current context, the caller's context
 *                        left unchanged, two imports of one allocation at
 *                        once, and kvf__gpu_range_dmabuf on the imported
 *                        memory (0 or -ENOTSUP).
 *   gpu_ipc --bench SIZE the registration of SIZE bytes (e.g. 64G; halved
 *                        until the GPU can allocate it) by each route: the
 *                        engine's export, the daemon's import, the dmabuf
 *                        export of the whole allocation (the GPU half of NIC
 *                        registration) and, when this host has an RDMA
 *                        device, ibv_reg_dmabuf_mr of it (the NIC half;
 *                        ibv_reg_mr of the device address, nvidia-peermem,
 *                        when there is no dmabuf); one JSON line per route.
 *
 * Exit 0: passed; 77: no CUDA driver or no GPU (said on stdout); 1: failed. */
#include <errno.h>
#include <infiniband/verbs.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "config.h"
#include "cuda/cudrv.h"
#include "cuda/gpu.h"
#include "gpu_test.h"
#include "kvferry.h"
#include "libkvferry_cuda.h"
#include "log.h"

static kvf_cu cu; /* the engine's own driver calls (allocation, checks) */
static int failures;
static bool out_of_step; /* the other process stopped answering: stop */

enum { ROUTE_IPC, ROUTE_VMM, N_ROUTES };
static const char *const route_name[N_ROUTES] = {"ipc", "vmm"};
enum { MSG_EXPORT = 1, MSG_CHECK, MSG_RESULT };

/* One message each way per step; the VMM fd rides with MSG_EXPORT. */
typedef struct msg {
  int op;
  int route;
  int rc;                  /* the sender's verdict so far (0: fine) */
  int dev;
  uint64_t alloc_size, off, len, seed;
  uint8_t ipc[64];
  char bus_id[32];         /* the allocation's GPU, as the engine's export found it */
  double alloc_us, export_us;
} msg;

/* ------------------------------------------------------------ helpers */

static int send_msg(int s, const msg *m, int fd) {
  struct iovec iov = {.iov_base = (void *)m, .iov_len = sizeof(*m)};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fd >= 0) {
    memset(&u, 0, sizeof(u));
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof(u.buf);
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  return sendmsg(s, &mh, MSG_NOSIGNAL) == (ssize_t)sizeof(*m) ? 0 : -1;
}

/* A whole message (SOCK_SEQPACKET), and its fd or -1. -1: the other side
 * is gone or sent something else. */
static int recv_msg(int s, msg *m, int *fd) {
  struct iovec iov = {.iov_base = m, .iov_len = sizeof(*m)};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof(u.buf)};
  *fd = -1;
  ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); n > 0 && c; c = CMSG_NXTHDR(&mh, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) memcpy(fd, CMSG_DATA(c), sizeof(int));
  return n == (ssize_t)sizeof(*m) ? 0 : -1;
}

/* Byte i of an allocation filled with pattern seed. */
static uint8_t pat(uint64_t seed, uint64_t i) {
  uint64_t x = ((i >> 3) + 1) * 0x9e3779b97f4a7c15ull ^ seed;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return (uint8_t)(x >> ((i & 7) * 8));
}

static void fill(uint8_t *b, uint64_t from, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n; i++) b[i] = pat(seed, from + i);
}

static uint64_t parse_size(const char *s) {
  char *end;
  uint64_t v = strtoull(s, &end, 10);
  switch (*end) {
    case 'K': case 'k': return v << 10;
    case 'M': case 'm': return v << 20;
    case 'G': case 'g': return v << 30;
    case 'T': case 't': return v << 40;
    default: return v;
  }
}

/* ------------------------------------------------------------ the engine (child) */

typedef struct galloc {
  int route;
  CUdeviceptr d;
  uint64_t size;
  CUmemGenericAllocationHandle h;
} galloc;

static int engine_alloc_types(galloc *a, int route, uint64_t want, int handle_types) {
  memset(a, 0, sizeof(*a));
  a->route = route;
  if (route == ROUTE_IPC) {
    a->size = want;
    return cu.MemAlloc(&a->d, want) == KVF_CU_SUCCESS ? 0 : -1;
  }
  kvf_cu_mem_prop prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = KVF_CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = handle_types;
  prop.location.type = KVF_CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  /* as an engine that wants NICs to reach it would (dmabuf of VMM memory
   * needs it) */
  int gdr = 0;
  cu.DeviceGetAttribute(&gdr, KVF_CU_ATTR_GDR_WITH_VMM_SUPPORTED, 0);
  prop.allocFlags.gpuDirectRDMACapable = gdr ? 1 : 0;
  size_t gran = 0;
  if (cu.MemGetAllocationGranularity(&gran, &prop, KVF_CU_MEM_GRANULARITY_MINIMUM) != KVF_CU_SUCCESS || !gran)
    return -1;
  a->size = (want + gran - 1) / gran * gran;
  if (cu.MemCreate(&a->h, a->size, &prop, 0) != KVF_CU_SUCCESS) return -1;
  kvf_cu_access_desc acc = {{KVF_CU_MEM_LOCATION_TYPE_DEVICE, 0}, KVF_CU_MEM_ACCESS_RW};
  if (cu.MemAddressReserve(&a->d, a->size, gran, 0, 0) == KVF_CU_SUCCESS) {
    if (cu.MemMap(a->d, a->size, 0, a->h, 0) == KVF_CU_SUCCESS) {
      if (cu.MemSetAccess(a->d, a->size, &acc, 1) == KVF_CU_SUCCESS) return 0;
      cu.MemUnmap(a->d, a->size);
    }
    cu.MemAddressFree(a->d, a->size);
  }
  cu.MemRelease(a->h);
  return -1;
}

static int engine_alloc(galloc *a, int route, uint64_t want) {
  return engine_alloc_types(a, route, want, KVF_CU_MEM_HANDLE_TYPE_POSIX_FD);
}

static void engine_free(galloc *a) {
  if (a->route == ROUTE_IPC) {
    cu.MemFree(a->d);
    return;
  }
  cu.MemUnmap(a->d, a->size);
  cu.MemAddressFree(a->d, a->size);
  cu.MemRelease(a->h);
}

/* An export from a thread that has no current context (the library must
 * find one, and leave the thread without one). */
typedef struct bare {
  CUdeviceptr p;
  uint64_t len;
  kvf__cuda_export ex;
  int rc;
  CUcontext after;
} bare;

static void *bare_thread(void *arg) {
  bare *b = arg;
  b->rc = kvf__cuda_export_range((void *)(uintptr_t)b->p, b->len, &b->ex);
  cu.CtxGetCurrent(&b->after);
  return NULL;
}

/* A range over two VMM allocations mapped side by side (what PyTorch's
 * expandable segments do): -ENOTSUP, one allocation being what the daemon
 * imports. Two fresh allocations of one granule each (a handle maps whole:
 * the engine's own one is larger). */
static int engine_span(CUmemGenericAllocationHandle h) {
  (void)h;
  kvf_cu_mem_prop prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = KVF_CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = KVF_CU_MEM_HANDLE_TYPE_POSIX_FD;
  prop.location.type = KVF_CU_MEM_LOCATION_TYPE_DEVICE;
  size_t gran = 0;
  CUmemGenericAllocationHandle h2 = 0, h3 = 0;
  CUdeviceptr va = 0;
  CHECK(cu.MemGetAllocationGranularity(&gran, &prop, KVF_CU_MEM_GRANULARITY_MINIMUM) == KVF_CU_SUCCESS &&
            cu.MemCreate(&h2, gran, &prop, 0) == KVF_CU_SUCCESS && cu.MemCreate(&h3, gran, &prop, 0) == KVF_CU_SUCCESS,
        "vmm: two more allocations");
  int rc = -1;
  kvf_cu_access_desc acc = {{KVF_CU_MEM_LOCATION_TYPE_DEVICE, 0}, KVF_CU_MEM_ACCESS_RW};
  kvf__cuda_export ex;
  if (cu.MemAddressReserve(&va, 2 * gran, gran, 0, 0) == KVF_CU_SUCCESS) {
    if (cu.MemMap(va, gran, 0, h2, 0) == KVF_CU_SUCCESS) {
      if (cu.MemMap(va + gran, gran, 0, h3, 0) == KVF_CU_SUCCESS) {
        if (cu.MemSetAccess(va, 2 * gran, &acc, 1) == KVF_CU_SUCCESS)
          rc = kvf__cuda_export_range((void *)(uintptr_t)(va + gran - 4096), 8192, &ex);
        cu.MemUnmap(va + gran, gran);
      }
      cu.MemUnmap(va, gran);
    }
    cu.MemAddressFree(va, 2 * gran);
  }
  cu.MemRelease(h2);
  cu.MemRelease(h3);
  CHECK(rc == -ENOTSUP, "vmm: a range over two allocations side by side: export says %d, not -ENOTSUP", rc);
  return 0;
}

/* Refusals and context handling, on allocation a, range [off, off+len). */
static int engine_checks(const galloc *a, uint64_t off, uint64_t len) {
  kvf__cuda_export ex;
  uint8_t host[4096];
  void *p = (void *)(uintptr_t)(a->d + off);
  CHECK(kvf__cuda_export_range(host, sizeof(host), &ex) == KVF_EINVAL && ex.fd == -1, "host memory not refused");
  CHECK(kvf__cuda_export_range(p, 0, &ex) == KVF_EINVAL, "size 0 not refused");
  CUdeviceptr base = 0;
  size_t asz = 0; /* the driver's idea of the allocation (may be rounded up) */
  CHECK(cu.MemGetAddressRange && cu.MemGetAddressRange(&base, &asz, a->d) == KVF_CU_SUCCESS && base == a->d,
        "%s: cuMemGetAddressRange", route_name[a->route]);
  /* KVF_EINVAL past device memory; -ENOTSUP when another allocation
   * happens to follow in the address space */
  int rc = kvf__cuda_export_range(p, asz - off + 1, &ex);
  CHECK(rc == KVF_EINVAL || rc == -ENOTSUP, "%s: a range one byte past the allocation not refused (%d)", route_name[a->route], rc);
  bare b = {.p = a->d + off, .len = len};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, bare_thread, &b) == 0, "pthread_create");
  pthread_join(t, NULL);
  CHECK(b.rc == 0, "%s: export from a thread without a context: %d", route_name[a->route], b.rc);
  CHECK(b.ex.alloc_base == a->d && b.ex.dev == 0, "%s: export from a bare thread: base/dev wrong", route_name[a->route]);
  CHECK(b.after == NULL, "%s: the bare thread was left with a current context", route_name[a->route]);
  if (b.ex.fd >= 0) close(b.ex.fd);
  if (a->route == ROUTE_VMM) {
    /* VMM memory made without the POSIX fd handle type (what PyTorch's
     * expandable segments did) cannot be shared: said, not faked. */
    galloc nofd;
    CHECK(engine_alloc_types(&nofd, ROUTE_VMM, 2u << 20, 0) == 0, "vmm: allocation without handle types");
    rc = kvf__cuda_export_range((void *)(uintptr_t)nofd.d, nofd.size, &ex);
    engine_free(&nofd);
    CHECK(rc == -ENOTSUP && ex.fd == -1, "vmm: memory without the POSIX fd type: export says %d, not -ENOTSUP", rc);
    CHECK(engine_span(a->h) == 0, "vmm: a range over two allocations");
  }
  return 0;
}

static int engine_verify(const galloc *a, const msg *chk, const msg *exp) {
  uint8_t *h = malloc(a->size);
  CHECK(h, "malloc %" PRIu64, a->size);
  int rc = cu.MemcpyDtoH(h, a->d, a->size) == KVF_CU_SUCCESS ? 0 : -1;
  uint64_t bad = 0, first = UINT64_MAX;
  for (uint64_t i = 0; rc == 0 && i < a->size; i++) {
    bool in = i >= exp->off && i < exp->off + exp->len;
    if (h[i] != pat(in ? chk->seed : exp->seed, i)) {
      bad++;
      if (first == UINT64_MAX) first = i;
    }
  }
  free(h);
  CHECK(rc == 0, "%s: cuMemcpyDtoH of the allocation", route_name[a->route]);
  CHECK(bad == 0, "%s: the engine sees %" PRIu64 " wrong bytes, the first at %" PRIu64 " (range %" PRIu64 "+%" PRIu64 ")",
        route_name[a->route], bad, first, exp->off, exp->len);
  return 0;
}

static int engine_route(int s, int route, uint64_t want, bool bench) {
  msg m = {.op = MSG_EXPORT, .route = route, .dev = -1, .seed = 0x1234567 + (uint64_t)route};
  galloc a;
  double t0 = gt_now_us();
  int rc = engine_alloc(&a, route, want);
  /* bench: as large as the GPU allows */
  while (rc && bench && want > (1ull << 30)) {
    want /= 2;
    rc = engine_alloc(&a, route, want);
  }
  m.alloc_us = gt_now_us() - t0;
  if (rc) {
    /* said to the daemon, which still answers MSG_CHECK: the two stay in step */
    fprintf(stderr, "FAIL: %s: allocating %" PRIu64 " bytes\n", route_name[route], want);
    failures++;
    m.rc = -1;
    msg chk, res = {.op = MSG_RESULT, .route = route, .rc = -1};
    int nofd;
    if (send_msg(s, &m, -1) == 0 && recv_msg(s, &chk, &nofd) == 0) send_msg(s, &res, -1);
    return -1;
  }
  m.off = bench ? 0 : 3 * 4096 + 123;
  m.len = bench ? a.size : a.size - m.off - 4096 - 45;
  if (!bench) {
    uint8_t *h = malloc(a.size);
    if (h) fill(h, 0, a.size, m.seed);
    if (!h || cu.MemcpyHtoD(a.d, h, a.size) != KVF_CU_SUCCESS) {
      fprintf(stderr, "FAIL: %s: filling the allocation\n", route_name[route]);
      failures++;
      m.rc = -1;
    }
    free(h);
    if (m.rc == 0 && engine_checks(&a, m.off, m.len)) m.rc = -1;
  }
  CUcontext before = NULL, after = NULL;
  cu.CtxGetCurrent(&before);
  kvf__cuda_export ex;
  t0 = gt_now_us();
  int erc = kvf__cuda_export_range((void *)(uintptr_t)(a.d + m.off), m.len, &ex);
  m.export_us = gt_now_us() - t0;
  cu.CtxGetCurrent(&after);
  if (erc || ex.alloc_base != a.d || ex.alloc_size < want || ex.dev != 0 || (route == ROUTE_VMM) != (ex.fd >= 0) ||
      before != after) {
    fprintf(stderr, "FAIL: %s: export rc %d, base %s, size %" PRIu64 ", dev %d, fd %d, context %s\n", route_name[route],
            erc, ex.alloc_base == a.d ? "ok" : "WRONG", ex.alloc_size, ex.dev, ex.fd,
            before == after ? "kept" : "CHANGED");
    failures++;
    m.rc = -1;
  }
  m.dev = ex.dev;
  memcpy(m.bus_id, ex.bus_id, sizeof(m.bus_id));
  m.alloc_size = ex.alloc_size;
  memcpy(m.ipc, ex.ipc, sizeof(m.ipc));
  rc = send_msg(s, &m, m.rc == 0 ? ex.fd : -1);
  if (ex.fd >= 0) close(ex.fd);
  /* the IPC route's dmabuf, which the daemon cannot make of imported memory */
  if (route == ROUTE_IPC)
    printf("     %s: the engine's own dmabuf of its allocation: %s\n", route_name[route],
           ex.dmabuf_fd >= 0 ? "made" : "refused by the driver");
  if (ex.dmabuf_fd >= 0) close(ex.dmabuf_fd);
  msg chk;
  int nofd;
  if (rc == 0) rc = recv_msg(s, &chk, &nofd);
  if (rc == 0 && chk.op != MSG_CHECK) rc = -1;
  /* The daemon released its import before MSG_CHECK: verify, then free. */
  int vrc = rc == 0 && chk.rc == 0 && m.rc == 0 && !bench ? engine_verify(&a, &chk, &m) : 0;
  engine_free(&a);
  msg res = {.op = MSG_RESULT, .route = route, .rc = vrc || m.rc ? -1 : 0};
  if (rc == 0) rc = send_msg(s, &res, -1);
  return rc || res.rc ? -1 : 0;
}

static int engine_main(int s, bool bench, uint64_t size) {
  if (gt_load_driver(&cu)) return 77;
  CUdevice d;
  CUcontext c;
  if (cu.DeviceGet(&d, 0) != KVF_CU_SUCCESS || cu.DevicePrimaryCtxRetain(&c, d) != KVF_CU_SUCCESS ||
      cu.CtxSetCurrent(c) != KVF_CU_SUCCESS) {
    fprintf(stderr, "FAIL: engine: no context on GPU 0\n");
    return 1;
  }
  int rc = 0;
  for (int r = 0; r < N_ROUTES; r++)
    if (engine_route(s, r, size, bench)) rc = 1;
  return rc || failures ? 1 : 0;
}

/* ------------------------------------------------------------ the daemon (parent) */

static int do_import(const msg *m, int fd, int guess, kvf__gpu_import *im, char *err, size_t errlen) {
  if (m->route == ROUTE_IPC) return kvf__gpu_import_ipc(guess, m->ipc, m->alloc_size, im, err, errlen);
  return kvf__gpu_import_fd(guess, fd, m->alloc_size, im, err, errlen);
}

/* The NIC half, where this host has an RDMA device: ibv_reg_dmabuf_mr of
 * the dmabuf, or without one (dmabuf >= 0 not given) ibv_reg_mr of the
 * device address (nvidia-peermem). *ms < 0 and why in *what when it did
 * not register. */
static void nic_register(int dmabuf, uint64_t len, uint64_t iova, double *ms, char *what, size_t wlen) {
  *ms = -1;
  int n = 0;
  struct ibv_device **list = ibv_get_device_list(&n);
  if (!list || n == 0) {
    snprintf(what, wlen, "no RDMA device");
    if (list) ibv_free_device_list(list);
    return;
  }
  struct ibv_context *ctx = ibv_open_device(list[0]);
  struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
  if (!pd) {
    snprintf(what, wlen, "%s: cannot open", ibv_get_device_name(list[0]));
  } else {
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    const char *how = dmabuf >= 0 ? "ibv_reg_dmabuf_mr" : "ibv_reg_mr (peermem)";
    double t0 = gt_now_us();
    struct ibv_mr *mr = dmabuf >= 0 ? ibv_reg_dmabuf_mr(pd, 0, len, iova, dmabuf, access)
                                    : ibv_reg_mr(pd, (void *)(uintptr_t)iova, len, access);
    double t1 = gt_now_us();
    if (mr) {
      *ms = (t1 - t0) / 1e3;
      snprintf(what, wlen, "%s %s", ibv_get_device_name(list[0]), how);
      ibv_dereg_mr(mr);
    } else {
      snprintf(what, wlen, "%s: %s: %s", ibv_get_device_name(list[0]), how, strerror(errno));
    }
  }
  if (pd) ibv_dealloc_pd(pd);
  if (ctx) ibv_close_device(ctx);
  ibv_free_device_list(list);
}

/* Copies [off, off+len) of the import out through the daemon's copy
 * routine and checks it; writes pattern seed2 into it the same way. */
static int daemon_copy(const kvf__gpu_import *im, const msg *m, uint64_t seed2) {
  uint64_t alias = 0;
  uint8_t *h = kvf__gpu_host_alloc(m->len, &alias);
  CHECK(h, "pinned host buffer of %" PRIu64 " bytes", m->len);
  kvf__gpu_end dev_end = {.dev = im->dev, .mapped = true, .addr = im->dptr + m->off};
  kvf__gpu_end host_end = {.dev = -1, .mapped = true, .addr = alias, .host = h};
  kvf__gpu_copy out = {.src = dev_end, .dst = host_end, .len = m->len};
  const char *route = "?";
  memset(h, 0, m->len);
  int rc = kvf__gpu_copy_all(&out, 1, &route);
  uint64_t bad = 0, first = UINT64_MAX;
  for (uint64_t i = 0; rc == 0 && i < m->len; i++)
    if (h[i] != pat(m->seed, m->off + i)) {
      bad++;
      if (first == UINT64_MAX) first = m->off + i;
    }
  if (rc == 0 && bad == 0) {
    fill(h, m->off, m->len, seed2);
    kvf__gpu_copy in = {.src = host_end, .dst = dev_end, .len = m->len};
    rc = kvf__gpu_copy_all(&in, 1, &route);
  }
  kvf__gpu_host_free(h);
  CHECK(rc == 0, "%s: copies of the imported memory: %d", route_name[m->route], rc);
  CHECK(bad == 0, "%s: the daemon reads %" PRIu64 " wrong bytes, the first at %" PRIu64, route_name[m->route], bad, first);
  printf("     %s: %" PRIu64 " bytes read and written by the daemon (%s)\n", route_name[m->route], m->len, route);
  return 0;
}

/* Imports with a wrong guess of the device (two GPUs or more, as under an
 * engine's CUDA_VISIBLE_DEVICES): the import must still find the
 * allocation's own GPU. A VMM handle says where it lives; an IPC handle
 * does not (opened in another GPU's context, its mapping reports that
 * GPU), so there the engine's bus id decides, as kvf_mem_register sends it. */
static int daemon_wrong_guess(const msg *m, int fd) {
  if (kvf__gpu_count() < 2) return 0;
  kvf__gpu_import im;
  char err[300] = "";
  int wrong = (m->dev + 1) % kvf__gpu_count(), guess = wrong;
  CHECK(m->bus_id[0], "%s: the engine's export names no PCI bus id", route_name[m->route]);
  if (m->route == ROUTE_IPC) {
    CHECK(kvf__gpu_resolve_dev(wrong, "") == wrong && kvf__gpu_resolve_dev(wrong, "0000:ff:1f.7") == wrong,
          "%s: without a known bus id the guess must stand", route_name[m->route]);
    guess = kvf__gpu_resolve_dev(wrong, m->bus_id);
  }
  int rc = do_import(m, fd, guess, &im, err, sizeof(err));
  CHECK(rc == 0, "%s: import with a wrong device guess: %d %s", route_name[m->route], rc, err);
  int got = im.dev;
  kvf__gpu_import_release(&im);
  CHECK(got == m->dev, "%s: import with a wrong guess says cuda:%d, the memory is on cuda:%d", route_name[m->route],
        got, m->dev);
  printf("ok   %s: import with a wrong device guess finds cuda:%d\n", route_name[m->route], got);
  return 0;
}

static int daemon_refusals(const msg *m, int fd) {
  kvf__gpu_import im;
  char err[300] = "";
  /* 2 MiB more than the allocation: the handle does not map it */
  int rc = do_import(m, fd, m->dev, &im, err, sizeof(err));
  if (rc == 0) kvf__gpu_import_release(&im);
  CHECK(rc == 0, "%s: plain import before the refusals: %d %s", route_name[m->route], rc, err);
  msg big = *m;
  big.alloc_size += 2u << 20;
  rc = do_import(&big, fd, m->dev, &im, err, sizeof(err));
  if (rc == 0) kvf__gpu_import_release(&im);
  CHECK(rc == -EINVAL, "%s: an allocation size 2 MiB too large was not refused with -EINVAL (%d: %s)",
        route_name[m->route], rc, err);
  printf("ok   %s: a size the handle does not map is refused: %s\n", route_name[m->route], err);
  if (m->route == ROUTE_VMM) {
    int other = memfd_create("not-cuda", MFD_CLOEXEC);
    CHECK(other >= 0, "memfd_create");
    rc = kvf__gpu_import_fd(m->dev, other, m->alloc_size, &im, err, sizeof(err));
    close(other);
    if (rc == 0) kvf__gpu_import_release(&im);
    CHECK(rc == -EINVAL, "vmm: a non-CUDA fd was not refused (%d)", rc);
  }
  return 0;
}

/* A second import of the same allocation (an engine registering K and V
 * of one segment apart), released before the first is used: the first
 * must stay whole (daemon_copy reads and writes it next). */
static int daemon_twice(const msg *m, int fd, const kvf__gpu_import *first) {
  kvf__gpu_import im2;
  char err[300] = "";
  int rc = do_import(m, fd, m->dev, &im2, err, sizeof(err));
  CHECK(rc == 0, "%s: a second import of the same allocation: %d %s", route_name[m->route], rc, err);
  CHECK(im2.dev == first->dev && im2.size == first->size, "%s: the second import differs", route_name[m->route]);
  uint8_t a, b;
  kvf__gpu_end e1 = {.dev = first->dev, .mapped = true, .addr = first->dptr + m->off};
  kvf__gpu_end e2 = {.dev = im2.dev, .mapped = true, .addr = im2.dptr + m->off};
  uint64_t alias = 0;
  uint8_t *h = kvf__gpu_host_alloc(2, &alias);
  CHECK(h, "pinned host buffer");
  kvf__gpu_copy c[2] = {{.src = e1, .dst = {.dev = -1, .mapped = true, .addr = alias, .host = h}, .len = 1},
                        {.src = e2, .dst = {.dev = -1, .mapped = true, .addr = alias + 1, .host = h + 1}, .len = 1}};
  const char *route;
  rc = kvf__gpu_copy_all(c, 2, &route);
  a = h[0];
  b = h[1];
  kvf__gpu_host_free(h);
  bool shared = im2.dptr == first->dptr;
  kvf__gpu_import_release(&im2);
  CHECK(rc == 0 && a == pat(m->seed, m->off) && b == a, "%s: the two imports read %d %d, want %d (rc %d)",
        route_name[m->route], a, b, pat(m->seed, m->off), rc);
  printf("ok   %s: imported twice at once (%s), the second released alone\n", route_name[m->route],
         shared ? "one mapping shared" : "two mappings");
  return 0;
}

typedef struct figures {
  double import_ms, dmabuf_ms, nic_ms, release_ms;
  const char *dmabuf;
  char nic[160];
} figures;

static int daemon_dmabuf(const kvf__gpu_import *im, const msg *m, figures *f) {
  uint64_t len = im->size & ~4095ull;
  int dfd = -1;
  uint64_t doff = 0;
  double t0 = gt_now_us();
  int rc = kvf__gpu_range_dmabuf(im->dptr, len, &dfd, &doff);
  f->dmabuf_ms = (gt_now_us() - t0) / 1e3;
  f->dmabuf = rc == 0 ? "ok" : rc == -ENOTSUP ? "unsupported" : "FAILED";
  nic_register(rc == 0 ? dfd : -1, len, im->dptr, &f->nic_ms, f->nic, sizeof(f->nic));
  if (rc == 0) close(dfd);
  CHECK(rc == 0 || rc == -ENOTSUP, "%s: kvf__gpu_range_dmabuf of the import: %d", route_name[m->route], rc);
  return 0;
}

/* One route: the engine's export, imported, used, released; the engine's
 * verdict. */
static int daemon_route(int s, bool bench) {
  msg m;
  int fd = -1;
  if (recv_msg(s, &m, &fd) != 0 || m.op != MSG_EXPORT) out_of_step = true;
  CHECK(!out_of_step, "no export message from the engine");
  int rc = m.rc;
  if (rc) fprintf(stderr, "FAIL: %s: the engine could not export\n", route_name[m.route]);
  if (rc == 0 && !bench) rc = daemon_wrong_guess(&m, fd) || daemon_refusals(&m, fd) ? -1 : 0;
  figures f = {0};
  kvf__gpu_import im = {.dev = -1};
  char err[300] = "";
  uint64_t seed2 = m.seed ^ 0xfeedface;
  if (rc == 0) {
    double t0 = gt_now_us();
    rc = do_import(&m, fd, m.dev, &im, err, sizeof(err));
    f.import_ms = (gt_now_us() - t0) / 1e3;
    if (rc) {
      fprintf(stderr, "FAIL: %s: import of %" PRIu64 " bytes: %d %s\n", route_name[m.route], m.alloc_size, rc, err);
      failures++;
    } else if (im.size != m.alloc_size || im.dev != m.dev || !im.dptr) {
      fprintf(stderr, "FAIL: %s: import says size %" PRIu64 " dev %d\n", route_name[m.route], im.size, im.dev);
      failures++;
      rc = -1;
    }
  }
  if (rc == 0 && !bench) rc = daemon_twice(&m, fd, &im);
  if (fd >= 0) close(fd); /* the import holds its own reference */
  if (rc == 0 && !bench) rc = daemon_copy(&im, &m, seed2);
  if (rc == 0) rc = daemon_dmabuf(&im, &m, &f);
  if (im.dptr) {
    double t0 = gt_now_us();
    kvf__gpu_import_release(&im);
    f.release_ms = (gt_now_us() - t0) / 1e3;
  }
  msg chk = {.op = MSG_CHECK, .route = m.route, .rc = rc, .seed = seed2};
  msg res = {0};
  int nofd;
  if (send_msg(s, &chk, -1) != 0 || recv_msg(s, &res, &nofd) != 0 || res.op != MSG_RESULT) out_of_step = true;
  CHECK(!out_of_step, "%s: the engine went away", route_name[m.route]);
  CHECK(res.rc == 0 && rc == 0, "%s: %s", route_name[m.route], rc ? "the daemon's side failed" : "the engine's check failed");
  if (bench) {
    double engine_ms = m.export_us / 1e3 + f.import_ms + f.dmabuf_ms + (f.nic_ms > 0 ? f.nic_ms : 0);
    printf("{\"route\": \"%s\", \"bytes\": %" PRIu64 ", \"alloc_ms\": %.3f, \"export_ms\": %.3f, \"import_ms\": %.3f, "
           "\"dmabuf\": \"%s\", \"dmabuf_ms\": %.3f, \"nic_reg_ms\": %.3f, \"nic\": \"%s\", \"release_ms\": %.3f, "
           "\"engine_wait_ms\": %.3f}\n",
           route_name[m.route], m.alloc_size, m.alloc_us / 1e3, m.export_us / 1e3, f.import_ms, f.dmabuf, f.dmabuf_ms,
           f.nic_ms, f.nic, f.release_ms, engine_ms);
  } else {
    printf("ok   %s: %" PRIu64 " of %" PRIu64 " bytes exported (%.3f ms), imported (%.3f ms), every byte checked on both "
           "sides; dmabuf %s (%.3f ms; NIC: %s%s)\n",
           route_name[m.route], m.len, m.alloc_size, m.export_us / 1e3, f.import_ms, f.dmabuf, f.dmabuf_ms, f.nic,
           f.nic_ms >= 0 ? " registered" : "");
  }
  fflush(stdout);
  return 0;
}

/* Whether a driver and a GPU are here, asked in a child so that neither
 * process forked later has touched CUDA (which does not survive fork). */
static int probe(void) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    kvf_cu c;
    char err[256];
    int n = 0;
    if (kvf__cu_load(&c, err, sizeof(err)) != 0) {
      printf("SKIP: no CUDA driver: %s\n", err);
      fflush(stdout);
      _exit(77);
    }
    if (c.DeviceGetCount(&n) != KVF_CU_SUCCESS || n == 0) {
      printf("SKIP: no GPU\n");
      fflush(stdout);
      _exit(77);
    }
    _exit(0);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st)) return 1;
  return WEXITSTATUS(st);
}

int main(int argc, char **argv) {
  bool bench = argc > 1 && strcmp(argv[1], "--bench") == 0;
  if (argc > 1 && !bench && strcmp(argv[1], "test") != 0) {
    fprintf(stderr, "usage: %s [test] | --bench SIZE (e.g. 64G)\n", argv[0]);
    return 2;
  }
  uint64_t size = bench ? (argc > 2 ? parse_size(argv[2]) : 64ull << 30) : (64ull << 20) + 4096 * 5 + 77;
  kvf__log_init(KVF__LOG_INFO);
  int p = probe();
  if (p) return p;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return 1;
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) return 1;
  if (pid == 0) {
    close(sv[0]);
    alarm(900); /* a hung peer ends the run */
    _exit(engine_main(sv[1], bench, size));
  }
  close(sv[1]);
  alarm(900);
  if (kvf__gpu_init(KVF__ON) != 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return 1;
  }
  printf("== gpu_ipc %s: %d GPU(s), %" PRIu64 " bytes per allocation\n", bench ? "bench" : "test", kvf__gpu_count(), size);
  for (int r = 0; r < N_ROUTES && !out_of_step; r++) daemon_route(sv[0], bench);
  close(sv[0]);
  int st = 0;
  if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "FAIL: the engine process exited with %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    failures++;
  }
  kvf__gpu_shutdown();
  printf("%s: %d failure(s)\n", bench ? "bench" : "test", failures);
  return failures ? 1 : 0;
}
