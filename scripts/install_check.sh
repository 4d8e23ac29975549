#!/usr/bin/env bash
# Installs dp into build/prefix and builds a program outside the tree against it with
# `pkg-config --cflags --libs dp`, then runs it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
meson install -C "$root/build" --quiet
prefix="$root/build/prefix"
pcdir=$(dirname "$(find "$prefix" -name dp.pc | head -n1)")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export PKG_CONFIG_PATH="$pcdir"
# shellcheck disable=SC2046
g++ -O2 -o "$out/hello_dp" "$root/scripts/install_check/main.cpp" $(pkg-config --cflags --libs dp)
LD_LIBRARY_PATH="$(pkg-config --variable=libdir dp)" "$out/hello_dp"
