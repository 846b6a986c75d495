#!/usr/bin/env bash
# tests/rdma/run.sh - make check-rdma: the rdma transport's tests in ONE boot
# of the soft-RoCE VM (../shared/rdma-vm/run --nodes 2): node 0 is 10.0.0.1
# with rxe0 on n0, node 1 is 10.0.0.2 with rxe1 on n1, both in the guest's
# one network namespace (each daemon binds its own address).
#
# In the VM this script first adds a second rail, as on a rail-optimized
# fabric: a veth pair m0 (10.0.1.1, rxe2, node 0) <-> m1 (10.0.1.2, rxe3,
# node 1) with the same policy routing as the first, prints what the devices
# do with memory windows (tests/rdma/mw_probe), then runs
#   1. the black-box suite (tests/integration) with KVF_TEST_TRANSPORT=rdma:
#      the same cases as `make check`, every event's path must be "rdma";
#   2. tests/rdma/test_rdma: 100k descriptors, large sliced descriptors, a
#      link down mid-transfer, the receiving / sending daemon killed
#      mid-transfer, then two devices per node (striping, one rail down);
#      tests/rdma/test_bounce: the bounce path (pools the NICs do not reach);
#      tests/rdma/test_engine (library, kvf_mem_register) and
#      tests/rdma/test_engine_rdma.py (raw wire): engine memory (registered after
#      start) at both ends, both directions, direct and bounced;
#   3. test_blocks and test_e2e again with both sides bouncing.
# Every transfer verifies every byte. The last line is tests/run.sh's
# "N passed, N failed" summary; the exit status is non-zero on failure.
#
# Environment: BUILD (default build), RDMA_VM (the VM's run script),
# RDMA_VM_MEM_CHECK (default 4G), KVF_TEST_TIMEOUT (per binary, seconds),
# RDMA_TESTS (names of test binaries to run instead of all, for work on
# one of them: RDMA_TESTS="test_blocks test_rdma"; "bounce" names step 3).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
RDMA_VM=${RDMA_VM:-$(cd .. && pwd)/shared/rdma-vm/run}

say() { echo "check-rdma: $*" >&2; }

if [ -z "${RDMA_VM_NODES:-}" ]; then
  [ -x "$RDMA_VM" ] || { say "no VM runner at $RDMA_VM (set RDMA_VM)"; exit 1; }
  [ -x "$BUILD/tests/rdma/test_rdma" ] || { say "$BUILD/tests/rdma/test_rdma not built (make test-build)"; exit 1; }
  export BUILD
  exec "$RDMA_VM" --nodes 2 --mem "${RDMA_VM_MEM_CHECK:-4G}" --timeout 1500 -- tests/rdma/run.sh
fi

# ---- in the VM: the second rail (mirrors the VM's own setup of n0/n1) ----
add_rail() {
  ip link add m0 type veth peer name m1
  local n me peer
  for n in 0 1; do
    me=10.0.1.$((n + 1)) peer=10.0.1.$((2 - n))
    sysctl -qw net.ipv4.conf.m$n.accept_local=1 net.ipv4.conf.m$n.rp_filter=0
    ip addr add "$me/24" dev m$n
    ip link set m$n mtu 9000 up
    ip route add 10.0.1.0/24 dev m$n src "$me" table $((110 + n))
    ip rule add pref $((12 + n)) from "$me" to "$peer" iif lo lookup $((110 + n))
  done
  rdma link add rxe2 type rxe netdev m0
  rdma link add rxe3 type rxe netdev m1
}
add_rail || { say "could not add the second rail"; exit 1; }

# Taking a link down flushes the routes through it: bringing it back up must
# restore the policy route of its table, as the VM's setup made it.
cat >/tmp/kvf-link <<'SH'
#!/bin/sh
# kvf-link DEV up|down
ip link set "$1" "$2" || exit 1
[ "$2" = up ] || exit 0
case $1 in
  n0) ip route replace 10.0.0.0/24 dev n0 src 10.0.0.1 table 100 ;;
  n1) ip route replace 10.0.0.0/24 dev n1 src 10.0.0.2 table 101 ;;
  m0) ip route replace 10.0.1.0/24 dev m0 src 10.0.1.1 table 110 ;;
  m1) ip route replace 10.0.1.0/24 dev m1 src 10.0.1.2 table 111 ;;
esac
SH
chmod +x /tmp/kvf-link
export KVF_TEST_LINK_CTL=/tmp/kvf-link
rdma link | sed 's/^/check-rdma: /' >&2
# What rxe does with type 2 memory windows (printed, not a pass/fail: the
# daemons test the bounds themselves at start and report it; test_rogue
# checks that what they report is what happens).
"$BUILD/tests/rdma/mw_probe" -n 4096 2>&1 | sed 's/^/check-rdma: /' >&2 || true

export KVF_TEST_TRANSPORT=rdma
export KVF_TEST_RDMA_IPS="$NODE0_IP $NODE1_IP"
export KVF_TEST_LINK=n1 KVF_TEST_LINK2=m1
export KVF_TEST_RAIL2_DEVICES="$NODE0_DEV,rxe2 $NODE1_DEV,rxe3"
bins=()
for src in tests/integration/test_*.c; do bins+=("$BUILD/tests/$(basename "$src" .c)"); done
bins+=("$BUILD/tests/rdma/test_rdma" "$BUILD/tests/rdma/test_bounce" "$BUILD/tests/rdma/test_engine" tests/rdma/test_engine_rdma.py)
bins+=(tests/ops/test_peer_wait.py) # split outcomes over rdma (issue 15, item 7)
bins+=(tests/ops/test_hetero.py) # heterogeneous layouts over rdma (issue 17): HeteroRdma
if [ -n "${RDMA_TESTS:-}" ]; then
  want=()
  for b in "${bins[@]}"; do
    case " $RDMA_TESTS " in *" $(basename "$b") "*) want+=("$b") ;; esac
  done
  say "running only: ${want[*]}"
  bins=("${want[@]+"${want[@]}"}")
fi
rc=0
[ ${#bins[@]} -eq 0 ] || BUILD=$BUILD tests/run.sh "${bins[@]}" || rc=$?
# 3. the bounce path: KV layouts and descriptors again with both sides'
#    pools unreachable by the NICs (gpu-direct off), through 2 MiB of
#    staging; every event's path must be "rdma-bounce".
if [ -z "${RDMA_TESTS:-}" ] || [[ " $RDMA_TESTS " == *" bounce "* ]]; then
  say "the bounce path: test_blocks and test_e2e with gpu-direct off on both sides"
  KVF_TEST_PATH=rdma-bounce KVF_TEST_CONF_PREFILL="gpu-direct off;rdma-bounce-size 2M" \
    KVF_TEST_CONF_DECODE="gpu-direct off;rdma-bounce-size 2M" \
    BUILD=$BUILD tests/run.sh "$BUILD/tests/test_blocks" "$BUILD/tests/test_e2e" || rc=$?
fi
exit $rc
