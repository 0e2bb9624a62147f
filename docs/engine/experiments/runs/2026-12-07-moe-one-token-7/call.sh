#!/usr/bin/env bash
# One device call of issue 38's seventh MoE pass, from the checkout's root (this tree: the L2
# prefetch landed and bench_gpu's timed warm-up); the tree before both (main 01a2402) unpacked at
# /tmp/kept:
#  1. three builds of bench_gpu and libkd_w4.so: "kept" (the kept tree as it is), "kept_fix" (the
#     kept kernels with this tree's bench_gpu.cu: the warm-up fix alone) and "this";
#  2. the full `bench_gpu --quick` of the three in turn, ROUNDS rounds (the T=1 headline before and
#     after the fix, and with the prefetch);
#  3. bench/torch_ref.py --kept: this tree's plain matmul against the kept one's, interleaved, with
#     tinygemm and cuBLAS bf16, bits compared;
#  4. docs/gpu-reference/reproduce.sh OUT/rec wide: the validate record of this tree, in the time
#     left (KD_CALL_S seconds from the start, default 585), unless KD_VALIDATE=0.
# Lands in $OUT/call.tgz, $OUT/driver.log, $OUT/rec/ and $OUT/reproduce.log.
#   bash call.sh ROUNDS
set -uo pipefail
root="$PWD"
res=/tmp/res
mkdir -p "$res"
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
py="${KD_TORCH_PYTHON:-/opt/torch/.venv/bin/python3}"
t0=$SECONDS
pack() { tar czf "$OUT/call.tgz" -C "$res" . ; cp "$res/driver.log" "$OUT/driver.log" 2>/dev/null; }
{
    echo "device: $(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader)"
    cp -r /tmp/kept /tmp/kept_fix && cp "$root/engine_src/bench/bench_gpu.cu" /tmp/kept_fix/engine_src/bench/bench_gpu.cu
    declare -A tree=([kept]=/tmp/kept/engine_src [kept_fix]=/tmp/kept_fix/engine_src [this]="$root/engine_src")
    for n in kept kept_fix this; do
        (cd "${tree[$n]}" && KD_BENCH_GPU_BUILD_ONLY=1 KD_RESULTS_DIR=build/p7 bash scripts/bench_gpu.sh) >"$res/build_$n.log" 2>&1 &
    done
    wait
    echo "builds done ($((SECONDS - t0)) s)"
    for r in $(seq 1 "$1"); do
        for n in kept kept_fix this; do
            timeout 120 "${tree[$n]}/build/p7/bench_gpu" --json "$res/full_${n}_$r.json" --quick >"$res/full_${n}_$r.log" 2>&1
            echo "full $n $r rc=$? (at $((SECONDS - t0)) s)"
            grep -E '^  T=(1|16) ' "$res/full_${n}_$r.log" | cut -c1-200
        done
    done
    (cd "$root/engine_src" && timeout 150 "$py" bench/torch_ref.py --json "$res/torch_kept.json" --quick \
        --ours build/p7/libkd_w4.so --kept /tmp/kept/engine_src/build/p7/libkd_w4.so) >"$res/torch_kept.log" 2>&1
    echo "torch_ref --kept rc=$? ($((SECONDS - t0)) s)"
    cut -c1-220 "$res/torch_kept.log"
    pack
    [[ "${KD_VALIDATE:-1}" == 0 ]] && exit 0
    left=$(( ${KD_CALL_S:-585} - SECONDS + t0 ))
    echo "validate wide with $left s left"
    timeout "$left" bash docs/gpu-reference/reproduce.sh "$OUT/rec" wide >"$OUT/reproduce.log" 2>&1
    echo "reproduce rc=$? ($((SECONDS - t0)) s)"
    tail -n 40 "$OUT/reproduce.log" | cut -c1-250
} 2>&1 | tee "$res/driver.log"
pack
