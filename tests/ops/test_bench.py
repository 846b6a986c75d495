#!/usr/bin/env python3
"""kvferry-bench's modes (issue 13) against two real daemons over tcp and
one daemon's local path: --blocks against the descriptor API, layer
events, the prefill emulation (--compute-us-per-layer with --layerwise or
--whole) and its exposed times, and the refusals of option mixes. The
bench verifies every byte itself; these tests check that it says so,
that its JSON line keeps its fields, and that it fails when it should."""
import json
import os
import unittest

import kvftest

BENCH = os.path.join(kvftest.BUILD, "kvferry-bench")
FIELDS = {"path", "bytes", "descriptors", "requests", "seconds", "gbps", "gbit_s", "p50_us", "p99_us",
          "post_p50_us", "verified", "model", "block_bytes", "concurrency", "tokens", "api"}


class TestBench(kvftest.PairTestCase):
    POOL = "64M"

    def bench(self, *args, to=None, ok=True):
        out = kvftest.run([BENCH, "--from", self.pre.sock, "--to", to or self.dec.sock, "--json"] + list(args),
                          timeout=120)
        if not ok:
            return out
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        d = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertTrue(FIELDS <= set(d), FIELDS - set(d))
        self.assertIs(d["verified"], True)
        return d

    def test_blocks_and_descs_move_the_same(self):
        args = ["--model", "llama3-8b", "--tokens", "100", "--requests", "3", "--concurrency", "2"]
        descs, blocks = self.bench(*args), self.bench("--blocks", *args)
        self.assertEqual((descs["api"], blocks["api"]), ("descs", "blocks"))
        for k in ("bytes", "descriptors", "requests", "block_bytes", "tokens"):
            self.assertEqual(descs[k], blocks[k], k)
        self.assertEqual(blocks["bytes"], 3 * 7 * 32 * 2 * 32768)  # 100 tokens: 7 blocks of 16
        self.assertEqual((blocks["path"], descs["path"]), ("tcp", "tcp"))
        self.assertNotIn("exposed_p50_us", blocks)

    def test_time_from_send_in_waves(self):
        """--time-from-send with several in flight: a wave's grants go first,
        then its sends, over tcp and the local path, by blocks and by
        descriptors, and every byte lands."""
        for to in (None, self.pre.sock):
            for api in ([], ["--blocks"], ["--blocks", "--nowait"]):
                d = self.bench("--tokens", "64", "--requests", "7", "--concurrency", "3", "--time-from-send",
                               *api, to=to)
                self.assertEqual((d["requests"], d["concurrency"]), (7, 3))
                self.assertEqual(d["path"], "local" if to else "tcp")

    def test_waves_per_check(self):
        """--waves-per-check: waves of --concurrency sent back to back, then
        every request of them checked (distinct blocks each, the pools sized
        for all), over tcp and the local path; a check past the run's end is
        cut to what is left (5 requests in waves of 2: one check of 2, 2
        and 1); the heterogeneous mode refuses it."""
        for to in (None, self.pre.sock):
            for api in (["--blocks", "--nowait"], []):
                d = self.bench("--tokens", "32", "--requests", "5", "--concurrency", "2", "--waves-per-check", "4",
                               "--time-from-send", *api, to=to)
                self.assertEqual((d["requests"], d["concurrency"], d["waves_per_check"]), (5, 2, 3), d)
                self.assertEqual(d["bytes"], 5 * 2 * 32 * 2 * 32768)
        out = self.bench("--tokens", "64", "--requests", "12", "--concurrency", "4", "--waves-per-check", "3",
                         ok=False)  # 12 x 4 blocks of 2 MiB: past the 64 MiB pools
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("12 requests of a check x 4 blocks", out.stderr)
        d = self.bench("--tokens", "64", "--requests", "3")
        self.assertNotIn("waves_per_check", d)
        out = self.bench("--blocks", "--prefill-tp", "2", "--waves-per-check", "2", "--requests", "4", ok=False)
        self.assertEqual(out.returncode, 2, out.stdout + out.stderr)
        self.assertIn("--waves-per-check", out.stderr)

    def test_window(self):
        """--window: a check's requests go through a sliding window of
        --concurrency (the next send as a RECV_DONE comes), over tcp and the
        local path, by blocks and by descriptors, layer by layer too, and
        every byte lands; it needs --time-from-send, and the heterogeneous
        mode refuses it."""
        for to in (None, self.pre.sock):
            for api in (["--blocks", "--nowait"], [], ["--blocks", "--layerwise"]):
                d = self.bench("--tokens", "32", "--requests", "7", "--concurrency", "2", "--waves-per-check", "3",
                               "--window", "--time-from-send", *api, to=to)
                self.assertEqual((d["requests"], d["concurrency"], d["window"]), (7, 2, True), d)
                self.assertEqual(d["bytes"], 7 * 2 * 32 * 2 * 32768)
                self.assertEqual(d["path"], "local" if to else "tcp")
        out = self.bench("--tokens", "32", "--requests", "4", "--concurrency", "2", "--window", ok=False)
        self.assertNotEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("--window needs --time-from-send", out.stderr)
        out = self.bench("--blocks", "--prefill-tp", "2", "--window", "--time-from-send", "--requests", "4", ok=False)
        self.assertEqual(out.returncode, 2, out.stdout + out.stderr)
        self.assertIn("--window", out.stderr)

    def test_layer_events_local_and_mla(self):
        d = self.bench("--blocks", "--layer-events", "--tokens", "64", "--requests", "2", "--layerwise",
                       to=self.pre.sock)
        self.assertEqual((d["path"], d["layer_events"], d["layer_events_in_order"]), ("local", 2 * 32, True))
        d = self.bench("--blocks", "--layer-events", "--model", "deepseek-v3", "--tokens", "128")
        self.assertEqual((d["layer_events"], d["descriptors"]), (61, 61 * 2))

    def test_prefill_emulation(self):
        """Layer-wise: 32 layers of 300 us compute, each layer's part posted
        as its compute ends; whole: one send after them. Both report the
        exposed time, which cannot exceed the whole latency."""
        for mode in ("layerwise", "whole"):
            for api in ([], ["--blocks"], ["--blocks", "--nowait"]):
                d = self.bench("--tokens", "32", "--requests", "3", "--compute-us-per-layer", "300",
                               "--" + mode, *api)
                self.assertEqual(d.get("nowait", False), "--nowait" in api)
                self.assertEqual((d["mode"], d["compute_us_per_layer"]), (mode, 300))
                self.assertGreater(d["exposed_p50_us"], 0)
                self.assertGreaterEqual(d["last_send_late_p50_us"], 0)
                self.assertLessEqual(d["exposed_p50_us"], d["exposed_p99_us"])
                # the latency runs from the grant, before 32 x 300 us of compute
                self.assertGreater(d["p50_us"], 32 * 300)
                self.assertLess(d["exposed_p99_us"], d["p99_us"])

    def test_refused_mixes(self):
        for args, what in ((["--whole"], "--whole needs --compute-us-per-layer"),
                           (["--compute-us-per-layer", "10"], "needs --layerwise or --whole"),
                           (["--whole", "--layerwise", "--compute-us-per-layer", "1"], "exclude each other"),
                           (["--layer-events"], "--layer-events needs --blocks"),
                           (["--compute-us-per-layer", "x", "--whole"], "is not a number")):
            out = self.bench(*args, ok=False)
            self.assertEqual(out.returncode, 2, out.stdout + out.stderr)
            self.assertIn(what, out.stderr)


if __name__ == "__main__":
    kvftest.main()
