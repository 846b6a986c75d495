#!/usr/bin/env python3
"""Calls that do not wait and the batched call (issue 16): KVF_NOWAIT
grants, sends and cancels and kvf_submit, through the Python binding,
against two real daemons (tcp between them, local within one). Every
transfer checks every byte of its destination. Errors come exactly once:
what the library refuses at once (and no event), what the daemon refuses
as the transfer's one DONE event (and the call succeeded). Parts submitted
back to back keep their order; a batch of 512 layer parts lands; a client
that submits and exits leaves nothing behind; a client that floods is
slowed (KVF_NOBLOCK says -EAGAIN while its daemon does not read), loses
nothing, and the daemon's memory stays bounded. A receiver that spins in
kvf_wait_events (KVFERRY_SPIN_US) gets its events and still times out."""
import os
import signal
import subprocess
import sys
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import wait_event

import kvferry

MB = 1 << 20
POOL = 32 * MB
BLK = 4096
POISON = 0x5A


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS for pid %d" % pid)


class Base(kvftest.PairTestCase):
    POOL = "32M"

    def setUp(self):
        self.cp, self.cd = self.pre.client(), self.dec.client()
        self.cp2 = self.pre.client()  # a second prefill-side client: the local path's receiver
        self.pp, self.pd = self.cp.pool_find("kv"), self.cd.pool_find("kv")
        self.pp2 = self.cp2.pool_find("kv")

    def tearDown(self):
        for c in (self.cp, self.cd, self.cp2):
            c.close()

    def fill(self, pool, off, n):
        data = os.urandom(n)
        pool.memory[off:off + n] = data
        return data

    def poison(self, pool, off, n):
        pool.memory[off:off + n] = bytes([POISON]) * n

    def assert_bytes(self, pool, off, want):
        got = bytes(pool.memory[off:off + len(want)])
        if got != want:
            i = next(i for i in range(len(want)) if got[i] != want[i])
            self.fail("byte %d of %d at pool offset %d is 0x%02x, expected 0x%02x" % (i, len(want), off, got[i],
                                                                                       want[i]))

    def done(self, client, xid, type, status=0):
        ev = wait_event(client, xid, type=type)
        self.assertEqual(ev.status, status, "%s %s: %s %s" % (xid, ev.kind, ev.error_name, ev.error))
        return ev

    sentinels = 0

    def no_more_events(self, client, xid):
        """No event of xid is left on client: a transfer made after it on
        the same connection (so its events come later) completes, then
        every event waiting is taken and none is of xid."""
        Base.sentinels += 1
        sid = "sentinel-%d" % Base.sentinels
        want = self.fill(self.pp, 8 * MB, BLK)
        self.poison(self.pd, 8 * MB, BLK)
        if client is self.cd:
            client.grant(sid, "prefill", [self.pd.desc(8 * MB, BLK)])
            self.cp.send(sid, "decode", [self.pp.desc(8 * MB, BLK)])
            self.done(self.cp, sid, kvferry.SEND_DONE)
            self.done(client, sid, kvferry.RECV_DONE)
        else:
            self.cd.grant(sid, "prefill", [self.pd.desc(8 * MB, BLK)])
            client.send(sid, "decode", [self.pp.desc(8 * MB, BLK)])
            self.done(self.cd, sid, kvferry.RECV_DONE)
            self.done(client, sid, kvferry.SEND_DONE)
        self.assert_bytes(self.pd, 8 * MB, want)
        stash = client.__dict__.get("_kvftest_stash", [])
        left = [e for e in stash + client.wait_events(256, 0) if e.xfer_id == xid]
        self.assertEqual(left, [], "events of %r after its one outcome" % xid)


