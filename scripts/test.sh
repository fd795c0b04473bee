#!/usr/bin/env bash
# Runs every test that needs no GPU: the unit and CLI tests and the Python
# suite on the `default` build, then the unit tests again under ASan+UBSan, then
# each libFuzzer harness for its fixed number of executions (scripts/fuzz.sh).
# GPU tests (ctest label `gpu`) run on a CUDA machine with `ctest --preset gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_dependencies.sh
jobs=$(nproc)

echo "== build (default preset)"
cmake --preset default >/dev/null
cmake --build --preset default -j "$jobs"
echo "== tests (default preset)"
ctest --preset default -j "$jobs"

echo "== build (asan preset: AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs"
echo "== tests (asan preset)"
# The NVRTC compile tests are left out here: their time is NVRTC's own (not instrumented), and the
# default preset above runs them; the generators they drive run under the sanitizers in other tests.
ASAN_OPTIONS=detect_leaks=1 ctest --preset asan -j "$jobs" -E 'Compiles?ForSm90|^GemvCompile\.'

echo "== fuzz (libFuzzer harnesses, ASan+UBSan, fixed executions)"
scripts/fuzz.sh
