"""KV layouts (kvf_layout): an engine's paged KV cache described once, so
that transfers name block ids instead of one descriptor per (layer, K/V,
block).

Region r = layer * n_kv + kv holds block b at pool offset
offsets[r] + b * block_stride. Layout.from_tensors reads offsets, block size
and stride from the engine's own tensors (torch, numpy, CuPy, memoryview, a
kvferry pool region) or from plain addresses, against the pool's base::

    # vLLM: per layer one [2, num_blocks, block_size, kv_heads, head_dim]
    # tensor in a kvferry pool (torch.as_tensor(pool, device="cuda") carved up)
    layout = client.layout_from_tensors(pool, [t[0] for t in kv_caches],
                                        [t[1] for t in kv_caches], block_dim=0)
    lid = client.register_layout(layout)
    client.send_blocks("req-42", "decode-0", lid, block_ids, first_layer=l, n_layers=1,
                       more=l < n_layers - 1)

Only the standard library is used; torch and numpy are recognised by what
their objects offer (data_ptr()/stride()/element_size(), or the array
interfaces), never imported.
"""
import ctypes

from . import _native

_ORDERS = {"NHD": _native.LAYOUT_NHD, "HND": _native.LAYOUT_HND}


def _typestr_bytes(typestr):
    """Bytes per element of an array-interface typestr ("<f2" -> 2)."""
    return int(typestr[2:])


def _buffer_address(mv):
    """The address of a memoryview's first byte (its buffer must be
    writable: read-only memory cannot be a KV cache)."""
    if mv.readonly:
        raise ValueError("a read-only buffer cannot be a KV cache tensor")
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


def tensor_geometry(t):
    """(address, shape, byte strides, element bytes) of a tensor-like
    object: torch tensors (data_ptr, stride, element_size), objects with
    __cuda_array_interface__ or __array_interface__ (CuPy, numpy, kvferry
    pool regions), or buffers (memoryview, bytearray, array.array)."""
    if hasattr(t, "data_ptr") and hasattr(t, "stride"):
        esize = t.element_size() if hasattr(t, "element_size") else t.itemsize
        shape = tuple(int(s) for s in t.shape)
        return int(t.data_ptr()), shape, tuple(int(s) * esize for s in t.stride()), esize
    iface = None
    for name in ("__cuda_array_interface__", "__array_interface__"):
        try:
            iface = getattr(t, name)
            break
        except AttributeError:
            continue
    if iface is not None:
        shape = tuple(int(s) for s in iface["shape"])
        esize = _typestr_bytes(iface["typestr"])
        strides = iface.get("strides")
        if strides is None:  # C order
            strides, step = [], esize
            for s in reversed(shape):
                strides.append(step)
                step *= s
            strides = tuple(reversed(strides))
        return int(iface["data"][0]), shape, tuple(int(s) for s in strides), esize
    mv = memoryview(t)
    return _buffer_address(mv), tuple(mv.shape), tuple(mv.strides), mv.itemsize


def _block_shape(name, shape, strides, esize, block_dim):
    """n_blocks, block_bytes, block_stride of one tensor whose dimension
    block_dim is the block id; the other dimensions must be one contiguous
    run of bytes (C order), as every engine's blocks are."""
    if not shape:
        raise ValueError("%s: a 0-d tensor has no blocks" % name)
    d = block_dim if block_dim >= 0 else len(shape) + block_dim
    if not 0 <= d < len(shape):
        raise ValueError("%s: block_dim %d outside its %d dimensions" % (name, block_dim, len(shape)))
    inner = [(s, st) for i, (s, st) in enumerate(zip(shape, strides)) if i != d]
    step = esize
    for size, stride in reversed(inner):
        if size != 1 and stride != step:
            raise ValueError("%s: the dimensions other than block_dim %d are not contiguous "
                             "(shape %s, byte strides %s)" % (name, block_dim, shape, strides))
        step *= size
    return shape[d], step, strides[d], [s for s, _ in inner]


