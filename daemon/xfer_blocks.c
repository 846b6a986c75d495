/* xfer_blocks.c - transfers of blocks of KV layouts (layout.h): the part of
 * the transfer state machine that knows blocks. A transfer of blocks keeps
 * its side as a view of a layout and block ids (x->mine); a sender keeps a
 * remote grant's view (x->send.grant) and names layers part by part; the
 * transport walks both views into runs or hands them to the GPU
 * (post_blocks), so no descriptor list is built on the sending side. A
 * receiver with layer events reports each granted layer once it landed,
 * in order (the transport's marks, the sender's LayersDone, or the end). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layouts.h"
#include "xfer.h"
#include "xfer_int.h"

void kvf__xblocks_free(kvf__xblocks *b) {
  if (b->layout) kvf__layout_release(b->layout);
  free(b->offsets);
  free(b->ids);
  memset(b, 0, sizeof(*b));
}

/* The grant a sender pairs against, when it is of blocks. */
static const kvf__xblocks *grant_blocks(const kvf__xfer *x) { return x->twin ? &x->twin->mine : &x->send.grant; }

bool kvf__xsend_grant_is_blocks(const kvf__xfer *x) { return grant_blocks(x)->n > 0; }

static void emit_layer(kvf__xfer *x, uint32_t layer) {
  if (!x->owner) return;
  Kvf__Event ev = KVF__EVENT__INIT;
  ev.type = KVF__EVENT_TYPE__EVENT_LAYER_DONE;
  ev.xfer_id = x->id;
  ev.path = (char *)kvf__xfer_path(x);
  ev.peer = x->peer_name;
  ev.bytes = kvf__blocks_bytes(&x->mine.view, x->mine.n, 1);
  ev.descriptors = kvf__blocks_pieces(&x->mine.view, x->mine.n, 1);
  ev.layer = layer;
  ev.error = "";
  kvf__xfer_emit(x->owner, &ev);
}

/* Reports, in order, the granted layers that landed and were not reported. */
static void report_layers(kvf__xfer *x) {
  const kvf__lview *v = &x->mine.view;
  while (x->recv.next_event < v->n_layers && x->recv.landed[x->recv.next_event])
    emit_layer(x, v->first_layer + x->recv.next_event++);
}

void kvf__xfer_on_layers_landed(kvf__xfer *x, uint32_t first, uint32_t n) {
  if (x->role != KVF__RECV || !x->blocks || !x->recv.layer_events || !kvf__xfer_live(x)) return;
  const kvf__lview *v = &x->mine.view;
  for (uint32_t l = first; l < first + n && l >= first; l++)
    if (l >= v->first_layer && l - v->first_layer < v->n_layers) x->recv.landed[l - v->first_layer] = 1;
  report_layers(x);
}

/* The sender's LayersDone: a staged part goes through the transport's
 * transform pass first (a failure fails x). */
void kvf__xrecv_layers_done(kvf__xfer *x, const Kvf__LayersDone *d) {
  if (!kvf__xfer_live(x)) return;
  if (d->staged_heads) {
    char why[200];
    kvf__xstaged st = {d->staged_order, d->staged_first_head, d->staged_heads};
    int rc = x->role == KVF__RECV && x->blocks && d->n_layers
                 ? x->tp->ops->unstage(x->tp, x, d->first_layer, d->n_layers, &st, why, sizeof(why))
                 : (snprintf(why, sizeof(why), "a staged part of no layers of blocks"), KVF_EPROTO);
    if (rc > 0) { /* rc passes run off the loop: each says kvf__xrecv_unstaged */
      x->recv.passes_out += (unsigned)rc;
      return;
    }
    if (rc) {
      kvf__xfer_fail(x, rc, why, true, rc);
      return;
    }
  }
  kvf__xfer_on_layers_landed(x, d->first_layer, d->n_layers);
}

