#!/usr/bin/env bash
# One device call for the decode MLP (notes/mlp_decode.md): build only these targets, then run the
# steps named, in order; full logs under $OUT, a short summary on stdout. From the repository root
# on the GPU machine:
#   benchmarks/mlp_decode/device_run.sh STEP...
#     gemv     GPU suite of every GEMV kernel and schedule     exec   GPU suite of the executor
#     kernels  benchmark --kernels (stage kernels alone)       quick | default | full   the benchmark
set -u
OUT=${OUT:-/tmp/mlp_decode_out}
mkdir -p "$OUT"
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMETILE_BUILD_PYTHON=OFF >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build build/gpu --target gpu_gemv_kernels_test gpu_mlp_executor_test mlp_decode_benchmark -j16 \
  >"$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
echo "built in $(($(date +%s) - start)) s"
export METILE_CACHE_DIR=/tmp/metile-cache
elapsed() { echo "$(($(date +%s) - start)) s"; }
for step in "$@"; do
  case $step in
    gemv)
      timeout 200 ./build/gpu/tests/gpu/gpu_gemv_kernels_test >"$OUT/gemv_kernels.log" 2>&1
      echo "gemv kernels: rc=$? after $(elapsed)"
      grep -E "^\[figures\]|Failure|^\[  FAILED|^\[  PASSED|Which is" "$OUT/gemv_kernels.log" | head -90 ;;
    exec)
      timeout 150 ./build/gpu/tests/gpu/gpu_mlp_executor_test >"$OUT/mlp_executor.log" 2>&1
      rc=$?
      echo "mlp executor: rc=$rc after $(elapsed)"
      grep -vE "^\[ RUN|^\[       OK|^\[----|^$" "$OUT/mlp_executor.log" | head -80
      if [ $rc -ge 128 ]; then  # a crash: where
        timeout 120 cuda-gdb -q -batch -ex run -ex bt --args ./build/gpu/tests/gpu/gpu_mlp_executor_test 2>&1 |
          grep -E "^#|signal|Signal" | head -30
      fi ;;
    kernels | quick | default | full)
      flag=--$step
      [ "$step" = default ] && flag=
      timeout 300 ./build/gpu/benchmarks/mlp_decode/mlp_decode_benchmark $flag >"$OUT/benchmark_$step.log" 2>&1
      echo "benchmark $step: rc=$? after $(elapsed)"
      if [ "$step" = kernels ]; then cat "$OUT/benchmark_$step.log"; else sed -n '/^per stage/,$p' "$OUT/benchmark_$step.log"; fi
      tail -2 "$OUT/benchmark_$step.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
