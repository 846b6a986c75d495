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

    def __init__(self, client, pool, base, tp, r, order, tpb, mla=False, n_layers=L, head_dim=D, dtype=ES,
                 model=H):
        self.r, self.order, self.tpb, self.base = r, order, tpb, base
        self.n_kv = 1 if mla else 2
        self.heads, self.h0 = (1, 0) if mla else (H // tp, r * (H // tp))
        model = 1 if mla else model  # 0: heads not stated
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
        return self.offsets[layer * self.n_kv + kv] + block * self.bb + inner * self.unit

    def holds(self, h):
        return self.h0 <= h < self.h0 + self.heads


class Base:
    """The cases; the classes below pick the daemons and paths."""

    def setUp(self):
        self.rng = random.Random(17)
        self.clients = []
        self.cp = self.client(self.pre)

    def tearDown(self):
        for c in self.clients:
            c.close()

    def client(self, daemon):
        c = kvferry.Client(daemon.sock)
        self.clients.append(c)
        return c

    def handoff(self, path, ptp, dtp, porder, dorder, pts, dts, mla=False, head_dim=D, model=H):
        """Every rank of prefill TP ptp and decode TP dtp is a client with
        its own layout. KV heads: one transfer id for the request, each
        decode rank grants it, each prefill rank sends it (fan-in and
        fan-out: the daemons move each head from the rank that holds it).
        MLA: decode rank r takes the latent from prefill rank r % ptp (any
        one source), one id each. Then every byte of every decode rank is
        checked. head_dim: the pieces' size (head_dim * 2 bytes); model 0:
        the layouts do not say which of the model's heads they hold (TP 1
        only: no fan, the heads move together)."""
        tag = "%s-%d-%d-%s-%s-%d-%d-%s-%d-%d" % (path, ptp, dtp, porder, dorder, pts, dts, mla, head_dim, model)
        ddaemon = self.dec if path != "local" else self.pre
        cps = [self.client(self.pre) for _ in range(ptp)]
        cds = [self.client(ddaemon) for _ in range(dtp)]
        pp, pd = cps[0].pool_find("kv"), cds[0].pool_find("kv")
        pre = [Rank(cps[i], pp, i * RANK_SLICE, ptp, i, porder, pts, mla, head_dim=head_dim, model=model)
               for i in range(ptp)]
        dbase = 8 * RANK_SLICE  # local: one pool for both sides
        dec = [Rank(cds[i], pd, dbase + i * RANK_SLICE, dtp, i, dorder, dts, mla, head_dim=head_dim, model=model)
               for i in range(dtp)]
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
        for d in dec:
            for layer in range(L):
                for kv in range(d.n_kv):
                    for h in range(d.h0, d.h0 + d.heads):
                        p = pre[d.r % ptp] if mla else next(p for p in pre if p.holds(h))
                        for t in range(TOKENS):
                            s, o = p.addr(layer, kv, sids[p.r], t, h), d.addr(layer, kv, dids[d.r], t, h) - dbase
                            want[o:o + d.unit] = src[s:s + p.unit]
        src_node = "prefill" if path != "local" else None
        dst_node = "decode" if path != "local" else "prefill"
        xid = lambda d: "%s-%d" % (tag, d.r) if mla else tag  # noqa: E731
        for d in dec:
            cds[d.r].grant_blocks(xid(d), src_node, d.id, dids[d.r])
        sends = [(pre[d.r % ptp], xid(d)) for d in dec] if mla else [(p, tag) for p in pre]
        for p, x in sends:
            cps[p.r].send_blocks(x, dst_node, p.id, sids[p.r])
        self.events = {}  # the completions, for the tests of what they say
        for d in dec:
            ev = self.events["recv", d.r] = wait_event(cds[d.r], xid(d), type=kvferry.RECV_DONE)
            self.assertEqual((ev.status, ev.error, ev.path), (0, "", path), xid(d))
            self.assertEqual(ev.bytes, nd * L * d.n_kv * d.bb, xid(d))
        for p, x in sends:
            sev = self.events["send", p.r] = wait_event(cps[p.r], x, type=kvferry.SEND_DONE)
            self.assertEqual((sev.status, sev.error), (0, ""), x)
            self.assertEqual(sev.bytes, TOKENS * p.heads * p.unit * L * p.n_kv, x)
        got = bytes(dmem[dbase:dbase + span])
        if got != want:
            i = next(i for i in range(span) if got[i] != want[i])
            self.fail("%s: decode rank %d byte %d is 0x%02x, expected 0x%02x" % (
                tag, i // RANK_SLICE, i % RANK_SLICE, got[i], want[i]))
        for c in cps + cds:
            c.close()
            self.clients.remove(c)

    def every_combination(self, path, tps=((1, 1), (8, 4), (4, 8), (2, 8), (8, 1), (1, 4)),
                          tokens=((16, 16), (16, 64), (64, 16))):
        for porder in ("NHD", "HND"):
            for dorder in ("NHD", "HND"):
                for pts, dts in tokens:
                    for ptp, dtp in tps:
                        with self.subTest(ptp=ptp, dtp=dtp, porder=porder, dorder=dorder, pts=pts, dts=dts):
                            self.handoff(path, ptp, dtp, porder, dorder, pts, dts)
                    with self.subTest(mla=True, porder=porder, dorder=dorder, pts=pts, dts=dts):
                        self.handoff(path, 2, 4, porder, dorder, pts, dts, mla=True)

    def test_fan_in_layer_by_layer(self):
        """TP 8 -> TP 4 sent layer by layer with layer events: one
        LAYER_DONE per layer, in order, once both heads have it, then
        RECV_DONE; every byte of the granted blocks checked."""
        for path in self.PATHS:
            cd = self.client(self.dec if path != "local" else self.pre)
            cps = [self.client(self.pre) for _ in range(2)]
            d = Rank(cd, cd.pool_find("kv"), 8 * RANK_SLICE, 4, 0, "HND", 64)
            ps = [Rank(cps[i], cps[i].pool_find("kv"), i * RANK_SLICE, 8, i, "NHD", 16) for i in range(2)]
            src = cps[0].pool_find("kv").memory
            for p in ps:
                src[p.base:p.base + p.size] = os.urandom(p.size)
            dids, sids = [5, 2], [list(range(8)), list(range(11, 3, -1))]
            xid = "%s-layers" % path
            cd.grant_blocks(xid, "prefill" if path != "local" else None, d.id, dids, layer_events=True)
            for layer in range(L):
                for i, p in enumerate(ps):
                    cps[i].send_blocks(xid, "decode" if path != "local" else "prefill", p.id,
                                       sids[i] if layer == 0 else None, first_layer=layer, n_layers=1,
                                       more=layer < L - 1)
            layers = []
            while True:
                ev = wait_event(cd, xid)
                if ev.type != kvferry.LAYER_DONE:
                    break
                layers.append(ev.layer)
            self.assertEqual((ev.type, ev.status, ev.error), (kvferry.RECV_DONE, 0, ""))
            self.assertEqual(layers, list(range(L)))
            got = cd.pool_find("kv").memory
            for layer in range(L):
                for kv in range(2):
                    for t in range(TOKENS):
                        for h in range(2):
                            p = ps[h]
                            s, o = p.addr(layer, kv, sids[h], t, h), d.addr(layer, kv, dids, t, h)
                            self.assertEqual(bytes(got[o:o + UNIT]), bytes(src[s:s + UNIT]), (layer, kv, t, h))
            for i in range(2):
                self.assertEqual(wait_event(cps[i], xid, type=kvferry.SEND_DONE).status, 0)

    def pair_clients(self, path):
        return self.client(self.pre), self.client(self.dec if path != "local" else self.pre)

    def refused(self, path, tag, grant_rank, send_rank, what, model=H):
        """The grant of grant_rank and the send of send_rank cannot pair:
        KVF_ESIZE with what in the message, from the call or the events
        (a fan over KV heads: every head's)."""
        cp, cd = self.pair_clients(path)
        xid = "%s-%s-%d" % (path, tag, model)
        base = 8 * RANK_SLICE
        g = grant_rank(cd, cd.pool_find("kv"), base, model)
        cd.grant_blocks(xid, "prefill" if path != "local" else None, g.id, list(range(TOKENS // 16)))
        p = send_rank(cp, cp.pool_find("kv"), 0, model)
        try:
            cp.send_blocks(xid, "decode" if path != "local" else "prefill", p.id, list(range(TOKENS // 16)))
        except kvferry.KvferryError as e:
            self.assertEqual(e.name, "KVF_ESIZE")
            self.assertIn(what, str(e))
            cd.cancel(xid)
            return
        sev = wait_event(cp, xid, type=kvferry.SEND_DONE)
        self.assertEqual(sev.error_name, "KVF_ESIZE", sev.error)
        self.assertIn(what, sev.error)
        rev = wait_event(cd, xid, type=kvferry.RECV_DONE)
        self.assertIn(rev.error_name, ("KVF_ESIZE", "KVF_EREMOTECANCEL"))
        self.assertIn(what, rev.error)
        if model:  # a fan: the event names the heads
            self.assertTrue(sev.error.startswith("heads 0-7 not sent: "), sev.error)
            self.assertTrue(rev.error.startswith("heads 0-7 missing: "), rev.error)

    def test_refusals(self):
        one = lambda **kw: (lambda c, pool, base, model: Rank(c, pool, base, 1, 0, "NHD", 16, model=model,  # noqa
                                                              **kw))
        for path in self.PATHS:
            for model in (0, H):  # heads not stated (one to one), stated (a fan of 8 heads)
                self.refused(path, "layers", one(), one(n_layers=1), "layer counts", model)
                self.refused(path, "head-dim", one(), one(head_dim=16, dtype=1), "head dims differ (16 and 8)", model)
                self.refused(path, "dtype", one(), one(dtype=4), "dtypes differ (4 and 2 bytes)", model)

    def test_missing_heads_at_deadline(self):
        """TP 8 -> TP 4 where prefill rank 1 never sends: decode rank 0's
        grant fails at its deadline naming head 1; rank 0's head lands and
        its send succeeds. A send whose heads no grant takes fails at its
        deadline naming them."""
        for path in self.PATHS:
            cp, cd = self.pair_clients(path)
            d = Rank(cd, cd.pool_find("kv"), 8 * RANK_SLICE, 4, 0, "HND", 16)
            p = Rank(cp, cp.pool_find("kv"), 0, 8, 0, "NHD", 16)
            xid = "%s-missing" % path
            cd.grant_blocks(xid, "prefill" if path != "local" else None, d.id, list(range(8)), deadline_ms=1500)
            cp.send_blocks(xid, "decode" if path != "local" else "prefill", p.id, list(range(8)), deadline_ms=1500)
            self.assertEqual(wait_event(cp, xid, type=kvferry.SEND_DONE).status, 0)
            rev = wait_event(cd, xid, type=kvferry.RECV_DONE)
            self.assertEqual(rev.error_name, "KVF_EDEADLINE", rev.error)
            self.assertTrue(rev.error.startswith("heads 1 missing: "), rev.error)
            self.assertEqual(rev.bytes, TOKENS * UNIT * L * 2)  # head 0 landed
            # a send of heads 4-5 into a grant of heads 2-3: nothing in common
            cp, cd = self.pair_clients(path)
            d = Rank(cd, cd.pool_find("kv"), 8 * RANK_SLICE, 4, 1, "HND", 16)
            p = Rank(cp, cp.pool_find("kv"), 0, 4, 2, "NHD", 16)
            xid = "%s-disjoint" % path
            cd.grant_blocks(xid, "prefill" if path != "local" else None, d.id, list(range(8)), deadline_ms=1000)
            cp.send_blocks(xid, "decode" if path != "local" else "prefill", p.id, list(range(8)), deadline_ms=1000)
            sev = wait_event(cp, xid, type=kvferry.SEND_DONE)
            self.assertTrue(sev.error.startswith("heads 4-5 not sent: "), sev.error)
            rev = wait_event(cd, xid, type=kvferry.RECV_DONE)
            self.assertTrue(rev.error.startswith("heads 2-3 missing: "), rev.error)


class Hetero(Base, kvftest.PairTestCase):
    """local (two clients of one daemon) and tcp."""
    POOL = "32M"
    PATHS = ("local", "tcp")

    def test_local(self):
        self.every_combination("local")

    def test_tcp(self):
        self.every_combination("tcp")

    def test_tcp_patterns(self):
        """Over tcp a transform goes in pattern batches: one entry for a
        chunk (16 tokens of one head here: the layouts state their model's
        heads, so each head is a sub-transfer), not one per 256-byte piece.
        TP 8 -> 4 NHD: the decode rank's two heads interleave, so a chunk
        lands as 16 pieces (the receiver places each); NHD -> HND: a head's
        tokens sit together at the decode rank, so it lands as one piece
        (the sender gathers it)."""
        def tcp(daemon):
            c = self.client(daemon)
            st = c.inspect("status", json=True)["tcp"]
            c.close()
            self.clients.remove(c)
            return st
        units = TOKENS * L * 2 * 8  # a token's head in a layer's K or V: 256 bytes
        for ptp, dtp, dorder, pieces in ((8, 4, "NHD", units), (1, 1, "HND", units // 16)):
            p0, d0 = tcp(self.pre), tcp(self.dec)
            self.handoff("tcp", ptp, dtp, "NHD", dorder, 16, 16)
            p1, d1 = tcp(self.pre), tcp(self.dec)
            self.assertEqual(p1["patterns_sent"] - p0["patterns_sent"], units // 16, (p0, p1))
            self.assertEqual(d1["pattern_pieces_read"] - d0["pattern_pieces_read"], pieces, (d0, d1))
            self.assertGreater(d1["pattern_batches_read"], d0["pattern_batches_read"])

    def test_tcp_whole_lines(self):
        """llama3's pieces: head_dim 128 of fp16, 256 bytes, whole cache
        lines that the receiver streams from its bounce buffer into place
        (TP 8 -> 4 NHD interleaves two senders' heads, so every piece is
        bounced); every byte checked as in every other handoff."""
        for pts in (16, 64):
            with self.subTest(pts=pts):
                self.handoff("tcp", 8, 4, "NHD", "NHD", pts, 16, head_dim=128)
        self.handoff("tcp", 8, 4, "NHD", "HND", 16, 16, head_dim=128)

    def test_transform_listed(self):
        """kvferryctl transfers (the inspect API) says what a send of blocks
        does once it knows its grant: the heads, orders and block sizes."""
        cp, cd = self.pair_clients("tcp")
        d = Rank(cd, cd.pool_find("kv"), 8 * RANK_SLICE, 1, 0, "HND", 64, model=0)
        p = Rank(cp, cp.pool_find("kv"), 0, 1, 0, "NHD", 16, model=0)
        cd.grant_blocks("listed", "prefill", d.id, [0, 1])
        cp.send_blocks("listed", "decode", p.id, list(range(8)), first_layer=0, n_layers=1, more=True)
        rows = [t for t in cp.inspect("transfers", json=True)["transfers"] if t["id"] == "listed"]
        self.assertEqual(len(rows), 1, rows)
        self.assertEqual(rows[0].get("transform"), "heads 0-7, NHD 16/8h -> HND 64/8h")
        cp.send_blocks("listed", "decode", p.id, None, first_layer=1, n_layers=1)
        self.assertEqual(wait_event(cd, "listed", type=kvferry.RECV_DONE).status, 0)
        self.assertEqual(wait_event(cp, "listed", type=kvferry.SEND_DONE).status, 0)

    def test_events_say_transform(self):
        """RECV_DONE and SEND_DONE say what the transfer did (Event.transform):
        a fan's over its heads, a one-to-one transform, whole blocks; over
        tcp the receiver has it from its sender's SendDone."""
        for path in self.PATHS:
            self.handoff(path, 8, 4, "NHD", "HND", 16, 64)
            ev = self.events
            self.assertEqual(ev["recv", 1].transform, "heads 2-3, NHD 16/1h -> HND 64/2h", path)
            self.assertEqual(ev["send", 5].transform, "heads 5-5, NHD 16/1h -> HND 64/2h", path)
            self.handoff(path, 2, 2, "NHD", "HND", 16, 16)
            self.assertEqual(self.events["recv", 0].transform, "heads 0-3, NHD 16/4h -> HND 16/4h", path)
            self.assertEqual(self.events["send", 1].transform, "heads 4-7, NHD 16/4h -> HND 16/4h", path)
            self.handoff(path, 4, 4, "HND", "HND", 16, 16)  # a fan still: each head on its own
            self.assertEqual(self.events["recv", 3].transform, "heads 6-7, HND 16/2h -> HND 16/2h", path)
            self.handoff(path, 2, 4, "NHD", "NHD", 64, 16, mla=True)
            self.assertEqual(self.events["recv", 2].transform, "heads 0-0, NHD 64/1h -> NHD 16/1h", path)
            self.handoff(path, 2, 4, "NHD", "NHD", 16, 16, mla=True)
            self.assertEqual((self.events["recv", 3].transform, self.events["send", 1].transform),
                             ("whole blocks", "whole blocks"), path)

    def test_bench(self):
        """kvferry-bench --blocks with heterogeneous layouts: every rank a
        client, every byte of every decode rank verified, the JSON line;
        with --nowait every rank's grant and send is queued."""
        import json
        import subprocess
        bench = os.path.join(kvftest.BUILD, "kvferry-bench")
        cases = [(self.dec, "tcp", "--tokens 256 --prefill-tp 8 --decode-tp 4 --prefill-order hnd "
                                   "--decode-block-tokens 64", []),
                 (self.pre, "local", "--tokens 32 --prefill-tp 2 --decode-tp 8 --decode-order hnd", []),
                 (self.dec, "tcp", "--tokens 256 --prefill-tp 2 --decode-tp 2 --prefill-block-tokens 64", []),
                 (self.dec, "tcp", "--tokens 64 --prefill-tp 8 --decode-tp 4 --decode-order hnd", ["--nowait"]),
                 (self.pre, "local", "--tokens 64 --prefill-tp 1 --decode-tp 1", ["--nowait"])]
        for to, path, args, flags in cases:
            out = subprocess.run([bench, "--from", self.pre.sock, "--to", to.sock, "--blocks", "--json",
                                  "--requests", "2"] + args.split() + flags, capture_output=True, text=True,
                                 timeout=300)
            self.assertEqual(out.returncode, 0, out.stderr)
            d = json.loads(out.stdout)
            self.assertEqual((d["path"], d["verified"], d["requests"], d["api"]), (path, True, 2, "blocks"), d)
            self.assertEqual(d.get("nowait", False), "--nowait" in flags, d)
            tp = dict(zip(args.split()[::2], args.split()[1::2]))
            self.assertEqual((d["prefill_tp"], d["decode_tp"]), (int(tp["--prefill-tp"]), int(tp["--decode-tp"])))
            self.assertEqual(d["fan"], tp["--prefill-tp"] != tp["--decode-tp"])
            self.assertEqual(d["bytes"], 2 * int(tp["--tokens"]) * 8 * 256 * 32 * 2)


IPS = os.environ.get("KVF_TEST_RDMA_IPS", "").split()


class FanOutNodes(unittest.TestCase):
    """Fan-out over nodes: one prefill rank (TP 1, all 8 heads) sends once
    with dst_node "A,B", and decode TP 4 runs on two daemons, ranks 0-1
    (heads 0-3) on A and ranks 2-3 (heads 4-7) on B: A takes the first
    half of the heads, B the second. The node names are 55 bytes, so the
    list (111) is longer than one node name: it was refused at 63 bytes.
    Every byte of every decode rank against the reference."""

    setUp, tearDown, client = Base.setUp, Base.tearDown, Base.client

    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        cls.pre = kvftest.Daemon(cls.dir, "prefill", "32M")
        cls.decs = [kvftest.Daemon(cls.dir, "decode-" + c * 48, "32M") for c in "ab"]
        for d in cls.decs:
            cls.pre.add_peer(d)
            d.add_peer(cls.pre)
        for d in [cls.pre] + cls.decs:
            d.start()
        for d in [cls.pre] + cls.decs:
            d.wait_peers_up()

    @classmethod
    def tearDownClass(cls):
        for d in [cls.pre] + cls.decs:
            assert d.stop() == 0

    def test_one_send_to_two_nodes(self):
        cp = self.client(self.pre)
        pp = cp.pool_find("kv")
        p = Rank(cp, pp, 0, 1, 0, "NHD", 16)
        cds = [self.client(self.decs[r // 2]) for r in range(4)]
        dec = [Rank(cds[r], cds[r].pool_find("kv"), (r % 2) * RANK_SLICE, 4, r, "HND", 16) for r in range(4)]
        sids = self.rng.sample(range(NB), TOKENS // 16)
        dids = [self.rng.sample(range(NB), TOKENS // 16) for _ in dec]
        src = pp.memory
        src[0:p.size] = os.urandom(p.size)
        for r, d in enumerate(dec):
            cds[r].pool_find("kv").memory[d.base:d.base + RANK_SLICE] = bytes([POISON]) * RANK_SLICE
        for r, d in enumerate(dec):
            cds[r].grant_blocks("fan-nodes", "prefill", d.id, dids[r])
        nodes = ",".join(d.name for d in self.decs)
        self.assertGreater(len(nodes), 63)
        cp.send_blocks("fan-nodes", nodes, p.id, sids)
        for r, d in enumerate(dec):
            ev = wait_event(cds[r], "fan-nodes", type=kvferry.RECV_DONE)
            self.assertEqual((ev.status, ev.error), (0, ""), r)
        sev = wait_event(cp, "fan-nodes", type=kvferry.SEND_DONE)
        self.assertEqual((sev.status, sev.error), (0, ""))
        for r, d in enumerate(dec):
            mem = cds[r].pool_find("kv").memory
            want = bytearray(mem[d.base:d.base + RANK_SLICE])  # what the transfer does not touch stays
            for layer in range(L):
                for kv in range(d.n_kv):
                    for h in range(d.h0, d.h0 + d.heads):
                        for t in range(TOKENS):
                            s, o = p.addr(layer, kv, sids, t, h), d.addr(layer, kv, dids[r], t, h) - d.base
                            want[o:o + d.unit] = src[s:s + p.unit]
            for i in range(d.size):  # the layout's bytes: written or still poison where no token goes
                if mem[d.base + i] != want[i]:
                    self.fail("decode rank %d byte %d is 0x%02x, expected 0x%02x" % (r, i, mem[d.base + i], want[i]))

    def test_node_lists_refused(self):
        cp = self.client(self.pre)
        p = Rank(cp, cp.pool_find("kv"), 0, 1, 0, "NHD", 16)
        for nodes in (",".join(["n%d" % i for i in range(17)]), "a" * 64, "a,,b", "a,", ""):
            with self.subTest(nodes=nodes[:20]):
                with self.assertRaises(kvferry.KvferryError) as e:
                    cp.send_blocks("bad-nodes", nodes, p.id, [0])
                self.assertEqual(e.exception.name, "KVF_EINVAL")


@unittest.skipUnless(len(IPS) == 2, "KVF_TEST_RDMA_IPS not set (run in the VM: tests/rdma/run.sh)")
class HeteroRdma(Base, unittest.TestCase):
    """rdma in the soft-RoCE VM, fewer combinations (the VM is slow). Every
    transform here has small runs (a head is 16 bytes): each goes through
    the receiver's staging (rdma_stage.c) and its transform pass, which the
    daemons' counters must show. A staging arena of 256 KiB holds every
    grant of those, not the one of test_staging_no_room."""
    PATHS = ("rdma",)
    STAGING = 256 << 10

    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        cls.pre, cls.dec = kvftest.pair(cls.dir, "32M", extra="transports rdma\nrdma-staging-size 256K\n", extra_of={
            "prefill": "rdma-listen %s:0" % IPS[0], "decode": "rdma-listen %s:0" % IPS[1]})

    def staging(self, daemon):
        """The rdma transport's staging counters (status JSON)."""
        return self.client(daemon).inspect("status", json=True)["rdma"]["staging"]

    @classmethod
    def tearDownClass(cls):
        for d in (cls.pre, cls.dec):
            assert d.stop() == 0

    def test_rdma(self):
        before_s, before_r = self.staging(self.pre), self.staging(self.dec)
        self.every_combination("rdma", tps=((8, 4), (2, 8)), tokens=((16, 64), (64, 16)))
        s, r = self.staging(self.pre), self.staging(self.dec)
        # 4 orders x 2 token pairs x (TP 8->4: 8 heads, 2->8: 8 heads, MLA 2->4: 4 grants) x 2 layers' part
        parts = 4 * 2 * (8 + 8 + 4)
        self.assertEqual(s["staged_parts"] - before_s["staged_parts"], parts, s)
        # each part in two chunks of one layer, each noted, and transformed, on its own
        self.assertEqual(s["chunks"] - before_s["chunks"], 2 * parts, s)
        self.assertEqual(r["passes"] - before_r["passes"], 2 * parts, r)
        self.assertEqual(r["grants"] - before_r["grants"], parts, r)
        self.assertEqual((r["no_room"], r["slices"], r["bytes"]), (before_r["no_room"], 0, self.STAGING), r)

    def test_events_say_staged(self):
        """Over rdma the events also say how the transform was placed."""
        self.handoff("rdma", 8, 4, "NHD", "HND", 16, 64)
        self.assertEqual(self.events["recv", 1].transform, "heads 2-3, NHD 16/1h -> HND 64/2h, staged")
        self.assertEqual(self.events["send", 5].transform, "heads 5-5, NHD 16/1h -> HND 64/2h, staged")
        self.handoff("rdma", 2, 4, "NHD", "NHD", 16, 16, mla=True)
        self.assertEqual(self.events["recv", 3].transform, "whole blocks")

    def test_staged_writes_gather(self):
        """A staged part's rows land back to back in the receiver's slice
        while their sources are scattered blocks (a prefill rank's block
        of its one head): the sender gathers many rows into each RDMA
        WRITE, one scatter/gather entry a row (rdma_post.c), so it posts
        far fewer work requests than runs (one a run before)."""
        post = lambda: self.client(self.pre).inspect("status", json=True)["rdma"]["post"]  # noqa: E731
        before = post()
        self.handoff("rdma", 8, 4, "NHD", "HND", 16, 16)
        after = post()
        runs, wrs = after["runs"] - before["runs"], after["work_requests"] - before["work_requests"]
        self.assertEqual(self.events["send", 3].transform, "heads 3-3, NHD 16/1h -> HND 16/2h, staged")
        # 8 ranks x 2 layers x K, V x 8 blocks of 256 bytes (fewer where two
        # source blocks happen to adjoin: one run then); each part goes in
        # two chunks of one layer, whose K and V rows are back to back in the
        # slice: one request a chunk, and the tail, so 3 a rank
        self.assertGreater(runs, 8 * 2 * 2 * 8 // 2, after)
        self.assertLessEqual(wrs, 8 * 3, after)

    def test_staged_writes_spread_over_qps(self):
        """A staging slice gets a memory window per QP the peer dialed (two
        here, rdma-qps-per-peer's default): a type 2 window takes writes
        only through its QP, and over one window every staged write went
        through one QP (one rxe pipeline: half the VM's CPUs idle). One
        grant, one send (grants of several ranks had their slices on
        different QPs already); each chunk here is a layer, and the two
        layers sit in two windows: the prefill daemon's two QPs each carry
        a fair share of the bytes."""
        def sent():
            peers = self.client(self.pre).inspect("status", json=True)["rdma"]["peers"]
            return {q["qp"]: q["bytes"] for p in peers for q in p["qps"] if q["dir"] == "out"}
        before = sent()
        self.handoff("rdma", 1, 1, "NHD", "HND", 16, 16)
        after = sent()
        self.assertEqual(self.events["send", 0].transform, "heads 0-7, NHD 16/8h -> HND 16/8h, staged")
        moved = sorted((after[q] - before.get(q, 0) for q in after), reverse=True)
        self.assertGreaterEqual(len(moved), 2, after)
        self.assertGreater(moved[1], 0.3 * sum(moved), (before, after))

    def test_head_slices_written_directly(self):
        """NHD into HND with heads of 128 bytes, the layouts not saying
        which of the model's heads they hold (no fan: the heads move
        together), a grant larger than the receiver's staging arena: a
        decode head slice (16 tokens, 2 KiB) is contiguous, its tokens a
        row apart in the prefill block, and the next head's slice follows
        it. The sender writes the slices directly, one strided run each
        (one scatter/gather entry a token), two a gathered request: no
        staging, no transform pass on the receiver (both counters still),
        half as many requests as runs; the events say so. Every byte
        checked."""
        post = lambda: self.client(self.pre).inspect("status", json=True)["rdma"]["post"]  # noqa: E731
        s0, r0, p0 = self.staging(self.pre), self.staging(self.dec), post()
        self.handoff("rdma", 1, 1, "NHD", "HND", 16, 16, head_dim=64, model=0)
        self.assertGreater(L * 2 * (TOKENS // 16) * 16 * H * 128, self.STAGING)
        said = "heads 0-7, NHD 16/8h -> HND 16/8h, direct, gathered (the receiver lent no staging)"
        self.assertEqual((self.events["send", 0].transform, self.events["recv", 0].transform), (said, said))
        s1, r1, p1 = self.staging(self.pre), self.staging(self.dec), post()
        self.assertGreaterEqual(s1["strided_parts"] - s0["strided_parts"], 1, s1)  # the sender posts in parts
        self.assertEqual((s1["staged_parts"], r1["passes"]), (s0["staged_parts"], r0["passes"]), (s1, r1))
        self.assertEqual(r1["no_room"] - r0["no_room"], 1, r1)
        # 2 layers x K, V x 8 blocks x 8 heads: 256 head slices; 32 entries
        # a request (rxe): two slices each, and the tail alone
        runs, wrs = p1["runs"] - p0["runs"], p1["work_requests"] - p0["work_requests"]
        self.assertEqual(runs, 256, p1)
        self.assertLessEqual(wrs, 256 // 2 + 8, p1)

    def test_staging_no_room(self):
        """A grant larger than the receiver's staging arena: it goes without
        a slice (the log says so, no_room counts it) and the sender writes
        its transform directly, run by run; every byte lands."""
        cp, cd = self.pair_clients("rdma")
        pp, pd = cp.pool_find("kv"), cd.pool_find("kv")
        p = Rank(cp, pp, 0, 1, 0, "NHD", 64, model=0)
        d = Rank(cd, pd, 8 * RANK_SLICE, 1, 0, "HND", 64, model=0)
        n = NB  # 12 blocks of 64 tokens of 8 heads, 2 layers, K and V: 384 KiB > 256 KiB
        self.assertGreater(n * L * 2 * d.bb, self.STAGING)
        sids, dids = self.rng.sample(range(NB), n), self.rng.sample(range(NB), n)
        pp.memory[0:p.size] = os.urandom(p.size)
        pd.memory[d.base:d.base + d.size] = bytes([POISON]) * d.size
        before = self.staging(self.dec)
        cd.grant_blocks("no-room", "prefill", d.id, dids)
        cp.send_blocks("no-room", "decode", p.id, sids)
        ev = wait_event(cd, "no-room", type=kvferry.RECV_DONE, timeout=60)
        self.assertEqual((ev.status, ev.error, ev.path), (0, "", "rdma"))
        sev = wait_event(cp, "no-room", type=kvferry.SEND_DONE, timeout=60)
        self.assertEqual(sev.status, 0)
        said = "heads 0-7, NHD 64/8h -> HND 64/8h, direct (the receiver lent no staging)"
        self.assertEqual((ev.transform, sev.transform), (said, said))
        want = bytearray([POISON]) * d.size
        src = pp.memory
        for layer in range(L):
            for kv in range(2):
                for h in range(H):
                    for t in range(n * 64):
                        s, o = p.addr(layer, kv, sids, t, h), d.addr(layer, kv, dids, t, h) - d.base
                        want[o:o + UNIT] = src[s:s + UNIT]
        self.assertEqual(bytes(pd.memory[d.base:d.base + d.size]), bytes(want))
        after = self.staging(self.dec)
        self.assertEqual(after["no_room"] - before["no_room"], 1, after)
        self.assertEqual(after["passes"], before["passes"], after)


if __name__ == "__main__":
    kvftest.main()
