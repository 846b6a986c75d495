/* test_registry.c - the registry's pieces that need no etcd: base64 as the
 * etcd gateway wants it (RFC 4648 test vectors, round trips of every byte,
 * malformed input), and the `registry`, `peer-connect` and
 * `peer-idle-close-ms` keys (accepted and refused forms). The registry
 * itself, against a real etcd: tests/ops/test_registry.py. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "registry.h"

static void test_b64_vectors(void **state) {
  static const char *const plain[] = {"", "f", "fo", "foo", "foob", "fooba", "foobar"};
  static const char *const coded[] = {"", "Zg==", "Zm8=", "Zm9v", "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"};
  for (size_t i = 0; i < 7; i++) {
    char out[16], back[16];
    kvf__b64_encode(plain[i], strlen(plain[i]), out);
    assert_string_equal(out, coded[i]);
    assert_int_equal(kvf__b64_decode(out, strlen(out), back, sizeof back), (int)strlen(plain[i]));
    assert_string_equal(back, plain[i]);
  }
}

static void test_b64_every_byte(void **state) {
  unsigned char in[256], back[260];
  char out[400];
  for (int i = 0; i < 256; i++) in[i] = (unsigned char)(255 - i);
  for (size_t n = 0; n <= 256; n += 1 + n / 8) {
    kvf__b64_encode(in, n, out);
    assert_int_equal(strlen(out), 4 * ((n + 2) / 3));
    assert_int_equal(kvf__b64_decode(out, strlen(out), (char *)back, sizeof back), (int)n);
    assert_memory_equal(back, in, n);
  }
}

static void test_b64_malformed(void **state) {
  char out[16];
  static const char *const bad[] = {"Zg=", "Z===", "Zg==Zg==", "Zm9*", "=Zm9", "Zm=v"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    if (kvf__b64_decode(bad[i], strlen(bad[i]), out, sizeof out) >= 0) fail_msg("'%s' decoded", bad[i]);
  assert_int_equal(kvf__b64_decode("Zm9vYmFy", 8, out, 6), -ENOSPC); /* 6 bytes + NUL */
}

static int parse(const char *text, kvf__config *c, char *err) {
  kvf__config_defaults(c);
  return kvf__config_parse(c, text, strlen(text), "t.conf", err, 256);
}

static void test_keys(void **state) {
  static kvf__config c;
  char err[256];
  assert_int_equal(parse("registry etcd://10.0.0.1:2379,etcd-b:2379,[::1]:2379/kvf/prod\n", &c, err), 0);
  assert_string_equal(c.registry, "etcd://10.0.0.1:2379,etcd-b:2379,[::1]:2379/kvf/prod");
  assert_int_equal(parse("registry off\n", &c, err), 0);
  assert_string_equal(c.registry, "");
  static const char *const refused[] = {
      "registry http://h:1/p\n",   "registry etcd://h:1\n",      "registry etcd://h:1/\n",
      "registry etcd://h/p\n",     "registry etcd://h:0/p\n",    "registry etcd://h:1,/p\n",
      "registry etcd://:1/p\n",    "registry-ttl-ms 1999\n",     "peer-connect lazy\n",
      "peer-idle-close-ms -1\n",
  };
  for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
    if (parse(refused[i], &c, err) == 0) fail_msg("accepted: %s", refused[i]);
  assert_int_equal(parse("peer-connect on-demand\npeer-idle-close-ms 0\nregistry-ttl-ms 2500\n", &c, err), 0);
  assert_int_equal(c.peer_connect, KVF__CONNECT_ON_DEMAND);
  assert_int_equal(c.peer_idle_close_ms, 0);
  assert_int_equal(c.registry_ttl_ms, 2500);
}

/* max-peers bounds live links: with peer-connect on-demand a file may list
 * more static peers than max-peers; eager, it may not. */
static void test_max_peers_on_demand(void **state) {
  static kvf__config c;
  char err[256];
  const char *peers = "node a\nmax-peers 1\npeer b 10.0.0.2:7470\npeer c 10.0.0.3:7470\n";
  char text[256];
  assert_int_equal(parse(peers, &c, err), 0);
  assert_int_not_equal(kvf__config_validate(&c, err, sizeof err), 0);
  snprintf(text, sizeof text, "%speer-connect on-demand\n", peers);
  assert_int_equal(parse(text, &c, err), 0);
  assert_int_equal(kvf__config_validate(&c, err, sizeof err), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_b64_vectors),  cmocka_unit_test(test_b64_every_byte),
      cmocka_unit_test(test_b64_malformed), cmocka_unit_test(test_keys),
      cmocka_unit_test(test_max_peers_on_demand),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
