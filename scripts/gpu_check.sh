#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, build dp with CUDA, run the CUDA
# suites (the op table against the CPU oracle, the allocator, DP/DDP/Sharded 1-3
# against CPU virtual devices, the communicators against the local one), each twice:
# on the GPUs as they are and with DP_CUDA_DEVICES_PER_GPU=4 (four dp devices per
# GPU, the CUDA copy communicator; so one GPU checks the whole multi-device runtime),
# then the collectives benchmark and dp_vs_ddp, and write one report (markdown + JSON)
# naming the GPU, the driver and the CUDA, cuDNN and NCCL versions.
#
#   scripts/gpu_check.sh                 # report in gpu-check/ (build in build-gpu/)
#   scripts/gpu_check.sh --out DIR       # report elsewhere
#   scripts/gpu_check.sh --quick         # suites only, no benchmarks
#
# Exit status: 0 when every suite passed, 1 when one failed (the report says which),
# 77 when no GPU is visible. Nothing here needs the network.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out="$root/gpu-check"
quick=0
while (($#)); do
  case "$1" in
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --quick) quick=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (expected --out DIR, --quick)" >&2; exit 2 ;;
  esac
done

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed): nothing to check" >&2
  exit 77
fi
mkdir -p "$out"
log="$out/log.txt"
: >"$log"
status=0
results=()   # "name|ok|seconds"

run() {  # run NAME CMD...: logs, times and records one step
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$log"
  if "$@" >>"$log" 2>&1; then
    results+=("$name|ok|$((SECONDS - t0))")
  else
    results+=("$name|FAILED (rc $?)|$((SECONDS - t0))")
    status=1
  fi
}

# ---- the machine --------------------------------------------------------------------
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
gpu_count=$(nvidia-smi -L | wc -l)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda_ver=$("$nvcc_bin" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
inc=$(dirname "$(dirname "$nvcc_bin")")/include
hdr_ver() {  # hdr_ver FILE MAJOR MINOR PATCH: "M.m.p" from #defines
  local f=$1
  [[ -f $f ]] || { echo unknown; return; }
  local v=()
  for k in "$2" "$3" "$4"; do v+=("$(sed -n "s/^#define $k \([0-9]*\).*/\1/p" "$f" | head -1)"); done
  echo "${v[0]:-?}.${v[1]:-?}.${v[2]:-?}"
}
cudnn_ver=$(hdr_ver "$inc/cudnn_version.h" CUDNN_MAJOR CUDNN_MINOR CUDNN_PATCHLEVEL)
nccl_ver=$(hdr_ver "$inc/nccl.h" NCCL_MAJOR NCCL_MINOR NCCL_PATCH)
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "GPU: $gpu_name x$gpu_count, driver $driver, CUDA $cuda_ver, cuDNN $cudnn_ver, NCCL $nccl_ver; CPU: $cpu" | tee -a "$log"

# ---- build and suites ------------------------------------------------------------
build=build-gpu
if [[ ! -f $build/build.ninja ]]; then
  run configure meson setup "$build" -Dcuda=enabled --buildtype=release
fi
run build ninja -C "$build"
# tests/cuda/meson.build registers every CUDA binary twice: as is, and *_4_per_gpu.
run "cuda suites (as is and 4 dp devices per GPU)" meson test -C "$build" --suite cuda --print-errorlogs
run "all suites" meson test -C "$build" --print-errorlogs --num-processes 4

# ---- benchmarks ------------------------------------------------------------------
if ((!quick)); then
  run "kernels" "$build/bench/kernels_bench" --device cuda:0
  run "collectives" "$build/bench/collectives_bench" --device cuda --devices "$gpu_count" --json
  run "collectives, 4 dp devices per GPU" env DP_CUDA_DEVICES_PER_GPU=4 \
    "$build/bench/collectives_bench" --device cuda --devices "$((4 * gpu_count))" --json
  run "dp_vs_ddp cnn, 4 dp devices per GPU" env DP_CUDA_DEVICES_PER_GPU=4 \
    "$build/samples/dp_vs_ddp/dp_vs_ddp" --model cnn --devices "1,$((4 * gpu_count))" --stages 1,2,3 --json
  for model in mlp cnn resnet18; do
    run "dp_vs_ddp $model" "$build/samples/dp_vs_ddp/dp_vs_ddp" --model "$model" --devices "1,$gpu_count" \
      --json --trace "$out/trace-$model" --plot "$out/plot-$model"
  done
fi

# ---- the report --------------------------------------------------------------------
{
  echo "# dp GPU check"
  echo
  echo "- GPU: $gpu_name × $gpu_count (driver $driver)"
  echo "- CUDA $cuda_ver, cuDNN $cudnn_ver, NCCL $nccl_ver"
  echo "- CPU: $cpu"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---|"
  for r in "${results[@]}"; do IFS='|' read -r n s t <<<"$r"; echo "| $n | $s | $t |"; done
  echo
  echo "Full output: log.txt. Benchmark JSON lines are in log.txt after each '=== ' header."
} >"$out/report.md"
{
  printf '{"gpu": "%s", "gpus": %s, "driver": "%s", "cuda": "%s", "cudnn": "%s", "nccl": "%s", "cpu": "%s", "steps": [' \
    "$gpu_name" "$gpu_count" "$driver" "$cuda_ver" "$cudnn_ver" "$nccl_ver" "$cpu"
  sep=""
  for r in "${results[@]}"; do
    IFS='|' read -r n s t <<<"$r"
    printf '%s{"name": "%s", "result": "%s", "seconds": %s}' "$sep" "$n" "$s" "$t"
    sep=", "
  done
  echo ']}'
} >"$out/report.json"
cat "$out/report.md"
exit $status
