"""The kvferry client: the calls of libkvferry (kvferry.h), Pythonic.

Every call that fails raises KvferryError carrying the C error code, its
name (kvf_err_name: "KVF_EDEADLINE", "ECONNREFUSED", ...) and message.
Blocking calls release the GIL (ctypes does), so a worker thread may sit
in wait_events() while others post grants and sends.
"""
import collections
import ctypes
import json as _json
import mmap as _mmap
import os as _os
import weakref as _weakref

from . import _native
from ._native import Desc as _CDesc
from .layout import Layout, block_id_array

RECV_DONE = _native.EV_RECV_DONE
SEND_DONE = _native.EV_SEND_DONE
LAYER_DONE = _native.EV_LAYER_DONE

_INSPECT = {"status": _native.INSPECT_STATUS, "pools": _native.INSPECT_POOLS,
            "peers": _native.INSPECT_PEERS, "transfers": _native.INSPECT_TRANSFERS,
            "layouts": _native.INSPECT_LAYOUTS}
_KINDS = {RECV_DONE: "recv_done", SEND_DONE: "send_done", LAYER_DONE: "layer_done"}


def err_name(code):
    """kvf_err_name: "OK", "KVF_ESIZE", "ENOENT", ... for a return code."""
    return _native.lib().kvf_err_name(code).decode()


def strerror(code):
    """kvf_strerror: the message of a return code."""
    return _native.lib().kvf_strerror(code).decode()


class KvferryError(Exception):
    """A libkvferry call failed. .code is the negative C code, .name its
    name (kvf_err_name), .message its text (kvf_strerror)."""

    def __init__(self, code, call="", detail=""):
        self.code = code
        self.name = err_name(code)
        self.message = strerror(code)
        self.call = call
        self.detail = detail
        where = "%s: " % call if call else ""
        # the daemon's detail often says what the code's text says: once is enough
        said = detail.strip().lower() in self.message.lower() or self.message.lower() in detail.lower()
        more = " (%s)" % detail if detail and not said else ""
        super().__init__("%s%s: %s%s" % (where, self.name, self.message, more))


def _check(rc, call):
    if rc < 0:
        raise KvferryError(rc, call)
    return rc


def _bytes(s, what, required=True):
    if s is None:
        if required:
            raise KvferryError(_native.ERRORS["KVF_EINVAL"], what, "missing")
        return None
    return s if isinstance(s, bytes) else str(s).encode()


# A block range of a pool: what kvf_desc holds.
Desc = collections.namedtuple("Desc", "pool offset len")


def _desc_array(descs):
    """descs (Desc, (pool, offset, len) tuples, or a ctypes array of
    kvf_desc) as a ctypes array and its length."""
    if isinstance(descs, ctypes.Array) and descs._type_ is _CDesc:
        return descs, len(descs)
    items = list(descs)
    arr = (_CDesc * len(items))()
    for i, (pool, offset, length) in enumerate(items):
        arr[i].pool, arr[i].offset, arr[i].len = pool, offset, length
    return arr, len(items)


class Event(collections.namedtuple(
        "Event", "type status xfer_id path peer bytes descriptors error layer transform",
        defaults=(0, ""))):
    """A transfer's event (kvf_event). type is RECV_DONE or SEND_DONE (the
    transfer's completion), or LAYER_DONE (a grant with layer_events=True:
    layer .layer has landed, before RECV_DONE); status 0 or a negative
    error code. .transform (completions of blocks): "whole blocks", or the
    transform and how it was placed, e.g. "heads 0-1, NHD 16/1h -> HND
    64/2h, staged"; "" when not known."""

    @property
    def ok(self):
        return self.status == 0

    @property
    def kind(self):
        return _KINDS.get(self.type, "unknown")

    @property
    def error_name(self):
        return err_name(self.status)

    def raise_for_status(self):
        """Raises KvferryError for a failed transfer; returns self otherwise."""
        if self.status:
            raise KvferryError(self.status, "transfer " + self.xfer_id, self.error)
        return self

    @classmethod
    def _from_c(cls, ev):
        return cls(ev.type, ev.status, ev.xfer_id.decode(errors="replace"), ev.path.decode(),
                   ev.peer.decode(), ev.bytes, ev.descriptors,
                   ev.error.decode(errors="replace"), ev.layer, ev.transform.decode(errors="replace"))


