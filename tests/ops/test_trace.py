#!/usr/bin/env python3
"""Where a transfer's time went (issue 16): `kvferryctl transfers --trace`
lists the last finished transfers of each daemon with their hops, and the
metrics count them in kvferry_transfer_hop_seconds. Transfers over tcp
(two daemons) and local (one daemon, two clients), every byte verified;
the hops are never negative and sum to the total, and each histogram's
count grows by exactly the transfers made. Also: an idle daemon does not
spin once traffic stops (spin.h's windows close)."""
import json
import os
import subprocess
import time
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
import kvferry
from kvftest import KVFERRYCTL, wait_event

from test_metrics import check_histograms, parse_exposition, scrape, value

BLK = 64 << 10
HOPS = ("post_to_pair", "pair_to_first", "first_to_last", "last_to_event")


def ctl(daemon, *args):
    return subprocess.run([KVFERRYCTL, "-s", daemon.sock] + list(args), capture_output=True, text=True,
                          timeout=30)


def trace(daemon):
    r = ctl(daemon, "transfers", "--trace", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["transfers"]


def hop_counts(daemon):
    fams = parse_exposition(scrape(daemon.metrics_url())[2])
    return fams, {(role, hop): value(fams, "kvferry_transfer_hop_seconds", "kvferry_transfer_hop_seconds_count",
                                     role=role, hop=hop)
                  for role in ("send", "recv") for hop in HOPS + ("total",)}


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class TestTrace(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        # spin-cadence-us 10 ms: test_layer_parts_find_the_loop_polling's
        # windows, wide enough for a loaded 2-core machine's scheduling.
        cls.pre, cls.dec = kvftest.pair(cls.dir, pool="32M", metrics=True, extra="spin-cadence-us 10000\n")
        # KVFERRY_SOON_POLL=1: these clients take a Soon on any machine (a
        # library on fewer than 4 CPUs says no_soon: test_no_soon_...)
        with kvftest.environ(KVFERRY_SOON_POLL="1"):
            cls.cp, cls.cd, cls.cd2 = cls.pre.client(), cls.dec.client(), cls.dec.client()
        cls.pp, cls.pd = cls.cp.pool_find("kv"), cls.cd.pool_find("kv")
        cls.pd2 = cls.cd2.pool_find("kv")

    @classmethod
    def tearDownClass(cls):
        for c in (cls.cp, cls.cd, cls.cd2):
            c.close()
        for d in (cls.pre, cls.dec):
            rc = d.stop()
            assert rc == 0, "%s exited %s" % (d.name, rc)

    def handoff(self, xid, src_client, src_pool, src_node, dst_node, n, off, dst=None):
        """n x 64 KiB of fresh random bytes at off, granted on decode (by
        self.cd, or dst: a client and its pool) and sent from src_client;
        every byte checked."""
        cd, pd = dst or (self.cd, self.pd)
        data = os.urandom(n * BLK)
        src_pool.memory[off:off + len(data)] = data
        pd.memory[off + (8 << 20):off + (8 << 20) + len(data)] = bytes(len(data))
        cd.grant(xid, src_node, [pd.desc(off + (8 << 20) + i * BLK, BLK) for i in range(n)])
        src_client.send(xid, dst_node, [src_pool.desc(off + i * BLK, BLK) for i in range(n)])
        self.assertTrue(wait_event(cd, xid).ok)
        self.assertTrue(wait_event(src_client, xid).ok)
        self.assertEqual(bytes(pd.memory[off + (8 << 20):off + (8 << 20) + len(data)]), data)

    def check_record(self, rec, role, path, nbytes):
        self.assertEqual(rec["role"], role)
        self.assertEqual(rec["path"], path)
        self.assertEqual(rec["bytes"], nbytes)
        self.assertEqual(rec["status"], "ok")
        hops = [rec[h + "_us"] for h in HOPS]
        for h, v in zip(HOPS, hops):
            self.assertGreaterEqual(v, 0, "%s of %s" % (h, rec))
        # printed with 3 decimals each: the sum is within rounding of the total
        self.assertAlmostEqual(sum(hops), rec["total_us"], delta=0.005, msg=rec)
        self.assertGreater(rec["total_us"], 0, rec)
        if rec["result_us"] is not None:
            self.assertGreaterEqual(rec["result_us"], 0, rec)

    def test_tcp_and_local(self):
        _, before_dec = hop_counts(self.dec)
        _, before_pre = hop_counts(self.pre)
        tcp_ids = ["tr-tcp-%d" % i for i in range(5)]
        for i, xid in enumerate(tcp_ids):  # 4 x 64 KiB: spread over the streams
            self.handoff(xid, self.cp, self.pp, "prefill", "decode", 4, i * 4 * BLK)
        self.handoff("tr-small", self.cp, self.pp, "prefill", "decode", 1, 6 << 20)  # one stream
        local_ids = ["tr-local-%d" % i for i in range(2)]
        for i, xid in enumerate(local_ids):
            self.handoff(xid, self.cd2, self.pd2, "decode", "decode", 2, (4 << 20) + i * 2 * BLK)

        sent = {r["id"]: r for r in trace(self.pre) if r["role"] == "send"}
        got = {r["id"]: r for r in trace(self.dec) if r["role"] == "recv"}
        local_sent = {r["id"]: r for r in trace(self.dec) if r["role"] == "send"}
        for xid in tcp_ids:
            self.check_record(sent[xid], "send", "tcp", 4 * BLK)
            self.check_record(got[xid], "recv", "tcp", 4 * BLK)
            self.assertEqual(sent[xid]["peer"], "decode")
            self.assertEqual(got[xid]["peer"], "prefill")
            # tcp stamps its first and last byte on its threads: time passes
            self.assertGreater(sent[xid]["first_to_last_us"], 0, sent[xid])
            self.assertGreater(got[xid]["first_to_last_us"], 0, got[xid])
            # each side heard from the other before its event
            self.assertIsNotNone(sent[xid]["result_us"])
            self.assertLessEqual(sent[xid]["result_us"], sent[xid]["total_us"] + 0.005)
        self.check_record(sent["tr-small"], "send", "tcp", BLK)
        self.check_record(got["tr-small"], "recv", "tcp", BLK)
        for xid in local_ids:
            self.check_record(local_sent[xid], "send", "local", 2 * BLK)
            self.check_record(got[xid], "recv", "local", 2 * BLK)

        fams, after_dec = hop_counts(self.dec)
        check_histograms(self, fams)
        fams, after_pre = hop_counts(self.pre)
        check_histograms(self, fams)
        n_tcp = len(tcp_ids) + 1
        for hop in HOPS + ("total",):
            self.assertEqual(after_pre[("send", hop)] - before_pre[("send", hop)], n_tcp, hop)
            self.assertEqual(after_dec[("recv", hop)] - before_dec[("recv", hop)], n_tcp + len(local_ids), hop)
            self.assertEqual(after_dec[("send", hop)] - before_dec[("send", hop)], len(local_ids), hop)

    def test_failure_listed_not_counted(self):
        _, before = hop_counts(self.dec)
        self.cd.grant("tr-late", "prefill", [self.pd.desc(20 << 20, BLK)], deadline_ms=100)
        self.assertEqual(wait_event(self.cd, "tr-late").error_name, "KVF_EDEADLINE")
        rec = [r for r in trace(self.dec) if r["id"] == "tr-late"]
        self.assertEqual(len(rec), 1, rec)
        self.assertEqual(rec[0]["status"], "KVF_EDEADLINE")
        self.assertEqual(rec[0]["role"], "recv")
        self.assertAlmostEqual(sum(rec[0][h + "_us"] for h in HOPS), rec[0]["total_us"], delta=0.005)
        self.assertGreaterEqual(rec[0]["total_us"], 100e3 * 0.9, rec)  # it waited for its deadline
        _, after = hop_counts(self.dec)
        self.assertEqual(after, before)  # the histograms count successes only

    def test_tables(self):
        self.handoff("tr-table", self.cp, self.pp, "prefill", "decode", 1, 7 << 20)
        r = ctl(self.dec, "transfers", "--trace")
        self.assertEqual(r.returncode, 0, r.stderr)
        head = r.stdout.splitlines()[0].split()
        self.assertEqual(head[:5], ["ID", "ROLE", "PEER", "PATH", "BYTES"])
        self.assertIn("POST>PAIR", head)
        self.assertTrue(any(l.startswith("tr-table ") for l in r.stdout.splitlines()), r.stdout)
        plain = ctl(self.dec, "transfers")  # unchanged without --trace: live transfers
        self.assertEqual(plain.returncode, 0, plain.stderr)
        self.assertIn("STATE", plain.stdout.splitlines()[0])
        self.assertNotIn("tr-table", plain.stdout)
        self.assertEqual(ctl(self.dec, "status", "--trace").returncode, 2)

    def cadence(self, daemon):
        fams = parse_exposition(scrape(daemon.metrics_url())[2])
        return (value(fams, "kvferry_spin_cadence_windows_total", "kvferry_spin_cadence_windows_total"),
                value(fams, "kvferry_spin_cadence_parts_total", "kvferry_spin_cadence_parts_total", loop="polling"),
                value(fams, "kvferry_spin_cadence_parts_total", "kvferry_spin_cadence_parts_total", loop="woken"))

    def test_layer_parts_find_the_loop_polling(self):
        """spin-cadence-us (10 ms here): six parts of a send, 60 ms apart
        (far past spin-us and spin-grant-us: each would find the loop asleep),
        on a fixed schedule as a prefill's layers come: parts 2 to 5 each
        open a window around the next one's due time, and parts 3 to 6 come
        at a known cadence, most of them to a polling loop. Every byte
        checked."""
        n, gap = 6, 0.060
        before = self.cadence(self.pre)
        off = 4 << 20
        data = os.urandom(n * BLK)
        self.pp.memory[off:off + len(data)] = data
        dst = off + (8 << 20)
        self.pd.memory[dst:dst + len(data)] = bytes(len(data))
        self.cd.grant("tr-cad", "prefill", [self.pd.desc(dst + i * BLK, BLK) for i in range(n)])
        t0 = time.monotonic()
        for i in range(n):
            time.sleep(max(0.0, t0 + i * gap - time.monotonic()))
            self.cp.send("tr-cad", "decode", [self.pp.desc(off + i * BLK, BLK)], more=i < n - 1)
        self.assertTrue(wait_event(self.cd, "tr-cad").ok)
        self.assertTrue(wait_event(self.cp, "tr-cad").ok)
        self.assertEqual(bytes(self.pd.memory[dst:dst + len(data)]), data)
        after = self.cadence(self.pre)
        windows, polled, woken = (a - b for a, b in zip(after, before))
        self.assertEqual(windows, n - 2)
        self.assertEqual(polled + woken, n - 2)
        self.assertGreaterEqual(polled, 2, "parts 3-6: %d found the loop polling, %d woke it" % (polled, woken))

    def test_last_layer_told_soon_ahead(self):
        """A local layer-wise send of blocks at a steady cadence (60 ms,
        spin-cadence-us 10 ms): the window the daemon opens ahead of the
        last part also tells the receiving client Soon (api_soon), once:
        not ahead of earlier parts, and not for a send to another node
        (the tcp case before it in this class sends descriptors). Host
        pools: no copy launch tells one. Every byte checked."""
        n_layers, nb, bb, gap = 6, 4, 16 << 10, 0.060
        base = 16 << 20
        src = kvferry.Layout(self.pd2, [base + r * nb * bb for r in range(2 * n_layers)], nb, bb)
        dst = kvferry.Layout(self.pd, [base + (4 << 20) + r * nb * bb for r in range(2 * n_layers)], nb, bb)
        ls, ld = self.cd2.register_layout(src), self.cd.register_layout(dst)
        data = os.urandom(2 * n_layers * nb * bb)
        self.pd2.memory[base:base + len(data)] = data
        self.pd.memory[base + (4 << 20):base + (4 << 20) + len(data)] = bytes(len(data))
        ids = list(range(nb))
        before = self.dec.status()["api_soon"]
        self.cd.grant_blocks("tr-soon", "decode", ld, ids)
        t0 = time.monotonic()
        for layer in range(n_layers):
            time.sleep(max(0.0, t0 + layer * gap - time.monotonic()))
            self.cd2.send_blocks("tr-soon", "decode", ls, ids if layer == 0 else None, first_layer=layer,
                                 n_layers=1, more=layer < n_layers - 1)
        self.assertTrue(wait_event(self.cd, "tr-soon").ok)
        self.assertTrue(wait_event(self.cd2, "tr-soon").ok)
        self.assertEqual(bytes(self.pd.memory[base + (4 << 20):base + (4 << 20) + len(data)]), data)
        self.assertEqual(self.dec.status()["api_soon"] - before, 1)
        self.assertEqual(self.cd.wait_events(16, 0), [])  # the Soon is no event
        self.cd.free_layout(ld)
        self.cd2.free_layout(ls)

    def test_tcp_grant_told_soon_at_its_first_bytes(self):
        """Over tcp the receiving daemon learns a grant's data began with its
        first batch: once a grant landed (the rate is known), each grant's
        engine hears Soon then (api_soon), one per grant, no event; where
        the rest would take longer than 2 ms at that rate, nothing (here:
        the first 64 KiB of a 22 MiB grant, the rest held back). Every
        byte checked."""
        self.handoff("tr-soon-0", self.cp, self.pp, "prefill", "decode", 1, 3 << 20)  # the rate
        for i in range(1, 4):
            before = self.dec.status()["api_soon"]
            self.handoff("tr-soon-%d" % i, self.cp, self.pp, "prefill", "decode", 1, 3 << 20)
            self.assertEqual(self.dec.status()["api_soon"] - before, 1, i)
            self.assertEqual(self.cd.wait_events(16, 0), [])  # a Soon is no event
        n = 350  # 22 MiB: past 2 ms
        data = os.urandom(n * BLK)
        self.pp.memory[0:len(data)] = data
        before = self.dec.status()["api_soon"]
        self.cd.grant("tr-soon-big", "prefill", [self.pd.desc((8 << 20) + i * BLK, BLK) for i in range(n)])
        self.cp.send("tr-soon-big", "decode", [self.pp.desc(0, BLK)], more=True)
        time.sleep(0.1)  # the first part landed
        self.assertEqual(self.dec.status()["api_soon"] - before, 0)
        self.cp.send("tr-soon-big", "decode", [self.pp.desc(i * BLK, BLK) for i in range(1, n)])
        self.assertTrue(wait_event(self.cd, "tr-soon-big").ok)
        self.assertTrue(wait_event(self.cp, "tr-soon-big").ok)
        self.assertEqual(bytes(self.pd.memory[8 << 20:(8 << 20) + len(data)]), data)

    def test_tcp_parts_after_a_pause_told_soon_again(self):
        """A layer-wise send's parts come a layer's compute apart, and the
        receiving engine's threads sleep through each. Over tcp, besides the
        grant's first batch, each part that comes after a pause (PART_GAP_US)
        tells the engine Soon when the rest would land within 2 ms: here 4
        parts 20 ms apart hear up to 4, at least one after the first part
        (the last part's rest is one part: within 2 ms unless that part
        took longer to land), no event among them; the same bytes sent
        whole hear at most 1. Every byte checked."""
        self.handoff("tr-parts-rate", self.cp, self.pp, "prefill", "decode", 1, 3 << 20)  # the rate
        n, off = 4, 5 << 20
        data = os.urandom(n * BLK)
        self.pp.memory[off:off + len(data)] = data
        self.pd.memory[off:off + len(data)] = bytes(len(data))
        before = self.dec.status()["api_soon"]
        self.cd.grant("tr-parts", "prefill", [self.pd.desc(off + i * BLK, BLK) for i in range(n)])
        for i in range(n):
            if i == 1:
                after_first = self.dec.status()["api_soon"]
            self.cp.send("tr-parts", "decode", [self.pp.desc(off + i * BLK, BLK)], more=i < n - 1)
            if i < n - 1:
                time.sleep(0.02)
                self.assertEqual(self.cd.wait_events(16, 0), [])  # a Soon is no event
        self.assertTrue(wait_event(self.cd, "tr-parts").ok)
        self.assertTrue(wait_event(self.cp, "tr-parts").ok)
        self.assertEqual(bytes(self.pd.memory[off:off + len(data)]), data)
        end = self.dec.status()["api_soon"]
        self.assertLessEqual(end - before, n)
        self.assertGreaterEqual(end - after_first, 1)  # told again after the first part
        self.handoff("tr-parts-whole", self.cp, self.pp, "prefill", "decode", n, off)
        self.assertLessEqual(self.dec.status()["api_soon"] - end, 1)

    def decode_client(self, soon_poll):
        """A decode client connected with KVFERRY_SOON_POLL=soon_poll, or
        (None) without it and without KVFERRY_SPIN_US, from this thread
        pinned to one CPU meanwhile (the library counts the CPUs it may run
        on at connect)."""
        cpus = os.sched_getaffinity(0)
        with kvftest.environ(KVFERRY_SOON_POLL=soon_poll, KVFERRY_SPIN_US=None):
            try:
                if soon_poll is None:
                    os.sched_setaffinity(0, {min(cpus)})
                return self.dec.client()
            finally:
                os.sched_setaffinity(0, cpus)

    def test_no_soon_where_no_cpu_is_spare(self):
        """Polling on a Soon takes a CPU while the data still moves through
        this host's threads: on 2 CPUs it starved the handoff it waited for
        (bench/RESULTS.md). A library that may run on fewer than 4 CPUs
        (connected from a thread pinned to one), or told KVFERRY_SOON_POLL=0,
        says no_soon in its Hello: its tcp grants hear no Soon (api_soon
        still) and move as before; KVFERRY_SOON_POLL=1 (self.cd) takes one
        on any machine. Every byte checked."""
        self.handoff("tr-nosoon-rate", self.cp, self.pp, "prefill", "decode", 1, 3 << 20)  # the rate
        for how in (None, "0"):
            c = self.decode_client(how)
            try:
                before = self.dec.status()["api_soon"]
                self.handoff("tr-nosoon-%s" % how, self.cp, self.pp, "prefill", "decode", 1, 3 << 20,
                             dst=(c, c.pool_find("kv")))
                self.assertEqual(self.dec.status()["api_soon"] - before, 0, how)
            finally:
                c.close()
        before = self.dec.status()["api_soon"]
        self.handoff("tr-nosoon-told", self.cp, self.pp, "prefill", "decode", 1, 3 << 20)
        self.assertEqual(self.dec.status()["api_soon"] - before, 1)

    def test_idle_daemon_sleeps(self):
        """spin-us and spin-grant-us are windows: once transfers stop, the
        daemons use under 5% of a core (measured over 2 s, after the
        windows' 10 ms)."""
        self.handoff("tr-idle", self.cp, self.pp, "prefill", "decode", 2, (8 << 20) - 2 * BLK)
        time.sleep(0.2)  # past spin-grant-us (10 ms) and spin-us
        t0 = {d.name: cpu_seconds(d.proc.pid) for d in (self.pre, self.dec)}
        start = time.monotonic()
        time.sleep(2.0)
        wall = time.monotonic() - start
        for d in (self.pre, self.dec):
            share = (cpu_seconds(d.proc.pid) - t0[d.name]) / wall
            self.assertLess(share, 0.05, "%s used %.1f%% of a core while idle" % (d.name, share * 100))


def threads_cpu(pid, name):
    """CPU seconds of each of pid's threads called name, by thread id."""
    out = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                if f.read().strip() != name:
                    continue
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # gone meanwhile
        out[tid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def thread_cpu(pid, name):
    """CPU seconds of pid's threads called name, together."""
    return sum(threads_cpu(pid, name).values())


class PairTest(unittest.TestCase):
    """A prefill and a decode daemon for the class (32 MiB pools, EXTRA and
    EXTRA_OF config lines), one client on each (cp, cd; with SOON_POLL they
    take a Soon on any machine) and their pools (pp, pd); each daemon must
    exit 0 at the end."""
    EXTRA, EXTRA_OF, SOON_POLL = "", None, False

    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        cls.pre, cls.dec = kvftest.pair(cls.dir, pool="32M", extra=cls.EXTRA, extra_of=cls.EXTRA_OF)
        with kvftest.environ(**({"KVFERRY_SOON_POLL": "1"} if cls.SOON_POLL else {})):
            cls.cp, cls.cd = cls.pre.client(), cls.dec.client()
        cls.pp, cls.pd = cls.cp.pool_find("kv"), cls.cd.pool_find("kv")

    @classmethod
    def tearDownClass(cls):
        for c in (cls.cp, cls.cd):
            c.close()
        for d in (cls.pre, cls.dec):
            rc = d.stop()
            assert rc == 0, "%s exited %s" % (d.name, rc)


class TestGrantWakesThreads(PairTest):
    """spin-grant-us promises that a grant keeps the data path polling
    until its data comes: the receiving daemon's tcp receivers from the
    grant's opening, the sending daemon's tcp senders from the grant
    reaching it. Threads asleep when the window opens are woken to poll
    (spin.h's wakers), instead of sleeping until the data wakes them. Here
    the window is 600 ms, the grant's send never comes: over 400 ms of it
    each side's threads use CPU time (they poll); after it, none (the
    kernel counts in 10 ms ticks)."""
    WINDOW_US = 600000

    EXTRA = "spin-grant-us %d\n" % WINDOW_US

    def polled(self):
        """CPU seconds over 400 ms: prefill's senders, decode's receivers."""
        t0 = (thread_cpu(self.pre.proc.pid, "kvf-tcp-send"), thread_cpu(self.dec.proc.pid, "kvf-tcp-recv"))
        time.sleep(0.4)
        t1 = (thread_cpu(self.pre.proc.pid, "kvf-tcp-send"), thread_cpu(self.dec.proc.pid, "kvf-tcp-recv"))
        return t1[0] - t0[0], t1[1] - t0[1]

    def test_a_grant_wakes_the_data_path(self):
        # one handoff first: the data streams connect and join the receivers
        data = os.urandom(BLK)
        self.pp.memory[0:BLK] = data
        self.cd.grant("gw-0", "prefill", [self.pd.desc(BLK, BLK)])
        self.cp.send("gw-0", "decode", [self.pp.desc(0, BLK)])
        self.assertTrue(wait_event(self.cd, "gw-0").ok)
        self.assertTrue(wait_event(self.cp, "gw-0").ok)
        self.assertEqual(bytes(self.pd.memory[BLK:2 * BLK]), data)
        time.sleep(self.WINDOW_US / 1e6 + 0.2)  # every window closed: the threads sleep
        idle = self.polled()
        self.cd.grant("gw-1", "prefill", [self.pd.desc(BLK, BLK)])
        time.sleep(0.02)  # the grant reaches prefill
        busy = self.polled()
        self.cd.cancel("gw-1")
        wait_event(self.cd, "gw-1")
        msg = "prefill's senders, decode's receivers: %.3f, %.3f s idle; %.3f, %.3f s in the window" % (idle + busy)
        self.assertLessEqual(max(idle), 0.01, msg)
        self.assertGreater(busy[0], 0.03, msg)
        self.assertGreater(busy[1], 0.03, msg)



class TestSendersPollTogether(PairTest):
    """tcp-pollers: while a peer's grant waits for our send, up to that
    many of the tcp sending workers poll the run queue (so that a part
    striped over a peer's streams starts on all of them at once), and the
    others sleep. Here 4 may poll on prefill (tcp-threads 6) and 1 on a
    second pair, each against a 600 ms window; then striped and small parts
    move with every byte checked while several poll."""
    WINDOW_US = 600000

    EXTRA = "spin-grant-us %d\ntcp-threads 6\ntcp-streams 4\n" % WINDOW_US
    EXTRA_OF = {"prefill": "tcp-pollers 4", "decode": "tcp-pollers 8"}

    def handoff(self, xid, size, off):
        data = os.urandom(size)
        self.pp.memory[off:off + size] = data
        self.cd.grant(xid, "prefill", [self.pd.desc(off, size)])
        self.cp.send(xid, "decode", [self.pp.desc(off, size)])
        ev = wait_event(self.cd, xid)
        self.assertTrue(ev.ok, ev.error)
        self.assertTrue(wait_event(self.cp, xid).ok)
        self.assertEqual(bytes(self.pd.memory[off:off + size]), data, xid)

    def test_a_status_says_how_many_may_poll(self):
        self.assertEqual(self.pre.status()["tcp"]["senders_polling_max"], 4)
        self.assertEqual(self.dec.status()["tcp"]["senders_polling_max"], 6)  # at most tcp-threads

    def test_b_several_poll_while_a_grant_waits(self):
        self.handoff("sp-0", 4 << 20, 0)  # the streams connect
        time.sleep(self.WINDOW_US / 1e6 + 0.2)  # every window closed
        self.cd.grant("sp-1", "prefill", [self.pd.desc(0, BLK)])
        time.sleep(0.02)  # the grant reaches prefill
        t0 = threads_cpu(self.pre.proc.pid, "kvf-tcp-send")
        time.sleep(0.4)
        t1 = threads_cpu(self.pre.proc.pid, "kvf-tcp-send")
        self.cd.cancel("sp-1")
        wait_event(self.cd, "sp-1")
        used = sorted((t1[t] - t0.get(t, 0.0) for t in t1), reverse=True)
        # 4 pollers share this machine's CPUs with everything else: each
        # gets some of them; the 2 workers beyond tcp-pollers sleep
        self.assertEqual(len(used), 6, used)
        self.assertGreater(sum(1 for u in used if u >= 0.01), 1, used)
        self.assertLessEqual(max(used[4:]), 0.01, used)

    def test_c_parts_move_while_several_poll(self):
        for i in range(24):
            size = (4 << 20) if i % 3 == 0 else (BLK if i % 3 == 1 else 1 << 20)
            self.handoff("sp-d%d" % i, size, (i % 4) * (4 << 20))


class TestSpinBacksOffWhereCpusAreBusy(PairTest):
    """A polling thread whose sched_yield ran another task for a whole
    slice (its CPU is shared with busy work) stops polling and blocks, for
    5 ms doubling to 1 s while that keeps happening (spin.c): with a busy
    loop on every CPU the pollers had fallen behind them (EEVDF moves a
    yielder's deadline back) and held the handoffs they polled for at about
    8 ms each. Here handoffs move, every byte checked, with a busy loop on
    every CPU and grants keeping the data path polling: the daemons count
    backoffs. Once the loops stop, the backed-off threads poll again
    within the same grant's window (each blocks until its backoff ends, not
    until the data comes)."""
    WINDOW_US = 3000000

    EXTRA = "spin-grant-us %d\n" % WINDOW_US

    def handoff(self, xid, off):
        data = os.urandom(BLK)
        self.pp.memory[off:off + BLK] = data
        self.cd.grant(xid, "prefill", [self.pd.desc(off, BLK)])
        self.cp.send(xid, "decode", [self.pp.desc(off, BLK)])
        ev = wait_event(self.cd, xid, timeout=10)
        self.assertTrue(ev.ok, ev.error)
        self.assertTrue(wait_event(self.cp, xid, timeout=10).ok)
        self.assertEqual(bytes(self.pd.memory[off:off + BLK]), data, xid)

    def backoffs(self):
        return [d.status()["spin_backoffs"] for d in (self.pre, self.dec)]

    def test_pollers_back_off_and_come_back(self):
        self.handoff("sb-0", 0)
        before = self.backoffs()
        self.assertEqual(sorted(before[0]), ["gpu", "loop", "tcp_recv", "tcp_send"])
        with kvftest.busy_loops(len(os.sched_getaffinity(0))):
            for i in range(1, 11):
                self.handoff("sb-%d" % i, i * BLK)
            self.cd.grant("sb-w", "prefill", [self.pd.desc(0, BLK)])  # a window that outlasts the load
            time.sleep(0.3)
        after = self.backoffs()
        grew = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in after[0]}
        self.assertGreater(grew["tcp_send"] + grew["tcp_recv"] + grew["loop"], 0, grew)
        # kvferryctl doctor warns where a daemon's pollers backed off
        for d, counts in zip((self.pre, self.dec), after):
            doc = json.loads(ctl(d, "--json", "doctor").stdout)
            check = [c for c in doc["checks"] if c["name"] == "spin-backoffs"][0]
            self.assertEqual(check["result"], "warn" if sum(counts.values()) else "ok", check)
        # a backoff lasts 1 s at most, the window 3 s: by 1.1 s after the
        # loops stopped, every thread backed off in it polls again
        time.sleep(1.1)
        t0 = (thread_cpu(self.pre.proc.pid, "kvf-tcp-send"), thread_cpu(self.dec.proc.pid, "kvf-tcp-recv"))
        time.sleep(0.4)
        t1 = (thread_cpu(self.pre.proc.pid, "kvf-tcp-send"), thread_cpu(self.dec.proc.pid, "kvf-tcp-recv"))
        self.cd.cancel("sb-w")
        wait_event(self.cd, "sb-w")
        polled = (t1[0] - t0[0], t1[1] - t0[1])
        msg = "backoffs %s; prefill's senders, decode's receivers: %.3f, %.3f s" % ((grew,) + polled)
        self.assertGreater(polled[0], 0.03, msg)
        self.assertGreater(polled[1], 0.03, msg)


class TestClientPollsWhileGrantWaits(PairTest):
    """libkvferry's grant window (KVFERRY_GRANT_SPIN_US, kvferry.h): while
    a grant of a client waits for its RECV_DONE, for that long after the
    grant was posted, the client's reader polls the daemon's socket and
    kvf_wait_events spins instead of sleeping, as the daemons poll through
    spin-grant-us; the grant's RECV_DONE ends it. A polling thread that is
    preempted (the CPUs are busy after all) stops, and no grant opens a
    window for the next 100 ms. Here the window is 600 ms; 0 turns it off
    (the default on fewer than 4 CPUs). The daemons do not poll here
    (spin-grant-us 0, spin-us 0): on a 2-CPU machine their pollers would
    take the CPUs of the reader and the waiter, and they would stop. Every
    byte checked."""
    WINDOW_US = 600000

    EXTRA = "spin-grant-us 0\nspin-us 0\n"

    def client(self, grant_spin_us, pin=True):
        """A decode client with that window. With pin, its reader thread is
        pinned to one CPU and this thread to another: on a 2-CPU machine
        the scheduler at times put both pollers on one CPU, where each lost
        half of it and the window closed in every grant of a run."""
        before = set(threads_cpu(os.getpid(), "kvf-client"))
        with kvftest.environ(KVFERRY_GRANT_SPIN_US=str(grant_spin_us)):
            c = self.dec.client()
        cpus = sorted(os.sched_getaffinity(0))
        if pin and len(cpus) >= 2:
            for tid in set(threads_cpu(os.getpid(), "kvf-client")) - before:
                os.sched_setaffinity(int(tid), {cpus[0]})
            os.sched_setaffinity(0, {cpus[1]})
            self.addCleanup(os.sched_setaffinity, 0, cpus)
        return c

    def readers_polled(self, seconds=0.4):
        """The most CPU seconds one of this process's library readers used
        over `seconds`."""
        t0 = threads_cpu(os.getpid(), "kvf-client")
        time.sleep(seconds)
        t1 = threads_cpu(os.getpid(), "kvf-client")
        return max(t1[t] - t0.get(t, 0.0) for t in t1)

    def waited(self, c, ms=300):
        """This thread's CPU seconds in a kvf_wait_events of ms that times
        out."""
        t0 = time.thread_time()
        self.assertEqual(c.wait_events(16, ms), [])
        return time.thread_time() - t0

    def handoff(self, c, xid, off, between=None):
        """64 KiB granted by c, `between` run before the send, then sent
        from prefill; every byte checked."""
        pd = c.pool_find("kv")
        data = os.urandom(BLK)
        self.pp.memory[off:off + BLK] = data
        pd.memory[off:off + BLK] = bytes(BLK)
        c.grant(xid, "prefill", [pd.desc(off, BLK)])
        got = between() if between else None
        self.cp.send(xid, "decode", [self.pp.desc(off, BLK)])
        ev = wait_event(c, xid, timeout=10)
        self.assertTrue(ev.ok, ev.error)
        self.assertTrue(wait_event(self.cp, xid).ok)
        self.assertEqual(bytes(pd.memory[off:off + BLK]), data, xid)
        return got

    def test_a_reader_and_waiter_poll_until_the_data_lands(self):
        c = self.client(self.WINDOW_US)
        try:
            self.handoff(c, "cp-0", 0)  # the data streams connect
            time.sleep(0.1)
            idle = self.readers_polled()
            # A window stops where its threads lose their CPU (test_c); on a
            # 2-CPU machine the reader and the waiter polling leave none for
            # anything else, and that happens: up to 5 grants, 150 ms apart.
            for i in range(5):
                waited, polled = self.handoff(c, "cp-%d" % (i + 1), BLK,
                                              lambda: (self.waited(c, 100), self.readers_polled(0.3)))
                if polled > 0.03 and waited > 0.03:
                    break
                time.sleep(0.15)
            after = self.readers_polled()  # the RECV_DONE ended the window
            msg = "reader: %.3f s idle, %.3f in the window, %.3f after; waiter %.3f" % (idle, polled, after, waited)
            self.assertLessEqual(idle, 0.01, msg)
            self.assertGreater(polled, 0.03, msg)
            self.assertGreater(waited, 0.03, msg)
            self.assertLessEqual(after, 0.01, msg)
            self.assertLess(self.waited(c), 0.05, msg)  # no grant waits: the wait sleeps
        finally:
            c.close()

    def test_b_off_at_zero(self):
        c = self.client(0)
        try:
            polled, waited = self.handoff(c, "cp-off", 2 * BLK, lambda: (self.readers_polled(), self.waited(c)))
            self.assertLessEqual(polled, 0.01)
            self.assertLess(waited, 0.05)
        finally:
            c.close()

    def test_c_preempted_pollers_stop(self):
        c = self.client(self.WINDOW_US, pin=False)  # busy loops spawned here must spread over every CPU
        try:
            self.handoff(c, "cp-b0", 3 * BLK)
            with kvftest.busy_loops(len(os.sched_getaffinity(0))):
                time.sleep(0.05)
                polled = self.handoff(c, "cp-b1", 4 * BLK, lambda: (time.sleep(0.05), self.readers_polled())[1])
            # the loops are gone and the 100 ms without windows over: the
            # next grant polls again
            for i in range(3):  # as in test_a
                time.sleep(0.15)
                again = self.handoff(c, "cp-b%d" % (i + 2), 5 * BLK, self.readers_polled)
                if again > 0.03:
                    break
            msg = "reader with busy loops: %.3f s; after: %.3f" % (polled, again)
            self.assertLessEqual(polled, 0.02, msg)
            self.assertGreater(again, 0.03, msg)
        finally:
            c.close()


class TestSoonFromPartsAlone(PairTest):
    """An engine that only sends layer by layer: the receiving daemon takes
    the wire's rate from each grant's last part (its parts hold compute
    between them), so the second such grant already hears Soon at parts
    after a pause (at least its last); the first, before any rate is known,
    hears none. Every byte checked."""

    SOON_POLL = True

    def layerwise(self, xid, n):
        """n parts of 64 KiB, 20 ms apart; the Soons its engine heard in
        all, and after the first part."""
        data = os.urandom(n * BLK)
        self.pp.memory[0:len(data)] = data
        self.pd.memory[0:len(data)] = bytes(len(data))
        before = self.dec.status()["api_soon"]
        self.cd.grant(xid, "prefill", [self.pd.desc(i * BLK, BLK) for i in range(n)])
        for i in range(n):
            if i == 1:
                after_first = self.dec.status()["api_soon"]
            self.cp.send(xid, "decode", [self.pp.desc(i * BLK, BLK)], more=i < n - 1)
            if i < n - 1:
                time.sleep(0.02)
        self.assertTrue(wait_event(self.cd, xid).ok)
        self.assertTrue(wait_event(self.cp, xid).ok)
        self.assertEqual(bytes(self.pd.memory[0:len(data)]), data)
        end = self.dec.status()["api_soon"]
        return end - before, end - after_first

    def test_rate_from_the_last_part(self):
        self.assertEqual(self.layerwise("sfp-1", 4), (0, 0))  # no rate known yet
        told, later = self.layerwise("sfp-2", 4)
        self.assertLessEqual(told, 4)
        self.assertGreaterEqual(later, 1)  # at least the last part's (its rest is one part)


if __name__ == "__main__":
    kvftest.main()
