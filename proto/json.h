/* json.h - the one JSON writer and reader of kvferry: the daemon's
 * documents (inspect, config dump), kvferryctl, kvferry-bench and the tests.
 *
 * Writing a string has one rule, everywhere:
 *   '"' and '\' are escaped as \" and \\;
 *   control bytes (0x00-0x1f and 0x7f) as \u00XX;
 *   valid UTF-8 passes through as it is;
 *   anything else (a stray continuation byte, a truncated or overlong
 *   sequence, a surrogate, beyond U+10FFFF) becomes \ufffd, one for each
 *   maximal ill-formed subpart (Unicode's "substitution of maximal
 *   subparts"), so the output is valid JSON whatever bytes came in
 *   (transfer ids and node names are bytes to the daemon).
 *
 * Reading is for documents a program wrote (the daemon's, metrics turned
 * into JSON): values are returned as pointers into the document, found by
 * key, and strings are decoded on request (every escape of RFC 8259,
 * surrogate pairs included). It does not build a tree and checks only what
 * it walks over. */
#ifndef KVF_JSON_H
#define KVF_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* ---- writing ---- */

/* Where escaped text goes, piece by piece. */
typedef void kvf__json_sink(void *ctx, const char *p, size_t n);

/* s (NUL-terminated; NULL is "") as a JSON string literal, quotes
 * included, through put. */
void kvf__json_quote_to(kvf__json_sink *put, void *ctx, const char *s);
/* The same into out, snprintf-like: always NUL-terminated when cap > 0;
 * returns the length of the whole literal (>= cap: it was cut). */
size_t kvf__json_quote(char *out, size_t cap, const char *s);
/* The same to a stdio stream. */
void kvf__json_fquote(FILE *f, const char *s);

/* ---- reading ---- */

/* The first byte after the value starting at p (leading white space
 * skipped), or NULL when it is malformed or cut short. */
const char *kvf__json_skip(const char *p);
/* The value of key at the top level of the object at obj, or NULL (no
 * object, no such key). */
const char *kvf__json_get(const char *obj, const char *key);
/* Iterates an array: *it starts at its '['; returns each element, then
 * NULL at the end (or at something malformed). */
const char *kvf__json_next(const char **it);

/* Decodes the string literal at v into out (UTF-8, NUL-terminated; cut
 * at a character boundary when longer than cap - 1): 0, or -EINVAL when v
 * is not a well-formed string literal (or cap is 0), out then "". \u
 * escapes of lone surrogates and of NUL become U+FFFD (out is a C string),
 * and so do raw bytes that are not UTF-8. */
int kvf__json_str(const char *v, char *out, size_t cap);
/* kvf__json_str of kvf__json_get(obj, key); -ENOENT when it is missing,
 * out then untouched (a default set before stays). */
int kvf__json_get_str(const char *obj, const char *key, char *out, size_t cap);
/* A non-negative integer; -ENOENT when missing, -EINVAL when not one,
 * -ERANGE beyond 2^64 - 1. */
int kvf__json_get_u64(const char *obj, const char *key, uint64_t *out);
/* true or false; dflt when the key is missing or holds something else. */
bool kvf__json_get_bool(const char *obj, const char *key, bool dflt);

#endif
