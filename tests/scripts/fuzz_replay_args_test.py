#!/usr/bin/env python3
"""The differential fuzzers' replays (tests/fuzz_replay.h) refuse bad usage with exit 2
and a message naming what was expected: no file, an unreadable one, an unknown argument,
a program the corpus lacks, and the optimizer replay's --design and --devices (an
unknown design, a count below 1 or above the devices there are, a missing value); a good
call of each runs and exits 0."""
import os
import subprocess
import sys
import tempfile

from checks import check, finish

source, build = sys.argv[1], sys.argv[2]
op = os.path.join(build, "tests", "tensor", "op_fuzz_replay")
optim = os.path.join(build, "tests", "optim", "optim_fuzz_replay")
op_corpus = os.path.join(source, "tests", "tensor", "op_fuzz_corpus.safetensors")
optim_corpus = os.path.join(source, "tests", "optim", "optim_fuzz_corpus.safetensors")
env = dict(os.environ, DP_CPU_DEVICES="4")


def run(*args):
    return subprocess.run(list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def refused(what, args, message):
    p = run(*args)
    check(p.returncode == 2 and message in p.stdout and "usage:" in p.stdout,
          f"{what}: exit 2 naming '{message}' (got {p.returncode}: {p.stdout.strip()[-300:]!r})")


with tempfile.TemporaryDirectory() as d:
    junk = os.path.join(d, "junk.safetensors")
    with open(junk, "w") as f:
        f.write("not a safetensors file")
    for tool, corpus in ((op, op_corpus), (optim, optim_corpus)):
        name = os.path.basename(tool)
        refused(f"{name} without a file", [tool], "expected a file")
        refused(f"{name} with an unknown argument", [tool, corpus, "--frobnicate"],
                "unexpected argument '--frobnicate'")
        refused(f"{name} with a program the corpus lacks", [tool, corpus, "--case", "c999999"],
                "no program named c999999")
        refused(f"{name} with a bad device", [tool, corpus, "--device", "tpu:0"], "tpu:0")
        p = run(tool, junk)
        check(p.returncode == 2 and "cannot read" in p.stdout,
              f"{name} with an unreadable file: exit 2, 'cannot read' (got {p.returncode})")
    refused("--design naming no design", [optim, optim_corpus, "--design", "DDP,ZeRO"], "no design named 'ZeRO'")
    refused("--devices 0", [optim, optim_corpus, "--design", "DP", "--devices", "0"], "expected a count >= 1, got 0")
    refused("--devices past the devices there are", [optim, optim_corpus, "--design", "DP", "--devices", "5"],
            "--devices 5: CPU has 4 devices here")
    refused("--devices without its value", [optim, optim_corpus, "--devices"], "unexpected argument '--devices'")
    # The replay's own checks of a program: one that agrees, in one design.
    p = run(optim, optim_corpus, "--case", "c2", "--design", "Sharded2", "--devices", "3", "--verbose")
    check(p.returncode == 0 and "agrees in Sharded2 on 3 CPU devices" in p.stdout,
          f"a program in Sharded stage 2 on 3 devices agrees (got {p.returncode}: {p.stdout.strip()[-300:]!r})")
    p = run(optim, optim_corpus, "--case", "c5", "--design", "Sharded1")
    check(p.returncode == 0 and "1 of them not applicable" in p.stdout,
          f"a program of loose tensors is not applicable in a design (got {p.returncode}: {p.stdout.strip()[-300:]!r})")
finish()
