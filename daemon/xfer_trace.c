/* xfer_trace.c - per-transfer timelines (xfer_trace.h). */
#include "xfer_trace.h"

#include <string.h>

#include "api.h"
#include "metrics.h"
#include "xfer_int.h"

#define TRACE_RING 1024

enum { HOP_POST_PAIR, HOP_PAIR_FIRST, HOP_FIRST_LAST, HOP_LAST_EVENT, HOP_TOTAL, N_HOPS };
static const char *const hop_name[N_HOPS] = {"post_to_pair", "pair_to_first", "first_to_last", "last_to_event",
                                             "total"};

/* Log-spaced bucket bounds, 1 us to 10 s: 1, 2.5, 5 per decade. */
static const double hop_le[] = {1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
                                5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
#define N_LE (sizeof hop_le / sizeof hop_le[0])

typedef struct trec {
  char id[KVF_XFER_ID_MAX + 1];
  char peer[KVF__NAME_MAX + 1];
  const char *path;            /* static (kvf__xfer_path) */
  int role, status;
  uint64_t bytes;
  uint64_t t[KVF__XT_N];       /* monotone, EVENT the end */
  uint64_t result;             /* the other side's word; 0 = none */
  uint64_t part;               /* a send's last part came; 0 = not a send */
} trec;

typedef struct hist {
  uint64_t buckets[N_LE];      /* not cumulative */
  uint64_t count;
  double sum;
} hist;

static struct {
  trec ring[TRACE_RING];
  uint64_t n;                  /* ever recorded; the next goes at n % TRACE_RING */
  hist h[2][N_HOPS];           /* [role][hop] */
} T;

void kvf__xtrace_stamp(kvf__xfer *x, int which, uint64_t ns) {
  if (!ns) ns = kvf__now_ns();
  uint64_t *t = &x->tr.t[which];
  if (which == KVF__XT_FIRST) *t = *t && *t < ns ? *t : ns;
  else if (which == KVF__XT_LAST) *t = *t > ns ? *t : ns;
  else if (!*t) *t = ns;
}

/* The window before a local send's last part opened: its receiver's
 * engine hears Soon, as for the copy's launch (local.c), a window ahead,
 * so that its threads, asleep through a layer's compute, are awake when
 * the event comes. A grant gone meanwhile is told nothing. */
static void soon_ahead(uint64_t recv_handle, uint32_t window_us) {
  kvf__xfer *r = kvf__xfer_by_handle(NULL, KVF__RECV, recv_handle);
  if (r && r->owner && r->twin) kvf__api_soon(r->owner, r->id, window_us);
}

void kvf__xtrace_part(kvf__xfer *x, bool last, bool next_last) {
  uint64_t now = x->tr.t[KVF__XT_PART] = kvf__now_ns();
  const kvf__xfer *r = x->twin;
  bool tell = next_last && r && r->owner && r->handle && !r->peer;
  kvf__spin_part(&x->send.cadence, last, now, tell ? soon_ahead : NULL, tell ? r->handle : 0);
}

void kvf__xtrace_twin(kvf__xfer *recv, const kvf__xfer *send) {
  const uint64_t *t = send->tr.t;
  recv->tr.t[KVF__XT_FIRST] = t[KVF__XT_FIRST] ? t[KVF__XT_FIRST] : send->send.first_post_ns;
  recv->tr.t[KVF__XT_LAST] = t[KVF__XT_LAST] ? t[KVF__XT_LAST] : send->send.posted_ns;
}

static void observe(hist *h, uint64_t ns) {
  double s = (double)ns / 1e9;
  size_t i = 0;
  while (i < N_LE && s > hop_le[i]) i++;
  if (i < N_LE) h->buckets[i]++;
  h->count++;
  h->sum += s;
}

/* Monotone stamps: a missing (or, across threads, earlier) one takes the
 * one before it; the event is at least the last. */
static void fill(trec *r, const kvf__xfer *x) {
  r->t[KVF__XT_POST] = x->tr.t[KVF__XT_POST] ? x->tr.t[KVF__XT_POST] : x->created_ns;
  uint64_t end = x->tr.t[KVF__XT_EVENT] ? x->tr.t[KVF__XT_EVENT] : kvf__now_ns();
  static const int order[] = {KVF__XT_PAIR, KVF__XT_FIRST, KVF__XT_LAST};
  uint64_t prev = r->t[KVF__XT_POST];
  uint64_t own[KVF__XT_N];
  memcpy(own, x->tr.t, sizeof(own));
  if (x->role == KVF__SEND && !own[KVF__XT_FIRST]) own[KVF__XT_FIRST] = x->send.first_post_ns; /* handed over */
  if (x->role == KVF__SEND && !own[KVF__XT_LAST]) own[KVF__XT_LAST] = x->send.posted_ns;       /* called back */
  for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
    uint64_t v = own[order[i]];
    if (v < prev) v = prev;
    if (v > end) v = end;
    r->t[order[i]] = prev = v;
  }
  r->t[KVF__XT_EVENT] = end > prev ? end : prev;
  r->t[KVF__XT_RESULT] = 0;
  r->result = x->tr.t[KVF__XT_RESULT];
  r->part = x->tr.t[KVF__XT_PART];
}

static uint64_t hop_ns(const trec *r, int hop) {
  static const int from[N_HOPS] = {KVF__XT_POST, KVF__XT_PAIR, KVF__XT_FIRST, KVF__XT_LAST, KVF__XT_POST};
  static const int to[N_HOPS] = {KVF__XT_PAIR, KVF__XT_FIRST, KVF__XT_LAST, KVF__XT_EVENT, KVF__XT_EVENT};
  return r->t[to[hop]] - r->t[from[hop]];
}

