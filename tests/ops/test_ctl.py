#!/usr/bin/env python3
"""kvferryctl: every command as a table and as JSON, the doctor's checks,
and the exit statuses kvferryctl(1) promises (0 ok, 1 daemon error or
metrics off, 2 usage, 3 unreachable, 4 a doctor check failed)."""
import ctypes
import json
import os
import subprocess
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
import kvferry
from kvftest import Daemon, run

CTL = kvftest.KVFERRYCTL


def ctl(sock, *args):
    return run([CTL, "-s", sock] + list(args), timeout=30)


class Layout(ctypes.Structure):
    """struct kvf_layout (client/kvferry.h); the binding has no layouts yet."""
    _fields_ = [("pool", ctypes.c_uint32), ("n_layers", ctypes.c_uint32),
                ("n_kv", ctypes.c_uint32), ("n_blocks", ctypes.c_uint32),
                ("block_bytes", ctypes.c_uint64), ("block_stride", ctypes.c_uint64),
                ("offsets", ctypes.POINTER(ctypes.c_uint64)),
                ("tokens_per_block", ctypes.c_uint32), ("kv_heads", ctypes.c_uint32),
                ("head_dim", ctypes.c_uint32), ("dtype_bytes", ctypes.c_uint32),
                ("order", ctypes.c_uint32), ("first_head", ctypes.c_uint32),
                ("model_kv_heads", ctypes.c_uint32)]


def layout_register(client, pool, offsets, **kw):
    """kvf_layout_register through the binding's library: the layout's id."""
    arr = (ctypes.c_uint64 * len(offsets))(*offsets)
    lay = Layout(pool=pool, offsets=arr, **kw)
    lid = ctypes.c_uint32()
    fn = client._lib.kvf_layout_register
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(Layout), ctypes.POINTER(ctypes.c_uint32)]
    rc = fn(client._handle(), ctypes.byref(lay), ctypes.byref(lid))
    if rc:
        raise OSError(rc, "kvf_layout_register: %s" % kvferry.err_name(rc))
    return lid.value


def layout_free(client, lid):
    fn = client._lib.kvf_layout_free
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    return fn(client._handle(), lid)


