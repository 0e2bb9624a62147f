#!/usr/bin/env bash
# The device call of issue 38 after the block-tail record, from the checkout's root on the GPU host:
#   bash next_call.sh probe    # ~200 s (each ncu at most 75 s): ncu metrics of the K2 MoE layer's kernels at one token,
#                              #   of the 28672 x 8192 matmul at M = 1 and of the expert's shapes at M = 8 and 16
#                              #   (main's tree, no change)
# Where targets 3, 1 and 2's remaining time sits: per kernel its duration, DRAM bytes and
# throughput, achieved occupancy, registers, grid, and the spread of its SMs' active cycles (min,
# mean, max: a launch whose SMs finish unevenly, a partial wave, shows max well over mean).
# Lands in $OUT/probe/ (ncu CSVs and their tables) and $OUT/driver.log.
set -uo pipefail
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export PYTHON="${KD_TORCH_PYTHON:-/opt/torch/.venv/bin/python3}"
case "${1:?usage: next_call.sh probe}" in
probe)
    out="$OUT/probe" && mkdir -p "$out" || exit 2
    cd engine_src || exit 2
    (KD_BENCH_GPU_BUILD_ONLY=1 KD_BENCH_TORCH=0 KD_RESULTS_DIR=build/ab bash scripts/bench_gpu.sh) >"$out/build.log" 2>&1 \
        || { tail -n 30 "$out/build.log"; exit 1; }
    metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size
    metrics+=,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem
    metrics+=,sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max
    probe() {  # NAME ARGS...: ncu of bench_gpu ARGS, then one line per kernel
        local name="$1"; shift
        timeout 75 ncu --clock-control none --csv --print-kernel-base function --metrics "$metrics" \
            -k 'regex:w4_kernel|w4_sum_kernel|moe_lists|moe_combine|mm_narrow|moe_gate' --launch-count 40 \
            build/ab/bench_gpu "$@" >"$out/ncu_$name.csv" 2>&1
        echo "ncu $name rc=$?"
        "$PYTHON" - "$out/ncu_$name.csv" "$name" <<'PY' | tee "$out/ncu_$name.txt"
import csv, sys
from collections import defaultdict
lines = [ln for ln in open(sys.argv[1], errors="replace") if ln.startswith('"')]
kernels = defaultdict(dict)
for r in csv.DictReader(lines):
    k = kernels[(int(r["ID"]), r.get("Kernel Name", "")[:28], r.get("Grid Size", ""))]
    k[r["Metric Name"]] = r["Metric Value"].replace(",", "")
for (i, name, grid), m in sorted(kernels.items()):
    g = lambda key: float(m.get(key, "nan"))
    print(f"{sys.argv[2]}: {i:2d} {name:28s} grid {grid:14s} {g('gpu__time_duration.sum') / 1e3:7.2f} us"
          f" {g('dram__bytes_read.sum') / 1e6:7.2f} MB dram {g('dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} %"
          f" warps {g('sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f} % regs {m.get('launch__registers_per_thread')}"
          f" blocks/SM reg {m.get('launch__occupancy_limit_registers')} smem {m.get('launch__occupancy_limit_shared_mem')}"
          f" SM cycles min/avg/max {g('sm__cycles_active.min'):.0f}/{g('sm__cycles_active.avg'):.0f}/{g('sm__cycles_active.max'):.0f}")
PY
    }
    probe moe1 --moe 1 2>&1 | tee -a "$OUT/driver.log"
    probe mm1 --only 28672 8192 1 2>&1 | tee -a "$OUT/driver.log"
    probe e8 --only 2048 7168 8 2>&1 | tee -a "$OUT/driver.log"
    probe e16 --only 7168 2048 16 2>&1 | tee -a "$OUT/driver.log" ;;
esac
