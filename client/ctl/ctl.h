/* ctl.h - kvferryctl's pieces: the commands beyond the daemon's own views
 * (metrics, doctor) and the small helpers they share. */
#ifndef KVF_CTL_H
#define KVF_CTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "json.h" /* the reader and writer of every JSON document */
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
/* --checks NAME[,NAME...]: doctor runs only those; false when one is not a
 * check's name. */
bool ctl_doctor_select(const char *list);

#endif
