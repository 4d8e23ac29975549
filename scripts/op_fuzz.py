#!/usr/bin/env python3
"""The differential op fuzzer: random programs of dp's tensor ops against PyTorch.

What it does and its oracle: Note [Op fuzzer] in tests/tensor/op_fuzz_replay.cpp.

Modes (a PyTorch 2.x is needed for both; the test itself needs none):
  python3 scripts/op_fuzz.py --replay build/tests/tensor/op_fuzz_replay --seeds 600:20600
      hunt: draw the programs, run dp on them, print each failing program (exit 1)
  python3 scripts/op_fuzz.py --write tests/tensor/op_fuzz_corpus.safetensors --seeds 0:600
      write the corpus that `meson test` replays (op_fuzz_replay on the file): the
      programs, their inputs, PyTorch's float64 results and each one's bound.
  python3 scripts/op_fuzz.py --replay build/tests/tensor/op_fuzz_replay --bf16-bits
      each single bfloat16 op over every finite input, bitwise against PyTorch: the
      measurement behind Note [16-bit tensors]'s list.
Seeds are fixed and torch runs on one thread, so a rerun writes the same tensors and
programs (safetensors may order the header's metadata otherwise).
"""
import argparse
import contextlib
import math
import os
import random
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

from fuzz_common import hunt, parse_seeds, write_corpus

torch.set_num_threads(1)

MAX_NUMEL = 240
MAX_ABS = 1e4


def draw_shape(rng, max_dims=4):
    while True:
        n = rng.choice([0, 1, 1, 2, 2, 2, 3, 3, 4][: 9 if max_dims >= 4 else 8])
        n = min(n, max_dims)
        shape = [rng.choice([1, 1, 2, 3, 3, 4, 5]) for _ in range(n)]
        if math.prod(shape) <= MAX_NUMEL:
            return shape


class Program:
    """The program as drawn: lines of text, the inputs, and each value's tensors."""

    def __init__(self, rng):
        self.rng = rng
        self.lines = []
        self.inputs = {}  # name -> float64 tensor (the values; float32-representable)
        self.ints = {}  # name -> int64 tensor
        self.consts = {}  # name -> float64 tensor of float32 values, no gradient
        self.values = []  # (low, high, kind): kind "float", "mask" or "int"
        self.leaves = {}  # input name -> (low, high) leaf tensors
        self.ops = 0

    # -- inputs ----------------------------------------------------------------------
    def new_input(self, shape, lo=-2.0, hi=2.0):
        name = f"x{len(self.inputs)}"
        t = (torch.rand(shape, generator=self.gen, dtype=torch.float64) * (hi - lo) + lo).float().double()
        self.inputs[name] = t
        return self.add_value(f"input {name}", t.float().requires_grad_(), t.clone().requires_grad_(), "float",
                              leaf=name)

    def new_const(self, shape, lo=0.5, hi=2.0, values=None):
        """A float32 input that takes no gradient (class weights, 0/1 keep masks)."""
        name = f"k{len(self.consts)}"
        t = values if values is not None else \
            (torch.rand(shape, generator=self.gen, dtype=torch.float64) * (hi - lo) + lo).float().double()
        self.consts[name] = t
        return self.add_value(f"const {name}", t.float(), t.clone(), "const")

    def new_ints(self, shape, lo, hi):
        name = f"i{len(self.ints)}"
        t = torch.randint(lo, hi, shape, generator=self.gen, dtype=torch.int64)
        self.ints[name] = t
        return self.add_value(f"ints {name}", t, t, "int")

    def add_value(self, text, low, high, kind, leaf=None):
        v = len(self.values)
        self.lines.append(f"v{v} = {text}")
        self.values.append((low, high, kind))
        if leaf:
            self.leaves[leaf] = (low, high)
        return v


def finite_ok(t):
    if not t.is_floating_point():
        return True
    d = t.detach().double()
    return bool(torch.isfinite(d).all()) and (d.numel() == 0 or float(d.abs().max()) <= MAX_ABS)


# Each op: a function (program, rng) -> (text, low, high, kind) or None when it does not
# apply to the values at hand. low/high are the results of PyTorch in the program's
# dtypes and in float64.

def floats(p, dims=None, min_dims=0):
    out = [i for i, (lo, hi, k) in enumerate(p.values) if k == "float" and lo.dim() >= min_dims]
    if dims is not None:
        out = [i for i in out if p.values[i][0].dim() in dims]
    return out


def pick(p, rng, **kw):
    c = floats(p, **kw)
    if not c:
        return None
    # Later values more often: programs grow deep rather than wide.
    return c[min(len(c) - 1, int(len(c) * (1 - rng.random() ** 2)))]


def positive(p, rng, besides=()):
    """A positive float value: one already positive, or x*x + 0.5 made by two ops, from a
    value not in `besides` (four draws, then none)."""
    for _ in range(4 if besides else 1):
        v = pick(p, rng)
        if v is not None and v not in besides:
            break
    else:
        return None
    lo, hi, _ = p.values[v]
    if lo.numel() and float(lo.detach().min()) > 0.1:
        return v
    sq = p.add_value(f"square v{v}", lo * lo, hi * hi, "float")
    lo2, hi2, _ = p.values[sq]
    return p.add_value(f"add_s v{sq} 0.5", lo2 + 0.5, hi2 + 0.5, "float")


