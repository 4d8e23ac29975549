#!/usr/bin/env python3
"""Training throughput of samples/fashion_mnist_cnn against PyTorch, or across dp's modes,
measured in ONE run with the contenders alternating (A, B, A, B, ...) to cancel drift.

  # dp (one device) vs PyTorch (2 threads), same CNN, batch 256, Adam 1e-3:
  python3 bench/side_by_side.py --binary build-fm/samples/fashion_mnist_cnn/fashion_mnist_cnn
  # dp DDP on 2 devices vs PyTorch DDP (gloo, 2 processes x 1 thread); --precision bf16
  # puts both in bf16 (dp's autocast policy, PyTorch's CPU autocast):
  python3 bench/side_by_side.py --compare ddp
  # single vs DP vs DDP on 2 CPU virtual devices (same global batch):
  python3 bench/side_by_side.py --compare modes --devices 0,1
  # MLP 784-1024-1024-10, batch 512, SGD: dp's step against the GEMM ceiling of its shapes
  # and against PyTorch's own step (best environment)
  python3 bench/side_by_side.py --compare mlp

PyTorch runs twice per round: in the environment it is given ("default") and in the best
one we know for it on this CPU ("best"), so a ratio against PyTorch is never against a
handicapped PyTorch:
  - its BLAS is checked: the library loaded for torch.mm must be OpenBLAS (Debian's
    python3-torch otherwise falls back to the reference BLAS, ~3 GFLOP/s), and the
    1024x1024 matmul rate is printed;
  - OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning against the
    other contender's or the other rank's threads;
  - MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_ large: glibc keeps
    freed activations instead of an mmap/munmap and page faults per tensor per step
    (dp's CPU backend caches its blocks itself and needs none of this);
  - OPENBLAS_CORETYPE=SkylakeX, only on CPUs with AVX-512 (/proc/cpuinfo flag avx512f):
    Debian's OpenBLAS misdetects some of them and runs its Haswell kernels;
  - channels_last (model and batches), and with --precision bf16 its bf16 autocast over
    the forward and the loss (dp's --precision bf16 is the same policy);
  - the same thread count on both sides (OMP_NUM_THREADS and torch.set_num_threads =
    --threads; dp's device gets the same cores), and both pinned (taskset) to the same
    CPUs 0..threads-1.

--compare mlp sets dp's MLP step (samples/dp_vs_ddp --model mlp --optimizer sgd --devices
1) against the ceiling of its GEMMs: the eight GEMMs a step issues, each timed as dp runs
it, as one dnnl_sgemm call and as oneDNN's matmul primitive (bench/mlp_ceiling, which
alternates them) and as torch.mm (bench/pytorch/mlp_gemms_torch.py, PyTorch's best
environment, when --torch-python has torch); per round, ceiling = sum of flops / sum over
the GEMMs of the least time any of them took, and dp's step GFLOP/s = the same flops /
its whole step's time (so everything else the step does counts against it). The old
figure, kernels_bench's "gemm 512x1024x1024" (N,N, dp's way) is printed too, labelled.
mlp_ceiling's SGD rows (the update vs a stream loop and memcpy) are printed with it.

--compare torch also prints dp's CNN step as a fraction of the machine's measured FMA
peak: bench/fma_peak (independent multiply-add chains in the widest vectors the CPU
has) on the same pinned CPUs, before and after the rounds, the better of the two; the
step's flops are counted per layer (cnn_step_gflop: 6.40 GFLOP at batch 256).

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
import shutil
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


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def pinned(args, cmd, cpus=None):
    """cmd under taskset on CPUs 0..cpus-1 (default --threads), when --pin and taskset exist."""
    n = cpus or args.threads
    if not args.pin or n > (os.cpu_count() or 1) or not shutil.which("taskset"):
        return cmd
    return ["taskset", "-c", f"0-{n - 1}"] + cmd


def torch_env(args, best, threads):
    """PyTorch's environment: the inherited one ('default') or the best one (module doc)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if best:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        big = str(1 << 30)  # 1 GiB: above every activation of these models
        env["MALLOC_MMAP_THRESHOLD_"] = big
        env["MALLOC_TRIM_THRESHOLD_"] = big
        env["MALLOC_TOP_PAD_"] = str(256 << 20)
        if "avx512f" in cpu_flags():
            env["OPENBLAS_CORETYPE"] = "SkylakeX"
        else:
            env.pop("OPENBLAS_CORETYPE", None)
    return env


