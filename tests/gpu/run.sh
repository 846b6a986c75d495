#!/usr/bin/env bash
# tests/gpu/run.sh - `make check-gpu`: kvferry on real GPUs.
#
#   1. the CUDA module alone: every copy route, odd geometries (gpu_copy),
#      again with peer access disabled (the staged path); block copies
#      between KV layouts by the block kernel and by its fallback
#      (gpu_blocks); transforms between layouts of other heads, order and
#      tokens per block (gpu_xform; XFORM_BENCH=REPS times them against
#      same-layout block copies); the rdma receiver's GPU pass from a
#      staged slice in mapped host memory (gpu_stage); engine GPU memory
#      exported and imported (gpu_ipc)
#   2. two kvferryd on loopback with cuda:N and host pools
#   3. two engine processes mapping one cuda pool at once (gpu_map_client)
#   4. local handoffs GPU->GPU (and GPU<->host, same pool), odd geometries,
#      heterogeneous layouts between cuda pools (TP 8 -> 4, NHD -> HND with
#      16 -> 64 tokens per block), every byte verified by kvferry-bench,
#      path checked
#   4b. block transfers by KV layout and block ids between two clients
#      (gpu_blocks_client), by the block kernel
#   5. tcp-bounce handoffs between the two daemons, GPU->GPU, GPU->host,
#      host->GPU, odd geometries (RECV_DONE's path is the receiving side's:
#      tcp-bounce into a GPU pool, tcp into a host pool)
#   5b. heterogeneous layouts (TP, order, tokens per block) over tcp into a
#      cuda pool, every byte against a numpy reference (hetero_tcp_gpu.py;
#      needs numpy and torch)
#   6. kvferryctl status/pools/doctor; start failures that must be clear
#
# Needs at least one GPU; the GPU->GPU cases need two (skipped, and said,
# with one). Without any GPU every case is skipped and the exit status is 0.
# Environment: BUILD (default build); LOGS_TO=DIR saves every log there as
# check_gpu_logs.tgz; BLOCKS_BENCH=REPS also times the block transfers
# (gpu_blocks_client bench). Prints "N passed, N failed, N skipped".
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
export NCCL_NVLS_ENABLE=0
pass=0 fail=0 skip=0
failed=()

ok() { pass=$((pass + 1)); echo "ok   $*"; }
bad() { fail=$((fail + 1)); failed+=("$1"); echo "FAIL $*"; }
skipped() { skip=$((skip + 1)); echo "skip $*"; }

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-gpu.XXXXXX")
PIDS=""
cleanup() {
  for p in $PIDS; do kill "$p" 2>/dev/null; done
  for p in $PIDS; do
    i=0
    while kill -0 "$p" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
    kill -9 "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  if [ -n "${LOGS_TO:-}" ]; then tar -C "$TMP" -czf "$LOGS_TO/check_gpu_logs.tgz" . 2>/dev/null; fi
  if [ "$fail" -eq 0 ]; then rm -rf "$TMP"; else echo "logs kept in $TMP"; fi
}
trap cleanup EXIT

NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); fi
echo "== kvferry check-gpu: $NGPU GPU(s), build $BUILD"
if [ "$NGPU" -eq 0 ]; then
  skipped "everything: no GPU here"
  echo "$pass passed, $fail failed, $skip skipped"
  exit 0
fi

# ---------------------------------------------------------------- 1. module
for mode in peer staged; do
  env=""
  [ $mode = staged ] && env="KVF_CUDA_NO_PEER=1"
  if [ $mode = staged ] && [ "$NGPU" -lt 2 ]; then skipped "gpu_copy staged: one GPU"; continue; fi
  if env $env timeout 300 "$BUILD/tests/gpu/gpu_copy" test >"$TMP/gpu_copy_$mode.log" 2>&1; then
    ok "gpu_copy test ($mode): $(grep -c '^ok' "$TMP/gpu_copy_$mode.log") routes"
  else
    bad "gpu_copy_$mode" "gpu_copy test ($mode)"; tail -n 20 "$TMP/gpu_copy_$mode.log"
  fi
done

