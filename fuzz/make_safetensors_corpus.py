#!/usr/bin/env python3
"""Writes the seed corpus fuzz/corpus/safetensors/ (generated files; rerun to refresh).

A few tiny valid files (F32 and I64 tensors, metadata, a scalar, an empty tensor) and
one invalid file per class of error parse_safetensors must reject. Standard library
only, so it runs anywhere: python3 fuzz/make_safetensors_corpus.py
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "safetensors")


def header_bytes(header, pad=True):
    raw = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def file_of(header, data, pad=True):
    return header_bytes(header, pad) + data


def f32(*xs):
    return struct.pack("<%df" % len(xs), *xs)


def i64(*xs):
    return struct.pack("<%dq" % len(xs), *xs)


def main():
    os.makedirs(OUT, exist_ok=True)
    w = f32(1.0, -2.0, 0.5, 3.25, 0.0, 1e-3)
    files = {
        "valid_f32_2x3.safetensors": file_of(
            {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, w),
        "valid_f32_i64_metadata.safetensors": file_of(
            {"__metadata__": {"format": "pt", "epoch": "3"},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "n": {"dtype": "I64", "shape": [], "data_offsets": [8, 16]}},
            f32(0.25, -1.0) + i64(7)),
        "valid_empty_tensor.safetensors": file_of(
            {"e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]}}, b""),
        "valid_no_tensors.safetensors": file_of({"__metadata__": {"format": "pt"}}, b""),
        "invalid_truncated_length.safetensors": b"\x10\x00\x00",
        "invalid_huge_header_length.safetensors": struct.pack("<Q", 1 << 62) + b"{}",
        "invalid_json.safetensors": struct.pack("<Q", 8) + b'{"w":{"d',
        "invalid_dtype.safetensors": file_of(
            {"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, f32(1.0)),
        "invalid_offsets_overlap.safetensors": file_of(
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, f32(1, 2, 3)),
        "invalid_size_mismatch.safetensors": file_of(
            {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, f32(1, 2)),
        "invalid_data_truncated.safetensors": file_of(
            {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, w[:10]),
        "invalid_shape_overflow.safetensors": file_of(
            {"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 16], "data_offsets": [0, 4]}},
            f32(1.0)),
        "invalid_negative_shape.safetensors": file_of(
            {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, f32(1.0)),
        "invalid_duplicate_name.safetensors": struct.pack("<Q", 120) + (
            b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}').ljust(120) + f32(1, 2),
    }
    for name, data in files.items():
        with open(os.path.join(OUT, name), "wb") as fh:
            fh.write(data)
    print(f"wrote {len(files)} files to {OUT}")


if __name__ == "__main__":
    main()
