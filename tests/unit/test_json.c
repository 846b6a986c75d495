/* test_json.c - the JSON module (proto/json.c): the writer's one escaping
 * rule (quote and backslash, control bytes as \u00XX, valid UTF-8 through,
 * each maximal ill-formed subpart as \ufffd: truncated sequences, stray
 * continuations, overlongs, surrogates, past U+10FFFF), its snprintf
 * contract, the reader (keys, arrays, every escape, surrogate pairs, what
 * it refuses), and the round trip writer -> reader over every byte pair
 * and many random strings. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

static char lit[4096];

static const char *q(const char *s) {
  size_t n = kvf__json_quote(lit, sizeof lit, s);
  assert_true(n < sizeof lit);
  return lit;
}

#define assert_quotes(in, want) assert_string_equal(q(in), want)

/* ---- writing -------------------------------------------------------------- */

static void test_plain_and_specials(void **state) {
  assert_quotes("", "\"\"");
  assert_quotes(NULL, "\"\"");
  assert_quotes("xfer-1 /a:b", "\"xfer-1 /a:b\"");
  assert_quotes("say \"hi\"\\", "\"say \\\"hi\\\"\\\\\"");
}

/* Every control byte, and DEL, as \u00XX; nothing else is escaped. */
static void test_control_bytes(void **state) {
  for (int c = 1; c < 0x80; c++) {
    char in[2] = {(char)c, 0}, want[16];
    if (c < 0x20 || c == 0x7f) snprintf(want, sizeof want, "\"\\u00%02x\"", c);
    else if (c == '"' || c == '\\') snprintf(want, sizeof want, "\"\\%c\"", c);
    else snprintf(want, sizeof want, "\"%c\"", c);
    assert_quotes(in, want);
  }
  assert_quotes("a\nb\tc\x1b[0m", "\"a\\u000ab\\u0009c\\u001b[0m\"");
}

/* Well-formed UTF-8 passes through byte for byte, at every boundary of
 * Table 3-7. */
static void test_valid_utf8(void **state) {
  static const char *ok[] = {
      "\xc2\x80",         /* U+0080 */
      "\xdf\xbf",         /* U+07FF */
      "\xe0\xa0\x80",     /* U+0800 */
      "\xed\x9f\xbf",     /* U+D7FF, below the surrogates */
      "\xee\x80\x80",     /* U+E000, above them */
      "\xef\xbf\xbf",     /* U+FFFF */
      "\xf0\x90\x80\x80", /* U+10000 */
      "\xf4\x8f\xbf\xbf", /* U+10FFFF */
      "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80",
  };
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    char want[64];
    snprintf(want, sizeof want, "\"%s\"", ok[i]);
    assert_quotes(ok[i], want);
  }
}

/* One \ufffd per maximal ill-formed subpart (Unicode 15, 3.9, U+FFFD
 * substitution of maximal subparts); what follows is read afresh. */
