/* ctl.h - kvferryctl's pieces: the commands beyond the daemon's own views
 * (metrics, doctor) and the small helpers they share. */
#ifndef KVF_CTL_H
#define KVF_CTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvferry.h"

/* Exit statuses (kvferryctl(1) documents them; scripts rely on them). */
enum {
  CTL_OK = 0,          /* success */
  CTL_ERROR = 1,       /* the daemon answered with an error, or another failure */
  CTL_USAGE = 2,       /* bad command line */
  CTL_UNREACHABLE = 3, /* no daemon answers on the socket */
  CTL_CHECK_FAILED = 4 /* doctor: at least one check failed */
};

/* Writes text (adding a final newline if missing); CTL_ERROR if stdout fails. */
int ctl_print(const char *text);

/* ---- tiny JSON reader, for the daemon's own documents ---- */

/* The value of key at the top level of the object at obj, or NULL. */
const char *cj_get(const char *obj, const char *key);
/* Iterates an array: *it starts at '['; returns each element, then NULL. */
const char *cj_next(const char **it);
int cj_str(const char *obj, const char *key, char *out, size_t cap);
int cj_u64(const char *obj, const char *key, uint64_t *out);
/* true / false; dflt when the key is missing. */
bool cj_bool(const char *obj, const char *key, bool dflt);
/* Writes s as a JSON string literal. */
void cj_put_str(FILE *out, const char *s);

/* ---- HTTP ---- */

/* GET url (http://HOST:PORT/PATH, HOST numeric or [IPv6]) with a timeout.
 * On success *body is the malloc'd body (NUL-terminated). Returns 0, or -1
 * with the reason in err. */
int ctl_http_get(const char *url, int timeout_ms, char **body, char *err, size_t errlen);
/* The Prometheus text as JSON: {"families": [{"name", "type", "help",
 * "samples": [{"name", "labels": {...}, "value"}]}]}. */
int ctl_metrics_json(const char *text, FILE *out);

/* ---- commands ---- */

int ctl_metrics(const char *socket, bool json);
int ctl_doctor(const char *socket, bool json);

#endif
