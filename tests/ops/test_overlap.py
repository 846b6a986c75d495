#!/usr/bin/env python3
"""Overlapping destinations (issue 15, item 10), against two real daemons
over tcp: a grant whose own ranges overlap is refused with KVF_EINVAL and a
message naming both (raw frames read it), touching and unsorted ranges are
fine; a grant over bytes that an open grant of the same pool holds is
refused with KVF_EBUSY naming the other grant, and accepted once that one
completed, failed at its deadline or was cancelled; grant-overlap allow
accepts it; blocks: a repeated id, a shared id on shared layers, and two
layouts over the same bytes. Every transfer checks every byte it moved.
Also item 12: what RECV_DONE's bytes say after a failure."""
import os
import random
import signal
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Raw, wait_event
from test_engine_wire import cancel, grant as raw_grant

import kvferry

KVF_EINVAL = -4016
KVF_EBUSY = -4017
BLK = 4096
MB = 1 << 20


def pattern(seed, n):
    return random.Random(seed).randbytes(n)


class RawClient:
    """A raw API client: the daemon's answer with its error text, which
    libkvferry does not hand back."""

    def __init__(self, sock):
        self.raw = Raw(sock)
        self.seq = 1
        self.raw.write(kvftest.hello_frame(1, "test_overlap"))
        assert self.raw.next()[:3] == ("response", 1, 0)

    def call(self, make, *args):
        self.seq += 1
        self.raw.write(make(self.seq, *args))
        while True:
            got = self.raw.next()
            assert got is not None, "no answer within 5 s"
            if got[0] == "response":
                break
        kind, seq, status, r = got
        assert seq == self.seq, (seq, self.seq)
        return status, r.get(3, [b""])[0].decode()

    def close(self):
        self.raw.close()


class Clients(kvftest.PairClientsTestCase):
    """A client of each daemon and its pool "kv"."""
    POOL = "32M"

    def assert_code(self, code, fn):
        with self.assertRaises(kvferry.KvferryError) as cm:
            fn()
        self.assertEqual(cm.exception.code, code, str(cm.exception))


