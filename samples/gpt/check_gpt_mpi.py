#!/usr/bin/env python3
"""Runs the GPT sample under mpirun -np 2 (two processes of two devices, DDP, dropout in
the blocks) and checks that a run stopped at step 4 and resumed from its checkpoint
ends with the bits of the uninterrupted run: the data stream, the optimizer and every
device's dropout stream come back on every process.

usage: check_gpt_mpi.py RUN_MPI [RUN_MPI options...] -- EXE OUT_DIR
Exit status 77 (skip) when run_mpi.py says dp has no MPI.
"""
import json
import os
import subprocess
import sys

SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch", "8",
         "--log-every", "1", "--warmup", "2", "--dropout", "0.2", "--mode", "ddp", "--devices", "2", "--json"]


def main():
    split = sys.argv.index("--")
    runner, (exe, out) = sys.argv[1:split], sys.argv[split + 1:]
    os.makedirs(out, exist_ok=True)
    corpus = os.path.join(out, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}\n"
                        for i in range(400)))

    def summary(what, *args):
        r = subprocess.run([sys.executable, *runner, "--np", "2", "--timeout", "200", "--", exe, *SMALL,
                            "--data", corpus, *args], capture_output=True, text=True, timeout=260)
        if r.returncode == 77:
            print("SKIP: no MPI")
            sys.exit(77)
        if r.returncode != 0:
            sys.exit(f"FAIL: {what}: exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
        recs = []
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                recs.append(json.loads(line))
        sums = [o for o in recs if o.get("type") == "summary"]
        if len(sums) != 1:
            sys.exit(f"FAIL: {what}: {len(sums)} summary records in\n{r.stdout[-1500:]}")
        return sums[0], [o["loss"] for o in recs if o.get("type") == "step"]

    ckpt = os.path.join(out, "mpi_run.ckpt")
    whole, whole_losses = summary("whole", "--steps", "8")
    part, _ = summary("part", "--steps", "8", "--stop-at", "4", "--checkpoint", ckpt)
    rest, rest_losses = summary("resumed", "--steps", "8", "--checkpoint", ckpt, "--resume")
    failures = []
    if part.get("steps") != 4:
        failures.append(f"stopped run: steps {part.get('steps')}")
    if rest_losses != whole_losses[4:]:
        failures.append(f"resumed losses {rest_losses} != the uninterrupted run's {whole_losses[4:]}")
    if rest.get("final_loss") != whole.get("final_loss"):
        failures.append(f"resumed final loss {rest.get('final_loss')} != uninterrupted {whole.get('final_loss')}")
    for f in failures:
        print("FAIL:", f)
    print(f"{'FAILED' if failures else 'OK'}: uninterrupted {whole_losses}, resumed {rest_losses}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
