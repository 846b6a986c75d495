/* test_wire.c - the hand-written request encoder of libkvferry
 * (client/libkvferry_wire.c, what kvf_submit writes) against protobuf-c:
 * for random grants, sends and cancels, with and without every field,
 * small and large values (every varint length), the bytes must be
 * protobuf-c's, so that the daemon reads what it always read. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"
#include "kvferry.pb-c.h"

static uint64_t rnd(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* 0, small, or wide: every varint length shows up. */
static uint32_t some_u32(uint64_t *s) {
  switch (rnd(s) % 4) {
  case 0: return 0;
  case 1: return (uint32_t)(rnd(s) % 128);
  case 2: return (uint32_t)(rnd(s) % 20000);
  default: return (uint32_t)rnd(s);
  }
}

static char *some_str(uint64_t *s, char *buf, size_t cap) {
  size_t n = rnd(s) % 4 == 0 ? 0 : rnd(s) % (cap - 1);
  for (size_t i = 0; i < n; i++) buf[i] = (char)('a' + rnd(s) % 26);
  buf[n] = '\0';
  return rnd(s) % 8 == 0 ? NULL : buf;
}

static size_t some_len(uint64_t *s, size_t unit) {
  switch (rnd(s) % 4) {
  case 0: return 0;
  case 1: return unit;
  case 2: return unit * (rnd(s) % 40);
  default: return unit * (rnd(s) % 9000); /* lengths past two varint bytes */
  }
}

/* The protobuf-c form of w. */
static size_t pack_reference(const kvf__wire_req *w, uint8_t *out) {
  Kvf__DescList dl = KVF__DESC_LIST__INIT;
  Kvf__BlockList bl = KVF__BLOCK_LIST__INIT;
  Kvf__GrantReq g = KVF__GRANT_REQ__INIT;
  Kvf__SendReq q = KVF__SEND_REQ__INIT;
  Kvf__CancelReq x = KVF__CANCEL_REQ__INIT;
  Kvf__ApiRequest req = KVF__API_REQUEST__INIT;
  req.seq = w->seq;
  dl.packed = (ProtobufCBinaryData){w->descs_len, (uint8_t *)w->descs};
  bl.layout = w->layout;
  bl.ids = (ProtobufCBinaryData){w->ids_len, (uint8_t *)w->ids};
  bl.first_layer = w->first_layer;
  bl.n_layers = w->n_layers;
  char *id = (char *)(w->xfer_id ? w->xfer_id : ""), *node = (char *)(w->node ? w->node : "");
  if (w->kind == KVF__WIRE_GRANT) {
    g.xfer_id = id;
    g.src_node = node;
    g.descs = w->has_descs ? &dl : NULL;
    g.blocks = w->has_blocks ? &bl : NULL;
    g.deadline_ms = w->deadline_ms;
    g.layer_events = w->layer_events;
    g.no_reply = w->no_reply;
    req.body_case = KVF__API_REQUEST__BODY_GRANT;
    req.grant = &g;
  } else if (w->kind == KVF__WIRE_SEND) {
    q.xfer_id = id;
    q.dst_node = node;
    q.descs = w->has_descs ? &dl : NULL;
    q.blocks = w->has_blocks ? &bl : NULL;
    q.more = w->more;
    q.deadline_ms = w->deadline_ms;
    q.continues = w->continues;
    q.no_reply = w->no_reply;
    req.body_case = KVF__API_REQUEST__BODY_SEND;
    req.send = &q;
  } else {
    x.xfer_id = id;
    x.no_reply = w->no_reply;
    req.body_case = KVF__API_REQUEST__BODY_CANCEL;
    req.cancel = &x;
  }
  return kvf__api_request__pack(&req, out);
}

static void test_matches_protobuf_c(void **state) {
  (void)state;
  uint64_t seed = 0x1234567887654321ull;
  size_t cap = 1u << 20;
  uint8_t *list = malloc(cap), *a = malloc(cap), *b = malloc(cap);
  assert_non_null(list);
  assert_non_null(a);
  assert_non_null(b);
  for (size_t i = 0; i < cap; i++) list[i] = (uint8_t)rnd(&seed);
  for (int iter = 0; iter < 20000; iter++) {
    char id[130], node[64];
    kvf__wire_req w = {.kind = 1 + (int)(rnd(&seed) % 3)};
    w.seq = rnd(&seed) % 3 == 0 ? some_u32(&seed) : rnd(&seed);
    w.xfer_id = some_str(&seed, id, sizeof(id));
    if (w.kind != KVF__WIRE_CANCEL) {
      w.node = some_str(&seed, node, sizeof(node));
      int which = (int)(rnd(&seed) % 3); /* descs, blocks, or (malformed, still encoded) neither */
      w.has_descs = which == 0;
      w.has_blocks = which == 1;
      w.descs = list;
      w.descs_len = w.has_descs ? some_len(&seed, 20) : 0;
      w.ids = list;
      w.ids_len = w.has_blocks ? some_len(&seed, 4) : 0;
      w.layout = some_u32(&seed);
      w.first_layer = some_u32(&seed);
      w.n_layers = some_u32(&seed);
      w.deadline_ms = some_u32(&seed);
      w.more = rnd(&seed) % 2;
      w.continues = rnd(&seed) % 2;
      w.layer_events = w.kind == KVF__WIRE_GRANT && rnd(&seed) % 2;
      if (w.kind != KVF__WIRE_SEND) w.more = w.continues = false;
    }
    w.no_reply = rnd(&seed) % 4 != 0;
    size_t n = kvf__wire_size(&w);
    assert_true(n < cap);
    kvf__wire_pack(&w, a);
    size_t m = pack_reference(&w, b);
    if (n != m || memcmp(a, b, n) != 0) {
      fprintf(stderr, "iteration %d: kind %d, %zu bytes against protobuf-c's %zu\n", iter, w.kind, n, m);
      fail();
    }
  }
  free(list);
  free(a);
  free(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matches_protobuf_c),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
