#!/bin/sh
# latency.sh - a handoff within microseconds of the wire (issue 16): one
# layer-block and a layer-wise request over kvferry's tcp transport between
# two kvferryd on loopback, against raw loopback TCP, in one run on one
# machine.
#
#   raw            build/tcp-pingpong: 64 KiB written, a 1-byte ack back
#                  (TCP_NODELAY, default buffers: as the tcp transport's data
#                  streams), p50/p99 over 2,000 round trips; the same after
#                  5 ms of idle before each (raw_gap); 512 KiB (one layer of
#                  llama3-8b at 128 tokens: its wire time); and 64 KiB
#                  with no thread asleep (--spin: both sides poll, the gap
#                  waited out busy), back to back and after 5 ms
#                  (raw_spin_gap): what the gap costs apart from wake-ups
#   back_to_back   kvferry-bench: one layer-block (llama3-8b, 16 tokens, one
#                  layer: K and V, 2 x 32 KiB), the grant posted just before
#                  the send, timed from the send call to RECV_DONE
#   grant_lead_5ms the same with the grant posted 5 ms before the send, as an
#                  engine grants ahead
#   layer_part     one layer's part of that request alone (llama3-8b, 128
#                  tokens, one layer by block ids: 512 KiB over the striped
#                  streams), back to back, from the send call to RECV_DONE,
#                  against raw TCP's 512 KiB: what the layer-wise case's last
#                  part costs, with its hops
#   layerwise      llama3-8b, 128 tokens (16 MiB, 512 layer-blocks), by block
#                  ids, each layer's part sent as its emulated compute
#                  (145 us a layer) ends: exposed time after the last layer
#                  against one layer's wire time (goal <= 1.2x)
# The kvferry cases print, with kvferry-bench --latency, where the p50
# handoff's time went on each daemon (kvferryctl transfers --trace), and
# which threads slept: sleeps_per_request gives, per daemon (a: prefill,
# b: decode) and thread name (kvferryd = the loop, kvf-tcp-send,
# kvf-tcp-recv), [voluntary, involuntary] context switches per request
# over the case (a spinning thread is preempted, it does not sleep);
# bench_sleeps_per_request the same for the bench process (kvferry-bench =
# the engine thread, kvf-client = the library's reader threads);
# spin_backoffs, per daemon and kind of thread, the times a polling thread
# found its CPU busy and stopped polling (null for a build without them).
#
# Output: one JSON line per case on stdout, each with "goal_us" (raw p50 +
# 20 us) and the ratios against the raw baseline; progress on stderr.
# Usage: bench/latency.sh [BUILD]   (BUILD: the build folder, default build)
# Environment: LAT_LOAD=N: N busy loops (sh) run through the whole run, raw
# and kvferry alike, as engines that keep the CPUs busy (bench/RESULTS.md:
# the daemons' polling threads then fall behind the busy tasks);
# LAT_EXTRA_LEADS: more grant leads in ms (e.g. "1 2"), each
# one more case grant_lead_<N>ms, to see how the lead's cost grows with the
# idle time; KVFERRY_SPIN_US: the clients' spin (libkvferry: their reader
# thread and kvf_wait_events poll instead of sleeping that long after each
# request and event; 10000 covers the 5 ms grant lead);
# KVFERRY_GRANT_SPIN_US: the clients' grant window (libkvferry: their reader
# and kvf_wait_events poll while a grant waits; default 10000 on 4 CPUs or
# more, 0 to compare without it); LAT_CONF: extra
# kvferryd.conf lines for both daemons (e.g. "spin-us 0" or "busy-poll
# yes"); LAT_BENCH_ARGS: extra kvferry-bench options (--busy-poll: the
# clients poll for events, and the prefill client stays busy through the
# grant lead, as an engine computing); REQUESTS (back to back, default
# 2000; a quarter of it with the 5 ms lead).
set -eu

cd "$(dirname "$0")/.."
BUILD=${1:-${BUILD:-build}}
REQUESTS=${REQUESTS:-2000}
LEAD_REQUESTS=$((REQUESTS / 4))
LAT_CONF=${LAT_CONF:-}
LAT_BENCH_ARGS=${LAT_BENCH_ARGS:-}
LAT_EXTRA_LEADS=${LAT_EXTRA_LEADS:-}
LAT_LOAD=${LAT_LOAD:-0}

say() { echo "latency: $*" >&2; }
die() {
  say "$*"
  exit 1
}

for bin in kvferryd kvferryctl kvferry-bench tcp-pingpong; do
  [ -x "$BUILD/$bin" ] || die "$BUILD/$bin is missing (make all bench-tools)"
done
command -v python3 >/dev/null || die "python3 is missing"

. bench/lib.sh
bench_setup latency
LOAD_PIDS=""
trap 'for p in $LOAD_PIDS; do kill "$p" 2>/dev/null || true; done; bench_cleanup' EXIT
i=0
while [ "$i" -lt "$LAT_LOAD" ]; do
  sh -c 'while :; do :; done' &
  LOAD_PIDS="$LOAD_PIDS $!"
  i=$((i + 1))