UNARY = {
    "neg": torch.neg, "abs": torch.abs, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu,
    "square": torch.square, "erf": torch.erf, "exp": torch.exp, "contiguous": lambda t: t.contiguous(),
    "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}
UNARY_POSITIVE = {"log": torch.log, "sqrt": torch.sqrt, "reciprocal": torch.reciprocal}


def unary_from(table, operand):
    """An op drawing one function of `table` and applying it to operand(p, rng)."""
    def op(p, rng):
        name = rng.choice(sorted(table))
        v = operand(p, rng)
        if v is None:
            return None
        lo, hi, _ = p.values[v]
        return f"{name} v{v}", table[name](lo), table[name](hi), "float"
    return op


op_unary = unary_from(UNARY, pick)
op_unary_positive = unary_from(UNARY_POSITIVE, positive)


def op_pow(p, rng):
    e = rng.choice([2.0, 3.0, 0.5, -1.0, 1.5])
    v = positive(p, rng) if e != int(e) or e < 0 else pick(p, rng)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    return f"pow v{v} {e!r}", torch.pow(lo, e), torch.pow(hi, e), "float"


def op_scalar(p, rng):
    v = pick(p, rng)
    if v is None:
        return None
    c = rng.choice([0.5, -1.5, 2.0, 3.25, -0.75])
    kind = rng.choice(["add_s", "mul_s", "rsub_s", "rdiv_s"])
    if kind == "rdiv_s":
        v = positive(p, rng)
    lo, hi, _ = p.values[v]
    f = {"add_s": lambda t: t + c, "mul_s": lambda t: t * c, "rsub_s": lambda t: c - t,
         "rdiv_s": lambda t: c / t}[kind]
    return f"{kind} v{v} {c!r}", f(lo), f(hi), "float"


# clamp's bounds (None: absent); (1.0, -1.0) is min > max, max everywhere.
CLAMP_BOUNDS = [(-0.5, 0.5), (0.25, None), (None, 0.0), (1.0, -1.0), (-1.5, 2.0)]


def clamp_args(lo, rng):
    """Bounds for clamp of `lo`, or None when an element lies within 1e-3 of one: the
    gradient is zero at a bound (Note [clamp's gradient]) and the two runs' roundings
    would decide the side."""
    b_lo, b_hi = rng.choice(CLAMP_BOUNDS)
    d = lo.detach().double()
    for b in (b_lo, b_hi):
        if b is not None and d.numel() and bool(((d - b).abs() < 1e-3).any()):
            return None
    return b_lo, b_hi


def bound_text(b):
    return "none" if b is None else repr(b)


def op_clamp(p, rng):
    v = pick(p, rng)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    bounds = clamp_args(lo, rng)
    if bounds is None:
        return None
    b_lo, b_hi = bounds
    return (f"clamp v{v} {bound_text(b_lo)} {bound_text(b_hi)}", torch.clamp(lo, b_lo, b_hi),
            torch.clamp(hi, b_lo, b_hi), "float")


def broadcast_partner(p, rng, shape):
    """A float value whose shape broadcasts with `shape`: an existing one, or a new input."""
    same = [i for i in floats(p) if list(p.values[i][0].shape) == list(shape)]
    if same and rng.random() < 0.3:
        return rng.choice(same)
    drop = rng.randint(0, len(shape))
    sub = [s if rng.random() < 0.6 else 1 for s in shape[drop:]]
    if rng.random() < 0.15 and len(sub) < 4:
        sub = [rng.choice([1, 2])] + sub if not shape else sub
    return p.new_input(sub)


BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum}


def op_binary(p, rng):
    v = pick(p, rng)
    if v is None:
        return None
    name = rng.choice(sorted(BINARY) + ["div"])
    shape = list(p.values[v][0].shape)
    w = broadcast_partner(p, rng, shape) if name != "div" else None
    if name == "div":
        w = positive(p, rng)
        try:
            torch.broadcast_shapes(p.values[v][0].shape, p.values[w][0].shape)
        except RuntimeError:
            return None
    a, b = (v, w) if rng.random() < 0.7 else (w, v)
    if name == "div":
        a, b = v, w
    f = BINARY.get(name, torch.div)
    (la, ha, _), (lb, hb, _) = p.values[a], p.values[b]
    if name == "maximum" and la.numel() and lb.numel():
        # A tie has no agreed gradient split: keep the operands apart.
        if bool(((la.detach().double() - lb.detach().double()).abs() < 1e-3).any()):
            return None
    return f"{name} v{a} v{b}", f(la, lb), f(ha, hb), "float"


def op_compare_where(p, rng):
    v = pick(p, rng)
    if v is None:
        return None
    shape = list(p.values[v][0].shape)
    w = broadcast_partner(p, rng, shape)
    (lv, hv, _), (lw, hw, _) = p.values[v], p.values[w]
    if lv.numel() and lw.numel() and bool(((lv.detach().double() - lw.detach().double()).abs() < 1e-3).any()):
        return None
    m = p.add_value(f"gt v{v} v{w}", lv.detach() > lw.detach(), hv.detach() > hw.detach(), "mask")
    if rng.random() < 0.5:
        value = rng.choice([0.0, -1.0, 2.5])
        t = rng.choice([v, w])
        lt, ht, _ = p.values[t]
        try:
            torch.broadcast_shapes(lt.shape, p.values[m][0].shape)
            if list(torch.broadcast_shapes(lt.shape, p.values[m][0].shape)) != list(lt.shape):
                return None
        except RuntimeError:
            return None
        return f"masked_fill v{t} v{m} {value!r}", lt.masked_fill(p.values[m][0], value), \
            ht.masked_fill(p.values[m][1], value), "float"
    return f"where v{m} v{v} v{w}", torch.where(p.values[m][0], lv, lw), torch.where(p.values[m][1], hv, hw), "float"


def op_tri(p, rng):
    v = pick(p, rng, min_dims=2)
    if v is None:
        return None
    k = rng.choice([-1, 0, 0, 1])
    name = rng.choice(["tril", "triu"])
    f = torch.tril if name == "tril" else torch.triu
    lo, hi, _ = p.values[v]
    return f"{name} v{v} {k}", f(lo, k), f(hi, k), "float"


def op_reduce(p, rng):
    v = pick(p, rng)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    name = rng.choice(["sum", "mean", "sum_d", "mean_d", "sum_d", "max_d"])
    if name in ("sum", "mean"):
        if name == "mean" and lo.numel() == 0:
            return None
        f = torch.sum if name == "sum" else torch.mean
        return f"{name} v{v}", f(lo), f(hi), "float"
    if lo.dim() == 0:
        return None
    d = rng.randrange(-lo.dim(), lo.dim())
    keep = rng.random() < 0.5
    if name == "max_d":
        if lo.shape[d] == 0:
            return None
        s = lo.detach().double().sort(dim=d).values
        if s.shape[d] > 1 and bool((s.narrow(d, 1, s.shape[d] - 1) - s.narrow(d, 0, s.shape[d] - 1) < 1e-3).any()):
            return None  # a tie: PyTorch's gradient goes to one of them, which is unspecified
        return f"max_d v{v} {d} {int(keep)}", lo.max(d, keep).values, hi.max(d, keep).values, "float"
    if name == "mean_d" and lo.shape[d] == 0:
        return None
    f = torch.sum if name == "sum_d" else torch.mean
    return f"{name} v{v} {d} {int(keep)}", f(lo, d, keep), f(hi, d, keep), "float"


