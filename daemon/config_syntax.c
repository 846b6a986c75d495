/* config_syntax.c - the syntax of configuration values that is not tied to
 * one key: decimal numbers, sizes with units, names, host names. Kept apart
 * from config.c's key table so that each stays short; the parsers there
 * (and kvferryctl's checks) use these. */
#include "config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

/* Parses leading decimal digits (no sign, no spaces); *end gets the rest. */
static int parse_digits(const char *s, uint64_t *out, const char **end) {
  uint64_t v = 0;
  if (!is_digit(*s)) return -EINVAL;
  for (; is_digit(*s); s++) {
    unsigned d = (unsigned)(*s - '0');
    if (v > (UINT64_MAX - d) / 10) return -ERANGE;
    v = v * 10 + d;
  }
  *out = v;
  *end = s;
  return 0;
}

int kvf__config_parse_dec(const char *s, uint64_t *out) {
  const char *end;
  int rc = parse_digits(s, out, &end);
  if (rc) return rc;
  return *end ? -EINVAL : 0;
}

/* Skips an optional "B", or "iB" after a unit letter ("64K", "64KB", "64KiB"). */
static const char *skip_byte_suffix(const char *p, bool after_unit) {
  if (after_unit && (*p == 'i' || *p == 'I') && (p[1] == 'b' || p[1] == 'B'))
    return p + 2;
  if (*p == 'b' || *p == 'B') return p + 1;
  return p;
}

int kvf__parse_size(const char *s, uint64_t *out) {
  static const char units[] = "KMGT";
  uint64_t v;
  const char *p;
  if (!s || !out) return -EINVAL;
  int rc = parse_digits(s, &v, &p);
  if (rc) return rc;
  char unit = (*p >= 'a' && *p <= 'z') ? (char)(*p - 'a' + 'A') : *p;
  const char *u = unit ? strchr(units, unit) : NULL;
  unsigned shift = u ? 10u * (unsigned)(u - units + 1) : 0;
  p = skip_byte_suffix(u ? p + 1 : p, u != NULL);
  if (*p) return -EINVAL;
  if (shift && v > (UINT64_MAX >> shift)) return -ERANGE;
  *out = v << shift;
  return 0;
}

/* The shortest exact form of a size: 64M rather than 67108864. */
const char *kvf__config_format_size(uint64_t v, char buf[static 32]) {
  static const char units[] = "KMGT";
  int i = -1;
  while (v && i < 3 && (v & 1023) == 0) {
    v >>= 10;
    i++;
  }
  if (i < 0)
    snprintf(buf, 32, "%" PRIu64, v);
  else
    snprintf(buf, 32, "%" PRIu64 "%c", v, units[i]);
  return buf;
}

bool kvf__config_valid_name(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n > KVF__NAME_MAX) return false;
  for (; *s; s++)
    if (!is_digit(*s) && !strchr("abcdefghijklmnopqrstuvwxyz"
                                 "ABCDEFGHIJKLMNOPQRSTUVWXYZ._-", *s))
      return false;
  return true;
}

bool kvf__config_valid_hostname(const char *h) {
  bool numeric = true;
  if (*h == '-' || *h == '.') return false;
  for (const char *p = h; *p; p++) {
    if (!is_digit(*p) && *p != '.') numeric = false;
    if (!is_digit(*p) && !strchr("abcdefghijklmnopqrstuvwxyz"
                                 "ABCDEFGHIJKLMNOPQRSTUVWXYZ.-", *p))
      return false;
  }
  struct in_addr a4;
  /* All digits and dots must be a real IPv4 address, not "999.1.1.1". */
  return !numeric || inet_pton(AF_INET, h, &a4) == 1;
}
