"""The documentation against the repository and the binaries.

* Every link in README.md, docs/, docs/notes/ and deploy/README.md points at
  a file of the repository (relative to the linking file's folder), and a
  link with an anchor at a heading of that file; no link leaves the
  repository.
* docs/configuration.md's flag tables are what `coalesce-server --help` and
  `coalesce-cli --help` print: the same flags, the same defaults.

Environment: COALESCE_SERVER, COALESCE_CLI (the binaries; default build/bin/).
"""

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(REPO, "build", "bin")
SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(BIN, "coalesce-server")
CLI = os.environ.get("COALESCE_CLI") or os.path.join(BIN, "coalesce-cli")
CONFIGURATION = os.path.join(REPO, "docs", "configuration.md")


def documents():
    found = [os.path.join(REPO, "README.md"), os.path.join(REPO, "deploy", "README.md")]
    for folder in (os.path.join(REPO, "docs"), os.path.join(REPO, "docs", "notes")):
        found += sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".md"))
    return found


def _without_code(text):
    """The text with fenced code blocks and inline code blanked out (a
    `[x](y)` inside code is not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "``", text)


def slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation other than
    '-' and '_' dropped, spaces to '-'."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    text = re.sub(r"^```.*?^```", "", open(path, encoding="utf-8").read(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def links(path):
    text = _without_code(open(path, encoding="utf-8").read())
    # [text](target): the text may hold inline code, now blanked; the
    # target has no spaces.
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


@pytest.mark.parametrize("doc", documents(), ids=lambda p: os.path.relpath(p, REPO))
def test_links_stay_in_the_repository_and_resolve(doc):
    found = links(doc)
    problems = []
    for target in found:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            problems.append("%s: leaves the repository" % target)
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if os.path.relpath(resolved, REPO).startswith(".."):
            problems.append("%s: leaves the repository" % target)
        elif not os.path.exists(resolved):
            problems.append("%s: no such file" % target)
        elif anchor and (not resolved.endswith(".md") or anchor not in anchors(resolved)):
            problems.append("%s: no heading with that anchor" % target)
    assert not problems, "\n".join(problems)


def test_the_checks_see_links():
    """The link parser finds links (so the test above can fail), and an anchor
    with punctuation and code slugs as GitHub makes it."""
    assert len(links(os.path.join(REPO, "README.md"))) >= 10
    assert slug("The service's own cost") == "the-services-own-cost"
    assert slug("Choosing `--batch_window` and X") == "choosing---batch_window-and-x"


# -- flags --------------------------------------------------------------------

def help_flags(binary):
    """{flag: default} as `binary --help` prints them (quotes stripped)."""
    if not os.path.exists(binary):
        pytest.fail("binary not found: %s (set COALESCE_SERVER / COALESCE_CLI)" % binary)
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    # Each flag: "    --name (help, over one or more lines); default: VALUE;"
    entries, current = [], None
    for line in text.splitlines():
        m = re.match(r"^\s+--(\w+) \(", line)
        if m:
            current = [m.group(1), line]
            entries.append(current)
        elif current is not None and line.startswith("      "):
            current[1] += " " + line.strip()
        else:
            current = None
    flags = {}
    for name, entry in entries:
        m = re.search(r"; default: (.*);$", entry)
        assert m, "no default in %r" % entry
        default = m.group(1)
        if default.startswith('"') and default.endswith('"'):
            default = default[1:-1]
        flags[name] = default
    return text, flags


def table_flags(section):
    """{flag: default cell} of the table under `## section` in
    docs/configuration.md."""
    text = open(CONFIGURATION, encoding="utf-8").read()
    m = re.search(r"^## %s\n(.*?)(?=^## |\Z)" % re.escape(section), text, flags=re.S | re.M)
    assert m, "no section %r in docs/configuration.md" % section
    rows = {}
    for row in re.finditer(r"^\| `--(\w+)` \| (.*?) \|", m.group(1), flags=re.M):
        rows[row.group(1)] = row.group(2)
    return rows


def _compare(binary, section):
    text, helped = help_flags(binary)
    documented = table_flags(section)
    assert helped, "no flags in %s --help:\n%s" % (binary, text)
    problems = []
    for name in sorted(set(helped) - set(documented)):
        problems.append("--%s is in --help but not in the table" % name)
    for name in sorted(set(documented) - set(helped)):
        problems.append("--%s is in the table but not in --help" % name)
    for name in sorted(set(helped) & set(documented)):
        default, cell = helped[name], documented[name]
        if default == "":
            # No value: the table says in words what happens (no backticks).
            if "`" in cell:
                problems.append("--%s: --help has no default, the table says %s" % (name, cell))
        elif cell != "`%s`" % default:
            problems.append("--%s: --help says %r, the table %s" % (name, default, cell))
    assert not problems, "\n".join(problems)


def test_server_flags_match_the_configuration_page():
    _compare(SERVER, "Server flags")


def test_cli_flags_match_the_configuration_page():
    _compare(CLI, "coalesce-cli")


# Every binary on Abseil flags, beside the server.
TOOLS = [os.path.join(os.path.dirname(SERVER), name)
         for name in ("coalesce-bench", "coalesce-engine-bench", "coalesce-loop-bench",
                     "coalesce-eval")]


@pytest.mark.parametrize("binary", [SERVER, CLI] + TOOLS, ids=os.path.basename)
def test_help_lists_its_own_flags_without_build_paths(binary):
    text, flags = help_flags(binary)
    assert "No flags matched" not in text, text
    assert len(flags) >= 5, text
    # Each "Flags from FILE:" names a file of the repository, relative to its
    # root, not where the build machine kept the sources.
    sources = re.findall(r"Flags from (\S+):", text)
    assert sources, text
    for source in sources:
        assert os.path.exists(os.path.join(REPO, source)), (source, text)