def op_shape(p, rng):
    v = pick(p, rng)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    n = lo.dim()
    kind = rng.choice(["reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "flatten", "narrow", "expand",
                       "chunk", "split", "cat"])
    if kind == "reshape":
        numel = lo.numel()
        dims = []
        rest = numel
        for _ in range(rng.randint(0, 3)):
            divs = [d for d in range(1, rest + 1) if rest % d == 0] if rest else [1]
            dims.append(rng.choice(divs))
            rest = rest // dims[-1] if dims[-1] else 0
        dims.append(rest if numel else 0)
        if rng.random() < 0.3:
            dims[rng.randrange(len(dims))] = -1
            if numel == 0:
                return None
        return "reshape v%d %s" % (v, " ".join(map(str, dims))), lo.reshape(dims), hi.reshape(dims), "float"
    if kind == "permute" and n >= 1:
        perm = list(range(n))
        rng.shuffle(perm)
        perm = [d - n if rng.random() < 0.2 else d for d in perm]
        return "permute v%d %s" % (v, " ".join(map(str, perm))), lo.permute(perm), hi.permute(perm), "float"
    if kind == "transpose" and n >= 1:
        a, b = rng.randrange(-n, n), rng.randrange(-n, n)
        return f"transpose v{v} {a} {b}", lo.transpose(a, b), hi.transpose(a, b), "float"
    if kind == "t" and n == 2:
        return f"t v{v}", lo.t(), hi.t(), "float"
    if kind == "unsqueeze" and n < 4:
        d = rng.randrange(-n - 1, n + 1)
        return f"unsqueeze v{v} {d}", lo.unsqueeze(d), hi.unsqueeze(d), "float"
    if kind == "squeeze":
        ones = [d for d in range(n) if lo.shape[d] == 1]
        if not ones:
            return None
        d = rng.choice(ones)
        return f"squeeze v{v} {d}", lo.squeeze(d), hi.squeeze(d), "float"
    if kind == "flatten" and n >= 1:
        s = rng.randrange(n)
        e = rng.randrange(s, n)
        return f"flatten v{v} {s} {e}", lo.flatten(s, e), hi.flatten(s, e), "float"
    if kind == "narrow" and n >= 1:
        d = rng.randrange(-n, n)
        size = lo.shape[d]
        start = rng.randint(0, size)
        length = rng.randint(0, size - start)
        if rng.random() < 0.2 and start > 0:
            start -= size  # torch.narrow counts a negative start from the end
        return f"narrow v{v} {d} {start} {length}", lo.narrow(d, start, length), hi.narrow(d, start, length), "float"
    if kind == "expand":
        shape = list(lo.shape)
        target = [rng.choice([2, 3]) if s == 1 and rng.random() < 0.7 else (s if rng.random() < 0.8 else -1)
                  for s in shape]
        if len(target) < 4 and rng.random() < 0.3:
            target = [rng.choice([1, 2])] + target
        if math.prod(max(1, t) if t != -1 else 1 for t in target) * max(1, lo.numel()) > MAX_NUMEL * 4:
            return None
        return "expand v%d %s" % (v, " ".join(map(str, target))), lo.expand(target), hi.expand(target), "float"
    if kind in ("chunk", "split") and n >= 1:
        d = rng.randrange(-n, n)
        size = lo.shape[d]
        if size == 0:
            return None
        k = rng.randint(1, max(1, size))
        pieces_lo = lo.chunk(k, d) if kind == "chunk" else lo.split(k, d)
        pieces_hi = hi.chunk(k, d) if kind == "chunk" else hi.split(k, d)
        i = rng.randrange(len(pieces_lo))
        return f"{kind} v{v} {k} {d} {i}", pieces_lo[i], pieces_hi[i], "float"
    if kind == "cat" and n >= 1:
        d = rng.randrange(-n, n)
        shape = list(lo.shape)
        shape[d] = rng.randint(0, 3)
        w = p.new_input(shape)
        (lw, hw, _) = p.values[w]
        order = [v, w] if rng.random() < 0.5 else [w, v]
        ls = [p.values[i][0] for i in order]
        hs = [p.values[i][1] for i in order]
        return "cat %d %s" % (d, " ".join(f"v{i}" for i in order)), torch.cat(ls, d), torch.cat(hs, d), "float"
    return None


def op_matmul(p, rng):
    v = pick(p, rng, min_dims=1)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    if lo.dtype != torch.float32 and not torch.is_autocast_enabled("cpu"):
        return None  # PyTorch refuses mixed dtypes, except (quirk) for empty operands
    shape = list(lo.shape)
    k = shape[-1]
    n = rng.choice([1, 2, 3, 4])
    form = rng.choice(["vec", "mat", "batch", "batch", "left"])
    if form == "vec":
        other = [k]
    elif form == "mat":
        other = [k, n]
    elif form == "batch":
        batch = [s if rng.random() < 0.6 else 1 for s in shape[:-2]][rng.randint(0, max(0, len(shape) - 2)):]
        if rng.random() < 0.2 and len(batch) < 2:
            batch = [2] + batch
        other = batch + [k, n]
    else:  # the value on the right: (..., m, k') @ value needs k' = value's rows
        if lo.dim() < 1:
            return None
        rows = shape[-2] if lo.dim() >= 2 else shape[0]
        other = [rng.choice([1, 2, 3]), rows]
        w = p.new_input(other)
        lw, hw, _ = p.values[w]
        return f"matmul v{w} v{v}", torch.matmul(lw, lo), torch.matmul(hw, hi), "float"
    w = p.new_input(other)
    lw, hw, _ = p.values[w]
    return f"matmul v{v} v{w}", torch.matmul(lo, lw), torch.matmul(hi, hw), "float"


def op_softmax(p, rng):
    v = pick(p, rng, min_dims=1)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    d = rng.randrange(-lo.dim(), lo.dim())
    name = rng.choice(["softmax", "log_softmax"])
    f = F.softmax if name == "softmax" else F.log_softmax
    return f"{name} v{v} {d}", f(lo, d), f(hi, d), "float"


def flat_groups(rows):
    """True when a row (a group a norm normalises) is nearly constant: its output is then
    rounding noise divided by sqrt(eps), which no two implementations share."""
    if rows.numel() == 0:
        return False
    return bool((rows.var(dim=1, unbiased=False) < 1e-3).any())


def op_layer_norm(p, rng):
    v = pick(p, rng, min_dims=1)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    k = rng.randint(1, min(2, lo.dim()))
    norm = list(lo.shape[-k:])
    if math.prod(norm) < 2:
        return None
    args_lo, args_hi, text = [None, None], [None, None], []
    for j in range(2):
        if rng.random() < 0.7:
            w = p.new_input(norm, 0.5, 1.5) if j == 0 else p.new_input(norm, -0.5, 0.5)
            args_lo[j], args_hi[j] = p.values[w][0], p.values[w][1]
            text.append(f"v{w}")
        else:
            text.append("-")
    # A row of one value is flat too (Note [Op fuzzer]): its output is exact, but the
    # gradient of a value broadcast into it is rounding noise times 1/sqrt(eps).
    if flat_groups(lo.detach().double().reshape(-1, math.prod(norm))):
        return None
    out_lo = F.layer_norm(lo, norm, args_lo[0], args_lo[1], 1e-5)
    out_hi = F.layer_norm(hi, norm, args_hi[0], args_hi[1], 1e-5)
    return f"layer_norm v{v} {k} {text[0]} {text[1]}", out_lo, out_hi, "float"


