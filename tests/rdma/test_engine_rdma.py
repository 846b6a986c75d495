#!/usr/bin/env python3
"""Engine memory (MemRegisterReq: a memfd that rides with the request)
over rdma, in the soft-RoCE VM (tests/rdma/run.sh): registered with the
NICs after start (the transport's pool_added), known to the peer from the
grants that name it (its Hello listed only the config's pools), at both
ends of a transfer, in both directions, then unregistered (pool_removed)
and registered again in the same slot. Once with the pools registered
(path "rdma"), once with gpu-direct off on both daemons (path
"rdma-bounce"). Every byte is checked. The raw client is the one of
tests/ops/test_engine_wire.py (the library's kvf_mem_register is not
there yet)."""
import mmap
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "ops"))

import kvftest  # noqa: E402
from test_engine_wire import (KiB, REGION, Client, grant, mem_unregister, memfd, pattern,  # noqa: E402
                              send)

IPS = (os.environ.get("KVF_TEST_RDMA_IPS") or "").split()


def rdma_pair(dir, extra):
    return kvftest.pair(dir, "8M", extra="transports rdma\n%s\n" % extra,
                        extra_of={"prefill": "rdma-listen %s:0" % IPS[0], "decode": "rdma-listen %s:0" % IPS[1]})


def rdma_qps_connected(d):
    r = d.status().get("rdma") or {}
    qps = [q for p in r.get("peers", []) for q in p.get("qps", [])]
    return bool(qps) and all(q["state"] == "connected" for q in qps)


class EngineRdma(unittest.TestCase):
    EXTRA = ""
    PATH = b"rdma"

    @classmethod
    def setUpClass(cls):
        if len(IPS) < 2:
            raise unittest.SkipTest("KVF_TEST_RDMA_IPS not set (run in the VM: tests/rdma/run.sh)")
        cls.dir = kvftest.tempdir()
        cls.pre, cls.dec = rdma_pair(cls.dir, cls.EXTRA)
        for d in (cls.pre, cls.dec):
            kvftest.wait_for(lambda: rdma_qps_connected(d), 30, "%s's rdma QPs" % d.name)

    @classmethod
    def tearDownClass(cls):
        for d in (cls.pre, cls.dec):
            assert d.stop() == 0

    def one_way(self, snd, rcv, snd_node, rcv_node, tag, seed):
        """A region of each side's own memory, registered now, 12 scattered
        64 KiB blocks from one to the other; every byte checked; both
        regions unregistered. Returns the pool ids they had."""
        fs = memfd("kvf-src-" + tag, 4 * REGION)
        fd = memfd("kvf-dst-" + tag, 4 * REGION)
        try:
            ms, md = mmap.mmap(fs, 4 * REGION), mmap.mmap(fd, 4 * REGION)
            ms[:] = pattern(seed, 4 * REGION)
            md[:] = pattern(seed + 1, 4 * REGION)
            src = snd.register(b"src-" + tag.encode(), fs, 3 * REGION, offset=100)[1][0]
            dst = rcv.register(b"dst-" + tag.encode(), fd, 4 * REGION)[1][0]
            blocks = [(i * 5 + 3) % 16 for i in range(12)]
            g = [(dst, b * 64 * KiB, 64 * KiB) for b in blocks]
            sd = [(src, i * 64 * KiB, 64 * KiB) for i in range(12)]
            xid = ("eng-" + tag).encode()
            self.assertEqual(rcv.call(grant, xid, *g)[0], 0)
            self.assertEqual(snd.call(send, xid, rcv_node, *sd)[0], 0)
            for c in (snd, rcv):
                (_, got, status, e), = c.events(1)
                self.assertEqual((got, status), (xid, 0), e.get(8))
                self.assertEqual(e[4][0], self.PATH)
            want = bytearray(pattern(seed + 1, 4 * REGION))
            src_bytes = pattern(seed, 4 * REGION)
            for i, b in enumerate(blocks):
                want[b * 64 * KiB:(b + 1) * 64 * KiB] = src_bytes[100 + i * 64 * KiB:100 + (i + 1) * 64 * KiB]
            self.assertEqual(bytes(md[:]), bytes(want), "every byte at the receiving end")
            self.assertEqual(snd.call(mem_unregister, src)[0], 0)
            self.assertEqual(rcv.call(mem_unregister, dst)[0], 0)
            return src, dst
        finally:
            os.close(fs)
            os.close(fd)

    def test_both_directions_and_again(self):
        pre, dec = Client(self.pre.sock, b"prefill"), Client(self.dec.sock, b"decode")
        try:
            ids = self.one_way(pre, dec, b"prefill", b"decode", "fwd", 21)
            self.one_way(dec, pre, b"decode", b"prefill", "back", 31)
            # the same slots again: what the peer learnt of the old pools must not stay
            again = self.one_way(pre, dec, b"prefill", b"decode", "again", 41)
            self.assertEqual(again, ids, "the slots are reused")
        finally:
            pre.close()
            dec.close()
        for d in (self.pre, self.dec):
            kvftest.wait_for(lambda: d.status()["engine_pools"] == 0, 5, "dropped")


class EngineRdmaBounce(EngineRdma):
    EXTRA = "gpu-direct off\nrdma-bounce-size 2M"
    PATH = b"rdma-bounce"


if __name__ == "__main__":
    kvftest.main()
