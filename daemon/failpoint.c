/* failpoint.c - see failpoint.h. Empty unless built with -DKVF_FAILPOINTS. */
#ifdef KVF_FAILPOINTS
#include "failpoint.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

static const char *const names[] = {[KVF__FP_WRITE_OUTSIDE] = "write-outside-grant",
                                    [KVF__FP_LATE_WRITE] = "late-write",
                                    [KVF__FP_WRONG_QP] = "write-wrong-qp",
                                    [KVF__FP_BAD_WINDOW_INDEX] = "bad-window-index",
                                    [KVF__FP_RESULT_LOST] = "result-lost",
                                    [KVF__FP_RESULT_WITHHELD] = "result-withheld",
                                    [KVF__FP_REGISTRY_SLOW_SYNC] = "registry-slow-sync",
                                    [KVF__FP_SEND_DONE_WITHHELD] = "send-done-withheld",
                                    [KVF__FP_CLOSE_DIAL_UNREAD] = "close-dial-unread",
                                    [KVF__FP_IDLE_CLOSE_HELD] = "idle-close-held"};

bool kvf__failpoint(int which) {
  const char *env = getenv("KVF_FAILPOINT"), *name = names[which];
  size_t n = strlen(name);
  for (const char *p = env ? strstr(env, name) : NULL; p; p = strstr(p + 1, name))
    if ((p == env || p[-1] == ',') && (p[n] == 0 || p[n] == ',')) return true;
  return false;
}

void kvf__failpoint_runs(const kvf__descs *grant, kvf__runs *runs) {
  kvf__run *r = NULL;
  for (size_t i = 0; i < runs->n; i++)
    if (!r || runs->v[i].dst_off + runs->v[i].len > r->dst_off + r->len) r = &runs->v[i];
  if (!r) return;
  uint64_t end = 0;
  for (size_t i = 0; i < grant->n; i++)
    if (grant->pool[i] == r->dst_pool && grant->offset[i] + grant->length[i] > end)
      end = grant->offset[i] + grant->length[i];
  kvf__warn("failpoint write-outside-grant: moving a write of %llu bytes from pool %u offset %llu to offset %llu, "
            "past the grant", (unsigned long long)r->len, r->dst_pool, (unsigned long long)r->dst_off,
            (unsigned long long)end);
  r->dst_off = end;
}
#else
typedef int kvf__no_failpoints; /* an empty file is not valid C */
#endif
