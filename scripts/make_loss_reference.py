#!/usr/bin/env python3
"""Writes tests/nn/loss_reference.h: inputs and PyTorch's values of the losses in
dp/nn/functional.h (cross_entropy, nll_loss, binary_cross_entropy_with_logits,
l1_loss, smooth_l1_loss) and their gradients, for tests/nn/loss_test.cpp.

Usage: python3 scripts/make_loss_reference.py > tests/nn/loss_reference.h
(needs torch; Debian's python3-torch is /usr/bin/python3's). The inputs are float32
values (what dp computes with); PyTorch evaluates the losses on them in float64, so
the header holds the exact values that dp's float32 results are compared with. A
gradient is d(Σ out·upstream)/d input with upstream = 1 for a reduced loss and
kUpstream* (fixed values) for reduction 'none'.
"""
import sys

import torch
import torch.nn.functional as F

B, C = 6, 5          # class-index losses: a batch of 6 rows, 5 classes
SHAPE = (4, 3)       # elementwise losses


def f32(t):
    """The float32 values of t, as float64 (exact)."""
    return t.to(torch.float32).to(torch.float64)


def values(t):
    return [float(v) for v in t.detach().reshape(-1).tolist()]


def grads(fn, inputs, upstream):
    """fn(*inputs) and its gradient for each input (float64)."""
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    (out * upstream).sum().backward() if out.dim() > 0 else out.backward()
    return out, [x.grad for x in leaves]