class Overlap(Clients):

    def move(self, xid, dst_offs, seed):
        """Sends BLK-sized blocks from the prefill pool's start into the
        decode pool at dst_offs (already granted as xid, in that order)
        and checks every byte that landed."""
        n = len(dst_offs)
        data = pattern(seed, n * BLK)
        self.pp.memory[0:n * BLK] = data
        self.cp.send(xid, "decode", [self.pp.desc(i * BLK, BLK) for i in range(n)])
        self.assertEqual(wait_event(self.cp, xid).status, 0)
        ev = wait_event(self.cd, xid)
        self.assertEqual(ev.status, 0, ev.error)
        self.assertEqual(ev.bytes, n * BLK)
        mem = self.pd.memory
        for i, off in enumerate(dst_offs):
            self.assertEqual(bytes(mem[off:off + BLK]), data[i * BLK:(i + 1) * BLK], "block %d" % i)

    def test_overlap_within_a_grant_is_refused(self):
        self.assert_code(KVF_EINVAL, lambda: self.cd.grant(
            "w1", "prefill", [self.pd.desc(0, 2 * BLK), self.pd.desc(BLK, 2 * BLK)]))
        self.assert_code(KVF_EINVAL, lambda: self.cd.grant(  # the same block twice, not next to each other
            "w2", "prefill", [self.pd.desc(8 * BLK, BLK), self.pd.desc(0, BLK), self.pd.desc(8 * BLK, BLK)]))
        c = RawClient(self.dec.sock)
        try:
            pool = self.pd.id
            status, err = c.call(raw_grant, b"w3", (pool, 0, 2 * BLK), (pool, 100 * BLK, BLK),
                                 (pool, BLK, 2 * BLK))
            self.assertEqual(status, KVF_EINVAL)
            self.assertIn("descriptor 0 (pool %d [0, 8192)) and descriptor 2 ([4096, 12288))" % pool, err)
            self.assertIn("overlap", err)
        finally:
            c.close()
        self.assertEqual(self.dec.status()["grants_active"], 0)

    def test_touching_and_unsorted_ranges_are_fine(self):
        offs = [5 * BLK, 1 * BLK, 2 * BLK, 9 * BLK, 0, 4 * BLK]  # 0..3 touch; shuffled
        self.cd.grant("t1", "prefill", [self.pd.desc(o, BLK) for o in offs])
        self.move("t1", offs, 1)

    def test_second_grant_over_the_same_bytes(self):
        self.cd.grant("s1", "prefill", [self.pd.desc(i * BLK, BLK) for i in range(4)])
        self.assert_code(KVF_EBUSY, lambda: self.cd.grant("s2", "prefill", [self.pd.desc(3 * BLK, 2 * BLK)]))
        c = RawClient(self.dec.sock)
        try:
            status, err = c.call(raw_grant, b"s3", (self.pd.id, 10 * BLK, BLK), (self.pd.id, 2 * BLK, BLK))
            self.assertEqual(status, KVF_EBUSY)
            self.assertIn("descriptor 1 (pool %d [8192, 12288)) overlaps descriptor 2 ([8192, 12288)) of the "
                          "open grant 's1'" % self.pd.id, err)
        finally:
            c.close()
        self.cd.grant("s4", "prefill", [self.pd.desc(4 * BLK, BLK)])  # touching: fine
        self.move("s1", [0, BLK, 2 * BLK, 3 * BLK], 2)
        # s1 completed: its bytes are free again
        self.cd.grant("s2", "prefill", [self.pd.desc(3 * BLK, BLK)])
        self.move("s2", [3 * BLK], 3)
        self.cd.cancel("s4")
        self.assertEqual(wait_event(self.cd, "s4").status, -4013)  # KVF_ECANCELED

    def test_bytes_are_free_after_cancel_and_deadline(self):
        self.cd.grant("f1", "prefill", [self.pd.desc(20 * BLK, BLK)])
        self.assert_code(KVF_EBUSY, lambda: self.cd.grant("f2", "prefill", [self.pd.desc(20 * BLK, BLK)]))
        self.cd.cancel("f1")
        self.assertNotEqual(wait_event(self.cd, "f1").status, 0)
        self.cd.grant("f2", "prefill", [self.pd.desc(20 * BLK, BLK)], deadline_ms=50)
        self.assertEqual(wait_event(self.cd, "f2").status, -4012)  # KVF_EDEADLINE
        self.cd.grant("f3", "prefill", [self.pd.desc(20 * BLK, BLK)])
        self.move("f3", [20 * BLK], 4)

    def test_another_client_and_a_raw_cancel(self):
        """The index is the daemon's, not a client's: another client's open
        grant counts too, and its bytes are free once it is cancelled."""
        c = RawClient(self.dec.sock)
        try:
            self.assertEqual(c.call(raw_grant, b"o1", (self.pd.id, 30 * BLK, BLK))[0], 0)
            self.assert_code(KVF_EBUSY, lambda: self.cd.grant("o2", "prefill", [self.pd.desc(30 * BLK, BLK)]))
            self.assertEqual(c.call(cancel, b"o1")[0], 0)
        finally:
            c.close()
        self.cd.grant("o2", "prefill", [self.pd.desc(30 * BLK, BLK)])
        self.move("o2", [30 * BLK], 5)


