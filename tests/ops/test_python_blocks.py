#!/usr/bin/env python3
"""The Python binding's KV layouts and transfers by block id (issue 13),
against two real daemons over tcp with host pools: layouts built from an
engine's tensors (memoryviews standing in for torch, which tests/gpu
covers), block ids from lists and arrays, block handoffs layer by layer,
in groups and whole, every byte of the decode pool checked (the granted
blocks hold what prefill wrote, every other byte is still the poison),
layer events in order and complete, and the errors."""
import array
import ctypes
import os
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import wait_event

import kvferry
from kvferry.layout import block_id_array

MB = 1 << 20
POOL = 32 * MB
L = 4            # layers
BB = 8192        # block bytes: 16 tokens x 2 heads x 128 dims x 2 bytes
GEO = [16, 2, 128]
POISON = 0xA5

try:
    import numpy
except ImportError:
    numpy = None


def vllm_tensors(pool, n_blocks, base=0):
    """Per layer a K and a V tensor [n_blocks, 16, 2, 128] of 2-byte
    elements, one after the other from pool offset base (vLLM's layout):
    memoryviews of format 'H' stand in for torch tensors."""
    mem = pool.memory
    region = n_blocks * BB
    ks, vs = [], []
    for layer in range(L):
        for kv, out in ((0, ks), (1, vs)):
            off = base + (2 * layer + kv) * region
            out.append(mem[off:off + region].cast("H", [n_blocks] + GEO))
    return ks, vs


class FakeTensor:
    """What Layout.from_tensors reads from a torch tensor."""

    def __init__(self, ptr, shape, stride, esize):
        self.ptr, self.shape, self._stride, self.esize = ptr, shape, stride, esize

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return self._stride

    def element_size(self):
        return self.esize


