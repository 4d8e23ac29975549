#!/usr/bin/env bash
# scripts/sanitize.sh — the test suites under AddressSanitizer+UBSan and ThreadSanitizer.
#
#   scripts/sanitize.sh                      # both, CI defaults
#   scripts/sanitize.sh --only tsan --tsan-suites "parallel comm"
#
# ASan+UBSan (build-asan): every suite but `cuda` (these builds have no CUDA backend,
# so that suite could only skip). TSan (build-tsan): the runtime suites (--tsan-suites,
# default: parallel comm autograd data optim nn, and `threads`: the tests elsewhere whose
# threads share state, e.g. channels_last_test). The library is built at -O1 (the
# level the sanitizers' authors recommend: fast enough, compiles a quarter faster than
# -O2 under ASan+UBSan) with -g1 (line tables: full stack traces, a faster compile than
# -g); test programs at -O0 (tests/meson.build). Only the test executables of the
# selected suites are built.
#
# TSan runs with DP_CPU_THREADS=1 (Note [DP_CPU_THREADS] in
# src/backend/cpu/cpu_backend.cpp): oneTBB and libgomp are not instrumented, so TSan
# cannot see their internal synchronisation; with one thread per device every kernel
# runs on dp's own worker threads and each report is about dp's code. Suppressions
# (scripts/sanitizers/*.supp) cover third-party code only, never dp's.
#
# Exit status: non-zero when any configure, build or test step fails. One summary
# line per step ("sanitize: <step> OK|FAIL (<seconds> s)"), repeated at the end.
set -u -o pipefail

usage() {
  cat <<USAGE
usage: $0 [--only asan|tsan] [--tsan-suites "s1 s2 ..."] [--asan-suites "s1 ..."]
          [--timeout-multiplier N] [--stress-configs N] [--jobs N]
  --only                run one sanitizer (default: both)
  --asan-suites         meson suites under ASan+UBSan (default: all but cuda)
  --tsan-suites         meson suites under TSan (default: parallel comm autograd data optim nn threads)
  --timeout-multiplier  meson test timeout multiplier (default: 4; sanitizers are slow)
  --stress-configs      random configurations of stress_test (default: 300, its own default)
  --jobs                ninja -j (default: ninja's choice)
USAGE
}

root="$(cd "$(dirname "$0")/.." && pwd)"
only=""
asan_suites=""
tsan_suites="parallel comm autograd data optim nn threads"
mult=4
stress=""
jobs=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) only="$2"; shift 2 ;;
    --asan-suites) asan_suites="$2"; shift 2 ;;
    --tsan-suites) tsan_suites="$2"; shift 2 ;;
    --timeout-multiplier) mult="$2"; shift 2 ;;
    --stress-configs) stress="$2"; shift 2 ;;
    --jobs) jobs=(-j "$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "sanitize: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
case "$only" in ""|asan|tsan) ;; *) echo "sanitize: --only expects asan or tsan" >&2; exit 2 ;; esac

cd "$root" || exit 2
summary=()
failed=0

# step <name> <command...>: runs, times and records one step.
step() {
  local name="$1"; shift
  local t0=$SECONDS
  echo "sanitize: --- $name: $*"
  "$@"
  local rc=$?
  local dt=$((SECONDS - t0))
  local line
  if [[ $rc -eq 0 ]]; then line="sanitize: $name OK ($dt s)"; else line="sanitize: $name FAIL (exit $rc, $dt s)"; failed=1; fi
  echo "$line"
  summary+=("$line")
  return $rc
}

# configure <dir> <sanitizers>
configure() {
  local dir="$1" san="$2"
  local opts=(-Db_sanitize="$san" -Db_lundef=false -Doptimization=1 -Ddebug=true -Dcuda=disabled
              -Dsamples=false -Dtests=true -Dcpp_args=-g1)
  if [[ -f "$dir/build.ninja" ]]; then
    meson configure "$dir" "${opts[@]}" >/dev/null
  else
    meson setup "$dir" "${opts[@]}" >/dev/null
  fi
}

# test_targets <dir> <suites...>: the build targets the tests of those suites need
# (their executables and whatever they depend on, e.g. a tool a script test runs).
test_targets() {
  local dir="$1"; shift
  python3 - "$dir" "$@" <<'PY'
import json, os, subprocess, sys
d = sys.argv[1]; root = os.path.realpath(d); want = set(sys.argv[2:])
intro = lambda what: json.loads(subprocess.check_output(["meson", "introspect", what, d]))
files = {t["id"]: t["filename"] for t in intro("--targets")}
out = set()
for t in intro("--tests"):
    suites = set(s.split(":")[-1] for s in t["suite"])
    if want and not want.intersection(suites): continue
    if not want and "cuda" in suites: continue  # no CUDA backend in sanitizer builds
    exe = os.path.realpath(t["cmd"][0])
    if exe.startswith(root + os.sep): out.add(os.path.relpath(exe, root))
    for dep in t.get("depends", []):
        for f in files.get(dep, []): out.add(os.path.relpath(os.path.realpath(f), root))
print("\n".join(sorted(out)))
PY
}

# build <dir> <suites...>
build() {
  local dir="$1"; shift
  local targets
  # Regenerate first, so tests added to a meson.build since the last run are listed.
  ninja -C "$dir" build.ninja >/dev/null || return 1
  targets=$(test_targets "$dir" "$@") || return 1
  # shellcheck disable=SC2086
  ninja -C "$dir" "${jobs[@]}" $targets
}

# test_args <suites...>: meson test arguments selecting those suites.
test_args() {
  local s
  printf '%s\n' --no-rebuild --print-errorlogs --timeout-multiplier "$mult"
  # docs: the snippets are separate programs compiled without the sanitizer flags, so
  # they cannot load an instrumented libdp; the release run compiles and runs them.
  [[ $# -eq 0 ]] && printf '%s\n' --no-suite cuda --no-suite docs --no-suite scripts
  for s in "$@"; do printf '%s\n' --suite "$s"; done
}

supp="$root/scripts/sanitizers"

if [[ -z "$only" || "$only" == asan ]]; then
  read -r -a suites <<<"$asan_suites"
  if step "asan configure" configure build-asan address,undefined &&
     step "asan build" build build-asan "${suites[@]}"; then
    # LSan: leaks inside oneDNN/oneTBB/libgomp singletons are suppressed by name
    # (lsan.supp); everything allocated by dp must be freed. Memory nothing has written
    # reads as NaN (Note [Poisoned memory] in src/backend/backend.h): ASan finds reads out
    # of bounds, the fill reads of what was never written.
    step "asan test" env \
      ASAN_OPTIONS="detect_leaks=1:strict_init_order=1:allocator_may_return_null=1" \
      LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0" \
      UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp" \
      DP_STRESS_CONFIGS="${stress:-300}" \
      DP_POISON_MEMORY=1 \
      meson test -C build-asan $(test_args "${suites[@]}")
  fi
fi

if [[ -z "$only" || "$only" == tsan ]]; then
  read -r -a suites <<<"$tsan_suites"
  if step "tsan configure" configure build-tsan thread &&
     step "tsan build" build build-tsan "${suites[@]}"; then
    step "tsan test" env \
      TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$supp/tsan.supp" \
      DP_CPU_THREADS=1 \
      DP_STRESS_CONFIGS="${stress:-300}" \
      meson test -C build-tsan $(test_args "${suites[@]}")
  fi
fi

echo "sanitize: ===== summary"
for l in "${summary[@]}"; do echo "$l"; done
exit $failed
