#!/usr/bin/env python3
"""scripts/gpu_profile.sh --summarize: the per-kernel table of an ncu raw CSV, and its
refusals (no such page, an unknown unit, bad arguments). Needs no GPU."""
import os
import subprocess
import sys
import tempfile

script = os.path.join(sys.argv[1], "scripts", "gpu_profile.sh")
from checks import check, finish


def run(*args):
    return subprocess.run(["bash", script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def csv(unit, rows):
    head = '"ID","Kernel Name","gpu__time_duration.sum"\n"","","%s"\n' % unit
    return "==PROF== noise before the table\n" + head + "".join(f'"{i}","{k}","{t}"\n' for i, (k, t) in enumerate(rows))


with tempfile.TemporaryDirectory() as tmp:
    good = os.path.join(tmp, "good.csv")
    with open(good, "w") as f:
        f.write(csv("nsecond", [("small_kernel", "1,000"), ("big_kernel", "30000"), ("small_kernel", "3000"),
                                ("big_kernel", "10000")]))
    p = run("--summarize", good)
    lines = p.stdout.splitlines()
    check(p.returncode == 0, f"a good CSV is summarised (exit {p.returncode}): {p.stdout}")
    check(lines and lines[0].startswith("4 launches, 44.0 us"), f"launches and total in us: {lines[:1]}")
    body = [l for l in lines[2:] if l.strip()]
    check(len(body) == 2 and "big_kernel" in body[0] and "small_kernel" in body[1],
          f"largest first, one row per kernel: {body}")
    check(len(body) == 2 and body[0].split()[0] == "40.0" and body[0].split()[2] == "2" and body[0].split()[3] == "20.00",
          f"sum, calls and mean of a kernel: {body[:1]}")
    p = run("--summarize", good, "--top", "1")
    check(len([l for l in p.stdout.splitlines()[2:] if l.strip()]) == 1, "--top 1 keeps one row")

    odd = os.path.join(tmp, "odd.csv")
    with open(odd, "w") as f:
        f.write(csv("cycles", [("k", "5")]))
    p = run("--summarize", odd)
    check(p.returncode != 0 and "unknown time unit 'cycles'" in p.stdout, f"an unknown unit is refused: {p.stdout.strip()}")
    p = run("--summarize", os.path.join(tmp, "missing.csv"))
    check(p.returncode != 0 and "cannot read" in p.stdout, f"a missing file: {p.stdout.strip()}")
    p = run("--summarize", script)
    check(p.returncode != 0 and "holds no ncu raw page" in p.stdout, f"a file that is no ncu CSV: {p.stdout.strip()}")
    p = run("--launches", "0")
    check(p.returncode == 2 and "positive integers" in p.stdout, f"--launches 0: {p.stdout.strip()}")
    p = run("--frobnicate")
    check(p.returncode == 2 and "unknown argument" in p.stdout, f"an unknown argument: {p.stdout.strip()}")
finish()
