/* gen_corpus.c - writes the fuzz targets' seed inputs from the current wire
 * format: gen_corpus DIR writes DIR/fuzz_api, DIR/fuzz_peer and
 * DIR/fuzz_config. `make fuzz` runs it into $(BUILD)/fuzz/seeds each time (so
 * the seeds follow proto/kvferry.proto); `make fuzz-corpus` writes
 * tests/fuzz/corpus, the committed copy, which also keeps the regression
 * inputs (crash-*, named after the bug) that no generator makes.
 *
 * The fixtures refer to the fuzz scenario (fuzz_common.h, fuzz_peer.c):
 * node A with pools 0 (64 KiB) and 1 (256 KiB), peers B and C; in
 * fuzz_peer, our grants g1..g3, l1 are handles 1..4 and B's messages act on
 * our sends s1, s2 (more parts to come) and s3 (to C). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config.h"
#include "desc.h"
#include "frame.h"
#include "kvferry.pb-c.h"
#include "kvferryd.h"

typedef struct buf {
  uint8_t *p;
  size_t n, cap;
} buf;

static void put(buf *b, const void *d, size_t n) {
  if (b->n + n > b->cap) {
    b->cap = (b->n + n) * 2 + 256;
    b->p = realloc(b->p, b->cap);
    if (!b->p) abort();
  }
  memcpy(b->p + b->n, d, n);
  b->n += n;
}

static void put_s(buf *b, const char *s) { put(b, s, strlen(s)); }

static const char *root;

static void out(const char *target, const char *name, buf *b) {
  char path[512];
  snprintf(path, sizeof(path), "%s/%s", root, target);
  mkdir(path, 0755);
  snprintf(path, sizeof(path), "%s/%s/%s", root, target, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(b->p ? (void *)b->p : (void *)"", 1, b->n, f) != b->n || fclose(f) != 0) {
    fprintf(stderr, "gen_corpus: %s: %s\n", path, strerror(errno));
    exit(1);
  }
  free(b->p);
  memset(b, 0, sizeof(*b));
}

static void frame(buf *b, const uint8_t *payload, size_t n) {
  uint8_t hdr[KVF__FRAME_HDR];
  kvf__frame_put_header(hdr, (uint32_t)n);
  put(b, hdr, sizeof(hdr));
  put(b, payload, n);
}

/* DescList.packed from (pool, offset, length) triples. */
typedef struct { uint64_t t[3]; } desc;
static Kvf__DescList *dl(Kvf__DescList *w, uint8_t *space, const desc *d, size_t n) {
  kvf__desc_list__init(w);
  for (size_t i = 0; i < n; i++) {
    uint8_t *r = space + i * KVF__DESC_WIRE_SIZE;
    for (int k = 0; k < 4; k++) r[k] = (uint8_t)(d[i].t[0] >> (8 * k));
    for (int k = 0; k < 8; k++) r[4 + k] = (uint8_t)(d[i].t[1] >> (8 * k));
    for (int k = 0; k < 8; k++) r[12 + k] = (uint8_t)(d[i].t[2] >> (8 * k));
  }
  w->packed.data = space;
  w->packed.len = n * KVF__DESC_WIRE_SIZE;
  return w;
}

#define D(...) ((const desc[]){__VA_ARGS__}), (sizeof((const desc[]){__VA_ARGS__}) / sizeof(desc))

/* ------------------------------------------------------------------ API */

static void api(buf *b, Kvf__ApiRequest *q) {
  size_t n = kvf__api_request__get_packed_size(q);
  uint8_t *p = malloc(n + 1);
  kvf__api_request__pack(q, p);
  frame(b, p, n);
  free(p);
}

static uint64_t seq;

/* One request of body CASE (field = body) into b, with the next seq. */
#define API_REQ(b, CASE, field, body)                   \
  do {                                                  \
    Kvf__ApiRequest q_ = KVF__API_REQUEST__INIT;        \
    q_.seq = ++seq;                                     \
    q_.body_case = KVF__API_REQUEST__BODY_##CASE;       \
    q_.field = (body);                                  \
    api(b, &q_);                                        \
  } while (0)

static void a_hello(buf *b, uint32_t version) {
  Kvf__HelloReq h = KVF__HELLO_REQ__INIT;
  h.version = version;
  h.client_name = "fuzz-seed";
  API_REQ(b, HELLO, hello, &h);
}

static void a_pools(buf *b) {
  Kvf__PoolsReq r = KVF__POOLS_REQ__INIT;
  API_REQ(b, POOLS, pools, &r);
}

static void a_map(buf *b, uint32_t pool) {
  Kvf__MapReq r = KVF__MAP_REQ__INIT;
  r.pool = pool;
  API_REQ(b, MAP, map, &r);
}

static void a_grant_w(buf *b, const char *id, const char *src, Kvf__DescList *w, uint32_t deadline) {
  Kvf__GrantReq g = KVF__GRANT_REQ__INIT;
  g.xfer_id = (char *)id;
  g.src_node = (char *)src;
  g.descs = w;
  g.deadline_ms = deadline;
  API_REQ(b, GRANT, grant, &g);
}

static void a_grant(buf *b, const char *id, const char *src, const desc *d, size_t n) {
  uint8_t space[128 * KVF__DESC_WIRE_SIZE];
  Kvf__DescList w;
  a_grant_w(b, id, src, dl(&w, space, d, n), 0);
}

