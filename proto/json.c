/* json.c - see json.h. */
#include "json.h"

#include <errno.h>
#include <string.h>

/* ---------------------------------------------------------------- UTF-8 */

/* The length (1..4) of the well-formed UTF-8 sequence at s, or minus the
 * length (1..3) of its maximal ill-formed subpart: the longest start of a
 * well-formed sequence, or 1. Table 3-7 of the Unicode standard: the
 * second byte's range excludes overlongs (E0, F0), surrogates (ED) and
 * code points past U+10FFFF (F4). A NUL ends the string, so it is never
 * read past: it fails every range check. */
static int utf8_len(const unsigned char *s) {
  unsigned lo = 0x80, hi = 0xBF;
  int n;
  if (s[0] < 0x80) return 1;
  if (s[0] >= 0xC2 && s[0] <= 0xDF) {
    n = 2;
  } else if (s[0] >= 0xE0 && s[0] <= 0xEF) {
    n = 3;
    if (s[0] == 0xE0) lo = 0xA0;
    if (s[0] == 0xED) hi = 0x9F;
  } else if (s[0] >= 0xF0 && s[0] <= 0xF4) {
    n = 4;
    if (s[0] == 0xF0) lo = 0x90;
    if (s[0] == 0xF4) hi = 0x8F;
  } else {
    return -1; /* 80..C1, F5..FF: never a first byte */
  }
  if (s[1] < lo || s[1] > hi) return -1;
  for (int i = 2; i < n; i++)
    if ((s[i] & 0xC0) != 0x80) return -i;
  return n;
}

