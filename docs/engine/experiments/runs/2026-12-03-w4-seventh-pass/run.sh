#!/bin/bash
# Issue 21, seventh pass: one device call. From the repository root: bash .xfer/i21h/run.sh
# this = three register buffers at M = 1 (branch i21h), base = main eb3c57d, regs = this without
# the third buffer (the two-buffer loop with this tree's register savings).
X="$(pwd)/.xfer/i21h"
O="${OUT:?}"
cd "$X/this/engine_src" || exit 1
t0=$SECONDS
KD_AB_REPS=3 KD_AB_QUICK="this base regs" KD_AB_NCU=1 KD_AB_NCU_NAMES="this base" timeout 190 \
    bash bench/gpu_ab.sh "$O/ab" this=. base="$X/base/engine_src" regs="$X/regs/engine_src" > "$O/ab.log" 2>&1
echo "gpu_ab rc=$? ($((SECONDS - t0)) s)" >> "$O/ab.log"
timeout 40 compute-sanitizer --tool memcheck --error-exitcode 9 build/test_ops --backend cuda > "$O/memcheck.log" 2>&1
echo "memcheck rc=$? ($((SECONDS - t0)) s): $(grep 'ERROR SUMMARY' "$O/memcheck.log")" >> "$O/ab.log"
left=$((262 - (SECONDS - t0)))
if (( left > 30 )); then
    KD_TEST_BACKENDS=cuda timeout "$left" bash scripts/run_tests.sh > "$O/run_tests.log" 2>&1
    echo "run_tests rc=$? ($((SECONDS - t0)) s): $(grep -cE '^PASS' "$O/run_tests.log") pass; $(grep -E '^FAIL|TESTS (PASSED|FAILED)' "$O/run_tests.log" | head -n 8 | tr '\n' ';')" >> "$O/ab.log"
fi
for n in this base; do
    [[ -f "$O/ab/ncu_$n.txt" ]] && grep -E "^ +(Achieved Occupancy|DRAM Throughput|Duration|SM Active Cycles|Stall (Barrier|Long Scoreboard|Short Scoreboard|Wait|Not Selected|No Instruction)|Warp Cycles Per Issued Instruction|Registers Per Thread|Executed Instructions) " "$O/ab/ncu_$n.txt" | sort -u | sed "s/^/ncu $n: /" >> "$O/ab.log"
done
cat "$O/ab.log"
