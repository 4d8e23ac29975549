#!/usr/bin/env python3
"""Checks the project's Notes: one name, one Note, every citation resolves.

A Note is defined by a comment line that holds only its title -- `// Note [Name]`,
`/// Note [Name]` or `# Note [Name]` -- followed by its text. Elsewhere code cites it as
"Note [Name]" (often "see Note [Name] in file"). This check fails when a name is
defined twice (two Notes drift apart), when a citation names a Note that is not
defined anywhere (a renamed or deleted Note, or one written inline instead of as a
header), and when a Markdown document cites one that does not exist.

  check_notes.py --root <source root>      # check the tree
  check_notes.py --self-test               # show that each rule can fail
"""
import argparse
import os
import re
import sys
import tempfile

SOURCE_DIRS = ["src", "include", "tests", "samples", "bench", "scripts"]
DOC_DIRS = ["docs"]
DOC_FILES = ["README.md"]
SOURCE_EXT = (".h", ".hpp", ".cpp", ".cu", ".cuh", ".py", ".sh", ".build", ".in", ".txt")

DEFINITION = re.compile(r"^\s*(?://+|#)\s*Note \[([^\]]+)\]\s*$")
CITATION = re.compile(r"Note \[([^\]]+)\]")


def files_under(root, dirs, exts):
    for d in dirs:
        top = os.path.join(root, d)
        for base, subdirs, names in os.walk(top):
            subdirs[:] = sorted(s for s in subdirs if not s.startswith((".", "build")))
            for n in sorted(names):
                if n.endswith(exts):
                    yield os.path.join(base, n)


def scan(root):
    """Returns (definitions: name -> [places], citations: name -> [places])."""
    definitions, citations = {}, {}
    sources = list(files_under(root, SOURCE_DIRS, SOURCE_EXT))
    docs = list(files_under(root, DOC_DIRS, (".md",)))
    docs += [os.path.join(root, f) for f in DOC_FILES if os.path.exists(os.path.join(root, f))]
    for path in sources + docs:
        rel = os.path.relpath(path, root)
        if rel == os.path.join("tests", "docs", "check_notes.py"):
            continue  # its own docstring shows the syntax
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                place = f"{rel}:{lineno}"
                m = DEFINITION.match(line) if path in sources else None
                if m:
                    definitions.setdefault(m.group(1), []).append(place)
                    continue
                for name in CITATION.findall(line):
                    citations.setdefault(name, []).append(place)
    return definitions, citations


def problems(root):
    definitions, citations = scan(root)
    out = []
    for name, places in sorted(definitions.items()):
        if len(places) > 1:
            out.append(f"Note [{name}] is defined {len(places)} times: " + ", ".join(places) +
                       " (one name, one Note: merge them or rename one)")
    for name, places in sorted(citations.items()):
        if name not in definitions:
            out.append(f"Note [{name}] is cited but never defined as a header line "
                       f"('// Note [{name}]' alone on its line): " + ", ".join(places[:5]) +
                       (f" and {len(places) - 5} more" if len(places) > 5 else ""))
    return out


def self_test():
    cases = {
        "duplicate": ({"src/a.cpp": "// Note [Twice]\n// text\n", "src/b.cpp": "// Note [Twice]\n"},
                      "defined 2 times"),
        "unresolved": ({"src/a.cpp": "int x;  // see Note [Nowhere]\n"}, "never defined"),
        "inline only": ({"src/a.cpp": "// Note [Inline]: text written after the title\n"},
                        "never defined"),
        "doc cites a missing Note": ({"src/a.cpp": "// Note [Here]\n", "docs/x.md": "Note [There]\n"},
                                     "Note [There]"),
    }
    good = {"src/a.cpp": "// Note [Good]\n// its text\nint x;  // Note [Good]\n",
            "include/b.h": "/// see Note [Good] in src/a.cpp\n", "docs/y.md": "Note [Good]\n"}
    failures = 0
    for label, (tree, expected) in list(cases.items()) + [("clean tree", (good, None))]:
        with tempfile.TemporaryDirectory() as tmp:
            for rel, text in tree.items():
                os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
                with open(os.path.join(tmp, rel), "w") as f:
                    f.write(text)
            found = problems(tmp)
            ok = (not found) if expected is None else any(expected in p for p in found)
            print(f"{'ok  ' if ok else 'FAIL'} {label}: {found}")
            failures += not ok
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    found = problems(os.path.abspath(a.root))
    for p in found:
        print(p)
    print(f"{len(found)} problem(s) with Notes" if found else "Notes: every name defined once, every citation resolves")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
