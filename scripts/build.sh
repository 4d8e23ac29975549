#!/usr/bin/env bash
# Configures (once) and builds the release tree in build/. The CUDA backend is built
# whenever the toolkit is found (nvcc on PATH or in /usr/local/cuda/bin). The install
# prefix is Meson's default (/usr/local), so `meson install -C build` installs dp where
# a C++ library goes; pass --prefix=DIR to choose another.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if [[ ! -f build/build.ninja ]]; then
  meson setup build --buildtype=release "$@"
fi
ninja -C build
