#!/usr/bin/env bash
# gpu_tcp_bounce.sh - tcp-bounce on one GPU, in one run: two kvferryd on
# loopback, each with a cuda:0 pool, hand llama3-8b 4096-token KV caches
# (16384 x 32 KiB = 512 MiB) GPU -> pinned host -> socket -> pinned host ->
# GPU, every byte verified; against the two ceilings measured in the same
# run: pinned H2D (and D2H) and iperf3 over loopback (1 and 4 streams; the
# daemons use tcp-streams 4). Also host->host kvferry for the staging cost.
# Environment: BUILD (default build), IPERF3 (default iperf3), REQUESTS (8),
# OUT_JSON (default /dev/null).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
IPERF3=${IPERF3:-iperf3}
REQUESTS=${REQUESTS:-8}
OUT_JSON=${OUT_JSON:-/dev/null}
say() { echo "gpu_tcp_bounce: $*" >&2; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-gputcp.XXXXXX")
PIDS=""
cleanup() {
  for p in $PIDS; do kill "$p" 2>/dev/null; done
  for p in $PIDS; do wait "$p" 2>/dev/null; done
  rm -rf "$TMP"
}
trap cleanup EXIT
ports() { python3 -c 'import socket
s=[socket.socket() for _ in range('"$1"')]
[x.bind(("127.0.0.1",0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))'; }
echo "== gpu_tcp_bounce: $(date -u +%Y-%m-%dT%H:%M:%SZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1), $(nproc) CPUs, kernel $(uname -r)"

# ---------------------------------------------------------------- pinned copies
"$BUILD/tests/gpu/gpu_copy" pinned $((512 << 20)) 20 >"$TMP/pinned.json" 2>"$TMP/pinned.err" || cat "$TMP/pinned.err"
grep '^{' "$TMP/pinned.json" >>"$OUT_JSON"
H2D=$(python3 -c 'import json,sys
for l in open(sys.argv[1]):
    if l.startswith("{"):
        d=json.loads(l)
        if d["what"]=="pinned_h2d": print("%.2f" % d["gbps"])' "$TMP/pinned.json")
D2H=$(python3 -c 'import json,sys
for l in open(sys.argv[1]):
    if l.startswith("{"):
        d=json.loads(l)
        if d["what"]=="pinned_d2h": print("%.2f" % d["gbps"])' "$TMP/pinned.json")
echo "  pinned H2D $H2D GB/s, D2H $D2H GB/s (512 MiB, cuMemcpyAsync)"

# ---------------------------------------------------------------- iperf3
read -r IP PA PB <<<"$(ports 3)"
IPERF1="" IPERF4=""
if command -v "$IPERF3" >/dev/null 2>&1; then
  "$IPERF3" -s -p "$IP" -B 127.0.0.1 >"$TMP/iperf-s.log" 2>&1 &
  PIDS="$PIDS $!"
  sleep 0.5
  for n in 1 4; do
    "$IPERF3" -c 127.0.0.1 -p "$IP" -t 5 -P $n -J >"$TMP/iperf$n.json" 2>&1
    v=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.2f" % (d["end"]["sum_received"]["bits_per_second"]/8e9))' "$TMP/iperf$n.json" 2>/dev/null)
    echo "{\"what\": \"iperf3_loopback\", \"streams\": $n, \"gbps\": ${v:-0}}" >>"$OUT_JSON"
    echo "  iperf3 loopback, $n stream(s): ${v:-?} GB/s"
    [ $n = 1 ] && IPERF1=$v || IPERF4=$v
  done
else
  say "iperf3 not found ($IPERF3): no network ceiling measured"
fi

# ---------------------------------------------------------------- kvferry
conf() { # NAME PORT PEERNAME PEERPORT
  cat >"$TMP/$1.conf" <<EOF
node $1
api-socket $TMP/$1.sock
peer-listen 127.0.0.1:$2
peer $3 127.0.0.1:$4
pool g cuda:0 2G
pool h host 2G
transports tcp
log-level info
cuda on
EOF
}
conf pa "$PA" pb "$PB"
conf pb "$PB" pa "$PA"
for n in pa pb; do
  "$BUILD/kvferryd" -c "$TMP/$n.conf" >"$TMP/$n.log" 2>&1 &
  PIDS="$PIDS $!"
done
for i in $(seq 1 150); do
  grep -q "peer pb up" "$TMP/pa.log" 2>/dev/null && grep -q "peer pa up" "$TMP/pb.log" 2>/dev/null && break
  sleep 0.1
done
run() { # NAME POOL_FROM POOL_TO
  local name=$1 pf=$2 pt=$3
  if "$BUILD/kvferry-bench" --from "$TMP/pa.sock" --to "$TMP/pb.sock" --pool-from "$pf" --pool-to "$pt" \
      --model llama3-8b --tokens 4096 --requests "$REQUESTS" --json >"$TMP/$name.json" 2>"$TMP/$name.err"; then
    sed "s/^{/{\"what\": \"$name\", /" "$TMP/$name.json" >>"$OUT_JSON"
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("  %-18s %7.2f GB/s  p50 %.0f us  path %s verified %s" % (sys.argv[2], d["gbps"], d["p50_us"], d["path"], d["verified"]))' "$TMP/$name.json" "$name"
  else
    say "$name failed"; tail -n 3 "$TMP/$name.err" "$TMP/$name.json"
  fi
}
run kvf_host_host h h
run kvf_gpu_gpu g g
run kvf_gpu_host g h
run kvf_host_gpu h g
B=$(python3 -c 'import json; print("%.2f" % json.load(open("'"$TMP"'/kvf_gpu_gpu.json"))["gbps"])' 2>/dev/null)
CEIL=$(python3 -c "v=[x for x in ['${H2D}','${IPERF4}'] if x]; print('%.2f' % min(float(x) for x in v) if v else '')")
echo "== summary: tcp-bounce GPU->GPU ${B:-?} GB/s; min(pinned H2D ${H2D:-?}, iperf3 4 streams ${IPERF4:-?}) = ${CEIL:-?} GB/s; ratio $(python3 -c "print('%.3f' % (${B:-0}/${CEIL:-1}))" 2>/dev/null) (goal >= 0.8); iperf3 1 stream ${IPERF1:-?}"
