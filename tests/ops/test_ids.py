#!/usr/bin/env python3
"""Transfer ids (issue 15, item 6): bytes that are not well-formed UTF-8
are refused with KVF_EINVAL, by the daemon (raw frames, as a client
without libkvferry could send them) and by the library, so that every
rendering of an id (kvferryctl transfers --json, the binding's inspect)
stays valid JSON; UTF-8 ids beyond ASCII are accepted and shown as they
are."""
import json

import kvftest  # puts the binding from the source tree on sys.path
import kvferry  # noqa: E402
from kvftest import Raw, run
from test_engine_wire import grant

KVF_EINVAL = -4016
BAD = [b"\xff\xfe-bad", b"\xc0\x80", b"id-\xed\xa0\x80", b"\xf4\x90\x80\x80", b"cut-\xe2\x82"]


class TransferIds(kvftest.SoloTestCase):
    def test_daemon_refuses_what_is_not_utf8(self):
        c = Raw(self.d.sock)
        try:
            c.write(kvftest.hello_frame(1, "test_ids"))
            self.assertEqual(c.next()[:3], ("response", 1, 0))
            for seq, bad in enumerate(BAD, start=2):
                c.write(grant(seq, bad, (0, 0, 4096)))
                kind, got, status, _ = c.next()
                self.assertEqual((kind, got, status), ("response", seq, KVF_EINVAL), bad)
            self.assertEqual(self.d.status()["grants_active"], 0)
        finally:
            c.close()

    def test_library_refuses_what_is_not_utf8(self):
        with self.d.client() as c:
            pool = c.pool_find("kv")
            for bad in BAD:
                with self.assertRaises(kvferry.KvferryError) as cm:
                    c.grant(bad, None, [pool.desc(0, 4096)])
                self.assertEqual(cm.exception.code, KVF_EINVAL, bad)

    def test_utf8_ids_are_shown_as_they_are(self):
        xid = "caf\u00e9-\u2615-\U0001F600"
        with self.d.client() as c:
            pool = c.pool_find("kv")
            c.grant(xid, None, [pool.desc(0, 4096)])
            ids = [t["id"] for t in c.inspect("transfers", json=True)["transfers"]]
            self.assertIn(xid, ids)
            out = run([kvftest.KVFERRYCTL, "-s", self.d.sock, "transfers", "--json"], timeout=30)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn(xid, [t["id"] for t in json.loads(out.stdout)["transfers"]])
            c.cancel(xid)
            kvftest.wait_event(c, xid)


if __name__ == "__main__":
    kvftest.main()
