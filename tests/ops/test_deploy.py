#!/usr/bin/env python3
"""deploy/kubernetes (issue 18): the DaemonSet and its ConfigMap pass
yamllint, carry what the issue asks (host network, IPC_LOCK, huge pages,
RDMA and NVIDIA device resources, the registry line, the API socket on a
hostPath, a doctor readiness probe), and the command line and config they
carry start a real kvferryd whose readiness and liveness probes pass.

What is rewritten for this machine, and only that: paths (the ConfigMap's
mount, /run/kvferry, the binaries, the cluster key) into a temp dir, the
fixed ports to free ones, the etcd endpoints to a local etcd, and the
hardware this machine lacks (the cuda pool dropped, huge pages and rdma
off). Skips loudly without yamllint, PyYAML or etcd."""
import os
import re
import shutil
import subprocess
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
import kvfetcd
from kvftest import wait_for

try:
    import yaml
except ImportError:  # Debian: python3-yaml (a dependency of yamllint)
    yaml = None

DEPLOY = os.path.join(kvftest.REPO, "deploy", "kubernetes")
YAMLLINT = shutil.which("yamllint")
LINT_CONF = "{extends: default, rules: {line-length: {max: 110}, document-start: disable}}"


def load(name):
    with open(os.path.join(DEPLOY, name)) as f:
        return yaml.safe_load(f)


@unittest.skipUnless(YAMLLINT, "yamllint is not installed (Debian package yamllint)")
class TestLint(unittest.TestCase):
    def test_yamllint(self):
        files = sorted(os.path.join(DEPLOY, f) for f in os.listdir(DEPLOY) if f.endswith(".yaml"))
        self.assertGreaterEqual(len(files), 2)
        out = subprocess.run([YAMLLINT, "-f", "parsable", "-d", LINT_CONF] + files, capture_output=True,
                             text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)


@unittest.skipUnless(yaml, "PyYAML is not installed (Debian package python3-yaml)")
class TestManifest(unittest.TestCase):
    def setUp(self):
        self.ds, self.cm = load("daemonset.yaml"), load("configmap.yaml")
        self.pod = self.ds["spec"]["template"]["spec"]
        self.c = self.pod["containers"][0]
        self.conf = self.cm["data"]["kvferryd.conf"]

    def test_what_the_daemonset_asks_for(self):
        self.assertEqual(self.ds["kind"], "DaemonSet")
        self.assertTrue(self.pod["hostNetwork"])
        self.assertIn("IPC_LOCK", self.c["securityContext"]["capabilities"]["add"])
        limits = self.c["resources"]["limits"]
        self.assertIn("hugepages-2Mi", limits)
        self.assertTrue(any(k.startswith("rdma/") for k in limits), limits)
        self.assertIn("nvidia.com/gpu", limits)
        probe = self.c["readinessProbe"]["exec"]["command"]
        self.assertIn("doctor", probe)
        # The ConfigMap it mounts is this one, and carries the registry.
        vols = {v["name"]: v for v in self.pod["volumes"]}
        self.assertEqual(vols["config"]["configMap"]["name"], self.cm["metadata"]["name"])
        self.assertRegex(self.conf, r"(?m)^registry etcd://\S+/\S+$")
        # The API socket's directory is a hostPath that the container mounts.
        sock = re.search(r"(?m)^api-socket (\S+)$", self.conf).group(1)
        run = next(m for m in self.c["volumeMounts"] if m["name"] == "run")
        self.assertEqual(os.path.dirname(sock), run["mountPath"])
        self.assertEqual(vols["run"]["hostPath"]["path"], run["mountPath"])
        self.assertEqual(self.ds["metadata"]["namespace"], self.cm["metadata"]["namespace"])


