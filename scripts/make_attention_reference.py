#!/usr/bin/env python3
"""Writes tests/nn/attention_reference.h: weights, inputs, outputs and every gradient from
PyTorch for torch.nn.MultiheadAttention (self-attention with a causal mask, cross-attention
with a key padding mask and the attention weights, per-head additive masks) and for a
nanoGPT pre-norm block, for tests/nn/attention_test.cpp and tests/nn/transformer_test.cpp.

Usage: python3 scripts/make_attention_reference.py > tests/nn/attention_reference.h
(needs torch). Floats are hexadecimal literals: PyTorch's float32 bits exactly. dp has no
bool dtype: PyTorch gets bool masks, dp their float form (-inf where masked).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from reference_header import floats, header

torch.manual_seed(20261128)
out = []


out.append("/// A parameter: its state-dict name, its value and its gradient.\n"
           "struct Param {\n  const char* name;\n  const std::vector<float>* value;\n  const std::vector<float>* grad;\n};\n")


def params(prefix, module, grads):
    """Every parameter (and its gradient when `grads`) of `module` under its state-dict name."""
    for name, p in module.named_parameters():
        key = name.replace(".", "_")
        out.append(floats(f"k{prefix}_{key}", p, f"{prefix} parameter {name}"))
        if grads:
            out.append(floats(f"k{prefix}_grad_{key}", p.grad, f"{prefix} gradient of {name}"))


def leaves(*ts):
    return [t.clone().requires_grad_(True) for t in ts]


# ---- MultiheadAttention: E = 8, 2 heads, batch first, random biases ------------------------
E, H, N, T, S = 8, 2, 2, 5, 6
mha = nn.MultiheadAttention(E, H, batch_first=True)
with torch.no_grad():
    mha.in_proj_bias.normal_()
    mha.out_proj.bias.normal_()
params("Mha", mha, False)

# Self-attention, causal (the bool mask PyTorch's hint needs), no weights: the sdpa path.
x = torch.randn(N, T, E)
up = torch.rand(N, T, E) + 0.5
out.append(floats("kMhaX", x, "self-attention input (N, T, E)"))
out.append(floats("kMhaUp", up, "upstream gradient of the self-attention output"))
xl, = leaves(x)
causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
y, _ = mha(xl, xl, xl, attn_mask=causal, need_weights=False, is_causal=True)
(y * up).sum().backward()
out.append(floats("kMhaCausalOut", y, "causal self-attention output"))
out.append(floats("kMhaCausalGradX", xl.grad, "causal self-attention: input gradient"))
for name, p in mha.named_parameters():
    out.append(floats(f"kMhaCausal_grad_{name.replace('.', '_')}", p.grad, f"causal self-attention: gradient of {name}"))
mha.zero_grad()

# Cross-attention, queries (N, T, E) over keys and values (N, S, E), batch 1's last two
# keys padding; output and head-averaged weights, both in the loss.
q, k, v = torch.randn(N, T, E), torch.randn(N, S, E), torch.randn(N, S, E)
pad = torch.zeros(N, S, dtype=torch.bool)
pad[1, -2:] = True
upw = torch.rand(N, T, S) + 0.5
ql, kl, vl = leaves(q, k, v)
y, w = mha(ql, kl, vl, key_padding_mask=pad, need_weights=True)
((y * up).sum() + (w * upw).sum()).backward()
for name, t in (("Q", q), ("K", k), ("V", v), ("Pad", pad.float()), ("UpW", upw), ("Out", y), ("Weights", w),
                ("GradQ", ql.grad), ("GradK", kl.grad), ("GradV", vl.grad)):
    out.append(floats(f"kMhaCross{name}", t, f"cross-attention {name}"))
for name, p in mha.named_parameters():
    out.append(floats(f"kMhaCross_grad_{name.replace('.', '_')}", p.grad, f"cross-attention: gradient of {name}"))
mha.zero_grad()
with torch.no_grad():
    _, wh = mha(q, k, v, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    out.append(floats("kMhaCrossHeadWeights", wh, "cross-attention weights per head (N, H, T, S)"))
    # Causal and padding together, and a per-head additive mask (N * H, T, T).
    pad_t = torch.zeros(N, T, dtype=torch.bool)
    pad_t[0, -1] = True
    y, _ = mha(x, x, x, key_padding_mask=pad_t, attn_mask=causal, need_weights=False)
    out.append(floats("kMhaPadT", pad_t.float(), "key padding over the self-attention keys (N, T)"))
    out.append(floats("kMhaCausalPadOut", y, "self-attention, causal and padded"))
    add = torch.randn(N * H, T, T)
    y, _ = mha(x, x, x, attn_mask=add, need_weights=False)
    out.append(floats("kMhaHeadMask", add, "additive mask per head (N * H, T, T)"))
    out.append(floats("kMhaHeadMaskOut", y, "self-attention with the per-head additive mask"))


# ---- nanoGPT's Block (model.py), GELU with GPT-2's tanh approximation -----------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


block = Block(E, H)
with torch.no_grad():  # LayerNorms away from ones and zeros, so their gradients are tested
    for ln in (block.ln_1, block.ln_2):
        ln.weight.add_(0.3 * torch.randn(E))
        ln.bias.normal_()
x = torch.randn(N, T, E)
up = torch.rand(N, T, E) + 0.5
xl, = leaves(x)
y = block(xl)
(y * up).sum().backward()
out.append(floats("kBlockX", x, "block input (N, T, E)"))
out.append(floats("kBlockUp", up, "upstream gradient of the block output"))
out.append(floats("kBlockOut", y, "block output"))
out.append(floats("kBlockGradX", xl.grad, "block input gradient"))
params("Block", block, True)
names = [n for n, _ in block.named_parameters()]
table = ",\n    ".join(f'{{"{n}", &kBlock_{n.replace(".", "_")}, &kBlock_grad_{n.replace(".", "_")}}}' for n in names)
out.append("/// (state-dict name, value, gradient) of every block parameter\n"
           "inline const std::vector<Param> kBlockParams = {\n    " + table + "};\n")

# ---- scaled_dot_product_attention across blocks (tests/nn/attention_fused_test.cpp) -------
# Sizes past one 64-row block of the fused kernel, neither a multiple of it, odd head dims:
# causal self-attention (2, 1, 72, 5) and cross-attention of 70 queries over 66 keys with an
# additive (L, S) mask -0.5 * ((7i + 3j) mod 5) (exact in float; the test makes it the same
# way). Drawn after everything above, so the values above do not move.
def sdpa_case(name, shape_q, shape_k, ev, **kw):
    q, k = torch.randn(*shape_q), torch.randn(*shape_k)
    v = torch.randn(*shape_k[:-1], ev)
    up = torch.randn(*shape_q[:-1], ev)
    ql, kl, vl = leaves(q, k, v)
    mask = kw.pop("mask", None)
    y = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=mask, **kw)
    (y * up).sum().backward()
    for part, t in (("Q", q), ("K", k), ("V", v), ("Up", up)):
        out.append(floats(f"kSdpa{name}{part}", t, f"sdpa {name}: {part}"))
    out.append(floats(f"kSdpa{name}Out", y, f"sdpa {name}: output"))
    for part, t in (("GradQ", ql.grad), ("GradK", kl.grad), ("GradV", vl.grad)):
        out.append(floats(f"kSdpa{name}{part}", t, f"sdpa {name}: {part}"))


sdpa_case("Blocks", (2, 1, 72, 5), (2, 1, 72, 5), 5, is_causal=True)
i, j = torch.arange(70).reshape(70, 1), torch.arange(66).reshape(1, 66)
sdpa_case("Cross", (1, 1, 70, 3), (1, 1, 66, 3), 7, mask=-0.5 * ((7 * i + 3 * j) % 5).float(), scale=0.4)

print(header("tests/nn/attention_reference.h", "scripts/make_attention_reference.py", "attention_reference",
             torch.__version__, out))
