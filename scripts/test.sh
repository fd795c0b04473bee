#!/usr/bin/env bash
# Runs every test that needs no GPU. The unit and CLI suites are built and run once, under
# ASan+UBSan (the asan preset, Debug): building them a second time in the default preset cost CI
# minutes it does not have. The default preset builds the library, the tools, the benchmarks, the
# GPU suites (they skip without a device) and the Python module, and runs the Python suite. Then
# each libFuzzer harness for its fixed number of executions (scripts/fuzz.sh).
# GPU tests (ctest label `gpu`) run on a CUDA machine with `ctest --preset gpu`, from a default
# build with the unit suites (`cmake --preset default`, METILE_BUILD_UNIT_TESTS is ON there).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_dependencies.sh
jobs=$(nproc)

echo "== build (default preset)"
cmake --preset default -DMETILE_BUILD_UNIT_TESTS=OFF >/dev/null
cmake --build --preset default -j "$jobs"
echo "== tests (default preset)"
ctest --preset default -j "$jobs"

echo "== build (asan preset: AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs"
echo "== tests (asan preset)"
ASAN_OPTIONS=detect_leaks=1 ctest --preset asan -j "$jobs"

echo "== fuzz (libFuzzer harnesses, ASan+UBSan, fixed executions)"
scripts/fuzz.sh
