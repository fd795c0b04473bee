#!/usr/bin/env bash
# Nsight Compute on the decode MLP's 4-bit g64 stage kernels (Llama-3-8B) at M = 1 and M = 16, side by
# side: time, DRAM throughput, achieved occupancy, issue activity, the L2 side (throughput, the bytes
# L1 read from L2 per DRAM byte, L1's hit rate: what re-reading x costs at M = 16) and the leading warp
# stall reasons (per issued instruction) of each kernel that `mlp_decode_benchmark --profile` launches (the first
# three register shapes of each stage and the first of each other kind). On a CUDA machine with ncu,
# from the repository root, after building mlp_decode_benchmark in build/gpu:
#   benchmarks/mlp_decode/ncu_stage_kernels.sh [OUT_DIR]
set -u
out=${1:-/tmp/ncu_stage_kernels}
mkdir -p "$out"
stalls="long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle barrier not_selected no_instruction dispatch_stall tex_throttle drain membar"
metrics="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active"
metrics+=",smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers"
metrics+=",lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum"
metrics+=",l1tex__t_sector_hit_rate.pct"
for s in $stalls; do metrics+=",smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"; done
for rows in 1 16; do
  ncu --clock-control none --print-units base --metrics "$metrics" --csv --page raw -k regex:metile_gemv \
    build/gpu/benchmarks/mlp_decode/mlp_decode_benchmark --profile-rows "$rows" >"$out/rows$rows.csv" 2>"$out/rows$rows.log" ||
    { echo "ncu failed at M = $rows:"; tail -5 "$out/rows$rows.log"; }
done
python3 - "$out" <<'PY'
import csv, io, sys
out = sys.argv[1]
def num(text): return float((text or "0").replace(",", ""))  # ncu writes 23,008
for rows in (1, 16):
    text = open(f"{out}/rows{rows}.csv").read()
    lines = [l for l in text.splitlines() if l.startswith('"')]
    if not lines: print(f"M = {rows}: no rows"); continue
    table = list(csv.DictReader(io.StringIO("\n".join(lines))))
    data = [r for r in table[1:] if r.get("Kernel Name")]  # the second row holds the units
    print(f"M = {rows}: kernel | us | DRAM % | occupancy % | issue % | regs | L2 % | L2 reads / DRAM bytes | L1 hit % |"
          " stalls per issue (largest four)")
    for r in data:
        stall = {k.split("stalled_")[1].split("_per_issue")[0]: num(v) for k, v in r.items() if "issue_stalled" in k}
        top = sorted(stall.items(), key=lambda kv: -kv[1])[:4]
        name = r["Kernel Name"].replace("metile_gemv_", "")[:80]
        print(f"  {name:<80} {num(r['gpu__time_duration.sum'])/1e3:7.1f} {num(r['dram__throughput.avg.pct_of_peak_sustained_elapsed']):6.1f}"
              f" {num(r['sm__warps_active.avg.pct_of_peak_sustained_active']):6.1f} {num(r['smsp__issue_active.avg.pct_of_peak_sustained_active']):6.1f}"
              f" {r['launch__registers_per_thread']:>4} {num(r['lts__throughput.avg.pct_of_peak_sustained_elapsed']):5.1f}"
              f" {32 * num(r['lts__t_sectors_srcunit_tex_op_read.sum']) / max(num(r['dram__bytes_read.sum']), 1):5.2f}"
              f" {num(r['l1tex__t_sector_hit_rate.pct']):5.1f}  " + " ".join(f"{k} {v:.2f}" for k, v in top))
PY