class TestNowait(Base):
    def test_descs_tcp(self):
        """A nowait grant and a nowait send of three parts over tcp."""
        n, parts = 3 * 64 * 1024, 3
        want = self.fill(self.pp, 0, n)
        self.poison(self.pd, MB, n)
        step = n // parts
        self.cd.grant("nw-tcp", "prefill", [self.pd.desc(MB + i * step, step) for i in range(parts)], nowait=True)
        for i in range(parts):
            self.cp.send("nw-tcp", "decode", [self.pp.desc(i * step, step)], more=i < parts - 1, nowait=True)
        ev = self.done(self.cd, "nw-tcp", kvferry.RECV_DONE)
        self.assertEqual((ev.path, ev.bytes), ("tcp", n))
        self.assertEqual(self.done(self.cp, "nw-tcp", kvferry.SEND_DONE).bytes, n)
        self.assert_bytes(self.pd, MB, want)

    def test_descs_local(self):
        """The same within one daemon (the local path), by kvf_submit."""
        n = 256 * 1024
        want = self.fill(self.pp, 0, n)
        self.poison(self.pp2, 2 * MB, n)
        self.cp2.submit([dict(op="grant", xfer_id="nw-local", node="prefill",
                              descs=[self.pp2.desc(2 * MB, n // 2), self.pp2.desc(2 * MB + n // 2, n // 2)])])
        self.cp.submit([dict(op="send", xfer_id="nw-local", node="prefill", descs=[self.pp.desc(0, n // 2)],
                             more=True),
                        dict(op="send", xfer_id="nw-local", node="prefill", descs=[self.pp.desc(n // 2, n // 2)])])
        ev = self.done(self.cp2, "nw-local", kvferry.RECV_DONE)
        self.assertEqual((ev.path, ev.bytes), ("local", n))
        self.done(self.cp, "nw-local", kvferry.SEND_DONE)
        self.assert_bytes(self.pp2, 2 * MB, want)

    def blocks_pair(self, L, nb, cp=None, pp=None, base_src=0, base_dst=0):
        """A layout of L layers x K/V x nb blocks of BLK on each side."""
        cp, pp = cp or self.cp, pp or self.pp
        src = cp.register_layout(kvferry.Layout(pp, [base_src + r * nb * BLK for r in range(2 * L)], nb, BLK))
        dst = self.cd.register_layout(kvferry.Layout(self.pd, [base_dst + r * nb * BLK for r in range(2 * L)], nb,
                                                     BLK))
        return src, dst

    def test_blocks_parts_in_order(self):
        """Layer parts submitted back to back, nowait, each its own call:
        the layers land in order (one LAYER_DONE each, in order), every
        block where the grant put it."""
        L, nb = 8, 16
        src, dst = self.blocks_pair(L, nb)
        sids, dids = [3, 1, 4, 15, 9, 2, 6, 5], [0, 7, 8, 9, 10, 11, 14, 12]
        self.poison(self.pd, 0, 2 * L * nb * BLK)
        want = {}
        for r in range(2 * L):
            for s, d in zip(sids, dids):
                want[r * nb * BLK + d * BLK] = self.fill(self.pp, r * nb * BLK + s * BLK, BLK)
        self.cd.grant_blocks("nw-blk", "prefill", dst, dids, layer_events=True, nowait=True)
        for layer in range(L):
            self.cp.send_blocks("nw-blk", "decode", src, sids if layer == 0 else None, first_layer=layer,
                                n_layers=1, more=layer < L - 1, nowait=True)
        layers = []
        while True:
            ev = wait_event(self.cd, "nw-blk")
            if ev.type != kvferry.LAYER_DONE:
                break
            layers.append(ev.layer)
        self.assertEqual((ev.type, ev.status, ev.bytes), (kvferry.RECV_DONE, 0, len(sids) * L * 2 * BLK), ev.error)
        self.assertEqual(layers, list(range(L)))
        self.done(self.cp, "nw-blk", kvferry.SEND_DONE)
        for off, data in want.items():
            self.assert_bytes(self.pd, off, data)

    def test_blocks_local_with_spinning(self):
        """Blocks within one daemon (the local path), nowait, the receiver
        spinning in kvf_wait_events (KVFERRY_SPIN_US, read at connect): the
        blocks land, and a wait with nothing to come still times out."""
        L, nb, base = 4, 8, 16 * MB
        with kvftest.environ(KVFERRY_SPIN_US="300"):
            rc = self.pre.client()
        try:
            pool = rc.pool_find("kv")
            src = self.cp.register_layout(kvferry.Layout(self.pp, [r * nb * BLK for r in range(2 * L)], nb, BLK))
            dst = rc.register_layout(kvferry.Layout(pool, [base + r * nb * BLK for r in range(2 * L)], nb, BLK))
            self.poison(pool, base, 2 * L * nb * BLK)
            self.fill(self.pp, 0, 2 * L * nb * BLK)
            sids, dids = [0, 5, 7], [6, 1, 2]
            self.assertEqual(rc.wait_events(4, 1), [])
            rc.grant_blocks("sp-loc", "prefill", dst, dids, nowait=True)
            for layer in range(L):
                self.cp.send_blocks("sp-loc", "prefill", src, sids if layer == 0 else None, first_layer=layer,
                                    n_layers=1, more=layer < L - 1, nowait=True)
            ev = self.done(rc, "sp-loc", kvferry.RECV_DONE)
            self.assertEqual((ev.path, ev.bytes), ("local", 3 * L * 2 * BLK))
            self.done(self.cp, "sp-loc", kvferry.SEND_DONE)
            for r in range(2 * L):
                for sb, db in zip(sids, dids):
                    self.assert_bytes(pool, base + r * nb * BLK + db * BLK,
                                      bytes(self.pp.memory[r * nb * BLK + sb * BLK:r * nb * BLK + (sb + 1) * BLK]))
            self.assertEqual(rc.wait_events(4, 1), [])
        finally:
            rc.close()

    def test_batch_of_512_parts(self):
        """16 requests x 32 layers: the grants in one kvf_submit, the 512
        layer parts in another; every block of every request lands."""
        L, nb, R, per = 32, 128, 16, 8
        src, dst = self.blocks_pair(L, nb)
        self.poison(self.pd, 0, 2 * L * nb * BLK)
        self.pp.memory[0:2 * L * nb * BLK] = os.urandom(2 * L * nb * BLK)
        ids = {r: (list(range(r * per, (r + 1) * per)), list(range(nb - 1 - r * per, nb - 1 - (r + 1) * per, -1)))
               for r in range(R)}
        self.assertEqual(self.cd.submit([dict(op="grant_blocks", xfer_id="b512-%d" % r, node="prefill",
                                              layout=dst, block_ids=ids[r][1]) for r in range(R)]), R)
        parts = [dict(op="send_blocks", xfer_id="b512-%d" % r, node="decode", layout=src,
                      block_ids=ids[r][0] if layer == 0 else None, first_layer=layer, n_layers=1,
                      more=layer < L - 1) for layer in range(L) for r in range(R)]
        self.assertEqual(len(parts), 512)
        self.assertEqual(self.cp.submit(parts), 512)
        for r in range(R):
            self.assertEqual(self.done(self.cd, "b512-%d" % r, kvferry.RECV_DONE).bytes, per * L * 2 * BLK)
            self.done(self.cp, "b512-%d" % r, kvferry.SEND_DONE)
        src_mem, dst_mem = self.pp.memory, self.pd.memory
        for r in range(R):
            for reg in range(2 * L):
                for s, d in zip(*ids[r]):
                    so, do = reg * nb * BLK + s * BLK, reg * nb * BLK + d * BLK
                    if dst_mem[do:do + BLK] != src_mem[so:so + BLK]:
                        self.fail("request %d region %d block %d -> %d differs" % (r, reg, s, d))


class TestErrorsOnce(Base):
    def test_daemon_refusals_come_as_events(self):
        """What the daemon refuses comes as the one DONE event, the call
        having returned without error: an unknown peer, an id granted by
        another client, a pool that does not exist, sizes that differ."""
        # unknown peer: the send's SEND_DONE
        self.cp.send("er-peer", "nowhere", [self.pp.desc(0, BLK)], nowait=True)
        ev = self.done(self.cp, "er-peer", kvferry.SEND_DONE, kvferry.KVF_ENOPEER)
        self.assertIn("nowhere", ev.error)
        self.no_more_events(self.cp, "er-peer")
        # an id another client of the daemon holds: KVF_EEXIST, that grant unharmed
        other = self.dec.client()
        try:
            other.grant("er-dup", "prefill", [self.pd.desc(4 * MB, BLK)])
            self.cd.grant("er-dup", "prefill", [self.pd.desc(5 * MB, BLK)], nowait=True)
            self.done(self.cd, "er-dup", kvferry.RECV_DONE, kvferry.KVF_EEXIST)
            want = self.fill(self.pp, 0, BLK)
            self.cp.send("er-dup", "decode", [self.pp.desc(0, BLK)], nowait=True)
            self.done(other, "er-dup", kvferry.RECV_DONE)
            self.done(self.cp, "er-dup", kvferry.SEND_DONE)
            self.assert_bytes(self.pd, 4 * MB, want)
        finally:
            other.close()
        self.no_more_events(self.cd, "er-dup")
        # no such pool
        self.cd.grant("er-pool", None, [kvferry.Desc(4242, 0, BLK)], nowait=True)
        self.done(self.cd, "er-pool", kvferry.RECV_DONE, kvferry.KVF_ENOPOOL)
        self.no_more_events(self.cd, "er-pool")
        # sizes differ: both sides fail, once each
        self.cd.grant("er-size", "prefill", [self.pd.desc(0, BLK)], nowait=True)
        self.cp.send("er-size", "decode", [self.pp.desc(0, 2 * BLK)], nowait=True)
        self.done(self.cp, "er-size", kvferry.SEND_DONE, kvferry.KVF_ESIZE)
        self.assertEqual(wait_event(self.cd, "er-size", type=kvferry.RECV_DONE).status, kvferry.KVF_ESIZE)
        self.no_more_events(self.cp, "er-size")
        self.no_more_events(self.cd, "er-size")

    def test_refused_first_part_ends_the_send(self):
        """Later parts queued behind a refused first part are refused
        silently: the one SEND_DONE already said why."""
        self.cp.submit([dict(op="send", xfer_id="er-first", node="nowhere", descs=[self.pp.desc(0, BLK)],
                             more=True)] +
                       [dict(op="send", xfer_id="er-first", node="nowhere", descs=[self.pp.desc(BLK, BLK)],
                             more=i < 2) for i in range(3)])
        self.done(self.cp, "er-first", kvferry.SEND_DONE, kvferry.KVF_ENOPEER)
        self.no_more_events(self.cp, "er-first")

    def assert_at_once(self, name, call):
        with self.assertRaises(kvferry.KvferryError, msg=name) as cm:
            call()
        self.assertEqual(cm.exception.name, name, str(cm.exception))

    def test_library_refusals_come_at_once(self):
        """What the library can check itself fails the call, and no event
        follows."""
        d = [self.pp.desc(0, BLK)]
        self.assert_at_once("KVF_EINVAL", lambda: self.cp.send("", "decode", d, nowait=True))
        self.assert_at_once("KVF_EINVAL", lambda: self.cp.send("al-bad\n", "decode", d, nowait=True))
        self.assert_at_once("KVF_EINVAL", lambda: self.cp.send("al-node", "x" * 64, d, nowait=True))
        self.assert_at_once("KVF_EINVAL", lambda: self.cp.send("al-nodesc", "decode", [], nowait=True))
        self.assert_at_once("KVF_ENOENT", lambda: self.cp.cancel("al-none", nowait=True))
        self.assert_at_once("KVF_ENOENT", lambda: self.cp.send_blocks("al-lay", "decode", 777, [0], nowait=True))
        self.cd.grant("al-twice", "prefill", [self.pd.desc(0, BLK)], nowait=True)
        self.assert_at_once("KVF_EEXIST", lambda: self.cd.grant("al-twice", "prefill", [self.pd.desc(BLK, BLK)],
                                                                nowait=True))
        # a batch stops at its first refused entry: those before it went
        with self.assertRaises(kvferry.KvferryError) as cm:
            self.cd.submit([dict(op="grant", xfer_id="al-b1", node="prefill", descs=[self.pd.desc(2 * BLK, BLK)]),
                            dict(op="grant", xfer_id="", node="prefill", descs=[self.pd.desc(3 * BLK, BLK)]),
                            dict(op="grant", xfer_id="al-b3", node="prefill", descs=[self.pd.desc(4 * BLK, BLK)])])
        self.assertEqual((cm.exception.name, cm.exception.queued), ("KVF_EINVAL", 1))
        self.cd.cancel("al-twice", nowait=True)
        self.cd.cancel("al-b1", nowait=True)
        self.done(self.cd, "al-twice", kvferry.RECV_DONE, kvferry.KVF_ECANCELED)
        self.done(self.cd, "al-b1", kvferry.RECV_DONE, kvferry.KVF_ECANCELED)
        for xid in ("al-bad\n", "al-node", "al-nodesc", "al-none", "al-lay"):
            self.no_more_events(self.cp, xid)
        self.no_more_events(self.cd, "al-b3")


CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import kvferry
c = kvferry.Client(sys.argv[2])
p = c.pool_find("kv")
c.send("exit-1", "decode", [p.desc(0, 4096)], more=True, nowait=True)
c.send("exit-1", "decode", [p.desc(4096, 4096)], more=True, nowait=True)
sys.stdout.write("sent\n")
sys.stdout.flush()
import os
os._exit(0)  # no kvf_close: the process just goes
"""


class TestLifecycle(Base):
    def test_submit_and_exit(self):
        """A client that submits parts nowait and exits: its daemon cancels
        the send, the receiver gets its one RECV_DONE, nothing is left."""
        self.cd.grant("exit-1", "prefill", [self.pd.desc(i * BLK, BLK) for i in range(4)])
        out = kvftest.run([sys.executable, "-c", CHILD, os.path.join(kvftest.REPO, "client", "python"),
                           self.pre.sock], env=kvftest.python_env())
        self.assertEqual((out.returncode, out.stdout), (0, "sent\n"), out.stderr)
        ev = self.done(self.cd, "exit-1", kvferry.RECV_DONE, kvferry.KVF_EREMOTECANCEL)
        self.assertEqual(ev.peer, "prefill")
        kvftest.wait_for(lambda: not self.cp.inspect("transfers", json=True).get("transfers"), 10,
                         "prefill's transfers gone")

    def test_flood_is_slowed_and_bounded(self):
        """While its daemon reads nothing (stopped), a client's nowait
        sends fill the socket and then get -EAGAIN under KVF_NOBLOCK; once
        the daemon runs again every one of them lands. A flood of 20,000
        refused requests by a client that reads no events leaves the
        daemon's memory where it was, and each refusal comes once."""
        self.pre.signal(signal.SIGSTOP)
        n = 0
        try:
            while True:
                try:
                    self.cp.submit([dict(op="send", xfer_id="fl-%d" % n, node="decode",
                                         descs=[self.pp.desc(n * BLK, BLK)])], noblock=True)
                except kvferry.KvferryError as e:
                    self.assertEqual(e.code, -11, str(e))  # -EAGAIN, queued nothing
                    break
                n += 1
                self.assertLess(n, 4096, "the socket never filled")
        finally:
            self.pre.signal(signal.SIGCONT)
        self.assertGreater(n, 8)
        self.poison(self.pd, 0, n * BLK)
        self.fill(self.pp, 0, n * BLK)
        self.cd.submit([dict(op="grant", xfer_id="fl-%d" % i, node="prefill", descs=[self.pd.desc(i * BLK, BLK)])
                        for i in range(n)])
        for i in range(n):
            self.done(self.cd, "fl-%d" % i, kvferry.RECV_DONE)
            self.done(self.cp, "fl-%d" % i, kvferry.SEND_DONE)
        self.assert_bytes(self.pd, 0, bytes(self.pp.memory[0:n * BLK]))

        before = rss_kib(self.pre.proc.pid)
        total, batch = 20000, 500
        for b in range(0, total, batch):
            self.cp.submit([dict(op="send", xfer_id="ref-%d" % i, node="nowhere", descs=[self.pp.desc(0, BLK)])
                            for i in range(b, b + batch)])
        got = {}
        while len(got) < total:
            for ev in self.cp.wait_events(1024, 10000):
                self.assertEqual(ev.status, kvferry.KVF_ENOPEER)
                self.assertNotIn(ev.xfer_id, got)
                got[ev.xfer_id] = ev
        self.assertEqual(set(got), {"ref-%d" % i for i in range(total)})
        grown = rss_kib(self.pre.proc.pid) - before
        print("# %d sends filled the stopped daemon's socket; kvferryd RSS %+d KiB over %d refused requests"
              % (n, grown, total), file=sys.stderr)
        if not kvftest.daemon_sanitized():
            self.assertLess(grown, 16 * 1024, "kvferryd grew %d KiB over 20,000 requests" % grown)


if __name__ == "__main__":
    kvftest.main()
