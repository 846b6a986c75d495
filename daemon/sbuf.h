/* sbuf.h - a growable string for rendering status text and JSON. */
#ifndef KVF_SBUF_H
#define KVF_SBUF_H

#include <stddef.h>

typedef struct kvf__sbuf {
  char *s;
  size_t len, cap;
  int oom;
} kvf__sbuf;

void kvf__sb_printf(kvf__sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Appends s as a JSON string literal, quotes included (proto/json.h's
 * one escaping rule). */
void kvf__sb_json_str(kvf__sbuf *b, const char *s);
void kvf__sb_free(kvf__sbuf *b);

#endif