BLAS_PROBE = r"""
import json, time, torch
torch.set_num_threads(%d)
a = torch.randn(1024, 1024); b = torch.randn(1024, 1024)
for _ in range(3): a @ b
t = time.perf_counter(); n = 10
for _ in range(n): a @ b
dt = (time.perf_counter() - t) / n
libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if "blas" in l.lower() and ".so" in l})
print(json.dumps({"gflops": 2 * 1024 ** 3 / dt / 1e9, "libs": libs, "torch": torch.__version__}))
"""


def check_torch_blas(args, best):
    """Which BLAS torch.mm runs on, and how fast; exits when it is the reference BLAS."""
    cmd = pinned(args, [args.torch_python, "-c", BLAS_PROBE % args.threads])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=torch_env(args, best, args.threads))
    if proc.returncode != 0:
        sys.exit(f"torch BLAS probe failed: {proc.stderr}")
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    openblas = any("openblas" in lib for lib in rec["libs"])
    print(f"torch {rec['torch']} ({'best' if best else 'default'} env): 1024x1024 matmul "
          f"{rec['gflops']:.1f} GFLOP/s on {args.threads} threads; BLAS {', '.join(rec['libs']) or 'none found'}",
          flush=True)
    if not openblas and not args.allow_reference_blas:
        sys.exit("torch is not using OpenBLAS (install libopenblas0-pthread, or pass "
                 "--allow-reference-blas to compare anyway)")
    return rec


