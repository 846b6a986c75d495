#!/usr/bin/env python3
"""The cluster key (cluster-key-file, daemon/auth.h), black box: real
daemons with the same key move data, every byte checked; with different
keys, or a key on one side only, peers never come up, both logs say why and
the daemons stay alive; bad key files stop the start with a message naming
the file; and a raw TCP client that speaks the peer protocol (framing and
protobuf written here, proofs computed with Python's hmac, independently of
daemon/auth.c) is refused with no proof, a wrong proof, a replayed proof or
a reflected one, on the control connection and on a tcp data stream, while
correct proofs are accepted."""
import hashlib
import hmac
import json
import os
import socket
import struct
import unittest
import urllib.request

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, field_bytes, field_varint, pb_decode as decode, run, wait_for

import kvferry

PEER_VERSION = 1
# A refusal closes at once; well within this, and well before the daemons'
# handshake timer (HANDSHAKE, set by daemons() below) would close an
# accepted but idle connection anyway.
REFUSED_S = 2.5
HANDSHAKE = "peer-handshake-timeout-ms 5000"


# PeerMsg bodies (proto/kvferry.proto)
MSG_HELLO, MSG_DATA_HELLO, MSG_HEARTBEAT, MSG_AUTH = 1, 2, 3, 10


def hello(node, nonce=None, proof=None, session=None, full=False):
    b = field_varint(1, PEER_VERSION) + field_bytes(2, node)
    if full:
        b += field_bytes(4, "tcp") + field_varint(5, 1) + field_varint(7, 100)
    if session is not None:
        b += field_varint(6, session)
    if nonce is not None:
        b += field_bytes(9, nonce)
    if proof is not None:
        b += field_bytes(10, proof)
    return b


def auth(proof=None, nonce=None):
    b = b""
    if proof is not None:
        b += field_bytes(1, proof)
    if nonce is not None:
        b += field_bytes(2, nonce)
    return b


def data_hello(node, session, stream):
    return (field_varint(1, PEER_VERSION) + field_bytes(2, node) + field_varint(3, session) +
            field_varint(4, stream))


# ---------------------------------------------------------------- proofs, by hand

def _s(name):
    name = name.encode()
    return bytes([len(name)]) + name


def hello_proof(key, role, nonce_d, nonce_a, acceptor, dialer):
    label = b"kvferry-auth-v1 " + role.encode() + b"\0"
    return hmac.new(key, label + nonce_d + nonce_a + _s(acceptor) + _s(dialer),
                    hashlib.sha256).digest()


def data_proof(key, nonce_r, receiver_session, stream, receiver, sender):
    return hmac.new(key, b"kvferry-auth-v1 data\0" + nonce_r +
                    struct.pack("<QI", receiver_session, stream) + _s(receiver) + _s(sender),
                    hashlib.sha256).digest()


# ---------------------------------------------------------------- a raw peer

class Raw:
    """One TCP connection to a daemon's peer port, framed as peer.c frames."""

    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=10)

    def send(self, body_field, body):
        msg = field_bytes(body_field, body)
        self.s.sendall(struct.pack("<I", len(msg)) + msg)

    def _exact(self, n):
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.s.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    def recv(self):
        """(body field, decoded body) of the next frame; None at EOF."""
        hdr = self._exact(4)
        if hdr is None:
            return None
        n = struct.unpack("<I", hdr)[0]
        msg = self._exact(n)
        if msg is None:
            return None
        top = decode(msg)
        (field, (body,)), = top.items()
        return field, decode(body)

    def closed_within(self, seconds):
        """True when the daemon closes the connection within seconds."""
        self.s.settimeout(seconds)
        try:
            return self.s.recv(1) == b""
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    def close(self):
        self.s.close()


# ---------------------------------------------------------------- helpers

def write_key(path, data, mode=0o600):
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


def keyed(path):
    return "cluster-key-file " + path


def fill(n, seed):
    return bytes((i * 131 + seed * 7 + (i >> 9)) & 0xFF for i in range(n))


def send_error(pre, dec, xfer_id):
    """The error a send from pre to dec ends with (raised or in its event)."""
    with pre.client() as c:
        kv = c.pool_find("kv")
        try:
            c.send(xfer_id, dec.name, [kv.desc(0, 4096)], deadline_ms=2000)
        except kvferry.KvferryError as e:
            return e.name
        try:
            kvftest.wait_event(c, xfer_id, timeout=10).raise_for_status()
        except kvferry.KvferryError as e:
            return e.name
        return "no error"


def count(log_text, needle):
    return log_text.count(needle)


