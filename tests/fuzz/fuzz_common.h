/* fuzz_common.h - what the libFuzzer targets share (tests/fuzz/README.md).
 *
 * The daemon's context as kvferryd sets it up, minus the sockets: node "A"
 * with two small real host pools (memfd, as kvf__pool_create makes them),
 * the transfer state machine (daemon/xfer.c) on a real libuv loop, peers
 * "B" and "C" as plain structs, and fake transports that check every run
 * they are handed against the pools (the local one copies the bytes) and
 * complete posts only when the harness pumps them, so that a run is the same
 * for the same input. fz_finish() fails whatever an input left behind and
 * checks that nothing leaked: no transfer, pre-grant, intent, post or open
 * grant outlives its input. */
#ifndef KVF_FUZZ_COMMON_H
#define KVF_FUZZ_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "desc.h"
#include "kvferryd.h"
#include "peer.h"
#include "xfer.h"

/* The scenario every target and the seed generator (gen_corpus.c) agree on. */
#define FZ_NODE "A"
#define FZ_PEER_B "B"            /* up */
#define FZ_PEER_C "C"            /* up for fuzz_peer, down for fuzz_api */
#define FZ_POOL0_SIZE (64u << 10)
#define FZ_POOL1_SIZE (256u << 10)
#define FZ_MAX_FRAME (64u << 10)  /* max-frame: the frame buffers' limit */
#define FZ_MAX_DESCS 64           /* max-descs */
#define FZ_MAX_XFERS 16           /* max-transfers-per-client */
#define FZ_MAX_WAITING 6u /* max-peer-waiting: inputs reach it */

extern kvf__peer *fz_b, *fz_c;

/* Call once (LLVMFuzzerInitialize). api_env: events and per-client counts
 * go through daemon/api.c (kvf__api_emit, kvf__api_session_xfers), else to
 * the fakes here (fz_emit checks that each event packs). */
void fz_init(bool api_env, bool c_up);

/* Completes the posts handed to the transports so far, in order (aborted
 * ones with KVF_ECANCELED); with land, then tells the state machine that
 * every open grant has all its bytes (kvf__xfer_on_landed), as the tcp
 * transport does once the data is in. */
void fz_pump(bool land);

/* Sessions of fuzz_peer's local clients: dummy addresses, counted. */
#define FZ_NSESS 2
extern char fz_sess_mem[FZ_NSESS];
#define FZ_SR ((kvf__session *)&fz_sess_mem[0])
#define FZ_SS ((kvf__session *)&fz_sess_mem[1])

/* Descriptors from (pool, offset, length) triples, through the wire form
 * (kvf__descs_from_wire, as a request's); n <= FZ_MAX_DESCS. */
kvf__descs fz_descs(const uint64_t (*t)[3], size_t n);

/* The end of one input: fails every transfer left (the fake sessions go
 * away when fake_sessions, then both peers), completes what the transports
 * hold, checks that nothing leaked (abort() otherwise) and drops the
 * metrics' series. */
void fz_finish(bool fake_sessions);

/* With KVF_FUZZ_STRICT=1 in the environment: fails unless status is 0 or
 * a known error (kvf_err_name knows it). Off by default, as is the check
 * that a local copy's source and destination do not overlap: both fail
 * today (README.md, "Findings"). */
void fz_check_status(int status, const char *what);

/* Calls abort() after printing why: a broken invariant is a crash. */
void fz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#endif
