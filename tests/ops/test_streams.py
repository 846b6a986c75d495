#!/usr/bin/env python3
"""A tcp data stream that the peer closes while both daemons stay up (what
the losing side of two daemons dialing each other at once does to the
streams it had opened) is joined and freed at once: its fd and memory must
not wait for the next time the peer goes down. Found by the chaos suite
(tests/chaos): every such flap left tcp-streams fds open on the other
daemon."""
import os
import socket
import unittest

import kvftest


def data_hello(node, session, stream):
    """A framed PeerMsg{data_hello: {version 1, node, session, stream}}
    (proto/kvferry.proto), encoded by hand: no protobuf module needed."""
    body = (kvftest.field_varint(1, 1) + kvftest.field_bytes(2, node) +
            kvftest.field_varint(3, session) + kvftest.field_varint(4, stream))
    return kvftest.frame(kvftest.field_bytes(2, body))


def open_fds(d):
    return len(os.listdir("/proc/%d/fd" % d.proc.pid))


def settled(c):
    """True when, as c's daemon says, c is its only API session (those of
    earlier calls are closed, fds with them) and 4 tcp data streams came in
    (what a peer opens)."""
    st = c.inspect("status", json=True)
    return st["clients"] == 1 and (st.get("tcp") or {}).get("streams_in") == 4


class ClosedStreams(unittest.TestCase):
    def test_closed_inbound_streams_are_freed(self):
        pre, dec = kvftest.pair(kvftest.tempdir(), pool="8M")
        try:
            with pre.client() as c:
                session = int(c.inspect("peers", json=True)["peers"][0]["session"], 16)
            # One API session for every status call: the fd count then only
            # moves with the streams.
            with dec.client() as c:
                kvftest.wait_for(lambda: settled(c), 5,
                                 "decode's 4 inbound streams and no other API session")
                fds = open_fds(dec)
                for i in range(8):  # streams of a torn-down incarnation, one after another
                    s = socket.create_connection(("127.0.0.1", dec.port), timeout=5)
                    s.sendall(data_hello(b"prefill", session, 100 + i))
                    self.assertEqual(s.recv(4), b"\0\0\0\0", "the stream's ACK")
                    s.close()
                try:
                    kvftest.wait_for(lambda: open_fds(dec) == fds and settled(c), 5, "")
                except AssertionError:
                    self.fail("decode has %d fds and status %s, not %d fds and 4 inbound streams" % (
                        open_fds(dec), c.inspect("status", json=True).get("tcp"), fds))
            self.assertTrue(pre.peers_up() and dec.peers_up())
        finally:
            self.assertEqual(pre.stop(), 0)
            self.assertEqual(dec.stop(), 0)


if __name__ == "__main__":
    kvftest.main()
