/* sbuf.h - a growable string for rendering status text and JSON. */
#ifndef KVF_SBUF_H
#define KVF_SBUF_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvf__sbuf {
  char *s;
  size_t len, cap;
  int oom;
} kvf__sbuf;

void kvf__sb_printf(kvf__sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Appends s as a JSON string literal, quotes included (proto/json.h's
 * one escaping rule). */
void kvf__sb_json_str(kvf__sbuf *b, const char *s);
/* Appends n bytes of s; a number in decimal (the hot paths of long renders). */
void kvf__sb_put(kvf__sbuf *b, const char *s, size_t n);
void kvf__sb_u64(kvf__sbuf *b, uint64_t v);
void kvf__sb_free(kvf__sbuf *b);

#endif
