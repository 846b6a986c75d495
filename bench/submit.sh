#!/usr/bin/env bash
# submit.sh - how long the send calls take to return (issue 16): one layer
# part (kvf_send_blocks of one layer of 8 blocks, KVF_SEND_MORE) with
# KVF_NOWAIT against waiting for the daemon, and 16 requests x 32 layers
# (512 parts) in one kvf_submit against 512 waiting calls, in the same run
# (bench/submit_bench.c: every transfer's bytes are verified).
#
# It starts its own daemons: two kvferryd peered over tcp on loopback, and
# one with two pools (the local path). Goals: one part <= 5 us p50, a batch
# of 512 <= 100 us p50.
#
# Usage: bench/submit.sh [BUILD_DIR]        (default $BUILD or build)
# Environment: REPS (requests per api, part; default 64), BATCHES (per api;
# default 16), BLOCK_BYTES (default 4096), RUNS (default 3: the whole
# bench again, each run printed; the machine is noisy), HANDOFFS (default
# 200) and SPINS (default "0 20 50"): the one-layer handoff, send call to
# RECV_DONE taken, with the decode client's KVFERRY_SPIN_US at each value.
# Prints each run's JSON lines and a Markdown table of them.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-${BUILD:-build}}
REPS=${REPS:-64}
BATCHES=${BATCHES:-16}
BLOCK_BYTES=${BLOCK_BYTES:-4096}
RUNS=${RUNS:-3}
HANDOFFS=${HANDOFFS:-200}
SPINS=${SPINS:-0 20 50}
. bench/lib.sh

say() { echo "submit: $*" >&2; }
die() { say "$*"; exit 1; }
for bin in kvferryd kvferryctl submit-bench; do
  [ -x "$BUILD/$bin" ] || die "$BUILD/$bin missing (make all bench-tools)"
done
bench_setup submit

# Each pool: 2 x 32 layers x 128 blocks x BLOCK_BYTES, and room.
POOL_MB=$(( 2 * 32 * 128 * BLOCK_BYTES / 1048576 + 8 ))
bench_pair a b "pool kv host ${POOL_MB}M"
bench_conf l "$(bench_free_ports 1)" <<EOF
pool kv host ${POOL_MB}M
pool kv2 host ${POOL_MB}M
EOF
bench_start l

ARGS=(--reps "$REPS" --batches "$BATCHES" --block-bytes "$BLOCK_BYTES")
: >"$TMP/all.json"
for run in $(seq 1 "$RUNS"); do
  for path in tcp local; do
    if [ $path = tcp ]; then where=(--from "$TMP/a.sock" --to "$TMP/b.sock")
    else where=(--from "$TMP/l.sock" --to "$TMP/l.sock" --pool kv --pool-to kv2); fi
    "$BUILD/submit-bench" "${where[@]}" "${ARGS[@]}" >"$TMP/run.json" || die "submit-bench ($path) failed"
    for spin in $SPINS; do
      KVFERRY_SPIN_US=$spin "$BUILD/submit-bench" "${where[@]}" --block-bytes "$BLOCK_BYTES" --handoffs "$HANDOFFS" \
        >>"$TMP/run.json" || die "submit-bench --handoffs ($path, spin $spin) failed"
    done
    sed "s/^{/{\"run\": $run, \"path\": \"$path\", /" "$TMP/run.json" | tee -a "$TMP/all.json"
  done
done

python3 - "$TMP/all.json" "$(nproc)" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print()
print("Machine: %s CPUs; every call's transfer verified byte for byte." % sys.argv[2])
print()
print("| run | path | mode | api | parts/call | p50 us | p90 us | p99 us | max us |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| %d | %s | %s | %s | %d | %.1f | %.1f | %.1f | %.1f |" % (
        r["run"], r["path"], r["mode"], r["api"], r["parts_per_call"], r["p50_us"], r["p90_us"], r["p99_us"],
        r["max_us"]))
EOF
