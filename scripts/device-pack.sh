#!/usr/bin/env bash
# scripts/device-pack.sh - gathers what a GPU machine without a package
# registry needs to run this build into .devcarry/ (ignored by git): the
# binaries the GPU tests and benchmarks run (.devcarry/build, laid out as
# build/), the Debian runtime libraries they link (libuv, protobuf-c,
# rdma-core, systemd, cmocka, iperf3 and their own dependencies, never
# glibc) in .devcarry/lib, and iperf3 and ss in .devcarry/bin. Carry `.devcarry`
# to the machine, then:
#
#   export LD_LIBRARY_PATH=$PWD/.devcarry/lib PATH=$PWD/.devcarry/bin:$PATH
#   BUILD=.devcarry/build tests/gpu/run.sh
#
# Build first (make all test-build). Environment: BUILD (default build).
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
[ -x "$BUILD/tests/gpu/gpu_copy" ] || { echo "device-pack: $BUILD/tests/gpu not built (make all test-build)" >&2; exit 1; }
out=.devcarry
rm -rf "$out/lib" "$out/bin" "$out/build"
mkdir -p "$out/lib" "$out/bin" "$out/build/tests/gpu"
bins=("$BUILD/kvferryd" "$BUILD/kvferry-bench" "$BUILD/kvferryctl" "$BUILD"/tests/gpu/* /usr/bin/iperf3 /usr/bin/ss)
cp "${bins[@]:0:3}" "$BUILD/libkvferry.so" "$out/build/"
cp "$BUILD"/tests/gpu/* "$out/build/tests/gpu/"
# The CPU benchmarks run there too (16 cores: bench/latency.sh, bench/submit.sh).
for tool in tcp-pingpong submit-bench; do
  [ -x "$BUILD/$tool" ] && cp "$BUILD/$tool" "$out/build/"
done
# Every library ldd resolves, except the C library and the loader, which the
# machine has (and must match its kernel).
ldd "${bins[@]}" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' | while read -r lib; do
    cp -L "$lib" "$out/lib/"
  done
cp /usr/bin/iperf3 /usr/bin/ss "$out/bin/" # ss: bench/tcp_vs_iperf.sh waits for iperf3's port with it
echo "device-pack: $(ls "$out/lib" | wc -l) libraries, $(du -sh "$out" | cut -f1) in $out"