def check_run(cmd, env=None):
    """Runs cmd (output captured); exits naming the command and its stderr when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    return proc


def run_dp(args, mode, devices, binary=None):
    cmd = [binary or args.binary, "--max-steps", str(args.steps), "--epochs", "1", "--json",
           "--log-every", str(args.warmup), "--batch", str(args.batch), "--mode", mode,
           "--devices", devices, "--path", args.path, "--no-eval", "--precision", args.precision]
    if args.data:
        cmd += ["--data", args.data]
    cmd = pinned(args, cmd, os.cpu_count() if mode != "single" else None)
    proc = check_run(cmd)
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


def run_torch(args, best):
    script = os.path.join(HERE, "pytorch", "fashion_cnn_torch.py")
    cmd = [args.torch_python, script, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--threads", str(args.threads), "--json"]
    if args.precision == "bf16":
        cmd.append("--bf16")  # torch.autocast('cpu', bfloat16) over the forward and the loss
    if best:
        cmd.append("--channels-last")
    if args.data:
        cmd += ["--data", args.data]
    cmd = pinned(args, cmd)
    proc = check_run(cmd, env=torch_env(args, best, args.threads))
    rec = [json.loads(l) for l in proc.stdout.splitlines() if l.strip()][-1]
    return {"ms_per_step": rec["ms_per_step"], "samples_per_sec": rec["samples_per_sec"],
            "cmd": " ".join(cmd)}


def run_torch_ddp(args, best):
    """PyTorch DDP (gloo), --ddp-procs processes x 1 thread (bench/pytorch/ddp_gloo.py)."""
    script = os.path.join(HERE, "pytorch", "ddp_gloo.py")
    procs = len(args.devices.split(","))
    cmd = [args.torch_python, script, "--procs", str(procs), "--threads", "1", "--batch", str(args.batch),
           "--steps", str(args.steps - args.warmup), "--warmup", str(args.warmup)]
    if args.precision == "bf16":
        cmd.append("--bf16")
    if best:
        cmd.append("--channels-last")
    cmd = pinned(args, cmd, os.cpu_count())
    proc = check_run(cmd, env=torch_env(args, best, 1))
    rec = [json.loads(l) for l in proc.stdout.splitlines() if l.strip().startswith("{")][-1]
    return {"ms_per_step": rec["ms_per_step"], "samples_per_sec": rec["samples_per_sec"],
            "cmd": " ".join(cmd)}


# MLP 784-1024-1024-10: flops of one training step of B rows. Forward 2*B*sum(in*out);
# backward twice that, less the first layer's input gradient (nobody needs it).
MLP_LAYERS = [(784, 1024), (1024, 1024), (1024, 10)]


def cnn_step_gflop(batch):
    """Flops of one Fashion-MNIST CNN training step (docs/BENCHMARKS.md): the forward,
    twice its GEMM-like work back (input and weight gradients) except conv1's input
    gradient, which is never computed."""
    conv1 = 2 * batch * 32 * 28 * 28 * 9
    conv2 = 2 * batch * 64 * 14 * 14 * 32 * 9
    fc1 = 2 * batch * 3136 * 128
    fc2 = 2 * batch * 128 * 10
    return (conv1 + conv2 + fc1 + fc2 + 2 * (conv2 + fc1 + fc2) + conv1) / 1e9


def fma_peak(args):
    """bench/fma_peak on the CPUs dp runs on: the measured fp32 multiply-add peak
    (GFLOP/s), or None where it was not built."""
    exe = os.path.join(args.build, "bench", "fma_peak")
    if not os.path.exists(exe):
        return None
    proc = check_run(pinned(args, [exe, "--threads", str(args.threads), "--json"]))
    return json.loads(proc.stdout.strip().splitlines()[-1])["gflops"]


def mlp_step_gflop(batch):
    fwd = sum(2 * batch * i * o for i, o in MLP_LAYERS)
    return (3 * fwd - 2 * batch * MLP_LAYERS[0][0] * MLP_LAYERS[0][1]) / 1e9


def run_dp_mlp(args):
    """dp's MLP step (samples/dp_vs_ddp --model mlp, single device, SGD momentum)."""
    cmd = [os.path.join(args.build, "samples", "dp_vs_ddp", "dp_vs_ddp"), "--model", "mlp",
           "--optimizer", "sgd", "--batch", str(args.batch), "--devices", "1",
           "--steps", str(args.steps - args.warmup), "--warmup", str(args.warmup), "--json"]
    cmd = pinned(args, cmd)
    proc = check_run(cmd)
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("mode") == "single":
                sps = rec["samples_per_s"]
                ms = args.batch * 1e3 / sps
                return {"ms_per_step": ms, "samples_per_sec": sps,
                        "gflops": mlp_step_gflop(args.batch) * 1e3 / ms, "cmd": " ".join(cmd)}
    sys.exit(f"no single-device record from {' '.join(cmd)}")


def mlp_gemms(batch):
    """The step's GEMMs in order, as bench/mlp_ceiling.cpp lists them (row-major, C = op(A) op(B))."""
    names = ["fc1", "fc2", "fc3"]
    out = [{"name": f"{names[l]} forward", "ta": False, "tb": True, "m": batch, "n": o, "k": i}
           for l, (i, o) in enumerate(MLP_LAYERS)]
    for l in (2, 1, 0):
        i, o = MLP_LAYERS[l]
        if l > 0:  # the first layer's input gradient is never computed
            out.append({"name": f"{names[l]} grad input", "ta": False, "tb": False, "m": batch, "n": i, "k": o})
        out.append({"name": f"{names[l]} grad weight", "ta": True, "tb": False, "m": o, "n": i, "k": batch})
    return out


def gemm_flops(g):
    return 2 * g["m"] * g["n"] * g["k"]


def gemm_result(args, ms_by_name, extra):
    """A contender's record from per-GEMM times: the step's GEMMs alone at these rates."""
    ms = sum(ms_by_name[g["name"]] for g in mlp_gemms(args.batch))
    flops = sum(gemm_flops(g) for g in mlp_gemms(args.batch))
    rec = {"ms_per_step": ms, "samples_per_sec": args.batch * 1e3 / ms, "gflops": flops / (ms * 1e6)}
    rec.update(extra)
    return rec


