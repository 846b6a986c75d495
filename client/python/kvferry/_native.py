"""ctypes declarations of libkvferry (client/kvferry.h), loaded once.

The library is found as $KVFERRY_LIB when set (a path), else by the
dynamic loader as libkvferry.so.1 (the soname `make install` puts in
LIBDIR). Every structure here mirrors the C header field for field.
"""
import ctypes
import os

KVF_XFER_ID_MAX = 127
KVF_NAME_MAX = 63
SEND_MORE = 0x1
NOWAIT = 0x2
SEND_NOWAIT = NOWAIT
NOBLOCK = 0x4
SUB_GRANT, SUB_SEND, SUB_GRANT_BLOCKS, SUB_SEND_BLOCKS, SUB_CANCEL = 1, 2, 3, 4, 5
GRANT_LAYER_EVENTS = 0x1
LAYOUT_NHD, LAYOUT_HND = 0, 1

INSPECT_STATUS, INSPECT_POOLS, INSPECT_PEERS, INSPECT_TRANSFERS, INSPECT_LAYOUTS = range(5)
EV_RECV_DONE, EV_SEND_DONE, EV_LAYER_DONE = 1, 2, 3
MEM_HOST, MEM_CUDA = 0, 1

# KVF_ERR_MAP: written by scripts/gen-errors.py from client/kvferry.h
ERRORS = {
    "KVF_ESIZE": -4001,
    "KVF_ENOPEER": -4002,
    "KVF_ENOPOOL": -4003,
    "KVF_ERANGE": -4004,
    "KVF_EPEERLOST": -4005,
    "KVF_EREMOTECANCEL": -4006,
    "KVF_EDAEMON": -4007,
    "KVF_EVERSION": -4008,
    "KVF_EPROTO": -4009,
    "KVF_ELIMIT": -4010,
    "KVF_EPERM": -4011,
    "KVF_EDEADLINE": -4012,
    "KVF_ECANCELED": -4013,
    "KVF_EEXIST": -4014,
    "KVF_ENOENT": -4015,
    "KVF_EINVAL": -4016,
    "KVF_EBUSY": -4017,
    "KVF_EUNKNOWN": -4018,
}
# end of KVF_ERR_MAP


class PoolInfo(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32),
                ("name", ctypes.c_char * (KVF_NAME_MAX + 1)),
                ("kind", ctypes.c_char * 16),
                ("backing", ctypes.c_char * 32),
                ("size", ctypes.c_uint64),
                ("engine", ctypes.c_int),
                ("nic_reg", ctypes.c_char * 16)]


class ConnectOpts(ctypes.Structure):
    _fields_ = [("wait_ms", ctypes.c_int),
                ("reconnect_ms", ctypes.c_int)]


class Mem(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int),
                ("addr", ctypes.c_void_p),
                ("size", ctypes.c_uint64),
                ("fd", ctypes.c_int),
                ("fd_offset", ctypes.c_uint64),
                ("name", ctypes.c_char_p)]


class Desc(ctypes.Structure):
    _fields_ = [("pool", ctypes.c_uint32),
                ("offset", ctypes.c_uint64),
                ("len", ctypes.c_uint64)]


class Layout(ctypes.Structure):
    _fields_ = [("pool", ctypes.c_uint32),
                ("n_layers", ctypes.c_uint32),
                ("n_kv", ctypes.c_uint32),
                ("n_blocks", ctypes.c_uint32),
                ("block_bytes", ctypes.c_uint64),
                ("block_stride", ctypes.c_uint64),
                ("offsets", ctypes.POINTER(ctypes.c_uint64)),
                ("tokens_per_block", ctypes.c_uint32),
                ("kv_heads", ctypes.c_uint32),
                ("head_dim", ctypes.c_uint32),
                ("dtype_bytes", ctypes.c_uint32),
                ("order", ctypes.c_uint32),
                ("first_head", ctypes.c_uint32),
                ("model_kv_heads", ctypes.c_uint32)]


class Blocks(ctypes.Structure):
    _fields_ = [("layout", ctypes.c_uint32),
                ("ids", ctypes.POINTER(ctypes.c_uint32)),
                ("n", ctypes.c_size_t),
                ("first_layer", ctypes.c_uint32),
                ("n_layers", ctypes.c_uint32)]