/* more: 1 more parts follow; 2 also a frame of the same call (chained). */
static void a_send_w(buf *b, const char *id, const char *dst, Kvf__DescList *w, int more) {
  Kvf__SendReq s = KVF__SEND_REQ__INIT;
  s.xfer_id = (char *)id;
  s.dst_node = (char *)dst;
  s.descs = w;
  s.more = more != 0;
  s.chained = more == 2;
  API_REQ(b, SEND, send, &s);
}

static void a_send(buf *b, const char *id, const char *dst, int more, const desc *d, size_t n) {
  uint8_t space[128 * KVF__DESC_WIRE_SIZE];
  Kvf__DescList w;
  a_send_w(b, id, dst, dl(&w, space, d, n), more);
}

static void a_cancel(buf *b, const char *id) {
  Kvf__CancelReq c = KVF__CANCEL_REQ__INIT;
  c.xfer_id = (char *)id;
  API_REQ(b, CANCEL, cancel, &c);
}

static void a_inspect(buf *b, int what, bool json) {
  Kvf__InspectReq r = KVF__INSPECT_REQ__INIT;
  r.what = what;
  r.json = json;
  API_REQ(b, INSPECT, inspect, &r);
}

/* A small KV layout in pool 1: layers x 2 regions of 4 blocks of 4 KiB,
 * region after region (offsets in space, 8 bytes each). */
static Kvf__Layout *lay(Kvf__Layout *l, uint8_t *space, uint32_t layers, uint64_t base) {
  kvf__layout__init(l);
  l->pool = 1;
  l->n_layers = layers;
  l->n_kv = 2;
  l->n_blocks = 4;
  l->block_bytes = 4096;
  l->block_stride = 4096;
  for (uint32_t r = 0; r < layers * 2; r++)
    for (int k = 0; k < 8; k++) space[r * 8 + k] = (uint8_t)((base + (uint64_t)r * 4 * 4096) >> (8 * k));
  l->offsets = (ProtobufCBinaryData){layers * 2 * 8, space};
  l->tokens_per_block = 16;
  l->dtype_bytes = 2;
  return l;
}

static void a_layout(buf *b, uint32_t layers, uint64_t base) {
  uint8_t space[64 * 16];
  Kvf__Layout l;
  Kvf__LayoutReq r = KVF__LAYOUT_REQ__INIT;
  r.layout = lay(&l, space, layers, base);
  API_REQ(b, LAYOUT, layout, &r);
}

static void a_layout_free(buf *b, uint32_t id) {
  Kvf__LayoutFreeReq r = KVF__LAYOUT_FREE_REQ__INIT;
  r.id = id;
  API_REQ(b, LAYOUT_FREE, layout_free, &r);
}

/* Engine memory: the fuzzer's sessions are detached (no socket), so no
 * fd ever comes: has_fd requests are refused, cuda ones find garbage
 * handles (or no CUDA). Both must be answered, nothing kept. */
static void a_mem_register(buf *b, const char *name, const char *kind, uint64_t size, bool has_fd, size_t ipc_len) {
  uint8_t handle[64] = {0};
  Kvf__MemRegisterReq r = KVF__MEM_REGISTER_REQ__INIT;
  r.name = (char *)name;
  r.kind = (char *)kind;
  r.size = size;
  r.has_fd = has_fd;
  r.cuda_ipc_handle = (ProtobufCBinaryData){ipc_len, handle};
  r.alloc_size = size;
  API_REQ(b, MEM_REGISTER, mem_register, &r);
}

static void a_mem_unregister(buf *b, uint32_t pool) {
  Kvf__MemUnregisterReq r = KVF__MEM_UNREGISTER_REQ__INIT;
  r.pool = pool;
  API_REQ(b, MEM_UNREGISTER, mem_unregister, &r);
}

/* ids: a string of small block ids ("0123": blocks 0, 1, 2, 3). */
static Kvf__BlockList *blist(Kvf__BlockList *w, uint8_t *space, uint32_t layout, const char *ids, uint32_t first,
                             uint32_t n) {
  kvf__block_list__init(w);
  size_t k = strlen(ids);
  for (size_t i = 0; i < k; i++) {
    memset(space + 4 * i, 0, 4);
    space[4 * i] = (uint8_t)(ids[i] - '0');
  }
  w->layout = layout;
  w->ids = (ProtobufCBinaryData){4 * k, space};
  w->first_layer = first;
  w->n_layers = n;
  return w;
}

static void a_grant_blocks(buf *b, const char *id, const char *src, uint32_t layout, const char *ids, bool events) {
  uint8_t space[256];
  Kvf__BlockList w;
  Kvf__GrantReq g = KVF__GRANT_REQ__INIT;
  g.xfer_id = (char *)id;
  g.src_node = (char *)src;
  g.blocks = blist(&w, space, layout, ids, 0, 0);
  g.layer_events = events;
  API_REQ(b, GRANT, grant, &g);
}

/* how: SB_MORE, SB_CONTINUES, SB_NOWAIT (no_reply) */
enum { SB_MORE = 1, SB_CONTINUES = 2, SB_NOWAIT = 4 };
static void a_send_blocks(buf *b, const char *id, const char *dst, uint32_t layout, const char *ids, uint32_t first,
                          uint32_t n, int how) {
  uint8_t space[256];
  Kvf__BlockList w;
  Kvf__SendReq s = KVF__SEND_REQ__INIT;
  s.xfer_id = (char *)id;
  s.dst_node = (char *)dst;
  s.blocks = blist(&w, space, layout, ids, first, n);
  s.more = (how & SB_MORE) != 0;
  s.continues = (how & SB_CONTINUES) != 0;
  s.no_reply = (how & SB_NOWAIT) != 0;
  API_REQ(b, SEND, send, &s);
}

