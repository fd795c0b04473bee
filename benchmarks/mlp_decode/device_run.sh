#!/usr/bin/env bash
# One device call for the decode MLP (notes/mlp_decode.md): build only these targets, run the GPU
# suites of the GEMV kernels and the executor, then the benchmark; full logs under $OUT, a short
# summary on stdout.  Usage (repository root, on the GPU machine):
#   benchmarks/mlp_decode/device_run.sh [tests|bench|all] [benchmark flags...]
set -u
OUT=${OUT:-/tmp/mlp_decode_out}
mkdir -p "$OUT"
what=${1:-all}
shift || true
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETILE_BUILD_PYTHON=OFF >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build build/gpu --target gpu_gemv_kernels_test gpu_mlp_executor_test mlp_decode_benchmark -j16 \
  >"$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
echo "built in $(($(date +%s) - start)) s"
export METILE_CACHE_DIR=/tmp/metile-cache
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 200 ./build/gpu/tests/gpu/gpu_gemv_kernels_test >"$OUT/gemv_kernels.log" 2>&1
  echo "gemv kernels: rc=$? after $(($(date +%s) - start)) s"
  grep -E "^\[figures\]|Failure|^\[  FAILED|^\[  PASSED|Which is|relative|: bf16|: f16" "$OUT/gemv_kernels.log" | head -90
  timeout 150 ./build/gpu/tests/gpu/gpu_mlp_executor_test >"$OUT/mlp_executor.log" 2>&1
  echo "mlp executor: rc=$? after $(($(date +%s) - start)) s"
  grep -vE "^\[ RUN|^\[       OK|^\[----|^$" "$OUT/mlp_executor.log" | head -80
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 300 ./build/gpu/benchmarks/mlp_decode/mlp_decode_benchmark "$@" >"$OUT/benchmark.log" 2>&1
  echo "benchmark: rc=$? after $(($(date +%s) - start)) s"
  sed -n '/^per stage/,$p' "$OUT/benchmark.log"
  tail -3 "$OUT/benchmark.log"
fi
