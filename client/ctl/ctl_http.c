/* ctl_http.c - kvferryctl's HTTP client (one GET to the daemon's metrics
 * endpoint, on this host) and the conversion of the Prometheus text format
 * to JSON. */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "ctl.h"

#define BODY_MAX (64u << 20) /* a scrape of a very busy daemon is far below */

/* ------------------------------------------------------------ URL */

struct url {
  struct sockaddr_storage sa;
  socklen_t len;
  char host[64];
  char path[256];
};

/* http://A.B.C.D:PORT/PATH or http://[V6]:PORT/PATH: what the daemon's
 * status reports; names are not resolved. */
static int parse_url(const char *url, struct url *u) {
  const char *p = url, *hs, *he, *ps;
  if (strncmp(p, "http://", 7) != 0) return -1;
  hs = p + 7;
  bool v6 = *hs == '[';
  he = v6 ? strchr(hs, ']') : strchr(hs, ':');
  if (!he) return -1;
  ps = v6 ? he + 1 : he;
  if (*ps != ':') return -1;
  size_t hl = (size_t)(he - hs) - (v6 ? 1 : 0);
  if (hl == 0 || hl >= sizeof u->host) return -1;
  memcpy(u->host, hs + (v6 ? 1 : 0), hl);
  u->host[hl] = '\0';
  char *end;
  long port = strtol(ps + 1, &end, 10);
  if (port <= 0 || port > 65535 || (*end && *end != '/')) return -1;
  snprintf(u->path, sizeof u->path, "%s", *end ? end : "/");
  memset(&u->sa, 0, sizeof u->sa);
  if (v6) {
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&u->sa;
    s6->sin6_family = AF_INET6;
    s6->sin6_port = htons((uint16_t)port);
    u->len = sizeof *s6;
    return inet_pton(AF_INET6, u->host, &s6->sin6_addr) == 1 ? 0 : -1;
  }
  struct sockaddr_in *s4 = (struct sockaddr_in *)&u->sa;
  s4->sin_family = AF_INET;
  s4->sin_port = htons((uint16_t)port);
  u->len = sizeof *s4;
  return inet_pton(AF_INET, u->host, &s4->sin_addr) == 1 ? 0 : -1;
}

/* ------------------------------------------------------------ GET */

