#!/usr/bin/python3
"""torch.mm on the GEMMs of one MLP step (bench/mlp_ceiling.cpp lists them), in order.

Each GEMM is given as {"name", "ta", "tb", "m", "n", "k"} (row-major, C = op(A) op(B),
C is m x n); a transposed operand is a transposed view of a contiguous tensor, as
linear() and its backward hand them to the BLAS. Each is warmed up, then timed in
batches of about 10 ms into a preallocated output (torch.mm(..., out=c)) until
--min-ms have passed; the best batch's mean per call is reported, as mlp_ceiling does.

  /usr/bin/python3 bench/pytorch/mlp_gemms_torch.py --threads 2 \\
      --gemms '[{"name": "fc2 forward", "ta": false, "tb": true, "m": 512, "n": 1024, "k": 1024}]'

Prints one JSON object: {"torch": version, "threads": T, "gemms": {name: {"ms", "gflops"}}}.
bench/side_by_side.py --compare mlp runs it in PyTorch's best environment.
"""
import argparse
import json
import time

import torch


def operand(rows, cols, transposed):
    """A rows x cols operand: a view of a contiguous cols x rows tensor when transposed."""
    return torch.randn(cols, rows).t() if transposed else torch.randn(rows, cols)


def time_gemm(g, min_ms):
    a = operand(g["m"], g["k"], g["ta"])
    b = operand(g["k"], g["n"], g["tb"])
    c = torch.empty(g["m"], g["n"])
    for _ in range(3):
        torch.mm(a, b, out=c)
    t = time.perf_counter()
    torch.mm(a, b, out=c)
    one = max(time.perf_counter() - t, 1e-7)
    iters = max(1, min(10000, int(0.010 / one)))
    best, total, batches = float("inf"), 0.0, 0
    while batches < 3 or total * 1e3 < min_ms:
        t = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b, out=c)
        dt = time.perf_counter() - t
        best = min(best, dt / iters)
        total += dt
        batches += 1
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemms", required=True, help="JSON list of the GEMMs (see above)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-ms", type=float, default=300.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {}
    for g in json.loads(args.gemms):
        ms = time_gemm(g, args.min_ms)
        out[g["name"]] = {"ms": ms, "gflops": 2.0 * g["m"] * g["n"] * g["k"] / (ms * 1e6)}
    print(json.dumps({"torch": torch.__version__, "threads": args.threads, "gemms": out}))


if __name__ == "__main__":
    main()
