#!/usr/bin/env python3
"""Writes tests/nn/golden_cnn.safetensors: PyTorch's results for a small CNN with BatchNorm.

tests/nn/golden_test.cpp builds the same network with dp::nn, loads the batch and the
initial state from this file and compares dp's logits, loss, gradients, BatchNorm
running statistics and parameters after optimizer steps with PyTorch's (as llm.c checks
train_gpt2.c against its PyTorch reference). The test needs no Python; this script is
only run to regenerate the file, with Debian's python3-torch (1.13; nothing else):

    /usr/bin/python3 scripts/make_golden.py            # from the repository root

Seeds are fixed and torch runs on one thread, so a rerun writes the same bytes.

The network (torch.nn.Sequential; dp's Sequential names children "0", "1", ... alike):
  0 Conv2d(1, 4, 3, padding=1, bias=False)  1 BatchNorm2d(4)  2 ReLU  3 MaxPool2d(2)
  4 Conv2d(4, 8, 3, padding=1, bias=False)  5 BatchNorm2d(8)  6 ReLU  7 MaxPool2d(2)
  8 Flatten  9 Linear(72, 10)
The convolutions have no bias because BatchNorm follows them: such a bias has a zero
gradient in exact arithmetic and float noise in practice, which Adam would scale up to
full lr-sized steps of random sign.

Tensors in the file ("<name>": a state_dict name, e.g. "1.running_mean"):
  input (8, 1, 12, 12) F32, target (8) I64       the batch, used by every run
  init.<name>          every parameter and buffer before training
  logits (8, 10), loss ()                         one train-mode forward from init,
  grad.<parameter>     the gradients of the mean cross-entropy loss,
  forward.<buffer>     and the BatchNorm buffers after that forward
  adam.<name>, adamw.<name>, sgd.<name>           the state_dict after 3 steps from init,
                       each step zero_grad, forward, backward, step on the same batch
  dp2.logits, dp2.loss, dp2.grad.<parameter>, dp2.adam.<name>
                       the same with the batch split into 2 shards of 4 (torch.chunk)
                       normalised separately, as DataParallel on 2 devices runs it:
                       BatchNorm uses each shard's statistics, the loss is the mean over
                       the whole batch, and the running statistics are shard 0's
                       (device 0's replica; the others' updates are discarded).
The hyperparameters are in the header's __metadata__ ("adam.lr", "sgd.momentum", ...).
"""
import argparse
import json
import struct
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = 6  # chosen for its kink margins (see MIN_KINK_MARGIN)
BATCH, CLASSES, SIDE = 8, 10, 12
STEPS = 3
SHARDS = 2
# Optimizer hyperparameters, also written to the metadata. The weight decays are large
# enough that dropping them moves the parameters by far more than the test's tolerance
# (sgd: lr·wd = 1e-3 of each parameter per step; adamw: lr·wd = 1e-4).
ADAM = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
SGD = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-2, nesterov=False)
# The smallest ReLU input magnitude and max-pool winner margin allowed: float32 results
# of dp and torch differ by ~1e-6 here, so values this far from a kink take the same
# branch in both (otherwise pick another seed).
MIN_KINK_MARGIN = 2e-5

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "nn" / "golden_cnn.safetensors"


def make_model():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, CLASSES),
    )


class KinkMargins:
    """Forward hooks recording how far ReLU inputs are from 0 and how far each max-pool
    window's winner is above the runner-up (windows whose maximum is 0 are skipped:
    their gradient is 0 whichever element wins)."""

    def __init__(self, model):
        self.relu = float("inf")
        self.pool = float("inf")
        for m in model:
            if isinstance(m, nn.ReLU):
                m.register_forward_hook(self.on_relu)
            elif isinstance(m, nn.MaxPool2d):
                m.register_forward_hook(self.on_pool)

    def on_relu(self, module, inputs, output):
        self.relu = min(self.relu, inputs[0].detach().abs().min().item())

    def on_pool(self, module, inputs, output):
        x = inputs[0].detach()
        windows = F.unfold(x.flatten(0, 1).unsqueeze(1), 2, stride=2)  # (N·C, 4, windows)
        top2 = windows.topk(2, dim=1).values
        gap = top2[:, 0] - top2[:, 1]
        live = top2[:, 0] > 0
        if live.any():
            self.pool = min(self.pool, gap[live].min().item())

    def check(self, label):
        print(f"{label}: kink margins: |relu input| >= {self.relu:.3g}, max-pool gap >= {self.pool:.3g}")
        assert self.relu > MIN_KINK_MARGIN and self.pool > MIN_KINK_MARGIN, (
            "a value lies within float noise of a ReLU or max-pool kink; change SEED")


