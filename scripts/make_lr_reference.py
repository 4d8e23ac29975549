#!/usr/bin/env python3
"""Writes tests/optim/lr_reference.h: the learning rates (and OneCycleLR's momenta)
that PyTorch's torch.optim.lr_scheduler gives, for the cases of
tests/optim/lr_scheduler_test.cpp.

Usage: python3 scripts/make_lr_reference.py > tests/optim/lr_reference.h
(needs torch; Debian's python3-torch is /usr/bin/python3's). Each array holds
get_last_lr()[0] right after construction and after each scheduler.step(), printed
with repr(), the shortest decimal that reads back as the same double; the test
expects dp's sequence to equal it bit for bit.
"""
import sys
import warnings

import torch
from torch.optim import SGD, Adam
from torch.optim import lr_scheduler as S

warnings.simplefilter("ignore")  # the "step() before optimizer.step()" hints


def params():
    return [torch.zeros(1, requires_grad=True)]


def run(opt, schedulers, steps, momentum=None):
    """lrs (and momentum or beta1 when asked) after construction and each step."""
    def read():
        g = opt.param_groups[0]
        lrs.append(g["lr"])
        if momentum == "momentum":
            moms.append(g["momentum"])
        elif momentum == "beta1":
            moms.append(g["betas"][0])

    lrs, moms = [], []
    read()
    for _ in range(steps):
        opt.step()  # no gradients: a no-op that keeps PyTorch's call order
        for s in schedulers:
            s.step()
        read()
    return lrs, moms


def one_cycle_overrun(opt, sched, steps):
    """The error PyTorch raises when stepping past total_steps."""
    run(opt, [sched], steps)
    try:
        sched.step()
    except ValueError as e:
        return str(e)
    raise AssertionError("OneCycleLR did not raise past total_steps")


CASES = []


def case(name, doc, values):
    CASES.append((name, doc, values))


