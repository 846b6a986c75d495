/* fuzz_config.c - the configuration parser, fed a kvferryd.conf.
 *
 * The input is a config file's text, parsed over the defaults by
 * kvf__config_parse (what kvf__config_load and SIGHUP use), then checked
 * by kvf__config_validate. Properties:
 *  - a file that fails leaves the configuration untouched, and says why as
 *    "fuzz.conf:LINE: message" in printable ASCII (user bytes are never
 *    echoed raw: the message goes to the log);
 *  - a file that parses dumps (kvferryd --check) to text that parses back to
 *    the same configuration: same dump, same verdict from validate;
 *  - the JSON dump is valid JSON (and valid UTF-8);
 *  - preparing a reload from the defaults to it reports only keys whose
 *    values differ, and leaves the restart-only keys at their old values. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "fuzz_common.h"

/* ---- a strict JSON checker (RFC 8259, UTF-8) ---- */

typedef struct { const unsigned char *p, *end; int depth; } js;

static void ws(js *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static bool lit(js *j, const char *s) {
  size_t n = strlen(s);
  if ((size_t)(j->end - j->p) < n || memcmp(j->p, s, n) != 0) return false;
  j->p += n;
  return true;
}

static bool utf8(js *j) {
  const unsigned char *s = j->p;
  int n;
  unsigned lo = 0x80, hi = 0xBF;
  if (*s >= 0xC2 && *s <= 0xDF) n = 2;
  else if (*s >= 0xE0 && *s <= 0xEF) { n = 3; if (*s == 0xE0) lo = 0xA0; if (*s == 0xED) hi = 0x9F; }
  else if (*s >= 0xF0 && *s <= 0xF4) { n = 4; if (*s == 0xF0) lo = 0x90; if (*s == 0xF4) hi = 0x8F; }
  else return false;
  if (j->end - s < n || s[1] < lo || s[1] > hi) return false;
  for (int i = 2; i < n; i++)
    if ((s[i] & 0xC0) != 0x80) return false;
  j->p += n;
  return true;
}

static bool string(js *j) {
  if (j->p >= j->end || *j->p != '"') return false;
  j->p++;
  while (j->p < j->end && *j->p != '"') {
    if (*j->p < 0x20) return false;
    if (*j->p == '\\') {
      j->p++;
      if (j->p >= j->end) return false;
      if (*j->p == 'u') {
        for (int i = 1; i <= 4; i++)
          if (j->p + i >= j->end || !strchr("0123456789abcdefABCDEF", j->p[i]) || !j->p[i]) return false;
        j->p += 5;
      } else if (strchr("\"\\/bfnrt", *j->p) && *j->p) {
        j->p++;
      } else {
        return false;
      }
    } else if (*j->p >= 0x80) {
      if (!utf8(j)) return false;
    } else {
      j->p++;
    }
  }
  if (j->p >= j->end) return false;
  j->p++;
  return true;
}

static bool number(js *j) {
  const unsigned char *s = j->p;
  if (j->p < j->end && *j->p == '-') j->p++;
  if (j->p >= j->end || *j->p < '0' || *j->p > '9') return false;
  if (*j->p == '0') j->p++;
  else while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
  return j->p > s;
}

static bool value(js *j);

static bool members(js *j, char close, bool keys) {
  j->p++;
  ws(j);
  if (j->p < j->end && *j->p == close) {
    j->p++;
    return true;
  }
  for (;;) {
    ws(j);
    if (keys) {
      if (!string(j)) return false;
      ws(j);
      if (j->p >= j->end || *j->p != ':') return false;
      j->p++;
      ws(j);
    }
    if (!value(j)) return false;
    ws(j);
    if (j->p < j->end && *j->p == ',') {
      j->p++;
      continue;
    }
    if (j->p < j->end && *j->p == close) {
      j->p++;
      return true;
    }
    return false;
  }
}

static bool value(js *j) {
  if (j->p >= j->end || ++j->depth > 32) return false;
  bool ok;
  switch (*j->p) {
  case '{': ok = members(j, '}', true); break;
  case '[': ok = members(j, ']', false); break;
  case '"': ok = string(j); break;
  case 't': ok = lit(j, "true"); break;
  case 'f': ok = lit(j, "false"); break;
  case 'n': ok = lit(j, "null"); break;
  default: ok = number(j); break;
  }
  j->depth--;
  return ok;
}

static bool valid_json(const char *s, size_t n) {
  js j = {(const unsigned char *)s, (const unsigned char *)s + n, 0};
  ws(&j);
  if (!value(&j)) return false;
  ws(&j);
  return j.p == j.end;
}

/* ---- the target ---- */

static char *dump(const kvf__config *c, bool json, size_t *len) {
  char *buf = NULL;
  size_t n = 0;
  FILE *f = open_memstream(&buf, &n);
  if (!f) fz_fail("open_memstream");
  kvf__config_dump(c, f, json);
  if (fclose(f) != 0) fz_fail("dump failed");
  if (len) *len = n;
  return buf;
}

static void on_change(const char *key, const char *from, const char *to, bool applied, void *arg) {
  if (strcmp(from, to) == 0) fz_fail("reload reports key %s as changed, but '%s' = '%s'", key, from, to);
  if (applied != kvf__config_key_reloadable(key)) fz_fail("reload of %s: applied is wrong", key);
}

static kvf__config defaults, cfg, again, next;
static char *defaults_dump;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  kvf__log_init(KVF__LOG_ERR);
  kvf__config_defaults(&defaults);
  defaults_dump = dump(&defaults, false, NULL);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char err[200];
  cfg = defaults;
  int rc = kvf__config_parse(&cfg, (const char *)data, size, "fuzz.conf", err, sizeof(err));
  if (rc) {
    if (rc > 0 || strncmp(err, "fuzz.conf:", 10) != 0) fz_fail("error %d without FILE:LINE: '%s'", rc, err);
    for (const char *p = err; *p; p++)
      if (*p < 0x20 || *p > 0x7e) fz_fail("unprintable byte 0x%02x in the error '%s'", (unsigned char)*p, err);
    char *after = dump(&cfg, false, NULL);
    if (strcmp(after, defaults_dump) != 0) fz_fail("a failed parse changed the configuration");
    free(after);
    return 0;
  }
  char verr[256], verr2[256];
  int vrc = kvf__config_validate(&cfg, verr, sizeof(verr));
  size_t n;
  char *text = dump(&cfg, false, &n);
  again = defaults;
  if (kvf__config_parse(&again, text, n, "dump", err, sizeof(err)) != 0)
    fz_fail("the dump does not parse back: %s\n---\n%s---", err, text);
  char *text2 = dump(&again, false, NULL);
  if (strcmp(text, text2) != 0) fz_fail("dump, parse, dump differs:\n---\n%s---\n%s---", text, text2);
  int vrc2 = kvf__config_validate(&again, verr2, sizeof(verr2));
  if (vrc != vrc2 || (vrc && strcmp(verr, verr2) != 0))
    fz_fail("validate says '%s' of the original, '%s' of its dump", vrc ? verr : "ok", vrc2 ? verr2 : "ok");
  char *jtext = dump(&cfg, true, &n);
  if (!valid_json(jtext, n)) fz_fail("the JSON dump is not valid JSON:\n%s", jtext);
  next = cfg;
  kvf__config_prepare_reload(&next, &defaults, on_change, NULL);
  free(text);
  free(text2);
  free(jtext);
  return 0;
}
