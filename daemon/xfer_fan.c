/* xfer_fan.c - fan-in and fan-out as one sub-transfer per KV head (see
 * xfer_fan.h). Loop thread. */
#include "xfer_fan.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "xfer_int.h"

#define FAN_ERR 200

typedef struct fan {
  struct fan *next;
  kvf__session *s;
  bool recv;                 /* a grant's, else a send's */
  bool quiet;                /* being undone after a refused call: no event */
  bool building;             /* its sub-transfers are being made: it cannot end yet */
  char id[KVF_XFER_ID_MAX + 1];
  uint32_t h0, nh;           /* its heads */
  uint8_t *ended;            /* per head: 0 open, 1 done, 2 failed */
  uint32_t open;             /* sub-transfers not ended */
  int status;                /* the first failure */
  char error[FAN_ERR];
  uint64_t bytes, descs;
  char path[32];
  char peers[128];
  char transform[112];       /* the first head's, over the fan's heads */
  char (*node)[KVF_NAME_MAX + 1]; /* a send's: per head, where it goes */
  bool layer_events;
  uint32_t first_layer, n_layers, next_layer;
  uint32_t *layer_heads;     /* per granted layer: heads that have it */
} fan;

static fan *fans;
static bool reporting;       /* the fan's own event is on its way out */

static fan *fan_find(kvf__session *s, const char *id, bool recv) {
  for (fan *f = fans; f; f = f->next)
    if (f->s == s && f->recv == recv && strcmp(f->id, id) == 0) return f;
  return NULL;
}

static void fan_free(fan *f) {
  for (fan **p = &fans; *p; p = &(*p)->next)
    if (*p == f) {
      *p = f->next;
      break;
    }
  free(f->ended);
  free(f->node);
  free(f->layer_heads);
  free(f);
}

static bool fanned(const kvf__layout *l) { return l->n_kv == 2 && l->geom.model_heads != 0; }

/* Head h's sub-transfer id; false when it does not fit an id. */
static bool sub_name(char *buf, size_t len, const char *id, uint32_t h) {
  int n = snprintf(buf, len, "%s#h%u", id, h);
  return n > 0 && (size_t)n < len && n <= KVF_XFER_ID_MAX;
}

static int sub_id(char *buf, size_t len, const char *id, uint32_t h, char *err, size_t errlen) {
  if (sub_name(buf, len, id, h)) return 0;
  snprintf(err, errlen, "transfer id '%s' is too long for a fan over KV heads (its ids add '#h<head>')", id);
  return KVF_EINVAL;
}

static fan *fan_new(kvf__session *s, const char *id, bool recv, const kvf__layout *l) {
  fan *f = calloc(1, sizeof(*f));
  if (!f) return NULL;
  f->s = s;
  f->recv = recv;
  snprintf(f->id, sizeof(f->id), "%s", id);
  f->h0 = l->geom.first_head;
  f->nh = l->geom.kv_heads;
  f->ended = calloc(f->nh, 1);
  if (!f->ended) {
    free(f);
    return NULL;
  }
  f->next = fans;
  fans = f;
  return f;
}

static int check_layout(const kvf__layout *l, char *err, size_t errlen) {
  const kvf__lgeom *g = &l->geom;
  if (g->tokens_per_block && g->kv_heads && g->head_dim && g->dtype_bytes) return 0;
  snprintf(err, errlen, "layout %u states model_kv_heads but not its whole geometry (tokens per block, heads, "
                        "head dim, dtype bytes): KV heads cannot be told apart", l->id);
  return KVF_EINVAL;
}

static void finish(fan *f, int type);

/* Its sub-transfers are made: one that ended meanwhile may have been the last. */
static void built(fan *f, int type) {
  f->building = false;
  if (f->open == 0) finish(f, type);
}

/* Undoes the first k sub-transfers of a fan whose call is refused. */
static void undo(fan *f, uint32_t k, bool recv) {
  f->quiet = true;
  f->open = k;
  for (uint32_t i = 0; i < k; i++) {
    char sid[KVF_XFER_ID_MAX + 8];
    if (sub_name(sid, sizeof(sid), f->id, f->h0 + i)) {
      if (recv) kvf__xfer_cancel(f->s, sid);
      else kvf__xfer_withdraw_send(f->s, sid, KVF_ECANCELED, "the fan's call was refused", true);
    }
  }
  /* events of the cancelled ones came back through kvf__xfan_event; the
   * silent ones never come */
  fan_free(f);
}

