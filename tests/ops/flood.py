"""flood - the local-client floods of issue 15 (items 1 and 2), shared by
tests/ops/test_flood.py (small, with bounds) and bench/flood_clients.py
(the issue's sizes, with figures).

- flood(): clients each post grants, then each pipelines TRANSFERS inspect
  requests at once and reads every reply; meanwhile an unrelated client
  (its own process, the Python binding) times one small request after
  another, and the peer links are watched (downs before and after).
- unread(): clients pipeline inspect requests and never read; the daemon's
  VmRSS is sampled before, during and after they go, while an unrelated
  client keeps working.

The flood clients speak the wire by hand (kvftest's encodings) in their
own processes: pipelining is what the issue did, and Python's GIL must not
slow the unrelated client's timing."""
import json
import multiprocessing
import os
import socket
import struct
import time

import kvftest
from kvftest import read_varint
from kvftest import field_bytes, field_varint, request

INSPECT_TRANSFERS = 3
INSPECT_STATUS = 0
GRANT_BYTES = 256


def grant_frame(seq, xfer_id, src_node, pool, offset, length, deadline_ms):
    descs = field_bytes(4, struct.pack("<IQQ", pool, offset, length))
    body = field_bytes(1, xfer_id) + field_bytes(2, src_node) + field_bytes(3, descs)
    return request(seq, 13, body + field_varint(4, deadline_ms))


def inspect_frame(seq, what, as_json=True):
    return request(seq, 16, field_varint(1, what) + field_varint(2, 1 if as_json else 0))


class Wire:
    """A raw client that reads whole frames fast (replies of megabytes)."""

    def __init__(self, path, name):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(60)
        self.s.connect(path)
        self.s.sendall(kvftest.hello_frame(1, name))
        seq, status, _ = self.reply()
        assert (seq, status) == (1, 0), (seq, status)

    def _exact(self, n):
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.s.recv_into(view[got:])
            if not k:
                raise ConnectionError("the daemon closed the connection")
            got += k
        return buf

    def reply(self):
        """(seq, status, message bytes) of the next response (events are skipped)."""
        while True:
            n = struct.unpack("<I", self._exact(4))[0]
            msg = self._exact(n)
            key, i = read_varint(msg, 0)
            if key >> 3 != 1:
                continue  # an event
            _, i = read_varint(msg, i)  # the response's length
            fields = {}
            while i < len(msg) and len(fields) < 2:
                key, i = read_varint(msg, i)
                if key & 7 != 0:
                    break
                fields[key >> 3], i = read_varint(msg, i)
            return fields.get(1, 0), kvftest.zigzag(fields.get(2, 0)), msg

    def close(self):
        self.s.close()


def _text_of(msg):
    """The text of an InspectResp inside an ApiMessage's response."""
    resp = kvftest.pb_decode(kvftest.pb_decode(bytes(msg))[1][0])
    return kvftest.pb_decode(resp[16][0])[1][0].decode() if 16 in resp else ""


# ---------------------------------------------------------------- the flood

def _flood_client(sock, idx, grants, inspects, pool, peer, ready, go, out):
    try:
        w = Wire(sock, "flood%d" % idx)
        seq = 1
        for start in range(0, grants, 500):  # a window: its replies are read as it goes
            batch = range(start, min(grants, start + 500))
            w.s.sendall(b"".join(grant_frame(seq + 1 + i, "f%d-%d" % (idx, i), peer, pool,
                                             (idx * grants + i) * GRANT_BYTES, GRANT_BYTES, 600000)
                                 for i in batch))
            for i in batch:
                s, status, _ = w.reply()
                assert status == 0, "grant %d: status %d" % (i, status)
            seq += len(batch)
        ready.wait(120)
        go.wait(120)
        t0 = time.monotonic()
        w.s.sendall(b"".join(inspect_frame(seq + 1 + i, INSPECT_TRANSFERS) for i in range(inspects)))
        nbytes, last = 0, None
        for i in range(inspects):
            s, status, msg = w.reply()
            assert (s, status) == (seq + 1 + i, 0), (s, status, seq + 1 + i)
            nbytes += len(msg)
            last = msg
        listed = len(json.loads(_text_of(last))["transfers"])
        out.put({"idx": idx, "ok": True, "seconds": time.monotonic() - t0, "bytes": nbytes,
                 "listed": listed})
        go.wait(120)  # holds its grants until every client is done
        w.close()
    except Exception as e:  # reported, not raised: the parent says what failed
        out.put({"idx": idx, "ok": False, "error": "%s: %s" % (type(e).__name__, e)})


