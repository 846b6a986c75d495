/* metrics_http.c - the metrics endpoint: a deliberately small HTTP/1.1
 * server on the libuv loop, enough for Prometheus and curl.
 *
 * One request per connection: the request head is read (at most
 * HEAD_MAX bytes, else 431), answered with Content-Length and
 * "Connection: close", and the connection is shut down. A connection gets
 * TIMEOUT_MS for the whole exchange, so a slow or silent client cannot hold
 * it; at most MAX_CONNS are open at once, more are closed on accept. No
 * request body is read; none of the routes takes one.
 *
 *   GET|HEAD /metrics   the exposition (text format 0.0.4)
 *   GET|HEAD /healthz   200 "ok", or 503 "stopping" while draining
 *   GET|HEAD /          a line pointing at /metrics */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"

#define HEAD_MAX 8192
#define TIMEOUT_MS 5000
#define MAX_CONNS 16

typedef struct mconn {
  uv_tcp_t tcp;
  uv_timer_t timer;
  uv_write_t wreq;
  uv_shutdown_t sreq;
  char *out;        /* the response, while it is being written */
  size_t n;         /* bytes of the request head read so far */
  bool answered;
  bool closing;
  struct mconn *prev, *next;
  char head[HEAD_MAX + 1];
} mconn;

static struct {
  uv_loop_t *loop;
  uv_tcp_t listener;
  bool listening;
  mconn *conns;
  size_t n;
  char url[320];
} H;

size_t kvf__metrics_http_conns(void) { return H.n; }
const char *kvf__metrics_url(void) { return H.url; }

/* ------------------------------------------------------------ connections */

static void on_tcp_closed(uv_handle_t *h) {
  mconn *c = h->data;
  free(c->out);
  free(c);
}

static void on_timer_closed(uv_handle_t *h) {
  mconn *c = h->data;
  uv_close((uv_handle_t *)&c->tcp, on_tcp_closed);
}

static void conn_close(mconn *c) {
  if (c->closing) return;
  c->closing = true;
  if (c->prev) c->prev->next = c->next;
  else H.conns = c->next;
  if (c->next) c->next->prev = c->prev;
  H.n--;
  uv_timer_stop(&c->timer);
  uv_close((uv_handle_t *)&c->timer, on_timer_closed);
}

static void on_shutdown(uv_shutdown_t *req, int status) { conn_close(req->data); }

static void on_written(uv_write_t *req, int status) {
  mconn *c = req->data;
  free(c->out);
  c->out = NULL;
  c->sreq.data = c;
  if (status || c->closing || uv_shutdown(&c->sreq, (uv_stream_t *)&c->tcp, on_shutdown) != 0)
    conn_close(c);
}

static const char *reason(int code) {
  switch (code) {
  case 200: return "OK";
  case 400: return "Bad Request";
  case 404: return "Not Found";
  case 405: return "Method Not Allowed";
  case 408: return "Request Timeout";
  case 431: return "Request Header Fields Too Large";
  case 503: return "Service Unavailable";
  default: return "Internal Server Error";
  }
}

/* Writes the whole response (head, and body unless head_only), then shuts
 * the connection down. body may be NULL for an empty one. */
static void respond(mconn *c, int code, const char *type, const char *body, size_t len,
                    bool head_only) {
  if (c->answered || c->closing) return;
  c->answered = true;
  uv_read_stop((uv_stream_t *)&c->tcp);
  char head[512];
  int hn = snprintf(head, sizeof head,
                    "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                    "Cache-Control: no-store\r\nConnection: close\r\n%s\r\n",
                    code, reason(code), type, len, code == 405 ? "Allow: GET, HEAD\r\n" : "");
  size_t blen = head_only || !body ? 0 : len;
  c->out = malloc((size_t)hn + blen);
  if (!c->out) {
    conn_close(c);
    return;
  }
  memcpy(c->out, head, (size_t)hn);
  if (blen) memcpy(c->out + hn, body, blen);
  uv_buf_t buf = uv_buf_init(c->out, (unsigned)((size_t)hn + blen));
  c->wreq.data = c;
  if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &buf, 1, on_written) != 0) conn_close(c);
}

static void respond_text(mconn *c, int code, const char *text, bool head_only) {
  respond(c, code, "text/plain; charset=utf-8", text, strlen(text), head_only);
}

static void serve_metrics(mconn *c, bool head_only) {
  size_t len = 0;
  char *text = kvf__metrics_render(&len);
  if (!text) {
    respond_text(c, 500, "out of memory\n", head_only);
    return;
  }
  respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", text, len, head_only);
  free(text);
}

/* Answers the request whose head is complete in c->head. */
static void route(mconn *c) {
  char method[16], target[256], version[16];
  /* The request line: METHOD SP TARGET SP HTTP/1.x */
  if (sscanf(c->head, "%15[A-Z] %255[^ \r\n] %15[^\r\n]", method, target, version) != 3 ||
      strncmp(version, "HTTP/1.", 7) != 0) {
    respond_text(c, 400, "bad request line\n", false);
    return;
  }
  bool head_only = strcmp(method, "HEAD") == 0;
  if (!head_only && strcmp(method, "GET") != 0) {
    respond_text(c, 405, "only GET and HEAD\n", false);
    return;
  }
  target[strcspn(target, "?#")] = '\0'; /* Prometheus may add parameters */
  if (strcmp(target, "/metrics") == 0) serve_metrics(c, head_only);
  else if (strcmp(target, "/healthz") == 0)
    respond_text(c, kvfd.draining || kvfd.stopping ? 503 : 200,
                 kvfd.draining || kvfd.stopping ? "stopping\n" : "ok\n", head_only);
  else if (strcmp(target, "/") == 0)
    respond_text(c, 200, "kvferryd: Prometheus metrics at /metrics\n", head_only);
  else respond_text(c, 404, "not found; try /metrics\n", head_only);
}

