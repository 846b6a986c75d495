/* fuzz_api.c - the local API decoder, fed as a client's socket feeds it.
 *
 * The input is the byte stream one client writes to kvferryd's Unix socket.
 * It goes through daemon/api.c exactly as reads do (kvf__api_feed: the
 * frame buffer with max-frame, ApiRequest unpack, the requests, the
 * descriptor checks against the real pools, the transfer state machine),
 * in chunks of varying size so that frames arrive split. Between chunks
 * the fake transports complete what was posted (local copies land in the
 * pools). What the daemon writes back must decode, and every request it
 * decoded gets exactly one response, with its seq, in order, until the
 * session is closed. At the end the client goes away and nothing may be
 * left behind (fuzz_common.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"
#include "frame.h"
#include "fuzz_common.h"

#define MAX_SEQS 4096

static struct {
  uint64_t resp_seq[MAX_SEQS];
  size_t nresp;
  size_t nevents;
} R;

static void sink(kvf__session *s, const uint8_t *frame, size_t len, int fd, void *arg) {
  if (len < KVF__FRAME_HDR || kvf__frame_get_u32(frame) != len - KVF__FRAME_HDR)
    fz_fail("the daemon wrote a frame whose header does not match its length");
  Kvf__ApiMessage *m = kvf__api_message__unpack(NULL, len - KVF__FRAME_HDR, frame + KVF__FRAME_HDR);
  if (!m) fz_fail("the daemon wrote an undecodable ApiMessage");
  if (getenv("KVF_FUZZ_VERBOSE")) {
    if (m->body_case == KVF__API_MESSAGE__BODY_RESPONSE)
      fprintf(stderr, "response seq %llu status %d %s%s\n", (unsigned long long)m->response->seq,
              m->response->status, m->response->error ? m->response->error : "", fd >= 0 ? " (fd)" : "");
    else if (m->body_case == KVF__API_MESSAGE__BODY_EVENT)
      fprintf(stderr, "event %s '%s' status %d path %s peer %s bytes %llu %s\n",
              m->event->type == KVF__EVENT_TYPE__EVENT_RECV_DONE ? "RECV_DONE" : "SEND_DONE", m->event->xfer_id,
              m->event->status, m->event->path, m->event->peer, (unsigned long long)m->event->bytes, m->event->error);
  }
  if (m->body_case == KVF__API_MESSAGE__BODY_RESPONSE) {
    if ((m->response->body_case == KVF__API_RESPONSE__BODY_MAP) != (fd >= 0))
      fz_fail("a pool fd rides with a response other than MapResp, or a MapResp without one");
    if (R.nresp < MAX_SEQS) R.resp_seq[R.nresp] = m->response->seq;
    R.nresp++;
    fz_check_status(m->response->status, "a response");
  } else if (m->body_case == KVF__API_MESSAGE__BODY_EVENT) {
    fz_check_status(m->event->status, "an event");
    R.nevents++;
  } else {
    fz_fail("the daemon wrote an ApiMessage with no body");
  }
  kvf__api_message__free_unpacked(m, NULL);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  fz_init(true, false);
  return 0;
}

/* The requests the daemon should answer, by seq: the same framing, up to
 * the first frame it must refuse; after hello, a chained SendReq (a frame
 * of a call that more frames continue) is answered by the call's last, and
 * a SendReq, GrantReq or CancelReq with no_reply (KVF_NOWAIT) not at all. */
static size_t expected_seqs(const uint8_t *data, size_t size, uint64_t *seqs) {
  kvf__framebuf fb;
  kvf__framebuf_init(&fb, FZ_MAX_FRAME);
  kvf__framebuf_append(&fb, data, size);
  size_t n = 0;
  bool hello_done = false;
  const uint8_t *p;
  uint32_t len;
  while (kvf__framebuf_next(&fb, &p, &len) == 1) {
    Kvf__ApiRequest *q = kvf__api_request__unpack(NULL, len, p);
    if (!q) break;
    bool silent = hello_done && ((q->body_case == KVF__API_REQUEST__BODY_SEND && (q->send->chained || q->send->no_reply)) ||
                                 (q->body_case == KVF__API_REQUEST__BODY_GRANT && q->grant->no_reply) ||
                                 (q->body_case == KVF__API_REQUEST__BODY_CANCEL && q->cancel->no_reply));
    /* Every version from 1 up is served (api.c, on_hello). */
    if (q->body_case == KVF__API_REQUEST__BODY_HELLO && q->hello->version >= 1 && q->hello->version <= KVF__API_VERSION)
      hello_done = true;
    if (!silent && n < MAX_SEQS) seqs[n] = q->seq;
    if (!silent) n++;
    kvf__api_request__free_unpacked(q, NULL);
  }
  kvf__framebuf_free(&fb);
  return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const size_t chunks[] = {5, 1, 300, 2, 64, 4093, 17, 65536};
  static uint64_t want[MAX_SEQS];
  memset(&R, 0, sizeof(R));
  kvf__session *s = kvf__api_session_detached(getpid(), geteuid(), getegid(), sink, NULL);
  if (!s) fz_fail("no session");
  size_t off = 0;
  for (size_t k = 0; off < size; k++) {
    size_t n = chunks[k % (sizeof(chunks) / sizeof(chunks[0]))];
    if (n > size - off) n = size - off;
    int rc = kvf__api_feed(s, data + off, n);
    off += n;
    fz_pump(false);
    if (rc) break;
  }
  bool closed = kvf__api_session_closed(s);
  size_t nwant = expected_seqs(data, size, want);
  if (R.nresp > nwant) fz_fail("%zu responses to %zu requests", R.nresp, nwant);
  if (!closed && R.nresp != nwant) fz_fail("%zu responses to %zu requests, session open", R.nresp, nwant);
  for (size_t i = 0; i < R.nresp && i < MAX_SEQS; i++)
    if (R.resp_seq[i] != want[i])
      fz_fail("response %zu has seq %llu, request %zu had %llu", i, (unsigned long long)R.resp_seq[i], i,
              (unsigned long long)want[i]);
  kvf__api_session_free(s);
  if (kvf__api_sessions() != 0) fz_fail("a session outlived its client");
  fz_finish(false);
  return 0;
}
