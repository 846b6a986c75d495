/* sbuf.c - see sbuf.h. */
#include "sbuf.h"

#include "json.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int reserve(kvf__sbuf *b, size_t more) {
  if (b->oom) return -1;
  if (b->len + more + 1 <= b->cap) return 0;
  size_t ncap = b->cap ? b->cap : 256;
  while (ncap < b->len + more + 1) ncap *= 2;
  char *ns = realloc(b->s, ncap);
  if (!ns) {
    b->oom = 1;
    return -1;
  }
  b->s = ns;
  b->cap = ncap;
  return 0;
}

/* Formats once when the text fits (inspect renders of many thousand rows
 * are mostly this), twice only when the buffer must grow. */
void kvf__sb_printf(kvf__sbuf *b, const char *fmt, ...) {
  va_list ap;
  if (b->oom) return;
  size_t room = b->cap > b->len ? b->cap - b->len : 0;
  va_start(ap, fmt);
  int n = vsnprintf(room ? b->s + b->len : NULL, room, fmt, ap);
  va_end(ap);
  if (n >= 0 && (size_t)n < room) {
    b->len += (size_t)n;
    return;
  }
  if (n < 0 || reserve(b, (size_t)n)) return;
  va_start(ap, fmt);
  vsnprintf(b->s + b->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
}

void kvf__sb_put(kvf__sbuf *b, const char *s, size_t n) {
  if (reserve(b, n)) return;
  memcpy(b->s + b->len, s, n);
  b->len += n;
  b->s[b->len] = '\0';
}

void kvf__sb_u64(kvf__sbuf *b, uint64_t v) {
  char d[20];
  size_t n = 0;
  do d[sizeof(d) - ++n] = (char)('0' + v % 10);
  while ((v /= 10) && n < sizeof(d));
  kvf__sb_put(b, d + sizeof(d) - n, n);
}

static void json_str_slow(kvf__sbuf *b, const char *s) {
  size_t n = kvf__json_quote(NULL, 0, s);
  if (reserve(b, n)) return;
  kvf__json_quote(b->s + b->len, n + 1, s);
  b->len += n;
}

/* Plain printable ASCII (ids mostly are) needs no escaping. */
void kvf__sb_json_str(kvf__sbuf *b, const char *s) {
  size_t i = 0;
  if (!s) s = "";
  while (s[i] >= 0x20 && s[i] < 0x7f && s[i] != '"' && s[i] != '\\') i++;
  if (s[i]) {
    json_str_slow(b, s);
    return;
  }
  kvf__sb_put(b, "\"", 1);
  kvf__sb_put(b, s, i);
  kvf__sb_put(b, "\"", 1);
}

void kvf__sb_free(kvf__sbuf *b) {
  free(b->s);
  memset(b, 0, sizeof(*b));
}
