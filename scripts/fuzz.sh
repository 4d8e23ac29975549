#!/usr/bin/env bash
# scripts/fuzz.sh — build and run dp's libFuzzer targets (fuzz/*_fuzz.cpp).
#
#   scripts/fuzz.sh                       # every target, 30 s each (CI)
#   scripts/fuzz.sh --time 600 --targets idx
#   scripts/fuzz.sh --loops 20000         # the differential loop fuzzer's long mode
#   scripts/fuzz.sh --conv-scan 20000     # oneDNN's convolutions on this CPU, random geometries
#
# --loops N runs tests/parallel/loop_fuzz (Note [Loop fuzzer]; the release build in
# build/, made by scripts/build.sh when missing) on N programs past the range CI runs
# (CI: `meson test` runs programs 0..999 in one process and 0..99 under mpirun), then
# N/10 of them under mpirun -np 2 when mpirun is there, and nothing else. A divergence
# prints the program as C++ and fails the run.
#
# --conv-scan N runs cpu_backend_test's convolution scans (Note [Convolution scans]) on N
# random geometries each, past the 300 that `meson test` draws (seed 2 on), memory
# poisoned: oneDNN picks its kernels by the CPU, so each new CPU is worth a scan.
#
# The library is built once with clang++-14 in build-fuzz (ASan+UBSan, with libFuzzer's
# coverage instrumentation: -fsanitize=fuzzer-no-link), then each target is compiled
# and linked against it with -fsanitize=fuzzer,address,undefined. Each target first
# runs its seed corpus (fuzz/corpus/<target>/), then mutates for --time seconds. New
# inputs go to build-fuzz/corpus/<target>/ (never into the repository); a crashing,
# hanging or OOM input goes to build-fuzz/artifacts/<target>/ and fails the run.
# Any parser input must give dp::Error: every other outcome (another exception, a
# crash, a sanitizer report, > 10 s on one input, > 2 GiB RSS or one allocation
# larger than that) is a finding.
#
# Exit status: non-zero on any build failure or finding. One summary line per step.
set -u -o pipefail

usage() {
  cat <<USAGE
usage: $0 [--time SECONDS] [--targets "idx cifar safetensors"] [--jobs N] [--build-only] [--loops N]
  --time        seconds of fuzzing per target after the seed corpus (default: 30)
  --targets     which fuzz/<name>_fuzz.cpp to build and run (default: all present)
  --jobs        ninja -j (default: ninja's choice)
  --build-only  build, then run only the seed corpora (no mutation)
  --loops       run the differential loop fuzzer on N programs instead (long mode)
  --conv-scan   run the convolution scans on N random geometries each instead
USAGE
}

root="$(cd "$(dirname "$0")/.." && pwd)"
time_s=30
targets=""
jobs=()
build_only=0
loops=0
conv_scan=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --time) time_s="$2"; shift 2 ;;
    --targets) targets="$2"; shift 2 ;;
    --jobs) jobs=(-j "$2"); shift 2 ;;
    --build-only) build_only=1; shift ;;
    --loops) loops="$2"; shift 2 ;;
    --conv-scan)
      conv_scan="${2-}"
      [[ "$conv_scan" =~ ^[1-9][0-9]*$ ]] ||
        { echo "fuzz: --conv-scan expects a positive count of geometries, got '$conv_scan'" >&2; exit 2; }
      shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "fuzz: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
cd "$root" || exit 2

if [[ "$conv_scan" != 0 ]]; then
  [[ -x build/tests/cpu_backend_test ]] || scripts/build.sh >/dev/null || exit 2
  ninja -C build tests/cpu_backend_test >/dev/null || exit 2
  echo "fuzz: convolution scans, $conv_scan geometries each, seed 2, on $(lscpu | sed -n 's/^Model name: *//p')"
  DP_CONV_SCAN="$conv_scan" DP_CONV_SCAN_SEED=2 build/tests/cpu_backend_test -tc="conv scan*" || exit 1
  exit 0
fi