static void api_mem_seeds(const char *T) {
  buf b = {0};
  a_hello(&b, KVF__API_VERSION);
  a_mem_register(&b, "eng0", "host", 1 << 20, true, 0);
  a_mem_register(&b, "eng1", "host", 1 << 20, false, 0);
  a_mem_register(&b, "eng2", "cuda:0", 1 << 20, false, 64);
  a_mem_register(&b, "eng3", "cuda:99", 0, true, 3);
  a_mem_unregister(&b, 2);
  a_mem_unregister(&b, 0);
  a_grant(&b, "m1", "", D({{2, 0, 4096}}));
  out(T, "mem-register", &b);
}

static void api_block_seeds(const char *T) {
  buf b = {0};
  /* layouts 1 and 2; a local handoff by blocks in two layer parts */
  a_hello(&b, KVF__API_VERSION);
  a_layout(&b, 4, 0);
  a_layout(&b, 4, 131072);
  a_grant_blocks(&b, "k1", "", 1, "0213", true);
  a_send_blocks(&b, "k1", "A", 2, "3120", 0, 1, SB_MORE);
  a_send_blocks(&b, "k1", "A", 2, "", 1, 1, SB_MORE | SB_CONTINUES | SB_NOWAIT);
  a_send_blocks(&b, "k1", "A", 2, "", 2, 2, SB_CONTINUES);
  a_inspect(&b, KVF__INSPECT_WHAT__INSPECT_LAYOUTS, true);
  a_layout_free(&b, 1);
  a_layout_free(&b, 1);
  out(T, "blocks-local", &b);

  /* to peer B, send first; a part after a cancel */
  a_hello(&b, KVF__API_VERSION);
  a_layout(&b, 2, 0);
  a_send_blocks(&b, "k2", "B", 1, "01", 0, 1, SB_MORE);
  a_cancel(&b, "k2");
  a_send_blocks(&b, "k2", "B", 1, "", 1, 1, SB_CONTINUES | SB_NOWAIT);
  a_grant_blocks(&b, "k3", "B", 1, "23", false);
  out(T, "blocks-remote", &b);

  /* errors: unknown layout, ids and layers outside it, a layout leaving
   * the pool, overlapping regions, blocks and descriptors mixed */
  a_hello(&b, KVF__API_VERSION);
  a_grant_blocks(&b, "k4", "", 9, "0", false);
  a_layout(&b, 4, 200000);
  a_layout(&b, 1, 0);
  a_grant_blocks(&b, "k4", "", 1, "9", false);
  a_send_blocks(&b, "k4", "A", 1, "0", 1, 3, 0);
  a_grant(&b, "k5", "", D({{1, 0, 4096}}));
  a_send_blocks(&b, "k5", "A", 1, "0", 0, 0, 0);
  out(T, "blocks-errors", &b);
}

/* Unanswered requests (KVF_NOWAIT, kvf_submit): a grant, a send's first
 * and later parts and a cancel with no_reply, back to back as one
 * kvf_submit writes them; refusals become events. */
static void a_nowait_grant(buf *b, const char *id, const char *src, const desc *d, size_t n) {
  uint8_t space[16 * KVF__DESC_WIRE_SIZE];
  Kvf__DescList w;
  Kvf__GrantReq g = KVF__GRANT_REQ__INIT;
  g.xfer_id = (char *)id;
  g.src_node = (char *)src;
  g.descs = dl(&w, space, d, n);
  g.no_reply = true;
  API_REQ(b, GRANT, grant, &g);
}

static void a_nowait_send(buf *b, const char *id, const char *dst, bool more, bool continues, const desc *d,
                          size_t n) {
  uint8_t space[16 * KVF__DESC_WIRE_SIZE];
  Kvf__DescList w;
  Kvf__SendReq s = KVF__SEND_REQ__INIT;
  s.xfer_id = (char *)id;
  s.dst_node = (char *)dst;
  s.descs = dl(&w, space, d, n);
  s.more = more;
  s.continues = continues;
  s.no_reply = true;
  API_REQ(b, SEND, send, &s);
}

static void a_nowait_cancel(buf *b, const char *id) {
  Kvf__CancelReq c = KVF__CANCEL_REQ__INIT;
  c.xfer_id = (char *)id;
  c.no_reply = true;
  API_REQ(b, CANCEL, cancel, &c);
}

static void api_nowait_seeds(const char *T) {
  buf b = {0};
  /* a local handoff in two parts, all unanswered */
  a_hello(&b, KVF__API_VERSION);
  a_nowait_grant(&b, "n1", "A", D({{1, 0, 4096}}, {{1, 8192, 4096}}));
  a_nowait_send(&b, "n1", "A", true, false, D({{1, 65536, 4096}}));
  a_nowait_send(&b, "n1", "A", false, true, D({{1, 69632, 4096}}));
  a_nowait_cancel(&b, "n1");
  out(T, "nowait-local", &b);

  /* refusals as events: an unknown peer, an id granted twice, no such
   * pool, parts after a refused first part, a cancel of nothing */
  a_hello(&b, KVF__API_VERSION);
  a_nowait_send(&b, "n2", "C", true, false, D({{1, 0, 4096}}));
  a_nowait_send(&b, "n2", "C", false, true, D({{1, 4096, 4096}}));
  a_nowait_grant(&b, "n3", "B", D({{1, 0, 4096}}));
  a_nowait_grant(&b, "n3", "B", D({{1, 4096, 4096}}));
  a_nowait_grant(&b, "n4", "", D({{77, 0, 4096}}));
  a_nowait_cancel(&b, "n5");
  a_nowait_send(&b, "n6", "B", false, false, D({{1, 0, 4096}}));
  out(T, "nowait-refusals", &b);
}

