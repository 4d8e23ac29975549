#!/usr/bin/python3
"""PyTorch's own step of the MLP 784-1024-1024-10 that samples/dp_vs_ddp --model mlp trains.

Linear 784->1024, ReLU, Linear 1024->1024, ReLU, Linear 1024->10; cross-entropy; SGD
lr 0.01, momentum 0.9; zero_grad(set_to_none=True), PyTorch's fastest form. Each step
draws a fresh batch (torch.randn inputs, class labels), as dp_vs_ddp's synthetic data
does, then forward, backward, step and loss.item().

  /usr/bin/python3 bench/pytorch/mlp_torch.py --batch 512 --steps 30 --warmup 10 --threads 2

Prints one JSON object: {"ms_per_step", "samples_per_sec", "gflops", "threads", "torch"}
(gflops: the step's GEMM flops over its time, bench/side_by_side.py's count).
bench/side_by_side.py --compare mlp runs it in PyTorch's best environment.
"""
import argparse
import json
import time

import torch
import torch.nn as nn

LAYERS = [(784, 1024), (1024, 1024), (1024, 10)]


def step_gflop(batch):
    fwd = sum(2 * batch * i * o for i, o in LAYERS)
    return (3 * fwd - 2 * batch * LAYERS[0][0] * LAYERS[0][1]) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("expected --batch >= 1, --steps >= 1, --warmup >= 0, --threads >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        x = torch.randn(args.batch, 784)
        y = torch.randint(0, 10, (args.batch,))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(args.warmup):
        step()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = (time.perf_counter() - t) * 1e3 / args.steps
    print(json.dumps({"ms_per_step": ms, "samples_per_sec": args.batch * 1e3 / ms,
                      "gflops": step_gflop(args.batch) * 1e3 / ms, "threads": args.threads,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
