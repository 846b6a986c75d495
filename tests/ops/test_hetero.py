#!/usr/bin/env python3
"""Heterogeneous KV layouts (issue 17), black box, over local (two clients
of one daemon) and tcp (two daemons): prefill and decode ranks with other
tensor parallelism (each rank's layout holds its range of the model's KV
heads), other order (NHD, HND) and other tokens per block (16 <-> 64), and
MLA. Every byte of every decode rank's pool slice is checked against a
reference transform computed here with plain index math from the
definitions (NHD: [block, token, head, dim], HND: [block, head, token,
dim]; the transfer's token t is block t // T slot t % T on each side), and
every byte around the granted blocks must still be the poison. Errors:
layouts that cannot be reconciled (layer counts, head dims, dtypes, no
head in common, a send that lacks some of its grant's heads) are refused
with KVF_ESIZE and a message naming the mismatch."""
import os
import random
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import wait_event

import kvferry

H = 8            # the model's KV heads (llama3-8b)
D = 8            # head dim
ES = 2           # dtype bytes
UNIT = D * ES    # one token of one head
L = 2            # layers
NB = 12          # blocks in each rank's layout
TOKENS = 128     # tokens a transfer moves
POISON = 0xA5
RANK_SLICE = 1 << 20


class Rank:
    """One engine rank's layout: per layer [n_kv][NB] blocks of tpb tokens
    of its heads, in order, from pool offset base."""

    def __init__(self, client, pool, base, tp, r, order, tpb, mla=False, n_layers=L, head_dim=D, dtype=ES):
        self.r, self.order, self.tpb, self.base = r, order, tpb, base
        self.n_kv = 1 if mla else 2
        self.heads, self.h0, model = (1, 0, 1) if mla else (H // tp, r * (H // tp), H)
        self.unit = head_dim * dtype
        self.bb = tpb * self.heads * self.unit
        self.offsets = [base + reg * NB * self.bb for reg in range(n_layers * self.n_kv)]
        self.size = n_layers * self.n_kv * NB * self.bb
        assert self.size <= RANK_SLICE
        self.id = client.register_layout(kvferry.Layout(
            pool, self.offsets, NB, self.bb, n_kv=self.n_kv, tokens_per_block=tpb, kv_heads=self.heads,
            head_dim=head_dim, dtype_bytes=dtype, order=order, first_head=self.h0, model_kv_heads=model))

    def addr(self, layer, kv, ids, t, h):
        """Pool offset of token t (of the transfer) of model head h."""
        block, slot, hh = ids[t // self.tpb], t % self.tpb, h - self.h0
        inner = slot * self.heads + hh if self.order == "NHD" else hh * self.tpb + slot
        return self.offsets[layer * self.n_kv + kv] + block * self.bb + inner * UNIT

    def holds(self, h):
        return self.h0 <= h < self.h0 + self.heads


class Hetero(kvftest.PairTestCase):
    POOL = "32M"

    def setUp(self):
        self.rng = random.Random(17)
        self.cp = kvferry.Client(self.pre.sock)

    def tearDown(self):
        self.cp.close()
        if getattr(self, "cd", None):
            self.cd.close()

    def decode_client(self, path):
        self.cd = kvferry.Client((self.dec if path == "tcp" else self.pre).sock)
        return self.cd

    def handoff(self, path, ptp, dtp, porder, dorder, pts, dts, mla=False):
        """Every decode rank of TP dtp receives its heads from the prefill
        rank of TP ptp that holds them (MLA: any one), by one send each;
        then every byte of every decode rank is checked."""
        tag = "%s-%d-%d-%s-%s-%d-%d-%s" % (path, ptp, dtp, porder, dorder, pts, dts, mla)
        cd = self.decode_client(path)
        pp, pd = self.cp.pool_find("kv"), cd.pool_find("kv")
        pre = [Rank(self.cp, pp, i * RANK_SLICE, ptp, i, porder, pts, mla) for i in range(ptp)]
        dbase = 8 * RANK_SLICE  # local: one pool for both sides
        dec = [Rank(cd, pd, dbase + i * RANK_SLICE, dtp, i, dorder, dts, mla) for i in range(dtp)]
        nd, ns = TOKENS // dts, -(-TOKENS // pts)
        sids = [self.rng.sample(range(NB), ns) for _ in pre]
        dids = [self.rng.sample(range(NB), nd) for _ in dec]
        src = pp.memory
        for p in pre:
            src[p.base:p.base + p.size] = os.urandom(p.size)
        dmem = pd.memory
        span = dtp * RANK_SLICE
        dmem[dbase:dbase + span] = bytes([POISON]) * span
        want = bytearray([POISON]) * span
        owner = {}
        for d in dec:
            p = pre[d.r % ptp] if mla else next(p for p in pre if p.holds(d.h0))
            owner[d.r] = p
            for layer in range(L):
                for kv in range(d.n_kv):
                    for t in range(TOKENS):
                        for h in range(d.h0, d.h0 + d.heads):
                            s, o = p.addr(layer, kv, sids[p.r], t, h), d.addr(layer, kv, dids[d.r], t, h) - dbase
                            want[o:o + UNIT] = src[s:s + UNIT]
        src_node = "prefill" if path == "tcp" else None
        dst_node = "decode" if path == "tcp" else "prefill"
        for d in dec:
            cd.grant_blocks("%s-%d" % (tag, d.r), src_node, d.id, dids[d.r])
        for d in dec:
            p = owner[d.r]
            self.cp.send_blocks("%s-%d" % (tag, d.r), dst_node, p.id, sids[p.r])
        for d in dec:
            xid = "%s-%d" % (tag, d.r)
            ev = wait_event(cd, xid, type=kvferry.RECV_DONE)
            self.assertEqual((ev.status, ev.error, ev.path), (0, "", path), xid)
            self.assertEqual(ev.bytes, nd * L * d.n_kv * d.bb, xid)
            sev = wait_event(self.cp, xid, type=kvferry.SEND_DONE)
            self.assertEqual((sev.status, sev.bytes), (0, ev.bytes), xid)
        got = bytes(dmem[dbase:dbase + span])
        if got != want:
            i = next(i for i in range(span) if got[i] != want[i])
            self.fail("%s: decode rank %d byte %d is 0x%02x, expected 0x%02x" % (
                tag, i // RANK_SLICE, i % RANK_SLICE, got[i], want[i]))
        cd.close()
        self.cd = None
        for p in pre:
            self.cp.free_layout(p.id)

    def every_combination(self, path):
        for porder in ("NHD", "HND"):
            for dorder in ("NHD", "HND"):
                for pts, dts in ((16, 16), (16, 64), (64, 16)):
                    for ptp, dtp in ((1, 1), (4, 8), (2, 8), (1, 4)):
                        with self.subTest(ptp=ptp, dtp=dtp, porder=porder, dorder=dorder, pts=pts, dts=dts):
                            self.handoff(path, ptp, dtp, porder, dorder, pts, dts)
                    with self.subTest(mla=True, porder=porder, dorder=dorder, pts=pts, dts=dts):
                        self.handoff(path, 2, 4, porder, dorder, pts, dts, mla=True)

    def test_local(self):
        self.every_combination("local")

    def test_tcp(self):
        self.every_combination("tcp")

    def refused(self, path, tag, grant_rank, send_rank, what):
        """The grant of grant_rank and the send of send_rank cannot pair:
        KVF_ESIZE with what in the message, from the call or the events."""
        cd = self.decode_client(path)
        xid = "%s-%s" % (path, tag)
        cd.grant_blocks(xid, "prefill" if path == "tcp" else None, grant_rank(cd).id, list(range(TOKENS // 16)))
        try:
            self.cp.send_blocks(xid, "decode" if path == "tcp" else "prefill", send_rank(self.cp).id,
                                list(range(TOKENS // 16)))
        except kvferry.KvferryError as e:
            self.assertEqual(e.name, "KVF_ESIZE")
            self.assertIn(what, str(e))
            cd.cancel(xid)
            return
        sev = wait_event(self.cp, xid, type=kvferry.SEND_DONE)
        self.assertEqual(sev.error_name, "KVF_ESIZE", sev.error)
        self.assertIn(what, sev.error)
        rev = wait_event(cd, xid, type=kvferry.RECV_DONE)
        self.assertIn(rev.error_name, ("KVF_ESIZE", "KVF_EREMOTECANCEL"))
        self.assertIn(what, rev.error)
        cd.close()
        self.cd = None

    def test_refusals(self):
        for path in ("local", "tcp"):
            pp = self.cp.pool_find("kv")
            base = 8 * RANK_SLICE
            rank = lambda c, **kw: Rank(c, c.pool_find("kv"), base, 1, 0, "NHD", 16, **kw)  # noqa: E731
            pre = lambda **kw: (lambda c: Rank(c, pp, 0, 1, 0, "NHD", 16, **kw))  # noqa: E731
            self.refused(path, "layers", rank, pre(n_layers=1), "layer counts")
            self.refused(path, "head-dim", rank, pre(head_dim=16, dtype=1), "head dims differ (16 and 8)")
            self.refused(path, "dtype2", rank, lambda c: Rank(c, pp, 0, 1, 0, "NHD", 16, head_dim=D, dtype=4),
                         "dtypes differ (4 and 2 bytes)")
            self.refused(path, "no-common-head", lambda c: Rank(c, c.pool_find("kv"), base, 4, 1, "HND", 16),
                         lambda c: Rank(c, pp, 0, 4, 2, "NHD", 16), "no KV head in common")
            # TP 8 -> TP 4 with one source: the grant's head 1 would be missing
            self.refused(path, "missing-heads", lambda c: Rank(c, c.pool_find("kv"), base, 4, 0, "NHD", 16),
                         lambda c: Rank(c, pp, 0, 8, 0, "NHD", 16), "heads 1-1 would be missing")


if __name__ == "__main__":
    unittest.main()
