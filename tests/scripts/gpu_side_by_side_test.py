#!/usr/bin/env python3
"""bench/gpu_side_by_side.py refuses bad arguments with a message and skips (77) where
no CUDA PyTorch is at hand; needs no GPU (the GPU run itself is scripts/gpu_check.sh's)."""
import os
import subprocess
import sys

source, binary = sys.argv[1], sys.argv[2]
script = os.path.join(source, "bench", "gpu_side_by_side.py")
from checks import check, finish


def run(*args):
    return subprocess.run([sys.executable, script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


p = run("--binary", binary, "--models", "cnn,vgg")
check(p.returncode != 0 and "--models takes mlp, cnn, resnet18" in p.stdout, f"an unknown model: {p.stdout.strip()}")
p = run("--binary", binary, "--rounds", "0")
check(p.returncode != 0 and "must be positive" in p.stdout, f"zero rounds: {p.stdout.strip()}")
p = run("--binary", os.path.join(source, "no-such-binary"))
check(p.returncode != 0 and "is not an executable" in p.stdout, f"a missing binary: {p.stdout.strip()}")
p = run("--binary", binary, "--torch-python", "/bin/false")
check(p.returncode == 77 and "has no CUDA PyTorch" in p.stdout, f"no CUDA PyTorch: skip (exit {p.returncode})")
p = run("--bogus")
check(p.returncode == 2, f"an unknown argument (exit {p.returncode})")
finish()
