/* ctl_gpu.c - `kvferryctl doctor`'s GPU checks (see ctl_gpu.h).
 *
 * What the GPUDirect RDMA field guides ask of a node: a driver that sees the
 * GPUs; dmabuf support (GPU, driver and kernel) or else nvidia-peermem; an
 * IOMMU that is off or in passthrough for the GPUs; a BAR1 aperture that
 * covers GPU memory; each GPU close to an RDMA NIC (same PCIe switch, from
 * sysfs); no ACS redirect on the bridges between them; and, from the daemon,
 * the NIC registration each cuda pool actually got. */
#include "ctl_gpu.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "ctl.h"
#include "cuda/cudrv.h"

#define MAX_GPUS 64

typedef struct gpu {
  char name[96];
  char bdf[32];       /* as sysfs spells it: 0000:19:00.0 */
  uint64_t mem;
  bool dmabuf;
} gpu;

static struct {
  bool probed;
  int rc;             /* 0, or -1: no driver / no GPU (why in err) */
  bool nvidia_dev;    /* /dev/nvidia0 or /proc/driver/nvidia exists */
  char err[300];
  int driver_version;
  int n;
  gpu g[MAX_GPUS];
} G;

static void norm_bdf(const char *in, char *out, size_t cap) {
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  if (sscanf(in, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) == 4)
    snprintf(out, cap, "%04x:%02x:%02x.%x", dom, bus, dev, fn);
  else
    snprintf(out, cap, "%s", in);
}

static void probe(void) {
  if (G.probed) return;
  G.probed = true;
  G.nvidia_dev = access("/dev/nvidia0", F_OK) == 0 || access("/proc/driver/nvidia", F_OK) == 0;
  kvf_cu cu;
  if (kvf__cu_load(&cu, G.err, sizeof(G.err)) != 0) {
    G.rc = -1;
    return;
  }
  G.driver_version = cu.driver_version;
  int n = 0;
  cu.DeviceGetCount(&n);
  for (int i = 0; i < n && G.n < MAX_GPUS; i++) {
    CUdevice d;
    if (cu.DeviceGet(&d, i) != KVF_CU_SUCCESS) continue;
    gpu *g = &G.g[G.n++];
    char raw[32] = "";
    cu.DeviceGetName(g->name, sizeof(g->name), d);
    cu.DeviceGetPCIBusId(raw, sizeof(raw), d);
    for (char *c = raw; *c; c++) *c = (char)tolower((unsigned char)*c);
    norm_bdf(raw, g->bdf, sizeof(g->bdf));
    size_t mem = 0;
    cu.DeviceTotalMem(&mem, d);
    g->mem = mem;
    int v = 0;
    cu.DeviceGetAttribute(&v, KVF_CU_ATTR_DMA_BUF_SUPPORTED, d);
    g->dmabuf = v != 0;
  }
  if (G.n == 0) {
    snprintf(G.err, sizeof(G.err), "the driver loads but sees no GPU");
    G.rc = -1;
  }
  kvf__cu_unload(&cu);
}

/* Skip (no GPU here) or fail (a GPU but no working driver): for checks that
 * need the GPUs. Returns -1 when the caller should go on. */
static int need_gpus(char *detail, size_t cap) {
  probe();
  if (G.rc == 0) return -1;
  snprintf(detail, cap, "%s", G.nvidia_dev ? "the NVIDIA driver does not work (see the cuda check)" : "no NVIDIA GPU here");
  return G.nvidia_dev ? CTL_GPU_FAIL : CTL_GPU_SKIP;
}

static void fmt_bytes(uint64_t v, char *buf, size_t cap) {
  if (v >= (1ull << 30)) snprintf(buf, cap, "%.0f GiB", (double)v / (1ull << 30));
  else snprintf(buf, cap, "%.0f MiB", (double)v / (1ull << 20));
}

/* ------------------------------------------------------------ driver */

