/* chaos_client.c - one engine of the chaos suite (tests/chaos/chaos.py).
 *
 * Runs a plan of transfers through libkvferry, a few at a time, and prints
 * one JSON line per transfer outcome on stdout. A process has one role:
 *
 *   recv   grants each transfer of the plan (source node --peer), and on
 *          RECV_DONE checks every byte of its slot: the blocks hold the
 *          sender's pattern, everything around them is still poisoned.
 *   send   fills its blocks with the transfer's pattern and sends them to
 *          --peer, in one to four parts (KVF_SEND_MORE), like a layerwise
 *          prefill.
 *   local  both ends on its own daemon (the local transport), one process.
 *
 * A third of the transfers (both sides) go without waiting for the daemon
 * (KVF_NOWAIT; descriptor grants through kvf_submit): what the daemon
 * refuses then comes as the transfer's DONE event, not from the call.
 *
 * A third of the transfers go by KV layout and block ids instead
 * (kvf_grant_blocks / kvf_send_blocks): each side registers a layout of its
 * slot for the transfer and frees it after its outcome; parts are groups of
 * layers; some grants ask for layer events, which must come in order, one
 * per layer, before a RECV_DONE that succeeds.
 *
 * The plan (--plan FILE: lines "ID SEED DEADLINE_MS") is the same for both
 * ends of a pair; each transfer's geometry (model preset, layers, blocks,
 * parts) follows from its seed, so sender and receiver agree without
 * talking. Block placement in each side's slot is random per side.
 *
 * The driver kills these processes, or their daemons, at random moments:
 * Stopping is two-step, so that both ends of a pair stop at the same
 * transfer: SIGUSR1 pauses (nothing new starts; the engine prints
 * {"paused": NEXT}, the plan index it would start next), then SIGUSR2 reads
 * PLAN.limit, the smaller NEXT of the pair: the engine cancels (kvf_cancel)
 * what it started at or past it, which the other end never did, and exits
 * once the rest is done. Those outcomes say "where": "withdrawn". A transfer
 * with no outcome by its deadline + --hung-ms is reported as HUNG and its
 * slot is never reused (its memory may still be written). When the daemon
 * goes away every transfer under way is reported with KVF_EDAEMON.
 *
 * Output lines (one JSON object each):
 *   {"ready": ...}                       connected, pool mapped (or {"setup_error": ...})
 *   {"posted": ID, ...}                  the first request of a transfer was accepted
 *   {"outcome": ID, "side": "recv"|"send", "status": NAME, ...}
 *   {"stray": ID, ...}                   an event for no transfer under way
 *   {"exit": ...}                        the last line of a normal exit */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "kvferry.h"

#define MAX_CONC 16
#define MAX_PARTS 4
#define GUARD 64

enum { ROLE_RECV, ROLE_SEND, ROLE_LOCAL };

typedef struct opts {
  const char *sock, *peer, *pool, *plan, *tag;
  int role;
  uint64_t region_off, region_len, max_bytes;
  int conc;
  int hung_ms;
} opts;

typedef struct plan_ent {
  char id[KVF_XFER_ID_MAX + 1];
  uint64_t seed;
  uint32_t deadline_ms;
} plan_ent;

/* What both ends derive from a transfer's seed. */
typedef struct geom {
  const char *preset;
  uint64_t block, ndesc, bytes;
  int parts;
  bool named;       /* the grant names its source node (pushed ahead) */
  int send_delay_ms;/* the sender starts this long after the receiver may have */
  int part_gap_ms;  /* pause between parts */
  bool blocks;      /* by layout and block ids: */
  bool layer_events;
  uint64_t layers, kv, nblocks;
  bool nowait;      /* KVF_NOWAIT: grant and parts unanswered, refusals as events */
} geom;

typedef struct xfer {
  const plan_ent *pe;
  geom g;
  int slot;
  kvf_desc *src, *dst;  /* this side's descriptors (local: both) */
  uint64_t t0_ms;
  int parts_posted;
  uint64_t next_part_ms;
  bool need_recv, need_send; /* outcomes still to come */
  bool active;
  bool withdrawn;       /* cancelled by the two-step stop */
  uint32_t lay_src, lay_dst; /* blocks: this side's layouts (0: none) */
  uint32_t *sids, *dids;
  uint64_t layers_seen;      /* LAYER_DONE events so far */
} xfer;

static volatile sig_atomic_t usr1, usr2;
static kvf_client *C;
static opts O;
static uint8_t *pool_base;
static uint32_t pool_id;
static const char *own_node;

