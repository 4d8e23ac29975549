#!/usr/bin/python3
"""PyTorch DDP (gloo) reference for dp's DDP mode on CPU.

Trains the Fashion-MNIST CNN of samples/fashion_mnist_cnn with
torch.nn.parallel.DistributedDataParallel over `--procs` processes of
`--threads` threads each (default 2 x 1 on a 2-core machine), global batch
`--batch` split evenly, Adam lr 1e-3, random data of Fashion-MNIST's shape, and
prints one JSON line: {"impl": "torch-ddp-gloo", "samples_per_sec": ...}.
--bf16 runs the forward and the loss under torch.autocast('cpu', bfloat16) (the
gradients reach gloo in float32, as DDP without a comm hook sends them);
--channels-last puts the model and the batch in channels_last.

Run with any PyTorch (the PyPI wheel in a venv, or Debian's python3-torch); never
imported by dp.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def make_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Linear(128, 10))


def worker(rank, args, port, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs)
    torch.manual_seed(0)
    net = make_cnn()
    if args.channels_last:
        net = net.to(memory_format=torch.channels_last)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    per_rank = args.batch // args.procs
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(per_rank, 1, 28, 28, generator=gen)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (per_rank,), generator=gen)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        queue.put(elapsed)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over the forward and the loss")
    p.add_argument("--channels-last", action="store_true", help="channels_last model and batch")
    args = p.parse_args()
    if args.batch % args.procs:
        p.error("--batch must be a multiple of --procs")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, args.port, queue)) for r in range(args.procs)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
        if pr.exitcode != 0:
            raise SystemExit(f"rank exited with {pr.exitcode}")
    elapsed = queue.get()
    print(json.dumps({"impl": "torch-ddp-gloo", "procs": args.procs, "threads": args.threads,
                      "bf16": args.bf16, "channels_last": args.channels_last, "torch": torch.__version__,
                      "batch": args.batch, "steps": args.steps,
                      "samples_per_sec": args.batch * args.steps / elapsed,
                      "ms_per_step": 1000 * elapsed / args.steps}))


if __name__ == "__main__":
    main()