done
[ "$LAT_LOAD" -gt 0 ] && say "$LAT_LOAD busy loops run throughout"

# ---------------------------------------------------------------- raw TCP
say "raw tcp: 64 KiB + 1-byte ack, back to back and after 5 ms idle; 512 KiB"
"$BUILD/tcp-pingpong" --rounds 2000 >"$TMP/raw.json"
"$BUILD/tcp-pingpong" --rounds 300 --warmup 20 --gap-us 5000 >"$TMP/raw_gap.json"
"$BUILD/tcp-pingpong" --bytes 524288 --rounds 500 >"$TMP/raw_layer.json"
# The same with no thread asleep (both sides poll, the gap busy): what the
# gap costs an awake machine, apart from its wake-ups.
"$BUILD/tcp-pingpong" --spin --rounds 2000 >"$TMP/raw_spin.json"
"$BUILD/tcp-pingpong" --spin --rounds 300 --warmup 20 --gap-us 5000 >"$TMP/raw_spin_gap.json"

# ---------------------------------------------------------------- daemons
bench_pair a b "pool kv host 256M
$LAT_CONF"

# Sleeps per thread (voluntary context switches, by thread name) of both
# daemons over one case: which threads of the handoff's path slept.
set -- $PIDS
PID_A=$1 PID_B=$2
threads_snap() { # FILE
  python3 - "$1" "$PID_A" "$PID_B" <<'PY'
import json, os, sys
out = {}
for side, pid in (("a", sys.argv[2]), ("b", sys.argv[3])):
    d = out[side] = {}
    for tid in os.listdir("/proc/%s/task" % pid):
        try:
            comm = open("/proc/%s/task/%s/comm" % (pid, tid)).read().strip()
            st = dict(l.split(":", 1) for l in open("/proc/%s/task/%s/status" % (pid, tid)) if ":" in l)
        except OSError:
            continue
        d[tid] = [comm, int(st["voluntary_ctxt_switches"]), int(st["nonvoluntary_ctxt_switches"])]
json.dump(out, open(sys.argv[1], "w"))
PY
}

# Spin backoffs of both daemons (status spin_backoffs): whether their
# polling threads found the CPUs busy and stopped polling over one case.
spin_snap() { # FILE
  for side in a b; do
    "$BUILD/kvferryctl" -s "$TMP/$side.sock" --json status 2>/dev/null |
      python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin).get("spin_backoffs")))' 2>/dev/null ||
      echo null
  done >"$1"
}

kvbench() { # NAME ARGS...
  name=$1
  shift
  spin_snap "$TMP/$name.spin0"
  threads_snap "$TMP/$name.thr0"
  say "kvferry-bench $*"
  # shellcheck disable=SC2086 # LAT_BENCH_ARGS: words
  "$BUILD/kvferry-bench" --from "$TMP/a.sock" --to "$TMP/b.sock" --model llama3-8b --json --latency $LAT_BENCH_ARGS "$@" \
    >"$TMP/$name.json" 2>"$TMP/$name.err" || {
    cat "$TMP/$name.json" "$TMP/$name.err" >&2
    die "kvferry-bench $* failed: $(tail -n 5 "$TMP/a.log" "$TMP/b.log")"
  }
  threads_snap "$TMP/$name.thr1"
  spin_snap "$TMP/$name.spin1"
}
kvbench back_to_back --layers 1 --tokens 16 --time-from-send --requests "$REQUESTS"
kvbench grant_lead_5ms --layers 1 --tokens 16 --grant-lead-ms 5 --requests "$LEAD_REQUESTS"
for ms in $LAT_EXTRA_LEADS; do
  kvbench "grant_lead_${ms}ms" --layers 1 --tokens 16 --grant-lead-ms "$ms" --requests "$LEAD_REQUESTS"
done
kvbench layer_part --layers 1 --tokens 128 --blocks --time-from-send --nowait --requests "$LEAD_REQUESTS"
kvbench layerwise --tokens 128 --blocks --layerwise --nowait --compute-us-per-layer 145 --requests 60

# Idle CPU of the daemons once traffic stopped (% of one core over 2 s).
cpu_ticks() {
  t=0
  for pid in $PIDS; do
    set -- $(sed 's/^.*) //' "/proc/$pid/stat")
    t=$((t + ${12} + ${13}))
  done
  echo "$t"
}
sleep 0.5
T0=$(cpu_ticks)
sleep 2
T1=$(cpu_ticks)
IDLE_PCT=$(python3 -c "import os; print(round(($T1 - $T0) * 100.0 / os.sysconf('SC_CLK_TCK') / 2, 1))")