void kvf__xrecv_unstaged(kvf__xfer *x, uint32_t first, uint32_t n, int rc, const char *why) {
  x->recv.passes_out--;
  if (!kvf__xfer_live(x)) return;
  if (rc) {
    kvf__xfer_fail(x, rc, why, true, rc);
    return;
  }
  kvf__xfer_on_layers_landed(x, first, n);
  if (x->recv.passes_out || !x->recv.done_owed) return;
  x->recv.done_owed = false;
  kvf__xrecv_sender_done(x, x->recv.owed_bytes);
}

uint64_t kvf__xrecv_blocks_bytes(const kvf__xfer *x) {
  uint64_t b = kvf__blocks_bytes(&x->mine.view, x->mine.n, x->mine.view.n_layers);
  return x->mine.head1 ? b / x->mine.view.geom.kv_heads : b; /* a fan's head of every block */
}

/* The receive is complete: the layers not reported yet all landed. */
void kvf__xrecv_flush_layers(kvf__xfer *x) {
  if (!x->blocks || !x->recv.layer_events) return;
  memset(x->recv.landed, 1, x->mine.view.n_layers);
  report_layers(x);
}

static int append_range(kvf__lrange **v, size_t *n, uint32_t first, uint32_t count) {
  kvf__lrange *nv = realloc(*v, (*n + 1) * sizeof(*nv));
  if (!nv) return -ENOMEM;
  nv[(*n)++] = (kvf__lrange){first, count};
  *v = nv;
  return 0;
}

/* A grant of blocks on the wire: the receiver's view of the granted layers
 * and its ids, in *buf (freed by the caller). */
int kvf__xblocks_to_grant(kvf__xfer *x, Kvf__Grant *g, Kvf__Layout *lw, uint8_t **buf) {
  const kvf__xblocks *b = &x->mine;
  size_t vb = KVF__LVIEW_WIRE_BYTES(&b->view);
  if (!(*buf = malloc(vb + b->n * 4))) return -ENOMEM;
  kvf__lview_to_wire(&b->view, lw, *buf);
  kvf__ids_to_wire(b->ids, b->n, *buf + vb);
  g->layout = lw;
  g->block_ids = (ProtobufCBinaryData){b->n * 4, *buf + vb};
  g->layer_events = x->recv.layer_events;
  return 0;
}

/* A Grant's blocks into *gb (owned); KVF_EPROTO when they do not decode,
 * KVF_ELIMIT past our max-descs. */
int kvf__xblocks_from_grant(const Kvf__Grant *g, kvf__xblocks *gb) {
  memset(gb, 0, sizeof(*gb));
  int rc = kvf__lview_from_wire(g->layout, &gb->view, &gb->offsets);
  if (rc == 0) rc = kvf__ids_from_wire(g->block_ids, kvfd.cfg.max_descs, &gb->ids, &gb->n);
  if (rc == 0 && gb->n == 0) rc = KVF_EPROTO;
  size_t bad;
  if (rc == 0 && kvf__blocks_check(&gb->view, gb->ids, gb->n, &bad) != 0) rc = KVF_EPROTO;
  if (rc) kvf__xblocks_free(gb);
  return rc;
}

/* The plan of x's blocks into grant g's: a fan's sub-send moves its head. */
static int send_plan(const kvf__xfer *x, const kvf__xblocks *g, kvf__xplan *p, char *why, size_t len) {
  int rc = kvf__xplan_make(&x->mine.view, x->mine.n, &g->view, g->n, p, why, len);
  if (rc == 0 && x->mine.head1) rc = kvf__xplan_only(p, x->mine.head1 - 1, why, len);
  return rc;
}

bool kvf__xfer_transform(const kvf__xfer *x, char *buf, size_t len) {
  const kvf__xfer *s = x->role == KVF__SEND ? x : x->twin; /* a receiver knows its sender's layout when local */
  kvf__xplan p;
  char why[160];
  if (!s || !s->blocks || s->role != KVF__SEND || !kvf__xsend_grant_is_blocks(s) ||
      send_plan(s, grant_blocks(s), &p, why, sizeof(why)) != 0)
    return false;
  kvf__xplan_describe(&p, buf, len);
  size_t u = strlen(buf);
  if (p.transform && s->stage_note && u < len) snprintf(buf + u, len - u, ", %s", s->stage_note);
  return true;
}

