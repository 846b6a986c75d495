/* sbuf.c - see sbuf.h. */
#include "sbuf.h"

#include "json.h"

#include <stdarg.h>
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

void kvf__sb_printf(kvf__sbuf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0 || reserve(b, (size_t)n)) return;
  va_start(ap, fmt);
  vsnprintf(b->s + b->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
}

void kvf__sb_json_str(kvf__sbuf *b, const char *s) {
  size_t n = kvf__json_quote(NULL, 0, s);
  if (reserve(b, n)) return;
  kvf__json_quote(b->s + b->len, n + 1, s);
  b->len += n;
}

void kvf__sb_free(kvf__sbuf *b) {
  free(b->s);
  memset(b, 0, sizeof(*b));
}
