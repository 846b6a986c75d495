#!/bin/sh
# tcp_vs_iperf.sh - kvferry's tcp transport against iperf3, on loopback, in
# one run on one machine, so the three figures share the same CPU, kernel and
# load: iperf3 with one stream, iperf3 with 4 streams (kvferryd's tcp-streams),
# and kvferry-bench handing 8 llama3-8b KV caches (4096 tokens, 512 MiB each)
# between two kvferryd; then the same by KV layout and block ids (--blocks),
# and llama3-70b at TP 8 (4 KiB K and V blocks) by descriptors and by
# block ids. All rates in GB/s (1e9 bytes/s).
#
# Prints a table, then (last line of stdout) the same as one JSON line.
# Environment: BUILD (default build), POOL (pool size per daemon, default 2G),
# SECONDS_IPERF (default 5), REQUESTS (default 8).
# Usage: make && bench/tcp_vs_iperf.sh   (or: make bench-tcp)
set -eu

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
POOL=${POOL:-2G}
SECONDS_IPERF=${SECONDS_IPERF:-5}
REQUESTS=${REQUESTS:-8}

say() { echo "tcp_vs_iperf: $*" >&2; }
die() { say "$*"; exit 1; }

for bin in kvferryd kvferryctl kvferry-bench; do
  [ -x "$BUILD/$bin" ] || die "$BUILD/$bin is missing (run make first)"
done
for tool in iperf3 python3 ss; do
  command -v "$tool" >/dev/null || die "$tool is missing (scripts/install-deps.sh installs it)"
done

. bench/lib.sh
bench_setup iperf

# Waits until something listens on 127.0.0.1:$1. A probe connection would
# count as a client to iperf3, so ask the kernel instead.
wait_listen() {
  i=0
  while [ -z "$(ss -Hltn "sport = :$1" 2>/dev/null)" ]; do
    i=$((i + 1))
    [ "$i" -le 100 ] || return 1
    sleep 0.1
  done
}

# Bytes from a size like 2G / 512M / 4096 (binary units, as kvferryd reads them).
size_bytes() {
  python3 -c '
import sys
s = sys.argv[1].strip().upper()
m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
print(int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s))' "$1"
}

# ---------------------------------------------------------------- machine
NPROC=$(nproc)
CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
[ -n "$CPU" ] || CPU=$(uname -m)
KERNEL=$(uname -r)
DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)

# Both pools are memfds of POOL bytes, touched by the bench; leave room for
# iperf3 and the page cache rather than pushing the machine into swap or OOM.
POOL_BYTES=$(size_bytes "$POOL")
AVAIL=$(awk '/^MemAvailable:/ { printf "%.0f", $2 * 1024 }' /proc/meminfo)
NEED=$(python3 -c "print(2 * $POOL_BYTES + (1 << 30))")
python3 -c "import sys; sys.exit(0 if $AVAIL >= $NEED else 1)" ||
  die "need $NEED bytes of free memory for two $POOL pools, $AVAIL available (set POOL, at least 512M)"

# ---------------------------------------------------------------- iperf3
# Gigabytes per second received, from iperf3's JSON.
iperf_gbps() {
  python3 -c '
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit("iperf3 wrote no JSON result")
if d.get("error"):
    sys.exit("iperf3: " + d["error"])
print("%.3f" % (d["end"]["sum_received"]["bits_per_second"] / 8e9))' "$1"
}

IPERF_PORT=$(bench_free_ports 1)

iperf3 -s -p "$IPERF_PORT" -B 127.0.0.1 >"$TMP/iperf-server.log" 2>&1 &
PIDS="$PIDS $!"
wait_listen "$IPERF_PORT" || die "iperf3 server did not start: $(tail -n 5 "$TMP/iperf-server.log")"

say "iperf3, 1 stream, ${SECONDS_IPERF}s"
iperf3 -c 127.0.0.1 -p "$IPERF_PORT" -t "$SECONDS_IPERF" -J >"$TMP/p1.json" || true
IPERF_P1=$(iperf_gbps "$TMP/p1.json")
say "iperf3, 4 streams, ${SECONDS_IPERF}s"
iperf3 -c 127.0.0.1 -p "$IPERF_PORT" -t "$SECONDS_IPERF" -P 4 -J >"$TMP/p4.json" || true
IPERF_P4=$(iperf_gbps "$TMP/p4.json")

