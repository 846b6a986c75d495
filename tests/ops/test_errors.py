#!/usr/bin/env python3
"""kvferry's error codes agree everywhere: KVF_ERR_MAP in client/kvferry.h
(the one list), the library's kvf_err_name and kvf_strerror (built from it),
the Python binding's names, and libkvferry(3)'s RETURN VALUE section, as
built (scripts/gen-errors.py writes the last two; --check must find them
current)."""
import importlib.util
import os
import re
import subprocess
import sys
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
import kvferry

GEN = os.path.join(kvftest.REPO, "scripts", "gen-errors.py")


def load_gen():
    spec = importlib.util.spec_from_file_location("gen_errors", GEN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class TestErrors(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.errors = load_gen().parse()

    def test_header_list(self):
        names = [n for n, _, _ in self.errors]
        codes = [c for _, c, _ in self.errors]
        self.assertGreaterEqual(len(names), 16)
        self.assertEqual(len(set(names)), len(names), "a name twice")
        self.assertEqual(len(set(codes)), len(codes), "a code twice")
        self.assertTrue(all(c <= -4001 for c in codes), "own codes stay clear of errno")
        for _, _, msg in self.errors:
            self.assertTrue(msg and msg == msg.strip(), msg)

    def test_library_names_and_messages(self):
        for name, code, msg in self.errors:
            self.assertEqual(kvferry.err_name(code), name)
            self.assertEqual(kvferry.strerror(code), msg)
        # and the library knows no KVF_ code the header does not list
        known = {c for _, c, _ in self.errors}
        lib = {c for c in range(-4000, -4200, -1) if kvferry.err_name(c).startswith("KVF_")}
        self.assertEqual(lib, known)

    def test_python_names(self):
        self.assertEqual(kvferry.ERRORS, {n: c for n, c, _ in self.errors})
        for name, code, _ in self.errors:
            self.assertEqual(getattr(kvferry, name), code)

    def test_man_page(self):
        with open(os.path.join(kvftest.BUILD, "man", "libkvferry.3")) as f:
            page = f.read()
        section = page.split(".SH RETURN VALUE", 1)[1].split("\n.SH ", 1)[0]
        entries = re.findall(r"(?m)^\.TP\n\.B (KVF_\w+)\n(.*)$", section)
        self.assertEqual(entries, [(n, m) for n, _, m in self.errors])

    def test_generated_files_current(self):
        out = subprocess.run([sys.executable, GEN, "--check"], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)


if __name__ == "__main__":
    kvftest.main()
