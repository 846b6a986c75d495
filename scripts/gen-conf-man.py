#!/usr/bin/env python3
"""gen-conf-man.py KVFERRYD TEMPLATE OUTPUT - writes kvferryd.conf(5).

The KEYS section is generated from `KVFERRYD --help`, which the daemon
prints from the same table that parses the configuration, so the man page
cannot list a key the parser does not know or miss one it does. The
template's @KEYS@ line is replaced by one .TP entry per key; @VERSION@ by
the daemon's version. Paths (@SYSCONFDIR@ ...) are left for `make install`.
"""
import re
import subprocess
import sys

HEAD = re.compile(r"^  (\S+)(.*?)\s+\[(.*)\]$")


def roff(text):
    """Escapes text for a roff body line."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


def parse_help(text):
    """Yields [key, argument, default note, help lines] from kvferryd --help:
    after the "Configuration keys (" header, a key line is indented by 2,
    its help lines by 6."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("Configuration keys ("))
    key = None
    for line in lines[start + 1:]:
        m = HEAD.match(line)
        if m:
            if key:
                yield key
            key = [m.group(1), m.group(2).strip(), m.group(3), []]
        elif key and line.startswith("      "):
            key[3].append(line.strip())
        elif key and line.strip():
            break  # the end of the key list
    if key:
        yield key


def entry(name, arg, note, help_lines):
    reload = "; SIGHUP reloads" in note
    note = note.replace("; SIGHUP reloads", "")
    out = [".TP", "\\fB%s\\fR %s" % (roff(name), "\\fI%s\\fR" % roff(arg) if arg else "")]
    out.append(roff(" ".join(help_lines)))
    out.append(".br")
    out.append(roff("%s%s." % (note[0].upper() + note[1:],
                               "; applied at run time by SIGHUP" if reload
                               else "; a change needs a restart")))
    return "\n".join(out)


def main():
    kvferryd, template, output = sys.argv[1:4]
    help_text = subprocess.run([kvferryd, "--help"], check=True, capture_output=True,
                               text=True).stdout
    version = subprocess.run([kvferryd, "--version"], check=True, capture_output=True,
                             text=True).stdout.split()[-1]
    keys = list(parse_help(help_text))
    if len(keys) < 10:
        sys.exit("gen-conf-man: found only %d keys in %s --help" % (len(keys), kvferryd))
    body = "\n".join(entry(*k) for k in keys)
    with open(template) as f:
        page = f.read()
    if "@KEYS@" not in page:
        sys.exit("gen-conf-man: no @KEYS@ line in " + template)
    page = page.replace("@KEYS@", body).replace("@VERSION@", version)
    with open(output, "w") as f:
        f.write(page)


if __name__ == "__main__":
    main()
