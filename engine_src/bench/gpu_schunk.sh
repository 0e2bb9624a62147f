#!/usr/bin/env bash
# Issue 38's measurement pass in one device call (108 s on an H100): builds the engine,
# bench_gpu and libkd_w4.so in parallel; the CUDA op tests; ours (the default and with the
# super-chunk forced to 1024, 512 and 256 inputs), tinygemm and cuBLAS bf16 interleaved in one
# process (bench/torch_ref.py --schunk); bench_gpu --quick (ceiling, table, K2 MoE layer with its
# share of the byte limit) with KD_W4_SCHUNK=1024 and with the default
# (the same since the pass kept 1024; in its call 1 the default was 512 for the K2 expert's shapes);
# with KD_SCHUNK_GATES=1 run_tests.sh and compute-sanitizer memcheck of the op tests; then ncu
# of w4_kernel on the K2 expert shape and on 28672 x 8192 at M = 16.
#   bench/gpu_schunk.sh [OUT_DIR]   (from engine_src/; env KD_ARCH as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${1:-build/gpu_schunk}"
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
t0=$SECONDS
nvidia-smi >"$out/setup.log" 2>&1
bash scripts/build.sh >>"$out/setup.log" 2>&1 &
b1=$!
KD_BENCH_GPU_BUILD_ONLY=1 bash scripts/bench_gpu.sh >>"$out/setup.log" 2>&1 &
b2=$!
wait $b1; r1=$?; wait $b2; r2=$?
echo "build rc=$r1 bench build rc=$r2 ($((SECONDS - t0)) s)"
(( r1 == 0 && r2 == 0 )) || { tail -n 30 "$out/setup.log"; exit 1; }
timeout 120 build/test_ops --backend cuda >"$out/test_ops.log" 2>&1
echo "test_ops cuda rc=$? ok=$(grep -c '^ok' "$out/test_ops.log") $(grep -E '^FAIL|rror' "$out/test_ops.log" | head -n 3 | tr '\n' ' ') ($((SECONDS - t0)) s)"
timeout 240 "$PYTHON" bench/torch_ref.py --json "$out/torch.json" --ours build/libkd_w4.so --quick \
    --schunk 1024,512,256 >"$out/torch.log" 2>&1
echo "torch_ref rc=$? ($((SECONDS - t0)) s)"
cat "$out/torch.log"
for sc in 1024 default; do
    v=$sc
    [[ $sc == default ]] && v=0
    KD_W4_SCHUNK=$v timeout 200 build/bench_gpu --quick \
        --json "$out/bench_$sc.json" >"$out/bench_$sc.log" 2>&1
    echo "bench_gpu --quick KD_W4_SCHUNK=$sc rc=$? ($((SECONDS - t0)) s)"
    grep -E "^read-band|M=1 |M=16 |T=" "$out/bench_$sc.log" | sed "s/^/$sc: /"
done
if [[ "${KD_SCHUNK_GATES:-0}" == 1 ]]; then
    timeout 200 bash scripts/run_tests.sh >"$out/run_tests.log" 2>&1
    echo "run_tests rc=$? ($((SECONDS - t0)) s): $(grep -E 'TESTS (PASSED|FAILED)' "$out/run_tests.log" | head -n 2 | tr '\n' ';')"
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 build/test_ops --backend cuda >"$out/memcheck.log" 2>&1
    echo "memcheck rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck.log")"
fi
for shape in "2048 7168 1" "2048 7168 16" "28672 8192 16"; do
    n="ncu_${shape// /_}"
    # shellcheck disable=SC2086  # N K M as three words
    timeout 120 ncu --clock-control none -k regex:w4_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum \
        build/bench_gpu --only $shape >"$out/$n.txt" 2>&1
    echo "$n rc=$? ($((SECONDS - t0)) s)"
    grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|hmma|inst_executed|Grid Size|Achieved Occupancy|Registers Per" \
        "$out/$n.txt" | sed "s/^ */  /"
done
