#!/usr/bin/env bash
# One command from a fresh clone: install dependencies, build (preset `default`),
# and run the seed example on the CPU reference backend.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_dependencies.sh
cmake --preset default >/dev/null
cmake --build --preset default
echo "+ build/default/tools/metile/metile run examples/add_rms_norm.json"
build/default/tools/metile/metile run examples/add_rms_norm.json
