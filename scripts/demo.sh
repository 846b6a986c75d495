#!/usr/bin/env bash
# scripts/demo.sh - two kvferryd daemons ("prefill" and "decode") on one host.
#
#   demo.sh run [BENCH ARGS...]  start both, wait until they see each other,
#                                run kvferry-bench prefill -> decode, stop both
#                                (default args: --model llama3-8b --tokens 4096 --json)
#   demo.sh up                   start both in the background; writes
#                                $BUILD/demo/env (PREFILL_SOCK DECODE_SOCK
#                                PREFILL_PEER DECODE_PEER PREFILL_PID DECODE_PID
#                                PREFILL_METRICS DECODE_METRICS: metrics URLs)
#   demo.sh down                 stop what `up` started, remove the env file
#
# `run` refuses while the daemons of `up` are running (they own the same
# sockets), and no start removes a socket a live daemon answers on.
# Environment: BUILD (default build), TRANSPORT (default tcp; written as
# `transports TRANSPORT`), LOG_LEVEL (default info), POOL_SIZE (default 1G).
# With TRANSPORT=rdma the daemons listen on $NODE0_IP and $NODE1_IP instead
# of 127.0.0.1. Ports 7471/7472 when free, else any free ports. Configs and
# logs live in $BUILD/demo/.
set -euo pipefail

BUILD=${BUILD:-build}
TRANSPORT=${TRANSPORT:-tcp}
POOL_SIZE=${POOL_SIZE:-1G}   # llama3-8b, 4096 tokens = 512 MiB of KV per side
READY_S=60                   # bound on start (1 GiB pools take seconds) and peers up
STOP_S=10                    # SIGTERM grace before SIGKILL

die() { echo "demo: $*" >&2; exit 1; }

