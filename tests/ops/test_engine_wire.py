#!/usr/bin/env python3
"""The daemon's side of engine memory (MemRegisterReq), spoken raw on the
API socket, as a careless or hostile client would: host memory by the fd
that rides with the frame, the checks on that fd, who may name the pool,
KVF_EBUSY while a transfer holds it, what the daemon lets go of when the
client leaves, and a file that shrinks under a registration. The
library's side (kvf_mem_register finding the file, Python) is tested
through libkvferry in its own tests."""
import fcntl
import mmap
import os
import struct

import kvftest
from kvftest import Raw, field_bytes as ld, field_varint, pb_decode as fields, request

KVF_ENOPOOL = -4003
KVF_ERANGE = -4004
KVF_EEXIST = -4014
KVF_EINVAL = -4016
KVF_EBUSY = -4017
KiB = 1024
REGION = 256 * KiB


def mem_register(seq, name, size, offset=0, has_fd=True, kind=b"host", ipc=None, alloc=0):
    body = ld(1, name) + ld(2, kind) + field_varint(3, size)
    if offset:
        body += field_varint(4, offset)
    if ipc is not None:
        body += ld(5, ipc) + field_varint(6, alloc)
    if has_fd:
        body += field_varint(7, 1)
    return request(seq, 19, body)


def mem_unregister(seq, pool):
    return request(seq, 20, field_varint(1, pool))


def descs(*triples):
    return ld(4, b"".join(struct.pack("<IQQ", *t) for t in triples))


def grant(seq, xfer_id, *triples):
    return request(seq, 13, ld(1, xfer_id) + ld(3, descs(*triples)) + field_varint(4, 10000))


def send(seq, xfer_id, node, *triples):
    return request(seq, 14, ld(1, xfer_id) + ld(2, node) + ld(3, descs(*triples)) + field_varint(5, 10000))


def cancel(seq, xfer_id):
    return request(seq, 15, ld(1, xfer_id))


def pools_req(seq):
    return request(seq, 11, b"")


def memfd(name, size, sealable=True):
    fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealable else 0))
    os.ftruncate(fd, size)
    return fd


def pattern(seed, n):
    return bytes((seed * 131 + i * 7 + (i >> 8)) & 0xFF for i in range(n))


class Client:
    """A raw client with its own regions."""

    def __init__(self, sock, name=b"test_engine_wire"):
        self.raw = Raw(sock)
        self.seq = 1
        self.stash = []   # events that came while a call waited for its answer
        self.raw.write(kvftest.hello_frame(self.seq, name))
        self.expect_ok(self.seq)

    def next_seq(self):
        self.seq += 1
        return self.seq

    def expect_ok(self, seq):
        kind, got, status, r = self.raw.next()
        assert (kind, got, status) == ("response", seq, 0), (kind, got, status, r.get(3))
        return r

    def call(self, make, *args, fds=()):
        """(status, error text, response fields) of one request."""
        seq = self.next_seq()
        self.raw.write(make(seq, *args), fds)
        while True:
            got = self.raw.next()
            assert got is not None, "no answer within 5 s"
            if got[0] == "response":
                break
            self.stash.append(got)
        kind, got, status, r = got
        assert got == seq, (got, seq, status)
        return status, r.get(3, [b""])[0].decode(), r

    def register(self, name, fd, size, offset=0):
        status, err, r = self.call(mem_register, name, size, offset, fds=[fd])
        assert status == 0, (status, err)
        info = fields(fields(r[19][0])[1][0])
        return info

    def events(self, n):
        out, self.stash = self.stash[:n], self.stash[n:]
        while len(out) < n:
            got = self.raw.next(10)
            assert got is not None, "no event within 10 s"
            if got[0] == "event":
                out.append(got)
        return out

    def close(self):
        self.raw.close()