/* One sub-request: b for head h, with a copy of its ids (the transfer takes them). */
static int sub_req(const kvf__blockreq *b, uint32_t h, bool first, kvf__blockreq *out, uint32_t **copy) {
  *out = *b;
  out->head1 = h + 1;
  out->no_claim = !first;
  *copy = NULL;
  if (b->n) {
    *copy = malloc(b->n * sizeof(uint32_t));
    if (!*copy) return -ENOMEM;
    memcpy(*copy, *b->ids, b->n * sizeof(uint32_t));
  }
  out->ids = copy;
  return 0;
}

int kvf__xfan_grant_blocks(kvf__session *s, const char *id, const char *src_node, const kvf__blockreq *b,
                           uint32_t deadline_ms, char *err, size_t errlen) {
  if (!fanned(b->layout)) return kvf__xfer_grant_blocks(s, id, src_node, b, deadline_ms, err, errlen);
  int rc = check_layout(b->layout, err, errlen);
  if (rc) return rc;
  if (fan_find(s, id, true)) {
    snprintf(err, errlen, "transfer '%s' is already granted", id);
    return KVF_EBUSY;
  }
  kvf__lview v;
  rc = kvf__xblocks_view(b, &v, err, errlen);
  if (rc) return rc;
  fan *f = fan_new(s, id, true, b->layout);
  if (!f) return -ENOMEM;
  f->layer_events = b->layer_events;
  f->building = true;
  f->first_layer = v.first_layer;
  f->n_layers = v.n_layers;
  if (f->layer_events && !(f->layer_heads = calloc(v.n_layers, sizeof(uint32_t)))) rc = -ENOMEM;
  for (uint32_t k = 0; k < f->nh && rc == 0; k++) {
    char sid[KVF_XFER_ID_MAX + 8];
    kvf__blockreq sb;
    uint32_t *copy = NULL;
    rc = sub_id(sid, sizeof(sid), id, f->h0 + k, err, errlen);
    if (rc == 0) rc = sub_req(b, f->h0 + k, k == 0, &sb, &copy);
    f->open++; /* before: its event may come before the call returns */
    if (rc == 0) rc = kvf__xfer_grant_blocks(s, sid, src_node, &sb, deadline_ms, err, errlen);
    free(copy);
    if (rc) {
      f->open--;
      undo(f, k, true);
      return rc;
    }
  }
  if (rc) undo(f, 0, true);
  else built(f, KVF__EVENT_TYPE__EVENT_RECV_DONE);
  return rc;
}

/* dst_node: one node, or several comma-separated that take f's heads in
 * order, in equal shares. */
static int split_nodes(fan *f, const char *dst_node, char *err, size_t errlen) {
  char names[KVF_DST_NODES_MAX][KVF_NAME_MAX + 1];
  uint32_t k = 0;
  for (const char *p = dst_node;; k++) {
    const char *c = strchr(p, ',');
    size_t n = c ? (size_t)(c - p) : strlen(p);
    if (k == KVF_DST_NODES_MAX || n == 0 || n > KVF_NAME_MAX) {
      snprintf(err, errlen, "dst_node '%.200s': up to %d comma-separated node names of up to %d bytes", dst_node,
               KVF_DST_NODES_MAX, KVF_NAME_MAX);
      return KVF_EINVAL;
    }
    memcpy(names[k], p, n);
    names[k][n] = 0;
    if (!c) break;
    p = c + 1;
  }
  k++;
  if (k > f->nh || f->nh % k) {
    snprintf(err, errlen, "dst_node names %u nodes for the send's %u KV heads: each node takes an equal share", k,
             f->nh);
    return KVF_EINVAL;
  }
  if (!(f->node = calloc(f->nh, sizeof(*f->node)))) return -ENOMEM;
  for (uint32_t i = 0; i < f->nh; i++) memcpy(f->node[i], names[i * k / f->nh], sizeof(f->node[i]));
  return 0;
}

static int send_heads(fan *f, const kvf__blockreq *b, bool more, uint32_t deadline_ms, bool first, char *err,
                      size_t errlen) {
  for (uint32_t k = 0; k < f->nh; k++) {
    char sid[KVF_XFER_ID_MAX + 8];
    kvf__blockreq sb;
    uint32_t *copy = NULL;
    int rc = sub_id(sid, sizeof(sid), f->id, f->h0 + k, err, errlen);
    if (rc == 0) rc = sub_req(b, f->h0 + k, true, &sb, &copy);
    if (first) f->open++; /* before: its event may come before the call returns */
    if (rc == 0) rc = kvf__xfer_send_blocks(f->s, sid, f->node[k], &sb, more, deadline_ms, err, errlen);
    free(copy);
    if (rc && first) {
      f->open--;
      undo(f, k, false);
      return rc;
    }
    if (rc) { /* a later part: the heads sent so far are ahead of the rest, which must fail too */
      for (uint32_t i = 0; i < f->nh; i++)
        if (sub_name(sid, sizeof(sid), f->id, f->h0 + i))
          kvf__xfer_withdraw_send(f->s, sid, rc, "another head's part was refused", false);
      return rc;
    }
  }
  if (first) built(f, KVF__EVENT_TYPE__EVENT_SEND_DONE);
  return 0;
}

