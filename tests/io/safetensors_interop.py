#!/usr/bin/env python3
"""dp's safetensors files against the reference implementation (Python safetensors).

Usage: safetensors_interop.py <path to safetensors_tool>

1. dp -> Python: the tool saves a small CNN with dp::save and prints its state_dict
   as JSON; safetensors.numpy.load_file must read the same names, dtypes, shapes and
   values (exactly), and the header must follow the format (length, 8-byte padding,
   "format": "pt" metadata); dp's "dp.crc32.<name>" metadata must be zlib.crc32 of
   each tensor's bytes, and a bit flipped in a tensor must make dp's load fail naming it.
2. Python -> dp: safetensors.numpy.save_file writes values of the CNN's shapes; the
   tool loads them strictly and prints what it loaded, which must equal them exactly.
3. Python -> dp, mismatching: a file missing a tensor and one with a wrong shape make
   the tool fail with dp's message naming the tensor.

Exits 77 (meson: SKIP) when numpy or safetensors cannot be imported.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import zlib

try:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"SKIP: the interop test needs numpy and safetensors (pip install numpy safetensors): {e}")
    sys.exit(77)

DTYPES = {"F32": np.float32, "I64": np.int64}
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run_tool(tool, *args, expect_ok=True):
    r = subprocess.run([tool, *args], capture_output=True, text=True)
    if expect_ok and r.returncode != 0:
        print(r.stderr)
        sys.exit(f"safetensors_tool {' '.join(args)} failed with status {r.returncode}")
    return r


def as_arrays(desc):
    return {name: np.array(e["values"], dtype=DTYPES[e["dtype"]]).reshape(e["shape"]) for name, e in desc.items()}


def compare(expected, got, where):
    check(list(got.keys()) == list(expected.keys()) or sorted(got) == sorted(expected),
          f"{where}: names differ: {sorted(expected)} vs {sorted(got)}")
    for name, want in expected.items():
        if name not in got:
            continue
        have = got[name]
        check(have.dtype == want.dtype, f"{where}: {name}: dtype {have.dtype} != {want.dtype}")
        check(have.shape == want.shape, f"{where}: {name}: shape {have.shape} != {want.shape}")
        check(have.shape == want.shape and have.tobytes() == want.tobytes(),
              f"{where}: {name}: values differ")


def main():
    tool = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        # 1. dp -> Python.
        path = os.path.join(d, "dp.safetensors")
        desc = json.loads(run_tool(tool, "write", path).stdout)
        expected = as_arrays(desc)
        check(len(expected) == 9, f"expected 9 tensors in the CNN, got {len(expected)}")
        check("features.1.num_batches_tracked" in expected, "the BatchNorm counter is saved")
        got = load_file(path)
        compare(expected, got, "dp -> python")
        with safe_open(path, framework="np") as f:
            meta = f.metadata()
            check(meta.get("format") == "pt", f"metadata format: {meta}")
            check(meta.get("producer") == "dp safetensors_tool", f"metadata producer: {meta}")
        with open(path, "rb") as f:
            raw = f.read()
        (n,) = struct.unpack("<Q", raw[:8])
        check(n % 8 == 0, f"header length {n} is a multiple of 8")
        header = json.loads(raw[8:8 + n])
        total = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")
        check(8 + n + total == len(raw), "the data region is exactly the tensors' bytes")
        # dp's per-tensor checksums are zlib's CRC-32 of the bytes: checkable without dp.
        for name, arr in got.items():
            want = f"{zlib.crc32(arr.tobytes()):08x}"
            check(meta.get(f"dp.crc32.{name}") == want,
                  f"dp.crc32.{name} = {meta.get(f'dp.crc32.{name}')}, zlib.crc32 gives {want}")

        # 1b. A flipped bit in a tensor dp wrote: dp names the tensor and the file.
        entry = header["classifier.1.weight"]
        flipped = bytearray(raw)
        flipped[8 + n + entry["data_offsets"][0] + 5] ^= 0x04
        path1b = os.path.join(d, "flipped.safetensors")
        with open(path1b, "wb") as f:
            f.write(flipped)
        r = run_tool(tool, "load", path1b, expect_ok=False)
        check(r.returncode == 1 and f"{path1b}: tensor 'classifier.1.weight' fails its checksum" in r.stderr,
              f"flipped bit reported: {r.returncode} {r.stderr!r}")

        # 2. Python -> dp (strict).
        rng = np.random.default_rng(7)
        theirs = {}
        for name, arr in expected.items():
            if arr.dtype == np.int64:
                theirs[name] = np.array(123456789012, dtype=np.int64).reshape(arr.shape)
            else:
                theirs[name] = rng.standard_normal(arr.shape).astype(np.float32)
        path2 = os.path.join(d, "py.safetensors")
        save_file(theirs, path2, metadata={"format": "pt"})
        loaded = as_arrays(json.loads(run_tool(tool, "load", path2).stdout))
        compare(theirs, loaded, "python -> dp")

        # 3. Mismatches are reported by name.
        missing = dict(theirs)
        del missing["classifier.1.bias"]
        path3 = os.path.join(d, "missing.safetensors")
        save_file(missing, path3)
        r = run_tool(tool, "load", path3, expect_ok=False)
        check(r.returncode == 1 and "'classifier.1.bias'" in r.stderr and "Missing" in r.stderr,
              f"missing tensor reported: {r.returncode} {r.stderr!r}")
        wrong = dict(theirs)
        wrong["features.0.weight"] = np.zeros((4, 3, 3, 3), dtype=np.float32)
        path4 = os.path.join(d, "wrong.safetensors")
        save_file(wrong, path4)
        r = run_tool(tool, "load", path4, expect_ok=False)
        check(r.returncode == 1 and "expected [4, 1, 3, 3], got [4, 3, 3, 3] for 'features.0.weight'" in r.stderr,
              f"shape mismatch reported: {r.returncode} {r.stderr!r}")
        double = dict(theirs)
        double["classifier.1.weight"] = double["classifier.1.weight"].astype(np.float64)
        path5 = os.path.join(d, "f64.safetensors")
        save_file(double, path5)
        r = run_tool(tool, "load", path5, expect_ok=False)
        check(r.returncode == 1 and "F64" in r.stderr and "not supported" in r.stderr,
              f"F64 reported: {r.returncode} {r.stderr!r}")
        # A float16 tensor is read, and a module of float32 parameters names the mismatch.
        half = dict(theirs)
        half["classifier.1.weight"] = half["classifier.1.weight"].astype(np.float16)
        path6 = os.path.join(d, "f16.safetensors")
        save_file(half, path6)
        r = run_tool(tool, "load", path6, expect_ok=False)
        check(r.returncode == 1 and "expected [10, 64] float32, got [10, 64] float16 for 'classifier.1.weight'"
              in r.stderr, f"F16 into float32 reported: {r.returncode} {r.stderr!r}")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("interop OK: dp <-> safetensors", end=" ")
    import safetensors
    print(safetensors.__version__, "numpy", np.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
