#!/usr/bin/env python3
"""A restarted peer is a new peer (issue 18): what is bound to its old
incarnation fails at once with KVF_EPEERLOST, never at its deadline, on
every path, and the new incarnation works:

- a grant pushed to a sender that then restarts (kill -9): the grant fails
  at once; the new sender's send of the same id does not meet it;
- sends bound to their grants (data under way, and those queued behind
  them in the transport) when the receiver restarts: each one completes
  (the receiver confirmed it) or fails with KVF_EPEERLOST (at the kill), or
  with KVF_EUNKNOWN when every byte had gone (they wait for the receiver's
  word, xfer_wait.c: the new incarnation says at once that it cannot
  know); none waits for its deadline;
- the same with registry members (connected on demand), where the
  registry's new incarnation also takes the old link down.

Every transfer that lands verifies every byte."""
import signal
import time
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
import kvfetcd
from kvftest import Daemon, wait_event, wait_for

import kvferry

DEADLINE_MS = 60000
AT_ONCE_S = 1.5  # RST on kill -9 (peer-timeout-ms 1000 would be the slow path)


def pattern(seed, n):
    block = bytes((seed * 131 + i * 7) & 0xFF for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


class Base(unittest.TestCase):
    REGISTRY = False

    def setUp(self):
        self.dir = kvftest.tempdir()
        self.clients, self.etcd = [], None
        extra = ""
        if self.REGISTRY:
            self.etcd = kvfetcd.Etcd(self.dir)
            self.addCleanup(self.etcd.kill)  # also when setUp fails later
            self.etcd.start()
            extra = "registry %s\nregistry-ttl-ms 2000\n" % self.etcd.url("inc")
        self.pre = Daemon(self.dir, "prefill", pool="64M", extra=extra)
        self.dec = Daemon(self.dir, "decode", pool="64M", extra=extra)
        self.addCleanup(self.pre.kill)
        self.addCleanup(self.dec.kill)
        if not self.REGISTRY:
            self.pre.add_peer(self.dec)
            self.dec.add_peer(self.pre)
        self.pre.start()
        self.dec.start()
        for d, other in ((self.pre, "decode"), (self.dec, "prefill")):
            wait_for(lambda: other in self.names(d), 10, "%s to know %s" % (d.name, other))

    def tearDown(self):
        for c in self.clients:
            c.close()
        for d in (self.pre, self.dec):
            d.kill()
        if self.etcd:
            self.etcd.kill()

    def names(self, d):
        with d.client() as c:
            return [p["name"] for p in c.inspect("peers", json=True)["peers"]]

    def client(self, d):
        c = d.client()
        self.clients.append(c)
        return c, c.pool_find("kv")

    def restart(self, d):
        d.kill()
        t0 = time.monotonic()
        d.start()
        return t0

    def test_pushed_grant_fails_when_the_sender_restarts(self):
        cd, pd = self.client(self.dec)
        cd.grant("push-1", "prefill", [(pd.id, 0, 4096)], deadline_ms=DEADLINE_MS)
        wait_for(lambda: self.pre.status()["pregrants"] == 1, 10, "the grant pushed to prefill")
        self.pre.kill()
        t0 = time.monotonic()
        ev = wait_event(cd, "push-1", 10, kvferry.RECV_DONE)
        took = time.monotonic() - t0
        self.assertEqual(ev.error_name, "KVF_EPEERLOST", ev)
        self.assertLess(took, AT_ONCE_S)
        # The new incarnation's send of that id does not meet the old grant.
        self.pre.start()
        cp, pp = self.client(self.pre)
        pp.memory[0:4096] = pattern(1, 4096)
        cp.send("push-1", "decode", [(pp.id, 0, 4096)], deadline_ms=800)
        self.assertEqual(wait_event(cp, "push-1", 10, kvferry.SEND_DONE).error_name, "KVF_EDEADLINE")
        # A fresh grant meets a fresh send.
        pd.memory[0:4096] = bytes(4096)
        cd.grant("push-2", "prefill", [(pd.id, 0, 4096)], deadline_ms=10000)
        cp.send("push-2", "decode", [(pp.id, 0, 4096)], deadline_ms=10000)
        wait_event(cd, "push-2", 10, kvferry.RECV_DONE).raise_for_status()
        self.assertEqual(bytes(pd.memory[0:4096]), pattern(1, 4096))

    def test_bound_and_queued_sends_fail_when_the_receiver_restarts(self):
        cp, pp = self.client(self.pre)
        cd, pd = self.client(self.dec)
        n, size = 12, 4 << 20
        pp.memory[0:size] = pattern(2, size)
        for i in range(n):
            cd.grant("q-%d" % i, "prefill", [(pd.id, (i % 12) * size, size)], deadline_ms=DEADLINE_MS)
        wait_for(lambda: self.pre.status()["pregrants"] == n, 10, "the grants pushed to prefill")
        # The receiver stops reading: the sends meet their grants and fill the
        # sockets, most of their data still to go when it dies.
        self.dec.signal(signal.SIGSTOP)
        for i in range(n):
            cp.send("q-%d" % i, "decode", [(pp.id, 0, size)], deadline_ms=DEADLINE_MS)
        wait_for(lambda: self.pre.status()["sends_active"] == n, 10, "the sends under way")
        self.dec.kill()
        t_kill = time.monotonic()
        self.dec.start()  # a new incarnation, at once (with a registry: once the old lease ran out)
        t_new = time.monotonic()
        outcomes = {}
        for i in range(n):
            ev = wait_event(cp, "q-%d" % i, 10, kvferry.SEND_DONE)
            outcomes[ev.error_name] = outcomes.get(ev.error_name, 0) + 1
        took = time.monotonic() - t_new
        print("# %d sends after the receiver's kill -9: %s; the new incarnation was up %.0f ms after the "
              "kill, every send had ended %.0f ms later" % (n, outcomes, (t_new - t_kill) * 1000, took * 1000),
              flush=True)
        self.assertLess(took, AT_ONCE_S)
        self.assertLessEqual(set(outcomes), {"OK", "KVF_EPEERLOST", "KVF_EUNKNOWN"}, outcomes)
        self.assertGreater(outcomes.get("KVF_EPEERLOST", 0), 0, outcomes)
        # The new incarnation is a new peer: transfers with it work.
        cd2, pd2 = self.client(self.dec)
        pd2.memory[0:size] = bytes(size)
        cd2.grant("after", "prefill", [(pd2.id, 0, size)], deadline_ms=10000)
        cp.send("after", "decode", [(pp.id, 0, size)], deadline_ms=10000)
        wait_event(cd2, "after", 15, kvferry.RECV_DONE).raise_for_status()
        wait_event(cp, "after", 15, kvferry.SEND_DONE).raise_for_status()
        self.assertEqual(bytes(pd2.memory[0:size]), pattern(2, size))


class TestStatic(Base):
    pass


@unittest.skipUnless(kvfetcd.ETCD, kvfetcd.SKIP_WHY)
class TestRegistry(Base):
    REGISTRY = True


del Base

if __name__ == "__main__":
    kvftest.main()