const char *kvf__xfer_event_transform(const kvf__xfer *x, char *buf, size_t len) {
  if (!x->blocks) return "";
  if (kvf__xfer_transform(x, buf, len)) return buf;
  return x->transform; /* a remote sender's word, or kept when the local pair parted */
}

void kvf__xfer_keep_transform(kvf__xfer *send, kvf__xfer *recv) {
  if (!send->blocks || !kvf__xfer_transform(send, send->transform, sizeof(send->transform))) return;
  if (recv) snprintf(recv->transform, sizeof(recv->transform), "%s", send->transform);
}

/* Why the send's blocks cannot go into the grant's, or NULL. */
static const char *blocks_mismatch(const kvf__xfer *x, int *rc, char *why, size_t len) {
  const kvf__xblocks *g = grant_blocks(x);
  *rc = KVF_EINVAL;
  if (x->blocks != kvf__xsend_grant_is_blocks(x)) return "one side of the transfer names blocks and the other descriptors";
  *rc = KVF_ESIZE;
  kvf__xplan p;
  if (send_plan(x, g, &p, why, len) != 0) return why;
  if (!x->mine.head1 && !kvf__xplan_covers(&p, why, len)) return why; /* a fan's head: its grant's too */
  if (g->view.first_layer + g->view.n_layers > x->mine.view.n_layers) {
    snprintf(why, len, "layer counts: the grant's layers %u-%u are not in the send's layout (%u layers)",
             g->view.first_layer, g->view.first_layer + g->view.n_layers - 1, x->mine.view.n_layers);
    return why;
  }
  return NULL;
}

static uint32_t layers_sent(const kvf__xfer *x) {
  uint32_t n = 0;
  for (uint32_t l = 0; l < x->mine.view.n_layers; l++) n += x->send.layers_sent[l];
  return n;
}

/* Hands layers [first, first + n) of every block to the transport; a
 * failure fails x. The last part checks that the parts covered the
 * grant's layers (each part named its layers once, kvf__xfer_send_blocks). */
static int post_block_part(kvf__xfer *x, uint32_t first, uint32_t n, bool last) {
  kvf__xsend *s = &x->send;
  const kvf__xblocks *g = grant_blocks(x);
  char why[160] = "the transport refused the data";
  int rc = 0;
  if (last && layers_sent(x) != g->view.n_layers) {
    snprintf(why, sizeof(why), "the send's parts cover %u layers and the grant %u", layers_sent(x),
             g->view.n_layers);
    rc = KVF_ESIZE;
  }
  kvf__bpart bp = {.src = &x->mine.view, .dst = &g->view, .src_layout = x->mine.layout, .dst_layout = g->layout,
                   .sids = x->mine.ids, .dids = g->ids, .n = x->mine.n, .first = first, .n_layers = n};
  /* checked when the grant came (kvf__xsend_blocks_start) */
  if (send_plan(x, g, &bp.xf, why, sizeof(why)) != 0) rc = KVF_ESIZE;
  s->last_post_ns = kvf__now_ns();
  if (!s->first_post_ns) s->first_post_ns = s->last_post_ns;
  if (rc == 0) {
    rc = x->tp->ops->post_blocks(x->tp, x, &bp, last);
    if (rc == KVF_ERANGE)
      snprintf(why, sizeof(why), "layers %u-%u are not in the grant (layers %u-%u)", first, first + n - 1,
               g->view.first_layer, g->view.first_layer + g->view.n_layers - 1);
    else if (rc)
      snprintf(why, sizeof(why), "%s", kvf__xfer_post_failure(rc, "the transport refused the data"));
  }
  /* a staged part is announced with or without layer events: the receiver transforms it then */
  if (rc == 0 && (s->layer_events || s->staged.nh) && !x->tp->ops->mark_layers(x->tp, x, first, n))
    rc = append_range(&s->unannounced, &s->n_unannounced, first, n);
  if (rc) {
    kvf__xfer_fail(x, rc, why, true, rc);
    return rc;
  }
  s->parts_out++;
  /* what lands in the grant: a transform moves other blocks, a fan's sub-send one head */
  s->bytes_posted += bp.xf.transform ? kvf__xplan_bytes(&bp.xf, n, g->view.n_kv) : kvf__blocks_bytes(&g->view, g->n, n);
  if (last) kvf__xfer_set_state(x, KVF__SEND_FLUSH);
  else if (s->state == KVF__SEND_WAIT) kvf__xfer_set_state(x, KVF__SEND_ACTIVE); /* QUEUED stays until its last */
  return 0;
}

