#!/usr/bin/env bash
# rdma_vs_perftest.sh - kvferry's rdma transport against perftest, in ONE run
# of the soft-RoCE VM (../shared/rdma-vm, two nodes, rxe0 <-> rxe1), so that
# every figure shares the same emulated CPUs, kernel and devices:
#
#   1. ib_write_bw, 32 KiB writes, rxe0 -> rxe1             bandwidth bar
#   2. kvferry-bench over rdma: llama3-8b, 4096 tokens       512 MiB requests of
#      (scattered 32 KiB blocks), REQUESTS requests          scattered 32 KiB blocks
#      and the same request by KV layout and block ids (--blocks)
#   2b. ib_write_bw, 4 KiB writes, and kvferry-bench with   small blocks
#      llama3-70b at TP 8 (4 KiB K and V blocks), 4096
#      tokens, by descriptors and by block ids
#   3. ib_write_lat, 32 KiB, rxe0 -> rxe1                   latency bar
#   4. kvferry-bench, one 32 KiB block per request,         1-block handoff
#      LAT_REQUESTS requests, grant posted first (untimed): p50 / p99 of
#      send -> RECV_DONE; the same with each grant posted LEAD_MS before
#      its send (as an engine grants a whole prefill ahead: the grant's
#      windows are bound and it reached the sender); and with grant and
#      send both timed
#   5. two transfers of 100,000 1 KiB descriptors, and the  posting cost
#      daemon's posting cost per descriptor of the second from its status
#   6. build/post-bench (bench/post_bench.c: the same posting code,
#      rdma_post.c and rdma_mw.c linked in, on a fake peer with no device, 100k descriptors, memory
#      windows as the daemons use them) on the host before the VM boots and
#      in the VM: the sender's own cost per descriptor on the host's CPU,
#      and how much of the daemon's figure in the VM is the emulation
#   7. build/wake-bench in the VM: one thread wake-up (epoll on an eventfd)
#      and one process wake-up (poll on a Unix socket), back to back and
#      after LEAD_MS idle; a handoff sleeps in 2 process and 3 thread
#      waits (the third: the receiver's progress thread on its completion
#      channel) besides the wire, so 2P + 3T + ib_write_lat is printed as
#      what the handoff would take if the wake-ups were all of it
#
# The VM is emulated (TCG): compare figures only within one run.
# Prints a table, then (last line of stdout) the same as one JSON line.
#
# Usage (as root, on the host): make bench-rdma, or make all bench-tools &&
# bench/rdma_vs_perftest.sh
# It boots the VM and runs itself inside. Environment: BUILD (default build),
# REQUESTS (4), LAT_REQUESTS (200), LEAD_MS (20), PERF_SECONDS (5), POOL (1G per daemon),
# VM_MEM (6G), RDMA_VM (the VM's run script), EXTRA_CONF (config lines for
# both daemons, e.g. $'rdma-qps-per-peer 1\nrdma-poll-us 0'), BUSY_POLL=1
# (the daemons' busy-poll and kvferry-bench --busy-poll: everything spins).
set -euo pipefail

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REQUESTS=${REQUESTS:-4}
LAT_REQUESTS=${LAT_REQUESTS:-200}
LEAD_MS=${LEAD_MS:-20}
PERF_SECONDS=${PERF_SECONDS:-5}
POOL=${POOL:-1G}
VM_MEM=${VM_MEM:-6G}
RDMA_VM=${RDMA_VM:-$(cd .. && pwd)/shared/rdma-vm/run}
EXTRA_CONF=${EXTRA_CONF:-}
BUSY_POLL=${BUSY_POLL:-0}

say() { echo "rdma_vs_perftest: $*" >&2; }
die() { say "$*"; exit 1; }

for bin in kvferryd kvferryctl kvferry-bench post-bench wake-bench; do
  [ -x "$BUILD/$bin" ] || die "$BUILD/$bin is missing (run make all bench-tools first)"
done