# the block kernel (KV layouts, addresses computed on the GPU), and its
# fallback without the kernel (cuMemcpy per run)
for mode in kernel memcpy; do
  env=""
  [ $mode = memcpy ] && env="KVF_CUDA_BLOCKS=memcpy"
  if env $env timeout 300 "$BUILD/tests/gpu/gpu_blocks" test >"$TMP/gpu_blocks_$mode.log" 2>&1; then
    ok "gpu_blocks test ($mode): $(grep -c '^ok' "$TMP/gpu_blocks_$mode.log") cases"
  else
    bad "gpu_blocks_$mode" "gpu_blocks test ($mode)"; tail -n 20 "$TMP/gpu_blocks_$mode.log"
  fi
done

# the transform kernel (heterogeneous layouts: other heads, order, tokens
# per block), every byte against a host reference; and its fallback
for mode in kernel memcpy; do
  env=""
  [ $mode = memcpy ] && env="KVF_CUDA_BLOCKS=memcpy"
  if env $env timeout 300 "$BUILD/tests/gpu/gpu_xform" ${XFORM_BENCH:+bench "$XFORM_BENCH"} >"$TMP/gpu_xform_$mode.log" 2>&1; then
    ok "gpu_xform ($mode): $(grep -c '^ok' "$TMP/gpu_xform_$mode.log") cases"; grep '^{' "$TMP/gpu_xform_$mode.log" | sed 's/^/    /'
  else
    bad "gpu_xform_$mode" "gpu_xform ($mode)"; tail -n 20 "$TMP/gpu_xform_$mode.log"
  fi
done

# the rdma receiver's GPU pass (issue 17): a staged slice in host memory
# mapped for CUDA into a cuda pool's grant by the transform kernel, chunk
# by chunk, every byte against a host reference (no NIC needed)
timeout 300 "$BUILD/tests/gpu/gpu_stage" >"$TMP/gpu_stage.log" 2>&1
case $? in
  0) ok "gpu_stage: $(grep -c '^ok' "$TMP/gpu_stage.log") cases"; grep '^ok' "$TMP/gpu_stage.log" | sed 's/^/    /' ;;
  77) skipped "gpu_stage: $(tail -n 1 "$TMP/gpu_stage.log")" ;;
  *) bad gpu_stage "gpu_stage"; tail -n 20 "$TMP/gpu_stage.log" ;;
esac

# engine GPU memory: exported by a forked engine (IPC handle, VMM fd),
# imported by the daemon's CUDA module, every byte checked on both sides
if timeout 300 "$BUILD/tests/gpu/gpu_ipc" test >"$TMP/gpu_ipc.log" 2>&1; then
  ok "gpu_ipc test: $(grep -c '^ok' "$TMP/gpu_ipc.log") checks"; grep '^ok' "$TMP/gpu_ipc.log" | sed 's/^/    /'
else
  bad gpu_ipc "gpu_ipc test"; tail -n 30 "$TMP/gpu_ipc.log"
fi

# ---------------------------------------------------------------- 2. daemons
free_ports() {
  python3 -c '
import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))'
}
read -r PA PB <<<"$(free_ports)"
G1=1; [ "$NGPU" -lt 2 ] && G1=0
# A: two GPUs and host; B: a GPU and host. 1 GiB each (llama3-8b 4096
# tokens is 512 MiB per request).
conf() { # NAME PORT PEER PEERPORT POOLS...
  local n=$1 p=$2 peer=$3 pp=$4; shift 4
  {
    echo "node $n"; echo "api-socket $TMP/$n.sock"; echo "peer-listen 127.0.0.1:$p"
    echo "peer $peer 127.0.0.1:$pp"; echo "transports tcp"; echo "log-level info"; echo "cuda on"
    # gpu_blocks_client's bench (inflight4) has four transfers write the same
    # blocks at once on purpose: the same bytes, to measure concurrency
    if [ -n "${BLOCKS_BENCH:-}" ]; then echo "grant-overlap allow"; fi
    for pl in "$@"; do echo "pool $pl"; done
  } >"$TMP/$n.conf"
}
conf gpua "$PA" gpub "$PB" "g0 cuda:0 1G" "g1 cuda:$G1 1G" "h host 1G"
conf gpub "$PB" gpua "$PA" "b0 cuda:$G1 1G" "bh host 1G"
start() {
  "$BUILD/kvferryd" -c "$TMP/$1.conf" >"$TMP/$1.log" 2>&1 &
  PIDS="$PIDS $!"
  local i=0
  while ! grep -q "ready" "$TMP/$1.log" 2>/dev/null; do
    i=$((i + 1)); [ $i -gt 300 ] && return 1
    kill -0 "$!" 2>/dev/null || return 1
    sleep 0.1
  done
}
if start gpua && start gpub; then
  ok "two kvferryd with cuda pools started"
  grep -h "cuda:\|pool " "$TMP/gpua.log" | sed 's/^/    /'
