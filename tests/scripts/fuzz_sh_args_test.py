#!/usr/bin/env python3
"""scripts/fuzz.sh refuses bad usage before building anything: an unknown argument, and
--conv-scan without a positive count of geometries, exit 2 naming what came."""
import os
import subprocess
import sys

from checks import check, finish

script = os.path.join(sys.argv[1], "scripts", "fuzz.sh")


def run(*args):
    return subprocess.run(["bash", script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=30)


p = run("--frobnicate")
check(p.returncode == 2 and "unknown argument '--frobnicate'" in p.stdout,
      f"an unknown argument is refused with exit 2 and named: rc {p.returncode}, {p.stdout!r}")
for bad in ("abc", "0", "-3", "1.5", ""):
    p = run("--conv-scan", bad)
    check(p.returncode == 2 and f"--conv-scan expects a positive count of geometries, got '{bad}'" in p.stdout,
          f"--conv-scan {bad!r} is refused with exit 2 and named: rc {p.returncode}, {p.stdout!r}")
p = run("--conv-scan")  # no value at all
check(p.returncode == 2 and "got ''" in p.stdout,
      f"--conv-scan without a value is refused with exit 2: rc {p.returncode}, {p.stdout!r}")
finish()
