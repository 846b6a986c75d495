/* log.c - one line per event on stderr (see log.h).
 *
 * Each line is formatted into one buffer and written with one write(2), so
 * lines from several threads never interleave (a write of at most PIPE_BUF
 * bytes to a pipe or socket is atomic, and the journal's stream is one). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LOG_LINE_MAX 4096 /* PIPE_BUF on Linux: the most one write keeps whole */

static atomic_int log_level = KVF__LOG_INFO;
static atomic_int journal = -1; /* -1: not looked at yet; else 0 or 1 */

static const char *const level_names[] = {"err", "warn", "info", "debug"};
/* systemd priorities (sd-daemon.h): SD_ERR, SD_WARNING, SD_INFO, SD_DEBUG */
static const char level_prio[] = {'3', '4', '6', '7'};

static int clamp_level(int level) {
  if (level < KVF__LOG_ERR) return KVF__LOG_ERR;
  if (level > KVF__LOG_DEBUG) return KVF__LOG_DEBUG;
  return level;
}

static int detect_journal(void) {
  const char *js = getenv("JOURNAL_STREAM");
  return js && js[0];
}

void kvf__log_init(int level) {
  atomic_store(&journal, detect_journal());
  kvf__log_set_level(level);
}

void kvf__log_set_level(int level) { atomic_store(&log_level, clamp_level(level)); }

/* Logging may happen before kvf__log_init (e.g. a config error). */
static bool to_journal(void) {
  int j = atomic_load(&journal);
  if (j < 0) {
    j = detect_journal();
    atomic_store(&journal, j);
  }
  return j == 1;
}

/* journald stamps time, pid and name itself and keeps the level from the
 * "<N>" prefix; a terminal or a file gets them written out. */
static int put_prefix(char *buf, size_t cap, int level) {
  if (to_journal())
    return snprintf(buf, cap, "<%c>%s: ", level_prio[level], level_names[level]);
  struct timespec ts;
  struct tm tm;
  char stamp[32];
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
  return snprintf(buf, cap, "%s.%03ldZ kvferryd[%ld]: %s: ", stamp, ts.tv_nsec / 1000000L,
                  (long)getpid(), level_names[level]);
}

/* One event, one line: embedded line breaks become spaces (under journald a
 * newline would start a new entry without the priority), trailing blanks go. */
static size_t flatten(char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] == '\n' || s[i] == '\r') s[i] = ' ';
  while (n > 0 && s[n - 1] == ' ') n--;
  return n;
}

static void write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return; /* nowhere else to report a failing stderr */
    p += w;
    n -= (size_t)w;
  }
}

void kvf__log(int level, const char *fmt, ...) {
  if (level > atomic_load_explicit(&log_level, memory_order_relaxed)) return;
  int saved_errno = errno; /* callers log, then look at errno */
  char buf[LOG_LINE_MAX];
  const size_t room = sizeof buf;
  level = clamp_level(level);
  int p = put_prefix(buf, room, level);
  size_t n = p < 0 ? 0 : (size_t)p < room - 1 ? (size_t)p : room - 1;
  size_t space = room - n; /* >= 1: vsnprintf's NUL, which becomes the '\n' */
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(buf + n, space, fmt, ap);
  va_end(ap);
  size_t msg = m < 0 ? 0 : (size_t)m < space ? (size_t)m : space - 1;
  if (m > 0 && (size_t)m >= space && msg >= 3) memcpy(buf + n + msg - 3, "...", 3); /* cut */
  n += flatten(buf + n, msg);
  buf[n++] = '\n';
  write_all(STDERR_FILENO, buf, n);
  errno = saved_errno;
}

bool kvf__log_ratelimit(kvf__ratelimit *rl, uint64_t *dropped) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  if (rl->last_ns && now - rl->last_ns < 1000000000ull) {
    rl->dropped++;
    return false;
  }
  rl->last_ns = now;
  *dropped = rl->dropped;
  rl->dropped = 0;
  return true;
}