class Blocks(Clients):
    L, NB = 4, 16

    def setUp(self):
        super().setUp()
        offs = [r * self.NB * BLK for r in range(2 * self.L)]
        self.src = self.cp.register_layout(kvferry.Layout(self.pp, offs, self.NB, BLK))
        self.dst = self.cd.register_layout(kvferry.Layout(self.pd, offs, self.NB, BLK))
        # a second layout over the same bytes: layer 0's K region is the first's
        self.alias = self.cd.register_layout(kvferry.Layout(self.pd, offs[:2], self.NB, BLK))

    def test_block_overlaps(self):
        self.assert_code(KVF_EINVAL, lambda: self.cd.grant_blocks("b0", "prefill", self.dst, [3, 5, 3]))
        self.cd.grant_blocks("b1", "prefill", self.dst, [1, 2, 3], first_layer=0, n_layers=2)
        self.assert_code(KVF_EBUSY, lambda: self.cd.grant_blocks("b2", "prefill", self.dst, [7, 3],
                                                                 first_layer=1, n_layers=1))
        self.assert_code(KVF_EBUSY, lambda: self.cd.grant_blocks("b3", "prefill", self.alias, [2]))
        # the same blocks on other layers, other blocks on the same layers: fine
        self.cd.grant_blocks("b4", "prefill", self.dst, [1, 2, 3], first_layer=2, n_layers=2)
        self.cd.grant_blocks("b5", "prefill", self.alias, [4, 5])
        # b1 lands, every byte checked; then its blocks are free for the alias
        used = 2 * self.L * self.NB * BLK
        data = pattern(7, used)
        self.pp.memory[0:used] = data
        self.cp.send_blocks("b1", "decode", self.src, [9, 10, 11], first_layer=0, n_layers=2)
        self.assertEqual(wait_event(self.cp, "b1").status, 0)
        self.assertEqual(wait_event(self.cd, "b1").status, 0)
        mem = self.pd.memory
        for layer in range(2):
            for kv in range(2):
                region = (2 * layer + kv) * self.NB * BLK
                for s, d in ((9, 1), (10, 2), (11, 3)):
                    self.assertEqual(bytes(mem[region + d * BLK:region + (d + 1) * BLK]),
                                     data[region + s * BLK:region + (s + 1) * BLK], (layer, kv, d))
        self.cd.grant_blocks("b3", "prefill", self.alias, [2])
        for xid in ("b3", "b4", "b5"):
            self.cd.cancel(xid)
            self.assertNotEqual(wait_event(self.cd, xid).status, 0)

    def test_same_layers_then_a_range(self):
        """Grants of one layout and the same layers share a set of block
        ids: a shared id is refused, others are fine; a descriptor grant
        over one of their blocks' bytes is refused too (the set becomes
        ranges), one beside them is fine, and every id is free again once
        the grants ended."""
        self.cd.grant_blocks("s1", "prefill", self.dst, [0, 1, 2])
        self.cd.grant_blocks("s2", "prefill", self.dst, [5, 6])
        self.assert_code(KVF_EBUSY, lambda: self.cd.grant_blocks("s3", "prefill", self.dst, [4, 6]))
        layer3_v = 7 * self.NB * BLK  # region of layer 3's V: s2's block 5 is [5 BLK, 6 BLK) of it
        self.assert_code(KVF_EBUSY, lambda: self.cd.grant("r1", "prefill", [self.pd.desc(layer3_v + 5 * BLK + 9, 1)]))
        self.cd.grant("r2", "prefill", [self.pd.desc(layer3_v + 7 * BLK, BLK)])  # block 7: nobody's
        self.assert_code(KVF_EBUSY, lambda: self.cd.grant_blocks("s4", "prefill", self.dst, [7]))
        self.cd.grant_blocks("s5", "prefill", self.dst, [3, 4])
        used = 2 * self.L * self.NB * BLK
        data = pattern(11, used)
        self.pp.memory[0:used] = data
        self.cp.send_blocks("s5", "decode", self.src, [12, 13])
        self.assertEqual(wait_event(self.cp, "s5").status, 0)
        self.assertEqual(wait_event(self.cd, "s5").status, 0)
        mem = self.pd.memory
        for r in range(2 * self.L):
            region = r * self.NB * BLK
            for s, d in ((12, 3), (13, 4)):
                self.assertEqual(bytes(mem[region + d * BLK:region + (d + 1) * BLK]),
                                 data[region + s * BLK:region + (s + 1) * BLK], (r, d))
        for xid in ("s1", "s2", "r2"):
            self.cd.cancel(xid)
            self.assertNotEqual(wait_event(self.cd, xid).status, 0)
        self.cd.grant_blocks("s6", "prefill", self.dst, list(range(self.NB)))  # all free again
        self.cd.cancel("s6")
        self.assertNotEqual(wait_event(self.cd, "s6").status, 0)


    def test_failed_recv_done_bytes(self):
        """Issue 15, item 12: a receive that fails after some layers landed
        reports the grant's whole size in RECV_DONE's bytes (as kvferry.h
        says: the receiver does not know what landed), and its LAYER_DONE
        events say which layers did; those hold the sender's bytes, the
        others are untouched."""
        ids = [4, 6, 8]
        used = 2 * self.L * self.NB * BLK
        data = pattern(21, used)
        self.pp.memory[0:used] = data
        self.pd.memory[0:used] = bytes(used)
        self.cd.grant_blocks("ev1", "prefill", self.dst, ids, layer_events=True)
        self.cp.send_blocks("ev1", "decode", self.src, ids, first_layer=0, n_layers=2, more=True)
        for layer in range(2):
            ev = wait_event(self.cd, "ev1", type=kvferry.LAYER_DONE)
            self.assertEqual((ev.layer, ev.bytes), (layer, len(ids) * 2 * BLK))
        self.cp.cancel("ev1")
        self.assertEqual(wait_event(self.cp, "ev1").status, -4013)  # KVF_ECANCELED
        ev = wait_event(self.cd, "ev1")
        self.assertEqual((ev.type, ev.status), (kvferry.RECV_DONE, -4006))  # KVF_EREMOTECANCEL
        self.assertEqual(ev.bytes, self.L * 2 * len(ids) * BLK, "the grant's size, not what landed")
        self.assertEqual(ev.descriptors, self.L * 2 * len(ids))
        mem = self.pd.memory
        for layer in range(self.L):
            for kv in range(2):
                region = (2 * layer + kv) * self.NB * BLK
                for b in ids:
                    got = bytes(mem[region + b * BLK:region + (b + 1) * BLK])
                    want = data[region + b * BLK:region + (b + 1) * BLK] if layer < 2 else bytes(BLK)
                    self.assertEqual(got, want, (layer, kv, b))
        self.cd.grant_blocks("ev2", "prefill", self.dst, ids)  # the bytes are free again
        self.cp.send_blocks("ev2", "decode", self.src, ids)
        self.assertEqual(wait_event(self.cp, "ev2").status, 0)
        ev = wait_event(self.cd, "ev2")
        self.assertEqual((ev.status, ev.bytes), (0, self.L * 2 * len(ids) * BLK))