else
  bad daemons "kvferryd start"; tail -n 20 "$TMP"/gpu*.log
  echo "$pass passed, $fail failed, $skip skipped"; exit 1
fi
# peers up
for i in $(seq 1 100); do
  "$BUILD/kvferryctl" -s "$TMP/gpua.sock" peers 2>/dev/null | grep -q " up " && break
  sleep 0.1
done
grep -q "cuda: driver" "$TMP/gpua.log" && ok "CUDA start line" || bad cudaline "no CUDA start line"
grep -q "pool g0: cuda:0 .*tcp-bounce" "$TMP/gpua.log" && ok "NIC registration line for pool g0" ||
  bad regline "no NIC registration line for g0"

# ---------------------------------------------------------------- 3. two mapping clients
mkdir -p "$TMP/hold"
"$BUILD/tests/gpu/gpu_map_client" "$TMP/gpua.sock" g0 hold 11 22 "$TMP/hold" >"$TMP/map_a.log" 2>&1 &
MA=$!
for i in $(seq 1 300); do [ -e "$TMP/hold/ready" ] && break; sleep 0.1; done
if "$BUILD/tests/gpu/gpu_map_client" "$TMP/gpua.sock" g0 check 11 >"$TMP/map_b.log" 2>&1 &&
   "$BUILD/tests/gpu/gpu_map_client" "$TMP/gpua.sock" g0 write 22 >>"$TMP/map_b.log" 2>&1; then
  touch "$TMP/hold/go"
  if wait $MA; then ok "two processes map pool g0 at once and see each other's writes"
  else bad map2 "first mapping client"; cat "$TMP/map_a.log"; fi
else
  touch "$TMP/hold/go"; wait $MA
  bad map2 "second mapping client"; cat "$TMP/map_a.log" "$TMP/map_b.log"
fi
sed 's/^/    /' "$TMP/map_a.log" "$TMP/map_b.log" | grep mapped

# ---------------------------------------------------------------- 4/5. handoffs
# bench NAME FROM TO POOL_FROM POOL_TO WANT_PATH ARGS...
bench() {
  local name=$1 from=$2 to=$3 pf=$4 pt=$5 want=$6; shift 6
  local out="$TMP/bench_$name.json"
  if timeout 300 "$BUILD/kvferry-bench" --from "$TMP/$from.sock" --to "$TMP/$to.sock" --pool-from "$pf" \
      --pool-to "$pt" --json "$@" >"$out" 2>"$TMP/bench_$name.err"; then
    local path
    path=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["path"], d["verified"], "%.2f GB/s" % d["gbps"])' "$out")
    case "$path" in
      "$want True"*) ok "$name: $pf -> $pt, path $path" ;;
      *) bad "$name" "$name: path/verified '$path', want '$want True'" ;;
    esac
  else
    bad "$name" "$name: kvferry-bench failed"; cat "$out" "$TMP/bench_$name.err" | tail -n 5
  fi
}
LINK=local-nvlink
if [ "$NGPU" -ge 2 ]; then
  link=$(grep -o "cuda:0<->cuda:1 [a-z0-9-]*" "$TMP/gpua.log" | awk '{print $2}')
  LINK=local-${link:-nvlink}
else
  LINK=local-same-gpu
fi
bench l_llama gpua gpua g0 g1 "$LINK" --model llama3-8b --tokens 4096 --requests 3
bench l_odd gpua gpua g0 g1 "$LINK" --layers 5 --kv-heads 3 --head-dim 37 --block-tokens 7 --dtype-bytes 1 --tokens 3000 --requests 2
bench l_tiny gpua gpua g0 g1 "$LINK" --layers 4 --kv-heads 1 --head-dim 32 --block-tokens 1 --dtype-bytes 2 --tokens 5000
bench l_dsv3 gpua gpua g0 g1 "$LINK" --model deepseek-v3 --tokens 2048 --layerwise
bench l_conc gpua gpua g0 g1 "$LINK" --model llama3-8b --tokens 1024 --requests 8 --concurrency 4 --send-first
bench l_same gpua gpua g0 g0 local-same-gpu --model llama3-8b --tokens 1024 --requests 2
# by block ids, waves back to back: the JSON line's GPU time in the run's
# block copies (the daemon's events) fills at most the timed windows
bench l_kernel gpua gpua g0 g1 "$LINK" --model llama3-8b --tokens 1024 --blocks --requests 8 --concurrency 4 \
  --waves-per-check 2 --time-from-send --nowait
