#!/usr/bin/env python3
"""A tcp data stream that the peer closes while both daemons stay up (what
the losing side of two daemons dialing each other at once does to the
streams it had opened) is joined and freed at once: its fd and memory must
not wait for the next time the peer goes down. Found by the chaos suite
(tests/chaos): every such flap left tcp-streams fds open on the other
daemon."""
import os
import socket
import time
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


def settled_fds(d):
    """The daemon's fd count once it holds still: the API session of the
    last status() call closes on the daemon's next loop turn, not when our
    end of it does."""
    prev = open_fds(d)
    while True:
        time.sleep(0.1)
        n = open_fds(d)
        if n == prev:
            return n
        prev = n


def streams_in(d):
    return (d.status().get("tcp") or {}).get("streams_in")


class ClosedStreams(unittest.TestCase):
    def test_closed_inbound_streams_are_freed(self):
        pre, dec = kvftest.pair(kvftest.tempdir(), pool="8M")
        try:
            with pre.client() as c:
                session = int(c.inspect("peers", json=True)["peers"][0]["session"], 16)
            kvftest.wait_for(lambda: streams_in(dec) == 4, 5, "decode's 4 inbound streams")
            fds = settled_fds(dec)
            for i in range(8):  # streams of a torn-down incarnation, one after another
                s = socket.create_connection(("127.0.0.1", dec.port), timeout=5)
                s.sendall(data_hello(b"prefill", session, 100 + i))
                self.assertEqual(s.recv(4), b"\0\0\0\0", "the stream's ACK")
                s.close()
            try:
                kvftest.wait_for(lambda: settled_fds(dec) == fds and streams_in(dec) == 4, 5, "")
            except AssertionError:
                self.fail("decode has %d fds and %s inbound streams, not %d and 4" % (
                    open_fds(dec), streams_in(dec), fds))
            self.assertTrue(pre.peers_up() and dec.peers_up())
        finally:
            self.assertEqual(pre.stop(), 0)
            self.assertEqual(dec.stop(), 0)


if __name__ == "__main__":
    kvftest.main()
