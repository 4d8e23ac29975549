#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, build dp with CUDA, run the CUDA
# suites (the op table against the CPU oracle, the allocator, DP/DDP/Sharded 1-3
# against CPU virtual devices, the communicators against the local one), each twice:
# on the GPUs as they are and with DP_CUDA_DEVICES_PER_GPU=4 (four dp devices per
# GPU, the CUDA copy communicator; so one GPU checks the whole multi-device runtime),
# then the collectives benchmark and dp_vs_ddp, and write one report (markdown + JSON)
# naming the GPU, the driver and the CUDA, cuDNN and NCCL versions. The report is
# rewritten after every step, so a check stopped part-way still leaves one.
#
#   scripts/gpu_check.sh                 # report in gpu-check/ (build in build-gpu/)
#   scripts/gpu_check.sh --out DIR       # report elsewhere
#   scripts/gpu_check.sh --quick         # suites only, no benchmarks
#   scripts/gpu_check.sh --bundle DIR    # no build: run a bundle of scripts/gpu_bundle.sh
#                                        # (for GPU machines with no compiler or Meson)
#
# DP_GPU_CHECK_BUDGET=S (default 420; 0: none) bounds the benchmarks: once they have
# taken S seconds, the steps left are skipped (the report lists them as skipped, not
# failed); the suites always run. The benchmarks run in order of need, the open
# issues' first, so a lease of a few minutes records those.
# DP_GPU_CHECK_ROUNDS=N (default 2) sets the alternating rounds of the three comparisons
# against PyTorch: 1 fits a lease of a few minutes (one round each: ratios of one run).
# DP_GPU_CHECK_STEP_TIMEOUT=S stops any one step after S seconds (it then fails); the
# steps against PyTorch get more: 4 S the bf16 CNN and ResNet-18, 3 S the GPT, 3 S
# the fp32 three models (four contenders a round).
# Where python3 has a CUDA PyTorch, the benchmarks begin with what the open issues ask
# of a GPU: bench/gpu_side_by_side.py --precision bf16 (the CNN and ResNet-18 in bf16
# autocast against PyTorch AMP: default, cudnn.benchmark, torch.compile; channels_last)
# and bench/gpt_side_by_side.py --device cuda (samples/gpt in GPT-2 small's shape, bf16,
# tokens/s and MFU against PyTorch eager and compiled); the fp32 side-by-side of the
# three models runs last. The report quotes each comparison's table.
# With --bundle the CUDA suites run through scripts/run_bundle_tests.py, the CPU suites
# are left to the build machine, the CUDA libraries are looked for on this machine
# (the loader's cache, /usr/local/cuda*, Python's nvidia-* wheels);
# where ncu is there, scripts/gpu_profile.sh gives the GPT's and ResNet-18's GPU time per kernel.
#
# Exit status: 0 when every suite passed, 1 when one failed (the report says which),
# 2 on bad arguments, 77 when no GPU is visible. Nothing here needs the network.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out="$root/gpu-check"
quick=0
bundle=""
while (($#)); do
  case "$1" in
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --quick) quick=1; shift ;;
    --bundle) bundle=$(realpath "$2"); shift 2 ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { print; next } { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (expected --out DIR, --quick, --bundle DIR)" >&2; exit 2 ;;
  esac
done

[[ ${DP_GPU_CHECK_BUDGET:-420} =~ ^[0-9]+$ ]] ||
  { echo "gpu_check: DP_GPU_CHECK_BUDGET='$DP_GPU_CHECK_BUDGET' is not a number of seconds" >&2; exit 2; }
rounds=${DP_GPU_CHECK_ROUNDS:-2}
[[ $rounds =~ ^[1-9][0-9]*$ ]] ||
  { echo "gpu_check: DP_GPU_CHECK_ROUNDS='$rounds' is not a positive number of rounds" >&2; exit 2; }
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed): nothing to check" >&2
  exit 77
