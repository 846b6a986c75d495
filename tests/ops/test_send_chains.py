#!/usr/bin/env python3
"""The daemon's side of chained sends (SendReq.chained), spoken raw on the
API socket: a call's frames get one response, the last frame's, for the
whole call; a frame that changes the transfer id fails the call with
KVF_EPROTO and withdraws, without an event, the send the call began. The
library's side (splitting, refusals in later frames) is tested through
libkvferry in tests/integration/test_errors.c."""
import struct

import kvftest

KVF_EPROTO = -4009
KVF_ECANCELED = -4013


from kvftest import field_bytes as ld, field_varint, pb_decode as fields


from kvftest import Raw, request


def hello(seq):
    return kvftest.hello_frame(seq, "test_send_chains")


def send(seq, xfer_id, node, pool, off, length, chained):
    """A frame as libkvferry writes it: every frame but the call's last is
    chained and says more parts follow."""
    descs = ld(4, struct.pack("<IQQ", pool, off, length))
    body = ld(1, xfer_id) + ld(2, node) + ld(3, descs) + field_varint(5, 20000)
    if chained:
        body += field_varint(4, 1) + field_varint(6, 1)
    return request(seq, 14, body)


def cancel(seq, xfer_id):
    return request(seq, 15, ld(1, xfer_id))


class SendChains(kvftest.SoloTestCase):
    def setUp(self):
        self.c = Raw(self.d.sock)
        self.c.write(hello(1))
        kind, seq, status, r = self.c.next()
        self.assertEqual((kind, seq, status), ("response", 1, 0))
        self.assertEqual(fields(r[10][0]).get(5), [1], "HelloResp.send_chains")

    def tearDown(self):
        self.c.close()
        kvftest.wait_for(lambda: self.d.status()["sends_active"] == 0, 5, "no send left")

    def test_one_response_for_the_call(self):
        for seq, chained in ((2, True), (3, True), (4, False)):
            self.c.write(send(seq, b"whole", b"solo", 0, (seq - 2) * 4096, 4096, chained))
        self.assertEqual(self.c.next()[:3], ("response", 4, 0), "only the last frame is answered")
        self.assertIsNone(self.c.next(0.3), "nothing more")
        self.assertEqual(self.d.status()["sends_active"], 1, "one send of three frames")
        self.c.write(cancel(5, b"whole"))
        got = [self.c.next(), self.c.next()]
        self.assertIn(("response", 5, 0), [g[:3] for g in got])
        self.assertIn(("event", b"whole", KVF_ECANCELED), [g[:3] for g in got])

    def test_changed_id_fails_the_call(self):
        self.c.write(send(2, b"first", b"solo", 0, 0, 4096, True))
        self.c.write(send(3, b"other", b"solo", 0, 4096, 4096, False))
        kind, seq, status, r = self.c.next()
        self.assertEqual((kind, seq, status), ("response", 3, KVF_EPROTO))
        self.assertIn(b"changed its transfer id", r[3][0])
        self.assertIsNone(self.c.next(0.3), "the withdrawn send has no event")
        self.assertEqual(self.d.status()["sends_active"], 0)

    def test_frames_after_a_refusal_are_ignored(self):
        self.c.write(send(2, b"refused", b"solo", 0, 0, 4096, True))
        self.c.write(send(3, b"refused", b"solo", 7, 0, 4096, True))     # no pool 7
        self.c.write(send(4, b"refused", b"solo", 0, 8192, 4096, False))
        kind, seq, status, r = self.c.next()
        self.assertEqual((kind, seq), ("response", 4))
        self.assertNotEqual(status, 0)
        self.assertIn(b"no such pool", r[3][0])
        self.assertIsNone(self.c.next(0.3))
        self.assertEqual(self.d.status()["sends_active"], 0, "the call's send is withdrawn")


if __name__ == "__main__":
    kvftest.main()
