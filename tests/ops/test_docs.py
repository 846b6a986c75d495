#!/usr/bin/env python3
"""The documentation matches the code: every configuration key (from the
daemon's own table, via kvferryd --help) is in kvferryd.conf(5) and in
config/kvferryd.conf, with the right SIGHUP note; every metric family the
daemon serves is in kvferryd(8); every kvferryctl command and doctor check
is in kvferryctl(1); the README's operations section exists."""
import json
import os
import re
import unittest
import urllib.request

import kvftest  # first: puts the binding from the source tree on sys.path
from kvftest import Daemon, run


def help_keys():
    """[(key, reloadable)] from kvferryd --help."""
    text = run([kvftest.KVFERRYD, "--help"]).stdout
    text = text[text.index("Configuration keys ("):]
    return [(m.group(1), "SIGHUP reloads" in m.group(2))
            for m in re.finditer(r"^  ([a-z][a-z-]+) .*?(\[.*\])$", text, re.M)]


def man(page):
    with open(os.path.join(kvftest.BUILD, "man", page)) as f:
        return f.read()


def plain(page):
    """The page's source with roff's escapes for hyphens and quotes undone
    (rendered text would hyphenate long names)."""
    return man(page).replace("\\-", "-").replace("\\(dq", '"')


def tag(name):
    """A .TP entry's tag line for name, as the pages write it."""
    return re.compile(r"(?m)^\.TP\n\.BR? %s( |$)" % re.escape(name.replace("-", "\\-")))


class TestDocs(unittest.TestCase):
    def test_every_key_in_conf_man_page(self):
        keys = help_keys()
        self.assertGreaterEqual(len(keys), 24)
        page = man("kvferryd.conf.5")
        entries = re.split(r"\n\.TP\n", page.split(".SH KEYS", 1)[1].split(".SH RELOADING")[0])[1:]
        self.assertEqual(len(entries), len(keys))
        for (key, reload), entry in zip(keys, entries):
            self.assertTrue(entry.startswith("\\fB%s\\fR" % key.replace("-", "\\-")), entry)
            note = "applied at run time by SIGHUP" if reload else "a change needs a restart"
            self.assertIn(note, entry, key)

    def test_every_key_in_example_config(self):
        with open(os.path.join(kvftest.REPO, "config", "kvferryd.conf")) as f:
            text = f.read()
        for key, _ in help_keys():
            self.assertRegex(text, r"(?m)^# %s " % re.escape(key), key)

    def test_every_metric_family_in_kvferryd_8(self):
        d = Daemon(kvftest.tempdir(), "docs", pool="4M", metrics=True).start()
        try:
            with urllib.request.urlopen(d.metrics_url(), timeout=5) as r:
                families = re.findall(r"^# TYPE (\S+) ", r.read().decode(), re.M)
        finally:
            self.assertEqual(d.stop(), 0)
        text = plain("kvferryd.8")
        self.assertGreaterEqual(len(families), 15)
        for fam in families:
            self.assertIn(fam, text)

    def test_every_ctl_command_and_check_in_kvferryctl_1(self):
        text = man("kvferryctl.1")
        helptext = run([kvftest.KVFERRYCTL, "--help"]).stdout
        commands = re.findall(r"^  ([a-z]+) ", helptext.split("Commands:")[1], re.M)
        self.assertIn("doctor", commands)
        for cmd in commands:
            self.assertRegex(text, tag(cmd))
        doc = json.loads(run([kvftest.KVFERRYCTL, "-s", "/nonexistent.sock", "--json",
                              "doctor"]).stdout)
        for check in doc["checks"]:
            self.assertRegex(text, tag(check["name"]))
        for status in ("0", "1", "2", "3", "4"):
            self.assertRegex(text, tag(status))

    def test_readme_operations_section(self):
        with open(os.path.join(kvftest.REPO, "README.md")) as f:
            text = f.read()
        section = text.split("## Operating kvferry", 1)
        self.assertEqual(len(section), 2, "README.md has no '## Operating kvferry' section")
        for word in ("make install", "systemctl", "kvferryctl doctor", "metrics-listen",
                     "SIGHUP", "PREFIX", "DESTDIR"):
            self.assertIn(word, section[1])


if __name__ == "__main__":
    kvftest.main()
