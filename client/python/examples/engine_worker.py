#!/usr/bin/env python3
"""How a serving engine's workers use kvferry, request by request.

Disaggregated serving: a prefill worker computes a request's KV cache and a
decode worker generates tokens from it, on another node. With kvferry:

  decode worker   admits the request, allocates KV blocks in its pool and
                  posts a grant: "blocks of request R go here" (naming the
                  prefill node lets its daemon push the grant ahead);
  prefill worker  allocates blocks, computes layer after layer and sends
                  each layer as soon as it is done (more=True until the
                  last), so the transfer overlaps the compute; it frees its
                  blocks when SEND_DONE says they may be reused;
  decode worker   starts decoding on RECV_DONE (the blocks are in place), or
                  frees the blocks and reschedules the request on an error.

Both workers poll kvferry's event fd in their own event loop (selectors
here; asyncio's add_reader works the same). This script runs one of each
against two daemons, e.g. after `make demo-up`:

    . build/demo/env
    python3 client/python/examples/engine_worker.py \\
        --prefill $PREFILL_SOCK --decode $DECODE_SOCK --requests 32

The "KV cache" is a byte pattern per (request, layer, block), which the
decode side checks; exit status 0 when every request arrived intact.
"""
import argparse
import os
import selectors
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kvferry  # noqa: E402  (after the path: runs from the source tree too)


class BlockAllocator:
    """Fixed-size KV blocks in a kvferry pool, as an engine's block manager
    hands them out: any free block, so a request's blocks are scattered."""

    def __init__(self, pool, block_bytes):
        self.pool = pool
        self.block_bytes = block_bytes
        self.free = list(range(pool.size // block_bytes))

    def alloc(self, n):
        if n > len(self.free):
            return None  # the engine would queue the request
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def release(self, blocks):
        self.free.extend(blocks)

    def desc(self, block):
        return kvferry.Desc(self.pool.id, block * self.block_bytes, self.block_bytes)


def pattern(req_id, layer, block, size):
    """The bytes prefill "computes" for one block of one layer."""
    seed = ("%s/%d/%d" % (req_id, layer, block)).encode()
    return (seed * (size // len(seed) + 1))[:size]


class PrefillWorker:
    def __init__(self, client, pool_name, layers, block_bytes):
        self.c = client
        self.layers = layers
        self.blocks = BlockAllocator(client.pool_find(pool_name), block_bytes)
        self.mem = self.blocks.pool.memory
        self.inflight = {}  # request id -> its blocks

    def run_request(self, req_id, n_blocks, decode_node):
        """Prefills one request and streams its KV cache layer by layer.
        Block b of layer l is blocks[l * n_blocks + b], in the same order as
        the decode side's grant."""
        blocks = self.blocks.alloc(self.layers * n_blocks)
        if blocks is None:
            raise RuntimeError("prefill pool full")
        self.inflight[req_id] = blocks
        size = self.blocks.block_bytes
        for layer in range(self.layers):
            mine = blocks[layer * n_blocks:(layer + 1) * n_blocks]
            for i, b in enumerate(mine):  # "the attention layer writes its KV"
                self.mem[b * size:(b + 1) * size] = pattern(req_id, layer, i, size)
            last = layer == self.layers - 1
            self.c.send(req_id, decode_node, [self.blocks.desc(b) for b in mine], more=not last)

    def on_event(self, ev):
        """SEND_DONE: the source blocks may be reused (whatever the status)."""
        self.blocks.release(self.inflight.pop(ev.xfer_id))
        if not ev.ok:
            print("prefill: %s failed: %s (%s)" % (ev.xfer_id, ev.error_name, ev.error))


class DecodeWorker:
    def __init__(self, client, pool_name, layers, block_bytes):
        self.c = client
        self.layers = layers
        self.blocks = BlockAllocator(client.pool_find(pool_name), block_bytes)
        self.mem = self.blocks.pool.memory
        self.waiting = {}  # request id -> (blocks, blocks per layer)
        self.done, self.bad = 0, 0

    def admit(self, req_id, n_blocks, prefill_node, deadline_ms=10000):
        blocks = self.blocks.alloc(self.layers * n_blocks)
        if blocks is None:
            raise RuntimeError("decode pool full")
        self.c.grant(req_id, prefill_node, [self.blocks.desc(b) for b in blocks], deadline_ms)
        self.waiting[req_id] = (blocks, n_blocks)

    def on_event(self, ev):
        """RECV_DONE: decode from the blocks, or give them back on error."""
        blocks, n_blocks = self.waiting.pop(ev.xfer_id)
        if ev.ok and self.kv_intact(ev.xfer_id, blocks, n_blocks):
            self.done += 1  # here the engine would schedule the decode steps
        else:
            self.bad += 1
            print("decode: %s: %s %s" % (ev.xfer_id, ev.error_name, ev.error))
        self.blocks.release(blocks)

    def kv_intact(self, req_id, blocks, n_blocks):
        size = self.blocks.block_bytes
        for k, b in enumerate(blocks):
            layer, i = divmod(k, n_blocks)
            if bytes(self.mem[b * size:(b + 1) * size]) != pattern(req_id, layer, i, size):
                print("decode: %s: layer %d block %d differs" % (req_id, layer, i))
                return False
        return True


def pump(sel, timeout):
    """Hands the events of every ready client to its worker."""
    for key, _ in sel.select(timeout):
        client, worker = key.data
        for ev in client.wait_events(64, 0):
            worker.on_event(ev)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="prefill node's kvferryd socket")
    ap.add_argument("--decode", required=True, help="decode node's kvferryd socket")
    ap.add_argument("--pool", default="kv", help="pool name on both nodes")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4, help="KV blocks per layer per request")
    ap.add_argument("--block-bytes", type=int, default=16384)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()

    with kvferry.Client(args.prefill) as pc, kvferry.Client(args.decode) as dc:
        pre = PrefillWorker(pc, args.pool, args.layers, args.block_bytes)
        dec = DecodeWorker(dc, args.pool, args.layers, args.block_bytes)
        sel = selectors.DefaultSelector()
        sel.register(pc.event_fd(), selectors.EVENT_READ, (pc, pre))
        sel.register(dc.event_fd(), selectors.EVENT_READ, (dc, dec))
        t0, started = time.monotonic(), 0
        while dec.done + dec.bad < args.requests:
            while started < args.requests and len(dec.waiting) < args.concurrency:
                req = "req-%d-%d" % (os.getpid(), started)
                dec.admit(req, args.blocks, pc.node)        # the decode worker first...
                pre.run_request(req, args.blocks, dc.node)  # ...then prefill streams the layers
                started += 1
            pump(sel, 1.0)
            if time.monotonic() - t0 > 60:
                print("gave up: %d requests still waiting" % len(dec.waiting))
                return 1
        while pre.inflight and time.monotonic() - t0 < 60:
            pump(sel, 1.0)
        mib = args.requests * args.layers * args.blocks * args.block_bytes / 2**20
        print("%d requests, %d intact, %d failed, %.1f MiB in %.2f s" % (
            args.requests, dec.done, dec.bad, mib, time.monotonic() - t0))
        return 0 if dec.bad == 0 and not pre.inflight else 1


if __name__ == "__main__":
    sys.exit(main())
