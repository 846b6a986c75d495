"""kvftest - helpers of the operations tests (tests/ops): real kvferryd
processes in a temp dir, the Python binding from the source tree, and a
unittest runner that prints TAP for tests/run.sh.

Environment: BUILD (the build dir, default build; run.sh sets it),
KVF_TEST_KEEP=1 keeps the temp dirs, KVF_OPS_MAKE overrides `make` for
the install test. Every wait is bounded.
"""
import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, os.environ.get("BUILD", "build"))
LIB = os.path.join(BUILD, "libkvferry.so")
KVFERRYD = os.path.join(BUILD, "kvferryd")
ROGUE = os.path.join(BUILD, "tests", "kvferryd-rogue")  # the failpoint build (daemon/failpoint.h)
KVFERRYCTL = os.path.join(BUILD, "kvferryctl")
READY_S = 10
STOP_S = 10


# ---------------------------------------------------------------- sanitizers

def _needs_asan(path):
    try:
        with open(path, "rb") as f:
            return b"libasan.so" in f.read()
    except OSError:
        return False


def daemon_sanitized():
    """Whether kvferryd is an ASan build (its allocator keeps freed memory
    in a quarantine: RSS does not come back as with glibc's malloc)."""
    return _needs_asan(KVFERRYD)


def _asan_loaded():
    with open("/proc/self/maps") as f:
        return "libasan" in f.read()


def _sanitizer_reexec():
    """An ASan build's libkvferry can only be loaded into a process that
    has the ASan runtime first: re-exec this test with it preloaded (and
    leak checks off: the interpreter itself is not leak-clean). Children
    get the environment as it was, so the daemons keep their leak checks."""
    if _asan_loaded():
        orig = os.environ.pop("KVF_ORIG_ENV_ASAN", None)
        if orig is not None:
            os.environ.pop("LD_PRELOAD", None)
            if orig == "-":
                os.environ.pop("ASAN_OPTIONS", None)
            else:
                os.environ["ASAN_OPTIONS"] = orig
        return
    if not _needs_asan(LIB):
        return
    cc = shutil.which("cc") or shutil.which("gcc")
    runtime = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip() if cc else ""
    if not runtime or not os.path.exists(runtime):
        return  # the tests that load the library will fail and say why
    env = dict(os.environ)
    env["KVF_ORIG_ENV_ASAN"] = env.get("ASAN_OPTIONS", "-")
    env["LD_PRELOAD"] = runtime
    env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=0"  # the last one wins
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def sanitized():
    """True in the ASan/UBSan build (compiled clients need the flags)."""
    return _needs_asan(LIB)


def python_env(**extra):
    """The environment for a child Python that loads libkvferry: in the
    sanitizer build it needs the ASan runtime preloaded, as this one has."""
    env = dict(os.environ, **extra)
    if sanitized():
        with open("/proc/self/maps") as f:
            runtime = next((l.split()[-1] for l in f if "libasan" in l), None)
        if runtime:
            env["LD_PRELOAD"] = runtime
            env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=0"
    return env


_sanitizer_reexec()
os.environ.setdefault("KVFERRY_LIB", LIB)
sys.path.insert(0, os.path.join(REPO, "client", "python"))


# ---------------------------------------------------------------- temp dirs

_dirs = []
_failed = False


@contextlib.contextmanager
def busy_loops(n):
    """n CPU-bound processes (sh busy loops) for the with block, as engines
    computing on a loaded node; killed and reaped at its end."""
    procs = []
    try:
        procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