static void on_usr(int sig) {
  if (sig == SIGUSR1) usr1 = 1;
  else usr2 = 1;
}

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ------------------------------------------------------------ randomness */

static uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

typedef struct rng { uint64_t s; } rng;
static uint64_t rnext(rng *r) { return mix64(r->s++ * 0x2545f4914f6cdd1dull); }
static uint64_t rbelow(rng *r, uint64_t n) { return n ? rnext(r) % n : 0; }

/* Byte g of transfer seed's data stream. */
static inline uint8_t pattern_byte(uint64_t seed, uint64_t g) {
  return (uint8_t)(mix64(seed ^ ((g >> 3) * 0xd1342543de82ef95ull)) >> (8 * (g & 7)));
}

static void fill_pattern(uint8_t *p, uint64_t len, uint64_t seed, uint64_t g0) {
  uint64_t i = 0;
  for (; i < len && ((g0 + i) & 7); i++) p[i] = pattern_byte(seed, g0 + i);
  for (; i + 8 <= len; i += 8) {
    uint64_t w = mix64(seed ^ (((g0 + i) >> 3) * 0xd1342543de82ef95ull));
    memcpy(p + i, &w, 8); /* little-endian: byte k of w is byte g0+i+k */
  }
  for (; i < len; i++) p[i] = pattern_byte(seed, g0 + i);
}

/* The first byte of p[0..len) that is not the pattern; len if none. */
static uint64_t check_pattern(const uint8_t *p, uint64_t len, uint64_t seed, uint64_t g0) {
  uint64_t i = 0;
  for (; i < len && ((g0 + i) & 7); i++)
    if (p[i] != pattern_byte(seed, g0 + i)) return i;
  for (; i + 8 <= len; i += 8) {
    uint64_t w = mix64(seed ^ (((g0 + i) >> 3) * 0xd1342543de82ef95ull));
    if (memcmp(p + i, &w, 8) != 0) break;
  }
  for (; i < len; i++)
    if (p[i] != pattern_byte(seed, g0 + i)) return i;
  return len;
}

static uint8_t poison_of(uint64_t seed) { return (uint8_t)(0xa5 ^ (seed & 0x5a)); }

/* The first byte of p[0..len) that is not v; len if none. memcmp against
 * a block of v: a slot is megabytes and the receiver must keep up. */
static uint64_t check_fill(const uint8_t *p, uint64_t len, uint8_t v) {
  static uint8_t ref[64 << 10];
  static int ref_v = -1;
  if (ref_v != v) {
    memset(ref, v, sizeof ref);
    ref_v = v;
  }
  for (uint64_t i = 0; i < len; i += sizeof ref) {
    uint64_t n = len - i < sizeof ref ? len - i : sizeof ref;
    if (memcmp(p + i, ref, n) == 0) continue;
    for (uint64_t k = 0; k < n; k++)
      if (p[i + k] != v) return i + k;
  }
  return len;
}

/* ------------------------------------------------------------- geometry */

/* The bench's model presets (bench/kvferry-bench.c), and an odd one whose
 * blocks are not a multiple of 8 bytes. */
static const struct {
  const char *name;
  uint64_t layers, kv, block;
} presets[] = {
    {"llama3-8b", 32, 2, 16 * 8 * 128 * 2},
    {"llama3-70b-tp8", 80, 2, 16 * 1 * 128 * 2},
    {"deepseek-v3", 61, 1, 64 * 1 * 576 * 2},
    {"odd-1000", 12, 2, 1000},
};

static geom geom_of(uint64_t seed, uint64_t max_bytes) {
  rng r = {seed};
  geom g;
  size_t k = rbelow(&r, sizeof presets / sizeof presets[0]);
  g.preset = presets[k].name;
  g.block = presets[k].block;
  uint64_t layers = 1 + rbelow(&r, presets[k].layers);
  uint64_t blocks = 1 + rbelow(&r, 8);
  while (layers * presets[k].kv * blocks * g.block > max_bytes && (blocks > 1 || layers > 1)) {
    if (blocks > 1) blocks--;
    else layers = (layers + 1) / 2 == layers ? layers - 1 : (layers + 1) / 2;
  }
  g.ndesc = layers * presets[k].kv * blocks;
  g.bytes = g.ndesc * g.block;
  g.parts = 1 + (int)rbelow(&r, MAX_PARTS);
  if ((uint64_t)g.parts > g.ndesc) g.parts = (int)g.ndesc;
  g.named = rbelow(&r, 4) != 0;
  /* Like a prefill computing its layers: the send starts a little later
   * and comes in parts, so grants wait with data half there. */
  g.send_delay_ms = (int)rbelow(&r, 8);
  g.part_gap_ms = (int)rbelow(&r, 6);
  g.layers = layers;
  g.kv = presets[k].kv;
  g.nblocks = blocks;
  g.blocks = rbelow(&r, 3) == 0;
  g.layer_events = g.blocks && rbelow(&r, 2);
  if (g.blocks && (uint64_t)g.parts > layers) g.parts = (int)layers;
  g.nowait = rbelow(&r, 3) == 0; /* last: the draws above stay as they were */
  return g;
}

