#!/usr/bin/env python3
"""The Prometheus endpoint: scraped with real HTTP clients (urllib, and
curl when installed), parsed strictly as the text exposition format, and
checked against transfers made, failed and refused; plus the HTTP edges
(HEAD, 404, 405, 431, a stalled client, Content-Length, Connection: close)
and metrics being off unless configured."""
import http.client
import math
import os
import re
import shutil
import socket
import subprocess
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, wait_event

import kvferry

NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def parse_labels(text):
    labels, pos = {}, 0
    while pos < len(text):
        m = LABEL.match(text, pos)
        if not m:
            raise ValueError("bad labels {%s}" % text)
        if m.group(1) in labels:
            raise ValueError("label %s twice" % m.group(1))
        labels[m.group(1)] = m.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        pos = m.end()
    return labels


def parse_exposition(text):
    """{family: {"type", "help", "samples": [(name, labels, value)]}},
    raising ValueError on anything the text format (0.0.4) forbids."""
    fams, current = {}, None
    if not text.endswith("\n"):
        raise ValueError("no final newline")
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            if not NAME.match(name) or name in fams:
                raise ValueError("line %d: bad or repeated family %s" % (n, name))
            current = fams[name] = {"help": help_, "type": None, "samples": []}
        elif line.startswith("# TYPE "):
            name, _, type_ = line[7:].partition(" ")
            if name not in fams or fams[name]["type"] or type_ not in TYPES:
                raise ValueError("line %d: TYPE %s %s" % (n, name, type_))
            fams[name]["type"] = type_
        elif line.startswith("#") or not line:
            continue
        else:
            m = re.match(r"([^{\s]+)(?:\{(.*)\})?\s+(\S+)$", line)
            if not m or not current:
                raise ValueError("line %d: bad sample %r" % (n, line))
            name, labels, value = m.group(1), parse_labels(m.group(2) or ""), float(m.group(3))
            family = [f for f in fams if name == f or (fams[f]["type"] == "histogram" and
                                                      name in (f + "_bucket", f + "_sum", f + "_count"))]
            if family != [list(fams)[-1]]:
                raise ValueError("line %d: %s outside its family" % (n, name))
            current["samples"].append((name, labels, value))
    for name, f in fams.items():
        if f["type"] is None:
            raise ValueError("family %s has no TYPE" % name)
        if f["type"] == "counter" and not name.endswith("_total"):
            raise ValueError("counter %s does not end in _total" % name)
        keys = [(s[0], tuple(sorted(s[1].items()))) for s in f["samples"]]
        if len(keys) != len(set(keys)):
            raise ValueError("family %s repeats a series" % name)
    return fams


def value(fams, family, sample=None, **labels):
    """The value of the one sample matching labels (0 when absent)."""
    found = [v for n, l, v in fams[family]["samples"]
             if n == (sample or family) and all(l.get(k) == str(x) for k, x in labels.items())]
    if len(found) > 1:
        raise AssertionError("%d samples of %s match %r" % (len(found), family, labels))
    return found[0] if found else 0


def total(fams, family, **labels):
    """The sum of the samples matching labels, whatever their other labels."""
    return sum(v for n, l, v in fams[family]["samples"]
               if n == family and all(l.get(k) == str(x) for k, x in labels.items()))


def check_histograms(test, fams):
    for name, f in fams.items():
        if f["type"] != "histogram":
            continue
        series = {}
        for n, l, v in f["samples"]:
            key = tuple(sorted((k, x) for k, x in l.items() if k != "le"))
            series.setdefault(key, {"buckets": [], "count": None})
            if n.endswith("_bucket"):
                series[key]["buckets"].append((float(l["le"]), v))
            elif n.endswith("_count"):
                series[key]["count"] = v
        for key, s in series.items():
            les = [le for le, _ in s["buckets"]]
            counts = [c for _, c in s["buckets"]]
            test.assertEqual(les, sorted(les), "%s%r buckets out of order" % (name, key))
            test.assertTrue(math.isinf(les[-1]), "%s%r has no +Inf bucket" % (name, key))
            test.assertEqual(counts, sorted(counts), "%s%r not cumulative" % (name, key))
            test.assertEqual(counts[-1], s["count"], "%s%r +Inf != count" % (name, key))


def scrape(url, method="GET"):
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status, dict(r.headers), r.read().decode()


