/* rdma_dev.c - the rdma transport's devices: which device ports it uses,
 * registering every pool with each (once, at start, never on the transfer
 * path), their CM listeners and progress threads, and their async events.
 *
 * A device is named by rdma-devices, or found: every active RoCE v2 port
 * with a GID for our address (rdma-listen, else peer-listen). Its CM
 * listener binds the GID's IP, never a wildcard, as several daemons may
 * share one host. GPU pools are registered for GPUDirect (dmabuf, else
 * nvidia-peermem); a pool that cannot be, or whose gpu-direct is off, is
 * not registered: its transfers go through the bounce path's staging
 * (rdma_bounce.c), which each device registers once here too. */
#include "rdma_int.h"

#include <errno.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include "peer.h"
#include "pool.h"

/* ------------------------------------------------------------ finding devices */

void kvf__rdma_addr_text(const struct sockaddr_storage *ss, char *buf, size_t len) {
  const void *a = ss->ss_family == AF_INET6 ? (const void *)&((const struct sockaddr_in6 *)ss)->sin6_addr
                                            : (const void *)&((const struct sockaddr_in *)ss)->sin_addr;
  if (!inet_ntop(ss->ss_family, a, buf, (socklen_t)len)) snprintf(buf, len, "?");
}

static bool is_wildcard(const char *host) {
  return !host[0] || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "::") == 0;
}

/* The address whose GID we want: rdma-listen's host, else peer-listen's. */
static bool wanted_ip(struct in6_addr *out) {
  const char *h = !is_wildcard(kvfd.cfg.rdma_listen_host) ? kvfd.cfg.rdma_listen_host
                  : !is_wildcard(kvfd.cfg.listen_host)     ? kvfd.cfg.listen_host
                                                           : NULL;
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res;
  if (!h || getaddrinfo(h, NULL, &hints, &res) != 0) return false;
  if (res->ai_family == AF_INET) {
    memset(out, 0, sizeof(*out));
    out->s6_addr[10] = out->s6_addr[11] = 0xff;
    memcpy(&out->s6_addr[12], &((struct sockaddr_in *)res->ai_addr)->sin_addr, 4);
  } else {
    *out = ((struct sockaddr_in6 *)res->ai_addr)->sin6_addr;
  }
  freeaddrinfo(res);
  return true;
}

static bool v4_mapped(const union ibv_gid *g) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(g->raw, prefix, 12) == 0;
}

/* A GID we can reach through the CM: RoCE v2, with an IPv4 or a global
 * IPv6 address. */
static bool usable_gid(const struct ibv_gid_entry *e) {
  if (e->gid_type != IBV_GID_TYPE_ROCE_V2) return false;
  return v4_mapped(&e->gid) || !(e->gid.raw[0] == 0xfe && (e->gid.raw[1] & 0xc0) == 0x80);
}

static void gid_to_addr(rdev *d) {
  memset(&d->addr, 0, sizeof(d->addr));
  if (v4_mapped(&d->gid)) {
    struct sockaddr_in *s = (struct sockaddr_in *)&d->addr;
    s->sin_family = AF_INET;
    memcpy(&s->sin_addr, &d->gid.raw[12], 4);
  } else {
    struct sockaddr_in6 *s = (struct sockaddr_in6 *)&d->addr;
    s->sin6_family = AF_INET6;
    memcpy(&s->sin6_addr, d->gid.raw, 16);
  }
  kvf__rdma_addr_text(&d->addr, d->ip, sizeof(d->ip));
}

/* Picks the GID: the configured index, else the first usable one (matching
 * want when given). */
static int pick_gid(rdev *d, uint32_t tbl_len, const struct in6_addr *want) {
  struct ibv_gid_entry e;
  if (kvfd.cfg.rdma_gid_index >= 0) {
    if (ibv_query_gid_ex(d->ctx, d->port, (uint32_t)kvfd.cfg.rdma_gid_index, &e, 0) != 0 || !usable_gid(&e))
      return -ENOENT;
    d->gid = e.gid;
    d->gid_index = e.gid_index;
    return 0;
  }
  for (uint32_t i = 0; i < tbl_len; i++) {
    if (ibv_query_gid_ex(d->ctx, d->port, i, &e, 0) != 0 || !usable_gid(&e)) continue;
    if (want && memcmp(e.gid.raw, want->s6_addr, 16) != 0) continue;
    if (!want && !v4_mapped(&e.gid)) continue;
    d->gid = e.gid;
    d->gid_index = e.gid_index;
    return 0;
  }
  return -ENOENT;
}

