/* libkvferry_mem.c - finding the file behind an engine's host memory
 * (kvf_mem_register with fd -1): the daemon maps that file, so the memory
 * must be a shared mapping of one file that this process can hand over. */
#include "client_int.h"
#include "kvferry.h"
#include "libkvferry_cuda.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/magic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

/* One line of /proc/self/maps. */
struct vma {
  uintptr_t start, end;
  bool shared;
  uint64_t offset;
  dev_t dev;
  ino_t ino;
  char path[4096];
};

static bool parse_vma(const char *line, struct vma *v) {
  unsigned long long start, end, off, ino;
  unsigned maj, min;
  char perms[8];
  int pos = 0;
  if (sscanf(line, "%llx-%llx %7s %llx %x:%x %llu %n", &start, &end, perms, &off, &maj, &min, &ino,
             &pos) < 7)
    return false;
  v->start = (uintptr_t)start;
  v->end = (uintptr_t)end;
  v->shared = perms[3] == 's';
  v->offset = off;
  v->dev = makedev(maj, min);
  v->ino = (ino_t)ino;
  v->path[0] = '\0';
  if (pos > 0) {
    snprintf(v->path, sizeof(v->path), "%s", line + pos);
    v->path[strcspn(v->path, "\n")] = '\0';
  }
  return true;
}

/* Whether next continues the file mapping of cur without a gap (one
 * mapping the kernel split, e.g. by mprotect of part of it). */
static bool continues(const struct vma *cur, const struct vma *next) {
  return next->start == cur->end && next->shared && next->dev == cur->dev && next->ino == cur->ino &&
         next->offset == cur->offset + (cur->end - cur->start);
}

/* The mapping of [addr, addr + size) in *first (its file and the file
 * offset of addr in *offset). */
static int find_vma(uintptr_t addr, uint64_t size, struct vma *first, uint64_t *offset) {
  FILE *f = fopen("/proc/self/maps", "re");
  if (!f) return -errno;
  char line[4352];
  struct vma v, cur = {0};
  bool found = false;
  int rc = KVF_EINVAL;
  uintptr_t want_end = addr + size;
  while (fgets(line, sizeof(line), f)) {
    if (!parse_vma(line, &v)) continue;
    if (!found) {
      if (addr < v.start || addr >= v.end) continue;
      /* Anonymous (malloc, MAP_ANONYMOUS|MAP_SHARED has inode 0 too) or
       * private memory has no file another process can map. */
      if (!v.shared || v.ino == 0) break;
      found = true;
      *first = v;
      *offset = v.offset + (addr - v.start);
      cur = v;
    } else if (!continues(&cur, &v)) {
      break;
    } else {
      cur = v;
    }
    if (want_end <= cur.end) {
      rc = 0;
      break;
    }
  }
  fclose(f);
  return rc;
}

static bool same_file(int fd, dev_t dev, ino_t ino) {
  struct stat st;
  return fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

/* A read-write descriptor of the file from one this process holds: the
 * engine's own memfd, typically. Reopening through /proc gives read-write
 * even when the engine's fd is read-only (if the file's mode allows). */
static int fd_from_open_fds(dev_t dev, ino_t ino) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -errno;
  int self = dirfd(d), out = KVF_EINVAL;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    char *end;
    long fd = strtol(e->d_name, &end, 10);
    if (*end || fd == self || !same_file((int)fd, dev, ino)) continue;
    int fl = fcntl((int)fd, F_GETFL);
    if (fl >= 0 && (fl & O_ACCMODE) == O_RDWR) {
      out = fcntl((int)fd, F_DUPFD_CLOEXEC, 0);
    } else {
      char path[64];
      snprintf(path, sizeof(path), "/proc/self/fd/%ld", fd);
      out = open(path, O_RDWR | O_CLOEXEC);
    }
    if (out < 0) out = -errno;
    break;
  }
  closedir(d);
  return out;
}

/* A file that is still linked on tmpfs (shm_open) or hugetlbfs, by path. */
static int fd_from_path(const struct vma *v) {
  size_t n = strlen(v->path);
  if (v->path[0] != '/' || (n > 10 && strcmp(v->path + n - 10, " (deleted)") == 0)) return KVF_EINVAL;
  struct statfs fs;
  if (statfs(v->path, &fs) != 0) return KVF_EINVAL;
  if (fs.f_type != TMPFS_MAGIC && fs.f_type != HUGETLBFS_MAGIC) return KVF_EINVAL;
  int fd = open(v->path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return KVF_EINVAL;
  if (!same_file(fd, v->dev, v->ino)) { /* replaced since it was mapped */
    close(fd);
    return KVF_EINVAL;
  }
  return fd;
}

int kvf__host_mem_fd(const void *addr, uint64_t size, int *fd, uint64_t *offset) {
  if (!addr || size == 0 || (uintptr_t)addr + size < (uintptr_t)addr) return KVF_EINVAL;
  struct vma *v = malloc(sizeof(*v)); /* 4 KiB of path: not on an engine's stack */
  if (!v) return -ENOMEM;
  int rc = find_vma((uintptr_t)addr, size, v, offset);
  if (rc == 0) {
    rc = fd_from_open_fds(v->dev, v->ino);
    if (rc == KVF_EINVAL) rc = fd_from_path(v);
  }
  free(v);
  if (rc < 0) return rc;
  *fd = rc;
  return 0;
}