if python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["gpu_kernel_us"] > 0 and 0 < d["vs_gpu_kernel"] <= 1.02, d; print("    gpu_kernel_us %.1f, vs_gpu_kernel %.3f" % (d["gpu_kernel_us"], d["vs_gpu_kernel"]))' "$TMP/bench_l_kernel.json"; then
  ok "l_kernel: the run's GPU time in block copies, from the daemon's status"
else bad l_kernel_time "l_kernel: no gpu_kernel_us, or more than the timed windows"; fi
bench l_d2h gpua gpua g0 h local-d2h --layers 3 --kv-heads 5 --head-dim 33 --block-tokens 3 --dtype-bytes 1 --tokens 2000
bench l_h2d gpua gpua h g1 local-h2d --model llama3-8b --tokens 1024
# heterogeneous layouts between cuda pools (issue 17), by the transform
# kernel: a fan-in (TP 8 -> 4, one transfer per KV head) and NHD -> HND
# with 16 -> 64 tokens per block, every byte of every decode rank checked
bench h_fanin gpua gpua g0 g1 "$LINK" --model llama3-8b --tokens 1024 --blocks --prefill-tp 8 --decode-tp 4 --requests 2
bench h_order gpua gpua g0 g1 "$LINK" --model llama3-8b --tokens 1024 --blocks --prefill-order nhd --decode-order hnd \
  --prefill-block-tokens 16 --decode-block-tokens 64 --requests 2
bench t_llama gpua gpub g0 b0 tcp-bounce --model llama3-8b --tokens 4096 --requests 2
bench t_odd gpua gpub g0 b0 tcp-bounce --layers 5 --kv-heads 3 --head-dim 37 --block-tokens 7 --dtype-bytes 1 --tokens 3000
bench t_tiny gpua gpub g0 b0 tcp-bounce --layers 4 --kv-heads 1 --head-dim 32 --block-tokens 1 --dtype-bytes 2 --tokens 5000
bench t_d2h gpua gpub g0 bh tcp --model deepseek-v3 --tokens 1024 --layerwise
bench t_h2d gpub gpua bh g1 tcp-bounce --layers 3 --kv-heads 5 --head-dim 33 --block-tokens 3 --dtype-bytes 1 --tokens 2000 --concurrency 2 --requests 4
bench t_back gpub gpua b0 g0 tcp-bounce --model llama3-8b --tokens 2048 --send-first

# ---------------------------------------------------------------- 5b. heterogeneous layouts over tcp
# Issue 17 into a cuda pool (tests/gpu/hetero_tcp_gpu.py, two daemons of
# its own): TP 8 -> 4 (a fan-in), 4 -> 8, NHD <-> HND, 16 <-> 64 tokens per
# block, from a host pool (pattern batches read into GPU staging) and from
# a cuda pool; every byte of every decode rank read back with torch and
# compared with a numpy reference.
if python3 -c 'import numpy, torch' 2>/dev/null; then
  if BUILD=$BUILD timeout 300 python3 tests/gpu/hetero_tcp_gpu.py >"$TMP/hetero_tcp_gpu.log" 2>&1; then
    ok "heterogeneous layouts over tcp into cuda:0: $(grep -c '^ok [0-9]* - ' "$TMP/hetero_tcp_gpu.log") tests, $(grep -c '# SKIP' "$TMP/hetero_tcp_gpu.log") skipped"
  else
    bad hetero_tcp_gpu "heterogeneous layouts over tcp into cuda:0"; grep -v '^ok' "$TMP/hetero_tcp_gpu.log" | tail -n 30
  fi
else
  skipped "heterogeneous layouts over tcp into cuda:0: no numpy or torch"
fi