def main():
    g = torch.Generator().manual_seed(20240601)
    logits = f32(torch.randn(B, C, generator=g, dtype=torch.float64) * 2)
    target = torch.tensor([3, 0, -100, 4, 1, 3])
    weight = f32(torch.tensor([0.5, 2.0, 1.0, 0.25, 1.5], dtype=torch.float64))
    upstream_b = f32(torch.linspace(-1.0, 1.5, B, dtype=torch.float64) + 0.1)  # no 0: ignored rows get 0 by themselves
    logp = f32(F.log_softmax(logits, 1))

    x = f32(torch.randn(*SHAPE, generator=g, dtype=torch.float64) * 3)
    t = f32(torch.rand(*SHAPE, generator=g, dtype=torch.float64))  # soft targets in [0, 1)
    bce_weight = f32(torch.rand(*SHAPE, generator=g, dtype=torch.float64) + 0.5)
    pos_weight = f32(torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64))
    a = f32(torch.randn(*SHAPE, generator=g, dtype=torch.float64))
    b = f32(a + torch.tensor([[0.05, -0.3, 1.7], [-2.5, 0.0, 0.6], [-0.8, 0.2, 3.0], [-0.01, 1.2, -0.45]],
                             dtype=torch.float64))
    upstream_e = f32(torch.linspace(-1.0, 1.5, SHAPE[0] * SHAPE[1], dtype=torch.float64).reshape(SHAPE) + 0.05)

    class_cases = []
    for weighted in (False, True):
        for smoothing in (0.0, 0.1):
            for ignore_index in (-100, 3):
                for reduction in ("mean", "sum", "none"):
                    w = weight if weighted else None
                    up = upstream_b if reduction == "none" else 1.0
                    ce, (ce_grad,) = grads(
                        lambda z: F.cross_entropy(z, target.clamp(min=0) if ignore_index == 3 else target, weight=w,
                                                  ignore_index=ignore_index, reduction=reduction,
                                                  label_smoothing=smoothing), [logits], up)
                    nll = nll_grad = None
                    if smoothing == 0.0:
                        nll, (nll_grad,) = grads(
                            lambda z: F.nll_loss(z, target.clamp(min=0) if ignore_index == 3 else target, weight=w,
                                                 ignore_index=ignore_index, reduction=reduction), [logp], up)
                    class_cases.append((weighted, smoothing, ignore_index, reduction, ce, ce_grad, nll, nll_grad))
    # Every row ignored: PyTorch's mean is 0 / 0.
    all_ignored = F.cross_entropy(logits, torch.full((B,), -100), reduction="mean")

    bce_cases = []
    for wname, w in (("none", None), ("full", bce_weight), ("row", bce_weight[0])):
        for pw in (None, pos_weight):
            for reduction in ("mean", "sum", "none"):
                up = upstream_e if reduction == "none" else 1.0
                out, (gx, gt) = grads(lambda z, y: F.binary_cross_entropy_with_logits(
                    z, y, weight=w, pos_weight=pw, reduction=reduction), [x, t], up)
                bce_cases.append((wname, pw is not None, reduction, out, gx, gt))
    big = f32(torch.tensor([[100.0, -100.0, 40.0], [-40.0, 0.0, 20.0]], dtype=torch.float64))
    big_t = f32(torch.tensor([[0.0, 1.0, 0.5], [0.25, 0.0, 1.0]], dtype=torch.float64))
    big_out = F.binary_cross_entropy_with_logits(big, big_t, reduction="none")

    elem_cases = []
    for name, beta in (("l1", None), ("smooth_l1", 1.0), ("smooth_l1", 0.5), ("smooth_l1", 0.0)):
        for reduction in ("mean", "sum", "none"):
            up = upstream_e if reduction == "none" else 1.0
            if beta is None:
                fn = lambda p, q: F.l1_loss(p, q, reduction=reduction)
            else:
                fn = lambda p, q: F.smooth_l1_loss(p, q, reduction=reduction, beta=beta)
            out, (ga, gb) = grads(fn, [a, b], up)
            elem_cases.append((name, beta if beta is not None else 0.0, reduction, out, ga, gb))

    w = sys.stdout.write

    def arr(name, ctype, vals, doc):
        w(f"/// {doc}\n")
        w(f"inline const std::vector<{ctype}> {name} = {{")
        line = ""
        for v in vals:
            item = (f"{v!r}" if ctype == "double" else f"{int(v)}") + ", "
            if len(line) + len(item) > 96:
                w("\n    " + line.rstrip())
                line = ""
            line += item
        w("\n    " + line.rstrip() + "\n};\n\n")

    def vec(vals):
        return "{" + ", ".join(repr(float(v)) for v in vals) + "}"

    w("// tests/nn/loss_reference.h — GENERATED by scripts/make_loss_reference.py with PyTorch "
      f"{torch.__version__}; do not edit.\n")
    w("// Inputs (float32 values) and PyTorch's losses and gradients on them, evaluated in float64.\n")
    w("#pragma once\n\n#include <cstdint>\n#include <string>\n#include <vector>\n\nnamespace loss_reference {\n\n")
    w(f"inline constexpr std::int64_t kB = {B}, kC = {C};\n")
    w(f"inline constexpr std::int64_t kRows = {SHAPE[0]}, kCols = {SHAPE[1]};\n\n")
    arr("kLogits", "double", values(logits), "cross_entropy's logits, (kB, kC)")
    arr("kLogp", "double", values(logp), "nll_loss's input: log_softmax(kLogits) in float32, (kB, kC)")
    arr("kTarget", "std::int64_t", values(target), "class targets (kB); -100 is PyTorch's default ignore_index")
    arr("kWeight", "double", values(weight), "class weights (kC)")
    arr("kUpstreamB", "double", values(upstream_b), "the upstream gradient of reduction 'none' (kB)")
    w("/// One configuration of cross_entropy and nll_loss. With ignore_index = 3 the target's\n"
      "/// -100 is replaced by 0 (PyTorch rejects -100 then), so class 3 is the ignored one.\n"
      "struct ClassCase {\n  bool weighted;\n  double label_smoothing;\n  std::int64_t ignore_index;\n"
      "  std::string reduction;\n  std::vector<double> ce, ce_grad;    // cross_entropy(kLogits): loss, d/dlogits\n"
      "  std::vector<double> nll, nll_grad;  // nll_loss(kLogp): loss, d/dlogp (empty with smoothing)\n};\n")
    w("inline const std::vector<ClassCase> kClassCases = {\n")
    for weighted, smoothing, ii, red, ce, ceg, nll, nllg in class_cases:
        w(f"    {{{'true' if weighted else 'false'}, {smoothing!r}, {ii}, \"{red}\",\n"
          f"     {vec(values(ce))},\n     {vec(values(ceg))},\n"
          f"     {vec(values(nll)) if nll is not None else '{}'},\n"
          f"     {vec(values(nllg)) if nllg is not None else '{}'}}},\n")
    w("};\n\n")
    w(f"/// cross_entropy with every row ignored, mean: {float(all_ignored)!r} in PyTorch.\n\n")

    arr("kBceInput", "double", values(x), "binary_cross_entropy_with_logits' input (kRows, kCols)")
    arr("kBceTarget", "double", values(t), "its soft targets (kRows, kCols)")
    arr("kBceWeight", "double", values(bce_weight), "a weight per element (kRows, kCols); its first row (kCols) "
        "is the broadcast weight")
    arr("kPosWeight", "double", values(pos_weight), "pos_weight (kCols)")
    arr("kUpstreamE", "double", values(upstream_e), "the upstream gradient of reduction 'none' (kRows, kCols)")
    w("/// One configuration of binary_cross_entropy_with_logits; weight: \"none\", \"full\"\n"
      "/// (kBceWeight) or \"row\" (its first row, broadcast).\n"
      "struct BceCase {\n  std::string weight;\n  bool pos_weight;\n  std::string reduction;\n"
      "  std::vector<double> loss, grad_input, grad_target;\n};\n")
    w("inline const std::vector<BceCase> kBceCases = {\n")
    for wname, pw, red, out, gx, gt in bce_cases:
        w(f"    {{\"{wname}\", {'true' if pw else 'false'}, \"{red}\",\n     {vec(values(out))},\n"
          f"     {vec(values(gx))},\n     {vec(values(gt))}}},\n")
    w("};\n\n")
    arr("kBceBigInput", "double", values(big), "large logits (2, 3): a naive exp would overflow")
    arr("kBceBigTarget", "double", values(big_t), "their targets (2, 3)")
    arr("kBceBigLoss", "double", values(big_out), "PyTorch's losses, reduction 'none' (2, 3)")

    arr("kElemA", "double", values(a), "l1_loss' and smooth_l1_loss' input (kRows, kCols)")
    arr("kElemB", "double", values(b), "their target (kRows, kCols): element 4 equals the input")
    w("/// One configuration of l1_loss (\"l1\") or smooth_l1_loss (\"smooth_l1\", beta).\n"
      "struct ElemCase {\n  std::string loss;\n  double beta;\n  std::string reduction;\n"
      "  std::vector<double> out, grad_input, grad_target;\n};\n")
    w("inline const std::vector<ElemCase> kElemCases = {\n")
    for name, beta, red, out, ga, gb in elem_cases:
        w(f"    {{\"{name}\", {beta!r}, \"{red}\",\n     {vec(values(out))},\n     {vec(values(ga))},\n"
          f"     {vec(values(gb))}}},\n")
    w("};\n\n}  // namespace loss_reference\n")


if __name__ == "__main__":
    main()
