#!/usr/bin/env python3
"""Runs the GPT sample in short modes and checks what it prints and saves.

usage: check_gpt.py EXE OUT_DIR

Checks, on a small GPT (2 layers, width 32, context 32) and a corpus written here:
- every design (single; dp, ddp, sharded stages 1-3 on 2 devices) prints the JSON
  records with their keys; the designs' losses are bitwise equal, and within float
  rounding of one device's;
- the loss falls over a short run;
- a run stopped at step 4 and resumed from its checkpoint ends with the bits of an
  uninterrupted run (optimizer state, lr schedule and data stream restored);
- --generate samples the asked number of characters from the checkpoint;
- bad input exits non-zero with a message: a missing, empty or binary corpus, a corpus
  too short for the context, a width the heads do not divide, a prompt outside the
  vocabulary, --generate or --resume without --checkpoint, a file that is not this
  sample's checkpoint, bad flags.
"""
import json
import math
import os
import subprocess
import sys

failures = []
SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch", "6",
         "--eval-iters", "1", "--log-every", "1", "--warmup", "2", "--json"]


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(exe, *args, timeout=240):
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode not in (0, 1, 2):
        sys.stderr.write(r.stderr)
    return r


def records(r, what):
    out = []
    for line in r.stdout.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            check(False, f"{what}: not JSON: {line[:120]}")
    return out


def summary(exe, what, *args):
    r = run(exe, *SMALL, *args)
    check(r.returncode == 0, f"{what}: exit {r.returncode}: {r.stderr[-400:]}")
    recs = records(r, what)
    steps = [o for o in recs if o.get("type") == "step"]
    sums = [o for o in recs if o.get("type") == "summary"]
    check(len(sums) == 1, f"{what}: {len(sums)} summary records")
    for o in steps:
        for k in ("step", "loss", "lr", "ms", "tokens_per_sec", "mfu", "flops_per_token", "mode", "devices"):
            check(k in o, f"{what}: step record lacks '{k}'")
    check(all(math.isfinite(o["loss"]) for o in steps), f"{what}: non-finite loss")
    return (sums[0] if sums else {}), steps


def main():
    exe, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    corpus = os.path.join(out, "corpus.txt")
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}\n" for i in range(400)]
    with open(corpus, "w") as f:
        f.write("".join(lines))
    data = ["--data", corpus]

    # Every design on 2 devices against one device.
    single, _ = summary(exe, "single", *data, "--steps", "5")
    losses = {}
    for mode in (["dp"], ["ddp"], ["sharded", "--shard-stage", "1"], ["sharded", "--shard-stage", "2"],
                 ["sharded", "--shard-stage", "3"]):
        name = " ".join(mode)
        s, steps = summary(exe, name, *data, "--steps", "5", "--mode", *mode, "--devices", "2")
        losses[name] = [o["loss"] for o in steps]
        if s and single:
            check(abs(s["final_loss"] - single["final_loss"]) < 1e-4,
                  f"{name}: final loss {s['final_loss']} vs one device's {single['final_loss']}")
            check(len(s.get("peak_bytes_per_device", [])) == 2, f"{name}: peak_bytes_per_device")
    first = losses.get("dp")
    for name, ls in losses.items():
        check(ls == first, f"{name}: losses {ls} differ from DP's {first}")

    # The loss falls.
    s, _ = summary(exe, "falls", *data, "--steps", "40", "--lr", "3e-3", "--eval-interval", "40")
    if s:
        check(s["final_loss"] < s["first_loss"] - 0.5, f"loss did not fall: {s['first_loss']} -> {s['final_loss']}")
        check(s.get("val_loss", math.inf) < s["first_loss"], "validation loss did not fall")

    # Stopped and resumed = uninterrupted.
    ckpt = os.path.join(out, "run.ckpt")
    whole, _ = summary(exe, "whole", *data, "--steps", "8", "--mode", "ddp", "--devices", "2")
    part, _ = summary(exe, "part", *data, "--steps", "8", "--stop-at", "4", "--mode", "ddp", "--devices", "2",
                      "--checkpoint", ckpt)
    check(part.get("steps") == 4, f"stopped run: steps {part.get('steps')}")
    rest, _ = summary(exe, "resumed", *data, "--steps", "8", "--mode", "sharded", "--shard-stage", "3",
                      "--devices", "2", "--checkpoint", ckpt, "--resume")
    check(rest.get("trained_steps") == 4 and rest.get("steps") == 8, f"resumed run: {rest}")
    check(rest.get("final_loss") == whole.get("final_loss"),
          f"resumed final loss {rest.get('final_loss')} != uninterrupted {whole.get('final_loss')}")

    # Sampling from the checkpoint.
    r = run(exe, "--checkpoint", ckpt, "--generate", "50", "--prompt", "line", "--json")
    check(r.returncode == 0, f"--generate: exit {r.returncode}: {r.stderr[-300:]}")
    recs = records(r, "--generate")
    text = recs[0].get("text", "") if recs else ""
    check(len(text) == len("line") + 50 and text.startswith("line"), f"--generate text: {text!r}")

    # Bad input.
    empty = os.path.join(out, "empty.txt")
    open(empty, "w").close()
    binary = os.path.join(out, "binary.txt")
    with open(binary, "wb") as f:
        f.write(b"text\x00more text" * 100)
    short = os.path.join(out, "short.txt")
    with open(short, "w") as f:
        f.write("too short a corpus")
    bad = [
        (["--data", os.path.join(out, "missing.txt")], 1, "expected a text file"),
        (["--data", empty], 1, "empty"),
        (["--data", binary], 1, "NUL byte"),
        (["--data", short], 1, "expected a corpus of more than"),
        ([*data, "--n-embd", "30", "--n-head", "4"], 1, "divisible by the heads"),
        (["--checkpoint", ckpt, "--generate", "5", "--prompt", "\u00e9"], 1, "vocabulary"),
        (["--generate", "5"], 2, "needs --checkpoint"),
        (["--resume"], 2, "needs --checkpoint"),
        ([*data, "--resume", "--checkpoint", corpus], 1, ""),
        (["--mode", "fsdp"], 2, ""),
        (["--shard-stage", "4"], 2, ""),
        (["--mode", "single", "--devices", "2"], 2, "one device"),
        (["--bogus"], 2, ""),
    ]
    for args, code, words in bad:
        r = run(exe, *args)
        check(r.returncode == code and r.stderr.strip() and words in r.stderr,
              f"{args}: exit {r.returncode} (expected {code}), stderr {r.stderr.strip()[-200:]!r}")
    r = run(exe, "--help")
    check(r.returncode == 0 and "--shard-stage" in r.stdout, "--help")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
