#!/usr/bin/env bash
# Packs a built tree into a relocatable bundle that runs on a GPU machine with no
# compiler, Meson, oneTBB, oneDNN or Open MPI installed: every executable and shared
# library of the build (object files left out, layout kept so RPATHs hold), the test
# list (Meson's intro-tests.json) with the paths it was built at, and the shared
# libraries they load that a bare CUDA machine may lack (oneTBB, oneDNN, Open MPI and
# what those load). CUDA's own libraries, the driver and the C/C++ runtime are left
# out: the GPU machine has its own, and scripts/gpu_check.sh --bundle finds them.
#
#   scripts/gpu_bundle.sh                      # build-gpu -> .gpu-bundle
#   scripts/gpu_bundle.sh BUILD_DIR DEST_DIR
#
# Then, on the GPU machine, from a checkout of the same commit:
#   scripts/gpu_check.sh --bundle DEST_DIR
#
#   scripts/gpu_bundle.sh --compact [BUILD_DIR DEST_DIR]
# keeps only what scripts/gpu_check.sh runs there (libdp, the CUDA suites, dp_vs_ddp,
# gpt and the three benchmarks), strips symbols, and packs it as DEST_DIR.tar.xz: a
# whole build's bundle is about 200 MB, more than a lent GPU machine takes with the
# working tree (64 MiB); the compact one is a few tens of MB. There:
#   tar -xJf DEST.tar.xz && scripts/gpu_check.sh --bundle DEST
# A CUDA object older than the newest header under src/ or include/ is refused (exit 2):
# Meson before 1.2 does not rebuild CUDA objects when a header changes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
compact=0
if [[ ${1:-} == --compact ]]; then compact=1; shift; fi
build=$(realpath "${1:-$root/build-gpu}")
dest=$(realpath -m "${2:-$root/.gpu-bundle}")
[[ -f $build/meson-info/intro-tests.json ]] ||
  { echo "gpu_bundle: $build is not a configured Meson build (no meson-info/intro-tests.json)" >&2; exit 2; }
[[ $dest != "$build" && $dest != / ]] || { echo "gpu_bundle: refusing to write the bundle over $dest" >&2; exit 2; }
# Meson before 1.2 records no header a .cu file includes (meson.build warns): a CUDA
# object older than the newest header would put old device code beside new host code.
newest_header=$(find "$root/src" "$root/include" \( -name '*.h' -o -name '*.cuh' \) -printf '%T@ %p\n' |
                sort -n | tail -1 | cut -d' ' -f2-)
if [[ -n $newest_header ]]; then
  stale=$(find "$build" -name '*.cu.o' ! -newer "$newest_header" | head -3)
  if [[ -n $stale ]]; then
    echo "gpu_bundle: CUDA objects older than $newest_header (e.g. $(echo "$stale" | head -1)):" \
         "this Meson may not have rebuilt them; run find $build -name '*.cu.o' -delete && ninja -C $build" >&2
    exit 2
  fi
fi

rm -rf "$dest"
mkdir -p "$dest/lib"
is_elf() { [[ -f $1 && ! -L $1 ]] && [[ $(head -c 4 "$1" | od -An -c | tr -d ' ') == '177ELF' ]]; }

# Executables and shared objects of the build, outside the per-target object folders.
while IFS= read -r -d '' f; do
  rel=${f#"$build"/}
  if [[ -L $f ]]; then
    mkdir -p "$dest/$(dirname "$rel")"; cp -P "$f" "$dest/$rel"   # libdp.so -> libdp.so.0.2 ...
  elif is_elf "$f"; then
    mkdir -p "$dest/$(dirname "$rel")"; cp -p "$f" "$dest/$rel"
  fi
done < <(find "$build" \( -name '*.p' -o -name 'meson-*' \) -prune -o \( -type f -o -type l \) -print0)
cp "$build/meson-info/intro-tests.json" "$dest/tests.json"
printf '{"build": "%s", "source": "%s"}\n' "$build" "$root" >"$dest/origin.json"

# Shared libraries a bare CUDA machine may not have.
keep_out='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+|libgcc_s|libcuda\.|libcudart|libcublas|libcudnn|libnccl|libnvrtc|libnvJitLink)'
while IFS= read -r -d '' f; do
  is_elf "$f" || continue
  ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done < <(find "$dest" -path "$dest/lib" -prune -o -type f -print0) | sort -u |
while read -r name path; do
  [[ $name =~ $keep_out || $path == "$build"/* || $path == "$dest"/* ]] && continue
  [[ -e $dest/lib/$name ]] || cp -L "$path" "$dest/lib/$name"
done
if ((compact)); then
  # What gpu_check.sh and gpu_profile.sh run; every other executable goes. The libraries
  # they load stay (lib/ and src/).
  keep='^(src/|lib/|tests/cuda/|tests/tensor/op_fuzz_replay$|tests/optim/optim_fuzz_replay$|samples/dp_vs_ddp/dp_vs_ddp$|samples/gpt/gpt$|bench/(kernels|overhead|collectives)_bench$|tests\.json$|origin\.json$)'
  while IFS= read -r -d '' f; do
    rel=${f#"$dest"/}
    [[ $rel =~ $keep ]] || rm -f "$f"
  done < <(find "$dest" \( -type f -o -type l \) -print0)
  find "$dest" -type d -empty -delete
  while IFS= read -r -d '' f; do
    is_elf "$f" && strip --strip-unneeded "$f" 2>/dev/null || true
  done < <(find "$dest" -type f -print0)
  tar -C "$(dirname "$dest")" -cJf "$dest.tar.xz" "$(basename "$dest")"
  echo "gpu_bundle: compact: $(find "$dest" -type f | wc -l) files, $(du -sh "$dest" | cut -f1) in $dest;" \
    "packed: $dest.tar.xz, $(($(stat -c %s "$dest.tar.xz") >> 20)) MiB"
  exit 0
fi
echo "gpu_bundle: $(find "$dest" -type f | wc -l) files, $(du -sh "$dest" | cut -f1) in $dest"
echo "gpu_bundle: libraries carried: $(ls "$dest/lib" | tr '\n' ' ')"
