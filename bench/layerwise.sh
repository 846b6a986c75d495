#!/usr/bin/env bash
# layerwise.sh - overlap with prefill (issue 13): how long a decode node
# still waits for a request's KV cache once the prefill's compute is over,
# when the prefill sends each layer as it is computed (layer-wise) against
# sending the whole request after the last layer (whole).
#
# kvferry-bench emulates the prefill (--compute-us-per-layer): it grants
# first (decode admits the request), then spends N us per layer, to absolute
# deadlines, and posts each layer's send part as its compute ends
# (--layerwise, the parts after the first with KVF_SEND_NOWAIT, as an
# engine posts them) or the whole request after the last layer (--whole).
# The exposed time is from the end of the last layer's compute to
# RECV_DONE (a last send call that the earlier ones made late counts);
# every byte of every request is verified. llama3-8b at 128, 1,024, 4,096 and 32,768 tokens,
# one request at a time (one prefill GPU works on one request).
#
# The compute model (llama3-8b, bf16, one H100), per layer and T tokens:
#   weights of a layer  P = 218.1e6: attention 4096 x (4096 + 1024 + 1024)
#                       + 4096 x 4096, MLP 3 x 4096 x 14336
#   FLOPs = 2 P T (the matmuls) + 2 T^2 d (QK^T and PV, causal half, d 4096)
#   time  = max(FLOPs / TFLOPS (400e12: about 40% of the H100's 989 dense
#           bf16 TFLOP/s, what serving engines reach in prefill),
#           2 P bytes / 3.0e12 B/s (the weights read once: small prompts
#           are bound by HBM))
#   -> 145 us at 128 tokens, 1.14 ms at 1,024, 4.81 ms at 4,096 and
#      57.7 ms at 32,768 (a 4,096-token prefill of 154 ms, 27k tokens/s).
# TFLOPS=... changes the model; COMPUTE_US=N uses N us per layer at every
# length instead.
#
# Usage:
#   bench/layerwise.sh                 tcp: two kvferryd on loopback, host pools
#   bench/layerwise.sh --gpu           the local GPU path: one kvferryd, two
#                                      pools on cuda:0 (GPU_TO=1: the second
#                                      on cuda:1)
# Options: --api blocks|descs|both (default both: kvf_send_blocks and
# kvf_send in the same run), --tokens "128 1024" (default the four lengths),
# --results FILE (default bench/RESULTS.md: the section is inserted before
# the newest one; --results - prints it only), --plot FILE (default
# bench/layerwise-tcp.png or -gpu.png; needs gnuplot, Debian gnuplot-nox:
# scripts/install-deps.sh bench), --json FILE (every kvferry-bench line),
# --replot FILE: no runs, the table and plot of the lines a --json FILE
# kept (e.g. from a GPU machine without gnuplot; the machine line is then
# this one's, so keep that run's own section).
# Environment: BUILD (default build), REQUESTS (per length; default 20, 12,
# 8 and 3 from the shortest), TFLOPS, COMPUTE_US, LW_CONF (kvferryd.conf
# lines for the daemons, e.g. "busy-poll yes"), LW_BENCH_ARGS (more
# kvferry-bench options for every run, e.g. --busy-poll).
set -euo pipefail
cd "$(dirname "$0")/.."
# The command as given, with the environment that changes what it measures.
COMMAND=bench/layerwise.sh
[ $# -eq 0 ] || COMMAND="$COMMAND$(printf ' %q' "$@")"
for v in GPU_TO COMPUTE_US TFLOPS REQUESTS LW_CONF LW_BENCH_ARGS; do
  [ -z "${!v:-}" ] || COMMAND="$v=$(printf %q "${!v}") $COMMAND"
done
BUILD=${BUILD:-build}
TFLOPS=${TFLOPS:-400}
MODE=tcp
API=both
TOKENS="128 1024 4096 32768"
RESULTS=bench/RESULTS.md
PLOT=""
JSON_OUT=""
REPLOT=""

say() { echo "layerwise: $*" >&2; }
die() { say "$*"; exit 1; }

while [ $# -gt 0 ]; do
  case $1 in
    --gpu) MODE=gpu ;;
    --api) API=$2; shift ;;
    --tokens) TOKENS=$2; shift ;;
    --results) RESULTS=$2; shift ;;
    --plot) PLOT=$2; shift ;;
    --json) JSON_OUT=$2; shift ;;
    --replot) REPLOT=$2; shift ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (--help)" ;;
  esac
  shift