int ctl_gpu_driver(char *detail, size_t cap) {
  probe();
  if (G.rc) {
    snprintf(detail, cap, "%s%s", G.err,
             G.nvidia_dev ? ": install a driver matching the kernel module (nvidia-smi must work)"
                          : " (no GPU here: cuda:N pools unavailable, host pools work)");
    return G.nvidia_dev ? CTL_GPU_FAIL : CTL_GPU_SKIP;
  }
  size_t o = (size_t)snprintf(detail, cap, "driver %d.%d, %d GPU%s:", G.driver_version / 1000,
                              G.driver_version % 1000 / 10, G.n, G.n == 1 ? "" : "s");
  for (int i = 0; i < G.n && o < cap; i++)
    o += (size_t)snprintf(detail + o, cap - o, "%s cuda:%d %s (%s)", i ? "," : "", i, G.g[i].name, G.g[i].bdf);
  return CTL_GPU_OK;
}

/* ------------------------------------------------------------ dmabuf / peermem */

static bool kernel_at_least(int major, int minor) {
  struct utsname u;
  int ma = 0, mi = 0;
  if (uname(&u) != 0 || sscanf(u.release, "%d.%d", &ma, &mi) != 2) return false;
  return ma > major || (ma == major && mi >= minor);
}

static bool peermem_loaded(void) { return access("/sys/module/nvidia_peermem", F_OK) == 0; }

static int dmabuf_gpus(void) {
  int k = 0;
  for (int i = 0; i < G.n; i++) k += G.g[i].dmabuf;
  return k;
}

int ctl_gpu_dmabuf(char *detail, size_t cap) {
  int r = need_gpus(detail, cap);
  if (r >= 0) return r;
  struct utsname u;
  uname(&u);
  int k = dmabuf_gpus();
  bool kern = kernel_at_least(5, 12);
  if (k == G.n && kern) {
    snprintf(detail, cap, "all %d GPUs export dmabuf; kernel %s has ibv_reg_dmabuf_mr support", G.n, u.release);
    return CTL_GPU_OK;
  }
  snprintf(detail, cap, "%d of %d GPUs export dmabuf, kernel %s%s: %s", k, G.n, u.release,
           kern ? "" : " (< 5.12: no dmabuf MRs)",
           peermem_loaded() ? "nvidia-peermem is loaded and is used instead"
                            : "use the open NVIDIA kernel modules (>= 515) and a kernel >= 5.12, or load nvidia-peermem");
  return peermem_loaded() ? CTL_GPU_OK : CTL_GPU_WARN;
}

int ctl_gpu_peermem(char *detail, size_t cap) {
  int r = need_gpus(detail, cap);
  if (r >= 0) return r;
  if (peermem_loaded()) {
    snprintf(detail, cap, "nvidia_peermem is loaded (ibv_reg_mr of GPU memory works)");
    return CTL_GPU_OK;
  }
  if (dmabuf_gpus() == G.n && kernel_at_least(5, 12)) {
    snprintf(detail, cap, "not loaded; not needed: dmabuf registration is used");
    return CTL_GPU_OK;
  }
  snprintf(detail, cap, "not loaded and dmabuf unavailable: rdma stages GPU pools through pinned host memory (rdma-bounce); modprobe nvidia-peermem");
  return CTL_GPU_WARN;
}

/* ------------------------------------------------------------ IOMMU */

static int read_line(const char *path, char *buf, size_t cap) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  if (!fgets(buf, (int)cap, f)) buf[0] = '\0';
  fclose(f);
  buf[strcspn(buf, "\n")] = '\0';
  return 0;
}

