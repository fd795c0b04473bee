#!/usr/bin/env bash
# Nsight Compute on the kernels `mlp_decode_benchmark --quick` launches whose names match KERNELS (an
# ncu -k filter; default: the stage-blocks persistent MLP of Llama-3-8B 4-bit g64, M = 1), the first
# COUNT launches (default 3: the gate runs of its candidates), each alone: time, DRAM throughput, warps
# active, issue activity, registers, DRAM bytes, warp instructions and the six leading stall reasons
# (per issued instruction). Session 31 compared it with the stage winners this way (notes/mlp_decode.md):
#   KERNELS='regex:metile_gemv_bf16_a4g64_m1_n14336_k4096_p2r_w4t1f2_e' COUNT=2 benchmarks/mlp_decode/ncu_persistent_mlp.sh
# On a CUDA machine with ncu, from the repository root, after building mlp_decode_benchmark in build/gpu;
# the CSV and ncu's log go to $OUT (default /tmp/ncu_persistent_mlp).
set -u
OUT=${OUT:-/tmp/ncu_persistent_mlp}
mkdir -p "$OUT"
stalls="long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle barrier not_selected no_instruction dispatch_stall drain membar sleeping branch_resolving"
metrics="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active"
metrics+=",smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,dram__bytes_read.sum,smsp__inst_executed.sum,sm__cycles_active.avg"
for s in $stalls; do metrics+=",smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"; done
kernels=${KERNELS:-'regex:metile_persistent_mlp_blocks_bf16_a4g64_m1_h4096'}
timeout 280 ncu --clock-control none --print-units base --metrics "$metrics" --csv --page raw --kill yes --launch-count ${COUNT:-3} \
  -k "$kernels" build/gpu/benchmarks/mlp_decode/mlp_decode_benchmark --quick >"$OUT/ncu.csv" 2>"$OUT/ncu.log"
echo ncu rc=$?
python3 - "$OUT/ncu.csv" <<'PY'
import csv, io, sys
def num(t): 
    try: return float((t or "0").replace(",", ""))
    except: return 0.0
text=open(sys.argv[1]).read()
lines=[l for l in text.splitlines() if l.startswith('"')]
t=list(csv.DictReader(io.StringIO("\n".join(lines))))
for r in t[1:]:
    if not r.get("Kernel Name"): continue
    st={k.split("stalled_")[1].split("_per_issue")[0]: num(v) for k,v in r.items() if "issue_stalled" in k}
    top=sorted(st.items(), key=lambda kv:-kv[1])[:6]
    print(r["Kernel Name"][:70], "us %.1f dram%% %.0f warps%% %.0f issue%% %.0f regs %s MB %.1f inst %.2fM cyc %.0f" % (num(r['gpu__time_duration.sum'])/1e3, num(r['dram__throughput.avg.pct_of_peak_sustained_elapsed']), num(r['sm__warps_active.avg.pct_of_peak_sustained_active']), num(r['smsp__issue_active.avg.pct_of_peak_sustained_active']), r['launch__registers_per_thread'], num(r['dram__bytes_read.sum'])/1e6, num(r['smsp__inst_executed.sum'])/1e6, num(r['sm__cycles_active.avg'])))
    print("   ", " ".join("%s=%.2f"%kv for kv in top))
PY
