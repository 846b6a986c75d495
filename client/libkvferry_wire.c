/* libkvferry_wire.c - the hand-written request encoder of client_int.h.
 * Every size is computed before a byte is written, so a message goes out
 * in one pass, nested lengths first. */
#include "client_int.h"

#include <string.h>

/* Wire types: varint 0, length-delimited 2. */
#define TAG(num, type) ((uint8_t)(((num) << 3) | (type)))

static size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  *p++ = (uint8_t)v;
  return p;
}

/* A varint field (left out when 0, as proto3 does). */
static size_t uint_size(uint64_t v) { return v ? 1 + varint_size(v) : 0; }

static uint8_t *put_uint(uint8_t *p, uint8_t tag, uint64_t v) {
  if (!v) return p;
  *p++ = tag;
  return put_varint(p, v);
}

/* A length-delimited field of len bytes; always when forced (a
 * submessage that is present), else left out when empty. */
static size_t bytes_size(size_t len, bool forced) { return len || forced ? 1 + varint_size(len) + len : 0; }

static uint8_t *put_bytes(uint8_t *p, uint8_t tag, const void *data, size_t len, bool forced) {
  if (!len && !forced) return p;
  *p++ = tag;
  p = put_varint(p, len);
  if (len) memcpy(p, data, len);
  return p + len;
}

/* A submessage's header only; its body follows. */
static uint8_t *put_head(uint8_t *p, uint8_t tag, size_t len) {
  *p++ = tag;
  return put_varint(p, len);
}


/* DescList (packed = 4) or BlockList (layout 1, ids 2, first_layer 3,
 * n_layers 4). */
static size_t descs_body(const kvf__wire_req *r) { return bytes_size(r->descs_len, false); }

static size_t blocks_body(const kvf__wire_req *r) {
  return uint_size(r->layout) + bytes_size(r->ids_len, false) + uint_size(r->first_layer) + uint_size(r->n_layers);
}

static uint8_t *put_descs(uint8_t *p, uint8_t tag, const kvf__wire_req *r) {
  p = put_head(p, tag, descs_body(r));
  return put_bytes(p, TAG(4, 2), r->descs, r->descs_len, false);
}

static uint8_t *put_blocks(uint8_t *p, uint8_t tag, const kvf__wire_req *r) {
  p = put_head(p, tag, blocks_body(r));
  p = put_uint(p, TAG(1, 0), r->layout);
  p = put_bytes(p, TAG(2, 2), r->ids, r->ids_len, false);
  p = put_uint(p, TAG(3, 0), r->first_layer);
  return put_uint(p, TAG(4, 0), r->n_layers);
}

static size_t lists_size(const kvf__wire_req *r) {
  return (r->has_descs ? bytes_size(descs_body(r), true) : 0) + (r->has_blocks ? bytes_size(blocks_body(r), true) : 0);
}

/* GrantReq: xfer_id 1, src_node 2, descs 3, deadline_ms 4, blocks 5,
 * layer_events 6, no_reply 7. SendReq: xfer_id 1, dst_node 2, descs 3,
 * more 4, deadline_ms 5, chained 6 (never), blocks 7, continues 8,
 * no_reply 9. CancelReq: xfer_id 1, no_reply 2. */
static size_t body_size(const kvf__wire_req *r) {
  size_t n = bytes_size(r->id_len, false);
  if (r->kind == KVF__WIRE_CANCEL) return n + uint_size(r->no_reply);
  n += bytes_size(r->node_len, false) + lists_size(r) + uint_size(r->deadline_ms) + uint_size(r->no_reply);
  if (r->kind == KVF__WIRE_GRANT) return n + uint_size(r->layer_events);
  return n + uint_size(r->more) + uint_size(r->continues);
}

static uint8_t *put_grant(uint8_t *p, const kvf__wire_req *r) {
  p = put_bytes(p, TAG(2, 2), r->node, r->node_len, false);
  if (r->has_descs) p = put_descs(p, TAG(3, 2), r);
  p = put_uint(p, TAG(4, 0), r->deadline_ms);
  if (r->has_blocks) p = put_blocks(p, TAG(5, 2), r);
  p = put_uint(p, TAG(6, 0), r->layer_events);
  return put_uint(p, TAG(7, 0), r->no_reply);
}

static uint8_t *put_send(uint8_t *p, const kvf__wire_req *r) {
  p = put_bytes(p, TAG(2, 2), r->node, r->node_len, false);
  if (r->has_descs) p = put_descs(p, TAG(3, 2), r);
  p = put_uint(p, TAG(4, 0), r->more);
  p = put_uint(p, TAG(5, 0), r->deadline_ms);
  if (r->has_blocks) p = put_blocks(p, TAG(7, 2), r);
  p = put_uint(p, TAG(8, 0), r->continues);
  return put_uint(p, TAG(9, 0), r->no_reply);
}

/* ApiRequest: seq 1, grant 13, send 14, cancel 15. */
static uint8_t body_tag(const kvf__wire_req *r) {
  return r->kind == KVF__WIRE_GRANT ? TAG(13, 2) : r->kind == KVF__WIRE_SEND ? TAG(14, 2) : TAG(15, 2);
}

size_t kvf__wire_size(kvf__wire_req *r) {
  r->id_len = r->xfer_id ? strlen(r->xfer_id) : 0;
  r->node_len = r->node ? strlen(r->node) : 0;
  r->body_len = body_size(r);
  return uint_size(r->seq) + bytes_size(r->body_len, true);
}

void kvf__wire_pack(const kvf__wire_req *r, uint8_t *out) {
  uint8_t *p = put_uint(out, TAG(1, 0), r->seq);
  p = put_head(p, body_tag(r), r->body_len);
  p = put_bytes(p, TAG(1, 2), r->xfer_id, r->id_len, false);
  if (r->kind == KVF__WIRE_GRANT) put_grant(p, r);
  else if (r->kind == KVF__WIRE_SEND) put_send(p, r);
  else put_uint(p, TAG(2, 0), r->no_reply);
}
