#!/usr/bin/env python3
"""bench_scale - the scale figures of issue 18 (bench/scale.sh runs it; root).

A real etcd and daemons in network namespaces (tests/scale/kvfscale.py, the
helpers of make check-scale), sized for a 2-core machine: small pools,
tcp-streams 2. Cases, one JSON line each, then markdown tables:

mesh     For each size in --sizes (4,16,32,64): that many fresh daemons,
         each registered in etcd and with a static peer line for every other
         (peer-connect eager: a full mesh). Formation time: start to every
         daemon having every other linked and listed. Then threads, fds, RSS
         and idle CPU (user + system over --idle-s) per daemon, once with the
         links just up ("linked") and once after a transfer over every
         ordered pair ("used": every link's tcp streams open both ways).
restart  At the largest size, --restarts times: one daemon killed with
         kill -9 and started again at once; seconds from the kill until it
         is ready, until every daemon has it linked again (its new
         incarnation) and until a transfer each way with it has succeeded.
etcd     At the largest size, --restarts times: etcd killed with kill -9;
         seconds until every daemon says unreachable, transfers while it is
         away, and seconds from its restart (with its data) until every
         daemon is registered again; whether any link dropped meanwhile.
active   One receiving daemon and up to max(--senders) sending daemons, all
         through etcd only (links on demand, never closed for idleness). For
         each count k in --senders (2,4,...,32), the same --xfers transfers
         of --xfer-size bytes, --inflight at a time, round robin over k
         senders (each link set up by a transfer beforehand, not counted):
         CPU seconds of the receiving daemon (/proc/PID/stat utime + stime)
         per transfer, its thread count, and the wall time. --repeat times
         each; the median is tabled.

Every transfer verifies every byte; a failed one stops the benchmark, except
while a daemon or etcd is being restarted (counted there)."""
import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvfscale  # noqa: E402  first: puts tests/ops and the binding on sys.path
import kvfetcd  # noqa: E402
from kvfscale import Net, Node, pattern  # noqa: E402
from kvftest import wait_for  # noqa: E402

import kvferry  # noqa: E402

DEADLINE_MS = 10000
WAIT_S = DEADLINE_MS / 1000 + 10


def size_arg(s):
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def ints(s):
    return [int(x) for x in s.split(",") if x]


def emit(rec):
    print(json.dumps(rec, sort_keys=False), flush=True)
    return rec


def note(msg):
    print("# " + msg, file=sys.stderr, flush=True)


class Mover:
    """Verified transfers, over API clients kept per worker and daemon (so
    that the daemons' own work is what the figures show, not API connects).
    Worker w owns slot w of every pool; one thread at a time is worker w."""

    def __init__(self, nodes, size):
        self.nodes, self.size = nodes, size
        self.lock = threading.Lock()
        self.seq = 0
        self.clients = {}  # (w, node index) -> (client, pool)
        self.bases = {}

    def client(self, w, i):
        if (w, i) not in self.clients:
            c = kvferry.Client(self.nodes[i].sock)
            self.clients[w, i] = (c, c.pool_find("kv"))
        return self.clients[w, i]

    def close(self):
        for c, _ in self.clients.values():
            c.close()
        self.clients = {}

    def one(self, w, s, d):
        """Transfer from node s to node d in worker w's slot; the error name
        ("OK" when every byte landed)."""
        with self.lock:
            self.seq += 1
            k = self.seq
        src, dst = self.nodes[s], self.nodes[d]
        if w not in self.bases:
            self.bases[w] = pattern(w + 1, self.size)
        data = k.to_bytes(8, "little") + self.bases[w][8:]  # each transfer's bytes differ
        try:
            cs, ps = self.client(w, s)
            cd, pd = self.client(w, d)
            er, es, landed = kvfscale.move(cs, cd, ps, pd, src, dst, "b%d" % k, w * self.size, data,
                                           DEADLINE_MS, WAIT_S)
        except kvferry.KvferryError as e:
            self.drop(w, s, d)
            return getattr(e, "name", "refused")
        for e in (er, es):
            if e.error_name != "OK":
                return e.error_name
        return "OK" if landed else "CORRUPT"

    def drop(self, w, *idx):
        """Forgets worker w's clients of these daemons (one was refused:
        perhaps its daemon was restarted)."""
        for i in idx:
            if (w, i) in self.clients:
                self.clients.pop((w, i))[0].close()

    def run(self, pairs, workers):
        """Every (s, d) of pairs, workers at a time; fails on any error."""
        pairs = list(pairs)
        errors = []
        lock = threading.Lock()

        def work(w):
            while True:
                with lock:
                    if not pairs or errors:
                        return
                    s, d = pairs.pop()
                r = self.one(w, s, d)
                if r != "OK":
                    with lock:
                        errors.append("%s -> %s: %s" % (self.nodes[s].name, self.nodes[d].name, r))
        in_threads(work, workers)
        if errors:
            raise AssertionError("transfers failed: %s" % errors[:5])