class Sub(ctypes.Structure):
    _fields_ = [("op", ctypes.c_int),
                ("xfer_id", ctypes.c_char_p),
                ("node", ctypes.c_char_p),
                ("descs", ctypes.POINTER(Desc)),
                ("n", ctypes.c_size_t),
                ("blocks", ctypes.POINTER(Blocks)),
                ("flags", ctypes.c_uint),
                ("deadline_ms", ctypes.c_uint32)]


class Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int),
                ("status", ctypes.c_int),
                ("xfer_id", ctypes.c_char * (KVF_XFER_ID_MAX + 1)),
                ("path", ctypes.c_char * 32),
                ("peer", ctypes.c_char * (KVF_NAME_MAX + 1)),
                ("bytes", ctypes.c_uint64),
                ("descriptors", ctypes.c_uint64),
                ("error", ctypes.c_char * 128),
                ("layer", ctypes.c_uint32),
                ("transform", ctypes.c_char * 112)]


_P = ctypes.c_void_p
_S = ctypes.c_char_p
_I = ctypes.c_int
_PROTOS = {
    "kvf_connect": (_I, [_S, ctypes.POINTER(_P)]),
    "kvf_connect_ex": (_I, [_S, ctypes.POINTER(ConnectOpts), ctypes.POINTER(_P)]),
    "kvf_mem_register": (_I, [_P, ctypes.POINTER(Mem), ctypes.POINTER(ctypes.c_uint32)]),
    "kvf_mem_unregister": (_I, [_P, ctypes.c_uint32]),
    "kvf_close": (None, [_P]),
    "kvf_node": (_S, [_P]),
    "kvf_pools": (_I, [_P, ctypes.POINTER(PoolInfo), ctypes.c_size_t]),
    "kvf_pool_find": (_I, [_P, _S, ctypes.POINTER(PoolInfo)]),
    "kvf_pool_map": (_I, [_P, ctypes.c_uint32, ctypes.POINTER(_P), ctypes.POINTER(ctypes.c_uint64)]),
    "kvf_grant": (_I, [_P, _S, _S, ctypes.POINTER(Desc), ctypes.c_size_t, ctypes.c_uint32]),
    "kvf_send": (_I, [_P, _S, _S, ctypes.POINTER(Desc), ctypes.c_size_t, ctypes.c_uint,
                      ctypes.c_uint32]),
    "kvf_cancel": (_I, [_P, _S]),
    "kvf_layout_register": (_I, [_P, ctypes.POINTER(Layout), ctypes.POINTER(ctypes.c_uint32)]),
    "kvf_layout_free": (_I, [_P, ctypes.c_uint32]),
    "kvf_grant_blocks": (_I, [_P, _S, _S, ctypes.POINTER(Blocks), ctypes.c_uint, ctypes.c_uint32]),
    "kvf_send_blocks": (_I, [_P, _S, _S, ctypes.POINTER(Blocks), ctypes.c_uint, ctypes.c_uint32]),
    "kvf_submit": (_I, [_P, ctypes.POINTER(Sub), ctypes.c_size_t, ctypes.c_uint, ctypes.POINTER(_I)]),
    "kvf_event_fd": (_I, [_P]),
    "kvf_wait_events": (_I, [_P, ctypes.POINTER(Event), ctypes.c_size_t, _I]),
    "kvf_inspect": (_I, [_P, _I, _I, ctypes.POINTER(_P)]),
    "kvf_strerror": (_S, [_I]),
    "kvf_err_name": (_S, [_I]),
}

_lib = None
_libc = None


def _open():
    path = os.environ.get("KVFERRY_LIB")
    names = [path] if path else ["libkvferry.so.1", "libkvferry.so"]
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise OSError("kvferry: cannot load libkvferry (set KVFERRY_LIB to its path, or "
                  "install it with `make install`): " + "; ".join(errors))


def lib():
    """The loaded library, with argument and return types declared."""
    global _lib, _libc
    if _lib is None:
        handle = _open()
        for fn, (restype, argtypes) in _PROTOS.items():
            f = getattr(handle, fn)
            f.restype = restype
            f.argtypes = argtypes
        _libc = ctypes.CDLL(None)  # free() for kvf_inspect's buffer
        _libc.free.argtypes = [_P]
        _libc.free.restype = None
        _lib = handle
    return _lib


def free(ptr):
    lib()
    _libc.free(ptr)


def libc():
    """The C library (mremap and munmap for views that outlive a client)."""
    lib()
    return _libc
