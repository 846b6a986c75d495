"""kvfetcd - a real etcd (Debian's etcd-server) for the registry tests
(tests/ops/test_registry.py, tests/scale/): one member on loopback, its
data in a temp dir, killed with SIGKILL and restarted on the same ports
(with its data, or without: a fresh cluster)."""
import json
import os
import shutil
import subprocess
import urllib.request

import kvftest

ETCD = shutil.which("etcd")
SKIP_WHY = "etcd is not installed (Debian package etcd-server; scripts/install-deps.sh test)"


class Etcd:
    def __init__(self, dir, host="127.0.0.1"):
        self.dir, self.host = dir, host
        self.data = os.path.join(dir, "etcd.data")
        self.log = os.path.join(dir, "etcd.log")
        self.client_port, self.peer_port = kvftest.free_ports(2)
        self.proc = None

    @property
    def endpoint(self):
        return "%s:%d" % (self.host, self.client_port)

    def url(self, prefix):
        return "etcd://%s/%s" % (self.endpoint, prefix)

    def start(self, wipe=False):
        if wipe:
            shutil.rmtree(self.data, ignore_errors=True)
        c = "http://%s:%d" % (self.host, self.client_port)
        p = "http://%s:%d" % (self.host, self.peer_port)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [ETCD, "--name", "kvftest", "--data-dir", self.data, "--listen-client-urls", c,
                 "--advertise-client-urls", c, "--listen-peer-urls", p,
                 "--initial-advertise-peer-urls", p, "--initial-cluster", "kvftest=" + p,
                 "--log-level", "warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        kvftest.wait_for(self.answers, 20, "etcd on %s" % self.endpoint)
        return self

    def answers(self):
        if self.proc.poll() is not None:
            raise AssertionError("etcd exited with %s" % self.proc.returncode)
        try:
            self.call("/v3/kv/range", {"key": "eA=="})
            return True
        except OSError:
            return False

    def call(self, path, body):
        req = urllib.request.Request("http://%s%s" % (self.endpoint, path), json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=2) as r:
            return json.loads(r.read())

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        kvftest.stop_proc(self.proc, 10)