def run_mlp_ceiling(args):
    """bench/mlp_ceiling: the step's GEMMs as dp, dnnl_sgemm and the matmul primitive run them."""
    cmd = [os.path.join(args.build, "bench", "mlp_ceiling"), "--threads", str(args.threads),
           "--batch", str(args.batch), "--min-ms", "300", "--json"]
    cmd = pinned(args, cmd)
    proc = check_run(cmd)
    rec = json.loads(proc.stdout)
    want = [(g["name"], g["ta"], g["tb"], g["m"], g["n"], g["k"]) for g in mlp_gemms(args.batch)]
    got = [(g["name"], g["ta"], g["tb"], g["m"], g["n"], g["k"]) for g in rec["gemms"]]
    if got != want:
        sys.exit(f"mlp_ceiling's GEMMs differ from this script's list:\n{got}\n{want}")
    ways = {g["name"]: {w: v["ms"] for w, v in g["ways"].items()} for g in rec["gemms"]}
    best = {name: min(v.values()) for name, v in ways.items()}
    return gemm_result(args, best, {"ways": ways, "sgd": rec["sgd"], "cmd": " ".join(cmd)})


def run_torch_gemms(args):
    """torch.mm on the same GEMMs, PyTorch's best environment (bench/pytorch/mlp_gemms_torch.py)."""
    script = os.path.join(HERE, "pytorch", "mlp_gemms_torch.py")
    cmd = [args.torch_python, script, "--threads", str(args.threads), "--min-ms", "300",
           "--gemms", json.dumps(mlp_gemms(args.batch))]
    cmd = pinned(args, cmd)
    proc = check_run(cmd, env=torch_env(args, True, args.threads))
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    ms = {name: v["ms"] for name, v in rec["gemms"].items()}
    return gemm_result(args, ms, {"ways": {name: {"torch": v} for name, v in ms.items()},
                                  "cmd": " ".join(cmd)})


def run_torch_mlp(args):
    """PyTorch's own MLP step, best environment (bench/pytorch/mlp_torch.py)."""
    script = os.path.join(HERE, "pytorch", "mlp_torch.py")
    cmd = [args.torch_python, script, "--batch", str(args.batch), "--threads", str(args.threads),
           "--steps", str(args.steps - args.warmup), "--warmup", str(args.warmup)]
    cmd = pinned(args, cmd)
    proc = check_run(cmd, env=torch_env(args, True, args.threads))
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"ms_per_step": rec["ms_per_step"], "samples_per_sec": rec["samples_per_sec"],
            "gflops": rec["gflops"], "cmd": " ".join(cmd)}


def torch_importable(args):
    proc = subprocess.run([args.torch_python, "-c", "import torch"], capture_output=True, text=True)
    return proc.returncode == 0


