#!/usr/bin/env python3
"""chaos.py - the chaos suite: kill -9 and network faults under a stream of
verified transfers (tests/chaos/README.md; `make chaos`, `make chaos-vm`).

Two daemons, "prefill" and "decode". Each trial starts engines
(tests/chaos/chaos_client, one process per role) that run a plan of
transfers with random model-shaped geometries, then does one thing to
them at a random moment within the transfers' expected time:

  kill-send-daemon   kill -9 prefill's kvferryd, restart it
  kill-send-client   kill -9 the sending engine
  kill-recv-client   kill -9 the receiving engine
  kill-recv-daemon   kill -9 decode's kvferryd, restart it
  net-loss           nftables drops N% of the packets both ways, for a while
  net-cut-short      every packet dropped for less than peer-timeout-ms
  net-cut-long       every packet dropped for longer than peer-timeout-ms
  net-link-down      the veth link down for a while, then up again
  (--vm, in the soft-RoCE VM:) netem delay, reordering, loss + delay,
  duplication, and a 100% loss blackout

The net-* trials need root and `ip netns`: the daemons then live in two
network namespaces joined by a veth pair (addresses 198.18.0.1 and .2,
RFC 2544's benchmarking range, present only inside those namespaces), and
the kill trials run there too. Without them the kill trials run on
loopback and each net-* trial is skipped, loudly, and counted.

Each transfer is classified from both engines' outcome lines:
  completed            every side OK, the receiver verified every byte
                       (blocks hold the pattern, the rest of its slot is
                       still poisoned)
  failed-as-expected   a transfer the fault hit, failed with an error the
                       fault explains (KVF_EPEERLOST, KVF_EDAEMON, ...)
                       before its deadline + margin
  hung                 no outcome by deadline + margin
  corrupted            a receiver saw wrong bytes, or, between two live
                       engines, one side's success with the other's failure
  unexpected           anything else (a transfer the fault did not touch
                       failed, an error the fault does not explain)
After each trial the killed engine is "restarted" as a fresh pair that must
complete a few transfers, and every counter that kvferryctl status --json
shows for work in progress (clients, transfers, grants, sends, pre-grants,
waiting sends, granted bytes, tcp grants and data streams, rdma state when
present) plus the daemon's open fds must return to their baseline within a
bounded wait; a daemon that did not must is "leaked". At the end each
daemon must exit 0 on SIGTERM with no sanitizer report in its log.

The last line is the summary:
  chaos: trials N, completed N, failed-as-expected N, hung N, leaked N, corrupted N[, skipped N]
The exit status is non-zero on any hang, leak, corruption or unexpected
outcome. Details of every trial go to stdout; every outcome line to
$BUILD/chaos/outcomes.jsonl.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ops"))
import kvftest  # noqa: E402  (real daemons, ports, sanitizer setup)

CLIENT = os.path.join(kvftest.BUILD, "tests", "chaos", "chaos_client")
CTL = kvftest.KVFERRYCTL
MIB = 1 << 20

KILL_KINDS = ["kill-send-daemon", "kill-send-client", "kill-recv-client", "kill-recv-daemon"]
NET_KINDS = ["net-loss", "net-cut-short", "net-cut-long", "net-link-down"]
VM_KINDS = ["netem-delay", "netem-reorder", "netem-loss-delay", "netem-duplicate", "netem-blackout"]

# Errors that explain a hit transfer's failure, by trial kind and side.
# KVF_EDAEMON: the engine's own daemon was killed. KVF_EPEERLOST: the other
# daemon (or the link) went away. KVF_EREMOTECANCEL: the other engine died.
# KVF_EDEADLINE: the other side never came (its engine or daemon died
# before posting, or the link was down past the deadline). KVF_EUNKNOWN: a
# sender had sent every byte when the link dropped and the receiver never
# told it the outcome (it restarted, or stayed away past the deadline).
NET_EXPECTED = {"KVF_EPEERLOST", "KVF_EDEADLINE", "KVF_EREMOTECANCEL", "KVF_EUNKNOWN"}
EXPECTED = {
    "kill-send-client": {"recv": {"KVF_EREMOTECANCEL", "KVF_EDEADLINE"}},
    "kill-recv-client": {"send": {"KVF_EREMOTECANCEL", "KVF_EDEADLINE"}},
    "kill-send-daemon": {"send": {"KVF_EDAEMON"}, "recv": {"KVF_EPEERLOST", "KVF_EDEADLINE"}},
    "kill-recv-daemon": {"recv": {"KVF_EDAEMON"}, "send": {"KVF_EPEERLOST", "KVF_EDEADLINE", "KVF_EUNKNOWN"}},
}
for _k in NET_KINDS + VM_KINDS:
    EXPECTED[_k] = {"recv": NET_EXPECTED, "send": NET_EXPECTED}

# Counters of work in progress (kvferryctl status --json) that must return
# to their baseline after every trial.
STATUS_KEYS = ["clients", "transfers_active", "grants_active", "sends_active", "pregrants",
               "waiting_sends", "granted_bytes"]
TCP_KEYS = ["open_grants", "streams_out", "streams_in"]

SAN_LOG_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                 "SUMMARY: UndefinedBehaviorSanitizer")


def log(msg):
    print(msg, flush=True)


def back_to(want, got):
    """Whether snapshot got is back at baseline want: every counter equal,
    and no more fds open (fewer is no leak: at one baseline in CI both
    daemons held one fd more than through every later trial, 2026-11-27)."""
    if got is None:
        return False
    if any(got.get(k) != v for k, v in want.items() if k != "fds"):
        return False
    return want.get("fds") is None or (got.get("fds") is not None and got["fds"] <= want["fds"])


def ctl(sock, what, timeout=10):
    """kvferryctl -s sock what --json, parsed; None when no daemon answers."""
    try:
        r = subprocess.run([CTL, "-s", sock, what, "--json"], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout)
    except ValueError:
        return None


def stacks(pid, out):
    """Every thread's stack of a stuck process, into out (when gdb exists)."""
    if not shutil.which("gdb"):
        return
    try:
        r = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                           capture_output=True, text=True, timeout=60)
        out.write("=== chaos: stacks of stuck pid %d\n%s\n" % (pid, r.stdout[-20000:]))
        out.flush()
    except (subprocess.TimeoutExpired, OSError):
        pass