class _Region:
    """Bytes [offset, offset + size) of a mapped pool, exposed to array
    libraries: host memory through the buffer protocol (memory, a
    memoryview) and __array_interface__ (numpy), GPU memory through
    __cuda_array_interface__ (torch.as_tensor, CuPy, Numba)."""

    def __init__(self, pool, offset, size):
        self._pool = pool
        self.offset = offset
        self.size = size

    @property
    def is_cuda(self):
        return self._pool.kind.startswith("cuda:")

    @property
    def address(self):
        """The address of the first byte: host virtual, or CUDA device."""
        return self._pool._mapped_address() + self.offset

    @property
    def memory(self):
        """A writable memoryview of the bytes (host pools only). Valid until
        the client is closed."""
        if self.is_cuda:
            raise TypeError("pool %s is %s memory: use __cuda_array_interface__ "
                            "(torch.as_tensor(pool, device='cuda'))" % (self._pool.name,
                                                                        self._pool.kind))
        buf = (ctypes.c_ubyte * self.size).from_address(self.address)
        # The view (and every slice or array made of it) keeps the pool, so
        # its client, so the mapping alive; Client.close() keeps a mapping
        # that such a view still uses (_KeptMap) until the view is gone.
        buf._pool = self._pool
        if not self._pool.engine:
            self._pool._client._track(buf, self._pool.id)
        return memoryview(buf).cast("B")

    def _interface(self):
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.address, False),
                "strides": None, "version": 3}

    @property
    def __array_interface__(self):
        if self.is_cuda:
            raise AttributeError("__array_interface__: a GPU pool has no host address")
        return self._interface()

    @property
    def __cuda_array_interface__(self):
        if not self.is_cuda:
            raise AttributeError("__cuda_array_interface__: a host pool; use .memory")
        iface = self._interface()
        # The daemon's RECV_DONE already means the data is in HBM.
        iface["stream"] = None
        return iface

    def view(self, offset, size):
        """A region of this one (bytes [offset, offset + size))."""
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError("view [%d, %d) outside a region of %d bytes" % (
                offset, offset + size, self.size))
        return _Region(self._pool, self.offset + offset, size)

    def desc(self, offset=0, size=None):
        """A Desc for bytes of this region, for grant() and send()."""
        size = self.size - offset if size is None else size
        if offset < 0 or size <= 0 or offset + size > self.size:
            raise ValueError("range outside the region")
        return Desc(self._pool.id, self.offset + offset, size)


class Pool(_Region):
    """A daemon-owned memory pool (kvf_pool_info). Its memory is mapped into
    this process on first use (kvf_pool_map) and stays mapped until the
    client is closed. .engine: engine memory (an EnginePool when this
    client registered it); .nic_reg: how NICs reach it."""

    def __init__(self, client, info):
        self._client = client
        self.id = info.id
        self.name = info.name.decode()
        self.kind = info.kind.decode()
        self.backing = info.backing.decode()
        self.engine = bool(info.engine)  # engine memory (Client.register)
        self.nic_reg = info.nic_reg.decode()
        super().__init__(self, 0, info.size)

    def _mapped_address(self):
        return self._client._map(self.id)[0]

    def __repr__(self):
        return "Pool(id=%d, name=%r, kind=%r, backing=%r, size=%d, engine=%r)" % (
            self.id, self.name, self.kind, self.backing, self.size, self.engine)


class EnginePool(Pool):
    """Memory of this process registered as a pool (Client.register): its
    address is the engine's own, nothing is mapped. Keeps the registered
    object alive while registered."""

    def __init__(self, client, info, address, obj):
        super().__init__(client, info)
        self._address = address
        self._obj = obj

    def _mapped_address(self):
        return self._address


