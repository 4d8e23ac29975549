#!/usr/bin/env python3
"""Writes tests/nn/golden_amp.safetensors: PyTorch's results under bfloat16 autocast.

tests/nn/golden_amp_test.cpp builds the same networks with dp::nn, loads the batches and
initial states from this file and compares, under dp::amp::autocast(BFloat16), the
logits, the loss, every gradient and the parameters after 3 Adam steps with PyTorch's
under torch.autocast("cpu", torch.bfloat16). The test needs no Python; this script is
only run to regenerate the file, with a PyTorch 2.x (the PyPI wheel):

    python3 scripts/make_golden_amp.py            # from the repository root

Seeds are fixed and torch runs on one thread, so a rerun writes the same bytes.

Two networks (torch.nn.Sequential; dp's Sequential names children "0", "1", ... alike):
  cnn: 0 Conv2d(1, 4, 3, padding=1, bias=False)  1 BatchNorm2d(4)  2 ReLU  3 MaxPool2d(2)
       4 Conv2d(4, 8, 3, padding=1, bias=False)  5 BatchNorm2d(8)  6 ReLU  7 MaxPool2d(2)
       8 Flatten  9 Linear(72, 10)                     input (8, 1, 12, 12)
  mlp: 0 Linear(20, 32)  1 ReLU  2 Linear(32, 32)  3 ReLU  4 Linear(32, 10)   input (16, 20)
Tensors, per network <n> (cnn or mlp):
  <n>.input, <n>.target        the batch (F32, I64)
  <n>.init.<name>              the state_dict before training (F32)
  <n>.logits, <n>.loss         one train-mode forward under autocast: the bfloat16
                               logits widened to F32, the float32 loss
  <n>.grad.<parameter>         the gradients of that loss (float32: master weights)
  <n>.adam.<name>              the state_dict after 3 Adam steps, each zero_grad, forward
                               and loss under autocast, backward, step
The fp16 case (the MLP under torch.autocast("cpu", torch.float16) with a GradScaler of
init_scale 2^10, growth 2^30 after every good step, backoff 2^-30; Adam as above), 6
steps, each zero_grad, forward and loss under autocast, scaler.scale(loss).backward(),
scaler.step, scaler.update. The scale alternates: 2^10 (the scaled gradients stay far
below float16's 65504: stepped, the scale grows to 2^40), 2^40 (the logits' gradients
alone reach ~2^36: inf in float16, skipped, back to 2^10), ... No decision lies near
float16's limit, so rounding cannot change one:
  fp16.input, fp16.target      the batches, (6, 16, 20) and (6, 16)
  fp16.init.<name>             the MLP's state before training
  fp16.scale                   (6) the scale after each update
  fp16.skipped                 (6) 1 where the step was skipped, else 0 (int64)
  fp16.adam.<name>             the state_dict after the 6 steps
"""
import argparse
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from make_golden import safetensors_bytes  # scripts/make_golden.py: the same F32/I64 encoding

SEED = 3
STEPS = 3
ADAM = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "nn" / "golden_amp.safetensors"


def make_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(72, 10))


def make_mlp():
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def run(make, x, y):
    model = make()
    with torch.no_grad():  # BatchNorm's affine parameters away from 1 and 0
        for m in model:
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    init = {n: t.detach().clone() for n, t in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    first = None
    for step in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
        loss.backward()
        if step == 0:
            first = dict(logits=logits.detach().float(), loss=loss.detach().clone(),
                         grads={n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return init, first, {n: t.detach().clone() for n, t in model.state_dict().items()}


FP16_STEPS = 6
FP16_SCALER = dict(init_scale=2.0**10, growth_factor=2.0**30, backoff_factor=2.0**-30, growth_interval=1)


def run_fp16(xs, ys):
    model = make_mlp()
    init = {n: t.detach().clone() for n, t in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    scaler = torch.amp.GradScaler("cpu", **FP16_SCALER)
    scales, skipped = [], []
    for step in range(FP16_STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(xs[step])
            loss = F.cross_entropy(logits, ys[step])
        assert logits.dtype == torch.float16 and loss.dtype == torch.float32
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(int(scaler.get_scale() < before))
    return init, scales, skipped, {n: t.detach().clone() for n, t in model.state_dict().items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    tensors = {}
    for name, make, x, y in (("cnn", make_cnn, torch.randn(8, 1, 12, 12), torch.randint(0, 10, (8,))),
                             ("mlp", make_mlp, torch.randn(16, 20), torch.randint(0, 10, (16,)))):
        init, first, adam = run(make, x, y)
        tensors[f"{name}.input"], tensors[f"{name}.target"] = x, y
        tensors.update({f"{name}.init.{n}": t for n, t in init.items() if t.dtype == torch.float32})
        tensors[f"{name}.logits"], tensors[f"{name}.loss"] = first["logits"], first["loss"]
        tensors.update({f"{name}.grad.{n}": g for n, g in first["grads"].items()})
        tensors.update({f"{name}.adam.{n}": t for n, t in adam.items() if t.dtype == torch.float32})
        print(f"{name}: loss {first['loss'].item():.6f}")
    xs, ys = torch.randn(FP16_STEPS, 16, 20), torch.randint(0, 10, (FP16_STEPS, 16))
    init, scales, skipped, adam = run_fp16(xs, ys)
    assert skipped == [0, 1, 0, 1, 0, 1], skipped
    tensors["fp16.input"], tensors["fp16.target"] = xs, ys
    tensors.update({f"fp16.init.{n}": t for n, t in init.items()})
    tensors["fp16.scale"] = torch.tensor(scales, dtype=torch.float32)
    tensors["fp16.skipped"] = torch.tensor(skipped, dtype=torch.int64)
    tensors.update({f"fp16.adam.{n}": t for n, t in adam.items()})
    print(f"fp16: scales {scales}, skipped {skipped}")
    metadata = {"format": "pt", "seed": str(SEED), "steps": str(STEPS), "autocast": "cpu bfloat16",
                "generated_by": f"scripts/make_golden_amp.py (torch {torch.__version__}); do not edit, rerun it",
                "adam.lr": repr(ADAM["lr"]), "fp16.autocast": "cpu float16",
                "fp16.steps": str(FP16_STEPS)}
    data = safetensors_bytes(tensors, metadata)
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data)} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