@unittest.skipUnless(yaml, "PyYAML is not installed (Debian package python3-yaml)")
@unittest.skipUnless(kvfetcd.ETCD, kvfetcd.SKIP_WHY)
class TestStartsADaemon(unittest.TestCase):
    def setUp(self):
        self.dir = kvftest.tempdir()
        self.etcd = kvfetcd.Etcd(self.dir)
        self.addCleanup(self.etcd.kill)  # also when start() fails
        self.etcd.start()
        self.proc = None

    def tearDown(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.etcd.kill()

    def rewrite(self, text, mounts):
        for old, new in mounts.items():
            text = text.replace(old, new)
        return text

    def test_command_and_config_start_kvferryd(self):
        ds, cm = load("daemonset.yaml"), load("configmap.yaml")
        c = ds["spec"]["template"]["spec"]["containers"][0]
        conf_mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
        key_mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "key" or
                         m["name"] == "cluster-key")
        run_mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "run")
        d = lambda *p: os.path.join(self.dir, *p)  # noqa: E731
        for sub in ("conf", "key", "run"):
            os.mkdir(d(sub))
        peer_port, metrics_port = kvftest.free_ports(2)
        mounts = {conf_mount: d("conf"), key_mount: d("key"), run_mount: d("run"),
                  "/usr/sbin/kvferryd": kvftest.KVFERRYD, "/usr/bin/kvferryctl": kvftest.KVFERRYCTL}
        conf = self.rewrite(cm["data"]["kvferryd.conf"], mounts)
        conf = re.sub(r"(?m)^registry etcd://\S+/", "registry etcd://%s/" % self.etcd.endpoint, conf)
        conf = conf.replace(":7470", ":%d" % peer_port).replace(":9470", ":%d" % metrics_port)
        # This machine has no GPU, no reserved huge pages, no RDMA device.
        conf = re.sub(r"(?m)^pool \S+ cuda:\d+ .*\n", "", conf)
        conf = re.sub(r"(?m)^hugepages on$", "hugepages off", conf)
        conf = re.sub(r"(?m)^transports .*$", "transports tcp", conf)
        conf = re.sub(r"(?m)^pool kv host \S+$", "pool kv host 16M", conf)
        with open(d("conf", "kvferryd.conf"), "w") as f:
            f.write(conf)
        fd = os.open(d("key", "cluster.key"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, os.urandom(32))
        os.close(fd)
        argv = [self.rewrite(a, mounts) for a in c["command"]]
        env = dict(os.environ, NODE_NAME="gpu-node-7", HOST_IP="127.0.0.1")
        with open(d("kvferryd.log"), "w") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        probe = [self.rewrite(a, mounts) for a in c["readinessProbe"]["exec"]["command"]]

        def ready():
            if self.proc.poll() is not None:
                with open(d("kvferryd.log")) as f:
                    raise AssertionError("kvferryd exited with %s:\n%s" % (self.proc.returncode, f.read()))
            return subprocess.run(probe, capture_output=True, text=True, timeout=30).returncode == 0
        wait_for(ready, 20, "the DaemonSet's readiness probe to pass", step=0.2)
        live = [self.rewrite(a, mounts) for a in c["livenessProbe"]["exec"]["command"]]
        self.assertEqual(subprocess.run(live, capture_output=True, timeout=30).returncode, 0)
        import kvferry
        with kvferry.Client(d("run", "kvferryd.sock")) as cl:
            st = cl.inspect("status", json=True)
        self.assertEqual(st["node"], "gpu-node-7")
        self.assertEqual(st["peer_port"], peer_port)
        self.assertEqual(st["registry"]["state"], "registered")
        self.assertEqual(st["auth"], "cluster-key")
        # The readiness probe fails while etcd is away (and liveness holds).
        self.etcd.kill()
        wait_for(lambda: subprocess.run(probe, capture_output=True, timeout=30).returncode == 4, 20,
                 "the readiness probe to fail without etcd", step=0.2)
        self.assertEqual(subprocess.run(live, capture_output=True, timeout=30).returncode, 0)


if __name__ == "__main__":
    kvftest.main()
