# shellcheck shell=sh
# bench/lib.sh - sourced by the bench scripts (POSIX sh).
#
# bench_setup NAME: a fresh $TMP (kvferry-NAME.XXXXXX under $TMPDIR) and an
# empty $PIDS; on exit, interrupt or termination the processes listed in
# $PIDS are stopped (SIGTERM, then SIGKILL after 5 s: a stuck daemon must
# not hang the script) and $TMP is removed.
#
# bench_ctl NAME ARGS...: kvferryctl against the daemon NAME of $TMP.
# bench_rdma_ready NAME: true once every rdma QP of daemon NAME is connected.
# bench_rdma_conf NAME IP PORT PEER PEER_IP PEER_PORT: writes NAME's config
#   for one node of the soft-RoCE VM: node, API socket, peer-listen IP:PORT,
#   the peer, transports rdma, then the lines read from stdin.
# bench_rdma_start A B: starts daemons A and B from $TMP/A.conf and B.conf
#   (the soft-RoCE VM's two nodes; added to $PIDS, stderr to $TMP/NAME.log)
#   and waits up to 60 s until every rdma QP of both is connected.
#
# Daemons on loopback (daemon NAME: $TMP/NAME.conf, .sock, .log):
# bench_free_ports N: N distinct free TCP ports of 127.0.0.1, on one line.
#   Another process could take one before it is used; then a start fails
#   loudly rather than measuring junk.
# bench_conf NAME PORT [PEER PEER_PORT]: writes NAME's config: node, API
#   socket, peer-listen 127.0.0.1:PORT, the peer line, then the lines read
#   from stdin.
# bench_start NAME: starts kvferryd NAME in the background (added to $PIDS,
#   its pid in $BENCH_PID) and waits for its "ready" log line.
# bench_peer_up NAME PEER: true while daemon NAME shows PEER up.
# bench_wait_up NAME PEER: waits until daemon NAME shows PEER up.
# bench_pair A B [CONF]: daemons A and B peered on free loopback ports, each
#   with the config lines CONF, started, each seeing the other up.
# bench_die MSG: MSG and the daemons' last log lines on stderr, exit 1.
# bench_setup's NAME prefixes the messages.

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
  BENCH_NAME=$1
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

bench_rdma_start() {
  for bench_n in "$1" "$2"; do
    "$BUILD/kvferryd" -c "$TMP/$bench_n.conf" 2>>"$TMP/$bench_n.log" &
    PIDS="$PIDS $!"
  done
  bench_i=0
  until bench_rdma_ready "$1" && bench_rdma_ready "$2"; do
    bench_i=$((bench_i + 1))
    [ "$bench_i" -le 600 ] || bench_die "daemons not connected over rdma after 60 s"
    sleep 0.1
  done
}

bench_die() {
  echo "${BENCH_NAME:-bench}: $*" >&2
  for bench_log in "$TMP"/*.log; do
    [ -f "$bench_log" ] || continue
    echo "--- $bench_log:" >&2
    tail -n 20 "$bench_log" >&2
  done
  exit 1
}

bench_free_ports() {
  python3 -c '
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

bench_rdma_conf() {
  {
    printf 'node %s\napi-socket %s\npeer-listen %s:%s\npeer %s %s:%s\ntransports rdma\n' \
      "$1" "$TMP/$1.sock" "$2" "$3" "$4" "$5" "$6"
    cat
  } >"$TMP/$1.conf"
}

bench_conf() {
  {
    printf 'node %s\napi-socket %s\npeer-listen 127.0.0.1:%s\n' "$1" "$TMP/$1.sock" "$2"
    [ $# -lt 4 ] || printf 'peer %s 127.0.0.1:%s\n' "$3" "$4"
    cat
  } >"$TMP/$1.conf"
}

bench_start() {
  "$BUILD/kvferryd" -c "$TMP/$1.conf" >>"$TMP/$1.log" 2>&1 &
  BENCH_PID=$!
  PIDS="$PIDS $BENCH_PID"
  bench_i=0
  until grep -q " ready" "$TMP/$1.log"; do
    kill -0 "$BENCH_PID" 2>/dev/null || bench_die "kvferryd $1 exited"
    bench_i=$((bench_i + 1))
    [ "$bench_i" -le 600 ] || bench_die "kvferryd $1 not ready after 60 s"
    sleep 0.1
  done
}

bench_peer_up() {
  bench_ctl "$1" peers --json 2>/dev/null | python3 -c '
import json, sys
try:
    peers = json.load(sys.stdin).get("peers", [])
except (ValueError, AttributeError):
    sys.exit(1)
sys.exit(0 if any(p.get("name") == sys.argv[1] and p.get("state") == "up" for p in peers) else 1)' "$2"
}

bench_wait_up() {
  bench_i=0
  until bench_peer_up "$1" "$2"; do
    for bench_pid in $PIDS; do
      kill -0 "$bench_pid" 2>/dev/null || bench_die "a process exited before $1 saw $2 up"
    done
    bench_i=$((bench_i + 1))
    [ "$bench_i" -le 200 ] || bench_die "$1 did not see $2 up in 20 s: $(bench_ctl "$1" peers 2>&1)"
    sleep 0.1
  done
}

bench_pair() {
  # shellcheck disable=SC2046 # the two ports: words
  set -- "$1" "$2" "${3:-}" $(bench_free_ports 2)
  printf '%s\n' "$3" | bench_conf "$1" "$4" "$2" "$5"
  printf '%s\n' "$3" | bench_conf "$2" "$5" "$1" "$4"
  bench_start "$1"
  bench_start "$2"
  bench_wait_up "$1" "$2"
  bench_wait_up "$2" "$1"
}
