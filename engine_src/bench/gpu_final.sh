#!/usr/bin/env bash
# One device call, under 280 s on the H200: builds the CUDA engine (with ptxas resource usage per
# kernel, build/cuda_resources.json) and build/bench_gpu in parallel, runs the CUDA op tests, the
# full kernel benchmark (build/bench_gpu --json), PyTorch's tinygemm and cuBLAS bf16 on the same
# shapes (bench/torch_ref.py), and folds both into OUT/bench_gpu_metrics.json with
# scripts/merge_gpu_bench.py (the gpu.* and gpu.torch.* metrics as bench.sh would report them).
# Every step has a time limit taken from what is left of KD_FINAL_BUDGET_S (default 270 s); a
# step that fails or runs out of time is said so, and the later steps still run when they can.
# Exit 0 only when the builds, the op tests and the benchmark's validation passed.
#   bench/gpu_final.sh [OUT_DIR]   (default build/gpu_final; env KD_ARCH, CUDA_HOME, PYTHON as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/gpu_final}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
budget="${KD_FINAL_BUDGET_S:-270}"
t0=$SECONDS
bad=0
left() { echo $(( budget - (SECONDS - t0) )); }
step() {  # step NAME LIMIT LOG CMD...: CMD with at most LIMIT s (and never past the budget)
    local name="$1" limit="$2" log="$3" rc=0 s=$SECONDS; shift 3
    (( limit > $(left) )) && limit=$(left)
    if (( limit < 5 )); then echo "$name: not run (time budget spent)" | tee -a "$out/summary.txt"; return 124; fi
    timeout -k 5 "$limit" "$@" >>"$out/$log" 2>&1 || rc=$?
    printf '%-28s rc=%-3d %4d s (limit %d s, %d s in)\n' "$name" "$rc" $((SECONDS - s)) "$limit" $((SECONDS - t0)) |
        tee -a "$out/summary.txt"
    return "$rc"
}

{ nvidia-smi; timeout 60 "$PYTHON" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'; } \
    >"$out/setup.log" 2>&1
step "build.sh + bench_gpu build" 170 build.log bash -c '
    bash scripts/build.sh & b1=$!
    KD_BENCH_GPU_BUILD_ONLY=1 bash scripts/bench_gpu.sh & b2=$!
    wait $b1; r1=$?; wait $b2; r2=$?
    echo "build.sh rc=$r1, bench_gpu build rc=$r2"; (( r1 == 0 && r2 == 0 ))' || bad=1
cp build/build_info.json build/cuda_resources.json "$out/" 2>/dev/null
tail -n 3 "$out/build.log"

if [[ -x build/test_ops ]]; then
    step "test_ops --backend cuda" 60 tests.log build/test_ops --backend cuda || bad=1
    echo "op tests: $(grep -c '^ok' "$out/tests.log") ok; $(grep -E '^FAIL' "$out/tests.log" | head -n 5 | tr '\n' ' ')"
fi
if [[ -x build/bench_gpu ]]; then
    # The torch comparison keeps 50 s of the budget; the benchmark takes what is left before it.
    limit=$(( $(left) - 50 )); (( limit > 150 )) && limit=150
    step "bench_gpu (full)" "$limit" bench_gpu.log build/bench_gpu --json "$out/bench_gpu.json" || bad=1
    grep -E "^device|^read-band|M=1 |M=16 |^ +T=|VALIDATION|validation" "$out/bench_gpu.log" | head -n 30
fi
step "torch_ref.py" 60 torch_ref.log "$PYTHON" bench/torch_ref.py --json "$out/bench_torch.json"
cat "$out/torch_ref.log" 2>/dev/null
if [[ -f "$out/bench_gpu.json" ]]; then
    echo '{"version": 1, "metrics": {}}' >"$out/bench_gpu_metrics.json"
    torch_ref=()
    [[ -f "$out/bench_torch.json" ]] && torch_ref=("$out/bench_torch.json")
    "$PYTHON" scripts/merge_gpu_bench.py "$out/bench_gpu_metrics.json" "$out/bench_gpu.json" \
        ${torch_ref[@]+"${torch_ref[@]}"} >>"$out/summary.txt" 2>&1 || bad=1
    "$PYTHON" - "$out/bench_gpu_metrics.json" <<'EOF' | tee "$out/side_by_side.txt"
import json, sys
m = json.load(open(sys.argv[1]))["metrics"]
def v(name):
    x = m.get(name)
    return f"{x['value']:9.2f}" if x else "        -"
print("N x K         M   ours us  %ceil | tinygemm us  ours x | cuBLAS bf16 us  ours x")
for shape in ("28672x8192", "2048x7168", "7168x2048"):
    for M in (1, 16):
        o, t, c = f"gpu.w4a16.{shape}.m{M}", f"gpu.torch.tinygemm.{shape}.m{M}", f"gpu.torch.cublas_bf16.{shape}.m{M}"
        print(f"{shape:12s} {M:2d} {v(o + '.us')} {v(o + '.pct_ceiling')} | {v(t + '.us')} {v(t + '.w4a16_speedup')}"
              f" | {v(c + '.us')} {v(c + '.w4a16_speedup')}")
EOF
fi
echo "== total $((SECONDS - t0)) s"
cat "$out/summary.txt"
(( bad == 0 )) && echo "GPU FINAL PASSED" || echo "GPU FINAL FAILED"
exit "$bad"
