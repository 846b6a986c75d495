#!/usr/bin/env python3
"""Signals: SIGTERM drains (new clients and transfers refused, transfers in
flight finish, exit 0), the drain is bounded by stop-timeout-ms (what is
left fails with ESHUTDOWN on both sides), a second SIGTERM stops at once;
SIGHUP reloads peers, the log level and limits, names what needs a
restart, and refuses a bad file as a whole."""
import os
import signal
import time
import unittest
import urllib.error
import urllib.request

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, wait_event, wait_for

import kvferry

BLOCK = 64 * 1024


def descs(pool, first, n):
    return [kvferry.Desc(pool.id, (first + i) * BLOCK, BLOCK) for i in range(n)]


class TestStop(unittest.TestCase):
    def setUp(self):
        self.dir = kvftest.tempdir()
        self.pre, self.dec = kvftest.pair(self.dir, metrics=True, extra="stop-timeout-ms 20000")
        self.cp, self.cd = self.pre.client(), self.dec.client()
        self.pp, self.pd = self.cp.pool_find("kv"), self.cd.pool_find("kv")

    def tearDown(self):
        for c in (self.cp, self.cd):
            c.close()
        for d in (self.pre, self.dec):
            d.kill()

    def test_sigterm_lets_inflight_transfer_finish(self):
        src, dst = descs(self.pp, 0, 8), descs(self.pd, 16, 8)
        health = self.pre.metrics_url().replace("/metrics", "/healthz")
        mem = self.pp.memory
        for i in range(8):
            mem[i * BLOCK:(i + 1) * BLOCK] = bytes([i + 1]) * BLOCK
        self.cd.grant("drain-1", "prefill", dst)
        self.cp.send("drain-1", "decode", src[:4], more=True)  # in flight now
        t0 = time.monotonic()
        self.pre.signal(signal.SIGTERM)
        # No new clients: the socket goes away...
        wait_for(lambda: not os.path.exists(self.pre.sock), 5, "the API socket to go")
        with self.assertRaises(kvferry.KvferryError):
            kvferry.Client(self.pre.sock)
        # ...and no new transfers from the clients still connected.
        with self.assertRaises(kvferry.KvferryError) as cm:
            self.cp.send("drain-new", "decode", src[:1])
        self.assertEqual(cm.exception.name, "ESHUTDOWN")
        self.assertEqual(self.cp.inspect("status", json=True)["state"], "stopping")
        with self.assertRaises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(health, timeout=5)
        self.assertEqual((http.exception.code, http.exception.read()), (503, b"stopping\n"))
        # The transfer in flight may still finish.
        self.cp.send("drain-1", "decode", src[4:])
        self.assertTrue(wait_event(self.cp, "drain-1").ok)
        self.assertTrue(wait_event(self.cd, "drain-1").ok)
        self.assertEqual(self.pre.proc.wait(10), 0)
        self.assertLess(time.monotonic() - t0, 10, "waited for stop-timeout-ms, not the transfer")
        got = self.pd.memory
        for i in range(8):
            off = (16 + i) * BLOCK
            self.assertEqual(bytes(got[off:off + BLOCK]), bytes([i + 1]) * BLOCK, "block %d" % i)
        log = self.pre.log_text()
        self.assertIn("SIGTERM: stopping; 1 transfers in flight", log)
        self.assertIn("every transfer in flight finished", log)

    def test_second_sigterm_stops_at_once(self):
        self.cd.grant("stuck-2", "prefill", descs(self.pd, 0, 1))
        self.dec.signal(signal.SIGTERM)
        # The first SIGTERM started a drain that waits for the grant (or,
        # wrongly, stopped the daemon at once).
        wait_for(lambda: self.dec.proc.poll() is not None or
                 "SIGTERM: stopping; 1 transfers in flight" in self.dec.log_text(), 5,
                 "decode to start draining")
        self.assertIsNone(self.dec.proc.poll(), "stopped without waiting for the grant")
        self.dec.signal(signal.SIGTERM)
        self.assertEqual(self.dec.proc.wait(5), 0)
        self.assertIn("second stop signal", self.dec.log_text())


