/* rdma_stage.c - transforms over rdma: direct writes where they are large,
 * else a staging slice of the receiver's and a transform pass there.
 *
 * A transform between layouts of other heads, order or tokens per block
 * (kv_xform.h) walks into runs that are often small: NHD into a grant of
 * more heads is a run per token (a head's 256 bytes), NHD <-> HND a run per
 * token and head. Over rdma each run is a work request, and small ones
 * cost far more than their bytes. So:
 *
 * Receiver. A grant of blocks of stated geometry into host memory, with
 * memory windows, gets a slice of the staging arena (rdma-staging-size of
 * host memory, registered with every device at start, its slot in the
 * per-pool tables KVF__RDMA_STAGE_POOL) as large as the grant's bytes, and
 * memory windows over that slice (one per QP of the peer's at least, so the
 * writes spread over its QPs), bound like the grant's others: a sender can
 * write nothing of the arena but its grant's slice, and only while the
 * grant is open. No room: the grant goes without (the sender then
 * writes directly; the log and kvferryctl say so).
 *
 * Sender. A part of a transform whose direct runs average under
 * STAGE_MIN_RUN bytes, to a grant with a slice, is written into the slice
 * instead, in the layout "the grant's blocks, in order, each of the
 * grant's tokens per block, holding only the heads moved, in the SEND's
 * order" (kvf__xstaged): that is the source's own bytes regrouped, so its
 * runs are whole rows of the source (a source block of the moved heads, or
 * a head's tokens). The part goes in chunks of about STAGE_CHUNK bytes
 * (whole layers, two chunks at least), a ticket each; as each chunk's writes complete the
 * sender says so (LayersDone with staged_* for the chunk's layers), and
 * the part is called back once its last chunk is, so every note comes
 * before its SendDone.
 *
 * Receiver again. On each note the chunk's layers are transformed from the
 * slice into the grant's blocks (the plan slice -> grant, a walk of
 * kv_xform.c on libuv's thread pool; every read checked against the slice,
 * every write computed from the grant's own view), then reported (layer
 * events), while the next chunks are still on the wire: only the last
 * chunk's pass follows the last byte. A grant of blocks completes on the
 * sender's SendDone as well as its last write's notice: the notes come
 * before the SendDone on the peer's link, and the SendDone waits for the
 * passes still running.
 *
 * CUDA pools: the arena is also mapped for the GPUs (cuMemHostRegister, at
 * start, on hosts with CUDA), and a grant into a cuda pool whose layout's
 * offsets are on its GPU gets a slice too; its pass is one launch of the
 * transform kernel (kvf_xblocks) per noted chunk on the pool's GPU,
 * reading the slice over the bus (kvf__gpu_xblocks_from_host), completed
 * on the loop through the transport's mailbox like the CPU jobs. */
#include "rdma_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kv_xform.h"
#include "peer.h"
#include "pool.h"
#include "pool_engine.h"

#define STAGE_ALIGN 4096u
/* Direct writes when a part's runs average at least this: a whole HND head
 * slice of 16 tokens of 128 x 2 bytes and up. Chosen, not tuned: below a
 * few KiB per work request the requests, not the bytes, set the time. */
#define STAGE_MIN_RUN 4096u
/* A staged part is written and noted in chunks of whole layers, about this
 * many bytes each (at least one layer): the receiver transforms a chunk
 * while the next ones are on the wire. Small enough that the pass after
 * the last byte is short (llama3-8b: one layer of 4,096 tokens is 16 MiB,
 * of one decode rank of TP 4, 4 MiB); large enough that a note and a pass
 * job per chunk cost nothing next to its writes. */
#define STAGE_CHUNK (4u << 20)
/* Most memory windows over one grant's slice (kvf__rdma_stage_window); a
 * sender takes at most STAGE_WINDOWS_SEEN of them. */
#define STAGE_WINDOWS 32u
#define STAGE_WINDOWS_SEEN 256u

/* ------------------------------------------------------------ the arena */