def fd_count(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def maps_with(pid, needle):
    with open("/proc/%d/maps" % pid) as f:
        return [line for line in f if needle in line]


class EngineWire(kvftest.SoloTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.pid = cls.d.proc.pid

    def setUp(self):
        self.c = Client(self.d.sock)
        self.fds = []

    def tearDown(self):
        self.c.close()
        for fd in self.fds:
            os.close(fd)
        kvftest.wait_for(lambda: self.d.status()["engine_pools"] == 0, 5, "the client's memory dropped")

    def region(self, name, size=REGION, sealable=True, fill=None):
        fd = memfd(name, size, sealable)
        self.fds.append(fd)
        m = mmap.mmap(fd, size)
        if fill is not None:
            m[:] = pattern(fill, size)
        return fd, m

    def test_transfer_between_two_regions(self):
        """Two memfds of the client become pools; a local transfer moves
        region a into region b, through the daemon's mappings."""
        fa, ma = self.region("kvftest-a", fill=3)
        fb, mb = self.region("kvftest-b", fill=9)
        a = self.c.register(b"wire-a", fa, REGION)
        b = self.c.register(b"wire-b", fb, REGION)
        self.assertEqual(a[6], [1], "PoolInfo.engine")
        self.assertEqual(a[5], [b"engine-memfd"])
        self.assertGreaterEqual(a[1][0], 1, "after the config's pool 0")
        listed = {p["name"]: p for p in self.d.status()["pools"]}
        self.assertTrue(listed["wire-a"]["engine"])
        self.assertEqual(listed["wire-a"]["owner_pid"], os.getpid())
        self.assertGreaterEqual(listed["wire-a"]["import_ms"], 0)
        self.assertFalse(listed["kv"]["engine"])
        self.assertNotEqual(a[1][0], b[1][0])
        # sealed against shrinking, growing still allowed
        self.assertTrue(fcntl.fcntl(fa, 1034) & 0x2, "F_GET_SEALS has F_SEAL_SHRINK")
        with self.assertRaises(PermissionError):
            os.ftruncate(fa, REGION // 2)
        pa, pb = a[1][0], b[1][0]
        self.assertEqual(self.c.call(grant, b"ab", (pb, 4096, 64 * KiB), (pb, 128 * KiB, 64 * KiB))[0], 0)
        self.assertEqual(self.c.call(send, b"ab", b"solo", (pa, 0, 64 * KiB), (pa, 64 * KiB, 64 * KiB))[0], 0)
        for kind, xid, status, e in self.c.events(2):
            self.assertEqual((xid, status), (b"ab", 0), e.get(8))
        want = bytearray(pattern(9, REGION))
        want[4096:4096 + 64 * KiB] = pattern(3, REGION)[:64 * KiB]
        want[128 * KiB:192 * KiB] = pattern(3, REGION)[64 * KiB:128 * KiB]
        self.assertEqual(bytes(mb[:]), bytes(want), "every byte of b")
        self.assertEqual(bytes(ma[:]), pattern(3, REGION), "a untouched")

    def test_unregister_while_in_use(self):
        fd, _ = self.region("kvftest-busy")
        p = self.c.register(b"wire-busy", fd, REGION)[1][0]
        self.assertEqual(self.c.call(grant, b"held", (p, 0, 4096))[0], 0)
        status, err, _ = self.c.call(mem_unregister, p)
        self.assertEqual(status, KVF_EBUSY, err)
        self.assertIn("transfers use it", err)
        self.assertEqual(self.d.status()["engine_pools"], 1, "nothing changed")
        self.assertEqual(self.c.call(cancel, b"held")[0], 0)
        self.assertEqual(self.c.events(1)[0][2], -4013, "KVF_ECANCELED")
        kvftest.wait_for(lambda: self.d.status()["grants_active"] == 0, 5, "the grant gone")
        self.assertEqual(self.c.call(mem_unregister, p)[0], 0)
        self.assertEqual(self.c.call(mem_unregister, p)[0], KVF_ENOPOOL, "once")
        self.assertEqual(self.c.call(grant, b"late", (p, 0, 4096))[0], KVF_ENOPOOL)

    def test_only_its_owner_names_it(self):
        fd, _ = self.region("kvftest-own")
        p = self.c.register(b"wire-own", fd, REGION)[1][0]
        other = Client(self.d.sock, b"other")
        try:
            self.assertEqual(other.call(grant, b"steal", (p, 0, 4096))[0], KVF_ENOPOOL)
            self.assertEqual(other.call(mem_unregister, p)[0], KVF_ENOPOOL)
            listed = [fields(x)[1][0] if 1 in fields(x) else 0 for x in fields(other.call(pools_req)[2][11][0]).get(1, [])]
            self.assertNotIn(p, listed, "another client's memory is not listed to it")
        finally:
            other.close()

    def test_bad_requests_lose_nothing(self):
        before = fd_count(self.pid)
        cases = [
            (dict(name=b"no-fd", size=REGION), [], KVF_EINVAL, "none came"),
            (dict(name=b"bad name!", size=REGION), None, KVF_EINVAL, "name"),
            (dict(name=b"zero", size=0), None, KVF_EINVAL, "0 bytes"),
            (dict(name=b"past-end", size=REGION, offset=4096), None, KVF_ERANGE, "passes the end"),
            (dict(name=b"k", size=REGION, kind=b"disk"), None, KVF_EINVAL, "kind"),
        ]
        for kw, fds, want, text in cases:
            fd = memfd("kvftest-bad", REGION)
            try:
                status, err, _ = self.c.call(mem_register, kw["name"], kw["size"], kw.get("offset", 0),
                                             fds is None, kw.get("kind", b"host"),
                                             fds=[fd] if fds is None else fds)
            finally:
                os.close(fd)
            self.assertEqual(status, want, (kw, err))
            self.assertIn(text, err)
        r, w = os.pipe()
        try:
            status, err, _ = self.c.call(mem_register, b"pipe", 4096, fds=[r])
        finally:
            os.close(r)
            os.close(w)
        self.assertEqual((status, "not a file" in err), (KVF_EINVAL, True), err)
        with open(kvftest.KVFERRYD, "rb") as f:   # a file on disk (the build tree)
            status, err, _ = self.c.call(mem_register, b"disk", 4096, fds=[f.fileno()])
        self.assertEqual(status, KVF_EINVAL, err)
        self.assertIn("not memory", err)
        fd, _ = self.region("kvftest-dup")
        self.c.register(b"wire-dup", fd, REGION)
        fd2, _ = self.region("kvftest-dup2")
        self.assertEqual(self.c.call(mem_register, b"wire-dup", REGION, fds=[fd2])[0], KVF_EEXIST)
        self.assertEqual(self.c.call(mem_register, b"kv", REGION, fds=[fd2])[0], KVF_EEXIST,
                         "nor the name of a daemon pool")
        status, err, _ = self.c.call(mem_register, b"gpu", REGION, 0, False, b"cuda:0", b"\0" * 64, REGION)
        self.assertNotEqual(status, 0, "garbage IPC handle, or no CUDA here")
        # fds no request asked for are closed
        strays = [memfd("kvftest-stray", 4096) for _ in range(3)]
        try:
            self.c.call(pools_req, fds=strays)
        finally:
            for s in strays:
                os.close(s)
        # each passed fd came in a libuv pipe handle, closed on a later turn
        # of the loop than the reply: wait for that turn, not longer
        kvftest.wait_for(lambda: fd_count(self.pid) == before, 5,
                         "the daemon to keep none of the fds that came (%d before)" % before)

    def test_client_that_leaves_loses_its_memory(self):
        before = fd_count(self.pid)
        other = Client(self.d.sock, b"leaver")
        fds = [memfd("kvftest-leaver", REGION) for _ in range(2)]
        self.fds.extend(fds)
        p = other.register(b"leaver-0", fds[0], REGION)[1][0]
        other.register(b"leaver-1", fds[1], REGION)
        self.assertEqual(other.call(grant, b"pending", (p, 0, 4096))[0], 0)
        self.assertEqual(len(maps_with(self.pid, "kvftest-leaver")), 2)
        other.close()
        kvftest.wait_for(lambda: self.d.status()["engine_pools"] == 0, 5, "dropped with its client")
        self.assertEqual(maps_with(self.pid, "kvftest-leaver"), [], "unmapped")
        # the status connections just used close on a later turn of the
        # daemon's loop than their reply: wait for that turn, not longer
        kvftest.wait_for(lambda: fd_count(self.pid) == before, 5,
                         "the daemon to keep none of the leaver's fds (%d before)" % before)
        self.assertEqual(self.d.status()["grants_active"], 0)

    def test_file_that_shrinks_fails_the_transfer_not_the_daemon(self):
        """A memfd made without MFD_ALLOW_SEALING cannot be sealed; the
        engine truncates it under its registration."""
        fa, _ = self.region("kvftest-shrink", sealable=False, fill=1)
        fb, mb = self.region("kvftest-intact", fill=2)
        a = self.c.register(b"wire-shrink", fa, REGION)[1][0]
        b = self.c.register(b"wire-intact", fb, REGION)[1][0]
        os.ftruncate(fa, 0)
        self.c.call(grant, b"shrunk", (b, 0, 64 * KiB))
        self.c.call(send, b"shrunk", b"solo", (a, 0, 64 * KiB))
        for e in self.c.events(2):
            self.assertEqual(e[2], -14, "EFAULT")
            self.assertIn(b"went away under the copy", e[3][8][0])
        self.assertIsNone(self.d.proc.poll(), "the daemon survived")
        fc, mc = self.region("kvftest-after", fill=5)
        c = self.c.register(b"wire-after", fc, REGION)[1][0]
        self.c.call(grant, b"after", (b, 0, REGION))
        self.c.call(send, b"after", b"solo", (c, 0, REGION))
        self.assertEqual([e[2] for e in self.c.events(2)], [0, 0])
        self.assertEqual(bytes(mb[:]), pattern(5, REGION))


class EngineWireTcp(kvftest.PairTestCase):
    """Engine memory at both ends of a tcp transfer between two daemons;
    a peer learns of it from the grant (the Hello listed only the config's
    pools)."""
    POOL = "8M"

    def test_engine_to_engine_over_tcp(self):
        pre, dec = Client(self.pre.sock, b"prefill"), Client(self.dec.sock, b"decode")
        fs = memfd("kvftest-src", 4 * REGION)
        fd = memfd("kvftest-dst", 4 * REGION)
        try:
            ms, md = mmap.mmap(fs, 4 * REGION), mmap.mmap(fd, 4 * REGION)
            ms[:] = pattern(11, 4 * REGION)
            md[:] = pattern(12, 4 * REGION)
            # a region at an offset of the file, not page aligned
            src = pre.register(b"engine-src", fs, 3 * REGION, offset=100)[1][0]
            dst = dec.register(b"engine-dst", fd, 4 * REGION)[1][0]
            blocks = [(i * 5 + 1) % 12 for i in range(12)]  # a permutation: a grant must not overlap itself
            g = [(dst, b * 64 * KiB, 64 * KiB) for b in blocks]
            sd = [(src, i * 64 * KiB, 64 * KiB) for i in range(12)]
            self.assertEqual(dec.call(grant, b"tcp-engine", *g)[0], 0)
            self.assertEqual(pre.call(send, b"tcp-engine", b"decode", *sd)[0], 0)
            for c in (pre, dec):
                (_, xid, status, e), = c.events(1)
                self.assertEqual((xid, status, e[4][0]), (b"tcp-engine", 0, b"tcp"), e.get(8))
            want = bytearray(pattern(12, 4 * REGION))
            src_bytes = pattern(11, 4 * REGION)
            for i, b in enumerate(blocks):
                want[b * 64 * KiB:(b + 1) * 64 * KiB] = src_bytes[100 + i * 64 * KiB:100 + (i + 1) * 64 * KiB]
            self.assertEqual(bytes(md[:]), bytes(want), "every byte at the decode end")
        finally:
            pre.close()
            dec.close()
            os.close(fs)
            os.close(fd)
        for d in (self.pre, self.dec):
            kvftest.wait_for(lambda: d.status()["engine_pools"] == 0, 5, "dropped")

    def test_file_that_shrinks_under_a_tcp_send(self):
        """The sender's writev faults: the batch goes out with zeros in its
        place (the stream stays in step), both sides fail with EFAULT, the
        peers stay up and the next transfer is whole."""
        self.shrink_at(src_shrinks=True)

    def test_file_that_shrinks_under_a_tcp_receive(self):
        """The receiver's read faults: that payload is read into a sink (the
        stream stays in step), both sides fail with EFAULT, the peers stay
        up and the next transfer is whole."""
        self.shrink_at(src_shrinks=False)

    def shrink_at(self, src_shrinks):
        pre, dec = Client(self.pre.sock, b"prefill"), Client(self.dec.sock, b"decode")
        fa, fb, fc = memfd("kvftest-shrink", REGION, sealable=not src_shrinks), \
            memfd("kvftest-dst", REGION, sealable=src_shrinks), memfd("kvftest-ok", REGION)
        try:
            mc = mmap.mmap(fc, REGION)
            mc[:] = pattern(21, REGION)
            a = pre.register(b"tcp-shrink", fa, REGION)[1][0]
            c = pre.register(b"tcp-ok", fc, REGION)[1][0]
            b = dec.register(b"tcp-dst", fb, REGION)[1][0]
            downs = self.pre.log_text().count("peer decode down")
            os.ftruncate(fa if src_shrinks else fb, 0)
            dec.call(grant, b"shrunk", (b, 0, 64 * KiB), (b, 128 * KiB, 64 * KiB))
            pre.call(send, b"shrunk", b"decode", (a, 0, 64 * KiB), (a, 64 * KiB, 64 * KiB))
            for cl in (pre, dec):
                (_, xid, status, e), = cl.events(1)
                self.assertEqual((xid, status), (b"shrunk", -14), e.get(8))
                self.assertIn(b"went away under the", e[8][0])
            if not src_shrinks:
                os.ftruncate(fb, REGION)  # the engine makes it whole again
            dec.call(grant, b"after-shrunk", (b, 0, REGION))
            pre.call(send, b"after-shrunk", b"decode", (c, 0, REGION))
            for cl in (pre, dec):
                (_, xid, status, e), = cl.events(1)
                self.assertEqual((xid, status), (b"after-shrunk", 0), e.get(8))
            self.assertEqual(bytes(mmap.mmap(fb, REGION)[:]), pattern(21, REGION))
            self.assertEqual(self.pre.log_text().count("peer decode down"), downs, "the peer stayed up")
        finally:
            pre.close()
            dec.close()
            for fd in (fa, fb, fc):
                os.close(fd)


if __name__ == "__main__":
    kvftest.main()
