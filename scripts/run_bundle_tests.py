#!/usr/bin/env python3
"""Runs the tests of a bundle made by scripts/gpu_bundle.sh, without Meson.

Reads BUNDLE/tests.json (Meson's intro-tests.json) and BUNDLE/origin.json (where the
build and the source tree were), maps those paths onto the bundle and this checkout,
and runs the chosen tests one at a time with each test's environment and timeout,
the way `meson test` does: exit 0 passes, 77 skips, anything else (or the timeout)
fails. Each test's output goes to LOG (appended); one line per test is printed.

  scripts/run_bundle_tests.py .gpu-bundle --suite cuda --log out/log.txt

Exit status: 0 when no chosen test failed, 1 otherwise, 2 on bad arguments.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--suite", action="append", default=[],
                    help="run tests of this suite only (e.g. cuda; repeatable; default all)")
    ap.add_argument("--log", help="append every test's output to this file")
    ap.add_argument("--timeout-multiplier", type=float, default=1.0)
    a = ap.parse_args()

    bundle = os.path.realpath(a.bundle)
    source = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
    try:
        with open(os.path.join(bundle, "tests.json")) as f:
            tests = json.load(f)
        with open(os.path.join(bundle, "origin.json")) as f:
            origin = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"run_bundle_tests: {bundle} is not a bundle of scripts/gpu_bundle.sh ({e})")

    def here(s):  # a path of the build machine, on this one
        if s is None:
            return None
        s = s.replace(origin["build"], bundle)
        return s.replace(origin["source"], source)

    def in_suite(t):
        names = {s.split(":")[-1] for s in t["suite"]} | set(t["suite"])
        return not a.suite or any(s in names for s in a.suite)

    chosen = [t for t in tests if in_suite(t)]
    if not chosen:
        sys.exit(f"run_bundle_tests: no test in suite(s) {a.suite}")
    log = open(a.log, "a") if a.log else None
    failed = 0
    for t in chosen:
        env = dict(os.environ)
        for k, v in (t.get("env") or {}).items():
            v = here(v)
            if k == "LD_LIBRARY_PATH" and os.environ.get(k):
                v = v + ":" + os.environ[k]
            env[k] = v
        cmd = [here(c) for c in t["cmd"]]
        timeout = (t.get("timeout") or 30) * a.timeout_multiplier
        t0 = time.time()
        try:
            p = subprocess.run(cmd, env=env, cwd=here(t.get("workdir")) or bundle,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
            out, rc = p.stdout, p.returncode
            verdict = "OK" if rc == 0 else "SKIP" if rc == 77 else f"FAIL (exit {rc})"
        except subprocess.TimeoutExpired as e:
            out, rc = e.stdout or b"", None
            verdict = f"TIMEOUT ({timeout:.0f} s)"
        except OSError as e:
            out, rc = str(e).encode(), None
            verdict = f"FAIL ({e.strerror})"
        dt = time.time() - t0
        failed += verdict not in ("OK", "SKIP")
        line = f"{t['name']:<40} {verdict:<18} {dt:7.1f} s"
        print(line, flush=True)
        if log:
            log.write(f"==== {line}\n$ {' '.join(cmd)}\n")
            log.write(out.decode(errors="replace"))
            log.write("\n")
            log.flush()
    print(f"{len(chosen) - failed} of {len(chosen)} passed or skipped, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