static int dial(const struct url *u, int timeout_ms, char *err, size_t errlen) {
  int fd = socket(u->sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(err, errlen, "socket: %s", strerror(errno));
    return -1;
  }
  /* On Linux SO_SNDTIMEO bounds connect() too. */
  struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (connect(fd, (const struct sockaddr *)&u->sa, u->len) != 0) {
    snprintf(err, errlen, "connect: %s", strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

static int send_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Reads until EOF into a malloc'd, NUL-terminated buffer. */
static char *read_all(int fd, size_t *len, char *err, size_t errlen) {
  size_t cap = 65536, n = 0;
  char *buf = malloc(cap);
  for (;;) {
    if (!buf) {
      snprintf(err, errlen, "out of memory");
      return NULL;
    }
    if (n + 1 >= cap) {
      char *nb = cap >= BODY_MAX ? NULL : realloc(buf, cap *= 2);
      if (!nb) {
        free(buf);
        snprintf(err, errlen, "response too large");
        return NULL;
      }
      buf = nb;
    }
    ssize_t r = recv(fd, buf + n, cap - n - 1, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      snprintf(err, errlen, "read: %s", errno == EAGAIN ? "timed out" : strerror(errno));
      free(buf);
      return NULL;
    }
    if (r == 0) break;
    n += (size_t)r;
  }
  buf[n] = '\0';
  *len = n;
  return buf;
}

/* Checks the status line and Content-Length; moves the body to the front. */
static int take_body(char *resp, size_t len, char **body, char *err, size_t errlen) {
  int code = 0;
  char *sep = strstr(resp, "\r\n\r\n");
  if (sscanf(resp, "HTTP/1.%*d %d", &code) != 1 || !sep) {
    snprintf(err, errlen, "not an HTTP response");
    return -1;
  }
  if (code != 200) {
    snprintf(err, errlen, "HTTP status %d", code);
    return -1;
  }
  char *b = sep + 4;
  size_t blen = len - (size_t)(b - resp);
  char *cl = strcasestr(resp, "\r\nContent-Length:");
  if (cl && cl < sep && strtoull(cl + 17, NULL, 10) != blen) {
    snprintf(err, errlen, "body of %zu bytes, Content-Length says %s", blen, cl + 17);
    return -1;
  }
  memmove(resp, b, blen + 1);
  *body = resp;
  return 0;
}

int ctl_http_get(const char *url, int timeout_ms, char **body, char *err, size_t errlen) {
  struct url u;
  if (parse_url(url, &u) != 0) {
    snprintf(err, errlen, "cannot use URL '%s'", url);
    return -1;
  }
  int fd = dial(&u, timeout_ms, err, errlen);
  if (fd < 0) return -1;
  char req[512];
  int n = snprintf(req, sizeof req,
                   "GET %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: kvferryctl\r\n"
                   "Accept: text/plain\r\nConnection: close\r\n\r\n",
                   u.path, u.host);
  size_t len = 0;
  char *resp = NULL;
  if (send_all(fd, req, (size_t)n) != 0) snprintf(err, errlen, "write: %s", strerror(errno));
  else resp = read_all(fd, &len, err, errlen);
  close(fd);
  if (!resp) return -1;
  if (take_body(resp, len, body, err, errlen) != 0) {
    free(resp);
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------ text -> JSON */

/* Writes the labels of a sample line ({a="x",b="y"}) as a JSON object;
 * returns the byte after '}', or NULL when malformed. */
static const char *put_labels(const char *p, FILE *out) {
  fputc('{', out);
  bool first = true;
  p++; /* '{' */
  while (*p && *p != '}') {
    const char *k = p;
    while (*p && *p != '=') p++;
    if (p[0] != '=' || p[1] != '"') return NULL;
    fprintf(out, "%s\"%.*s\":\"", first ? "" : ",", (int)(p - k), k);
    first = false;
    for (p += 2; *p && *p != '"'; p++) {
      if (*p == '\\' && p[1]) {
        p++;
        fputs(*p == 'n' ? "\\n" : *p == '"' ? "\\\"" : "\\\\", out);
      } else if ((unsigned char)*p < 0x20) {
        fprintf(out, "\\u%04x", *p);
      } else {
        fputc(*p, out);
      }
    }
    if (*p != '"') return NULL;
    fputc('"', out);
    p++;
    if (*p == ',') p++;
  }
  fputc('}', out);
  return *p == '}' ? p + 1 : NULL;
}

static void put_value(const char *v, FILE *out) {
  char *end;
  double d = strtod(v, &end);
  if (end != v && isfinite(d)) fprintf(out, "%.17g", d);
  else kvf__json_fquote(out, v); /* +Inf, NaN: JSON has no numbers for them */
}

static int put_sample(const char *line, FILE *out, bool first) {
  size_t nl = strcspn(line, "{ ");
  fprintf(out, "%s{\"name\":\"%.*s\",\"labels\":", first ? "" : ",", (int)nl, line);
  const char *p = line + nl;
  if (*p == '{') p = put_labels(p, out);
  else fputs("{}", out);
  if (!p || *p != ' ') return -1;
  fputs(",\"value\":", out);
  char val[64];
  if (sscanf(p, " %63s", val) != 1) return -1;
  put_value(val, out);
  fputc('}', out);
  return 0;
}

/* A family in the output: none open, its name and help written, or its
 * samples array open. */
enum fam { FAM_NONE, FAM_HEAD, FAM_SAMPLES };

static void open_samples(FILE *out, enum fam *st, const char *type) {
  if (*st != FAM_HEAD) return;
  fputs(",\"type\":", out);
  kvf__json_fquote(out, type);
  fputs(",\"samples\":[", out);
  *st = FAM_SAMPLES;
}

static void end_family(FILE *out, enum fam *st) {
  open_samples(out, st, "untyped");
  if (*st == FAM_SAMPLES) fputs("]}", out);
  *st = FAM_NONE;
}

int ctl_metrics_json(const char *text, FILE *out) {
  char *copy = strdup(text), *save = NULL;
  enum fam st = FAM_NONE;
  bool first_fam = true, first_sample = true;
  int rc = 0;
  if (!copy) return -1;
  fputs("{\"families\":[", out);
  for (char *line = strtok_r(copy, "\n", &save); line && rc == 0; line = strtok_r(NULL, "\n", &save)) {
    char name[256];
    int off = 0;
    if (sscanf(line, "# HELP %255s %n", name, &off) == 1) {
      end_family(out, &st);
      fprintf(out, "%s{\"name\":\"%s\",\"help\":", first_fam ? "" : ",", name);
      kvf__json_fquote(out, line + off);
      first_fam = false;
      first_sample = true;
      st = FAM_HEAD;
    } else if (sscanf(line, "# TYPE %255s %n", name, &off) == 1) {
      open_samples(out, &st, line + off);
    } else if (line[0] != '#' && line[0] && st != FAM_NONE) {
      open_samples(out, &st, "untyped");
      rc = put_sample(line, out, first_sample);
      first_sample = false;
    }
  }
  end_family(out, &st);
  fputs("]}\n", out);
  free(copy);
  return rc;
}
