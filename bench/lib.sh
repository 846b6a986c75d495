# bench/lib.sh - sourced by the bench scripts (POSIX sh).
#
# bench_setup NAME: a fresh $TMP (kvferry-NAME.XXXXXX under $TMPDIR) and an
# empty $PIDS; on exit, interrupt or termination the processes listed in
# $PIDS are stopped (SIGTERM, then SIGKILL after 5 s: a stuck daemon must
# not hang the script) and $TMP is removed.

bench_cleanup() {
  for pid in $PIDS; do kill "$pid" 2>/dev/null || true; done
  for pid in $PIDS; do
    i=0
    while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$TMP"
}

bench_setup() {
  TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-$1.XXXXXX")
  PIDS=""
  trap bench_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}
