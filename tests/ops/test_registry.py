#!/usr/bin/env python3
"""Membership through etcd (issue 18): `registry etcd://HOST:PORT/PREFIX`,
against a real etcd (Debian's etcd-server) started by the test, and real
daemons that have no peer lines:

- daemons join through etcd and become each other's peers, without a
  reload; a static peer line works beside the registry;
- a daemon killed with SIGKILL leaves the others' membership when its lease
  expires (within registry-ttl-ms and a margin); one stopped with SIGTERM
  leaves at once (it revokes its lease); restarted, it is back;
- a second daemon claiming a live daemon's name is refused at start, with
  a clear error;
- etcd down: transfers go on between the members already known, status,
  doctor and metrics say that etcd is unreachable; etcd back (with its
  data: same leases; without: a new cluster) and the daemons are
  registered again and see each other.

Every transfer verifies every byte. Skips (loudly) without etcd."""
import json
import subprocess
import time
import unittest
import urllib.request

import kvftest  # first: puts the binding from the source tree on sys.path
import kvfetcd
from kvftest import Daemon, wait_event, wait_for

import kvferry

TTL_MS = 2000
N = 256 << 10


def pattern(seed, n):
    block = bytes((seed * 131 + i * 7) & 0xFF for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


class RegDaemon(Daemon):
    def __init__(self, dir, name, etcd, prefix, extra="", **kw):
        self.registry = "registry %s\nregistry-ttl-ms %d\n" % (etcd.url(prefix), TTL_MS)
        super().__init__(dir, name, pool="8M", metrics=True, extra=self.registry + extra, **kw)


class SlowSyncDaemon(RegDaemon):
    """A daemon of the failpoint build whose registry thread waits 1 s before
    each read of the membership (a slow etcd at start)."""

    failpoint = "registry-slow-sync"


def peer_names(d, state=None):
    with d.client() as c:
        return sorted(p["name"] for p in c.inspect("peers", json=True)["peers"]
                      if state is None or p["state"] == state)


def ctl(sock, *args):
    return subprocess.run([kvftest.KVFERRYCTL, "-s", sock] + list(args), capture_output=True,
                          text=True, timeout=30)


def doctor_row(d, name):
    doc = json.loads(ctl(d.sock, "--json", "doctor").stdout)
    return next(c for c in doc["checks"] if c["name"] == name)


def metric(d, name):
    with urllib.request.urlopen(d.metrics_url(), timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


@unittest.skipUnless(kvfetcd.ETCD, kvfetcd.SKIP_WHY)
class Base(unittest.TestCase):
    def setUp(self):
        self.dir = kvftest.tempdir()
        self.etcd = kvfetcd.Etcd(self.dir)
        self.addCleanup(self.etcd.kill)  # also when start() fails
        self.etcd.start()
        self.daemons, self.clients = [], []

    def tearDown(self):
        for c in self.clients:
            c.close()
        for d in self.daemons:
            d.kill()
        self.etcd.kill()

    def daemon(self, name, prefix="kvf", start=True, **kw):
        d = RegDaemon(self.dir, name, self.etcd, prefix, **kw)
        self.daemons.append(d)
        return d.start() if start else d

    def mesh(self, daemons):
        """Every daemon lists the others (members are connected on demand)."""
        names = sorted(d.name for d in daemons)
        for d in daemons:
            others = [n for n in names if n != d.name]
            wait_for(lambda: peer_names(d) == others, 10, "%s to list %s" % (d.name, others))

    def transfer(self, src, dst, xid, seed):
        cs, cd = src.client(), dst.client()
        self.clients += [cs, cd]
        ps, pd = cs.pool_find("kv"), cd.pool_find("kv")
        ps.memory[0:N] = pattern(seed, N)
        pd.memory[0:N] = bytes(N)
        cd.grant(xid, src.name, [(pd.id, 0, N)], deadline_ms=10000)
        cs.send(xid, dst.name, [(ps.id, 0, N)], deadline_ms=10000)
        wait_event(cd, xid, 15, kvferry.RECV_DONE).raise_for_status()
        wait_event(cs, xid, 15, kvferry.SEND_DONE).raise_for_status()
        self.assertEqual(bytes(pd.memory[0:N]), pattern(seed, N))


class TestJoinLeave(Base):
    def test_join_without_peer_lines(self):
        a, b, c = (self.daemon(n) for n in ("a", "b", "c"))
        self.mesh([a, b, c])
        self.transfer(a, b, "j-1", 1)
        self.transfer(c, a, "j-2", 2)
        st = a.status()["registry"]
        self.assertEqual((st["state"], st["reachable"], st["registered"], st["members"]),
                         ("registered", True, True, 2), st)
        self.assertEqual(doctor_row(a, "registry")["result"], "ok")
        self.assertEqual(metric(a, "kvferry_registry_registered"), 1)
        self.assertEqual(metric(a, "kvferry_registry_members"), 2)
        self.assertIn("registry        registered", ctl(a.sock, "status").stdout)

    def test_members_known_when_ready(self):
        """A daemon serves its clients only once it has the membership: a
        client's first send right after the start names a member without
        KVF_ENOPEER (it came early once, under load, in CI)."""
        a = self.daemon("a")
        cd = a.client()
        self.clients.append(cd)
        pd = cd.pool_find("kv")
        for n in range(3):
            pd.memory[0:N] = bytes(N)
            cd.grant("early-%d" % n, None, [(pd.id, 0, N)], deadline_ms=10000)  # from any node
            b = SlowSyncDaemon(self.dir, "b%d" % n, self.etcd, "kvf")
            self.daemons.append(b)
            b.start()  # returns once b is ready
            cs = b.client()
            self.clients.append(cs)
            ps = cs.pool_find("kv")
            ps.memory[0:N] = pattern(10 + n, N)
            cs.send("early-%d" % n, "a", [(ps.id, 0, N)], deadline_ms=10000)  # at once: no KVF_ENOPEER
            wait_event(cd, "early-%d" % n, 15, kvferry.RECV_DONE).raise_for_status()
            wait_event(cs, "early-%d" % n, 15, kvferry.SEND_DONE).raise_for_status()
            self.assertEqual(bytes(pd.memory[0:N]), pattern(10 + n, N))

    def test_static_peer_beside_the_registry(self):
        a = self.daemon("a", start=False)
        s = Daemon(self.dir, "static", pool="8M")  # no registry at all
        self.daemons.append(s)
        a.add_peer(s)
        s.add_peer(a)
        a.start()
        s.start()
        b = self.daemon("b")
        wait_for(lambda: peer_names(a) == ["b", "static"], 10, "a to list b and static")
        wait_for(lambda: peer_names(a, "up") == ["static"], 10, "a to have static (eager) up")
        self.transfer(s, a, "s-1", 3)
        self.transfer(b, a, "s-2", 4)
        self.assertEqual(a.status()["registry"]["members"], 1)

    def test_killed_member_leaves_within_the_ttl(self):
        a, b = self.daemon("a"), self.daemon("b")
        self.mesh([a, b])
        b.kill()
        t0 = time.monotonic()
        wait_for(lambda: peer_names(a) == [], 10, "b to leave a's membership")
        took = time.monotonic() - t0
        print("# a SIGKILLed member left after %.0f ms (ttl %d ms)" % (took * 1000, TTL_MS), flush=True)
        self.assertLess(took, TTL_MS / 1000 + 1.5)
        self.assertIn("registry: peer b removed", a.log_text())
        b.start()  # its old record is gone: it registers at once
        self.mesh([a, b])
        self.transfer(b, a, "k-1", 5)

    def test_stopped_member_leaves_at_once(self):
        a, b = self.daemon("a"), self.daemon("b")
        self.mesh([a, b])
        t0 = time.monotonic()
        self.assertEqual(b.stop(), 0)
        wait_for(lambda: peer_names(a) == [], 10, "b to leave a's membership")
        self.assertLess(time.monotonic() - t0, 1.5)  # lease revoked, not expired

    def test_restart_after_kill_waits_for_its_old_record(self):
        a, b = self.daemon("a"), self.daemon("b")
        self.mesh([a, b])
        b.kill()
        b.start()  # the old incarnation's lease still runs: b waits for it, then registers
        self.mesh([a, b])
        self.assertIn("waiting for that lease to expire", b.log_text())
        self.transfer(a, b, "r-1", 6)


class TestOnDemand(Base):
    """Members are dialed on first need and closed when idle; max-peers
    bounds live links, not members; peer-connect on-demand does the same
    for static peers."""
    IDLE = "peer-idle-close-ms 600\n"

    def test_connect_on_send_and_close_when_idle(self):
        a, b = self.daemon("a", extra=self.IDLE), self.daemon("b", extra=self.IDLE)
        self.mesh([a, b])
        self.assertEqual((peer_names(a, "idle"), peer_names(b, "idle")), (["b"], ["a"]))
        self.transfer(a, b, "d-1", 40)  # the send dials
        wait_for(lambda: peer_names(a, "idle") == ["b"] and peer_names(b, "idle") == ["a"], 10,
                 "both links idle again")
        self.assertEqual(metric(a, 'kvferry_peers{state="idle"}'), 1)
        self.assertEqual(doctor_row(a, "peers-up")["result"], "ok")  # idle is not down
        self.transfer(b, a, "d-2", 41)  # and the next need dials again
        self.assertNotIn("peer b down", a.log_text())  # idle closes are not losses

    def test_pushed_grant_dials(self):
        a, b = self.daemon("a"), self.daemon("b")
        self.mesh([a, b])
        cb = b.client()
        self.clients.append(cb)
        pb = cb.pool_find("kv")
        cb.grant("g-1", "a", [(pb.id, 0, 4096)], deadline_ms=10000)  # no send yet
        wait_for(lambda: peer_names(b, "up") == ["a"], 10, "b to dial a for its grant")
        cb.cancel("g-1")

    def test_max_peers_bounds_links_not_members(self):
        a = self.daemon("a", extra="max-peers 1\n")
        b, c = self.daemon("b"), self.daemon("c")
        self.mesh([a, b, c])
        self.transfer(a, b, "m-1", 42)
        self.assertEqual(peer_names(a, "up"), ["b"])
        self.transfer(a, c, "m-2", 43)  # b's idle link makes room
        self.assertEqual(peer_names(a, "up"), ["c"])
        self.assertEqual(peer_names(a), ["b", "c"])
        self.transfer(b, a, "m-3", 44)

    def test_static_peers_on_demand(self):
        s1 = Daemon(self.dir, "s1", pool="8M", extra="peer-connect on-demand\n" + self.IDLE)
        s2 = Daemon(self.dir, "s2", pool="8M", extra="peer-connect on-demand\n" + self.IDLE)
        self.daemons += [s1, s2]
        s1.add_peer(s2)
        s2.add_peer(s1)
        s1.start()
        s2.start()
        self.assertEqual(peer_names(s1, "idle"), ["s2"])
        self.transfer(s1, s2, "t-1", 45)
        wait_for(lambda: peer_names(s1, "idle") == ["s2"], 10, "s1's link to s2 idle again")


class TestDuplicate(Base):
    def test_live_name_is_refused_at_start(self):
        a = self.daemon("a")
        dup = RegDaemon(self.dir, "a", self.etcd, "kvf")
        dup.sock = dup.sock.replace("a.sock", "a2.sock")
        dup.log = dup.log.replace("a.log", "a2.log")
        dup.conf = dup.conf.replace("a.conf", "a2.conf")
        self.daemons.append(dup)
        dup.start(wait=False)
        rc = dup.proc.wait(TTL_MS / 1000 + 10)
        self.assertNotEqual(rc, 0)
        self.assertIn("node name 'a' is held by a live kvferryd of another incarnation", dup.log_text())
        self.assertEqual(a.status()["registry"]["state"], "registered")


class TestEtcdOutage(Base):
    def outage(self, wipe):
        a, b = self.daemon("a"), self.daemon("b")
        self.mesh([a, b])
        self.etcd.kill()
        wait_for(lambda: a.status()["registry"]["state"] == "unreachable", 10, "a to see etcd down")
        # The members stay, transfers go on.
        for i in range(3):
            self.transfer(a, b, "o-%d-%d" % (wipe, i), 10 + i)
            self.transfer(b, a, "p-%d-%d" % (wipe, i), 20 + i)
        st = a.status()["registry"]
        self.assertEqual((st["reachable"], st["members"]), (False, 1), st)
        self.assertTrue(st["last_error"], st)
        self.assertEqual(peer_names(a), ["b"])
        row = doctor_row(a, "registry")
        self.assertEqual(row["result"], "fail", row)
        self.assertIn("unreachable", row["detail"])
        self.assertEqual(metric(a, "kvferry_registry_reachable"), 0)
        self.assertIn("registry        unreachable", ctl(a.sock, "status").stdout)
        t0 = time.monotonic()
        self.etcd.start(wipe=wipe)
        for d in (a, b):
            wait_for(lambda: d.status()["registry"]["state"] == "registered", 10,
                     "%s registered again" % d.name)
        print("# registered again %.0f ms after etcd came back (%s)" % (
            (time.monotonic() - t0) * 1000, "new cluster" if wipe else "same data"), flush=True)
        self.assertEqual(metric(a, "kvferry_registry_reachable"), 1)
        self.mesh([a, b])
        self.transfer(a, b, "q-%d" % wipe, 30)
        return a, b

    def test_etcd_restarts_with_its_data(self):
        self.outage(wipe=False)

    def test_etcd_comes_back_empty(self):
        a, b = self.outage(wipe=True)
        # Both records are back in the new cluster: each registered twice.
        for d in (a, b):
            self.assertGreaterEqual(d.status()["registry"]["registrations"], 2)
        c = self.daemon("c")  # and the membership works on: a newcomer joins
        self.mesh([a, b, c])


if __name__ == "__main__":
    kvftest.main()