class TestLayoutFromTensors(unittest.TestCase):
    """Layout arithmetic, checked without a transfer (the pool is mapped)."""

    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        cls.d = kvftest.Daemon(cls.dir, "solo", "4M")
        cls.d.start()

    @classmethod
    def tearDownClass(cls):
        assert cls.d.stop() == 0

    def setUp(self):
        self.c = kvferry.Client(self.d.sock)
        self.pool = self.c.pool_find("kv")

    def tearDown(self):
        self.c.close()

    def test_vllm_per_layer_tensors(self):
        ks, vs = vllm_tensors(self.pool, 16, base=BB)
        lay = self.c.layout_from_tensors(self.pool, ks, vs, block_dim=0)
        self.assertEqual((lay.pool, lay.n_layers, lay.n_kv, lay.n_blocks, lay.block_bytes, lay.block_stride),
                         (self.pool.id, L, 2, 16, BB, BB))
        self.assertEqual(lay.offsets, [BB + r * 16 * BB for r in range(2 * L)])
        self.assertEqual((lay.tokens_per_block, lay.kv_heads, lay.head_dim, lay.dtype_bytes, lay.order),
                         (16, 2, 128, 2, "NHD"))
        hnd = kvferry.Layout.from_tensors(self.pool, ks, vs, order="HND")
        self.assertEqual((hnd.tokens_per_block, hnd.kv_heads, hnd.order), (2, 16, "HND"))
        mla = self.c.layout_from_tensors("kv", ks[:2], None, head_dim=64)
        self.assertEqual((mla.n_kv, mla.n_layers, mla.head_dim), (1, 2, 64))

    def test_cross_layer_torch_like(self):
        """One block holds every layer's K and V ([n_blocks, L, 2, 16, 2,
        128]): per-layer views stride over the whole block."""
        base, n = self.pool.address, 8
        step = [L * 2 * BB, 2 * BB, BB]  # byte strides of the outer three dims
        ks = [FakeTensor(base + l * 2 * BB, (n, 16, 2, 128), (step[0] // 2, 256, 128, 1), 2) for l in range(L)]
        vs = [FakeTensor(base + l * 2 * BB + BB, (n, 16, 2, 128), (step[0] // 2, 256, 128, 1), 2)
              for l in range(L)]
        lay = kvferry.Layout.from_tensors(self.pool, ks, vs)
        self.assertEqual((lay.n_blocks, lay.block_bytes, lay.block_stride), (n, BB, L * 2 * BB))
        self.assertEqual(lay.offsets, [r * BB for r in range(2 * L)])
        # the block's own dimensions must be contiguous
        bad = [FakeTensor(base, (n, 16, 2, 128), (step[0] // 2, 128, 2048, 1), 2)]
        with self.assertRaisesRegex(ValueError, "not contiguous"):
            kvferry.Layout.from_tensors(self.pool, bad)

    def test_array_interface(self):
        """numpy and CuPy arrays are read through their array interfaces
        (strides None: C order)."""
        class Arr:
            def __init__(self, ptr, strides=None):
                self.__array_interface__ = {"data": (ptr, False), "shape": (8, 16, 2, 128), "typestr": "<f2",
                                            "strides": strides, "version": 3}
        base = self.pool.address
        ks = [Arr(base + 2 * l * 8 * BB) for l in range(L)]
        vs = [Arr(base + (2 * l + 1) * 8 * BB) for l in range(L)]
        lay = kvferry.Layout.from_tensors(self.pool, ks, vs)
        self.assertEqual((lay.n_blocks, lay.block_bytes, lay.block_stride, lay.offsets[:3]),
                         (8, BB, BB, [0, 8 * BB, 16 * BB]))
        self.assertEqual((lay.tokens_per_block, lay.kv_heads, lay.head_dim, lay.dtype_bytes), (16, 2, 128, 2))
        strided = [Arr(base, (3 * BB, 512, 256, 2))]  # blocks every 3 blocks' bytes: fine
        self.assertEqual(kvferry.Layout.from_tensors(self.pool, strided).block_stride, 3 * BB)

    def test_addresses_and_refusals(self):
        base = self.pool.address
        lay = kvferry.Layout.from_tensors(self.pool, [base, base + 4 * BB], [base + 8 * BB, base + 12 * BB],
                                          n_blocks=4, block_bytes=BB)
        self.assertEqual((lay.offsets, lay.block_stride, lay.tokens_per_block), ([0, 8 * BB, 4 * BB, 12 * BB],
                                                                                 BB, 0))
        with self.assertRaisesRegex(ValueError, "give n_blocks"):
            kvferry.Layout.from_tensors(self.pool, [base])
        outside = bytearray(4 * BB)  # memory the engine did not take from the pool
        with self.assertRaisesRegex(ValueError, "not inside pool kv"):
            kvferry.Layout.from_tensors(self.pool, [memoryview(outside).cast("B", [4, BB])])
        past = kvferry.Layout.from_tensors
        with self.assertRaisesRegex(ValueError, "not inside pool"):
            past(self.pool, [base + self.pool.size - BB], n_blocks=2, block_bytes=BB)
        ks, vs = vllm_tensors(self.pool, 8)
        with self.assertRaisesRegex(ValueError, "first tensor"):
            kvferry.Layout.from_tensors(self.pool, ks, [v[:4] for v in vs])
        with self.assertRaisesRegex(ValueError, "V tensors"):
            kvferry.Layout.from_tensors(self.pool, ks, vs[:1])
        with self.assertRaises(ValueError):
            kvferry.Layout(self.pool, [0, 1, 2], 1, BB)  # odd count for K and V

    def test_block_id_forms(self):
        ids = array.array("I", [7, 3, 5])
        arr, n, _ = block_id_array(ids)
        addr, _ = ids.buffer_info()
        self.assertEqual((ctypes.addressof(arr), n, list(arr)), (addr, 3, [7, 3, 5]))  # no copy
        arr, n, _ = block_id_array([1, 2, 0xFFFFFFFF])
        self.assertEqual((list(arr), n), ([1, 2, 0xFFFFFFFF], 3))
        self.assertEqual(list(block_id_array(range(4))[0]), [0, 1, 2, 3])
        self.assertEqual(list(block_id_array(array.array("q", [9, 8]))[0]), [9, 8])  # converted
        self.assertEqual(block_id_array(None)[:2], (None, 0))
        for bad in ([-1], [1 << 32], array.array("q", [-5])):
            with self.assertRaises(ValueError):
                block_id_array(bad)
        with self.assertRaises(TypeError):
            block_id_array(["a"])

    @unittest.skipUnless(numpy, "numpy is not installed")
    def test_block_ids_numpy(self):
        u32 = numpy.array([4, 2, 9], dtype=numpy.uint32)
        arr, n, _ = block_id_array(u32)
        self.assertEqual((ctypes.addressof(arr), list(arr)), (u32.ctypes.data, [4, 2, 9]))
        self.assertEqual(list(block_id_array(numpy.array([4, 2], dtype=numpy.int64))[0]), [4, 2])


class TestBlockTransfers(kvftest.PairTestCase):

    def setUp(self):
        self.cp = kvferry.Client(self.pre.sock)
        self.cd = kvferry.Client(self.dec.sock)
        self.pp, self.pd = self.cp.pool_find("kv"), self.cd.pool_find("kv")
        # prefill: vLLM per-layer tensors; decode: another engine, whose
        # blocks hold every layer (cross-layer), at another pool offset
        self.nb = 64
        self.src = self.cp.register_layout(self.cp.layout_from_tensors(self.pp, *vllm_tensors(self.pp, self.nb)))
        self.dst_base = 3 * BB
        self.dst_layout = kvferry.Layout(self.pd, [self.dst_base + r * BB for r in range(2 * L)], self.nb, BB,
                                         block_stride=2 * L * BB, tokens_per_block=16, kv_heads=2,
                                         head_dim=128, dtype_bytes=2)
        self.dst = self.cd.register_layout(self.dst_layout)

    def tearDown(self):
        self.cp.close()
        self.cd.close()

    def src_off(self, layer, kv, b):
        return (2 * layer + kv) * self.nb * BB + b * BB

    def dst_off(self, layer, kv, b):
        return self.dst_base + b * 2 * L * BB + (2 * layer + kv) * BB

    def fill(self, src_ids, dst_ids):
        """Random bytes in every source block, poison in the whole decode
        pool; returns what the decode pool must hold afterwards."""
        mem = self.pp.memory
        self.pd.memory[:] = bytes([POISON]) * POOL
        want = bytearray([POISON]) * POOL
        for layer in range(L):
            for kv in range(2):
                for s, d in zip(src_ids, dst_ids):
                    data = os.urandom(BB)
                    mem[self.src_off(layer, kv, s):self.src_off(layer, kv, s) + BB] = data
                    want[self.dst_off(layer, kv, d):self.dst_off(layer, kv, d) + BB] = data
        return want

    def check_pool(self, want):
        got = self.pd.memory
        if got == want:
            return
        i = next(i for i in range(POOL) if got[i] != want[i])
        rel = i - self.dst_base
        block, rest = divmod(rel, 2 * L * BB)
        self.fail("decode pool byte %d (block %d, region %d, byte %d) is 0x%02x, expected 0x%02x" % (
            i, block, rest // BB, rest % BB, got[i], want[i]))

    def finish(self, xid, n, layer_events):
        """Events of xid: the layers' (when asked) in order, then RECV_DONE
        with the right counts; SEND_DONE on the prefill side."""
        layers = []
        while True:
            ev = wait_event(self.cd, xid)
            if ev.type != kvferry.LAYER_DONE:
                break
            self.assertEqual((ev.status, ev.kind), (0, "layer_done"))
            layers.append(ev.layer)
        self.assertEqual((ev.type, ev.status, ev.error, ev.path, ev.peer), (kvferry.RECV_DONE, 0, "", "tcp",
                                                                           "prefill"))
        self.assertEqual((ev.bytes, ev.descriptors), (n * L * 2 * BB, n * L * 2))
        self.assertEqual(layers, list(range(L)) if layer_events else [])
        sev = wait_event(self.cp, xid)
        self.assertEqual((sev.type, sev.status, sev.bytes), (kvferry.SEND_DONE, 0, n * L * 2 * BB))

    def test_layer_by_layer_with_layer_events(self):
        src_ids = [5, 63, 0, 17, 18, 19, 40, 2]  # scattered, a run of three
        dst_ids = [60, 1, 30, 31, 32, 9, 0, 63]
        want = self.fill(src_ids, dst_ids)
        self.cd.grant_blocks("pb-layers", "prefill", self.dst, dst_ids, layer_events=True)
        for layer in range(L):
            self.cp.send_blocks("pb-layers", "decode", self.src, src_ids if layer == 0 else None,
                                first_layer=layer, n_layers=1, more=layer < L - 1)
        self.finish("pb-layers", len(src_ids), True)
        self.check_pool(want)

    def test_nowait_parts(self):
        """Layer parts with nowait=True arrive as awaited ones do; a later
        part the daemon refuses (a layer outside the layout) fails the send
        in SEND_DONE, since its call could not."""
        src_ids, dst_ids = [9, 8, 7], [1, 2, 3]
        want = self.fill(src_ids, dst_ids)
        self.cd.grant_blocks("pn-ok", "prefill", self.dst, dst_ids, layer_events=True)
        for layer in range(L):
            self.cp.send_blocks("pn-ok", "decode", self.src, src_ids if layer == 0 else None,
                                first_layer=layer, n_layers=1, more=layer < L - 1, nowait=True)
        self.finish("pn-ok", 3, True)
        self.check_pool(want)
        self.cd.grant_blocks("pn-bad", "prefill", self.dst, dst_ids)
        self.cp.send_blocks("pn-bad", "decode", self.src, src_ids, first_layer=0, n_layers=1, more=True)
        self.cp.send_blocks("pn-bad", "decode", self.src, None, first_layer=L, n_layers=1, more=True, nowait=True)
        sev = wait_event(self.cp, "pn-bad")
        self.assertEqual((sev.type, sev.error_name), (kvferry.SEND_DONE, "KVF_ERANGE"), sev.error)
        rev = wait_event(self.cd, "pn-bad")
        self.assertEqual(rev.type, kvferry.RECV_DONE)
        self.assertNotEqual(rev.status, 0)

    def test_whole_and_groups_with_arrays(self):
        src_ids = array.array("I", range(10, 26))
        dst_ids = array.array("I", reversed(range(40, 56)))
        want = self.fill(src_ids, dst_ids)
        self.cd.grant_blocks("pb-whole", None, self.dst, dst_ids)
        self.cp.send_blocks("pb-whole", "decode", self.src, src_ids)
        self.finish("pb-whole", 16, False)
        self.check_pool(want)
        # groups of two layers; the second part repeats the ids
        want = self.fill(src_ids[:4], dst_ids[:4])
        self.cd.grant_blocks("pb-groups", "prefill", self.dst, list(dst_ids[:4]), layer_events=True)
        self.cp.send_blocks("pb-groups", "decode", self.src, src_ids[:4], first_layer=0, n_layers=2, more=True)
        self.cp.send_blocks("pb-groups", "decode", self.src, src_ids[:4], first_layer=2, n_layers=2)
        self.finish("pb-groups", 4, True)
        self.check_pool(want)

    def assert_error(self, name, call):
        with self.assertRaises(kvferry.KvferryError, msg=name) as cm:
            call()
        self.assertEqual(cm.exception.name, name, str(cm.exception))

    def test_errors(self):
        nope = self.dst + 1000
        self.assert_error("KVF_ENOENT", lambda: self.cd.grant_blocks("pe-1", None, nope, [0]))
        self.assert_error("KVF_ENOENT", lambda: self.cp.send_blocks("pe-2", "decode", nope, [0]))
        self.assert_error("KVF_ENOENT", lambda: self.cd.free_layout(nope))
        # another client's layout (of the same daemon) is not this one's
        with kvferry.Client(self.dec.sock) as other:
            theirs = other.register_layout(self.dst_layout)
            self.assert_error("KVF_ENOENT", lambda: self.cd.grant_blocks("pe-3", None, theirs, [0]))
            self.assert_error("KVF_ENOENT", lambda: self.cd.free_layout(theirs))
        self.assert_error("KVF_ERANGE", lambda: self.cd.grant_blocks("pe-4", None, self.dst, [0, self.nb]))
        self.assert_error("KVF_ERANGE", lambda: self.cd.grant_blocks("pe-5", None, self.dst, [0], first_layer=L))
        self.assert_error("KVF_ERANGE", lambda: self.cd.grant_blocks("pe-6", None, self.dst, [0], first_layer=1,
                                                                      n_layers=L))
        self.assert_error("KVF_EINVAL", lambda: self.cd.grant_blocks("pe-7", None, self.dst, []))
        self.assert_error("KVF_EINVAL", lambda: self.cp.send_blocks("pe-8", "decode", self.src, None))
        # registration: a region past the pool's end, two regions overlapping
        end = kvferry.Layout(self.pd, [0, POOL - BB], 2, BB)
        self.assert_error("KVF_ERANGE", lambda: self.cd.register_layout(end))
        overlap = kvferry.Layout(self.pd, [0, BB], 4, BB)
        self.assert_error("KVF_EINVAL", lambda: self.cd.register_layout(overlap))
        self.assert_error("KVF_ENOPOOL", lambda: self.cd.register_layout(kvferry.Layout(9, [0, BB], 1, BB)))

    def test_geometry_mismatch_is_esize(self):
        """Two layouts whose blocks differ (another head_dim) cannot pair:
        KVF_ESIZE, from the call or in both sides' events."""
        other = kvferry.Layout(self.pd, [r * 16 * BB for r in range(2 * L)], 16, BB, tokens_per_block=16,
                               kv_heads=2, head_dim=64, dtype_bytes=4)
        lid = self.cd.register_layout(other)
        self.cd.grant_blocks("pg-1", "prefill", lid, [0, 1])
        try:
            self.cp.send_blocks("pg-1", "decode", self.src, [0, 1])
        except kvferry.KvferryError as e:
            self.assertEqual(e.name, "KVF_ESIZE")
            self.cd.cancel("pg-1")
            return
        self.assertEqual(wait_event(self.cp, "pg-1").error_name, "KVF_ESIZE")
        self.assertIn(wait_event(self.cd, "pg-1").error_name, ("KVF_ESIZE", "KVF_EREMOTECANCEL"))

    def test_layouts_listed_and_freed_at_close(self):
        other = kvferry.Client(self.dec.sock)
        lid = other.register_layout(self.dst_layout)
        ids = [row["id"] for row in self.cd.inspect("layouts", json=True)["layouts"]]
        self.assertIn(lid, ids)
        self.assertIn(self.dst, ids)
        other.close()
        # the daemon sees the close on its own loop, after close() returned
        kvftest.wait_for(lambda: lid not in [row["id"] for row in self.cd.inspect("layouts", json=True)["layouts"]],
                         5, "the closed client's layout freed")
        self.cd.free_layout(self.dst)
        ids = [row["id"] for row in self.cd.inspect("layouts", json=True)["layouts"]]
        self.assertNotIn(self.dst, ids)
        self.assert_error("KVF_ENOENT", lambda: self.cd.free_layout(self.dst))


if __name__ == "__main__":
    kvftest.main()
