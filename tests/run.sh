#!/usr/bin/env bash
# tests/run.sh BIN... - runs cmocka test binaries and sums their results.
#
# Each binary runs under a timeout with CMOCKA_MESSAGE_OUTPUT=TAP; its TAP
# lines are counted per test case. A binary that crashes, times out, or exits
# non-zero without reporting a failure counts as one more failure, and the
# tests it planned but never reported count as failed too. On failure the
# tail of its stderr is shown, and the tail of every daemon log in the temp
# dirs it announced ("kvf-harness: temp dir DIR"; kept on failure).
# The last line is always "N passed, N failed[, N skipped]"; the exit status
# is non-zero when anything failed.
#
# Environment: BUILD (passed on to the tests), KVF_TEST_TIMEOUT (seconds per
# binary, default 600).
set -u

timeout_s=${KVF_TEST_TIMEOUT:-600}
export BUILD=${BUILD:-build}
total_pass=0 total_fail=0 total_skip=0
failed_bins=()

# Sets plan/ok/nok/skip/group_fail from a TAP file. cmocka 1.1 prints skips
# as "not ok N # SKIP name" and group fixture failures as "not ok 0 - ...".
parse_tap() {
  plan=0 ok=0 nok=0 skip=0 group_fail=0
  local line re_plan='^1\.\.([0-9]+)' re_skip='^(not )?ok [0-9]+ # SKIP'
  while IFS= read -r line; do
    if [[ $line =~ $re_plan ]]; then plan=$((plan + BASH_REMATCH[1]))
    elif [[ $line =~ $re_skip ]]; then skip=$((skip + 1))
    elif [[ $line =~ ^not\ ok\ 0[^0-9] ]]; then group_fail=$((group_fail + 1))
    elif [[ $line =~ ^not\ ok\ [0-9]+ ]]; then nok=$((nok + 1))
    elif [[ $line =~ ^ok\ [0-9]+ ]]; then ok=$((ok + 1))
    fi
  done <"$1"
}

# Shows the daemon logs of the temp dirs the binary announced on stderr.
show_logs() {
  local dir log
  grep -o 'kvf-harness: temp dir [^ ]*' "$1" 2>/dev/null | awk '{print $4}' | sort -u |
    while IFS= read -r dir; do
      [ -d "$dir" ] || continue
      echo "    daemon logs kept in $dir"
      for log in "$dir"/*.log; do
        [ -f "$log" ] || continue
        echo "    ---- tail of $log ----"
        tail -n 40 "$log" | sed 's/^/    | /'
      done
    done
}

run_one() {
  local bin=$1 name out err rc t0 t1 missing extra=0 why=""
  name=$(basename "$bin")
  echo "=== $name"
  if [ ! -x "$bin" ]; then
    echo "    $bin: not found or not executable"
    total_fail=$((total_fail + 1)); failed_bins+=("$name")
    return
  fi
  out=$(mktemp) err=$(mktemp)
  t0=$(date +%s)
  # -k: a binary ignoring SIGTERM gets SIGKILL 10 s later.
  CMOCKA_MESSAGE_OUTPUT=TAP timeout -k 10 "$timeout_s" "$bin" >"$out" 2>"$err"
  rc=$?
  t1=$(date +%s)
  parse_tap "$out"
  sed -n -e '/^\(not \)\?ok /p' -e '/^# /p' "$out" | sed 's/^/    /'
  missing=$((plan - ok - nok - skip))
  [ "$missing" -lt 0 ] && missing=0
  if [ "$plan" -eq 0 ] && [ "$rc" -eq 0 ]; then
    ok=1   # not a TAP producer: one passing test
  fi
  case $rc in
    0) ;;
    124) why="timed out after ${timeout_s}s" ;;
    *) if [ "$rc" -eq 137 ] && [ $((t1 - t0)) -ge "$timeout_s" ]; then why="timed out after ${timeout_s}s, killed"
       elif [ "$rc" -gt 128 ]; then why="killed by signal $((rc - 128))"; else why="exit status $rc"; fi ;;
  esac
  # A non-zero exit must be explained by a reported failure, else it counts.
  # A failed group setup already shows as its tests never reported; a
  # failed teardown (all tests reported) counts once. cmocka 1.1 exits 0
  # after a failed teardown, so the TAP line is what tells.
  local gf=0
  [ "$missing" -eq 0 ] && gf=$group_fail
  if [ "$rc" -ne 0 ] && [ $((nok + gf + missing)) -eq 0 ]; then extra=1; fi
  local f=$((nok + gf + missing + extra))
  total_pass=$((total_pass + ok)); total_fail=$((total_fail + f)); total_skip=$((total_skip + skip))
  local notes="$((t1 - t0))s"
  [ -n "$why" ] && notes="$notes, $why"
  [ "$missing" -gt 0 ] && notes="$notes, $missing never reported"
  [ "$group_fail" -gt 0 ] && notes="$notes, $group_fail group fixture failure(s)"
  [ "$extra" -gt 0 ] && notes="$notes, no failure reported for the exit status"
  local counts="$ok passed, $f failed"
  [ "$skip" -gt 0 ] && counts="$counts, $skip skipped"
  echo "    $name: $counts ($notes)"
  if [ "$f" -gt 0 ]; then
    failed_bins+=("$name")
    if [ -s "$err" ]; then
      echo "    ---- last 80 lines of $name's stderr ----"
      tail -n 80 "$err" | sed 's/^/    | /'
    fi
    show_logs "$err"
  fi
  rm -f "$out" "$err"
}

for bin in "$@"; do
  run_one "$bin"
done

[ "${#failed_bins[@]}" -gt 0 ] && echo "failed: ${failed_bins[*]}"
summary="$total_pass passed, $total_fail failed"
[ "$total_skip" -gt 0 ] && summary="$summary, $total_skip skipped"
echo "$summary"
[ "$total_fail" -eq 0 ]
