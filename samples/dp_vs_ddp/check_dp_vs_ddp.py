#!/usr/bin/env python3
"""Runs dp_vs_ddp in a short mode and checks its outputs.

usage: check_dp_vs_ddp.py EXE WORKDIR

Checks: one JSON object per configuration (single, DP and DDP on 1 and 2 devices)
with every key and phase key; finite losses; the CSV; one trace per configuration,
valid JSON, with one "thread_name" track per worker (and per comm thread in DDP);
PNG charts when gnuplot is installed; bad flags exit non-zero.
"""
import csv
import json
import math
import os
import shutil
import subprocess
import sys

PHASES = ["scatter", "replicate", "forward", "backward", "reduce", "allreduce_exposed",
          "allreduce_hidden", "step", "gather"]
KEYS = ["model", "mode", "devices", "device_kind", "global_batch", "steps", "warmup", "path",
        "seconds", "samples_per_s", "speedup", "efficiency", "phase_ms_device0", "phase_ms_max",
        "peak_memory_bytes", "loss_first", "loss_last", "trace"]

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def main():
    exe, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    trace_dir, plot_dir = os.path.join(work, "traces"), os.path.join(work, "plots")
    csv_path = os.path.join(work, "results.csv")
    cmd = [exe, "--model", "cnn", "--devices", "1,2", "--batch", "32", "--steps", "3", "--warmup", "1",
           "--json", "--csv", csv_path, "--trace", trace_dir, "--plot", plot_dir]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    sys.stderr.write(run.stderr)
    check(run.returncode == 0, f"exit status {run.returncode} of {' '.join(cmd)}")

    objs = []
    for line in run.stdout.splitlines():
        if line.strip():
            try:
                objs.append(json.loads(line))
            except json.JSONDecodeError as e:
                check(False, f"stdout line is not JSON ({e}): {line[:80]}")
    configs = [(o.get("mode"), o.get("devices")) for o in objs]
    check(configs == [("single", 1), ("DP", 1), ("DP", 2), ("DDP", 1), ("DDP", 2)],
          f"configurations {configs}")
    for o in objs:
        name = f"{o.get('mode')}-{o.get('devices')}"
        for k in KEYS:
            check(k in o, f"{name}: key '{k}' missing")
        for group in ("phase_ms_device0", "phase_ms_max"):
            for p in PHASES:
                v = o.get(group, {}).get(p)
                check(isinstance(v, (int, float)) and v >= 0, f"{name}: {group}.{p} = {v}")
        check(o.get("samples_per_s", 0) > 0, f"{name}: samples_per_s {o.get('samples_per_s')}")
        for k in ("loss_first", "loss_last"):
            check(isinstance(o.get(k), float) and math.isfinite(o[k]), f"{name}: {k} = {o.get(k)}")
        check(len(o.get("peak_memory_bytes", [])) == o.get("devices"), f"{name}: peak memory per device")
        check(all(b > 0 for b in o.get("peak_memory_bytes", [0])), f"{name}: zero peak memory")
        if o.get("mode") == "DDP" and o.get("devices") == 2:
            hid = o["phase_ms_max"]["allreduce_hidden"] + o["phase_ms_max"]["allreduce_exposed"]
            check(hid > 0, f"{name}: no all-reduce time recorded")
        if o.get("mode") == "DP" and o.get("devices") == 2:
            check(o["phase_ms_max"]["reduce"] > 0, f"{name}: no reduce time recorded")

        # The trace: valid JSON, one named track per worker thread and comm thread.
        path = o.get("trace")
        check(isinstance(path, str) and os.path.isfile(path), f"{name}: trace file {path}")
        if isinstance(path, str) and os.path.isfile(path):
            try:
                with open(path) as f:
                    trace = json.load(f)
            except json.JSONDecodeError as e:
                check(False, f"{name}: trace is not valid JSON: {e}")
                continue
            events = trace.get("traceEvents", [])
            tracks = [e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"]
            check(len(tracks) == len(set(tracks)), f"{name}: duplicate tracks {tracks}")
            workers = [t for t in tracks if t.startswith("worker ")]
            comms = [t for t in tracks if t.startswith("comm ")]
            n = o["devices"]
            if o["mode"] == "single":
                check(tracks == ["main"], f"{name}: tracks {tracks}")
            else:
                check(len(workers) == n, f"{name}: {len(workers)} worker tracks for {n} devices: {tracks}")
                # One device has nothing to all-reduce: no comm thread, no comm track.
                want = n if o["mode"] == "DDP" and n > 1 else 0
                check(len(comms) == want, f"{name}: comm tracks {comms}")
                check("main" in tracks, f"{name}: no main track")
            check(any(e.get("ph") == "X" for e in events), f"{name}: trace has no events")

    # CSV: a header and one row per configuration.
    if os.path.isfile(csv_path):
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        check(len(rows) == 5, f"CSV has {len(rows)} rows")
        check(all(f"{p}_ms_dev0" in rows[0] for p in PHASES) if rows else False, "CSV phase columns")
    else:
        check(False, "no CSV written")

    # Charts: drawn by gnuplot when it is installed.
    if shutil.which("gnuplot"):
        for png in ("throughput.png", "phases.png"):
            p = os.path.join(plot_dir, png)
            ok = os.path.isfile(p) and open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
            check(ok, f"chart {p} missing or not a PNG")
    else:
        print("SKIP: gnuplot not installed, chart check skipped")

    # Bad flags: a clear error and a non-zero exit.
    for bad in (["--model", "vgg"], ["--devices", "0"], ["--devices", "x"], ["--steps", "-1"],
                ["--no-such-flag"]):
        r = subprocess.run([exe] + bad, capture_output=True, text=True, timeout=60)
        check(r.returncode != 0, f"{bad} exited {r.returncode}")
        check(r.stderr.strip() != "", f"{bad} printed no error")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 0 and "--devices" in r.stdout, "--help")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print(f"OK: {len(objs)} configurations checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