static uint64_t slot_len(void) {
  uint64_t n = O.role == ROLE_LOCAL ? 2 * (uint64_t)O.conc : (uint64_t)O.conc;
  return (O.region_len / n) & ~(uint64_t)4095;
}

static uint64_t slot_base(int slot, bool dst_half) {
  uint64_t k = O.role == ROLE_LOCAL && dst_half ? (uint64_t)(O.conc + slot) : (uint64_t)slot;
  return O.region_off + k * slot_len();
}

/* Random distinct positions for g->ndesc blocks in a slot, with a random
 * guard (0 or GUARD bytes) between neighbours and a random shift. */
/* The first n of a random permutation of [0, npos), malloc'ed. */
static uint32_t *pick_distinct(rng *r, uint64_t npos, uint64_t n) {
  uint32_t *pos = malloc(npos * sizeof *pos);
  if (!pos) return NULL;
  for (uint64_t i = 0; i < npos; i++) pos[i] = (uint32_t)i;
  for (uint64_t i = 0; i < n; i++) {
    uint64_t j = i + rbelow(r, npos - i);
    uint32_t t = pos[i];
    pos[i] = pos[j];
    pos[j] = t;
  }
  return pos;
}

static int layout(kvf_desc *d, const geom *g, uint64_t base, uint64_t seed) {
  rng r = {seed};
  uint64_t guard = rbelow(&r, 2) ? GUARD : 0, shift = rbelow(&r, 8);
  uint64_t stride = g->block + guard, npos = (slot_len() - shift) / stride;
  if (npos < g->ndesc) return -1;
  uint32_t *pos = pick_distinct(&r, npos, g->ndesc);
  if (!pos) return -1;
  for (uint64_t i = 0; i < g->ndesc; i++) d[i] = (kvf_desc){pool_id, base + shift + pos[i] * stride, g->block};
  free(pos);
  return 0;
}

/* Blocks: one side's layout over its slot (per-layer regions of nb blocks
 * from base), registered; g->nblocks random distinct ids in ids; d gets
 * the pieces in the order both sides number them (layer, K/V, block i), so
 * the patterns and verify_slot are the descriptors' own. */
static int block_side(const geom *g, uint64_t base, uint64_t seed, kvf_desc *d, uint32_t **ids, uint32_t *lay) {
  uint64_t regions = g->layers * g->kv, nb = slot_len() / (regions * g->block);
  if (nb < g->nblocks) return -1;
  if (nb > 4096) nb = 4096;
  rng r = {seed};
  uint64_t *off = malloc(regions * sizeof(*off));
  *ids = pick_distinct(&r, nb, g->nblocks); /* the first nblocks are the ids */
  if (!off || !*ids) exit(2);
  for (uint64_t reg = 0; reg < regions; reg++) {
    off[reg] = base + reg * nb * g->block;
    for (uint64_t i = 0; i < g->nblocks; i++)
      d[reg * g->nblocks + i] = (kvf_desc){pool_id, off[reg] + (*ids)[i] * g->block, g->block};
  }
  kvf_layout l = {.pool = pool_id, .n_layers = (uint32_t)g->layers, .n_kv = (uint32_t)g->kv,
                  .n_blocks = (uint32_t)nb, .block_bytes = g->block, .block_stride = g->block, .offsets = off};
  int rc = kvf_layout_register(C, &l, lay);
  free(off);
  return rc;
}

/* ------------------------------------------------------------- output */

static void json_str(const char *s) { kvf__json_fquote(stdout, s); }

static void line_end(void) {
  printf("}\n");
  fflush(stdout);
}

static void head(const char *key, const char *id) {
  printf("{\"%s\": ", key);
  json_str(id);
  printf(", \"tag\": ");
  json_str(O.tag);
}

