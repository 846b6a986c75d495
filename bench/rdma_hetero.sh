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
# Prints one line per case and mode (with the sending daemon's rdma runs
# and work requests in it), then (last line) one JSON line.
# Usage (as root, on the host): make all && bench/rdma_hetero.sh.
# Environment: BUILD (build), TOKENS (4096), REQUESTS (2), POOL (1G per
# daemon), STAGING (rdma-staging-size when on, 640M), VM_MEM (8G), RDMA_VM,
# VM_TIMEOUT (1500 s), DEADLINE_MS (each transfer's, 600000), CASES (same tp8to4 nhd2hnd), MODES (direct staged),
# CONF (extra kvferryd.conf lines for both daemons, e.g. "rdma-slice 128K"),
# ROUNDS (1), PAIRED (0; 1: each transform case right after a same-layout
# run of its own, its ratio against that one: on a busy host the load
# drifts within a round), and
# BUILDS (BUILD): several build directories (each with kvferryd, kvferryctl
# and kvferry-bench; e.g. "build/base build" for before and after) take
# turns, round by round, in the same VM run; keys then start with the
# build's name (its last path component) and the round. The daemons' peer
# timeout is 5 s: under emulation on a busy host a peer can go quiet for
# more than the default 700 ms (a pool is locked in for tens of seconds).
# PERF_DIR (unset): a folder under the repository where each case leaves a
# system-wide profile of the VM (RUN-CASE.data and, by command and symbol,
# .txt: perf record -a -g), `vmstat 1` over it (.vmstat: how busy the two
# CPUs were) and the sending daemon's status before and after (.post0,
# .post1: work requests and bytes per QP). Profiling costs throughput:
# compare such runs only with each other.
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
  export PERF_DIR BUILD BUILDS ROUNDS PAIRED DEADLINE_MS TOKENS REQUESTS POOL STAGING CASES MODES CONF
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
${CONF:-}
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
PAIRED=${PAIRED:-0}
RUNS=""
FAILS=0 # a case that fails is reported and left out; the exit status says so

# one_case RUN KEY CASE: kvferry-bench's JSON in $TMP/RUN-KEY.json, and the
# sending daemon's status (its rdma posting counters) before and after
one_case() {
  local run=$1 key=$2 c=$3
  bench_ctl prefill status --json >"$TMP/$run-$key.post0" 2>/dev/null || true
  say "$run: $key: $BUILD/kvferry-bench --blocks --model llama3-8b --tokens $TOKENS --requests $REQUESTS ${ARGS[$c]}"
  # shellcheck disable=SC2086
  [ -z "${PERF_DIR:-}" ] || { perf record -a -g -F 499 -o "$PERF_DIR/$run-$key.data" 2>/dev/null & PERF_PID=$!
    vmstat -t 1 >"$PERF_DIR/$run-$key.vmstat" & VMSTAT_PID=$!; }
  "$BUILD/kvferry-bench" --from "$TMP/prefill.sock" --to "$TMP/decode.sock" --json --blocks --model llama3-8b \
    --tokens "$TOKENS" --requests "$REQUESTS" --deadline-ms "$DEADLINE_MS" ${ARGS[$c]} >"$TMP/$run-$key.json" 2>"$TMP/$run-$key.err" ||
    { cat "$TMP/$run-$key.err" >&2; tail -n 20 "$TMP"/*.log >&2; say "$run: $key: FAILED (left out)"
      rm -f "$TMP/$run-$key.json"; FAILS=$((FAILS + 1)); return 0; }
  [ -z "${PERF_DIR:-}" ] || { kill -INT "$PERF_PID"; wait "$PERF_PID" || true
    perf report -i "$PERF_DIR/$run-$key.data" --stdio --no-children -g none --sort comm,sym >"$PERF_DIR/$run-$key.txt" 2>/dev/null || true
    kill "$VMSTAT_PID" || true; }
  bench_ctl prefill status --json >"$TMP/$run-$key.post1" 2>/dev/null || true
  [ -z "${PERF_DIR:-}" ] || cp "$TMP/$run-$key.post0" "$TMP/$run-$key.post1" "$PERF_DIR/" 2>/dev/null || true
  say "$run: $key: $(tail -n 1 "$TMP/$run-$key.json")"
}

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
        # PAIRED=1: each transform right after a same-layout run of its own
        if [ "$PAIRED" = 1 ] && [ "$c" != same ]; then one_case "$run" "same4$c" same; fi
        one_case "$run" "$c" "$c"
      done
      bench_ctl decode status --json >"$TMP/$run-status.json"
      stop_daemons
    done
  done
done

python3 - "$TMP" "$CASES" "$RUNS" "$PAIRED" <<'EOF'
import json, os, sys
tmp, cases, runs, paired = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), sys.argv[4] == "1"
def last_json(path):
    return json.loads([l for l in open(path).read().splitlines() if l.strip()][-1])
def posted(run, key):
    """The sender's runs and work requests in one case (status deltas)."""
    try:
        a, b = [json.load(open(os.path.join(tmp, "%s-%s.post%d" % (run, key, i))))["rdma"]["post"] for i in (0, 1)]
    except (OSError, ValueError, KeyError):
        return None
    return b["runs"] - a["runs"], b["work_requests"] - a["work_requests"]
keys = [k for c in cases for k in ((["same4" + c] if paired and c != "same" else []) + [c])]
out = {}
for run in runs:
    st = json.load(open(os.path.join(tmp, run + "-status.json")))["rdma"]["staging"]
    for c in keys:
        path = os.path.join(tmp, "%s-%s.json" % (run, c))
        if not os.path.exists(path):
            print("%-18s %-13s FAILED" % (run, c))
            continue
        r = last_json(path)
        assert r["verified"], r
        out["%s_%s_mbps" % (run, c)] = r["bytes"] / r["seconds"] / 1e6  # gbps has 3 decimals only
        p = posted(run, c)
        if p:
            out["%s_%s_runs" % (run, c)], out["%s_%s_wrs" % (run, c)] = p
        print("%-18s %-13s %9.1f MB/s  %d bytes, path %s%s" % (run, c, out["%s_%s_mbps" % (run, c)], r["bytes"],
              r["path"], ", sender: %d runs in %d work requests" % p if p else ""))
    out[run + "_staging"] = st
    print("%-18s staging: %s" % (run, json.dumps(st)))
for run in runs:
    for c in cases:
        base = "same4" + c if paired else "same"
        if c != "same" and out.get("%s_%s_mbps" % (run, base)) and "%s_%s_mbps" % (run, c) in out:
            k = "%s_%s_mbps" % (run, c)
            out["%s_%s_ratio" % (run, c)] = out[k] / out["%s_%s_mbps" % (run, base)]
            print("%-18s %-8s / %s: %.3f" % (run, c, base, out["%s_%s_ratio" % (run, c)]))
print(json.dumps(out))
EOF
[ "$FAILS" = 0 ] || die "$FAILS case(s) failed (left out above)"
