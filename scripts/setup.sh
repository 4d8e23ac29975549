#!/usr/bin/env bash
# Installs what dp needs on Debian 12 (as root), skipping what is already there.
#   scripts/setup.sh            build + demo dependencies
#   scripts/setup.sh --test     also test tools (clang-14 for fuzzing, cmake for the install
#                               check's find_package(dp) build, Python packages)
set -euo pipefail

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

# openmpi-bin + libopenmpi-dev: multi-process jobs (dp::dist, mpirun; the 'mpi' tests).
# fortunes: the plain-text corpus samples/gpt trains on by default.
pkgs=(meson ninja-build pkg-config g++ libtbb-dev doctest-dev libdnnl-dev zlib1g-dev
      nlohmann-json3-dev libcli11-dev dataset-fashion-mnist gnuplot-nox python3
      openmpi-bin libopenmpi-dev fortunes)
if (( want_test )); then
  pkgs+=(clang-14 libclang-rt-14-dev python3-numpy cmake)
fi

missing=()
for p in "${pkgs[@]}"; do
  # gnuplot-qt or gnuplot-x11 satisfy the gnuplot need as well as gnuplot-nox.
  if [[ "$p" == gnuplot-nox ]] && command -v gnuplot >/dev/null; then continue; fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} )); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: all Debian packages present"
fi

if (( want_test )); then
  # The checkpoint interop test reads dp's files with the reference safetensors
  # client; it skips (exit 77) when the package cannot be had.
  py=$(command -v python3)
  if ! "$py" -c "import safetensors, numpy" 2>/dev/null; then
    echo "setup: pip install safetensors numpy"
    "$py" -m pip install -q safetensors numpy 2>/dev/null || echo "setup: pip install failed; the interop test will skip"
  fi
fi
