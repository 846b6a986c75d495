#!/usr/bin/env python3
"""kvferryctl: every command as a table and as JSON, the doctor's checks,
and the exit statuses kvferryctl(1) promises (0 ok, 1 daemon error or
metrics off, 2 usage, 3 unreachable, 4 a doctor check failed)."""
import json
import os
import subprocess
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, run

CTL = kvftest.KVFERRYCTL


def ctl(sock, *args):
    return run([CTL, "-s", sock] + list(args), timeout=30)


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
                                        "pcie-acs", "gpu-pools", "rdma-writes"})
        for name in ("socket", "peers-up", "metrics"):
            self.assertEqual(results[name], "ok", doc)
        self.assertEqual(results["rdma-writes"], "skip", doc)  # no rdma transport here
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
        out = run([CTL, "--help"])
        self.assertEqual(out.returncode, 0)
        for cmd in ("status", "pools", "peers", "transfers", "metrics", "doctor"):
            self.assertIn(cmd, out.stdout)
        env = dict(os.environ, KVFERRY_SOCKET=self.dec.sock)
        self.assertEqual(run([CTL, "status"], env=env).returncode, 0)

    def test_utf8_ids(self):
        """A transfer id is bytes to the daemon (control bytes refused):
        bytes that are not UTF-8 (stray, truncated, a surrogate) still print
        as valid UTF-8 JSON, each bad sequence as U+FFFD (proto/json.h)."""
        raw = b"raw-\xff-\xc3(-\xed\xa0\x80-\"\\-\xe2\x82\xac"
        want = "raw-\ufffd-\ufffd(-\ufffd\ufffd\ufffd-\"\\-\u20ac"
        pool = self.client.pool_find("kv")
        self.client.grant(raw, "prefill", [pool.desc(8192, 8192)])
        try:
            out = subprocess.run([CTL, "-s", self.dec.sock, "--json", "transfers"],
                                 capture_output=True, timeout=30)
            self.assertEqual(out.returncode, 0, out.stderr)
            doc = json.loads(out.stdout.decode("utf-8"))  # strict: a bad byte raises
            self.assertIn(want, [t["id"] for t in doc["transfers"]])
            doc = self.client.inspect("transfers", json=True)
            self.assertIn(want, [t["id"] for t in doc["transfers"]])
        finally:
            self.client.cancel(raw)


if __name__ == "__main__":
    kvftest.main()
