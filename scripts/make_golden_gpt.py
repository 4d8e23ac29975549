#!/usr/bin/env python3
"""Writes tests/nn/golden_gpt.safetensors: a small GPT's training in PyTorch, float32.

tests/nn/gpt_golden_test.cpp builds samples::GPT (samples/gpt/gpt.h) with the same
shape, loads the initial state and the batches from this file and compares the logits,
the loss, every gradient, and the parameters after 10 AdamW steps with two parameter
groups and gradient clipping, on one device and under every DataParallel design. The
test needs no Python; this script is only run to regenerate the file, with a PyTorch 2.x
(the PyPI wheel, for scaled_dot_product_attention):

    python3 scripts/make_golden_gpt.py            # from the repository root

Seeds are fixed and torch runs on one thread, so a rerun writes the same bytes.

The model is a GPT-2 in nanoGPT's layout and names, written here from the architecture:
token and position embeddings, N pre-norm blocks (ln_1, causal self-attention through
c_attn and c_proj, ln_2, an MLP c_fc -> GELU(tanh) -> c_proj), ln_f, and lm_head tied to
the token embedding; normal(0, 0.02) matrices, residual projections normal(0, 0.02 /
sqrt(2 N)). No biases (nanoGPT's bias=False): a key's bias shifts every score of a
query alike, so softmax makes its gradient zero in exact arithmetic and rounding noise
in practice, which Adam (g / (sqrt(v) + eps)) would turn into steps of either sign that
no two implementations share. The LayerNorms' weights start uniform in [0.5, 1.5], so
that their gradients are not all alike. Config below (CONFIG).

Tensors:
  input, target                 one batch (B, T) int64, and its next tokens
  init.<name>                   the state_dict before training (both names of the tied
                                weight, as PyTorch lists it)
  logits, loss                  one forward of (input, target)
  grad.<parameter>              the gradients of that loss (named_parameters: the tied
                                weight once, as transformer.wte.weight)
  steps.input, steps.target     (STEPS, B, T): the batch of each optimizer step
  steps.norm                    (STEPS) the gradient norm clip_grad_norm_ returned
  adamw.<name>                  the state_dict after STEPS steps, each: zero_grad,
                                forward, loss, backward, clip_grad_norm_(CLIP), step of
                                AdamW over two groups — matrices with weight_decay
                                DECAY, the norms' weights without and at lr·LR2
"""
import argparse
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from make_golden import safetensors_bytes  # scripts/make_golden.py: the same F32/I64 encoding

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "nn" / "golden_gpt.safetensors"
SEED = 11
CONFIG = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16)
B, T = 4, 8
STEPS = 10
LR, LR2, BETAS, EPS, DECAY, CLIP = 3e-3, 0.5, (0.9, 0.95), 1e-8, 0.1, 1.0


class Attention(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(c, 3 * c, bias=False)
        self.c_proj = nn.Linear(c, c, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        split = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c, bias=False)
        self.c_proj = nn.Linear(4 * c, c, bias=False)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c, bias=False)
        self.attn = Attention(c, heads)
        self.ln_2 = nn.LayerNorm(c, bias=False)
        self.mlp = Mlp(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=False),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                    p.normal_(0.0, std)
                else:  # the LayerNorms' weights, away from 1
                    p.uniform_(0.5, 1.5)

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def loss_of(model, x, y):
    logits = model(x)
    return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT.relative_to(REPO)}")
    args = ap.parse_args()

    torch.set_num_threads(1)  # one summation order, so reruns write the same bytes
    torch.manual_seed(SEED)
    model = GPT(**CONFIG)
    v = CONFIG["vocab_size"]
    data = torch.randint(0, v, (STEPS + 1, B, T + 1))
    x, y = data[0, :, :T].contiguous(), data[0, :, 1:].contiguous()
    out = {"input": x, "target": y}
    out.update({f"init.{n}": t.detach().clone() for n, t in model.state_dict().items()})

    logits, loss = loss_of(model, x, y)
    loss.backward()
    out["logits"], out["loss"] = logits.detach().clone(), loss.detach().reshape(1).clone()
    out.update({f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})

    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": DECAY},
                             {"params": plain, "weight_decay": 0.0, "lr": LR * LR2}],
                            lr=LR, betas=BETAS, eps=EPS)
    xs, ys, norms = data[1:, :, :T].contiguous(), data[1:, :, 1:].contiguous(), []
    for s in range(STEPS):
        opt.zero_grad()
        _, l = loss_of(model, xs[s], ys[s])
        l.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    out["steps.input"], out["steps.target"] = xs, ys
    out["steps.norm"] = torch.tensor(norms, dtype=torch.float32)
    out.update({f"adamw.{n}": t.detach().clone() for n, t in model.state_dict().items()})

    meta = {"torch": torch.__version__, "seed": str(SEED), "steps": str(STEPS), "lr": repr(LR),
            "lr2_factor": repr(LR2), "beta1": repr(BETAS[0]), "beta2": repr(BETAS[1]), "eps": repr(EPS),
            "weight_decay": repr(DECAY), "clip": repr(CLIP), "bias": "false"}
    meta.update({k: str(v) for k, v in CONFIG.items()})
    args.out.write_bytes(safetensors_bytes(out, meta))
    print(f"wrote {args.out} ({len(out)} tensors); loss {loss.item():.6f}, clip norms {norms[0]:.4f} .. "
          f"{norms[-1]:.4f}")


if __name__ == "__main__":
    main()
