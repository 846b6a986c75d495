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
sends zeros in its place) must not: both sides fail at the deadline. Blocks
sent whole complete on their bytes too (the event says "whole blocks");
blocks with a transform wait (its description comes with the SendDone).

Also: a daemon pool's memfd is sealed, so a client holding its fd cannot
shrink it under the daemon's mappings."""
import mmap
import os
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import pattern, wait_event

import kvferry

N = 256 * 1024


@unittest.skipUnless(os.path.exists(kvftest.ROGUE), "no failpoint build (make test-build)")
class TestSealed(kvftest.PairClientsTestCase):
    POOL = "16M"
    FAILPOINTS = {"prefill": "send-done-withheld"}

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

    def blocks_handoff(self, xfer_id, dst_order, deadline_ms=10000):
        """2 layers x K/V x 4 blocks of 16 tokens x 2 heads x 64 B, NHD at
        the sender, dst_order at the receiver; returns both events and the
        sender's bytes of each region (for the identity check)."""
        geo = dict(tokens_per_block=16, kv_heads=2, head_dim=32, dtype_bytes=2)
        bb = 16 * 2 * 64
        src = kvferry.Layout(self.pp, [N + r * 4 * bb for r in range(4)], 4, bb, order="NHD", **geo)
        dst = kvferry.Layout(self.pd, [r * 4 * bb for r in range(4)], 4, bb, order=dst_order, **geo)
        self.pp.memory[N:N + 16 * bb] = pattern(4, 16 * bb)
        self.pd.memory[0:16 * bb] = bytes(16 * bb)
        ls, ld = self.cp.register_layout(src), self.cd.register_layout(dst)
        self.cd.grant_blocks(xfer_id, "prefill", ld, [3, 2, 1, 0], deadline_ms=deadline_ms)
        self.cp.send_blocks(xfer_id, "decode", ls, [0, 1, 2, 3], deadline_ms=deadline_ms)
        recv = wait_event(self.cd, xfer_id, deadline_ms / 1000 + 10, kvferry.RECV_DONE)
        send = wait_event(self.cp, xfer_id, deadline_ms / 1000 + 10, kvferry.SEND_DONE)
        return recv, send, bb

    def test_whole_blocks_complete_on_their_bytes(self):
        recv, send, bb = self.blocks_handoff("sealed-blocks", "NHD")
        recv.raise_for_status()
        send.raise_for_status()
        self.assertEqual(recv.transform, "whole blocks")
        src = pattern(4, 16 * bb)
        for region in range(4):
            for i in range(4):  # source block i -> granted block 3 - i
                d = (region * 4 + 3 - i) * bb
                sb = (region * 4 + i) * bb
                self.assertEqual(bytes(self.pd.memory[d:d + bb]), src[sb:sb + bb], (region, i))

    def test_transformed_blocks_wait_for_the_sender(self):
        """NHD -> HND: the receiver learns the transform from the SendDone
        (withheld here), so it must not complete on the bytes."""
        recv, send, _ = self.blocks_handoff("transformed-blocks", "HND", deadline_ms=1500)
        self.assertEqual(recv.status, kvferry.ERRORS["KVF_EDEADLINE"], recv.error)

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