[ -x "$BUILD/kvferryd" ] || die "$BUILD/kvferryd not built (run make)"
mkdir -p "$BUILD/demo"
DEMO=$(cd "$BUILD/demo" && pwd)
ENV_FILE=$DEMO/env
# Unix socket paths are limited to 107 bytes, and 9p (the rdma VM's view of
# the tree) cannot hold sockets: fall back to a short local dir.
SOCK_DIR=$DEMO
if [ ${#SOCK_DIR} -gt 90 ] || [ "$(findmnt -n -o FSTYPE -T "$DEMO" 2>/dev/null)" = 9p ]; then
  SOCK_DIR=${XDG_RUNTIME_DIR:-/tmp}/kvferry-demo-$(id -u)
  mkdir -p "$SOCK_DIR"
fi

if [ "$TRANSPORT" = rdma ]; then
  : "${NODE0_IP:?TRANSPORT=rdma needs NODE0_IP}" "${NODE1_IP:?TRANSPORT=rdma needs NODE1_IP}"
  HOST0=$NODE0_IP HOST1=$NODE1_IP
else
  HOST0=127.0.0.1 HOST1=127.0.0.1
fi

# Prints PORT if it can be bound on HOST (as the daemon will, with
# SO_REUSEADDR), else a free port chosen by the kernel.
pick_port() {
  python3 - "$1" "$2" <<'EOF'
import socket, sys
host, want = sys.argv[1], int(sys.argv[2])
def bind(port):
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    return s
try:
    s = bind(want)
except OSError:
    s = bind(0)
print(s.getsockname()[1])
EOF
}

# write_conf NAME LISTEN_HOST:PORT PEER_NAME PEER_HOST:PORT
write_conf() {
  cat >"$DEMO/$1.conf" <<EOF
# written by scripts/demo.sh
node $1
api-socket $SOCK_DIR/$1.sock
peer-listen $2
peer $3 $4
pool kv host $POOL_SIZE
transports $TRANSPORT
log-level ${LOG_LEVEL:-info}
metrics-listen 127.0.0.1:0
EOF
}

# metrics_url SOCK: the daemon's metrics URL (it bound port 0: no races).
metrics_url() {
  "$BUILD/kvferryctl" -s "$1" --json status |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["metrics"])'
}

# demo_daemon PID: true when PID is alive and is a kvferryd (not a recycled pid).
demo_daemon() {
  [ -n "$1" ] && kill -0 "$1" 2>/dev/null && grep -q kvferryd "/proc/$1/cmdline" 2>/dev/null
}

# up_running: true when $ENV_FILE names a daemon that still runs; sets
# PREFILL_PID, DECODE_PID and the rest from it.
up_running() {
  [ -f "$ENV_FILE" ] || return 1
  # shellcheck disable=SC1090
  . "$ENV_FILE"
  demo_daemon "${PREFILL_PID:-}" || demo_daemon "${DECODE_PID:-}"
}

# start NAME DETACH: starts kvferryd on $DEMO/NAME.conf, sets STARTED_PID.
# DETACH=1 puts it in its own session, immune to this shell's end.
start() {
  local log=$DEMO/$1.log
  rm -f "$SOCK_DIR/$1.sock"
  echo "=== demo: starting $1 ($(date -Is))" >>"$log"
  if [ "$2" = 1 ]; then
    setsid nohup "$BUILD/kvferryd" -c "$DEMO/$1.conf" >>"$log" 2>&1 </dev/null &
  else
    "$BUILD/kvferryd" -c "$DEMO/$1.conf" >>"$log" 2>&1 </dev/null &
  fi
  STARTED_PID=$!
}

# wait_up NAME PID: until its API answers and its peer shows "up".
wait_up() {
  local end=$((SECONDS + READY_S)) out=""
  while [ $SECONDS -lt $end ]; do
    kill -0 "$2" 2>/dev/null || { tail -n 20 "$DEMO/$1.log" >&2; die "$1 exited during start (log: $DEMO/$1.log)"; }
    if out=$("$BUILD/kvferryctl" -s "$SOCK_DIR/$1.sock" --json peers 2>&1) &&
       grep -q '"state" *: *"up"' <<<"$out"; then
      return 0
    fi
    sleep 0.1
  done
  tail -n 20 "$DEMO/$1.log" >&2
  die "$1: peer not up after ${READY_S}s (last: $out; log: $DEMO/$1.log)"
}

# stop PID NAME: SIGTERM, SIGKILL after STOP_S. Fails unless it exited 0
# (only for our own children; a detached daemon's status is not ours).
stop() {
  local pid=$1 name=$2 i rc=0
  kill -0 "$pid" 2>/dev/null || return 0
  # Never signal a recycled pid that is no longer our daemon.
  grep -q kvferryd "/proc/$pid/cmdline" 2>/dev/null || return 0
  kill -TERM "$pid"
  for ((i = 0; i < STOP_S * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
    echo "demo: $name did not stop within ${STOP_S}s of SIGTERM; killed" >&2
    rc=1
  fi
  if wait "$pid" 2>/dev/null; then :; else
    local st=$?
    # 127: not our child (detached by `up`); nothing to check.
    if [ $st -ne 127 ]; then echo "demo: $name exited with status $st" >&2; rc=1; fi
  fi
  return $rc
}

# The EXIT trap while starting: no half-started pair is left behind.
kill_started() {
  local p
  for p in ${PREFILL_PID:-} ${DECODE_PID:-}; do kill -KILL "$p" 2>/dev/null || true; done
}

configure() {
  PORT0=$(pick_port "$HOST0" 7471)
  PORT1=$(pick_port "$HOST1" 7472)
  # Both picked free on the same host: make sure they differ.
  [ "$HOST0:$PORT0" != "$HOST1:$PORT1" ] || PORT1=$(pick_port "$HOST1" 0)
  PREFILL_PEER=$HOST0:$PORT0 DECODE_PEER=$HOST1:$PORT1
  write_conf prefill "$PREFILL_PEER" decode "$DECODE_PEER"
  write_conf decode "$DECODE_PEER" prefill "$PREFILL_PEER"
  PREFILL_SOCK=$SOCK_DIR/prefill.sock DECODE_SOCK=$SOCK_DIR/decode.sock
}

# refuse_live_sockets: fails when a daemon answers on a demo socket (a
# `run` in progress, or an `up` whose env file is gone): a start would
# rewrite its config and remove its socket.
refuse_live_sockets() {
  local n sock
  for n in prefill decode; do
    sock=$SOCK_DIR/$n.sock
    if [ -S "$sock" ] && "$BUILD/kvferryctl" -s "$sock" status >/dev/null 2>&1; then
      die "a kvferryd already answers on $sock (another demo running?): stop it first"
    fi
  done
}

# start_both DETACH: sets PREFILL_PID and DECODE_PID, waits until both up.
start_both() {
  refuse_live_sockets
  configure
  start prefill "$1"; PREFILL_PID=$STARTED_PID
  start decode "$1"; DECODE_PID=$STARTED_PID
  wait_up prefill "$PREFILL_PID"
  wait_up decode "$DECODE_PID"
  echo "demo: prefill pid $PREFILL_PID ($PREFILL_PEER), decode pid $DECODE_PID ($DECODE_PEER), transport $TRANSPORT"
}

cmd_run() {
  [ -x "$BUILD/kvferry-bench" ] || die "$BUILD/kvferry-bench not built (run make)"
  if up_running; then
    die "the daemons of \`make demo-up\` are running (prefill pid $PREFILL_PID, decode pid $DECODE_PID;" \
      "$ENV_FILE): use them (kvferry-bench --from $PREFILL_SOCK --to $DECODE_SOCK), or stop them" \
      "first (make demo-down)"
  fi
  [ $# -gt 0 ] || set -- --model llama3-8b --tokens 4096 --json
  PREFILL_PID="" DECODE_PID=""
  # Whatever happens, leave no daemon behind.
  trap kill_started EXIT
  start_both 0
  local rc=0
  echo "demo: $BUILD/kvferry-bench --from $PREFILL_SOCK --to $DECODE_SOCK $*"
  "$BUILD/kvferry-bench" --from "$PREFILL_SOCK" --to "$DECODE_SOCK" "$@" || rc=$?
  [ $rc -eq 0 ] || echo "demo: kvferry-bench failed (status $rc)" >&2
  stop "$PREFILL_PID" prefill || rc=1
  stop "$DECODE_PID" decode || rc=1
  PREFILL_PID="" DECODE_PID=""
  if [ $rc -ne 0 ]; then
    for n in prefill decode; do echo "---- tail of $DEMO/$n.log" >&2; tail -n 20 "$DEMO/$n.log" >&2; done
  fi
  return $rc
}

cmd_up() {
  if [ -f "$ENV_FILE" ]; then
    # shellcheck disable=SC1090
    . "$ENV_FILE"
    if demo_daemon "$PREFILL_PID" && demo_daemon "$DECODE_PID"; then
      echo "demo: already up ($ENV_FILE)"; return 0
    fi
    cmd_down
  fi
  PREFILL_PID="" DECODE_PID=""
  trap kill_started EXIT
  start_both 1
  PREFILL_METRICS=$(metrics_url "$PREFILL_SOCK")
  DECODE_METRICS=$(metrics_url "$DECODE_SOCK")
  trap - EXIT
  cat >"$ENV_FILE" <<EOF
PREFILL_SOCK=$PREFILL_SOCK
DECODE_SOCK=$DECODE_SOCK
PREFILL_PEER=$PREFILL_PEER
DECODE_PEER=$DECODE_PEER
PREFILL_PID=$PREFILL_PID
DECODE_PID=$DECODE_PID
PREFILL_METRICS=$PREFILL_METRICS
DECODE_METRICS=$DECODE_METRICS
EOF
  echo "demo: up; variables in $ENV_FILE, logs in $DEMO/*.log"
}

cmd_down() {
  [ -f "$ENV_FILE" ] || { echo "demo: nothing to stop (no $ENV_FILE)"; return 0; }
  # shellcheck disable=SC1090
  . "$ENV_FILE"
  local rc=0
  stop "${PREFILL_PID:-}" prefill || rc=1
  stop "${DECODE_PID:-}" decode || rc=1
  rm -f "$ENV_FILE"
  echo "demo: down"
  return $rc
}

case ${1:-} in
  run) shift; cmd_run "$@" ;;
  up) cmd_up ;;
  down) cmd_down ;;
  *) echo "usage: $0 run [BENCH ARGS...] | up | down" >&2; exit 2 ;;
esac
