#!/bin/sh
# bench/hetero_tcp.sh - heterogeneous layouts over tcp next to the same
# layout, in one run (issue 17): two daemons on loopback (tcp-streams 4),
# kvferry-bench --blocks for each case, each case next to the same-layout
# handoff of the same bytes; prints one JSON line per run and the ratios.
#
#   bench/hetero_tcp.sh                 TP 8->4 NHD->NHD, TP 8->4 NHD->HND,
#                                       TP 1->1 NHD->HND, 4096 tokens, 3 requests
#   TOKENS=1024 REQUESTS=2 ROUNDS=3 POOL=2G bench/hetero_tcp.sh
#   CASES="--prefill-tp_2_--decode-tp_1" bench/hetero_tcp.sh   (words joined by _)
#   BUILD=/tmp/before ROUNDS=1 bench/hetero_tcp.sh   (another build's kvferryd,
#       kvferryctl and kvferry-bench: alternate it with build/ round by round
#       for a before/after in one session; the ratios vary by about 0.2x
#       between rounds on the loaded 2-core dev machine)
#   BENCH_ARGS=--nowait bench/hetero_tcp.sh   (extra kvferry-bench options for
#       both runs of a pair: --nowait queues every rank's grant and send)
#   PERF=/tmp/p ROUNDS=1 bench/hetero_tcp.sh   (perf record -F 4000 of both
#       daemons around each run: /tmp/p/ROUND-N-same.data, ROUND-N-het.data
#       for the N-th case; compare with perf report --sort dso,sym)
set -eu

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
POOL=${POOL:-2G}
TOKENS=${TOKENS:-4096}
REQUESTS=${REQUESTS:-3}
ROUNDS=${ROUNDS:-1}
# The default 700 ms took a peer for dead when other sessions' VMs held both
# cores of the dev machine (KVF_EPEERLOST mid-run, either build): the
# loop's heartbeats wait behind them. Not a throughput setting.
PEER_TIMEOUT_MS=${PEER_TIMEOUT_MS:-5000}
# the cases, words joined by _
CASES=${CASES:-"--prefill-tp_8_--decode-tp_4 --prefill-tp_8_--decode-tp_4_--prefill-order_nhd_--decode-order_hnd
--prefill-order_nhd_--decode-order_hnd"}

say() { echo "hetero_tcp: $*" >&2; }
die() { say "$*"; exit 1; }
for bin in kvferryd kvferryctl kvferry-bench; do
  [ -x "$BUILD/$bin" ] || die "$BUILD/$bin is missing (run make first)"
done

. bench/lib.sh
bench_setup hetero

PORTS=$(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')
read -r PORT_A PORT_B <<EOF2
$PORTS
EOF2

write_conf() { # NAME PORT OTHER OTHER_PORT
  cat >"$TMP/$1.conf" <<EOF2
node $1
api-socket $TMP/$1.sock
peer-listen 127.0.0.1:$2
peer $3 127.0.0.1:$4
pool kv host $POOL
tcp-streams 4
peer-timeout-ms $PEER_TIMEOUT_MS
EOF2
}
write_conf a "$PORT_A" b "$PORT_B"
write_conf b "$PORT_B" a "$PORT_A"
for n in a b; do
  "$BUILD/kvferryd" -c "$TMP/$n.conf" >"$TMP/$n.log" 2>&1 &
  PIDS="$PIDS $!"
done
i=0
until "$BUILD/kvferryctl" -s "$TMP/a.sock" peers --json 2>/dev/null | grep -q '"up"'; do
  i=$((i + 1))
  [ "$i" -le 100 ] || die "the daemons did not connect: $(tail -n 5 "$TMP/a.log")"
  sleep 0.1
done

gbps() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])["gbps"])' "$1"; }

bench_once() { # ARGS...
  # shellcheck disable=SC2086
  "$BUILD/kvferry-bench" --from "$TMP/a.sock" --to "$TMP/b.sock" --blocks --json --tokens "$TOKENS" \
    --requests "$REQUESTS" ${BENCH_ARGS:-} "$@"
}

# Both daemons' CPU time so far (user + system, every thread), in clock ticks.
daemon_ticks() {
  t=0
  for pid in $PIDS; do
    # fields 14 and 15 of /proc/PID/stat, counted after the ")" that ends the name
    set -- $(sed 's/.*) //' "/proc/$pid/stat")
    t=$((t + ${12} + ${13}))
  done
  echo "$t"
}

# One run's JSON line with "daemon_cpu_s" added: both daemons' CPU seconds
# over it, steadier on a shared machine than the wall clock (other
# sessions' load stretches the wall clock, less the CPU the run itself used).
run() { # TAG ARGS...
  tag=$1
  shift
  perf_pid=""
  if [ -n "${PERF:-}" ]; then
    mkdir -p "$PERF"
    perf record -q -F 4000 -g -p "$(echo $PIDS | tr ' ' ,)" -o "$PERF/$tag.data" >/dev/null 2>&1 &
    perf_pid=$!
    sleep 0.5 # perf attaches before the run starts (a measurement aid only)
  fi
  t0=$(daemon_ticks)
  out=$(bench_once "$@")
  t1=$(daemon_ticks)
  if [ -n "$perf_pid" ]; then
    kill -INT "$perf_pid"
    wait "$perf_pid" || true
  fi
  python3 -c 'import json, sys; d = json.loads(sys.argv[1]); d["daemon_cpu_s"] = round(int(sys.argv[2]) / int(sys.argv[3]), 3); print(json.dumps(d))' \
    "$out" "$((t1 - t0))" "$(getconf CLK_TCK)"
}

r=0
n=0
while [ "$r" -lt "$ROUNDS" ]; do
  r=$((r + 1))
  for c in $CASES; do
    c=$(echo "$c" | tr _ ' ')
    n=$((n + 1))
    same=$(run "$r-$n-same")
    # shellcheck disable=SC2086
    het=$(run "$r-$n-het" $c)
    echo "$same"
    echo "$het"
    python3 -c '
import json, sys
s, h = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert s["bytes"] == h["bytes"] and s["verified"] and h["verified"]
print("round %s  %-70s %6.2f GB/s vs same layout %6.2f GB/s: %.2fx  (daemon CPU %.2f s vs %.2f s: %.2fx)" % (
    sys.argv[3], sys.argv[4], h["gbps"], s["gbps"], h["gbps"] / s["gbps"], h["daemon_cpu_s"], s["daemon_cpu_s"],
    h["daemon_cpu_s"] / s["daemon_cpu_s"]))
with open(sys.argv[5], "a") as f:
    f.write("%s\t%.4f\t%.4f\n" % (sys.argv[4], h["gbps"] / s["gbps"], h["daemon_cpu_s"] / s["daemon_cpu_s"]))' \
      "$same" "$het" "$r" "$c" "$TMP/ratios" >&2
  done
done

# Several rounds: each case's ratios over them (median, range, rounds >= 0.8x).
[ "$ROUNDS" -gt 1 ] && python3 -c '
import collections, statistics, sys
by = collections.defaultdict(list)
for line in open(sys.argv[1]):
    c, w, u = line.rstrip("\n").split("\t")
    by[c].append((float(w), float(u)))
for c, v in by.items():
    w, u = [x[0] for x in v], [x[1] for x in v]
    print("%-70s wall %.2fx median (%.2f-%.2f, %d of %d rounds >= 0.8x), daemon CPU %.2fx median" % (
        c, statistics.median(w), min(w), max(w), sum(x >= 0.8 for x in w), len(w), statistics.median(u)))' \
  "$TMP/ratios" >&2
exit 0
