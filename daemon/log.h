/* log.h - one line per event on stderr; "<N>" priority prefixes when stderr
 * is the journal (JOURNAL_STREAM set), so journald keeps the level. */
#ifndef KVF_LOG_H
#define KVF_LOG_H

#include "config.h"

void kvf__log_init(int level);
void kvf__log_set_level(int level);
void kvf__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* At most one line a second from one source (a flood of refused
 * connections must not flood the log). Loop thread only. */
typedef struct kvf__ratelimit {
  uint64_t last_ns;
  uint64_t dropped;
} kvf__ratelimit;
/* True when a line may be written now; *dropped gets how many were held
 * back since the last one. */
bool kvf__log_ratelimit(kvf__ratelimit *rl, uint64_t *dropped);

#define kvf__err(...) kvf__log(KVF__LOG_ERR, __VA_ARGS__)
#define kvf__warn(...) kvf__log(KVF__LOG_WARN, __VA_ARGS__)
#define kvf__info(...) kvf__log(KVF__LOG_INFO, __VA_ARGS__)
#define kvf__debug(...) kvf__log(KVF__LOG_DEBUG, __VA_ARGS__)

#endif