class TestCtl(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        cls.pre, cls.dec = kvftest.pair(cls.dir, pool="16M", metrics=True)
        cls.client = cls.dec.client()
        pool = cls.client.pool_find("kv")
        cls.client.grant("ctl-held-1", "prefill", [pool.desc(0, 8192)])  # shows in transfers

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        for d in (cls.pre, cls.dec):
            assert d.stop() == 0

    def test_tables(self):
        heads = {"status": "node            decode", "pools": "BACKING", "peers": "TRANSPORT",
                 "transfers": "ctl-held-1"}
        for cmd, want in heads.items():
            out = ctl(self.dec.sock, cmd)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn(want, out.stdout, cmd)
        out = ctl(self.dec.sock, "status")
        self.assertIn("metrics         http://127.0.0.1:", out.stdout)
        self.assertIn("state           running", out.stdout)

    def test_json(self):
        docs = {cmd: json.loads(ctl(self.dec.sock, "--json", cmd).stdout)
                for cmd in ("status", "pools", "peers", "transfers")}
        self.assertEqual(docs["status"]["node"], "decode")
        self.assertTrue(docs["status"]["metrics"].startswith("http://127.0.0.1:"))
        self.assertEqual(docs["pools"]["pools"][0]["name"], "kv")
        self.assertEqual(docs["peers"]["peers"][0]["state"], "up")
        self.assertEqual(docs["transfers"]["transfers"][0]["id"], "ctl-held-1")

    def test_metrics(self):
        out = ctl(self.dec.sock, "metrics")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("# TYPE kvferry_transfers_total counter", out.stdout)
        doc = json.loads(ctl(self.dec.sock, "metrics", "--json").stdout)
        fams = {f["name"]: f for f in doc["families"]}
        self.assertEqual(fams["kvferry_peers"]["type"], "gauge")
        up = [s for s in fams["kvferry_peers"]["samples"] if s["labels"] == {"state": "up"}]
        self.assertEqual(up[0]["value"], 1)
        hist = fams["kvferry_transfer_duration_seconds"]
        self.assertEqual(hist["type"], "histogram")

    def test_doctor(self):
        out = ctl(self.dec.sock, "doctor")
        doc = json.loads(ctl(self.dec.sock, "--json", "doctor").stdout)
        results = {c["name"]: c["result"] for c in doc["checks"]}
        self.assertEqual(set(results), {"socket", "memlock", "pools-locked", "hugepages",
                                        "peers-up", "metrics", "cluster-key", "cuda", "gpu-dmabuf",
                                        "nvidia-peermem", "iommu", "gpu-bar1", "gpu-nic-pcie",
                                        "pcie-acs", "gpu-pools", "rdma-writes", "registry",
                                        "spin-backoffs"})
        for name in ("socket", "peers-up", "metrics"):
            self.assertEqual(results[name], "ok", doc)
        self.assertEqual(results["rdma-writes"], "skip", doc)  # no rdma transport here
        self.assertEqual(results["registry"], "skip", doc)  # registry off
        self.assertEqual(doc["failed"], sum(r == "fail" for r in results.values()))
        self.assertEqual(out.returncode, 4 if doc["failed"] else 0, out.stdout)
        self.assertIn("CHECK", out.stdout.splitlines()[0])

    def test_doctor_sees_a_down_peer(self):
        d = Daemon(kvftest.tempdir(), "lonely", pool="4M")
        d.add_peer(self.pre, port=kvftest.free_ports(1)[0])  # nobody there
        d.start()
        try:
            out = ctl(d.sock, "--json", "doctor")
            doc = json.loads(out.stdout)
            peers = [c for c in doc["checks"] if c["name"] == "peers-up"][0]
            self.assertEqual(peers["result"], "fail")
            self.assertIn("prefill", peers["detail"])
            self.assertEqual(out.returncode, 4)
            metrics = [c for c in doc["checks"] if c["name"] == "metrics"][0]
            self.assertEqual(metrics["result"], "skip")
        finally:
            self.assertEqual(d.stop(), 0)

    def test_exit_statuses(self):
        nowhere = os.path.join(self.dir, "nobody.sock")
        self.assertEqual(ctl(nowhere, "status").returncode, 3)
        self.assertEqual(ctl(nowhere, "metrics").returncode, 3)
        out = ctl(nowhere, "doctor")
        self.assertEqual(out.returncode, 4)
        self.assertIn("socket         FAIL", out.stdout)
        self.assertEqual(run([CTL, "bogus"]).returncode, 2)
        self.assertEqual(run([CTL]).returncode, 2)
        self.assertEqual(run([CTL, "--nope", "status"]).returncode, 2)
        self.assertEqual(run([CTL, "status", "-s"]).returncode, 2)  # -s without its path
        self.assertEqual(run([CTL, "status", "extra"]).returncode, 2)
        self.assertEqual(run([CTL, "--socket=", "status"]).returncode, 2)
        out = run([CTL, "status", "--socket=" + self.dec.sock, "--json"])  # options after
        self.assertEqual(json.loads(out.stdout)["node"], "decode", out.stderr)
        out = run([CTL, "--help"])
        self.assertEqual(out.returncode, 0)
        for cmd in ("status", "pools", "peers", "transfers", "layouts", "metrics", "doctor"):
            self.assertIn(cmd, out.stdout)
        env = dict(os.environ, KVFERRY_SOCKET=self.dec.sock)
        self.assertEqual(run([CTL, "status"], env=env).returncode, 0)

    def test_layouts(self):
        """kvferryctl layouts lists the layouts the node's clients
        registered, as a table and as JSON, and forgets a freed one."""
        pool = self.client.pool_find("kv")
        offsets = [(1 << 20) + r * (64 << 10) for r in range(6)]  # 3 layers, K and V
        lid = layout_register(self.client, pool.id, offsets, n_layers=3, n_kv=2, n_blocks=8,
                              block_bytes=4096, block_stride=8192, tokens_per_block=16,
                              kv_heads=2, head_dim=64, dtype_bytes=2, order=1)
        try:
            out = ctl(self.dec.sock, "layouts")
            self.assertEqual(out.returncode, 0, out.stderr)
            head, *rows = out.stdout.splitlines()
            self.assertEqual(head.split()[:4], ["ID", "CLIENT", "PID", "POOL"])
            row = [r.split() for r in rows if r.split()[0] == str(lid)]
            self.assertEqual(len(row), 1, out.stdout)
            self.assertEqual(row[0][2:10], [str(os.getpid()), "kv", "3", "2", "8", "4096", "8192",
                                            "16"])
            self.assertIn("16 x 2 x 64 x 2, HND", out.stdout)
            out = ctl(self.dec.sock, "--json", "layouts")
            self.assertEqual(out.returncode, 0, out.stderr)
            mine = [l for l in json.loads(out.stdout)["layouts"] if l["id"] == lid]
            self.assertEqual(len(mine), 1, out.stdout)
            want = {"pid": os.getpid(), "pool": "kv", "pool_id": pool.id, "layers": 3, "n_kv": 2,
                    "blocks": 8, "block_bytes": 4096, "block_stride": 8192,
                    "tokens_per_block": 16, "kv_heads": 2, "head_dim": 64, "dtype_bytes": 2,
                    "order": "HND", "transfers": 0}
            self.assertEqual({k: mine[0][k] for k in want}, want)
        finally:
            self.assertEqual(layout_free(self.client, lid), 0)
        doc = json.loads(ctl(self.dec.sock, "layouts", "--json").stdout)
        self.assertNotIn(lid, [l["id"] for l in doc["layouts"]])

    def test_utf8_ids(self):
        """A transfer id is UTF-8 (issue 15): bytes that are not are refused
        (KVF_EINVAL), and ids with quotes, backslashes and characters
        beyond ASCII print as themselves in strict JSON."""
        pool = self.client.pool_find("kv")
        with self.assertRaises(kvferry.KvferryError) as cm:
            self.client.grant(b"raw-\xff-\xc3(-\xed\xa0\x80", "prefill", [pool.desc(8192, 8192)])
        self.assertEqual(cm.exception.name, "KVF_EINVAL")
        xid = "raw-\"\\-\u20ac-\u00e9"
        self.client.grant(xid, "prefill", [pool.desc(8192, 8192)])
        try:
            out = subprocess.run([CTL, "-s", self.dec.sock, "--json", "transfers"],
                                 capture_output=True, timeout=30)
            self.assertEqual(out.returncode, 0, out.stderr)
            doc = json.loads(out.stdout.decode("utf-8"))  # strict: a bad byte raises
            self.assertIn(xid, [t["id"] for t in doc["transfers"]])
            doc = self.client.inspect("transfers", json=True)
            self.assertIn(xid, [t["id"] for t in doc["transfers"]])
        finally:
            self.client.cancel(xid)


if __name__ == "__main__":
    kvftest.main()
