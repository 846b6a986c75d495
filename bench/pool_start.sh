#!/bin/sh
# pool_start.sh - how long kvferryd takes from exec to ready with one host
# pool (default 4 GiB), with huge pages and without: the time an engine
# waits before it can connect after a (re)start (issue 14).
#
# Each trial starts kvferryd with NOTIFY_SOCKET pointing at a datagram
# socket of ours and times exec -> READY=1 (what systemd waits for, sent
# after the pools exist and the API socket listens), then stops it and
# waits for its exit (so that the next trial finds the memory free). The
# pool's start line (backing, locked) is printed with each mode.
#
# Huge pages: mode "huge" needs vm.nr_hugepages to hold the pool. With
# RESERVE=1 (root) the script reserves what is missing and gives it back
# at the end; otherwise mode huge is skipped when there are too few.
#
# Environment: BUILD (default build), KVFERRYD (default $BUILD/kvferryd: set
# it to another build to compare), POOL (default 4G), TRIALS (default 3),
# MODES (default "huge normal"), MLOCK (yes/no, default yes), RESERVE.
# Prints one line per trial and a summary line per mode (median seconds);
# the last line of stdout is the same as JSON. Each trial line also gives the
# daemon's CPU time (user + system, all threads) up to READY=1.
# Usage: make && RESERVE=1 bench/pool_start.sh
set -eu

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
KVFERRYD=${KVFERRYD:-$BUILD/kvferryd}
POOL=${POOL:-4G}
TRIALS=${TRIALS:-3}
MODES=${MODES:-huge normal}
MLOCK=${MLOCK:-yes}
RESERVE=${RESERVE:-0}

say() { echo "pool_start: $*" >&2; }
die() { say "$*"; exit 1; }

[ -x "$KVFERRYD" ] || die "$KVFERRYD is missing (run make first)"
command -v python3 >/dev/null || die "python3 is missing"

. bench/lib.sh
bench_setup poolstart

bytes=$(python3 -c 'import sys; s=sys.argv[1]; m={"K":1<<10,"M":1<<20,"G":1<<30}; print(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s))' "$POOL")
want_huge=$((bytes / 2097152))
huge_before=$(cat /proc/sys/vm/nr_hugepages)
restore_huge() {
  if [ "$(cat /proc/sys/vm/nr_hugepages)" != "$huge_before" ]; then
    echo "$huge_before" >/proc/sys/vm/nr_hugepages 2>/dev/null || true
  fi
  bench_cleanup
}
trap restore_huge EXIT

huge_free() { awk '/^HugePages_Free:/ {print $2}' /proc/meminfo; }

results=""
for mode in $MODES; do
  case $mode in
    huge)
      hp=on
      # pages other processes hold count in nr_hugepages but are not free:
      # raise it by what is missing, a few times (the kernel may give fewer)
      tries=0
      while [ "$(huge_free)" -lt "$want_huge" ] && [ "$RESERVE" = 1 ] && [ $tries -lt 3 ]; do
        echo $(($(cat /proc/sys/vm/nr_hugepages) + want_huge - $(huge_free))) >/proc/sys/vm/nr_hugepages 2>/dev/null || true
        tries=$((tries + 1))
      done
      if [ "$(huge_free)" -lt "$want_huge" ]; then
        say "mode huge skipped: $(huge_free) free 2 MiB huge pages, $want_huge needed (RESERVE=1 as root reserves them)"
        continue
      fi
      ;;
    normal) hp=off ;;
    *) die "unknown mode $mode (huge, normal)" ;;
  esac
  conf="$TMP/$mode.conf"
  {
    echo "node poolstart"
    echo "api-socket $TMP/api.sock"
    echo "peer-listen off"
    echo "transports tcp"
    echo "cuda off"
    echo "hugepages $hp"
    echo "mlock $MLOCK"
    echo "log-level info"
    echo "pool p host $POOL"
  } >"$conf"
  line=$(python3 - "$KVFERRYD" "$conf" "$TMP" "$TRIALS" "$mode" <<'EOF'
import os, socket, statistics, subprocess, sys, time
exe, conf, tmp, trials, mode = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
path = os.path.join(tmp, "notify.sock")
times = []
for t in range(trials):
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(120)
    log = open(os.path.join(tmp, "%s-%d.log" % (mode, t)), "w+")
    env = dict(os.environ, NOTIFY_SOCKET=path)
    t0 = time.monotonic()
    p = subprocess.Popen([exe, "-c", conf], stdout=log, stderr=subprocess.STDOUT, env=env)
    ready = None
    try:
        while ready is None:
            msg = s.recv(4096)
            if b"READY=1" in msg.split(b"\n"):
                ready = time.monotonic() - t0
                # CPU time to ready (all threads, ended ones included):
                # on a busy machine wall time says more about the others
                with open("/proc/%d/stat" % p.pid) as f:
                    st = f.read().rsplit(")", 1)[1].split()
                cpu = (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")
    except socket.timeout:
        pass
    p.terminate()
    rc = p.wait()
    s.close()
    log.seek(0)
    text = log.read()
    if ready is None or rc != 0:
        sys.stderr.write(text)
        sys.exit("pool_start: %s trial %d: %s (exit %d)" % (mode, t, "no READY=1" if ready is None else "ready", rc))
    pool = [l.split("pool p: ", 1)[1] for l in text.splitlines() if "pool p: " in l]
    print("pool_start: %s trial %d: %.3f s to ready, %.2f s of CPU (%s)" % (mode, t, ready, cpu, pool[0] if pool else "?"),
          file=sys.stderr)
    times.append(ready)
print("%s %.3f %.3f %.3f" % (mode, statistics.median(times), min(times), max(times)))
EOF
)
  set -- $line
  printf '%-7s pool %s: median %s s (min %s, max %s) over %s trials\n' "$1" "$POOL" "$2" "$3" "$4" "$TRIALS"
  results="$results${results:+, }\"$1\": {\"median_s\": $2, \"min_s\": $3, \"max_s\": $4}"
done
echo "{\"pool\": \"$POOL\", \"trials\": $TRIALS, \"mlock\": \"$MLOCK\"${results:+, $results}}"
