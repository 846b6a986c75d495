#!/usr/bin/env python3
"""gen-errors.py [--check] - writes kvferry's error list where C cannot reach.

The one list of kvferry's own error codes is KVF_ERR_MAP in client/kvferry.h
(the C enum and kvf_strerror's table expand it). This script writes the two
copies that are not C, each between its marker lines:
  client/python/kvferry/_native.py   the ERRORS dict (name -> code)
  docs/libkvferry.3                  the codes in RETURN VALUE (.TP entries)
With --check it writes nothing and exits 1, naming the stale files, when
either differs from what it would write (tests/ops/test_errors.py runs it).
"""
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(REPO, "client", "kvferry.h")
PYTHON = os.path.join(REPO, "client", "python", "kvferry", "_native.py")
MAN = os.path.join(REPO, "docs", "libkvferry.3")

ENTRY = re.compile(r'^\s*XX\((\w+),\s*(-?\d+),\s*"((?:[^"\\]|\\.)*)"\)\s*\\?$')
BEGIN, END = "KVF_ERR_MAP: written by scripts/gen-errors.py", "end of KVF_ERR_MAP"


def parse(header=HEADER):
    """[(name, code, message)] of KVF_ERR_MAP, in its order; names with
    their KVF_ prefix."""
    with open(header) as f:
        lines = f.read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("#define KVF_ERR_MAP(XX)"))
    errors = []
    for line in lines[start + 1:]:
        m = ENTRY.match(line)
        if not m:
            raise SystemExit("%s: not an XX(name, code, \"message\") entry: %r" % (header, line))
        name, code, msg = m.groups()
        errors.append(("KVF_" + name, int(code), re.sub(r"\\(.)", r"\1", msg)))
        if not line.rstrip().endswith("\\"):
            return errors
    raise SystemExit("%s: KVF_ERR_MAP does not end" % header)


def roff(text):
    """Escapes text for a roff body line."""
    text = text.replace("\\", "\\e")
    return "\\&" + text if text[:1] in (".", "'") else text


def python_block(errors):
    lines = ["# %s from client/kvferry.h" % BEGIN, "ERRORS = {"]
    lines += ['    "%s": %d,' % (name, code) for name, code, _ in errors]
    return lines + ["}", "# " + END]


def man_block(errors):
    lines = ['.\\" %s from client/kvferry.h' % BEGIN]
    for name, _, msg in errors:
        lines += [".TP", ".B " + name, roff(msg)]
    return lines + ['.\\" ' + END]


def splice(path, block):
    """The file's text with the lines from the BEGIN marker to the END
    marker (both included) replaced by block."""
    with open(path) as f:
        lines = f.read().split("\n")
    try:
        a = next(i for i, l in enumerate(lines) if BEGIN in l)
        b = next(i for i in range(a, len(lines)) if END in lines[i])
    except StopIteration:
        raise SystemExit("%s: no %r ... %r marker lines" % (path, BEGIN, END))
    return "\n".join(lines[:a] + block + lines[b + 1:])


def main(argv):
    check = argv[1:] == ["--check"]
    if argv[1:] not in ([], ["--check"]):
        raise SystemExit("usage: gen-errors.py [--check]")
    errors = parse()
    stale = []
    for path, block in ((PYTHON, python_block(errors)), (MAN, man_block(errors))):
        text = splice(path, block)
        with open(path) as f:
            if f.read() == text:
                continue
        stale.append(os.path.relpath(path, REPO))
        if not check:
            with open(path, "w") as f:
                f.write(text)
    if stale:
        print("%s: %s" % ("stale (run scripts/gen-errors.py)" if check else "written",
                          ", ".join(stale)), file=sys.stderr)
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
