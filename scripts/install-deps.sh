#!/bin/sh
# Installs the Debian packages kvferry builds and tests with, only those that
# are missing; quiet when nothing is to do. Idempotent.
set -e
# systemd (systemd-analyze, systemd-sysusers), groff-base and curl: the
# operations tests verify the unit, render the man pages and scrape metrics.
# clang and libclang-rt-dev (libFuzzer and the sanitizer runtimes of the
# default clang): `make fuzz`. nftables: `make chaos`'s network faults.
PKGS="build-essential pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler
libibverbs-dev librdmacm-dev libcmocka-dev iperf3 libsystemd-dev python3 iproute2
systemd groff-base curl clang libclang-rt-dev nftables"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "kvferry: missing packages:$missing (run as root, or: sudo apt-get install$missing)" >&2
  exit 1
fi
echo "kvferry: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends $missing >/dev/null
