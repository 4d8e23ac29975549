#!/usr/bin/env python3
"""dp 0.1's AdamOptions spelling compiles with a deprecation warning, and only it.

usage: deprecated_spelling_test.py --include DIR [--include DIR ...] --cxx COMPILER [ARGS...]

Compiles (-fsyntax-only) three small programs against dp's headers (Note [Deprecated
beta1 and beta2] in src/optim/adam.cpp):
  - betas, and options that leave beta1/beta2 out, braced and passed to a function,
    copied and assigned, with -Werror: no warning at all;
  - .beta1 = ..., .beta2 = ... (designated, and assigned as members) with
    -Werror=deprecated-declarations: refused, "is deprecated: use betas" once per
    use;
  - the same without -Werror: compiles (a warning, not an error, for one release).
Exit status: 0 when all three behave so, 1 otherwise.
"""
import argparse
import os
import subprocess
import sys
import tempfile

PRELUDE = """#include "dp/optim/adam.h"
#include "dp/optim/adamw.h"
#include <vector>
using namespace dp::optim;
double use(AdamOptions o) { return o.lr; }
double use_w(AdamWOptions o) { return o.lr; }
"""

CURRENT = PRELUDE + """
int main() {
  AdamOptions a{.lr = 1e-3};
  AdamOptions b{.lr = 1e-3, .betas = {0.8, 0.99}, .eps = 1e-6, .weight_decay = 0.1};
  AdamOptions c = a;
  c = b;
  AdamWOptions w;
  AdamWOptions w2{.betas = {0.9, 0.95}};
  w = w2;
  return static_cast<int>(use(a) + use({.lr = 2}) + use({}) + use(c) + use_w({.lr = 1}) + use_w(w));
}
"""

# Four uses of the old spelling: each must be reported.
OLD = PRELUDE + """
int main() {
  AdamOptions a{.lr = 1e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6};
  AdamWOptions w;
  w.beta1 = 0.7;
  return static_cast<int>(use(a) + use({.beta2 = 0.95}) + use_w(w));
}
"""
OLD_USES = 4


def compile_(cxx, includes, text, extra, work, name):
    src = os.path.join(work, name + ".cpp")
    with open(src, "w", encoding="utf-8") as f:
        f.write(text)
    cmd = cxx + ["-std=c++20", "-Wall", "-Wextra", "-fsyntax-only"] + extra
    cmd += [f"-I{d}" for d in includes] + [src]
    return subprocess.run(cmd, capture_output=True, text=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--include", action="append", required=True)
    ap.add_argument("--cxx", nargs=argparse.REMAINDER, required=True)
    args = ap.parse_args()
    failures = []
    with tempfile.TemporaryDirectory(prefix="dp_deprecated_") as work:
        r = compile_(args.cxx, args.include, CURRENT, ["-Werror"], work, "current")
        if r.returncode != 0:
            failures.append("the current spelling does not compile cleanly with -Werror:\n" + r.stderr)
        r = compile_(args.cxx, args.include, OLD, ["-Werror=deprecated-declarations"], work, "old_werror")
        reported = r.stderr.count("is deprecated: use betas")
        if r.returncode == 0:
            failures.append("the old spelling compiled under -Werror=deprecated-declarations (no warning)")
        elif reported != OLD_USES:
            failures.append("expected %d deprecation diagnostics saying 'use betas', got %d:\n%s"
                            % (OLD_USES, reported, r.stderr))
        r = compile_(args.cxx, args.include, OLD, [], work, "old")
        if r.returncode != 0:
            failures.append("the old spelling does not compile (it must, for one release):\n" + r.stderr)
    if failures:
        print("\n".join(failures))
        return 1
    print("AdamOptions: betas compiles cleanly; beta1/beta2 compile with %d deprecation warnings"
          % OLD_USES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
