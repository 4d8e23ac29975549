#!/usr/bin/env python3
"""Writes tests/tensor/where_reference.h: inputs, outputs and gradients from PyTorch for
torch.where, Tensor.masked_fill, torch.tril and torch.triu, for tests/tensor/where_test.cpp.

Usage: python3 scripts/make_where_reference.py > tests/tensor/where_reference.h
(needs torch). Floats are hexadecimal literals: PyTorch's float32 bits exactly. dp has no
bool dtype: a condition is written as float32 0/1, PyTorch gets it as bool.
"""
import torch

from reference_header import floats, header

torch.manual_seed(20261128)


def leaves(*ts):
    return [t.clone().requires_grad_(True) for t in ts]


out = []
# where: cond (1, 4) over a (2, 3, 4) and b (3, 1) — all three broadcast.
cond = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
a = torch.randn(2, 3, 4)
b = torch.randn(3, 1)
up = torch.rand(2, 3, 4) + 0.5
al, bl = leaves(a, b)
y = torch.where(cond.bool(), al, bl)
(y * up).sum().backward()
for name, t in (("Cond", cond), ("A", a), ("B", b), ("Up", up), ("Out", y), ("GradA", al.grad), ("GradB", bl.grad)):
    out.append(floats(f"kWhere{name}", t, f"where {name}"))

# masked_fill of (2, 3, 4) by a (3, 4) mask with -1.5.
x = torch.randn(2, 3, 4)
mask = (torch.rand(3, 4) > 0.5).float()
xl, = leaves(x)
y = xl.masked_fill(mask.bool(), -1.5)
(y * up).sum().backward()
for name, t in (("X", x), ("Mask", mask), ("Out", y), ("Grad", xl.grad)):
    out.append(floats(f"kMaskedFill{name}", t, f"masked_fill {name} (upstream: kWhereUp)"))

# tril / triu of (2, 3, 4, 5) for several diagonals, with the gradient of tril(x, 1).
x = torch.randn(2, 3, 4, 5)
up = torch.rand(2, 3, 4, 5) + 0.5
out.append(floats("kTriX", x, "tril/triu input"))
out.append(floats("kTriUp", up, "tril/triu upstream gradient"))
for d in (-1, 0, 2):
    tag = f"M{-d}" if d < 0 else str(d)
    out.append(floats(f"kTril{tag}", torch.tril(x, d), f"tril(x, {d})"))
    out.append(floats(f"kTriu{tag}", torch.triu(x, d), f"triu(x, {d})"))
xl, = leaves(x)
(torch.tril(xl, 1) * up).sum().backward()
out.append(floats("kTril1Grad", xl.grad, "gradient of tril(x, 1)"))

print(header("tests/tensor/where_reference.h", "scripts/make_where_reference.py", "where_reference",
             torch.__version__, out))
