#!/usr/bin/env bash
# One device call of issue 38's sixth MoE pass (from the checkout's root; this tree unpacked at
# /tmp/this, the same tree with bench/experiments/moe_shared_l2_prefetch.patch applied at /tmp/pf):
#  1. the probe: bench_gpu (this tree's) in turn --quick --moe-only and the full --quick table,
#     each plain and with --moe-probe (the MoE layer timed in more ways at 1 and 4 tokens, the
#     probe lines), PROBE_ROUNDS rounds; in the first round also the full table with one GEMM
#     shape (KD_BENCH_GEMM_SHAPES), plain;
#  2. the A/B of the prefetch patch (/tmp/pf) against the checkout's engine_src (main) with
#     bench/gpu_moe_ab.sh and its gates (KD_AB_ROUNDS rounds; KD_AB=0: none).
# Everything lands in $OUT/call.tgz and $OUT/driver.log.
#   bash call.sh PROBE_ROUNDS
set -uo pipefail
root="$PWD"
res=/tmp/res
mkdir -p "$res/probe"
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
t0=$SECONDS
pack() { tar czf "$OUT/call.tgz" -C "$res" . ; cp "$res/driver.log" "$OUT/driver.log" 2>/dev/null; }
trap pack EXIT
{
    echo "device: $(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader)"
    echo "kept: $root/engine_src ($(git -C "$root" log -1 --format=%h 2>/dev/null))"
    nvidia-smi >"$res/probe/nvidia-smi.txt" 2>&1
    (cd /tmp/this/engine_src && KD_BENCH_GPU_BUILD_ONLY=1 KD_BENCH_TORCH=0 KD_RESULTS_DIR=build/probe \
        bash scripts/bench_gpu.sh) >"$res/probe/build.log" 2>&1
    echo "probe build rc=$? ($((SECONDS - t0)) s)"
    b=/tmp/this/engine_src/build/probe/bench_gpu
    run() {  # run NAME [ENV=VALUE ...] -- ARGS
        local name="$1"; shift
        local envs=()
        while [[ "$1" != -- ]]; do envs+=("$1"); shift; done
        shift
        local s=$SECONDS
        env ${envs[@]+"${envs[@]}"} timeout 120 "$b" --json "$res/probe/$name.json" "$@" >"$res/probe/$name.log" 2>&1
        echo "$name rc=$? ($((SECONDS - s)) s, at $((SECONDS - t0)) s)"
        grep -E '^  T=1 |probe T=1 ' "$res/probe/$name.log" | cut -c1-330
    }
    for r in $(seq 1 "$1"); do
        run "moeonly_$r" -- --quick --moe-only
        run "full_$r" -- --quick
        run "moeonly_probe_$r" -- --quick --moe-only --moe-probe
        run "full_probe_$r" -- --quick --moe-probe
        (( r <= 1 )) || continue
        run "full_w28672_$r" KD_BENCH_GEMM_SHAPES=28672x8192 -- --quick
        run "full_w2048_$r" KD_BENCH_GEMM_SHAPES=2048x7168 -- --quick
    done
    pack
    if [[ "${KD_AB:-1}" == 1 ]]; then
        (cd /tmp/pf/engine_src && KD_MOE_AB_ROUNDS="${KD_AB_ROUNDS:-9}" KD_MOE_AB_GATES=this KD_MOE_AB_TESTS_S=200 \
            timeout "${KD_AB_S:-300}" bash bench/gpu_moe_ab.sh "$res/ab" "$root/engine_src")
        echo "A/B rc=$? ($((SECONDS - t0)) s)"
    fi
} 2>&1 | tee "$res/driver.log"
