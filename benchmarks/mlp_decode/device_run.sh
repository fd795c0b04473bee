#!/usr/bin/env bash
# One device call for the decode MLP (notes/mlp_decode.md): build only these targets, then run the
# steps named, in order; full logs under $OUT, a short summary on stdout. From the repository root
# on the GPU machine:
#   benchmarks/mlp_decode/device_run.sh STEP...
#     gemv     GPU suite of every GEMV kernel and schedule     exec   GPU suite of the executor
#     streamed only the streamed-mainloop GPU test     persistent  the persistent decode-MLP GPU suite
#     new      the split-K / staged / group-sum and programmatic-dependent-launch GPU suite (issue 15)
#     profile  ncu --clock-control none over benchmark --profile (M=1 stage kernels, read-only stream)
#     kernels  benchmark --kernels (stage kernels alone)       quick | default | full   the benchmark
#     anchors  the PyTorch peers ($ANCHORS/kernels_torch.py, default .anchors/: copied into the checkout and carried)
# Environment: DEADLINE (seconds; every step's timeout shrinks to fit it), *_TIMEOUT per step,
# BENCHMARK_ARGS (extra benchmark flags). When the `new` step failed (not a timeout), the benchmark
# runs with --candidates 5 (the v3 register shapes only), so that a broken new kernel cannot take
# the whole measurement down with it.
set -u
OUT=${OUT:-/tmp/mlp_decode_out}
mkdir -p "$OUT"
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMETILE_BUILD_PYTHON=OFF >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build build/gpu --target gpu_gemv_kernels_test gpu_gemv_schedules_test gpu_mlp_executor_test gpu_mlp_persistent_test mlp_decode_benchmark -j16 \
  >"$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
echo "built in $(($(date +%s) - start)) s"
export METILE_CACHE_DIR=/tmp/metile-cache
elapsed() { echo "$(($(date +%s) - start)) s"; }
# DEADLINE (seconds after the start): every step's timeout shrinks to what is left of it.
limit() { local left=$(( ${DEADLINE:-100000} - ($(date +%s) - start) - 5 )); [ $left -lt $1 ] && echo $(( left > 1 ? left : 1 )) || echo $1; }
for step in "$@"; do
  case $step in
    gemv)
      timeout $(limit 200) ./build/gpu/tests/gpu/gpu_gemv_kernels_test >"$OUT/gemv_kernels.log" 2>&1
      echo "gemv kernels: rc=$? after $(elapsed)"
      grep -E "^\[figures\]|Failure|^\[  FAILED|^\[  PASSED|Which is" "$OUT/gemv_kernels.log" | head -90 ;;
    exec)
      timeout $(limit ${EXEC_TIMEOUT:-150}) ./build/gpu/tests/gpu/gpu_mlp_executor_test >"$OUT/mlp_executor.log" 2>&1
      rc=$?
      echo "mlp executor: rc=$rc after $(elapsed)"
      grep -vE "^\[ RUN|^\[       OK|^\[----|^$" "$OUT/mlp_executor.log" | head -80
      if [ $rc -ge 128 ]; then  # a crash: where
        timeout 120 cuda-gdb -q -batch -ex run -ex bt --args ./build/gpu/tests/gpu/gpu_mlp_executor_test 2>&1 |
          grep -E "^#|signal|Signal" | head -30
      fi ;;
    new)
      timeout $(limit ${NEW_TIMEOUT:-150}) ./build/gpu/tests/gpu/gpu_gemv_schedules_test >"$OUT/new_kernels.log" 2>&1
      new_rc=$?
      echo "split-K/staged/group-sum/PDL kernels: rc=$new_rc after $(elapsed)"
      if [ $new_rc -ne 0 ] && [ $new_rc -ne 124 ]; then BENCHMARK_ARGS="${BENCHMARK_ARGS:-} --candidates 5"; echo "benchmark falls back to --candidates 5"; fi
      grep -E "^\[figures\]|Failure|^\[  FAILED|^\[  PASSED|^\[       OK|Which is|error" "$OUT/new_kernels.log" | head -60 ;;
    persistent)
      timeout $(limit ${PERSISTENT_TIMEOUT:-200}) ./build/gpu/tests/gpu/gpu_mlp_persistent_test >"$OUT/persistent.log" 2>&1
      echo "persistent decode MLP: rc=$? after $(elapsed)"
      grep -E "^\[figures\]|Failure|^\[  FAILED|^\[  PASSED|Which is|error|seed" "$OUT/persistent.log" | head -60 ;;
    streamed)
      timeout $(limit 240) ./build/gpu/tests/gpu/gpu_gemv_kernels_test --gtest_filter='*Streamed*' >"$OUT/streamed.log" 2>&1
      echo "streamed kernels: rc=$? after $(elapsed)"
      grep -E "^\[figures\]|Failure|^\[  FAILED|^\[  PASSED|Which is|error" "$OUT/streamed.log" | head -60 ;;
    profile)
      timeout $(limit ${PROFILE_TIMEOUT:-200}) ncu --clock-control none --kernel-name regex:'metile_' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section SchedulerStats ./build/gpu/benchmarks/mlp_decode/mlp_decode_benchmark --profile >"$OUT/ncu.log" 2>&1
      echo "ncu: rc=$? after $(elapsed)"
      grep -E "^  metile_|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|stalled|Dynamic Shared" "$OUT/ncu.log" |
        sed -E 's/ +/ /g' | cut -c1-230 | head -150 ;;
    anchors)
      PYTHONUNBUFFERED=1 timeout 200 python3 "${ANCHORS:-.anchors}/kernels_torch.py" >"$OUT/anchors.log" 2>&1
      echo "anchors: rc=$? after $(elapsed)"
      grep -E "COPY_BW|mlp" "$OUT/anchors.log" | head -40 ;;
    kernels | quick | default | full)
      flag=--$step
      [ "$step" = default ] && flag=
      timeout $(limit ${BENCHMARK_TIMEOUT:-300}) ./build/gpu/benchmarks/mlp_decode/mlp_decode_benchmark $flag ${BENCHMARK_ARGS:-} >"$OUT/benchmark_$step.log" 2>&1
      echo "benchmark $step: rc=$? after $(elapsed)"
      if [ "$step" = kernels ]; then cat "$OUT/benchmark_$step.log"; else sed -n '/^per stage/,$p' "$OUT/benchmark_$step.log"; fi
      tail -2 "$OUT/benchmark_$step.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