# ---------------------------------------------------------------- kvferry
bench_pair a b "pool kv host $POOL
tcp-streams 4"

say "kvferry-bench, llama3-8b, 4096 tokens, $REQUESTS requests"
if ! "$BUILD/kvferry-bench" --from "$TMP/a.sock" --to "$TMP/b.sock" --model llama3-8b \
    --tokens 4096 --requests "$REQUESTS" --json >"$TMP/bench.json" 2>"$TMP/bench.err"; then
  cat "$TMP/bench.json" "$TMP/bench.err" >&2
  bench_die "kvferry-bench failed"
fi
cat "$TMP/bench.err" >&2
more_bench() { # NAME ARGS...
  name=$1
  shift
  say "kvferry-bench $*"
  "$BUILD/kvferry-bench" --from "$TMP/a.sock" --to "$TMP/b.sock" --tokens 4096 --requests "$REQUESTS" --json "$@" \
    >"$TMP/$name.json" 2>"$TMP/$name.err" || { cat "$TMP/$name.json" "$TMP/$name.err" >&2; die "kvferry-bench $* failed"; }
}
more_bench blocks --model llama3-8b --blocks
more_bench small --model llama3-70b-tp8
more_bench small_blocks --model llama3-70b-tp8 --blocks

# ---------------------------------------------------------------- report
python3 - "$TMP/bench.json" "$IPERF_P1" "$IPERF_P4" "$NPROC" "$CPU" "$KERNEL" "$DATE" <<'EOF'
import json, os, sys
bench_file, p1, p4, nproc, cpu, kernel, date = sys.argv[1:]
def last(path):
    return json.loads([l for l in open(path).read().splitlines() if l.strip()][-1])
kvf = last(bench_file)
more = {n: last(os.path.join(os.path.dirname(bench_file), n + ".json")) for n in ("blocks", "small", "small_blocks")}
p1, p4, k = float(p1), float(p4), float(kvf["gbps"])
def ratio(a, b):
    return round(a / b, 3) if b > 0 else None
def fmt(r):
    return "-" if r is None else "%.2fx" % r
print("kvferry tcp vs iperf3, loopback, %s" % date)
print("machine: %s CPUs, %s, Linux %s" % (nproc, cpu, kernel))
print("%-44s %10s %10s" % ("", "GB/s", "Gbit/s"))
print("%-44s %10.3f %10.2f" % ("iperf3, 1 stream", p1, p1 * 8))
print("%-44s %10.3f %10.2f" % ("iperf3, 4 streams", p4, p4 * 8))
label = "kvferry tcp (%s, %d req, p50 %.0f ms)" % (kvf.get("model"), kvf.get("requests", 0),
                                                  kvf.get("p50_us", 0) / 1e3)
print("%-44s %10.3f %10.2f" % (label, k, k * 8))
print("kvferry / iperf3 1 stream: %s   kvferry / iperf3 4 streams: %s   (path %s, verified %s)"
      % (fmt(ratio(k, p1)), fmt(ratio(k, p4)), kvf.get("path"), json.dumps(kvf.get("verified"))))
for name, label in (("blocks", "llama3-8b by block ids"), ("small", "llama3-70b-tp8 (4 KiB), descriptors"),
                    ("small_blocks", "llama3-70b-tp8 (4 KiB), block ids")):
    g = float(more[name]["gbps"])
    print("%-44s %10.3f %10.2f   / iperf3 4 streams: %s (verified %s)" % ("kvferry tcp, " + label, g, g * 8,
          fmt(ratio(g, p4)), json.dumps(more[name].get("verified"))))
print(json.dumps({
    "date": date,
    "machine": {"nproc": int(nproc), "cpu": cpu, "kernel": kernel},
    "iperf3_p1_gbps": p1, "iperf3_p4_gbps": p4, "kvferry_gbps": k,
    "kvferry_vs_iperf3_p1": ratio(k, p1), "kvferry_vs_iperf3_p4": ratio(k, p4),
    "kvferry": kvf,
    "blocks_gbps": float(more["blocks"]["gbps"]), "small_descs_gbps": float(more["small"]["gbps"]),
    "small_blocks_gbps": float(more["small_blocks"]["gbps"]),
    "small_blocks_vs_iperf3_p4": ratio(float(more["small_blocks"]["gbps"]), p4),
    "verified_all": all(m.get("verified") for m in [kvf] + list(more.values())),
}))
EOF
