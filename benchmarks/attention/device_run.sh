#!/usr/bin/env bash
# One device call for the fused attention kernels (notes/attention.md): build only the attention
# targets, then PyTorch's SDPA anchor, the GPU suite and the benchmark (with the anchor's figures
# for the ratios), one after the other so that nothing shares the GPU while timed. Full logs under $OUT, a short table last. From the
# repository root on the GPU machine:
#   benchmarks/attention/device_run.sh [PATH/attention_torch.py]
set -u
OUT=${OUT:-/tmp/attention_out}
mkdir -p "$OUT"
export METILE_CACHE_DIR=/tmp/metile-cache
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
anchor=${1:-}
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETILE_BUILD_PYTHON=OFF >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build build/gpu --target gpu_attention_kernels_test attention_benchmark -j14 >"$OUT/build.log" 2>&1 ||
  { grep -E "error|Error" -A3 "$OUT/build.log" | head -40; exit 1; }
echo "built after $(elapsed)"
torch_figures=
if [ -n "$anchor" ] && [ -f "$anchor" ]; then
  PYTHONUNBUFFERED=1 timeout 150 python3 "$anchor" >"$OUT/torch.log" 2>&1
  echo "torch anchor: rc=$? after $(elapsed)"
  torch_figures=$OUT/torch.log
fi
timeout 150 ./build/gpu/tests/gpu/gpu_attention_kernels_test >"$OUT/gpu_test.log" 2>&1
echo "gpu_attention_kernels_test: rc=$? after $(elapsed)"
grep -E "METILE_TEST_SEED|^\[figures\]|Failure|^\[  FAILED|^\[  PASSED|Which is|error" "$OUT/gpu_test.log" | head -60
timeout 170 ./build/gpu/benchmarks/attention/attention_benchmark ${torch_figures:+--torch "$torch_figures"} \
  >"$OUT/benchmark.log" 2>"$OUT/benchmark_progress.log"
echo "attention_benchmark: rc=$? after $(elapsed)"
tail -5 "$OUT/benchmark_progress.log"
cat "$OUT/torch.log" 2>/dev/null
cat "$OUT/benchmark.log"
