#!/usr/bin/env bash
# Builds the libFuzzer harnesses (preset `fuzz`: clang, ASan+UBSan) and runs each
# for a fixed number of executions from its seed corpus in fuzz/corpus/<harness>/
# (README, "Input limits" lists the counts). New inputs go to a scratch folder,
# never into the repository. A finding stops the script with libFuzzer's report;
# turn the crashing input into a regression test.
#   scripts/fuzz.sh            the CI counts
#   scripts/fuzz.sh 20         twenty times the CI counts (a longer local run)
set -euo pipefail
cd "$(dirname "$0")/.."
multiplier=${1:-1}
jobs=$(nproc)

echo "== build (fuzz preset: clang, libFuzzer, ASan+UBSan)"
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j "$jobs"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# harness:executions (CI); max_len bounds one input so every run costs about the same.
for entry in graph_json:8000 planner:2000 dimacs:8000 target:3000 safetensors:4000 model_config:4000 shard_index:3000; do
  harness=${entry%%:*}
  runs=$((${entry##*:} * multiplier))
  mkdir -p "$scratch/$harness"
  start=$(date +%s)
  dictionary=()  # fuzz/<harness>.dict where one exists: the format's keywords
  [ -f "fuzz/$harness.dict" ] && dictionary=(-dict="fuzz/$harness.dict")
  ASAN_OPTIONS=detect_leaks=1 build/fuzz/fuzz/fuzz_$harness -runs="$runs" -max_len=8192 -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 "${dictionary[@]}" "$scratch/$harness" "fuzz/corpus/$harness" \
    >"$scratch/$harness.log" 2>&1 || { cat "$scratch/$harness.log"; echo "fuzz_$harness: FINDING"; exit 1; }
  echo "fuzz_$harness: $runs executions clean in $(($(date +%s) - start)) s" \
       "($(grep -o 'cov: [0-9]*' "$scratch/$harness.log" | tail -1))"
done
