#!/usr/bin/env python3
"""What an adversarial tester and a new user broke (issue 15), against real
daemons:

- API slots (item 5): connections that never complete their Hello (nothing
  sent, or half a frame) must not hold the client slots forever. They are
  closed after api-hello-timeout-ms; meanwhile root and kvferryd's own
  user still get in (operator slots on top of max-clients), and an
  ordinary user gets in once the squatters are gone.
- A second daemon on a socket in use allocates nothing (item 12).
- A peer that does not list us says why it refuses (item 12)."""
import os
import socket
import subprocess
import sys
import time
import unittest

import kvftest

MAX_CLIENTS = 4
HELLO_TIMEOUT_MS = 600
NOBODY = 65534

# An ordinary user's client: connects (no waiting) and prints the node.
PROBE = """
import sys
sys.path.insert(0, sys.argv[2])
import kvferry
try:
    c = kvferry.Client(sys.argv[1], wait_ms=0, reconnect_ms=0)
    print("ok", c.node)
    c.close()
except kvferry.KvferryError as e:
    print("refused", e.name)
"""


def as_nobody():
    os.setgid(NOBODY)
    os.setuid(NOBODY)


class ApiSlots(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        extra = "max-clients %d\napi-hello-timeout-ms %d\napi-allow-users %d" % (
            MAX_CLIENTS, HELLO_TIMEOUT_MS, NOBODY)
        d = kvftest.tempdir()
        os.chmod(d, 0o755)  # the other user reaches the socket (the daemon makes it 0666)
        cls.d = kvftest.Daemon(d, "solo", pool="8M", extra=extra).start()

    @classmethod
    def tearDownClass(cls):
        assert cls.d.stop() == 0

    def probe_as_nobody(self):
        binding = os.path.join(kvftest.REPO, "client", "python")
        # the system's python: the user's own may live where nobody cannot read
        python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        out = subprocess.run([python, "-c", PROBE, self.d.sock, binding], capture_output=True,
                             text=True, timeout=30, preexec_fn=as_nobody, cwd="/",
                             env=kvftest.python_env())  # the ASan runtime in the SAN build
        return out.stdout.strip() or out.stderr.strip()

    def squat(self, n):
        """n connections that never say Hello; every other one sends half a frame."""
        socks = []
        for i in range(n):
            s = socket.socket(socket.AF_UNIX)
            s.connect(self.d.sock)
            if i % 2:
                s.sendall(b"\x40\x00\x00\x00\x08")  # a 64-byte frame's first byte
            socks.append(s)
        return socks

    def test_squatters_are_closed_and_operators_get_in(self):
        socks = self.squat(MAX_CLIENTS)
        try:
            t0 = time.monotonic()
            got = self.probe_as_nobody()
            self.assertTrue(got.startswith("refused KVF_ELIMIT"), "the slots are taken: an ordinary "
                            "user is refused; got: " + got[-500:])
            st = self.d.status()  # root: an operator slot
            self.assertGreaterEqual(st["clients"], MAX_CLIENTS)
            for s in socks:  # the daemon closes each one
                s.settimeout(HELLO_TIMEOUT_MS / 1000 * 4)
                self.assertEqual(s.recv(64), b"", "closed by the daemon")
            waited = time.monotonic() - t0
            self.assertLess(waited, HELLO_TIMEOUT_MS / 1000 * 4)
            got = self.probe_as_nobody()
            self.assertTrue(got.startswith("ok solo"), "a slot is free again; got: " + got[-500:])
            self.assertIn("no Hello within api-hello-timeout-ms", self.d.log_text())
        finally:
            for s in socks:
                s.close()

    def test_second_daemon_on_the_socket_allocates_nothing(self):
        """Issue 15, item 12: refused before its pools are made (a 4 GiB
        pool would otherwise be allocated and locked for nothing)."""
        other = kvftest.Daemon(kvftest.tempdir(), "second", pool="4G")
        other.sock = self.d.sock
        other.start(wait=False)
        self.assertNotEqual(other.proc.wait(30), 0)
        log = other.log_text()
        self.assertIn("another kvferryd is listening there", log)
        self.assertNotIn("pool kv:", log, "no pool was allocated")
        self.assertEqual(self.d.status()["node"], "solo", "the first one is untouched")


class PeerNotConfigured(unittest.TestCase):
    """Issue 15, item 12: a daemon dialling a peer that does not list it
    learns why (a Goodbye with the reason), not just a closed connection."""

    def test_the_refusal_says_why(self):
        d = kvftest.tempdir()
        a, b = kvftest.Daemon(d, "alpha", pool="4M"), kvftest.Daemon(d, "beta", pool="4M")
        a.add_peer(b)  # beta does not list alpha
        b.start()
        a.start()
        try:
            want = "node 'alpha' is not in the configuration of node 'beta'"
            kvftest.wait_for(lambda: want in a.log_text(), 10, "the reason in alpha's log")
            with a.client() as c:
                peer = c.inspect("peers", json=True)["peers"][0]
            self.assertIn(want, peer["last_error"])
        finally:
            self.assertEqual(a.stop(), 0)
            self.assertEqual(b.stop(), 0)


if __name__ == "__main__":
    kvftest.main()
