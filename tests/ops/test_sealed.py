#!/usr/bin/env python3
"""A tcp receive completes on its bytes alone when the sender's source
cannot fault (tcp_wire.h: BATCH_SEALED), and waits for the sender's
SendDone when it can.

The sender runs the failpoint build with send-done-withheld: it never sends
SendDone. A grant fed from a daemon pool (a memfd the daemon sealed) or
from engine memory the daemon could seal completes anyway, every byte
checked, and so does the send (the receiver's RecvResult). A grant fed from
engine memory that cannot be sealed (a memfd made without
MFD_ALLOW_SEALING: it could shrink under the sender's writev, which then
sends zeros in its place) must not: both sides fail at the deadline.

Also: a daemon pool's memfd is sealed, so a client holding its fd cannot
shrink it under the daemon's mappings."""
import mmap
import os
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, wait_event

import kvferry

N = 256 * 1024


def pattern(seed, n):
    block = bytes((seed * 37 + i * 11) & 0xFF for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


@unittest.skipUnless(os.path.exists(kvftest.ROGUE), "no failpoint build (make test-build)")
class TestSealed(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        cls.pre = Daemon(cls.dir, "prefill", pool="16M")
        cls.pre.failpoint = "send-done-withheld"
        cls.dec = Daemon(cls.dir, "decode", pool="16M")
        cls.pre.add_peer(cls.dec)
        cls.dec.add_peer(cls.pre)
        cls.pre.start()
        cls.dec.start()
        cls.pre.wait_peers_up()
        cls.dec.wait_peers_up()

    @classmethod
    def tearDownClass(cls):
        for d in (cls.pre, cls.dec):
            assert d.stop() == 0

    def setUp(self):
        self.cp, self.cd = self.pre.client(), self.dec.client()
        self.pp, self.pd = self.cp.pool_find("kv"), self.cd.pool_find("kv")

    def tearDown(self):
        self.cp.close()
        self.cd.close()

    def handoff(self, xfer_id, src, src_off, deadline_ms=10000):
        """Grants N bytes at the decode pool's offset 0, sends them from
        (src pool, src_off); returns both events."""
        self.pd.memory[0:N] = bytes(N)
        self.cd.grant(xfer_id, "prefill", [(self.pd.id, 0, N)], deadline_ms=deadline_ms)
        self.cp.send(xfer_id, "decode", [(src, src_off, N)], deadline_ms=deadline_ms)
        recv = wait_event(self.cd, xfer_id, deadline_ms / 1000 + 10, kvferry.RECV_DONE)
        send = wait_event(self.cp, xfer_id, deadline_ms / 1000 + 10, kvferry.SEND_DONE)
        return recv, send

    def test_daemon_pool_source_completes_on_its_bytes(self):
        self.pp.memory[N:2 * N] = pattern(1, N)
        recv, send = self.handoff("sealed-pool", self.pp.id, N)
        recv.raise_for_status()
        send.raise_for_status()
        self.assertEqual(bytes(self.pd.memory[0:N]), pattern(1, N))

    def test_sealable_engine_memory_completes_on_its_bytes(self):
        buf = kvferry.host_buffer(N, "kvftest-sealable")
        try:
            buf[:] = pattern(2, N)
            ep = self.cp.register(buf, "sealable")
            recv, send = self.handoff("sealed-engine", ep.id, 0)
            recv.raise_for_status()
            send.raise_for_status()
            self.assertEqual(bytes(self.pd.memory[0:N]), pattern(2, N))
            self.cp.unregister(ep)
        finally:
            buf.close()

    def test_unsealable_engine_memory_waits_for_the_sender(self):
        fd = os.memfd_create("kvftest-unsealable", os.MFD_CLOEXEC)  # no MFD_ALLOW_SEALING
        os.ftruncate(fd, N)
        m = mmap.mmap(fd, N)
        try:
            m[:] = pattern(3, N)
            ep = self.cp.register(memoryview(m), "unsealable")
            recv, send = self.handoff("unsealed-engine", ep.id, 0, deadline_ms=1500)
            # Every byte landed, but only the (withheld) SendDone could
            # vouch for them: the receive must not report success.
            self.assertEqual(recv.status, kvferry.ERRORS["KVF_EDEADLINE"], recv.error)
            self.assertNotEqual(send.status, 0)
            kvftest.wait_for(lambda: self.try_unregister(ep), 10, "the engine pool freed")
        finally:
            m.close()
            os.close(fd)

    def try_unregister(self, ep):
        try:
            self.cp.unregister(ep)
            return True
        except kvferry.KvferryError:
            return False

    def test_daemon_pool_memfd_cannot_shrink(self):
        for d in (self.pre, self.dec):
            fds = [os.path.join("/proc/%d/fd" % d.proc.pid, f) for f in os.listdir("/proc/%d/fd" % d.proc.pid)]
            pools = [p for p in fds if "kvferry-pool-kv" in os.readlink(p)]
            self.assertTrue(pools, "the daemon holds its pool's memfd")
            fd = os.open(pools[0], os.O_RDWR)
            try:
                with self.assertRaises(PermissionError):
                    os.ftruncate(fd, 4096)
            finally:
                os.close(fd)


if __name__ == "__main__":
    kvftest.main()