static void api_seeds(void) {
  buf b = {0};
  const char *T = "fuzz_api";

  a_hello(&b, KVF__API_VERSION);
  out(T, "hello", &b);

  a_hello(&b, KVF__API_VERSION);
  a_pools(&b);
  a_map(&b, 0);
  a_map(&b, 1);
  a_map(&b, 7);
  out(T, "pools-map", &b);

  a_hello(&b, KVF__API_VERSION);
  a_grant(&b, "t1", "", D({{0, 0, 4096}}, {{0, 8192, 4096}}));
  a_send(&b, "t1", "A", false, D({{1, 0, 4096}}, {{1, 4096, 4096}}));
  out(T, "local-transfer", &b);

  a_hello(&b, KVF__API_VERSION);
  a_send(&b, "t2", "A", true, D({{1, 0, 1000}}));
  a_grant(&b, "t2", "A", D({{0, 0, 1000}}, {{0, 4096, 2000}}, {{0, 8192, 3000}}));
  a_send(&b, "t2", "A", true, D({{1, 1000, 2000}}));
  a_send(&b, "t2", "A", false, D({{1, 3000, 3000}}));
  out(T, "local-parts", &b);

  /* Calls that come as chained frames: whole, refused in a later frame,
   * and one whose frames change the transfer id. */
  a_hello(&b, KVF__API_VERSION);
  a_grant(&b, "k1", "", D({{0, 0, 4096}}, {{0, 8192, 4096}}, {{0, 16384, 100}}));
  a_send(&b, "k1", "A", 2, D({{1, 0, 4096}}));
  a_send(&b, "k1", "A", 2, D({{1, 4096, 4096}}));
  a_send(&b, "k1", "A", false, D({{1, 12288, 100}}));
  a_grant(&b, "k2", "B", D({{0, 32768, 8192}}));
  a_send(&b, "k2", "B", 2, D({{1, 0, 4096}}));
  a_send(&b, "k2", "B", 2, D({{9, 0, 4096}}));
  a_send(&b, "k2", "B", false, D({{1, 8192, 4096}}));
  a_send(&b, "k3", "A", 2, D({{1, 0, 4096}}));
  a_send(&b, "k4", "A", false, D({{1, 4096, 4096}}));
  out(T, "chained-sends", &b);

  a_hello(&b, KVF__API_VERSION);
  a_grant(&b, "ov", "", D({{0, 0, 8192}}));
  a_send(&b, "ov", "A", false, D({{0, 4096, 8192}}));
  out(T, "local-overlap", &b);

  a_hello(&b, KVF__API_VERSION);
  a_grant(&b, "r1", "B", D({{1, 0, 65536}}));
  a_send(&b, "r2", "B", true, D({{1, 65536, 4096}}));
  a_send(&b, "r2", "B", false, D({{1, 69632, 4096}}));
  a_grant(&b, "r3", "C", D({{0, 0, 4096}}));
  a_send(&b, "r4", "C", false, D({{0, 0, 4096}}));
  a_send(&b, "r5", "Z", false, D({{0, 0, 4096}}));
  a_grant(&b, "r6", "Z", D({{0, 0, 4096}}));
  out(T, "remote", &b);

  a_hello(&b, KVF__API_VERSION);
  a_grant(&b, "c1", "", D({{0, 0, 4096}}));
  a_send(&b, "c2", "B", true, D({{0, 0, 4096}}));
  a_cancel(&b, "c1");
  a_cancel(&b, "c1");
  a_cancel(&b, "c2");
  a_cancel(&b, "none");
  a_cancel(&b, "");
  out(T, "cancel", &b);

  a_hello(&b, KVF__API_VERSION);
  a_grant(&b, "i1", "B", D({{0, 0, 4096}}));
  a_send(&b, "i2", "B", true, D({{0, 0, 4096}}));
  for (int w = 0; w < 5; w++) {
    a_inspect(&b, w, false);
    a_inspect(&b, w, true);
  }
  out(T, "inspect", &b);

  /* Descriptor lists the daemon must refuse, one request each. */
  a_hello(&b, KVF__API_VERSION);
  {
    uint8_t junk[41] = {0};
    Kvf__DescList w = KVF__DESC_LIST__INIT;
    w.packed.data = junk;
    w.packed.len = 41; /* not whole records */
    a_grant_w(&b, "e1", "", &w, 0);
    w.packed.len = 0; /* empty */
    a_grant_w(&b, "e2", "", &w, 0);
    a_grant_w(&b, "e3", "", NULL, 0); /* none */
  }
  a_grant(&b, "e4", "", D({{0, 0, 0}}));                                /* zero length */
  a_grant(&b, "e5", "", D({{9, 0, 4096}}));                             /* no such pool */
  a_grant(&b, "e6", "", D({{0, 61440, 8192}}));                         /* past the end */
  a_grant(&b, "e7", "", D({{0, UINT64_MAX - 10, 100}}));                /* offset + length wraps */
  a_grant(&b, "e8", "", D({{0, 0, UINT64_MAX}}, {{0, 0, 2}}));          /* total wraps */
  a_send(&b, "e9", "A", false, D({{1, 262144, 1}}));                    /* one past the end */
  {
    desc many[65];
    for (int i = 0; i < 65; i++) many[i] = (desc){{0, (uint64_t)i * 64, 64}};
    a_grant(&b, "e10", "", many, 65); /* max-descs + 1 */
    a_grant(&b, "e11", "", many, 64); /* exactly max-descs */
  }
  a_grant(&b, "", "", D({{0, 0, 4096}}));          /* empty id */
  a_grant(&b, "ctl\x01", "", D({{0, 0, 4096}}));   /* control character */
  a_grant(&b, "x-0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789"
              "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789"
              "0123456789012345678901234567890123456789012345678901234567890123456789",
          "", D({{0, 0, 4096}})); /* longer than KVF_XFER_ID_MAX */
  a_grant(&b, "dup", "", D({{0, 0, 4096}}));
  a_grant(&b, "dup", "", D({{0, 4096, 4096}}));
  a_send(&b, "dup", "A", false, D({{1, 0, 4000}})); /* sizes differ */
  a_send(&b, "s", "", false, D({{1, 0, 4000}}));    /* no destination */
  out(T, "bad-requests", &b);

  a_hello(&b, KVF__API_VERSION);
  for (int i = 0; i < 18; i++) {
    char id[16];
    snprintf(id, sizeof(id), "q%d", i);
    a_grant(&b, id, "", D({{0, (uint64_t)i * 4096, 4096}}));
  }
  out(T, "quota", &b);

  a_pools(&b);
  a_hello(&b, KVF__API_VERSION);
  out(T, "no-hello", &b);

  a_hello(&b, KVF__API_VERSION);
  a_hello(&b, KVF__API_VERSION);
  a_pools(&b);
  out(T, "hello-twice", &b);

  a_hello(&b, 99);
  a_pools(&b);
  out(T, "bad-version", &b);

  a_hello(&b, KVF__API_VERSION);
  put(&b, "\xff\xff\xff\x7f", 4); /* past max-frame */
  out(T, "oversized-frame", &b);

  a_hello(&b, KVF__API_VERSION);
  put(&b, "\x06\x00\x00\x00\xff\xff\xff\xff\xff\xff", 10); /* undecodable */
  out(T, "undecodable", &b);

  a_hello(&b, KVF__API_VERSION);
  put(&b, "\x00\x00\x00\x00", 4); /* an empty request */
  put(&b, "\x02\x00\x00\x00\x08\x07", 6); /* seq only */
  out(T, "empty-requests", &b);

  api_block_seeds(T);
  api_mem_seeds(T);
  api_nowait_seeds(T);
}

