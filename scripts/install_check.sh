#!/usr/bin/env bash
# Installs a build tree into a staging directory (meson install --destdir: nothing is
# written under the real prefix, so no root and nothing left behind), then builds a
# program outside the tree against the staged copy both ways a user does after
# `meson install`, and runs each:
#   1. g++ with `pkg-config --cflags --libs dp`;
#   2. CMake: find_package(dp <version> CONFIG REQUIRED) and target_link_libraries(...
#      dp::dp), with CMAKE_PREFIX_PATH at the staged prefix (which also shows the CMake
#      package finds its files from its own place, not from the configured prefix).
# Both programs print dp::version() and check it equals the headers' DP_VERSION_STRING;
# the script checks that number is dp.pc's. Then find_package's version rule: no
# version, an older minor of the same major and a range are met; a newer minor, the next major and 99
# are refused by dp's dpConfigVersion.cmake (its file named as considered, not just
# missing). Usage: install_check.sh [BUILD_DIR] (default build/). Needs cmake
# (scripts/setup.sh --test).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
fail() { echo "install_check: $*" >&2; exit 1; }
command -v cmake >/dev/null || fail "cmake is missing; scripts/setup.sh --test installs it"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
meson install -C "$build" --quiet --destdir "$stage"

# ---- 1. pkg-config ------------------------------------------------------------------
pc=$(find "$stage" -name dp.pc | head -n1)
[[ -n "$pc" ]] || fail "no dp.pc was installed"
export PKG_CONFIG_PATH
PKG_CONFIG_PATH=$(dirname "$pc")
# dp.pc names the real prefix (/usr/local unless configured otherwise); point it at the
# staged copy.
prefix=$(pkg-config --variable=prefix dp)
version=$(pkg-config --modversion dp)
pcflags=(--define-variable=prefix="$stage$prefix")
# shellcheck disable=SC2046
g++ -O2 -o "$stage/hello_dp" "$root/scripts/install_check/main.cpp" $(pkg-config "${pcflags[@]}" --cflags --libs dp)
out=$(LD_LIBRARY_PATH="$(pkg-config "${pcflags[@]}" --variable=libdir dp)" "$stage/hello_dp") ||
  { echo "$out"; fail "the program built with pkg-config failed"; }
echo "pkg-config: $out" | sed '2,$s/^/            /'
grep -qx "dp $version (headers $version)" <<<"$out" || fail "the program did not report dp.pc's version $version"

# ---- 2. CMake -----------------------------------------------------------------------
config=$(find "$stage" -name dpConfig.cmake | head -n1)
[[ -n "$config" ]] || fail "no dpConfig.cmake was installed"
[[ -f "$(dirname "$config")/dpConfigVersion.cmake" ]] || fail "no dpConfigVersion.cmake beside $config"
configure() {  # configure BUILD_DIR VERSION_REQUEST: the output; the status of cmake
  cmake -S "$root/scripts/install_check" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH="$stage$prefix" -DDP_REQUEST="$2" 2>&1
}
log=$(configure "$stage/cmake" "$version") || { echo "$log"; fail "find_package(dp $version CONFIG REQUIRED) failed"; }
grep -q "dp $version found in $stage" <<<"$log" || { echo "$log"; fail "CMake did not find the staged dp $version"; }
log=$(cmake --build "$stage/cmake" --verbose 2>&1) || { echo "$log"; fail "the CMake build against dp::dp failed"; }
# The staged headers and library, not a dp installed under the real prefix.
grep -q -- "$stage$prefix/include" <<<"$log" && grep -q -- "$stage$prefix/.*libdp\.so" <<<"$log" ||
  { echo "$log"; fail "the CMake build did not use the staged dp's headers and library"; }
# No LD_LIBRARY_PATH: CMake records libdp's folder in the program (its build-tree rpath).
out=$("$stage/cmake/hello_dp") || { echo "$out"; fail "the program built with CMake failed"; }
echo "CMake:      $out" | sed '2,$s/^/            /'
grep -qx "dp $version (headers $version)" <<<"$out" || fail "the program did not report version $version"

# ---- find_package's version rule (same major, not older than asked) -----------------
IFS=. read -r major minor _ <<<"$version"
accepted=("" "$major.0...<$((major + 1))")  # "": find_package(dp CONFIG REQUIRED)
(( minor > 0 )) && accepted+=("$major.$((minor - 1))")
refused=("99" "$((major + 1))" "$major.$((minor + 1))")
n=0
for want in "${accepted[@]}"; do
  n=$((n + 1))
  log=$(configure "$stage/want$n" "$want") || { echo "$log"; fail "find_package(dp $want) refused dp $version"; }
done
for want in "${refused[@]}"; do
  n=$((n + 1))
  if log=$(configure "$stage/want$n" "$want"); then
    echo "$log"; fail "find_package(dp $want) accepted dp $version"
  fi
  # Refused by the version file, not for want of a package: CMake names the file it
  # considered and its version.
  grep -q "dpConfig.cmake, version: $version" <<<"$log" ||
    { echo "$log"; fail "find_package(dp $want) failed without considering the staged dp $version"; }
done
echo "find_package(dp [VERSION]): no version, ${accepted[*]:1} met; ${refused[*]} refused"
