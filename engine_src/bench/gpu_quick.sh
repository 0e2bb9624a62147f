#!/usr/bin/env bash
# A short GPU pass for kernel work, in one device call (about 110 s on the H200): builds the
# engine and bench_gpu in parallel; CUDA op tests once per variant; matmul_w4a16 at M = 1 on
# 28672x8192 and 7168x2048 per variant (twice, interleaved; one weight set, so a few % above
# the rotated table); picks the fastest variant on 28672x8192 (or KD_QUICK_PICK); the full
# benchmark with it and the --quick one with the first variant (same-run baseline); then
# run_tests.sh and compute-sanitizer memcheck of the op tests with the pick.
# A variant is a value of the environment variable KD_QUICK_VAR (default KD_MM_STAGES, read by
# the kernel of bench/experiments/mm_ring_cp_async.patch when applied) from KD_QUICK_VALUES
# (default "0 2 3 4"); without such a patch every variant is the committed kernel.
#   bench/gpu_quick.sh [OUT_DIR]   (from engine_src/; env KD_ARCH as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/gpu_quick}"
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
var="${KD_QUICK_VAR:-KD_MM_STAGES}"
values=(${KD_QUICK_VALUES:-0 2 3 4})
for ns in "${values[@]}"; do
    echo "== $var=$ns" >>"$out/tests.log"
    env "$var=$ns" timeout 90 build/test_ops --backend cuda >"$out/t.log" 2>&1
    rc=$?
    cat "$out/t.log" >>"$out/tests.log"
    echo "test_ops cuda $var=$ns rc=$rc ok=$(grep -c '^ok' "$out/t.log") $(grep -E '^FAIL|rror' "$out/t.log" | head -n 3 | tr '\n' ' ')"
done
rm -f "$out/t.log"
for rep in 1 2; do
    for ns in "${values[@]}"; do
        for shape in "28672 8192 1" "7168 2048 1"; do
            r="$(env "$var=$ns" timeout 30 build/bench_gpu --only $shape 2>&1 | grep matmul_w4a16)"
            echo "ns=$ns $r" | tee -a "$out/only.log"
        done
    done
done
best="${KD_QUICK_PICK:-$(grep 28672x8192 "$out/only.log" | awk '{t[$1] += $5} END {for (k in t) print t[k], k}' | sort -n | head -n 1 | sed 's/.*ns=//')}"
echo "variant chosen: $var=$best ($((SECONDS - t0)) s)"
export "$var=$best"
timeout 200 build/bench_gpu --json "$out/bench_best.json" >"$out/bench_best.log" 2>&1
echo "bench_gpu (full, $var=$best) rc=$? ($((SECONDS - t0)) s)"
env "$var=${values[0]}" timeout 100 build/bench_gpu --quick >"$out/bench_base.log" 2>&1
echo "bench_gpu --quick $var=${values[0]} rc=$? ($((SECONDS - t0)) s)"
grep -E "^read-band|28672 x 8192  M=1 |7168 x 2048  M=1 |T=1 " "$out/bench_base.log" | sed 's/^/base: /'
grep -A 40 "^read-bandwidth" "$out/bench_best.log" | grep -vE "^\s*$" | head -n 40
timeout "${KD_QUICK_TESTS_S:-150}" bash scripts/run_tests.sh >"$out/run_tests.log" 2>&1
echo "run_tests rc=$? ($((SECONDS - t0)) s): $(grep -cE '^PASS' "$out/run_tests.log") pass; $(grep -E '^FAIL|TESTS (PASSED|FAILED)' "$out/run_tests.log" | head -n 8 | tr '\n' ';')"
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 build/test_ops --backend cuda >"$out/memcheck.log" 2>&1
echo "memcheck rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck.log")"
