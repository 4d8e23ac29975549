#!/usr/bin/env bash
# GPU time per kernel of dp's training step: Nsight Compute (ncu) over the first
# launches of samples/dp_vs_ddp's single-device configuration, summed per kernel name,
# largest first. The table the CUDA kernels' work starts from (docs/BENCHMARKS.md, "On
# a GPU").
#
#   scripts/gpu_profile.sh                          # build-gpu, cnn mlp resnet18
#   scripts/gpu_profile.sh --bundle DIR --models cnn --launches 400 --top 15
#   scripts/gpu_profile.sh --models gpt2 --launches 4000  # samples/gpt, GPT-2 small's shape
#   scripts/gpu_profile.sh --summarize FILE.csv     # the table of a saved ncu CSV
#
# Each model runs `dp_vs_ddp --model M --devices 1 --warmup 2 --steps 3` under
# `ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw
# --launch-count N`: the single-device step comes first, so the first N launches are
# its warm-up and timed steps. The model `gpt2` is samples/gpt instead: `--config
# gpt2-124m --precision bf16 --batch 8` on one device, its corpus the repository's own
# documents (a character vocabulary, as scripts/gpu_check.sh's GPT runs); give it
# launches enough for its warm-up step and one more. The CSVs are kept in --out
# (default gpu-profile/).
# Exit status: 0, 77 when no GPU or no ncu is found, 2 on bad arguments.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build-gpu"
out="$root/gpu-profile"
models="cnn mlp resnet18"
launches=320
top=12
summarize=""
while (($#)); do
  case "$1" in
    --bundle) build=$(realpath "$2"); shift 2 ;;
    --build) build=$(realpath "$2"); shift 2 ;;
    --models) models=${2//,/ }; shift 2 ;;
    --launches) launches=$2; shift 2 ;;
    --top) top=$2; shift 2 ;;
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --summarize) summarize=$2; shift 2 ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { print; next } { exit }' "$0"; exit 0 ;;
    *) echo "gpu_profile: unknown argument '$1' (expected --bundle DIR, --build DIR, --models LIST," \
            "--launches N, --top N, --out DIR, --summarize FILE)" >&2; exit 2 ;;
  esac
done
[[ $launches =~ ^[1-9][0-9]*$ && $top =~ ^[1-9][0-9]*$ ]] ||
  { echo "gpu_profile: --launches and --top take positive integers, got '$launches' and '$top'" >&2; exit 2; }

summary() {  # summary CSV: the per-kernel table of one ncu raw CSV
  python3 - "$1" "$top" <<'PY'
import collections, csv, sys
path, top = sys.argv[1], int(sys.argv[2])
try:
    rows = list(csv.reader(l for l in open(path, errors="replace") if l.startswith('"')))
except OSError as e:
    sys.exit(f"gpu_profile: cannot read {path}: {e}")
if len(rows) < 3 or "Kernel Name" not in rows[0] or "gpu__time_duration.sum" not in rows[0]:
    sys.exit(f"gpu_profile: {path} holds no ncu raw page with gpu__time_duration.sum")
h = rows[0]
name, col = h.index("Kernel Name"), h.index("gpu__time_duration.sum")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(rows[1][col], None)
if scale is None:
    sys.exit(f"gpu_profile: unknown time unit '{rows[1][col]}' in {path}")
agg = collections.defaultdict(lambda: [0, 0.0])
for r in rows[2:]:
    try:
        t = float(r[col].replace(",", "")) * scale
    except (ValueError, IndexError):
        continue
    a = agg[r[name]]
    a[0] += 1
    a[1] += t
total = sum(v[1] for v in agg.values())
print(f"{sum(v[0] for v in agg.values())} launches, {total:.1f} us of GPU time")
print(f"{'us':>9} {'share':>6} {'calls':>5} {'us/call':>8}  kernel")
for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
    print(f"{t:9.1f} {100 * t / total:5.1f}% {n:5d} {t / n:8.2f}  {k[:100]}")
PY
}

if [[ -n $summarize ]]; then
  summary "$summarize"
  exit $?
fi
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_profile: no NVIDIA GPU visible (nvidia-smi -L failed)" >&2
  exit 77
fi
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[[ -n $ncu ]] || { echo "gpu_profile: ncu (Nsight Compute) not found" >&2; exit 77; }
bin="$build/samples/dp_vs_ddp/dp_vs_ddp"
[[ -x $bin ]] || { echo "gpu_profile: $bin not found (build with CUDA first, or --bundle DIR)" >&2; exit 2; }
if [[ -f $build/tests.json && -d $build/lib ]]; then  # a bundle of scripts/gpu_bundle.sh
  export LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
mkdir -p "$out"
status=0
for m in $models; do
  if [[ $m == gpt2 ]]; then
    cat "$root"/README.md "$root"/docs/*.md >"$out/corpus.txt"
    cmd=("$build/samples/gpt/gpt" --config gpt2-124m --data "$out/corpus.txt" --devices 1 --batch 8 --steps 3
         --warmup 1 --precision bf16 --log-every 1 --eval-interval 1000000 --eval-iters 1)
  else
    cmd=("$bin" --model "$m" --devices 1 --warmup 2 --steps 3 --json)
  fi
  echo "== $m: the first $launches launches of ${cmd[*]#"$build/"}"
  if ! "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --page raw --launch-count "$launches" \
      "${cmd[@]}" >"$out/ncu-$m.csv" 2>"$out/ncu-$m.err"; then
    echo "gpu_profile: ncu failed for $m (see $out/ncu-$m.err)" >&2
    status=1
    continue
  fi
  summary "$out/ncu-$m.csv" || status=1
done
exit $status
