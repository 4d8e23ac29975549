#!/usr/bin/env python3
"""dp's training step against PyTorch's on one GPU, in ONE run with the contenders
alternating (dp, PyTorch default, PyTorch cudnn.benchmark, dp, ...) to cancel drift.

  python3 bench/gpu_side_by_side.py --binary build-gpu/samples/dp_vs_ddp/dp_vs_ddp
  python3 bench/gpu_side_by_side.py --binary B --models cnn,resnet18 --rounds 5 --json

Per round and model: dp's single-device step (`dp_vs_ddp --model M --devices 1`, its
"single" record), then bench/pytorch/gpu_step_torch.py in PyTorch's default settings and
with torch.backends.cudnn.benchmark (PyTorch at its best on fixed shapes); the same
models, batch (256), SGD momentum 0.9, cross-entropy, host batches copied every step,
TF32 as each defaults. Reported per model: the median over rounds of samples/s of each
contender and the ratio of medians dp / PyTorch's better setting (> 1: dp is faster).
--dp-env adds dp's own DP_CUDNN_BENCHMARK=1 as a fourth contender.

Exit status: 0; 77 when no GPU is visible (to dp or to PyTorch); 2 on bad arguments or
when a contender fails (its output is printed).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_SCRIPT = os.path.join(HERE, "pytorch", "gpu_step_torch.py")


def run_json(cmd, env=None):
    """Runs cmd and returns the JSON objects it printed, one per line."""
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if p.returncode == 77:
        raise SystemExit(77)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:])
        sys.exit(f"gpu_side_by_side: {' '.join(cmd)} exited with {p.returncode}")
    out = []
    for line in p.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def dp_step(a, model, extra_env=None):
    env = dict(os.environ, **(extra_env or {}))
    recs = run_json([a.binary, "--model", model, "--devices", "1", "--batch", str(a.batch), "--steps",
                     str(a.steps), "--warmup", str(a.warmup), "--json"], env)
    single = [r for r in recs if r.get("mode") == "single"]
    if not single or single[0].get("device_kind") != "cuda":
        sys.exit(f"gpu_side_by_side: no single-device CUDA record from {a.binary} for {model} "
                 f"(got {[r.get('mode') for r in recs]}, device_kind {recs[0].get('device_kind') if recs else None})")
    return single[0]["samples_per_s"]


def torch_step(a, model, benchmark):
    cmd = [a.torch_python, TORCH_SCRIPT, "--model", model, "--batch", str(a.batch), "--steps", str(a.steps),
           "--warmup", str(a.warmup)]
    if benchmark:
        cmd.append("--benchmark")
    recs = run_json(cmd)
    if not recs:
        sys.exit(f"gpu_side_by_side: no record from {' '.join(cmd)}")
    return recs[0]["samples_per_s"], recs[0].get("torch"), recs[0].get("gpu")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", required=True, help="samples/dp_vs_ddp/dp_vs_ddp of a CUDA build")
    ap.add_argument("--models", default="mlp,cnn,resnet18")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--torch-python", default=sys.executable, help="a Python with a CUDA PyTorch")
    ap.add_argument("--dp-env", action="store_true", help="also dp with DP_CUDNN_BENCHMARK=1")
    ap.add_argument("--json", action="store_true", help="one JSON object per model instead of the table")
    a = ap.parse_args()
    models = [m for m in a.models.split(",") if m]
    bad = [m for m in models if m not in ("mlp", "cnn", "resnet18")]
    if bad or not models:
        sys.exit(f"gpu_side_by_side: --models takes mlp, cnn, resnet18; got {a.models!r}")
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0 or a.batch < 1:
        sys.exit("gpu_side_by_side: --rounds, --steps and --batch must be positive, --warmup >= 0")
    if not os.access(a.binary, os.X_OK):
        sys.exit(f"gpu_side_by_side: {a.binary} is not an executable")
    probe = subprocess.run([a.torch_python, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 77)"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if probe.returncode != 0:
        print(f"gpu_side_by_side: {a.torch_python} has no CUDA PyTorch (or no GPU is visible)", file=sys.stderr)
        return 77

    names = ["dp", "torch default", "torch cudnn.benchmark"] + (["dp DP_CUDNN_BENCHMARK=1"] if a.dp_env else [])
    results = {m: {n: [] for n in names} for m in models}
    meta = {}
    for r in range(a.rounds):
        for m in models:
            results[m]["dp"].append(dp_step(a, m))
            v, meta["torch"], meta["gpu"] = torch_step(a, m, False)
            results[m]["torch default"].append(v)
            v, _, _ = torch_step(a, m, True)
            results[m]["torch cudnn.benchmark"].append(v)
            if a.dp_env:
                results[m]["dp DP_CUDNN_BENCHMARK=1"].append(dp_step(a, m, {"DP_CUDNN_BENCHMARK": "1"}))
            print(f"round {r + 1} {m}: " + ", ".join(f"{n} {results[m][n][-1]:.0f}" for n in names),
                  file=sys.stderr, flush=True)

    rows = []
    for m in models:
        med = {n: statistics.median(v) for n, v in results[m].items()}
        best_torch = max(med["torch default"], med["torch cudnn.benchmark"])
        rows.append({"model": m, "batch": a.batch, "rounds": a.rounds, "gpu": meta.get("gpu"), "torch": meta.get("torch"),
                     "samples_per_s": med, "per_round": results[m], "dp_vs_torch_best": med["dp"] / best_torch})
    if a.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{meta.get('gpu')}, PyTorch {meta.get('torch')}, batch {a.batch}, median of {a.rounds} alternating rounds")
    print(f"{'model':<9}" + "".join(f"{n:>25}" for n in names) + f"{'dp / PyTorch best':>19}")
    for row in rows:
        print(f"{row['model']:<9}" + "".join(f"{row['samples_per_s'][n]:>25.0f}" for n in names) +
              f"{row['dp_vs_torch_best']:>19.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
