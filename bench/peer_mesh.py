#!/usr/bin/env python3
"""Mesh formation bench (issue 15, item 8): N daemons (default 16), each
configured with all the others, started at once, R rounds (default 5).
Prints per round the seconds until every daemon had every peer up and the
link drops seen (peers' downs counters + "down:" log lines), then a total.

  bench/peer_mesh.py [-n 16] [-r 5] [--kvferryd PATH]

--kvferryd runs another build's daemon (e.g. the tree before a change);
the client library and tests/ops/kvftest.py are this tree's."""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "ops"))
import kvftest  # noqa: E402
import test_peer_mesh  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=16, help="daemons (default 16)")
    ap.add_argument("-r", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--kvferryd", help="the daemon binary to run (default: this build's)")
    a = ap.parse_args()
    if a.kvferryd:
        kvftest.KVFERRYD = os.path.abspath(a.kvferryd)
    total, rounds_with = 0, 0
    try:
        for r in range(a.r):
            formed, drops, details = test_peer_mesh.form_mesh(a.n)
            total += drops
            rounds_with += drops > 0
            print("round %d: mesh of %d formed in %.2f s, %d drops" % (r, a.n, formed, drops), flush=True)
            for line in details[:6]:
                print("    " + line)
    finally:
        kvftest._cleanup()
    print("total: %d drops in %d rounds (%d rounds with a drop), %d daemons, %s" % (
        total, a.r, rounds_with, a.n, kvftest.KVFERRYD))
    return 0


if __name__ == "__main__":
    sys.exit(main())
