#!/usr/bin/env python3
"""Runs a test program under mpirun for `meson test` (suite 'mpi').

    run_mpi.py --mpirun PATH --have-mpi 1 --np 2 [--timeout S] [--env K=V ...]
               [--expect-fail REGEX ...] -- PROGRAM [ARGS ...]

Exit status: 77 (Meson's SKIP) when dp was built without MPI or mpirun is missing;
otherwise 0 when the job did what was expected and 1 when it did not:
  - by default every process must succeed (mpirun exits 0);
  - with --expect-fail the job must end with a non-zero status within the timeout,
    its output must match every REGEX, and no process may print "got through".
A job still running at the timeout is killed (the whole process group) and fails the
test: nothing may wait forever.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpirun", default="")
    ap.add_argument("--have-mpi", default="0")
    ap.add_argument("--np", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--expect-fail", action="append", default=[])
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if a.have_mpi != "1":
        print("SKIP: dp was built without MPI (meson -Dmpi=enabled needs libopenmpi-dev)")
        return 77
    mpirun = a.mpirun or shutil.which("mpirun")
    if not mpirun:
        print("SKIP: mpirun not found (install openmpi-bin)")
        return 77

    env = dict(os.environ)
    exports = []
    if "ASAN_OPTIONS" in env:
        # Open MPI's libraries have no frame pointers: without slow unwinding a leak
        # inside MPI_Init has a 2-frame stack that lsan.supp's `leak:MPI_Init` cannot
        # match (scripts/sanitizers/lsan.supp).
        env["ASAN_OPTIONS"] += ":fast_unwind_on_malloc=0"
        exports += ["-x", "ASAN_OPTIONS"]
    for var in ("LSAN_OPTIONS", "UBSAN_OPTIONS", "TSAN_OPTIONS"):
        if var in env:
            exports += ["-x", var]
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
        exports += ["-x", k]
    # --oversubscribe: CI has 2 cores and these jobs start up to 3 processes;
    # --bind-to none: several jobs' processes must not be pinned to the same core;
    # --allow-run-as-root: CI containers run as root (harmless otherwise).
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
            "-np", str(a.np)] + exports + cmd
    print("+ " + " ".join(argv), flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        print(out)
        print(f"FAIL: the job was still running after {a.timeout:.0f} s (killed)")
        return 1
    elapsed = time.monotonic() - start
    print(out)
    print(f"mpirun exited with {proc.returncode} after {elapsed:.1f} s")

    if not a.expect_fail:
        return 0 if proc.returncode == 0 else 1
    ok = True
    if proc.returncode == 0:
        print("FAIL: expected the job to fail, but mpirun exited 0")
        ok = False
    for pattern in a.expect_fail:
        if not re.search(pattern, out):
            print(f"FAIL: the output does not match {pattern!r}")
            ok = False
    if "got through" in out:
        print("FAIL: a process got through a collective that a peer never joined")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