# ---------------------------------------------------------------- host side
if [ -z "${RDMA_VM_NODES:-}" ]; then
  [ -x "$RDMA_VM" ] || die "no VM runner at $RDMA_VM (set RDMA_VM)"
  HOST_CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
  export BUILD REQUESTS LAT_REQUESTS LEAD_MS PERF_SECONDS POOL EXTRA_CONF BUSY_POLL
  export HOST_CPU HOST_NPROC=$(nproc) HOST_KERNEL=$(uname -r)
  HOST_POST_BENCH=$("$BUILD/post-bench" 100000 9 2 | tr '\n' ' ')
  export HOST_POST_BENCH
  exec "$RDMA_VM" --nodes 2 --mem "$VM_MEM" --timeout 900 -- bench/rdma_vs_perftest.sh
fi

# ---------------------------------------------------------------- in the VM
TMP=$(mktemp -d /tmp/kvferry-rdma-bench.XXXXXX)
PIDS=""
cleanup() {
  for pid in $PIDS; do kill "$pid" 2>/dev/null || true; done
  for pid in $PIDS; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
PORT0=7471 PORT1=7472

# perftest's client line after the "#bytes" header; field $1 of it.
perf_field() { awk -v f="$2" '/^ *#bytes/ {h = 1; next} h && NF > 3 {print $f; exit}' "$1"; }

perftest_try() { # TOOL OUT ARGS...: 0 when a result came
  local tool=$1 out=$2
  shift 2
  node1 "$tool" -d "$NODE1_DEV" -x 1 "$@" >"$TMP/$tool.server" 2>&1 &
  local spid=$! i
  # The server may take a while to listen on a loaded (emulated) machine.
  for i in 1 2 3 4 5 6 7 8 9 10; do
    sleep 1
    node0 "$tool" -d "$NODE0_DEV" -x 1 "$@" "$NODE1_IP" >"$out" 2>&1 && break
    grep -q "Couldn't connect" "$out" || break
  done
  kill "$spid" 2>/dev/null || true
  wait "$spid" 2>/dev/null || true
  [ -n "$(perf_field "$out" 1)" ]
}

perftest_pair() { # TOOL OUT ARGS...
  local tool=$1 out=$2 try
  shift 2
  # Under TCG the clock perftest calibrates against can be too unsteady
  # for it ("Correlation coefficient ... Can't produce a report"): again.
  for try in 1 2 3; do
    perftest_try "$tool" "$out" "$@" && return 0
    say "$tool gave no result (try $try of 3)"
  done
  cat "$out" >&2
  die "$tool failed"
}

say "ib_write_bw, 32 KiB, ${PERF_SECONDS}s"
perftest_pair ib_write_bw "$TMP/bw" -s 32768 -D "$PERF_SECONDS" --report_gbits
BW_GBIT=$(perf_field "$TMP/bw" 4)
say "ib_write_bw, 4 KiB, ${PERF_SECONDS}s"
perftest_pair ib_write_bw "$TMP/bw4k" -s 4096 -D "$PERF_SECONDS" --report_gbits
BW4K_GBIT=$(perf_field "$TMP/bw4k" 4)
say "ib_write_lat, 32 KiB, 1000 iterations"
perftest_pair ib_write_lat "$TMP/lat" -s 32768 -n 1000
LAT_TYP=$(perf_field "$TMP/lat" 5)
LAT_AVG=$(perf_field "$TMP/lat" 6)

# ---------------------------------------------------------------- kvferry
write_conf() { # NAME IP PORT PEER PEER_IP PEER_PORT
  cat >"$TMP/$1.conf" <<EOF
node $1
api-socket $TMP/$1.sock
peer-listen $2:$3
peer $4 $5:$6
pool kv host $POOL
transports rdma
max-descs 200000
log-level info
$EXTRA_CONF
EOF
}

. bench/lib.sh # bench_ctl, bench_rdma_start
BENCH_NAME=$(basename "$0" .sh) # bench_die's prefix (no bench_setup here)

start_daemons() {
  write_conf prefill "$NODE0_IP" $PORT0 decode "$NODE1_IP" $PORT1
  write_conf decode "$NODE1_IP" $PORT1 prefill "$NODE0_IP" $PORT0
  bench_rdma_start prefill decode
}

BENCH_FLAGS=()
if [ "$BUSY_POLL" = 1 ]; then
  EXTRA_CONF="$EXTRA_CONF"$'\nbusy-poll yes'
  BENCH_FLAGS=(--busy-poll)
fi

bench() { # OUT ARGS...
  local out=$1
  shift
  "$BUILD/kvferry-bench" "${BENCH_FLAGS[@]}" --from "$TMP/prefill.sock" --to "$TMP/decode.sock" --json "$@" >"$out" 2>"$out.err" ||
    { cat "$out" "$out.err" >&2; tail -n 20 "$TMP"/*.log >&2; die "kvferry-bench $* failed"; }
}

start_daemons
say "kvferry-bench, llama3-8b, 4096 tokens, $REQUESTS requests"
bench "$TMP/kv.json" --model llama3-8b --tokens 4096 --requests "$REQUESTS"
say "kvferry-bench, llama3-8b, 4096 tokens, $REQUESTS requests, by block ids"
bench "$TMP/kv_blocks.json" --model llama3-8b --tokens 4096 --requests "$REQUESTS" --blocks
say "kvferry-bench, llama3-70b-tp8 (4 KiB blocks), 4096 tokens, $REQUESTS requests, descriptors then block ids"
bench "$TMP/small.json" --model llama3-70b-tp8 --tokens 4096 --requests "$REQUESTS"
bench "$TMP/small_blocks.json" --model llama3-70b-tp8 --tokens 4096 --requests "$REQUESTS" --blocks
# One llama3-8b block: 16 tokens x 8 KV heads x 128 x 2 bytes = 32 KiB.
ONE="--layers 1 --mla --kv-heads 8 --head-dim 128 --block-tokens 16 --dtype-bytes 2 --tokens 16"
say "kvferry-bench, one 32 KiB block, $LAT_REQUESTS requests, from the send"
bench "$TMP/one.json" $ONE --requests "$LAT_REQUESTS" --time-from-send
bench_ctl decode status --json >"$TMP/decode_status.json" # the last 1-block grant's windows
say "kvferry-bench, one 32 KiB block, $LAT_REQUESTS requests, each grant $LEAD_MS ms ahead"
bench "$TMP/one_lead.json" $ONE --requests "$LAT_REQUESTS" --grant-lead-ms "$LEAD_MS"
say "kvferry-bench, one 32 KiB block, $LAT_REQUESTS requests, grant and send timed"
bench "$TMP/one_gs.json" $ONE --requests "$LAT_REQUESTS"
say "kvferry-bench, one transfer of 100000 x 1 KiB descriptors"
bench "$TMP/100k.json" --layers 1 --mla --kv-heads 1 --head-dim 512 --block-tokens 1 --tokens 100000 --requests 2
bench_ctl prefill status --json >"$TMP/status.json"
cleanup # the daemons stop (with busy-poll they would spin under what follows)
PIDS=""
say "post-bench in the VM (the host ran it before the boot)"
"$BUILD/post-bench" 100000 9 2 >"$TMP/post.json"
say "wake-bench in the VM"
"$BUILD/wake-bench" 400 "$LEAD_MS" >"$TMP/wake.json"

# ---------------------------------------------------------------- report
python3 - "$TMP" "$BW_GBIT" "$LAT_TYP" "$LAT_AVG" "$DATE" "$LEAD_MS" "$BW4K_GBIT" <<'EOF'
import json, os, sys
tmp, bw_gbit, lat_typ, lat_avg, date, lead_ms, bw4k_gbit = sys.argv[1:]
def last_json(path):
    return json.loads([l for l in open(path).read().splitlines() if l.strip()][-1])
kv, one, one_lead, one_gs, big = (last_json(os.path.join(tmp, n))
                                  for n in ("kv.json", "one.json", "one_lead.json", "one_gs.json", "100k.json"))
kvb, small, smallb = (last_json(os.path.join(tmp, n)) for n in ("kv_blocks.json", "small.json", "small_blocks.json"))
bw4k = float(bw4k_gbit) / 8
rdma = json.load(open(os.path.join(tmp, "status.json")))["rdma"]
post, mw = rdma["post"], rdma.get("memory_windows") or {}
dmw = json.load(open(os.path.join(tmp, "decode_status.json")))["rdma"].get("memory_windows") or {}
def post_bench(text):  # post-bench's sum_ns for the mode the daemons ran in
    rows = [json.loads(l) for l in text.replace("} {", "}\n{").splitlines() if l.strip()]
    return next(r["sum_ns"] for r in rows if r["memory_windows"] == bool(mw.get("in_use")))
vm_post = post_bench(open(os.path.join(tmp, "post.json")).read())
wake = last_json(os.path.join(tmp, "wake.json"))
host_post = post_bench(os.environ["HOST_POST_BENCH"])
bw = float(bw_gbit) / 8          # GB/s (1e9 bytes)
lat_typ, lat_avg = float(lat_typ), float(lat_avg)
k = float(kv["gbps"])
per_desc = post["last_loop_ns_per_wr"] + post["last_build_ns_per_wr"]
host = "%s CPUs, %s, Linux %s" % (os.environ.get("HOST_NPROC", "?"), os.environ.get("HOST_CPU", "?"),
                                 os.environ.get("HOST_KERNEL", "?"))
busy = os.environ.get("BUSY_POLL") == "1"
print("kvferry rdma vs perftest, soft-RoCE VM (rxe0 -> rxe1), %s%s" % (date, ", busy-poll" if busy else ""))
print("host: %s; guest: %s vCPUs (TCG), Linux %s" % (host, os.cpu_count(), os.uname().release))
print("%-52s %12s" % ("", "value"))
print("%-52s %9.1f MB/s" % ("ib_write_bw, 32 KiB", bw * 1e3))
print("%-52s %9.1f MB/s" % ("kvferry rdma, llama3-8b 4096 tok (%d x %.0f MiB)" % (kv["requests"], kv["bytes"] / kv["requests"] / 2**20), k * 1e3))
print("%-52s %12.3f" % ("  ratio kvferry / ib_write_bw (goal >= 0.97)", k / bw if bw else 0))
print("%-52s %9.1f MB/s" % ("kvferry rdma, the same by block ids", float(kvb["gbps"]) * 1e3))
print("%-52s %12.3f" % ("  ratio blocks / ib_write_bw", float(kvb["gbps"]) / bw if bw else 0))
print("%-52s %9.1f MB/s" % ("ib_write_bw, 4 KiB", bw4k * 1e3))
print("%-52s %9.1f MB/s" % ("kvferry rdma, llama3-70b-tp8 4096 tok, descriptors", float(small["gbps"]) * 1e3))
print("%-52s %9.1f MB/s" % ("kvferry rdma, llama3-70b-tp8 4096 tok, block ids", float(smallb["gbps"]) * 1e3))
print("%-52s %12.3f / %.3f" % ("  ratio to ib_write_bw 4 KiB (goal >= 0.97)", float(small["gbps"]) / bw4k if bw4k else 0,
                                float(smallb["gbps"]) / bw4k if bw4k else 0))
print("%-52s %9.1f us" % ("ib_write_lat, 32 KiB, typical (avg %.1f)" % lat_avg, lat_typ))
print("%-52s %9.1f us" % ("kvferry 1-block handoff p50, from the send (p99 %.0f)" % one["p99_us"], one["p50_us"]))
print("%-52s %9.1f us" % ("  handoff - ib_write_lat (goal <= 10)", one["p50_us"] - lat_typ))
print("%-52s %9.1f us" % ("kvferry 1-block handoff p50, grant %s ms ahead (p99 %.0f)" % (lead_ms, one_lead["p99_us"]),
                          one_lead["p50_us"]))
print("%-52s %9.1f us" % ("  handoff - ib_write_lat (goal <= 10)", one_lead["p50_us"] - lat_typ))
print("%-52s %9.1f us" % ("kvferry 1-block, grant + send timed, p50", one_gs["p50_us"]))
print("%-52s %9.1f ns" % ("posting cost per descriptor, 100k (loop + build)", per_desc))
print("%-52s %9.1f ns" % ("  of which on the loop (ticket, slicing, checks)", post["last_loop_ns_per_wr"]))
print("%-52s %9.1f ns" % ("  of which building work requests", post["last_build_ns_per_wr"]))
print("%-52s %9.1f ns" % ("  ibv_post_send per descriptor (rxe: runs the NIC)", post["last_doorbell_ns_per_wr"]))
print("%-52s %9.1f MB/s" % ("  100k x 1 KiB transfer rate", float(big["gbps"]) * 1e3))
print("%-52s %9.1f us" % ("wake-up, thread (epoll, eventfd), one way", wake["thread_us"]))
print("%-52s %9.1f us" % ("wake-up, process (poll, Unix socket), one way", wake["process_us"]))
model = 2 * wake["process_us"] + 3 * wake["thread_us"] + lat_typ
model_gap = 2 * wake["process_after_gap_us"] + 3 * wake["thread_after_gap_us"] + lat_typ
print("%-52s %9.1f us" % ("  2P + 3T + ib_write_lat, back to back", model))
print("%-52s %9.1f us" % ("  the same after %s ms idle" % lead_ms, model_gap))
print("%-52s %9.1f ns" % ("post-bench (same code, no device), in the VM", vm_post))
print("%-52s %9.1f ns" % ("post-bench on the host CPU (goal <= 100)", host_post))
if mw.get("in_use"):
    print("%-52s %9.3f ms" % ("1-block grant: its window bound in (the last one)", dmw.get("last_bind_ms", 0)))
print("memory windows: %s; writes whose window was searched for: %s of %s" % (
      "in use" if mw.get("in_use") else "not in use", mw.get("searches", "-"), mw.get("lookups", "-")))
print("paths: %s / %s / %s; verified: %s" % (kv["path"], one["path"], big["path"],
      " ".join(str(r["verified"]) for r in (kv, kvb, small, smallb, one, one_lead, one_gs, big))))
print(json.dumps({
    "date": date, "host": host, "busy_poll": busy, "ib_write_bw_gbps": round(bw, 4), "kvferry_gbps": k,
    "bw_ratio": round(k / bw, 3) if bw else None, "ib_write_lat_typical_us": lat_typ,
    "ib_write_lat_avg_us": lat_avg, "handoff_p50_us": one["p50_us"], "handoff_p99_us": one["p99_us"],
    "handoff_minus_lat_us": round(one["p50_us"] - lat_typ, 1), "handoff_lead_ms": int(lead_ms),
    "handoff_lead_p50_us": one_lead["p50_us"], "handoff_lead_p99_us": one_lead["p99_us"],
    "handoff_grant_send_p50_us": one_gs["p50_us"], "memory_windows": bool(mw.get("in_use")),
    "mw_lookups": mw.get("lookups"), "mw_searches": mw.get("searches"),
    "one_block_bind_ms": dmw.get("last_bind_ms"),
    "post_ns_per_desc": round(per_desc, 1),
    "post_loop_ns": post["last_loop_ns_per_wr"], "post_build_ns": post["last_build_ns_per_wr"],
    "post_doorbell_ns": post["last_doorbell_ns_per_wr"], "descs_100k_gbps": big["gbps"],
    "post_bench_vm_ns": vm_post, "post_bench_host_ns": host_post,
    "wake_thread_us": wake["thread_us"], "wake_process_us": wake["process_us"],
    "wake_thread_after_gap_us": wake["thread_after_gap_us"],
    "wake_process_after_gap_us": wake["process_after_gap_us"],
    "handoff_wake_model_us": round(model, 1), "handoff_wake_model_after_gap_us": round(model_gap, 1),
    "kvferry_blocks_gbps": kvb["gbps"], "ib_write_bw_4k_gbps": round(bw4k, 4),
    "small_descs_gbps": small["gbps"], "small_blocks_gbps": smallb["gbps"],
    "small_descs_ratio": round(float(small["gbps"]) / bw4k, 3) if bw4k else None,
    "small_blocks_ratio": round(float(smallb["gbps"]) / bw4k, 3) if bw4k else None,
    "path": kv["path"], "verified": all(r["verified"] for r in (kv, kvb, small, smallb, one, one_lead, one_gs, big))}))
EOF