/* The grant is known: check that the blocks fit, then post the parts that
 * came early, in their order. */
void kvf__xsend_blocks_start(kvf__xfer *x) {
  kvf__xsend *s = &x->send;
  bool last = s->state == KVF__SEND_QUEUED;
  char why[160];
  int rc;
  const char *bad = blocks_mismatch(x, &rc, why, sizeof(why));
  if (bad) {
    kvf__xfer_fail(x, rc, bad, true, rc);
    return;
  }
  if (x->twin) s->layer_events = x->twin->recv.layer_events;
  kvf__lrange *early = s->early_layers;
  size_t n = s->n_early;
  s->early_layers = NULL;
  s->n_early = 0;
  if (n == 0) kvf__xfer_set_state(x, KVF__SEND_ACTIVE);
  for (size_t i = 0; i < n && kvf__xfer_live(x); i++) post_block_part(x, early[i].first, early[i].n, last && i == n - 1);
  free(early);
}

/* Owed layer events: once none of the parts posted so far is out, their
 * layers are in (the transport's callback means so: its writes completed). */
void kvf__xsend_announce_layers(kvf__xfer *x) {
  kvf__xsend *s = &x->send;
  for (size_t i = 0; i < s->n_unannounced; i++) {
    kvf__lrange r = s->unannounced[i];
    if (x->twin) {
      kvf__xfer_on_layers_landed(x->twin, r.first, r.n);
      continue;
    }
    Kvf__LayersDone d = KVF__LAYERS_DONE__INIT;
    d.handle = x->handle;
    d.first_layer = r.first;
    d.n_layers = r.n;
    d.staged_order = s->staged.order;
    d.staged_first_head = s->staged.h0;
    d.staged_heads = s->staged.nh;
    Kvf__PeerMsg m = KVF__PEER_MSG__INIT;
    m.body_case = KVF__PEER_MSG__BODY_LAYERS_DONE;
    m.layers_done = &d;
    kvf__xfer_peer_send(x->peer, &m);
  }
  s->n_unannounced = 0;
}

/* A part of blocks for x: the same layout and blocks as the first part,
 * and layers none of the earlier parts named. */
int kvf__xsend_part_check(const kvf__xfer *x, const kvf__blockreq *b, const kvf__lview *v, char *err,
                            size_t errlen) {
  if (!x->blocks) {
    snprintf(err, errlen, "transfer '%s' sends descriptors: a part of blocks cannot continue it", x->id);
    return KVF_EINVAL;
  }
  if (b->layout != x->mine.layout) {
    snprintf(err, errlen, "a part of transfer '%s' names layout %u, its first part layout %u", x->id,
             b->layout->id, x->mine.layout->id);
    return KVF_EINVAL;
  }
  if (b->n && (b->n != x->mine.n || memcmp(*b->ids, x->mine.ids, b->n * sizeof(uint32_t)) != 0)) {
    snprintf(err, errlen, "a part of transfer '%s' names other blocks than its first part", x->id);
    return KVF_EINVAL;
  }
  for (uint32_t l = v->first_layer; l < v->first_layer + v->n_layers; l++)
    if (x->send.layers_sent[l]) {
      snprintf(err, errlen, "layer %u of transfer '%s' was sent already", l, x->id);
      return KVF_EINVAL;
    }
  return 0;
}

