/* pool.h - daemon-owned memory pools, shared with clients by fd. */
#ifndef KVF_POOL_H
#define KVF_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"

struct kvf__pool {
  uint32_t id;
  char name[KVF__NAME_MAX + 1];
  char kind[16];
  char backing[32];      /* "memfd-hugetlb", "memfd" */
  uint64_t size;
  int fd;                /* shared with clients by SCM_RIGHTS */
  uint8_t *base;         /* the daemon's own mapping */
  bool locked;           /* mlock succeeded */
};
typedef struct kvf__pool kvf__pool;

/* Allocates and maps a pool from its config entry. */
int kvf__pool_create(const kvf__pool_cfg *pc, uint32_t id, int hugepages, bool want_mlock,
                     kvf__pool **out, char *err, size_t errlen);
void kvf__pool_destroy(kvf__pool *p);
/* 0 when [offset, offset+len) lies inside the pool (overflow-safe). */
int kvf__pool_check_range(const kvf__pool *p, uint64_t offset, uint64_t len);

#endif
