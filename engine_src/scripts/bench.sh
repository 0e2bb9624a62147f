#!/usr/bin/env bash
# Benchmarks the engine and writes $KD_RESULTS_DIR/bench.json (default build/; README, "Result
# files"): tokens/s AR vs DDTree per bundle and budget, mean acceptance length, per-layer timings
# (FP32 vs INT4 MoE), and a K2-width MoE layer (h 7168, moe_inter 2048, top-8 + 1 shared) in FP32
# and INT4. Builds and regenerates bundles when missing, unless KD_NO_BUILD is set.
#   KD_BENCH_ARGS: extra flags for `kdtree bench` (e.g. "--moe-experts 384 --moe-tokens 1,4,16").
#   KD_MAX_MEMORY (bytes, default the engine's 4 GiB): --max-memory, what one bundle may ask for.
# Reports each phase it starts (python/kdtree_ref/progress.py).
set -euo pipefail
engine="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$engine"
refs="${KD_BUNDLE_DIR:-tests/refs}"   # where scripts/bundles.sh writes the bundles
results="${KD_RESULTS_DIR:-build}"
if [[ -n "${KD_NO_BUILD:-}" ]]; then
    for f in build/kdtree "$refs/manifest.json"; do
        [[ -e "$f" ]] || { echo "bench.sh: $f is missing and KD_NO_BUILD is set (build and regenerate first)" >&2; exit 2; }
    done
fi
[[ -x build/kdtree ]] || bash scripts/build.sh
[[ -f "$refs/manifest.json" ]] || bash scripts/bundles.sh
mkdir -p "$results"
# With the CUDA backend, the GPU kernel benchmarks (ceiling, w4a16 vs cuBLAS, K2 MoE layer, and
# PyTorch's kernels on the same shapes when its Python has torch) join the report;
# KD_BENCH_GPU_ARGS defaults to --quick (fewer repeats and token counts).
cuda=false
grep -q '"backend": "cuda"' build/build_info.json 2>/dev/null && cuda=true
phases=$($cuda && echo 2 || echo 1)
progress() {  # progress DONE WHAT: a progress report (its shape: python/kdtree_ref/progress.py)
    echo "::kdtree-progress done=$1 total=$phases unit=phases what=$2"
}
progress 0 "kdtree bench: every bundle, the layers, the K2-width MoE layer"
# shellcheck disable=SC2086  # KD_BENCH_ARGS is a list of flags
build/kdtree bench --manifest "$refs/manifest.json" --out "$results/bench.json" \
    ${KD_MAX_MEMORY:+--max-memory "$KD_MAX_MEMORY"} ${KD_BENCH_ARGS:-}
if $cuda; then
    progress 1 "GPU kernel benchmarks (bench_gpu.sh)"
    KD_BENCH_GPU_ARGS="${KD_BENCH_GPU_ARGS:---quick}" bash scripts/bench_gpu.sh
    torch_ref=()
    [[ -f "$results/bench_torch.json" ]] && torch_ref=("$results/bench_torch.json")
    "${PYTHON:-python3}" scripts/merge_gpu_bench.py "$results/bench.json" "$results/bench_gpu.json" ${torch_ref[@]+"${torch_ref[@]}"}
fi
# The big configs' decode figures (k2wide: bytes a decode step reads, share of the read ceiling)
"${PYTHON:-python3}" scripts/big_bundle_metrics.py "$results/bench.json" "$refs/manifest.json"
