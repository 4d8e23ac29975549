#!/usr/bin/env python3
"""Runs the teach sample and checks its narration, figures and trace.

usage: check_teach.py EXE WORKDIR
"""
import json
import math
import os
import subprocess
import sys

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def main():
    exe, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    trace = os.path.join(work, "teach_trace.json")
    if os.path.exists(trace):
        os.remove(trace)
    r = subprocess.run([exe, "--devices", "4", "--batch", "32", "--json", "--trace", trace],
                       capture_output=True, text=True, timeout=120)
    sys.stderr.write(r.stderr)
    check(r.returncode == 0, f"exit status {r.returncode}")
    try:
        o = json.loads(r.stdout)
    except json.JSONDecodeError as e:
        print("FAIL: output is not JSON:", e, r.stdout[:300])
        return 1
    for k in ("sample", "devices", "global_batch", "param_bytes", "dp", "ddp", "max_param_diff", "trace",
              "narration"):
        check(k in o, f"key '{k}' missing")
    for mode in ("dp", "ddp"):
        m = o.get(mode, {})
        check(math.isfinite(m.get("loss", float("nan"))), f"{mode}: loss {m.get('loss')}")
        check(len(m.get("phase_ms", [])) == 4, f"{mode}: phase_ms for {len(m.get('phase_ms', []))} devices")
        for d in m.get("phase_ms", []):
            for p in ("scatter", "replicate", "forward", "backward", "reduce", "allreduce_hidden",
                      "allreduce_exposed", "step", "gather", "device", "peak_memory_bytes"):
                check(p in d, f"{mode}: phase '{p}' missing")
    buckets = o.get("ddp", {}).get("buckets", [])
    check(len(buckets) >= 1, "no DDP buckets")
    for b in buckets:
        for k in ("index", "params", "bytes", "start_ms", "end_ms", "overlap_ms", "exposed_ms"):
            check(k in b, f"bucket key '{k}' missing")
    check(sum(b.get("bytes", 0) for b in buckets) == o.get("param_bytes"), "buckets do not cover the gradients")
    check(o.get("max_param_diff", 1) <= 1e-6, f"DP and DDP parameters differ by {o.get('max_param_diff')}")
    text = "\n".join(o.get("narration", []))
    for phrase in ("replicate: 0.weight [32, 1, 3, 3] 1152 B cpu:0 → cpu:1,2,3", "DP reduce: 4 gradient buffers",
                   "DDP bucket 0 (params 9.bias, 9.weight", "2(N-1)/N", "(N-1)·P"):
        check(phrase in text, f"narration lacks '{phrase}'")

    # The trace: DP and DDP as two processes, one track per worker (and comm thread in DDP).
    try:
        with open(trace) as f:
            t = json.load(f)
        names = {}
        for e in t["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                names.setdefault(e["pid"], []).append(e["args"]["name"])
        dp_tracks, ddp_tracks = names.get(1, []), names.get(2, [])
        check(sum(n.startswith("worker ") for n in dp_tracks) == 4, f"DP tracks {dp_tracks}")
        check(sum(n.startswith("comm ") for n in dp_tracks) == 0, f"DP tracks {dp_tracks}")
        check(sum(n.startswith("worker ") for n in ddp_tracks) == 4, f"DDP tracks {ddp_tracks}")
        check(sum(n.startswith("comm ") for n in ddp_tracks) == 4, f"DDP tracks {ddp_tracks}")
    except (OSError, ValueError, KeyError) as e:
        check(False, f"trace {trace}: {e}")

    # Text mode and bad flags.
    r = subprocess.run([exe, "--devices", "2", "--batch", "8"], capture_output=True, text=True, timeout=120)
    check(r.returncode == 0 and "== DDP" in r.stdout, "text mode")
    for bad in (["--devices", "1"], ["--devices", "100000"], ["--batch", "0"], ["--devices", "4", "--batch", "2"],
                ["--nope"]):
        r = subprocess.run([exe] + bad, capture_output=True, text=True, timeout=60)
        check(r.returncode != 0 and r.stderr.strip(), f"{bad} exited {r.returncode}")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