# ---------------------------------------------------------------- network

def sh(*cmd, check=True):
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(cmd), (r.stderr or r.stdout).strip()))
    return r


class Netns:
    """Two namespaces joined by a veth pair; faults by nftables or link state."""

    def __init__(self):
        tag = "%05d" % (os.getpid() % 100000)
        self.ns = ["kvfc%sa" % tag, "kvfc%sb" % tag]
        self.dev = ["kvc%sa" % tag, "kvc%sb" % tag]
        self.ip = ["198.18.0.1", "198.18.0.2"]
        self.up = False

    @staticmethod
    def unavailable():
        """Why the namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "not root"
        for tool in ("ip", "nft"):
            if not shutil.which(tool):
                return "no %s (apt-get install %s)" % (tool, "iproute2" if tool == "ip" else "nftables")
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        if r.returncode != 0:
            return "ip netns: " + r.stderr.strip()
        return None

    def create(self):
        self.up = True
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for i in range(2):
            sh("ip", "link", "set", self.dev[i], "netns", self.ns[i])
            sh("ip", "-n", self.ns[i], "addr", "add", self.ip[i] + "/24", "dev", self.dev[i])
            sh("ip", "-n", self.ns[i], "link", "set", self.dev[i], "up")
        # Probe that nftables works in a namespace before relying on it.
        self.nft_rule(None)

    def destroy(self):
        if not self.up:
            return
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)
        self.up = False

    def nft_rule(self, rule):
        """Replaces the fault rule in both namespaces' output (None: none)."""
        for ns in self.ns:
            sh("ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "kvfchaos", check=False)
            if rule is None:
                continue
            script = ("table inet kvfchaos {\n chain out {\n  type filter hook output priority 0;\n"
                      "  %s\n }\n}\n" % rule)
            r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script,
                               capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise RuntimeError("nft in %s: %s" % (ns, r.stderr.strip()))

    def link(self, up):
        sh("ip", "-n", self.ns[0], "link", "set", self.dev[0], "up" if up else "down")


class Netem:
    """In the soft-RoCE VM: two nodes in one namespace, n0 <-> n1 (veth)."""

    devs = ["n0", "n1"]

    @staticmethod
    def set(spec):
        for d in Netem.devs:
            sh("tc", "qdisc", "del", "dev", d, "root", check=False)
            if spec:
                sh("tc", "qdisc", "add", "dev", d, "root", "netem", *spec.split())


# ---------------------------------------------------------------- daemons

class ChaosDaemon(kvftest.Daemon):
    """kvftest's daemon, bound to ip and optionally inside a namespace."""

    def __init__(self, dir, name, pool, ip, netns=None, extra="", transport="tcp", rdma_dev=None):
        super().__init__(dir, name, pool, extra=extra)
        self.ip, self.netns = ip, netns
        self.transport, self.rdma_dev = transport, rdma_dev
        self.peer_ips = []
        self.incarnation = 0

    def add_peer(self, other, port=None):
        self.peer_ips.append((other.name, other.ip, other.port))

    def config_text(self):
        lines = ["# written by tests/chaos", "node " + self.name, "api-socket " + self.sock,
                 "peer-listen %s:%d" % (self.ip, self.port)]
        lines += ["peer %s %s:%d" % p for p in self.peer_ips]
        lines += ["pool kv host " + self.pool, "heartbeat-ms 100", "peer-timeout-ms 1000",
                  "reconnect-min-ms 50", "reconnect-max-ms 300"]
        if self.transport == "rdma":  # soft-RoCE in the VM: CM on this node's address
            lines += ["transports rdma,tcp", "rdma-listen %s:0" % self.ip]
            lines += ["rdma-devices " + self.rdma_dev] if self.rdma_dev else []
        else:
            lines.append("transports tcp")
        lines.append(self.extra)
        return "\n".join(lines) + "\n"

    def start(self, env=None, wait=True):
        self.write_conf()
        self.incarnation += 1
        cmd = [kvftest.KVFERRYD, "-c", self.conf]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns] + cmd
        with open(self.log, "a") as f:
            f.write("=== chaos: starting %s (incarnation %d)\n" % (self.name, self.incarnation))
            f.flush()
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=env)
        if wait:
            self.wait_ready()
        return self

    def api_answers(self):
        return ctl(self.sock, "status") is not None

    def peers_up(self):
        j = ctl(self.sock, "peers")
        return bool(j and j["peers"] and all(p["state"] == "up" for p in j["peers"]))

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def snapshot(self):
        """The counters that must return to baseline, and open fds. The fds
        are counted before kvferryctl connects: right after a status read
        the daemon may not yet have closed that kvferryctl's session (it
        does so on a later loop turn), and the count would race with it.
        (This did not explain CI's baseline of one fd more on 2026-11-27:
        counted either way, the dev machine's was 31.)"""
        try:
            fds = len(os.listdir("/proc/%d/fd" % self.proc.pid))
        except OSError:
            fds = None
        st = ctl(self.sock, "status")
        if st is None:
            return None
        snap = {k: st.get(k) for k in STATUS_KEYS}
        for k in TCP_KEYS:
            snap["tcp." + k] = (st.get("tcp") or {}).get(k)
        rdma = st.get("rdma")
        if rdma:  # queue pairs, registered pools (memory regions), grants
            for k in ("open_grants", "parked_requests"):
                snap["rdma." + k] = rdma.get(k)
            snap["rdma.qps"] = sum(len(p.get("qps", [])) for p in rdma.get("peers", []))
            snap["rdma.mrs"] = sum(d.get("pools_registered", 0) for d in rdma.get("devices", []))
        snap["fds"] = fds
        return snap