static bool head_complete(const mconn *c) {
  return strstr(c->head, "\r\n\r\n") || strstr(c->head, "\n\n");
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  mconn *c = h->data;
  *buf = uv_buf_init(c->head + c->n, (unsigned)(HEAD_MAX - c->n));
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  mconn *c = st->data;
  if (nread < 0) {
    conn_close(c);
    return;
  }
  c->n += (size_t)nread;
  c->head[c->n] = '\0';
  if (memchr(c->head, '\0', c->n)) respond_text(c, 400, "NUL in request\n", false);
  else if (head_complete(c)) route(c);
  else if (c->n == HEAD_MAX) respond_text(c, 431, "request head too large\n", false);
}

static void on_timeout(uv_timer_t *t) {
  mconn *c = t->data;
  if (!c->answered) {
    respond_text(c, 408, "request timeout\n", false);
    /* Last chance: if even the answer does not drain in time, drop it. */
    if (!c->closing) uv_timer_start(&c->timer, on_timeout, TIMEOUT_MS, 0);
    return;
  }
  conn_close(c);
}

static void on_connection(uv_stream_t *server, int status) {
  if (status < 0) return;
  mconn *c = calloc(1, sizeof *c);
  if (!c) return;
  uv_tcp_init(H.loop, &c->tcp);
  uv_timer_init(H.loop, &c->timer);
  c->tcp.data = c->timer.data = c;
  c->next = H.conns;
  if (H.conns) H.conns->prev = c;
  H.conns = c;
  H.n++;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0 || H.n > MAX_CONNS) {
    conn_close(c); /* over the limit: the scraper retries on its next interval */
    return;
  }
  uv_timer_start(&c->timer, on_timeout, TIMEOUT_MS, 0);
  uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* ------------------------------------------------------------ listener */

static bool is_loopback(const struct sockaddr *sa) {
  if (sa->sa_family == AF_INET)
    return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
  if (sa->sa_family == AF_INET6)
    return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)sa)->sin6_addr);
  return false;
}

static bool is_wildcard(const struct sockaddr *sa) {
  if (sa->sa_family == AF_INET)
    return ((const struct sockaddr_in *)sa)->sin_addr.s_addr == htonl(INADDR_ANY);
  return IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)sa)->sin6_addr);
}

/* The URL clients use: a wildcard address is reached over loopback. */
static void make_url(const struct sockaddr *bound) {
  char host[INET6_ADDRSTRLEN] = "";
  bool v6 = bound->sa_family == AF_INET6;
  int port = ntohs(v6 ? ((const struct sockaddr_in6 *)bound)->sin6_port
                      : ((const struct sockaddr_in *)bound)->sin_port);
  if (is_wildcard(bound)) snprintf(host, sizeof host, v6 ? "::1" : "127.0.0.1");
  else if (v6) inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)bound)->sin6_addr, host, sizeof host);
  else inet_ntop(AF_INET, &((const struct sockaddr_in *)bound)->sin_addr, host, sizeof host);
  snprintf(H.url, sizeof H.url, v6 ? "http://[%s]:%d/metrics" : "http://%s:%d/metrics", host, port);
}

static int bind_listener(const struct sockaddr *sa, char *err, size_t errlen) {
  uv_tcp_init(H.loop, &H.listener);
  H.listening = true;
  int rc = uv_tcp_bind(&H.listener, sa, 0);
  if (rc == 0) rc = uv_listen((uv_stream_t *)&H.listener, 64, on_connection);
  if (rc) {
    snprintf(err, errlen, "metrics-listen %s:%u: %s", kvfd.cfg.metrics_host, kvfd.cfg.metrics_port,
             uv_strerror(rc));
    return rc;
  }
  struct sockaddr_storage bound;
  int blen = sizeof bound;
  uv_tcp_getsockname(&H.listener, (struct sockaddr *)&bound, &blen);
  make_url((struct sockaddr *)&bound);
  return 0;
}

int kvf__metrics_http_start(uv_loop_t *loop, char *err, size_t errlen) {
  H.loop = loop;
  H.url[0] = '\0';
  if (!kvfd.cfg.metrics_host[0]) return 0;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
  char port[8];
  snprintf(port, sizeof port, "%u", kvfd.cfg.metrics_port);
  if (getaddrinfo(kvfd.cfg.metrics_host, port, &hints, &res) != 0) {
    snprintf(err, errlen, "metrics-listen: cannot resolve %s", kvfd.cfg.metrics_host);
    return -EINVAL;
  }
  if (!is_loopback(res->ai_addr))
    kvf__warn("metrics-listen %s is not a loopback address: anyone who can reach it reads the "
              "metrics (there is no authentication)", kvfd.cfg.metrics_host);
  int rc = bind_listener(res->ai_addr, err, errlen);
  freeaddrinfo(res);
  if (rc == 0) kvf__info("metrics at %s", H.url);
  return rc;
}

void kvf__metrics_http_stop(void) {
  if (H.listening) uv_close((uv_handle_t *)&H.listener, NULL);
  H.listening = false;
  while (H.conns) conn_close(H.conns);
}
