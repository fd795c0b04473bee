#!/usr/bin/env bash
# One device call for the fused attention kernels (notes/attention.md): build only the attention
# targets, then PyTorch's SDPA anchor, the GPU suite and the benchmark (with the anchor's figures
# for the ratios), one after the other so that nothing shares the GPU while timed. Full logs under $OUT, a short table last. From the
# repository root on the GPU machine:
#   benchmarks/attention/device_run.sh [PATH/attention_torch.py] [SECONDS]
# SECONDS (default 290) bounds the whole script: the benchmark gets what the steps before it left.
set -u
OUT=${OUT:-/tmp/attention_out}
mkdir -p "$OUT"
export METILE_CACHE_DIR=/tmp/metile-cache
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
anchor=${1:-}
budget=${2:-290}
left() { echo $((budget - ($(date +%s) - start))); }
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETILE_BUILD_PYTHON=OFF >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build build/gpu --target gpu_attention_kernels_test attention_benchmark -j16 >"$OUT/build.log" 2>&1 ||
  { grep -E "error|Error" -A3 "$OUT/build.log" | head -40; exit 1; }
echo "built after $(elapsed)"
torch_figures=
if [ -n "$anchor" ] && [ -f "$anchor" ]; then
  PYTHONUNBUFFERED=1 timeout 60 python3 "$anchor" >"$OUT/torch.log" 2>&1
  echo "torch anchor: rc=$? after $(elapsed)"
  torch_figures=$OUT/torch.log
fi
# The suite's tests run as parallel processes: NVRTC compiles (one CPU each) are most of its time,
# the kernel cache is safe to share (entries are renamed into place), and nothing here is timed.
suite=./build/gpu/tests/gpu/gpu_attention_kernels_test
pids=
for test in $($suite --gtest_list_tests | awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}'); do
  timeout 100 $suite --gtest_filter="$test" >"/tmp/gpu_test.${test//\//_}.log" 2>&1 &  # parameterized names hold "/"
  pids="$pids $!"
done
failed=0
for pid in $pids; do wait $pid || failed=$((failed + 1)); done
cat /tmp/gpu_test.*.log >"$OUT/gpu_test.log"
echo "gpu_attention_kernels_test: $failed of $(echo $pids | wc -w) tests failed, after $(elapsed)"
grep -E "METILE_TEST_SEED|^\[figures\]|Failure|^\[  FAILED|^\[  PASSED|Which is|error" "$OUT/gpu_test.log" | head -80
timeout $(($(left) > 20 ? $(left) : 20)) ./build/gpu/benchmarks/attention/attention_benchmark ${torch_figures:+--torch "$torch_figures"} \
  >"$OUT/benchmark.log" 2>"$OUT/benchmark_progress.log"
rc=$?
echo "attention_benchmark: rc=$rc after $(elapsed)"
if [ $rc -eq 0 ]; then tail -3 "$OUT/benchmark_progress.log"; else cat "$OUT/benchmark_progress.log"; fi
cat "$OUT/torch.log" 2>/dev/null
cat "$OUT/benchmark.log"
