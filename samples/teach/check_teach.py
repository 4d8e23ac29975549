#!/usr/bin/env python3
"""Runs the teach sample and checks its narration, figures and trace.

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

    check(o.get("max_param_diff", 1) <= 1e-6, f"DP and DDP parameters differ by {o.get('max_param_diff')}")
    check(o.get("max_param_diff_sharded", 1) <= 1e-6,
          f"DDP and Sharded parameters differ by {o.get('max_param_diff_sharded')}")
    text = "\n".join(o.get("narration", []))
    for phrase in ("replicate: 0.weight [32, 1, 3, 3] 1152 B cpu:0 → cpu:1,2,3", "DP reduce: 4 gradient buffers",
                   "DDP bucket 0 (params 9.bias, 9.weight", "2(N-1)/N", "(N-1)·P", "through cpu:0",
                   "waiting until the slowest device joined", "copies nothing itself",
                   "cpu:0 owns [0, ", "REDUCED ONTO ITS OWNER", "all-gather", "= P, as they must",
                   f"median of {iterations} iterations"):
        check(phrase in text, f"narration lacks '{phrase}'")
    check("ALL through" not in text and " won " not in text, "narration claims a winner or a single hub for DDP")

    # The trace: one process per design, one track per worker (and comm thread in DDP, Sharded).
    try:
        with open(trace) as f:
            t = json.load(f)
        names = {}
        for e in t["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                names.setdefault(e["pid"], []).append(e["args"]["name"])
        for pid, comms in ((1, 0), (2, 4), (3, 4)):
            tracks = names.get(pid, [])
            check(sum(n.startswith("worker ") for n in tracks) == 4, f"process {pid} tracks {tracks}")
            check(sum(n.startswith("comm ") for n in tracks) == comms, f"process {pid} tracks {tracks}")
    except (OSError, ValueError, KeyError) as e:
        check(False, f"trace {trace}: {e}")

    # Text mode, stage 1, an explicit id list, and the default device count: never more
    # devices than hardware threads (no oversubscription by default), and --help says it.
    r = run(exe, "--devices", "0,2", "--batch", "8", "--iterations", "1", "--shard-stage", "1")
    check(r.returncode == 0 and "== DDP" in r.stdout and "ZeRO stage 1" in r.stdout and "cpu:2" in r.stdout,
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
                ["--iterations", "0"], ["--nope"]):
        r = run(exe, *bad, timeout=60)
        check(r.returncode != 0 and r.stderr.strip(), f"{bad} exited {r.returncode}")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
