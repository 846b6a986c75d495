#!/usr/bin/env python3
"""Heterogeneous KV layouts over tcp into a cuda pool (issue 17; run by
tests/gpu/run.sh, section 5b, so not named test_*.py: check-gpu's Python
pass would run it twice): two daemons on loopback, the decode side's layouts in a cuda:0
pool, the prefill side's in a host pool (the sender's pattern batches,
read by the receiver into GPU staging: tcp_recv.c receive_pattern_gpu) or
in a cuda:0 pool of its own (GPU -> GPU, staged on both sides). Every
prefill and decode rank of the two TPs is a client with its own layout;
the cases: TP 8 -> 4 (a fan-in of two), NHD <-> HND, 16 <-> 64 tokens per
block, TP 4 -> 8 (fan-out), llama3-8b's 256-byte pieces (128 dims of
fp16).

Every byte of every decode rank's slice of the GPU pool is read back
(torch) and compared with a reference built here with numpy from the
definitions (NHD: [block, token, head, dim], HND: [block, head, token,
dim]; the transfer's token t is block t // T, slot t % T on each side):
the granted blocks hold the prefill ranks' heads, every other byte is
still the poison. Skips without torch or a CUDA device."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ops"))
import kvftest  # noqa: E402  (puts the binding from the source tree on sys.path)
from kvftest import wait_event  # noqa: E402

import kvferry  # noqa: E402

try:
    import numpy as np
    import torch
except ImportError:
    np = torch = None

H = 8             # the model's KV heads (llama3-8b)
UNIT = 128 * 2    # one token of one head: 128 dims of fp16
L = 2             # layers
NB = 12           # blocks in each rank's layout
TOKENS = 128      # tokens a transfer moves
POISON = 0xA5
SLICE = 8 << 20   # a rank's share of its pool


class Rank:
    """One engine rank: per layer [K, V][NB] blocks of tpb tokens of its
    heads, from pool offset base."""

    def __init__(self, client, pool, base, tp, r, order, tpb):
        self.r, self.order, self.tpb, self.base = r, order, tpb, base
        self.heads, self.h0 = H // tp, r * (H // tp)
        self.bb = tpb * self.heads * UNIT
        self.size = L * 2 * NB * self.bb
        assert self.size <= SLICE
        offsets = [base + reg * NB * self.bb for reg in range(L * 2)]
        self.id = client.register_layout(kvferry.Layout(
            pool, offsets, NB, self.bb, n_kv=2, tokens_per_block=tpb, kv_heads=self.heads, head_dim=UNIT // 2,
            dtype_bytes=2, order=order, first_head=self.h0, model_kv_heads=H))

    def blocks(self, mem):
        """mem (this rank's bytes) as [layer][kv][block][token][head][unit]
        (a view for NHD, a transposed view for HND)."""
        shape = (self.tpb, self.heads) if self.order == "NHD" else (self.heads, self.tpb)
        a = mem[:self.size].reshape(L, 2, NB, shape[0], shape[1], UNIT)
        return a if self.order == "NHD" else a.transpose(0, 1, 2, 4, 3, 5)


def reference(pre, dec, sids, dids, src):
    """Each decode rank's slice as it must be: the tokens of every model
    head gathered from the prefill rank that holds it, placed in the decode
    rank's blocks, poison elsewhere."""
    model = np.zeros((L, 2, TOKENS, H, UNIT), np.uint8)  # [layer][kv][token][head][unit]
    for p in pre:
        b = p.blocks(src[p.r])[:, :, sids[p.r]]           # [l][kv][i][slot][head][unit]
        b = b.reshape(L, 2, len(sids[p.r]) * p.tpb, p.heads, UNIT)[:, :, :TOKENS]
        model[:, :, :, p.h0:p.h0 + p.heads] = b
    want = []
    for d in dec:
        mem = np.full(d.size, POISON, np.uint8)
        c = model[:, :, :, d.h0:d.h0 + d.heads].reshape(L, 2, len(dids[d.r]), d.tpb, d.heads, UNIT)
        d.blocks(mem)[:, :, dids[d.r]] = c
        want.append(mem)
    return want


@unittest.skipUnless(torch is not None, "torch or numpy is not installed")
class HeteroTcpGpu(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not torch.cuda.is_available():
            raise unittest.SkipTest("no CUDA device")
        cls.dir = kvftest.tempdir()
        cls.pre, cls.dec = kvftest.pair(cls.dir, "80M", extra_of={
            "prefill": "pool pg cuda:0 80M\n", "decode": "pool hbm cuda:0 80M\n"})
        cls.rng = np.random.default_rng(17)

    @classmethod
    def tearDownClass(cls):
        for d in (cls.pre, cls.dec):
            assert d.stop() == 0

    def setUp(self):
        self.clients = []

    def tearDown(self):
        for c in self.clients:
            c.close()

    def client(self, daemon):
        c = kvferry.Client(daemon.sock)
        self.clients.append(c)
        return c

    def tcp_status(self, daemon):
        return self.client(daemon).inspect("status", json=True)["tcp"]

    def handoff(self, src_pool, ptp, dtp, porder, dorder, pts, dts):
        tag = "%s-%d-%d-%s-%s-%d-%d" % (src_pool, ptp, dtp, porder, dorder, pts, dts)
        cps = [self.client(self.pre) for _ in range(ptp)]
        cds = [self.client(self.dec) for _ in range(dtp)]
        pp, pd = cps[0].pool_find(src_pool), cds[0].pool_find("hbm")
        self.assertTrue(pd.is_cuda)
        pre = [Rank(cps[i], pp, i * SLICE, ptp, i, porder, pts) for i in range(ptp)]
        dec = [Rank(cds[i], pd, i * SLICE, dtp, i, dorder, dts) for i in range(dtp)]
        nd, ns = TOKENS // dts, -(-TOKENS // pts)
        sids = [[int(x) for x in self.rng.permutation(NB)[:ns]] for _ in pre]
        dids = [[int(x) for x in self.rng.permutation(NB)[:nd]] for _ in dec]
        src = [self.rng.integers(0, 256, p.size, dtype=np.uint8) for p in pre]
        for p in pre:  # the prefill ranks' caches
            if pp.is_cuda:
                torch.as_tensor(pp.view(p.base, p.size), device="cuda").copy_(torch.from_numpy(src[p.r]))
            else:
                pp.memory[p.base:p.base + p.size] = src[p.r].tobytes()
        for d in dec:  # the decode ranks' slices, poisoned
            torch.as_tensor(pd.view(d.base, d.size), device="cuda").fill_(POISON)
        torch.cuda.synchronize()
        for d in dec:
            cds[d.r].grant_blocks(tag, "prefill", d.id, dids[d.r])
        for p in pre:
            cps[p.r].send_blocks(tag, "decode", p.id, sids[p.r])
        for d in dec:
            ev = wait_event(cds[d.r], tag, type=kvferry.RECV_DONE, timeout=60)
            self.assertEqual((ev.status, ev.error, ev.path), (0, "", "tcp-bounce"), tag)
            self.assertEqual(ev.bytes, nd * dts * d.heads * UNIT * L * 2, tag)
        for p in pre:
            ev = wait_event(cps[p.r], tag, type=kvferry.SEND_DONE, timeout=60)
            self.assertEqual((ev.status, ev.error), (0, ""), tag)
        want = reference(pre, dec, sids, dids, src)
        for d in dec:
            got = torch.as_tensor(pd.view(d.base, d.size), device="cuda").cpu().numpy()
            if not np.array_equal(got, want[d.r]):
                i = int(np.flatnonzero(got != want[d.r])[0])
                self.fail("%s: decode rank %d byte %d is 0x%02x, expected 0x%02x (%d bytes differ)" % (
                    tag, d.r, i, got[i], want[d.r][i], int((got != want[d.r]).sum())))
        for c in cps + cds:
            c.close()
            self.clients.remove(c)

    def test_pattern_batches_read(self):
        """The host sources' transforms came as pattern batches (the path
        under test), counted by the decode daemon."""
        before = self.tcp_status(self.dec)
        self.handoff("kv", 8, 4, "NHD", "NHD", 16, 16)
        after = self.tcp_status(self.dec)
        self.assertGreater(after["pattern_batches_read"], before["pattern_batches_read"], (before, after))


# (prefill TP, decode TP, orders, tokens per block): TP 8 -> 4 is a fan-in
# (two senders' heads in every decode block), 4 -> 8 a fan-out. One test
# each (a subtest's failure would not be reported line by line), from the
# host pool "kv" (pattern batches into GPU staging) and, for the first
# four, from the cuda pool "pg" (the sender stages per piece).
CASES = ((8, 4, "NHD", "NHD", 16, 16),
         (8, 4, "NHD", "HND", 16, 64),
         (8, 4, "HND", "NHD", 64, 16),
         (1, 1, "NHD", "HND", 16, 16),
         (1, 1, "HND", "NHD", 16, 64),
         (2, 2, "NHD", "NHD", 64, 16),
         (4, 8, "NHD", "HND", 16, 16))


def add_case(src, case):
    def test(self):
        self.handoff(src, *case)
    name = "test_%s_tp%d_%d_%s_%s_%d_%d" % (("host" if src == "kv" else "gpu"), case[0], case[1], case[2].lower(),
                                            case[3].lower(), case[4], case[5])
    test.__doc__ = "%s -> cuda: TP %d -> %d, %s -> %s, %d -> %d tokens per block" % ((src,) + case)
    setattr(HeteroTcpGpu, name, test)


for i, case in enumerate(CASES):
    add_case("kv", case)
    if i < 4:
        add_case("pg", case)


if __name__ == "__main__":
    kvftest.main()