/* Adds (ctx, port) when the port is active RoCE with a GID we can use.
 * why gets the reason when it is not. */
static int add_device(rdma_transport *rt, struct ibv_context *ctx, uint8_t port, const struct in6_addr *want,
                      char *why, size_t wlen) {
  const char *name = ibv_get_device_name(ctx->device);
  struct ibv_port_attr pa;
  struct ibv_device_attr da;
  if (rt->n_devs == MAX_DEVS) return snprintf(why, wlen, "more than %d devices", MAX_DEVS), -E2BIG;
  if (ibv_query_port(ctx, port, &pa) != 0 || ibv_query_device(ctx, &da) != 0)
    return snprintf(why, wlen, "%s port %u cannot be queried", name, port), -ENODEV;
  if (pa.state != IBV_PORT_ACTIVE)
    return snprintf(why, wlen, "%s port %u is not active", name, port), -ENODEV;
  if (pa.link_layer != IBV_LINK_LAYER_ETHERNET)
    return snprintf(why, wlen, "%s port %u is not RoCE (InfiniBand needs IPoIB support)", name, port), -ENODEV;
  rdev *d = &rt->devs[rt->n_devs];
  memset(d, 0, sizeof(*d));
  d->rt = rt;
  d->efd = d->epfd = -1;
  pthread_mutex_init(&d->lock, NULL);
  pthread_cond_init(&d->cond, NULL);
  d->ctx = ctx;
  d->port = port;
  snprintf(d->name, sizeof(d->name), "%s", name);
  if (pick_gid(d, (uint32_t)pa.gid_tbl_len, want) != 0)
    return snprintf(why, wlen, "%s port %u has no RoCE v2 GID %s", name, port,
                    kvfd.cfg.rdma_gid_index >= 0 ? "with an IP at rdma-gid-index" : "for our address"),
           -ENODEV;
  gid_to_addr(d);
  d->max_cqe = (uint32_t)da.max_cqe;
  d->max_qp_wr = (uint32_t)da.max_qp_wr;
  d->max_sge = (uint32_t)da.max_sge;
  d->write_sge = GATHER_MAX; /* lowered by each dialed QP's own (rdma_conn.c) */
  d->index = rt->n_devs++;
  return 0;
}

