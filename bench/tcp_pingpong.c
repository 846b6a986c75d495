/* tcp_pingpong - the raw loopback baseline of bench/latency.sh: a message
 * of --bytes (default 64 KiB) written on one TCP connection and a 1-byte
 * ack back, --rounds times, timed from the first write to the ack read.
 * The sockets are set up as kvferryd's tcp transport sets up its data
 * streams: TCP_NODELAY, the kernel's default buffer sizes, blocking I/O,
 * one thread per side. --gap-us N idles N us between rounds (both sides
 * blocked in recv), as a handoff whose grant was posted ahead idles.
 * --spin: no thread sleeps: both sides poll their socket (MSG_DONTWAIT)
 * and the gap is waited out busy, so that a gap's cost with every thread
 * awake (caches, the machine) shows apart from its wake-ups. With --spin
 * and a gap, --warm-us N sends a 1-byte ping (answered) on the same
 * connection every N us of the gap, which keeps the kernel's path in use
 * (each message then carries a 1-byte type ahead of it, read apart by the
 * server), and --touch-us N re-reads the message buffer every N us of it
 * (the user's memory kept in the caches): which of the two takes the gap's
 * cost away says where it lies.
 *
 * Prints one JSON line: {"bytes", "rounds", "gap_us", "p50_us", "p99_us",
 * "min_us"}. Exit status 1 on any error. */
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static size_t msg_bytes = 64 << 10;
static long rounds = 2000, warmup = 200, gap_us = 0;
static int spin; /* --spin: poll instead of blocking, busy through the gap */
static long warm_us, touch_us; /* --warm-us, --touch-us: what the busy gap does */
enum { MSG_TYPE = 'M', PING_TYPE = 'P' }; /* with --warm-us, ahead of each message */

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int die(const char *what) {
  fprintf(stderr, "tcp-pingpong: %s: %s\n", what, strerror(errno));
  exit(1);
}

static void io_all(int fd, uint8_t *buf, size_t len, int out) {
  for (size_t done = 0; done < len;) {
    int flags = spin ? MSG_DONTWAIT : 0;
    ssize_t r = out ? send(fd, buf + done, len - done, MSG_NOSIGNAL | flags) : recv(fd, buf + done, len - done, flags);
    if (r < 0 && (errno == EINTR || (spin && (errno == EAGAIN || errno == EWOULDBLOCK)))) continue;
    if (r <= 0) die(out ? "send" : "recv");
    done += (size_t)r;
  }
}

static void nodelay(int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) die("TCP_NODELAY");
}

/* The receiving side: reads each message whole, answers one byte. */
static void *server(void *arg) {
  int fd = *(int *)arg;
  uint8_t *buf = malloc(msg_bytes), ack = 1, type = MSG_TYPE;
  if (!buf) die("malloc");
  for (long i = 0; i < warmup + rounds;) {
    if (warm_us) io_all(fd, &type, 1, 0);
    if (type == MSG_TYPE) {
      io_all(fd, buf, msg_bytes, 0);
      i++;
    }
    io_all(fd, &ack, 1, 1);
  }
  free(buf);
  return NULL;
}

static int ping_fd;                /* --warm-us: the client's socket */
static const uint8_t *touch_buf;   /* --touch-us: the message */
static volatile uint8_t touch_sink;

static void idle(long us) {
  if (!spin) {
    nanosleep(&(struct timespec){us / 1000000, (us % 1000000) * 1000}, NULL);
    return;
  }
  int64_t now = now_ns(), end = now + (int64_t)us * 1000, next_warm = now, next_touch = now;
  for (; now < end; now = now_ns()) {
    if (warm_us && now >= next_warm) {
      uint8_t b = PING_TYPE;
      io_all(ping_fd, &b, 1, 1);
      io_all(ping_fd, &b, 1, 0);
      next_warm = now + warm_us * 1000;
    }
    if (touch_us && now >= next_touch) {
      for (size_t k = 0; k < msg_bytes; k += 64) touch_sink += touch_buf[k];
      next_touch = now + touch_us * 1000;
    }
  }
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double pct(const double *v, long n, double p) {
  long rank = (long)ceil(p / 100.0 * (double)n);
  return v[(rank < 1 ? 1 : rank > n ? n : rank) - 1];
}

static long arg_num(const char *s) {
  char *end;
  long v = strtol(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v < 0) {
    fprintf(stderr, "tcp-pingpong: '%s' is not a number\n", s);
    exit(2);
  }
  return v;
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--bytes") == 0) msg_bytes = (size_t)arg_num(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--rounds") == 0) rounds = arg_num(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--gap-us") == 0) gap_us = arg_num(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--warmup") == 0) warmup = arg_num(argv[++i]);
    else if (strcmp(argv[i], "--spin") == 0) spin = 1;
    else if (i + 1 < argc && strcmp(argv[i], "--warm-us") == 0) warm_us = arg_num(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--touch-us") == 0) touch_us = arg_num(argv[++i]);
    else {
      fprintf(stderr, "usage: tcp-pingpong [--bytes N] [--rounds N] [--gap-us N] [--warmup N] [--spin [--warm-us N] [--touch-us N]]\n");
      return 2;
    }
  }
  if (msg_bytes == 0 || rounds == 0) return 2;
  if ((warm_us || touch_us) && (!spin || !gap_us)) {
    fprintf(stderr, "tcp-pingpong: --warm-us and --touch-us shape a busy gap: they need --spin and --gap-us\n");
    return 2;
  }
  int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof(a);
  if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(ls, 1) != 0 ||
      getsockname(ls, (struct sockaddr *)&a, &alen) != 0)
    die("listen");
  int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof(a)) != 0) die("connect");
  int s = accept(ls, NULL, NULL);
  if (s < 0) die("accept");
  nodelay(c);
  nodelay(s);
  pthread_t thr;
  if (pthread_create(&thr, NULL, server, &s) != 0) die("pthread_create");
  /* with --warm-us a message goes with its type byte ahead, in one send */
  size_t head = warm_us ? 1 : 0;
  uint8_t *frame = malloc(head + msg_bytes), *buf = frame + head, ack;
  double *lat = calloc((size_t)rounds, sizeof(double));
  if (!frame || !lat) die("malloc");
  memset(buf, 0x5a, msg_bytes);
  if (warm_us) frame[0] = MSG_TYPE;
  ping_fd = c;
  touch_buf = buf;
  for (long i = 0; i < warmup + rounds; i++) {
    if (gap_us) idle(gap_us);
    int64_t t0 = now_ns();
    io_all(c, frame, head + msg_bytes, 1);
    io_all(c, &ack, 1, 0);
    if (i >= warmup) lat[i - warmup] = (double)(now_ns() - t0) / 1e3;
  }
  pthread_join(thr, NULL);
  qsort(lat, (size_t)rounds, sizeof(double), cmp);
  printf("{\"bytes\": %zu, \"rounds\": %ld, \"gap_us\": %ld, \"spin\": %s, \"warm_us\": %ld, \"touch_us\": %ld, \"p50_us\": %.1f, \"p99_us\": %.1f, \"min_us\": %.1f}\n",
         msg_bytes, rounds, gap_us, spin ? "true" : "false", warm_us, touch_us, pct(lat, rounds, 50), pct(lat, rounds, 99), lat[0]);
  free(frame);
  free(lat);
  return 0;
}
