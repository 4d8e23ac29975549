#!/usr/bin/env python3
"""scripts/gpu_bundle.sh and scripts/run_bundle_tests.py, end to end and on bad input.

Packs the build under test into a bundle in a temporary folder, runs one suite of it
(`core`: two doctest binaries that load libdp from the bundle) through
run_bundle_tests.py from a copy of the bundle moved elsewhere (the paths it was built
at must be mapped), and checks that every bad input is a clear error with a nonzero
exit: a folder that is no build, a bundle written over its build, a CUDA object older
than the newest header, a folder that is no bundle, a suite with no tests, a failing test.

  gpu_bundle_test.py --source SRC --build BUILD
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from checks import check, failures


def run(cmd, **kw):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--build", required=True)
    a = ap.parse_args()
    bundle_sh = os.path.join(a.source, "scripts", "gpu_bundle.sh")
    runner = os.path.join(a.source, "scripts", "run_bundle_tests.py")
    with tempfile.TemporaryDirectory() as tmp:
        first = os.path.join(tmp, "first")
        p = run(["bash", bundle_sh, a.build, first])
        check(p.returncode == 0, f"gpu_bundle.sh packs the build (exit {p.returncode}): {p.stdout[-300:]}")
        for rel in ("tests.json", "origin.json", "lib"):
            check(os.path.exists(os.path.join(first, rel)), f"the bundle holds {rel}")
        libdp = [f for f in os.listdir(os.path.join(first, "src")) if f.startswith("libdp.so")]
        check(len(libdp) >= 1, f"the bundle holds libdp ({libdp})")
        check(not any(f.endswith(".o") for _, _, fs in os.walk(first) for f in fs), "no object files")
        with open(os.path.join(first, "origin.json")) as f:
            origin = json.load(f)
        check(origin["build"] == os.path.realpath(a.build), "origin.json names the build")

        # Moved elsewhere, as on another machine: the runner maps the build's paths.
        moved = os.path.join(tmp, "elsewhere", "bundle")
        shutil.move(first, moved)
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.path.join(moved, "lib") + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        log = os.path.join(tmp, "log.txt")
        p = run([sys.executable, runner, moved, "--suite", "core", "--log", log], env=env)
        check(p.returncode == 0 and "passed or skipped, 0 failed" in p.stdout,
              f"the moved bundle's core suite passes (exit {p.returncode}): {p.stdout[-400:]}")
        check(os.path.exists(log) and "doctest" in open(log).read(), "each test's output is in the log")

        # Bad input: each a clear message and a nonzero exit.
        p = run(["bash", bundle_sh, tmp, os.path.join(tmp, "x")])
        check(p.returncode == 2 and "not a configured Meson build" in p.stdout,
              f"a folder that is no build is refused (exit {p.returncode}): {p.stdout.strip()}")
        p = run(["bash", bundle_sh, a.build, a.build])
        check(p.returncode == 2 and "refusing" in p.stdout, f"a bundle over its build is refused: {p.stdout.strip()}")
        # A CUDA object older than the newest header (Meson before 1.2 does not rebuild it).
        stale = os.path.join(tmp, "stale-build")
        os.makedirs(os.path.join(stale, "meson-info"))
        os.makedirs(os.path.join(stale, "src", "libdp.so.p"))
        with open(os.path.join(stale, "meson-info", "intro-tests.json"), "w") as f:
            f.write("[]")
        old = os.path.join(stale, "src", "libdp.so.p", "backend_cuda_x.cu.o")
        open(old, "w").close()
        os.utime(old, (946684800, 946684800))  # 2000-01-01: older than any header of the checkout
        p = run(["bash", bundle_sh, stale, os.path.join(tmp, "y")])
        check(p.returncode == 2 and "CUDA objects older than" in p.stdout and "-delete" in p.stdout,
              f"a stale CUDA object is refused (exit {p.returncode}): {p.stdout.strip()}")
        p = run([sys.executable, runner, tmp])
        check(p.returncode != 0 and "is not a bundle" in p.stdout, f"a folder that is no bundle: {p.stdout.strip()}")
        p = run([sys.executable, runner, moved, "--suite", "no-such-suite"], env=env)
        check(p.returncode != 0 and "no test in suite" in p.stdout, f"a suite with no tests: {p.stdout.strip()}")

        # A failing test fails the run: a test list whose one test exits 3.
        tests = [{"name": "exits_3", "cmd": ["/bin/sh", "-c", "exit 3"], "env": {}, "workdir": None,
                  "timeout": 10, "suite": ["dp:fake"]},
                 {"name": "skips", "cmd": ["/bin/sh", "-c", "exit 77"], "env": {}, "workdir": None,
                  "timeout": 10, "suite": ["dp:fake"]}]
        with open(os.path.join(moved, "tests.json"), "w") as f:
            json.dump(tests, f)
        p = run([sys.executable, runner, moved])
        check(p.returncode == 1 and "FAIL (exit 3)" in p.stdout and "SKIP" in p.stdout and "1 failed" in p.stdout,
              f"a failing test fails the run, a skip does not (exit {p.returncode}): {p.stdout.strip()}")
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