if [[ "$loops" != 0 ]]; then
  [[ "$loops" =~ ^[0-9]+$ ]] || { echo "fuzz: --loops expects a count of programs, got '$loops'" >&2; exit 2; }
  [[ -x build/tests/parallel/loop_fuzz ]] || scripts/build.sh >/dev/null || exit 2
  ninja -C build tests/parallel/loop_fuzz >/dev/null || exit 2
  first=1000  # CI runs 0..999
  echo "fuzz: loop programs $first..$((first + loops - 1)), one process"
  DP_CPU_DEVICES=8 DP_POISON_MEMORY=1 build/tests/parallel/loop_fuzz --seeds "$first:$((first + loops))" || exit 1
  if command -v mpirun >/dev/null; then
    n=$(( loops / 10 > 0 ? loops / 10 : 1 ))
    echo "fuzz: loop programs $first..$((first + n - 1)), mpirun -np 2"
    root_flag=(); [[ $(id -u) -eq 0 ]] && root_flag=(--allow-run-as-root)
    mpirun "${root_flag[@]}" --oversubscribe --bind-to none -np 2 -x DP_CPU_DEVICES=8 -x DP_POISON_MEMORY=1 \
      build/tests/parallel/loop_fuzz --seeds "$first:$((first + n))" || exit 1
  fi
  exit 0
fi

CXX_FUZZ="${CXX_FUZZ:-clang++-14}"
command -v "$CXX_FUZZ" >/dev/null || { echo "fuzz: $CXX_FUZZ not found (apt install clang-14 libclang-rt-14-dev)"; exit 2; }
if [[ -z "$targets" ]]; then
  for f in fuzz/*_fuzz.cpp; do t="${f#fuzz/}"; targets+="${t%_fuzz.cpp} "; done
fi

bdir=build-fuzz
summary=()
failed=0
step() {
  local name="$1"; shift
  local t0=$SECONDS
  echo "fuzz: --- $name"
  "$@"
  local rc=$?
  local dt=$((SECONDS - t0))
  local line
  if [[ $rc -eq 0 ]]; then line="fuzz: $name OK ($dt s)"; else line="fuzz: $name FAIL (exit $rc, $dt s)"; failed=1; fi
  echo "$line"
  summary+=("$line")
  return $rc
}

san=(-fsanitize=address,undefined -fno-sanitize-recover=all)
configure() {
  local opts=(-Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized
              -Dcuda=disabled -Dsamples=false -Dtests=false
              "-Dcpp_args=-g1 -fsanitize=fuzzer-no-link -fno-sanitize-recover=all"
              "-Dcpp_link_args=-fsanitize=fuzzer-no-link")
  if [[ -f $bdir/build.ninja ]]; then
    meson configure $bdir "${opts[@]}" >/dev/null
  else
    CXX="$CXX_FUZZ" meson setup $bdir "${opts[@]}" >/dev/null
  fi
}
# By target name: the file name carries the version (src/libdp.so.X.Y.Z).
build_lib() { meson compile -C $bdir "${jobs[@]}" dp; }
build_target() {
  local t="$1"
  "$CXX_FUZZ" -std=c++20 -O1 -g1 -fsanitize=fuzzer "${san[@]}" -Iinclude -Isrc "fuzz/${t}_fuzz.cpp" \
    -o "$bdir/fuzz/${t}_fuzz" -L"$bdir/src" -ldp -Wl,-rpath,"$root/$bdir/src"
}
run_target() {
  local t="$1"
  local work="$bdir/corpus/$t" art="$bdir/artifacts/$t/"
  mkdir -p "$work" "$art"
  local args=(-rss_limit_mb=2048 -timeout=10 -artifact_prefix="$art" -print_final_stats=1)
  if [[ $build_only -eq 1 ]]; then args+=(-runs=0); else args+=(-max_total_time="$time_s"); fi
  # DP_CPU_THREADS=1: tensors are created on cpu(0) without oneTBB worker threads.
  DP_CPU_THREADS=1 \
  ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=0" \
  UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
    "$bdir/fuzz/${t}_fuzz" "${args[@]}" "$work" "fuzz/corpus/$t" 2>&1 | tail -n 25
}

if step "configure $bdir ($CXX_FUZZ)" configure && step "build libdp (fuzzer instrumentation)" build_lib; then
  mkdir -p $bdir/fuzz
  for t in $targets; do
    if [[ ! -f "fuzz/${t}_fuzz.cpp" ]]; then
      echo "fuzz: no fuzz/${t}_fuzz.cpp"; failed=1; summary+=("fuzz: $t MISSING"); continue
    fi
    [[ -d "fuzz/corpus/$t" ]] || { echo "fuzz: no seed corpus fuzz/corpus/$t"; failed=1; continue; }
    step "build ${t}_fuzz" build_target "$t" && step "run ${t}_fuzz ($([[ $build_only -eq 1 ]] && echo seeds only || echo "${time_s} s"))" run_target "$t"
  done
fi

echo "fuzz: ===== summary"
for l in "${summary[@]}"; do echo "$l"; done
exit $failed