done
case $API in blocks) APIS="blocks" ;; descs) APIS="descs" ;; both) APIS="descs blocks" ;;
  *) die "--api: blocks, descs or both" ;; esac
[ -n "$PLOT" ] || PLOT=bench/layerwise-$MODE.png
for bin in kvferryd kvferryctl kvferry-bench; do
  [ -x "$BUILD/$bin" ] || die "$BUILD/$bin is missing (run make first)"
done
command -v python3 >/dev/null || die "python3 is missing"

. bench/lib.sh
bench_setup layerwise

# ---------------------------------------------------------------- the model
compute_us() { # TOKENS -> us of compute per layer
  if [ -n "${COMPUTE_US:-}" ]; then echo "$COMPUTE_US"; return; fi
  python3 -c '
import sys
t, tflops = int(sys.argv[1]), float(sys.argv[2]) * 1e12
p = 4096 * (4096 + 1024 + 1024) + 4096 * 4096 + 3 * 4096 * 14336
flops = 2 * p * t + 2 * t * t * 4096
print(round(max(flops / tflops, 2 * p / 3.0e12) * 1e6))' "$1" "$TFLOPS"
}
requests_for() { # TOKENS
  if [ -n "${REQUESTS:-}" ]; then echo "$REQUESTS"; return; fi
  if [ "$1" -le 128 ]; then echo 20; elif [ "$1" -le 1024 ]; then echo 12; elif [ "$1" -le 4096 ]; then echo 8; else echo 3; fi
}

# ---------------------------------------------------------------- daemons
MAXTOK=0
for t in $TOKENS; do [ "$t" -gt "$MAXTOK" ] && MAXTOK=$t; done
# One request in flight: blocks x 32 layers x K/V x 32 KiB, and room.
# shellcheck disable=SC2017 # whole blocks: the division rounds on purpose
POOL_MB=$(( (MAXTOK + 15) / 16 * 2 + 64 ))
if [ -n "$REPLOT" ]; then
  PATH_DESC="replotted from $REPLOT"
elif [ "$MODE" = tcp ]; then
  AVAIL_MB=$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo)
  [ "$AVAIL_MB" -gt $((2 * POOL_MB + 1024)) ] ||
    die "two pools of $POOL_MB MiB need more memory than the $AVAIL_MB MiB available (fewer --tokens)"
  bench_pair a b "pool kv host ${POOL_MB}M
tcp-streams 4
${LW_CONF:-}"
  BENCH_ARGS=(--from "$TMP/a.sock" --to "$TMP/b.sock")
  PATH_DESC="tcp: two kvferryd on loopback (tcp-streams 4), host pools"
else
  GPU_TO=${GPU_TO:-0}
  bench_conf g "$(bench_free_ports 1)" <<EOF
pool g0 cuda:0 ${POOL_MB}M
pool g1 cuda:$GPU_TO ${POOL_MB}M
cuda on
${LW_CONF:-}
EOF
  bench_start g
  BENCH_ARGS=(--from "$TMP/g.sock" --to "$TMP/g.sock" --pool-from g0 --pool-to g1)
  PATH_DESC="local GPU path: one kvferryd, pools on cuda:0 and cuda:$GPU_TO"
fi

# shellcheck disable=SC2206 # words on purpose: several options
[ -z "${LW_BENCH_ARGS:-}" ] || BENCH_ARGS+=(${LW_BENCH_ARGS})