def report_mlp(args, results):
    """Per GEMM and way the median GFLOP/s; per round the ceiling; dp's step against it."""
    gemms = mlp_gemms(args.batch)
    flops = sum(gemm_flops(g) for g in gemms)
    sources = [n for n in ("gemms", "torch gemms") if n in results]
    rounds = len(results["dp mlp"])
    ceilings, ratios = [], []
    for r in range(rounds):
        best = 0.0
        for g in gemms:
            best += min(ms for n in sources for ms in results[n][r]["ways"][g["name"]].values())
        ceilings.append(flops / (best * 1e6))
        ratios.append(results["dp mlp"][r]["gflops"] / ceilings[-1])
    ways = [w for n in sources for w in results[n][0]["ways"][gemms[0]["name"]]]
    print(f"\nGFLOP/s per GEMM, median of {rounds} rounds (each the best batch of its run), {args.threads} threads:")
    print(f"{'gemm':16s} {'op shape (m x n x k)':22s}" + "".join(f" {w:>8s}" for w in ways) + "    best")
    for g in gemms:
        row, top = [], 0.0
        for n in sources:
            for w in results[n][0]["ways"][g["name"]]:
                gf = statistics.median(gemm_flops(g) / (x["ways"][g["name"]][w] * 1e6) for x in results[n])
                row.append(gf)
                top = max(top, gf)
        shape = f"{'T' if g['ta'] else 'N'},{'T' if g['tb'] else 'N'} {g['m']}x{g['n']}x{g['k']}"
        print(f"{g['name']:16s} {shape:22s}" + "".join(f" {x:8.1f}" for x in row) + f"  {top:6.1f}")
    dp_g = statistics.median(x["gflops"] for x in results["dp mlp"])
    ceil = statistics.median(ceilings)
    print(f"\nceiling: {flops / 1e9:.3f} GFLOP of GEMMs per step at the best way per GEMM and round = "
          f"{ceil:.1f} GFLOP/s (median; rounds {', '.join(f'{c:.1f}' for c in ceilings)})")
    print(f"dp MLP step {dp_g:.1f} GFLOP/s ({mlp_step_gflop(args.batch):.3f} GFLOP/step) = "
          f"{dp_g / ceil:.3f} of the ceiling (per round {', '.join(f'{x:.3f}' for x in ratios)}; target >= 0.85)")
    if "torch mlp" in results:
        t_g = statistics.median(x["gflops"] for x in results["torch mlp"])
        t_ratios = [results["torch mlp"][r]["gflops"] / ceilings[r] for r in range(rounds)]
        print(f"PyTorch's MLP step (best env) {t_g:.1f} GFLOP/s = {t_g / ceil:.3f} of the ceiling (per round "
              f"{', '.join(f'{x:.3f}' for x in t_ratios)}); dp / PyTorch = {dp_g / t_g:.3f}")
    if "sgemm 512^3" in results:
        old = statistics.median(x["gflops"] for x in results["sgemm 512^3"])
        print(f"(old figure, kept for continuity: kernels_bench 'gemm 512x1024x1024' (N,N, dp's way) "
              f"{old:.1f} GFLOP/s; dp's step = {dp_g / old:.3f} of it)")
    sgd = [x["sgd"] for x in results["gemms"]]
    gb = {w: statistics.median(s["bytes"] / (s["ways"][w]["ms"] * 1e6) for s in sgd) for w in sgd[0]["ways"]}
    print(f"\nSGD momentum step, {sgd[0]['params']} parameters, {sgd[0]['bytes'] / 1e6:.1f} MB read + written: "
          + ", ".join(f"{w} {v:.1f} GB/s" for w, v in gb.items()))
    print(f"sgd_step / stream = {gb['sgd_step'] / gb['stream']:.3f}, sgd_step / memcpy = "
          f"{gb['sgd_step'] / gb['memcpy']:.3f}  (median of {rounds}; bench/mlp_ceiling.cpp defines both)")
    return {"ceiling_gflops": ceil, "dp_gflops": dp_g, "ratio": dp_g / ceil, "ratios": ratios,
            "ceilings": ceilings, "sgd_gbps": gb}


