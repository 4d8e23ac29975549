#!/usr/bin/env python3
"""samples/gpt's training step against PyTorch 2.x's, in ONE run, contenders alternating.

  python3 bench/gpt_side_by_side.py --binary build/samples/gpt/gpt --torch-python /work/venv/bin/python
  python3 bench/gpt_side_by_side.py --precision bf16 --rounds 3

Each round runs dp (samples/gpt on one device, --steps S, its step records' `ms`
after the first W steps) and PyTorch (bench/pytorch/gpt_torch.py: the same model,
batch, context and optimizer; SDPA) eager and with torch.compile, in turn, all pinned
to the same CPUs with the same thread count. PyTorch's best is the faster of its two
modes in that round. Reported: per contender the median over rounds of tokens/s, and
dp / PyTorch's best (> 1: dp is faster), with the CPU model and load average. bf16:
autocast on both sides (dp::amp::autocast, torch.autocast("cpu", bfloat16)).

The dp run trains on the fortunes corpus (the speed does not depend on the text);
PyTorch on random tokens of the same vocabulary size.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def pinned(threads, cmd):
    return ["taskset", "-c", ",".join(str(c) for c in range(threads))] + cmd


def env_for(threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", DP_CPU_DEVICES="1")
    return env


def run_dp(args):
    cmd = pinned(args.threads, [args.binary, "--steps", str(args.steps), "--log-every", "1", "--eval-interval",
                                str(10 ** 6), "--eval-iters", "1", "--precision", args.precision, "--json",
                                "--batch", str(args.batch), "--warmup", "2"])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env_for(args.threads), timeout=1800)
    if r.returncode != 0:
        sys.exit(f"dp failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    steps = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    steps = [o for o in steps if o.get("type") == "step" and o["step"] > args.warmup]
    ms = statistics.mean(o["ms"] for o in steps)
    return args.batch * 128 / (ms / 1e3), ms  # the tiny config's context: 128 tokens


def run_torch(args, compiled):
    cmd = [args.torch_python, os.path.join(HERE, "pytorch", "gpt_torch.py"), "--threads", str(args.threads),
           "--steps", str(args.steps - args.warmup), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    if args.precision == "bf16":
        cmd.append("--bf16")
    if compiled:
        cmd.append("--compile")
    r = subprocess.run(pinned(args.threads, cmd), capture_output=True, text=True, env=env_for(args.threads),
                       timeout=1800)
    if r.returncode != 0:
        sys.exit(f"PyTorch failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    o = json.loads(r.stdout.strip().splitlines()[-1])
    return o["tokens_per_sec"], o["ms_per_step"], o["torch"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default="build/samples/gpt/gpt")
    ap.add_argument("--torch-python", default=sys.executable)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25, help="steps per run, the first --warmup not timed")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()

    print(f"CPU: {cpu_model()}; {args.threads} threads; precision {args.precision}; batch {args.batch} x 128 "
          f"tokens; load {loadavg():.2f}")
    dp_tps, eager_tps, compiled_tps, best_ratio = [], [], [], []
    version = "?"
    for rnd in range(args.rounds):
        d, dms = run_dp(args)
        e, ems, version = run_torch(args, compiled=False)
        c, cms, _ = run_torch(args, compiled=True)
        dp_tps.append(d)
        eager_tps.append(e)
        compiled_tps.append(c)
        best_ratio.append(d / max(e, c))
        print(f"round {rnd + 1}: dp {d:,.0f} tokens/s ({dms:.1f} ms) | torch eager {e:,.0f} ({ems:.1f} ms) | "
              f"torch compile {c:,.0f} ({cms:.1f} ms) | dp / best {best_ratio[-1]:.2f}; load {loadavg():.2f}")
    med = statistics.median
    best = max(med(eager_tps), med(compiled_tps))
    print(f"median tokens/s: dp {med(dp_tps):,.0f}, torch {version} eager {med(eager_tps):,.0f}, compiled "
          f"{med(compiled_tps):,.0f}; dp / PyTorch's best = {med(dp_tps) / best:.2f} (per round "
          f"{', '.join(f'{r:.2f}' for r in best_ratio)})")


if __name__ == "__main__":
    main()