int kvf__xfan_send_blocks(kvf__session *s, const char *id, const char *dst_node, const kvf__blockreq *b,
                          bool more, uint32_t deadline_ms, char *err, size_t errlen) {
  fan *f = fan_find(s, id, false);
  if (f) return send_heads(f, b, more, deadline_ms, false, err, errlen);
  if (!fanned(b->layout)) {
    if (dst_node && strchr(dst_node, ',')) {
      snprintf(err, errlen, "several destination nodes need a layout that states its KV heads (model_kv_heads)");
      return KVF_EINVAL;
    }
    return kvf__xfer_send_blocks(s, id, dst_node, b, more, deadline_ms, err, errlen);
  }
  int rc = check_layout(b->layout, err, errlen);
  if (rc == 0 && (!dst_node || !dst_node[0])) {
    snprintf(err, errlen, "a send names its destination node");
    rc = KVF_EINVAL;
  }
  if (rc) return rc;
  if (!(f = fan_new(s, id, false, b->layout))) return -ENOMEM;
  rc = split_nodes(f, dst_node, err, errlen);
  if (rc) {
    fan_free(f);
    return rc;
  }
  f->building = true;
  return send_heads(f, b, more, deadline_ms, true, err, errlen);
}

static int cancel_fan(fan *f) {
  char sid[KVF_XFER_ID_MAX + 8];
  int any = KVF_ENOENT;
  for (uint32_t k = 0; k < f->nh; k++)
    if (!f->ended[k] && sub_name(sid, sizeof(sid), f->id, f->h0 + k) &&
        kvf__xfer_cancel(f->s, sid) == 0)
      any = 0;
  return any;
}

int kvf__xfan_cancel(kvf__session *s, const char *id) {
  fan *r = fan_find(s, id, true), *t = fan_find(s, id, false);
  if (!r && !t) return kvf__xfer_cancel(s, id);
  int rc = KVF_ENOENT;
  if (r && cancel_fan(r) == 0) rc = 0;
  if (t && cancel_fan(t) == 0) rc = 0;
  return rc;
}

/* A refused later part fails the send it continues; a fan's send is its
 * heads' sends, and every one of them must fail with it. */
void kvf__xfan_withdraw_send(kvf__session *s, const char *id, int status, const char *why) {
  fan *f = fan_find(s, id, false);
  if (!f) {
    kvf__xfer_withdraw_send(s, id, status, why, false);
    return;
  }
  char sid[KVF_XFER_ID_MAX + 8];
  for (uint32_t k = 0; k < f->nh; k++)
    if (!f->ended[k] && sub_name(sid, sizeof(sid), f->id, f->h0 + k))
      kvf__xfer_withdraw_send(s, sid, status, why, false);
}

bool kvf__xfan_sending(kvf__session *s, const char *id) {
  fan *f = fan_find(s, id, false);
  if (!f) return kvf__xfer_sending(s, id);
  char sid[KVF_XFER_ID_MAX + 8];
  for (uint32_t k = 0; k < f->nh; k++)
    if (sub_name(sid, sizeof(sid), f->id, f->h0 + k) && kvf__xfer_sending(s, sid)) return true;
  return false;
}

void kvf__xfan_session_gone(kvf__session *s) {
  for (fan *f = fans, *next; f; f = next) {
    next = f->next;
    if (f->s == s) fan_free(f);
  }
}

/* ------------------------------------------------------------ events */

/* "X#h<h>": X and h. */
static bool parse_sub(const char *sid, char *base, size_t len, uint32_t *h) {
  const char *m = strrchr(sid, '#');
  if (!m || m[1] != 'h' || m[2] < '0' || m[2] > '9' || (size_t)(m - sid) >= len) return false;
  char *end;
  unsigned long v = strtoul(m + 2, &end, 10);
  if (*end || v > UINT32_MAX) return false;
  memcpy(base, sid, (size_t)(m - sid));
  base[m - sid] = 0;
  *h = (uint32_t)v;
  return true;
}

