#!/usr/bin/env python3
"""Writes tests/nn/sequence_reference.h: inputs, outputs and gradients from PyTorch for
the sequence-model ops (softmax / log_softmax along a dim, layer_norm, embedding with
padding_idx, Linear over (B, T, C)), for tests/nn/sequence_test.cpp.

Usage: python3 scripts/make_sequence_reference.py > tests/nn/sequence_reference.h
(needs torch). Floats are hexadecimal literals: PyTorch's float32 bits exactly.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(20261128)


def hexf(v):
    return float(v).hex() + "f"


def floats(name, t, doc):
    vals = [hexf(v) for v in t.detach().reshape(-1).tolist()]
    rows = ",\n    ".join(", ".join(vals[i:i + 4]) for i in range(0, len(vals), 4))
    return f"/// {doc}, shape {list(t.shape)}\ninline const std::vector<float> {name} = {{\n    {rows}}};\n"


def ints(name, t, doc):
    return (f"/// {doc}, shape {list(t.shape)}\ninline const std::vector<std::int64_t> {name} = "
            f"{{{', '.join(str(int(v)) for v in t.reshape(-1).tolist())}}};\n")


out = []
# softmax / log_softmax along dim 1 of (2, 3, 4), and log_softmax along dim 0.
x = torch.randn(2, 3, 4) * 3
up = torch.rand(2, 3, 4) + 0.5
out.append(floats("kSoftmaxX", x, "input"))
out.append(floats("kSoftmaxUp", up, "upstream gradient"))
for name, fn in (("Softmax1", lambda t: F.softmax(t, 1)), ("LogSoftmax0", lambda t: F.log_softmax(t, 0)),
                 ("SoftmaxLast", lambda t: F.softmax(t, -1))):
    leaf = x.clone().requires_grad_(True)
    y = fn(leaf)
    (y * up).sum().backward()
    out.append(floats(f"k{name}Out", y, f"{name} output"))
    out.append(floats(f"k{name}Grad", leaf.grad, f"{name} input gradient"))

# layer_norm over the last dim of (2, 3, 8), with weight and bias.
x = torch.randn(2, 3, 8) * 2 + 1
w = torch.randn(8)
b = torch.randn(8)
up = torch.rand(2, 3, 8) + 0.5
xl, wl, bl = (t.clone().requires_grad_(True) for t in (x, w, b))
y = F.layer_norm(xl, (8,), wl, bl, 1e-5)
(y * up).sum().backward()
for name, t in (("X", x), ("W", w), ("B", b), ("Up", up), ("Out", y), ("GradX", xl.grad), ("GradW", wl.grad),
                ("GradB", bl.grad)):
    out.append(floats(f"kLayerNorm{name}", t, f"layer_norm {name}"))

# embedding (7, 3) with padding_idx 2 and repeated ids.
wt = torch.randn(7, 3)
ids = torch.tensor([[1, 2, 5], [5, 0, 1]])
up = torch.rand(2, 3, 3) + 0.5
wl = wt.clone().requires_grad_(True)
y = F.embedding(ids, wl, padding_idx=2)
(y * up).sum().backward()
out.append(floats("kEmbeddingWeight", wt, "embedding weight"))
out.append(ints("kEmbeddingIds", ids, "ids"))
out.append(floats("kEmbeddingUp", up, "upstream gradient"))
out.append(floats("kEmbeddingOut", y, "output"))
out.append(floats("kEmbeddingGrad", wl.grad, "weight gradient (row 2, the padding row, stays zero)"))

# Linear over (B, T, C) = (2, 3, 4) -> 5.
lin = torch.nn.Linear(4, 5)
x = torch.randn(2, 3, 4)
up = torch.rand(2, 3, 5) + 0.5
xl = x.clone().requires_grad_(True)
y = lin(xl)
(y * up).sum().backward()
for name, t in (("W", lin.weight), ("B", lin.bias), ("X", x), ("Up", up), ("Out", y), ("GradX", xl.grad),
                ("GradW", lin.weight.grad), ("GradB", lin.bias.grad)):
    out.append(floats(f"kLinear3d{name}", t, f"Linear over (B, T, C): {name}"))

# gelu, exact and with the tanh approximation, with gradients.
x = torch.linspace(-6, 6, 49)
up = torch.rand(49) + 0.5
out.append(floats("kGeluX", x, "gelu input"))
out.append(floats("kGeluUp", up, "upstream gradient"))
for name, mode in (("Exact", "none"), ("Tanh", "tanh")):
    leaf = x.clone().requires_grad_(True)
    y = F.gelu(leaf, approximate=mode)
    (y * up).sum().backward()
    out.append(floats(f"kGelu{name}Out", y, f"gelu approximate={mode}"))
    out.append(floats(f"kGelu{name}Grad", leaf.grad, f"gelu approximate={mode}: input gradient"))

# scaled_dot_product_attention: causal self-attention (2, 3, 5, 4) with gradients, a
# boolean keep-mask, an additive float mask, cross-attention with L != S and a scale.
q = torch.randn(2, 3, 5, 4)
k = torch.randn(2, 3, 5, 4)
v = torch.randn(2, 3, 5, 6)
up = torch.rand(2, 3, 5, 6) + 0.5
ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
y = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
(y * up).sum().backward()
for name, t in (("Q", q), ("K", k), ("V", v), ("Up", up), ("CausalOut", y), ("CausalGradQ", ql.grad),
                ("CausalGradK", kl.grad), ("CausalGradV", vl.grad)):
    out.append(floats(f"kSdpa{name}", t, f"sdpa {name}"))
keep = torch.rand(5, 5) > 0.3
keep[:, 0] = True  # every query keeps a key
out.append(floats("kSdpaKeep", keep.float(), "0/1 keep-mask (PyTorch: a bool mask)"))
out.append(floats("kSdpaKeepOut", F.scaled_dot_product_attention(q, k, v, attn_mask=keep), "sdpa with the keep-mask"))
addm = torch.randn(3, 5, 5)
out.append(floats("kSdpaAdd", addm, "additive float mask, (H, L, S)"))
out.append(floats("kSdpaAddOut", F.scaled_dot_product_attention(q, k, v, attn_mask=addm), "sdpa with the additive mask"))
out.append(floats("kSdpaCrossOut", F.scaled_dot_product_attention(q[:, :, :3], k, v, scale=0.3),
                  "sdpa, 3 queries over 5 keys, scale 0.3"))

print("// tests/nn/sequence_reference.h — GENERATED by scripts/make_sequence_reference.py with "
      f"PyTorch {torch.__version__}; do not edit.")
print("#pragma once\n\n#include <cstdint>\n#include <vector>\n")
print("namespace sequence_reference {\n")
print("\n".join(out))
print("}  // namespace sequence_reference")