class TestStopBound(unittest.TestCase):
    def test_stop_timeout_fails_what_is_left(self):
        d = kvftest.tempdir()
        pre, dec = kvftest.pair(d, extra="stop-timeout-ms 300")
        try:
            with pre.client() as cp, dec.client() as cd:
                pp, pd = cp.pool_find("kv"), cd.pool_find("kv")
                cd.grant("bound-1", "prefill", descs(pd, 0, 2))
                cp.send("bound-1", "decode", descs(pp, 0, 1), more=True)  # never finished
                t0 = time.monotonic()
                pre.signal(signal.SIGTERM)
                ev = wait_event(cp, "bound-1", 5)
                self.assertEqual(ev.error_name, "ESHUTDOWN", ev)
                self.assertIn("stopped before the transfer finished", ev.error)
                self.assertEqual(pre.proc.wait(5), 0)
                self.assertLess(time.monotonic() - t0, 3)
                # The receiver hears of it from the stopping peer.
                ev = wait_event(cd, "bound-1", 5)
                self.assertFalse(ev.ok)
                self.assertIn("stop-timeout-ms (300) expired", pre.log_text())
        finally:
            pre.kill()
            dec.kill()


class TestReload(unittest.TestCase):
    def setUp(self):
        self.dir = kvftest.tempdir()
        self.a = Daemon(self.dir, "alpha", pool="16M", metrics=True)
        self.b = Daemon(self.dir, "beta", pool="16M")

    def tearDown(self):
        self.a.kill()
        self.b.kill()

    def reload(self, daemon, text):
        n = daemon.log_text().count("reload done") + daemon.log_text().count("reload refused")
        daemon.write_conf(text)
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: daemon.log_text().count("reload done") +
                 daemon.log_text().count("reload refused") > n, 5, "the reload")

    def peers_of(self, daemon):
        with daemon.client() as c:
            return {p["name"]: p for p in c.inspect("peers", json=True)["peers"]}

    def test_peers_limits_and_log_level(self):
        self.a.add_peer(self.b, port=kvftest.free_ports(1)[0])  # a wrong address first
        self.a.start()
        self.assertNotEqual(self.peers_of(self.a)["beta"]["state"], "up")
        # beta starts only now: had it run, its own dial could have brought
        # the link up from its side, whatever alpha's address for it
        self.b.add_peer(self.a)
        self.b.start()

        # Fix beta's address, lower a limit, raise the log level, and change
        # keys that need a restart.
        self.a.peers = [("beta", self.b.port)]
        text = self.a.config_text().replace("node alpha", "node gamma")
        text += "max-transfers-per-client 1\nlog-level debug\npool more host 4M\n"
        self.reload(self.a, text)
        self.a.wait_peers_up()
        log = self.a.log_text()
        self.assertIn("reload: peer beta readdressed", log)
        self.assertIn("reload: max-transfers-per-client: 4096 -> 1", log)
        self.assertIn("reload: log-level: info -> debug", log)
        self.assertIn("reload: node changed (alpha -> gamma) but only a restart applies it", log)
        self.assertIn("reload: pool changed", log)
        with self.a.client() as c:
            self.assertEqual(c.node, "alpha")
            self.assertEqual(len(c.pools()), 1)
            pool = c.pool_find("kv")
            c.grant("lim-1", None, [pool.desc(0, 4096)])
            with self.assertRaises(kvferry.KvferryError) as cm:
                c.grant("lim-2", None, [pool.desc(8192, 4096)])
            self.assertEqual(cm.exception.name, "KVF_ELIMIT")

        # Remove beta: it is said goodbye and no longer listed.
        self.a.peers = []
        self.reload(self.a, self.a.config_text())
        self.assertEqual(self.peers_of(self.a), {})
        wait_for(lambda: self.peers_of(self.b)["alpha"]["state"] != "up", 5, "beta to see alpha go")
        self.assertIn("reload: peer beta removed", self.a.log_text())

        # And back: the same slot comes back up.
        self.a.peers = [("beta", self.b.port)]
        self.reload(self.a, self.a.config_text())
        self.a.wait_peers_up()
        self.assertEqual(self.a.stop(), 0)

    def test_bad_file_changes_nothing(self):
        self.a.start()
        self.reload(self.a, self.a.config_text() + "max-clients 0\n")
        self.assertIn("reload refused", self.a.log_text())
        self.reload(self.a, self.a.config_text() + "peer alpha 127.0.0.1:9\n")  # its own name
        self.assertIn("has this node's own name", self.a.log_text())
        self.assertTrue(self.a.api_answers())
        import urllib.request
        with urllib.request.urlopen(self.a.metrics_url(), timeout=5) as r:
            text = r.read().decode()
        self.assertIn('kvferry_config_reloads_total{result="failed"} 2', text)
        self.assertIn('kvferry_config_reloads_total{result="ok"} 0', text)
        self.assertEqual(self.a.stop(), 0)


if __name__ == "__main__":
    kvftest.main()