fi
mkdir -p "$out"
log="$out/log.txt"
: >"$log"
status=0
results=()   # "name|ok|seconds"
budget=${DP_GPU_CHECK_BUDGET:-420}
bench_t0=""  # set when the benchmarks begin: their steps count against $budget

run() {  # run [--steps K] NAME CMD...: logs, times and records one step (worth K steps' time)
  local weight=1
  if [[ $1 == --steps ]]; then weight=$2; shift 2; fi
  local name=$1; shift
  local t0=$SECONDS
  if [[ -n $bench_t0 ]] && ((budget > 0 && SECONDS - bench_t0 >= budget)); then
    echo "=== skipped: $name (the benchmarks are past their ${budget} s, DP_GPU_CHECK_BUDGET)" | tee -a "$log"
    results+=("$name|skipped (past the ${budget} s budget)|0")
    write_report
    return
  fi
  echo "=== $name: $*" | tee -a "$log"
  local limit=()   # DP_GPU_CHECK_STEP_TIMEOUT=S: no step runs longer than K * S seconds
  [[ -n ${DP_GPU_CHECK_STEP_TIMEOUT:-} ]] && limit=(timeout "$((DP_GPU_CHECK_STEP_TIMEOUT * weight))")
  if "${limit[@]}" "$@" >>"$log" 2>&1; then
    results+=("$name|ok|$((SECONDS - t0))")
  else
    results+=("$name|FAILED (rc $?)|$((SECONDS - t0))")
    status=1
  fi
  write_report
}