# ---------------------------------------------------------------- runs
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
: >"$TMP/all.json"
[ -z "$REPLOT" ] || { cp "$REPLOT" "$TMP/all.json"; TOKENS=""; }
for t in $TOKENS; do
  us=$(compute_us "$t")
  n=$(requests_for "$t")
  for api in $APIS; do
    extra=(); [ "$api" = blocks ] && extra=(--blocks)
    for mode in whole layerwise; do
      say "$t tokens, $api, $mode, $us us/layer, $n requests"
      how=(--whole); [ "$mode" = layerwise ] && how=(--layerwise --nowait)
      if ! "$BUILD/kvferry-bench" "${BENCH_ARGS[@]}" --model llama3-8b --tokens "$t" --requests "$n" \
          --compute-us-per-layer "$us" "${how[@]}" "${extra[@]}" --json >"$TMP/one.json" 2>"$TMP/one.err"; then
        cat "$TMP/one.json" "$TMP/one.err" >&2
        die "kvferry-bench failed ($t tokens, $api, $mode); daemon logs: $(tail -n 5 "$TMP"/*.log)"
      fi
      tail -n 1 "$TMP/one.json" >>"$TMP/all.json"
    done
    # One layer's transfer, measured: the same bytes as one layer's part,
    # sent alone as a request of one layer (send call to RECV_DONE, with the
    # grant in place), what the last layer's part has left to do at best.
    say "$t tokens, $api, one layer alone, $n requests"
    if ! "$BUILD/kvferry-bench" "${BENCH_ARGS[@]}" --model llama3-8b --layers 1 --tokens "$t" --requests "$n" \
        --time-from-send "${extra[@]}" --json >"$TMP/one.json" 2>"$TMP/one.err"; then
      cat "$TMP/one.json" "$TMP/one.err" >&2
      die "kvferry-bench failed ($t tokens, $api, one layer alone)"
    fi
    tail -n 1 "$TMP/one.json" | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); d["mode"]="alone"; d["tokens"]=int(sys.argv[1]); print(json.dumps(d))' "$t" >>"$TMP/all.json"
  done
done
[ -z "$JSON_OUT" ] || cp "$TMP/all.json" "$JSON_OUT"

# ---------------------------------------------------------------- report
CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
MACHINE="$(uname -srm), $(nproc) CPUs, ${CPU:-unknown CPU}, load average at the start $LOAD_START"
if [ "$MODE" = gpu ] && command -v nvidia-smi >/dev/null; then
  MACHINE="$MACHINE, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
fi
DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT+changes"
MODEL_DESC=$([ -n "${COMPUTE_US:-}" ] && echo "COMPUTE_US=$COMPUTE_US us per layer at every length" ||
  echo "llama3-8b on an H100 at $TFLOPS TFLOP/s, HBM-bound floor (see bench/layerwise.sh)")

python3 - "$TMP/all.json" "$TMP" "$MODE" "$COMMAND" "$MACHINE" "$DATE" "$COMMIT" "$PATH_DESC" \
  "$MODEL_DESC" "$PLOT" <<'EOF'
