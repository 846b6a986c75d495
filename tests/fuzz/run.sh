#!/usr/bin/env bash
# tests/fuzz/run.sh TARGET... - runs libFuzzer targets one after another
# (`make fuzz` calls it; see tests/fuzz/README.md).
#
# Each target runs from its corpora: $BUILD/fuzz/corpus/TARGET (where new
# inputs go; kept between runs), tests/fuzz/corpus/TARGET (the committed
# seeds and regression inputs) and $BUILD/fuzz/seeds/TARGET (generated from
# the current wire format), with tests/fuzz/TARGET.dict. A crash, a leak, a
# timeout or a broken invariant leaves the input in
# $BUILD/fuzz/artifacts/ and fails the run. One line per target, then a
# summary; the exit status is non-zero when any target failed.
#
# Environment: BUILD (default build), FUZZ_SECONDS (per target, default 10;
# 0 = no time limit), FUZZ_RUNS (stop after this many executions too),
# FUZZ_MAX_LEN (largest input, default 4096 bytes: a few hundred requests or
# messages; larger inputs make each execution slower, not deeper), FUZZ_ARGS
# (more libFuzzer flags).
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
dir=$BUILD/fuzz
secs=${FUZZ_SECONDS:-10}
runs=${FUZZ_RUNS:-}


failed=0
summary=()
mkdir -p "$dir/artifacts" "$dir/logs"
for t in "$@"; do
  bin=$dir/$t
  log=$dir/logs/$t.log
  mkdir -p "$dir/corpus/$t" "$dir/seeds/$t"
  limit=(-max_total_time="$secs")
  [ -n "$runs" ] && limit+=(-runs="$runs")
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$bin" "${limit[@]}" -timeout=25 -rss_limit_mb=2048 -max_len="${FUZZ_MAX_LEN:-4096}" \
    -dict="tests/fuzz/$t.dict" -artifact_prefix="$dir/artifacts/$t-" -print_final_stats=1 \
    ${FUZZ_ARGS:-} "$dir/corpus/$t" "tests/fuzz/corpus/$t" "$dir/seeds/$t" >"$log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | awk '{print $2}')
  corpus=$(find "$dir/corpus/$t" -type f | wc -l)
  if [ $rc -ne 0 ]; then
    failed=$((failed + 1))
    echo "FAIL $t: exit $rc after ${took}s, ${execs:-?} executions (log $log)"
    grep -E 'ERROR|SUMMARY|fuzz invariant|Test unit written|^    #[0-9]+ ' "$log" | head -n 40
    summary+=("$t FAILED")
  else
    echo "ok   $t: ${execs:-?} executions in ${took}s (${rate:-?} exec/s), coverage ${cov:-?} edges, corpus $corpus, 0 crashes"
    summary+=("$t ok")
  fi
done
echo "fuzz: ${#summary[@]} targets, $failed failed (${summary[*]})"
[ $failed -eq 0 ]
