#!/usr/bin/env python3
"""`make install` into a DESTDIR: the files and their places for PREFIX=/usr
and /usr/local, libkvferry's soname and exports, kvferry.pc, a small C
client built through pkg-config against the installed files (shared, and
static with Libs.private) and run against the installed daemon, the
installed Python package, the man pages, the systemd unit (systemd-analyze
verify), the sysusers file, and `make uninstall` keeping the operator's
configuration. Also: what `make all` and `make install` build (the product
only) and that they only check for packages; the same client built in the
tree (cc app.c -Iclient -Lbuild -lkvferry) and against build/libkvferry.a."""
import os
import re
import shutil
import subprocess
import sys
import unittest

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, run

HERE = os.path.dirname(os.path.abspath(__file__))


def make(*args):
    """`make ARGS` in the repository, as a user would run it (not as a
    sub-make of `make check`: no jobserver handed down)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    cmd = os.environ.get("KVF_OPS_MAKE", "make").split()
    build = os.path.relpath(kvftest.BUILD, kvftest.REPO)
    out = run(cmd + ["-s", "BUILD=" + build] + list(args), cwd=kvftest.REPO, env=env, timeout=300)
    if out.returncode != 0:
        raise AssertionError("make %s failed:\n%s%s" % (" ".join(args), out.stdout, out.stderr))
    return out


def san_flags():
    return ["-fsanitize=address,undefined"] if kvftest.sanitized() else []


def build_client(args, exe, cwd=None):
    """Compiles install_client.c into exe with args (where to find the
    header and the library); fails the test with the compiler's words."""
    out = run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror"] + san_flags() +
              [os.path.join(HERE, "install_client.c"), "-o", exe] + args, cwd=cwd)
    if out.returncode != 0:
        raise AssertionError("cc %s: %s" % (" ".join(args), out.stderr))
    return exe


def run_client(exe, sock, env=None):
    """exe moves a block through the daemon at sock and checks it."""
    out = run([exe, sock], env=env, timeout=30)
    if out.returncode != 0 or "install-client: ok" not in out.stdout:
        raise AssertionError("%s: status %d\n%s%s" % (exe, out.returncode, out.stdout, out.stderr))


def config_keys():
    """Every key, from the daemon's own table (kvferryd --help)."""
    text = run([kvftest.KVFERRYD, "--help"]).stdout
    text = text[text.index("Configuration keys ("):]
    return re.findall(r"^  ([a-z][a-z-]+) ", text, re.M)


