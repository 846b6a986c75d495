#!/usr/bin/env bash
# rdma_hetero.sh - heterogeneous handoffs over rdma (issue 17) against a
# same-layout handoff of the same bytes, in ONE run of the soft-RoCE VM
# (two nodes, rxe0 <-> rxe1), with the receiver's staging off (every run of
# a transform written directly: rdma-staging-size 0) and on (small runs
# staged and transformed on the receiver: daemon/transport/rdma/rdma_stage.c):
#
#   kvferry-bench --blocks --model llama3-8b --tokens TOKENS --requests N
#     same        TP 1 -> TP 1, NHD -> NHD (whole blocks)
#     tp8to4      --prefill-tp 8 --decode-tp 4 (fan-in of two, NHD)
#     nhd2hnd     --decode-order hnd (TP 1 -> TP 1)
#
# The VM is emulated (TCG): compare figures only within one run.
# Prints one line per case and mode, then (last line) one JSON line.
# Usage (as root, on the host): make all && bench/rdma_hetero.sh.
# Environment: BUILD (build), TOKENS (4096), REQUESTS (2), POOL (1G per
# daemon), STAGING (rdma-staging-size when on, 640M), VM_MEM (8G), RDMA_VM,
# VM_TIMEOUT (1500 s), DEADLINE_MS (each transfer's, 600000), CASES (same tp8to4 nhd2hnd), MODES (direct staged),
# ROUNDS (1), and
# BUILDS (BUILD): several build directories (each with kvferryd, kvferryctl
# and kvferry-bench; e.g. "build/base build" for before and after) take
# turns, round by round, in the same VM run; keys then start with the
# build's name (its last path component) and the round. The daemons' peer
# timeout is 5 s: under emulation on a busy host a peer can go quiet for
# more than the default 700 ms (a pool is locked in for tens of seconds).
set -euo pipefail

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
TOKENS=${TOKENS:-4096}
REQUESTS=${REQUESTS:-2}
POOL=${POOL:-1G}
STAGING=${STAGING:-640M}
DEADLINE_MS=${DEADLINE_MS:-600000}
VM_MEM=${VM_MEM:-8G}
RDMA_VM=${RDMA_VM:-$(cd .. && pwd)/shared/rdma-vm/run}

say() { echo "rdma_hetero: $*" >&2; }
die() { say "$*"; exit 1; }

BUILDS=${BUILDS:-$BUILD}
ROUNDS=${ROUNDS:-1}
for b in $BUILDS; do
  for bin in kvferryd kvferryctl kvferry-bench; do
    [ -x "$b/$bin" ] || die "$b/$bin is missing (run make all first)"
  done
done

if [ -z "${RDMA_VM_NODES:-}" ]; then
  [ -x "$RDMA_VM" ] || die "no VM runner at $RDMA_VM (set RDMA_VM)"
  export BUILD BUILDS ROUNDS DEADLINE_MS TOKENS REQUESTS POOL STAGING CASES MODES
  exec "$RDMA_VM" --nodes 2 --mem "$VM_MEM" --timeout "${VM_TIMEOUT:-1500}" -- bench/rdma_hetero.sh
fi

# ---------------------------------------------------------------- in the VM
. bench/lib.sh
bench_setup rdma-hetero
PORT0=7471 PORT1=7472

write_conf() { # NAME IP PORT PEER PEER_IP PEER_PORT STAGING
  cat >"$TMP/$1.conf" <<EOF
node $1
api-socket $TMP/$1.sock
peer-listen $2:$3
peer $4 $5:$6
pool kv host $POOL
transports rdma
rdma-staging-size $7
heartbeat-ms 500
peer-timeout-ms 5000
log-level info
EOF
}

start_daemons() { # STAGING
  write_conf prefill "$NODE0_IP" $PORT0 decode "$NODE1_IP" $PORT1 "$1"
  write_conf decode "$NODE1_IP" $PORT1 prefill "$NODE0_IP" $PORT0 "$1"
  bench_rdma_start prefill decode
}

stop_daemons() {
  for pid in $PIDS; do kill "$pid" 2>/dev/null || true; done
  for pid in $PIDS; do wait "$pid" 2>/dev/null || true; done
  PIDS=""
}

declare -A ARGS=([same]="" [tp8to4]="--prefill-tp 8 --decode-tp 4" [nhd2hnd]="--decode-order hnd")
CASES=${CASES:-same tp8to4 nhd2hnd}
MODES=${MODES:-direct staged}
RUNS=""
FAILS=0 # a case that fails is reported and left out; the exit status says so
for round in $(seq 1 "$ROUNDS"); do
  for BUILD in $BUILDS; do
    tag=""
    [ "$BUILDS" = "$BUILD" ] && [ "$ROUNDS" = 1 ] || tag="$(basename "$BUILD")-r$round-"
    for mode in $MODES; do
      run="$tag$mode"
      RUNS="$RUNS $run"
      staging=0
      [ $mode = staged ] && staging=$STAGING
      start_daemons "$staging"
      for c in $CASES; do
        say "$run: $c: $BUILD/kvferry-bench --blocks --model llama3-8b --tokens $TOKENS --requests $REQUESTS ${ARGS[$c]}"
        # shellcheck disable=SC2086
        "$BUILD/kvferry-bench" --from "$TMP/prefill.sock" --to "$TMP/decode.sock" --json --blocks --model llama3-8b \
          --tokens "$TOKENS" --requests "$REQUESTS" --deadline-ms "$DEADLINE_MS" ${ARGS[$c]} >"$TMP/$run-$c.json" 2>"$TMP/$run-$c.err" ||
          { cat "$TMP/$run-$c.err" >&2; tail -n 20 "$TMP"/*.log >&2; say "$run: $c: FAILED (left out)"
            rm -f "$TMP/$run-$c.json"; FAILS=$((FAILS + 1)); continue; }
        say "$run: $c: $(tail -n 1 "$TMP/$run-$c.json")"
      done
      bench_ctl decode status --json >"$TMP/$run-status.json"
      stop_daemons
    done
  done
done

python3 - "$TMP" "$CASES" "$RUNS" <<'EOF'
import json, os, sys
tmp, cases, runs = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def last_json(path):
    return json.loads([l for l in open(path).read().splitlines() if l.strip()][-1])
out = {}
for run in runs:
    st = json.load(open(os.path.join(tmp, run + "-status.json")))["rdma"]["staging"]
    for c in cases:
        path = os.path.join(tmp, "%s-%s.json" % (run, c))
        if not os.path.exists(path):
            print("%-18s %-8s FAILED" % (run, c))
            continue
        r = last_json(path)
        assert r["verified"], r
        out["%s_%s_mbps" % (run, c)] = r["bytes"] / r["seconds"] / 1e6  # gbps has 3 decimals only
        print("%-18s %-8s %9.1f MB/s  %d bytes, path %s" % (run, c, out["%s_%s_mbps" % (run, c)], r["bytes"], r["path"]))
    out[run + "_staging"] = st
    print("%-18s staging: %s" % (run, json.dumps(st)))
for run in runs:
    for c in cases:
        if c != "same" and out.get("%s_same_mbps" % run) and "%s_%s_mbps" % (run, c) in out:
            k = "%s_%s_mbps" % (run, c)
            out["%s_%s_ratio" % (run, c)] = out[k] / out["%s_same_mbps" % run]
            print("%-18s %-8s / same: %.3f" % (run, c, out["%s_%s_ratio" % (run, c)]))
print(json.dumps(out))
EOF
[ "$FAILS" = 0 ] || die "$FAILS case(s) failed (left out above)"