def op_attention(p, rng):
    batch = [rng.choice([1, 2])] + ([rng.choice([1, 2])] if rng.random() < 0.7 else [])
    L, S, E, Ev = rng.randint(1, 5), rng.randint(1, 6), rng.randint(1, 5), rng.randint(1, 4)
    causal = rng.random() < 0.4
    if causal:
        S = L if rng.random() < 0.6 else S
    q, k, v = p.new_input(batch + [L, E]), p.new_input(batch + [S, E]), p.new_input(batch + [S, Ev])
    scale = rng.choice([None, None, 0.7])
    mask, mtext, keep = None, "-", False
    if not causal and rng.random() < 0.4:
        if rng.random() < 0.5:
            m = p.new_input([L, S], -1.0, 1.0)  # additive, learned
        else:  # a 0/1 keep mask (PyTorch's bool mask) keeping one key per query at least
            bits = (torch.rand([L, S], generator=p.gen) < 0.6).double()
            bits[torch.arange(L), torch.randint(0, S, (L,), generator=p.gen)] = 1.0
            if rng.random() < 0.3:  # but one query, which attends to nothing: zeros (Note [Rows with every key masked])
                bits[rng.randrange(L)] = 0.0
            m, keep = p.new_const([L, S], values=bits), True
        mask, mtext = m, f"v{m}"
    vals = [p.values[i] for i in (q, k, v)]
    ml = p.values[mask][0] if mask is not None else None
    mh = p.values[mask][1] if mask is not None else None
    if keep:
        ml, mh = ml > 0.5, mh > 0.5
    out_lo = F.scaled_dot_product_attention(vals[0][0], vals[1][0], vals[2][0], attn_mask=ml, is_causal=causal,
                                            scale=scale)
    out_hi = F.scaled_dot_product_attention(vals[0][1], vals[1][1], vals[2][1], attn_mask=mh, is_causal=causal,
                                            scale=scale)
    return (f"sdpa v{q} v{k} v{v} {int(causal)} {'-' if scale is None else repr(scale)} {mtext} {int(keep)}", out_lo,
            out_hi, "float")


def op_embedding(p, rng):
    v = pick(p, rng, dims=[2])
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    rows = lo.shape[0]
    if rows == 0:
        return None
    ids = p.new_ints(draw_shape(rng, 2), 0, rows)
    pad = rng.randrange(rows) if rng.random() < 0.3 else None
    li = p.values[ids][0]
    return (f"embedding v{ids} v{v} {'-' if pad is None else pad}", F.embedding(li, lo, pad), F.embedding(li, hi, pad),
            "float")


def class_scores(p, rng):
    """Scores (N, C) with C > 0 and a new target per row: (v, lo, hi, N, C, t, lt), lt a
    copy of the targets to edit; None where no such value is drawn."""
    v = pick(p, rng, dims=[2])
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    N, C = lo.shape
    if C == 0:
        return None
    t = p.new_ints([N], 0, C)
    return v, lo, hi, N, C, t, p.values[t][0].clone()


def class_weights(p, rng, C, chance):
    """Class weights (C) drawn with probability `chance`: ((lo, hi), text), or no weight."""
    if rng.random() < chance:
        k = p.new_const([C])
        return (p.values[k][0], p.values[k][1]), f"v{k}"
    return (None, None), "-"


def op_loss(p, rng):
    if rng.random() < 0.5:
        drawn = class_scores(p, rng)
        if drawn is None:
            return None
        v, lo, hi, N, C, t, lt = drawn
        ignore = -100
        if rng.random() < 0.3 and N > 1:
            lt[rng.randrange(N)] = ignore
            p.ints[f"i{len(p.ints) - 1}"] = lt
            p.values[t] = (lt, lt, "int")
        red = rng.choice(["mean", "sum", "none"])
        smooth = rng.choice([0.0, 0.0, 0.1])
        if red == "mean" and bool((lt == ignore).all()):
            return None
        wt, wtext = class_weights(p, rng, C, 0.35)

        def f(x, weight):
            return F.cross_entropy(x, lt, weight=weight, reduction=red, label_smoothing=smooth, ignore_index=ignore)
        return f"cross_entropy v{v} v{t} {red} {smooth!r} {wtext}", f(lo, wt[0]), f(hi, wt[1]), "float"
    v = pick(p, rng)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    w = p.new_input(list(lo.shape))
    red = rng.choice(["mean", "sum", "none"])
    if red == "mean" and lo.numel() == 0:
        return None
    lw, hw, _ = p.values[w]
    return f"mse v{v} v{w} {red}", F.mse_loss(lo, lw, reduction=red), F.mse_loss(hi, hw, reduction=red), "float"


def op_cast(p, rng):
    v = pick(p, rng)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    if lo.dtype in (torch.bfloat16, torch.float16):
        return f"f32 v{v}", lo.float(), hi, "float"
    # In float64 the cast rounds to the 16-bit dtype as well, then computes on in float64.
    if rng.random() < 0.25:
        return f"f16 v{v}", lo.to(torch.float16), hi.to(torch.float16).double(), "float"
    return f"bf16 v{v}", lo.to(torch.bfloat16), hi.to(torch.bfloat16).double(), "float"


def op_argmax_gather(p, rng):
    """argmax along a dim (ids, no gradient), then gather or index_select with them."""
    v = pick(p, rng, min_dims=1)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    d = rng.randrange(-lo.dim(), lo.dim())
    if lo.shape[d] == 0 or lo.numel() == 0:
        return None
    s = lo.detach().double().sort(dim=d).values
    if s.shape[d] > 1 and bool((s.narrow(d, 1, s.shape[d] - 1) - s.narrow(d, 0, s.shape[d] - 1) < 1e-3).any()):
        return None  # a tie: which index argmax returns is not promised
    ids = lo.detach().argmax(d, keepdim=True)
    a = p.add_value(f"argmax v{v} {d} 1", ids, hi.detach().argmax(d, keepdim=True), "int")
    w = pick(p, rng)
    lw, hw, _ = p.values[w]
    if lw.dim() != ids.dim() or any(ids.shape[k] > lw.shape[k] for k in range(lw.dim()) if k != d % lw.dim()):
        return None
    if int(ids.max()) >= lw.shape[d]:
        return None
    return f"gather v{w} {d} v{a}", torch.gather(lw, d, ids), torch.gather(hw, d, ids), "float"


def op_linear(p, rng):
    v = pick(p, rng, min_dims=1)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    n_in, n_out = lo.shape[-1], rng.randint(1, 4)
    w = p.new_input([n_out, n_in])
    b = p.new_input([n_out]) if rng.random() < 0.6 else None
    auto = rng.random() < 0.25
    (lw, hw, _) = p.values[w]
    lb, hb = (p.values[b][0], p.values[b][1]) if b is not None else (None, None)
    name = "ac_linear" if auto else "linear"
    # Entered only when asked: a disabled inner scope would switch an outer one off.
    with torch.autocast("cpu", dtype=torch.bfloat16) if auto else contextlib.nullcontext():
        out_lo = F.linear(lo, lw, lb)
    out_hi = F.linear(hi, hw, hb)
    return f"{name} v{v} v{w} {'-' if b is None else f'v{b}'}", out_lo, out_hi, "float"


def op_autocast_matmul(p, rng):
    v = pick(p, rng, min_dims=2)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    w = p.new_input([lo.shape[-1], rng.randint(1, 4)])
    (lw, hw, _) = p.values[w]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_lo = torch.matmul(lo, lw)
    return f"ac_matmul v{v} v{w}", out_lo, torch.matmul(hi, hw), "float"


def image(p, rng):
    """A 4-d float value (N, C, H, W), or a new input of that shape."""
    c = floats(p, dims=[4])
    if c and rng.random() < 0.6:
        return rng.choice(c)
    return p.new_input([rng.randint(1, 2), rng.randint(1, 3), rng.randint(2, 6), rng.randint(2, 6)])


