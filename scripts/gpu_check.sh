#!/usr/bin/env bash
# One call on a CUDA machine: build the GPU-facing targets (Release, no Python), run every
# GPU test (ctest label `gpu`), `metile run --backend cuda --check` on the examples, and the
# kernel benchmarks. Full logs under $OUT (default /tmp/metile-gpu-check), a summary last.
set -u
OUT=${OUT:-/tmp/metile-gpu-check}
mkdir -p "$OUT"
export METILE_CACHE_DIR=${METILE_CACHE_DIR:-/tmp/metile-cache}
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start))s"; }
summary=()
step() {  # step NAME TIMEOUT COMMAND...: runs, logs to $OUT/NAME.log, records rc
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-22s rc=%-3s at %s' "$name" "$rc" "$(elapsed)")")
  return $rc
}
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETILE_BUILD_PYTHON=OFF >"$OUT/configure.log" 2>&1 ||
  { tail -20 "$OUT/configure.log"; exit 1; }
gpu_targets=$(for source in tests/gpu/*_test.cpp; do echo "gpu_$(basename "$source" .cpp)"; done)
step build 300 cmake --build build/gpu --target metile kernels_benchmark mlp_decode_benchmark $gpu_targets -j"$(nproc)" ||
  { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
step gpu_tests 300 ctest --test-dir build/gpu -L gpu -j1 --output-on-failure --timeout 250
grep -E "tests passed|FAILED|Failed|\*\*\*" "$OUT/gpu_tests.log" | head -20
for example in add_rms_norm decoder_layer; do
  step "run_$example" 120 build/gpu/tools/metile/metile run examples/$example.json --backend cuda --check
  grep -E "^region|^check|error" "$OUT/run_$example.log" | head -12
done
step kernels_benchmark 120 build/gpu/benchmarks/kernels/kernels_benchmark
tail -25 "$OUT/kernels_benchmark.log"
step mlp_decode_quick 150 build/gpu/benchmarks/mlp_decode/mlp_decode_benchmark --quick
sed -n '/^per stage/,$p' "$OUT/mlp_decode_quick.log" | tail -30
printf '%s\n' "${summary[@]}"
