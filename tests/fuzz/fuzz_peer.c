/* fuzz_peer.c - the peer-protocol decoder, fed as peer B's connection
 * feeds it.
 *
 * Before each input, this node's clients set up transfers with B, C and
 * themselves (scenario() below: grants pushed to B and C, a grant waiting
 * for any sender, sends waiting for B's grant, one still taking parts, a
 * local pair), so that what B says has something to act on. Our grants'
 * handles count from 1 at every input's start as seen by B: a handle of
 * 1..15 in SendDone, or in a Cancel to the receiver, names the scenario's
 * grants in order (g1, g2, g3, l1), whatever the state machine's counter
 * says after earlier inputs.
 *
 * Control stream (any input not starting with "KVFD"): B's established
 * connection. Bytes go through a frame buffer with max-frame in chunks,
 * each frame is unpacked as a PeerMsg and dispatched as peer.c's on_frame
 * does for an established connection: Goodbye, an undecodable or an
 * oversized frame take the peer down (its transfers fail); Heartbeat only
 * counts as life; anything else goes to kvf__xfer_on_peer_msg. After each
 * frame, posts complete and open grants land.
 *
 * Data stream (an input starting with "KVFD", a tcp data batch's magic):
 * batches as a tcp receiver thread reads them, checked by the transport's
 * own kvf__tcp_batch_check against grant g1's ranges: a malformed batch
 * ends the stream; one outside the grant fails g1 (as the tcp transport's
 * EV_DATA_ERROR does); one for another handle is skipped; the payload of a
 * good one is written into the pools, where every entry must lie. Pattern
 * batches ("KVFP", tcp_pattern.h) too, checked by kvf__tcp_pattern_check:
 * one it lets through must have every piece in the grant (a plain walk of
 * each piece), and its payload goes where kvf__tcp_pat_iov places it. */
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "fuzz_common.h"
#include "pool.h"
#include "transport/tcp/tcp.h"
#include "transport/tcp/tcp_pattern.h"

static kvf__xfer *find(const char *id, int role) {
  for (kvf__xfer *x = kvf__xfer_first(); x; x = x->next)
    if (x->role == role && strcmp(x->id, id) == 0) return x;
  return NULL;
}

static void must(int rc, const char *what) {
  if (rc) fz_fail("scenario: %s: %d", what, rc);
}

static void do_grant(const char *id, const char *src, const uint64_t (*t)[3], size_t n) {
  char err[256];
  kvf__descs d = fz_descs(t, n);
  must(kvf__xfer_grant(FZ_SR, id, src, &d, 0, err, sizeof(err)), id);
  kvf__descs_free(&d);
}

static void do_send(const char *id, const char *dst, const uint64_t (*t)[3], size_t n, bool more) {
  char err[256];
  kvf__descs d = fz_descs(t, n);
  must(kvf__xfer_send(FZ_SS, id, dst, &d, more, 0, err, sizeof(err)), id);
  kvf__descs_free(&d);
}

/* What the fixtures in gen_corpus.c refer to (by id, by handle 1..4). */
static const uint64_t G1[][3] = {{0, 0, 4096}, {0, 4096, 4096}, {0, 12288, 100}, {1, 0, 65536}, {1, 200000, 1000}};
static const uint64_t G2[][3] = {{1, 65536, 16384}};
static const uint64_t G3[][3] = {{0, 16384, 8192}};
static const uint64_t L1[][3] = {{0, 49152, 4096}};
static const uint64_t S1[][3] = {{1, 98304, 4096}, {1, 106496, 4096}};
static const uint64_t S2[][3] = {{1, 131072, 8192}};
static const uint64_t S3[][3] = {{0, 32768, 4096}};
static const uint64_t SL1[][3] = {{1, 196608, 4096}};
#define N(a) (sizeof(a) / sizeof((a)[0]))

static uint64_t base_handle;

static void scenario(void) {
  do_grant("g1", FZ_PEER_B, G1, N(G1)); /* pushed to B: open, handle 1 */
  do_grant("g2", "", G2, N(G2));        /* any sender: waits, handle 2 */
  do_grant("g3", FZ_PEER_C, G3, N(G3)); /* pushed to C, handle 3 */
  do_grant("l1", "", L1, N(L1));        /* handle 4; its local send below */
  do_send("s1", FZ_PEER_B, S1, N(S1), false);
  do_send("s2", FZ_PEER_B, S2, N(S2), true); /* more parts would follow */
  do_send("s3", FZ_PEER_C, S3, N(S3), false);
  do_send("l1", FZ_NODE, SL1, N(SL1), false);
  fz_pump(false);
  kvf__xfer *g1 = find("g1", KVF__RECV);
  if (!g1) fz_fail("scenario: no g1");
  base_handle = g1->handle;
}

