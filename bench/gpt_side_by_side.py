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

On one GPU (--device cuda; the CPU mode above is unchanged without it):

  python3 bench/gpt_side_by_side.py --device cuda --binary build-gpu/samples/gpt/gpt \
      --data corpus.txt --precision bf16 --peak-gflops 989000 --rounds 2 --steps 30 --warmup 10

Each round runs dp (samples/gpt with DP_DEVICE=cuda, --config gpt2-124m by default:
12 layers, 12 heads, 768 wide, context 1024, on one GPU), then gpt_torch.py --device
cuda eager and with torch.compile ("torch compile"), in turn, no CPU pinning. PyTorch
takes its shape from dp's run: its summary record's config, so the vocabulary is the
character set of dp's corpus (--data, else the fortunes corpus); the same batch
(default 8) and context; --steps S per run (default 30), the first --warmup W (default
10) not timed on either side. PyTorch runs as nanoGPT's train.py does on a GPU:
autocast(bfloat16) under --precision bf16, SDPA (flash attention on an H100), fused
AdamW, TF32 in float32 products, pinned non-blocking batch copies; --threads is the
CPU mode's only. A torch.compile run that fails or passes
--compile-timeout seconds is reported as unavailable, and the run goes on without it.
Reported per contender: median tokens/s and ms per step over the rounds, MFU given
--peak-gflops (the GPU's dense peak for the precision; the FLOPs per token are dp's,
nanoGPT's estimate: 6 x non-embedding parameters + 12 x layers x context x width, the
same model on both sides), and dp / PyTorch's best (> 1: dp is faster); --json prints
one object instead of the table. Round lines go to stderr.

Exit status (--device cuda): 0; 77 when no GPU is visible to dp or to PyTorch; 2 on
bad arguments or when dp or eager PyTorch fails (its output's tail is printed).
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


# ---- --device cuda ---------------------------------------------------------------------


def fail(message):
    print(f"gpt_side_by_side: {message}", file=sys.stderr)
    sys.exit(2)


class Unavailable(Exception):
    pass


def tail(text, n=2000):
    return text[-n:] if text else ""


def run_dp_cuda(args):
    """dp's run on the GPU: (tokens/s, ms per step, its summary record, FLOPs per token)."""
    cmd = [args.binary, "--config", args.config, "--devices", "1", "--steps", str(args.steps), "--log-every", "1",
           "--eval-interval", str(10 ** 6), "--eval-iters", "1", "--precision", args.precision, "--json",
           "--batch", str(args.batch), "--warmup", "2"]
    if args.data:
        cmd += ["--data", args.data]
    if args.peak_gflops:
        cmd += ["--peak-gflops", str(args.peak_gflops)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DP_DEVICE="cuda"), timeout=1800)
    if r.returncode != 0:
        if "expected a visible CUDA device" in r.stderr:
            print(f"gpt_side_by_side: {args.binary} sees no CUDA device (DP_DEVICE=cuda)", file=sys.stderr)
            raise SystemExit(77)
        sys.stderr.write(tail(r.stdout) + tail(r.stderr))
        fail(f"dp failed (exit {r.returncode}): DP_DEVICE=cuda {' '.join(cmd)}")
    recs = []
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass
    summary = [o for o in recs if o.get("type") == "summary"]
    steps = [o for o in recs if o.get("type") == "step" and o["step"] > args.warmup]
    if not summary or not steps:
        sys.stderr.write(tail(r.stdout) + tail(r.stderr))
        fail(f"no summary or no step after {args.warmup} in dp's output: {' '.join(cmd)}")
    ms = statistics.mean(o["ms"] for o in steps)
    tokens = args.batch * summary[0]["config"]["block_size"]
    dp_tokens = round(steps[-1]["tokens_per_sec"] * steps[-1]["ms"] / 1e3)  # dp's own tokens per step
    if abs(dp_tokens - tokens) > 0.01 * tokens:
        fail(f"dp's steps are of {dp_tokens} tokens, not --batch {args.batch} x context "
             f"{summary[0]['config']['block_size']} = {tokens}")
    return tokens / (ms / 1e3), ms, summary[0], steps[-1]["flops_per_token"]