def _prober(sock, stop, out, interval):
    """The unrelated client: one small request at a time, timed."""
    import kvferry
    lat, errors, not_up = [], [], 0
    try:
        c = kvferry.Client(sock)
    except Exception as e:
        out.put({"lat": [], "errors": [repr(e)], "not_up": 0})
        return
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            peers = c.inspect("peers", json=True)["peers"]
            lat.append(time.monotonic() - t0)
            not_up += any(p["state"] != "up" for p in peers)
        except Exception as e:
            lat.append(time.monotonic() - t0)
            errors.append(repr(e))
        stop.wait(interval)
    c.close()
    out.put({"lat": lat, "errors": errors, "not_up": not_up})


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))] if xs else float("nan")


def downs(d):
    with d.client() as c:
        return sum(p["downs"] for p in c.inspect("peers", json=True)["peers"])


def flood(pre, dec, clients, grants, inspects, interval=0.005, timeout=600):
    """Runs the flood against pre (dec its peer); returns the figures."""
    ctx = multiprocessing.get_context("fork")
    with pre.client() as c:
        pool = c.pool_find("kv").id
    downs0 = (downs(pre), downs(dec))
    ready, go = ctx.Barrier(clients + 1), ctx.Barrier(clients + 1)
    out, pout, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_flood_client, args=(pre.sock, i, grants, inspects, pool, dec.name,
                                                     ready, go, out)) for i in range(clients)]
    for p in procs:
        p.start()
    ready.wait(timeout)
    probe = ctx.Process(target=_prober, args=(pre.sock, stop, pout, interval))
    probe.start()
    time.sleep(0.2)  # the prober's baseline: a few requests before the flood (pacing, not a sync)
    t0 = time.monotonic()
    go.wait(timeout)
    results = [out.get(timeout=timeout) for _ in procs]
    seconds = time.monotonic() - t0
    stop.set()
    probed = pout.get(timeout=60)
    probe.join(30)
    try:
        go.wait(60)
    except Exception:
        pass
    for p in procs:
        p.join(60)
    lat = probed["lat"]
    return {
        "clients": clients, "grants": grants, "inspects": inspects,
        "flood_ok": all(r["ok"] for r in results),
        "flood_errors": [r["error"] for r in results if not r["ok"]],
        "listed": min((r["listed"] for r in results if r["ok"]), default=0),
        "reply_mb": round(sum(r.get("bytes", 0) for r in results) / 1e6, 1),
        "seconds": round(seconds, 2),
        "probes": len(lat), "probe_errors": probed["errors"][:5], "probes_not_up": probed["not_up"],
        "p50_ms": round(pct(lat, 50) * 1e3, 2), "p99_ms": round(pct(lat, 99) * 1e3, 2),
        "max_ms": round(max(lat) * 1e3, 2) if lat else None,
        "link_drops": (downs(pre) - downs0[0]) + (downs(dec) - downs0[1]),
    }


# ---------------------------------------------------------------- unread replies

def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def post_grants(sock, n, pool, peer, prefix="hold", base=32 << 20):
    """A client that holds n grants (for inspect replies of some size)."""
    w = Wire(sock, prefix)
    for start in range(0, n, 500):
        batch = range(start, min(n, start + 500))
        w.s.sendall(b"".join(grant_frame(2 + i, "%s-%d" % (prefix, i), peer, pool, base + i * GRANT_BYTES,
                                         GRANT_BYTES, 600000) for i in batch))
        for i in batch:
            assert w.reply()[1] == 0, "grant %d refused" % i
    return w


def non_reader(sock, name, what, n):
    """A client that pipelines n inspect requests and never reads. Its
    socket is left to the caller (to close when it is done with it)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.settimeout(30)
    s.sendall(kvftest.hello_frame(1, name) + b"".join(inspect_frame(2 + i, what) for i in range(n)))
    return s

