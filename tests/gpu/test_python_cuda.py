#!/usr/bin/env python3
"""GPU pools from Python (make check-gpu): a daemon with a cuda:0 pool, the
binding's __cuda_array_interface__ wrapped by torch.as_tensor without a
copy, and a transfer from a host pool into GPU memory checked on the GPU.
Skips without torch or a CUDA device."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ops"))
import kvftest  # noqa: E402  (puts the binding from the source tree on sys.path)
from kvftest import Daemon, wait_event  # noqa: E402

import kvferry  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

MIB = 1 << 20


@unittest.skipUnless(torch is not None, "torch is not installed")
class TestCudaPool(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not torch.cuda.is_available():
            raise unittest.SkipTest("no CUDA device")
        cls.d = Daemon(kvftest.tempdir(), "gpu", pool="16M", extra="pool hbm cuda:0 64M").start()

    @classmethod
    def tearDownClass(cls):
        assert cls.d.stop() == 0

    def test_torch_wraps_pool_without_copy(self):
        with self.d.client() as c:
            pool = c.pool_find("hbm")
            self.assertTrue(pool.is_cuda)
            t = torch.as_tensor(pool, device="cuda")
            self.assertEqual((t.dtype, t.numel(), t.data_ptr()), (torch.uint8, 64 * MIB, pool.address))
            view = torch.as_tensor(pool.view(MIB, 4096), device="cuda")
            view.fill_(7)
            torch.cuda.synchronize()
            self.assertEqual(int(t[MIB:MIB + 4096].sum()), 7 * 4096)  # the same memory

    def test_host_to_gpu_transfer(self):
        with self.d.client() as c:
            host, hbm = c.pool_find("kv"), c.pool_find("hbm")
            host.memory[0:MIB] = bytes(range(256)) * (MIB // 256)
            c.grant("gpu-1", None, [hbm.desc(2 * MIB, MIB)])
            c.send("gpu-1", c.node, [host.desc(0, MIB)])
            for kind in (kvferry.RECV_DONE, kvferry.SEND_DONE):
                ev = wait_event(c, "gpu-1", type=kind)
                self.assertTrue(ev.ok, ev)
            t = torch.as_tensor(hbm.view(2 * MIB, MIB), device="cuda")
            want = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(MIB // 256)
            self.assertTrue(torch.equal(t, want))


if __name__ == "__main__":
    kvftest.main()