int ctl_gpu_iommu(char *detail, size_t cap) {
  int r = need_gpus(detail, cap);
  if (r >= 0) return r;
  char cmdline[2048] = "";
  read_line("/proc/cmdline", cmdline, sizeof(cmdline));
  int translated = 0, identity = 0, none = 0;
  char first[64] = "";
  for (int i = 0; i < G.n; i++) {
    char path[256], type[64] = "";
    snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/iommu_group/type", G.g[i].bdf);
    if (read_line(path, type, sizeof(type)) != 0) {
      none++;
      continue;
    }
    if (strcmp(type, "identity") == 0) identity++;
    else {
      translated++;
      if (!first[0]) snprintf(first, sizeof(first), "%s (%s)", G.g[i].bdf, type);
    }
  }
  if (translated) {
    snprintf(detail, cap, "the IOMMU translates DMA for %d GPU(s), e.g. %s: GPUDirect RDMA and P2P may fail or slow "
             "down; boot with iommu=pt (intel_iommu=on iommu=pt)", translated, first);
    return CTL_GPU_WARN;
  }
  if (identity) {
    snprintf(detail, cap, "passthrough (identity) for %d GPU(s)", identity);
    return CTL_GPU_OK;
  }
  snprintf(detail, cap, "no IOMMU groups for the GPUs (IOMMU off%s)", strstr(cmdline, "iommu") ? ", per the kernel command line" : "");
  return CTL_GPU_OK;
}

/* ------------------------------------------------------------ BAR1 */

static int bar_size(const char *bdf, int bar, uint64_t *size) {
  char path[256], line[256];
  snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/resource", bdf);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  int rc = -1;
  for (int i = 0; fgets(line, sizeof(line), f); i++) {
    if (i != bar) continue;
    unsigned long long s = 0, e = 0, fl = 0;
    if (sscanf(line, "%llx %llx %llx", &s, &e, &fl) == 3) {
      *size = e > s ? e - s + 1 : 0;
      rc = 0;
    }
    break;
  }
  fclose(f);
  return rc;
}

int ctl_gpu_bar1(char *detail, size_t cap) {
  int r = need_gpus(detail, cap);
  if (r >= 0) return r;
  int small = 0, unknown = 0;
  uint64_t min_bar = UINT64_MAX, mem = 0;
  for (int i = 0; i < G.n; i++) {
    uint64_t b = 0;
    if (bar_size(G.g[i].bdf, 1, &b) != 0 || b == 0) {
      unknown++;
      continue;
    }
    if (b < min_bar) {
      min_bar = b;
      mem = G.g[i].mem;
    }
    small += b < G.g[i].mem;
  }
  char bs[32], ms[32];
  if (unknown == G.n) {
    snprintf(detail, cap, "cannot read BAR1 from /sys/bus/pci/devices/*/resource (a VM without PCI topology?)");
    return CTL_GPU_WARN;
  }
  fmt_bytes(min_bar, bs, sizeof(bs));
  fmt_bytes(mem, ms, sizeof(ms));
  if (small) {
    snprintf(detail, cap, "BAR1 is %s on %d GPU(s), less than their %s: peermem registrations are limited to "
             "it; enable large/resizable BAR in the firmware", bs, small, ms);
    return CTL_GPU_WARN;
  }
  snprintf(detail, cap, "BAR1 %s covers GPU memory (%s)%s", bs, ms, unknown ? " (some GPUs unreadable)" : "");
  return CTL_GPU_OK;
}

/* ------------------------------------------------------------ PCIe path to the NICs */

/* The device's sysfs path split into components below /sys/devices. */
static int pci_chain(const char *devpath, char comps[][32], int max) {
  char real[PATH_MAX];
  if (!realpath(devpath, real)) return -1;
  const char *p = strstr(real, "/sys/devices/");
  if (!p) return -1;
  p += strlen("/sys/devices/");
  int n = 0;
  while (*p && n < max) {
    size_t len = strcspn(p, "/");
    if (len >= 32) return -1;
    memcpy(comps[n], p, len);
    comps[n][len] = '\0';
    n++;
    p += len;
    if (*p == '/') p++;
  }
  return n;
}

typedef struct nic_path {
  char nic[64];
  int common;       /* components shared with the GPU's chain */
  int gpu_depth, nic_depth;
  char g[16][32], n[16][32];
} nic_path;