def raw_http(port, data, timeout=5):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out.decode(errors="replace")
            out += chunk
    finally:
        s.close()


class TestMetrics(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        cls.pre, cls.dec = kvftest.pair(cls.dir, pool="32M", metrics=True)
        cls.cp, cls.cd = cls.pre.client(), cls.dec.client()
        cls.pp, cls.pd = cls.cp.pool_find("kv"), cls.cd.pool_find("kv")
        cls.url_pre, cls.url_dec = cls.pre.metrics_url(), cls.dec.metrics_url()
        cls.port_pre = urllib.parse.urlparse(cls.url_pre).port
        cls.traffic()

    @classmethod
    def traffic(cls):
        """3 good transfers of 4 x 64 KiB, one that misses its deadline,
        one refused request."""
        blk = 65536
        for i in range(3):
            xid = "m-ok-%d" % i
            cls.cd.grant(xid, "prefill", [cls.pd.desc(j * blk, blk) for j in range(4)])
            cls.cp.send(xid, "decode", [cls.pp.desc(j * blk, blk) for j in range(4)])
            assert wait_event(cls.cd, xid).ok and wait_event(cls.cp, xid).ok
        cls.cd.grant("m-late", "prefill", [cls.pd.desc(0, blk)], deadline_ms=100)
        ev = wait_event(cls.cd, "m-late")
        assert ev.error_name == "KVF_EDEADLINE", ev
        try:
            cls.cd.grant("m-nopeer", "nowhere", [cls.pd.desc(0, blk)])
        except kvferry.KvferryError:
            pass
        cls.idle_grant = cls.pd.desc(blk * 100, 3 * blk)
        cls.cd.grant("m-held", "prefill", [cls.idle_grant])  # stays active

    @classmethod
    def tearDownClass(cls):
        cls.cp.close()
        cls.cd.close()
        for d in (cls.pre, cls.dec):
            rc = d.stop()
            assert rc == 0, "%s exited %s" % (d.name, rc)

    def test_scrape_parses_and_counts(self):
        status, headers, text = scrape(self.url_dec)
        self.assertEqual(status, 200)
        self.assertEqual(headers["Content-Type"], "text/plain; version=0.0.4; charset=utf-8")
        self.assertEqual(int(headers["Content-Length"]), len(text.encode()))
        fams = parse_exposition(text)
        check_histograms(self, fams)
        self.assertEqual(value(fams, "kvferry_build_info", node="decode"), 1)
        self.assertEqual(value(fams, "kvferry_transfers_total", role="recv", path="tcp", status="ok"), 3)
        self.assertEqual(value(fams, "kvferry_transfer_bytes_total", role="recv", path="tcp",
                               status="ok"), 3 * 4 * 65536)
        self.assertEqual(value(fams, "kvferry_transfer_descriptors_total", role="recv", path="tcp",
                               status="ok"), 12)
        self.assertEqual(total(fams, "kvferry_transfers_total", role="recv",
                               status="KVF_EDEADLINE"), 1)
        self.assertEqual(value(fams, "kvferry_transfer_duration_seconds",
                               "kvferry_transfer_duration_seconds_count", role="recv", path="tcp"), 3)
        self.assertEqual(value(fams, "kvferry_api_errors_total", error="KVF_ENOPEER"), 1)
        self.assertGreaterEqual(value(fams, "kvferry_errors_total", kind="api"), 1)
        self.assertEqual(value(fams, "kvferry_errors_total", kind="transfer"), 1)
        self.assertEqual(value(fams, "kvferry_peers", state="up"), 1)
        self.assertEqual(value(fams, "kvferry_peer_up", peer="prefill"), 1)
        self.assertEqual(value(fams, "kvferry_peer_transport", peer="prefill", transport="tcp"), 1)
        self.assertEqual(value(fams, "kvferry_pool_size_bytes", pool="kv"), 32 << 20)
        self.assertEqual(value(fams, "kvferry_pool_granted_bytes", pool="kv"), self.idle_grant.len)
        self.assertGreaterEqual(value(fams, "kvferry_transfers_active", role="recv", state="active") +
                                value(fams, "kvferry_transfers_active", role="recv", state="waiting"), 1)
        self.assertGreaterEqual(value(fams, "kvferry_connections", kind="api"), 1)
        self.assertEqual(value(fams, "kvferry_connections", kind="peer"), 1)
        self.assertEqual(value(fams, "kvferry_stopping"), 0)
        start = value(fams, "kvferry_start_time_seconds")
        self.assertLess(abs(start - time.time()), 3600)
        # The sender's view of the same transfers.
        fams = parse_exposition(scrape(self.url_pre)[2])
        self.assertEqual(value(fams, "kvferry_transfers_total", role="send", path="tcp", status="ok"), 3)

    def test_curl_scrapes_too(self):
        curl = shutil.which("curl")
        if not curl:
            self.skipTest("curl is not installed")
        out = subprocess.run([curl, "-sS", "--fail", "--max-time", "5", self.url_pre],
                             capture_output=True, text=True, timeout=10)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("kvferry_transfers_total", parse_exposition(out.stdout))

    def test_head_and_errors(self):
        status, headers, body = scrape(self.url_pre, "HEAD")
        self.assertEqual((status, body), (200, ""))
        self.assertGreater(int(headers["Content-Length"]), 1000)
        self.assertEqual(headers["Connection"], "close")
        base = self.url_pre[:-len("/metrics")]
        for path, method, code in (("/nope", "GET", 404), ("/metrics", "POST", 405),
                                   ("/metrics", "DELETE", 405)):
            with self.assertRaises(urllib.error.HTTPError) as cm:
                scrape(base + path, method)
            self.assertEqual(cm.exception.code, code, path)
        self.assertEqual(scrape(base + "/healthz")[2], "ok\n")
        self.assertEqual(scrape(self.url_pre + "?name[]=x")[0], 200)  # parameters ignored

    def test_bounded_requests(self):
        huge = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n"
        self.assertTrue(raw_http(self.port_pre, huge).startswith("HTTP/1.1 431 "))
        self.assertTrue(raw_http(self.port_pre, b"BLAH\r\n\r\n").startswith("HTTP/1.1 400 "))
        # A client that never finishes its request holds nothing up.
        stalled = socket.create_connection(("127.0.0.1", self.port_pre))
        stalled.sendall(b"GET /metrics HTTP/1.1\r\n")
        try:
            self.assertEqual(scrape(self.url_pre)[0], 200)
            conn = http.client.HTTPConnection("127.0.0.1", self.port_pre, timeout=5)
            conn.request("GET", "/metrics")
            r = conn.getresponse()
            self.assertEqual((r.status, r.getheader("Connection")), (200, "close"))
            r.read()
            conn.close()
        finally:
            stalled.close()

    def test_metrics_off_by_default(self):
        d = Daemon(kvftest.tempdir(), "plain", pool="4M").start()
        try:
            self.assertEqual(d.status()["metrics"], "")
            out = kvftest.run([kvftest.KVFERRYCTL, "-s", d.sock, "metrics"])
            self.assertEqual(out.returncode, 1)
            self.assertIn("metrics-listen", out.stderr)
        finally:
            self.assertEqual(d.stop(), 0)


class TestDemoEnv(unittest.TestCase):
    def test_demo_up_writes_metrics_urls(self):
        """make demo-up's env file names both daemons' metrics URLs. The demo
        runs in its own build dir (links to the binaries), so that it never
        meets a demo a developer left up."""
        build = kvftest.tempdir()
        for exe in ("kvferryd", "kvferryctl", "kvferry-bench"):
            os.symlink(os.path.join(kvftest.BUILD, exe), os.path.join(build, exe))
        demo = os.path.join(kvftest.REPO, "scripts", "demo.sh")
        env = dict(os.environ, BUILD=build, POOL_SIZE="16M")
        out = kvftest.run([demo, "up"], env=env, timeout=120)
        try:
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            with open(os.path.join(build, "demo", "env")) as f:
                vars = dict(line.strip().split("=", 1) for line in f if "=" in line)
            for side in ("PREFILL", "DECODE"):
                url = vars[side + "_METRICS"]
                self.assertRegex(url, r"^http://127\.0\.0\.1:\d+/metrics$")
                fams = parse_exposition(scrape(url)[2])
                self.assertEqual(value(fams, "kvferry_peers", state="up"), 1, side)
        finally:
            down = kvftest.run([demo, "down"], env=env, timeout=60)
            self.assertEqual(down.returncode, 0, down.stdout + down.stderr)


if __name__ == "__main__":
    kvftest.main()
