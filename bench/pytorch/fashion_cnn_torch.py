#!/usr/bin/python3
"""PyTorch reference of samples/fashion_mnist_cnn: the same CNN, data and recipe.

Conv 1->32 3x3 pad 1, ReLU, MaxPool 2; Conv 32->64 3x3 pad 1, ReLU, MaxPool 2; Flatten;
Linear 3136->128, ReLU; Linear 128->10; cross-entropy; Adam lr 1e-3; batch 256; pixels
/ 255. The IDX files are read with gzip + numpy (no torchvision, no download).

  /usr/bin/python3 bench/pytorch/fashion_cnn_torch.py --steps 60 --warmup 10 --json
  /usr/bin/python3 bench/pytorch/fashion_cnn_torch.py --epochs 3          # accuracy run
  python3 bench/pytorch/fashion_cnn_torch.py --steps 60 --bf16 --channels-last --json

--bf16 runs the forward and the loss under torch.autocast("cpu", torch.bfloat16), as
samples/fashion_mnist_cnn --precision bf16 does (float32 master weights, Adam in float32);
--channels-last stores the model and each batch in torch.channels_last, the layout
PyTorch's oneDNN convolutions prefer on CPUs.

Timing: every step (batch assembly, forward, backward, optimizer step, loss.item())
after the first --warmup steps is timed; ms/step and samples/s are over those steps,
which is how bench/side_by_side.py reads samples/fashion_mnist_cnn's step records.
Needs Debian's python3-torch: run it with /usr/bin/python3.
"""
import argparse
import gzip
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn


def read_idx(path):
    opener = gzip.open if os.path.exists(path + ".gz") else open
    with opener(path + ".gz" if os.path.exists(path + ".gz") else path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not a uint8 IDX file")
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir, split):
    prefix = "train" if split == "train" else "t10k"
    x = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte"))
    y = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte"))
    return x, y.astype(np.int64)


def make_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
        nn.Linear(128, 10))


def batch(x_u8, y, idx):
    xb = torch.from_numpy(x_u8[idx]).unsqueeze(1).float().div_(255.0)
    return xb, torch.from_numpy(y[idx])


def evaluate(net, x_u8, y, batch_size=1000):
    net.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), batch_size):
            idx = np.arange(i, min(i + batch_size, len(y)))
            xb, yb = batch(x_u8, y, idx)
            correct += (net(xb).argmax(1) == yb).sum().item()
    net.train()
    return correct / len(y)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.environ.get("DP_DATA_DIR") or "/usr/share/datasets/fashion-mnist")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="timing run: train this many steps (0 = use --epochs)")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--bf16", action="store_true", help="forward and loss under torch.autocast('cpu', bfloat16)")
    ap.add_argument("--channels-last", action="store_true", help="model and batches in torch.channels_last")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    x_train, y_train = load(args.data, "train")
    x_test, y_test = load(args.data, "test")
    net = make_cnn()
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    net = net.to(memory_format=fmt)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    def emit(rec):
        if args.json:
            print(json.dumps(rec), flush=True)
        else:
            print(" ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()), flush=True)

    step, t_warm = 0, None
    total_steps = args.steps if args.steps > 0 else math.inf
    steps_per_epoch = math.ceil(len(y_train) / args.batch)
    epoch = 0
    while step < total_steps and (args.steps > 0 or epoch < args.epochs):
        epoch += 1
        perm = rng.permutation(len(y_train))
        loss_sum, seen, t_epoch = 0.0, 0, time.perf_counter()
        for b in range(steps_per_epoch):
            if step >= total_steps:
                break
            if step == args.warmup:
                t_warm = time.perf_counter()
            xb, yb = batch(x_train, y_train, perm[b * args.batch:(b + 1) * args.batch])
            xb = xb.contiguous(memory_format=fmt)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = loss_fn(net(xb), yb)
            loss.backward()
            opt.step()
            l = loss.item()
            step += 1
            loss_sum += l * len(yb)
            seen += len(yb)
        train_s = time.perf_counter() - t_epoch
        if args.steps == 0:
            emit({"type": "epoch", "epoch": epoch, "train_loss": loss_sum / seen,
                  "test_accuracy": evaluate(net, x_test, y_test),
                  "samples_per_sec": seen / train_s, "threads": args.threads})
    t_end = time.perf_counter()
    timed = step - args.warmup
    if t_warm is not None and timed > 0:
        ms = (t_end - t_warm) * 1e3 / timed
        emit({"type": "timing", "steps": timed, "warmup": args.warmup, "batch": args.batch,
              "ms_per_step": ms, "samples_per_sec": args.batch * 1e3 / ms,
              "threads": args.threads, "torch": torch.__version__, "bf16": args.bf16,
              "channels_last": args.channels_last})
    return 0


if __name__ == "__main__":
    sys.exit(main())
