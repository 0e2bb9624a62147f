#!/usr/bin/env bash
# The DDTree-round pass (issue 21, target 3) in one device call, an A/B against a base engine:
# builds this engine and BASE (another engine_src checkout: the tree before the change) for CUDA
# in parallel, and the bundles once (BASE reads the same files); CUDA op tests; `kdtree bench`
# on the tiny bundles, BASE and this tree interleaved, with units (the default) and with
# KD_CUDA_GRAPH=1 (launches, copies, syncs and microseconds per decode step; DDTree's
# speed-up over AR); compute-sanitizer memcheck of a DDTree run with and without graphs;
# run_tests.sh (CUDA backend) with graphs and without; then, while time is left, the benchmarks
# a second time.
#   bench/gpu_round.sh BASE [OUT_DIR]   (from engine_src/; env KD_ARCH as for build.sh;
#   KD_ROUND_BUDGET_S, default 420: the steps after it are skipped, and said so)
set -uo pipefail
cd "$(dirname "$0")/.."
base="$(cd "${1:?usage: bench/gpu_round.sh BASE [OUT_DIR]}" && pwd)"
out="${2:-build/gpu_round}"
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
budget_s="${KD_ROUND_BUDGET_S:-420}"
t0=$SECONDS
left() { echo $((budget_s - (SECONDS - t0))); }
nvidia-smi >"$out/setup.log" 2>&1
bash scripts/build.sh >>"$out/setup.log" 2>&1 &
b1=$!
(cd "$base" && bash scripts/build.sh) >"$out/setup_base.log" 2>&1 &
b2=$!
bash scripts/bundles.sh >"$out/bundles.log" 2>&1 &
b3=$!
wait $b1; r1=$?; wait $b2; r2=$?; wait $b3; r3=$?
echo "build rc=$r1 base build rc=$r2 bundles rc=$r3 ($((SECONDS - t0)) s)"
(( r1 == 0 && r2 == 0 && r3 == 0 )) || { tail -n 30 "$out/setup.log" "$out/setup_base.log" "$out/bundles.log"; exit 1; }
timeout 120 build/test_ops --backend cuda >"$out/test_ops.log" 2>&1
echo "test_ops cuda rc=$? ok=$(grep -c '^ok' "$out/test_ops.log") $(grep -E '^FAIL' "$out/test_ops.log" | head -n 3 | tr '\n' ' ') ($((SECONDS - t0)) s)"
"$PYTHON" bench/tiny_manifest.py
manifest="$PWD/tests/refs/manifest_tiny.json"
modes=()
bench_pass() {  # base and this tree, interleaved, with graphs and with units
    local pass=$1 m tree bin mode
    for m in "graph KD_CUDA_GRAPH=1" "units KD_CUDA_GRAPH=0"; do
        set -- $m
        for tree in base new; do
            bin=build/kdtree
            [[ $tree == base ]] && bin="$base/build/kdtree"
            mode="${tree}_$1_$pass"
            env "$2" timeout 120 "$bin" bench --manifest "$manifest" --out "$out/bench_$mode.json" \
                --budgets 2,4,8,16,32 --repeats 3 --moe-experts 8 --moe-tokens 1 >"$out/bench_$mode.log" 2>&1
            echo "bench $mode rc=$? ($((SECONDS - t0)) s)"
            modes+=("$mode")
        done
    done
}
bench_pass 1
"$PYTHON" bench/per_step_table.py "$out" "${modes[@]}"
tiny="tests/refs/model_tiny_int4.kdtr"
for g in 1 0; do
    KD_CUDA_GRAPH=$g timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 build/kdtree check --bundle "$tiny" \
        --mode ddtree --expect ar --budget 8 >"$out/memcheck_graph$g.log" 2>&1
    echo "memcheck KD_CUDA_GRAPH=$g ddtree rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck_graph$g.log")"
done
for g in 1 0; do
    (( $(left) > 40 )) || { echo "run_tests KD_CUDA_GRAPH=$g: skipped, $(left) s of the budget left"; continue; }
    KD_NO_BUILD=1 KD_CUDA_GRAPH=$g KD_TEST_BACKENDS=cuda KD_TEST_RESULTS="$out/test_results_graph$g.json" timeout "$(left)" \
        bash scripts/run_tests.sh >"$out/run_tests_graph$g.log" 2>&1
    echo "run_tests KD_CUDA_GRAPH=$g rc=$? ($((SECONDS - t0)) s): $(grep -E '^FAIL|TESTS (PASSED|FAILED)' "$out/run_tests_graph$g.log" | head -n 8 | tr '\n' ';')"
done
if (( $(left) > 120 )); then bench_pass 2; else echo "bench pass 2: skipped, $(left) s of the budget left"; fi
"$PYTHON" bench/per_step_table.py "$out" "${modes[@]}" | tee "$out/per_step.txt"