def forward_loss(model, x, y, shards):
    """Logits and mean cross-entropy of the batch split into `shards` chunks, each
    normalised on its own, and shard 0's BatchNorm buffers (None for one shard)."""
    if shards == 1:
        logits = model(x)
        return logits, F.cross_entropy(logits, y), None
    outs, loss, kept = [], 0.0, None
    for s, (xs, ys) in enumerate(zip(x.chunk(shards), y.chunk(shards))):
        out = model(xs)
        loss = loss + F.cross_entropy(out, ys, reduction="sum") / x.shape[0]
        outs.append(out)
        if s == 0:
            kept = [b.detach().clone() for b in model.buffers()]
    return torch.cat(outs), loss, kept


def train(label, init, x, y, make_opt, shards=1):
    """The state_dict after STEPS steps from `init`, and the first step's logits, loss,
    gradients and buffers (after its forward)."""
    model = make_model()
    model.load_state_dict(init)
    margins = KinkMargins(model)
    opt = make_opt(model.parameters())
    first = None
    for step in range(STEPS):
        opt.zero_grad()
        logits, loss, kept = forward_loss(model, x, y, shards)
        loss.backward()
        if kept is not None:  # after backward: BatchNorm's backward reads the buffers
            with torch.no_grad():
                for b, k in zip(model.buffers(), kept):
                    b.copy_(k)
        if step == 0:
            first = dict(
                logits=logits.detach().clone(),
                loss=loss.detach().clone(),
                grads={n: p.grad.clone() for n, p in model.named_parameters()},
                buffers={n: b.clone() for n, b in model.named_buffers()},
            )
        opt.step()
    margins.check(label)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}, first


def safetensors_bytes(tensors, metadata):
    """The safetensors encoding of {name: tensor} (F32 or I64) in the given order."""
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().flatten()
        if t.dtype == torch.float32:
            dtype, data = "F32", struct.pack(f"<{t.numel()}f", *t.tolist())
        elif t.dtype == torch.int64:
            dtype, data = "I64", struct.pack(f"<{t.numel()}q", *t.tolist())
        else:
            raise TypeError(f"{name}: unsupported dtype {t.dtype}")
        shape = list(tensors[name].shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to a multiple of 8
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def hyper(prefix, options):
    out = {}
    for k, v in options.items():
        if k == "betas":
            out[f"{prefix}.beta1"], out[f"{prefix}.beta2"] = repr(v[0]), repr(v[1])
        else:
            out[f"{prefix}.{k}"] = repr(v).lower()  # bools as "false" / "true"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT.relative_to(REPO)}")
    args = ap.parse_args()

    torch.set_num_threads(1)  # one summation order, so reruns write the same bytes
    torch.manual_seed(SEED)
    model = make_model()
    with torch.no_grad():  # BatchNorm's affine parameters away from 1 and 0
        for m in model:
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    init = {n: t.detach().clone() for n, t in model.state_dict().items()}
    x = torch.randn(BATCH, 1, SIDE, SIDE)
    y = torch.randint(0, CLASSES, (BATCH,))

    adam, first = train("adam", init, x, y, lambda p: torch.optim.Adam(p, **ADAM))
    adamw, _ = train("adamw", init, x, y, lambda p: torch.optim.AdamW(p, **ADAMW))
    sgd, _ = train("sgd", init, x, y, lambda p: torch.optim.SGD(p, **SGD))
    dp2_adam, dp2 = train("dp2.adam", init, x, y, lambda p: torch.optim.Adam(p, **ADAM), shards=SHARDS)

    tensors = {"input": x, "target": y}
    tensors.update({f"init.{n}": t for n, t in init.items()})
    tensors["logits"], tensors["loss"] = first["logits"], first["loss"]
    tensors.update({f"grad.{n}": g for n, g in first["grads"].items()})
    tensors.update({f"forward.{n}": b for n, b in first["buffers"].items()})
    tensors.update({f"adam.{n}": t for n, t in adam.items()})
    tensors.update({f"adamw.{n}": t for n, t in adamw.items()})
    tensors.update({f"sgd.{n}": t for n, t in sgd.items()})
    tensors["dp2.logits"], tensors["dp2.loss"] = dp2["logits"], dp2["loss"]
    tensors.update({f"dp2.grad.{n}": g for n, g in dp2["grads"].items()})
    tensors.update({f"dp2.adam.{n}": t for n, t in dp2_adam.items()})

    metadata = {
        "format": "pt",
        "generated_by": f"scripts/make_golden.py (torch {torch.__version__}); do not edit, rerun it",
        "model": "Sequential(Conv2d(1,4,3,p=1,bias=False), BatchNorm2d(4), ReLU, MaxPool2d(2), "
                 "Conv2d(4,8,3,p=1,bias=False), BatchNorm2d(8), ReLU, MaxPool2d(2), Flatten, Linear(72,10))",
        "seed": str(SEED),
        "steps": str(STEPS),
        "dp2.shards": str(SHARDS),
        "loss": "cross_entropy, mean over the batch",
    }
    metadata.update(hyper("adam", ADAM))
    metadata.update(hyper("adamw", ADAMW))
    metadata.update(hyper("sgd", SGD))

    data = safetensors_bytes(tensors, metadata)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data)} bytes, {len(tensors)} tensors), loss {first['loss'].item():.6f}")


if __name__ == "__main__":
    main()