# ---------------------------------------------------------------- engines

class Engine:
    """One chaos_client process; its JSON lines are collected with the time
    they came."""

    def __init__(self, suite, tag, group, role, daemon, peer, region, plan, conc, max_bytes):
        self.tag, self.group, self.role, self.daemon = tag, group, role, daemon
        self.lines = []
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.killed = self.stopped = False
        self.plan = plan
        self.plan_path = path = os.path.join(suite.dir, "plan-%s.txt" % tag)
        with open(path, "w") as f:
            for xid, seed, deadline in plan:
                f.write("%s %d %d\n" % (xid, seed, deadline))
        cmd = [CLIENT, "--sock", daemon.sock, "--role", role, "--plan", path, "--tag", tag,
               "--region", "%d:%d" % region, "--conc", str(conc), "--max-bytes", str(max_bytes),
               "--hung-ms", str(suite.margin_ms)]
        if peer:
            cmd += ["--peer", peer]
        self.errlog = open(os.path.join(suite.dir, "engine-%s.log" % tag), "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.errlog, text=True, env=suite.client_env)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        raw = open(self.errlog.name[:-4] + ".out", "w")
        for line in self.proc.stdout:
            t = time.monotonic()
            raw.write("%.3f %s" % (t, line))
            try:
                obj = json.loads(line)
            except ValueError:
                obj = {"garbage": line.rstrip()}
            with self.lock:
                self.lines.append((t, obj))
            if "ready" in obj or "setup_error" in obj:
                self.ready.set()
        raw.close()
        self.ready.set()

    def signal(self, sig):
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill9(self):
        self.killed = True
        self.signal(signal.SIGKILL)

    def wait(self, timeout):
        """True when it exited in time; else it is killed (and False)."""
        try:
            self.proc.wait(timeout)
            ok = True
        except subprocess.TimeoutExpired:
            stacks(self.proc.pid, self.errlog)
            self.proc.kill()
            self.proc.wait()
            ok = False
        self.reader.join(5)
        self.errlog.close()
        return ok

    def stderr_text(self):
        try:
            with open(self.errlog.name) as f:
                return f.read()
        except OSError:
            return ""

    def of(self, key):
        with self.lock:
            return [(t, o) for t, o in self.lines if key in o]


class Prober:
    """Times `kvferryctl status` on each daemon every 0.2 s during a trial:
    the daemon's loop must keep answering while peers fail and return (a
    loop blocked for seconds is a hang of its own). Skips a daemon that is
    not running (killed and not yet restarted)."""

    def __init__(self, daemons):
        self.daemons = daemons
        self.worst = {d.name: 0.0 for d in daemons}
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop_ev.wait(0.2):
            for d in self.daemons:
                if not d.alive():
                    continue
                t0 = time.monotonic()
                ok = ctl(d.sock, "status", timeout=30) is not None
                if ok and d.alive():
                    self.worst[d.name] = max(self.worst[d.name], time.monotonic() - t0)

    def stop(self):
        self.stop_ev.set()
        self.thread.join(40)
        return self.worst


# ---------------------------------------------------------------- the suite

class Tally:
    def __init__(self):
        self.trials = self.completed = self.failed = self.hung = 0
        self.leaked = self.corrupted = self.skipped = self.unexpected = 0
        self.in_flight = 0
        self.worst_ctl = 0.0
        self.problems = []

    def problem(self, kind, text):
        self.problems.append("%s: %s" % (kind, text))
        log("  FAIL %s: %s" % (kind, text))


class Suite:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.dir = tempfile.mkdtemp(prefix="kvferry-chaos.", dir="/tmp")
        self.outdir = os.path.join(kvftest.BUILD, "chaos")
        os.makedirs(self.outdir, exist_ok=True)
        self.outcomes = open(os.path.join(self.outdir, "outcomes.jsonl"), "w")
        self.san = kvftest.sanitized()
        slow = 3 if self.san else 1
        if args.vm:
            slow *= 4  # TCG: everything is emulated
        self.deadline_ms = args.deadline_ms or 3000 * slow
        self.margin_ms = 2000 * slow
        self.max_bytes = (args.max_mib * MIB) if args.max_mib else (MIB // 2 if args.vm else 4 * MIB)
        self.client_env = dict(os.environ)
        if args.grant_spin_us >= 0:  # the engines' grant window (libkvferry, kvferry.h)
            self.client_env["KVFERRY_GRANT_SPIN_US"] = str(args.grant_spin_us)
        self.net = None
        self.pre = self.dec = None
        self.baseline = {}
        self.engines = []

    # ---- daemons

    def start_daemons(self):
        pool = "96M"
        if self.args.vm:
            ips, nss = [os.environ.get("NODE0_IP", "10.0.0.1"), os.environ.get("NODE1_IP", "10.0.0.2")], [None, None]
        elif self.net:
            ips, nss = self.net.ip, self.net.ns
        else:
            ips, nss = ["127.0.0.1", "127.0.0.1"], [None, None]
        tp = self.args.transport
        devs = [os.environ.get("NODE0_DEV"), os.environ.get("NODE1_DEV")]
        extra = "tcp-pollers %d" % self.args.tcp_pollers if self.args.tcp_pollers else ""
        self.pre = ChaosDaemon(self.dir, "prefill", pool, ips[0], nss[0], extra, tp, devs[0])
        self.dec = ChaosDaemon(self.dir, "decode", pool, ips[1], nss[1], extra, tp, devs[1])
        self.pre.add_peer(self.dec)
        self.dec.add_peer(self.pre)
        self.pre.start()
        self.dec.start()
        self.wait_peers()

    def wait_peers(self, timeout=15):
        kvftest.wait_for(lambda: self.pre.peers_up() and self.dec.peers_up(), timeout, "both peers up",
                         step=0.05)

    def daemons(self):
        return [self.pre, self.dec]

    # ---- plans and engines

    def plan(self, prefix, n):
        return [("%s-%d" % (prefix, k), self.rng.getrandbits(63), self.deadline_ms) for k in range(n)]

    # Pool regions (each daemon has a 96 MiB pool "kv"): the main pair in
    # [0, 40M), a second remote pair in [40M, 64M), a local pair in [64M, 96M).
    REGIONS = {"main": (0, 40 * MIB), "by": (40 * MIB, 24 * MIB), "local": (64 * MIB, 32 * MIB)}

    def pair(self, group, trial, n, conc, region):
        plan = self.plan("%s-t%d" % (group, trial), n)
        mb = min(self.max_bytes, region[1] // conc // 2)
        s = Engine(self, "%s-send-t%d" % (group, trial), group, "send", self.pre, "decode", region, plan,
                   conc, mb)
        r = Engine(self, "%s-recv-t%d" % (group, trial), group, "recv", self.dec, "prefill", region, plan,
                   conc, mb)
        self.engines += [s, r]
        return s, r

    def local(self, daemon, trial, n):
        group = "local-" + daemon.name
        plan = self.plan("%s-t%d" % (group, trial), n)
        region = self.REGIONS["local"]
        e = Engine(self, "%s-t%d" % (group, trial), group, "local", daemon, None, region, plan, 2,
                   min(self.max_bytes, region[1] // 4 // 2))
        self.engines.append(e)
        return e

    def wait_ready(self, engines, timeout=15):
        for e in engines:
            if not e.ready.wait(timeout):
                raise RuntimeError("engine %s not ready in %ss" % (e.tag, timeout))
            if e.of("setup_error"):
                raise RuntimeError("engine %s: %s" % (e.tag, e.of("setup_error")[0][1]))

    def stop(self, engines):
        """Stops engines at the same transfer per pair (chaos_client.c):
        SIGUSR1 pauses each, which says the plan index it would start next;
        each then gets the smaller of its pair's and SIGUSR2, and withdraws
        (kvf_cancel) what it started past it: transfers the other end never
        posted, which would otherwise wait out their deadlines."""
        live = [e for e in engines if not e.killed and not e.stopped and e.proc.poll() is None]
        for e in live:
            e.stopped = True
            e.signal(signal.SIGUSR1)
        end = time.monotonic() + self.margin_ms / 1000.0
        while time.monotonic() < end and any(not e.of("paused") and e.proc.poll() is None for e in live):
            time.sleep(0.005)
        groups = {}
        for e in live:
            groups.setdefault(e.group, []).append(e)
        for es in groups.values():
            k = min([e.of("paused")[-1][1]["paused"] for e in es if e.of("paused")] or [0])
            for e in es:
                with open(e.plan_path + ".limit", "w") as f:
                    f.write("%d\n" % k)
                e.signal(signal.SIGUSR2)

    def finish(self, engines):
        """Waits for every engine: each ends by itself once its transfers have
        an outcome (hung ones past deadline + margin included)."""
        bound = (self.deadline_ms + 2 * self.margin_ms) / 1000.0 + 10
        end = time.monotonic() + bound
        stuck = []
        for e in engines:
            if not e.wait(max(0.1, end - time.monotonic())):
                stuck.append(e)
            elif not e.killed and e.proc.returncode != 0:
                self.tally.unexpected += 1
                self.tally.problem("unexpected", "engine %s exited with %s: %s" % (
                    e.tag, e.proc.returncode, e.stderr_text()[-2000:]))
        return stuck

    # ---- calibration and baseline

    def calibrate(self):
        """A trial without faults: every transfer must complete. Its main
        pair's run time sets when the faults strike."""
        log("calibration: main pair, a second pair and a local pair on each daemon, no faults")
        t0 = time.monotonic()
        s, r = self.pair("main", 0, self.args.transfers, 3, self.REGIONS["main"])
        n = self.args.transfers
        b = self.pair("by", 0, n, 2, self.REGIONS["by"])
        locs = [self.local(self.pre, 0, n), self.local(self.dec, 0, n)]
        allx = [s, r, *b, *locs]
        self.wait_ready(allx)
        t_ready = time.monotonic()
        stuck = self.finish([s, r])
        self.t_main = max(0.3, time.monotonic() - t_ready)
        stuck += self.finish(allx[2:])
        res = self.classify("calibration", allx, hit=set(), kill_t=None, stuck=stuck)
        log("calibration: main pair ran %.2f s; %s (%.1f s)" % (self.t_main, res, time.monotonic() - t0))
        if res["completed"] != sum(len(e.plan) for e in allx if e.role != "recv"):
            raise RuntimeError("calibration: not every transfer completed: %s" % res)
        # The baseline: what each daemon shows with no work in progress,
        # once the engines' API sessions (and their fds) are gone: the one
        # session left is that of the kvferryctl asking.
        for d in self.daemons():
            kvftest.wait_for(lambda: (d.snapshot() or {}).get("clients") == 1, 10,
                             "%s to close the engines' API sessions" % d.name)
            self.baseline[d.name] = snap = self.settle(d, None, 5)
            # With one peer up: tcp-streams (4) data streams each way, and
            # both daemons alike (a stream left over from a flap is a leak).
            tcp_ok = snap["tcp.streams_out"] == 4 and snap["tcp.streams_in"] == 4
            # Nothing may wait once every transfer ended: a send intent or a
            # pushed grant left here would wait for its deadline (a crossed
            # intent read after its grant ended, 2026-11-26, proto SendDone).
            waiting = snap["waiting_sends"] or snap["pregrants"]
            if (self.args.transport == "tcp" and not tcp_ok) or snap["granted_bytes"] or waiting:
                self.tally.leaked += 1
                self.tally.problem("leaked", "%s's baseline: %s" % (d.name, json.dumps(snap, sort_keys=True)))
        log("baseline: %s" % json.dumps(self.baseline, sort_keys=True))

    def settle(self, d, want, timeout):
        """Waits until d's snapshot equals want (None: until two readings in a
        row agree and no transfer is active). Returns the last snapshot."""
        end = time.monotonic() + timeout
        prev = None
        while True:
            snap = d.snapshot()
            if snap is not None:
                if want is None and snap == prev and not snap["transfers_active"]:
                    return snap
                if want is not None and back_to(want, snap):
                    return snap
            prev = snap
            if time.monotonic() > end:
                return snap
            time.sleep(0.1)

    def check_leaks(self, trial, kind):
        """Every daemon back to its baseline within the deadline + margin
        (pre-grants of transfers whose sender died live until theirs)."""
        leaks = []
        for d in self.daemons():
            if not d.alive():
                self.tally.unexpected += 1
                self.tally.problem("unexpected", "trial %d %s: %s is not running (exit %s): %s" % (
                    trial, kind, d.name, d.proc.returncode, d.log_text()[-3000:]))
                continue
            want = self.baseline[d.name]
            got = self.settle(d, want, (self.deadline_ms + self.margin_ms) / 1000.0 + 2)
            if got and got.get("fds") is not None and want.get("fds") is not None and got["fds"] < want["fds"]:
                log("  note: trial %d %s: %s holds %d fds, %d fewer than at the baseline" % (
                    trial, kind, d.name, got["fds"], want["fds"] - got["fds"]))
            if not back_to(want, got):
                diff = {k: (want.get(k), (got or {}).get(k)) for k in set(want) | set(got or {})
                        if want.get(k) != (got or {}).get(k)}
                leaks.append("%s %s" % (d.name, json.dumps(diff, sort_keys=True)))
        if leaks:
            self.tally.leaked += 1
            for l in leaks:
                self.tally.problem("leaked", "trial %d %s: %s (baseline, now)" % (trial, kind, l))
        return leaks

    # ---- classification

    def classify(self, trial_name, engines, hit, kill_t, stuck, kind=None):
        """Merges the engines' outcome lines per transfer and classifies each.
        hit: the groups the fault touched. Returns counts, adds to the tally."""
        res = {"completed": 0, "failed": 0, "hung": 0, "corrupted": 0, "unexpected": 0, "vanished": 0,
               "withdrawn": 0, "refused": 0}
        fails = {}
        xfers = {}
        for e in engines:
            for t, o in e.of("posted"):
                xfers.setdefault((e.group, o["posted"]), {}).setdefault("posted", []).append(e)
            for t, o in e.of("outcome"):
                rec = xfers.setdefault((e.group, o["outcome"]), {})
                rec.setdefault("out", []).append((e, t, o))
                self.outcomes.write(json.dumps(dict(o, trial=trial_name, group=e.group)) + "\n")
            for t, o in e.of("stray"):
                log("  note: %s: stray event %s" % (e.tag, json.dumps(o)))
            for t, o in e.of("garbage"):
                res["unexpected"] += 1
                self.tally.problem("unexpected", "%s: %s printed %r" % (trial_name, e.tag, o["garbage"]))
        # A posted transfer of an engine that the driver had to kill has no
        # outcome from it: hung.
        for (group, xid), rec in sorted(xfers.items()):
            outs = rec.get("out", [])
            by_side = {}
            for e, t, o in outs:
                by_side.setdefault(o["side"], []).append((e, t, o))
            posted_by = rec.get("posted", [])
            missing = [e for e in posted_by if e in stuck and not any(x[0] is e for x in outs)]
            verdict = self.verdict(trial_name, group, xid, by_side, missing, group in hit, kill_t, kind)
            if verdict == "failed":
                for side, lst in by_side.items():
                    for e, t, o in lst:
                        if o["status"] != "OK":
                            fails[o["status"]] = fails.get(o["status"], 0) + 1
                if all(o["where"] in ("grant", "send") for e, t, o in outs):
                    res["refused"] += 1  # refused at the call: the peer was down
            res[verdict] += 1
        t = self.tally
        t.completed += res["completed"]
        t.failed += res["failed"]
        t.hung += res["hung"]
        t.corrupted += res["corrupted"]
        t.unexpected += res["unexpected"]
        res["errors"] = fails
        return res

    def verdict(self, trial, group, xid, by_side, missing, hit, kill_t, kind):
        where = "%s %s/%s" % (trial, group, xid)
        outs = [x for lst in by_side.values() for x in lst]
        if not outs and not missing:
            return "vanished"  # only the killed engine ever had it
        for e, t, o in outs:
            if o["status"] == "OK" and o["side"] == "recv" and o.get("verified") is not True:
                self.tally.problem("corrupted", "%s: %s" % (where, o.get("detail", o)))
                return "corrupted"
        if any(o["where"] == "withdrawn" for e, t, o in outs):
            bad = [o for e, t, o in outs if o["status"] not in ("OK", "KVF_ECANCELED")]
            if bad:
                self.tally.problem("unexpected", "%s: withdrawn, yet %s" % (where, bad))
                return "unexpected"
            return "withdrawn"  # the stop cancelled it before the other end posted it
        late = [(e, o) for e, t, o in outs
                if o["status"] == "HUNG" or o["elapsed_ms"] > o["deadline_ms"] + self.margin_ms]
        # An engine whose daemon was killed must learn it at once.
        slow_gone = [(e, o) for e, t, o in outs if o["where"] == "daemon" and kill_t is not None
                     and t - kill_t > self.margin_ms / 1000.0]
        if late or missing or slow_gone:
            what = [o for e, o in late + slow_gone] + ["%s: no outcome, engine stuck" % e.tag for e in missing]
            self.tally.problem("hung", "%s: %s" % (where, what))
            return "hung"
        statuses = {o["side"]: o["status"] for e, t, o in outs}
        if all(s == "OK" for s in statuses.values()):
            return "completed"
        # Two live engines must agree (a success against a failure means one
        # of them was told a lie) unless the fault hit this transfer.
        if not hit and "OK" in statuses.values():
            self.tally.problem("corrupted", "%s: sides disagree: %s" % (where, statuses))
            return "corrupted"
        if not hit:
            self.tally.problem("unexpected", "%s: not hit by %s, yet %s" % (where, kind, [
                (o["side"], o["status"], o["error"]) for e, t, o in outs]))
            return "unexpected"
        allowed = EXPECTED.get(kind, {})
        bad = [(o["side"], o["status"], o["error"], o["where"]) for e, t, o in outs
               if o["status"] != "OK" and o["status"] not in allowed.get(o["side"], ())]
        if bad:
            self.tally.problem("unexpected", "%s: %s does not explain %s" % (where, kind, bad))
            return "unexpected"
        return "failed"

    # ---- trials

    def run_trial(self, i, kind):
        net_kind = kind.startswith("net-")
        if net_kind and not self.net:
            self.tally.skipped += 1
            log("trial %d %s: SKIPPED (%s)" % (i, kind, self.no_net))
            return
        self.tally.trials += 1
        t_start = time.monotonic()
        rng = self.rng
        # Plans longer than the trial: the engines run until told to stop
        # (SIGUSR1: post nothing new, finish what is under way), so the
        # transfers beside the fault keep flowing through all of it.
        n = self.args.transfers * 10
        s, r = self.pair("main", i, n, 3, self.REGIONS["main"])
        extra, hit = [], {"main"}
        if kind in ("kill-send-client", "kill-recv-client"):
            extra += self.pair("by", i, n, 2, self.REGIONS["by"])
        elif kind == "kill-send-daemon":
            extra.append(self.local(self.dec, i, n))
        elif kind == "kill-recv-daemon":
            extra.append(self.local(self.pre, i, n))
        else:  # network faults: both local pairs are beside the link
            extra += [self.local(self.pre, i, n), self.local(self.dec, i, n)]
        everyone = [s, r] + extra
        self.wait_ready(everyone)
        prober = Prober(self.daemons())
        t_ready = time.monotonic()
        # A random moment while the main pair is busy: once the receiver
        # has granted a random one of its transfers (others are in flight
        # then), plus up to 20 ms.
        k = rng.randint(1, max(1, self.args.transfers - 4))
        kvftest.wait_for(lambda: len(r.of("posted")) >= k or r.proc.poll() is not None,
                         self.t_main * 5 + 10, "the receiver's transfer %d" % k, step=0.002)
        time.sleep(rng.uniform(0, 0.02))  # the random moment: part of the trial, not a wait
        kill_t = time.monotonic()
        delay = kill_t - t_ready
        note = self.strike(kind, s, r)
        time.sleep(0.2)  # a little more traffic after the restart or restore (the trial's load)
        self.stop(everyone)
        stuck = self.finish(everyone)
        worst = prober.stop()
        self.tally.worst_ctl = max([self.tally.worst_ctl] + list(worst.values()))
        for name, w in worst.items():
            if w * 1000 > self.margin_ms:
                self.tally.hung += 1
                self.tally.problem("hung", "trial %d %s: %s took %.1f s to answer kvferryctl status" % (
                    i, kind, name, w))
        # "Restart what was killed": a fresh pair must complete its transfers.
        health = list(self.pair("health", i, 4, 2, self.REGIONS["main"]))
        self.wait_ready(health)
        stuck += self.finish(health)
        inflight = self.in_flight([s, r], kill_t)
        res = self.classify("trial %d %s" % (i, kind), everyone, hit, kill_t, stuck, kind)
        hres = self.classify("trial %d %s health" % (i, kind), health, set(), None, stuck, kind)
        leaks = self.check_leaks(i, kind)
        self.tally.in_flight += inflight
        log("trial %d %s: at %.0f ms (%d in flight) %s; transfers %s; after it %d/%d completed; %s; "
            "slowest status %.0f ms (%.1f s)" % (
                i, kind, delay * 1000, inflight, note, self.brief(res), hres["completed"], 4,
                "LEAKED" if leaks else "no leak", max(worst.values()) * 1000, time.monotonic() - t_start))
        self.engines = []

    @staticmethod
    def in_flight(engines, t):
        """Transfers of the main pair posted before t with an outcome after it
        (or none): those the strike could hit."""
        ids = set()
        for e in engines:
            posted = {o["posted"] for pt, o in e.of("posted") if pt <= t}
            done = {o["outcome"] for ot, o in e.of("outcome") if ot <= t}
            ids |= posted - done
        return len(ids)

    @staticmethod
    def brief(res):
        parts = ["%d completed" % res["completed"]]
        if res["failed"]:
            parts.append("%d failed as expected (%s%s)" % (res["failed"], ", ".join(
                "%s x%d" % kv for kv in sorted(res["errors"].items())),
                "; %d refused at the call" % res["refused"] if res["refused"] else ""))
        for k in ("hung", "corrupted", "unexpected"):
            if res[k]:
                parts.append("%d %s" % (res[k], k.upper()))
        return ", ".join(parts)

    def strike(self, kind, s, r):
        """Does the trial's harm; returns how it went, in words."""
        rng = self.rng
        if kind == "kill-send-client":
            s.kill9()
            self.stop([r])  # post nothing new; finish what is under way
            return "killed the sending engine"
        if kind == "kill-recv-client":
            r.kill9()
            self.stop([s])
            return "killed the receiving engine"
        if kind in ("kill-send-daemon", "kill-recv-daemon"):
            victim, other = (self.pre, r) if kind == "kill-send-daemon" else (self.dec, s)
            victim.kill()
            self.stop([other])
            pause = rng.uniform(0.1, 0.8)
            time.sleep(pause)  # how long the daemon stays dead: the fault itself
            t0 = time.monotonic()
            victim.start()
            self.wait_peers()
            return "killed %s's daemon, restarted it after %.0f ms, peers up in %.0f ms" % (
                victim.name, pause * 1000, (time.monotonic() - t0) * 1000)
        if kind.startswith("net-") or kind.startswith("netem-"):
            note = self.net_fault(kind) if kind.startswith("net-") else self.netem_fault(kind)
            # The link is back: the pair stops at one transfer (a receiver
            # would otherwise wait out the deadline of every grant whose send
            # failed at once while the peer was down).
            self.stop([s, r])
            return note
        raise ValueError(kind)

    def net_fault(self, kind):
        rng = self.rng
        if kind == "net-loss":
            pct, hold = rng.choice([2, 5, 15, 30]), rng.uniform(1.0, 2.5)
            self.net.nft_rule("numgen random mod 100 < %d drop" % pct)
            what = "dropped %d%% of packets both ways for %.1f s" % (pct, hold)
        elif kind == "net-cut-short":
            hold = rng.uniform(0.2, 0.7)
            self.net.nft_rule("drop")
            what = "cut the link (nft drop) for %.0f ms" % (hold * 1000)
        elif kind == "net-cut-long":
            hold = rng.uniform(1.5, 3.0)
            self.net.nft_rule("drop")
            what = "cut the link (nft drop) for %.1f s, past peer-timeout-ms" % hold
        else:
            hold = rng.uniform(0.5, 2.5)
            self.net.link(False)
            what = "took the link down for %.1f s" % hold
        time.sleep(hold)  # how long the fault lasts: the thing under test
        self.net.nft_rule(None)
        self.net.link(True)
        self.wait_peers(20)
        return what

    NETEM = {
        "netem-delay": "delay 20ms 10ms",
        "netem-reorder": "delay 10ms reorder 25% 50%",
        "netem-loss-delay": "delay 5ms loss 3%",
        "netem-duplicate": "delay 2ms duplicate 5%",
        "netem-blackout": "loss 100%",
    }

    def netem_fault(self, kind):
        hold = self.rng.uniform(2.0, 4.0) if kind != "netem-blackout" else self.rng.uniform(1.5, 3.0)
        Netem.set(self.NETEM[kind])
        time.sleep(hold)  # how long the fault lasts: the thing under test
        Netem.set(None)
        self.wait_peers(30)
        return "netem %s on n0 and n1 for %.1f s" % (self.NETEM[kind], hold)

    # ---- the end

    def stop_daemons(self):
        """SIGTERM; each must exit 0 with no sanitizer report in its log."""
        if self.args.busy_loops:
            log("chaos: with %d busy loops, the daemons' polling threads backed off %d times since their "
                "last start" % (self.args.busy_loops, self.spin_backoffs()))
        for d in self.daemons():
            if d is None or d.proc is None:
                continue
            try:
                rc = d.stop()
            except AssertionError as e:
                self.tally.problem("hung", str(e))
                self.tally.hung += 1
                continue
            text = d.log_text()
            marks = [m for m in SAN_LOG_MARKS if m in text]
            if "LeakSanitizer" in text:
                self.tally.leaked += 1
                self.tally.problem("leaked", "%s: LeakSanitizer report:\n%s" % (d.name, text[-4000:]))
            elif rc != 0 or marks:
                self.tally.unexpected += 1
                self.tally.problem("unexpected", "%s exited %s%s:\n%s" % (
                    d.name, rc, " with " + ", ".join(marks) if marks else "", text[-4000:]))
            else:
                log("%s: exit 0 on SIGTERM, no sanitizer report (%d incarnations)" % (d.name, d.incarnation))

    def spin_backoffs(self):
        """The live daemons' spin backoffs since their last start (status)."""
        n = 0
        for d in self.daemons():
            st = ctl(d.sock, "status") if d is not None and d.alive() else None
            n += sum((st or {}).get("spin_backoffs", {}).values())
        return n

    def cleanup(self):
        for e in self.engines:
            if e.proc.poll() is None:
                e.proc.kill()
        for d in self.daemons():
            if d is not None:
                d.kill()
        if self.net:
            self.net.destroy()
        if self.args.vm:
            Netem.set(None)
        failed = bool(self.tally.problems)
        if failed or os.environ.get("KVF_TEST_KEEP", "0") not in ("", "0"):
            if self.args.vm:  # the guest's /tmp dies with it
                keep = os.path.join(self.outdir, "kept-" + os.path.basename(self.dir))
                shutil.copytree(self.dir, keep, ignore=shutil.ignore_patterns("*.sock"))
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = keep
            log("kept %s (daemon logs, plans, engine logs)" % self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.outcomes.close()

    def run(self):
        args = self.args
        if args.vm:
            kinds = VM_KINDS
            self.no_net = None
        else:
            why = None if args.loopback else Netns.unavailable()
            self.no_net = why or "--loopback"
            if not args.loopback and why is None:
                self.net = Netns()
                try:
                    self.net.create()
                except RuntimeError as e:
                    self.net.destroy()
                    self.net, self.no_net = None, str(e)
            if self.net is None:
                log("chaos: network faults SKIPPED: %s; kill trials run on loopback" % self.no_net)
            kinds = KILL_KINDS + NET_KINDS
        if args.kinds:
            kinds = args.kinds.split(",")
            unknown = [k for k in kinds if k not in EXPECTED]
            if unknown:
                raise ValueError("unknown trial kinds %s" % unknown)
        where = ("in the soft-RoCE VM (%s, %s)" % tuple(Netem.devs) if args.vm else
                 "in network namespaces %s, %s" % tuple(self.net.ns) if self.net else "on loopback")
        log("chaos: %d trials, seed %d, build %s%s, daemons %s, transport %s, deadline %d ms + margin %d ms" % (
            args.trials, args.seed, kvftest.BUILD, " (sanitizers)" if self.san else "", where, args.transport,
            self.deadline_ms, self.margin_ms))
        self.start_daemons()
        self.calibrate()
        for i in range(1, args.trials + 1):
            self.run_trial(i, kinds[(i - 1) % len(kinds)])
        self.stop_daemons()


def summary_line(t):
    line = "chaos: trials %d, completed %d, failed-as-expected %d, hung %d, leaked %d, corrupted %d" % (
        t.trials, t.completed, t.failed, t.hung, t.leaked, t.corrupted)
    if t.skipped:
        line += ", skipped %d" % t.skipped
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock; printed)")
    ap.add_argument("--transfers", type=int, default=0,
                    help="transfers of each pair per trial (default 40; 16 in the VM)")
    ap.add_argument("--deadline-ms", type=int, default=0, help="each transfer's deadline")
    ap.add_argument("--max-mib", type=int, default=0, help="largest transfer, MiB")
    ap.add_argument("--kinds", default="", help="comma-separated trial kinds to rotate through")
    ap.add_argument("--loopback", action="store_true", help="no namespaces: kill trials only")
    ap.add_argument("--vm", action="store_true", help="inside ../shared/rdma-vm: netem trials")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "rdma"],
                    help="the daemons' data transport (rdma: in the VM, soft-RoCE)")
    ap.add_argument("--tcp-pollers", type=int, default=0,
                    help="the daemons' tcp-pollers (0: their default; more than 1 runs the sending "
                         "workers' several-pollers path on a small machine)")
    ap.add_argument("--busy-loops", type=int, default=0,
                    help="CPU-bound loops that run through every trial, as engines computing on a "
                         "loaded node (the daemons' polling threads back off from them)")
    ap.add_argument("--grant-spin-us", type=int, default=-1,
                    help="the engines' KVFERRY_GRANT_SPIN_US (-1: the library's default, 0 on fewer than "
                         "4 CPUs): their readers and waiters poll while a grant waits, and stop where "
                         "they lose their CPU")
    args = ap.parse_args()
    if not args.transfers:
        args.transfers = 16 if args.vm else 40
    if args.seed is None:
        args.seed = int(time.time() * 1000) % 1000000
    if not os.access(CLIENT, os.X_OK):
        print("chaos: %s is missing: make test-build BUILD=%s" % (CLIENT, os.path.basename(kvftest.BUILD)),
              file=sys.stderr)
        return 2
    suite = Suite(args)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    crashed = None
    try:
        with kvftest.busy_loops(args.busy_loops):
            suite.run()
    except (Exception, KeyboardInterrupt) as e:  # the summary still comes
        import traceback
        crashed = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        suite.tally.unexpected += 1
        suite.tally.problem("unexpected", "the suite stopped: %s" % crashed)
    finally:
        suite.cleanup()
    t = suite.tally
    log("chaos: %d transfers of the main pairs were in flight when the faults struck; slowest "
        "kvferryctl status during a trial: %.0f ms" % (t.in_flight, t.worst_ctl * 1000))
    if t.problems:
        log("chaos: %d problem(s), %d unexpected; rerun with --seed %d" % (len(t.problems), t.unexpected, args.seed))
    print(summary_line(t), flush=True)
    bad = t.hung or t.leaked or t.corrupted or t.unexpected or crashed
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