class TestInstall(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = kvftest.tempdir()
        cls.root = os.path.join(cls.tmp, "stage")
        make("install", "PREFIX=/usr", "DESTDIR=" + cls.root)
        cls.version = run([kvftest.KVFERRYD, "--version"]).stdout.split()[-1]

    def p(self, path):
        return os.path.join(self.root, path.lstrip("/"))

    def test_files_in_place(self):
        for path, mode in (("/usr/sbin/kvferryd", 0o755), ("/usr/bin/kvferryctl", 0o755),
                           ("/usr/bin/kvferry-bench", 0o755), ("/usr/lib/libkvferry.so.1.0.0", 0o755),
                           ("/usr/lib/libkvferry.a", 0o644), ("/usr/include/kvferry.h", 0o644),
                           ("/usr/lib/pkgconfig/kvferry.pc", None),
                           ("/usr/share/man/man8/kvferryd.8", None),
                           ("/usr/share/man/man5/kvferryd.conf.5", None),
                           ("/usr/share/man/man1/kvferryctl.1", None),
                           ("/usr/share/man/man3/libkvferry.3", None),
                           ("/usr/lib/systemd/system/kvferryd.service", None),
                           ("/usr/lib/sysusers.d/kvferry.conf", None),
                           ("/etc/kvferry/kvferryd.conf", 0o644),
                           ("/usr/share/doc/kvferry/kvferryd.conf.example", None),
                           ("/usr/lib/python3/dist-packages/kvferry/__init__.py", None),
                           ("/usr/lib/python3/dist-packages/kvferry/client.py", None)):
            st = os.stat(self.p(path))
            if mode is not None:
                self.assertEqual(st.st_mode & 0o777, mode, path)
        self.assertEqual(os.readlink(self.p("/usr/lib/libkvferry.so.1")), "libkvferry.so.1.0.0")
        self.assertEqual(os.readlink(self.p("/usr/lib/libkvferry.so")), "libkvferry.so.1")

    def test_library_soname_and_exports(self):
        lib = self.p("/usr/lib/libkvferry.so.1.0.0")
        dyn = run(["readelf", "-d", lib]).stdout
        self.assertIn("Library soname: [libkvferry.so.1]", dyn)
        syms = run(["nm", "-D", "--defined-only", lib]).stdout.split("\n")
        names = [l.split()[-1].split("@")[0] for l in syms if l.strip() and l.split()[1] in "TDBR"]
        self.assertIn("kvf_connect", names)
        self.assertEqual([n for n in names if not n.startswith("kvf_")], [],
                         "exported beyond kvf_*")
        versions = run(["readelf", "--dyn-syms", "-W", lib]).stdout
        self.assertIn("kvf_connect@@KVFERRY_1", versions)

    def pkg_config(self, *args):
        env = dict(os.environ, PKG_CONFIG_PATH=self.p("/usr/lib/pkgconfig"),
                   PKG_CONFIG_SYSROOT_DIR=self.root, PKG_CONFIG_LIBDIR="")
        out = run(["pkg-config"] + list(args) + ["kvferry"], env=env)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout.split()

    def test_pkg_config_client_runs_against_installed_files(self):
        self.assertEqual(self.pkg_config("--modversion"), [self.version])
        cflags, libs = self.pkg_config("--cflags"), self.pkg_config("--libs")
        self.assertEqual(cflags, ["-I" + self.p("/usr/include")])
        self.assertEqual(libs, ["-L" + self.p("/usr/lib"), "-lkvferry"])
        self.assertIn("-lprotobuf-c", self.pkg_config("--static", "--libs"))
        exe = build_client(cflags + libs, os.path.join(self.tmp, "install_client"))
        # Static: the archive and Libs.private, all that pkg-config --static gives.
        static_libs = [self.p("/usr/lib/libkvferry.a") if a == "-lkvferry" else a
                       for a in self.pkg_config("--static", "--libs")]
        static_exe = build_client(cflags + static_libs, os.path.join(self.tmp, "static_client"))
        self.assertNotIn("libkvferry", run(["ldd", static_exe]).stdout)
        env = dict(os.environ, LD_LIBRARY_PATH=self.p("/usr/lib"))
        self.assertIn(self.p("/usr/lib/libkvferry.so.1"), run(["ldd", exe], env=env).stdout)
        d = Daemon(self.tmp, "installed", pool="4M")
        d.write_conf()
        d.proc = subprocess.Popen([self.p("/usr/sbin/kvferryd"), "-c", d.conf],
                                  stdout=open(d.log, "a"), stderr=subprocess.STDOUT)
        try:
            d.wait_ready()
            run_client(exe, d.sock, env)
            run_client(static_exe, d.sock)
            # The installed Python package finds the installed library by its soname.
            code = "import kvferry; c = kvferry.Client(%r); print(c.node, c.pools()[0].size)" % d.sock
            penv = kvftest.python_env(PYTHONPATH=self.p("/usr/lib/python3/dist-packages"),
                                      LD_LIBRARY_PATH=self.p("/usr/lib"))
            penv.pop("KVFERRY_LIB", None)
            out = run([sys.executable, "-c", code], env=penv, cwd=self.tmp)
            self.assertEqual(out.stdout.split(), ["installed", str(4 << 20)], out.stderr)
            ctl = run([self.p("/usr/bin/kvferryctl"), "-s", d.sock, "status"], env=env)
            self.assertEqual(ctl.returncode, 0, ctl.stderr)
        finally:
            self.assertEqual(d.stop(), 0)

    def test_unit_file(self):
        unit = open(self.p("/usr/lib/systemd/system/kvferryd.service")).read()
        self.assertIsNone(re.search(r"@[A-Z]+@", unit), "placeholder left")
        for line in ("Type=notify", "ExecStart=/usr/sbin/kvferryd -c /etc/kvferry/kvferryd.conf",
                     "ExecReload=/bin/kill -HUP $MAINPID", "LimitMEMLOCK=infinity",
                     "RuntimeDirectory=kvferry", "User=kvferry", "NoNewPrivileges=yes",
                     "ProtectSystem=strict"):
            self.assertIn("\n" + line + "\n", unit)
        families = re.search(r"\nRestrictAddressFamilies=(.*)\n", unit).group(1).split()
        self.assertIn("AF_NETLINK", families)
        # Nothing may close /dev/infiniband or /dev/nvidia*.
        for bad in ("PrivateDevices=yes", "DevicePolicy=", "DeviceAllow=", "ProtectClock=yes"):
            self.assertNotIn("\n" + bad, unit)
        if not shutil.which("systemd-analyze"):
            self.skipTest("systemd-analyze is not installed")
        # verify wants ExecStart to exist: point it at the staged binary.
        copy = os.path.join(self.tmp, "kvferryd.service")
        with open(copy, "w") as f:
            f.write(unit.replace("/usr/sbin/kvferryd", self.p("/usr/sbin/kvferryd")))
        env = dict(os.environ, MANPATH=self.p("/usr/share/man"))
        man = ["--man=yes"] if shutil.which("man") else ["--man=no"]
        out = run(["systemd-analyze", "verify"] + man + [copy], env=env)
        self.assertEqual((out.returncode, out.stdout + out.stderr), (0, ""))

    def test_sysusers(self):
        if not shutil.which("systemd-sysusers"):
            self.skipTest("systemd-sysusers is not installed")
        root = os.path.join(self.tmp, "sysroot")
        os.makedirs(os.path.join(root, "etc"))
        out = run(["systemd-sysusers", "--root=" + root, self.p("/usr/lib/sysusers.d/kvferry.conf")])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertRegex(open(os.path.join(root, "etc/passwd")).read(), r"(?m)^kvferry:x:\d+:\d+:")

    def test_man_pages(self):
        keys = config_keys()
        self.assertIn("metrics-listen", keys)
        self.assertIn("stop-timeout-ms", keys)
        for page in ("man8/kvferryd.8", "man5/kvferryd.conf.5", "man1/kvferryctl.1",
                     "man3/libkvferry.3"):
            path = self.p("/usr/share/man/" + page)
            text = open(path).read()
            self.assertIsNone(re.search(r"@[A-Z]+@", text), page)
            self.assertIn(self.version, text)
            out = run(["groff", "-man", "-ww", "-z", "-Tutf8", path])
            self.assertEqual((out.returncode, out.stderr), (0, ""), page)
        rendered = run(["groff", "-man", "-Tascii", "-P", "-cbou",
                        self.p("/usr/share/man/man5/kvferryd.conf.5")]).stdout
        self.assertIn("/etc/kvferry/kvferryd.conf", rendered)
        for key in keys:
            self.assertRegex(rendered, r"(?m)^ {7}%s( |$)" % re.escape(key), key)

    def test_configuration_kept_and_valid(self):
        conf = self.p("/etc/kvferry/kvferryd.conf")
        out = run([self.p("/usr/sbin/kvferryd"), "-c", conf, "--check"])
        self.assertEqual(out.returncode, 0, out.stderr)
        with open(conf, "a") as f:
            f.write("# the operator's edit\n")
        make("install", "PREFIX=/usr", "DESTDIR=" + self.root)
        self.assertIn("# the operator's edit", open(conf).read())

    def test_other_prefix_and_uninstall(self):
        root = os.path.join(self.tmp, "local")
        make("install", "PREFIX=/usr/local", "DESTDIR=" + root)
        p = lambda path: os.path.join(root, path.lstrip("/"))  # noqa: E731
        unit = open(p("/usr/local/lib/systemd/system/kvferryd.service")).read()
        self.assertIn("ExecStart=/usr/local/sbin/kvferryd -c /usr/local/etc/kvferry/kvferryd.conf",
                      unit)
        self.assertIn("prefix=/usr/local\n", open(p("/usr/local/lib/pkgconfig/kvferry.pc")).read())
        self.assertIn("/usr/local/etc/kvferry/kvferryd.conf",
                      open(p("/usr/local/share/man/man5/kvferryd.conf.5")).read())
        pydirs = os.listdir(p("/usr/local/lib"))
        self.assertTrue([d for d in pydirs if re.match(r"python3\.\d+$", d)], pydirs)
        make("uninstall", "PREFIX=/usr/local", "DESTDIR=" + root)
        left = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]
        self.assertEqual(left, ["usr/local/etc/kvferry/kvferryd.conf"])