@contextlib.contextmanager
def environ(**changes):
    """os.environ with each name set to its value (None: unset) for the with
    block (a client reads its KVFERRY_* settings at connect), then as it
    was."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        for k, v in changes.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tempdir():
    """A fresh dir under /tmp (short: daemons' sockets live there); kept
    when a test fails. tests/run.sh shows the *.log files of dirs announced
    like this."""
    d = tempfile.mkdtemp(prefix="kvferry-ops.", dir="/tmp")
    _dirs.append(d)
    print("kvf-harness: temp dir %s" % d, file=sys.stderr, flush=True)
    return d


def _cleanup():
    keep = os.environ.get("KVF_TEST_KEEP", "0") not in ("", "0")
    for d in _dirs:
        if _failed or keep:
            print("kvf-harness: kept %s" % d, file=sys.stderr)
        else:
            shutil.rmtree(d, ignore_errors=True)


def free_ports(n):
    """n distinct free TCP ports on 127.0.0.1."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(cond, timeout, what, step=0.02):
    """Polls cond() until it returns something true, and returns that, as
    Redis's wait_for_condition: tests wait on the condition they need (a
    status counter, an inspect field, a log line, an event), never for a
    fixed time, so that a slow machine makes them slower, not flaky or
    silently weaker. On timeout, fails saying what was awaited and what
    cond() last returned (when that says more than False). Polls every
    millisecond at first, backing off to step."""
    end = time.monotonic() + timeout
    delay = 0.001
    while True:
        late = time.monotonic() > end  # before the check: one slow check still counts
        v = cond()
        if v:
            return v
        if late:
            seen = "" if v is None or v is False else " (last seen: %r)" % (v,)
            raise AssertionError("timed out after %.1fs waiting for %s%s" % (timeout, what, seen))
        time.sleep(delay)
        delay = min(delay * 2, step)


# ---------------------------------------------------------------- daemons

class Daemon:
    """One kvferryd with a config in dir: node name, host pool "kv",
    peer-listen on a free loopback port, optional metrics on loopback."""

    def __init__(self, dir, name, pool="64M", metrics=False, extra=""):
        self.dir, self.name = dir, name
        self.conf = os.path.join(dir, name + ".conf")
        self.sock = os.path.join(dir, name + ".sock")
        self.log = os.path.join(dir, name + ".log")
        self.port = free_ports(1)[0]
        self.pool = pool
        self.metrics = metrics
        self.extra = extra
        self.peers = []  # (name, port)
        self.proc = None

    def add_peer(self, other, port=None):
        self.peers.append((other.name, port or other.port))

    def config_text(self):
        lines = ["# written by tests/ops", "node " + self.name, "api-socket " + self.sock,
                 "peer-listen 127.0.0.1:%d" % self.port]
        lines += ["peer %s 127.0.0.1:%d" % p for p in self.peers]
        if self.pool:
            lines.append("pool kv host " + self.pool)
        if self.metrics:
            lines.append("metrics-listen 127.0.0.1:0")
        lines += ["heartbeat-ms 100", "peer-timeout-ms 1000", "reconnect-min-ms 50",
                  "reconnect-max-ms 300", "transports tcp", self.extra]
        return "\n".join(lines) + "\n"

    def write_conf(self, text=None):
        with open(self.conf, "w") as f:
            f.write(text if text is not None else self.config_text())

    failpoint = None  # e.g. "result-lost": runs the failpoint build with KVF_FAILPOINT set

    def start(self, env=None, wait=True):
        self.write_conf()
        binary = KVFERRYD
        if self.failpoint:
            binary, env = ROGUE, dict(env or os.environ, KVF_FAILPOINT=self.failpoint)
        with open(self.log, "a") as log:
            log.write("=== kvftest: starting %s%s\n" % (self.name, " (%s)" % self.failpoint if self.failpoint else ""))
            log.flush()
            self.proc = subprocess.Popen([binary, "-c", self.conf], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, env=env)
        if wait:
            self.wait_ready()
        return self

    def api_answers(self):
        import kvferry
        try:
            kvferry.Client(self.sock).close()
            return True
        except kvferry.KvferryError:
            return False

    def wait_ready(self, timeout=READY_S):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError("%s exited with %s during start:\n%s" % (
                    self.name, self.proc.returncode, self.log_text()[-3000:]))
            return self.api_answers()
        wait_for(ready, timeout, "%s's API socket" % self.name)

    def client(self):
        import kvferry
        return kvferry.Client(self.sock)

    def status(self):
        with self.client() as c:
            return c.inspect("status", json=True)

    def peers_up(self):
        with self.client() as c:
            peers = c.inspect("peers", json=True)["peers"]
        return peers and all(p["state"] == "up" for p in peers)

    def wait_peers_up(self, timeout=READY_S):
        wait_for(self.peers_up, timeout, "%s's peers up" % self.name)

    def metrics_url(self):
        return self.status()["metrics"]

    def signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, timeout=STOP_S):
        """SIGTERM; returns the exit status (fails on a hang)."""
        if not self.proc or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("%s did not exit within %ss of SIGTERM" % (self.name, timeout))

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_text(self):
        try:
            with open(self.log) as f:
                return f.read()
        except OSError:
            return ""


