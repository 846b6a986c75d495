#!/usr/bin/env python3
"""How a serving engine's workers use kvferry, request by request.

Disaggregated serving: a prefill worker computes a request's KV cache and a
decode worker generates tokens from it, on another node. With kvferry:

  both workers    register their KV cache's layout once (from its per-layer
                  K and V tensors), so that transfers name block ids;
  decode worker   admits the request, allocates KV blocks in its pool and
                  posts a grant: "blocks of request R go to these block
                  ids" (naming the prefill node lets its daemon push the
                  grant ahead), asking for an event per layer;
  prefill worker  allocates blocks, computes layer after layer and sends
                  each layer as soon as it is done (more=True until the
                  last), so the transfer overlaps the compute; it frees its
                  blocks when SEND_DONE says they may be reused;
  decode worker   may start on a layer at its LAYER_DONE, decodes on
                  RECV_DONE (every layer in place), or frees the blocks and
                  reschedules the request on an error.

Both workers poll kvferry's event fd in their own event loop (selectors
here; asyncio's add_reader works the same). This script runs one of each
against two daemons, e.g. after `make demo-up`:

    . build/demo/env
    python3 client/python/examples/engine_worker.py \\
        --prefill $PREFILL_SOCK --decode $DECODE_SOCK --requests 32

The "KV cache" is a byte pattern per (request, layer, K/V, block), which
the decode side checks; exit status 0 when every request arrived intact.
"""
import argparse
import os
import selectors
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kvferry  # noqa: E402  (after the path: runs from the source tree too)


class KVCache:
    """An engine's paged KV cache in a kvferry pool: per layer a K and a V
    "tensor" of shape [num_blocks, block_bytes] (memoryviews here; torch
    tensors carved out of torch.as_tensor(pool) work the same), and a block
    manager that hands out any free block id, so a request's blocks are
    scattered. One block id names that block in every layer's K and V.

    The layout is registered once (built from the tensors' addresses
    against the pool's base); transfers then name block ids only."""

    def __init__(self, client, pool_name, layers, block_bytes):
        pool = client.pool_find(pool_name)
        self.layers, self.block_bytes = layers, block_bytes
        self.num_blocks = pool.size // (layers * 2 * block_bytes)
        if self.num_blocks == 0:
            raise RuntimeError("pool %s too small for %d layers of one block" % (pool_name, layers))
        mem, region = pool.memory, self.num_blocks * block_bytes
        self.k = [mem[(2 * l) * region:(2 * l + 1) * region] for l in range(layers)]
        self.v = [mem[(2 * l + 1) * region:(2 * l + 2) * region] for l in range(layers)]
        shape = [self.num_blocks, block_bytes]
        tensors = [[t.cast("B", shape) for t in kv] for kv in (self.k, self.v)]
        self.layout = client.register_layout(client.layout_from_tensors(pool, *tensors, block_dim=0))
        self.free = list(range(self.num_blocks))

    def alloc(self, n):
        if n > len(self.free):
            return None  # the engine would queue the request
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def release(self, blocks):
        self.free.extend(blocks)

    def block(self, tensor, b):
        """Block b of a layer's K or V: a writable view of its bytes."""
        return tensor[b * self.block_bytes:(b + 1) * self.block_bytes]


