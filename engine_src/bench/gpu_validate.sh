#!/usr/bin/env bash
# Everything the CUDA backend must show on a GPU host, in one pass (one device session):
# build, op tests against the reference, the kernel benchmarks, bundles, run_tests.sh (CPU and
# CUDA backends), compute-sanitizer memcheck of the op tests, and the engine benchmark.
# Run from engine_src/; logs go to the folder given (default build/gpu_validate), one per step.
#   bench/gpu_validate.sh [OUT_DIR]        (env: KD_ARCH, CUDA_HOME, PYTHON as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/gpu_validate}"
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
step() {  # step LOG SECONDS CMD...: run with a time limit, append to LOG, print a summary line
    local log="$1" limit="$2"; shift 2
    local t0=$SECONDS rc=0
    echo "== $*" >>"$out/$log"
    timeout -k 5 "$limit" "$@" >>"$out/$log" 2>&1 || rc=$?
    printf '%-60s rc=%-3d %4ds\n' "$*" "$rc" $((SECONDS - t0)) | tee -a "$out/summary.txt"
    return "$rc"
}
nvidia-smi >"$out/setup.log" 2>&1
step setup.log 180 bash scripts/build.sh || { tail -n 40 "$out/setup.log"; exit 1; }
step tests.log 60 build/test_ops --backend cuda
step bench_gpu.log 200 bash scripts/bench_gpu.sh
cp build/bench_gpu.json "$out/" 2>/dev/null
[[ -f tests/refs/manifest.json ]] || step setup.log 120 bash scripts/bundles.sh
step tests.log 240 bash scripts/run_tests.sh
cp build/test_results.json "$out/" 2>/dev/null
step tests.log 150 compute-sanitizer --tool memcheck --error-exitcode 9 build/test_ops --backend cuda
step bench.log 150 bash scripts/bench.sh
cp build/bench.json "$out/" 2>/dev/null
grep -E "ok |FAIL|skip" "$out/tests.log" | grep -c '^ok' | sed 's/^/op tests ok: /'
grep -E "^FAIL|FAILED|PASSED" "$out/tests.log" | head -n 20
grep -E "ERROR SUMMARY" "$out/tests.log"
tail -n 45 "$out/bench_gpu.log"
cat "$out/summary.txt" >>"$out/setup.log"
cat "$out/summary.txt"
rm -f "$out/summary.txt"
