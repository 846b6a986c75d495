/* ctl_json.c - just enough JSON to read the daemon's status, pools and
 * peers documents (which the daemon writes, so they are well formed) and to
 * write strings. Values are returned as pointers into the document. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"

static const char *ws(const char *p) {
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
  return p;
}

/* The byte after the string literal at p (which is at its '"'). */
static const char *skip_str(const char *p) {
  for (p++; *p; p++) {
    if (*p == '\\') {
      if (!*++p) return NULL;
    } else if (*p == '"') {
      return p + 1;
    }
  }
  return NULL;
}

/* The byte after the value at p, or NULL when malformed. */
static const char *skip_value(const char *p) {
  p = ws(p);
  if (*p == '"') return skip_str(p);
  if (*p != '{' && *p != '[') {
    const char *s = p;
    while (*p && !strchr(",}] \t\r\n", *p)) p++;
    return p == s ? NULL : p;
  }
  int depth = 0;
  while (*p) {
    if (*p == '"') {
      if (!(p = skip_str(p))) return NULL;
      continue;
    }
    if (*p == '{' || *p == '[') depth++;
    else if ((*p == '}' || *p == ']') && --depth == 0) return p + 1;
    p++;
  }
  return NULL;
}

const char *cj_get(const char *obj, const char *key) {
  const char *p = obj ? ws(obj) : NULL;
  size_t kl = strlen(key);
  if (!p || *p != '{') return NULL;
  p = ws(p + 1);
  while (*p == '"') {
    const char *k = p + 1, *e = skip_str(p);
    if (!e) return NULL;
    bool match = (size_t)(e - 1 - k) == kl && memcmp(k, key, kl) == 0;
    p = ws(e);
    if (*p != ':') return NULL;
    p = ws(p + 1);
    if (match) return p;
    if (!(p = skip_value(p))) return NULL;
    p = ws(p);
    if (*p != ',') break;
    p = ws(p + 1);
  }
  return NULL;
}

const char *cj_next(const char **it) {
  const char *p = ws(*it), *e;
  if (*p == '[' || *p == ',') p = ws(p + 1);
  if (*p == ']' || !*p) return NULL;
  if (!(e = skip_value(p))) return NULL;
  *it = ws(e);
  return p;
}

int cj_str(const char *obj, const char *key, char *out, size_t cap) {
  const char *v = cj_get(obj, key);
  size_t n = 0;
  if (!v || *v != '"' || cap == 0) return -1;
  for (v++; *v && *v != '"'; v++) {
    if (*v == '\\' && v[1]) v++; /* good enough for names and messages */
    if (n + 1 < cap) out[n++] = *v;
  }
  out[n] = '\0';
  return *v == '"' ? 0 : -1;
}

int cj_u64(const char *obj, const char *key, uint64_t *out) {
  const char *v = cj_get(obj, key);
  char *end;
  if (!v || *v < '0' || *v > '9') return -1;
  errno = 0;
  *out = strtoull(v, &end, 10);
  return errno ? -1 : 0;
}

bool cj_bool(const char *obj, const char *key, bool dflt) {
  const char *v = cj_get(obj, key);
  if (v && strncmp(v, "true", 4) == 0) return true;
  if (v && strncmp(v, "false", 5) == 0) return false;
  return dflt;
}

void cj_put_str(FILE *out, const char *s) {
  fputc('"', out);
  for (const unsigned char *p = (const unsigned char *)s; p && *p; p++) {
    if (*p == '"' || *p == '\\') fprintf(out, "\\%c", *p);
    else if (*p < 0x20) fprintf(out, "\\u%04x", *p);
    else fputc(*p, out);
  }
  fputc('"', out);
}
