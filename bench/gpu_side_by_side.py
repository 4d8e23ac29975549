#!/usr/bin/env python3
"""dp's training step against PyTorch's on one GPU, in ONE run with the contenders
alternating (dp, PyTorch default, PyTorch cudnn.benchmark, dp, ...) to cancel drift.

  python3 bench/gpu_side_by_side.py --binary build-gpu/samples/dp_vs_ddp/dp_vs_ddp
  python3 bench/gpu_side_by_side.py --binary B --models cnn,resnet18 --rounds 5 --json
  python3 bench/gpu_side_by_side.py --binary B --models cnn,resnet18 --precision bf16

Per round and model: dp's single-device step (`dp_vs_ddp --model M --devices 1`, its
"single" record), then bench/pytorch/gpu_step_torch.py in PyTorch's default settings and
with torch.backends.cudnn.benchmark (PyTorch at its best on fixed shapes); the same
models, batch (256), SGD momentum 0.9, cross-entropy, host batches copied every step,
TF32 as each defaults. Reported per model: the median over rounds of samples/s of each
contender and the ratio of medians dp / PyTorch's best setting (> 1: dp is faster).
--dp-env adds dp's own DP_CUDNN_BENCHMARK=1 as a further contender.

--precision bf16 (default fp32): mixed precision on both sides. dp runs `dp_vs_ddp
--precision bf16` (forward and loss under dp::amp::autocast(bfloat16), float32 master
weights); PyTorch runs gpu_step_torch.py --bf16 (forward and loss under
torch.autocast("cuda", bfloat16), channels_last model and batches for cnn and
resnet18; dp's batches for those two are channels-last too, `dp_vs_ddp --channels-last`,
unless --dp-nchw) as three contenders: default, cudnn.benchmark, and torch.compile with
cudnn.benchmark ("torch compile+benchmark", compiled in the warm-up steps). A compile
that fails or takes longer than --compile-timeout seconds is reported as unavailable
for that model (with its reason; any earlier rounds of it dropped) and not tried again;
the run goes on without it. PyTorch's best is the fastest of the contenders that ran.
The JSON records carry "precision" (and under bf16 "torch_best" and "unavailable").

Exit status: 0; 77 when no GPU is visible (to dp or to PyTorch); 2 on bad arguments or
when a contender other than torch.compile fails (its output is printed).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_SCRIPT = os.path.join(HERE, "pytorch", "gpu_step_torch.py")
COMPILED = "torch compile+benchmark"


def fail(message):
    print(f"gpu_side_by_side: {message}", file=sys.stderr)
    sys.exit(2)


class Unavailable(Exception):
    pass


def run_json(cmd, env=None, optional=False, timeout=None):
    """Runs cmd and returns the JSON objects it printed, one per line. optional: a failure
    raises Unavailable (with the output's last line) instead of ending the run."""
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        if optional:
            raise Unavailable(f"took longer than {timeout} s")
        raise
    if p.returncode == 77:
        raise SystemExit(77)
    if p.returncode != 0:
        if optional:
            lines = [l for l in p.stdout.splitlines() if l.strip()]
            raise Unavailable(f"exit {p.returncode}: {lines[-1].strip()[:300] if lines else 'no output'}")
        sys.stderr.write(p.stdout[-4000:])
        fail(f"{' '.join(cmd)} exited with {p.returncode}")
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
    cmd = [a.binary, "--model", model, "--devices", "1", "--batch", str(a.batch), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--json"]
    if a.precision != "fp32":
        cmd += ["--precision", a.precision]
    channels_last = a.precision == "bf16" and model in ("cnn", "resnet18") and not a.dp_nchw
    if channels_last:
        cmd += ["--channels-last"]  # as PyTorch's batches under --precision bf16
    recs = run_json(cmd, env)
    single = [r for r in recs if r.get("mode") == "single"]
    if single and single[0].get("device_kind") == "cpu":
        print(f"gpu_side_by_side: {a.binary} sees no CUDA device (it ran on CPU devices)", file=sys.stderr)
        raise SystemExit(77)
    if not single or single[0].get("device_kind") != "cuda":
        fail(f"no single-device CUDA record from {a.binary} for {model} "
             f"(got {[r.get('mode') for r in recs]}, device_kind {recs[0].get('device_kind') if recs else None})")
    if single[0].get("precision", "fp32") != a.precision:
        fail(f"{a.binary} ran {model} in {single[0].get('precision')}, not {a.precision}")
    if bool(single[0].get("channels_last", False)) != channels_last:
        fail(f"{a.binary} ran {model} with channels_last {single[0].get('channels_last')}, not {channels_last}")
    return single[0]["samples_per_s"]


def torch_step(a, model, benchmark, compiled=False):
    cmd = [a.torch_python, TORCH_SCRIPT, "--model", model, "--batch", str(a.batch), "--steps", str(a.steps),
           "--warmup", str(a.warmup)]
    if benchmark:
        cmd.append("--benchmark")
    if a.precision == "bf16":
        cmd.append("--bf16")
    if compiled:
        cmd.append("--compile")
    recs = run_json(cmd, optional=compiled, timeout=a.compile_timeout if compiled else None)
    if not recs:
        fail(f"no record from {' '.join(cmd)}")
    return recs[0]["samples_per_s"], recs[0].get("torch"), recs[0].get("gpu")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", required=True, help="samples/dp_vs_ddp/dp_vs_ddp of a CUDA build")
    ap.add_argument("--models", default="mlp,cnn,resnet18")
    ap.add_argument("--dp-nchw", action="store_true",
                    help="under --precision bf16, give dp NCHW batches (default: channels-last, as PyTorch's)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="fp32 (default) or bf16: autocast on both sides, PyTorch also channels_last and compiled")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--torch-python", default=sys.executable, help="a Python with a CUDA PyTorch")
    ap.add_argument("--dp-env", action="store_true", help="also dp with DP_CUDNN_BENCHMARK=1")
    ap.add_argument("--compile-timeout", type=float, default=300,
                    help="seconds a torch.compile contender's run may take before it counts as unavailable (bf16)")
    ap.add_argument("--json", action="store_true", help="one JSON object per model instead of the table")
    a = ap.parse_args()
    models = [m for m in a.models.split(",") if m]
    bad = [m for m in models if m not in ("mlp", "cnn", "resnet18")]
    if bad or not models:
        fail(f"--models takes mlp, cnn, resnet18; got {a.models!r}")
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0 or a.batch < 1:
        fail("--rounds, --steps and --batch must be positive, --warmup >= 0")
    if a.precision == "bf16" and a.warmup < 1:
        fail("--precision bf16 needs --warmup >= 1 (torch.compile compiles in the first warm-up step)")
    if a.compile_timeout <= 0:
        fail("--compile-timeout must be positive")
    if not os.access(a.binary, os.X_OK):
        fail(f"{a.binary} is not an executable")
    probe = subprocess.run([a.torch_python, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 77)"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if probe.returncode != 0:
        print(f"gpu_side_by_side: {a.torch_python} has no CUDA PyTorch (or no GPU is visible)", file=sys.stderr)
        return 77

    bf16 = a.precision == "bf16"
    names = (["dp", "torch default", "torch cudnn.benchmark"] + ([COMPILED] if bf16 else []) +
             (["dp DP_CUDNN_BENCHMARK=1"] if a.dp_env else []))
    results = {m: {n: [] for n in names} for m in models}
    unavailable = {}  # model -> why its compiled contender did not run
    meta = {}
    for r in range(a.rounds):
        for m in models:
            results[m]["dp"].append(dp_step(a, m))
            v, meta["torch"], meta["gpu"] = torch_step(a, m, False)
            results[m]["torch default"].append(v)
            v, _, _ = torch_step(a, m, True)
            results[m]["torch cudnn.benchmark"].append(v)
            if bf16 and m not in unavailable:
                try:
                    v, _, _ = torch_step(a, m, True, compiled=True)
                    results[m][COMPILED].append(v)
                except Unavailable as e:
                    unavailable[m] = str(e)
                    results[m][COMPILED] = []
                    print(f"round {r + 1} {m}: {COMPILED} unavailable ({e}); going on without it",
                          file=sys.stderr, flush=True)
            if a.dp_env:
                results[m]["dp DP_CUDNN_BENCHMARK=1"].append(dp_step(a, m, {"DP_CUDNN_BENCHMARK": "1"}))
            print(f"round {r + 1} {m}: " + ", ".join(f"{n} {results[m][n][-1]:.0f}" for n in names if results[m][n]),
                  file=sys.stderr, flush=True)

    rows = []
    for m in models:
        med = {n: statistics.median(v) if v else None for n, v in results[m].items()}
        torch_names = [n for n in names if n.startswith("torch") and med[n] is not None]
        best_name = max(torch_names, key=lambda n: med[n])
        row = {"model": m, "precision": a.precision, "batch": a.batch, "rounds": a.rounds, "gpu": meta.get("gpu"),
               "torch": meta.get("torch"), "samples_per_s": med, "per_round": results[m],
               "dp_vs_torch_best": med["dp"] / med[best_name]}
        if bf16:
            row["torch_best"] = best_name
            row["unavailable"] = {COMPILED: unavailable[m]} if m in unavailable else {}
        rows.append(row)
    if a.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    mode = "" if not bf16 else ", bf16 autocast (PyTorch: channels_last for cnn and resnet18)"
    print(f"{a.precision}: {meta.get('gpu')}, PyTorch {meta.get('torch')}, batch {a.batch}, median of {a.rounds} "
          f"alternating rounds{mode}")
    print(f"{'model':<9}" + "".join(f"{n:>25}" for n in names) + f"{'dp / PyTorch best':>19}")
    for row in rows:
        cells = "".join(f"{row['samples_per_s'][n]:>25.0f}" if row["samples_per_s"][n] is not None
                        else f"{'unavailable':>25}" for n in names)
        print(f"{row['model']:<9}" + cells + f"{row['dp_vs_torch_best']:>19.2f}")
    for m, why in unavailable.items():
        print(f"{COMPILED} unavailable for {m}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