static void outcome(xfer *x, const char *side, int status, const char *where, const char *error,
                    int verified, const char *detail, const char *path) {
  if (x->withdrawn && !strcmp(where, "event")) where = "withdrawn";
  head("outcome", x->pe->id);
  printf(", \"side\": \"%s\", \"status\": \"%s\", \"code\": %d, \"where\": \"%s\", \"error\": ", side,
         status == 1 ? "HUNG" : kvf_err_name(status), status, where);
  json_str(error ? error : "");
  printf(", \"path\": \"%s\"", path ? path : "");
  printf(", \"elapsed_ms\": %" PRIu64 ", \"deadline_ms\": %u, \"bytes\": %" PRIu64 ", \"descs\": %" PRIu64
         ", \"parts\": %d, \"preset\": \"%s\", \"verified\": %s",
         now_ms() - x->t0_ms, x->pe->deadline_ms, x->g.bytes, x->g.ndesc, x->g.parts, x->g.preset,
         verified < 0 ? "null" : verified ? "true" : "false");
  if (detail) {
    printf(", \"detail\": ");
    json_str(detail);
  }
  line_end();
}

/* ------------------------------------------------------------- checks */

static int cmp_off(const void *a, const void *b) {
  const kvf_desc *x = *(const kvf_desc *const *)a, *y = *(const kvf_desc *const *)b;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Every byte of the receiver's slot: pattern inside the blocks, poison
 * everywhere else. 1 when right; 0 with detail filled. */
static int verify_slot(const xfer *x, char *detail, size_t dlen) {
  const kvf_desc **order = malloc(x->g.ndesc * sizeof *order);
  if (!order) {
    snprintf(detail, dlen, "out of memory");
    return 0;
  }
  for (uint64_t i = 0; i < x->g.ndesc; i++) order[i] = &x->dst[i];
  qsort(order, x->g.ndesc, sizeof *order, cmp_off);
  uint64_t base = slot_base(x->slot, true), end = base + slot_len(), at = base;
  uint8_t poison = poison_of(x->pe->seed);
  int ok = 1;
  for (uint64_t k = 0; ok && k <= x->g.ndesc; k++) {
    uint64_t next = k < x->g.ndesc ? order[k]->offset : end;
    uint64_t o = next > at ? at + check_fill(pool_base + at, next - at, poison) : next;
    if (o < next) {
      snprintf(detail, dlen, "pool offset %" PRIu64 " outside the grant is %#x, not poison %#x", o,
               pool_base[o], poison);
      ok = 0;
    }
    if (!ok || k == x->g.ndesc) break;
    const kvf_desc *d = order[k];
    uint64_t i = (uint64_t)(d - x->dst);
    uint64_t bad = check_pattern(pool_base + d->offset, d->len, x->pe->seed, i * x->g.block);
    if (bad < d->len) {
      snprintf(detail, dlen, "descriptor %" PRIu64 " (pool offset %" PRIu64 ") byte %" PRIu64
               " is %#x, expected %#x",
               i, d->offset, bad, pool_base[d->offset + bad], pattern_byte(x->pe->seed, i * x->g.block + bad));
      ok = 0;
    }
    at = d->offset + d->len;
  }
  free(order);
  return ok;
}

/* ------------------------------------------------------------- posting */

static plan_ent *plan; /* global: reachable at any exit (LeakSanitizer) */
static xfer X[MAX_CONC];
static bool slot_dead[MAX_CONC];
static int n_active;
static uint64_t hold_until_ms; /* after a refusal, like an engine, wait before the next */

static void finish_if_done(xfer *x) {
  if (x->need_recv || x->need_send) return;
  /* a daemon that went away took them with it */
  if (x->lay_src) kvf_layout_free(C, x->lay_src);
  if (x->lay_dst) kvf_layout_free(C, x->lay_dst);
  free(x->src);
  free(x->dst);
  free(x->sids);
  free(x->dids);
  x->src = x->dst = NULL;
  x->sids = x->dids = NULL;
  x->active = false;
  n_active--;
}

static unsigned nowait_of(const xfer *x) { return x->g.nowait ? KVF_NOWAIT : 0; }

/* A descriptor grant: kvf_grant has no flags; unanswered it goes as a
 * batch of one. */
static int grant_descs(const xfer *x, const char *from) {
  if (!x->g.nowait) return kvf_grant(C, x->pe->id, from, x->dst, x->g.ndesc, x->pe->deadline_ms);
  kvf_sub sub = {.op = KVF_SUB_GRANT, .xfer_id = x->pe->id, .node = from, .descs = x->dst, .n = x->g.ndesc,
                 .deadline_ms = x->pe->deadline_ms};
  int err = 0, rc = kvf_submit(C, &sub, 1, 0, &err);
  return rc < 0 ? rc : rc == 1 ? 0 : err;
}

/* The part k of parts: descriptors [k*n/parts, (k+1)*n/parts). The first
 * one accepted makes the transfer "posted". */
/* Blocks: part k is layers [k*L/parts, (k+1)*L/parts); the first names
 * the ids. */
static int post_block_part(xfer *x, int k, const char *to) {
  uint64_t a = (uint64_t)k * x->g.layers / (uint64_t)x->g.parts;
  uint64_t b = (uint64_t)(k + 1) * x->g.layers / (uint64_t)x->g.parts;
  kvf_blocks bl = {.layout = x->lay_src, .ids = k ? NULL : x->sids, .n = k ? 0 : x->g.nblocks,
                   .first_layer = (uint32_t)a, .n_layers = (uint32_t)(b - a)};
  return kvf_send_blocks(C, x->pe->id, to, &bl, (k + 1 < x->g.parts ? KVF_SEND_MORE : 0) | nowait_of(x),
                         x->pe->deadline_ms);
}

static int post_part(xfer *x) {
  int k = x->parts_posted, parts = x->g.parts;
  uint64_t a = (uint64_t)k * x->g.ndesc / (uint64_t)parts, b = (uint64_t)(k + 1) * x->g.ndesc / (uint64_t)parts;
  const char *to = O.role == ROLE_LOCAL ? own_node : O.peer;
  int rc = x->g.blocks ? post_block_part(x, k, to)
                       : kvf_send(C, x->pe->id, to, x->src + a, b - a,
                                  (k + 1 < parts ? KVF_SEND_MORE : 0) | nowait_of(x), x->pe->deadline_ms);
  if (rc == 0) {
    x->parts_posted++;
    x->next_part_ms = now_ms() + (uint64_t)x->g.part_gap_ms;
  }
  if (rc == 0 && k == 0) {
    head("posted", x->pe->id);
    printf(", \"side\": \"send\", \"slot\": %d, \"bytes\": %" PRIu64 ", \"descs\": %" PRIu64 ", \"parts\": %d",
           x->slot, x->g.bytes, x->g.ndesc, x->g.parts);
    line_end();
  }
  return rc;
}

static void daemon_gone(void);

/* A request refused: the transfer ends here for that side (the library
 * queues no event for a failed call). A part after the first leaves the
 * send under way in the daemon, whose event still comes. */
static void refused(xfer *x, const char *side, int rc, const char *what) {
  if (rc == KVF_EDAEMON) {
    daemon_gone();
    return;
  }
  if (rc == KVF_ENOENT && !strcmp(side, "send") && x->parts_posted > 0) {
    /* the send this part continues has ended already (its daemon or peer
     * failed it): not an outcome of its own; its SEND_DONE says how */
    x->parts_posted = x->g.parts;
    return;
  }
  outcome(x, side, rc, what, kvf_strerror(rc), -1, NULL, NULL);
  hold_until_ms = now_ms() + 100;
  if (!strcmp(side, "recv")) x->need_recv = false;
  else if (x->parts_posted == 0) x->need_send = false;
  else x->parts_posted = x->g.parts; /* post nothing more; wait for its event */
  finish_if_done(x);
}

static void start(const plan_ent *pe, int slot) {
  xfer *x = &X[slot];
  memset(x, 0, sizeof *x);
  x->pe = pe;
  x->slot = slot;
  x->g = geom_of(pe->seed, O.max_bytes);
  x->t0_ms = now_ms();
  x->active = true;
  n_active++;
  bool recv = O.role != ROLE_SEND, send = O.role != ROLE_RECV;
  x->need_recv = recv;
  x->need_send = send;
  if (send) {
    x->src = malloc(x->g.ndesc * sizeof(kvf_desc));
    int lrc = 0;
    if (x->src && x->g.blocks) {
      lrc = block_side(&x->g, slot_base(slot, false), pe->seed ^ 0x5e11d, x->src, &x->sids, &x->lay_src);
      if (lrc != 0 && lrc != -1) {
        x->need_send = false; /* the daemon took no send */
        refused(x, "send", lrc, "layout");
        if (!x->active) return;
        send = false;
      }
    }
    if (!x->src || lrc == -1 || (!x->g.blocks && layout(x->src, &x->g, slot_base(slot, false), pe->seed ^ 0x5e11d))) {
      fprintf(stderr, "chaos_client: slot too small for %s\n", pe->id);
      exit(2);
    }
    for (uint64_t i = 0; send && i < x->g.ndesc; i++)
      fill_pattern(pool_base + x->src[i].offset, x->src[i].len, pe->seed, i * x->g.block);
  }
  if (recv) {
    x->dst = malloc(x->g.ndesc * sizeof(kvf_desc));
    int lrc = x->dst && x->g.blocks
                  ? block_side(&x->g, slot_base(slot, true), pe->seed ^ 0xdec0de, x->dst, &x->dids, &x->lay_dst)
                  : 0;
    if (!x->dst || lrc == -1 || (!x->g.blocks && layout(x->dst, &x->g, slot_base(slot, true), pe->seed ^ 0xdec0de))) {
      fprintf(stderr, "chaos_client: slot too small for %s\n", pe->id);
      exit(2);
    }
    memset(pool_base + slot_base(slot, true), poison_of(pe->seed), slot_len());
    const char *from = O.role == ROLE_LOCAL ? own_node : x->g.named ? O.peer : NULL;
    kvf_blocks bl = {.layout = x->lay_dst, .ids = x->dids, .n = x->g.nblocks};
    int rc = lrc ? lrc
             : x->g.blocks ? kvf_grant_blocks(C, pe->id, from, &bl,
                                              (x->g.layer_events ? KVF_GRANT_LAYER_EVENTS : 0) | nowait_of(x),
                                              pe->deadline_ms)
                           : grant_descs(x, from);
    if (rc) {
      refused(x, "recv", rc, "grant");
      if (!x->active || O.role != ROLE_LOCAL) return;
      x->need_send = false; /* no grant: the local send is not tried */
      finish_if_done(x);
      return;
    }
  }
  if (recv) {
    head("posted", pe->id);
    printf(", \"side\": \"recv\", \"slot\": %d, \"bytes\": %" PRIu64 ", \"descs\": %" PRIu64 ", \"parts\": %d",
           slot, x->g.bytes, x->g.ndesc, x->g.parts);
    line_end();
  }
  if (send) x->next_part_ms = x->t0_ms + (uint64_t)x->g.send_delay_ms; /* run() posts the parts */
}

static xfer *find(const char *id) {
  for (int i = 0; i < O.conc; i++)
    if (X[i].active && !strcmp(X[i].pe->id, id)) return &X[i];
  return NULL;
}

/* LAYER_DONE: one per layer, in order, only for grants that asked. */
static void on_layer(xfer *x, const kvf_event *ev) {
  if (x && x->need_recv && x->g.layer_events && ev->status == 0 && ev->layer == x->layers_seen) {
    x->layers_seen++;
    return;
  }
  head("stray", ev->xfer_id);
  printf(", \"type\": %d, \"layer\": %u, \"expected_layer\": %" PRIu64 "", ev->type, ev->layer,
         x ? x->layers_seen : 0);
  line_end();
}

static void on_event(const kvf_event *ev) {
  xfer *x = find(ev->xfer_id);
  if (ev->type == KVF_EV_LAYER_DONE) {
    on_layer(x, ev);
    return;
  }
  bool is_recv = ev->type == KVF_EV_RECV_DONE;
  if (!x || (is_recv ? !x->need_recv : !x->need_send)) {
    head("stray", ev->xfer_id);
    printf(", \"type\": %d, \"status\": \"%s\", \"error\": ", ev->type, kvf_err_name(ev->status));
    json_str(ev->error);
    line_end();
    return;
  }
  if (is_recv) {
    char detail[256] = "";
    int verified = -1;
    if (ev->status == 0) verified = verify_slot(x, detail, sizeof detail);
    if (ev->status == 0 && x->g.layer_events && x->layers_seen != x->g.layers) {
      snprintf(detail, sizeof detail, "RECV_DONE after %" PRIu64 " of %" PRIu64 " layer events", x->layers_seen,
               x->g.layers);
      verified = 0;
    }
    if (ev->status == 0 && ev->bytes != x->g.bytes) {
      snprintf(detail, sizeof detail, "event says %" PRIu64 " bytes, the grant has %" PRIu64, ev->bytes,
               x->g.bytes);
      verified = 0;
    }
    outcome(x, "recv", ev->status, "event", ev->error, verified, detail[0] ? detail : NULL, ev->path);
    x->need_recv = false;
  } else {
    outcome(x, "send", ev->status, "event", ev->error, -1, NULL, ev->path);
    x->need_send = false;
    x->parts_posted = x->g.parts; /* a failed send takes no more parts */
  }
  finish_if_done(x);
}

/* The daemon is gone: every transfer under way ends with KVF_EDAEMON. */
static void daemon_gone(void) {
  for (int i = 0; i < O.conc; i++) {
    xfer *x = &X[i];
    if (!x->active) continue;
    if (x->need_recv) outcome(x, "recv", KVF_EDAEMON, "daemon", "the daemon went away", -1, NULL, NULL);
    if (x->need_send) outcome(x, "send", KVF_EDAEMON, "daemon", "the daemon went away", -1, NULL, NULL);
    x->need_recv = x->need_send = false;
    finish_if_done(x);
  }
  printf("{\"exit\": \"daemon gone\", \"tag\": ");
  json_str(O.tag);
  line_end();
  kvf_close(C);
  exit(0);
}

/* Past deadline + hung_ms with no outcome: reported, slot retired. */
static void check_hung(void) {
  uint64_t t = now_ms();
  for (int i = 0; i < O.conc; i++) {
    xfer *x = &X[i];
    if (!x->active || t - x->t0_ms <= (uint64_t)x->pe->deadline_ms + (uint64_t)O.hung_ms) continue;
    if (x->need_recv) outcome(x, "recv", 1, "hung", "no outcome by deadline + margin", -1, NULL, NULL);
    if (x->need_send) outcome(x, "send", 1, "hung", "no outcome by deadline + margin", -1, NULL, NULL);
    x->need_recv = x->need_send = false;
    slot_dead[i] = true;
    finish_if_done(x);
  }
}

static int free_slot(void) {
  for (int i = 0; i < O.conc; i++)
    if (!X[i].active && !slot_dead[i]) return i;
  return -1;
}

/* The plan index to stop before, from PLAN.limit (SIGUSR2). */
static size_t read_limit(size_t n) {
  char path[4096];
  snprintf(path, sizeof path, "%s.limit", O.plan);
  FILE *f = fopen(path, "r");
  unsigned long long v = n;
  if (!f || fscanf(f, "%llu", &v) != 1) fprintf(stderr, "chaos_client: no limit in %s\n", path);
  if (f) fclose(f);
  return v < n ? (size_t)v : n;
}

static void run(size_t n) {
  size_t next = 0, limit = n;
  bool paused = false;
  kvf_event evs[32];
  for (;;) {
    int s;
    if (usr1 && !paused && limit == n) {
      paused = true;
      printf("{\"paused\": %zu, \"tag\": ", next);
      json_str(O.tag);
      line_end();
    }
    if (usr2 && paused) {
      paused = false;
      limit = read_limit(n);
      for (int i = 0; i < O.conc; i++) {
        xfer *x = &X[i];
        if (!x->active || (size_t)(x->pe - plan) < limit) continue;
        bool unsent = x->parts_posted == 0;
        x->withdrawn = true;
        x->parts_posted = x->g.parts; /* no more parts */
        int rc = kvf_cancel(C, x->pe->id);
        if (rc == KVF_EDAEMON) daemon_gone();
        if (unsent && x->need_send) { /* the daemon never had the send */
          x->need_send = false;
          finish_if_done(x);
        }
      }
    }
    while (!paused && next < limit && now_ms() >= hold_until_ms && (s = free_slot()) >= 0)
      start(&plan[next++], s);
    if (!paused && (next >= limit || free_slot() < 0) && n_active == 0) return;
    uint64_t t = now_ms();
    int wait = 50;
    for (int i = 0; i < O.conc; i++) {
      xfer *x = &X[i];
      if (!x->active || !x->need_send || x->parts_posted >= x->g.parts) continue;
      /* Events first: a send that already failed takes no more parts. */
      if (x->parts_posted > 0 && kvf_wait_events(C, evs, 1, 0) == 1) {
        on_event(&evs[0]);
        if (!x->active || !x->need_send) continue;
      }
      if (x->next_part_ms <= t) {
        int rc = post_part(x);
        if (rc) refused(x, "send", rc, x->parts_posted ? "send part" : "send");
      } else if ((int)(x->next_part_ms - t) < wait) {
        wait = (int)(x->next_part_ms - t);
      }
    }
    int got = kvf_wait_events(C, evs, sizeof evs / sizeof evs[0], wait);
    if (got == KVF_EDAEMON) daemon_gone();
    if (got < 0) {
      fprintf(stderr, "chaos_client: kvf_wait_events: %s\n", kvf_err_name(got));
      exit(2);
    }
    for (int i = 0; i < got; i++) on_event(&evs[i]);
    check_hung();
  }
}

/* ------------------------------------------------------------- setup */

static size_t read_plan(const char *path, plan_ent **out) {
  FILE *f = fopen(path, "r");
  if (!f) {
    perror(path);
    exit(2);
  }
  size_t n = 0, cap = 64;
  plan_ent *p = malloc(cap * sizeof *p);
  char line[512];
  while (p && fgets(line, sizeof line, f)) {
    if (n == cap) p = realloc(p, (cap *= 2) * sizeof *p);
    if (!p) break;
    if (sscanf(line, "%127s %" SCNu64 " %" SCNu32, p[n].id, &p[n].seed, &p[n].deadline_ms) == 3) n++;
  }
  fclose(f);
  if (!p) exit(2);
  *out = p;
  return n;
}

static uint64_t parse_u64(const char *s) { return strtoull(s, NULL, 0); }

static void usage(void) {
  fprintf(stderr, "usage: chaos_client --sock PATH --role recv|send|local --peer NODE --plan FILE\n"
                  "         --region OFF:LEN [--pool kv] [--tag T] [--conc N] [--max-bytes N] [--hung-ms N]\n");
  exit(2);
}

static void parse_args(int argc, char **argv) {
  O = (opts){.pool = "kv", .tag = "chaos", .conc = 3, .max_bytes = 4u << 20, .hung_ms = 3000, .role = -1};
  for (int i = 1; i + 1 < argc; i += 2) {
    const char *k = argv[i], *v = argv[i + 1];
    if (!strcmp(k, "--sock")) O.sock = v;
    else if (!strcmp(k, "--peer")) O.peer = v;
    else if (!strcmp(k, "--pool")) O.pool = v;
    else if (!strcmp(k, "--plan")) O.plan = v;
    else if (!strcmp(k, "--tag")) O.tag = v;
    else if (!strcmp(k, "--conc")) O.conc = atoi(v);
    else if (!strcmp(k, "--max-bytes")) O.max_bytes = parse_u64(v);
    else if (!strcmp(k, "--hung-ms")) O.hung_ms = atoi(v);
    else if (!strcmp(k, "--region")) {
      char *colon = strchr(v, ':');
      if (!colon) usage();
      O.region_off = parse_u64(v);
      O.region_len = parse_u64(colon + 1);
    } else if (!strcmp(k, "--role")) {
      O.role = !strcmp(v, "recv") ? ROLE_RECV : !strcmp(v, "send") ? ROLE_SEND : !strcmp(v, "local") ? ROLE_LOCAL : -2;
    } else usage();
  }
  if (!O.sock || !O.plan || O.role < 0 || (O.role != ROLE_LOCAL && !O.peer) || O.conc < 1 ||
      O.conc > MAX_CONC || !O.region_len)
    usage();
}

int main(int argc, char **argv) {
  parse_args(argc, argv);
  signal(SIGUSR1, on_usr);
  signal(SIGUSR2, on_usr);
  size_t n = read_plan(O.plan, &plan);
  kvf_pool_info pi;
  void *addr;
  uint64_t size;
  int rc = kvf_connect(O.sock, &C);
  if (rc == 0) rc = kvf_pool_find(C, O.pool, &pi);
  if (rc == 0) rc = kvf_pool_map(C, pi.id, &addr, &size);
  if (rc) {
    printf("{\"setup_error\": \"%s\", \"tag\": ", kvf_err_name(rc));
    json_str(O.tag);
    line_end();
    return 3;
  }
  if (O.region_off + O.region_len > size) {
    fprintf(stderr, "chaos_client: region past the pool's %" PRIu64 " bytes\n", size);
    return 2;
  }
  pool_base = addr;
  pool_id = pi.id;
  own_node = kvf_node(C);
  printf("{\"ready\": true, \"tag\": ");
  json_str(O.tag);
  printf(", \"pid\": %d, \"plan\": %zu}\n", (int)getpid(), n);
  fflush(stdout);
  run(n);
  printf("{\"exit\": \"done\", \"tag\": ");
  json_str(O.tag);
  line_end();
  kvf_close(C);
  free(plan);
  return 0;
}