/* ------------------------------------------------------------------ peer */

static void peer(buf *b, Kvf__PeerMsg *m) {
  size_t n = kvf__peer_msg__get_packed_size(m);
  uint8_t *p = malloc(n + 1);
  kvf__peer_msg__pack(m, p);
  frame(b, p, n);
  free(p);
}

/* One peer message of body CASE (field = body) into b. */
#define PEER_MSG(b, CASE, field, body)              \
  do {                                              \
    Kvf__PeerMsg m_ = KVF__PEER_MSG__INIT;          \
    m_.body_case = KVF__PEER_MSG__BODY_##CASE;      \
    m_.field = (body);                              \
    peer(b, &m_);                                   \
  } while (0)

static void p_grant(buf *b, const char *id, uint64_t handle, const desc *d, size_t n) {
  uint8_t space[128 * KVF__DESC_WIRE_SIZE];
  Kvf__DescList w;
  Kvf__Grant g = KVF__GRANT__INIT;
  g.xfer_id = (char *)id;
  g.handle = handle;
  g.descs = dl(&w, space, d, n);
  g.deadline_ms = 5000;
  PEER_MSG(b, GRANT, grant, &g);
}

/* A Grant of blocks: the receiver's view (layers x 2 regions of 4 blocks
 * from base in pool 1) and ids as in blist. */
static void p_grant_blocks(buf *b, const char *id, uint64_t handle, uint32_t layers, uint64_t base, const char *ids,
                           bool events) {
  uint8_t space[64 * 16], idspace[256];
  Kvf__Layout l;
  Kvf__BlockList w;
  Kvf__Grant g = KVF__GRANT__INIT;
  g.xfer_id = (char *)id;
  g.handle = handle;
  g.layout = lay(&l, space, layers, base);
  g.block_ids = blist(&w, idspace, 0, ids, 0, 0)->ids;
  g.layer_events = events;
  g.deadline_ms = 5000;
  PEER_MSG(b, GRANT, grant, &g);
}

static void p_layers_done(buf *b, uint64_t handle, uint32_t first, uint32_t n) {
  Kvf__LayersDone d = KVF__LAYERS_DONE__INIT;
  d.handle = handle;
  d.first_layer = first;
  d.n_layers = n;
  PEER_MSG(b, LAYERS_DONE, layers_done, &d);
}

static void p_intent(buf *b, const char *id) {
  Kvf__SendIntent s = KVF__SEND_INTENT__INIT;
  s.xfer_id = (char *)id;
  s.deadline_ms = 5000;
  PEER_MSG(b, SEND_INTENT, send_intent, &s);
}

static void p_done(buf *b, uint64_t handle, uint64_t bytes, uint64_t descs) {
  Kvf__SendDone d = KVF__SEND_DONE__INIT;
  d.handle = handle;
  d.bytes = bytes;
  d.descriptors = descs;
  PEER_MSG(b, SEND_DONE, send_done, &d);
}

static void p_result(buf *b, uint64_t handle, int status, const char *err) {
  Kvf__RecvResult r = KVF__RECV_RESULT__INIT;
  r.handle = handle;
  r.status = status;
  r.error = (char *)err;
  PEER_MSG(b, RECV_RESULT, recv_result, &r);
}

