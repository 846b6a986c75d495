#!/bin/sh
# scale.sh - the scale figures of issue 18: a real etcd (Debian's
# etcd-server) and kvferryd daemons in network namespaces, sized for a
# 2-core machine (small pools, tcp-streams 2). tests/scale/bench_scale.py
# does the work with the helpers of make check-scale; its --help tells the
# cases:
#   mesh     formation time, threads / fds / RSS / idle CPU per daemon of an
#            eager full mesh of 4, 16, 32, 64 daemons (every daemon linked to
#            every other), with the links just up and after a transfer over
#            every link each way
#   restart  a daemon of the largest mesh killed with kill -9 and restarted:
#            ready, linked again, first transfers
#   etcd     etcd killed with kill -9 and restarted: noticed, transfers
#            meanwhile, every daemon registered again
#   active   CPU seconds of one receiving daemon per transfer, with 2, 4, 8,
#            16, 32 senders sending the same transfers and bytes
# Output: one JSON line per case on stdout, then Markdown tables; progress
# on stderr. Every transfer verifies every byte.
#
# Usage: bench/scale.sh [BUILD] [bench_scale.py options]   (root; BUILD: the
#        build folder, default $BUILD or build)
#   e.g. bench/scale.sh build --sizes 4,16 --senders 2,4 --repeat 1
set -eu
cd "$(dirname "$0")/.."
case ${1:-} in -*|'') ;; *) BUILD=$1; shift ;; esac
BUILD=${BUILD:-build}
[ -x "$BUILD/kvferryd" ] || { echo "scale: $BUILD/kvferryd is missing (make all)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "scale: needs root (network namespaces)" >&2; exit 1; }
BUILD=$BUILD exec python3 tests/scale/bench_scale.py "$@"
