# bench/lib.sh - sourced by the bench scripts (POSIX sh).
#
# bench_setup NAME: a fresh $TMP (kvferry-NAME.XXXXXX under $TMPDIR) and an
# empty $PIDS; on exit, interrupt or termination the processes listed in
# $PIDS are stopped (SIGTERM, then SIGKILL after 5 s: a stuck daemon must
# not hang the script) and $TMP is removed.
#
# bench_ctl NAME ARGS...: kvferryctl against the daemon NAME of $TMP.
# bench_rdma_ready NAME: true once every rdma QP of daemon NAME is connected.

bench_cleanup() {
  for pid in $PIDS; do kill "$pid" 2>/dev/null || true; done
  for pid in $PIDS; do
    i=0
    while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$TMP"
}

bench_setup() {
  TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-$1.XXXXXX")
  PIDS=""
  trap bench_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

bench_ctl() {
  bench_ctl_name=$1
  shift
  "$BUILD/kvferryctl" -s "$TMP/$bench_ctl_name.sock" "$@"
}

bench_rdma_ready() {
  bench_ctl "$1" status --json 2>/dev/null | python3 -c '
import json, sys
try:
    r = json.load(sys.stdin).get("rdma") or {}
except ValueError:
    sys.exit(1)
qps = [q for p in r.get("peers", []) for q in p.get("qps", [])]
sys.exit(0 if qps and all(q["state"] == "connected" for q in qps) else 1)'
}
