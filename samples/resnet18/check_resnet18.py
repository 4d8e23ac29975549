#!/usr/bin/env python3
"""Runs the resnet18 sample in short modes and checks its output.

usage: check_resnet18.py EXE WORKDIR

1. DDP on 2 devices, batch 8, 4 steps on one fixed batch (--overfit-batch): the JSON
   keys, finite losses, and the last loss well below the first (fitting one batch is
   deterministic, so this does not flake); the same with --channels-last gives the same
   losses to float32 rounding.
2. DP, batch 4, 3 steps on a tiny CIFAR-10 binary directory written here: the data
   path works and its losses are finite.
3. Bad input (missing data dir, bad flags) exits non-zero with a message.
"""
import json
import math
import os
import random
import subprocess
import sys

KEYS = ("sample", "mode", "devices", "global_batch", "data", "steps", "losses", "seconds", "samples_per_s")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run_json(exe, *args):
    r = subprocess.run([exe, "--json", *args], capture_output=True, text=True, timeout=300)
    sys.stderr.write(r.stderr)
    check(r.returncode == 0, f"{args}: exit status {r.returncode}")
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as e:
        check(False, f"{args}: output is not JSON ({e}): {r.stdout[:200]}")
        return {}


def main():
    exe, work = sys.argv[1], sys.argv[2]
    o = run_json(exe, "--mode", "ddp", "--devices", "2", "--batch", "8", "--max-steps", "4", "--overfit-batch")
    for k in KEYS:
        check(k in o, f"key '{k}' missing")
    ls = o.get("losses", [])
    check(len(ls) == 4 and all(math.isfinite(v) for v in ls), f"losses {ls}")
    check(o.get("data") == "synthetic", "synthetic data not reported")
    if len(ls) == 4:
        check(ls[-1] < 0.7 * ls[0], f"loss did not fall on one batch: {ls}")
    # --channels-last: the same run with the batches laid out N x H x W x C gives the
    # same losses to float32 rounding (convolutions and batch norms sum in another order).
    c = run_json(exe, "--mode", "ddp", "--devices", "2", "--batch", "8", "--max-steps", "4", "--overfit-batch",
                 "--channels-last")
    cl = c.get("losses", [])
    check(len(cl) == len(ls) == 4 and all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(cl, ls)),
          f"--channels-last losses {cl}, NCHW {ls}")

    # A tiny CIFAR-10 binary directory: 5 train files of 6 records each.
    data = os.path.join(work, "cifar")
    os.makedirs(data, exist_ok=True)
    rng = random.Random(0)
    for i in range(1, 6):
        with open(os.path.join(data, f"data_batch_{i}.bin"), "wb") as f:
            for _ in range(6):
                f.write(bytes([rng.randrange(10)]) + bytes(rng.randrange(256) for _ in range(3072)))
    o = run_json(exe, "--mode", "dp", "--devices", "2", "--batch", "4", "--max-steps", "3", "--data", data)
    check(o.get("data") == "cifar10", f"data {o.get('data')}")
    ls = o.get("losses", [])
    check(len(ls) == 3 and all(math.isfinite(v) for v in ls), f"CIFAR losses {ls}")

    for bad in (["--data", os.path.join(work, "no_such_dir"), "--max-steps", "1", "--batch", "2", "--devices", "2"],
                ["--mode", "zero"], ["--batch", "-3"], ["--devices", "100000"], ["--devices", "0,0"], ["--frobnicate"]):
        r = subprocess.run([exe, *bad], capture_output=True, text=True, timeout=120)
        check(r.returncode != 0 and r.stderr.strip(), f"{bad} exited {r.returncode}")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 0 and "--max-steps" in r.stdout, "--help")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