def op_conv(p, rng):
    x = image(p, rng)
    lo, hi, _ = p.values[x]
    N, C, H, W = lo.shape
    if C == 0:
        return None  # PyTorch returns (N, 0, P, Q) there, dp refuses (functional_test)
    k = rng.randint(1, 3)
    stride, pad = rng.randint(1, 2), rng.randint(0, 1)
    if H + 2 * pad < k or W + 2 * pad < k:
        return None
    w = p.new_input([rng.randint(1, 3), C, k, k], -1.0, 1.0)
    b = p.new_input([p.inputs[f"x{len(p.inputs) - 1}"].shape[0]]) if rng.random() < 0.6 else None
    (lw, hw, _) = p.values[w]
    lb, hb = (p.values[b][0], p.values[b][1]) if b is not None else (None, None)
    return (f"conv2d v{x} v{w} {'-' if b is None else f'v{b}'} {stride} {pad}", F.conv2d(lo, lw, lb, stride, pad),
            F.conv2d(hi, hw, hb, stride, pad), "float")


def op_pool(p, rng):
    x = image(p, rng)
    lo, hi, _ = p.values[x]
    H, W = lo.shape[2], lo.shape[3]
    kind = rng.choice(["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"])
    if kind == "adaptive_avg_pool2d":
        oh, ow = rng.randint(1, H), rng.randint(1, W)
        return (f"{kind} v{x} {oh} {ow}", F.adaptive_avg_pool2d(lo, (oh, ow)), F.adaptive_avg_pool2d(hi, (oh, ow)),
                "float")
    k = rng.randint(1, 3)
    stride, pad = rng.randint(1, 3), rng.randint(0, k // 2)
    if H + 2 * pad < k or W + 2 * pad < k:
        return None
    if kind == "max_pool2d":
        # Ties inside a window have no agreed gradient: keep the values apart.
        flat = lo.detach().double().flatten()
        if flat.numel() > 1 and bool((flat.sort().values.diff() < 1e-3).any()):
            return None
        return (f"{kind} v{x} {k} {stride} {pad}", F.max_pool2d(lo, k, stride, pad), F.max_pool2d(hi, k, stride, pad),
                "float")
    return (f"{kind} v{x} {k} {stride} {pad}", F.avg_pool2d(lo, k, stride, pad), F.avg_pool2d(hi, k, stride, pad),
            "float")


def op_batch_norm(p, rng):
    c = floats(p, dims=[2, 4])
    x = rng.choice(c) if c and rng.random() < 0.6 else image(p, rng)
    lo, hi, _ = p.values[x]
    C = lo.shape[1]
    if lo.numel() // max(1, C) < 2 or flat_groups(lo.detach().double().transpose(0, 1).reshape(C, -1)):
        return None
    w = p.new_input([C], 0.5, 1.5) if rng.random() < 0.7 else None
    b = p.new_input([C], -0.5, 0.5) if rng.random() < 0.7 else None
    lw, hw = (p.values[w][0], p.values[w][1]) if w is not None else (None, None)
    lb, hb = (p.values[b][0], p.values[b][1]) if b is not None else (None, None)
    # PyTorch 2.15's CPU batch_norm backward is wrong, in float32 and float64 alike, when
    # its input and its incoming gradient are in different memory formats: an input that
    # is channels_last-contiguous (a permuted N=1 image: strides (1, 1, 16, 4)) with a
    # contiguous gradient (program 2806: 14.4 off), or a contiguous input with a gradient
    # that a later transpose leaves channels_last-strided (program 267653, an input of
    # shape (4, 3, 1, 4) and transpose(1, 3) after: every gradient off by up to 7; autograd
    # through the same forward composed of elementwise ops gives dp's values). dp has no
    # strides, so the oracle gives batch_norm a contiguous input and a contiguous gradient
    # (the same values either way).
    return (f"batch_norm v{x} {'-' if w is None else f'v{w}'} {'-' if b is None else f'v{b}'}",
            _ContiguousGrad.apply(F.batch_norm(lo.contiguous(), None, None, lw, lb, True)),
            _ContiguousGrad.apply(F.batch_norm(hi.contiguous(), None, None, hw, hb, True)), "float")


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes its incoming gradient contiguous (op_batch_norm)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def pick_along(p, rng, f32_only=False):
    """A value with a dim (float32 only if asked) and one of its dims, which is not empty;
    None when there is none."""
    v = pick(p, rng, min_dims=1)
    if v is None or (f32_only and p.values[v][0].dtype != torch.float32):
        return None
    lo = p.values[v][0]
    d = rng.randrange(-lo.dim(), lo.dim())
    return (v, d) if lo.shape[d] else None


def op_index(p, rng):
    picked = pick_along(p, rng)
    if picked is None:
        return None
    v, d = picked
    lo, hi, _ = p.values[v]
    size = lo.shape[d]
    if rng.random() < 0.5:
        ids = p.new_ints([rng.randint(0, 5)], 0, size)
        li = p.values[ids][0]
        return f"index_select v{v} {d} v{ids}", lo.index_select(d, li), hi.index_select(d, li), "float"
    shape = [rng.randint(0, s) if k != d % lo.dim() else rng.randint(0, 4) for k, s in enumerate(lo.shape)]
    ids = p.new_ints(shape, 0, size)
    li = p.values[ids][0]
    return f"gather v{v} {d} v{ids}", torch.gather(lo, d, li), torch.gather(hi, d, li), "float"


def op_index_add(p, rng):
    """index_add along a dim: repeated indices add up; differentiable in input and source.
    float32 only (dp's and PyTorch's need input and source of one dtype; dp takes float32)."""
    picked = pick_along(p, rng, f32_only=True)
    if picked is None:
        return None
    v, d = picked
    lo, hi, _ = p.values[v]
    size = lo.shape[d]
    k = rng.randint(0, 5)
    shape = list(lo.shape)
    shape[d] = k
    same = [i for i in floats(p) if i != v and list(p.values[i][0].shape) == shape
            and p.values[i][0].dtype == torch.float32]
    s = rng.choice(same) if same and rng.random() < 0.4 else p.new_input(shape)
    ids = p.new_ints([k], 0, size)
    li = p.values[ids][0]
    (slo, shi, _) = p.values[s]
    return f"index_add v{v} {d} v{ids} v{s}", lo.index_add(d, li, slo), hi.index_add(d, li, shi), "float"


def op_loss2(p, rng):
    v = pick(p, rng)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    red = rng.choice(["mean", "sum", "none"])
    if red == "mean" and lo.numel() == 0:
        return None
    kind = rng.choice(["bce", "l1", "smooth_l1"])
    t = p.new_input(list(lo.shape), 0.0, 1.0) if kind == "bce" else p.new_input(list(lo.shape))
    lt, ht, _ = p.values[t]
    if kind == "bce":
        return (f"bce v{v} v{t} {red}", F.binary_cross_entropy_with_logits(lo, lt, reduction=red),
                F.binary_cross_entropy_with_logits(hi, ht, reduction=red), "float")
    if kind == "l1":
        d = (lo.detach().double() - lt.detach().double()).abs()
        if d.numel() and float(d.min()) < 1e-3:
            return None  # |a - b| has no agreed gradient at 0
        return f"l1 v{v} v{t} {red}", F.l1_loss(lo, lt, reduction=red), F.l1_loss(hi, ht, reduction=red), "float"
    beta = rng.choice([1.0, 0.5])
    d = (lo.detach().double() - lt.detach().double()).abs()
    if d.numel() and float(((d - beta).abs()).min()) < 1e-3:
        return None
    return (f"smooth_l1 v{v} v{t} {red} {beta!r}", F.smooth_l1_loss(lo, lt, reduction=red, beta=beta),
            F.smooth_l1_loss(hi, ht, reduction=red, beta=beta), "float")


def source_for(p, rng, t, shape):
    """A float value to write into `t` (of `shape`): t itself, an existing value whose shape
    broadcasts to `shape`, or a new input of a shape that does (leading dims dropped,
    some sizes 1)."""
    if rng.random() < 0.15:
        return t
    fits = [i for i in floats(p) if i != t and _broadcasts(p.values[i][0].shape, shape)
            and tuple(torch.broadcast_shapes(p.values[i][0].shape, shape)) == tuple(shape)]
    if fits and rng.random() < 0.5:
        return rng.choice(fits)
    drop = rng.randint(0, len(shape))
    return p.new_input([d if rng.random() < 0.6 else 1 for d in shape[drop:]])


def _broadcasts(a, b):
    try:
        torch.broadcast_shapes(a, b)
        return True
    except RuntimeError:
        return False


# The in-place writes of a scalar: line name -> (Tensor method, the scalars drawn from).
SCALAR_WRITES = {"iadd_s": ("add_", [0.5, -1.25]), "imul": ("mul_", [2.0, -0.75]), "ifill": ("fill_", [0.5, -2.0]),
                 "isub_s": ("sub_", [0.5, -1.25]), "idiv_s": ("div_", [3.0, -0.75])}


def other_source(p, rng, mine, shape):
    """source_for, but never t or another handle of it (`mine`): t.mul_(t) makes PyTorch's
    backward refuse (mul_ saved its own input)."""
    t = max(mine)
    for _ in range(4):
        src = source_for(p, rng, t, shape)
        if src not in mine:
            return src
    return None


def op_inplace(p, rng):
    """In-place writes (Note [In-place writes and autograd], Note [Sources of in-place
    writes], Note [In-place writes as out-of-place ops]): t = v * c, a fresh result no
    node saved, then one to three of add_ and sub_ (of a value or input broadcast to t's
    shape, of t's dtype or another, or of t itself), add_, sub_, mul_ and div_ of a
    scalar, mul_ and div_ of a tensor (a positive one for div_), masked_fill_ (the mask
    a comparison of t), relu_ (t away from 0), clamp_ (t away from its bounds), copy_ (a 16-bit t rounds the source in
    float64 too, as a cast does), fill_ and zero_. Each write is a line whose value is t
    itself; later ops read the written tensor."""
    v = pick(p, rng)
    if v is None:
        return None
    lo, hi, _ = p.values[v]
    c = rng.choice([1.0, -0.5, 2.0])
    t = p.add_value(f"mul_s v{v} {c!r}", lo * c, hi * c, "float")
    tlo, thi, _ = p.values[t]
    shape = list(tlo.shape)
    mine = {t}  # t's handles: one per write
    writes = rng.randint(1, 3)
    for k in range(writes):
        kind = rng.choice(["iadd", "iadd", "icopy", "iadd_s", "imul", "ifill", "izero", "isub", "isub_s",
                           "imul_t", "idiv_t", "idiv_s", "imask", "irelu", "iclamp"])
        if kind == "isub":
            src = source_for(p, rng, t, shape)
            slo, shi, _ = p.values[src]
            alpha = rng.choice([1.0, 0.5, -1.5])
            tlo.sub_(slo, alpha=alpha)
            thi.sub_(shi, alpha=alpha)
            text = f"isub v{t} v{src} {alpha!r}"
        elif kind in ("imul_t", "idiv_t"):
            # Sources away from t's own handles: a node that saves one (the square behind
            # a divisor) makes dp refuse the write at once, where PyTorch refuses the
            # backward only if it runs (Note [In-place writes and autograd]).
            src = other_source(p, rng, mine, shape) if kind == "imul_t" else positive(p, rng, besides=mine)
            if src is None:
                return None
            slo, shi, _ = p.values[src]
            if kind == "idiv_t" and list(torch.broadcast_shapes(slo.shape, tlo.shape)) != shape:
                return None
            getattr(tlo, kind[1:4] + "_")(slo)
            getattr(thi, kind[1:4] + "_")(shi)
            text = f"{kind} v{t} v{src}"
        elif kind == "imask":
            src = other_source(p, rng, mine, shape)
            if src is None:
                return None
            slo, shi, _ = p.values[src]
            if tlo.numel() and bool(((tlo.detach().double() - slo.detach().double()).abs() < 1e-3).any()):
                return None  # a near tie: the two runs may compare it differently
            m = p.add_value(f"gt v{t} v{src}", tlo.detach() > slo.detach(), thi.detach() > shi.detach(), "mask")
            value = rng.choice([0.0, -1.0, 2.5])
            tlo.masked_fill_(p.values[m][0], value)
            thi.masked_fill_(p.values[m][1], value)
            text = f"imask v{t} v{m} {value!r}"
        elif kind == "iclamp":
            bounds = clamp_args(tlo, rng)
            if bounds is None:
                return None
            tlo.clamp_(*bounds)
            thi.clamp_(*bounds)
            text = f"iclamp v{t} {bound_text(bounds[0])} {bound_text(bounds[1])}"
        elif kind == "irelu":
            if tlo.numel() and bool((tlo.detach().double().abs() < 1e-3).any()):
                return None  # relu has no agreed gradient at 0
            tlo.relu_()
            thi.relu_()
            text = f"irelu v{t}"
        elif kind in ("iadd", "icopy"):
            src = source_for(p, rng, t, shape)
            slo, shi, _ = p.values[src]
            if kind == "iadd":
                alpha = rng.choice([1.0, 0.5, -1.5])
                tlo.add_(slo, alpha=alpha)
                thi.add_(shi, alpha=alpha)
                text = f"iadd v{t} v{src} {alpha!r}"
            else:
                tlo.copy_(slo)
                if tlo.dtype in (torch.bfloat16, torch.float16):
                    thi.copy_(shi.to(tlo.dtype).double())
                else:
                    thi.copy_(shi)
                text = f"icopy v{t} v{src}"
        elif kind in SCALAR_WRITES:
            method, choices = SCALAR_WRITES[kind]
            c = rng.choice(choices)
            getattr(tlo, method)(c)
            getattr(thi, method)(c)
            text = f"{kind} v{t} {c!r}"
        else:
            tlo.zero_()
            thi.zero_()
            text = f"izero v{t}"
        if k + 1 == writes:
            return text, tlo, thi, "float"
        t = p.add_value(text, tlo, thi, "float")
        mine.add(t)


def op_more(p, rng):
    """logsigmoid, the fused linear + relu, nll_loss (class weights, ignore_index), and the
    CNN's fused conv2d + relu (+ max_pool2d)."""
    kind = rng.choice(["logsigmoid", "linear_relu", "nll_loss", "conv_relu", "conv_relu_pool"])
    if kind in ("conv_relu", "conv_relu_pool"):
        x = image(p, rng)
        lo, hi, _ = p.values[x]
        N, C, H, W = lo.shape
        k = rng.randint(1, 3)
        stride, pad = rng.randint(1, 2), rng.randint(0, 1)
        if C == 0 or H + 2 * pad < k or W + 2 * pad < k:
            return None
        w = p.new_input([rng.randint(1, 3), C, k, k], -1.0, 1.0)
        b = p.new_input([p.values[w][0].shape[0]])
        (lw, hw, _), (lb, hb, _) = p.values[w], p.values[b]
        conv_lo, conv_hi = F.conv2d(lo, lw, lb, stride, pad), F.conv2d(hi, hw, hb, stride, pad)
        if conv_hi.numel() and float(conv_hi.detach().abs().min()) < 1e-3:
            return None  # relu has no agreed gradient at 0
        if kind == "conv_relu":
            return f"conv2d_relu v{x} v{w} v{b} {stride} {pad}", F.relu(conv_lo), F.relu(conv_hi), "float"
        P, Q = conv_hi.shape[2], conv_hi.shape[3]
        pk = rng.randint(1, 3)
        ps, pp = rng.randint(1, 3), rng.randint(0, pk // 2)
        if P + 2 * pp < pk or Q + 2 * pp < pk:
            return None
        # Ties among positive values in a window have no agreed gradient (zeros carry none).
        pos = F.relu(conv_hi).detach().flatten()
        pos = pos[pos > 0]
        if pos.numel() > 1 and bool((pos.sort().values.diff() < 1e-3).any()):
            return None
        return (f"conv2d_relu_max_pool2d v{x} v{w} v{b} {stride} {pad} {pk} {ps} {pp}",
                F.max_pool2d(F.relu(conv_lo), pk, ps, pp), F.max_pool2d(F.relu(conv_hi), pk, ps, pp), "float")
    if kind == "logsigmoid":
        v = pick(p, rng)
        if v is None:
            return None
        lo, hi, _ = p.values[v]
        return f"logsigmoid v{v}", F.logsigmoid(lo), F.logsigmoid(hi), "float"
    if kind == "linear_relu":
        v = pick(p, rng, min_dims=1)
        if v is None:
            return None
        lo, hi, _ = p.values[v]
        w = p.new_input([rng.randint(1, 4), lo.shape[-1]])
        b = p.new_input([p.values[w][0].shape[0]])
        (lw, hw, _), (lb, hb, _) = p.values[w], p.values[b]
        out_lo, out_hi = F.linear(lo, lw, lb), F.linear(hi, hw, hb)
        # relu has no agreed gradient at 0. Under bfloat16 autocast the operands and the
        # product round to 8 bits, so an output within a few of those roundings of its
        # terms' magnitude may fall on either side of 0 in dp and in PyTorch (program
        # 270643: 0.0097 from terms of ~1.5): keep 2^-6 of that magnitude away.
        margin = torch.full_like(out_hi.detach(), 1e-3)
        if torch.is_autocast_enabled("cpu"):
            terms = F.linear(hi.detach().abs(), hw.detach().abs(), hb.detach().abs())
            margin = torch.clamp(terms * 2.0 ** -6, min=1e-3)
        if out_hi.numel() and bool((out_hi.detach().abs() < margin).any()):
            return None
        return f"linear_relu v{v} v{w} v{b}", F.relu(out_lo), F.relu(out_hi), "float"
    drawn = class_scores(p, rng)
    if drawn is None:
        return None
    v, lo, hi, N, C, t, lt = drawn
    ignore = rng.choice([-100, 0])
    red = rng.choice(["mean", "sum", "none"])
    wt, wtext = class_weights(p, rng, C, 0.4)
    if red == "mean" and bool((lt == ignore).all()):
        return None

    def f(x, weight):
        return F.nll_loss(x, lt, weight=weight, reduction=red, ignore_index=ignore)
    return f"nll_loss v{v} v{t} {red} {ignore} {wtext}", f(lo, wt[0]), f(hi, wt[1]), "float"


OPS = [(op_unary, 6), (op_unary_positive, 2), (op_pow, 1), (op_scalar, 2), (op_binary, 6), (op_compare_where, 2),
       (op_tri, 1), (op_reduce, 4), (op_shape, 8), (op_matmul, 4), (op_softmax, 2), (op_layer_norm, 2),
       (op_attention, 1), (op_embedding, 1), (op_loss, 2), (op_cast, 2), (op_linear, 2), (op_autocast_matmul, 1),
       (op_conv, 2), (op_pool, 2), (op_batch_norm, 1), (op_index, 2), (op_loss2, 2), (op_argmax_gather, 1),
       (op_inplace, 2), (op_clamp, 1), (op_index_add, 1), (op_more, 2)]


def draw(seed, attempt=0):
    rng = random.Random(seed if attempt == 0 else f"{seed}/{attempt}")
    p = Program(rng)
    p.gen = torch.Generator().manual_seed(seed + 1000003 * attempt)
    p.new_input(draw_shape(rng))
    if rng.random() < 0.5:
        p.new_input(draw_shape(rng))
    want = rng.randint(1, 8)
    tries = 0
    while p.ops < want and tries < 60:
        tries += 1
        f = rng.choices([o for o, _ in OPS], weights=[w for _, w in OPS])[0]
        saved = (list(p.lines), dict(p.inputs), dict(p.ints), list(p.values), dict(p.leaves), dict(p.consts))
        # Some ops run under bfloat16 autocast (PyTorch's CPU autocast leaves float64 alone,
        # so the float64 run stays exact).
        auto = rng.random() < 0.12
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16) if auto else contextlib.nullcontext():
                r = f(p, rng)
        except (RuntimeError, IndexError, ValueError):
            r = None
        if r is not None and finite_ok(r[1]) and finite_ok(r[2]) and r[1].numel() <= MAX_NUMEL * 4:
            text, lo, hi, kind = r
            p.add_value(("ac " if auto else "") + text, lo, hi, kind)
            p.ops += 1
        else:
            p.lines, p.inputs, p.ints, p.values, p.leaves, p.consts = saved
    outs = [i for i, (lo, hi, k) in enumerate(p.values) if k == "float"]
    chosen = [outs[-1]] + ([rng.choice(outs[:-1])] if len(outs) > 1 and rng.random() < 0.3 else [])
    return p, chosen


def evaluate(p, chosen, seed):
    """Outputs and gradients of L = sum_i sum(out_i * w_i), in PyTorch's dtypes and in float64."""
    g = torch.Generator().manual_seed(seed + 1)
    ws = [(torch.rand(p.values[o][0].shape, generator=g, dtype=torch.float64) * 2 - 1).float().double()
          for o in chosen]
    leaves = p.leaves
    res = {}
    for which, idx in (("low", 0), ("high", 1)):
        loss = 0
        for o, w in zip(chosen, ws):
            t = p.values[o][idx]
            loss = loss + (t.double() * w).sum() if which == "high" else loss + (t.float() * w.float()).sum()
        names = sorted(leaves)
        ins = [leaves[n][idx] for n in names]
        grads = torch.autograd.grad(loss, ins, allow_unused=True) if torch.is_tensor(loss) and loss.requires_grad \
            else [None] * len(ins)
        res[which] = ([p.values[o][idx].detach().double() for o in chosen],
                      {n: (gr.detach().double() if gr is not None else torch.zeros_like(leaves[n][1]).detach())
                       for n, gr in zip(names, grads)})
    return ws, res


def bound(low, high, ops, half):
    """Note [Op fuzzer]'s bound; `half`: the program computes in bfloat16 somewhere."""
    err = float((low - high).abs().max()) if high.numel() else 0.0
    scale = max(1.0, float(high.abs().max()) if high.numel() else 0.0)
    return 16 * err + max(1, ops) * (2.0 ** -7 if half else 2.0 ** -20) * scale


def drawn_and_evaluated(seed):
    """Program `seed`, drawn again (deterministically) while PyTorch's own backward fails on it."""
    for attempt in range(20):
        p, chosen = draw(seed, attempt)
        try:
            return p, chosen, evaluate(p, chosen, seed)
        except RuntimeError:
            continue
    raise RuntimeError(f"program {seed}: PyTorch's backward failed on 20 draws")


def case_tensors(seed, prefix):
    p, chosen, (ws, res) = drawn_and_evaluated(seed)
    tensors, program = {}, list(p.lines)
    program.append("out " + " ".join(f"v{o}" for o in chosen))
    for n, t in p.inputs.items():
        tensors[f"{prefix}.{n}"] = t.float().contiguous()
    for n, t in p.ints.items():
        tensors[f"{prefix}.{n}"] = t.contiguous()
    for n, t in p.consts.items():
        tensors[f"{prefix}.{n}"] = t.float().contiguous()
    for i, w in enumerate(ws):
        tensors[f"{prefix}.w{i}"] = w.float().contiguous()
    (lo_outs, lo_grads), (hi_outs, hi_grads) = res["low"], res["high"]
    half = any(f" = {op}" in line for line in p.lines for op in ("bf16 ", "f16 ", "ac_", "ac "))
    for i, (lo, hi) in enumerate(zip(lo_outs, hi_outs)):
        tensors[f"{prefix}.out{i}"] = hi.float().contiguous()
        tensors[f"{prefix}.bound.out{i}"] = torch.tensor(bound(lo, hi, p.ops, half), dtype=torch.float32)
    for n in sorted(hi_grads):
        tensors[f"{prefix}.grad.{n}"] = hi_grads[n].float().contiguous()
        tensors[f"{prefix}.bound.grad.{n}"] = torch.tensor(bound(lo_grads[n], hi_grads[n], p.ops, half),
                                                          dtype=torch.float32)
    return tensors, "; ".join(program)


def write_file(path, seeds):
    write_corpus(path, seeds, case_tensors, "scripts/op_fuzz.py --write (Note [Op fuzzer]); do not edit")


BITS_OPS = {"neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "square": torch.square, "exp": torch.exp,
            "log": torch.log, "sqrt": torch.sqrt, "reciprocal": torch.reciprocal, "tanh": torch.tanh,
            "sigmoid": torch.sigmoid, "erf": torch.erf, "gelu": F.gelu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "pow 0.5": lambda t: t.pow(0.5),
            "pow 2.0": lambda t: t.pow(2.0), "pow -1.0": lambda t: t.pow(-1.0), "pow 3.0": lambda t: t.pow(3.0),
            "mul_s 0.7": lambda t: t * 0.7, "rsub_s 1.5": lambda t: 1.5 - t, "add_s 0.7": lambda t: t + 0.7,
            "rdiv_s 1.5": lambda t: 1.5 / t}


def write_bits_file(path):
    """One program per op of BITS_OPS over every finite bfloat16 value, bound 0 on the
    output: which single bfloat16 ops give PyTorch's bits (Note [16-bit tensors])."""
    from safetensors.torch import save_file
    every = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = every[torch.isfinite(every)]
    tensors, meta, names = {}, {}, []
    for i, (name, f) in enumerate(BITS_OPS.items()):
        op, *args = name.split()
        x = every[every > 0] if op in ("log", "sqrt") or name == "pow 0.5" else every
        with torch.no_grad():
            y = f(x.to(torch.bfloat16)).float()
        keep = torch.isfinite(y)
        x, y = x[keep].contiguous(), y[keep].contiguous()
        c = f"b{i}"
        names.append(c)
        meta[f"program.{c}"] = f"v0 = input x0; v1 = bf16 v0; v2 = {' '.join([op, 'v1'] + args)}; out v2"
        tensors.update({f"{c}.x0": x, f"{c}.w0": torch.zeros_like(y), f"{c}.out0": y, f"{c}.grad.x0": torch.zeros_like(x),
                        f"{c}.bound.out0": torch.tensor(0.0), f"{c}.bound.grad.x0": torch.tensor(float("inf"))})
    meta["cases"] = " ".join(names)
    save_file(tensors, path, metadata=meta)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0:200",
                    help="A:B (programs A..B-1) or single programs, comma-separated: 0:200,4078")
    ap.add_argument("--write", help="write the corpus to this file")
    ap.add_argument("--replay", help="op_fuzz_replay binary: run dp on the programs and report")
    ap.add_argument("--batch", type=int, default=200, help="programs per replay call")
    ap.add_argument("--print", action="store_true", help="print each program")
    ap.add_argument("--bf16-bits", action="store_true",
                    help="with --replay: each single bfloat16 op over every finite input, bitwise against PyTorch")
    a = ap.parse_args()
    if a.bf16_bits:
        if not a.replay:
            sys.exit("op_fuzz: --bf16-bits needs --replay BIN")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bits.safetensors")
            write_bits_file(path)
            r = subprocess.run([a.replay, path], capture_output=True, text=True)
            print("\n".join(l for l in r.stdout.splitlines() if l.startswith(("FAIL", "  - ", "op_fuzz_replay"))))
            sys.exit(r.returncode)
    seeds = parse_seeds(a.seeds)
    if a.print:
        for s in seeds:
            p, chosen, _ = drawn_and_evaluated(s)
            print(f"# program {s}\n" + "\n".join(p.lines) + "\nout " + " ".join(f"v{o}" for o in chosen))
    if a.write:
        write_file(a.write, seeds)
        print(f"wrote {len(seeds)} programs to {a.write}")
    if a.replay:
        hunt("op_fuzz", a.replay, write_file, seeds, a.batch, a.seeds)


if __name__ == "__main__":
    main()
