#!/usr/bin/env bash
# Where the K2 MoE layer's time goes, and the gates, in one device call (issue 38): builds the
# engine and bench_gpu; the CUDA op tests and compute-sanitizer memcheck of them; `bench_gpu --moe
# T` (each stage of the layer alone in a graph) at 1 and 16 tokens; ncu's duration of each kernel
# of the first layer calls at one token (the router, moe_gate, the routing lists, the grouped
# w4_kernel launches, their split-K sums and the combine, in launch order).
#   bench/gpu_moe_profile.sh [OUT_DIR]   (from engine_src/; env KD_ARCH as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${1:-build/gpu_moe_profile}"
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
t0=$SECONDS
nvidia-smi >"$out/setup.log" 2>&1
bash scripts/build.sh >>"$out/setup.log" 2>&1 &
b1=$!
KD_BENCH_GPU_BUILD_ONLY=1 KD_BENCH_TORCH=0 bash scripts/bench_gpu.sh >>"$out/setup.log" 2>&1 &
b2=$!
wait $b1; r1=$?; wait $b2; r2=$?
echo "build rc=$r1 bench build rc=$r2 ($((SECONDS - t0)) s)"
(( r1 == 0 && r2 == 0 )) || { tail -n 30 "$out/setup.log"; exit 1; }
timeout 120 build/test_ops --backend cuda >"$out/test_ops.log" 2>&1
echo "test_ops cuda rc=$? ok=$(grep -c '^ok' "$out/test_ops.log") $(grep -E '^FAIL|rror' "$out/test_ops.log" | head -n 3 | tr '\n' ' ') ($((SECONDS - t0)) s)"
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 build/test_ops --backend cuda >"$out/memcheck.log" 2>&1
echo "memcheck rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck.log")"
for T in 1 16; do
    timeout 120 build/bench_gpu --moe "$T" >"$out/moe_t$T.log" 2>&1
    echo "bench_gpu --moe $T rc=$? ($((SECONDS - t0)) s)"
    grep -vE '^device' "$out/moe_t$T.log"
done
timeout 150 ncu --clock-control none --csv --print-kernel-base function --metrics gpu__time_duration.sum,dram__bytes_read.sum \
    -k 'regex:w4_kernel|w4_sum_kernel|moe_lists|moe_combine|mm_narrow|moe_gate' --launch-count 40 \
    build/bench_gpu --moe 1 >"$out/ncu_moe_t1.csv" 2>&1
echo "ncu moe t1 rc=$? ($((SECONDS - t0)) s)"
"$PYTHON" - "$out/ncu_moe_t1.csv" <<'PY'
import csv, sys
lines = [ln for ln in open(sys.argv[1], errors="replace") if ln.startswith('"')]
for r in csv.DictReader(lines):
    print(r.get("ID"), r.get("Kernel Name", "")[:40], r.get("Grid Size", ""), r.get("Metric Name"), r.get("Metric Unit"),
          r.get("Metric Value"))
PY
