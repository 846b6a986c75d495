"""kvfscale - daemons in network namespaces for make check-scale
(tests/scale/test_scale.py) and the scale benchmark (tests/scale/bench_scale.py,
bench/scale.sh): the namespaces and their bridge, one daemon per namespace,
its resource figures from /proc, and one verified transfer."""
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "ops"))
import kvftest  # noqa: E402  first: puts the binding from the source tree on sys.path
import kvfetcd  # noqa: E402

import kvferry  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def sh(*argv, check=True):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(argv), r.stderr.strip()))
    return r


def why_not():
    if os.geteuid() != 0:
        return "not root (network namespaces)"
    if not shutil.which("ip"):
        return "no ip (apt-get install iproute2)"
    if not kvfetcd.ETCD:
        return kvfetcd.SKIP_WHY
    return None


pattern = kvftest.pattern  # bytes that differ per seed and position


class Net:
    """A bridge (SUBNET.1, etcd's address) and one namespace per daemon,
    PREFIX0 .. PREFIX{n-1}. Each user has its own prefix and subnet, so that
    make check-scale and the benchmark can run side by side.

    The kernel's ARP table is one for all namespaces, gc_thresh3 (default
    1024) entries in all: N namespaces that each talk to every other need
    about N x N, and past the bound new entries fail ("neighbour: arp_cache:
    neighbor table overflow!"), so some pairs cannot reach each other for
    seconds. create() raises the bounds for the run; destroy() restores
    them."""

    NEIGH = "/proc/sys/net/ipv4/neigh/default/gc_thresh%d"

    def __init__(self, n, prefix="kvfs", subnet="10.79.0"):
        self.n, self.prefix, self.subnet = n, prefix, subnet
        self.bridge = prefix + "br0"
        self.saved = {}

    def raise_neigh_bounds(self):
        need = 4 * (self.n + 2) ** 2
        for k, want in ((2, need // 2), (3, need)):
            with open(self.NEIGH % k) as f:
                cur = int(f.read())
            if cur < want:
                self.saved[k] = cur
                with open(self.NEIGH % k, "w") as f:
                    f.write(str(want))

    @property
    def host(self):
        return self.subnet + ".1"

    def ip(self, i):
        return "%s.%d" % (self.subnet, 10 + i)

    def ns(self, i):
        return "%s%d" % (self.prefix, i)

    def create(self):
        self.destroy()  # what a killed run left
        self.raise_neigh_bounds()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", self.host + "/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i in range(self.n):
            ns = self.ns(i)
            h, c = ns + "h", ns + "n"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", h, "type", "veth", "peer", "name", c)
            sh("ip", "link", "set", c, "netns", ns)
            sh("ip", "link", "set", h, "master", self.bridge)
            sh("ip", "link", "set", h, "up")
            sh("ip", "-n", ns, "addr", "add", self.ip(i) + "/24", "dev", c)
            sh("ip", "-n", ns, "link", "set", c, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def destroy(self):
        for i in range(self.n):
            sh("ip", "netns", "del", self.ns(i), check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        for k in sorted(self.saved, reverse=True):  # thresh3 first: 2 <= 3 holds throughout
            with open(self.NEIGH % k, "w") as f:
                f.write(str(self.saved.pop(k)))


# The daemons' common settings: fast failure detection and a short lease,
# small pools, few tcp streams (a 2-core machine runs dozens of daemons).
BASE_CONF = ("heartbeat-ms 200\npeer-timeout-ms 1500\nreconnect-min-ms 50\nreconnect-max-ms 500\n"
             "tcp-streams 2\npeer-idle-close-ms 5000\ntransports tcp\n")


class Node:
    """Daemon i of net: node name nII, peer-listen on the namespace's
    address, registry at registry (an etcd:// URL, or None). extra: config
    lines after the common ones (a key given twice keeps the last value);
    peers: (name, ip) of static peer lines."""

    def __init__(self, dir, i, net, registry, ttl_ms=2000, pool="8M", extra="", peers=()):
        self.i, self.name, self.ns, self.ip = i, "n%02d" % i, net.ns(i), net.ip(i)
        self.sock = os.path.join(dir, self.name + ".sock")
        self.conf = os.path.join(dir, self.name + ".conf")
        self.log = os.path.join(dir, self.name + ".log")
        with open(self.conf, "w") as f:
            f.write("node %s\napi-socket %s\npeer-listen %s:7470\npool kv host %s\n"
                    % (self.name, self.sock, self.ip, pool))
            if registry:
                f.write("registry %s\nregistry-ttl-ms %d\n" % (registry, ttl_ms))
            f.write(BASE_CONF)
            f.writelines("peer %s %s:7470\n" % p for p in peers)
            f.write(extra + "\n")
            f.write(os.environ.get("KVF_SCALE_EXTRA", "") + "\n")  # e.g. log-level debug
        self.proc = None

    def start(self):
        with open(self.log, "a") as log:
            log.write("=== kvfscale: starting %s\n" % self.name)
            log.flush()
            # cwd: its own dir, where a core dump lands (core_pattern "core")
            self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, kvftest.KVFERRYD, "-c", self.conf],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         cwd=os.path.dirname(self.conf))

    def ready(self):
        if self.proc.poll() is not None:
            with open(self.log) as f:
                raise AssertionError("%s exited with %s:\n%s" % (self.name, self.proc.returncode, f.read()[-2000:]))
        try:
            kvferry.Client(self.sock).close()
            return True
        except kvferry.KvferryError:
            return False

    def inspect(self, what):
        with kvferry.Client(self.sock) as c:
            return c.inspect(what, json=True)

    def members(self):
        return sorted(p["name"] for p in self.inspect("peers")["peers"])

    def links_up(self):
        return sum(p["state"] == "up" for p in self.inspect("peers")["peers"])

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        return kvftest.stop_proc(self.proc, 15)

    def usage(self):
        """(threads, fds, RSS KiB) of the daemon."""
        pid = self.proc.pid  # ip netns exec execs the daemon: same pid
        with open("/proc/%d/status" % pid) as f:
            st = dict(line.split(":", 1) for line in f)
        return int(st["Threads"]), len(os.listdir("/proc/%d/fd" % pid)), int(st["VmRSS"].split()[0])

    def cpu(self):
        """CPU seconds (user + system) the daemon has used, all its threads."""
        with open("/proc/%d/stat" % self.proc.pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: fields 14 and 15


move = kvftest.move  # one verified transfer