/* The RDMA NIC closest to GPU i (most shared components); -1 if none. */
static int nearest_nic(int i, nic_path *best) {
  char path[256];
  nic_path cur;
  snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s", G.g[i].bdf);
  int gd = pci_chain(path, cur.g, 16);
  if (gd < 0) return -2;
  DIR *d = opendir("/sys/class/infiniband");
  if (!d) return -1;
  struct dirent *e;
  int found = -1;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof(path), "/sys/class/infiniband/%.64s/device", e->d_name);
    int nd = pci_chain(path, cur.n, 16);
    if (nd < 0) continue;
    int c = 0;
    while (c < gd && c < nd && strcmp(cur.g[c], cur.n[c]) == 0) c++;
    if (found < 0 || c > best->common) {
      cur.common = c;
      cur.gpu_depth = gd;
      cur.nic_depth = nd;
      snprintf(cur.nic, sizeof(cur.nic), "%.63s", e->d_name);
      *best = cur;
      found = 0;
    }
  }
  closedir(d);
  return found;
}

/* NCCL's names: PIX/PXB share a switch, PHB only the root complex, SYS not even that. */
static const char *distance(const nic_path *p) {
  if (p->common == 0) return "SYS";
  if (p->common == 1) return "PHB";
  return p->common == p->gpu_depth - 2 || p->common == p->nic_depth - 2 ? "PIX" : "PXB";
}

int ctl_gpu_nic_path(char *detail, size_t cap) {
  int r = need_gpus(detail, cap);
  if (r >= 0) return r;
  size_t o = 0;
  int far = 0, none = 0;
  for (int i = 0; i < G.n && o < cap; i++) {
    nic_path p;
    int rc = nearest_nic(i, &p);
    if (rc == -1) {
      snprintf(detail, cap, "no RDMA NICs (/sys/class/infiniband is empty): tcp only, GPU pools bounce");
      return CTL_GPU_SKIP;
    }
    if (rc == -2) {
      none++;
      continue;
    }
    const char *dist = distance(&p);
    far += strcmp(dist, "PIX") != 0 && strcmp(dist, "PXB") != 0;
    o += (size_t)snprintf(detail + o, cap - o, "%scuda:%d-%s %s", i ? ", " : "", i, p.nic, dist);
  }
  if (none == G.n) {
    snprintf(detail, cap, "cannot place the GPUs in sysfs's PCI tree");
    return CTL_GPU_WARN;
  }
  if (far && o < cap)
    snprintf(detail + o, cap - o, ": a GPU without a NIC on its PCIe switch pays a trip through the CPU "
                                  "(PHB/SYS); pair each GPU with a NIC under the same switch");
  return far ? CTL_GPU_WARN : CTL_GPU_OK;
}

/* ------------------------------------------------------------ ACS */

/* ACS control of a PCI device: 0 and *ctl set, 1 when it has no ACS
 * capability, -1 when the config space cannot be read (not root). */
static int acs_ctl(const char *bdf, unsigned *ctl) {
  char path[256];
  uint8_t cfg[4096];
  snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/config", bdf);
  FILE *f = fopen(path, "rb");
  if (!f) return -1;
  size_t n = fread(cfg, 1, sizeof(cfg), f);
  fclose(f);
  if (n < 0x104) return -1; /* only root reads the extended space */
  unsigned off = 0x100;
  for (int guard = 0; off >= 0x100 && off + 8 <= n && guard < 64; guard++) {
    uint32_t hdr = (uint32_t)cfg[off] | (uint32_t)cfg[off + 1] << 8 | (uint32_t)cfg[off + 2] << 16 |
                   (uint32_t)cfg[off + 3] << 24;
    if (hdr == 0 || hdr == 0xffffffffu) break;
    if ((hdr & 0xffff) == 0x000d) {
      *ctl = (unsigned)cfg[off + 6] | (unsigned)cfg[off + 7] << 8;
      return 0;
    }
    off = hdr >> 20;
  }
  return 1;
}

static bool is_bdf(const char *s) {
  unsigned a, b, c, d;
  return sscanf(s, "%x:%x:%x.%x", &a, &b, &c, &d) == 4;
}

