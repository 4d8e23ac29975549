#!/usr/bin/env python3
"""PyTorch reference of samples/dp_vs_ddp's single-device step on one GPU.

The same models (cnn: the Fashion-MNIST CNN; mlp: 784-1024-1024-10; resnet18: the
CIFAR ResNet-18 of samples/common/models.h), batch, loss (cross-entropy) and
optimizer (SGD lr 0.01 momentum 0.9), and the same step as dp_vs_ddp's "single" row:
the host batch is copied to the GPU, zero_grad, forward, loss, backward, step; four
random batches are rotated; the loss of the last timed step is read to wait for the
GPU. Prints one JSON line per model:
{"impl": "torch", "model", "batch", "samples_per_s", "ms_per_step", ...}.

  python3 bench/pytorch/gpu_step_torch.py --model cnn,mlp,resnet18 --benchmark
  python3 bench/pytorch/gpu_step_torch.py --model resnet18 --bf16 --benchmark --compile

--benchmark sets torch.backends.cudnn.benchmark (PyTorch at its best on fixed shapes);
TF32 follows PyTorch's defaults (matmul off, convolutions on) unless --no-tf32.
--bf16 is PyTorch's automatic mixed precision as its tuning guide has it: forward and
loss under torch.autocast("cuda", dtype=torch.bfloat16) (float32 weights, SGD on them),
and for the convolutional models (cnn, resnet18) the model and the host batches in
channels_last (the batches are made channels_last once, on the host; the copy keeps it).
--compile runs the model through torch.compile (Inductor; compiled in the warm-up
steps). A compile that fails (no Triton, no compiler, an Inductor error) exits 3 with
"torch.compile failed: ..." on stderr and no record.

Exit status: 0; 77 when PyTorch sees no GPU; 2 on bad arguments; 3 when --compile fails.
Needs a CUDA build of PyTorch; never imported by dp.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn as nn


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (self.down(x) if self.down is not None else x))


class ResNet18(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for s, w in enumerate((64, 128, 256, 512)):
            layers += [BasicBlock(cin, w, 1 if s == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, 10)

    def forward(self, x):
        y = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


MODELS = ("cnn", "mlp", "resnet18")
CONV_MODELS = ("cnn", "resnet18")  # channels_last under --bf16


def make(model):
    if model == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Linear(128, 10)), (1, 28, 28)
    if model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                             nn.ReLU(), nn.Linear(1024, 10)), (1, 28, 28)
    if model == "resnet18":
        return ResNet18(), (3, 32, 32)
    raise SystemExit(f"unknown model '{model}' (expected cnn, mlp or resnet18)")


class CompileFailed(Exception):
    pass


def run(model_name, a):
    torch.manual_seed(a.seed)
    net, shape = make(model_name)
    channels_last = a.bf16 and model_name in CONV_MODELS
    net = net.cuda()
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = [(torch.randn(a.batch, *shape), torch.randint(0, 10, (a.batch,))) for _ in range(4)]
    if channels_last:
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    forward = torch.compile(net) if a.compile else net

    def step(i):
        x, y = batches[i % 4]
        x, y = x.cuda(), y.cuda()
        opt.zero_grad()
        if a.bf16:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(forward(x), y)
        else:  # fp32: the step as before --bf16 (no autocast context at all)
            loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()
        return loss

    for i in range(a.warmup):
        if a.compile and i == 0:
            try:  # the first call compiles the forward and, at backward, the backward
                step(i).item()
            except Exception as e:  # Inductor raises many kinds (BackendCompilerFailed, ...)
                raise CompileFailed(f"{type(e).__name__}: {str(e).strip()[:600]}") from e
            continue
        step(i).item()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(a.steps):
        loss = step(a.warmup + i)
    loss.item()
    dt = time.perf_counter() - t0
    return {"impl": "torch", "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
            "model": model_name, "batch": a.batch, "steps": a.steps,
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "bf16": a.bf16, "channels_last": channels_last,
            "compile": a.compile,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_conv": torch.backends.cudnn.allow_tf32,
            "samples_per_s": a.batch * a.steps / dt, "ms_per_step": dt * 1e3 / a.steps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn,mlp,resnet18")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    ap.add_argument("--no-tf32", action="store_true", help="no TF32 in convolutions either")
    ap.add_argument("--bf16", action="store_true",
                    help="forward and loss under torch.autocast('cuda', bfloat16); channels_last for cnn and resnet18")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (exit 3 when that fails)")
    a = ap.parse_args()
    models = a.model.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        ap.error(f"--model takes a list of {', '.join(MODELS)}; got {a.model!r}")
    if a.batch < 1 or a.steps < 1 or a.warmup < 0:
        ap.error("--batch and --steps must be positive, --warmup >= 0")
    if a.compile and a.warmup < 1:
        ap.error("--compile needs --warmup >= 1 (the first step compiles)")
    if not torch.cuda.is_available():
        print("gpu_step_torch: PyTorch sees no CUDA device", file=sys.stderr)
        raise SystemExit(77)
    torch.backends.cudnn.benchmark = a.benchmark
    if a.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    for m in models:
        try:
            rec = run(m, a)
        except CompileFailed as e:
            print(f"torch.compile failed: {e}", file=sys.stderr)
            raise SystemExit(3)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