# The report (markdown and JSON) as the steps so far left it; rewritten after each step.
bf16_step="dp vs PyTorch, bf16 autocast, alternating"
gpt_step="GPT (gpt2-124m shape) vs PyTorch, bf16, one GPU"
fp32_step="dp vs PyTorch, alternating"
quoted_steps=("$bf16_step" "$gpt_step" "$fp32_step")
write_report() {
  local r n s t step sep
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
    for step in "${quoted_steps[@]}"; do  # each comparison's table, its progress lines left out
      grep -qF "=== $step:" "$log" || continue
      echo
      echo "$step:"
      echo
      echo '```'
      awk -v h="=== $step:" 'index($0, h) == 1 {f = 1; next} /^=== / {f = 0} f && !/^round /' "$log"
      echo '```'
    done
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
lib_ver() {  # lib_ver SONAME: the version in the file name the loader's cache points at
  local p
  p=$(ldconfig -p 2>/dev/null | awk -v n="$1" '$1 == n {print $NF; exit}')
  [[ -n $p ]] && basename "$(readlink -f "$p")" | sed -n 's/.*\.so\.\([0-9.]*\)$/\1/p'
}
cudnn_ver=$(hdr_ver "$inc/cudnn_version.h" CUDNN_MAJOR CUDNN_MINOR CUDNN_PATCHLEVEL)
nccl_ver=$(hdr_ver "$inc/nccl.h" NCCL_MAJOR NCCL_MINOR NCCL_PATCH)
# No headers (a bundle's machine): the libraries' own file names say it.
[[ $cudnn_ver == unknown ]] && cudnn_ver="$(lib_ver libcudnn.so.9) (library)"
[[ $nccl_ver == unknown ]] && nccl_ver="$(lib_ver libnccl.so.2) (library)"

cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "GPU: $gpu_name x$gpu_count, driver $driver, CUDA $cuda_ver, cuDNN $cudnn_ver, NCCL $nccl_ver; CPU: $cpu" | tee -a "$log"

# ---- build and suites ------------------------------------------------------------
if [[ -n $bundle ]]; then
  [[ -f $bundle/tests.json ]] || { echo "gpu_check: $bundle is no bundle of scripts/gpu_bundle.sh" >&2; exit 2; }
  build=$bundle
  # The CUDA libraries dp links (by soname), wherever this machine keeps them.
  libdirs=("$bundle/lib")
  for so in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcudnn.so.9 libnccl.so.2; do
    ldconfig -p 2>/dev/null | grep -q "$so" && continue
    hit=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/lib/python3*/ /usr/local/lib/python3*/ \
            /opt/*/.venv/lib/python3*/site-packages/nvidia -name "$so" 2>/dev/null | head -1)
    if [[ -n $hit ]]; then libdirs+=("$(dirname "$hit")"); else echo "gpu_check: $so not found" | tee -a "$log"; fi
  done
  LD_LIBRARY_PATH=$(IFS=:; echo "${libdirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LD_LIBRARY_PATH
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >>"$log"
  run "cuda suites (as is and 4 dp devices per GPU)" python3 "$root/scripts/run_bundle_tests.py" "$bundle" \
    --suite cuda --log "$out/tests.txt" --timeout-multiplier "${DP_GPU_CHECK_TIMEOUT_MULTIPLIER:-1}"
else
  build=build-gpu
  if [[ ! -f $build/build.ninja ]]; then
    run configure meson setup "$build" -Dcuda=enabled --buildtype=release
  fi
  run build ninja -C "$build"
  # tests/cuda/meson.build registers every CUDA binary twice: as is, and *_4_per_gpu.
  run "cuda suites (as is and 4 dp devices per GPU)" meson test -C "$build" --suite cuda --print-errorlogs
  run "all suites" meson test -C "$build" --print-errorlogs --num-processes 4
fi

# ---- benchmarks ------------------------------------------------------------------
if ((!quick)); then
  bench_t0=$SECONDS
  # The GPU's dense bf16 peak for the GPT runs' MFU (DP_GPU_PEAK_GFLOPS overrides): H100
  # and H200 SXM 989,000 GFLOP/s (TF32 494,500, FP32 66,900), H100 NVL 835,000, PCIe 756,000.
  peak_bf16=${DP_GPU_PEAK_GFLOPS:-}
  if [[ -z $peak_bf16 && $gpu_name =~ H100|H200 ]]; then
    peak_bf16=989000
    [[ $gpu_name =~ NVL ]] && peak_bf16=835000
    [[ $gpu_name =~ PCIe ]] && peak_bf16=756000
  fi
  # The GPT runs' corpus: the repository's own documents (character-level vocabulary).
  cat "$root"/README.md "$root"/docs/*.md >"$out/corpus.txt"
  torch_cuda=0
  python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && torch_cuda=1
  echo "python3 with a CUDA PyTorch: $( ((torch_cuda)) && echo yes || echo no)" | tee -a "$log"
  if ((torch_cuda)); then
    # The open issues' GPU figures first. bf16: the CNN and ResNet-18 in autocast, dp
    # against PyTorch AMP (channels_last; default, cudnn.benchmark and torch.compile, a
    # compile that fails or passes 150 s counted as unavailable), two alternating rounds
    # of four processes a model, each a fresh process (the compiles dominate; estimated
    # at 2-4 min on an H100 machine before its first run, so it counts as four steps).
    run --steps 4 "$bf16_step" python3 "$root/bench/gpu_side_by_side.py" \
      --binary "$build/samples/dp_vs_ddp/dp_vs_ddp" --precision bf16 --models cnn,resnet18 \
      --rounds "$rounds" --steps 50 --warmup 10 --compile-timeout 150
    # GPT-2 small's shape (12 layers, 12 heads, 768 wide, context 1024, the corpus'
    # characters as vocabulary), batch 8, bf16: samples/gpt against nanoGPT's recipe in
    # PyTorch (SDPA, fused AdamW) eager and compiled, tokens/s and MFU; two rounds of 30
    # steps (20 timed), estimated at 2-3 min with GPT-2's compile, so three steps.
    run --steps 3 "$gpt_step" python3 "$root/bench/gpt_side_by_side.py" --device cuda \
      --binary "$build/samples/gpt/gpt" --data "$out/corpus.txt" --precision bf16 --batch 8 \
      --rounds "$rounds" --steps 30 --warmup 10 --compile-timeout 180 ${peak_bf16:+--peak-gflops "$peak_bf16"}
  fi
  run "kernels" "$build/bench/kernels_bench" --device cuda:0
  run "kernels, TF32" "$build/bench/kernels_bench" --device cuda:0 --tf32 --filter gemm,conv2d
  run "overhead (ToyModel)" "$build/bench/overhead_bench" --devices 1
  run "overhead (ToyModel), 4 dp devices per GPU" env DP_CUDA_DEVICES_PER_GPU=4 \
    "$build/bench/overhead_bench" --devices "1,2,$((4 * gpu_count))"
  run "collectives" "$build/bench/collectives_bench" --device cuda --devices "$gpu_count" --json
  run "collectives, 4 dp devices per GPU" env DP_CUDA_DEVICES_PER_GPU=4 \
    "$build/bench/collectives_bench" --device cuda --devices "$((4 * gpu_count))" --json
  run "dp_vs_ddp cnn, 4 dp devices per GPU" env DP_CUDA_DEVICES_PER_GPU=4 \
    "$build/samples/dp_vs_ddp/dp_vs_ddp" --model cnn --devices "1,$((4 * gpu_count))" --stages 1,2,3 --json
  plot=()
  for model in mlp cnn resnet18; do
    command -v gnuplot >/dev/null && plot=(--plot "$out/plot-$model")
    run "dp_vs_ddp $model" "$build/samples/dp_vs_ddp/dp_vs_ddp" --model "$model" --devices "1,$gpu_count" \
      --json --trace "$out/trace-$model" "${plot[@]}"
  done
  # The GPT sample in GPT-2 small's shape (12 layers, 12 heads, 768 wide, context 1024;
  # character-level vocabulary, on the repository's own documents) on one GPU, fp32 and bf16
  # autocast: tokens/s and MFU against the GPU's dense peak (peak_bf16 above).
  gpt=("$build/samples/gpt/gpt" --config gpt2-124m --data "$out/corpus.txt" --devices 1 --batch 8 --steps 12
       --warmup 2 --log-every 1 --eval-interval 1000000 --eval-iters 1 --json)
  run "gpt2-124m shape, fp32, one GPU" "${gpt[@]}" --precision fp32
  run "gpt2-124m shape, bf16 autocast, one GPU" "${gpt[@]}" --precision bf16 ${peak_bf16:+--peak-gflops "$peak_bf16"}
  # The three designs on it, 4 dp devices per GPU, bf16 with bf16 gradients on the wire.
  run "gpt (tiny) every design, bf16, 4 dp devices per GPU" env DP_CUDA_DEVICES_PER_GPU=4 \
    "$build/samples/dp_vs_ddp/dp_vs_ddp" --model gpt --optimizer adamw --devices "$((4 * gpu_count))" \
    --stages 1,2,3 --precision bf16 --reduce-dtype bf16 --json
  # GPU time per kernel of the GPT's (GPT-2 small's shape, bf16) and ResNet-18's steps,
  # the two the open issues time against PyTorch, where Nsight Compute is there.
  if command -v ncu >/dev/null || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu >/dev/null 2>&1; then
    run "profile (ncu), gpt2 and resnet18" "$root/scripts/gpu_profile.sh" --build "$build" --models gpt2,resnet18 \
      --launches 4000 --top 25 --out "$out/profile"
  fi
  # PyTorch's step beside dp's on the same GPU (same models, batch 256, SGD), alternating,
  # where python3 has a CUDA PyTorch: its default and its best (cuDNN benchmark), and
  # dp's single-device step with and without DP_CUDNN_BENCHMARK.
  if ((torch_cuda)); then
    # Two rounds of three models and four contenders, each PyTorch one a fresh process:
    # about 150 s a round on an H100 machine, so it counts as three steps.
    run --steps 3 "$fp32_step" python3 "$root/bench/gpu_side_by_side.py" \
      --binary "$build/samples/dp_vs_ddp/dp_vs_ddp" --rounds "$rounds" --steps 50 --warmup 10 --dp-env
  fi
fi

# ---- the report --------------------------------------------------------------------
write_report
cat "$out/report.md"
exit $status