class Layout:
    """An engine's KV cache layout in one pool (kvf_layout), not yet
    registered: pass it to Client.register_layout.

    pool: a Pool or a pool id. offsets: n_layers * n_kv pool offsets of
    block 0, region r = layer * n_kv + kv (K then V). n_kv 2 (K and V) or 1
    (MLA's latent). block_stride defaults to block_bytes. The geometry
    (tokens_per_block, kv_heads, head_dim, dtype_bytes, order "NHD" or
    "HND") says what a block holds; 0 leaves it unstated. first_head and
    model_kv_heads say which of the model's KV heads it holds (tensor
    parallelism): [first_head, first_head + kv_heads) of model_kv_heads;
    model_kv_heads 0: every head. Two sides whose geometry is fully stated
    may differ in heads, order and tokens per block (by a whole factor):
    the daemon moves the heads they share, transformed."""

    def __init__(self, pool, offsets, n_blocks, block_bytes, block_stride=None, n_kv=2,
                 tokens_per_block=0, kv_heads=0, head_dim=0, dtype_bytes=0, order="NHD",
                 first_head=0, model_kv_heads=0):
        self.pool = pool.id if hasattr(pool, "id") else int(pool)
        self.offsets = [int(o) for o in offsets]
        self.n_kv = int(n_kv)
        if self.n_kv not in (1, 2) or not self.offsets or len(self.offsets) % self.n_kv:
            raise ValueError("a layout needs n_layers * n_kv offsets, n_kv 1 or 2 (got %d offsets, "
                             "n_kv %d)" % (len(self.offsets), self.n_kv))
        self.n_layers = len(self.offsets) // self.n_kv
        self.n_blocks = int(n_blocks)
        self.block_bytes = int(block_bytes)
        self.block_stride = self.block_bytes if block_stride is None else int(block_stride)
        self.tokens_per_block = int(tokens_per_block)
        self.kv_heads = int(kv_heads)
        self.head_dim = int(head_dim)
        self.dtype_bytes = int(dtype_bytes)
        if order not in _ORDERS:
            raise ValueError("order: 'NHD' or 'HND', not %r" % (order,))
        self.order = order
        self.first_head = int(first_head)
        self.model_kv_heads = int(model_kv_heads)

    @classmethod
    def from_tensors(cls, pool, k_tensors, v_tensors=None, block_dim=0, n_blocks=None,
                     block_bytes=None, block_stride=None, order="NHD", tokens_per_block=None,
                     kv_heads=None, head_dim=None, dtype_bytes=None, first_head=0, model_kv_heads=0):
        """A layout from an engine's per-layer K and V tensors (v_tensors
        None: one latent per layer, MLA), all inside pool (a Pool: its
        mapped address is the base the offsets are taken from).

        A tensor is anything tensor_geometry reads (torch, numpy, CuPy,
        memoryview, a pool region), its dimension block_dim indexed by
        block id; or a plain address (int), which then needs n_blocks and
        block_bytes (block_stride defaults to block_bytes). The geometry,
        unless given, is read from a tensor's other dimensions: [tokens,
        heads, head_dim] (order "NHD"; "HND": [heads, tokens, head_dim]) or
        [tokens, head_dim] (one head), and its element size."""
        base, size = pool.address, pool.size
        ks = list(k_tensors)
        vs = None if v_tensors is None else list(v_tensors)
        if vs is not None and len(vs) != len(ks):
            raise ValueError("%d K tensors but %d V tensors" % (len(ks), len(vs)))
        regions = []
        for layer, k in enumerate(ks):
            regions.append(("k_tensors[%d]" % layer, k))
            if vs is not None:
                regions.append(("v_tensors[%d]" % layer, vs[layer]))
        found = None  # (n_blocks, block_bytes, block_stride) of the first tensor
        geometry = None
        offsets = []
        for name, t in regions:
            if isinstance(t, int):
                if n_blocks is None or block_bytes is None:
                    raise ValueError("%s is an address: give n_blocks and block_bytes" % name)
                addr = t
                shape = (int(n_blocks), int(block_bytes),
                         int(block_bytes if block_stride is None else block_stride))
            else:
                addr, dims, strides, esize = tensor_geometry(t)
                nb, bb, bs, inner = _block_shape(name, dims, strides, esize, block_dim)
                shape = (nb, bb, bs)
                if geometry is None:
                    geometry = (inner, esize)
            if found is None:
                found = shape
            elif shape != found:
                raise ValueError("%s: %d blocks of %d bytes every %d, but the first tensor has "
                                 "%d of %d every %d" % ((name,) + shape + found))
            off = addr - base
            end = off + (shape[0] - 1) * shape[2] + shape[1]
            if off < 0 or end > size:
                raise ValueError("%s (address 0x%x) is not inside pool %s (0x%x, %d bytes): an engine's "
                                 "KV tensors must be carved out of the pool" % (
                                     name, addr, getattr(pool, "name", pool), base, size))
            offsets.append(off)
        if found is None:
            raise ValueError("no tensors")
        geo = {"tokens_per_block": 0, "kv_heads": 0, "head_dim": 0, "dtype_bytes": 0}
        if geometry is not None:
            inner, esize = geometry
            geo["dtype_bytes"] = esize
            if len(inner) == 3:
                toks, heads = (inner[0], inner[1]) if order == "NHD" else (inner[1], inner[0])
                geo.update(tokens_per_block=toks, kv_heads=heads, head_dim=inner[2])
            elif len(inner) == 2:
                geo.update(tokens_per_block=inner[0], kv_heads=1, head_dim=inner[1])
            else:  # bytes only: nothing to state but the size
                geo["dtype_bytes"] = 0
        for key, given in (("tokens_per_block", tokens_per_block), ("kv_heads", kv_heads),
                           ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
            if given is not None:
                geo[key] = given
        return cls(pool, offsets, found[0], found[1], found[2], n_kv=1 if vs is None else 2,
                   order=order, first_head=first_head, model_kv_heads=model_kv_heads, **geo)

    def _to_c(self):
        """The kvf_layout, and the offsets array it points to (keep both)."""
        offs = (ctypes.c_uint64 * len(self.offsets))(*self.offsets)
        c = _native.Layout(pool=self.pool, n_layers=self.n_layers, n_kv=self.n_kv,
                           n_blocks=self.n_blocks, block_bytes=self.block_bytes,
                           block_stride=self.block_stride,
                           offsets=ctypes.cast(offs, ctypes.POINTER(ctypes.c_uint64)),
                           tokens_per_block=self.tokens_per_block, kv_heads=self.kv_heads,
                           head_dim=self.head_dim, dtype_bytes=self.dtype_bytes,
                           order=_ORDERS[self.order], first_head=self.first_head,
                           model_kv_heads=self.model_kv_heads)
        return c, offs

    def __repr__(self):
        return ("Layout(pool=%d, n_layers=%d, n_kv=%d, n_blocks=%d, block_bytes=%d, block_stride=%d, "
                "geometry=%d/%d/%d/%d %s, heads %d+%d of %d)" % (
                    self.pool, self.n_layers, self.n_kv, self.n_blocks, self.block_bytes,
                    self.block_stride, self.tokens_per_block, self.kv_heads, self.head_dim,
                    self.dtype_bytes, self.order, self.first_head, self.kv_heads,
                    self.model_kv_heads))


_U32 = ("I", "=I", "<I", "@I")


def block_id_array(ids):
    """Block ids as (ctypes uint32 array or None, count, the object to keep
    alive during the call). A C-contiguous, writable buffer of native uint32
    (numpy uint32, array.array("I")) is passed without a copy; anything else
    (lists, other integer types, torch tensors via tolist()) is converted,
    each id checked to fit 32 bits."""
    if ids is None:
        return None, 0, None
    try:
        mv = memoryview(ids)
    except TypeError:
        mv = None
    if mv is not None and mv.format in _U32 and mv.itemsize == 4 and mv.c_contiguous:
        n = mv.nbytes // 4
        if n == 0:
            return None, 0, None
        flat = mv.cast("B")
        if flat.readonly:
            arr = (ctypes.c_uint32 * n).from_buffer_copy(flat)
        else:
            arr = (ctypes.c_uint32 * n).from_buffer(flat)
        return arr, n, (arr, flat)
    if mv is not None:
        vals = mv.tolist()
        if mv.ndim != 1:
            raise ValueError("block ids: a 1-d array, not shape %s" % (mv.shape,))
    elif hasattr(ids, "tolist"):
        vals = ids.tolist()
    else:
        vals = list(ids)
    if not vals:
        return None, 0, None
    try:
        lo, hi = min(vals), max(vals)
    except TypeError:
        raise TypeError("block ids must be integers") from None
    if lo < 0 or hi > 0xFFFFFFFF or any(not isinstance(v, int) for v in (lo, hi)):
        raise ValueError("block ids must be integers in [0, 2**32), got %r..%r" % (lo, hi))
    arr = (ctypes.c_uint32 * len(vals))(*vals)
    return arr, len(vals), arr