static int open_named(rdma_transport *rt, const struct in6_addr *want, char *err, size_t errlen) {
  char list[sizeof(kvfd.cfg.rdma_devices)];
  snprintf(list, sizeof(list), "%s", kvfd.cfg.rdma_devices);
  for (char *save = NULL, *w = strtok_r(list, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
    char *colon = strchr(w, ':');
    uint8_t port = colon ? (uint8_t)atoi(colon + 1) : 1;
    if (colon) *colon = 0;
    struct ibv_context *ctx = NULL;
    for (int i = 0; rt->all[i]; i++)
      if (strcmp(ibv_get_device_name(rt->all[i]->device), w) == 0) ctx = rt->all[i];
    if (!ctx) return snprintf(err, errlen, "rdma-devices: no device named %s", w), -ENODEV;
    /* A named device need not carry our address: it may be a second rail. */
    int rc = add_device(rt, ctx, port, NULL, err, errlen);
    if (rc) return rc;
  }
  (void)want;
  return 0;
}

static int open_auto(rdma_transport *rt, const struct in6_addr *want, char *err, size_t errlen) {
  char why[160] = "no RDMA device has an active RoCE port";
  for (int i = 0; rt->all[i]; i++) {
    struct ibv_device_attr da;
    if (ibv_query_device(rt->all[i], &da) != 0) continue;
    for (uint8_t port = 1; port <= da.phys_port_cnt; port++)
      add_device(rt, rt->all[i], port, want, why, sizeof(why));
  }
  if (rt->n_devs) return 0;
  char ip[INET6_ADDRSTRLEN] = "";
  if (want) inet_ntop(AF_INET6, want, ip, sizeof(ip));
  snprintf(err, errlen, "%s%s%s (set rdma-devices or rdma-listen)", want ? "no RoCE v2 GID for " : why,
           want ? ip : "", want ? " on any device" : "");
  return -ENODEV;
}

int kvf__rdma_open_devices(rdma_transport *rt, char *err, size_t errlen) {
  int n = 0;
  rt->all = rdma_get_devices(&n);
  if (!rt->all || n == 0) {
    snprintf(err, errlen, "no RDMA device found");
    return -ENODEV;
  }
  struct in6_addr want;
  bool have = wanted_ip(&want);
  if (kvfd.cfg.rdma_devices[0]) return open_named(rt, have ? &want : NULL, err, errlen);
  return open_auto(rt, have ? &want : NULL, err, errlen);
}

/* ------------------------------------------------------------ registering the pools */

static bool has_ipc_lock(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  unsigned long long caps = 0;
  if (!f) return false;
  while (fgets(line, sizeof(line), f))
    if (sscanf(line, "CapEff: %llx", &caps) == 1) break;
  fclose(f);
  return caps & (1ull << CAP_IPC_LOCK_BIT);
}

/* Each registration pins the pool again, counted against RLIMIT_MEMLOCK
 * unless we hold CAP_IPC_LOCK. */
int kvf__rdma_check_memlock(const rdma_transport *rt, char *err, size_t errlen) {
  uint64_t need = kvfd.cfg.rdma_bounce_size; /* the bounce staging */
  for (size_t i = 0; i < kvfd.n_pools; i++) { /* GPU memory pins no host pages */
    const kvf__pool *p = kvf__pool_get((uint32_t)i);
    if (p && !kvf__pool_gpu(p) && !kvf__rdma_pool_wants_bounce(p)) need += p->size;
  }
  need *= (uint64_t)rt->n_devs;
  struct rlimit rl;
  if (need == 0 || has_ipc_lock() || getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
      rl.rlim_cur >= need)
    return 0;
  snprintf(err, errlen,
           "RLIMIT_MEMLOCK is %llu bytes but registering the pools with %d device(s) pins %llu; set "
           "LimitMEMLOCK=infinity in the service (or ulimit -l unlimited), or grant CAP_IPC_LOCK",
           (unsigned long long)rl.rlim_cur, rt->n_devs, (unsigned long long)need);
  return -ENOMEM;
}

static bool access_ok(const char *path) { return access(path, F_OK) == 0; }

/* A cuda pool, GPUDirect: dmabuf (cuMemGetHandleForAddressRange +
 * ibv_reg_dmabuf_mr) first, then ibv_reg_mr of the device address (works
 * with nvidia-peermem loaded); p->nic_reg says which. NULL when neither. */
/* With memory windows the pools take remote writes only through windows
 * bound on them; else through the pool's own rkey. */
static int pool_access(const rdma_transport *rt) {
  return IBV_ACCESS_LOCAL_WRITE | (rt->mw.on ? IBV_ACCESS_MW_BIND : IBV_ACCESS_REMOTE_WRITE);
}

static struct ibv_mr *register_gpu_pool(rdev *d, kvf__pool *p, char *why, size_t whylen) {
  const int access = pool_access(d->rt);
  int fd = -1;
  uint64_t off = 0;
  int rc = kvf__pool_dmabuf(p, &fd, &off);
  struct ibv_mr *mr = NULL;
  if (rc == 0) {
    mr = ibv_reg_dmabuf_mr(d->pd, off, p->size, (uint64_t)(uintptr_t)p->base, fd, access);
    int e = errno;
    close(fd);
    if (mr) {
      snprintf(p->nic_reg, sizeof(p->nic_reg), "dmabuf");
      return mr;
    }
    snprintf(why, whylen, "ibv_reg_dmabuf_mr: %s", strerror(e));
  } else {
    snprintf(why, whylen, "no dmabuf export (%s)", strerror(-rc));
  }
  mr = ibv_reg_mr(d->pd, p->base, p->size, access);
  if (mr) {
    snprintf(p->nic_reg, sizeof(p->nic_reg), "peermem");
    return mr;
  }
  size_t used = strlen(why);
  snprintf(why + used, whylen - used, "; ibv_reg_mr of GPU memory: %s (nvidia-peermem %s)", strerror(errno),
           access_ok("/sys/module/nvidia_peermem") ? "loaded" : "not loaded");
  snprintf(p->nic_reg, sizeof(p->nic_reg), "bounce");
  return NULL;
}

/* Pool p (id i) with device d: its MR, or none when it bounces (said
 * once, by the first device). */
int kvf__rdma_register_pool(rdev *d, kvf__pool *p, char *err, size_t errlen) {
  rdma_transport *rt = d->rt;
  uint32_t i = p->id;
  if (kvf__rdma_pool_wants_bounce(p) || rt->pool_bounce[i]) {
    if (!rt->pool_bounce[i])
      kvf__info("rdma: pool %s (%s): gpu-direct off: its transfers are staged through pinned memory "
                "(rdma-bounce)", p->name, p->kind);
    rt->pool_bounce[i] = true;
    snprintf(p->nic_reg, sizeof(p->nic_reg), "bounce");
    return 0;
  }
  if (kvf__pool_gpu(p)) {
    char why[256] = "";
    d->mrs[i] = register_gpu_pool(d, p, why, sizeof(why));
    if (!d->mrs[i]) {
      /* Without GPUDirect for this pool on some device, every device
       * stages it: one path per pool, said once. */
      kvf__warn("rdma: pool %s (%s) cannot be registered with %s: %s; its transfers are staged through "
                "pinned memory (rdma-bounce)", p->name, p->kind, d->name, why);
      for (int k = 0; k < d->index; k++) {
        if (rt->devs[k].mrs[i]) ibv_dereg_mr(rt->devs[k].mrs[i]);
        rt->devs[k].mrs[i] = NULL;
        rt->devs[k].lkey[i] = 0;
      }
      rt->pool_bounce[i] = true;
      return 0;
    }
    d->lkey[i] = d->mrs[i]->lkey;
    return 0;
  }
  snprintf(p->nic_reg, sizeof(p->nic_reg), "host");
  d->mrs[i] = ibv_reg_mr(d->pd, p->base, p->size, pool_access(rt));
  if (!d->mrs[i]) {
    int e = errno;
    snprintf(err, errlen, "registering pool %s (%llu bytes) with %s failed: %s%s", p->name,
             (unsigned long long)p->size, d->name, strerror(e),
             e == ENOMEM || e == EPERM ? " (raise RLIMIT_MEMLOCK: LimitMEMLOCK=infinity)" : "");
    return -e;
  }
  d->lkey[i] = d->mrs[i]->lkey;
  return 0;
}

int kvf__rdma_register_pools(rdev *d, char *err, size_t errlen) {
  size_t n = d->rt->n_pool_slots;
  d->mrs = calloc(n ? n : 1, sizeof(*d->mrs));
  d->lkey = calloc(n ? n : 1, sizeof(*d->lkey));
  if (!d->mrs || !d->lkey) return -ENOMEM;
  for (size_t i = 0; i < kvfd.n_pools; i++) {
    kvf__pool *p = kvf__pool_get((uint32_t)i);
    int rc = p ? kvf__rdma_register_pool(d, p, err, errlen) : 0;
    if (rc) return rc;
  }
  return kvf__rdma_bounce_setup(d, err, errlen);
}

int kvf__rdma_setup_device(rdev *d, char *err, size_t errlen) {
  d->pd = ibv_alloc_pd(d->ctx);
  d->ch = d->pd ? ibv_create_comp_channel(d->ctx) : NULL;
  if (!d->ch || set_nonblock(d->ch->fd) || set_nonblock(d->ctx->async_fd)) {
    snprintf(err, errlen, "%s: cannot allocate a protection domain or completion channel", d->name);
    return -ENOMEM;
  }
  return 0;
}

/* ------------------------------------------------------------ listeners and progress threads */

int kvf__rdma_start_listener(rdev *d, uint16_t port, char *err, size_t errlen) {
  struct sockaddr_storage a = d->addr;
  set_port(&a, port);
  if (rdma_create_id(d->rt->cm, &d->listener, d, RDMA_PS_TCP) != 0 ||

      rdma_bind_addr(d->listener, (struct sockaddr *)&a) != 0 || rdma_listen(d->listener, 64) != 0) {
    int e = errno;
    snprintf(err, errlen, "CM listener of %s on %s port %u: %s", d->name, d->ip, port, strerror(e));
    if (d->listener) rdma_destroy_id(d->listener);
    d->listener = NULL;
    return -e;
  }
  if (d->listener->verbs != d->ctx) {
    snprintf(err, errlen, "address %s belongs to another device than %s", d->ip, d->name);
    return -EXDEV;
  }
  d->cm_port = ntohs(rdma_get_src_port(d->listener));
  return 0;
}

int kvf__rdma_start_thread(rdev *d, char *err, size_t errlen) {
  d->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  d->epfd = epoll_create1(EPOLL_CLOEXEC);
  struct epoll_event a = {.events = EPOLLIN}, b = {.events = EPOLLIN};
  if (d->efd < 0 || d->epfd < 0 || epoll_ctl(d->epfd, EPOLL_CTL_ADD, d->efd, &a) != 0 ||
      epoll_ctl(d->epfd, EPOLL_CTL_ADD, d->ch->fd, &b) != 0) {
    snprintf(err, errlen, "%s: progress thread setup: %s", d->name, strerror(errno));
    return -errno;
  }
  if (pthread_create(&d->thr, NULL, kvf__rdma_progress_main, d) != 0) {
    snprintf(err, errlen, "%s: cannot start its progress thread", d->name);
    return -EAGAIN;
  }
  d->started = true;
  return 0;
}

/* After its port went down and up (or its GIDs changed) a device's CM
 * listener hears no more requests (seen with rxe on Linux 6.1): listen again
 * on the same address and port, which the peers already know. */
void kvf__rdma_relisten(rdev *d) {
  char err[256];
  if (d->listener) rdma_destroy_id(d->listener);
  d->listener = NULL;
  if (kvf__rdma_start_listener(d, d->cm_port, err, sizeof(err)) != 0) kvf__warn("rdma: %s; retrying", err);
  else kvf__info("rdma: %s listening again on %s:%u", d->name, d->ip, d->cm_port);
}

/* ------------------------------------------------------------ device async events */

void kvf__rdma_on_dev_async(uv_poll_t *h, int status, int events) {
  rdev *d = h->data;
  struct ibv_async_event ev;
  while (ibv_get_async_event(d->ctx, &ev) == 0) {
    enum ibv_event_type type = ev.event_type;
    kvf__peer *p = NULL;
    uint64_t gen = 0;
    if ((type == IBV_EVENT_QP_FATAL || type == IBV_EVENT_QP_REQ_ERR || type == IBV_EVENT_QP_ACCESS_ERR) &&
        ev.element.qp && ev.element.qp->qp_context) {
      rqp *q = ev.element.qp->qp_context;
      if (q->outbound) { /* accepted QPs: see qp_failed */
        p = q->lk->rp->p;
        gen = q->lk->rp->gen;
      }
    } else if (type == IBV_EVENT_CQ_ERR && ev.element.cq && ev.element.cq->cq_context) {
      rlink *lk = ev.element.cq->cq_context;
      p = lk->rp->p;
      gen = lk->rp->gen;
    }
    int port = ev.element.port_num;
    ibv_ack_async_event(&ev); /* before acting: tearing down waits for the ack */
    if (type == IBV_EVENT_PORT_ERR || type == IBV_EVENT_PORT_ACTIVE)
      kvf__warn("rdma: %s port %d is %s", d->name, port, type == IBV_EVENT_PORT_ACTIVE ? "active" : "down");
    if ((type == IBV_EVENT_PORT_ACTIVE || type == IBV_EVENT_GID_CHANGE) && port == d->port) kvf__rdma_relisten(d);
    else if (type == IBV_EVENT_DEVICE_FATAL)
      kvf__err("rdma: %s: fatal device error", d->name);
    rpeer *rp = p ? rpeer_of(d->rt, p) : NULL;
    if (rp && rp->gen == gen) {
      char why[128];
      snprintf(why, sizeof(why), "rdma: %s on %s", ibv_event_type_str(type), d->name);
      kvf__rdma_reset_peer(rp, why);
    }
  }
}

/* ------------------------------------------------------------ teardown */

void kvf__rdma_free_device(rdev *d) {
  for (size_t i = 0; d->mrs && i < d->rt->n_pool_slots; i++)
    if (d->mrs[i]) ibv_dereg_mr(d->mrs[i]);
  kvf__rdma_bounce_free(d);
  free(d->mrs);
  free(d->lkey);
  if (d->ch) ibv_destroy_comp_channel(d->ch);
  if (d->pd) ibv_dealloc_pd(d->pd);
  if (d->efd >= 0) close(d->efd);
  if (d->epfd >= 0) close(d->epfd);
  pthread_mutex_destroy(&d->lock);
  pthread_cond_destroy(&d->cond);
}