def run_torch_cuda(args, config, compiled):
    """PyTorch's run of dp's shape: (tokens/s, ms per step, its record)."""
    cmd = [args.torch_python, os.path.join(HERE, "pytorch", "gpt_torch.py"), "--device", "cuda",
           "--steps", str(args.steps - args.warmup), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--block-size", str(config["block_size"]), "--n-layer", str(config["n_layer"]),
           "--n-head", str(config["n_head"]), "--n-embd", str(config["n_embd"]), "--vocab", str(config["vocab_size"])]
    if args.precision == "bf16":
        cmd.append("--bf16")
    if compiled:
        cmd.append("--compile")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.compile_timeout if compiled else 1800)
    except subprocess.TimeoutExpired:
        if compiled:
            raise Unavailable(f"took longer than {args.compile_timeout:g} s")
        raise
    if r.returncode == 77:
        raise SystemExit(77)
    if r.returncode != 0:
        if compiled:
            lines = [l for l in (r.stdout + r.stderr).splitlines() if l.strip()]
            raise Unavailable(f"exit {r.returncode}: {lines[-1].strip()[:300] if lines else 'no output'}")
        sys.stderr.write(tail(r.stderr))
        fail(f"PyTorch failed (exit {r.returncode}): {' '.join(cmd)}")
    o = json.loads(r.stdout.strip().splitlines()[-1])
    return o["tokens_per_sec"], o["ms_per_step"], o