def pair(dir, pool="64M", metrics=False, extra="", extra_of=None, failpoint_of=None):
    """"prefill" and "decode", peered, started, both peers up. extra_of:
    config lines by daemon name, after extra (e.g. each one's rdma-listen);
    failpoint_of: a failpoint by daemon name (that daemon runs the
    failpoint build, Daemon.failpoint)."""
    extra_of, failpoint_of = extra_of or {}, failpoint_of or {}
    pre = Daemon(dir, "prefill", pool, metrics, extra + extra_of.get("prefill", ""))
    dec = Daemon(dir, "decode", pool, metrics, extra + extra_of.get("decode", ""))
    pre.failpoint, dec.failpoint = failpoint_of.get("prefill"), failpoint_of.get("decode")
    pre.add_peer(dec)
    dec.add_peer(pre)
    pre.start()
    dec.start()
    pre.wait_peers_up()
    dec.wait_peers_up()
    return pre, dec


def wait_event(client, xfer_id, timeout=10.0, type=None):
    """The next event of xfer_id (of that type, when given). Other events
    are kept on the client for later calls."""
    stash = client.__dict__.setdefault("_kvftest_stash", [])
    match = lambda ev: ev.xfer_id == xfer_id and type in (None, ev.type)  # noqa: E731
    end = time.monotonic() + timeout
    while True:
        for ev in stash:
            if match(ev):
                stash.remove(ev)
                return ev
        left = int(max(0, end - time.monotonic()) * 1000)
        stash.extend(client.wait_events(16, left))
        if not any(match(ev) for ev in stash) and time.monotonic() >= end:
            raise AssertionError("no event for %s within %.1fs" % (xfer_id, timeout))