static void test_invalid_utf8(void **state) {
  /* stray continuation bytes, bytes never first */
  assert_quotes("\x80", "\"\\ufffd\"");
  assert_quotes("a\xbf" "b", "\"a\\ufffdb\"");
  assert_quotes("\xfe\xff", "\"\\ufffd\\ufffd\"");
  assert_quotes("\xf5\x80", "\"\\ufffd\\ufffd\"");
  /* truncated: one replacement for the start that was good so far */
  assert_quotes("\xc3", "\"\\ufffd\"");
  assert_quotes("\xe2\x82", "\"\\ufffd\"");
  assert_quotes("\xe2\x82" "A", "\"\\ufffdA\"");
  assert_quotes("\xf0\x9f\x98", "\"\\ufffd\"");
  assert_quotes("\xf0\x9f\x98" "\xf0\x9f\x98\x80", "\"\\ufffd\xf0\x9f\x98\x80\"");
  assert_quotes("\xe2\x82\n", "\"\\ufffd\\u000a\"");
  /* overlong: C0/C1 are never first; E0 and F0 need a high second byte */
  assert_quotes("\xc0\xaf", "\"\\ufffd\\ufffd\"");
  assert_quotes("\xc1\xbf", "\"\\ufffd\\ufffd\"");
  assert_quotes("\xe0\x80\xaf", "\"\\ufffd\\ufffd\\ufffd\"");
  assert_quotes("\xf0\x80\x80\xaf", "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");
  /* UTF-16 surrogates, alone or as a CESU-8 pair */
  assert_quotes("\xed\xa0\x80", "\"\\ufffd\\ufffd\\ufffd\"");
  assert_quotes("\xed\xbf\xbf", "\"\\ufffd\\ufffd\\ufffd\"");
  assert_quotes("\xed\xa0\xbd\xed\xb8\x80", "\"\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\"");
  /* past U+10FFFF */
  assert_quotes("\xf4\x90\x80\x80", "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");
  /* a good sequence between bad bytes survives */
  assert_quotes("\xff\xc3\xa9\xff", "\"\\ufffd\xc3\xa9\\ufffd\"");
}

/* snprintf's contract: the whole length back, a cut but terminated text. */
static void test_quote_cut(void **state) {
  char small[6];
  assert_int_equal(kvf__json_quote(small, sizeof small, "abc\x01"), 11);
  assert_string_equal(small, "\"abc\\");
  assert_int_equal(kvf__json_quote(NULL, 0, "\xff"), 8);
  memset(small, 'x', sizeof small);
  assert_int_equal(kvf__json_quote(small, 1, "a"), 3);
  assert_string_equal(small, "");
}

static void test_fquote(void **state) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  assert_non_null(f);
  kvf__json_fquote(f, "a\"\x02\xff");
  fclose(f);
  assert_string_equal(buf, "\"a\\\"\\u0002\\ufffd\"");
  free(buf);
}

/* ---- reading -------------------------------------------------------------- */

static const char DOC[] =
    " {\"node\": \"decode\", \"n\": 42, \"big\": 18446744073709551615, \"over\": 18446744073709551616,"
    " \"neg\": -1, \"frac\": 1.5, \"on\": true, \"off\": false, \"nil\": null,"
    " \"tricky\": \"a \\\"}]\\\\ b\","
    " \"list\": [1, {\"id\": \"x\", \"inner\": [[], {}]}, \"s\", [2, 3]],"
    " \"empty\": [], \"last\": {\"k\": \"v\"}}";

static void test_get(void **state) {
  char s[64];
  uint64_t u;
  assert_int_equal(kvf__json_get_str(DOC, "node", s, sizeof s), 0);
  assert_string_equal(s, "decode");
  assert_int_equal(kvf__json_get_u64(DOC, "n", &u), 0);
  assert_int_equal(u, 42);
  assert_int_equal(kvf__json_get_u64(DOC, "big", &u), 0);
  assert_true(u == UINT64_MAX);
  assert_int_equal(kvf__json_get_u64(DOC, "over", &u), -ERANGE);
  assert_int_equal(kvf__json_get_u64(DOC, "neg", &u), -EINVAL);
  assert_int_equal(kvf__json_get_u64(DOC, "frac", &u), -EINVAL);
  assert_int_equal(kvf__json_get_u64(DOC, "node", &u), -EINVAL);
  assert_int_equal(kvf__json_get_u64(DOC, "none", &u), -ENOENT);
  assert_int_equal(kvf__json_get_str(DOC, "none", s, sizeof s), -ENOENT);
  assert_int_equal(kvf__json_get_str(DOC, "n", s, sizeof s), -EINVAL);
  assert_true(kvf__json_get_bool(DOC, "on", false));
  assert_false(kvf__json_get_bool(DOC, "off", true));
  assert_true(kvf__json_get_bool(DOC, "nil", true));
  assert_false(kvf__json_get_bool(DOC, "none", false));
  /* a key inside a nested value is not at the top level */
  assert_null(kvf__json_get(DOC, "id"));
  assert_null(kvf__json_get(DOC, "k"));
  assert_int_equal(kvf__json_get_str(DOC, "tricky", s, sizeof s), 0);
  assert_string_equal(s, "a \"}]\\ b");
  assert_int_equal(kvf__json_get_str(kvf__json_get(DOC, "last"), "k", s, sizeof s), 0);
  assert_string_equal(s, "v");
  assert_null(kvf__json_get("[1]", "k"));
  assert_null(kvf__json_get(NULL, "k"));
}

