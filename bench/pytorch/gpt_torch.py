#!/usr/bin/env python3
"""PyTorch's side of bench/gpt_side_by_side.py: samples/gpt's training step in PyTorch.

The same GPT as samples::GPT (nanoGPT's layout: token and position embeddings, pre-norm
blocks with causal self-attention through F.scaled_dot_product_attention and a GELU(tanh)
MLP, ln_f, lm_head tied to the token embedding; biases on), the same step: AdamW (betas
0.9, 0.95; weight decay 0.1 on matrices, none on biases and norms), cross-entropy over
every next token, clip_grad_norm_(1.0). Random token windows (the speed does not depend
on the text). Prints one JSON object: tokens/s over the steps after --warmup.

  python3 bench/pytorch/gpt_torch.py --threads 2 --steps 30 [--bf16] [--compile]
  python3 bench/pytorch/gpt_torch.py --device cuda --n-layer 12 --n-head 12 --n-embd 768 \
      --block-size 1024 --vocab V --batch 8 --bf16 [--compile]

--device cuda (default cpu) is nanoGPT's train.py on one GPU: the model on the GPU,
AdamW fused (where this PyTorch has it), autocast("cuda", bfloat16) under --bf16,
TF32 allowed in float32 products, the batches copied each step from pinned host memory
(non_blocking), the loss read every step (as dp's sample does). SDPA picks its kernel
(flash attention on an H100 in bf16). --threads sets torch.set_num_threads: 2 unless
given on the CPU; left as PyTorch has it on the GPU unless given.

Exit status: 0; 77 with --device cuda when PyTorch sees no GPU; 2 on bad arguments; 3
when --compile fails in the first step ("torch.compile failed: ..." on stderr).
"""
import argparse
import inspect
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.attn_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        heads = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block, layers, heads, width):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.h = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02)
                elif name.endswith("bias"):
                    p.zero_()

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: 2 on the CPU)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=114)  # the fortunes corpus' characters
    ap.add_argument("--bf16", action="store_true",
                    help="forward and loss under torch.autocast(device, bfloat16)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = ap.parse_args()
    for name in ("steps", "batch", "block_size", "n_layer", "n_head", "n_embd", "vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.n_embd % args.n_head:
        ap.error(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be positive")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpt_torch: --device cuda, but PyTorch sees no CUDA device", file=sys.stderr)
        raise SystemExit(77)

    threads = args.threads if args.threads is not None or cuda else 2
    if threads is not None:
        torch.set_num_threads(threads)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # nanoGPT's train.py
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = GPT(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd).to(args.device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    fused = cuda and "fused" in inspect.signature(torch.optim.AdamW).parameters
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), **({"fused": True} if fused else {}))
    step_model = torch.compile(model) if args.compile else model
    data = torch.randint(0, args.vocab, (args.steps + args.warmup, args.batch, args.block_size + 1))
    if cuda:  # contiguous and pinned, so that the copies are asynchronous
        inputs, targets = data[:, :, :-1].contiguous().pin_memory(), data[:, :, 1:].contiguous().pin_memory()

    def step(i):
        if cuda:
            x, y = inputs[i].to("cuda", non_blocking=True), targets[i].to("cuda", non_blocking=True)
        else:
            x, y = data[i, :, :-1], data[i, :, 1:]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.bf16):
            logits = step_model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    for i in range(args.warmup):
        if args.compile and i == 0:
            try:  # the first call compiles the forward and, at backward, the backward
                step(i)
            except Exception as e:  # Inductor raises many kinds (BackendCompilerFailed, ...)
                print(f"torch.compile failed: {type(e).__name__}: {str(e).strip()[:600]}", file=sys.stderr)
                raise SystemExit(3)
            continue
        step(i)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(args.warmup + i)
    dt = time.perf_counter() - t0
    tokens = args.steps * args.batch * args.block_size
    rec = {"torch": torch.__version__, "tokens_per_sec": tokens / dt, "ms_per_step": dt / args.steps * 1e3,
           "loss": loss, "bf16": args.bf16, "compile": args.compile, "threads": threads}
    if cuda:
        rec.update(device="cuda", gpu=torch.cuda.get_device_name(0), fused_adamw=fused,
                   parameters=sum(p.numel() for p in model.parameters()), batch=args.batch,
                   block_size=args.block_size, vocab=args.vocab)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
