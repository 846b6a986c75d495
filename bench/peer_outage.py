#!/usr/bin/env python3
"""peer_outage.py - what an engine sees of a network outage between two
daemons (issue 15, item 9). Needs root, `ip netns` and nft (the chaos
suite's namespaces, tests/chaos/chaos.py).

Two daemons with their default heartbeat-ms, peer-timeout-ms and
reconnect-*-ms, in two namespaces joined by a veth pair. The decode engine
posts grants (any source) for heal-1..heal-N. The prefill engine sends
heal-i (64 KiB) and retries every 2 ms while its send is refused; a send
that fails moves on to heal-(i+1). The link is cut (nft drop, both ways)
for --outage seconds while the engine retries. Reported: how long prefill
took to notice the peer was gone, the refused calls, the failed sends,
and the time from the heal to the first send that succeeded (every byte
checked by the receiver side).

  sudo BUILD=build python3 bench/peer_outage.py [--outage 3] [--runs 3]
"""
import argparse
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "chaos"))
import chaos  # noqa: E402  (Netns, ChaosDaemon; puts kvftest on the path)
import kvftest  # noqa: E402

import kvferry  # noqa: E402

N = 64 << 10
GRANTS = 64


class DefaultsDaemon(chaos.ChaosDaemon):
    """The chaos suite's daemon with the daemon's own liveness defaults."""

    def config_text(self):
        drop = ("heartbeat-ms", "peer-timeout-ms", "reconnect-min-ms", "reconnect-max-ms")
        return "".join(line + "\n" for line in super().config_text().splitlines() if not line.startswith(drop))


def pattern(n):
    return bytes((i * 7 + 3) & 0xFF for i in range(n))


def peer_up(client, name):
    for p in client.inspect("peers", json=True)["peers"]:
        if p["name"] == name:
            return p["state"] == "up"
    return False


def one_run(net, dir, outage):
    pre = DefaultsDaemon(dir, "prefill", "16M", net.ip[0], net.ns[0])
    dec = DefaultsDaemon(dir, "decode", "16M", net.ip[1], net.ns[1])
    pre.add_peer(dec)
    dec.add_peer(pre)
    try:
        pre.start()
        dec.start()
        kvftest.wait_for(lambda: pre.peers_up() and dec.peers_up(), 20, "peers up")
        cp, cd, watch = pre.client(), dec.client(), pre.client()
        pp, pd = cp.pool_find("kv"), cd.pool_find("kv")
        pp.memory[0:N] = pattern(N)
        for i in range(1, GRANTS + 1):
            cd.grant("heal-%d" % i, None, [(pd.id, i * N, N)], deadline_ms=120000)
        res = {"refused": 0, "failed": 0, "errors": {}}
        cut_at = time.monotonic()
        net.nft_rule("drop")
        heal_at = [None]

        def healer():
            time.sleep(outage)  # the outage's length: the thing measured against
            heal_at[0] = time.monotonic()
            net.nft_rule(None)
        threading.Thread(target=healer, daemon=True).start()

        noticed = None
        i, done_at = 1, None
        while done_at is None and time.monotonic() - cut_at < outage + 30:
            xid = "heal-%d" % i
            try:
                cp.send(xid, "decode", [(pp.id, 0, N)], deadline_ms=60000)
            except kvferry.KvferryError as e:
                res["refused"] += 1
                res["errors"][e.name] = res["errors"].get(e.name, 0) + 1
                if noticed is None and not peer_up(watch, "decode"):
                    noticed = time.monotonic() - cut_at
                time.sleep(0.002)
                continue
            while True:  # accepted: its outcome (the notice is polled meanwhile)
                evs = [ev for ev in cp.wait_events(4, 10) if ev.xfer_id == xid]
                if noticed is None and not peer_up(watch, "decode"):
                    noticed = time.monotonic() - cut_at
                if evs:
                    break
            if evs[0].ok:
                done_at = time.monotonic()
            else:
                res["failed"] += 1
                res["errors"][evs[0].error_name] = res["errors"].get(evs[0].error_name, 0) + 1
                i += 1
        got = None
        for _ in range(200):
            got = [ev for ev in cd.wait_events(64, 50) if ev.xfer_id == "heal-%d" % i]
            if got:
                break
        assert got and got[0].ok, got
        assert bytes(pd.memory[i * N:(i + 1) * N]) == pattern(N), "wrong bytes"
        res["notice_ms"] = round(noticed * 1000) if noticed is not None else None
        res["heal_to_success_ms"] = round((done_at - heal_at[0]) * 1000) if done_at and heal_at[0] else None
        res["sends_tried"] = i
        for c in (cp, cd, watch):
            c.close()
        return res
    finally:
        pre.kill()
        dec.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outage", type=float, default=3.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    why = chaos.Netns.unavailable()
    if why:
        sys.exit("peer_outage: needs network namespaces: " + why)
    net = chaos.Netns()
    net.create()
    try:
        for r in range(args.runs):
            dir = kvftest.tempdir()
            res = one_run(net, dir, args.outage)
            res["run"] = r + 1
            res["outage_s"] = args.outage
            print(json.dumps(res), flush=True)
    finally:
        net.destroy()


if __name__ == "__main__":
    main()
