#!/usr/bin/env bash
# Installs a build tree into a staging directory (meson install --destdir: nothing is
# written under the real prefix, so no root and nothing left behind), then builds a
# program outside the tree against the staged copy with `pkg-config --cflags --libs dp`,
# as a user does after `meson install`, and runs it. Usage: install_check.sh [BUILD_DIR]
# (default build/).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
meson install -C "$build" --quiet --destdir "$stage"
pc=$(find "$stage" -name dp.pc | head -n1)
[[ -n "$pc" ]] || { echo "install_check: no dp.pc was installed" >&2; exit 1; }
export PKG_CONFIG_PATH
PKG_CONFIG_PATH=$(dirname "$pc")
# dp.pc names the real prefix (/usr/local unless configured otherwise); point it at the
# staged copy.
prefix=$(pkg-config --variable=prefix dp)
pcflags=(--define-variable=prefix="$stage$prefix")
# shellcheck disable=SC2046
g++ -O2 -o "$stage/hello_dp" "$root/scripts/install_check/main.cpp" $(pkg-config "${pcflags[@]}" --cflags --libs dp)
LD_LIBRARY_PATH="$(pkg-config "${pcflags[@]}" --variable=libdir dp)" "$stage/hello_dp"