static void p_cancel_ex(buf *b, uint64_t handle, const char *id, int status, bool to_sender, bool ack) {
  Kvf__Cancel c = KVF__CANCEL__INIT;
  c.handle = handle;
  c.xfer_id = (char *)id;
  c.status = status;
  c.error = "seed";
  c.to_sender = to_sender;
  c.ack = ack;
  PEER_MSG(b, CANCEL, cancel, &c);
}

static void p_cancel(buf *b, uint64_t handle, const char *id, int status, bool to_sender) {
  p_cancel_ex(b, handle, id, status, to_sender, false);
}

/* A Cancel to our sending side that asks for a CancelDone. */
static void p_cancel_ack(buf *b, uint64_t handle, const char *id) { p_cancel_ex(b, handle, id, 0, true, true); }

static void p_cancel_done(buf *b, uint64_t handle) {
  Kvf__CancelDone d = KVF__CANCEL_DONE__INIT;
  d.handle = handle;
  PEER_MSG(b, CANCEL_DONE, cancel_done, &d);
}

static void p_simple(buf *b, int which) {
  Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
  Kvf__Heartbeat hb = KVF__HEARTBEAT__INIT;
  Kvf__Goodbye gb = KVF__GOODBYE__INIT;
  Kvf__Hello h = KVF__HELLO__INIT;
  Kvf__DataHello dh = KVF__DATA_HELLO__INIT;
  char *tps[] = {"tcp", "rdma"};
  switch (which) {
  case 0:
    hb.time_ns = 123456789;
    m.body_case = KVF__PEER_MSG__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    break;
  case 1:
    gb.reason = "seed";
    m.body_case = KVF__PEER_MSG__BODY_GOODBYE;
    m.goodbye = &gb;
    break;
  case 2:
    h.version = KVF__PEER_VERSION;
    h.node = "B";
    h.session = 42;
    h.transports = tps;
    h.n_transports = 2;
    m.body_case = KVF__PEER_MSG__BODY_HELLO;
    m.hello = &h;
    break;
  default:
    dh.version = KVF__PEER_VERSION;
    dh.node = "B";
    dh.stream = 1;
    m.body_case = KVF__PEER_MSG__BODY_DATA_HELLO;
    m.data_hello = &dh;
    break;
  }
  peer(b, &m);
}

/* A tcp data batch: header and entries (pool, len, offset), then payloads. */
static void batch(buf *b, uint32_t magic, uint64_t handle, const uint64_t (*e)[3], uint32_t n, bool payload) {
  uint8_t h[16];
  kvf__frame_put_header(h, magic);
  kvf__frame_put_header(h + 4, n);
  for (int i = 0; i < 8; i++) h[8 + i] = (uint8_t)(handle >> (8 * i));
  put(b, h, 16);
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < n; i++) {
    uint8_t r[16];
    kvf__frame_put_header(r, (uint32_t)e[i][0]);
    kvf__frame_put_header(r + 4, (uint32_t)e[i][2]);
    for (int k = 0; k < 8; k++) r[8 + k] = (uint8_t)(e[i][1] >> (8 * k));
    put(b, r, 16);
    bytes += e[i][2];
  }
  for (uint64_t i = 0; payload && i < bytes; i++) put(b, "\xa5", 1);
}

#define MAGIC 0x4446564bu

/* A tcp pattern batch of one entry (tcp_pattern.h): pool, len, n1, n2,
 * off, s1, s2, then its payload. */
static void pattern(buf *b, uint64_t handle, uint32_t pool, uint32_t len, uint32_t n1, uint32_t n2, uint64_t off,
                    uint64_t s1, uint64_t s2) {
  uint8_t h[16 + 40];
  kvf__frame_put_header(h, 0x5046564bu);
  kvf__frame_put_header(h + 4, 1);
  for (int i = 0; i < 8; i++) h[8 + i] = (uint8_t)(handle >> (8 * i));
  uint32_t w[4] = {pool, len, n1, n2};
  uint64_t q[3] = {off, s1, s2};
  for (int k = 0; k < 4; k++) kvf__frame_put_header(h + 16 + 4 * k, w[k]);
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < 8; i++) h[32 + 8 * k + i] = (uint8_t)(q[k] >> (8 * i));
  put(b, h, sizeof(h));
  for (uint64_t i = 0; i < (uint64_t)len * n1 * n2; i++) put(b, "\x5a", 1);
}
#define E(...) ((const uint64_t[][3]){__VA_ARGS__}), (uint32_t)(sizeof((const uint64_t[][3]){__VA_ARGS__}) / sizeof(uint64_t[3]))

