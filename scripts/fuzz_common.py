"""What the differential fuzzers' scripts share (scripts/op_fuzz.py, scripts/optim_fuzz.py):
the --seeds syntax and the hunt that writes batches of programs and replays them in dp."""
import os
import subprocess
import sys
import tempfile


def parse_seeds(text):
    """"A:B" (programs A..B-1) or single programs, comma-separated: "0:200,552,2394"."""
    seeds = []
    for part in text.split(","):
        if ":" in part:
            lo, hi = (int(x) for x in part.split(":"))
            seeds += range(lo, hi)
        else:
            seeds.append(int(part))
    return seeds


def hunt(tool, replay, write_file, seeds, batch, label, replay_args=()):
    """Writes the programs `batch` at a time with write_file(path, seeds) and runs the
    replay binary on each file (with replay_args after the file); prints what it reports
    and exits 1 when any program differs (the binary's own status otherwise: 2 on a bad
    file)."""
    failed = 0
    for i in range(0, len(seeds), batch):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "cases.safetensors")
            write_file(path, seeds[i:i + batch])
            # unwritten memory reads as NaN (Note [Poisoned memory] in src/backend/backend.h).
            env = dict(os.environ, DP_POISON_MEMORY=os.environ.get("DP_POISON_MEMORY", "1"))
            r = subprocess.run([replay, path, *replay_args], capture_output=True, text=True, env=env)
            sys.stdout.write(r.stdout[-20000:])
            sys.stderr.write(r.stderr[-4000:])
            if r.returncode not in (0, 1):
                sys.exit(f"{tool}: {replay} exited {r.returncode}")
            failed += r.returncode
    print(f"{tool}: programs {label}: {'FAILURES' if failed else 'all agree with PyTorch'}")
    sys.exit(1 if failed else 0)


def write_corpus(path, seeds, case_tensors, generated_by):
    """One safetensors file of programs c<seed>: case_tensors(seed, prefix) gives each one's
    tensors and text; the metadata lists the cases and holds each program."""
    from safetensors.torch import save_file
    tensors, meta, names = {}, {"generated_by": generated_by}, []
    for s in seeds:
        t, program = case_tensors(s, f"c{s}")
        tensors.update(t)
        meta[f"program.c{s}"] = program
        names.append(f"c{s}")
    meta["cases"] = " ".join(names)
    save_file(tensors, path, metadata=meta)