int ctl_gpu_acs(char *detail, size_t cap) {
  int r = need_gpus(detail, cap);
  if (r >= 0) return r;
  int redirect = 0, unreadable = 0, bridges = 0;
  char where[128] = "";
  for (int i = 0; i < G.n; i++) {
    nic_path p;
    int rc = nearest_nic(i, &p);
    if (rc == -1) {
      snprintf(detail, cap, "no RDMA NICs: no GPU<->NIC peer traffic to check");
      return CTL_GPU_SKIP;
    }
    if (rc) continue;
    /* the bridges from the common ancestor down to each end (the ends
     * themselves are not bridges) */
    for (int side = 0; side < 2; side++) {
      int depth = side ? p.nic_depth : p.gpu_depth;
      for (int k = p.common > 1 ? p.common - 1 : 1; k < depth - 1; k++) {
        const char *bdf = side ? p.n[k] : p.g[k];
        if (!is_bdf(bdf)) continue;
        unsigned ctl = 0;
        bridges++;
        int a = acs_ctl(bdf, &ctl);
        if (a < 0) unreadable++;
        else if (a == 0 && (ctl & 0xc)) { /* RR or CR */
          redirect++;
          if (!where[0]) snprintf(where, sizeof(where), "%s (ACS ctl 0x%x)", bdf, ctl);
        }
      }
    }
  }
  if (redirect) {
    snprintf(detail, cap, "ACS redirects peer-to-peer requests on %d bridge(s), e.g. %s: GPU<->NIC traffic goes "
             "up to the root complex; disable ACS P2P redirect (setpci, or the BIOS) on those switches", redirect, where);
    return CTL_GPU_WARN;
  }
  if (unreadable) {
    snprintf(detail, cap, "cannot read the PCI config of %d bridge(s): run doctor as root", unreadable);
    return CTL_GPU_WARN;
  }
  snprintf(detail, cap, bridges ? "no ACS redirect on the %d bridge(s) between GPUs and NICs" : "no bridges between GPUs and NICs",
           bridges);
  return CTL_GPU_OK;
}

/* ------------------------------------------------------------ the daemon's pools */

int ctl_gpu_pools(const char *pools, char *detail, size_t cap) {
  if (!pools) {
    snprintf(detail, cap, "daemon not reachable");
    return CTL_GPU_SKIP;
  }
  const char *it = kvf__json_get(pools, "pools"), *e;
  int n = 0, direct = 0, bounce = 0;
  size_t o = 0;
  detail[0] = '\0';
  while (it && (e = kvf__json_next(&it))) {
    char kind[32] = "", name[64] = "", reg[32] = "";
    kvf__json_get_str(e, "kind", kind, sizeof kind);
    if (strncmp(kind, "cuda:", 5) != 0) continue;
    kvf__json_get_str(e, "name", name, sizeof name);
    if (kvf__json_get_str(e, "registration", reg, sizeof reg) != 0) snprintf(reg, sizeof reg, "unknown");
    n++;
    bool d = strcmp(reg, "dmabuf") == 0 || strcmp(reg, "peermem") == 0;
    direct += d;
    bounce += !d;
    if (o < cap)
      o += (size_t)snprintf(detail + o, cap - o, "%s%s (%s) %s", n > 1 ? ", " : "", name, kind,
                            d                             ? reg
                            : strcmp(reg, "none") == 0   ? "unregistered: tcp-bounce"
                            : strcmp(reg, "bounce") == 0 ? "bounce: rdma-bounce"
                                                         : reg);
  }
  if (n == 0) {
    snprintf(detail, cap, "no cuda pools");
    return CTL_GPU_SKIP;
  }
  if (bounce && o < cap)
    snprintf(detail + o, cap - o, ": remote transfers of bounce pools stage through pinned host memory; "
                                  "see the dmabuf and nvidia-peermem checks");
  return bounce ? CTL_GPU_WARN : CTL_GPU_OK;
}
