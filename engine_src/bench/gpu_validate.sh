#!/usr/bin/env bash
# Everything the CUDA backend must show on a GPU host, in one pass (one device session):
# build, op tests against the reference, the kernel benchmarks, bundles, run_tests.sh (CPU and
# CUDA backends), compute-sanitizer memcheck of the op tests, and the engine benchmark.
# With --contention, the same engine with a co-tenant on the GPU (build/gpu_load, see
# scripts/gpu_load.sh) instead: build/test_ops KD_CONTENTION_RUNS times (default 4) under each
# load of KD_CONTENTION_LOADS (default "compute mma memory@0.5 burst pulse"), run_tests.sh (CUDA
# backend) under the cycling load, and compute-sanitizer racecheck and synccheck of the op tests
# alone and under load. Exit 0 only when every run passed and the load ran throughout.
# Run from engine_src/; logs go to the folder given (default build/gpu_validate), one per step.
#   bench/gpu_validate.sh [--contention] [OUT_DIR]        (env: KD_ARCH, CUDA_HOME, PYTHON as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
mode=default
if [[ "${1:-}" == --contention ]]; then mode=contention; shift; fi
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
[[ -f tests/refs/manifest.json ]] || step setup.log 120 bash scripts/bundles.sh

# ---- contention ---------------------------------------------------------------------------------
if [[ "$mode" == contention ]]; then
    source scripts/gpu_load.sh
    trap '[[ -z "$GPU_LOAD_PID" ]] || gpu_load_stop' EXIT
    bad=0
    # under LOG LOAD CMD...: CMD as a step (into LOG) with the load running; fails when CMD
    # fails or the load was not running throughout.
    under() {
        local log="$1" load="$2" rc=0; shift 2
        gpu_load_start "$load" "$out/gpu_load.log" || { echo "load $load did not start: $(tail -n 2 "$out/gpu_load.log")"; return 1; }
        printf 'under load %s: ' "$load" | tee -a "$out/summary.txt"
        step "$log" 400 "$@" || rc=$?
        gpu_load_stop || { echo "load $load stopped early: $GPU_LOAD_SUMMARY"; rc=1; }
        echo "   load: $GPU_LOAD_SUMMARY" >>"$out/$log"
        return "$rc"
    }
    runs="${KD_CONTENTION_RUNS:-4}" total=0 passed=0
    for load in ${KD_CONTENTION_LOADS:-compute mma memory@0.5 burst pulse}; do
        ok=0
        gpu_load_start "$load" "$out/gpu_load.log" || { echo "load $load did not start: $(tail -n 2 "$out/gpu_load.log")"; bad=1; continue; }
        for ((i = 1; i <= runs; i++)); do
            rc=0
            timeout -k 5 120 build/test_ops --backend cuda >"$out/t.log" 2>&1 || rc=$?
            { echo "== test_ops under $load, run $i: rc=$rc"; cat "$out/t.log"; } >>"$out/contention.log"
            if (( rc == 0 )); then ok=$((ok + 1)); else echo "   $load run $i: rc=$rc $(grep -E '^FAIL|rror' "$out/t.log" | head -n 3 | tr '\n' ' ')"; fi
        done
        gpu_load_stop || { echo "   load $load stopped before its runs ended: $GPU_LOAD_SUMMARY"; bad=1; }
        echo "test_ops under $load: $ok of $runs passed ($GPU_LOAD_SUMMARY)" | tee -a "$out/summary.txt"
        total=$((total + runs)); passed=$((passed + ok))
    done
    rm -f "$out/t.log"
    echo "test_ops under load: $passed of $total runs passed" | tee -a "$out/summary.txt"
    (( passed == total )) || bad=1
    # run_tests.sh starts and stops its own load (KD_GPU_LOAD) and records it as load.gpu_load.
    step contention.log 400 env KD_GPU_LOAD=cycle KD_TEST_BACKENDS=cuda KD_TEST_RESULTS="$out/contention_results.json" \
        bash scripts/run_tests.sh || bad=1
    grep -E "^FAIL|TESTS (PASSED|FAILED)" "$out/contention.log" | tail -n 12
    for tool in racecheck synccheck; do
        step sanitizer.log 300 compute-sanitizer --tool "$tool" --error-exitcode 9 build/test_ops --backend cuda || bad=1
        under sanitizer.log cycle compute-sanitizer --tool "$tool" --error-exitcode 9 build/test_ops --backend cuda || bad=1
    done
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitizer.log" "$out/contention.log"
    cat "$out/summary.txt" >>"$out/setup.log"
    rm -f "$out/summary.txt"
    (( bad == 0 )) && echo "CONTENTION PASSED" || echo "CONTENTION FAILED"
    exit "$bad"
fi

# ---- the default pass -------------------------------------------------------------------------
step tests.log 60 build/test_ops --backend cuda
step bench_gpu.log 200 bash scripts/bench_gpu.sh
cp build/bench_gpu.json "$out/" 2>/dev/null
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
