#!/bin/sh
# scripts/install-deps.sh [--check] [build] [test] [bench]
#
# Installs the Debian packages kvferry needs, only those that are missing;
# quiet when nothing is to do. Idempotent.
#   build    what `make all` and `make install` need: compiler, libraries'
#            headers, protoc-c, python3 (the man pages)
#   test     what the test, fuzz, chaos and bench targets add
#   bench    optional, never by default: gnuplot-nox, for the plots of
#            bench/layerwise.sh (which runs without it, minus the plot)
#   (none)   build and test
# --check installs nothing: it names the missing packages and fails. `make`
# and `make install` run it that way (a production host gets nothing from
# apt-get); the test targets and `make demo` install what they need.
set -e
# systemd (systemd-analyze, systemd-sysusers), groff-base, curl and
# pkg-config: the operations tests verify the unit, render the man pages,
# scrape metrics and build a client from kvferry.pc. clang and
# libclang-rt-dev (libFuzzer and the sanitizer runtimes of the default
# clang): `make fuzz`. nftables and iproute2: `make chaos`'s network
# faults. iperf3: `make bench-tcp`. libcurl4-openssl-dev: the registry
# (etcd's JSON gateway, daemon/registry.c); etcd-server: the registry tests
# and `make check-scale` start a real etcd; yamllint checks
# deploy/kubernetes/.
BUILD_PKGS="build-essential libuv1-dev libprotobuf-c-dev protobuf-c-compiler
libibverbs-dev librdmacm-dev libsystemd-dev libgcrypt20-dev libcurl4-openssl-dev python3"
TEST_PKGS="pkg-config libcmocka-dev iperf3 iproute2 systemd groff-base curl
clang libclang-rt-dev nftables etcd-server yamllint"
BENCH_PKGS="gnuplot-nox"

check=0 pkgs="" sets=""
for arg in "$@"; do
  case $arg in
    --check) check=1 ;;
    build) pkgs="$pkgs $BUILD_PKGS" sets="$sets build" ;;
    test) pkgs="$pkgs $TEST_PKGS" sets="$sets test" ;;
    bench) pkgs="$pkgs $BENCH_PKGS" sets="$sets bench" ;;
    *) echo "usage: $0 [--check] [build] [test] [bench]" >&2; exit 2 ;;
  esac
done
[ -n "$pkgs" ] || pkgs="$BUILD_PKGS $TEST_PKGS"

# Not Debian: nothing to check against; the compiler will name what is missing.
command -v dpkg-query >/dev/null 2>&1 || exit 0

missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ $check = 1 ]; then
  echo "kvferry: missing Debian packages:$missing" >&2
  echo "kvferry: install them (apt-get install$missing), or scripts/install-deps.sh$sets as root;" \
    "SKIP_DEPS=1 skips this check" >&2
  exit 1
fi
if [ "$(id -u)" != 0 ]; then
  echo "kvferry: missing packages:$missing (run as root, or: sudo apt-get install$missing)" >&2
  exit 1
fi
echo "kvferry: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
# shellcheck disable=SC2086 # one argument per package
apt-get install -y -qq --no-install-recommends $missing >/dev/null