import json, os, sys
src, tmp, mode, command, machine, date, commit, path_desc, model_desc, plot = sys.argv[1:]
rows = [json.loads(l) for l in open(src) if l.strip()]
by = {(d["tokens"], d["api"], d["mode"]): d for d in rows}
tokens = sorted({d["tokens"] for d in rows})
apis = [a for a in ("descs", "blocks") if any(d["api"] == a for d in rows)]
layers = 32
out = []
out.append("## Overlap with prefill, layer-wise vs whole (issue 13), %s, %s" % (mode, date[:10]))
out.append("")
out.append("Machine: %s. Path: %s. Commit %s, %s UTC." % (machine, path_desc, commit, date[11:16]))
out.append("Compute per layer: %s. One request at a time; every byte verified." % model_desc)
out.append("")
out.append("    " + command)
out.append("")
out.append("Exposed time: from the end of the last layer's compute, when its send (the")
out.append("last layer's part, or the whole request) is due, to RECV_DONE, p50 / p99 over")
out.append("the requests, in ms; layer-wise parts after the first go with KVF_SEND_NOWAIT.")
out.append("\"Late\": how long after the compute the last send call was made (p50),")
out.append("layer-wise. \"One layer\": what one layer's transfer takes, measured as a")
out.append("request of that one layer's bytes sent alone (send call to RECV_DONE, p50),")
out.append("and, for comparison, the whole request's exposed p50 / %d (its share of a" % layers)
out.append("pipelined transfer, without a transfer's fixed cost). The goal is checked")
out.append("against the measured one where the run has it.")
out.append("")
out.append("| tokens | MiB | api | compute/layer | whole p50 / p99 | layer-wise p50 / p99 | layer-wise / whole | late | one layer alone | whole / %d | req |" % layers)
out.append("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
def measured():
    """(tokens, api, whole, layer-wise, one layer's transfer) of each length and API both modes ran."""
    for t in tokens:
        for a in apis:
            w, l, one = by.get((t, a, "whole")), by.get((t, a, "layerwise")), by.get((t, a, "alone"))
            if w and l:
                yield t, a, w, l, one["p50_us"] if one else w["exposed_p50_us"] / layers
for t, a, w, l, one in measured():
    alone = by.get((t, a, "alone"))
    out.append("| %d | %.0f | %s | %.2f ms | %.2f / %.2f | %.2f / %.2f | %.2fx | %.2f ms | %s | %.2f ms | %d |" % (
        t, w["bytes"] / w["requests"] / 2**20, a, w["compute_us_per_layer"] / 1e3,
        w["exposed_p50_us"] / 1e3, w["exposed_p99_us"] / 1e3, l["exposed_p50_us"] / 1e3,
        l["exposed_p99_us"] / 1e3, l["exposed_p50_us"] / w["exposed_p50_us"],
        l.get("last_send_late_p50_us", 0) / 1e3, "%.3f ms" % (alone["p50_us"] / 1e3) if alone else "-",
        w["exposed_p50_us"] / layers / 1e3, w["requests"]))
out.append("")
# The issue's goal, checked where it applies.
notes = []
for t, a, w, l, one in measured():
    if l["exposed_p50_us"] > w["exposed_p50_us"]:
        notes.append("%d tokens (%s): layer-wise slower than whole" % (t, a))
    if one < w["compute_us_per_layer"]:
        ok = l["exposed_p50_us"] <= one + 50
        notes.append("%d tokens (%s): a layer's transfer (%.2f ms) is shorter than its compute (%.2f ms); "
                     "layer-wise exposed %.2f ms against one layer + 50 us = %.2f ms: %s" % (
                         t, a, one / 1e3, w["compute_us_per_layer"] / 1e3, l["exposed_p50_us"] / 1e3,
                         (one + 50) / 1e3, "met" if ok else "missed"))
if notes:
    out.append("Against the goal (exposed <= one layer's transfer + 50 us where a layer's")
    out.append("transfer is shorter than its compute; layer-wise never slower than whole):")
    out.append("")
    out.extend("- " + n for n in notes)
else:
    out.append("Against the goal: no length here has a layer's transfer shorter than its")
    out.append("compute, and layer-wise is nowhere slower than whole.")
out.append("")
if plot:
    out.append("Plot: [%s](%s)." % (os.path.basename(plot), os.path.basename(plot)))
    out.append("")
open(os.path.join(tmp, "section.md"), "w").write("\n".join(out) + "\n")
with open(os.path.join(tmp, "plot.dat"), "w") as f:
    for a in apis:
        for m in ("whole", "layerwise"):
            f.write("# %s %s\n" % (a, m))
            for t in tokens:
                d = by.get((t, a, m))
                if d:
                    f.write("%d %.3f %.3f\n" % (t, d["exposed_p50_us"] / 1e3, d["exposed_p99_us"] / 1e3))
            f.write("\n\n")
with open(os.path.join(tmp, "plot.gp"), "w") as f:
    f.write('set terminal pngcairo size 900,560 noenhanced\nset output "%s"\n' % plot)
    f.write('set title "kvferry: exposed KV transfer after prefill, llama3-8b, %s (%s)"\n' % (mode, date[:10]))
    f.write('set xlabel "prompt length (tokens)"\nset ylabel "exposed time p50 (ms, error bar to p99)"\n')
    f.write('set logscale xy\nset grid\nset key top left\nset xtics (%s)\n' % ", ".join(str(t) for t in tokens))
    f.write('set xrange [%g:%g]\n' % (tokens[0] / 1.5, tokens[-1] * 1.5))
    plots, i = [], 0
    for a in apis:
        for m in ("whole", "layerwise"):
            dash = 1 if m == "whole" else 2
            plots.append('"%s/plot.dat" index %d using 1:2:2:3 with yerrorlines dt %d lw 2 title "%s, %s"' % (
                tmp, i, dash, m, a))
            i += 1
    f.write("plot " + ", \\\n     ".join(plots) + "\n")
EOF

cat "$TMP/section.md"
if command -v gnuplot >/dev/null; then
  gnuplot "$TMP/plot.gp" || die "gnuplot failed"
  say "plot: $PLOT"
else
  say "gnuplot is missing (Debian gnuplot-nox; scripts/install-deps.sh bench): no plot"
fi
if [ "$RESULTS" != - ]; then
  # The newest section goes first, after the file's introduction.
  python3 - "$RESULTS" "$TMP/section.md" <<'EOF'
import sys
path, section = sys.argv[1], open(sys.argv[2]).read()
try:
    text = open(path).read()
except FileNotFoundError:
    text = "# kvferry benchmark results\n\n"
i = text.find("\n## ")
text = text + "\n" + section if i < 0 else text[:i + 1] + section + "\n" + text[i + 1:]
open(path, "w").write(text)
EOF
  say "section added to $RESULTS"
fi
