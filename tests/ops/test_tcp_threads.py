#!/usr/bin/env python3
"""The tcp transport runs on a fixed set of worker threads (tcp-threads,
issue 18): a daemon's thread count does not grow with its peers, and a peer
that stalls in the middle of a batch does not hold back another peer's data
on the same receiver worker.

Before: one sender thread per outbound stream and one receiver thread per
inbound stream, 8 threads per peer with tcp-streams 4 (and no tcp-threads
key: these daemons would not start). Every transfer verifies every byte."""
import os
import socket
import struct
import time
import unittest

import kvftest
import kvferry

MIB = 1 << 20


def pattern(seed, n):
    block = bytes((seed * 131 + i * 7) & 0xFF for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


def threads(d):
    """The Threads line of /proc/PID/status."""
    with open("/proc/%d/status" % d.proc.pid) as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line")


def transfer(src, src_c, dst, dst_c, xid, n, seed, off):
    """src sends n bytes to dst over tcp (dst's grant first); checks every
    byte that landed. Returns the seconds from the send to RECV_DONE."""
    sp, dp = src_c.pool_find("kv"), dst_c.pool_find("kv")
    sp.memory[off:off + n] = pattern(seed, n)
    dp.memory[off:off + n] = bytes(n)
    dst_c.grant(xid, src.name, [(dp.id, off, n)])
    t0 = time.monotonic()
    src_c.send(xid, dst.name, [(sp.id, off, n)])
    kvftest.wait_event(dst_c, xid, 20, kvferry.RECV_DONE).raise_for_status()
    took = time.monotonic() - t0
    kvftest.wait_event(src_c, xid, 20, kvferry.SEND_DONE).raise_for_status()
    if bytes(dp.memory[off:off + n]) != pattern(seed, n):
        raise AssertionError("%s: the bytes that landed on %s differ from those %s sent" % (xid, dst.name, src.name))
    return took


def mesh(hub_extra, names):
    """A hub daemon and peers of it (each peered with the hub only), not
    started."""
    dir = kvftest.tempdir()
    hub = kvftest.Daemon(dir, "hub", "64M", extra=hub_extra)
    peers = [kvftest.Daemon(dir, n, "32M") for n in names]
    for p in peers:
        hub.add_peer(p)
        p.add_peer(hub)
    return hub, peers


def peer_up(d, name):
    with d.client() as c:
        return any(p["name"] == name and p["state"] == "up" for p in c.inspect("peers", json=True)["peers"])


def data_hello(node, session, stream):
    """A framed PeerMsg{data_hello} (as tests/ops/test_streams.py)."""
    body = (kvftest.field_varint(1, 1) + kvftest.field_bytes(2, node) +
            kvftest.field_varint(3, session) + kvftest.field_varint(4, stream))
    return kvftest.frame(kvftest.field_bytes(2, body))


class FixedThreads(unittest.TestCase):
    def setUp(self):
        self.daemons = []

    def tearDown(self):
        for d in self.daemons:
            self.assertEqual(d.stop(), 0, d.name)

    def start(self, d):
        self.daemons.append(d)
        d.start()

    def test_threads_do_not_grow_with_peers(self):
        """One daemon's thread count with 1 and with 6 connected peers,
        each of which sent to it and received from it."""
        hub, peers = mesh("tcp-threads 2", ["p%d" % i for i in range(6)])
        self.start(hub)
        counts = []
        for group, active in ((peers[:1], peers[:1]), (peers[1:], peers)):
            for p in group:
                self.start(p)
            for p in group:
                kvftest.wait_for(lambda: peer_up(hub, p.name) and peer_up(p, "hub"), 10, "%s up" % p.name)
            with hub.client() as hc:
                for i, p in enumerate(active):
                    with p.client() as pc:
                        off = i * 4 * MIB
                        transfer(p, pc, hub, hc, "to-hub-%s-%d" % (p.name, len(counts)), 4 * MIB, i, off)
                        transfer(hub, hc, p, pc, "from-hub-%s-%d" % (p.name, len(counts)), 4 * MIB, 50 + i, off)
                tcp = hc.inspect("status", json=True)["tcp"]
            self.assertEqual(tcp["threads"], 4, "2 sender and 2 receiver workers")
            self.assertEqual((tcp["streams_out"], tcp["streams_in"]), (4 * len(active),) * 2)
            counts.append(threads(hub))
        self.assertEqual(counts[0], counts[1], "the hub's threads with 1 peer and with 6 peers")

    def test_stalled_peer_does_not_hold_back_another(self):
        """A rogue data stream sends a batch header and half its payload,
        then stalls; with one receiver worker, a good peer's transfers to
        the same daemon still land at once."""
        hub, (good, rogue) = mesh("tcp-threads 1", ["good", "rogue"])
        for d in (hub, good, rogue):
            self.start(d)
        for p in (good, rogue):
            kvftest.wait_for(lambda: peer_up(hub, p.name) and peer_up(p, "hub"), 10, "%s up" % p.name)
        with rogue.client() as rc:
            session = int([p for p in rc.inspect("peers", json=True)["peers"] if p["name"] == "hub"][0]["session"], 16)
        raw = socket.create_connection(("127.0.0.1", hub.port), timeout=5)
        try:
            raw.sendall(data_hello(b"rogue", session, 9))
            self.assertEqual(raw.recv(4), b"\0\0\0\0", "the stream's ACK")
            with hub.client() as hc:
                kvftest.wait_for(lambda: hc.inspect("status", json=True)["tcp"]["streams_in"] == 9, 10,
                                 "the rogue stream adopted")
                # One batch of one 1 MiB frame into a grant nobody opened (read
                # into a sink: the receive is mid-batch all the same), half of it.
                raw.sendall(struct.pack("<IIQ", 0x4446564b, 1, 0x1234) + struct.pack("<IIQ", 0, MIB, 0) +
                            pattern(7, MIB // 2))
                with good.client() as gc:
                    for i in range(4):
                        took = transfer(good, gc, hub, hc, "past-the-stall-%d" % i, 8 * MIB, i, i * 8 * MIB)
                        self.assertLess(took, 5.0, "a transfer behind a stalled stream on the same worker")
                self.assertEqual(hc.inspect("status", json=True)["tcp"]["streams_in"], 9, "the rogue stream waits")
                # The rest of the batch comes: the stream goes on in step.
                raw.sendall(pattern(7, MIB)[MIB // 2:])
                with good.client() as gc:
                    transfer(good, gc, hub, hc, "after-the-stall", MIB, 9, 0)
        finally:
            raw.close()
        self.assertTrue(peer_up(hub, "good") and peer_up(hub, "rogue"))


if __name__ == "__main__":
    kvftest.main()
