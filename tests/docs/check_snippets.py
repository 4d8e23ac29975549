#!/usr/bin/env python3
"""Compiles every fenced C++ block of the documentation and runs the complete programs.

usage: check_snippets.py --root SRC --lib LIBDP --work DIR [--include DIR ...] [--jobs N]
                         [--run-timeout S] [--docs FILE.md ...] --cxx COMPILER [ARGS...]
       check_snippets.py --self-test --root SRC --lib LIBDP --work DIR --cxx COMPILER...

Blocks are found by extract_snippets.py (which documents the ```cpp info strings).
Fragments are compiled (-fsyntax-only) after a prelude; programs are compiled, linked
against the built libdp and run with a time limit, from a scratch directory. A program
that exits 77 (e.g. its data set is not installed) counts as skipped. The test fails
when any block fails, and when no block at all is found (a broken extractor must not
pass). --include adds a folder of headers after SRC/include: the build tree's include/,
which holds the generated dp/version.h. Exit status: 0 all passed, 1 a failure, 77
everything skipped.
"""
import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import extract_snippets  # noqa: E402

# The project's warning level (warning_level=2) and standard; -O1 as for the unit tests.
CXXFLAGS = ["-std=c++20", "-Wall", "-Wextra", "-O1", "-pthread"]
DEFAULT_DOCS = ["README.md", "docs/getting-started.md", "docs/architecture.md", "docs/dp-vs-ddp.md",
                "docs/multi-node.md", "docs/BENCHMARKS.md", "docs/RELIABILITY.md"]


def check_one(s, args, work):
    """(status, message) for snippet s: status is 'ok', 'skip' or 'FAIL'."""
    if s.kind == "skip":
        return "skip", f"skipped as marked: {s.reason}"
    src = os.path.join(work, s.name + ".cpp")
    with open(src, "w", encoding="utf-8") as f:
        f.write(extract_snippets.to_cpp(s))
    inc = [f"-I{d}" for d in [os.path.join(args.root, "include")] + args.include]
    if s.kind == "fragment":
        cmd = args.cxx + CXXFLAGS + inc + ["-fsyntax-only", src]
    else:
        exe = os.path.join(work, s.name)
        libdir = os.path.dirname(os.path.abspath(args.lib))
        cmd = args.cxx + CXXFLAGS + inc + [src, "-o", exe, args.lib, f"-Wl,-rpath,{libdir}"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=args.root)
    if r.returncode != 0:
        return "FAIL", f"does not compile:\n{' '.join(cmd)}\n{r.stderr[-6000:]}"
    built = time.monotonic() - t0
    if s.kind != "program":
        return "ok", f"compiled ({s.kind}, {built:.1f} s)"
    run_dir = os.path.join(work, s.name + ".run")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    try:
        r = subprocess.run([exe], capture_output=True, text=True, cwd=run_dir, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        return "FAIL", f"ran longer than {args.run_timeout} s (keep documented programs small)"
    tail = (r.stdout[-1500:] + r.stderr[-1500:]).strip()
    if r.returncode == 77:
        return "skip", f"the program skipped itself (exit 77): {tail}"
    if r.returncode != 0:
        return "FAIL", f"exited {r.returncode}:\n{tail}"
    return "ok", f"compiled and ran ({built:.1f} s + {time.monotonic() - t0 - built:.1f} s)"


def check_all(snippets, args, work):
    """Prints one line per snippet; returns the counts per status."""
    counts = {"ok": 0, "skip": 0, "FAIL": 0}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda s: (s, check_one(s, args, work)), snippets))
    for s, (status, msg) in results:
        counts[status] += 1
        print(f"{status:4} {s.where()}: {msg}")
    return counts


def self_test(args):
    """The checker must reject a snippet that does not compile, one that fails at run
    time, a skip without a reason and a document without snippets."""
    with tempfile.TemporaryDirectory() as tmp:
        cases = {
            "compile": "```cpp\nint main() { return undeclared_name; }\n```\n",
            "run": "```cpp\n#include <dp/dp.h>\nint main() { dp::data::SequentialSampler s(-1); }\n```\n",
            "fragment": "```cpp\nmodel.no_such_method();\n```\n",
        }
        failures = []
        for what, text in cases.items():
            doc = os.path.join(tmp, what + ".md")
            with open(doc, "w") as f:
                f.write(text)
            snippets = extract_snippets.extract(doc)
            counts = check_all(snippets, args, tmp)
            if counts["FAIL"] != 1:
                failures.append(f"a snippet that should fail ({what}) passed")
        doc = os.path.join(tmp, "skip.md")
        with open(doc, "w") as f:
            f.write("```cpp skip\nint x;\n```\n")
        try:
            extract_snippets.extract(doc)
            failures.append("a skip without a reason was accepted")
        except extract_snippets.ExtractError as e:
            print("rejected as expected:", e)
        doc = os.path.join(tmp, "good.md")
        with open(doc, "w") as f:
            f.write("text\n```cpp\n#include <dp/dp.h>\nint main() { return dp::cpu(0).index; }\n```\n"
                    "```cpp\nopt.zero_grad();\n```\n")
        counts = check_all(extract_snippets.extract(doc), args, tmp)
        if counts["ok"] != 2:
            failures.append(f"two good snippets did not both pass: {counts}")
    for f in failures:
        print("FAIL:", f)
    print("self-test:", "FAILED" if failures else "OK")
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True)
    p.add_argument("--lib", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--include", action="append", default=[])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--run-timeout", type=float, default=60)
    p.add_argument("--docs", nargs="*", default=DEFAULT_DOCS)
    p.add_argument("--self-test", action="store_true")
    p.add_argument("--cxx", nargs=argparse.REMAINDER, required=True)
    args = p.parse_args()
    args.lib = os.path.abspath(args.lib)  # meson passes it relative to the build directory
    args.work = os.path.abspath(args.work)
    os.makedirs(args.work, exist_ok=True)
    if args.self_test:
        return self_test(args)
    snippets = []
    try:
        for doc in args.docs:
            path = os.path.join(args.root, doc)
            if os.path.exists(path):
                snippets += extract_snippets.extract(path)
    except extract_snippets.ExtractError as e:
        print("FAIL:", e)
        return 1
    # Report paths relative to the source root, as the documents name each other.
    for s in snippets:
        s.doc = os.path.relpath(s.doc, args.root)
    if not snippets:
        print("FAIL: no ```cpp block found in", ", ".join(args.docs))
        return 1
    counts = check_all(snippets, args, args.work)
    print(f"{len(snippets)} snippets: {counts['ok']} passed, {counts['skip']} skipped, {counts['FAIL']} failed")
    if counts["FAIL"]:
        return 1
    return 77 if counts["ok"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
