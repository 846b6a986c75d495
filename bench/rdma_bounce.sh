#!/usr/bin/env bash
# rdma_bounce.sh - the rdma transport direct (pools registered with the NIC,
# path "rdma") against the bounce path (both daemons with gpu-direct off:
# every byte staged through pinned memory on both sides, path
# "rdma-bounce"), in ONE run of the soft-RoCE VM (two nodes, rxe0 <->
# rxe1), with the same kvferry-bench commands against two daemons started
# the one way, then the other:
#
#   kvferry-bench --model llama3-8b --tokens 4096 --requests REQUESTS
#     (512 MiB requests of scattered 32 KiB blocks), by descriptors and by
#     block ids (--blocks)
#
# The VM is emulated (TCG): compare figures only within one run; the ratio
# says what the copies through staging cost when the wire is slow, not
# what a GPU's copies cost next to a real NIC.
# Prints a table, then (last line of stdout) the same as one JSON line.
#
# Usage (as root, on the host): make bench-rdma-bounce, or make all &&
# bench/rdma_bounce.sh. Environment: BUILD (default build), REQUESTS (4),
# POOL (1G per daemon), VM_MEM (6G), RDMA_VM (the VM's run script),
# BOUNCE_SIZE (rdma-bounce-size of the bounce daemons, default 64M).
set -euo pipefail

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REQUESTS=${REQUESTS:-4}
POOL=${POOL:-1G}
VM_MEM=${VM_MEM:-6G}
BOUNCE_SIZE=${BOUNCE_SIZE:-64M}
RDMA_VM=${RDMA_VM:-$(cd .. && pwd)/shared/rdma-vm/run}

say() { echo "rdma_bounce: $*" >&2; }
die() { say "$*"; exit 1; }

for bin in kvferryd kvferryctl kvferry-bench; do
  [ -x "$BUILD/$bin" ] || die "$BUILD/$bin is missing (run make all first)"
done

# ---------------------------------------------------------------- host side
if [ -z "${RDMA_VM_NODES:-}" ]; then
  [ -x "$RDMA_VM" ] || die "no VM runner at $RDMA_VM (set RDMA_VM)"
  export BUILD REQUESTS POOL BOUNCE_SIZE
  export HOST_CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) HOST_NPROC=$(nproc)
  exec "$RDMA_VM" --nodes 2 --mem "$VM_MEM" --timeout 900 -- bench/rdma_bounce.sh
fi

# ---------------------------------------------------------------- in the VM
TMP=$(mktemp -d /tmp/kvferry-bounce-bench.XXXXXX)
PIDS=""
stop_daemons() {
  for pid in $PIDS; do kill "$pid" 2>/dev/null || true; done
  for pid in $PIDS; do wait "$pid" 2>/dev/null || true; done
  PIDS=""
}
trap stop_daemons EXIT
DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
PORT0=7471 PORT1=7472

write_conf() { # NAME IP PORT PEER PEER_IP PEER_PORT EXTRA
  cat >"$TMP/$1.conf" <<EOF
node $1
api-socket $TMP/$1.sock
peer-listen $2:$3
peer $4 $5:$6
pool kv host $POOL
transports rdma
max-descs 200000
log-level info
$7
EOF
}

. bench/lib.sh # bench_ctl, bench_rdma_start
BENCH_NAME=$(basename "$0" .sh) # bench_die's prefix (no bench_setup here)

start_daemons() { # EXTRA
  write_conf prefill "$NODE0_IP" $PORT0 decode "$NODE1_IP" $PORT1 "$1"
  write_conf decode "$NODE1_IP" $PORT1 prefill "$NODE0_IP" $PORT0 "$1"
  bench_rdma_start prefill decode
}

bench() { # OUT ARGS...
  local out=$1
  shift
  "$BUILD/kvferry-bench" --from "$TMP/prefill.sock" --to "$TMP/decode.sock" --json "$@" >"$out" 2>"$out.err" ||
    { cat "$out" "$out.err" >&2; tail -n 20 "$TMP"/*.log >&2; die "kvferry-bench $* failed"; }
}

for mode in direct bounce; do
  extra=""
  [ $mode = bounce ] && extra=$'gpu-direct off\nrdma-bounce-size '"$BOUNCE_SIZE"
  start_daemons "$extra"
  say "$mode: kvferry-bench, llama3-8b, 4096 tokens, $REQUESTS requests, descriptors then block ids"
  bench "$TMP/$mode.json" --model llama3-8b --tokens 4096 --requests "$REQUESTS"
  bench "$TMP/${mode}_blocks.json" --model llama3-8b --tokens 4096 --requests "$REQUESTS" --blocks
  bench_ctl prefill status --json >"$TMP/${mode}_status.json"
  stop_daemons
done

python3 - "$TMP" "$DATE" "$BOUNCE_SIZE" <<'EOF'
import json, os, sys
tmp, date, bsize = sys.argv[1:]
def last_json(path):
    return json.loads([l for l in open(path).read().splitlines() if l.strip()][-1])
r = {n: last_json(os.path.join(tmp, n + ".json")) for n in ("direct", "direct_blocks", "bounce", "bounce_blocks")}
st = json.load(open(os.path.join(tmp, "bounce_status.json")))
staged = sum(d.get("bounce", {}).get("sent_bytes", 0) for d in st["rdma"]["devices"])
regs = [p["registration"] for p in st["pools"]]
g = {n: float(v["gbps"]) for n, v in r.items()}
print("kvferry rdma direct vs rdma-bounce, soft-RoCE VM (rxe0 -> rxe1), %s" % date)
print("host: %s CPUs, %s; guest: %s vCPUs (TCG), Linux %s" % (os.environ.get("HOST_NPROC", "?"),
      os.environ.get("HOST_CPU", "?"), os.cpu_count(), os.uname().release))
print("bounce daemons: gpu-direct off, rdma-bounce-size %s; pool registration %s; %.0f MiB staged by the sender" %
      (bsize, ",".join(regs), staged / 2**20))
print("%-52s %12s" % ("", "value"))
print("%-52s %9.1f MB/s" % ("rdma, llama3-8b 4096 tok, descriptors", g["direct"] * 1e3))
print("%-52s %9.1f MB/s" % ("rdma-bounce, the same", g["bounce"] * 1e3))
print("%-52s %12.3f" % ("  ratio bounce / direct", g["bounce"] / g["direct"] if g["direct"] else 0))
print("%-52s %9.1f MB/s" % ("rdma, by block ids", g["direct_blocks"] * 1e3))
print("%-52s %9.1f MB/s" % ("rdma-bounce, by block ids", g["bounce_blocks"] * 1e3))
print("%-52s %12.3f" % ("  ratio bounce / direct", g["bounce_blocks"] / g["direct_blocks"] if g["direct_blocks"] else 0))
print(json.dumps({"date": date, "bounce_size": bsize, "direct_mbps": g["direct"] * 1e3,
                  "bounce_mbps": g["bounce"] * 1e3, "direct_blocks_mbps": g["direct_blocks"] * 1e3,
                  "bounce_blocks_mbps": g["bounce_blocks"] * 1e3,
                  "ratio": g["bounce"] / g["direct"] if g["direct"] else 0,
                  "ratio_blocks": g["bounce_blocks"] / g["direct_blocks"] if g["direct_blocks"] else 0,
                  "staged_bytes": staged}))
EOF
