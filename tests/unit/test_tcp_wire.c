/* test_tcp_wire.c - the tcp transport's batch header
 * (daemon/transport/tcp/tcp_wire.h): BATCH_SEALED rides in a data batch's
 * count and comes back out of it (the count itself unchanged), the
 * receiver's checks take a sealed batch as they take any other, and the
 * same bit in a layer marker's or a pattern batch's count is not read as
 * the flag (those headers carry other counts). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "desc.h"
#include "transport/tcp/tcp.h"
#include "transport/tcp/tcp_pattern.h"
#include "transport/tcp/tcp_wire.h"

static void test_sealed_round_trip(void **state) {
  (void)state;
  for (int sealed = 0; sealed < 2; sealed++)
    for (uint32_t count = 1; count <= BATCH_FRAMES; count += 85) {
      uint8_t raw[BHDR_LEN];
      bhdr_encode(raw, count, 0x1122334455667788ull, sealed);
      batch_hdr h;
      bhdr_decode(raw, &h);
      assert_int_equal(h.magic, DATA_MAGIC);
      assert_int_equal(h.count, count);
      assert_int_equal(h.sealed, sealed);
      assert_true(h.handle == 0x1122334455667788ull);
      assert_int_equal(check_header(&h), 0);
      /* on the wire: little-endian count, the flag in its top bit */
      assert_int_equal(raw[4], count & 0xff);
      assert_int_equal(raw[7], sealed ? 0x80 : 0);
    }
}

/* A whole sealed batch through the receiver's checks. */
static void test_sealed_batch_checks(void **state) {
  (void)state;
  uint8_t buf[BHDR_LEN + 2 * ENT_LEN];
  bhdr_encode(buf, 2, 42, true);
  ent_encode(buf + BHDR_LEN, 0, 4096, 0);
  ent_encode(buf + BHDR_LEN + ENT_LEN, 0, 4096, 8192);
  uint32_t pool = 0;
  uint64_t off = 0, len = 16384;
  kvf__descs grant = {.pool = &pool, .offset = &off, .length = &len, .n = 1, .total = len};
  kvf__rangeset rs;
  assert_int_equal(kvf__rangeset_build(&rs, &grant), 0);
  uint64_t handle = 0, bytes = 0;
  uint32_t count = 0;
  assert_int_equal(kvf__tcp_batch_check(buf, sizeof(buf), &rs, &handle, &count, &bytes, NULL), 0);
  assert_int_equal(count, 2);
  assert_int_equal(bytes, 8192);
  assert_int_equal(handle, 42);
  /* a count past BATCH_FRAMES is refused with or without the flag */
  bhdr_encode(buf, BATCH_FRAMES + 1, 42, true);
  assert_int_equal(kvf__tcp_batch_check(buf, sizeof(buf), &rs, &handle, &count, &bytes, NULL), KVF_EPROTO);
  kvf__rangeset_free(&rs);
}

static void test_other_headers_are_never_sealed(void **state) {
  (void)state;
  const uint32_t magics[] = {LAYER_MAGIC, KVF__TCP_PAT_MAGIC};
  for (size_t i = 0; i < 2; i++) {
    uint8_t raw[BHDR_LEN];
    put32(raw, magics[i]);
    put32(raw + 4, 0x80000003u);
    put64(raw + 8, 7);
    batch_hdr h;
    bhdr_decode(raw, &h);
    assert_false(h.sealed);
    assert_int_equal(h.count, 0x80000003u); /* left for that header's own checks */
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sealed_round_trip),
      cmocka_unit_test(test_sealed_batch_checks),
      cmocka_unit_test(test_other_headers_are_never_sealed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
