#!/usr/bin/env python3
"""Training throughput of samples/fashion_mnist_cnn against PyTorch, or across dp's modes,
measured in ONE run with the contenders alternating (A, B, A, B, ...) to cancel drift.

  # dp (one device) vs PyTorch (2 threads), same CNN, batch 256, Adam 1e-3:
  python3 bench/side_by_side.py --binary build-fm/samples/fashion_mnist_cnn/fashion_mnist_cnn
  # single vs DP vs DDP on 2 CPU virtual devices (same global batch):
  python3 bench/side_by_side.py --compare modes --devices 0,1

Each dp run is `fashion_mnist_cnn --max-steps S --epochs 1 --json --log-every W --no-eval`; its
step records carry the cumulative training time, so samples/s = (S - W) * batch /
(time_s[S] - time_s[W]) — the first W steps are warm-up. The PyTorch script times the
same steps itself (bench/pytorch/fashion_cnn_torch.py, run by --torch-python, which
must be a Python with torch: Debian's /usr/bin/python3). Reported per contender: the
median over rounds of samples/s and ms/step, and the ratio of medians
(dp / torch > 1 means dp is faster). The load average is printed with each figure:
on a shared machine, re-run when it is high.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def loadavg():
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run_dp(args, mode, devices):
    cmd = [args.binary, "--max-steps", str(args.steps), "--epochs", "1", "--json",
           "--log-every", str(args.warmup), "--batch", str(args.batch), "--mode", mode,
           "--devices", devices, "--path", args.path, "--no-eval"]
    if args.data:
        cmd += ["--data", args.data]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    steps = {}
    summary = {}
    for line in proc.stdout.splitlines():
        rec = json.loads(line)
        if rec.get("type") == "step":
            steps[rec["step"]] = rec
        elif rec.get("type") == "summary":
            summary = rec
    t0, t1 = steps[args.warmup]["time_s"], steps[args.steps]["time_s"]
    timed = args.steps - args.warmup
    ms = (t1 - t0) * 1e3 / timed
    return {"ms_per_step": ms, "samples_per_sec": args.batch * 1e3 / ms,
            "phases": summary.get("phases"), "cmd": " ".join(cmd)}


def run_torch(args):
    script = os.path.join(HERE, "pytorch", "fashion_cnn_torch.py")
    cmd = [args.torch_python, script, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--threads", str(args.threads), "--json"]
    if args.data:
        cmd += ["--data", args.data]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    rec = [json.loads(l) for l in proc.stdout.splitlines() if l.strip()][-1]
    return {"ms_per_step": rec["ms_per_step"], "samples_per_sec": rec["samples_per_sec"],
            "cmd": " ".join(cmd)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default=os.path.join(ROOT, "build-fm", "samples", "fashion_mnist_cnn",
                                                     "fashion_mnist_cnn"))
    ap.add_argument("--compare", choices=["torch", "modes"], default="torch")
    ap.add_argument("--devices", default="0,1", help="devices of the dp/ddp runs (--compare modes)")
    ap.add_argument("--path", default="worker", choices=["worker", "module"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2, help="PyTorch threads")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the contenders")
    ap.add_argument("--data", default="")
    ap.add_argument("--torch-python", default="/usr/bin/python3")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        sys.exit("--steps must exceed --warmup")

    if args.compare == "torch":
        contenders = [("dp single", lambda: run_dp(args, "single", "0")),
                      ("pytorch", lambda: run_torch(args))]
    else:
        contenders = [("single", lambda: run_dp(args, "single", "1")),  # one device: device 0
                      ("dp", lambda: run_dp(args, "dp", args.devices)),
                      ("ddp", lambda: run_dp(args, "ddp", args.devices))]

    results = {name: [] for name, _ in contenders}
    for r in range(args.rounds):
        for name, fn in contenders:
            load_before = loadavg()
            res = fn()
            res["load"] = load_before
            results[name].append(res)
            print(f"round {r + 1} {name:10s} {res['samples_per_sec']:8.1f} samples/s "
                  f"{res['ms_per_step']:8.1f} ms/step  (load {load_before:.2f})", flush=True)

    med = {name: statistics.median(x["samples_per_sec"] for x in runs) for name, runs in results.items()}
    names = [n for n, _ in contenders]
    base = names[1] if args.compare == "torch" else names[0]
    print()
    print(f"{'contender':12s} {'samples/s':>10s} {'ms/step':>9s} {'ratio':>7s}   (median of {args.rounds}; "
          f"steps {args.warmup + 1}..{args.steps} of batch {args.batch})")
    out = {"compare": args.compare, "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
           "rounds": args.rounds, "contenders": {}}
    for name in names:
        ratio = med[name] / med[base]
        print(f"{name:12s} {med[name]:10.1f} {args.batch * 1e3 / med[name]:9.1f} {ratio:7.3f}")
        out["contenders"][name] = {"samples_per_sec": med[name], "ratio": ratio,
                                   "runs": results[name]}
    if args.compare == "torch":
        print(f"\ndp / torch samples/s = {med[names[0]] / med[names[1]]:.3f}  (>1: dp faster)")
    else:
        print(f"\nDP / single = {med['dp'] / med['single']:.3f}, DDP / single = {med['ddp'] / med['single']:.3f}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
