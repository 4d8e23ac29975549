#!/usr/bin/env python3
"""Smoke test of samples/fashion_mnist_cnn: its JSON lines, its learning, its exit codes.

Usage: fashion_mnist_cnn_smoke.py BINARY

Runs the sample for a few steps in DDP mode on two CPU virtual devices and in single
mode, checks that every stdout line is a JSON object with the documented keys, that the
loss is finite and lower at the last step record than at the first, that test_accuracy
lies in [0, 1]; then checks that a bad flag exits with code 2 and a bad data directory
with code 1. Exits 77 (Meson's SKIP) when the Fashion-MNIST files are absent.
Needs only the standard library (no torch).
"""
import json
import math
import os
import subprocess
import sys

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)


def run_json(binary, args):
    cmd = [binary] + args
    print("running:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    check(proc.returncode == 0, f"{args}: exit code {proc.returncode}; stderr: {proc.stderr.strip()}")
    records = []
    for line in proc.stdout.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            check(False, f"{args}: stdout line is not JSON: {line!r}")
            continue
        check(isinstance(rec, dict), f"{args}: line is not a JSON object: {line!r}")
        records.append(rec)
    return records


def check_run(binary, args, mode, devices, precision="fp32"):
    recs = run_json(binary, args)
    steps = [r for r in recs if r.get("type") == "step"]
    epochs = [r for r in recs if r.get("type") == "epoch"]
    summary = [r for r in recs if r.get("type") == "summary"]
    check(len(steps) >= 2, f"{mode}: expected at least 2 step records, got {len(steps)}")
    check(len(epochs) == 1, f"{mode}: expected 1 epoch record, got {len(epochs)}")
    check(len(summary) == 1, f"{mode}: expected 1 summary record, got {len(summary)}")
    for r in recs:
        check(r.get("mode") == mode, f"{mode}: record has mode {r.get('mode')!r}")
        check(r.get("devices") == devices, f"{mode}: record has devices {r.get('devices')!r}")
        check(r.get("precision") == precision, f"{mode}: record has precision {r.get('precision')!r}")
    for r in steps:
        for k in ("step", "loss"):
            check(k in r, f"{mode}: step record lacks {k!r}: {r}")
        check(isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]),
              f"{mode}: loss not finite at step {r.get('step')}: {r.get('loss')!r}")
    if len(steps) >= 2 and all(isinstance(r.get("loss"), (int, float)) for r in steps):
        first, last = steps[0], steps[-1]
        check(last["step"] == 20, f"{mode}: last step record is step {last['step']}, expected 20")
        check(last["loss"] < first["loss"],
              f"{mode}: loss did not fall: step {first['step']} {first['loss']:.4f} -> "
              f"step {last['step']} {last['loss']:.4f}")
        print(f"  {mode}: loss {first['loss']:.4f} (step {first['step']}) -> "
              f"{last['loss']:.4f} (step {last['step']})")
    for r in epochs:
        for k in ("epoch", "train_loss", "test_accuracy", "samples_per_sec"):
            check(k in r, f"{mode}: epoch record lacks {k!r}: {r}")
        acc = r.get("test_accuracy")
        check(isinstance(acc, (int, float)) and 0.0 <= acc <= 1.0,
              f"{mode}: test_accuracy {acc!r} outside [0, 1]")
        tl = r.get("train_loss")
        check(isinstance(tl, (int, float)) and math.isfinite(tl), f"{mode}: train_loss {tl!r}")
        sps = r.get("samples_per_sec")
        check(isinstance(sps, (int, float)) and sps > 0, f"{mode}: samples_per_sec {sps!r}")
        print(f"  {mode}: test_accuracy {acc:.4f} after 20 steps, {sps:.0f} samples/s")


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    binary = sys.argv[1]
    data = os.environ.get("DP_DATA_DIR") or "/usr/share/datasets/fashion-mnist"
    if not os.path.exists(os.path.join(data, "train-images-idx3-ubyte.gz")) and \
            not os.path.exists(os.path.join(data, "train-images-idx3-ubyte")):
        print(f"SKIP: no Fashion-MNIST in {data}")
        return 77
    common = ["--max-steps", "20", "--epochs", "1", "--json", "--log-every", "5", "--data", data]
    check_run(binary, common + ["--mode", "ddp", "--devices", "0,1"], "ddp", [0, 1])
    check_run(binary, common + ["--mode", "single"], "single", [0])
    # The shared option spellings (samples/common/options.h): a count, the module path, Sharded.
    check_run(binary, common + ["--mode", "sharded", "--shard-stage", "1", "--devices", "2", "--path", "module"],
              "sharded", [0, 1])
    # bfloat16 autocast on two DDP workers: the loss falls as in float32.
    check_run(binary, common + ["--mode", "ddp", "--devices", "2", "--precision", "bf16"], "ddp", [0, 1], "bf16")
    # float16 with a GradScaler, on one device and through both DataParallel paths.
    check_run(binary, common + ["--mode", "single", "--precision", "fp16"], "single", [0], "fp16")
    check_run(binary, common + ["--mode", "sharded", "--devices", "2", "--precision", "fp16"], "sharded", [0, 1], "fp16")
    check_run(binary, common + ["--mode", "ddp", "--devices", "2", "--path", "module", "--precision", "fp16"], "ddp",
              [0, 1], "fp16")

    # Bad --devices, --path and --mode values: exit code 2 and a message naming the value.
    for flags, needle in ((["--devices", "0"], "--devices 0"), (["--devices", "0,0"], "appears twice"),
                          (["--devices", "x"], "'x' is not a number"), (["--devices", "0,99"], "out of range"),
                          (["--path", "worker-loss"], "worker-loss"), (["--mode", "zero"], "zero"),
                          (["--mode", "single", "--devices", "2"], "one device"),
                          (["--shard-stage", "3"], "3"), (["--precision", "fp8"], "fp8")):
        bad = subprocess.run([binary, "--max-steps", "1", "--data", data] + flags, capture_output=True, text=True,
                             timeout=60)
        check(bad.returncode == 2, f"{flags}: expected exit code 2, got {bad.returncode}")
        check(needle in bad.stderr + bad.stdout, f"{flags}: message lacks {needle!r}: {bad.stderr!r}")
    helptext = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    check("worker" in helptext and "module" in helptext and "sharded" in helptext, "--help lacks the shared values")

    bad = subprocess.run([binary, "--epochs", "zero"], capture_output=True, text=True, timeout=60)
    check(bad.returncode == 2, f"bad flag: expected exit code 2, got {bad.returncode}")
    check(bad.stderr.strip() != "", "bad flag: expected a message on stderr")
    bad = subprocess.run([binary, "--no-such-flag"], capture_output=True, text=True, timeout=60)
    check(bad.returncode == 2, f"unknown flag: expected exit code 2, got {bad.returncode}")
    bad = subprocess.run([binary, "--data", "/nonexistent/fashion-mnist", "--max-steps", "1"],
                         capture_output=True, text=True, timeout=60)
    check(bad.returncode == 1, f"bad data dir: expected exit code 1, got {bad.returncode}")
    check("/nonexistent/fashion-mnist" in bad.stderr, f"bad data dir: message lacks the path: {bad.stderr!r}")

    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
