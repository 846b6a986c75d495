#!/usr/bin/env python3
"""Recovery after a peer restart under a flood of half-open peer
connections (issue 15, item 4). Two daemons with a cluster key on loopback
(the shipped redial backoff, reconnect 100..5000 ms); "prefill" is stopped,
"decode"'s peer port is flooded with N connections that send half a frame
header and nothing more (what the daemon closes is reopened), prefill stays
down for --down seconds (decode's backoff grows meanwhile) and is started
again: the figure is the time from its start until both sides have the
other up and one 64 KiB transfer went through, bytes checked.

  bench/peer_flood.py [-n 1100] [-r 3] [--down 3.5] [--src 127.0.0.2] [--kvferryd PATH]

-n 0 is the baseline without a flood. --src 127.0.0.1 floods from the
peer's own address (the same host as the peer). --kvferryd runs another
build's daemon; the client library and tests/ops are this tree's."""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "ops"))
import kvftest  # noqa: E402
import test_peer_guard as g  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1100, help="half-open connections (0: no flood)")
    ap.add_argument("-r", type=int, default=3, help="restarts (default 3)")
    ap.add_argument("--down", type=float, default=3.5, help="seconds prefill stays down")
    ap.add_argument("--src", default="127.0.0.2", help="the flood's source address")
    ap.add_argument("--kvferryd", help="the daemon binary to run (default: this build's)")
    a = ap.parse_args()
    if a.kvferryd:
        kvftest.KVFERRYD = os.path.abspath(a.kvferryd)
    g.Flood.__init__.__defaults__ = (a.src,)
    times = []
    try:
        pre, dec = g.keyed_pair(kvftest.tempdir())
        try:
            for r in range(a.r):
                t = g.restart_under_flood(pre, dec, a.n, a.down)
                times.append(t)
                print("restart %d: up and a transfer through %.3f s after the start" % (r, t), flush=True)
        finally:
            pre.kill()
            dec.kill()
    finally:
        kvftest._cleanup()
    print("flood %d from %s, down %.1f s: median %.3f s, max %.3f s over %d restarts (%s)" % (
        a.n, a.src, a.down, statistics.median(times), max(times), len(times), kvftest.KVFERRYD))
    return 0


if __name__ == "__main__":
    sys.exit(main())