class TestInTreeClient(unittest.TestCase):
    """The build dir as the README describes it: the library under its
    soname, a client built in the tree and run against it."""

    def test_client_built_in_tree(self):
        tmp = kvftest.tempdir()
        build = os.path.relpath(kvftest.BUILD, kvftest.REPO)
        self.assertEqual(os.path.realpath(os.path.join(kvftest.BUILD, "libkvferry.so.1")),
                         os.path.join(os.path.realpath(kvftest.BUILD), "libkvferry.so.1.0.0"))
        # As the README says, from the repository: cc app.c -Iclient -Lbuild -lkvferry
        exe = build_client(["-Iclient", "-L" + build, "-lkvferry"],
                           os.path.join(tmp, "intree_client"), cwd=kvftest.REPO)
        static_exe = build_client(["-Iclient", os.path.join(build, "libkvferry.a")] +
                                  self.libs_private(), os.path.join(tmp, "intree_static"),
                                  cwd=kvftest.REPO)
        needed = re.findall(r"\(NEEDED\).*\[(.*)\]", run(["readelf", "-d", exe]).stdout)
        self.assertIn("libkvferry.so.1", needed)
        env = dict(os.environ, LD_LIBRARY_PATH=kvftest.BUILD)
        self.assertIn(os.path.join(kvftest.BUILD, "libkvferry.so.1"), run(["ldd", exe], env=env).stdout)
        d = Daemon(tmp, "intree", pool="4M").start()
        try:
            run_client(exe, d.sock, env)
            run_client(static_exe, d.sock)
        finally:
            self.assertEqual(d.stop(), 0)

    @staticmethod
    def libs_private():
        with open(os.path.join(kvftest.REPO, "kvferry.pc.in")) as f:
            return re.search(r"(?m)^Libs\.private:(.*)$", f.read()).group(1).split()


