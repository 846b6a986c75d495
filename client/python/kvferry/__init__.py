"""kvferry: Python binding of libkvferry, the client library of kvferryd.

A serving engine talks to the kvferryd of its node; the daemon owns memory
pools that the engine maps and keeps its KV cache in, and moves blocks
between nodes when the receiving side posts a grant and the sending side a
send with the same transfer id::

    import kvferry
    with kvferry.Client() as c:                 # $KVFERRY_SOCKET or /run/kvferry/...
        pool = c.pool_find("kv")
        pool.memory[0:4] = b"abcd"              # host pools: a memoryview
        c.grant("req-42", "prefill-0", [pool.desc(0, 65536)])
        for ev in c.wait_events(timeout_ms=1000):
            ev.raise_for_status()

GPU pools (kind "cuda:N") expose __cuda_array_interface__, so
torch.as_tensor(pool, device="cuda") wraps them without a copy (this needs
a libkvferry whose kvf_pool_map maps GPU pools: it then returns the device
address). The calls are those of kvferry.h; failures raise KvferryError
with the C error's name.

KV caches go by block id: register the engine's layout once (built from its
K and V tensors: Client.layout_from_tensors), then grant_blocks and
send_blocks name block ids and layers (see kvferry.layout).

Only the standard library is used; the library is loaded from
$KVFERRY_LIB or as libkvferry.so.1.
"""
from ._native import ERRORS, GRANT_LAYER_EVENTS, NOBLOCK, NOWAIT, SEND_MORE, SEND_NOWAIT
from .client import (LAYER_DONE, RECV_DONE, SEND_DONE, Client, Desc, EnginePool, Event, HostBuffer,
                     KvferryError, Pool, err_name, host_buffer, strerror)
from .layout import Layout

__all__ = ["Client", "Desc", "EnginePool", "Event", "HostBuffer", "KvferryError", "Layout", "Pool",
           "host_buffer", "RECV_DONE", "SEND_DONE",
           "LAYER_DONE", "SEND_MORE", "SEND_NOWAIT", "NOWAIT", "NOBLOCK", "GRANT_LAYER_EVENTS", "ERRORS", "connect", "err_name",
           "strerror"]
__version__ = "0.1.0"

globals().update(ERRORS)  # kvferry.KVF_EDEADLINE == -4012, ...


def connect(socket_path=None, wait_ms=None, reconnect_ms=None):
    """kvf_connect_ex: a Client for the daemon at socket_path (None:
    $KVFERRY_SOCKET, else /run/kvferry/kvferryd.sock); wait_ms and
    reconnect_ms as Client's."""
    return Client(socket_path, wait_ms, reconnect_ms)
