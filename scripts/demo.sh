#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: install, build, run the DP-vs-DDP demo.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
exec "$root/build/samples/dp_vs_ddp/dp_vs_ddp" "$@"