/* Code point cp (<= U+10FFFF, no surrogate) as UTF-8 into b; its length. */
static size_t utf8_put(uint32_t cp, char b[4]) {
  if (cp < 0x80) {
    b[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    b[0] = (char)(0xC0 | cp >> 6);
    b[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    b[0] = (char)(0xE0 | cp >> 12);
    b[1] = (char)(0x80 | (cp >> 6 & 0x3F));
    b[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  b[0] = (char)(0xF0 | cp >> 18);
  b[1] = (char)(0x80 | (cp >> 12 & 0x3F));
  b[2] = (char)(0x80 | (cp >> 6 & 0x3F));
  b[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

#define REPLACEMENT 0xFFFDu

/* ---------------------------------------------------------------- writing */

void kvf__json_quote_to(kvf__json_sink *put, void *ctx, const char *str) {
  static const char hex[] = "0123456789abcdef";
  const unsigned char *p = (const unsigned char *)(str ? str : ""), *run = p;
  put(ctx, "\"", 1);
  while (*p) {
    char esc[7] = "\\u00";
    const char *e = esc;
    size_t elen = 6, skip = 1;
    int n = utf8_len(p);
    if (*p == '"' || *p == '\\') {
      esc[1] = (char)*p;
      elen = 2;
    } else if (*p < 0x20 || *p == 0x7F) {
      esc[4] = hex[*p >> 4];
      esc[5] = hex[*p & 0xF];
    } else if (n < 0) {
      e = "\\ufffd";
      skip = (size_t)-n;
    } else {
      p += n; /* passes through: written with its run */
      continue;
    }
    if (p > run) put(ctx, (const char *)run, (size_t)(p - run));
    put(ctx, e, elen);
    p += skip;
    run = p;
  }
  if (p > run) put(ctx, (const char *)run, (size_t)(p - run));
  put(ctx, "\"", 1);
}

typedef struct {
  char *out;
  size_t cap, len;
} membuf;

static void put_mem(void *ctx, const char *p, size_t n) {
  membuf *m = ctx;
  if (m->len + 1 < m->cap) {
    size_t room = m->cap - 1 - m->len;
    memcpy(m->out + m->len, p, n < room ? n : room);
  }
  m->len += n;
}

size_t kvf__json_quote(char *out, size_t cap, const char *s) {
  membuf m = {out, cap, 0};
  kvf__json_quote_to(put_mem, &m, s);
  if (cap) out[m.len < cap ? m.len : cap - 1] = '\0';
  return m.len;
}

static void put_file(void *ctx, const char *p, size_t n) { fwrite(p, 1, n, ctx); }

void kvf__json_fquote(FILE *f, const char *s) { kvf__json_quote_to(put_file, f, s); }

/* ---------------------------------------------------------------- reading */

/* Deeper nesting than this is refused: the walk recurses. */
#define MAX_DEPTH 64

static const char *ws(const char *p) {
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
  return p;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* The 4 hex digits at p, or -1. */
static long hex4(const char *p) {
  long v = 0;
  for (int i = 0; i < 4; i++) {
    int d = hexval(p[i]); /* stops at a NUL: not a digit */
    if (d < 0) return -1;
    v = v << 4 | d;
  }
  return v;
}

/* The escape after the '\' at p: its code point into *cp and the byte after
 * it, or NULL. A \u surrogate pair is one code point; a lone surrogate, and
 * NUL (the result is a C string), are U+FFFD. */
static const char *unescape(const char *p, uint32_t *cp) {
  static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
  const char *e = *++p ? strchr(from, *p) : NULL;
  if (e) {
    *cp = (unsigned char)to[e - from];
    return p + 1;
  }
  long u = *p == 'u' ? hex4(p + 1) : -1;
  if (u < 0) return NULL;
  p += 5;
  *cp = u == 0 || (u >= 0xD800 && u <= 0xDFFF) ? REPLACEMENT : (uint32_t)u;
  if (u >= 0xD800 && u <= 0xDBFF && p[0] == '\\' && p[1] == 'u') {
    long lo = hex4(p + 2);
    if (lo >= 0xDC00 && lo <= 0xDFFF) {
      *cp = 0x10000 + ((uint32_t)(u - 0xD800) << 10) + (uint32_t)(lo - 0xDC00);
      p += 6;
    }
  }
  return p;
}

/* The byte after the string literal at p (at its '"'), or NULL. Raw
 * control bytes are not allowed inside (RFC 8259). */
static const char *skip_str(const char *p) {
  uint32_t cp;
  p++;
  while (*p != '"') {
    if ((unsigned char)*p < 0x20) return NULL; /* the NUL included: cut short */
    if (*p != '\\') p++;
    else if (!(p = unescape(p, &cp))) return NULL;
  }
  return p + 1;
}

static const char *skip_value(const char *p, int depth);

/* The byte after the object or array at p, or NULL. */
static const char *skip_container(const char *p, int depth) {
  char close = *p == '{' ? '}' : ']';
  if (depth >= MAX_DEPTH) return NULL;
  p = ws(p + 1);
  if (*p == close) return p + 1;
  for (;;) {
    if (close == '}') {
      if (*p != '"' || !(p = skip_str(p))) return NULL;
      p = ws(p);
      if (*p != ':') return NULL;
      p++;
    }
    if (!(p = skip_value(p, depth + 1))) return NULL;
    p = ws(p);
    if (*p == close) return p + 1;
    if (*p != ',') return NULL;
    p = ws(p + 1);
  }
}

static const char *skip_value(const char *p, int depth) {
  p = ws(p);
  if (*p == '"') return skip_str(p);
  if (*p == '{' || *p == '[') return skip_container(p, depth);
  /* a number, true, false or null: a run of their characters */
  const char *s = p;
  while (*p && strchr("+-.0123456789Eaeflnrstu", *p)) p++;
  return p == s ? NULL : p;
}

const char *kvf__json_skip(const char *p) { return p ? skip_value(p, 0) : NULL; }

const char *kvf__json_get(const char *obj, const char *key) {
  const char *p = obj ? ws(obj) : NULL;
  size_t kl = strlen(key);
  if (!p || *p != '{') return NULL;
  p = ws(p + 1);
  while (*p == '"') {
    const char *k = p + 1, *e = skip_str(p);
    if (!e) return NULL;
    /* keys are compared as written: the daemon's keys have no escapes */
    bool match = (size_t)(e - 1 - k) == kl && memcmp(k, key, kl) == 0;
    p = ws(e);
    if (*p != ':') return NULL;
    p = ws(p + 1);
    if (match) return p;
    if (!(p = skip_value(p, 1))) return NULL;
    p = ws(p);
    if (*p != ',') break;
    p = ws(p + 1);
  }
  return NULL;
}

const char *kvf__json_next(const char **it) {
  const char *p = ws(*it), *e;
  if (*p == '[' || *p == ',') p = ws(p + 1);
  if (*p == ']' || !*p) return NULL;
  if (!(e = skip_value(p, 1))) return NULL;
  *it = ws(e);
  return p;
}

/* kvf__json_str's work, out left unterminated on an error. */
static int decode_str(const char *v, char *out, size_t cap) {
  size_t n = 0;
  bool full = false;
  if (!v || *v != '"') return -EINVAL;
  const char *p = v + 1;
  while (*p != '"') {
    char b[4];
    size_t len;
    if ((unsigned char)*p < 0x20) return -EINVAL;
    if (*p == '\\') {
      uint32_t cp;
      if (!(p = unescape(p, &cp))) return -EINVAL;
      len = utf8_put(cp, b);
    } else {
      int k = utf8_len((const unsigned char *)p);
      if (k > 0) {
        memcpy(b, p, (size_t)k);
        len = (size_t)k;
      } else {
        len = utf8_put(REPLACEMENT, b);
      }
      p += k > 0 ? k : -k;
    }
    full = full || n + len >= cap; /* cut at a character: nothing after */
    if (!full) {
      memcpy(out + n, b, len);
      n += len;
    }
  }
  out[n] = '\0';
  return 0;
}

int kvf__json_str(const char *v, char *out, size_t cap) {
  if (cap == 0) return -EINVAL;
  int rc = decode_str(v, out, cap);
  if (rc) out[0] = '\0';
  return rc;
}

int kvf__json_get_str(const char *obj, const char *key, char *out, size_t cap) {
  const char *v = kvf__json_get(obj, key);
  if (!v) return -ENOENT;
  return kvf__json_str(v, out, cap);
}

int kvf__json_get_u64(const char *obj, const char *key, uint64_t *out) {
  const char *v = kvf__json_get(obj, key);
  uint64_t x = 0;
  if (!v) return -ENOENT;
  if (*v < '0' || *v > '9') return -EINVAL;
  for (; *v >= '0' && *v <= '9'; v++) {
    unsigned d = (unsigned)(*v - '0');
    if (x > (UINT64_MAX - d) / 10) return -ERANGE;
    x = x * 10 + d;
  }
  if (*v == '.' || *v == 'e' || *v == 'E') return -EINVAL;
  *out = x;
  return 0;
}

bool kvf__json_get_bool(const char *obj, const char *key, bool dflt) {
  const char *v = kvf__json_get(obj, key);
  if (v && strncmp(v, "true", 4) == 0) return true;
  if (v && strncmp(v, "false", 5) == 0) return false;
  return dflt;
}
