#!/usr/bin/env bash
# Issue 38's tenth pass in one device call: engine trees' matmul_w4a16 (this one, named "this",
# and variants NAME=FOLDER, each an engine_src folder) against a kept tree's (main's, say), side
# by side. Builds each tree's engine, bench_gpu and libkd_w4.so in parallel; per tree: the CUDA
# op tests, then ours, the kept kernel, tinygemm and cuBLAS bf16 interleaved in one process
# (bench/torch_ref.py --kept: also whether each output equals the kept kernel's bit for bit);
# bench_gpu --quick (read ceiling, table, K2 MoE layer) of the trees named in KD_ROWS_QUICK
# (default: kept this); with KD_ROWS_GATES=1 compute-sanitizer memcheck of each tree's op tests
# and each tree's run_tests.sh (in parallel), with KD_ROWS_GATES=memcheck the memcheck alone; ncu
# of each tree's w4_kernel on 28672 x 8192 at the token counts in KD_ROWS_NCU_M (default: 16 32;
# the kept tree's 32 rows are two 16-row launches: its first is profiled).
#   bench/gpu_rows.sh OUT_DIR KEPT_ENGINE_SRC [NAME=ENGINE_SRC ...]   (from engine_src/; env KD_ARCH as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
(( $# >= 2 )) || { echo "usage: bench/gpu_rows.sh OUT_DIR KEPT_ENGINE_SRC [NAME=ENGINE_SRC ...]" >&2; exit 2; }
out="$1"
kept="$(cd "$2" && pwd)" || exit 2
shift 2
names=(this); trees=("$PWD")
for a in "$@"; do
    names+=("${a%%=*}"); trees+=("$(cd "${a#*=}" && pwd)") || exit 2
done
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
t0=$SECONDS
nvidia-smi >"$out/setup.log" 2>&1
# The shim as this tree's bench_gpu.sh builds it (no unique symbols: two of them share one
# process), into build/ab/libkd_w4_rows.so of every tree, the kept one included.
cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')"
cc="${KD_ARCH:-sm_$cc}"; cc="${cc#sm_}"
shim() {
    mkdir -p "$1/build/ab"
    "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" -O3 -std=c++17 -gencode "arch=compute_$cc,code=sm_$cc" -I"$1/src" \
        -Xcompiler -fPIC,-fno-gnu-unique -shared "$1/bench/w4_shim.cu" "$1/src/cuda/matmul_w4a16.cu" \
        -o "$1/build/ab/libkd_w4_rows.so"
}
pids=()
for i in "${!trees[@]}"; do
    (cd "${trees[$i]}" && bash scripts/build.sh) >"$out/build_${names[$i]}.log" 2>&1 & pids+=($!)
done
for t in "$kept" "${trees[@]}"; do
    (cd "$t" && KD_BENCH_GPU_BUILD_ONLY=1 KD_RESULTS_DIR=build/ab bash scripts/bench_gpu.sh && shim "$t") \
        >>"$out/build_bench.log" 2>&1 & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "builds rc=$rc ($((SECONDS - t0)) s)"
(( rc == 0 )) || { tail -n 20 "$out"/build_*.log; exit 1; }
for i in "${!trees[@]}"; do
    n="${names[$i]}"
    timeout 120 "${trees[$i]}/build/test_ops" --backend cuda >"$out/test_ops_$n.log" 2>&1
    echo "test_ops $n rc=$? ok=$(grep -c '^ok' "$out/test_ops_$n.log") $(grep -E '^FAIL|rror' "$out/test_ops_$n.log" | head -n 3 | tr '\n' ' ') ($((SECONDS - t0)) s)"
done
for i in "${!trees[@]}"; do
    n="${names[$i]}"
    timeout 200 "$PYTHON" bench/torch_ref.py --json "$out/torch_$n.json" --ours "${trees[$i]}/build/ab/libkd_w4_rows.so" \
        --kept "$kept/build/ab/libkd_w4_rows.so" --quick >"$out/torch_$n.log" 2>&1
    echo "torch_ref $n rc=$? ($((SECONDS - t0)) s)"
    sed "s/^/$n: /" "$out/torch_$n.log"
done
for i in -1 "${!trees[@]}"; do
    n=kept bin="$kept/build/ab/bench_gpu"
    (( i >= 0 )) && n="${names[$i]}" bin="${trees[$i]}/build/ab/bench_gpu"
    [[ " ${KD_ROWS_QUICK-kept this} " == *" $n "* ]] || continue
    timeout 200 "$bin" --quick --json "$out/bench_$n.json" >"$out/bench_$n.log" 2>&1
    echo "bench_gpu --quick $n rc=$? ($((SECONDS - t0)) s)"
    grep -E "^read-band|M=1 |M=16 |T=" "$out/bench_$n.log" | sed "s/^/$n: /"
done
if [[ "${KD_ROWS_GATES:-0}" == 1 || "${KD_ROWS_GATES:-0}" == memcheck ]]; then
    for i in "${!trees[@]}"; do
        n="${names[$i]}"
        timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "${trees[$i]}/build/test_ops" --backend cuda \
            >"$out/memcheck_$n.log" 2>&1
        echo "memcheck $n rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck_$n.log")"
    done
fi
if [[ "${KD_ROWS_GATES:-0}" == 1 ]]; then
    pids=()
    for i in "${!trees[@]}"; do
        (cd "${trees[$i]}" && timeout 300 bash scripts/run_tests.sh) >"$out/run_tests_${names[$i]}.log" 2>&1 & pids+=($!)
    done
    for i in "${!trees[@]}"; do
        wait "${pids[$i]}"
        r=$?
        l="$out/run_tests_${names[$i]}.log"
        echo "run_tests ${names[$i]} rc=$r ($((SECONDS - t0)) s): $(grep -cE '^PASS' "$l") pass; $(grep -E '^FAIL|TESTS (PASSED|FAILED)' "$l" | head -n 4 | tr '\n' ';')"
    done
fi
for m in ${KD_ROWS_NCU_M-16 32}; do
    for i in -1 "${!trees[@]}"; do
        n=kept bin="$kept/build/ab/bench_gpu"
        (( i >= 0 )) && n="${names[$i]}" bin="${trees[$i]}/build/ab/bench_gpu"
        timeout 120 ncu --clock-control none -k regex:w4_kernel --launch-skip 3 --launch-count 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum \
            "$bin" --only 28672 8192 "$m" >"$out/ncu_${n}_m$m.txt" 2>&1
        echo "ncu $n M=$m rc=$? ($((SECONDS - t0)) s): $(grep -E "Duration|inst_executed|Registers Per|Achieved Occupancy|DRAM Throughput" \
            "$out/ncu_${n}_m$m.txt" | awk '{print $1, $NF}' | tr '\n' ' ')"
    done
done