static void test_arrays(void **state) {
  const char *it = kvf__json_get(DOC, "list"), *e;
  char s[8];
  assert_non_null(it);
  assert_non_null(e = kvf__json_next(&it));
  assert_int_equal(e[0], '1');
  assert_non_null(e = kvf__json_next(&it));
  assert_int_equal(kvf__json_get_str(e, "id", s, sizeof s), 0);
  assert_string_equal(s, "x");
  assert_non_null(e = kvf__json_next(&it));
  assert_int_equal(kvf__json_str(e, s, sizeof s), 0);
  assert_string_equal(s, "s");
  assert_non_null(e = kvf__json_next(&it));
  assert_int_equal(e[0], '[');
  assert_null(kvf__json_next(&it));
  it = kvf__json_get(DOC, "empty");
  assert_null(kvf__json_next(&it));
}

static void expect_str(const char *lit_in, const char *want) {
  char s[64];
  int rc = kvf__json_str(lit_in, s, sizeof s);
  if (rc) fail_msg("%s: %d", lit_in, rc);
  assert_string_equal(s, want);
  assert_ptr_equal(kvf__json_skip(lit_in), lit_in + strlen(lit_in));
}

static void test_unescape(void **state) {
  expect_str("\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"", "\"\\/\b\f\n\r\t");
  expect_str("\"\\u0041\\u00e9\\u20AC\"", "A\xc3\xa9\xe2\x82\xac");
  expect_str("\"\\ud83d\\ude00\"", "\xf0\x9f\x98\x80"); /* a pair is one code point */
  expect_str("\"\\ud83d\"", "\xef\xbf\xbd");             /* lone high surrogate */
  expect_str("\"\\ud83dx\"", "\xef\xbf\xbdx");
  expect_str("\"\\ude00\\ud83d\"", "\xef\xbf\xbd\xef\xbf\xbd"); /* the wrong way round */
  expect_str("\"a\\u0000b\"", "a\xef\xbf\xbd" "b");              /* a C string: no NUL */
  expect_str("\"\xc3\xa9\"", "\xc3\xa9");                        /* raw UTF-8 */
  expect_str("\"\xff\"", "\xef\xbf\xbd");                        /* raw and bad */
}

/* What the reader refuses: cut short, bad escapes, raw control bytes,
 * missing punctuation, nesting deeper than it walks. */
static void test_malformed(void **state) {
  static const char *bad[] = {
      "\"abc",      "\"a\\\"",    "\"\\x\"",     "\"\\u12\"",   "\"\\u12g4\"", "\"a\nb\"",
      "{\"a\" 1}",  "{\"a\":1,}", "{\"a\":1",    "[1,2",        "[1 2]",       "{a:1}",
      "",           "]",          "{\"a\":}",    "[\"x\",]",
  };
  char s[16];
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    if (kvf__json_skip(bad[i])) fail_msg("accepted: %s", bad[i]);
  assert_int_equal(kvf__json_str("\"abc", s, sizeof s), -EINVAL);
  assert_int_equal(kvf__json_str("\"\\q\"", s, sizeof s), -EINVAL);
  assert_int_equal(kvf__json_str("abc", s, sizeof s), -EINVAL);
  assert_int_equal(kvf__json_str("\"a\"", s, 0), -EINVAL);
  char deep[200];
  memset(deep, '[', 100);
  memset(deep + 100, ']', 100);
  deep[sizeof deep - 1] = '\0';
  deep[99] = '1'; /* [[[...1]]]: 99 levels */
  assert_null(kvf__json_skip(deep));
  assert_non_null(kvf__json_skip("[[[[1]]]]"));
}