class Allow(unittest.TestCase):
    """grant-overlap allow: a second grant over the same bytes is accepted;
    each transfer lands in turn; overlap within a grant is still refused.
    SIGHUP back to refuse: a grant over the bytes of one still open (from
    before) is refused."""

    def test_allowed_then_refused_after_reload(self):
        pre, dec = kvftest.pair(kvftest.tempdir(), pool="8M", extra="grant-overlap allow")
        try:
            with pre.client() as cp, dec.client() as cd:
                pp, pd = cp.pool_find("kv"), cd.pool_find("kv")
                with self.assertRaises(kvferry.KvferryError) as cm:
                    cd.grant("a0", "prefill", [pd.desc(0, 2 * BLK), pd.desc(BLK, BLK)])
                self.assertEqual(cm.exception.code, KVF_EINVAL)
                cd.grant("a1", "prefill", [pd.desc(0, 2 * BLK)])
                cd.grant("a2", "prefill", [pd.desc(BLK, 2 * BLK)])
                cd.grant("a3", "prefill", [pd.desc(BLK, BLK)])
                for xid, src_off, seed in (("a1", 0, 11), ("a2", 2 * BLK, 12)):
                    data = pattern(seed, 2 * BLK)
                    pp.memory[src_off:src_off + 2 * BLK] = data
                    cp.send(xid, "decode", [pp.desc(src_off, 2 * BLK)])
                    self.assertEqual(wait_event(cp, xid).status, 0)
                    self.assertEqual(wait_event(cd, xid).status, 0)
                    dst = 0 if xid == "a1" else BLK
                    self.assertEqual(bytes(pd.memory[dst:dst + 2 * BLK]), data, xid)
                # a3 (over [BLK, 2 BLK)) is still open: refuse applies to what comes next
                n = dec.log_text().count("reload done")
                dec.extra = "grant-overlap refuse"
                dec.write_conf()
                dec.signal(signal.SIGHUP)
                kvftest.wait_for(lambda: dec.log_text().count("reload done") > n, 5, "the reload")
                self.assertIn("reload: grant-overlap: allow -> refuse", dec.log_text())
                with self.assertRaises(kvferry.KvferryError) as cm:
                    cd.grant("a4", "prefill", [pd.desc(0, 2 * BLK)])
                self.assertEqual(cm.exception.code, KVF_EBUSY)
                cd.grant("a4", "prefill", [pd.desc(2 * BLK, BLK)])
                for xid in ("a3", "a4"):
                    cd.cancel(xid)
                    self.assertEqual(wait_event(cd, xid).status, -4013)  # KVF_ECANCELED
        finally:
            for d in (pre, dec):
                self.assertEqual(d.stop(), 0)


if __name__ == "__main__":
    kvftest.main()
