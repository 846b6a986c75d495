#!/usr/bin/env python3
"""The idle-close race for pushed grants (issue 18, connections on demand).

A receiving daemon pushes its grant to the sending daemon over their
on-demand link. If the sender closes the link for idleness
(peer-idle-close-ms) while the push is on the wire, the sender never holds
the grant, and the receiver's grant failed at once with KVF_EPEERLOST
("lost the peer daemon"), though no daemon was lost. Now the grant waits
again and is pushed on the next link, which the receiver dials at once; a
peer lost for real still fails it.

The failpoint idle-close-held (the failpoint build, tests/kvferryd-rogue)
makes "prefill" close its idle link although it holds the pushed grant:
the close crossing the push, deterministic. Every transfer verifies every
byte."""
import os
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, peer_row, wait_event, wait_for

import kvferry

N = 256 << 10
ON_DEMAND = "peer-connect on-demand\n"


@unittest.skipUnless(os.path.exists(kvftest.ROGUE), "no failpoint build (make test-build)")
class TestIdleGrant(unittest.TestCase):
    def setUp(self):
        self.dir = kvftest.tempdir()
        self.pre = Daemon(self.dir, "prefill", pool="8M", extra=ON_DEMAND + "peer-idle-close-ms 300")
        self.pre.failpoint = "idle-close-held"
        self.dec = Daemon(self.dir, "decode", pool="8M", extra=ON_DEMAND + "peer-idle-close-ms 0")
        kvftest.peer_both(self, self.pre, self.dec)
        self.pre.start()
        self.dec.start()

    def test_grant_survives_an_idle_close_that_crossed_its_push(self):
        cd, cp = self.dec.client(), self.pre.client()
        self.addCleanup(cd.close)
        self.addCleanup(cp.close)
        pd, pp = cd.pool_find("kv"), cp.pool_find("kv")
        pd.memory[0:N] = bytes(N)
        pp.memory[0:N] = kvftest.pattern(7, N)
        cd.grant("g1", "prefill", [(pd.id, 0, N)], deadline_ms=20000)  # decode dials prefill, pushes it
        # prefill closes the link 300 ms later, its grant held (the
        # failpoint); decode must dial again for the grant, not fail it.
        events = []

        def relinked_or_ended():
            events.extend(cd.wait_events(4, 0))
            return events or peer_row(self.dec, "prefill")["ups"] >= 2
        wait_for(relinked_or_ended, 15, "decode to link to prefill again after prefill's idle close")
        self.assertEqual(events, [], "the grant ended at the idle close: %s" % [(e.error_name, e.error) for e in events])
        cp.send("g1", "decode", [(pp.id, 0, N)], deadline_ms=20000)
        er = wait_event(cd, "g1", 15, kvferry.RECV_DONE)
        es = wait_event(cp, "g1", 15, kvferry.SEND_DONE)
        self.assertEqual((er.error_name, es.error_name), ("OK", "OK"), (er.error, es.error))
        self.assertEqual(bytes(pd.memory[0:N]), kvftest.pattern(7, N))
        self.assertEqual(self.pre.stop(), 0)
        self.assertEqual(self.dec.stop(), 0)


if __name__ == "__main__":
    kvftest.main()
