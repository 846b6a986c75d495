#!/usr/bin/env python3
"""A dial closed with the peer's Hello already read (bench/scale.sh, 64
daemons on a loaded machine, crashed kvferryd: uv_close and uv_write
assertions, a heap use after free under ASan in the heartbeat's write).

The dial's patience (peer-timeout-ms) ran out in a timer, which closed the
connection; in the same loop iteration the poll then read the peer's Hello
from it, and the Hello brought the link up on the closing connection. The
connection was freed a moment later while the peer still routed through
it. Frames read on a connection being closed must be dropped.

The failpoint close-dial-unread (the failpoint build, tests/kvferryd-rogue)
closes every dial of "prefill" as the first frame from the peer comes in,
with that frame still to be read: deterministic, where the race needs a
timer and a read to meet. "decode" connects on demand, so "prefill"'s dials
are all there is until decode sends; then decode's dial carries the link,
and transfers both ways verify every byte."""
import os
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, peer_row, wait_for

N = 256 << 10


@unittest.skipUnless(os.path.exists(kvftest.ROGUE), "no failpoint build (make test-build)")
class TestClosedDial(unittest.TestCase):
    def setUp(self):
        self.dir = kvftest.tempdir()
        self.pre = Daemon(self.dir, "prefill", pool="8M")
        self.pre.failpoint = "close-dial-unread"
        self.dec = Daemon(self.dir, "decode", pool="8M", extra="peer-connect on-demand\npeer-idle-close-ms 0")
        kvftest.peer_both(self, self.pre, self.dec)

    def transfer(self, src, dst, xid, seed):
        with src.client() as cs, dst.client() as cd:
            er, es, landed = kvftest.move(cs, cd, cs.pool_find("kv"), cd.pool_find("kv"), src, dst, xid, 0,
                                          kvftest.pattern(seed, N), 10000, 15)
            er.raise_for_status()
            es.raise_for_status()
            self.assertTrue(landed, "%s: wrong bytes landed" % xid)

    def test_link_never_rides_a_closed_dial(self):
        self.pre.start()
        self.dec.start()
        # Each closed dial is redialed (reconnect-min-ms 50); two closed,
        # with their Hellos unread, or the link came up on one of them.
        closed = lambda: self.pre.log_text().count("failpoint close-dial-unread: closed")  # noqa: E731
        wait_for(lambda: closed() >= 2 or peer_row(self.pre, "decode")["ups"] > 0, 15,
                 "two dials of prefill closed by the failpoint")
        self.assertEqual(peer_row(self.pre, "decode")["ups"], 0,
                         "the link came up on a dial that was being closed:\n" + self.pre.log_text()[-2000:])
        # decode's own dial carries the link; the link works both ways.
        self.transfer(self.dec, self.pre, "to-prefill", 1)
        self.transfer(self.pre, self.dec, "to-decode", 2)
        self.assertEqual(peer_row(self.pre, "decode")["state"], "up")
        self.assertIsNone(self.pre.proc.poll(), "prefill died:\n" + self.pre.log_text()[-2000:])
        self.assertEqual(self.pre.stop(), 0)
        self.assertEqual(self.dec.stop(), 0)


if __name__ == "__main__":
    kvftest.main()