static void peer_seeds(void) {
  buf b = {0};
  const char *T = "fuzz_peer";

  /* B grants s1 (2 x 4096), we send, B confirms. */
  p_grant(&b, "s1", 77, D({{0, 0, 4096}}, {{0, 4096, 4096}}));
  p_result(&b, 77, 0, "");
  out(T, "grant-s1-ok", &b);

  p_grant(&b, "s1", 77, D({{0, 0, 8192}}));
  p_result(&b, 77, 0, "");
  out(T, "grant-s1-coalesced", &b);

  /* B grants s1, then cancels it asking for a CancelDone; and answers a
   * CancelDone for our pushed grant g1. */
  p_grant(&b, "s1", 77, D({{0, 0, 4096}}, {{0, 4096, 4096}}));
  p_cancel_ack(&b, 77, "s1");
  p_cancel_done(&b, 1);
  out(T, "grant-s1-cancel-ack", &b);

  p_grant(&b, "s1", 77, D({{0, 0, 4096}}));
  out(T, "grant-s1-short", &b);

  p_grant(&b, "s1", 77, D({{0, 0, 4096}}, {{0, 4096, 4096}}));
  p_grant(&b, "s1", 77, D({{0, 0, 4096}}, {{0, 4096, 4096}}));
  p_result(&b, 77, -1011, "failed over there");
  out(T, "grant-s1-twice-fail", &b);

  /* s2 is still taking parts. */
  p_grant(&b, "s2", 78, D({{0, 0, 8192}}, {{0, 8192, 4096}}));
  p_cancel(&b, 78, "s2", -1005, true);
  out(T, "grant-s2-cancel", &b);

  p_intent(&b, "g2");
  p_done(&b, 2, 16384, 1);
  out(T, "intent-g2-done", &b);

  p_intent(&b, "g2");
  p_intent(&b, "g2");
  p_done(&b, 2, 100, 1);
  out(T, "intent-g2-wrong-bytes", &b);

  p_done(&b, 1, 4096 + 4096 + 100 + 65536 + 1000, 5);
  out(T, "done-g1", &b);

  /* B grants blocks for s1 (pushed ahead), says layers landed for a
   * handle of ours, then a malformed view (block ids past it) */
  p_grant_blocks(&b, "s1", 79, 4, 0, "0123", true);
  p_layers_done(&b, 1, 0, 2);
  p_layers_done(&b, 1, 4000000000u, 4000000000u);
  p_grant_blocks(&b, "s2", 80, 4, 0, "07", false);
  p_grant_blocks(&b, "s3", 81, 4, 250000, "0", false);
  p_result(&b, 79, 0, "");
  out(T, "grant-blocks", &b);

  p_intent(&b, "g1");
  p_intent(&b, "g3");
  p_intent(&b, "l1");
  p_intent(&b, "new");
  p_intent(&b, "");
  p_done(&b, 3, 8192, 1);
  p_done(&b, 4, 4096, 1);
  out(T, "intents", &b);

  p_cancel(&b, 1, "g1", -1005, false);
  p_cancel(&b, 3, "g3", 0, false);
  p_cancel(&b, 0, "s1", 0, true);
  p_cancel(&b, 0, "new", 0, false);
  out(T, "cancels", &b);

  p_grant(&b, "later", 99, D({{0, 0, 4096}}));
  p_grant(&b, "later", 100, D({{0, 0, 8192}}));
  p_cancel(&b, 0, "later", 0, true);
  p_grant(&b, "s3", 101, D({{0, 0, 4096}}));
  p_grant(&b, "l1", 102, D({{0, 0, 4096}}));
  out(T, "pregrants", &b);

  p_grant(&b, "s1", 0, D({{0, 0, 8192}}));            /* handle 0 */
  p_grant(&b, "s1", 5, D({{0, 0, 0}}));               /* zero length */
  p_grant(&b, "s1", 6, D({{0, 0, UINT64_MAX}}, {{0, 0, 9}})); /* total wraps */
  p_result(&b, 12345, 0, "");
  p_done(&b, 999, 1, 1);
  out(T, "bad-messages", &b);

  p_simple(&b, 0);
  p_simple(&b, 2);
  p_simple(&b, 3);
  p_grant(&b, "s1", 77, D({{0, 0, 8192}}));
  p_simple(&b, 1);
  p_result(&b, 77, 0, "");
  out(T, "heartbeat-hello-goodbye", &b);

  p_grant(&b, "s1", 77, D({{0, 0, 8192}}));
  put(&b, "\x10\x00\x00\x00\xff\xff", 6);
  out(T, "truncated", &b);

  put(&b, "\xff\xff\xff\xff", 4);
  out(T, "oversized", &b);

  put(&b, "\x03\x00\x00\x00\x0a\xff\x01", 7);
  out(T, "undecodable", &b);

  /* Data streams into g1 (handle 1): pool 0 [0, 8192) [12288, 12388),
   * pool 1 [0, 65536) [200000, 201000). */
  batch(&b, MAGIC, 1, E({0, 0, 4096}, {0, 4096, 4096}, {0, 12288, 100}), true);
  batch(&b, MAGIC, 1, E({1, 0, 65536}, {1, 200000, 1000}), true);
  out(T, "data-g1-whole", &b);

  batch(&b, MAGIC, 1, E({0, 6000, 2192}), true);
  batch(&b, MAGIC, 2, E({0, 0, 16}), true); /* another grant: skipped */
  batch(&b, MAGIC, 1, E({1, 65000, 536}), true);
  out(T, "data-g1-parts", &b);

  batch(&b, MAGIC, 1, E({0, 8000, 1000}), true); /* crosses the gap */
  out(T, "data-outside", &b);

  batch(&b, MAGIC, 1, E({1, 200500, 1000}), true); /* past the range's end */
  batch(&b, MAGIC, 1, E({0, 0, 4096}), true);
  out(T, "data-past-end", &b);

  /* pattern batches into g1: 2 rows of 4 pieces of 16 bytes in pool 0's
   * first range, then one whose box crosses the gap */
  pattern(&b, 1, 0, 16, 4, 2, 0, 64, 4096);
  pattern(&b, 1, 1, 100, 1, 1, 200000, 0, 0);
  out(T, "data-pattern", &b);

  batch(&b, MAGIC, 1, E({0, 0, 100}), true);
  pattern(&b, 1, 0, 16, 2, 1, 8000, 4288, 0); /* pieces inside, box over the gap */
  out(T, "data-pattern-gap", &b);

  batch(&b, MAGIC, 1, E({0, 0, 0}), true); /* zero length */
  out(T, "data-zero", &b);

  batch(&b, MAGIC, 1, E({0, 0, (1u << 20) + 1}), false); /* above a slice */
  out(T, "data-big", &b);

  batch(&b, MAGIC, 1, NULL, 0, false); /* count 0 */
  out(T, "data-empty", &b);

  {
    uint64_t many[257][3];
    for (int i = 0; i < 257; i++) {
      many[i][0] = 0;
      many[i][1] = (uint64_t)i * 16;
      many[i][2] = 16;
    }
    batch(&b, MAGIC, 1, (const uint64_t(*)[3])many, 256, true);
    out(T, "data-256", &b);
    batch(&b, MAGIC, 1, (const uint64_t(*)[3])many, 257, false);
    out(T, "data-257", &b);
  }

  batch(&b, MAGIC, 1, E({0, 0, 4096}), true);
  batch(&b, 0x44465640u, 1, E({0, 0, 4096}), true); /* bad magic */
  out(T, "data-bad-magic", &b);

  batch(&b, MAGIC, 1, E({7, 0, 4096}), true);
  batch(&b, MAGIC, 1, E({0, UINT64_MAX - 100, 4096}), true);
  out(T, "data-wild", &b);
}

