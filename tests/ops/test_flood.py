#!/usr/bin/env python3
"""Local clients that flood the daemon (issue 15, items 1 and 2), against
real daemons; the workloads are tests/ops/flood.py's, smaller than
bench/flood_clients.py's.

- Fair turns (item 1): clients each post grants, then each pipelines
  TRANSFERS inspects. The peer link must stay up (kvftest's peer-timeout,
  1 s) and an unrelated client's requests keep being answered promptly
  (bounds with a margin for a loaded 2-core machine; the old loop blocked
  for seconds, and the link went down).
- Unread replies (item 2): clients that pipeline inspects and never read
  make the daemon hold a bounded amount for them (it stops serving them),
  not hundreds of MB; once they go, its RSS is back near where it was.
- api-output-budget (item 2): with a small budget, many such clients: the
  biggest holders are dropped (logged, counted), the daemon and a client
  that reads keep working, and the memory comes back."""
import os
import threading
import time
import unittest

import flood
import kvftest

MB = 1 << 20


class RssWatch:
    """Samples a process's VmRSS until stopped; .peak in kB."""

    def __init__(self, pid):
        self.pid, self.peak, self.stop = pid, flood.rss_kb(pid), threading.Event()
        self.t = threading.Thread(target=self.run)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, flood.rss_kb(self.pid))
            self.stop.wait(0.005)

    def done(self):
        self.stop.set()
        self.t.join()
        return self.peak


def settled(d, key="api_output_bytes", n=10):
    """Waits until status[key] stays the same (and above 0) over n reads
    in a row: the daemon has done all it will for clients that do not
    read. Returns the last status."""
    seen = []

    def same():
        st = d.status()
        seen.append(st[key])
        return st if len(seen) >= n and seen[-1] > 0 and len(set(seen[-n:])) == 1 else None
    return kvftest.wait_for(same, 60, "%s to settle" % key)


class FairTurns(unittest.TestCase):
    def test_flood_keeps_peers_and_other_clients_served(self):
        d = kvftest.tempdir()
        pre, dec = kvftest.pair(d, pool="32M", extra="max-transfers-per-client 8192\n")
        try:
            r = flood.flood(pre, dec, clients=6, grants=1000, inspects=100, interval=0.002)
            print("# flood: %s" % r, flush=True)
            self.assertTrue(r["flood_ok"], r["flood_errors"])
            self.assertEqual(r["listed"], 6 * 1000, "every grant listed in the last reply")
            self.assertEqual(r["link_drops"], 0, r)
            self.assertEqual(r["probes_not_up"], 0, r)
            self.assertEqual(r["probe_errors"], [], r)
            self.assertGreater(r["probes"], 20, r)
            self.assertLess(r["p99_ms"], 150, r)
            for x in (pre, dec):
                self.assertNotIn("no word from the peer", x.log_text())
        finally:
            self.assertEqual(pre.stop(), 0)
            self.assertEqual(dec.stop(), 0)


class UnreadReplies(unittest.TestCase):
    HOLD = 4000  # listed transfers: TRANSFERS replies of about 1 MB

    def setUp(self):
        self.d = kvftest.Daemon(kvftest.tempdir(), "solo", pool="16M", extra=self.EXTRA).start()
        with self.d.client() as c:
            self.pool = c.pool_find("kv").id
        self.holder = flood.post_grants(self.d.sock, self.HOLD, self.pool, "", base=0)

    def tearDown(self):
        self.holder.close()
        self.assertEqual(self.d.stop(), 0)

    def close_and_check_rss(self, socks, before):
        for s in socks:
            s.close()
        kvftest.wait_for(lambda: self.d.status()["clients"] <= 2, 30, "the non-readers gone")
        if kvftest.daemon_sanitized():
            print("# ASan build: its allocator quarantines freed memory; RSS coming back not checked", flush=True)
            return
        after = kvftest.wait_for(lambda: (lambda r: r if r - before < 16 * 1024 else None)(flood.rss_kb(
            self.d.proc.pid)), 10, "RSS back within 16 MB of %d kB" % before)
        print("# rss after %d kB" % after, flush=True)


class UnreadDefault(UnreadReplies):
    EXTRA = ""

    def test_non_readers_hold_little_and_memory_comes_back(self):
        pid = self.d.proc.pid
        before = flood.rss_kb(pid)
        watch = RssWatch(pid)
        socks = [flood.non_reader(self.d.sock, "unread%d" % i, flood.INSPECT_TRANSFERS, 300) for i in range(2)]
        try:
            st = settled(self.d)
            peak = watch.done()
            print("# rss before %d kB, peak %d kB; unread output %d bytes" % (before, peak, st["api_output_bytes"]),
                  flush=True)
            self.assertLess(st["api_output_bytes"], 8 * MB)
            self.assertLess(peak - before, 48 * 1024, "the daemon grew by %d kB" % (peak - before))
            self.assertEqual(st["clients"], 4, "nobody dropped: the non-readers are just not served")
            with self.d.client() as c:  # a client that reads is served meanwhile
                self.assertEqual(len(c.inspect("transfers", json=True)["transfers"]), self.HOLD)
        finally:
            watch.done()
            self.close_and_check_rss(socks, before)


class OutputBudget(UnreadReplies):
    HOLD = 600  # replies of about 140 KB, below max-frame
    EXTRA = "api-output-budget 1M\nmax-frame 256K\nmax-descs 10000\n"

    def test_biggest_holders_dropped_within_the_budget(self):
        pid = self.d.proc.pid
        before = flood.rss_kb(pid)
        reader = self.d.client()
        socks = [flood.non_reader(self.d.sock, "unread%d" % i, flood.INSPECT_TRANSFERS, 200) for i in range(8)]
        try:
            st = settled(self.d, "api_output_drops")
            st = settled(self.d)
            print("# status: %d clients, %d dropped, %d bytes unread" % (
                st["clients"], st["api_output_drops"], st["api_output_bytes"]), flush=True)
            self.assertGreaterEqual(st["api_output_drops"], 1)
            self.assertEqual(st["clients"], 2 + 8 + 1 - st["api_output_drops"])  # holder, reader, status client
            self.assertLessEqual(st["api_output_bytes"], 1 * MB)
            self.assertIn("past api-output-budget (1048576)", self.d.log_text())
            # the client that reads was not the one dropped, and is served
            self.assertEqual(len(reader.inspect("transfers", json=True)["transfers"]), self.HOLD)
        finally:
            reader.close()
            self.close_and_check_rss(socks, before)


if __name__ == "__main__":
    kvftest.main()