int kvf__rdma_stage_setup(rdma_transport *rt, char *err, size_t errlen) {
  size_t len = kvfd.cfg.rdma_staging_size;
  if (!len || !rt->mw.on) return 0; /* without windows a slice could not be confined to its grant */
  void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return snprintf(err, errlen, "no memory for rdma-staging-size (%zu bytes)", len), -ENOMEM;
  rt->stage.mem = m;
  rt->stage.len = len;
  for (int i = 0; i < rt->n_devs; i++) {
    rdev *d = &rt->devs[i];
    d->mrs[KVF__RDMA_STAGE_POOL] = ibv_reg_mr(d->pd, m, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
    if (!d->mrs[KVF__RDMA_STAGE_POOL]) {
      int e = errno;
      snprintf(err, errlen, "registering %zu bytes of staging (rdma-staging-size) with %s failed: %s", len, d->name,
               strerror(e));
      return -e;
    }
    d->lkey[KVF__RDMA_STAGE_POOL] = d->mrs[KVF__RDMA_STAGE_POOL]->lkey;
  }
  /* the passes into cuda pools read the slices on the GPU */
  if (kvf__gpu_ready() && kvf__gpu_host_register(m, len, &rt->stage.alias) != 0) {
    rt->stage.alias = 0;
    kvf__warn("rdma: the staging arena (rdma-staging-size %zu) could not be mapped for CUDA: transforms into "
              "cuda pools are written directly, run by run", len);
  }
  return 0;
}

/* After the devices' MRs went (kvf__rdma_free_device). */
void kvf__rdma_stage_free(rdma_transport *rt) {
  if (rt->stage.alias) kvf__gpu_host_unregister(rt->stage.mem);
  if (rt->stage.mem) munmap(rt->stage.mem, rt->stage.len);
  free(rt->stage.used);
  memset(&rt->stage, 0, sizeof(rt->stage));
}

/* First fit among the used extents (sorted by offset): 0, or -ENOSPC. */
static int arena_take(rdma_transport *rt, uint64_t len, uint64_t *off) {
  uint64_t at = 0;
  size_t i = 0;
  for (; i < rt->stage.n_used; i++) {
    if (rt->stage.used[i].off - at >= len) break;
    at = rt->stage.used[i].off + rt->stage.used[i].len;
  }
  if (at > rt->stage.len || rt->stage.len - at < len) return -ENOSPC;
  if (rt->stage.n_used == rt->stage.cap_used) {
    size_t cap = rt->stage.cap_used ? 2 * rt->stage.cap_used : 16;
    void *nv = realloc(rt->stage.used, cap * sizeof(*rt->stage.used));
    if (!nv) return -ENOMEM;
    rt->stage.used = nv;
    rt->stage.cap_used = cap;
  }
  memmove(&rt->stage.used[i + 1], &rt->stage.used[i], (rt->stage.n_used - i) * sizeof(*rt->stage.used));
  rt->stage.used[i].off = at;
  rt->stage.used[i].len = len;
  rt->stage.n_used++;
  *off = at;
  return 0;
}

void kvf__rdma_stage_release(rdma_transport *rt, uint64_t off, uint64_t len) {
  for (size_t i = 0; len && i < rt->stage.n_used; i++)
    if (rt->stage.used[i].off == off) {
      memmove(&rt->stage.used[i], &rt->stage.used[i + 1], (rt->stage.n_used - i - 1) * sizeof(*rt->stage.used));
      rt->stage.n_used--;
      return;
    }
}

static bool geometry_stated(const kvf__lgeom *g) {
  return g->tokens_per_block && g->kv_heads && g->head_dim && g->dtype_bytes;
}

/* A cuda pool's pass runs on its GPU: the arena mapped there, the
 * transform kernel built in, the layout's offsets on that GPU. */
static bool gpu_passes(const rdma_transport *rt, const kvf__xfer *x) {
  return rt->stage.alias && kvf__gpu_blocks_kernel() && x->mine.layout && x->mine.layout->gpu;
}

void kvf__rdma_stage_reserve(rgrant *g, kvf__xfer *x) {
  rdma_transport *rt = g->rt;
  const kvf__pool *p = x->blocks ? kvf__pool_get(x->mine.view.pool) : NULL;
  if (!rt->stage.mem || g->bg || !p || (kvf__pool_gpu(p) && !gpu_passes(rt, x)) ||
      !geometry_stated(&x->mine.view.geom))
    return;
  uint64_t need = (x->dst.total + STAGE_ALIGN - 1) / STAGE_ALIGN * STAGE_ALIGN;
  if (need == 0) return;
  if (arena_take(rt, need, &g->st_off) != 0) {
    rt->stage.refused++;
    kvf__warn("rdma: grant %s: no room for its %llu bytes in the staging arena (rdma-staging-size %zu, %zu "
              "grants hold slices): a transform into it is written directly, run by run",
              x->id, (unsigned long long)need, rt->stage.len, rt->stage.n_used);
    return;
  }
  g->st_len = need;
  rt->stage.grants++;
}

/* The slice's windows: at least one per QP of the peer's that takes
 * windows (lanes), about one per STAGE_CHUNK beyond that, at most
 * STAGE_WINDOWS. Windows go round-robin on those QPs, and a type 2 window
 * takes writes only through its own: over one window every staged write
 * went through one QP, whose rxe tasks kept one of the VM's two CPUs busy
 * (bench/RESULTS.md). Consecutive windows on different QPs let neighbouring
 * chunks travel at once. */
int kvf__rdma_stage_window(rgrant *g, size_t lanes) {
  if (!g->st_len) return 0;
  uint64_t pages = g->st_len / STAGE_ALIGN, k = (g->st_len + STAGE_CHUNK - 1) / STAGE_CHUNK;
  if (k < lanes) k = lanes;
  if (k > STAGE_WINDOWS) k = STAGE_WINDOWS;
  if (k > pages) k = pages;
  if (k == 0) k = 1;
  kvf__range *nv = realloc(g->win, (g->n_win + k) * sizeof(*nv));
  if (!nv) return -ENOMEM;
  g->win = nv;
  uint64_t a = (uint64_t)(uintptr_t)g->rt->stage.mem + g->st_off; /* the slot's base is 0 */
  uint64_t each = pages / k * STAGE_ALIGN, end = a + g->st_len;
  for (uint64_t i = 0; i < k; i++, a += each)
    nv[g->n_win++] = (kvf__range){.pool = KVF__RDMA_STAGE_POOL, .start = a, .end = i + 1 < k ? a + each : end};
  return 0;
}

/* ------------------------------------------------------------ the staged layout */

/* The view of grant view gv's nd blocks as staged with st: same layers,
 * regions and tokens per block, st's heads and order, packed (layer,
 * region, block); its offsets in *offs (malloc'ed). Its bytes in *bytes. */
static int stage_view(const kvf__lview *gv, size_t nd, const kvf__xstaged *st, kvf__lview *v, uint64_t **offs,
                      uint64_t *bytes) {
  uint64_t unit = (uint64_t)gv->geom.head_dim * gv->geom.dtype_bytes;
  uint64_t bb = (uint64_t)gv->geom.tokens_per_block * st->nh * unit;
  size_t n = (size_t)gv->n_layers * gv->n_kv;
  uint64_t *o = malloc((n ? n : 1) * sizeof(*o));
  if (!o) return -ENOMEM;
  for (size_t i = 0; i < n; i++) o[i] = (uint64_t)i * nd * bb;
  *v = *gv;
  v->pool = KVF__RDMA_STAGE_POOL;
  v->n_blocks = (uint32_t)nd;
  v->block_bytes = v->block_stride = bb;
  v->offsets = o;
  v->geom.kv_heads = st->nh;
  v->geom.first_head = st->h0;
  v->geom.order = st->order;
  *offs = o;
  *bytes = (uint64_t)n * nd * bb;
  return 0;
}

static uint32_t *identity(size_t n) {
  uint32_t *v = malloc((n ? n : 1) * sizeof(*v));
  for (size_t i = 0; v && i < n; i++) v[i] = (uint32_t)i;
  return v;
}

/* ------------------------------------------------------------ sender */

typedef struct counter {
  uint64_t runs, bytes;
} counter;

static void count_run(void *ctx, uint64_t so, uint64_t dof, uint64_t len, uint32_t piece) {
  counter *c = ctx;
  c->runs++;
  c->bytes += len;
}

/* The receiver's staging slice, if its Grant gave one: its windows, back
 * to back (kvf__rdma_stage_window), as one record (w) and where each after
 * the first starts (cuts, n_cuts). A receiver that gave them otherwise gave
 * none that this sender can use. */
typedef struct stage_slice {
  kvf__mw_rec w;
  uint64_t cuts[STAGE_WINDOWS_SEEN];
  size_t n_cuts;
} stage_slice;

static bool stage_record(const kvf__xfer *x, stage_slice *s) {
  size_t n = kvf__rdma_window_records(&x->tp_grant), i = n;
  while (i > 0) { /* they come last, after the grant's own */
    kvf__mw_rec r;
    kvf__mw_rec_get(x->tp_grant.win + (i - 1) * KVF__MW_REC, &r);
    if (r.pool != KVF__RDMA_STAGE_POOL) break;
    i--;
  }
  if (i == n || n - i > STAGE_WINDOWS_SEEN + 1) return false;
  s->n_cuts = 0;
  for (size_t j = i; j < n; j++) {
    kvf__mw_rec r;
    kvf__mw_rec_get(x->tp_grant.win + j * KVF__MW_REC, &r);
    if (j == i) s->w = r;
    else if (r.off != s->w.off + s->w.len) return false;
    else {
      s->cuts[s->n_cuts++] = r.off;
      s->w.len += r.len;
    }
  }
  return true;
}

/* Cuts each run that crosses one of cuts (sorted, ascending) there: a
 * write must lie in one window. Pieces keep the run's order. */
int kvf__rdma_cut_runs(kvf__runs *runs, const uint64_t *cuts, size_t n_cuts) {
  size_t extra = 0;
  for (size_t i = 0; i < runs->n; i++)
    for (size_t c = 0; c < n_cuts; c++)
      extra += runs->v[i].dst_off < cuts[c] && cuts[c] < runs->v[i].dst_off + runs->v[i].len;
  if (!extra) return 0;
  kvf__run *nv = malloc((runs->n + extra) * sizeof(*nv));
  if (!nv) return -ENOMEM;
  size_t k = 0;
  for (size_t i = 0; i < runs->n; i++) {
    kvf__run r = runs->v[i];
    for (size_t c = 0; c < n_cuts; c++) {
      if (!(r.dst_off < cuts[c] && cuts[c] < r.dst_off + r.len)) continue;
      uint64_t head = cuts[c] - r.dst_off;
      nv[k] = r;
      nv[k++].len = head;
      r.src_off += head;
      r.dst_off += head;
      r.len -= head;
    }
    nv[k++] = r;
  }
  free(runs->v);
  runs->v = nv;
  runs->n = runs->cap = k;
  return 0;
}

/* Whether b's direct runs would be small: their average under STAGE_MIN_RUN,
 * judged on its first layer (every layer has the same geometry; the loop
 * does not walk them all twice). */
static bool runs_small(const kvf__bpart *b) {
  counter c = {0};
  if (kvf__xform_walk(&b->xf, b->src, b->sids, b->dst, b->dids, b->first, 1, count_run, &c) != 0) return false;
  return c.runs && c.bytes / c.runs < STAGE_MIN_RUN;
}

/* b's runs into the staging slice sl, staged as st. */
static int staged_runs(const kvf__bpart *b, const stage_slice *sl, const kvf__xstaged *st, kvf__runs *runs) {
  const kvf__mw_rec *w = &sl->w;
  kvf__lview sv;
  uint64_t *offs = NULL, bytes = 0;
  uint32_t *ids = identity(b->xf.nd);
  int rc = ids ? stage_view(b->dst, b->xf.nd, st, &sv, &offs, &bytes) : -ENOMEM;
  if (rc == 0 && bytes > w->len) rc = KVF_ESIZE; /* the receiver sized its slice otherwise: go direct */
  kvf__xplan p = b->xf; /* the send's side, heads and tokens; the slice's side: */
  p.d = (kvf__xside){b->xf.d.tpb, st->nh, st->h0, st->order};
  p.transform = true;
  if (rc == 0) rc = kvf__xform_runs(&p, b->src, b->sids, &sv, ids, b->first, b->n_layers, runs);
  for (size_t i = 0; rc == 0 && i < runs->n; i++) {
    runs->v[i].dst_off += w->off;
    runs->v[i].dst_desc = UINT32_MAX; /* not a grant descriptor: its window is found by pool */
  }
  if (rc == 0) rc = kvf__rdma_cut_runs(runs, sl->cuts, sl->n_cuts);
  free(ids);
  free(offs);
  return rc;
}

/* A staged part's chunks: the part is called back once all are. */
struct sgroup {
  unsigned out;                 /* chunks posted, not yet called back */
  bool posting;                 /* more chunks may come (post_chunks runs) */
  bool last;
  int status;                   /* the first failure among its chunks */
};

/* Layers per chunk: about STAGE_CHUNK bytes of what lands, at least one,
 * and at most half the part's (a part of two layers or more goes in two
 * chunks or more: small ones too, so that the tests walk this path). */
static uint32_t chunk_layers(const kvf__bpart *b) {
  uint64_t per = kvf__xplan_bytes(&b->xf, 1, b->dst->n_kv);
  uint64_t k = per && per < STAGE_CHUNK ? STAGE_CHUNK / per : 1, half = (b->n_layers + 1) / 2;
  return (uint32_t)(k < half ? k : half);
}

/* The tail of g, once nothing of it is out nor to come: the part's callback. */
static void group_end(sgroup *g, kvf__xfer *x) {
  if (g->out || g->posting) return;
  int st = g->status;
  bool last = g->last;
  free(g);
  kvf__xfer_on_posted(x, st, last);
}

/* Posts b chunk by chunk (runs: its first chunk's, made by the caller).
 * A chunk that cannot be posted once others are out fails the part through
 * its callback (those out still complete first). */
static int post_chunks(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, uint32_t step, const stage_slice *w,
                       const kvf__xstaged *st, kvf__runs *runs, bool last) {
  sgroup *g = calloc(1, sizeof(*g));
  if (!g) return -ENOMEM;
  *g = (sgroup){.posting = true, .last = last};
  uint32_t end = b->first + b->n_layers;
  int rc = 0;
  for (uint32_t l = b->first; l < end && rc == 0; l += step) {
    kvf__bpart c = *b;
    c.first = l;
    c.n_layers = end - l < step ? end - l : step;
    if (l != b->first) {
      runs->n = 0; /* posting took the list, or copied it: made anew */
      runs->bytes = 0;
      rc = staged_runs(&c, w, st, runs);
    }
    if (rc == 0) rc = kvf__rdma_post_chunk(t, x, runs, last && l + c.n_layers == end, g, l, c.n_layers);
    if (rc == 0) {
      g->out++;
      to_rdma(t)->stage.chunks++;
    }
  }
  if (rc && g->out == 0) {
    free(g);
    return rc;
  }
  if (rc) g->status = rc;
  g->posting = false;
  return 0; /* callbacks come on the loop, after this */
}

void kvf__rdma_stage_chunk_done(sgroup *g, kvf__xfer *x, uint32_t first, uint32_t n, int st) {
  g->out--;
  if (st && st != KVF_ECANCELED && !g->status) g->status = st;
  /* a chunk's writes all completed: the receiver may transform its layers
   * now (LayersDone, as the transfer would once the whole part is back) */
  bool ending = x->send.state == KVF__SEND_DRAIN || x->send.state == KVF__SEND_DONE ||
                x->send.state == KVF__SEND_FAILED;
  if (st == 0 && !g->status && !ending && x->peer) {
    Kvf__LayersDone d = KVF__LAYERS_DONE__INIT;
    d.handle = x->handle;
    d.first_layer = first;
    d.n_layers = n;
    d.staged_order = x->send.staged.order;
    d.staged_first_head = x->send.staged.h0;
    d.staged_heads = x->send.staged.nh;
    Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
    m.body_case = KVF__PEER_MSG__BODY_LAYERS_DONE;
    m.layers_done = &d;
    kvf__peer_send(x->peer, &m); /* a peer lost meanwhile: the peer layer fails or holds x, as for the transfer's own */
  }
  group_end(g, x);
}

/* A staged part's chunks are noted by the transport (kvf__rdma_stage_chunk_done);
 * a part written directly is noted by the transfer once called back. */
bool kvf__rdma_mark_layers(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n) {
  return x->send.staged.nh != 0;
}

/* Pieces a strided run may take (kv_xform.h), or 0 where b does not go
 * strided: its plan reads no fixed step (NHD into HND), or a request
 * would carry under STAGE_MIN_RUN bytes. A run is a chunk's tokens of one
 * head (g pieces), at most the scatter/gather entries of a request on
 * every dialed QP and within rdma-slice, which never cuts one; a request
 * gathers the runs of a block's next heads (they follow in the HND
 * destination), as many as fit: of one head (a fan's sub-transfer), one. */
static uint32_t strided_pieces(const rdma_transport *rt, const kvf__bpart *b) {
  const kvf__xplan *p = &b->xf;
  if (!kvf__xplan_strides(p)) return 0;
  uint32_t sge = GATHER_MAX, g = p->s.tpb < p->d.tpb ? p->s.tpb : p->d.tpb;
  for (int i = 0; i < rt->n_devs; i++) /* what every dialed QP so far takes: a run never exceeds a request */
    if (rt->devs[i].write_sge < sge) sge = rt->devs[i].write_sge;
  uint64_t in_slice = kvfd.cfg.rdma_slice / p->unit, max = sge < in_slice ? sge : in_slice;
  if (g > max) return 0;
  uint64_t runs = max / g < p->nh ? max / g : p->nh;
  return runs * g * p->unit < STAGE_MIN_RUN ? 0 : (uint32_t)max;
}

/* Why a transform went direct, the events' note either way. */
typedef struct direct_why {
  const char *runs, *strided;
} direct_why;

static const direct_why NO_STAGING = {"direct (the receiver lent no staging)",
                                      "direct, gathered (the receiver lent no staging)"};
static const direct_why STAGING_SMALL = {"direct (the receiver's staging is too small)",
                                         "direct, gathered (the receiver's staging is too small)"};
static const direct_why LARGE_RUNS = {"direct (runs of 4 KiB or more)", "direct (runs of 4 KiB or more)"};

/* b written directly: in strided runs where they serve (a destination
 * head slice's pieces, scattered over an NHD source's tokens, in one
 * gathered write: as many requests as the runs a token each would gather
 * into, a sixteenth of the runs to check and claim), else run by run.
 * Strided runs do not go through bounce buffers (their pieces would be
 * copied one by one): -ENOTSUP there, and run by run. */
static int post_direct(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last, const direct_why *why) {
  uint32_t pieces = strided_pieces(to_rdma(t), b);
  x->stage_note = pieces ? why->strided : why->runs;
  if (pieces) {
    kvf__runs runs = {0};
    int rc = kvf__xform_runs_strided(&b->xf, b->src, b->sids, b->dst, b->dids, b->first, b->n_layers, pieces, &runs);
    if (rc == 0) rc = kvf__rdma_post(t, x, &runs, last);
    kvf__runs_free(&runs);
    if (rc == 0) to_rdma(t)->stage.strided_parts++;
    if (rc != -ENOTSUP) return rc;
    x->stage_note = why->runs;
  }
  return kvf__transport_post_block_runs(t, x, b, last);
}

/* A transform: staged where the receiver lent a slice and the direct
 * writes would be small (in the soft-RoCE VM, gathering a head's 256-byte
 * tokens into each write costs rxe more than the receiver's pass: bench/
 * RESULTS.md), else direct. */
int kvf__rdma_post_blocks(kvf__transport *t, kvf__xfer *x, const kvf__bpart *b, bool last) {
  stage_slice w;
  kvf__xstaged st = {b->xf.s.order, b->xf.h0, b->xf.nh};
  if (!b->xf.transform) return kvf__transport_post_block_runs(t, x, b, last);
  bool offered = stage_record(x, &w);
  if (!offered || (!x->send.staged.nh && !runs_small(b)))
    return post_direct(t, x, b, last, offered ? &LARGE_RUNS : &NO_STAGING);
  kvf__runs runs = {0};
  uint32_t step = chunk_layers(b);
  kvf__bpart c = *b;
  c.n_layers = step;
  int rc = staged_runs(&c, &w, &st, &runs);
  if (rc == KVF_ESIZE && !x->send.staged.nh) {
    kvf__runs_free(&runs);
    return post_direct(t, x, b, last, &STAGING_SMALL);
  }
  x->send.staged = st; /* every later part of x goes the same way */
  x->stage_note = "staged";
  if (rc == 0) rc = post_chunks(t, x, b, step, &w, &st, &runs, last);
  if (rc == 0) to_rdma(t)->stage.staged_parts++;
  kvf__runs_free(&runs);
  return rc;
}

/* ------------------------------------------------------------ receiver: the pass
 *
 * A part's layers are split among up to PASS_JOBS jobs on libuv's thread
 * pool (the loop keeps serving: a pass of a large part takes seconds under
 * emulation, longer than a peer waits for heartbeats). Each job reports its
 * layers on the loop (kvf__xrecv_unstaged). A grant that closes waits for
 * its jobs still running (they write into its blocks) and detaches them.
 * A job copies block by block through a table of the block's units
 * (unit_table): the units are small (a head's token, 256 bytes for
 * llama3-8b), so per-unit calls and checks would cost more than the copy. */

#define PASS_JOBS 4u

struct spass {
  uv_work_t req;
  struct spass *next;           /* the grant's jobs (loop) */
  rgrant *g;                    /* NULL once the grant closed */
  kvf__xfer *x;
  kvf__xplan p;
  kvf__lview sv, gv;
  uint64_t *offs;               /* sv's offsets (owned) */
  uint32_t *ids;                /* the slice's block ids (owned) */
  uint32_t first, n;
  const uint8_t *src;
  uint64_t src_len;
  uint8_t *dst;
  uint64_t dst_len;
  bool guard;                   /* dst is engine memory: copies guarded (kvf__pool_copy) */
  int rc;
  uint64_t ns;
  atomic_bool done;             /* the work is over (close_grant waits for it) */
  kvf__mail mail;               /* a GPU pass: its completion, to the loop */
  rdma_transport *rt;
};

static void pass_run(void *ctx, uint64_t so, uint64_t dof, uint64_t len, uint32_t piece) {
  spass *p = ctx;
  if (p->rc) return;
  if (so > p->src_len || len > p->src_len - so || dof > p->dst_len || len > p->dst_len - dof) {
    p->rc = KVF_ERANGE;
    return;
  }
  p->rc = kvf__pool_copy(p->dst + dof, p->src + so, len); /* guarded: engine memory may shrink */
}

/* The offsets of every unit of a staged block (send's order, the moved
 * heads) and of where it goes in a grant block, in *tab (pairs; malloc'ed):
 * the same for every block, so the pass works them out once. NULL when a
 * block has too many units for a table (the walk then does it). */
#define PASS_TABLE_MAX 65536u
static uint64_t *unit_table(const kvf__xplan *x, size_t *n) {
  uint64_t units = (uint64_t)x->s.tpb * x->nh;
  if (x->s.tpb != x->d.tpb || units == 0 || units > PASS_TABLE_MAX) return NULL;
  uint64_t *t = malloc(2 * units * sizeof(*t)), u = x->unit;
  uint32_t hs = x->h0 - x->s.h0, hd = x->h0 - x->d.h0;
  for (uint64_t k = 0; t && k < units; k++) {
    uint64_t tok = k / x->nh, h = k % x->nh; /* the grant's order below: NHD rows, HND columns */
    if (x->d.order == KVF_LAYOUT_HND) tok = k % x->s.tpb, h = k / x->s.tpb;
    t[2 * k] = x->s.order == KVF_LAYOUT_HND ? ((hs + h) * x->s.tpb + tok) * u : (tok * x->s.heads + hs + h) * u;
    t[2 * k + 1] = x->d.order == KVF_LAYOUT_HND ? ((hd + h) * x->d.tpb + tok) * u : (tok * x->d.heads + hd + h) * u;
  }
  *n = (size_t)units;
  return t;
}

/* The pass block by block through the unit table: each block's bounds
 * checked once (the slice's, the pool's), its units copied; into engine
 * memory each copy is guarded (the memory may shrink under it). The same
 * bytes as the walk of kv_xform.c, without its per-unit calls. */
static int pass_blocks(spass *p, const uint64_t *tab, size_t units) {
  /* what of a block the table reaches on either side (every unit's head is
   * below that side's count) */
  uint64_t u = p->p.unit, bs = (uint64_t)p->p.s.tpb * p->p.s.heads * u, bd = (uint64_t)p->p.d.tpb * p->p.d.heads * u;
  const uint32_t *dids = p->x->mine.ids;
  for (uint32_t l = p->first; l < p->first + p->n; l++)
    for (uint32_t kv = 0; kv < p->gv.n_kv; kv++)
      for (size_t i = 0; i < p->p.nd; i++) {
        uint64_t so = kvf__lview_addr(&p->sv, l, kv, (uint32_t)i), dof = kvf__lview_addr(&p->gv, l, kv, dids[i]);
        if (so > p->src_len || bs > p->src_len - so || dof > p->dst_len || bd > p->dst_len - dof) return KVF_ERANGE;
        const uint8_t *src = p->src + so;
        uint8_t *dst = p->dst + dof;
        for (size_t k = 0; k < units; k++) {
          if (!p->guard) {
            memcpy(dst + tab[2 * k + 1], src + tab[2 * k], u);
            continue;
          }
          int rc = kvf__pool_copy(dst + tab[2 * k + 1], src + tab[2 * k], u);
          if (rc) return rc;
        }
      }
  return 0;
}

static void pass_work(uv_work_t *req) {
  spass *p = req->data;
  uint64_t t0 = kvf__now_ns();
  size_t units = 0;
  uint64_t *tab = unit_table(&p->p, &units);
  int rc = tab ? pass_blocks(p, tab, units)
               : kvf__xform_walk(&p->p, &p->sv, p->ids, &p->gv, p->x->mine.ids, p->first, p->n, pass_run, p);
  free(tab);
  if (rc && !p->rc) p->rc = rc;
  p->ns = kvf__now_ns() - t0;
  atomic_store(&p->done, true);
}

static void pass_free(spass *p) {
  free(p->offs);
  free(p->ids);
  free(p);
}

static void pass_after(uv_work_t *req, int status) {
  spass *p = req->data;
  rgrant *g = p->g;
  if (!g) { /* the grant closed under it */
    pass_free(p);
    return;
  }
  for (spass **pp = &g->passes; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  rdma_transport *rt = g->rt;
  rt->stage.pass_ns += p->ns; /* the jobs' time summed (they may overlap) */
  if (!g->passes && g->st_landed_ns) { /* the last byte waited for this pass */
    rt->stage.tail_ns += kvf__now_ns() - g->st_landed_ns;
    g->st_landed_ns = 0;
  }
  char why[160] = "";
  int rc = p->rc ? p->rc : status;
  if (rc) snprintf(why, sizeof(why), "the transform pass of staged layers %u-%u failed (%d)", p->first,
                   p->first + p->n - 1, rc);
  kvf__xfer *x = p->x;
  uint32_t first = p->first, n = p->n;
  pass_free(p);
  kvf__xrecv_unstaged(x, first, n, rc, why);
}

void kvf__rdma_stage_landed(rgrant *g) {
  if (g->passes) g->st_landed_ns = kvf__now_ns();
}

void kvf__rdma_stage_detach(rgrant *g) {
  for (spass *p = g->passes; p; p = p->next) {
    while (!atomic_load(&p->done)) { /* a CPU job, or a kernel: both end by themselves */
      struct timespec nap = {0, 50000};
      nanosleep(&nap, NULL);
    }
    p->g = NULL;
  }
  g->passes = NULL;
  if (g->st_gpu) {
    kvf__rdma_sgpu_free(g->st_gpu);
    free(g->st_gpu);
    g->st_gpu = NULL;
  }
}

static int check_note(const kvf__xfer *x, const rgrant *g, const kvf__xstaged *st, char *why, size_t len) {
  const kvf__lgeom *ge = &x->mine.view.geom;
  if (!g || !g->st_len) return snprintf(why, len, "the sender says it staged, but the grant has no staging"), KVF_EPROTO;
  if ((st->order != KVF_LAYOUT_NHD && st->order != KVF_LAYOUT_HND) || !st->nh || st->h0 < ge->first_head ||
      st->nh > ge->kv_heads || st->h0 - ge->first_head > ge->kv_heads - st->nh ||
      (x->mine.head1 && (st->h0 != x->mine.head1 - 1 || st->nh != 1)))
    return snprintf(why, len, "the sender staged heads %u-%u in order %u: not the grant's heads %u-%u",
                    st->h0, st->h0 + st->nh - 1, st->order, ge->first_head, ge->first_head + ge->kv_heads - 1),
           KVF_EPROTO;
  return 0;
}

/* The plan of a pass: the slice (staged as st, nd blocks of grant view
 * gv's geometry) into the grant's blocks. */
static kvf__xplan stage_plan(const kvf__lview *gv, size_t nd, const kvf__xstaged *st) {
  const kvf__lgeom *ge = &gv->geom;
  return (kvf__xplan){.transform = true,
                      .s = {ge->tokens_per_block, st->nh, st->h0, st->order},
                      .d = {ge->tokens_per_block, ge->kv_heads, ge->first_head, ge->order},
                      .h0 = st->h0, .nh = st->nh, .unit = (uint64_t)ge->head_dim * ge->dtype_bytes,
                      .tokens = (uint64_t)nd * ge->tokens_per_block, .ns = nd, .nd = nd};
}

/* One job over layers [first, first + n): its own copy of the views. */
static int pass_start(rdma_transport *rt, rgrant *g, kvf__xfer *x, const kvf__xstaged *st, const kvf__pool *pool,
                      uint32_t first, uint32_t n) {
  spass *p = calloc(1, sizeof(*p));
  if (!p) return -ENOMEM;
  const kvf__lview *gv = &x->mine.view;
  uint64_t bytes = 0;
  p->ids = identity(x->mine.n);
  int rc = p->ids ? stage_view(gv, x->mine.n, st, &p->sv, &p->offs, &bytes) : -ENOMEM;
  if (rc == 0 && bytes > g->st_len) rc = KVF_ESIZE;
  if (rc) {
    pass_free(p);
    return rc;
  }
  p->p = stage_plan(gv, x->mine.n, st);
  p->gv = *gv;
  p->g = g;
  p->x = x;
  p->rt = rt;
  p->first = first;
  p->n = n;
  p->src = rt->stage.mem + g->st_off;
  p->src_len = g->st_len;
  p->dst = pool->base;
  p->dst_len = pool->size;
  p->guard = pool->engine != NULL;
  p->req.data = p;
  rt->stage.bytes += bytes / (gv->n_layers ? gv->n_layers : 1) * n;
  if ((rc = uv_queue_work(rt->base.loop, &p->req, pass_work, pass_after)) != 0) {
    pass_free(p);
    return rc;
  }
  p->next = g->passes;
  g->passes = p;
  return 0;
}

/* ------------------------------------------------------------ receiver: GPU passes */

int kvf__rdma_sgpu_plan(const kvf__lview *gv, size_t nd, const kvf__xstaged *st, kvf__sgpu *s) {
  memset(s, 0, sizeof(*s));
  uint64_t bytes = 0;
  s->st = *st;
  s->p = stage_plan(gv, nd, st);
  s->ids = identity(nd);
  int rc = s->ids ? stage_view(gv, nd, st, &s->sv, &s->offs, &bytes) : -ENOMEM;
  if (rc) kvf__rdma_sgpu_free(s);
  return rc;
}

int kvf__rdma_sgpu_make(const kvf__lview *gv, size_t nd, const kvf__xstaged *st, int dev, kvf__sgpu *s) {
  int rc = kvf__rdma_sgpu_plan(gv, nd, st, s);
  if (rc == 0 && (rc = kvf__gpu_layout_upload(dev, s->offs, (size_t)gv->n_layers * gv->n_kv, &s->table)) != 0)
    kvf__rdma_sgpu_free(s);
  return rc;
}

void kvf__rdma_sgpu_free(kvf__sgpu *s) {
  kvf__gpu_layout_free(s->table);
  free(s->offs);
  free(s->ids);
  memset(s, 0, sizeof(*s));
}

void kvf__rdma_sgpu_job(const kvf__sgpu *s, uint64_t slice, const kvf__gpu_bside *dst, uint32_t first, uint32_t n,
                        kvf__gpu_blocks *j) {
  size_t skip = (size_t)(first - s->sv.first_layer) * s->sv.n_kv; /* the slice's regions from layer first */
  *j = (kvf__gpu_blocks){.src = {.dev = -1, .base = slice, .table = kvf__gpu_layout_table(s->table) + skip * 8,
                                 .offsets = s->offs + skip, .stride = s->sv.block_stride, .ids = s->ids},
                         .dst = *dst, .block_bytes = s->sv.block_bytes, .n_layers = n, .n_kv = s->sv.n_kv,
                         .n = s->p.nd, .xf = &s->p};
}

/* On the loop: a GPU pass ended (its mail). */
static void gpu_pass_mail(kvf__mail *m) {
  spass *p = kvf__container_of(m, spass, mail);
  pass_after(&p->req, 0);
}

/* On CUDA's completion thread: hands the result on, nothing else. */
static void gpu_pass_done(void *arg, int rc, float kernel_ms) {
  spass *p = arg;
  p->rc = rc;
  p->ns = kernel_ms > 0 ? (uint64_t)((double)kernel_ms * 1e6) : 0;
  rdma_transport *rt = p->rt;
  atomic_store(&p->done, true);
  kvf__mailbox_post(&rt->mb, &p->mail, gpu_pass_mail);
}

/* Layers [first, first + n) by one launch of the transform kernel from
 * the slice into the grant's blocks of a cuda pool. */
static int gpu_pass_start(rdma_transport *rt, rgrant *g, kvf__xfer *x, const kvf__xstaged *st, const kvf__pool *pool,
                          uint32_t first, uint32_t n) {
  const kvf__lview *gv = &x->mine.view;
  if (!g->st_gpu) {
    kvf__sgpu *sg = calloc(1, sizeof(*sg));
    int rc = sg ? kvf__rdma_sgpu_make(gv, x->mine.n, st, pool->cuda_dev, sg) : -ENOMEM;
    if (rc) {
      free(sg);
      return rc;
    }
    g->st_gpu = sg;
  }
  const kvf__sgpu *sg = g->st_gpu;
  if (memcmp(&sg->st, st, sizeof(*st)) != 0) return KVF_EPROTO; /* one slice layout per grant */
  uint64_t bytes = (uint64_t)n * gv->n_kv * x->mine.n * sg->sv.block_bytes;
  if ((uint64_t)gv->n_layers * gv->n_kv * x->mine.n * sg->sv.block_bytes > g->st_len) return KVF_ESIZE;
  spass *p = calloc(1, sizeof(*p));
  if (!p) return -ENOMEM;
  p->g = g;
  p->x = x;
  p->rt = rt;
  p->first = first;
  p->n = n;
  kvf__gpu_bside dst;
  kvf__transport_block_side(gv, x->mine.layout, x->mine.ids, first, &dst);
  kvf__gpu_blocks j;
  kvf__rdma_sgpu_job(sg, rt->stage.alias + g->st_off, &dst, first, n, &j);
  int rc = kvf__gpu_xblocks_from_host(&j, gpu_pass_done, p);
  if (rc) {
    free(p);
    return rc;
  }
  rt->stage.bytes += bytes;
  rt->stage.gpu_passes++;
  p->next = g->passes;
  g->passes = p;
  return 0;
}

int kvf__rdma_unstage(kvf__transport *t, kvf__xfer *x, uint32_t first, uint32_t n, const kvf__xstaged *st,
                      char *why, size_t len) {
  rdma_transport *rt = to_rdma(t);
  char key[16];
  grant_key(key, sizeof(key), (uint32_t)x->handle);
  rgrant *g = kvf__map_get(&rt->grants, key);
  if (g && g->x != x) g = NULL;
  int rc = check_note(x, g, st, why, len);
  if (rc) return rc;
  const kvf__lview *gv = &x->mine.view;
  const kvf__pool *pool = kvf__pool_get(gv->pool);
  bool gpu = pool && kvf__pool_gpu(pool);
  if (!pool || (gpu && !gpu_passes(rt, x)) || first < gv->first_layer || n > gv->n_layers ||
      first - gv->first_layer > gv->n_layers - n)
    return snprintf(why, len, "staged layers %u-%u are not the grant's (or in a pool no pass here reaches)",
                    first, first + n - 1), KVF_ERANGE;
  if (gpu) { /* one launch for the chunk */
    if ((rc = gpu_pass_start(rt, g, x, st, pool, first, n)) != 0)
      return snprintf(why, len, "the GPU transform pass could not start (%d)", rc), rc;
    g->st_done += n;
    rt->stage.passes++;
    return 1;
  }
  uint32_t jobs = n < PASS_JOBS ? n : PASS_JOBS, per = (n + jobs - 1) / jobs, started = 0;
  for (uint32_t l = first; l < first + n && rc == 0; l += per, started++)
    rc = pass_start(rt, g, x, st, pool, l, first + n - l < per ? first + n - l : per);
  if (rc && started == 0) return snprintf(why, len, "the transform pass could not start (%d)", rc), rc;
  g->st_done += n;
  rt->stage.passes++; /* per staged part, however many jobs */
  return (int)started; /* a job that could not start: its layers never land, the deadline says so */
}