class _KeptMap:
    """Pool memory that .memory views still use when their client closes:
    a second mapping of the same shared pages (mremap with old size 0),
    moved back to the original address once kvf_close unmapped it, and
    unmapped when the last view holding this object is gone."""

    MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2

    def __init__(self, addr, size, bufs):
        libc = _native.libc()
        self._mremap, self._munmap = libc.mremap, libc.munmap
        self._mremap.restype = ctypes.c_void_p
        self._mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                                 ctypes.c_void_p]
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.addr, self.size, self.live = addr, size, None
        dup = self._mremap(addr, 0, size, self.MREMAP_MAYMOVE, None)
        if dup in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mremap")
        self.dup = dup
        for b in bufs:
            b._kept = self  # the last view's buffer to go unmaps it

    def restore(self):
        got = self._mremap(self.dup, self.size, self.size, self.MREMAP_MAYMOVE | self.MREMAP_FIXED,
                           self.addr)
        self.live = self.addr if got == self.addr else self.dup
        self.dup = None

    def drop(self):
        if self.dup:
            self._munmap(self.dup, self.size)
            self.dup = None

    def __del__(self):
        self.drop()
        if self.live:
            self._munmap(self.live, self.size)


class HostBuffer(_mmap.mmap):
    """Host memory that the daemon can map: an mmap of a memfd (created
    with MFD_ALLOW_SEALING, so the daemon can seal it against shrinking).
    A writable buffer (memoryview, numpy.frombuffer); .fd is the memfd.
    Register it with Client.register; close() unmaps it and closes .fd."""

    def __new__(cls, size, name="kvferry"):
        flags = _os.MFD_CLOEXEC | getattr(_os, "MFD_ALLOW_SEALING", 2)
        fd = _os.memfd_create(name, flags)
        try:
            _os.ftruncate(fd, size)
            self = super().__new__(cls, fd, size)
        except BaseException:
            _os.close(fd)
            raise
        self.fd = fd
        return self

    @property
    def address(self):
        """The address of the first byte."""
        return _buffer_address(self)

    def close(self):
        super().close()
        if self.fd >= 0:
            _os.close(self.fd)
            self.fd = -1


def host_buffer(size, name="kvferry"):
    """size bytes of host memory an engine can register (Client.register):
    a HostBuffer (an mmap of a memfd)."""
    return HostBuffer(size, name)


def _buffer_address(obj):
    """The address of a writable buffer-protocol object's first byte."""
    view = memoryview(obj)
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    finally:
        view.release()


def _memory_of(obj):
    """(kind, address, size, fd, fd_offset) of what Client.register takes."""
    if isinstance(obj, HostBuffer):
        return _native.MEM_HOST, obj.address, len(obj), obj.fd, 0
    if type(obj).__module__.split(".")[0] == "torch":  # without importing torch
        if not obj.is_cuda:
            raise ValueError("register: a torch tensor on the CPU has no memfd; allocate the memory with "
                             "kvferry.host_buffer and wrap it (torch.frombuffer)")
        if not obj.is_contiguous():
            raise ValueError("register: the tensor must be contiguous")
        return _native.MEM_CUDA, obj.data_ptr(), obj.numel() * obj.element_size(), -1, 0
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        n = 1
        for d in cai["shape"]:
            n *= d
        itemsize = int(cai["typestr"][2:])
        return _native.MEM_CUDA, cai["data"][0], n * itemsize, -1, 0
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:  # numpy: over a memfd mapping, found by the library
        n = 1
        for d in ai["shape"]:
            n *= d
        return _native.MEM_HOST, ai["data"][0], n * int(ai["typestr"][2:]), -1, 0
    view = memoryview(obj)
    size = view.nbytes
    view.release()
    return _native.MEM_HOST, _buffer_address(obj), size, -1, 0


