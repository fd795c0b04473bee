#!/usr/bin/env bash
# A/B on the device machine in one call, run from the repository root: this tree (A) against a variant (B) made of this tree with
# some files replaced, both built the same way (Release, no Python), the same command run on each,
# alternating A B A B ..., logs under $OUT/ab/. The variant's files travel with the tree (carry an
# ignored folder, e.g. .gpu_lead): VARIANT_DIR holds them at their repository paths.
#   scripts/gpu_ab.sh VARIANT_DIR TARGETS ROUNDS COMMAND
#     TARGETS: the CMake targets to build (comma-separated), ROUNDS: how many times each runs,
#     COMMAND: run by bash in the tree's root with $BUILD set to its build folder, e.g.
#   scripts/gpu_ab.sh .gpu_lead/old_loop metile 1 \
#     '$BUILD/tools/metile/metile bench-model --preset llama3-8b --engines fused --decode-steps 32 --prefill-tokens 128'
# A variant's tree is /tmp/metile-ab-variant; each side has its own METILE_CACHE_DIR (default base
# /tmp/metile-cache, then /A and /B: decisions raced by one side are not reused by the other); AB_TIMEOUT (s, default 560) bounds the whole call, each run gets
# an equal share of what the builds leave; the summary prints each run's rc and the lines AB_GREP matches
# (default: the decode and whole-MLP figures).
set -u
if [ $# -ne 4 ] || [ ! -d "$1" ]; then
  echo "usage: scripts/gpu_ab.sh VARIANT_DIR TARGETS ROUNDS COMMAND (VARIANT_DIR: files at their repository paths)" >&2
  exit 2
fi
variant_files=${1%/} targets=${2//,/ } rounds=$3 command=$4
variant_files=${variant_files#./}
# Decimal digits without a leading 0 (the shell's arithmetic reads 010 as octal 8 and 08 as an error; 00 is 0).
case $rounds in '' | *[!0-9]* | 0*) echo "gpu_ab.sh: ROUNDS must be a whole number >= 1, not '$rounds'" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/metile-ab}/ab
mkdir -p "$OUT"
cache=${METILE_CACHE_DIR:-/tmp/metile-cache}  # one kernel and decision cache a side: B's races are its own
start=$(date +%s)
left() { echo $((${AB_TIMEOUT:-560} - ($(date +%s) - start))); }
variant=/tmp/metile-ab-variant
rm -rf "$variant" && mkdir -p "$variant"
tar --exclude=./build --exclude=./.git --exclude="./$variant_files" -cf - . | tar -C "$variant" -xf -
cp -r "$variant_files"/. "$variant"/
echo "variant B: $(cd "$variant_files" && find . -type f | sed 's|^\./||' | tr '\n' ' ')"
for tree in . "$variant"; do
  cmake -S "$tree" -B "$tree/build/gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETILE_BUILD_PYTHON=OFF >"$OUT/configure.log" 2>&1 ||
    { echo "configure of $tree failed:"; tail -20 "$OUT/configure.log"; exit 1; }
  cmake --build "$tree/build/gpu" --target $targets -j"$(nproc)" >"$OUT/build.log" 2>&1 ||
    { echo "build of $tree failed:"; grep -E "error" -A3 "$OUT/build.log" | head -30; exit 1; }
done
echo "built A and B after $(($(date +%s) - start)) s"
share=$(($(left) / (2 * rounds)))
if [ "$share" -lt 10 ]; then
  echo "gpu_ab.sh: $(left) s left after the builds, under 10 s a run: nothing run (raise AB_TIMEOUT or lower ROUNDS)"
  exit 1
fi
summary=()
for round in $(seq 1 "$rounds"); do
  for side in A B; do
    tree=.; [ $side = B ] && tree=$variant
    log="$OUT/$side$round.log"
    (cd "$tree" && BUILD=build/gpu METILE_CACHE_DIR="$cache/$side" timeout "$share" bash -c "$command") >"$log" 2>&1
    summary+=("$side round $round: rc=$? $(grep -E "${AB_GREP:-decode ms/token \(graph|^whole MLP|% of the weight}" "$log" | tr -s ' ' | head -4 | tr '\n' ';')")
  done
done
printf '%s\n' "${summary[@]}"
