#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: install, build (CUDA backend included
# when the toolkit is present), run every test suite, check the installed library
# from an out-of-tree program, then the sanitizer builds and the fuzzers.
#   scripts/test.sh            everything (what CI runs)
#   scripts/test.sh --quick    unit suites only
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
quick=0
[[ "${1:-}" == "--quick" ]] && quick=1

start=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - start )) s)"; }

step "setup"
scripts/setup.sh --test

step "build (release)"
# -Werror here (not in the README's demo build): every warning of the host compiler
# and nvcc — the CUDA backend included where the toolkit is — fails CI.
scripts/build.sh -Dwerror=true

step "unit, integration and sample tests"
meson test -C build --print-errorlogs --num-processes 2

if (( quick )); then exit 0; fi

step "install + out-of-tree program via pkg-config and via CMake find_package(dp)"
scripts/install_check.sh

if [[ -x scripts/sanitize.sh ]]; then
  step "sanitizers (ASan+UBSan, TSan)"
  # ASan+UBSan: every suite. TSan: the threaded runtime (parallel, comm, autograd,
  # data, optim, nn, threads) with DP_CPU_THREADS=1 (see docs/RELIABILITY.md).
  scripts/sanitize.sh
fi
if [[ -x scripts/fuzz.sh ]]; then
  step "fuzzers"
  scripts/fuzz.sh --time 20
fi
step "all checks passed"