class Client:
    """A connection to the node's kvferryd (kvf_connect). Use as a context
    manager, or call close()."""

    def __init__(self, socket_path=None, wait_ms=None, reconnect_ms=None):
        """wait_ms: wait up to this long for a daemon that is starting
        (None: $KVFERRY_CONNECT_WAIT_MS, else 0). reconnect_ms: after the
        daemon went away, connect again by itself for up to this long
        (None: $KVFERRY_RECONNECT_MS, else 30000; 0 never): see
        kvf_connect_opts in kvferry.h."""
        self._lib = _native.lib()
        self._c = ctypes.c_void_p()
        self._maps = {}
        self._views = []  # weakrefs to the buffers of .memory views of mapped pools
        opts = _native.ConnectOpts(-1 if wait_ms is None else int(wait_ms),
                                   -1 if reconnect_ms is None else int(reconnect_ms))
        _check(self._lib.kvf_connect_ex(_bytes(socket_path, "kvf_connect", False), ctypes.byref(opts),
                                        ctypes.byref(self._c)), "kvf_connect")

    # ---- connection

    def close(self):
        """kvf_close. The daemon cancels this client's transfers; pool
        memory from this client is unmapped, except what .memory views
        still alive use: that stays mapped (the same shared memory, at the
        same address) until the last view, or anything made of one, is
        gone. Raises BufferError (closing nothing) only when it cannot keep
        such memory (a mapping the kernel cannot duplicate)."""
        if not self._c:
            return
        kept = self._keep_viewed_maps()
        self._lib.kvf_close(self._c)
        for k in kept:
            k.restore()
        self._c = ctypes.c_void_p()
        self._maps.clear()
        self._views.clear()

    def _track(self, buf, pool_id):
        self._views = [(ref, pid) for ref, pid in self._views if ref() is not None]
        self._views.append((_weakref.ref(buf), pool_id))

    def _keep_viewed_maps(self):
        """A duplicate of each host mapping a live view uses, moved back in
        place once kvf_close has unmapped it (_KeptMap)."""
        kept = []
        for pid in sorted({pid for ref, pid in self._views if ref() is not None}):
            addr, size = self._maps[pid]
            bufs = [ref() for ref, p in self._views if p == pid and ref() is not None]
            try:
                kept.append(_KeptMap(addr, size, bufs))
            except OSError as e:
                for k in kept:
                    k.drop()
                raise BufferError("%d memory views of pool %d are alive and its mapping cannot be "
                                  "kept (%s); drop them before close()" % (len(bufs), pid, e)) from None
        return kept

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        except BufferError:
            if exc[0] is None:
                raise
            # an exception is on its way out: do not hide it; the views keep
            # the client, which closes once they are gone

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _handle(self):
        if not self._c:
            raise KvferryError(_native.ERRORS["KVF_EINVAL"], "kvferry", "the client is closed")
        return self._c

    @property
    def node(self):
        """The daemon's node name (kvf_node)."""
        return self._lib.kvf_node(self._handle()).decode()

    # ---- pools

    def _pool_infos(self):
        n = _check(self._lib.kvf_pools(self._handle(), None, 0), "kvf_pools")
        arr = (_native.PoolInfo * max(n, 1))()
        n = _check(self._lib.kvf_pools(self._handle(), arr, len(arr)), "kvf_pools")
        return [arr[i] for i in range(min(n, len(arr)))]

    def pools(self):
        """Every pool of the daemon (kvf_pools)."""
        return [Pool(self, info) for info in self._pool_infos()]

    def pool_find(self, name):
        """The pool called name (kvf_pool_find)."""
        info = _native.PoolInfo()
        _check(self._lib.kvf_pool_find(self._handle(), _bytes(name, "kvf_pool_find"),
                                       ctypes.byref(info)), "kvf_pool_find")
        return Pool(self, info)

    def pool_map(self, pool):
        """Maps a pool (a Pool, or its id) now and returns (address, size)
        (kvf_pool_map). Pool.memory and the array interfaces map on their
        own; this is for callers that want the raw address."""
        return self._map(pool.id if isinstance(pool, Pool) else int(pool))

    def _map(self, pool_id):
        if pool_id not in self._maps:
            addr, size = ctypes.c_void_p(), ctypes.c_uint64()
            _check(self._lib.kvf_pool_map(self._handle(), pool_id, ctypes.byref(addr),
                                          ctypes.byref(size)), "kvf_pool_map")
            self._maps[pool_id] = (addr.value, size.value)
        return self._maps[pool_id]

    # ---- engine memory

    def register(self, obj, name=None):
        """kvf_mem_register: memory this process owns becomes a pool, usable
        in descriptors and layouts (Layout.from_tensors takes it). obj: a
        torch tensor on a GPU (or another __cuda_array_interface__ object),
        or host memory backed by a memfd: a HostBuffer (kvferry.host_buffer)
        or a numpy array / memoryview over one. Memory without a file
        (bytearray, malloc) is refused with KVF_EINVAL. Returns an
        EnginePool; obj is kept alive until unregister or close."""
        kind, addr, size, fd, fd_offset = _memory_of(obj)
        m = _native.Mem(kind=kind, addr=addr, size=size, fd=fd, fd_offset=fd_offset,
                        name=_bytes(name, "kvf_mem_register", False))
        pid = ctypes.c_uint32()
        rc = self._lib.kvf_mem_register(self._handle(), ctypes.byref(m), ctypes.byref(pid))
        if rc < 0:
            detail = ""
            if rc == _native.ERRORS["KVF_EINVAL"] and kind == _native.MEM_HOST:
                detail = ("host memory must be a shared mapping of a memfd, tmpfs or hugetlbfs file "
                          "(kvferry.host_buffer); anonymous memory cannot be shared")
            raise KvferryError(rc, "kvf_mem_register", detail)
        info = next((p for p in self._pool_infos() if p.id == pid.value), None)
        if info is None:
            info = _native.PoolInfo(id=pid.value, size=size, engine=1)
            info.name = (name or "").encode()[:63]
            info.kind = b"host" if kind == _native.MEM_HOST else b"cuda"
        return EnginePool(self, info, addr, obj)

    def unregister(self, pool):
        """kvf_mem_unregister: drops engine memory (an EnginePool or its id).
        KVF_EBUSY while a transfer uses it; this client's layouts on it go
        with it."""
        pid = pool.id if isinstance(pool, Pool) else int(pool)
        _check(self._lib.kvf_mem_unregister(self._handle(), pid), "kvf_mem_unregister")
        if isinstance(pool, EnginePool):
            pool._obj = None

    # ---- transfers

    def grant(self, xfer_id, src_node, descs, deadline_ms=0, nowait=False):
        """Receiving side (kvf_grant): blocks of xfer_id go to descs.
        src_node None accepts any sender; naming it pushes the grant ahead.
        Completion: one RECV_DONE event. nowait=True: returns once written
        (kvf_submit); what the daemon refuses comes as that RECV_DONE."""
        if nowait:
            self.submit([dict(op="grant", xfer_id=xfer_id, node=src_node, descs=descs, deadline_ms=deadline_ms)])
            return
        arr, n = _desc_array(descs)
        _check(self._lib.kvf_grant(self._handle(), _bytes(xfer_id, "kvf_grant"),
                                   _bytes(src_node, "kvf_grant", False), arr, n, deadline_ms),
               "kvf_grant")

    def send(self, xfer_id, dst_node, descs, more=False, deadline_ms=0, flags=0, nowait=False):
        """Sending side (kvf_send): descs go to dst_node. more=True (or
        flags=SEND_MORE) on every part but the last. nowait=True (or
        flags=NOWAIT): the part (the first too) returns once written,
        unanswered; what the daemon refuses fails the send (in SEND_DONE).
        Completion: one SEND_DONE event."""
        arr, n = _desc_array(descs)
        flags |= _native.SEND_MORE if more else 0
        flags |= _native.SEND_NOWAIT if nowait else 0
        _check(self._lib.kvf_send(self._handle(), _bytes(xfer_id, "kvf_send"),
                                  _bytes(dst_node, "kvf_send"), arr, n, flags, deadline_ms),
               "kvf_send")

    # ---- layouts and transfers by block id

    def layout_from_tensors(self, pool, k_tensors, v_tensors=None, block_dim=0, **kw):
        """A Layout of an engine's per-layer K and V tensors in pool (a Pool
        or its name); see Layout.from_tensors. Register it with
        register_layout."""
        if isinstance(pool, (str, bytes)):
            pool = self.pool_find(pool)
        return Layout.from_tensors(pool, k_tensors, v_tensors, block_dim=block_dim, **kw)

    def register_layout(self, layout=None, **kw):
        """kvf_layout_register: registers a Layout (or Layout(**kw)) and
        returns its id, for grant_blocks and send_blocks. The daemon checks
        that every block lies in the pool (KVF_ERANGE) and that regions do
        not overlap (KVF_EINVAL). Freed by free_layout or close()."""
        if layout is None:
            layout = Layout(**kw)
        c, offs = layout._to_c()
        lid = ctypes.c_uint32()
        _check(self._lib.kvf_layout_register(self._handle(), ctypes.byref(c), ctypes.byref(lid)),
               "kvf_layout_register")
        del offs  # the daemon has its copy
        return lid.value

    def free_layout(self, layout_id):
        """kvf_layout_free (KVF_ENOENT: no such layout of this client). A
        transfer under way keeps what it needs of it."""
        _check(self._lib.kvf_layout_free(self._handle(), int(layout_id)), "kvf_layout_free")

    @staticmethod
    def _blocks(layout_id, block_ids, first_layer, n_layers):
        arr, n, keep = block_id_array(block_ids)
        b = _native.Blocks(layout=int(layout_id), n=n, first_layer=first_layer, n_layers=n_layers)
        if arr is not None:
            b.ids = ctypes.cast(arr, ctypes.POINTER(ctypes.c_uint32))
        return b, keep

    def grant_blocks(self, xfer_id, src_node, layout, block_ids, first_layer=0, n_layers=0,
                     layer_events=False, deadline_ms=0, nowait=False):
        """Receiving side by block id (kvf_grant_blocks): layers
        [first_layer, first_layer + n_layers) (n_layers 0: all from
        first_layer) of the transfer land in block_ids of layout (an id
        from register_layout). block_ids: a list, array.array("I") or a
        numpy array (uint32 ones without a copy). layer_events=True adds a
        LAYER_DONE event per layer as it lands, before RECV_DONE.
        nowait=True: returns once written; a refusal comes as RECV_DONE."""
        b, keep = self._blocks(layout, block_ids, first_layer, n_layers)
        flags = _native.GRANT_LAYER_EVENTS if layer_events else 0
        flags |= _native.NOWAIT if nowait else 0
        _check(self._lib.kvf_grant_blocks(self._handle(), _bytes(xfer_id, "kvf_grant_blocks"),
                                          _bytes(src_node, "kvf_grant_blocks", False), ctypes.byref(b),
                                          flags, deadline_ms), "kvf_grant_blocks")
        del keep

    def send_blocks(self, xfer_id, dst_node, layout, block_ids, first_layer=0, n_layers=0,
                    more=False, deadline_ms=0, nowait=False):
        """Sending side by block id (kvf_send_blocks): layers [first_layer,
        first_layer + n_layers) of block_ids of layout; block i lands in
        the grant's block i for every layer and K/V. In parts, layer by
        layer or by groups, more=True on all but the last; a later part may
        pass block_ids None (the first part's ids). nowait=True: the
        part (the first too) returns once written, without the daemon's
        answer (no round trip per layer); its refusal fails the send, in
        SEND_DONE."""
        b, keep = self._blocks(layout, block_ids, first_layer, n_layers)
        flags = _native.SEND_MORE if more else 0
        flags |= _native.SEND_NOWAIT if nowait else 0
        _check(self._lib.kvf_send_blocks(self._handle(), _bytes(xfer_id, "kvf_send_blocks"),
                                         _bytes(dst_node, "kvf_send_blocks"), ctypes.byref(b), flags,
                                         deadline_ms), "kvf_send_blocks")
        del keep

    def cancel(self, xfer_id, nowait=False):
        """kvf_cancel: both sides get their event. nowait=True: returns
        once written (a transfer that ended meanwhile is left as it is)."""
        if nowait:
            self.submit([dict(op="cancel", xfer_id=xfer_id)])
            return
        _check(self._lib.kvf_cancel(self._handle(), _bytes(xfer_id, "kvf_cancel")), "kvf_cancel")

    def submit(self, entries, noblock=False):
        """kvf_submit: many grants, send parts and cancels in one write,
        none waiting for the daemon. entries: dicts with op ("grant",
        "send", "grant_blocks", "send_blocks", "cancel"), xfer_id, node
        (src_node of grants, dst_node of sends), and as the single calls
        take them descs, or layout, block_ids, first_layer, n_layers;
        more, layer_events, deadline_ms. Returns len(entries). An entry the
        library refuses at once raises KvferryError with .queued: the
        number of entries before it, which were queued (none after it
        was). noblock=True: -EAGAIN (nothing queued) when the socket
        cannot take the whole batch now."""
        items = list(entries)
        subs = (_native.Sub * max(1, len(items)))()
        keep = []
        for i, e in enumerate(items):
            self._sub_entry(subs[i], e, keep)
        err = ctypes.c_int(0)
        flags = _native.NOBLOCK if noblock else 0
        rc = _check(self._lib.kvf_submit(self._handle(), subs, len(items), flags, ctypes.byref(err)), "kvf_submit")
        del keep
        if rc < len(items):
            e = KvferryError(err.value, "kvf_submit", "entry %d (%s)" % (rc, items[rc].get("op")))
            e.queued = rc
            raise e
        return rc

    _SUB_OPS = {"grant": _native.SUB_GRANT, "send": _native.SUB_SEND, "grant_blocks": _native.SUB_GRANT_BLOCKS,
                "send_blocks": _native.SUB_SEND_BLOCKS, "cancel": _native.SUB_CANCEL}

    def _sub_entry(self, sub, e, keep):
        op = self._SUB_OPS.get(e.get("op"))
        if op is None:
            raise ValueError("submit: unknown op %r" % (e.get("op"),))
        sub.op = op
        sub.xfer_id = _bytes(e.get("xfer_id"), "kvf_submit")
        sub.node = _bytes(e.get("node"), "kvf_submit", False)
        sub.deadline_ms = e.get("deadline_ms", 0)
        sub.flags = (_native.SEND_MORE if e.get("more") else 0) | \
            (_native.GRANT_LAYER_EVENTS if e.get("layer_events") else 0)
        if op in (_native.SUB_GRANT, _native.SUB_SEND):
            arr, n = _desc_array(e.get("descs", ()))
            sub.descs = ctypes.cast(arr, ctypes.POINTER(_native.Desc))
            sub.n = n
            keep.append(arr)
        elif op != _native.SUB_CANCEL:
            b, k = self._blocks(e["layout"], e.get("block_ids"), e.get("first_layer", 0), e.get("n_layers", 0))
            sub.blocks = ctypes.pointer(b)
            keep.extend((b, k))

    # ---- events

    def event_fd(self):
        """A descriptor that polls readable while events wait (for
        selectors / asyncio add_reader); do not read or close it."""
        return _check(self._lib.kvf_event_fd(self._handle()), "kvf_event_fd")

    def wait_events(self, max_events=64, timeout_ms=-1):
        """Takes up to max_events events (kvf_wait_events); timeout_ms 0
        returns at once, -1 waits without bound. Returns a list of Event,
        empty on timeout."""
        arr = (_native.Event * max_events)()
        n = _check(self._lib.kvf_wait_events(self._handle(), arr, max_events, timeout_ms),
                   "kvf_wait_events")
        return [Event._from_c(arr[i]) for i in range(n)]

    # ---- introspection

    def inspect(self, what="status", json=False):
        """The daemon's view (kvf_inspect): "status", "pools", "peers",
        "transfers" or "layouts", as a table, or as a parsed JSON document with
        json=True."""
        out = ctypes.c_void_p()
        _check(self._lib.kvf_inspect(self._handle(), _INSPECT[what], 1 if json else 0,
                                     ctypes.byref(out)), "kvf_inspect")
        try:
            text = ctypes.string_at(out.value).decode()
        finally:
            _native.free(out)
        return _json.loads(text) if json else text
