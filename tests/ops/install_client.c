/* install_client.c - a client built against an installed libkvferry
 * (pkg-config kvferry) and in the tree (-Iclient -Lbuild -lkvferry) by
 * tests/ops/test_install.py: connects to the daemon at argv[1], moves a
 * block within its pool "kv" and checks it.
 * Prints "install-client: ok" and exits 0 when everything works. */
#include <kvferry.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLK 4096

static int fail(const char *what, int rc) {
  fprintf(stderr, "install-client: %s: %s (%s)\n", what, kvf_strerror(rc), kvf_err_name(rc));
  return 1;
}

int main(int argc, char **argv) {
  kvf_client *c;
  kvf_pool_info pool;
  void *base;
  kvf_event ev[2];
  int rc;
  if (argc != 2) return 2;
  if ((rc = kvf_connect(argv[1], &c)) < 0) return fail("kvf_connect", rc);
  if ((rc = kvf_pool_find(c, "kv", &pool)) < 0) return fail("kvf_pool_find", rc);
  if ((rc = kvf_pool_map(c, pool.id, &base, NULL)) < 0) return fail("kvf_pool_map", rc);
  memset(base, 0x5a, BLK);
  kvf_desc src = {pool.id, 0, BLK}, dst = {pool.id, 4 * BLK, BLK};
  if ((rc = kvf_grant(c, "install-1", NULL, &dst, 1, 0)) < 0) return fail("kvf_grant", rc);
  if ((rc = kvf_send(c, "install-1", kvf_node(c), &src, 1, 0, 0)) < 0) return fail("kvf_send", rc);
  for (int got = 0; got < 2; got += rc)
    if ((rc = kvf_wait_events(c, ev + got, 2 - got, 10000)) <= 0) return fail("kvf_wait_events", rc ? rc : -110);
  if (ev[0].status || ev[1].status) return fail("transfer", ev[0].status ? ev[0].status : ev[1].status);
  if (memcmp((char *)base + 4 * BLK, base, BLK) != 0) {
    fprintf(stderr, "install-client: the block did not arrive\n");
    return 1;
  }
  if (strcmp(kvf_err_name(KVF_EDEADLINE), "KVF_EDEADLINE") != 0) return 1;
  kvf_close(c);
  printf("install-client: ok (pool %s, path %s)\n", pool.name, ev[0].path);
  return 0;
}