def main_cuda(args):
    if args.steps <= args.warmup or args.warmup < 1 or args.rounds < 1 or args.batch < 1:
        fail("--device cuda needs --rounds and --batch >= 1 and --steps > --warmup >= 1 "
             "(torch.compile compiles in the first warm-up step)")
    if args.peak_gflops is not None and args.peak_gflops <= 0:
        fail("--peak-gflops must be positive")
    if args.compile_timeout <= 0:
        fail("--compile-timeout must be positive")
    if not os.access(args.binary, os.X_OK):
        fail(f"{args.binary} is not an executable (samples/gpt of a CUDA build)")
    if args.data and not os.path.exists(args.data):
        fail(f"--data {args.data}: no such file or folder")
    probe = subprocess.run([args.torch_python, "-c",
                            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 77)"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if probe.returncode != 0:
        print(f"gpt_side_by_side: {args.torch_python} has no CUDA PyTorch (or no GPU is visible)", file=sys.stderr)
        return 77

    names = ["dp", "torch eager", "torch compile"]
    tps = {n: [] for n in names}
    ms = {n: [] for n in names}
    ratios = []
    unavailable = None
    mismatch = None
    meta = {}
    for rnd in range(args.rounds):
        d, dms, dp_summary, fpt = run_dp_cuda(args)
        config = dp_summary["config"]
        tps["dp"].append(d)
        ms["dp"].append(dms)
        e, ems, meta = run_torch_cuda(args, config, compiled=False)
        if meta.get("parameters") != dp_summary.get("parameters"):
            mismatch = (f"note: the models differ: dp {dp_summary.get('parameters')} parameters, "
                        f"PyTorch {meta.get('parameters')}")
        tps["torch eager"].append(e)
        ms["torch eager"].append(ems)
        line = f"round {rnd + 1}: dp {d:,.0f} tokens/s ({dms:.1f} ms) | torch eager {e:,.0f} ({ems:.1f} ms)"
        best = e
        if unavailable is None:
            try:
                c, cms, _ = run_torch_cuda(args, config, compiled=True)
                tps["torch compile"].append(c)
                ms["torch compile"].append(cms)
                best = max(e, c)
                line += f" | torch compile {c:,.0f} ({cms:.1f} ms)"
            except Unavailable as err:
                unavailable = str(err)
                tps["torch compile"], ms["torch compile"] = [], []
                line += f" | torch compile unavailable ({unavailable})"
        ratios.append(d / best)
        print(line + f" | dp / best {ratios[-1]:.2f}", file=sys.stderr, flush=True)

    med = statistics.median
    tps_med = {n: med(v) if v else None for n, v in tps.items()}
    ms_med = {n: med(v) if v else None for n, v in ms.items()}
    mfu = {n: (fpt * v / (args.peak_gflops * 1e9) if v is not None and args.peak_gflops else None)
           for n, v in tps_med.items()}
    torch_best = max((n for n in names[1:] if tps_med[n] is not None), key=lambda n: tps_med[n])
    ratio = tps_med["dp"] / tps_med[torch_best]
    params = meta.get("parameters")
    row = {"config": args.config, "shape": config, "parameters": params, "flops_per_token": fpt,
           "precision": args.precision, "batch": args.batch, "rounds": args.rounds, "steps": args.steps,
           "warmup": args.warmup, "gpu": meta.get("gpu"), "torch": meta.get("torch"),
           "fused_adamw": meta.get("fused_adamw"), "peak_gflops": args.peak_gflops, "tokens_per_sec": tps_med,
           "ms_per_step": ms_med, "mfu": mfu, "per_round": tps, "torch_best": torch_best,
           "dp_vs_torch_best": ratio, "per_round_dp_vs_best": ratios,
           "unavailable": {"torch compile": unavailable} if unavailable else {}, "mismatch": mismatch}
    if args.json:
        print(json.dumps(row))
        return 0
    prec = "bf16 autocast" if args.precision == "bf16" else "fp32"
    print(f"{meta.get('gpu')}, PyTorch {meta.get('torch')}; {args.config} shape ({config['n_layer']} layers, "
          f"{config['n_head']} heads, {config['n_embd']} wide, context {config['block_size']}, vocabulary "
          f"{config['vocab_size']}: {params / 1e6:.1f} M parameters); {prec}; batch {args.batch} x "
          f"{config['block_size']} tokens; {args.steps - args.warmup} timed steps after {args.warmup}; median of "
          f"{args.rounds} alternating rounds")
    print(f"{'contender':<15}{'tokens/s':>12}{'ms/step':>10}{'MFU':>8}")
    for n in names:
        if tps_med[n] is None:
            print(f"{n:<15}{'unavailable':>12}")
            continue
        m = f"{mfu[n] * 100:.1f}%" if mfu[n] is not None else "-"
        print(f"{n:<15}{tps_med[n]:>12,.0f}{ms_med[n]:>10.1f}{m:>8}")
    print(f"dp / PyTorch's best ({torch_best}) = {ratio:.2f} (per round {', '.join(f'{r:.2f}' for r in ratios)})")
    if unavailable:
        print(f"torch compile unavailable: {unavailable}")
    if mismatch:
        print(mismatch)
    if not args.peak_gflops:
        print("MFU: give --peak-gflops (the GPU's dense peak for the precision)")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default="build/samples/gpt/gpt")
    ap.add_argument("--torch-python", default=sys.executable)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="steps per run, the first --warmup not timed "
                    "(default 25; 30 with --device cuda)")
    ap.add_argument("--warmup", type=int, default=None, help="default 5; 10 with --device cuda")
    ap.add_argument("--batch", type=int, default=None, help="default 16; 8 with --device cuda")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu (default: the CPU comparison above) or cuda (one GPU)")
    ap.add_argument("--config", choices=["tiny", "gpt2-124m"], default=None,
                    help="dp's --config under --device cuda (default gpt2-124m)")
    ap.add_argument("--data", default=None, help="dp's corpus under --device cuda (default: dp's, the fortunes)")
    ap.add_argument("--peak-gflops", type=float, default=None,
                    help="under --device cuda: the GPU's dense peak GFLOP/s for the MFU (H100 SXM bf16: 989000)")
    ap.add_argument("--compile-timeout", type=float, default=480,
                    help="under --device cuda: seconds torch.compile's run may take before it counts as unavailable")
    ap.add_argument("--json", action="store_true", help="under --device cuda: one JSON object instead of the table")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    for name, cpu_default, cuda_default in (("steps", 25, 30), ("warmup", 5, 10), ("batch", 16, 8)):
        if getattr(args, name) is None:
            setattr(args, name, cuda_default if cuda else cpu_default)
    if cuda:
        args.config = args.config or "gpt2-124m"
        return main_cuda(args)
    given = [f for f, v in (("--config", args.config), ("--data", args.data), ("--peak-gflops", args.peak_gflops),
                            ("--json", args.json or None)) if v is not None]
    if given:
        ap.error(f"{', '.join(given)}: only with --device cuda (the CPU mode runs the tiny config on the fortunes)")

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
