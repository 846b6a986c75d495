#!/usr/bin/env python3
"""Engines that survive a daemon restart (issue 14), against real daemons:
kvf_connect_ex waiting for a daemon that is starting; the library
reconnecting by itself after kvferryd is killed under load (every transfer
in flight ends with KVF_EDAEMON, calls made meanwhile fail at once, the
first transfer after the new daemon says READY=1 succeeds within 100 ms);
pool and layout ids the engine holds still naming the same pools after the
new daemon numbered them differently; host pools remapped at the same
address; memory with no file refused with KVF_EINVAL. Every transfer
verifies every byte."""
import mmap
import os
import select
import signal
import socket
import threading
import time
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, wait_event, wait_for

import kvferry

MIB = 1 << 20
EDAEMON = kvferry.ERRORS["KVF_EDAEMON"]
EINVAL = kvferry.ERRORS["KVF_EINVAL"]
GOAL_MS = 100  # the first transfer after READY=1 (issue 14)


class Notify:
    """A NOTIFY_SOCKET the daemon says READY=1 on; a thread notes when."""

    def __init__(self, dir):
        self.path = os.path.join(dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.ready_at = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                return
            if b"READY=1" in data.split(b"\n"):
                self.ready_at.append(time.monotonic())

    def env(self):
        return dict(os.environ, NOTIFY_SOCKET=self.path)

    def close(self):
        self.sock.close()


def pattern(seed, n):
    """n bytes that differ per seed and per position."""
    block = bytes((seed * 131 + i * 7) & 0xFF for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


def self_transfer(c, xid, pool_id, mem, src, dst, n, seed, timeout=10.0):
    """Grant [dst, dst + n) and send [src, src + n) of one pool within one
    daemon; verifies every byte that landed. Returns the two events."""
    mem[src:src + n] = pattern(seed, n)
    mem[dst:dst + n] = bytes(n)
    c.grant(xid, None, [(pool_id, dst, n)])
    c.send(xid, c.node, [(pool_id, src, n)])
    evs = (wait_event(c, xid, timeout, kvferry.RECV_DONE), wait_event(c, xid, timeout, kvferry.SEND_DONE))
    for ev in evs:
        ev.raise_for_status()
    if bytes(mem[dst:dst + n]) != pattern(seed, n):
        raise AssertionError("%s: the bytes that landed differ from those sent" % xid)
    return evs


def fd_readable(fd):
    return bool(select.select([fd], [], [], 0)[0])


class TestConnectWaits(unittest.TestCase):
    def setUp(self):
        self.dir = kvftest.tempdir()
        self.d = Daemon(self.dir, "solo")

    def tearDown(self):
        self.d.kill()

    def test_connect_fails_at_once_without_wait(self):
        t0 = time.monotonic()
        with self.assertRaises(kvferry.KvferryError) as cm:
            kvferry.Client(self.d.sock, wait_ms=0)
        self.assertIn(cm.exception.name, ("ENOENT", "ECONNREFUSED"))
        self.assertLess(time.monotonic() - t0, 1.0)

    def test_connect_waits_for_a_starting_daemon(self):
        got = {}

        def connect():
            try:
                got["client"] = kvferry.Client(self.d.sock, wait_ms=20000)
                got["at"] = time.monotonic()
            except kvferry.KvferryError as e:
                got["error"] = e
        t = threading.Thread(target=connect)
        t.start()
        # The client is retrying before the daemon exists (no socket yet).
        self.assertFalse(os.path.exists(self.d.sock))
        wait_for(lambda: t.is_alive(), 5, "the connecting thread")
        self.d.start(wait=False)
        t.join(30)
        self.assertFalse(t.is_alive(), "kvf_connect_ex did not return")
        self.assertNotIn("error", got)
        with got["client"] as c:
            self.assertEqual(c.node, "solo")

    def test_connect_wait_is_bounded(self):
        t0 = time.monotonic()
        with self.assertRaises(kvferry.KvferryError):
            kvferry.Client(self.d.sock, wait_ms=300)
        took = time.monotonic() - t0
        self.assertGreaterEqual(took, 0.29)
        self.assertLess(took, 5.0)


class RestartableDaemon(unittest.TestCase):
    """A test case with one daemon "solo" (pool POOL) whose READY=1 comes
    to self.notify, killed at the end (tests restart it)."""
    POOL = "32M"

    def setUp(self):
        self.dir = kvftest.tempdir()
        self.notify = Notify(self.dir)
        self.d = Daemon(self.dir, "solo", pool=self.POOL)
        self.d.start(env=self.notify.env())

    def tearDown(self):
        self.d.kill()
        self.notify.close()


class TestRestart(RestartableDaemon):
    """One daemon, restarted under the engine's feet."""

    def restart(self, extra_pools=""):
        """kill -9, then a new daemon on the same socket (its config with
        extra_pools lines before kv). Returns the time the kill was sent."""
        t_kill = time.monotonic()
        self.d.kill()
        if extra_pools:
            text = self.d.config_text().replace("pool kv host", extra_pools + "\npool kv host")
            self.d.config_text = lambda: text
        n_ready = len(self.notify.ready_at)
        self.d.start(env=self.notify.env(), wait=False)
        wait_for(lambda: len(self.notify.ready_at) > n_ready, 20, "READY=1 from the new daemon")
        return t_kill

    def wait_reconnected(self, c):
        def up():
            try:
                c.pools()
                return True
            except kvferry.KvferryError as e:
                if e.code != EDAEMON:
                    raise
                return False
        wait_for(up, 20, "the library to reconnect")

    def test_restart_under_load(self):
        c = kvferry.Client(self.d.sock, reconnect_ms=30000)
        pool = c.pool_find("kv")
        mem = pool.memory
        addr = pool.address
        n = 2 * MIB
        stop = threading.Event()
        log = {"ok": [], "edaemon_events": 0, "refused": [], "errors": [], "done": []}

        def load():
            i = 0
            while not stop.is_set():
                i += 1
                xid = "load-%d" % i
                t_write = time.monotonic()
                try:
                    self_transfer(c, xid, pool.id, mem, (i % 4) * n, 8 * n + (i % 4) * n, n, i)
                    log["ok"].append(time.monotonic())
                    log["done"].append((time.monotonic(), None))
                except kvferry.KvferryError as e:
                    if e.code != EDAEMON:
                        log["errors"].append(repr(e))
                        return
                    if e.call == "transfer " + xid:
                        log["edaemon_events"] += 1  # in flight when the daemon died
                    else:
                        log["refused"].append(time.monotonic())
                        # A refused call took nothing: poll again (not a sync).
                        time.sleep(0.001)
                except AssertionError as e:
                    log["done"].append((time.monotonic(), str(e)))  # judged below
        # One grant always in flight when the daemon dies (nobody sends to it).
        c.grant("parked", None, [(pool.id, 30 * MIB, 4096)])
        t = threading.Thread(target=load)
        t.start()
        try:
            wait_for(lambda: len(log["ok"]) >= 5, 20, "transfers before the restart")
            t_kill = self.restart()
            t_ready = self.notify.ready_at[-1]
            wait_for(lambda: log["ok"] and log["ok"][-1] > t_ready or log["errors"], 20,
                     "a transfer after the restart")
        finally:
            stop.set()
            t.join(30)
        self.assertEqual(log["errors"], [])
        # Bytes that differ are an error, but for one transfer that ended
        # after the kill: the one whose source was written before the
        # library remapped the pool onto the new daemon's memory (which
        # starts empty, kvferry.h), so that the send moved that. Once a call
        # of the new daemon's has been answered the pool is remapped, and
        # later writes land in it. (Not judged by READY=1's time: the notify
        # thread notes it late, and the library remaps only once it
        # reconnects, later still.)
        differed = [(t, e) for t, e in log["done"] if e]
        self.assertEqual([e for t, e in differed if t <= t_kill], [])
        self.assertLessEqual(len(differed), 1, differed)
        self.assertEqual(wait_event(c, "parked", 5, kvferry.RECV_DONE).status, EDAEMON)
        first = min(x for x in log["ok"] if x > t_ready)
        ms = (first - t_ready) * 1000
        print("# restart under load: first transfer done %.1f ms after READY=1 (%.0f ms after kill -9); "
              "%d calls refused with KVF_EDAEMON meanwhile, %d transfers ended with KVF_EDAEMON" % (
                  ms, (first - t_kill) * 1000, len(log["refused"]), log["edaemon_events"]), flush=True)
        self.assertLess(ms, GOAL_MS, "first transfer %.1f ms after readiness" % ms)
        # The pool is mapped where it was: the engine's pointers stay valid.
        self.assertEqual(c.pool_map(pool)[0], addr)
        c.close()

    def test_in_flight_transfers_end_and_calls_fail_fast(self):
        c = kvferry.Client(self.d.sock, reconnect_ms=60000)
        pool = c.pool_find("kv")
        efd = c.event_fd()
        # A grant nobody sends to and a send nobody grants: both in flight.
        c.grant("waiting-grant", None, [(pool.id, 0, 4096)])
        c.send("waiting-send", "solo", [(pool.id, 8192, 4096)])
        self.d.kill()
        evs = {}
        wait_for(lambda: fd_readable(efd), 10, "the event fd to wake")
        for xid, typ in (("waiting-grant", kvferry.RECV_DONE), ("waiting-send", kvferry.SEND_DONE)):
            evs[xid] = wait_event(c, xid, 5, typ)
            self.assertEqual(evs[xid].status, EDAEMON, evs[xid])
        # Nothing left: the fd is quiet (no spinning) while reconnecting,
        # and every call fails at once.
        self.assertFalse(fd_readable(efd))
        for name, call in (("grant", lambda: c.grant("x1", None, [(pool.id, 0, 4096)])),
                           ("send", lambda: c.send("x2", "solo", [(pool.id, 0, 4096)])),
                           ("pools", c.pools),
                           ("wait_events", lambda: c.wait_events(1, 5000))):
            t0 = time.monotonic()
            with self.assertRaises(kvferry.KvferryError) as cm:
                call()
            took = (time.monotonic() - t0) * 1000
            self.assertEqual(cm.exception.code, EDAEMON, name)
            self.assertLess(took, 50, "%s took %.1f ms while disconnected" % (name, took))
        # Back again: the same ids work.
        self.restart()
        self.wait_reconnected(c)
        self_transfer(c, "waiting-grant", pool.id, pool.memory, 0, 16 * MIB, MIB, 3)
        c.close()

    def test_gives_up_after_reconnect_ms(self):
        c = kvferry.Client(self.d.sock, reconnect_ms=200)
        efd = c.event_fd()
        self.d.kill()
        # Gone for good: the fd stays raised and calls keep failing.
        wait_for(lambda: fd_readable(efd), 10, "the event fd raised once the library gave up")
        with self.assertRaises(kvferry.KvferryError) as cm:
            c.wait_events(1, 0)
        self.assertEqual(cm.exception.code, EDAEMON)
        self.d.start()
        with self.assertRaises(kvferry.KvferryError) as cm:
            c.pools()
        self.assertEqual(cm.exception.code, EDAEMON)
        c.close()

    def test_close_while_reconnecting(self):
        c = kvferry.Client(self.d.sock, reconnect_ms=60000)
        efd = c.event_fd()
        c.grant("pending", None, [(c.pool_find("kv").id, 0, 4096)])
        self.d.kill()
        wait_for(lambda: fd_readable(efd), 10, "the in-flight grant's event")
        t0 = time.monotonic()
        c.close()  # the reader is retrying: close stops it at once
        self.assertLess(time.monotonic() - t0, 1.0)

    def test_ids_translated_after_restart(self):
        c = kvferry.Client(self.d.sock)
        kv = c.pool_find("kv")
        mem, addr = kv.memory, kv.address
        bb = 64 * 1024
        layout = c.register_layout(pool=kv, offsets=[0, 4 * MIB], n_blocks=16, block_bytes=bb)
        old = (kv.id, layout)
        # The new daemon lists a pool before kv: kv's id there is another.
        self.restart(extra_pools="pool aa host 4M")
        self.wait_reconnected(c)
        names = {p.name: p.id for p in c.pools()}
        self.assertEqual(names["kv"], old[0], "kv keeps the id the engine holds")
        self.assertNotEqual(names["aa"], old[0])
        with kvferry.Client(self.d.sock) as fresh:
            daemon_id = fresh.pool_find("kv").id
            self.assertNotEqual(daemon_id, old[0], "the test needs the daemon to renumber kv")
            # Descriptors with the old id land in kv (the new daemon's,
            # mapped at the same address).
            self.assertEqual(c.pool_map(kv)[0], addr)
            self_transfer(c, "old-id", old[0], mem, 8 * MIB, 12 * MIB, MIB, 9)
            fresh_mem = fresh.pool_find("kv").memory
            self.assertEqual(bytes(fresh_mem[12 * MIB:13 * MIB]), pattern(9, MIB))
        # The layout the engine registered before, by its old id: blocks
        # 0..3 to blocks 8..11, both regions.
        for r in (0, 4 * MIB):
            mem[r:r + 4 * bb] = pattern(20 + r // MIB, 4 * bb)
            mem[r + 8 * bb:r + 12 * bb] = bytes(4 * bb)
        c.grant_blocks("old-layout", None, old[1], [8, 9, 10, 11])
        c.send_blocks("old-layout", "solo", old[1], [0, 1, 2, 3])
        wait_event(c, "old-layout", 10, kvferry.RECV_DONE).raise_for_status()
        wait_event(c, "old-layout", 10, kvferry.SEND_DONE).raise_for_status()
        for r in (0, 4 * MIB):
            self.assertEqual(bytes(mem[r + 8 * bb:r + 12 * bb]), pattern(20 + r // MIB, 4 * bb))
        c.free_layout(old[1])
        c.close()


class TestUnshareable(unittest.TestCase):
    """Memory with no file another process can map is refused, clearly,
    before anything reaches the daemon."""

    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        cls.d = Daemon(cls.dir, "solo", pool="4M").start()

    @classmethod
    def tearDownClass(cls):
        assert cls.d.stop() == 0

    def refused(self, obj):
        with kvferry.Client(self.d.sock) as c:
            with self.assertRaises(kvferry.KvferryError) as cm:
                c.register(obj)
            self.assertEqual(cm.exception.code, EINVAL)
            self.assertIn("memfd", str(cm.exception))
            self.assertEqual([p.name for p in c.pools()], ["kv"])

    def test_malloc_memory_refused(self):
        self.refused(bytearray(1 << 20))

    def test_anonymous_shared_memory_refused(self):
        m = mmap.mmap(-1, 1 << 20)  # MAP_SHARED | MAP_ANONYMOUS: no file
        self.refused(m)
        m.close()

    def test_private_mapping_of_a_memfd_refused(self):
        fd = os.memfd_create("private")
        os.ftruncate(fd, 1 << 20)
        m = mmap.mmap(fd, 1 << 20, flags=mmap.MAP_PRIVATE)
        self.refused(m)
        m.close()
        os.close(fd)


if __name__ == "__main__":
    kvftest.main()
