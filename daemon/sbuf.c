/* sbuf.c - see sbuf.h. */
#include "sbuf.h"

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
  kvf__sb_printf(b, "\"");
  for (; s && *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') kvf__sb_printf(b, "\\%c", c);
    else if (c < 0x20) kvf__sb_printf(b, "\\u%04x", c);
    else kvf__sb_printf(b, "%c", c);
  }
  kvf__sb_printf(b, "\"");
}

void kvf__sb_free(kvf__sbuf *b) {
  free(b->s);
  memset(b, 0, sizeof(*b));
}