# ---------------------------------------------------------------- 4b. block transfers
# KV layouts in cuda pools, granted and sent by block ids between two
# clients of one daemon: the block kernel computes the addresses (path as
# the handoffs above), every byte of the receiver's cache checked.
if timeout 300 "$BUILD/tests/gpu/gpu_blocks_client" "$TMP/gpua.sock" gpua g0 g1 "$LINK" ${BLOCKS_BENCH:+bench "$BLOCKS_BENCH"} >"$TMP/blocks_client.log" 2>&1; then
  ok "block transfers g0 -> g1 by layout and block ids ($(grep -c '^ok' "$TMP/blocks_client.log") handoffs, $LINK)"
  sed 's/^/    /' "$TMP/blocks_client.log"
else
  bad blocks_client "block transfers g0 -> g1"; cat "$TMP/blocks_client.log" | tail -n 20
fi
if "$BUILD/kvferryctl" -s "$TMP/gpua.sock" --json status | python3 -c 'import json,sys; c=json.load(sys.stdin)["cuda"]; assert c["block_copy"] == "kernel" and c["block_launches"] > 0 and c["block_kernel_us"] > 0, c; print("    blocks:", c["block_copy"], c["block_launches"], "launches,", c["block_bytes"], "bytes")'; then
  ok "status JSON: block copies by the kernel"
else bad ctlblocks "block copies not counted as the kernel's"; fi

# ---------------------------------------------------------------- 6. ctl, doctor, failures
if "$BUILD/kvferryctl" -s "$TMP/gpua.sock" pools >"$TMP/pools.txt" 2>&1 && grep -q "cuda:0.*cumem" "$TMP/pools.txt"; then
  ok "kvferryctl pools shows the cuda pools"; sed 's/^/    /' "$TMP/pools.txt"
else bad ctlpools "kvferryctl pools"; cat "$TMP/pools.txt"; fi
if "$BUILD/kvferryctl" -s "$TMP/gpua.sock" --json status | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["cuda"]["ready"] and d["cuda"]["kernel_launches"] > 0, d["cuda"]; print("    cuda:", d["cuda"])'; then
  ok "status JSON: cuda ready, kernel launches counted"
else bad ctlstatus "kvferryctl --json status"; fi
"$BUILD/kvferryctl" -s "$TMP/gpua.sock" doctor >"$TMP/doctor.txt" 2>&1; drc=$?
if { [ $drc -eq 0 ] || [ $drc -eq 4 ]; } && grep -q "^cuda " "$TMP/doctor.txt"; then
  ok "kvferryctl doctor (exit $drc)"; sed 's/^/    /' "$TMP/doctor.txt"
else bad doctor "kvferryctl doctor exit $drc"; cat "$TMP/doctor.txt"; fi
if "$BUILD/kvferryctl" -s "$TMP/gpua.sock" doctor --json | python3 -c 'import json,sys; d=json.load(sys.stdin); assert any(c["name"].startswith("cuda") for c in d["checks"])'; then
  ok "kvferryctl doctor --json"
else bad doctorjson "kvferryctl doctor --json"; fi
# a pool on a GPU that does not exist, and CUDA required but absent: clear failures
conf bad1 0 gpua "$PA" "x cuda:9 64M"
if timeout 20 "$BUILD/kvferryd" -c "$TMP/bad1.conf" >"$TMP/bad1.log" 2>&1; then bad badgpu "cuda:9 pool started"
elif grep -q "cuda:9 does not exist" "$TMP/bad1.log"; then ok "cuda:9 pool refused clearly"
else bad badgpu "cuda:9 message"; cat "$TMP/bad1.log"; fi
conf bad2 0 gpua "$PA" "x host 64M"
if KVF_LIBCUDA=/nonexistent.so timeout 20 "$BUILD/kvferryd" -c "$TMP/bad2.conf" >"$TMP/bad2.log" 2>&1; then bad nodrv "cuda on without driver started"
elif grep -q "no NVIDIA driver" "$TMP/bad2.log"; then ok "cuda on without a driver refused clearly"
else bad nodrv "no-driver message"; cat "$TMP/bad2.log"; fi

echo "== daemon logs: warnings and errors"
grep -h "warn\|err" "$TMP"/gpua.log "$TMP"/gpub.log | grep -v "peer .* down" | head -n 20 | sed 's/^/    /'
[ "${#failed[@]}" -gt 0 ] && echo "failed: ${failed[*]}"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