class TestBuildTargets(unittest.TestCase):
    """`make all` and `make install` build the product only and install no
    package; `make check` builds the tests and installs what they need."""

    def planned(self, goal):
        """What `make -n GOAL` would do in an empty build dir: the files its
        compiles, links and archives write, and its package step."""
        build = os.path.join(kvftest.tempdir(), "build")
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        out = run(["make", "-n", "BUILD=" + build, goal], cwd=kvftest.REPO, env=env)
        self.assertEqual(out.returncode, 0, out.stderr)
        made = re.findall(r"(?:-o|ar rcs|ln -sf \S+) (%s/\S+)" % re.escape(build), out.stdout)
        made = {os.path.relpath(m, build) for m in made}
        made = {m for m in made if not m.endswith(".o") and not m.startswith("cuda/")}
        made |= {os.path.relpath(m, build) for m in
                 re.findall(r"> (%s/man/\S+)" % re.escape(build), out.stdout)}
        made |= {os.path.relpath(m, build) for m in
                 re.findall(r"gen-conf-man.py \S+ \S+ (%s/\S+)" % re.escape(build), out.stdout)}
        deps = re.findall(r"scripts/install-deps.sh\s+(.*)", out.stdout)
        return made, deps

    def test_all_and_install_build_only_the_product(self):
        product = {"kvferryd", "kvferryctl", "kvferry-bench", "libkvferry.so.1.0.0", "libkvferry.so.1",
                   "libkvferry.so", "libkvferry.a", "man/kvferryd.8", "man/kvferryd.conf.5",
                   "man/kvferryctl.1", "man/libkvferry.3"}
        for goal in ("all", "install"):
            made, deps = self.planned(goal)
            self.assertEqual(made, product, goal)
            # A check that names what is missing, never an install.
            self.assertEqual(deps, ["--check build"], goal)
        made, deps = self.planned("check")
        self.assertIn("tests/test_e2e", made)
        self.assertEqual(deps, ["build test"])

if __name__ == "__main__":
    kvftest.main()
