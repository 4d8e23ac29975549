#!/usr/bin/env python3
"""Writes tests/tensor/half_ops_reference.h: PyTorch's bits for bfloat16, float16 and float32 ops
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
for dtype, tag in [(torch.bfloat16, "bf16"), (torch.float16, "f16"), (torch.float32, "f32")]:
    def leaf(t):
        return t.detach().requires_grad_()
    a = leaf(grid([6, 10], 1, 0.125, 32, dtype))
    b = leaf(grid([6, 10], 2, 0.0625, 64, dtype))
    c = leaf(grid([10], 3, 0.25, 16, dtype))
    d = leaf(grid([6, 10], 4, 0.5, 3, dtype) + 3.0)
    w = leaf(grid([4, 10], 5, 0.0625, 64, dtype))
    bias = leaf(grid([4], 6, 0.0625, 128, dtype))
    x4 = leaf(grid([2, 3, 5, 5], 7, 0.125, 32, dtype))
    w4 = leaf(grid([4, 3, 3, 3], 8, 0.0625, 64, dtype))
    b4 = leaf(grid([4], 9, 0.0625, 128, dtype))
    lw = leaf(grid([10], 10, 0.0625, 64, dtype))
    lb = leaf(grid([10], 11, 0.0625, 64, dtype))
    gamma = leaf(grid([3], 12, 0.0625, 64, torch.float32))
    beta = leaf(grid([3], 13, 0.0625, 64, torch.float32))
    target = torch.tensor([1, 3, 5, 7, 9, 0])
    # name: (the op, its inputs whose gradients are recorded)
    pytorch = {
        "mean": (lambda: a.mean(), [a]), "mean0": (lambda: a.mean(0), [a]), "mean1": (lambda: a.mean(1), [a]),
        "sum": (lambda: a.sum(), [a]), "sum1": (lambda: a.sum(1), [a]), "mul": (lambda: a * b, [a, b]),
        "div": (lambda: a / d, [a, d]), "mul_scalar": (lambda: a * 0.3, [a]), "div_scalar": (lambda: a / 3.0, [a]),
        "bias_add": (lambda: a + c, [a, c]), "linear": (lambda: F.linear(a, w, bias), [a, w, bias]),
        "matmul": (lambda: a @ w.t(), [a, w]), "conv2d": (lambda: F.conv2d(x4, w4, b4, 1, 1), [x4, w4, b4]),
        "softmax": (lambda: F.softmax(a, 1), [a]), "layer_norm": (lambda: F.layer_norm(a, [10], lw, lb), [a, lw, lb]),
        "gelu_tanh": (lambda: F.gelu(a, approximate="tanh"), [a]), "mse_loss": (lambda: F.mse_loss(a, b), [a, b]),
        "exp": (lambda: a.exp(), [a]),
        "batch_norm": (lambda: F.batch_norm(x4, None, None, gamma, beta, training=True), [x4, gamma, beta]),
    }
    once = {  # the float64 value rounded once
        "add_scalar": lambda t: t + 0.3, "log_softmax": lambda t: F.log_softmax(t, 1),
        "cross_entropy": lambda t: F.cross_entropy(t, target), "gelu": lambda t: F.gelu(t),
    }
    for name, (op, inputs) in pytorch.items():
        out = op()
        parts.append(floats(f"k{tag}_{name}", out.float(), f"PyTorch's {tag} {name}"))
        # The gradients of sum(out * g), g a grid in the output's dtype: the op's backward
        # receives g exactly. PyTorch's, and the float64 ones rounded once to each
        # input's dtype (the same op on the inputs' float64 values).
        g = grid(list(out.shape), 14, 0.125, 16, out.dtype)
        for t in inputs:
            t.grad = None
        (out * g).sum().backward()
        for i, t in enumerate(inputs):
            parts.append(floats(f"k{tag}_{name}_grad{i}", t.grad.float(),
                                f"PyTorch's {tag} {name}: the gradient of its input {i}"))
        saved = [t.detach().clone() for t in inputs]
        wide = [leaf(t.detach().double()) for t in inputs]
        with torch.no_grad():
            for t, t64 in zip(inputs, wide):
                t.data = t64.detach()
        for t in inputs:
            t.grad = None
        out64 = op()
        parts.append(floats(f"k{tag}_{name}_once", out64.detach().to(out.dtype).float(),
                            f"the float64 {name} rounded once to {tag}"))
        (out64 * g.double()).sum().backward()
        for i, t in enumerate(inputs):
            parts.append(floats(f"k{tag}_{name}_grad{i}_once", t.grad.to(saved[i].dtype).float(),
                                f"the float64 {name}'s gradient of its input {i}, rounded once"))
        with torch.no_grad():
            for t, v in zip(inputs, saved):
                t.data = v
    for name, op in once.items():
        parts.append(floats(f"k{tag}_{name}_once", op(a.detach().double()).to(dtype).float(),
                            f"the float64 {name} rounded once to {tag}"))
names = [line.split(" = ")[0].split()[-1] for part in parts for line in part.splitlines()
         if line.startswith("inline const std::vector<float>")]
entries = ",\n      ".join(f'{{"{n[1:]}", &{n}}}' for n in names)
parts.append(f"""/// Every array above by its name without the k ("bf16_linear_grad0"); null for none.
inline const std::vector<float>* find(const char* name) {{
  struct Entry {{
    const char* name;
    const std::vector<float>* values;
  }};
  static const Entry all[] = {{
      {entries}}};
  for (const Entry& e : all) {{
    const char* p = e.name;
    const char* q = name;
    while (*p != '\\0' && *p == *q) ++p, ++q;
    if (*p == *q) return e.values;
  }}
  return nullptr;
}}
""")
print(header("tests/tensor/half_ops_reference.h", "scripts/make_half_ops_reference.py", "dp_test::half_ops",
             torch.__version__, parts))
