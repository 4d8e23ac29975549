#!/usr/bin/env python3
"""Writes tests/tensor/half_ops_reference.h: PyTorch's bits for bfloat16 and float16 ops
that sum, reduce or combine (means, products, a Linear's bias, a convolution's bias,
softmax, layer norm, batch norm, losses), for tests/tensor/half_tensor_test.cpp.

Usage: python3 scripts/make_half_ops_reference.py > tests/tensor/half_ops_reference.h
(needs torch: PyPI's torch 2.x). The inputs lie on grids (eighths and sixteenths of
small integers) whose float32 sums are exact in any order, so an op that accumulates in
float32 and rounds once has one right answer whatever its order of summation: dp must
give PyTorch's bits. Where PyTorch rounds an intermediate (x + scalar rounds the scalar
to the tensor's dtype; log_softmax and a float16 cross_entropy round the log-softmax;
float16's exact gelu cancels 1 + erf), the header also holds the float64 value rounded
once, which dp gives (Note [16-bit tensors] in include/dp/tensor/tensor.h).
"""
import torch
import torch.nn.functional as F

from reference_header import floats, header

torch.set_num_threads(1)


def grid(shape, salt, unit, span, dtype):
    """((i * 37 + salt * 11) mod 2 span - span) * unit, element i in row-major order: the
    same formula as the test's."""
    n = 1
    for s in shape:
        n *= s
    v = [float(((i * 37 + salt * 11) % (2 * span)) - span) * unit for i in range(n)]
    return torch.tensor(v, dtype=torch.float32).reshape(shape).to(dtype)


parts = []
for dtype, tag in [(torch.bfloat16, "bf16"), (torch.float16, "f16")]:
    a = grid([6, 10], 1, 0.125, 32, dtype)
    b = grid([6, 10], 2, 0.0625, 64, dtype)
    c = grid([10], 3, 0.25, 16, dtype)
    w = grid([4, 10], 5, 0.0625, 64, dtype)
    bias = grid([4], 6, 0.0625, 128, dtype)
    x4 = grid([2, 3, 5, 5], 7, 0.125, 32, dtype)
    w4 = grid([4, 3, 3, 3], 8, 0.0625, 64, dtype)
    b4 = grid([4], 9, 0.0625, 128, dtype)
    lw = grid([10], 10, 0.0625, 64, dtype)
    lb = grid([10], 11, 0.0625, 64, dtype)
    gamma = grid([3], 12, 0.0625, 64, torch.float32)
    beta = grid([3], 13, 0.0625, 64, torch.float32)
    target = torch.tensor([1, 3, 5, 7, 9, 0])
    pytorch = {
        "mean": a.mean(), "mean0": a.mean(0), "mean1": a.mean(1), "sum": a.sum(), "sum1": a.sum(1),
        "mul": a * b, "div": a / (grid([6, 10], 4, 0.5, 3, dtype) + 3.0), "mul_scalar": a * 0.3,
        "div_scalar": a / 3.0, "bias_add": a + c, "linear": F.linear(a, w, bias), "matmul": a @ w.t(),
        "conv2d": F.conv2d(x4, w4, b4, 1, 1), "softmax": F.softmax(a, 1), "layer_norm": F.layer_norm(a, [10], lw, lb),
        "gelu_tanh": F.gelu(a, approximate="tanh"), "mse_loss": F.mse_loss(a, b), "exp": a.exp(),
        "batch_norm": F.batch_norm(x4, None, None, gamma, beta, training=True),
    }
    once = {  # the float64 value rounded once
        "add_scalar": (a.double() + 0.3).to(dtype), "log_softmax": F.log_softmax(a.double(), 1).to(dtype),
        "cross_entropy": F.cross_entropy(a.double(), target).to(dtype), "gelu": F.gelu(a.double()).to(dtype),
    }
    for name, t in pytorch.items():
        parts.append(floats(f"k{tag}_{name}", t.float(), f"PyTorch's {tag} {name}"))
    for name, t in once.items():
        parts.append(floats(f"k{tag}_{name}_once", t.float(), f"the float64 {name} rounded once to {tag}"))
print(header("tests/tensor/half_ops_reference.h", "scripts/make_half_ops_reference.py", "dp_test::half_ops",
             torch.__version__, parts))
