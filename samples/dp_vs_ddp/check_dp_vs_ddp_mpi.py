#!/usr/bin/env python3
"""Runs dp_vs_ddp under mpirun -np 2 in a tiny mode and checks what process 0 prints.

usage: check_dp_vs_ddp_mpi.py --mpirun PATH --have-mpi 0|1 EXE

Exit 77 (Meson's SKIP) without MPI or mpirun. Two runs (MLP, global batch 16 = 2
processes x 8 rows, devices 1 and 2 per process, 2 steps, stages 1 and 2):
  - tables: only process 0 prints (one header line); the main table has the processes
    and world-device columns; the per-process table has one column per process and a
    global column that equals the sum of the per-process figures AS PRINTED (to their
    rounding); the phase table has the x-proc column, which is positive for every
    design that crosses processes; the by-collective table names the collectives;
  - --json: one object per configuration, from process 0 only, with processes 2,
    samples_per_s equal to the sum of samples_per_s_per_process, the inter-process
    keys, and the same global-batch loss for every design (all train the same global
    batches from the same seed).
"""
import argparse
import json
import math
import shutil
import subprocess
import sys

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def mpirun_cmd(a, exe, args):
    return [a.mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2",
            "-x", "DP_CPU_DEVICES", exe] + args


def table(lines, first_header_word, header_contains):
    """The rows (lists of cells) of the table whose header line contains header_contains."""
    for i, line in enumerate(lines):
        if line.startswith(first_header_word) and header_contains in line and i + 1 < len(lines) \
                and set(lines[i + 1].strip()) == {"-"}:
            header = line.split()
            rows = []
            for row in lines[i + 2:]:
                if not row.strip():
                    break
                rows.append(row.split())
            return header, rows
    return None, []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpirun", default="")
    ap.add_argument("--have-mpi", default="0")
    ap.add_argument("exe")
    a = ap.parse_args()
    if a.have_mpi != "1":
        print("SKIP: dp was built without MPI")
        return 77
    a.mpirun = a.mpirun or shutil.which("mpirun")
    if not a.mpirun:
        print("SKIP: mpirun not found")
        return 77
    common = ["--model", "mlp", "--devices", "1,2", "--batch", "16", "--steps", "2", "--warmup", "1",
              "--stages", "1,2"]
    designs = ["single", "DP", "DDP", "Sharded-1", "Sharded-2"]

    # The tables.
    cmd = mpirun_cmd(a, a.exe, common)
    print("+ " + " ".join(cmd), flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print(run.stdout)
    sys.stderr.write(run.stderr)
    check(run.returncode == 0, f"exit status {run.returncode}")
    lines = run.stdout.splitlines()
    check(sum(line.startswith("dp_vs_ddp: model") for line in lines) == 1,
          "the header is printed once (process 0 alone reports)")
    check(any("2 processes x 8 rows" in line for line in lines), "the header says how the global batch splits")

    head, rows = table(lines, "mode", "world devices")
    check(head is not None and "processes" in head, f"main table with processes columns: {head}")
    check([r[0] for r in rows] == ["single", "DP", "DP", "DDP", "DDP", "Sharded-1", "Sharded-1",
                                   "Sharded-2", "Sharded-2"], f"main table rows {[r[0] for r in rows]}")
    for r in rows[1:]:
        check(r[2] == "2" and r[3] == str(2 * int(r[1])), f"processes / world devices of {r[:4]}")

    head, rows = table(lines, "mode", "process 1")
    check(head == ["mode", "devices", "process", "0", "process", "1", "global"],
          f"per-process table header {head}")
    check(len(rows) == 9, f"per-process table has {len(rows)} rows")
    for r in rows:
        name = f"{r[0]}-{r[1]}"
        if r[0] == "single":
            check(r[3] == "-", f"{name}: process 1 runs no single-device baseline: {r}")
            continue
        try:
            p0, p1, total = float(r[2]), float(r[3]), float(r[4])
        except (ValueError, IndexError):
            check(False, f"{name}: not numbers: {r}")
            continue
        check(p0 > 0 and p1 > 0, f"{name}: per-process samples/s {p0}, {p1}")
        # One decimal printed: the sum of the rounded figures is within 0.1 of the rounded sum.
        check(abs(p0 + p1 - total) <= 0.1 + 1e-9, f"{name}: global {total} != {p0} + {p1}")

    head, rows = table(lines, "mode", "x-proc")
    check(head is not None and head[-1] == "x-proc", f"phase table header {head}")
    for r in rows:
        dev0, mx = (float(v) for v in r[-1].split("/"))
        if r[0] == "single":
            check(dev0 == 0 and mx == 0, f"single: x-proc {r[-1]}")
        else:
            check(0 < dev0 <= mx, f"{r[0]}-{r[1]}: x-proc {r[-1]} (device 0 / max)")

    head, rows = table(lines, "mode", "reduce_scatter")
    check(head == ["mode", "devices", "all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather"],
          f"by-collective table header {head}")
    check(len(rows) == 8, f"by-collective table has {len(rows)} rows (no single row)")

    # --json.
    cmd = mpirun_cmd(a, a.exe, common + ["--json"])
    print("+ " + " ".join(cmd), flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    sys.stderr.write(run.stderr)
    check(run.returncode == 0, f"--json: exit status {run.returncode}")
    objs = []
    for line in run.stdout.splitlines():
        if line.strip():
            try:
                objs.append(json.loads(line))
            except json.JSONDecodeError as e:
                check(False, f"stdout line is not JSON ({e}): {line[:80]}")
    check(len(objs) == 9, f"{len(objs)} JSON objects, from process 0 alone (expected 9)")
    losses = []
    for o in objs:
        name = f"{o.get('mode')}{o.get('shard_stage') or ''}-{o.get('devices')}"
        for k in ("processes", "world_devices", "per_process_batch", "samples_per_s_per_process",
                  "interprocess_ms_device0", "interprocess_ms_max", "interprocess_per_step_device0"):
            check(k in o, f"{name}: key {k} missing")
        if o.get("mode") == "single":
            check(o.get("processes") == 1 and o.get("per_process_batch") == 16, f"{name}: {o.get('processes')}")
            continue
        per = o.get("samples_per_s_per_process", [])
        check(o.get("processes") == 2 and len(per) == 2 and o.get("per_process_batch") == 8,
              f"{name}: processes {o.get('processes')}, per process {per}")
        check(math.isclose(sum(per), o.get("samples_per_s", -1), rel_tol=1e-9),
              f"{name}: samples_per_s {o.get('samples_per_s')} != sum {per}")
        check(o.get("interprocess_ms_device0", 0) > 0, f"{name}: no time crossing processes")
        by = o.get("interprocess_per_step_device0", {})
        check(sum(v.get("calls", 0) for v in by.values()) > 0, f"{name}: no inter-process call counted")
        losses.append((name, o.get("loss_last")))
    # Every design trains the same global batches from the same parameters.
    if losses:
        ref = losses[0][1]
        for name, v in losses:
            check(isinstance(v, float) and abs(v - ref) <= 1e-4 * max(1.0, abs(ref)),
                  f"{name}: global-batch loss {v} differs from {losses[0][0]}'s {ref}")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
