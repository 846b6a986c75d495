#!/usr/bin/env python3
"""kvferryd under a service manager: the sd_notify messages it sends to a
real NOTIFY_SOCKET (a datagram socket this test listens on), and their
order: STATUS= while starting, READY=1 only once the API socket and the
metrics endpoint answer, RELOADING=1 / READY=1 around SIGHUP, STOPPING=1
on SIGTERM, exit 0; a failed start never says READY=1; WATCHDOG=1 pings."""
import os
import signal
import socket
import time
import unittest
import urllib.request

import kvftest
from kvftest import Daemon


class NotifyListener:
    """A NOTIFY_SOCKET: each datagram is one message of KEY=value lines."""

    def __init__(self, dir):
        self.path = os.path.join(dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)

    def env(self, **extra):
        env = dict(os.environ, NOTIFY_SOCKET=self.path)
        env.update(extra)
        return env

    def next(self, timeout=10.0):
        """The next message as a dict, or None on timeout."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096).decode()
        except socket.timeout:
            return None
        return dict(line.split("=", 1) for line in data.split("\n") if "=" in line)

    def until(self, key, timeout=10.0):
        """Messages up to and including the first that has key."""
        seen = []
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = self.next(max(0.01, end - time.monotonic()))
            if m is None:
                break
            seen.append(m)
            if key in m:
                return seen
        raise AssertionError("no %s within %ss; got %r" % (key, timeout, seen))

    def close(self):
        self.sock.close()


class TestNotify(unittest.TestCase):
    def setUp(self):
        self.dir = kvftest.tempdir()
        self.n = NotifyListener(self.dir)
        self.d = None

    def tearDown(self):
        if self.d:
            self.d.kill()
        self.n.close()

    def test_start_reload_stop_in_order(self):
        self.d = Daemon(self.dir, "solo", pool="16M", metrics=True).start(self.n.env(), wait=False)
        before = self.n.until("READY")
        # At the moment READY=1 arrives, everything must already answer.
        self.assertTrue(self.d.api_answers(), "READY=1 before the API socket answers")
        url = self.d.metrics_url()
        with urllib.request.urlopen(url, timeout=5) as r:
            self.assertEqual(r.status, 200)
        statuses = [m["STATUS"] for m in before[:-1] if "STATUS" in m]
        self.assertTrue(statuses, "no STATUS= before READY=1: %r" % before)
        self.assertTrue(any("pool" in s for s in statuses), statuses)
        self.assertEqual(before[-1]["READY"], "1")
        self.assertIn("ready", before[-1].get("STATUS", ""))
        self.assertFalse(any("READY" in m or "STOPPING" in m for m in before[:-1]))

        self.d.signal(signal.SIGHUP)
        reload = self.n.until("READY")
        self.assertEqual(reload[0].get("RELOADING"), "1", reload)
        self.assertTrue(int(reload[0]["MONOTONIC_USEC"]) > 0)
        self.assertIn("reloaded", reload[-1]["STATUS"])

        self.d.signal(signal.SIGTERM)
        stopping = self.n.until("STOPPING")
        self.assertEqual(stopping[-1]["STOPPING"], "1")
        self.assertFalse(any("READY" in m for m in stopping))
        self.assertEqual(self.d.proc.wait(10), 0)

    def test_failed_reload_still_ready(self):
        self.d = Daemon(self.dir, "solo", pool="16M").start(self.n.env(), wait=False)
        self.n.until("READY")
        with open(self.d.conf, "a") as f:
            f.write("no-such-key 1\n")
        self.d.signal(signal.SIGHUP)
        msgs = self.n.until("READY")
        self.assertIn("RELOADING", msgs[0])
        self.assertIn("reload failed", msgs[-1]["STATUS"])
        self.assertIn("configuration not changed", self.d.log_text())
        self.assertTrue(self.d.api_answers())
        self.assertEqual(self.d.stop(), 0)

    def test_failed_start_is_never_ready(self):
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        d = Daemon(self.dir, "solo", pool="16M",
                   extra="metrics-listen 127.0.0.1:%d" % busy.getsockname()[1])
        self.d = d.start(self.n.env(), wait=False)
        try:
            rc = d.proc.wait(10)
        finally:
            busy.close()
        self.assertNotEqual(rc, 0)
        msgs = []
        while True:
            m = self.n.next(0.2)
            if m is None:
                break
            msgs.append(m)
        self.assertFalse(any("READY" in m for m in msgs), msgs)
        self.assertIn("start failed", msgs[-1].get("STATUS", ""), msgs)
        self.assertIn("metrics-listen", d.log_text())

    def test_watchdog_pings(self):
        env = self.n.env(WATCHDOG_USEC="200000")  # 200 ms: pings every 100 ms
        self.d = Daemon(self.dir, "solo", pool="16M").start(env, wait=False)
        self.n.until("READY")
        pings = self.n.until("WATCHDOG", timeout=2)
        self.assertEqual(pings[-1]["WATCHDOG"], "1")
        self.assertEqual(self.d.stop(), 0)


if __name__ == "__main__":
    kvftest.main()
