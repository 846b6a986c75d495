#!/usr/bin/env python3
"""scripts/demo.sh (`make demo`, `make demo-up`, `make demo-down`), each
test in a build dir of its own (links to the binaries), so that it never
meets a demo a developer left up: `run` refuses while the daemons of `up`
run (by the pids in the env file, or by a live daemon on a demo socket)
and leaves them serving; once they are down, `run` hands off a verified
KV cache."""
import json
import os
import unittest

import kvftest

DEMO = os.path.join(kvftest.REPO, "scripts", "demo.sh")
RUN_ARGS = ["--model", "llama3-8b", "--tokens", "64", "--json"]


class TestDemo(unittest.TestCase):
    def setUp(self):
        self.build = kvftest.tempdir()
        for exe in ("kvferryd", "kvferryctl", "kvferry-bench"):
            os.symlink(os.path.join(kvftest.BUILD, exe), os.path.join(self.build, exe))
        self.env = dict(os.environ, BUILD=self.build, POOL_SIZE="16M")
        self.env_file = os.path.join(self.build, "demo", "env")

    def demo(self, *args):
        return kvftest.run([DEMO] + list(args), env=self.env, timeout=120)

    def up(self):
        out = self.demo("up")
        self.addCleanup(self.down)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        with open(self.env_file) as f:
            return dict(line.strip().split("=", 1) for line in f if "=" in line)

    def down(self):
        out = self.demo("down")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)

    def starts(self):
        """How many times the demo started each daemon (its log says so)."""
        n = {}
        for side in ("prefill", "decode"):
            with open(os.path.join(self.build, "demo", side + ".log")) as f:
                n[side] = f.read().count("=== demo: starting")
        return n

    def assert_still_serving(self, vars, inodes, starts):
        """The pair `up` started: same processes, same sockets, both answer."""
        for side in ("PREFILL", "DECODE"):
            pid, sock = int(vars[side + "_PID"]), vars[side + "_SOCK"]
            os.kill(pid, 0)
            self.assertEqual(os.stat(sock).st_ino, inodes[side], side + "'s socket replaced")
            out = kvftest.run([kvftest.KVFERRYCTL, "-s", sock, "--json", "status"])
            self.assertEqual(out.returncode, 0, side + ": " + out.stderr)
        self.assertEqual(self.starts(), starts, "a daemon was started again")

    def check_refused(self, vars, want):
        inodes = {side: os.stat(vars[side + "_SOCK"]).st_ino for side in ("PREFILL", "DECODE")}
        starts = self.starts()
        out = self.demo("run", *RUN_ARGS)
        self.assertNotEqual(out.returncode, 0, out.stdout)
        self.assertIn(want, out.stderr)
        self.assert_still_serving(vars, inodes, starts)
        return out

    def test_run_refused_while_up(self):
        vars = self.up()
        out = self.check_refused(vars, "make demo-down")
        self.assertIn("prefill pid %s" % vars["PREFILL_PID"], out.stderr)

    def test_run_refused_by_a_live_socket(self):
        """Without the env file (lost, or another demo's), the daemon that
        answers on a demo socket is what refuses the start."""
        vars = self.up()
        saved = self.env_file + ".saved"
        os.rename(self.env_file, saved)
        try:
            self.check_refused(vars, "already answers on " + vars["PREFILL_SOCK"])
        finally:
            os.rename(saved, self.env_file)

    def test_run_after_down(self):
        """The refusals above are the running pair's doing: with it down
        (a stale env file left behind), run hands off and verifies."""
        vars = self.up()
        self.down()
        with open(self.env_file, "w") as f:
            f.write("PREFILL_PID=%s\nDECODE_PID=%s\n" % (vars["PREFILL_PID"], vars["DECODE_PID"]))
        out = self.demo("run", *RUN_ARGS)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual((result["verified"], result["path"]), (True, "tcp"), result)
        os.unlink(self.env_file)


if __name__ == "__main__":
    kvftest.main()