def pattern(req_id, layer, kv, block, size):
    """The bytes prefill "computes" for the K (kv 0) or V (1) of one block
    of one layer; block is its index in the request."""
    seed = ("%s/%d/%s/%d" % (req_id, layer, "KV"[kv], block)).encode()
    return (seed * (size // len(seed) + 1))[:size]


class PrefillWorker:
    def __init__(self, client, pool_name, layers, block_bytes):
        self.c = client
        self.kv = KVCache(client, pool_name, layers, block_bytes)
        self.inflight = {}  # request id -> its blocks

    def run_request(self, req_id, n_blocks, decode_node):
        """Prefills one request and streams its KV cache layer by layer:
        one send_blocks per layer, naming the layer and (in the first part)
        the request's block ids; block i lands in the decode side's
        granted block i."""
        blocks = self.kv.alloc(n_blocks)
        if blocks is None:
            raise RuntimeError("prefill pool full")
        self.inflight[req_id] = blocks
        size = self.kv.block_bytes
        for layer in range(self.kv.layers):
            for kv, tensor in enumerate((self.kv.k[layer], self.kv.v[layer])):
                for i, b in enumerate(blocks):  # "the attention layer writes its KV"
                    self.kv.block(tensor, b)[:] = pattern(req_id, layer, kv, i, size)
            last = layer == self.kv.layers - 1
            # nowait: a later layer's part is not awaited (no round trip
            # per layer); a refusal would come in SEND_DONE
            self.c.send_blocks(req_id, decode_node, self.kv.layout, blocks if layer == 0 else None,
                               first_layer=layer, n_layers=1, more=not last, nowait=True)

    def on_event(self, ev):
        """SEND_DONE: the source blocks may be reused (whatever the status)."""
        self.kv.release(self.inflight.pop(ev.xfer_id))
        if not ev.ok:
            print("prefill: %s failed: %s (%s)" % (ev.xfer_id, ev.error_name, ev.error))


class DecodeWorker:
    def __init__(self, client, pool_name, layers, block_bytes):
        self.c = client
        self.kv = KVCache(client, pool_name, layers, block_bytes)
        self.waiting = {}  # request id -> (blocks, layers landed)
        self.done, self.bad = 0, 0

    def admit(self, req_id, n_blocks, prefill_node, deadline_ms=10000):
        blocks = self.kv.alloc(n_blocks)
        if blocks is None:
            raise RuntimeError("decode pool full")
        # layer_events: a LAYER_DONE per layer as it lands, so the forward
        # pass could start on layer 0 before the last one is here
        # (vLLM's wait_for_layer_load).
        self.c.grant_blocks(req_id, prefill_node, self.kv.layout, blocks, layer_events=True,
                            deadline_ms=deadline_ms)
        self.waiting[req_id] = (blocks, [])

    def on_event(self, ev):
        """LAYER_DONE: one more layer usable. RECV_DONE: decode from the
        blocks, or give them back on error."""
        if ev.type == kvferry.LAYER_DONE:
            self.waiting[ev.xfer_id][1].append(ev.layer)
            return
        blocks, landed = self.waiting.pop(ev.xfer_id)
        if ev.ok and self.layers_complete(ev.xfer_id, landed) and self.kv_intact(ev.xfer_id, blocks):
            self.done += 1  # here the engine would schedule the decode steps
        else:
            self.bad += 1
            print("decode: %s: %s %s" % (ev.xfer_id, ev.error_name, ev.error))
        self.kv.release(blocks)

    def layers_complete(self, req_id, landed):
        if sorted(landed) != list(range(self.kv.layers)):
            print("decode: %s: layer events %s" % (req_id, landed))
            return False
        return True

    def kv_intact(self, req_id, blocks):
        size = self.kv.block_bytes
        for layer in range(self.kv.layers):
            for kv, tensor in enumerate((self.kv.k[layer], self.kv.v[layer])):
                for i, b in enumerate(blocks):
                    if self.kv.block(tensor, b) != pattern(req_id, layer, kv, i, size):
                        print("decode: %s: layer %d %s block %d differs" % (req_id, layer, "KV"[kv], i))
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
    ap.add_argument("--blocks", type=int, default=4, help="KV blocks per request")
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
        mib = args.requests * args.layers * 2 * args.blocks * args.block_bytes / 2**20
        print("%d requests, %d intact, %d failed, %.1f MiB in %.2f s" % (
            args.requests, dec.done, dec.bad, mib, time.monotonic() - t0))
        return 0 if dec.bad == 0 and not pre.inflight else 1


if __name__ == "__main__":
    sys.exit(main())