class TestClusterKey(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = kvftest.tempdir()
        cls.key1 = write_key(os.path.join(cls.dir, "k1.key"), os.urandom(32))
        cls.key2 = write_key(os.path.join(cls.dir, "k2.key"), os.urandom(32))
        with open(cls.key1, "rb") as f:
            cls.key1_bytes = f.read()

    def daemons(self, key_pre, key_dec, metrics=False):
        d = kvftest.tempdir()
        pre = Daemon(d, "prefill", "16M", metrics, HANDSHAKE + "\n" + (keyed(key_pre) if key_pre else ""))
        dec = Daemon(d, "decode", "16M", metrics, HANDSHAKE + "\n" + (keyed(key_dec) if key_dec else ""))
        pre.add_peer(dec)
        dec.add_peer(pre)
        self.addCleanup(lambda: [x.kill() for x in (pre, dec)])
        pre.start()
        dec.start()
        return pre, dec

    def assert_alive(self, *daemons):
        for d in daemons:
            self.assertIsNone(d.proc.poll(), "%s died:\n%s" % (d.name, d.log_text()[-3000:]))
            self.assertTrue(d.api_answers(), d.name)

    def wait_redials_refused(self, *daemons, n=4):
        """Until each daemon has refused n handshakes: the first and
        several redials (reconnect-max-ms is 300), all of them refused."""
        for d in daemons:
            wait_for(lambda: d.status()["auth_failures"] >= n, 10,
                     "%s to refuse %d handshakes" % (d.name, n))

    def assert_never_up(self, *daemons):
        """Not up now, and never was (not even for a moment)."""
        for d in daemons:
            with d.client() as c:
                peers = c.inspect("peers", json=True)["peers"]
            self.assertTrue(peers, d.name)
            for p in peers:
                self.assertNotEqual(p["state"], "up", p)
                self.assertEqual(p["ups"], 0, p)
            self.assertNotIn(" up (", d.log_text())

    def stop(self, *daemons):
        for d in daemons:
            self.assertEqual(d.stop(), 0, d.log_text()[-3000:])

    # ------------------------------------------------------------ same key

    def test_same_key_moves_every_byte(self):
        pre, dec = self.daemons(self.key1, self.key1)
        pre.wait_peers_up()
        dec.wait_peers_up()
        for d in (pre, dec):
            st = d.status()
            self.assertEqual(st["auth"], "cluster-key")
            self.assertEqual(st["auth_failures"], 0)
            with d.client() as c:
                self.assertIn("auth            cluster-key", c.inspect("status"))
        n = 4 << 20
        with pre.client() as cp, dec.client() as cd:
            src, dst = cp.pool_find("kv"), cd.pool_find("kv")
            data = fill(n, 3)
            src.memory[0:n] = data
            dst.memory[0:n] = bytes(n)
            blocks = 64
            size = n // blocks
            # every other block, so that runs are not coalesced into one
            cd.grant("auth-x", "prefill", [dst.desc(i * size, size) for i in range(blocks)])
            order = [i for i in range(blocks) if i % 2] + [i for i in range(blocks) if not i % 2]
            cp.send("auth-x", "decode", [src.desc(i * size, size) for i in order])
            kvftest.wait_event(cd, "auth-x", timeout=20).raise_for_status()
            kvftest.wait_event(cp, "auth-x", timeout=20).raise_for_status()
            got = bytes(dst.memory[0:n])
            for k, i in enumerate(order):
                self.assertEqual(got[k * size:(k + 1) * size], data[i * size:(i + 1) * size],
                                 "block %d" % k)
        for d in (pre, dec):
            self.assertNotIn("refused peer", d.log_text())
            self.assertIn("peers authenticate with the cluster key", d.log_text())
        out = run([kvftest.KVFERRYCTL, "-s", dec.sock, "--json", "doctor"], timeout=30)
        checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
        self.assertEqual(checks["cluster-key"]["result"], "ok", checks["cluster-key"])
        self.stop(pre, dec)

    # ------------------------------------------------------------ refusals

    def test_different_keys_never_come_up(self):
        pre, dec = self.daemons(self.key1, self.key2, metrics=True)
        for d in (pre, dec):
            wait_for(lambda: "cluster key mismatch" in d.log_text(), 10,
                     "%s to log a key mismatch" % d.name)
        self.wait_redials_refused(pre, dec)
        self.assert_never_up(pre, dec)
        self.assertIn("refused peer decode at 127.0.0.1:", pre.log_text())
        self.assertIn("refused peer prefill at 127.0.0.1:", dec.log_text())
        # A send to a peer that is not up waits for it, here past its deadline.
        self.assertEqual(send_error(pre, dec, "auth-mismatch"), "KVF_EDEADLINE")
        self.assert_alive(pre, dec)
        for d in (pre, dec):
            self.assertGreaterEqual(d.status()["auth_failures"], 1)
            with urllib.request.urlopen(d.metrics_url(), timeout=5) as r:
                text = r.read().decode()
            line = [l for l in text.splitlines() if l.startswith('kvferry_errors_total{kind="auth"}')]
            self.assertEqual(len(line), 1, text)
            self.assertGreaterEqual(int(line[0].split()[-1]), 1)
        with dec.client() as c:
            peer = c.inspect("peers", json=True)["peers"][0]
        self.assertIn("cluster key", peer["last_error"])
        self.stop(pre, dec)

    def test_key_on_one_side_only(self):
        pre, dec = self.daemons(self.key1, None)
        wait_for(lambda: "has no cluster key and this daemon requires one" in pre.log_text(), 10,
                 "prefill to refuse a keyless peer")
        wait_for(lambda: "uses a cluster key and this daemon has none" in dec.log_text(), 10,
                 "decode to refuse a keyed peer")
        self.wait_redials_refused(pre, dec)
        self.assert_never_up(pre, dec)
        self.assertEqual(send_error(dec, pre, "auth-oneside"), "KVF_EDEADLINE")
        self.assertEqual(dec.status()["auth"], "off")
        self.assertIn("cluster-key-file is off: peers are not authenticated", dec.log_text())
        out = run([kvftest.KVFERRYCTL, "-s", dec.sock, "--json", "doctor"], timeout=30)
        checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
        self.assertEqual(checks["cluster-key"]["result"], "warn", checks["cluster-key"])
        self.assert_alive(pre, dec)
        self.stop(pre, dec)

    # ------------------------------------------------------------ key files

    def refused_start(self, key_path, want):
        d = Daemon(kvftest.tempdir(), "lonely", "4M", extra=keyed(key_path))
        d.start(wait=False)
        try:
            rc = d.proc.wait(10)
        except Exception:
            d.kill()
            raise
        self.assertNotEqual(rc, 0, d.log_text())
        log = d.log_text()
        self.assertIn(key_path, log)
        self.assertIn(want, log)
        self.assertNotIn("ready", log)
        check = run([kvftest.KVFERRYD, "-c", d.conf, "--check"], timeout=10)
        self.assertNotEqual(check.returncode, 0)
        self.assertIn(want, check.stderr)

    def test_bad_key_files_stop_the_start(self):
        self.refused_start(write_key(os.path.join(self.dir, "open.key"), os.urandom(32), 0o644),
                           "mode 0644")
        self.refused_start(write_key(os.path.join(self.dir, "ro.key"), os.urandom(32), 0o400),
                           "mode 0400")
        self.refused_start(write_key(os.path.join(self.dir, "short.key"), os.urandom(15)),
                           "15 bytes")
        self.refused_start(write_key(os.path.join(self.dir, "long.key"), os.urandom(4097)),
                           "more than 4096 bytes")
        self.refused_start(self.dir, "not a regular file")
        self.refused_start(os.path.join(self.dir, "missing.key"), "No such file")
        if os.geteuid() == 0:
            theirs = write_key(os.path.join(self.dir, "theirs.key"), os.urandom(32))
            os.chown(theirs, 65534, 65534)
            self.refused_start(theirs, "owned by uid 65534")
        good = Daemon(kvftest.tempdir(), "fine", "4M", extra=keyed(self.key1)).start()
        self.assertEqual(good.status()["auth"], "cluster-key")
        self.stop(good)

    # ------------------------------------------------------------ raw peers

    def test_raw_peer_without_a_good_proof_is_refused(self):
        pre, dec = self.daemons(self.key1, self.key1)
        dec.wait_peers_up()
        base = dec.status()["auth_failures"]

        # No nonce at all: a keyless peer. It hears why (a nonce, no pools).
        r = Raw(dec.port)
        r.send(MSG_HELLO, hello("prefill"))
        got = r.recv()
        self.assertIsNotNone(got)
        field, h = got
        self.assertEqual(field, MSG_HELLO)
        self.assertEqual(len(h[9][0]), 32)
        for leak in (3, 4, 6, 8, 10):  # pools, transports, session, rdma, proof
            self.assertNotIn(leak, h)
        self.assertTrue(r.closed_within(REFUSED_S))
        r.close()

        # A nonce, then a garbage proof.
        r = Raw(dec.port)
        r.send(MSG_HELLO, hello("prefill", nonce=os.urandom(32)))
        field, h = r.recv()
        self.assertEqual(field, MSG_HELLO)
        self.assertEqual((len(h[9][0]), len(h[10][0])), (32, 32))
        for leak in (3, 4, 6, 8):
            self.assertNotIn(leak, h)
        r.send(MSG_AUTH, auth(proof=os.urandom(32)))
        self.assertTrue(r.closed_within(REFUSED_S))
        r.close()

        # A nonce, then an empty Auth; then a Hello where the proof should be.
        for answer in ((MSG_AUTH, auth()), (MSG_HELLO, hello("prefill", full=True))):
            r = Raw(dec.port)
            r.send(MSG_HELLO, hello("prefill", nonce=os.urandom(32)))
            self.assertIsNotNone(r.recv())
            r.send(*answer)
            self.assertTrue(r.closed_within(REFUSED_S))
            r.close()

        # A nonce, then silence: the handshake timer (HANDSHAKE, 5 s) ends it.
        r = Raw(dec.port)
        r.send(MSG_HELLO, hello("prefill", nonce=os.urandom(32)))
        self.assertIsNotNone(r.recv())
        self.assertTrue(r.closed_within(10))
        r.close()

        wait_for(lambda: dec.status()["auth_failures"] >= base + 5, 5, "5 refusals counted")
        log = dec.log_text()
        self.assertIn("refused peer prefill at 127.0.0.1:", log)
        self.assertIn("it has no cluster key and this daemon requires one", log)
        self.assertIn("cluster key mismatch", log)
        self.assertIn("the peer did not authenticate (no Hello in time", log)
        # The real prefill never noticed.
        self.assertTrue(dec.peers_up())
        self.assert_alive(pre, dec)
        self.stop(pre, dec)

    def test_proofs_replayed_or_reflected_are_refused(self):
        pre, dec = self.daemons(self.key1, self.key1)
        dec.wait_peers_up()
        key = self.key1_bytes

        def handshake():
            r = Raw(dec.port)
            nonce_d = os.urandom(32)
            r.send(MSG_HELLO, hello("prefill", nonce=nonce_d))
            field, h = r.recv()
            self.assertEqual(field, MSG_HELLO)
            return r, nonce_d, h[9][0], h[10][0]

        # The daemon's proof checks out against an independent HMAC, and ours
        # is accepted: the connection waits for our full Hello.
        r, nd1, na1, pa1 = handshake()
        self.assertEqual(pa1, hello_proof(key, "acceptor", nd1, na1, "decode", "prefill"))
        pd1 = hello_proof(key, "dialer", nd1, na1, "decode", "prefill")
        r.send(MSG_AUTH, auth(proof=pd1))
        self.assertFalse(r.closed_within(1.5), "a correct proof was refused")
        r.close()
        mismatches = count(dec.log_text(), "cluster key mismatch")

        # The same proof on a new connection (new nonces): a replay.
        r, nd2, na2, pa2 = handshake()
        self.assertNotEqual(na2, na1)
        r.send(MSG_AUTH, auth(proof=pd1))
        self.assertTrue(r.closed_within(REFUSED_S), "a replayed proof was accepted")
        r.close()
        # The daemon's own proof sent back to it: a reflection.
        r, nd3, na3, pa3 = handshake()
        r.send(MSG_AUTH, auth(proof=pa3))
        self.assertTrue(r.closed_within(REFUSED_S), "a reflected proof was accepted")
        r.close()
        # The right proof under another key.
        r, nd4, na4, _ = handshake()
        r.send(MSG_AUTH, auth(proof=hello_proof(b"another key, same length!!", "dialer", nd4, na4,
                                                "decode", "prefill")))
        self.assertTrue(r.closed_within(REFUSED_S))
        r.close()
        wait_for(lambda: count(dec.log_text(), "cluster key mismatch") >= mismatches + 3, 5,
                 "three mismatches logged")

        # tcp data streams: challenged, and adopted only with a fresh proof.
        with pre.client() as c:
            session = int(c.inspect("peers", json=True)["peers"][0]["session"], 16)

        def data_stream():
            r = Raw(dec.port)
            r.send(MSG_DATA_HELLO, data_hello("prefill", session, 0))
            field, a = r.recv()
            self.assertEqual(field, MSG_AUTH)
            self.assertEqual(len(a[2][0]), 32)
            return r, a[2][0]

        r, n1 = data_stream()
        good1 = data_proof(key, n1, session, 0, "decode", "prefill")
        r.send(MSG_AUTH, auth(proof=os.urandom(32)))
        self.assertTrue(r.closed_within(REFUSED_S), "a data stream with a wrong proof stayed open")
        r.close()
        r, n2 = data_stream()
        r.send(MSG_AUTH, auth(proof=good1))  # the proof for another nonce
        self.assertTrue(r.closed_within(REFUSED_S), "a replayed data proof was accepted")
        r.close()
        r, n3 = data_stream()
        r.send(MSG_AUTH, auth(proof=data_proof(key, n3, session, 0, "decode", "prefill")))
        r.s.settimeout(5)
        self.assertEqual(r._exact(4), b"\0\0\0\0", "no ACK for a correct data proof")
        r.close()
        self.assertGreaterEqual(count(dec.log_text(), "cluster key mismatch on a data stream"), 2)
        self.assert_alive(pre, dec)
        self.stop(pre, dec)


if __name__ == "__main__":
    kvftest.main()