static void report(fan *f, const Kvf__Event *like, int type, uint32_t layer, int status, const char *error) {
  Kvf__Event ev = KVF__EVENT__INIT;
  ev.type = type;
  ev.xfer_id = f->id;
  ev.status = status;
  ev.path = f->path;
  ev.peer = f->peers;
  ev.bytes = like ? like->bytes * f->nh : f->bytes;
  ev.descriptors = like ? like->descriptors : f->descs;
  ev.layer = layer;
  ev.error = (char *)error;
  ev.transform = type == KVF__EVENT_TYPE__EVENT_LAYER_DONE ? "" : f->transform;
  reporting = true;
  kvf__xfer_emit(f->s, &ev);
  reporting = false;
}

/* "heads 1, 3-4 missing: <the first failure>" */
static void say_missing(const fan *f, char *buf, size_t len) {
  size_t o = (size_t)snprintf(buf, len, "heads ");
  for (uint32_t k = 0; k < f->nh && o < len; k++) {
    if (f->ended[k] != 2 || (k > 0 && f->ended[k - 1] == 2)) continue;
    uint32_t e = k;
    while (e + 1 < f->nh && f->ended[e + 1] == 2) e++;
    o += (size_t)(e > k ? snprintf(buf + o, len - o, "%s%u-%u", o > 6 ? ", " : "", f->h0 + k, f->h0 + e)
                        : snprintf(buf + o, len - o, "%s%u", o > 6 ? ", " : "", f->h0 + k));
  }
  if (o < len) snprintf(buf + o, len - o, " %s: %s", f->recv ? "missing" : "not sent", f->error);
}

/* Every sub-transfer ended: the fan's event, and the fan goes. */
static void finish(fan *f, int type) {
  char why[FAN_ERR + 64] = "";
  if (f->status) say_missing(f, why, sizeof(why));
  report(f, NULL, type, 0, f->status, why);
  fan_free(f);
}

static void on_layer(fan *f, const Kvf__Event *ev) {
  if (!f->layer_events || ev->layer < f->first_layer || ev->layer - f->first_layer >= f->n_layers) return;
  f->layer_heads[ev->layer - f->first_layer]++;
  while (f->next_layer < f->n_layers && f->layer_heads[f->next_layer] == f->nh)
    report(f, ev, KVF__EVENT_TYPE__EVENT_LAYER_DONE, f->first_layer + f->next_layer++, 0, "");
}

/* A head's "heads 3-3, NHD ..." said of the fan's heads: "heads 2-3, NHD ...". */
static void note_transform(fan *f, const char *tf) {
  const char *rest = tf ? strstr(tf, ", ") : NULL;
  if (f->transform[0] || !tf || !tf[0]) return;
  if (strncmp(tf, "heads ", 6) == 0 && rest)
    snprintf(f->transform, sizeof(f->transform), "heads %u-%u%s", f->h0, f->h0 + f->nh - 1, rest);
  else snprintf(f->transform, sizeof(f->transform), "%s", tf);
}

static void note_peer(fan *f, const char *peer) {
  if (!peer || !peer[0] || strstr(f->peers, peer)) return;
  size_t o = strlen(f->peers);
  snprintf(f->peers + o, sizeof(f->peers) - o, "%s%s", o ? "," : "", peer);
}

bool kvf__xfan_event(kvf__session *s, const Kvf__Event *ev) {
  char base[KVF_XFER_ID_MAX + 1];
  uint32_t h;
  if (reporting || !ev->xfer_id || !parse_sub(ev->xfer_id, base, sizeof(base), &h)) return false;
  bool recv = ev->type != KVF__EVENT_TYPE__EVENT_SEND_DONE;
  fan *f = fan_find(s, base, recv);
  if (!f || h < f->h0 || h - f->h0 >= f->nh || f->ended[h - f->h0]) return false;
  if (ev->type == KVF__EVENT_TYPE__EVENT_LAYER_DONE) {
    on_layer(f, ev);
    return true;
  }
  f->ended[h - f->h0] = ev->status ? 2 : 1;
  f->open--;
  if (!ev->status) { /* what landed */
    f->bytes += ev->bytes;
    f->descs += ev->descriptors;
  }
  if (ev->path && !f->path[0]) snprintf(f->path, sizeof(f->path), "%s", ev->path);
  note_peer(f, ev->peer);
  note_transform(f, ev->transform);
  if (ev->status && !f->status) {
    f->status = ev->status;
    snprintf(f->error, sizeof(f->error), "%s", ev->error ? ev->error : "");
  }
  if (f->open > 0 || f->quiet || f->building) return true;
  finish(f, ev->type);
  return true;
}
