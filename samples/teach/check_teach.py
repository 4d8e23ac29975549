#!/usr/bin/env python3
"""Runs the teach sample and checks its narration, figures and trace (stage 3 to the byte).

usage: check_teach.py EXE WORKDIR
"""
import json
import math
import os
import re
import subprocess
import sys

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(exe, *args, timeout=180):
    return subprocess.run([exe] + list(args), capture_output=True, text=True, timeout=timeout)


def run_json(what, exe, *args, timeout=180):
    """Runs the sample with --json; its object, or {} (a failure) when it failed or printed no JSON."""
    r = run(exe, *args, "--json", timeout=timeout)
    check(r.returncode == 0, f"{what}: exit status {r.returncode}: {r.stderr[-300:]}")
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError:
        check(False, f"{what}: output is not JSON")
        return {}


def main():
    exe, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    trace = os.path.join(work, "teach_trace.json")
    if os.path.exists(trace):
        os.remove(trace)
    iterations = 3
    r = run(exe, "--devices", "4", "--batch", "32", "--iterations", str(iterations), "--json", "--trace", trace)
    sys.stderr.write(r.stderr)
    check(r.returncode == 0, f"exit status {r.returncode}")
    try:
        o = json.loads(r.stdout)
    except json.JSONDecodeError as e:
        print("FAIL: output is not JSON:", e, r.stdout[:300])
        return 1
    for k in ("sample", "devices", "global_batch", "iterations", "param_bytes", "dp", "ddp", "sharded",
              "max_param_diff", "max_param_diff_sharded", "trace", "narration"):
        check(k in o, f"key '{k}' missing")
    N, P = o.get("devices"), o.get("param_bytes", 0)
    check(N == 4, f"devices {N}")
    for mode in ("dp", "ddp", "sharded"):
        m = o.get(mode, {})
        check(math.isfinite(m.get("loss", float("nan"))), f"{mode}: loss {m.get('loss')}")
        it = m.get("iteration", {})
        times = it.get("all_ms", [])
        check(len(times) == iterations, f"{mode}: {len(times)} iteration times, expected {iterations}")
        if times:
            check(it.get("median_ms") == sorted(times)[len(times) // 2], f"{mode}: median of {times}")
            check(it.get("min_ms") == min(times) and it.get("max_ms") == max(times), f"{mode}: spread of {times}")
        check(len(m.get("phase_ms", [])) == 4, f"{mode}: phase_ms for {len(m.get('phase_ms', []))} devices")
        for d in m.get("phase_ms", []):
            for p in ("scatter", "replicate", "forward", "backward", "reduce", "allreduce_hidden",
                      "allreduce_exposed", "step", "gather", "allgather", "device", "peak_memory_bytes"):
                check(p in d, f"{mode}: phase '{p}' missing")

    # DP: device 0 moves N-1 parameter copies out and N-1 gradient copies in; others 2P.
    check(o["dp"].get("bytes_through_device0") == 2 * (N - 1) * P, "DP bytes through device 0")
    check(o["dp"].get("bytes_other_device") == 2 * P, "DP bytes of another device")
    check(abs(o["ddp"].get("bytes_per_device", 0) - 2 * (N - 1) / N * P) < 1e-6, "DDP bytes per device")
    buckets = o.get("ddp", {}).get("buckets", [])
    check(len(buckets) >= 1, "no DDP buckets")
    for b in buckets:
        for k in ("index", "params", "bytes", "start_ms", "last_join_ms", "end_ms", "waiting_ms", "overlap_ms",
                  "exposed_ms"):
            check(k in b, f"bucket key '{k}' missing")
        if "waiting_ms" in b:
            check(abs(b["waiting_ms"] - (b["last_join_ms"] - b["start_ms"])) < 1e-9, f"bucket waiting {b}")
    check(sum(b.get("bytes", 0) for b in buckets) == P, "buckets do not cover the gradients")

    # Sharded: the ranges, recomputed here from P and N, and the bytes they imply.
    sh = o.get("sharded", {})
    elems = P // 4
    S = -(-elems // N)
    S = -(-S // 16) * 16
    shards = sh.get("shards", [])
    check(sh.get("stage") == 2, f"default shard stage {sh.get('stage')}")
    check(sh.get("param_elems") == elems, f"param_elems {sh.get('param_elems')} != {elems}")
    check(shards == [[r * S, (r + 1) * S] for r in range(N)], f"shards {shards}, expected S = {S}")
    owned = [max(0, min(hi, elems) - lo) for lo, hi in shards]
    check(sh.get("reduce_scatter_recv_bytes") == [4.0 * (N - 1) * w for w in owned], "reduce-scatter bytes in")
    check(sh.get("reduce_scatter_send_bytes") == [4.0 * (elems - w) for w in owned], "reduce-scatter bytes out")
    check(sh.get("all_gather_recv_bytes") == [4.0 * (N - 1) * S] * N, "all-gather bytes in")
    check(sh.get("recorded_bucket_bytes") == P, f"recorded reduce-scatter bytes {sh.get('recorded_bucket_bytes')}")
    rs_ag = sh["reduce_scatter_recv_bytes"][0] + sh["all_gather_recv_bytes"][0] if shards else 0
    check(abs(rs_ag - 2 * (N - 1) / N * P) <= 4 * 2 * (N - 1) * 16, "Sharded bytes differ from DDP's beyond padding")

    # Stage 3: the gather units recomputed from the CNN's layer shapes, the bytes each
    # gather and the reduce-scatter move per device, and the allocator's count between
    # steps, which must be the parameters', gradient's and momentum's ranges exactly.
    s3 = o.get("stage3", {})
    check(s3.get("stage") == 3, f"stage 3 run: stage {s3.get('stage')}")
    check(s3.get("shards") == shards, f"stage 3 shards {s3.get('shards')}")
    layers = [("0", 32 * 1 * 3 * 3 + 32), ("3", 64 * 32 * 3 * 3 + 64), ("7", 3136 * 128 + 128), ("9", 128 * 10 + 10)]
    units, lo = [], 0
    for child, size in layers:
        units.append((child, lo, lo + size))
        lo += size
    check(lo == elems, f"the CNN's layers hold {lo} floats, P says {elems}")
    got_units = [(u.get("child"), u.get("lo"), u.get("hi")) for u in s3.get("units", [])]
    check(got_units == units, f"gather units {got_units}, expected {units}")

    def own(u_lo, u_hi, d):
        return max(0, min(u_hi, shards[d][1]) - max(u_lo, shards[d][0])) if d < len(shards) else 0

    fwd_in = [sum(4 * (hi - lo - own(lo, hi, d)) for _, lo, hi in units) for d in range(N)]
    fwd_out = [sum(4 * (N - 1) * own(lo, hi, d) for _, lo, hi in units) for d in range(N)]
    bwd_in = [sum(4 * (hi - lo - own(lo, hi, d)) for _, lo, hi in units[:-1]) for d in range(N)]
    bwd_out = [sum(4 * (N - 1) * own(lo, hi, d) for _, lo, hi in units[:-1]) for d in range(N)]
    rs_in = [4 * (N - 1) * w for w in owned]
    rs_out = [4 * (elems - w) for w in owned]
    check(s3.get("forward_gather_recv_bytes") == fwd_in, f"stage 3 forward gather bytes in {s3.get('forward_gather_recv_bytes')}")
    check(s3.get("forward_gather_send_bytes") == fwd_out, "stage 3 forward gather bytes out")
    check(s3.get("backward_gather_recv_bytes") == bwd_in, "stage 3 backward gather bytes in")
    check(s3.get("backward_gather_send_bytes") == bwd_out, "stage 3 backward gather bytes out")
    check(s3.get("reduce_scatter_recv_bytes") == rs_in and s3.get("reduce_scatter_send_bytes") == rs_out,
          "stage 3 reduce-scatter bytes")
    total_in = [fwd_in[d] + bwd_in[d] + rs_in[d] for d in range(N)]
    total_out = [fwd_out[d] + bwd_out[d] + rs_out[d] for d in range(N)]
    check(s3.get("total_recv_bytes") == total_in and s3.get("total_send_bytes") == total_out, "stage 3 totals")
    # What leaves one device arrives at another; a ring all-gather of every unit moves the same.
    check(sum(fwd_in) == sum(fwd_out) == (N - 1) * P, "stage 3 forward gathers do not move (N-1)·P in all")
    last = 4 * (units[-1][2] - units[-1][1])
    check(abs(sum(total_in) / N - (N - 1) / N * (3 * P - last)) < 1e-6, "stage 3 mean bytes per device")
    check(s3.get("forward_gather_calls") == [len(units)] * N, f"forward gathers {s3.get('forward_gather_calls')}")
    check(s3.get("backward_gather_calls") == [len(units)] * N, f"backward gathers {s3.get('backward_gather_calls')}")
    check(s3.get("recorded_bucket_bytes") == P, f"stage 3 recorded reduce-scatter bytes {s3.get('recorded_bucket_bytes')}")
    sizes = [4 * (hi - lo) for _, lo, hi in units]
    check(s3.get("params_held_bytes") == 4 * S, "stage 3 parameters held")
    check(s3.get("largest_unit_bytes") == max(sizes), "stage 3 largest unit")
    pair = max(sizes[i] + (sizes[i + 1] if i + 1 < len(sizes) else 0) for i in range(len(sizes)))
    check(s3.get("forward_gathered_peak_bytes") == pair, "stage 3 unit and prefetched successor")
    between = [8 * S + 4 * w for w in owned]
    check(s3.get("between_steps_expected_bytes") == between, "stage 3 expected memory between steps")
    check(s3.get("between_steps_bytes") == between, f"the allocator's count between steps {s3.get('between_steps_bytes')}, "
          f"first principles {between}")
    check(s3.get("ddp_between_steps_bytes") == [3 * P] * N, f"DDP between steps {s3.get('ddp_between_steps_bytes')}")
    peaks = s3.get("peak_bytes", [])
    check(len(peaks) == N and all(between[d] + max(sizes) <= peaks[d] < s3["ddp_peak_bytes"][d] for d in range(N)),
          f"stage 3 peaks {peaks}: expected above the between-steps count plus the largest unit, below DDP's")
    check(o.get("max_param_diff_stage3", 1) == 0, f"DDP and stage 3 parameters differ by {o.get('max_param_diff_stage3')}")

    check(o.get("max_param_diff", 1) <= 1e-6, f"DP and DDP parameters differ by {o.get('max_param_diff')}")
    check(o.get("max_param_diff_sharded", 1) <= 1e-6,
          f"DDP and Sharded parameters differ by {o.get('max_param_diff_sharded')}")
    text = "\n".join(o.get("narration", []))
    for phrase in ("replicate: 0.weight [32, 1, 3, 3] 1152 B cpu:0 → cpu:1,2,3", "DP reduce: 4 gradient buffers",
                   "DDP bucket 0 (params 9.bias, 9.weight", "2(N-1)/N", "(N-1)·P", "through cpu:0",
                   "waiting until the slowest device joined", "copies nothing itself",
                   "cpu:0 owns [0, ", "REDUCED ONTO ITS OWNER", "all-gather", "= P, as they must",
                   f"median of {iterations} iterations", "ZeRO stage 3"):
        check(phrase in text, f"narration lacks '{phrase}'")
    # The stage-3 narration states the recomputed figures to the byte.
    for d in range(N):
        check(f"cpu:{d} holds [{shards[d][0]}, {shards[d][1]}): 4·S = {int(4 * S)} B" in text, f"stage 3: cpu:{d}'s range")
        check(f"cpu:{d}: forward gathers in {int(fwd_in[d])} B" in text and f"out {int(fwd_out[d])} B" in text and
              f"backward gathers in {int(bwd_in[d])} B" in text and f"total in {int(total_in[d])} B" in text and
              f"out {int(total_out[d])} B" in text, f"stage 3: cpu:{d}'s bytes")
        check(f"cpu:{d}: expected {int(between[d])} B" in text, f"stage 3: cpu:{d}'s memory between steps")
    for i, (child, lo, hi) in enumerate(units):
        check(f"unit {i} = child '{child}' ({child}.weight, {child}.bias) [{lo}, {hi}), {4 * (hi - lo)} B" in text,
              f"stage 3: unit {i}")
        ins = ", ".join(f"cpu:{d} in {int(4 * (hi - lo - own(lo, hi, d)))} B" for d in range(N))
        check(f"unit {i} (" in text and ins in text, f"stage 3: unit {i}'s gather, '{ins}'")
    check("DIFFERENT" not in text, "stage 3: the allocator disagrees with first principles")
    check(f"at most {int(pair)} B" in text and f"largest child is '7' (unit 2, {int(max(sizes))} B" in text,
          "stage 3: the gathered units' memory")
    check("ALL through" not in text and " won " not in text, "narration claims a winner or a single hub for DDP")

    # The trace: one process per design, one track per worker (and comm thread in DDP, Sharded).
    try:
        with open(trace) as f:
            t = json.load(f)
        names = {}
        for e in t["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                names.setdefault(e["pid"], []).append(e["args"]["name"])
        for pid, comms in ((1, 0), (2, 4), (3, 4), (4, 4)):
            tracks = names.get(pid, [])
            check(sum(n.startswith("worker ") for n in tracks) == 4, f"process {pid} tracks {tracks}")
            check(sum(n.startswith("comm ") for n in tracks) == comms, f"process {pid} tracks {tracks}")
    except (OSError, ValueError, KeyError) as e:
        check(False, f"trace {trace}: {e}")

    # Text mode, stage 1, an explicit id list, and the default device count: never more
    # devices than hardware threads (no oversubscription by default), and --help says it.
    r = run(exe, "--devices", "0,2", "--batch", "8", "--iterations", "1", "--shard-stage", "1")
    check(r.returncode == 0 and "== DDP" in r.stdout and "ZeRO stage 1" in r.stdout and "ZeRO stage 3" in r.stdout
          and "cpu:2" in r.stdout,
          f"text mode, stage 1, ids 0,2: {r.returncode} {r.stderr[-300:]}")
    r = run(exe, "--batch", "8", "--iterations", "1", "--json")
    default_devices = json.loads(r.stdout).get("devices") if r.returncode == 0 else None
    threads = json.loads(r.stdout).get("hardware_threads") if r.returncode == 0 else None
    check(default_devices is not None and default_devices <= max(2, min(4, threads)),
          f"default run uses {default_devices} devices on {threads} hardware threads")
    r = run(exe, "--help")
    check(r.returncode == 0 and re.search(r"--devices TEXT(=| \[)" + str(default_devices) + r"\b", r.stdout) is not None,
          f"--help does not show the default device count {default_devices}: {r.stdout[:600]}")
    for bad in (["--devices", "1"], ["--devices", "100000"], ["--devices", "0,0"], ["--devices", "x"],
                ["--batch", "0"], ["--devices", "4", "--batch", "2"], ["--shard-stage", "3"],
                ["--iterations", "0"], ["--nope"], ["--model", "vgg"]):
        r = run(exe, *bad, timeout=60)
        check(r.returncode != 0 and r.stderr.strip(), f"{bad} exited {r.returncode}")

    # The GPT: a gather unit per transformer block (shard_unit), named by its module; the
    # allocator agrees with first principles between steps; every design ends bitwise alike.
    g = run_json("--model gpt", exe, "--model", "gpt", "--devices", "2", "--batch", "2", "--iterations", "1",
                 timeout=300)
    children = [u.get("child") for u in g.get("stage3", {}).get("units", [])]
    check(children == ["transformer"] + [f"transformer.h.{i}" for i in range(6)] + ["transformer.ln_f"],
          f"--model gpt: gather units {children}")
    check(g.get("stage3", {}).get("between_steps_bytes") == g.get("stage3", {}).get("between_steps_expected_bytes"),
          "--model gpt: the allocator's count between steps differs from first principles")
    check(g.get("max_param_diff") == 0 and g.get("max_param_diff_sharded") == 0 and g.get("max_param_diff_stage3") == 0,
          "--model gpt: the designs' parameters differ")
    check("a GPT" in "\n".join(g.get("narration", [])), "--model gpt: the narration does not name the GPT")

    # Mixed precision: a bf16 DDP step told phase by phase, every dtype measured, and the
    # bytes of a bf16 wire against the float32 wire's. The default run tells none of it.
    check(o.get("mixed_precision") is None and "Mixed precision" not in text,
          "the default run narrates mixed precision")
    b = run_json("--precision bf16 --reduce-dtype bf16", exe, "--devices", "4", "--batch", "32", "--iterations", "2",
                 "--precision", "bf16", "--reduce-dtype", "bf16")
    m = b.get("mixed_precision") or {}
    P = b.get("param_bytes", 0)
    check(m.get("precision") == "bf16" and m.get("reduce_dtype") == "bf16", f"mixed precision options {m.get('precision')}")
    # Every worker's loss got bfloat16 logits and returned a float32 loss, in every traced iteration.
    check(m.get("logits_dtypes") == ["bfloat16"] and m.get("loss_calls") == 4 * 2,
          f"logits dtypes {m.get('logits_dtypes')} over {m.get('loss_calls')} loss calls, expected bfloat16 over 8")
    check(m.get("loss_dtypes") == ["float32"] and m.get("probe_loss_dtype") == "float32", f"loss dtypes {m.get('loss_dtypes')}")
    check(m.get("softmax_dtype") == "float32" and m.get("layer_norm_dtype") == "float32", "softmax / layer_norm not float32")
    # The CNN's activations on a shard of 8 rows: bfloat16, 2 B an element.
    acts = m.get("activations", [])
    check([a.get("child") for a in acts] == [str(i) for i in range(10)], f"activations {[a.get('child') for a in acts]}")
    for a in acts:
        check(a.get("dtype") == "bfloat16" and a.get("bytes") == 2 * math.prod(a.get("shape", [0])),
              f"activation {a}: expected bfloat16, 2 B an element")
    if acts:
        check(acts[0].get("type") == "Conv2d" and acts[0].get("shape") == [8, 32, 28, 28], f"first activation {acts[0]}")
        check(acts[-1].get("shape") == [8, 10] and m.get("probe_logits_dtype") == "bfloat16", f"logits {acts[-1]}")
    # float32 accumulation inside a bfloat16 product; a bfloat16 running sum stalls at 256.
    acc = m.get("accumulation", {})
    check(acc.get("k") == 1024 and acc.get("product") == 1024 and acc.get("product_dtype") == "bfloat16"
          and acc.get("bf16_running_sum") == 256, f"accumulation {acc}")
    # Master weights, gradients in the leaves and the optimizer state: float32, 4 B a parameter.
    check(m.get("param_dtype") == "float32" and m.get("grad_dtype") == "float32", "parameters or gradients not float32")
    check(m.get("optimizer_state_dtypes") == ["float32"] and m.get("optimizer_state_bytes") == P,
          f"optimizer state {m.get('optimizer_state_dtypes')} {m.get('optimizer_state_bytes')} B, expected float32, {P} B")
    check(m.get("grad_elems") == P // 4 and m.get("updates") == P // 4, "gradient / update counts")
    check(0 < m.get("updates_lost_in_bf16_weights", 0) < m.get("updates", 0),
          f"updates lost in bf16 weights {m.get('updates_lost_in_bf16_weights')}")
    check(m.get("grad_zero_in_bf16") == 0 and m.get("grad_zero_in_fp16", -1) >= m.get("grad_zero_in_bf16", 0),
          f"gradients flushed to zero: fp16 {m.get('grad_zero_in_fp16')}, bf16 {m.get('grad_zero_in_bf16')}")
    # The wire: half the bytes, and a rounding that shows in the parameters, barely.
    check(m.get("grad_bytes_fp32_wire") == P and m.get("recorded_bucket_bytes_fp32_wire") == P, "float32 wire bytes")
    check(m.get("grad_bytes_wire") == P / 2 and m.get("recorded_bucket_bytes_wire") == P / 2,
          f"bf16 wire bytes {m.get('grad_bytes_wire')} / {m.get('recorded_bucket_bytes_wire')}, expected {P / 2}")
    check(0 < m.get("max_param_diff_wire", 0) < 1e-3, f"bf16 wire against float32's: {m.get('max_param_diff_wire')}")
    # Under autocast the designs still agree.
    check(b.get("max_param_diff") == 0 and b.get("max_param_diff_sharded") == 0 and b.get("max_param_diff_stage3") == 0,
          "--precision bf16: the designs' parameters differ")
    btext = "\n".join(b.get("narration", []))
    for phrase in ("== Mixed precision in the DDP step (--precision bf16, --reduce-dtype bf16)",
                   "'0' (Conv2d) → bfloat16 [8, 32, 28, 28], 401408 B (float32: 802816 B)",
                   "The logits reached the loss as bfloat16 on every worker",
                   "gives 1024 (bfloat16)", "stops at 256", "the loss is float32", ".grad are float32",
                   f"the bytes halved ({int(P)} → {int(P // 2)} B)", "bfloat16 on the wire",
                   "no GradScaler", "master weights are float32"):
        check(phrase in btext, f"--precision bf16: narration lacks '{phrase}'")
    # A float16 wire without autocast: the forward stays float32, the bytes still halve.
    h = run_json("--reduce-dtype fp16", exe, "--devices", "2", "--batch", "8", "--iterations", "1", "--reduce-dtype", "fp16")
    f16 = h.get("mixed_precision") or {}
    check(f16.get("logits_dtypes") == ["float32"] and "accumulation" not in f16, f"--reduce-dtype fp16 alone: {f16.get('logits_dtypes')}")
    check(f16.get("grad_bytes_wire", 0) * 2 == f16.get("grad_bytes_fp32_wire", -1) > 0, "--reduce-dtype fp16: bytes not halved")
    check("float16 on the wire" in "\n".join(h.get("narration", [])),
          "--reduce-dtype fp16: the narration does not say float16 on the wire")
    r = run(exe, "--precision", "fp16", timeout=60)
    check(r.returncode != 0 and r.stderr.strip(), "--precision fp16 (teach offers fp32 and bf16) was accepted")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