def run_sgemm(args):
    """The old ceiling: dp's sgemm 512x1024x1024 (N,N) on the same threads (bench/kernels_bench)."""
    cmd = [os.path.join(args.build, "bench", "kernels_bench"), "--filter", "gemm 512x1024x1024",
           "--threads", str(args.threads), "--min-ms", "300", "--json"]
    cmd = pinned(args, cmd)
    proc = check_run(cmd)
    rows = json.loads(proc.stdout)
    g = rows[0]["gflops"]
    ms = mlp_step_gflop(args.batch) / g * 1e3  # the step if every flop ran at sgemm's rate
    return {"ms_per_step": ms, "samples_per_sec": args.batch * 1e3 / ms, "gflops": g,
            "cmd": " ".join(cmd)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default=os.path.join(ROOT, "build-fm", "samples", "fashion_mnist_cnn",
                                                     "fashion_mnist_cnn"))
    ap.add_argument("--compare", choices=["torch", "ddp", "modes", "mlp"], default="torch")
    ap.add_argument("--build", default="", help="build dir of --compare mlp (default: --binary's)")
    ap.add_argument("--torch-env", choices=["default", "best", "both"], default="both",
                    help="PyTorch's environment(s) (see the module doc)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="taskset every contender to the same CPUs")
    ap.add_argument("--allow-reference-blas", action="store_true")
    ap.add_argument("--baseline", default="", help="another fashion_mnist_cnn binary (e.g. an older "
                    "build) run as one more contender, 'dp before' (--compare torch or ddp)")
    ap.add_argument("--devices", default="0,1", help="devices of the dp/ddp runs (--compare modes)")
    ap.add_argument("--path", default="worker", choices=["worker", "module"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="--compare torch|ddp: dp's --precision, and PyTorch's bf16 autocast for bf16")
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

    if not args.build:
        args.build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(args.binary))))
    if args.compare == "mlp" and args.batch == 256 and "--batch" not in sys.argv:
        args.batch = 512
    print(f"CPU: {cpu_model()} ({os.cpu_count()} CPUs); load {loadavg():.2f}", flush=True)
    envs = {"default": [False], "best": [True], "both": [False, True]}[args.torch_env]
    if args.compare in ("torch", "ddp"):
        for best in envs:
            check_torch_blas(args, best)
    tag = {False: "default", True: "best"}
    if args.compare == "torch":
        contenders = [("dp single", lambda: run_dp(args, "single", "1"))]
        if args.baseline:
            contenders.append(("dp before", lambda: run_dp(args, "single", "1", args.baseline)))
        contenders += [(f"torch {tag[b]}", lambda b=b: run_torch(args, b)) for b in envs]
    elif args.compare == "ddp":
        contenders = [("dp ddp", lambda: run_dp(args, "ddp", args.devices))]
        if args.baseline:
            contenders.append(("dp before", lambda: run_dp(args, "ddp", args.devices, args.baseline)))
        contenders += [(f"torch ddp {tag[b]}", lambda b=b: run_torch_ddp(args, b)) for b in envs]
    elif args.compare == "mlp":
        contenders = [("dp mlp", lambda: run_dp_mlp(args)), ("gemms", lambda: run_mlp_ceiling(args))]
        if torch_importable(args):
            check_torch_blas(args, True)
            contenders.append(("torch gemms", lambda: run_torch_gemms(args)))
            contenders.append(("torch mlp", lambda: run_torch_mlp(args)))
        else:
            print(f"{args.torch_python} has no torch: the ceiling is oneDNN's alone", flush=True)
        contenders.append(("sgemm 512^3", lambda: run_sgemm(args)))
    else:
        contenders = [("single", lambda: run_dp(args, "single", "1")),  # one device: device 0
                      ("dp", lambda: run_dp(args, "dp", args.devices)),
                      ("ddp", lambda: run_dp(args, "ddp", args.devices))]

    # The measured FMA peak before and after the rounds (the best of the two): the
    # CNN step's fraction of it (--compare torch).
    peaks = [fma_peak(args)] if args.compare == "torch" else []
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
    base = names[-1] if args.compare in ("torch", "ddp") else names[1] if args.compare == "mlp" else names[0]
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
    if args.compare in ("torch", "ddp"):
        print()
        for n in names[1:]:
            print(f"{names[0]} / {n} samples/s = {med[names[0]] / med[n]:.3f}  (>1: dp faster)")
    if peaks and peaks[0] is not None:
        peaks.append(fma_peak(args))
        peak = max(peaks)
        gflop = cnn_step_gflop(args.batch)
        ms = args.batch * 1e3 / med[names[0]]
        out["fma_peak_gflops"] = peak
        out["fraction_of_fma_peak"] = gflop / ms * 1e3 / peak
        print(f"dp's step {gflop:.2f} GFLOP / {ms:.1f} ms = {gflop / ms * 1e3:.1f} GFLOP/s = "
              f"{100 * out['fraction_of_fma_peak']:.1f} % of the measured FMA peak, {peak:.1f} GFLOP/s on "
              f"{args.threads} threads (bench/fma_peak; {', '.join(f'{p:.1f}' for p in peaks)})")
    if args.compare == "mlp":
        out["mlp"] = report_mlp(args, results)
    elif args.compare == "modes":
        print(f"\nDP / single = {med['dp'] / med['single']:.3f}, DDP / single = {med['ddp'] / med['single']:.3f}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
