#!/usr/bin/env bash
# One call on a CUDA machine: build the GPU-facing targets (Release; the Python module where pybind11 is), start the
# transformers oracle of the model module in the background (CPU only: torch + metile on the
# CPU), run every GPU test (ctest label `gpu`), compute-sanitizer memcheck over the GEMV and step
# kernels' suites (scripts/gpu_sanitize.sh quick), the Python suite (CudaModel's tests among it), `metile run --backend cuda --check` on the
# examples, the transformers oracle against the GPU decode engine (--backend cuda), one short
# row of the model benchmark (benchmarks/model/device_run.sh, Llama-3.2-1B's shapes cut to 4 layers;
# BENCH_MODEL_ROWS="..." for others, "" for none), the kernel benchmark (row kernels, one-pass
# vs two-pass softmax) and the decode-MLP goals (mlp_decode_benchmark --quick; MLP_DECODE_TIMEOUT=0
# skips it). The decode-MLP, attention and whole-model benchmarks' other modes have their own device
# scripts (benchmarks/*/device_run.sh).
# Full logs under $OUT (default /tmp/metile-gpu-check), a summary last. Everything fits one call of
# the device tool (TIME_LIMIT seconds, default 570): each step runs for at most what is left, steps run
# in order of importance (build, the GPU tests three at a time, the oracles, then the benchmarks), and a
# step with less than 20 s left is skipped and said so in the summary.
set -u
OUT=${OUT:-/tmp/metile-gpu-check}
mkdir -p "$OUT"
export METILE_CACHE_DIR=${METILE_CACHE_DIR:-/tmp/metile-cache}
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start))s"; }
summary=()
TIME_LIMIT=${TIME_LIMIT:-570}
left() { echo $((TIME_LIMIT - ($(date +%s) - start))); }
step() {  # step NAME TIMEOUT COMMAND...: runs for at most TIMEOUT and what is left, logs to $OUT/NAME.log, records rc
  local name=$1 limit=$2; shift 2
  if [ "$(left)" -lt 20 ]; then
    summary+=("$(printf '%-22s skipped: %s s left' "$name" "$(left)")")
    echo "skipped: $(left) s of TIME_LIMIT left" >"$OUT/$name.log"  # not an earlier run's log
    return 124
  fi
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-22s rc=%-3s at %s' "$name" "$rc" "$(elapsed)")")
  return $rc
}
# The Python module too where the machine's python3 has pybind11 (the device image's venv does): the
# Python CUDA path (load_model(backend="cuda")) runs nowhere else.
python_flags=(-DMETILE_BUILD_PYTHON=OFF)
if pybind11_dir=$(python3 -m pybind11 --cmakedir 2>/dev/null); then
  python_flags=(-DMETILE_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$(command -v python3)" -Dpybind11_DIR="$pybind11_dir")
fi
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release "${python_flags[@]}" >"$OUT/configure.log" 2>&1 ||
  { tail -20 "$OUT/configure.log"; exit 1; }
gpu_targets=$(for source in tests/gpu/*_test.cpp; do echo "gpu_$(basename "$source" .cpp)"; done)
grep -q "_metile" build/gpu/build.ninja && gpu_targets="$gpu_targets _metile"
step build 240 cmake --build build/gpu --target metile kernels_benchmark mlp_decode_benchmark $gpu_targets -j"$(nproc)" ||
  { grep -E "error" -A3 "$OUT/build.log" | head -40; printf '%s\n' "${summary[@]}"; exit 1; }
# The oracle needs no GPU; it runs beside the GPU suites on the machine's CPU cores.
oracle_limit=$(left); [ "$oracle_limit" -lt 20 ] && oracle_limit=20
PYTHONUNBUFFERED=1 timeout "$oracle_limit" python3 tests/gpu/transformers_oracle.py --metile build/gpu/tools/metile/metile \
  >"$OUT/transformers_oracle.log" 2>&1 &
oracle=$!
# Three suites at a time: the label took ~380 s so on the H200 (session 16), one at a time past 600.
step gpu_tests ${GPU_TESTS_TIMEOUT:-420} ctest --test-dir build/gpu -L gpu -E transformers_oracle -j3 \
  --output-on-failure --timeout 250
grep -E "tests passed|FAILED|Failed|\*\*\*|Passed|sec$" "$OUT/gpu_tests.log" | tail -24
# compute-sanitizer's memcheck over the LM-head, projection and step kernels' suites (the quick list of
# scripts/gpu_sanitize.sh; `scripts/gpu_sanitize.sh all` runs every kernel family, a call of its own).
step sanitize 250 env OUT="$OUT/sanitize" TIME_LIMIT="$(left)" scripts/gpu_sanitize.sh quick
cat "$OUT/sanitize.log"
# The whole Python suite, CudaModel against the CPU model among it (tests/python/test_model.py's GPU branches),
# with the machine's compiler and numpy: the device image's g++ links libstdc++ statically, which crashed the module
# in a process that imported numpy first until the module exported its entry point only (session 55).
if [ -d build/gpu/python/metile ]; then
  step python_suite 150 env PYTHONPATH=build/gpu/python PYTHONDONTWRITEBYTECODE=1 METILE_SOURCE_DIR="$PWD" \
    python3 -m pytest -q -p no:cacheprovider tests/python
  tail -6 "$OUT/python_suite.log"
fi
for example in add_rms_norm decoder_layer; do
  step "run_$example" 60 build/gpu/tools/metile/metile run examples/$example.json --backend cuda --check
  grep -E "^region|^check|error" "$OUT/run_$example.log" | head -12
done
wait $oracle
oracle_rc=$?
summary+=("$(printf '%-22s rc=%-3s at %s' transformers_oracle "$oracle_rc" "$(elapsed)")")
tail -25 "$OUT/transformers_oracle.log"
# The GPU decode engine against transformers' float32 logits (after the CPU oracle: one GPU user at a time).
step oracle_cuda ${ORACLE_CUDA_TIMEOUT:-180} python3 tests/gpu/transformers_oracle.py \
  --metile build/gpu/tools/metile/metile --backend cuda
tail -18 "$OUT/oracle_cuda.log"
if [ -n "${BENCH_MODEL_ROWS-llama3.2-1b:4:4}" ]; then
  step bench_model ${BENCH_MODEL_TIMEOUT:-200} env OUT="$OUT/bench_model" METILE=build/gpu/tools/metile/metile \
    benchmarks/model/device_run.sh ${BENCH_MODEL_ROWS-llama3.2-1b:4:4}
  tail -8 "$OUT/bench_model.log"
fi
step kernels_benchmark ${KERNELS_TIMEOUT:-90} build/gpu/benchmarks/kernels/kernels_benchmark
tail -22 "$OUT/kernels_benchmark.log"
if [ "${MLP_DECODE_TIMEOUT:-240}" != 0 ]; then
  step mlp_decode_benchmark ${MLP_DECODE_TIMEOUT:-240} build/gpu/benchmarks/mlp_decode/mlp_decode_benchmark --quick
  sed -n '/^whole MLP/,/^candidates/p' "$OUT/mlp_decode_benchmark.log" | head -50
fi
printf '%s\n' "${summary[@]}"
