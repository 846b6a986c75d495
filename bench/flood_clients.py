#!/usr/bin/env python3
"""flood_clients.py - local clients that flood one daemon (issue 15, items 1
and 2), with the figures bench/RESULTS.md records.

flood: two daemons peered over tcp with the default heartbeat-ms and
peer-timeout-ms; CLIENTS clients of the first each post GRANTS grants, then
each pipelines INSPECTS TRANSFERS inspect requests at once and reads every
reply. Meanwhile an unrelated client (its own process) times one `peers`
inspect after another. Figures: its p50/p99/max latency (the max is the
longest the loop kept it waiting), the peer links that dropped, and how
long the flood took.

unread: UNREAD clients each pipeline UNREAD_REQUESTS TRANSFERS inspects (the
daemon lists HOLD grants) and never read; the daemon's VmRSS before, at its
peak while they hang on, and after they have gone; whether it dropped them.

  bench/flood_clients.py [--build DIR] [--clients 6] [--grants 4000]
      [--inspects 1000] [--unread 2] [--unread-requests 1000] [--hold 4000]
      [--only flood|unread] [--json]

--build: the build to run (default build; e.g. an old tree's build to
compare). Prints one line per part; --json prints JSON lines."""
import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--build", default=os.environ.get("BUILD", "build"))
ap.add_argument("--clients", type=int, default=6)
ap.add_argument("--grants", type=int, default=4000)
ap.add_argument("--inspects", type=int, default=1000)
ap.add_argument("--unread", type=int, default=2)
ap.add_argument("--unread-requests", type=int, default=1000)
ap.add_argument("--hold", type=int, default=4000)
ap.add_argument("--only", choices=("flood", "unread"))
ap.add_argument("--json", action="store_true")
args = ap.parse_args()

os.environ["BUILD"] = os.path.abspath(args.build)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "ops"))
import flood  # noqa: E402
import kvftest  # noqa: E402

# The defaults of heartbeat-ms and peer-timeout-ms (kvftest's pair has
# faster ones), room for the grants.
EXTRA = "heartbeat-ms 500\npeer-timeout-ms 3000\nmax-transfers-per-client 65536\n"


def say(part, d):
    if args.json:
        print(json.dumps(dict(part=part, **d)), flush=True)
    else:
        print("%-7s %s" % (part, " ".join("%s=%s" % kv for kv in d.items())), flush=True)


def run_flood(pre, dec):
    d = flood.flood(pre, dec, args.clients, args.grants, args.inspects)
    d["peer_down_lines"] = sum(x.log_text().count("no word from the peer") for x in (pre, dec))
    say("flood", d)


def run_unread(pre, dec):
    pid = pre.proc.pid
    with pre.client() as c:
        pool = c.pool_find("kv").id
    holder = flood.post_grants(pre.sock, args.hold, pool, dec.name)
    before = flood.rss_kb(pid)
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], flood.rss_kb(pid))
            done.wait(0.01)

    t = threading.Thread(target=sample)
    t.start()
    lat = []
    socks = [flood.non_reader(pre.sock, "unread%d" % i, flood.INSPECT_TRANSFERS, args.unread_requests)
             for i in range(args.unread)]
    # an unrelated client meanwhile, until the daemon has done what it will
    # with them: dropped them, or stopped serving them (its unread output stays put)
    with pre.client() as c:
        last, still = None, 0
        end = time.monotonic() + 120
        while time.monotonic() < end and still < 50:
            t0 = time.monotonic()
            st = c.inspect("status", json=True)
            lat.append(time.monotonic() - t0)
            now = (st["clients"], st.get("api_output_bytes"))
            still = still + 1 if now == last else 0
            last = now
            time.sleep(0.02)
    clients_left = last[0]
    during = flood.rss_kb(pid)
    for s in socks:
        s.close()
    holder.close()
    kvftest.wait_for(lambda: pre.status()["clients"] <= 1, 60, "the clients gone")
    time.sleep(0.5)  # lets the daemon finish closing (pacing, not a sync: RSS is only sampled)
    done.set()
    t.join()
    after = flood.rss_kb(pid)
    st = pre.status()
    say("unread", {"clients": args.unread, "requests": args.unread_requests, "listed": args.hold,
                   "rss_before_mb": round(before / 1024, 1), "rss_peak_mb": round(peak[0] / 1024, 1),
                   "rss_while_mb": round(during / 1024, 1), "rss_after_mb": round(after / 1024, 1),
                   "unread_clients_dropped": args.unread + 2 - clients_left,
                   "api_output_drops": st.get("api_output_drops", "n/a"),
                   "status_p99_ms": round(flood.pct(lat, 99) * 1e3, 2)})


def main():
    # its own dir (not kvftest.tempdir's prefix, which other runs may sweep)
    d = tempfile.mkdtemp(prefix="kvf-flood.", dir="/tmp")
    try:
        pre, dec = kvftest.pair(d, pool="64M", extra=EXTRA)
        try:
            if args.only in (None, "flood"):
                run_flood(pre, dec)
            if args.only in (None, "unread"):
                run_unread(pre, dec)
        finally:
            pre.stop()
            dec.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


main()