/* ---------------------------------------------------------------- config */

static void config_seeds(const char *shipped) {
  buf b = {0};
  const char *T = "fuzz_config";
  FILE *f = fopen(shipped, "rb");
  if (f) {
    char chunk[4096];
    size_t n;
    while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) put(&b, chunk, n);
    fclose(f);
    out(T, "shipped", &b);
  }

  kvf__config c;
  kvf__config_defaults(&c);
  snprintf(c.node, sizeof(c.node), "node-a");
  char *text = NULL;
  size_t len = 0;
  FILE *m = open_memstream(&text, &len);
  kvf__config_dump(&c, m, false);
  fclose(m);
  put(&b, text, len);
  free(text);
  out(T, "defaults-dump", &b);

  put_s(&b,
        "\xef\xbb\xbf# every kind of value\r\n"
        "node n.0_x-Y\r\n"
        "api-socket /tmp/k v\n"
        "api-socket /tmp/kvferry.sock\n"
        "api-allow-users root, 0 ,1\n"
        "api-allow-groups root,0\n"
        "api-allow-users\n"
        "peer-listen [::1]:0\n"
        "peer b 10.0.0.2:7470\n"
        "peer c [fe80::1]:1\n"
        "peer d host-name.example:65535\n"
        "pool main host 256M\n"
        "pool kv0 cuda:07 16G\n"
        "pool tiny host 4KiB\n"
        "default-deadline-ms 86400000\n"
        "heartbeat-ms 10\tpeer-timeout-ms 21\n"
        "heartbeat-ms 10\n"
        "peer-timeout-ms 21\n"
        "reconnect-min-ms 5000\n"
        "reconnect-max-ms 100\n"
        "max-frame 1G\n"
        "max-descs 1\n"
        "hugepages on\n"
        "mlock no\n"
        "cuda off\n"
        "log-level debug\n"
        "transports rdma, tcp\n"
        "metrics-listen 127.0.0.1:9464\n"
        "stop-timeout-ms 0\n"
        "rdma-devices mlx5_0,rxe0:1\n"
        "rdma-gid-index 1023\n"
        "rdma-listen off\n"
        "rdma-inline 0\n"
        "rdma-slice 4K\n"
        "rdma-poll-us 100000 # trailing comment\n");
  out(T, "every-kind", &b);

#define S(x) {x, sizeof(x) - 1}
  static const struct { const char *s; size_t n; } bad[] = {
      S("node\n"),
      S("node a b\n"),
      S("node this-name-is-much-longer-than-sixty-three-characters-which-is-the-limit-here\n"),
      S("nodes a\n"),
      S("max-frame 4095\n"),
      S("max-frame 18446744073709551616\n"),
      S("max-frame 16E\n"),
      S("max-descs -1\n"),
      S("heartbeat-ms 0x10\n"),
      S("peer-listen 1.2.3.4\n"),
      S("peer-listen 999.1.1.1:80\n"),
      S("peer-listen [::1:80\n"),
      S("peer-listen ::1:80\n"),
      S("peer-listen :80\n"),
      S("peer x 1.2.3.4:0\n"),
      S("pool p host 4097\n"),
      S("pool p cuda:64 4K\n"),
      S("pool p gpu 4K\n"),
      S("pool p host 99999999999T\n"),
      S("transports tcp,tcp\n"),
      S("transports udp\n"),
      S("rdma-devices bad!name\n"),
      S("rdma-devices mlx5_0:256\n"),
      S("rdma-gid-index 1024\n"),
      S("api-allow-users no-such-user-kvferry\n"),
      S("api-allow-users 4294967295\n"),
      S("mlock maybe\n"),
      S("log-level \xff\xfe\n"),
      S("node a\0b\n"),
      S("node node-a\npeer node-a 1.2.3.4:1\n"),
      S("node a\npeer b 1.1.1.1:1\npeer b 1.1.1.2:1\n"),
      S("node a\npool p host 4K\npool p host 8K\n"),
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    char name[32];
    put(&b, bad[i].s, bad[i].n);
    snprintf(name, sizeof(name), "bad-%02zu", i);
    out(T, name, &b);
  }
  for (int i = 0; i < 5000; i++) put_s(&b, "x");
  put_s(&b, "\n");
  out(T, "long-line", &b);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: gen_corpus DIR [SHIPPED_CONF]\n");
    return 2;
  }
  root = argv[1];
  mkdir(root, 0755);
  api_seeds();
  peer_seeds();
  config_seeds(argc > 2 ? argv[2] : "config/kvferryd.conf");
  return 0;
}
