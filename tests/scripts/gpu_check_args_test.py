#!/usr/bin/env python3
"""scripts/gpu_check.sh without a GPU: --help prints the whole header comment (up to its
exit-status paragraph, nothing of the code), an unknown argument and a bad setting
(DP_GPU_CHECK_ROUNDS, DP_GPU_CHECK_BUDGET) are refused with exit 2,
and a machine without nvidia-smi skips with 77 before writing anything."""
import os
import subprocess
import sys
import tempfile

script = os.path.join(sys.argv[1], "scripts", "gpu_check.sh")
from checks import check, finish


def run(*args, env=None):
    return subprocess.run(["bash", script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env)


with open(script) as f:
    header = []
    for line in f.read().splitlines()[1:]:
        if not line.startswith("#"):
            break
        header.append(line)
p = run("--help")
check(p.returncode == 0, f"--help exits 0 (got {p.returncode})")
check(p.stdout.splitlines() == header, f"--help prints the {len(header)} header lines, got:\n{p.stdout}")
check(any("Exit status" in l for l in p.stdout.splitlines()), "the header ends with the exit statuses")
check(any("DP_GPU_CHECK_STEP_TIMEOUT" in l for l in p.stdout.splitlines()), "--help names the step limit")

p = run("--frobnicate")
check(p.returncode == 2 and "unknown argument '--frobnicate'" in p.stdout,
      f"an unknown argument is refused with exit 2 and named: rc {p.returncode}, {p.stdout!r}")

for var, value in (("DP_GPU_CHECK_ROUNDS", "0"), ("DP_GPU_CHECK_ROUNDS", "two"), ("DP_GPU_CHECK_BUDGET", "-1")):
    p = run(env=dict(os.environ, **{var: value}))
    check(p.returncode == 2 and f"{var}='{value}'" in p.stdout,
          f"{var}={value} is refused with exit 2 and named: rc {p.returncode}, {p.stdout!r}")

with tempfile.TemporaryDirectory() as tmp:
    # A PATH without nvidia-smi: the check skips (77) and writes no report.
    bindir = os.path.join(tmp, "bin")
    os.mkdir(bindir)
    for tool in ("bash", "dirname", "realpath", "cat", "sed", "awk"):
        for d in ("/usr/bin", "/bin"):
            if os.path.exists(os.path.join(d, tool)):
                os.symlink(os.path.join(d, tool), os.path.join(bindir, tool))
                break
    out = os.path.join(tmp, "report")
    p = subprocess.run([os.path.join(bindir, "bash"), script, "--out", out], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env={"PATH": bindir})
    check(p.returncode == 77 and "no NVIDIA GPU" in p.stdout,
          f"without nvidia-smi it skips with 77: rc {p.returncode}, {p.stdout!r}")
    check(not os.path.exists(out), "and writes no report directory")

finish()
