#!/usr/bin/env bash
# Runs every test that needs no GPU. The unit and CLI suites are built and run once, under
# ASan+UBSan (the asan preset, Debug): building them a second time in the default preset cost CI
# minutes it does not have. The default preset builds the library, the tools, the benchmarks and the
# Python module, and runs the Python suite. Then each libFuzzer harness for its fixed number of
# executions (scripts/fuzz.sh). The GPU suites (ctest label `gpu`) are not built here: without a
# device they only skip; scripts/gpu_check.sh builds and runs them on a CUDA machine (and
# `cmake --preset default` builds them, with the unit suites, for `ctest --preset gpu`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_dependencies.sh
jobs=$(nproc)

echo "== build (default preset)"
cmake --preset default -DMETILE_BUILD_UNIT_TESTS=OFF -DMETILE_BUILD_GPU_TESTS=OFF >/dev/null
cmake --build --preset default -j "$jobs"
echo "== tests (default preset)"
ctest --preset default -j "$jobs"

echo "== build (asan preset: AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs"
echo "== tests (asan preset)"
# intercept_tls_get_addr=0: LeakSanitizer's tracking of dynamic TLS read a bogus block of a
# dlopen'd library (NVRTC) at exit and crashed ("Tracer caught signal 11", "DTLS 5 at 0x11a7-...")
# in two NVRTC tests under ctest, after they had passed; leaks are still detected.
ASAN_OPTIONS=detect_leaks=1:intercept_tls_get_addr=0 ctest --preset asan -j "$jobs"

echo "== fuzz (libFuzzer harnesses, ASan+UBSan, fixed executions)"
scripts/fuzz.sh
