#!/usr/bin/env bash
# The GPU decode engine's benchmark (issue 14 goals): `metile bench-model` on synthetic checkpoints
# of the goal shapes, fused and native, then (with --torch) PyTorch's gpt-fast-style peer on the
# same card; full logs and JSON under $OUT, a short table last. From the repository root on the
# GPU machine (scripts/gpu_check.sh calls it with one short row):
#   benchmarks/model/device_run.sh [--torch PATH/decode_torch.py] [ROW...]
#     ROW = PRESET:FORMAT[:LAYERS], FORMAT bf16 | 4 | 8 (group 64), LAYERS to shorten a model;
#     default rows: the goals' (llama3.2-1b:4 qwen2.5-1.5b:4 llama3-8b:bf16 llama3-8b:4)
# METILE (default build/gpu/tools/metile/metile) is built when missing; ROW_TIMEOUT (s) bounds each row;
# ENGINES (bench-model --engines, default fused,fused-pdl,native) picks the engines measured;
# FLAGS adds bench-model flags to every row (e.g. FLAGS="--weight-prefetch raced --weight-prefetch-mb 16").
set -u
OUT=${OUT:-/tmp/metile-bench-model}
mkdir -p "$OUT"
export METILE_CACHE_DIR=${METILE_CACHE_DIR:-/tmp/metile-cache}
METILE=${METILE:-build/gpu/tools/metile/metile}
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
torch_peer=
if [ "${1:-}" = "--torch" ]; then torch_peer=$2; shift 2; fi
rows=("$@")
[ ${#rows[@]} -eq 0 ] && rows=(llama3.2-1b:4 qwen2.5-1.5b:4 llama3-8b:bf16 llama3-8b:4)
if [ ! -x "$METILE" ]; then
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETILE_BUILD_PYTHON=OFF >"$OUT/configure.log" 2>&1 &&
    cmake --build build/gpu --target metile -j"$(nproc)" >"$OUT/build.log" 2>&1 ||
    { grep -E "error" -A3 "$OUT/build.log" | head -40; exit 1; }
fi
for row in "${rows[@]}"; do
  IFS=: read -r preset format layers <<<"$row"
  name=${preset}-${format}${layers:+-${layers}l}
  arguments=(bench-model --preset "$preset" --format json --engines "${ENGINES:-fused,fused-pdl,native}")
  [ "$format" != bf16 ] && arguments+=(--quantize "$format" --group-size 64)
  [ -n "$layers" ] && arguments+=(--layers "$layers")
  read -r -a extra <<<"${FLAGS:-}"
  arguments+=("${extra[@]}")
  timeout "${ROW_TIMEOUT:-420}" "$METILE" "${arguments[@]}" >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "bench-model $row: rc=$? after $(elapsed)"
done
if [ -n "$torch_peer" ] && [ -f "$torch_peer" ]; then
  PYTHONUNBUFFERED=1 timeout 300 python3 "$torch_peer" --out "$OUT" >"$OUT/decode_torch.log" 2>&1
  echo "PyTorch peer ($torch_peer): rc=$? after $(elapsed)"
  tail -12 "$OUT/decode_torch.log"
fi
python3 - "$OUT" "${rows[@]}" <<'PY'
import json, os, sys
out, rows = sys.argv[1], sys.argv[2:]
print(f"{'model':22} {'format':>14} {'fused ms':>9} {'floor %':>8} {'tok/s':>7} {'+PDL ms':>8} {'native ms':>10} "
      f"{'prefill tok/s':>14} {'native prefill':>15}")
breakdowns = []
for row in rows:
    preset, fmt, *rest = row.split(":")
    name = f"{preset}-{fmt}" + (f"-{rest[0]}l" if rest and rest[0] else "")
    try:
        with open(os.path.join(out, name + ".json")) as file:
            r = json.load(file)
    except (OSError, ValueError):
        print(f"{name:22} {'(no result: see ' + name + '.log)':>40}")
        continue
    nan = {"decode_ms_per_token": float("nan"), "prefill_tokens_per_second": float("nan")}
    f, n = r["fused"], r.get("native", nan)
    pdl = r.get("fused_pdl", nan)["decode_ms_per_token"]
    print(f"{name:22} {r['format']:>14} {f['decode_ms_per_token']:9.3f} {f['floor_percent']:7.1f}% "
          f"{f['tokens_per_second']:7.0f} {pdl:8.3f} {n['decode_ms_per_token']:10.3f} {f['prefill_tokens_per_second']:14.0f} "
          f"{n['prefill_tokens_per_second']:15.0f}")
    breakdowns.append((name, f))
# Where one fused decode step's time goes (units run eagerly with events between them), largest first.
for name, f in breakdowns:
    kinds = sorted(f["breakdown"], key=lambda k: -k["ms"])
    total = sum(k["ms"] for k in kinds)
    print(f"\n{name}: fused step by kind, {total:.3f} ms eager, {f['decode_ms_per_token']:.3f} ms replayed, "
          f"{f['decode_feed_ms_per_token']:.3f} ms a feed (uploads, replay, logits back), "
          f"{f['decode_greedy_stepped_ms_per_token']:.3f} ms a greedy step with a host round trip, "
          f"{f['decode_greedy_ms_per_token']:.3f} ms a greedy step queued (generate: replay and link on the device)")
    for k in kinds[:8]:
        print(f"  {k['kind']:<44} {k['ms']:8.4f} ms {100 * k['ms'] / total:5.1f}% {k['steps']:5d} steps")
PY