# ---------------------------------------------------------------- report
python3 - "$TMP" "$(nproc)" "$LAT_CONF" "$IDLE_PCT" "$LAT_EXTRA_LEADS" <<'PY'
import json, os, sys, time
tmp, nproc, conf, idle = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
extra_leads = ["grant_lead_%sms" % ms for ms in sys.argv[5].split()]
def load(name):
    lines = [l for l in open(os.path.join(tmp, name + ".json")).read().splitlines() if l.strip()]
    return json.loads(lines[-1])
raw, gap, layer = load("raw"), load("raw_gap"), load("raw_layer")
spin, spin_gap = load("raw_spin"), load("raw_spin_gap")
goal = raw["p50_us"] + 20
common = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "nproc": nproc, "conf": conf,
          "client_spin_us": int(os.environ.get("KVFERRY_SPIN_US", "0") or 0),
          "client_grant_spin_us": os.environ.get("KVFERRY_GRANT_SPIN_US", "default"),
          "busy_loops": int(os.environ.get("LAT_LOAD", "0") or 0),
          "bench_args": os.environ.get("LAT_BENCH_ARGS", ""),
          "raw_p50_us": raw["p50_us"], "raw_p99_us": raw["p99_us"], "goal_us": round(goal, 1)}
print(json.dumps(dict(case="raw", **common, raw_gap_5ms_p50_us=gap["p50_us"], raw_gap_5ms_p99_us=gap["p99_us"],
                      raw_512k_p50_us=layer["p50_us"], raw_spin_p50_us=spin["p50_us"],
                      raw_spin_gap_5ms_p50_us=spin_gap["p50_us"], daemons_idle_cpu_pct=idle)))
def sleeps(name, requests):
    """Per daemon, per thread name: voluntary (sleeps) and involuntary
    (preempted) context switches per request over the case."""
    try:
        a = json.load(open(os.path.join(tmp, name + ".thr0")))
        b = json.load(open(os.path.join(tmp, name + ".thr1")))
    except (OSError, ValueError):
        return None
    out = {}
    for side in ("a", "b"):
        per = {}
        for tid, (comm, vol, inv) in b[side].items():
            v0, i0 = a[side].get(tid, [comm, 0, 0])[1:]
            s = per.setdefault(comm, [0, 0])
            s[0] += vol - v0
            s[1] += inv - i0
        out[side] = {c: [round(v / requests, 2), round(i / requests, 2)] for c, (v, i) in sorted(per.items()) if v or i}
    return out
def backoffs(name):
    """Per daemon, the spin backoffs over the case by kind of thread (None:
    a daemon without them)."""
    try:
        a = [json.loads(l) for l in open(os.path.join(tmp, name + ".spin0"))]
        b = [json.loads(l) for l in open(os.path.join(tmp, name + ".spin1"))]
    except (OSError, ValueError):
        return None
    if None in a + b:
        return None
    return {side: {k: y[k] - x.get(k, 0) for k in y} for side, x, y in zip("ab", a, b)}
def handoff(name):
    """A handoff case's figures: its p50, the p50 request's hops on both
    daemons and in the clients, and which threads slept."""
    k = load(name)
    t = k.get("trace", {})
    return dict(case=name, **common, p50_us=k["p50_us"], p99_us=k["p99_us"], requests=k["requests"],
                verified=k["verified"], path=k["path"], p50_send_hops=t.get("send"), p50_recv_hops=t.get("recv"),
                p50_client_to_daemon_us=t.get("client_to_daemon_us"),
                p50_daemon_to_client_us=t.get("daemon_to_client_us"),
                sleeps_per_request=sleeps(name, k["requests"]), bench_sleeps_per_request=k.get("sleeps"),
                spin_backoffs=backoffs(name))
for name in ["back_to_back", "grant_lead_5ms"] + extra_leads:
    h = handoff(name)
    print(json.dumps(dict(h, p50_vs_raw=round(h["p50_us"] / raw["p50_us"], 2),
                          p50_over_raw_us=round(h["p50_us"] - raw["p50_us"], 1), meets_goal=h["p50_us"] <= goal)))
h = handoff("layer_part")
print(json.dumps(dict(h, raw_512k_p50_us=layer["p50_us"], p50_vs_raw_512k=round(h["p50_us"] / layer["p50_us"], 2))))
k = load("layerwise")
t = k.get("trace", {})
wire = layer["p50_us"]
print(json.dumps(dict(case="layerwise", **common, tokens=128, exposed_p50_us=k["exposed_p50_us"],
                      exposed_p99_us=k["exposed_p99_us"], one_layer_wire_us=wire,
                      exposed_vs_layer=round(k["exposed_p50_us"] / wire, 2),
                      meets_goal=k["exposed_p50_us"] <= 1.2 * wire, verified=k["verified"],
                      last_send_late_p50_us=k.get("last_send_late_p50_us"),
                      p50_send_hops=t.get("send"), p50_recv_hops=t.get("recv"),
                      spin_backoffs=backoffs("layerwise"))))
PY