def main():
    opt = SGD(params(), lr=0.1)
    case("kStepLR", "StepLR(SGD(lr=0.1), step_size=3, gamma=0.5), 12 steps",
         run(opt, [S.StepLR(opt, step_size=3, gamma=0.5)], 12)[0])

    opt = SGD(params(), lr=0.1)
    case("kMultiStepLR", "MultiStepLR(SGD(lr=0.1), milestones=[2, 5, 9], gamma=0.1), 12 steps",
         run(opt, [S.MultiStepLR(opt, milestones=[2, 5, 9], gamma=0.1)], 12)[0])

    opt = SGD(params(), lr=0.05)
    case("kExponentialLR", "ExponentialLR(SGD(lr=0.05), gamma=0.9), 20 steps",
         run(opt, [S.ExponentialLR(opt, gamma=0.9)], 20)[0])

    opt = SGD(params(), lr=0.1)
    case("kCosineAnnealingLR",
         "CosineAnnealingLR(SGD(lr=0.1), T_max=10, eta_min=0.001), 35 steps (past T_max: up again, "
         "troughs at 11 and 31)",
         run(opt, [S.CosineAnnealingLR(opt, T_max=10, eta_min=0.001)], 35)[0])

    opt = SGD(params(), lr=0.2)
    case("kCosineAnnealingLRZeroMin", "CosineAnnealingLR(SGD(lr=0.2), T_max=7), 20 steps",
         run(opt, [S.CosineAnnealingLR(opt, T_max=7)], 20)[0])

    opt = SGD(params(), lr=0.1)
    case("kLinearLRWarmup", "LinearLR(SGD(lr=0.1), start_factor=0.25, end_factor=1.0, total_iters=4), 8 steps",
         run(opt, [S.LinearLR(opt, start_factor=0.25, end_factor=1.0, total_iters=4)], 8)[0])

    opt = SGD(params(), lr=0.1)
    case("kLinearLRDecay", "LinearLR(SGD(lr=0.1), start_factor=1.0, end_factor=0.1, total_iters=5), 8 steps",
         run(opt, [S.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=5)], 8)[0])

    opt = SGD(params(), lr=0.1)
    case("kLambdaLRPow", "LambdaLR(SGD(lr=0.1), lambda e: 0.95 ** e), 10 steps",
         run(opt, [S.LambdaLR(opt, lambda e: 0.95 ** e)], 10)[0])

    opt = SGD(params(), lr=0.1)
    case("kLambdaLRInverse", "LambdaLR(SGD(lr=0.1), lambda e: 1.0 / (e + 1)), 10 steps",
         run(opt, [S.LambdaLR(opt, lambda e: 1.0 / (e + 1))], 10)[0])

    opt = SGD(params(), lr=0.1, momentum=0.9)
    lrs, moms = run(opt, [S.OneCycleLR(opt, max_lr=0.1, total_steps=20)], 20, "momentum")
    case("kOneCycleCosLR", "OneCycleLR(SGD(lr=0.1, momentum=0.9), max_lr=0.1, total_steps=20): lr, "
         "steps 0 … 20", lrs)
    case("kOneCycleCosMomentum", "the same run: SGD's momentum", moms)

    opt = Adam(params(), lr=1e-3, betas=(0.9, 0.999))
    lrs, moms = run(opt, [S.OneCycleLR(opt, max_lr=0.01, total_steps=30, pct_start=0.25,
                                       anneal_strategy="linear", three_phase=True)], 30, "beta1")
    case("kOneCycleLinear3LR", "OneCycleLR(Adam(lr=1e-3), max_lr=0.01, total_steps=30, pct_start=0.25, "
         "anneal_strategy='linear', three_phase=True): lr, steps 0 … 30", lrs)
    case("kOneCycleLinear3Beta1", "the same run: Adam's beta1", moms)

    opt = SGD(params(), lr=0.1)
    lrs, _ = run(opt, [S.OneCycleLR(opt, max_lr=0.5, epochs=3, steps_per_epoch=7, div_factor=10.0,
                                    final_div_factor=100.0, cycle_momentum=False)], 21)
    case("kOneCycleEpochsLR", "OneCycleLR(SGD(lr=0.1), max_lr=0.5, epochs=3, steps_per_epoch=7, div_factor=10, "
         "final_div_factor=100, cycle_momentum=False): lr, steps 0 … 21", lrs)

    opt = SGD(params(), lr=0.1)
    warm = S.LinearLR(opt, start_factor=0.1, total_iters=5)
    cos = S.CosineAnnealingLR(opt, T_max=20)
    case("kChainedWarmupCosine", "LinearLR(SGD(lr=0.1), start_factor=0.1, total_iters=5) and "
         "CosineAnnealingLR(T_max=20) on one optimizer, both stepped each time, 15 steps",
         run(opt, [warm, cos], 15)[0])

    opt = SGD(params(), lr=0.1, momentum=0.9)
    overrun = one_cycle_overrun(opt, S.OneCycleLR(opt, max_lr=0.1, total_steps=20), 20)

    out = sys.stdout
    out.write("// tests/optim/lr_reference.h — GENERATED by scripts/make_lr_reference.py with PyTorch "
              f"{torch.__version__}; do not edit.\n")
    out.write("// Each array: get_last_lr()[0] (or the momentum) after construction and after each step().\n")
    out.write(f"// Stepping OneCycleLR(total_steps=20) a 21st time raises: \"{overrun}\"\n")
    out.write("#pragma once\n\nnamespace lr_reference {\n")
    for name, doc, values in CASES:
        out.write(f"\n/// {doc}\n")
        out.write(f"inline constexpr double {name}[] = {{\n")
        line = "   "
        for v in values:
            item = f" {float(v)!r},"
            if len(line) + len(item) > 100:
                out.write(line + "\n")
                line = "   "
            line += item
        out.write(line + "\n};\n")
    out.write("\n}  // namespace lr_reference\n")


if __name__ == "__main__":
    main()