void kvf__xtrace_finish(const kvf__xfer *x, int status) {
  trec *r = &T.ring[T.n++ % TRACE_RING];
  memset(r, 0, sizeof(*r));
  snprintf(r->id, sizeof(r->id), "%s", x->id);
  snprintf(r->peer, sizeof(r->peer), "%s", x->peer_name);
  r->path = kvf__xfer_path(x);
  r->role = x->role;
  r->status = status;
  r->bytes = kvf__xfer_bytes(x);
  fill(r, x);
  if (status) return;
  int role = x->role == KVF__RECV ? 1 : 0;
  for (int k = 0; k < N_HOPS; k++) observe(&T.h[role][k], hop_ns(r, k));
}

static const char *role_name(int role) { return role == KVF__RECV ? "recv" : "send"; }

static double us(uint64_t ns) { return (double)ns / 1e3; }

static void render_one(kvf__sbuf *b, const trec *r, int json, int first) {
  if (!json) {
    kvf__sb_printf(b, "%-32s %-4s %-16s %-10s %12llu %10.1f %10.1f %10.1f %10.1f %10.1f%s%s\n", r->id,
                   role_name(r->role), r->peer[0] ? r->peer : "-", r->path, (unsigned long long)r->bytes,
                   us(hop_ns(r, HOP_POST_PAIR)), us(hop_ns(r, HOP_PAIR_FIRST)), us(hop_ns(r, HOP_FIRST_LAST)),
                   us(hop_ns(r, HOP_LAST_EVENT)), us(hop_ns(r, HOP_TOTAL)), r->status ? " " : "",
                   r->status ? kvf_err_name(r->status) : "");
    return;
  }
  kvf__sb_printf(b, "%s{\"id\": ", first ? "" : ", ");
  kvf__sb_json_str(b, r->id);
  kvf__sb_printf(b, ", \"role\": \"%s\", \"peer\": ", role_name(r->role));
  kvf__sb_json_str(b, r->peer);
  kvf__sb_printf(b, ", \"path\": ");
  kvf__sb_json_str(b, r->path);
  kvf__sb_printf(b, ", \"bytes\": %llu, \"status\": \"%s\", \"posted_ns\": %llu", (unsigned long long)r->bytes,
                 r->status ? kvf_err_name(r->status) : "ok", (unsigned long long)r->t[KVF__XT_POST]);
  for (int k = 0; k < N_HOPS; k++) kvf__sb_printf(b, ", \"%s_us\": %.3f", hop_name[k], us(hop_ns(r, k)));
  if (r->result) kvf__sb_printf(b, ", \"result_us\": %.3f", us(r->result - r->t[KVF__XT_POST]));
  else kvf__sb_printf(b, ", \"result_us\": null");
  /* A layer-wise send's last part to its event: what the decode side waits
   * for once the prefill is over (bench/layerwise.sh). */
  if (r->part && r->part <= r->t[KVF__XT_EVENT])
    kvf__sb_printf(b, ", \"last_part_to_event_us\": %.3f", us(r->t[KVF__XT_EVENT] - r->part));
  else kvf__sb_printf(b, ", \"last_part_to_event_us\": null");
  kvf__sb_printf(b, "}");
}

void kvf__xtrace_render(kvf__sbuf *b, int json) {
  if (json) kvf__sb_printf(b, "{\"transfers\": [");
  else
    kvf__sb_printf(b, "%-32s %-4s %-16s %-10s %12s %10s %10s %10s %10s %10s\n", "ID", "ROLE", "PEER", "PATH", "BYTES",
                   "POST>PAIR", "PAIR>FIRST", "FIRST>LAST", "LAST>EVENT", "TOTAL (us)");
  uint64_t from = T.n > TRACE_RING ? T.n - TRACE_RING : 0;
  for (uint64_t i = from; i < T.n; i++) render_one(b, &T.ring[i % TRACE_RING], json, i == from);
  if (json) kvf__sb_printf(b, "]}\n");
}

void kvf__xtrace_metrics(kvf__sbuf *b) {
  const char *name = "kvferry_transfer_hop_seconds";
  kvf__metrics_family(b, name, "histogram",
                      "Where successful transfers' time went, hop by hop on this daemon's side "
                      "(kvferryctl transfers --trace).");
  for (int role = 0; role < 2; role++)
    for (int k = 0; k < N_HOPS; k++) {
      const hist *h = &T.h[role][k];
      const char *rn = role ? "recv" : "send";
      uint64_t cum = 0;
      for (size_t i = 0; i < N_LE; i++) {
        cum += h->buckets[i];
        kvf__sb_printf(b, "%s_bucket{hop=\"%s\",role=\"%s\",le=\"%g\"} %llu\n", name, hop_name[k], rn, hop_le[i],
                       (unsigned long long)cum);
      }
      kvf__sb_printf(b, "%s_bucket{hop=\"%s\",role=\"%s\",le=\"+Inf\"} %llu\n", name, hop_name[k], rn,
                     (unsigned long long)h->count);
      kvf__sb_printf(b, "%s_sum{hop=\"%s\",role=\"%s\"} %.9f\n", name, hop_name[k], rn, h->sum);
      kvf__sb_printf(b, "%s_count{hop=\"%s\",role=\"%s\"} %llu\n", name, hop_name[k], rn,
                     (unsigned long long)h->count);
    }
}

void kvf__xtrace_reset(void) { memset(&T, 0, sizeof(T)); }
