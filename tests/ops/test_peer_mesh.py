#!/usr/bin/env python3
"""Mesh formation (issue 15, item 8): N daemons, each configured with all
the others, started at the same moment, so every pair dials each other at
once. Each pair must end with one link that never went down: every peer
up with ups == 1 and downs == 0, and no "peer X down" line in any log,
for a while after the mesh is whole. Before the fix a side could see the
losing connection closed (by the other side, as the tie-break's loser)
before it read the winner's Hello, and took the peer down.

form_mesh() is also what bench/peer_mesh.py runs, many rounds, 16 daemons."""
import os
import random
import socket
import time
import unittest

import kvftest
from kvftest import Daemon, wait_for

# Long enough that a loaded 2-core machine starting N daemons does not miss
# heartbeats: a drop counted here is the dial race, not a slow loop.
EXTRA = "heartbeat-ms 200\npeer-timeout-ms 5000"
WATCH_S = 1.5  # the links must stay up this long after the mesh is whole


def peers_of(d):
    if d.proc.poll() is not None:
        raise AssertionError("%s exited with %s:\n%s" % (d.name, d.proc.returncode, d.log_text()[-3000:]))
    with d.client() as c:
        return c.inspect("peers", json=True)["peers"]


def quiet_ports(n):
    """n free ports below the ephemeral range: with many daemons dialing
    each other at once, a port picked from that range (free_ports) may be
    taken as the source port of some dial before its daemon listens."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = []
    for port in range(max(1024, low - 12000) + random.randrange(8000), low):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            ports.append(port)
        except OSError:
            pass
        finally:
            s.close()
        if len(ports) == n:
            return ports
    return kvftest.free_ports(n)


def form_mesh(n, dir=None, extra=EXTRA, watch_s=WATCH_S, timeout=60):
    """Starts n daemons at once, waits for the whole mesh, watches it for
    watch_s; stops them. Returns (seconds to form, drops, details): drops
    counts the downs the peers report; details lists them, with every
    "down:" or refusal line of the logs (none is expected)."""
    dir = dir or kvftest.tempdir()
    ds = [Daemon(dir, "m%02d" % i, pool=None, extra=extra) for i in range(n)]
    for d, port in zip(ds, quiet_ports(n)):
        d.port = port
    for a in ds:
        for b in ds:
            if a is not b:
                a.add_peer(b)
    try:
        t0 = time.monotonic()
        for d in ds:
            d.start(wait=False)
        for d in ds:
            d.wait_ready()

        def whole():
            return all(len(ps) == n - 1 and all(p["state"] == "up" for p in ps)
                       for ps in map(peers_of, ds))
        wait_for(whole, timeout, "a whole mesh of %d daemons" % n, step=0.1)
        formed = time.monotonic() - t0
        end = time.monotonic() + watch_s
        while time.monotonic() < end:
            whole_now = whole()
            if not whole_now:
                break
            time.sleep(0.1)
        details = []
        drops = 0
        for d in ds:
            for p in peers_of(d):
                if p["downs"] or p["ups"] != 1 or p["state"] != "up":
                    details.append("%s sees %s: state %s, ups %d, downs %d, last error %r" % (
                        d.name, p["name"], p["state"], p["ups"], p["downs"], p.get("last_error")))
                drops += p["downs"]
            for line in d.log_text().splitlines():
                if " down: " in line or "refused" in line or "closed a peer connection" in line:
                    details.append("%s: %s" % (d.name, line))
        for d in ds:
            if d.stop() != 0:
                details.append("%s exited badly:\n%s" % (d.name, d.log_text()[-2000:]))
        return formed, drops, details
    finally:
        for d in ds:
            d.kill()


class TestMeshFormation(unittest.TestCase):
    N = int(os.environ.get("KVF_MESH_N", "16"))
    ROUNDS = int(os.environ.get("KVF_MESH_ROUNDS", "4"))

    def test_simultaneous_dials_keep_one_link_without_a_drop(self):
        for r in range(self.ROUNDS):
            formed, drops, details = form_mesh(self.N)
            self.assertEqual(details, [], "round %d: %d drops while %d daemons formed a mesh" % (
                r, drops, self.N))


if __name__ == "__main__":
    kvftest.main()
