#!/usr/bin/env bash
# gpu_local.sh - GPU0 -> GPU1 on one node, in one run (needs 2 GPUs):
#   1. cudaMemcpyPeer (cuMemcpyPeerAsync) of 512 MiB contiguous: the ceiling
#   2. NCCL send/recv of the same bytes through PyTorch (if torch is there)
#   3. the copy kernel alone on llama3-8b's 4096-token KV cache: 16384
#      scattered 32 KiB blocks (512 MiB), the default and a sweep of every
#      entry point, launch shape and push/pull split (gpu_copy sweep), and
#      the copy engines on a paged KV layout, one 2D copy per block pair
#      (gpu_copy kvlayout)
#   4. kvferry end to end: one kvferryd with cuda:0 and cuda:1 pools,
#      kvferry-bench posting grant+send and timing to RECV_DONE, every byte
#      verified; one request at a time (latency) and 4 in flight (throughput)
# Prints a table; JSON lines of every figure go to $OUT_JSON (default
# /dev/null). Environment: BUILD (default build), REPS (default 30),
# CHAINS (more KVFERRY_SEND_CHAIN shapes to try end to end, e.g. "1024:1024").
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REPS=${REPS:-30}
OUT_JSON=${OUT_JSON:-/dev/null}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
say() { echo "gpu_local: $*" >&2; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-gpulocal.XXXXXX")
DPID=""
cleanup() {
  [ -n "$DPID" ] && kill "$DPID" 2>/dev/null && wait "$DPID" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT
gbps_of() { python3 -c 'import json,sys
for l in open(sys.argv[1]):
    l=l.strip()
    if not l.startswith("{"): continue
    d=json.loads(l)
    if d.get("what")==sys.argv[2]: print("%.1f" % d["gbps"]); break' "$1" "$2"; }

echo "== gpu_local: $(date -u +%Y-%m-%dT%H:%M:%SZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1) x$(nvidia-smi -L | wc -l), $(nvidia-smi topo -m 2>/dev/null | awk '/^GPU0/{print $3}') GPU0-GPU1"

# ---------------------------------------------------------------- 1 + 3: module
say "references and the copy kernel (16384 x 32 KiB scattered, GPU0 -> GPU1)"
: >"$TMP/k.json"
"$BUILD/tests/gpu/gpu_copy" bench 16384 32768 "$REPS" 1 >>"$TMP/k.json" 2>"$TMP/k.err" || { say "gpu_copy bench failed"; cat "$TMP/k.err"; }
# every kernel entry point, launch shape and push/pull split, in one process
"$BUILD/tests/gpu/gpu_copy" sweep 16384 32768 "$REPS" >"$TMP/sweep.json" 2>>"$TMP/k.err" || { say "gpu_copy sweep failed"; tail -n 5 "$TMP/k.err"; }
# the copy engines instead: one 2D copy per block pair of a paged KV layout
"$BUILD/tests/gpu/gpu_copy" kvlayout 64 256 32768 512 "$REPS" >"$TMP/kv.json" 2>>"$TMP/k.err" || { say "gpu_copy kvlayout failed"; tail -n 5 "$TMP/k.err"; }
cat "$TMP/k.json" "$TMP/sweep.json" "$TMP/kv.json" >>"$OUT_JSON"
PEER=$(gbps_of "$TMP/k.json" memcpy_peer_contiguous)
python3 - "$TMP/k.json" "$TMP/sweep.json" "$TMP/kv.json" <<'EOF'
import json, sys
rows = [json.loads(l) for f in sys.argv[1:] for l in open(f) if l.startswith("{") and "gbps" in l]
peer = next(d["gbps"] for d in rows if d["what"] == "memcpy_peer_contiguous")
def line(what, how, d):
    print("  %-24s %-46s %7.1f GB/s  %.3f ms  %.3fx" % (what, how, d["gbps"], d["ms"], d["gbps"] / peer))
for d in rows:
    if d["what"] in ("memcpy_peer_contiguous", "memcpy_async_per_block", "pinned_h2d", "pinned_d2h", "kernel_scattered",
                     "kernel_contiguous", "ce_batch", "kv_kernel", "kv_ce2d"):
        how = {"kernel_scattered": "default (%s)" % d.get("kernel"), "kv_ce2d": "engines: push %s pull %s, %s rows" % (
            d.get("push_streams"), d.get("pull_streams"), d.get("rows"))}.get(d["what"], "")
        line(d["what"], how, d)
sweep = sorted((d for d in rows if d["what"] == "sweep_kernel"), key=lambda d: -d["gbps"])
if sweep:
    print("  sweep: %d shapes, %.1f-%.1f GB/s (%.3f-%.3fx); best:" % (len(sweep), sweep[-1]["gbps"], sweep[0]["gbps"],
          sweep[-1]["gbps"] / peer, sweep[0]["gbps"] / peer))
    for d in sweep[:5]:
        line("sweep_kernel", "%s %dx%d push %d%%" % (d["kernel"], d["threads"], d["ctas_per_sm"], d["push_pct"]), d)
EOF

# ---------------------------------------------------------------- 2: NCCL
NCCL=""
if python3 -c 'import torch' 2>/dev/null; then
  say "NCCL send/recv through torch"
  cat >"$TMP/nccl.py" <<'EOF'
import os, sys, time, json, torch, torch.distributed as dist, torch.multiprocessing as mp
N = 512 << 20
REPS = int(sys.argv[1])
def run(rank, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, world_size=2, rank=rank)
    t = torch.randint(0, 255, (N,), dtype=torch.uint8, device="cuda") if rank == 0 else torch.empty(N, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(REPS + 5):
        dist.barrier(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank == 0: dist.send(t, 1)
        else: dist.recv(t, 0)
        torch.cuda.synchronize()
        if i >= 5: times.append(time.perf_counter() - t0)
    if rank == 1:
        times.sort(); med = times[len(times) // 2]
        print(json.dumps({"what": "nccl_send_recv", "bytes": N, "ms": med * 1e3, "gbps": N / med / 1e9}))
        # torch's own peer copy of the same bytes, for cross-checking cuMemcpyPeer
        src = torch.empty(N, dtype=torch.uint8, device="cuda:0"); dst = torch.empty(N, dtype=torch.uint8, device="cuda:1")
        for _ in range(3): dst.copy_(src); torch.cuda.synchronize()
        tt = []
        for _ in range(REPS):
            t0 = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize(); tt.append(time.perf_counter() - t0)
        tt.sort(); med = tt[len(tt) // 2]
        print(json.dumps({"what": "torch_copy_peer", "bytes": N, "ms": med * 1e3, "gbps": N / med / 1e9}))
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(run, args=(port,), nprocs=2)
EOF
  if timeout 240 python3 "$TMP/nccl.py" "$REPS" >"$TMP/nccl.json" 2>"$TMP/nccl.err"; then
    cat "$TMP/nccl.json" >>"$OUT_JSON"
    NCCL=$(gbps_of "$TMP/nccl.json" nccl_send_recv)
    echo "  nccl send/recv (torch)   512 MiB                                      $NCCL GB/s"
    echo "  torch peer copy_         512 MiB                                      $(gbps_of "$TMP/nccl.json" torch_copy_peer) GB/s"
  else
    say "NCCL run failed"; tail -n 5 "$TMP/nccl.err"
  fi
fi

# ---------------------------------------------------------------- 4: end to end
say "kvferry end to end, one kvferryd, cuda:0 -> cuda:1"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"$TMP/d.conf" <<EOF
node gpunode
api-socket $TMP/d.sock
peer-listen 127.0.0.1:$PORT
pool g0 cuda:0 2G
pool g1 cuda:1 2G
transports tcp
log-level ${LOG_LEVEL:-debug}
cuda on
EOF
${KVF_ENV:-} "$BUILD/kvferryd" -c "$TMP/d.conf" >"$TMP/d.log" 2>&1 &
DPID=$!
for i in $(seq 1 100); do grep -q ready "$TMP/d.log" && break; sleep 0.1; done
grep "cuda:" "$TMP/d.log" | head -n 3 | sed 's/^/  /'
e2e() { # NAME ARGS...
  local name=$1; shift
  if "$BUILD/kvferry-bench" --from "$TMP/d.sock" --to "$TMP/d.sock" --pool-from g0 --pool-to g1 --json "$@" \
      >"$TMP/$name.json" 2>"$TMP/$name.err"; then
    sed "s/^{/{\"what\": \"$name\", /" "$TMP/$name.json" >>"$OUT_JSON"
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("  %-24s %-44s %7.1f GB/s  p50 %.0f us (API calls %.0f us)  p99 %.0f us  path %s verified %s" % (sys.argv[2], " ".join(sys.argv[3:])[-44:], d["gbps"], d["p50_us"], d.get("post_p50_us", -1), d["p99_us"], d["path"], d["verified"]))' "$TMP/$name.json" "$name" "$@"
  else
    say "$name failed"; cat "$TMP/$name.json" "$TMP/$name.err" | tail -n 3
  fi
}
# e2e_grant_send: the clock starts before the grant (both API calls timed);
# e2e_from_send: the grant is posted first, untimed, as a decode engine
# would, and the clock runs from the send to RECV_DONE (the issue's measure).
e2e e2e_warm --model llama3-8b --tokens 4096 --requests 3
e2e e2e_grant_send --model llama3-8b --tokens 4096 --requests 16
e2e e2e_from_send --model llama3-8b --tokens 4096 --requests 16 --time-from-send
# the same with each send as one frame (no chained frames: the earlier way)
KVFERRY_SEND_CHAIN=0 e2e e2e_one_frame --model llama3-8b --tokens 4096 --requests 16 --time-from-send
e2e e2e_layerwise --model llama3-8b --tokens 4096 --requests 8 --layerwise --time-from-send
e2e e2e_conc4 --model llama3-8b --tokens 4096 --requests 24 --concurrency 4 --time-from-send
e2e e2e_tiny_blocks --layers 32 --kv-heads 1 --head-dim 2 --block-tokens 16 --dtype-bytes 1 --tokens 4096 --requests 16 --time-from-send
# the same request by KV layout and block ids (the block kernel computes
# addresses on the GPU; issue 13's goal: 4 in flight >= 0.9x memcpy_peer)
e2e e2e_blocks_from_send --model llama3-8b --tokens 4096 --requests 16 --time-from-send --blocks
e2e e2e_blocks_layerwise --model llama3-8b --tokens 4096 --requests 8 --layerwise --nowait --time-from-send --blocks
e2e e2e_blocks_conc4 --model llama3-8b --tokens 4096 --requests 24 --concurrency 4 --time-from-send --blocks
# the same with send calls that do not wait for the daemon (KVF_NOWAIT)
e2e e2e_blocks_from_send_nowait --model llama3-8b --tokens 4096 --requests 16 --time-from-send --blocks --nowait
e2e e2e_blocks_conc4_nowait --model llama3-8b --tokens 4096 --requests 24 --concurrency 4 --time-from-send --blocks --nowait
# other chain shapes (KVFERRY_SEND_CHAIN=FIRST:MAX descriptors per frame)
for ch in ${CHAINS:-}; do KVFERRY_SEND_CHAIN=$ch e2e "e2e_chain_$ch" --model llama3-8b --tokens 4096 --requests 16 --time-from-send; done
E2E=$(python3 -c 'import json; print("%.1f" % json.load(open("'"$TMP"'/e2e_from_send.json"))["gbps"])' 2>/dev/null)
E2EC=$(python3 -c 'import json; print("%.1f" % json.load(open("'"$TMP"'/e2e_conc4.json"))["gbps"])' 2>/dev/null)
E2EB=$(python3 -c 'import json; print("%.1f" % json.load(open("'"$TMP"'/e2e_blocks_from_send.json"))["gbps"])' 2>/dev/null)
E2EBC=$(python3 -c 'import json; print("%.1f" % json.load(open("'"$TMP"'/e2e_blocks_conc4.json"))["gbps"])' 2>/dev/null)
grep "transfer '" "$TMP/d.log" | tail -n 3 | sed 's/.*local[^:]*: /  trace: /'
"$BUILD/kvferryctl" -s "$TMP/d.sock" --json status | python3 -c 'import json,sys; print("  daemon cuda counters:", json.load(sys.stdin)["cuda"])'
KER=$(gbps_of "$TMP/k.json" kernel_scattered)
echo "== summary: memcpy_peer ${PEER:-?} GB/s, nccl ${NCCL:-?} GB/s, kernel (default) ${KER:-?} GB/s ($(python3 -c "print('%.3f' % (${KER:-0}/${PEER:-1}))")x peer), e2e one request (send->RECV_DONE) ${E2E:-?} GB/s ($(python3 -c "print('%.3f' % (${E2E:-0}/${PEER:-1}))")x), e2e 4 in flight ${E2EC:-?} GB/s ($(python3 -c "print('%.3f' % (${E2EC:-0}/${PEER:-1}))")x); by block ids: one request ${E2EB:-?} GB/s ($(python3 -c "print('%.3f' % (${E2EB:-0}/${PEER:-1}))")x), 4 in flight ${E2EBC:-?} GB/s ($(python3 -c "print('%.3f' % (${E2EBC:-0}/${PEER:-1}))")x)"