def in_threads(fn, n):
    """fn(0) .. fn(n - 1), each on its own thread; returns when all have."""
    ts = [threading.Thread(target=fn, args=(w,)) for w in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


class Bench:
    def __init__(self, a):
        self.a = a
        self.dir = tempfile.mkdtemp(prefix="kvferry-scale.", dir="/tmp")
        n = max(a.sizes + [1 + k for k in a.senders])
        self.net = Net(n, "kvfb", "10.78.0")
        self.etcd = kvfetcd.Etcd(self.dir, host=self.net.host)
        self.nodes = []
        self.records = []

    # ------------------------------------------------------------ plumbing

    def setup(self):
        self.net.create()
        self.etcd.start()

    def stop_nodes(self):
        bad = [(n.name, n.stop()) for n in self.nodes]
        self.nodes = []
        bad = [b for b in bad if b[1] != 0]
        if bad:
            raise AssertionError("daemons did not exit cleanly: %s" % bad)

    def teardown(self):
        for n in self.nodes:
            n.kill()
        self.etcd.kill()
        self.net.destroy()
        if self.a.keep:
            note("kept " + self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def record(self, rec):
        self.records.append(emit(rec))

    def start(self, nodes):
        for n in nodes:
            n.start()
        for n in nodes:
            wait_for(n.ready, 60, "%s ready" % n.name, step=0.05)

    def preflight(self, size):
        """The limits a full mesh of size daemons meets on this machine."""
        peers = size - 1
        threads = size * (4 + 2 * self.a.tcp_streams * peers)  # today: a sender and a receiver per stream
        fds = 30 + peers * (1 + 2 * self.a.tcp_streams)
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
        with open("/proc/sys/kernel/threads-max") as f:
            threads_max = int(f.read())
        soft = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)[0]
        note("%d daemons: about %d threads in all (pid_max %d, threads-max %d), %d fds each (limit %d)"
             % (size, threads, pid_max, threads_max, fds, soft))
        if threads > min(pid_max, threads_max) * 3 // 4 or fds > soft:
            raise SystemExit("bench_scale: %d daemons do not fit this machine's limits" % size)
        if peers > 256:
            raise SystemExit("bench_scale: max-peers is at most 256")

    def conf(self):
        return "tcp-streams %d\nheartbeat-ms %d\npeer-timeout-ms %d\n" % (
            self.a.tcp_streams, self.a.heartbeat_ms, self.a.peer_timeout_ms)

    def usage(self, nodes):
        """Per daemon: (threads, fds, RSS KiB) now, and CPU over idle_s."""
        c0, t0 = [n.cpu() for n in nodes], time.monotonic()
        time.sleep(self.a.idle_s)  # measuring idle CPU: nothing to wait for
        c1, t1 = [n.cpu() for n in nodes], time.monotonic()
        use = [n.usage() for n in nodes]
        cpu = [(b - a) / (t1 - t0) for a, b in zip(c0, c1)]
        return use, cpu

    # ------------------------------------------------------------ mesh

    def mesh(self, size):
        self.preflight(size)
        d = os.path.join(self.dir, "mesh%d" % size)
        os.mkdir(d)
        addr = [("n%02d" % i, self.net.ip(i)) for i in range(size)]
        extra = "peer-connect eager\nmax-peers %d\n%s" % (max(64, size), self.conf())
        self.nodes = [Node(d, i, self.net, self.etcd.url("mesh%d" % size), self.a.ttl_ms, self.a.pool, extra,
                           [p for j, p in enumerate(addr) if j != i]) for i in range(size)]
        t0 = time.monotonic()
        self.start(self.nodes)
        ready = time.monotonic() - t0
        others = lambda n: sorted(x.name for x in self.nodes if x is not n)  # noqa: E731
        base = {"case": "mesh", "daemons": size, "tcp_streams": self.a.tcp_streams, "heartbeat_ms": self.a.heartbeat_ms,
                "peer_timeout_ms": self.a.peer_timeout_ms, "ready_s": round(ready, 3)}
        try:
            wait_for(lambda: all(n.members() == others(n) and n.links_up() == size - 1 for n in self.nodes),
                     self.a.form_s, "a full mesh of %d daemons" % size, step=0.1)
        except AssertionError as e:
            note(str(e))
            self.mesh_figures(dict(base, state="not formed", formation_s=None))
            return False
        base["formation_s"] = round(time.monotonic() - t0, 3)
        self.mesh_figures(dict(base, state="linked"))
        mover = Mover(self.nodes, self.a.mesh_xfer_size)
        t1 = time.monotonic()
        try:
            mover.run([(s, r) for s in range(size) for r in range(size) if s != r], self.a.inflight)
        except AssertionError as e:  # e.g. 64 daemons on 2 cores: API calls time out
            note(str(e))
            mover.close()
            self.record(dict(base, state="used", error=str(e)[:300]))
            return False
        took = time.monotonic() - t1
        mover.close()
        self.mesh_figures(dict(base, state="used", pair_xfers=size * (size - 1), pair_xfers_s=round(took, 2)))
        return True

    def mesh_figures(self, rec):
        use, cpu = self.usage(self.nodes)
        n = len(use)
        try:
            links = round(sum(x.links_up() for x in self.nodes) / n, 1)
        except kvferry.KvferryError:
            links = None  # a daemon that does not answer
        mean = lambda k: sum(u[k] for u in use) / n  # noqa: E731
        rec.update(threads_mean=round(mean(0), 1), threads_max=max(u[0] for u in use),
                   fds_mean=round(mean(1), 1), fds_max=max(u[1] for u in use),
                   rss_kib_mean=round(mean(2)), rss_kib_max=max(u[2] for u in use),
                   idle_cpu_pct_mean=round(100 * sum(cpu) / n, 3), idle_cpu_pct_max=round(100 * max(cpu), 3),
                   idle_s=self.a.idle_s, links_up_mean=links)
        self.record(rec)

    # ------------------------------------------------------------ recovery

    def restart(self, round_):
        """kill -9 of one daemon of the mesh, started again at once."""
        size = len(self.nodes)
        v = 1 + round_ % (size - 1)
        victim, witness = self.nodes[v], self.nodes[0 if v != 0 else 1]
        old = {p["name"]: p["session"] for p in witness.inspect("peers")["peers"]}[victim.name]
        t0 = time.monotonic()
        victim.kill()
        victim.start()
        wait_for(victim.ready, 60, "%s back" % victim.name, step=0.02)
        ready = time.monotonic() - t0

        def relinked():
            if victim.links_up() != size - 1:
                return False
            for n in self.nodes:
                if n is not victim:
                    p = [p for p in n.inspect("peers")["peers"] if p["name"] == victim.name]
                    if not p or p[0]["state"] != "up" or p[0]["session"] == old:
                        return False
            return True
        wait_for(relinked, 60, "every daemon linked to %s's new incarnation" % victim.name, step=0.02)
        linked = time.monotonic() - t0
        mover = Mover(self.nodes, self.a.mesh_xfer_size)
        tries = 0
        for s, d in ((v, witness.i), (witness.i, v)):
            while True:
                tries += 1
                r = mover.one(0, s, d)
                if r == "OK":
                    break
                if time.monotonic() - t0 > 60:
                    raise AssertionError("no transfer with %s after its restart: %s" % (victim.name, r))
                time.sleep(0.01)  # a retry, not a synchronisation
        moved = time.monotonic() - t0
        mover.close()
        self.record({"case": "restart", "daemons": size, "victim": victim.name, "ready_s": round(ready, 3),
                     "relinked_s": round(linked, 3), "first_xfers_s": round(moved, 3), "tries": tries})

    def etcd_restart(self):
        size = len(self.nodes)
        state = lambda: [n.inspect("status")["registry"]["state"] for n in self.nodes]  # noqa: E731
        downs = lambda: sum(p["downs"] for n in self.nodes for p in n.inspect("peers")["peers"])  # noqa: E731
        downs0 = downs()
        t0 = time.monotonic()
        self.etcd.kill()
        wait_for(lambda: all(s == "unreachable" for s in state()), 60, "every daemon to see etcd down", step=0.05)
        seen = time.monotonic() - t0
        mover = Mover(self.nodes, self.a.mesh_xfer_size)
        mover.run([(i, (i + 1) % size) for i in range(size)], self.a.inflight)  # fails on any failure
        mover.close()
        t1 = time.monotonic()
        self.etcd.start()
        wait_for(lambda: all(s == "registered" for s in state()), 60, "every daemon registered again", step=0.05)
        back = time.monotonic() - t1
        self.record({"case": "etcd", "daemons": size, "seen_s": round(seen, 3), "xfers_while_down_ok": size,
                     "registered_s": round(back, 3), "link_downs": downs() - downs0})

    # ------------------------------------------------------------ active peers

    def active(self):
        k_max = max(self.a.senders)
        d = os.path.join(self.dir, "active")
        os.mkdir(d)
        rx_pool = "%dK" % (self.a.inflight * self.a.xfer_size // 1024 + 1024)
        extra = "peer-idle-close-ms 0\nmax-peers %d\n%s" % (max(64, k_max), self.conf())
        self.nodes = [Node(d, i, self.net, self.etcd.url("active"), self.a.ttl_ms, rx_pool, extra)
                      for i in range(k_max + 1)]
        self.start(self.nodes)
        names = sorted(n.name for n in self.nodes)
        wait_for(lambda: all(n.members() == [x for x in names if x != n.name] for n in self.nodes), 120,
                 "membership of %d daemons" % len(self.nodes), step=0.1)
        rx = self.nodes[0]
        mover = Mover(self.nodes, self.a.xfer_size)
        linked = 0
        for k in sorted(self.a.senders):
            mover.run([(s, 0) for s in range(linked + 1, k + 1)], self.a.inflight)  # links to the new senders
            linked = max(linked, k)
            wait_for(lambda: rx.links_up() == k, 30, "%s linked to %d senders" % (rx.name, k))
            for w in range(self.a.inflight):  # the API connections, before the measured runs
                mover.client(w, 0)
                mover.client(w, 1 + w % k)
            runs = []
            for _ in range(self.a.repeat):
                # Worker w always sends from sender 1 + w % k, into its own slot of rx's pool.
                pairs = [(1 + w % k, 0) for w in range(self.a.inflight)]
                todo = [pairs[j % len(pairs)] for j in range(self.a.xfers)]
                c0, t0 = rx.cpu(), time.monotonic()
                self.run_fixed(mover, todo)
                c1, t1 = rx.cpu(), time.monotonic()
                runs.append(((c1 - c0) / self.a.xfers, t1 - t0, rx.usage()[0]))
            cpu = statistics.median(r[0] for r in runs)
            self.record({"case": "active", "senders": k, "links_up": rx.links_up(), "xfers": self.a.xfers,
                         "xfer_bytes": self.a.xfer_size, "inflight": self.a.inflight,
                         "cpu_ms_per_xfer": round(1000 * cpu, 4),
                         "cpu_ms_per_xfer_runs": [round(1000 * r[0], 4) for r in runs],
                         "wall_s_runs": [round(r[1], 2) for r in runs],
                         "gbit_s": round(8 * self.a.xfers * self.a.xfer_size / statistics.median(r[1] for r in runs)
                                         / 1e9, 2),
                         "rx_threads": max(r[2] for r in runs)})
        mover.close()

    def run_fixed(self, mover, todo):
        """todo[j] done by worker j % inflight: each worker keeps one sender
        and one slot, so that k senders are busy at once."""
        errors = []

        def work(w):
            for j in range(w, len(todo), self.a.inflight):
                r = mover.one(w, *todo[j])
                if r != "OK":
                    errors.append(r)
                    return
        in_threads(work, self.a.inflight)
        if errors:
            raise AssertionError("transfers failed: %s" % errors[:5])

    # ------------------------------------------------------------ all

    def run(self):
        sizes = sorted(self.a.sizes)
        for size in sizes:
            note("mesh of %d daemons" % size)
            if not self.mesh(size):
                for n in self.nodes:  # what did not form is not asked to stop cleanly
                    n.kill()
                self.nodes = []
                continue
            if size == self.a.recovery_at:
                for r in range(self.a.restarts):
                    self.restart(r)
                for r in range(self.a.restarts):
                    self.etcd_restart()
            self.stop_nodes()
        if self.a.senders:
            note("active peers: %s" % self.a.senders)
            self.active()
            self.stop_nodes()

    def tables(self):
        out = ["", "| daemons | state | formation s | threads mean / max | fds mean / max | RSS MiB mean / max "
               "| idle CPU % of a core per daemon | idle CPU % per peer | RSS KiB per peer |",
               "|---|---|---|---|---|---|---|---|---|"]
        mesh = [r for r in self.records if r["case"] == "mesh" and "threads_mean" in r]
        for r in mesh:
            first = [m for m in mesh if m["state"] == r["state"]][0]
            peers = r["daemons"] - 1
            slope = ((r["rss_kib_mean"] - first["rss_kib_mean"]) / (peers - first["daemons"] + 1)
                     if peers > first["daemons"] - 1 else float("nan"))
            out.append("| %d | %s | %s | %.1f / %d | %.1f / %d | %.1f / %.1f | %.2f | %.4f | %s |" % (
                r["daemons"], r["state"], "%.2f" % r["formation_s"] if r["formation_s"] is not None
                else "not in %d s (%s links up of %d)" % (self.a.form_s, r["links_up_mean"], peers),
                r["threads_mean"], r["threads_max"], r["fds_mean"],
                r["fds_max"], r["rss_kib_mean"] / 1024, r["rss_kib_max"] / 1024, r["idle_cpu_pct_mean"],
                r["idle_cpu_pct_mean"] / peers, "-" if slope != slope else "%.0f" % slope))
        act = [r for r in self.records if r["case"] == "active"]
        if act:
            out += ["", "| active senders | receiver CPU ms per transfer (median; runs) | vs 2 senders "
                    "| receiver threads | Gbit/s |", "|---|---|---|---|---|"]
            for r in act:
                out.append("| %d | %.3f (%s) | %.2fx | %d | %.2f |" % (
                    r["senders"], r["cpu_ms_per_xfer"], ", ".join("%.3f" % x for x in r["cpu_ms_per_xfer_runs"]),
                    r["cpu_ms_per_xfer"] / act[0]["cpu_ms_per_xfer"], r["rx_threads"], r["gbit_s"]))
        for case, cols in (("restart", ("ready_s", "relinked_s", "first_xfers_s")),
                           ("etcd", ("seen_s", "registered_s", "link_downs"))):
            rs = [r for r in self.records if r["case"] == case]
            if rs:
                out += ["", "| %s (%d daemons) | min | median | max |" % (case, rs[0]["daemons"]), "|---|---|---|---|"]
                for c in cols:
                    v = [r[c] for r in rs]
                    out.append("| %s | %s | %s | %s |" % (c, min(v), statistics.median(v), max(v)))
        print("\n".join(out), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=ints, default=[4, 16, 32, 64], help="mesh sizes [4,16,32,64]")
    p.add_argument("--senders", type=ints, default=[2, 4, 8, 16, 32], help="active senders [2,4,8,16,32]; "
                   "empty: no active case")
    p.add_argument("--xfers", type=int, default=2048, help="transfers per active case [2048]")
    p.add_argument("--xfer-size", type=size_arg, default=256 << 10, help="bytes per active transfer [256K]")
    p.add_argument("--mesh-xfer-size", type=size_arg, default=16 << 10, help="bytes per mesh transfer [16K]")
    p.add_argument("--inflight", type=int, default=32, help="transfers at once [32]")
    p.add_argument("--repeat", type=int, default=3, help="runs per active case [3]")
    p.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window [5]")
    p.add_argument("--restarts", type=int, default=3, help="peer and etcd restarts [3]")
    p.add_argument("--recovery-at", type=int, default=32, help="the mesh size the restarts are measured at [32]")
    p.add_argument("--form-s", type=int, default=90, help="how long a mesh may take to form [90]")
    p.add_argument("--tcp-streams", type=int, default=2, help="tcp-streams of every daemon [2]")
    p.add_argument("--pool", default="4M", help="host pool per mesh daemon [4M]")
    p.add_argument("--heartbeat-ms", type=int, default=200, help="heartbeat-ms of every daemon [200, the default]")
    # 2 cores and 64 daemons that all dial 63 peers at once (16,000 threads
    # started): heartbeats fall seconds behind while the mesh forms, and
    # with 1.5 s links drop and redial in a storm that does not settle.
    p.add_argument("--peer-timeout-ms", type=int, default=10000, help="peer-timeout-ms of every daemon [10000]")
    p.add_argument("--ttl-ms", type=int, default=2000, help="registry-ttl-ms of every daemon [2000, as make check-scale]")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (daemon logs)")
    a = p.parse_args()
    if a.inflight * max(a.mesh_xfer_size, 1) > size_arg(a.pool):
        p.error("--inflight x --mesh-xfer-size must fit --pool")
    why = kvfscale.why_not()
    if why:
        raise SystemExit("bench_scale: " + why)
    b = Bench(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        b.setup()
        b.run()
    finally:
        b.tables()
        b.teardown()


if __name__ == "__main__":
    main()