static uint64_t our_handle(uint64_t h) { return h >= 1 && h < 16 ? base_handle + h - 1 : h; }

static void peer_down(void) {
  fz_b->state = KVF__PEER_DOWN;
  kvf__xfer_on_peer_down(fz_b);
}

/* One frame, as peer.c's on_frame for B's established connection; false
 * when the connection is closed. */
static bool on_frame(const uint8_t *buf, uint32_t len) {
  Kvf__PeerMsg *m = kvf__peer_msg__unpack(NULL, len, buf);
  if (!m) {
    peer_down();
    return false;
  }
  bool open = true;
  switch (m->body_case) {
  case KVF__PEER_MSG__BODY_GOODBYE:
    peer_down();
    open = false;
    break;
  case KVF__PEER_MSG__BODY_HEARTBEAT: break;
  case KVF__PEER_MSG__BODY_SEND_DONE:
    m->send_done->handle = our_handle(m->send_done->handle);
    kvf__xfer_on_peer_msg(fz_b, m);
    break;
  case KVF__PEER_MSG__BODY_CANCEL:
    if (!m->cancel->to_sender) m->cancel->handle = our_handle(m->cancel->handle);
    kvf__xfer_on_peer_msg(fz_b, m);
    break;
  case KVF__PEER_MSG__BODY_CANCEL_DONE:
    m->cancel_done->handle = our_handle(m->cancel_done->handle);
    kvf__xfer_on_peer_msg(fz_b, m);
    break;
  default: kvf__xfer_on_peer_msg(fz_b, m); break;
  }
  kvf__peer_msg__free_unpacked(m, NULL);
  return open;
}

static void control_stream(const uint8_t *data, size_t size) {
  static const size_t chunks[] = {3, 1, 200, 7, 4096, 65536};
  kvf__framebuf fb;
  kvf__framebuf_init(&fb, FZ_MAX_FRAME);
  bool open = true;
  size_t off = 0;
  for (size_t k = 0; open && off < size; k++) {
    size_t n = chunks[k % (sizeof(chunks) / sizeof(chunks[0]))];
    if (n > size - off) n = size - off;
    if (kvf__framebuf_append(&fb, data + off, n) != 0) fz_fail("out of memory");
    off += n;
    while (open) {
      const uint8_t *p;
      uint32_t len;
      int rc = kvf__framebuf_next(&fb, &p, &len);
      if (rc == 0) break;
      if (rc < 0) { /* oversized: the connection is closed */
        peer_down();
        open = false;
        break;
      }
      open = on_frame(p, len);
      fz_pump(true);
    }
  }
  kvf__framebuf_free(&fb);
}

/* Whether every byte of [start, start + len) in pool lies in one of d's
 * descriptors: a plain walk, independent of desc.c's range set. */
static bool granted(const kvf__descs *d, uint32_t pool, uint64_t start, uint64_t len) {
  if (len == 0 || start + len < start) return false;
  uint64_t pos = start, end = start + len;
  while (pos < end) {
    uint64_t next = pos;
    for (size_t i = 0; i < d->n; i++)
      if (d->pool[i] == pool && d->offset[i] <= pos && pos - d->offset[i] < d->length[i] &&
          d->offset[i] + d->length[i] > next)
        next = d->offset[i] + d->length[i];
    if (next == pos) return false;
    pos = next;
  }
  return true;
}

/* A pattern batch at data (size bytes left): its verdict against g1 (the
 * plain walk of every piece where the check let it through), then its
 * payload placed as the receiver does. Returns the bytes it took, 0 when
 * malformed (the stream ends). *alive: g1 still open. */
