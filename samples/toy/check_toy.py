#!/usr/bin/env python3
"""Runs the toy sample in a short mode and checks its output.

usage: check_toy.py EXE

Checks: --json gives the keys and one finite loss per step, the loss falls from the
first to the last step (one fixed batch, plain SGD: every step descends), DP and DDP
report the same losses, the text mode prints a line per step, bad flags exit non-zero.
"""
import json
import math
import subprocess
import sys

STEPS = 20
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(exe, *args):
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
    sys.stderr.write(r.stderr)
    return r


def main():
    exe = sys.argv[1]
    losses = {}
    for mode in ("dp", "ddp", "sharded"):
        r = run(exe, "--mode", mode, "--max-steps", str(STEPS), "--json")
        check(r.returncode == 0, f"{mode}: exit status {r.returncode}")
        try:
            o = json.loads(r.stdout)
        except json.JSONDecodeError as e:
            check(False, f"{mode}: output is not JSON ({e}): {r.stdout[:200]}")
            continue
        for k in ("sample", "mode", "devices", "steps", "losses"):
            check(k in o, f"{mode}: key '{k}' missing")
        ls = o.get("losses", [])
        check(len(ls) == STEPS, f"{mode}: {len(ls)} losses for {STEPS} steps")
        check(all(isinstance(v, float) and math.isfinite(v) for v in ls), f"{mode}: non-finite loss")
        if len(ls) == STEPS:
            check(ls[-1] < ls[0], f"{mode}: loss did not fall: {ls[0]} -> {ls[-1]}")
            # Full-batch gradient descent with a small step: the loss falls every step.
            check(sum(b < a for a, b in zip(ls, ls[1:])) >= STEPS - 2, f"{mode}: loss not decreasing: {ls}")
        losses[mode] = ls
    if len(losses.get("dp", [])) == len(losses.get("ddp", [])) == STEPS:
        check(all(abs(a - b) <= 1e-6 * max(1.0, abs(a)) for a, b in zip(losses["dp"], losses["ddp"])),
              "DP and DDP losses differ")
    if len(losses.get("ddp", [])) == len(losses.get("sharded", [])) == STEPS:
        check(all(abs(a - b) <= 1e-6 * max(1.0, abs(a)) for a, b in zip(losses["ddp"], losses["sharded"])),
              "DDP and Sharded losses differ")

    r = run(exe, "--max-steps", "3")
    lines = [l for l in r.stdout.splitlines() if l.startswith("step ")]
    check(r.returncode == 0 and len(lines) == 3, f"text mode: {r.stdout!r}")

    for bad in (["--mode", "fsdp"], ["--shard-stage", "3"], ["--max-steps", "0"], ["--max-steps", "abc"], ["--bogus"]):
        r = run(exe, *bad)
        check(r.returncode != 0 and r.stderr.strip(), f"{bad} exited {r.returncode}")
    r = run(exe, "--help")
    check(r.returncode == 0 and "--max-steps" in r.stdout, "--help")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