def pattern(seed, n):
    """n bytes that differ per seed and per position."""
    block = bytes((seed * 131 + i * 7) & 0xFF for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


def peer_row(daemon, name):
    """daemon's inspect("peers") entry for peer name."""
    with daemon.client() as c:
        return next(p for p in c.inspect("peers", json=True)["peers"] if p["name"] == name)


def peer_both(test, a, b):
    """Daemons a and b each get the other as a peer line; the test's
    cleanup kills both."""
    a.add_peer(b)
    b.add_peer(a)
    test.addCleanup(a.kill)
    test.addCleanup(b.kill)


def move(cs, cd, ps, pd, src, dst, xid, off, data, deadline_ms, wait_s):
    """One transfer of data from src (client cs, pool ps) to offset off of
    dst's pool pd (client cd): grant, send, both outcomes. Returns
    (receiver event, sender event, every byte landed). A refusal raises
    kvferry.KvferryError; no outcome within wait_s raises AssertionError."""
    import kvferry
    ps.memory[off:off + len(data)] = data
    pd.memory[off:off + len(data)] = bytes(len(data))
    cd.grant(xid, src.name, [(pd.id, off, len(data))], deadline_ms=deadline_ms)
    cs.send(xid, dst.name, [(ps.id, off, len(data))], deadline_ms=deadline_ms)
    er = wait_event(cd, xid, wait_s, kvferry.RECV_DONE)
    es = wait_event(cs, xid, wait_s, kvferry.SEND_DONE)
    return er, es, bytes(pd.memory[off:off + len(data)]) == data


def stop_proc(proc, timeout):
    """SIGTERM, then SIGKILL after timeout s: the exit status, or "hung"."""
    if not proc or proc.poll() is not None:
        return proc.returncode if proc else 0
    proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "hung"


def run(cmd, timeout=120, **kw):
    """subprocess.run with text output; never hangs the suite."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# ---------------------------------------------------------------- protobuf, by hand
# For tests that speak the wire themselves (no protobuf module needed):
# the encodings proto/kvferry.proto's messages use, and a decoder into
# {field number: [values]} (ints for varints, bytes for the rest).

def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def field_varint(num, v):
    return varint(num << 3) + varint(v)


def field_bytes(num, b):
    if isinstance(b, str):
        b = b.encode()
    return varint(num << 3 | 2) + varint(len(b)) + b


def read_varint(buf, i):
    v = shift = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, i


def pb_decode(buf):
    """{field number: [values]}: ints for varints, bytes for the rest."""
    out, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(buf, i)
        elif wt == 2:
            n, i = read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wt == 1:
            v, i = buf[i:i + 8], i + 8
        elif wt == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise AssertionError("wire type %d" % wt)
        out.setdefault(num, []).append(v)
    return out


def zigzag(v):
    """A sint32/sint64 field's value from its varint."""
    return (v >> 1) ^ -(v & 1)


def frame(msg):
    """A message framed as proto/frame.h frames it: u32 little-endian length."""
    return struct.pack("<I", len(msg)) + msg


def request(seq, body_num, body):
    """An ApiRequest frame: seq and one body field."""
    return frame(field_varint(1, seq) + field_bytes(body_num, body))


def hello_frame(seq, name):
    return request(seq, 10, field_varint(1, 1) + field_bytes(2, name))


class Raw:
    """A client that writes frames and reads ApiMessages."""

    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(5)
        self.s.connect(path)
        self.buf = b""

    def write(self, frame, fds=()):
        """Sends a frame; fds ride with its first byte (SCM_RIGHTS), as
        libkvferry sends them."""
        if fds:
            n = socket.send_fds(self.s, [frame], list(fds))
            if n < len(frame):
                self.s.sendall(frame[n:])
        else:
            self.s.sendall(frame)

    def next(self, timeout=5.0):
        """('response', seq, status, fields) or ('event', id, status, fields);
        None when nothing comes within timeout. A Soon (the daemon's hint
        that an event is near) is skipped, as a client may."""
        self.s.settimeout(timeout)
        while True:
            while len(self.buf) < 4 or len(self.buf) < 4 + struct.unpack("<I", self.buf[:4])[0]:
                try:
                    chunk = self.s.recv(65536)
                except socket.timeout:
                    return None
                if not chunk:
                    raise AssertionError("the daemon closed the connection")
                self.buf += chunk
            n = struct.unpack("<I", self.buf[:4])[0]
            msg, self.buf = pb_decode(self.buf[4:4 + n]), self.buf[4 + n:]
            if 1 in msg:
                r = pb_decode(msg[1][0])
                return ("response", r.get(1, [0])[0], zigzag(r.get(2, [0])[0]), r)
            if 2 in msg:
                e = pb_decode(msg[2][0])
                return ("event", e.get(2, [b""])[0], zigzag(e.get(3, [0])[0]), e)
            # else a Soon (3) or a kind this client does not know: the next

    def close(self):
        self.s.close()



# ---------------------------------------------------------------- TAP

class TapResult(unittest.TestResult):
    """Prints one TAP line per test as it ends ("# " lines carry the
    failure), which tests/run.sh counts."""

    def __init__(self):
        super().__init__()
        self.n = 0

    @staticmethod
    def _name(test):
        module = os.path.splitext(os.path.basename(sys.argv[0]))[0]
        return test.id().replace("__main__", module)

    def _line(self, ok, test, extra=""):
        self.n += 1
        print("%s %d - %s%s" % ("ok" if ok else "not ok", self.n, self._name(test), extra),
              flush=True)

    def _diag(self, err):
        text = "".join(traceback.format_exception(*err))
        for line in text.rstrip().splitlines()[-30:]:
            print("# " + line, flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._line(True, test)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._line(False, test)
        self._diag(err)

    def addError(self, test, err):
        super().addError(test, err)
        self._line(False, test)
        self._diag(err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.n += 1
        print("ok %d # SKIP %s: %s" % (self.n, self._name(test), reason), flush=True)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._line(True, test, " # expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._line(False, test, " # unexpected success")


def main():
    """Runs the calling module's tests with TAP output; exits 1 on failure."""
    global _failed
    suite = unittest.defaultTestLoader.loadTestsFromModule(sys.modules["__main__"])
    print("1..%d" % suite.countTestCases(), flush=True)
    result = TapResult()
    try:
        suite.run(result)
    finally:
        _failed = not result.wasSuccessful()
        _cleanup()
    sys.exit(0 if result.wasSuccessful() else 1)


class SoloTestCase(unittest.TestCase):
    """Tests against one daemon "solo" (pool POOL) for the whole class; it
    must exit 0 at the end."""
    POOL = "8M"

    @classmethod
    def setUpClass(cls):
        cls.d = Daemon(tempdir(), "solo", pool=cls.POOL).start()

    @classmethod
    def tearDownClass(cls):
        assert cls.d.stop() == 0


class PairTestCase(unittest.TestCase):
    """Tests against one "prefill"/"decode" pair for the whole class (pool
    POOL each; FAILPOINTS: pair's failpoint_of); both daemons must exit 0
    at the end."""
    POOL = "32M"
    FAILPOINTS = {}

    @classmethod
    def setUpClass(cls):
        cls.dir = tempdir()
        cls.pre, cls.dec = pair(cls.dir, pool=cls.POOL, failpoint_of=cls.FAILPOINTS)

    @classmethod
    def tearDownClass(cls):
        for d in (cls.pre, cls.dec):
            assert d.stop() == 0


class PairClientsTestCase(PairTestCase):
    """A PairTestCase whose every test has a client of each daemon (cp,
    cd) and its pool "kv" (pp, pd)."""

    def setUp(self):
        self.cp, self.cd = self.pre.client(), self.dec.client()
        self.pp, self.pd = self.cp.pool_find("kv"), self.cd.pool_find("kv")

    def tearDown(self):
        self.cp.close()
        self.cd.close()
