#!/usr/bin/env bash
# Issue 38's tenth pass in one device call: this tree's matmul_w4a16 against a kept tree's (an
# engine_src folder: main's, say), side by side. Builds this tree's engine, both trees' bench_gpu
# and libkd_w4.so in parallel; the CUDA op tests; ours, the kept kernel, tinygemm and cuBLAS bf16
# interleaved in one process (bench/torch_ref.py --kept: also whether each output equals the kept
# kernel's bit for bit); bench_gpu --quick of each tree (read ceiling, table, K2 MoE layer); with
# KD_ROWS_GATES=1 run_tests.sh and compute-sanitizer memcheck of the op tests; then ncu of each
# tree's w4_kernel on 28672 x 8192 at M = 16 and 32.
#   bench/gpu_rows.sh OUT_DIR KEPT_ENGINE_SRC   (from engine_src/; env KD_ARCH as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
(( $# == 2 )) || { echo "usage: bench/gpu_rows.sh OUT_DIR KEPT_ENGINE_SRC" >&2; exit 2; }
out="$1"
kept="$(cd "$2" && pwd)" || exit 2
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
t0=$SECONDS
nvidia-smi >"$out/setup.log" 2>&1
pids=()
bash scripts/build.sh >>"$out/setup.log" 2>&1 & pids+=($!)
KD_BENCH_GPU_BUILD_ONLY=1 bash scripts/bench_gpu.sh >>"$out/setup.log" 2>&1 & pids+=($!)
(cd "$kept" && KD_BENCH_GPU_BUILD_ONLY=1 KD_RESULTS_DIR=build/ab bash scripts/bench_gpu.sh) >"$out/build_kept.log" 2>&1 & pids+=($!)
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "builds rc=$rc ($((SECONDS - t0)) s)"
(( rc == 0 )) || { tail -n 30 "$out/setup.log" "$out/build_kept.log"; exit 1; }
timeout 120 build/test_ops --backend cuda >"$out/test_ops.log" 2>&1
echo "test_ops cuda rc=$? ok=$(grep -c '^ok' "$out/test_ops.log") $(grep -E '^FAIL|rror' "$out/test_ops.log" | head -n 3 | tr '\n' ' ') ($((SECONDS - t0)) s)"
timeout 300 "$PYTHON" bench/torch_ref.py --json "$out/torch.json" --ours build/libkd_w4.so \
    --kept "$kept/build/ab/libkd_w4.so" --quick >"$out/torch.log" 2>&1
echo "torch_ref rc=$? ($((SECONDS - t0)) s)"
cat "$out/torch.log"
for tree in this kept; do
    bin=build/bench_gpu
    [[ $tree == kept ]] && bin="$kept/build/ab/bench_gpu"
    timeout 200 "$bin" --quick --json "$out/bench_$tree.json" >"$out/bench_$tree.log" 2>&1
    echo "bench_gpu --quick $tree rc=$? ($((SECONDS - t0)) s)"
    grep -E "^read-band|M=1 |M=16 |M=32 |M=64 |T=" "$out/bench_$tree.log" | sed "s/^/$tree: /"
done
if [[ "${KD_ROWS_GATES:-0}" == 1 ]]; then
    timeout 200 bash scripts/run_tests.sh >"$out/run_tests.log" 2>&1
    echo "run_tests rc=$? ($((SECONDS - t0)) s): $(grep -cE '^PASS' "$out/run_tests.log") pass; $(grep -E '^FAIL|TESTS (PASSED|FAILED)' "$out/run_tests.log" | head -n 4 | tr '\n' ';')"
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 build/test_ops --backend cuda >"$out/memcheck.log" 2>&1
    echo "memcheck rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck.log")"
fi
for m in 16 32; do
    for tree in this kept; do
        bin=build/bench_gpu
        [[ $tree == kept ]] && bin="$kept/build/ab/bench_gpu"
        n="ncu_${tree}_m$m"
        timeout 120 ncu --clock-control none -k regex:w4_kernel --launch-skip 3 --launch-count 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum \
            "$bin" --only 28672 8192 "$m" >"$out/$n.txt" 2>&1
        echo "$n rc=$? ($((SECONDS - t0)) s)"
        grep -E "Duration|DRAM Throughput|Compute \(SM\)|hmma|inst_executed|Grid Size|Achieved Occupancy|Registers Per" \
            "$out/$n.txt" | sed "s/^ */  /"
    done
done
