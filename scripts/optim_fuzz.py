#!/usr/bin/env python3
"""The differential optimizer fuzzer: random training-step programs of dp's optimizers,
schedulers, clipping and GradScaler against PyTorch's.

What it does and its oracle: Note [Optimizer fuzzer] in tests/optim/optim_fuzz_replay.cpp.

Modes (a PyTorch 2.x is needed for both; the test itself needs none):
  python3 scripts/optim_fuzz.py --replay build/tests/optim/optim_fuzz_replay --seeds 200:10200
      hunt: draw the programs, run dp on them, print each failing program (exit 1)
  python3 scripts/optim_fuzz.py --write tests/optim/optim_fuzz_corpus.safetensors \
      --seeds 0:200,568,656,2496,3790,4228
      write the corpus that `meson test` replays (programs 0..199 and the ones that
      found something): the programs, their gradients, PyTorch's float64 results after
      every step and each one's bound.
  python3 scripts/optim_fuzz.py --replay build/tests/optim/optim_fuzz_replay --seeds 0:5000 \
      --replay-args "--design all --devices 3"
      hunt in the DataParallel designs (the programs of a module's parameters; Sharded
      runs those whose gradients come from backward)
  python3 scripts/optim_fuzz.py --seeds 17:18 --print
Seeds are fixed and torch runs on one thread, so a rerun writes the same tensors.
"""
import argparse
import copy
import math
import random
import re
import sys
import warnings

import torch

from fuzz_common import hunt, parse_seeds, write_corpus