/* A string longer than the buffer is cut between characters, never inside. */
static void test_cut_at_character(void **state) {
  char s[4];
  assert_int_equal(kvf__json_str("\"\xc3\xa9\xe2\x82\xac\"", s, sizeof s), 0);
  assert_string_equal(s, "\xc3\xa9");
  assert_int_equal(kvf__json_str("\"abcdef\"", s, sizeof s), 0);
  assert_string_equal(s, "abc");
}

/* ---- round trip --------------------------------------------------------- */

static bool valid_utf8(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  while (*p) {
    /* an independent check, from the code points' ranges */
    uint32_t cp;
    int n = *p < 0x80 ? 1 : *p >= 0xf8 ? 0 : *p >= 0xf0 ? 4 : *p >= 0xe0 ? 3 : *p >= 0xc0 ? 2 : 0;
    if (!n) return false;
    cp = n == 1 ? *p : (uint32_t)(*p & (0x7f >> n));
    for (int i = 1; i < n; i++) {
      if ((p[i] & 0xc0) != 0x80) return false;
      cp = cp << 6 | (p[i] & 0x3f);
    }
    static const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    p += n;
  }
  return true;
}

/* s -> literal -> decoded: the literal is one well-formed string, pure
 * ASCII-or-UTF-8; decoded is valid UTF-8, equal to s when s was, and
 * writing it again decodes to itself. */
static void round_trip(const char *s) {
  char a[1024], b[1024], l2[2048];
  size_t n = kvf__json_quote(lit, sizeof lit, s);
  assert_true(n < sizeof lit);
  assert_ptr_equal(kvf__json_skip(lit), lit + n);
  assert_true(valid_utf8(lit));
  assert_int_equal(kvf__json_str(lit, a, sizeof a), 0);
  assert_true(valid_utf8(a));
  if (valid_utf8(s)) assert_string_equal(a, s);
  else assert_string_not_equal(a, s);
  kvf__json_quote(l2, sizeof l2, a);
  assert_int_equal(kvf__json_str(l2, b, sizeof b), 0);
  assert_string_equal(a, b);
}

static void test_round_trip_pairs(void **state) {
  for (int x = 1; x < 256; x++)
    for (int y = 0; y < 256; y++) {
      char s[4] = {(char)x, (char)y, 'z', 0};
      round_trip(s);
    }
}

static void test_round_trip_random(void **state) {
  uint64_t r = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 20000; i++) {
    char s[48];
    size_t len = (size_t)(i % 47);
    for (size_t k = 0; k < len; k++) {
      r ^= r << 13, r ^= r >> 7, r ^= r << 17;
      /* mostly UTF-8-looking bytes, so that valid sequences occur too */
      unsigned v = (unsigned)(r >> 32);
      s[k] = (char)(v % 4 == 0 ? 0x80 + (v >> 8) % 0x40 : v % 4 == 1 ? 0xc2 + (v >> 8) % 0x33 : v >> 8);
      if (s[k] == 0) s[k] = 'x';
    }
    s[len] = '\0';
    round_trip(s);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plain_and_specials),
      cmocka_unit_test(test_control_bytes),
      cmocka_unit_test(test_valid_utf8),
      cmocka_unit_test(test_invalid_utf8),
      cmocka_unit_test(test_quote_cut),
      cmocka_unit_test(test_fquote),
      cmocka_unit_test(test_get),
      cmocka_unit_test(test_arrays),
      cmocka_unit_test(test_unescape),
      cmocka_unit_test(test_malformed),
      cmocka_unit_test(test_cut_at_character),
      cmocka_unit_test(test_round_trip_pairs),
      cmocka_unit_test(test_round_trip_random),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