static size_t pattern_batch(const uint8_t *data, size_t size, kvf__xfer *g1, const kvf__rangeset *rs, bool *alive,
                            uint64_t *landed) {
  uint64_t handle, bytes;
  uint32_t count;
  int rc = kvf__tcp_pattern_check(data, size, rs, &handle, &count, &bytes);
  if (rc != 0 && rc != KVF_EPERM) return 0;
  kvf__tcp_pat pe[KVF__TCP_BATCH_MAX];
  uint64_t b2;
  if (kvf__tcp_pat_decode(data + KVF__TCP_BATCH_HDR, count, pe, &b2) != 0 || b2 != bytes)
    fz_fail("a pattern batch decodes differently the second time");
  size_t off = KVF__TCP_BATCH_HDR + (size_t)count * KVF__TCP_PAT_ENT;
  bool ours = *alive && handle == g1->handle;
  if (rc == KVF_EPERM && ours) {
    kvf__xfer_on_data_error(g1, KVF_EPERM, "the peer wrote outside the grant");
    *alive = false;
  } else if (rc == 0 && ours) {
    for (uint32_t i = 0; i < count; i++) {
      kvf__pool *p = pe[i].pool < kvfd.n_pools ? kvfd.pools[pe[i].pool] : NULL;
      uint64_t next = 0, total = (uint64_t)pe[i].n1 * pe[i].n2;
      for (uint64_t k = 0; k < total; k++) { /* every piece, from the definition */
        uint64_t at = pe[i].off + k / pe[i].n1 * pe[i].s2 + k % pe[i].n1 * pe[i].s1;
        if (!p || !granted(&g1->dst, pe[i].pool, at, pe[i].len) || kvf__pool_check_range(p, at, pe[i].len) != 0)
          fz_fail("pattern %u piece %llu (pool %u offset %llu len %u) passed the check but lies outside grant g1",
                  i, (unsigned long long)k, pe[i].pool, (unsigned long long)at, pe[i].len);
      }
      struct iovec iov[64];
      int n;
      while ((n = kvf__tcp_pat_iov(&pe[i], p->base, &next, iov, 64)) > 0)
        for (int j = 0; j < n && off < size; j++) {
          size_t take = iov[j].iov_len < size - off ? iov[j].iov_len : size - off;
          memcpy(iov[j].iov_base, data + off, take);
          off += take;
        }
    }
    *landed += bytes;
    if (*landed == g1->dst.total) kvf__xfer_on_landed(g1);
    return off < size ? off : size;
  }
  off += bytes < size - off ? (size_t)bytes : size - off; /* skipped */
  return off;
}

static void data_stream(const uint8_t *data, size_t size) {
  kvf__xfer *g1 = find("g1", KVF__RECV);
  kvf__rangeset rs;
  if (!g1 || kvf__rangeset_build(&rs, &g1->dst) != 0) fz_fail("no grant g1 to write into");
  uint64_t total = g1->dst.total, landed = 0;
  bool alive = true;
  kvf__range ents[KVF__TCP_BATCH_MAX];
  size_t off = 0;
  while (off < size) {
    if (size - off >= 4 && memcmp(data + off, "KVFP", 4) == 0) {
      size_t took = pattern_batch(data + off, size - off, g1, &rs, &alive, &landed);
      if (took == 0) break;
      off += took;
      continue;
    }
    uint64_t handle, bytes;
    uint32_t count;
    int rc = kvf__tcp_batch_check(data + off, size - off, &rs, &handle, &count, &bytes, ents);
    if (rc != 0 && rc != KVF_EPERM) break; /* malformed: the stream is closed */
    off += KVF__TCP_BATCH_HDR + (size_t)count * KVF__TCP_BATCH_ENT;
    if (alive) { /* the verdict must be the plain walk's */
      uint32_t outside = count;
      for (uint32_t i = 0; i < count && outside == count; i++)
        if (!granted(&g1->dst, ents[i].pool, ents[i].start, ents[i].end - ents[i].start)) outside = i;
      const kvf__range *e = &ents[outside < count ? outside : 0];
      if ((rc == 0) != (outside == count))
        fz_fail("batch of %u entries: entry %u (pool %u offset %llu len %llu) is %s grant g1, the receiver "
                "says the batch is %s", count, outside, e->pool, (unsigned long long)e->start,
                (unsigned long long)(e->end - e->start), outside == count ? "all inside" : "outside",
                rc ? "outside" : "inside");
    }
    bool ours = alive && handle == g1->handle;
    if (rc == KVF_EPERM && ours) {
      kvf__xfer_on_data_error(g1, KVF_EPERM, "the peer wrote outside the grant");
      alive = false; /* g1 failed: its grant is closed, later batches are skipped */
    } else if (rc == 0 && ours) {
      for (uint32_t i = 0; i < count && off < size; i++) {
        uint64_t len = ents[i].end - ents[i].start;
        kvf__pool *p = ents[i].pool < kvfd.n_pools ? kvfd.pools[ents[i].pool] : NULL;
        if (!p || kvf__pool_check_range(p, ents[i].start, len) != 0)
          fz_fail("batch entry %u (pool %u [%llu, %llu)) passed the checks but lies outside the pools", i,
                  ents[i].pool, (unsigned long long)ents[i].start, (unsigned long long)ents[i].end);
        size_t n = len < size - off ? (size_t)len : size - off;
        memcpy(p->base + ents[i].start, data + off, n);
        off += n;
      }
      landed += bytes;
      if (landed == total) kvf__xfer_on_landed(g1);
      continue;
    }
    off += bytes < size - off ? (size_t)bytes : size - off; /* skipped */
  }
  kvf__rangeset_free(&rs);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  fz_init(false, true);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  scenario();
  if (size >= 4 && (memcmp(data, "KVFD", 4) == 0 || memcmp(data, "KVFP", 4) == 0)) data_stream(data, size);
  else control_stream(data, size);
  fz_finish(true);
  fz_b->state = KVF__PEER_UP;
  return 0;
}