/* Takes a checked part of layers v for x: queued until the grant is known,
 * posted after. An error takes nothing. */
int kvf__xsend_part_take(kvf__xfer *x, const kvf__lview *v, bool last) {
  kvf__xsend *s = &x->send;
  if (s->state == KVF__SEND_WAIT &&
      append_range(&s->early_layers, &s->n_early, v->first_layer, v->n_layers) != 0)
    return -ENOMEM;
  memset(s->layers_sent + v->first_layer, 1, v->n_layers);
  s->descs_taken += kvf__blocks_pieces(v, x->mine.n, v->n_layers);
  uint32_t left = x->mine.view.n_layers - layers_sent(x);
  kvf__xtrace_part(x, last, !last && left && left <= v->n_layers); /* parts of equal layers: the next is the last */
  if (s->state == KVF__SEND_WAIT) {
    if (last) kvf__xfer_set_state(x, KVF__SEND_QUEUED);
    return 0;
  }
  post_block_part(x, v->first_layer, v->n_layers, last); /* a failure fails x: its event says so */
  return 0;
}

/* A new send of blocks: the layout's every layer is its view (parts pick
 * layers from it). */
int kvf__xsend_blocks_begin(kvf__xfer *x, const kvf__blockreq *b) {
  kvf__lview all;
  kvf__layout_view(b->layout, 0, 0, &all);
  if (!(x->send.layers_sent = calloc(all.n_layers, 1))) return -ENOMEM;
  x->blocks = true;
  kvf__xblocks_take(&x->mine, b, &all);
  return 0;
}

/* Checks a request's blocks against its layout: the view of its layers in
 * *v, KVF_ERANGE (err says which) for layers or ids outside it. */
int kvf__xblocks_view(const kvf__blockreq *b, kvf__lview *v, char *err, size_t errlen) {
  const kvf__layout *l = b->layout;
  if (kvf__layout_view(l, b->first, b->n_layers, v) != 0) {
    snprintf(err, errlen, "layers from %u (%u of them) are not in layout %u (%u layers)", b->first, b->n_layers,
             l->id, l->n_layers);
    return KVF_ERANGE;
  }
  size_t bad;
  if (b->n && kvf__blocks_check(v, *b->ids, b->n, &bad) != 0) {
    snprintf(err, errlen, "block id %u (at %zu) is not in layout %u (%u blocks)", (*b->ids)[bad], bad, l->id,
             l->n_blocks);
    return KVF_ERANGE;
  }
  return 0;
}

/* Our side's blocks: the layout held, the ids taken from b. */
void kvf__xblocks_take(kvf__xblocks *mine, const kvf__blockreq *b, const kvf__lview *v) {
  kvf__layout_hold(b->layout);
  mine->layout = b->layout;
  mine->view = *v;
  mine->ids = *b->ids;
  mine->n = b->n;
  mine->head1 = b->head1;
  *b->ids = NULL;
}


/* ------------------------------------------------------------ a Grant's transport part
 * (here for room: xfer.c is at its size limit) */

static int copy_bytes(uint8_t **out, size_t *len, const ProtobufCBinaryData *w) {
  *out = NULL;
  *len = 0;
  if (!w->len) return 0;
  if (!(*out = malloc(w->len))) return -ENOMEM;
  memcpy(*out, w->data, w->len);
  *len = w->len;
  return 0;
}

void kvf__tp_grant_free(kvf__tp_grant *t) {
  free(t->win);
  free(t->of);
  memset(t, 0, sizeof(*t));
}

int kvf__tp_grant_copy(kvf__tp_grant *t, const Kvf__Grant *g) {
  int rc = copy_bytes(&t->win, &t->win_len, &g->windows);
  if (rc == 0) rc = copy_bytes(&t->of, &t->of_len, &g->window_of);
  if (rc) kvf__tp_grant_free(t);
  return rc;
}
