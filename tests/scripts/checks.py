"""The tally the script tests share: check(cond, what) prints ok/FAILED and counts."""
import sys

failures = []


def check(cond, what):
    print(("ok     " if cond else "FAILED ") + what, flush=True)
    if not cond:
        failures.append(what)


def finish():
    """Prints the count and exits 1 when a check failed, else 0."""
    print(f"{len(failures)} failed")
    sys.exit(1 if failures else 0)