torch.set_num_threads(1)
# A scheduler stepped in a step that skipped opt.step() (a program choice) is not news.
warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\(\)`")


def num(x):
    """A number as the program's text spells it: repr round-trips a double exactly."""
    return repr(float(x))


class Spec:
    """What a program builds, and builds again at a resume."""

    def __init__(self):
        self.container = "module"  # "module": one dp parameter set; "loose": tensors
        self.shapes = []
        self.opt = None  # (kind, {name: value})
        self.groups = []  # [(indices, {name: value})]; empty: one group of every parameter
        self.scheds = []  # [(kind, {name: value})]
        self.scaler = None  # {name: value}

    def order(self):
        """Parameters in the optimizer's numbering (group 0's first)."""
        return [i for idx, _ in self.groups for i in idx] if self.groups else list(range(len(self.shapes)))


def torch_options(kind, o):
    o = dict(o)
    if "beta1" in o:
        o["betas"] = (o.pop("beta1"), o.pop("beta2"))
    if "nesterov" in o:
        o["nesterov"] = bool(o["nesterov"])
    return o


def build_scheduler(opt, kind, o):
    S = torch.optim.lr_scheduler
    if kind == "StepLR":
        return S.StepLR(opt, step_size=o["step_size"], gamma=o["gamma"])
    if kind == "MultiStepLR":
        return S.MultiStepLR(opt, milestones=o["milestones"], gamma=o["gamma"])
    if kind == "ExponentialLR":
        return S.ExponentialLR(opt, gamma=o["gamma"])
    if kind == "CosineAnnealingLR":
        return S.CosineAnnealingLR(opt, T_max=o["T_max"], eta_min=o["eta_min"])
    if kind == "LinearLR":
        return S.LinearLR(opt, start_factor=o["start_factor"], end_factor=o["end_factor"],
                          total_iters=o["total_iters"])
    assert kind == "OneCycleLR"
    return S.OneCycleLR(opt, max_lr=o["max_lr"], total_steps=o["total_steps"], pct_start=o["pct_start"],
                        anneal_strategy=o["anneal_strategy"], cycle_momentum=bool(o["cycle_momentum"]),
                        base_momentum=o["base_momentum"], max_momentum=o["max_momentum"],
                        div_factor=o["div_factor"], final_div_factor=o["final_div_factor"],
                        three_phase=bool(o["three_phase"]))


class Run:
    """One PyTorch run of the program, in float32 (PyTorch's own) or float64 (the exact one)."""

    def __init__(self, spec, inits, dtype):
        self.spec, self.dtype = spec, dtype
        self.params = [t.to(dtype).clone().requires_grad_() for t in inits]
        self.norms = []
        self.build()

    def build(self):
        s = self.spec
        kind, o = s.opt
        defaults = torch_options(kind, o)
        if s.groups:
            groups = [dict({"params": [self.params[i] for i in idx]}, **torch_options(kind, g)) for idx, g in s.groups]
        else:
            groups = [{"params": list(self.params)}]
        self.opt = getattr(torch.optim, kind)(groups, **defaults)
        self.scheds = [build_scheduler(self.opt, k, so) for k, so in s.scheds]
        self.scaler = None
        if s.scaler is not None:
            self.scaler = torch.amp.GradScaler("cpu", **s.scaler)
            self.scaler.scale(torch.ones(()))  # the scale exists from the first step on

    def resume(self):
        saved = (copy.deepcopy(self.opt.state_dict()), [copy.deepcopy(x.state_dict()) for x in self.scheds],
                 copy.deepcopy(self.scaler.state_dict()) if self.scaler else None)
        self.build()  # a fresh optimizer, schedulers and scaler; then their states
        self.opt.load_state_dict(saved[0])
        for x, st in zip(self.scheds, saved[1]):
            x.load_state_dict(st)
        if self.scaler:
            self.scaler.load_state_dict(saved[2])

    def line(self, w, grads):
        p = self.params
        if w[0] == "zero_grad":
            self.opt.zero_grad(set_to_none=w[1] == "none")
        elif w[0] == "freeze":
            p[int(w[1])].requires_grad_(False)
        elif w[0] == "unfreeze":
            p[int(w[1])].requires_grad_(True)
        elif w[0] == "grad":
            t, g = p[int(w[1])], grads[w[2]].to(self.dtype)
            if w[3] == "set":
                t.grad = g.clone()
            else:
                t.grad.add_(g)
        elif w[0] == "backward":  # what a backward gives: a .grad assigned where there was none, else added to
            for pair in w[1:]:
                i, name = pair.split("=")
                t, g = p[int(i)], grads[name].to(self.dtype)
                if t.grad is None:
                    t.grad = g.clone()
                else:
                    t.grad.add_(g)
        elif w[0] == "unscale":
            self.scaler.unscale_(self.opt)
        elif w[0] == "clip_norm":
            with_grad = [t for t in p if t.grad is not None]
            n = torch.nn.utils.clip_grad_norm_(with_grad, float(w[1]), float(w[2]))
            self.norms.append(float(n))
        elif w[0] == "clip_value":
            torch.nn.utils.clip_grad_value_([t for t in p if t.grad is not None], float(w[1]))
        elif w[0] == "step":
            if self.scaler:
                self.scaler.step(self.opt)
                self.scaler.update()
                self.scaler.scale(torch.ones(()))
            else:
                self.opt.step()
        elif w[0] == "sched_step":
            for x in self.scheds:
                x.step()
                for g in self.opt.param_groups:
                    if g["lr"] < -ZERO_BY_ROUNDING * g["initial_lr"]:
                        raise ValueError("a schedule below zero, which dp refuses (Note [Learning rates below "
                                         "zero by rounding])")
        elif w[0] == "set_lr":
            self.opt.param_groups[int(w[1])]["lr"] = float(w[2])
        elif w[0] == "set_option":  # PyTorch's param_groups[g][key] = value
            g, key = self.opt.param_groups[int(w[1])], w[2]
            if key == "betas":
                g[key] = tuple(float(x) for x in w[3].split(","))
            elif key == "nesterov":
                g[key] = bool(int(w[3]))
            else:
                g[key] = float(w[3])
        elif w[0] == "resume":
            self.resume()
        else:
            raise ValueError(f"optim_fuzz: unknown line {' '.join(w)}")

    def group_values(self):
        # dp sets an lr below zero by rounding as 0 (Note [Learning rates below zero by rounding]).
        lrs = [0.0 if g["lr"] < 0 else g["lr"] for g in self.opt.param_groups]
        moms = [g["betas"][0] if "betas" in g else g["momentum"] for g in self.opt.param_groups]
        return lrs, moms

    def state(self):
        """{(j, name): tensor} in the optimizer's numbering."""
        out = {}
        for j, i in enumerate(self.spec.order()):
            for name, v in self.opt.state.get(self.params[i], {}).items():
                out[(j, name)] = v.detach().double().clone()
        return out


ZERO_BY_ROUNDING = 2.0 ** -40


def bound(low, high, steps):
    """Note [Optimizer fuzzer]'s bound, over the finite values (an infinity or NaN must be
    dp's too: the replay compares those exactly)."""
    low = low.double()
    finite = torch.isfinite(high) & torch.isfinite(low)
    if not bool(finite.any()):
        return 0.0
    err = float((low[finite] - high[finite]).abs().max())
    return 16 * err + max(1, steps) * 2.0 ** -20 * float(high[finite].abs().max())


OPTIMIZERS = ("SGD", "Adam", "AdamW")
SCHEDULERS = ("StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "LinearLR", "OneCycleLR")


def draw_options(rng, kind, group=False):
    if kind == "SGD":
        o = {}
        if not group or rng.random() < 0.5:
            o["lr"] = rng.choice([0.1, 0.05, 0.01, 0.3])
        if not group or rng.random() < 0.4:
            o["momentum"] = rng.choice([0.0, 0.9, 0.5, 0.99])
            o["dampening"] = rng.choice([0.0, 0.0, 0.1, 0.5])
            o["nesterov"] = int(o["dampening"] == 0.0 and o["momentum"] > 0 and rng.random() < 0.4)
        if not group or rng.random() < 0.4:
            o["weight_decay"] = rng.choice([0.0, 0.0, 1e-4, 0.1])
        return o
    o = {}
    if not group or rng.random() < 0.5:
        o["lr"] = rng.choice([1e-3, 1e-2, 3e-4, 0.1])
    if not group or rng.random() < 0.3:
        o["beta1"], o["beta2"] = rng.choice([(0.9, 0.999), (0.9, 0.95), (0.8, 0.99), (0.0, 0.9), (0.5, 0.999)])
    if not group or rng.random() < 0.3:
        o["eps"] = rng.choice([1e-8, 1e-8, 1e-6, 1e-3])
    if not group or rng.random() < 0.4:
        o["weight_decay"] = rng.choice([0.0, 1e-2, 0.1] if kind == "AdamW" else [0.0, 0.0, 1e-2, 0.1])
    return o


def draw_scheduler(rng, kind, steps, opt_kind, momentum):
    if kind == "StepLR":
        return {"step_size": rng.randint(1, 3), "gamma": rng.choice([0.5, 0.1, 0.9])}
    if kind == "MultiStepLR":
        return {"milestones": sorted(rng.sample(range(0, steps + 1), rng.randint(1, 3))),
                "gamma": rng.choice([0.5, 0.1, 0.7])}
    if kind == "ExponentialLR":
        return {"gamma": rng.choice([0.9, 0.5, 0.99])}
    if kind == "CosineAnnealingLR":
        return {"T_max": rng.randint(1, steps + 2), "eta_min": rng.choice([0.0, 1e-4, 1e-3])}
    if kind == "LinearLR":
        return {"start_factor": rng.choice([1 / 3, 0.25, 0.5, 1.0]), "end_factor": rng.choice([1.0, 0.5, 0.0]),
                "total_iters": rng.randint(1, steps + 1)}
    cycle = int(rng.random() < 0.7 and (opt_kind != "SGD" or momentum > 0))
    total = steps + rng.randint(1, 4)
    pct = rng.choice([0.3, 0.5, 0.25])
    if abs(pct * total - 1) < 1e-9 or (pct * total - 1 <= 0 < pct * total):
        pct = 0.5
    return {"max_lr": rng.choice([0.1, 0.01, 0.05]), "total_steps": total, "pct_start": pct,
            "anneal_strategy": rng.choice(["cos", "linear"]), "cycle_momentum": cycle,
            "base_momentum": rng.choice([0.85, 0.8]), "max_momentum": rng.choice([0.95, 0.9]),
            "div_factor": rng.choice([25.0, 10.0]), "final_div_factor": rng.choice([1e4, 100.0]),
            "three_phase": int(rng.random() < 0.3)}


def options_text(o):
    out = []
    for k, v in o.items():
        if k == "beta2":
            continue
        if k == "beta1":
            out.append(f"betas={num(v)},{num(o['beta2'])}")
        elif isinstance(v, list):
            out.append(f"{k}={','.join(str(x) for x in v)}")
        elif isinstance(v, str):
            out.append(f"{k}={v}")
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append(f"{k}={v}")
        else:
            out.append(f"{k}={num(v)}")
    return " ".join(out)


def shape_text(shape):
    return "x".join(str(d) for d in shape)


class Program:
    def __init__(self, seed, attempt=0):
        self.seed, self.attempt = seed, attempt
        self.rng = random.Random(seed if attempt == 0 else f"{seed}:{attempt}")
        self.gen = torch.Generator().manual_seed(seed * 64 + attempt)
        self.lines = []
        self.tensors = {}  # name -> float32 tensor
        self.checks = []  # per check: its tensors

    def draw(self):
        rng = self.rng
        s = self.spec = Spec()
        s.container = rng.choice(["module", "module", "loose"])
        # Half the module programs take their gradients from backward (one line per round of
        # gradients), so that they run in every DataParallel design; from a stream of their own,
        # so a program number keeps the rest of its program.
        by_backward = s.container == "module" and random.Random(f"{self.seed}:{self.attempt}:backward").random() < 0.5
        n = rng.randint(1, 4)
        s.shapes = [rng.choice([[3], [2, 3], [1], [4, 2], [5], [2, 2, 2]]) for _ in range(n)]
        inits = [(torch.rand(sh, generator=self.gen, dtype=torch.float64) * 4 - 2).float() for sh in s.shapes]
        for i, t in enumerate(inits):
            self.tensors[f"p{i}"] = t
        kind = rng.choice(OPTIMIZERS)
        s.opt = (kind, draw_options(rng, kind))
        if n > 1 and rng.random() < 0.4:
            cut = sorted(rng.sample(range(n), rng.randint(1, n - 1)))
            rest = [i for i in range(n) if i not in cut]
            s.groups = [(cut, draw_options(rng, kind, group=True)), (rest, draw_options(rng, kind, group=True))]
            if rng.random() < 0.5:
                s.groups.reverse()
        steps = rng.randint(1, 6)
        momentum = s.opt[1].get("momentum", 0.0)
        if kind == "SGD" and s.groups:
            momentum = min([g.get("momentum", momentum) for _, g in s.groups])
        for _ in range(rng.choice([0, 1, 1, 1, 2])):
            sk = rng.choice(SCHEDULERS)
            if sk == "OneCycleLR" and any(k == "OneCycleLR" for k, _ in s.scheds):
                continue
            s.scheds.append((sk, draw_scheduler(rng, sk, steps, kind, momentum)))
        if rng.random() < 0.3:
            s.scaler = {"init_scale": rng.choice([1024.0, 65536.0, 8.0]), "growth_factor": rng.choice([2.0, 4.0]),
                        "backoff_factor": rng.choice([0.5, 0.25]), "growth_interval": rng.randint(1, 3)}
        self.lines.append(f"params {s.container} " + " ".join(shape_text(sh) for sh in s.shapes))
        self.lines.append(f"opt {kind} {options_text(s.opt[1])}".rstrip())
        for idx, g in s.groups:
            self.lines.append(f"group {','.join(str(i) for i in idx)} {options_text(g)}".rstrip())
        for sk, so in s.scheds:
            self.lines.append(f"sched {sk} {options_text(so)}")
        if s.scaler:
            self.lines.append(f"scaler {options_text(s.scaler)}")
        self.low = Run(s, inits, torch.float32)
        self.high = Run(s, inits, torch.float64)
        frozen = [False] * n
        for step in range(steps):
            if step == 0 or rng.random() < 0.8:
                self.emit(["zero_grad", "none" if rng.random() < 0.75 else "zeros"])
            has_grad = [t.grad is not None for t in self.low.params]
            for i in range(n):
                if frozen[i] and rng.random() < 0.3:
                    frozen[i] = False
                    self.emit(["unfreeze", str(i)])
                elif not frozen[i] and not has_grad[i] and rng.random() < 0.12:
                    frozen[i] = True
                    self.emit(["freeze", str(i)])
            inf_at = None
            if s.scaler and rng.random() < 0.3:
                inf_at = rng.randrange(n)
            rounds = [[], []]  # by_backward: the gradients of each backward, "i=g<k>"
            for i in range(n):
                if frozen[i] or rng.random() < 0.2:
                    continue
                for r in range(rng.choice([1, 1, 1, 2])):
                    mag = rng.choice([1.0, 1.0, 1e-3, 30.0])
                    g = (torch.rand(s.shapes[i], generator=self.gen, dtype=torch.float64) * 4 - 2) * mag
                    if rng.random() < 0.15:
                        g = g * (torch.rand(s.shapes[i], generator=self.gen) < 0.5)
                    if s.scaler:
                        g = g * self.low.scaler.get_scale()
                    g = g.float()
                    if inf_at == i:
                        g.view(-1)[rng.randrange(g.numel())] = rng.choice([math.inf, -math.inf, math.nan])
                        inf_at = None
                    name = f"g{sum(1 for k in self.tensors if k.startswith('g'))}"
                    self.tensors[name] = g
                    has = self.low.params[i].grad is not None
                    how = "add" if has and rng.random() < 0.5 else "set"
                    if by_backward:
                        rounds[r].append(f"{i}={name}")
                    else:
                        self.emit(["grad", str(i), name, how])
            for r in rounds:
                if r:
                    self.emit(["backward"] + r)
            unscaled = False
            if s.scaler and rng.random() < 0.4:
                self.emit(["unscale"])
                unscaled = True
            if (not s.scaler or unscaled) and rng.random() < 0.3:
                self.emit(["clip_norm", num(rng.choice([0.5, 1.0, 5.0, 100.0])), num(rng.choice([2.0, 2.0, 1.0,
                                                                                                  math.inf]))])
            if (not s.scaler or unscaled) and rng.random() < 0.15:
                self.emit(["clip_value", num(rng.choice([0.1, 0.5, 1.0]))])
            any_grad = any(t.grad is not None for t in self.low.params)
            if rng.random() < 0.9 and (any_grad or not s.scaler):  # PyTorch's scaler asserts there
                self.emit(["step"])
            if s.scheds and rng.random() < 0.9:
                self.emit(["sched_step"])
            if rng.random() < 0.12:
                g = rng.randrange(max(1, len(s.groups)))
                self.emit(["set_lr", str(g), num(rng.choice([0.02, 1e-3, 0.2]))])
            if rng.random() < 0.15:
                self.emit(["set_option"] + self.draw_option_edit())
            if rng.random() < 0.15:
                self.emit(["resume"])
            self.check(step + 1)
        return self

    def draw_option_edit(self):
        """A hyper-parameter of one group changed by hand, to a value its optimizer's
        constructor takes (dp's set_options refuses the others, PyTorch's step runs them)."""
        rng = self.rng
        g = rng.randrange(len(self.low.opt.param_groups))
        group = self.low.opt.param_groups[g]
        if self.spec.opt[0] == "SGD":
            key = rng.choice(["momentum", "dampening", "weight_decay", "nesterov"])
            if key == "momentum":
                choices = [0.0, 0.5, 0.9] if not group["nesterov"] else [0.5, 0.9]
                return [str(g), key, num(rng.choice(choices))]
            if key == "dampening":
                return [str(g), key, num(0.0 if group["nesterov"] else rng.choice([0.0, 0.1, 0.6]))]
            if key == "nesterov":
                ok = group["momentum"] > 0 and group["dampening"] == 0
                return [str(g), key, str(int(ok and not group["nesterov"]))]
            return [str(g), key, num(rng.choice([0.0, 1e-3, 0.1]))]
        key = rng.choice(["betas", "eps", "weight_decay"])
        if key == "betas":
            b1, b2 = rng.choice([(0.9, 0.999), (0.9, 0.95), (0.5, 0.99), (0.0, 0.9)])
            return [str(g), key, f"{num(b1)},{num(b2)}"]
        if key == "eps":
            return [str(g), key, num(rng.choice([1e-8, 1e-6, 1e-3]))]
        return [str(g), key, num(rng.choice([0.0, 1e-2, 0.1]))]

    def emit(self, w):
        self.lines.append(" ".join(w))
        for r in (self.low, self.high):
            r.line(w, self.tensors)

    def check(self, steps):
        k = len(self.checks)
        t = {}
        for i, (lo, hi) in enumerate(zip(self.low.params, self.high.params)):
            t[f"k{k}.p{i}"] = hi.detach().clone()
            t[f"k{k}.bp{i}"] = torch.tensor(bound(lo.detach(), hi.detach(), steps), dtype=torch.float64)
        ls, hs = self.low.state(), self.high.state()
        for (j, name), hv in sorted(hs.items()):
            t[f"k{k}.s{j}.{name}"] = hv
            if name != "step":
                t[f"k{k}.bs{j}.{name}"] = torch.tensor(bound(ls[(j, name)], hv, steps), dtype=torch.float64)
        lrs, moms = self.low.group_values()
        t[f"k{k}.lr"] = torch.tensor(lrs, dtype=torch.float64)
        t[f"k{k}.mom"] = torch.tensor(moms, dtype=torch.float64)
        if self.low.scaler:
            t[f"k{k}.scale"] = torch.tensor(self.low.scaler.get_scale(), dtype=torch.float64)
            t[f"k{k}.growth_tracker"] = torch.tensor(float(self.low.scaler._growth_tracker), dtype=torch.float64)
        for j, (lo, hi) in enumerate(zip(self.low.norms, self.high.norms)):
            t[f"k{k}.n{j}"] = torch.tensor(hi, dtype=torch.float64)
            err = abs(lo - hi) if math.isfinite(hi) else 0.0
            t[f"k{k}.bn{j}"] = torch.tensor(16 * err + 2.0 ** -20 * (abs(hi) if math.isfinite(hi) else 0.0),
                                            dtype=torch.float64)
        self.checks.append(t)
        self.lines.append(f"check k{k}")


def drawn(seed):
    """Program `seed`, drawn again (deterministically) while PyTorch refuses it."""
    for attempt in range(20):
        try:
            return Program(seed, attempt).draw()
        except (RuntimeError, ValueError, AssertionError, ZeroDivisionError):
            continue
    raise RuntimeError(f"program {seed}: PyTorch refused 20 draws")


def case_tensors(seed, prefix):
    p = drawn(seed)
    tensors = {f"{prefix}.{n}": t.contiguous() for n, t in p.tensors.items()}
    for c in p.checks:
        # Tensors compared within a bound travel as float32 (half a unit in the last place,
        # far below the bound's floor of 2^-20 of the tensor's scale); the values compared
        # exactly (lrs, momenta, the scale, step counts, norms) as the bits of their float64
        # in int64 tensors (dp has no float64 dtype).
        for n, v in c.items():
            rounded = re.fullmatch(r"k\d+\.(p\d+|s\d+\.\w+)", n) is not None and not n.endswith(".step")
            tensors[f"{prefix}.{n}"] = v.float().contiguous() if rounded else v.contiguous().view(torch.int64)
    return tensors, "; ".join(p.lines)


def write_file(path, seeds):
    write_corpus(path, seeds, case_tensors, "scripts/optim_fuzz.py --write (Note [Optimizer fuzzer]); do not edit")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0:200",
                    help="A:B (programs A..B-1) or single programs, comma-separated: 0:200,552,2394")
    ap.add_argument("--write", help="write the corpus to this file")
    ap.add_argument("--replay", help="optim_fuzz_replay binary: run dp on the programs and report")
    ap.add_argument("--replay-args", default="",
                    help="more arguments for the replay binary: '--design all --devices 3' runs the programs in "
                         "every DataParallel design on 3 CPU devices (DP_CPU_DEVICES must allow them)")
    ap.add_argument("--batch", type=int, default=500, help="programs per replay call")
    ap.add_argument("--print", action="store_true", help="print each program")
    a = ap.parse_args()
    seeds = parse_seeds(a.seeds)
    if a.print:
        for s in seeds:
            print(f"# program {s}\n" + "\n".join(drawn(s).lines))
    if a.write:
        write_file(a.write, seeds)
        print(f"wrote {len(seeds)} programs to {a.write}")
    if a.replay:
        hunt("optim_fuzz", a.replay, write_file, seeds, a.batch, a.seeds, a.replay_args.split())


if __name__ == "__main__":
    main()
