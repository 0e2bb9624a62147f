#!/usr/bin/env bash
# The decode-step pass (issue 21, target 3) in one device call: builds the engine (CUDA) and the
# bundles; op tests; on every bundle AR == golden and DDTree == AR (budget, block in (4, 2),
# (8, 8), (16, 4), (48, 8)) in the three modes of the CUDA backend; `kdtree bench` on the tiny
# bundles in each mode (launches, copies, syncs and microseconds per decode step, DDTree's
# speed-up over AR); compute-sanitizer memcheck of a graph-mode DDTree run and of the op tests;
# then run_tests.sh (CUDA backend) with graphs, and without when time is left.
# Modes: `before` KD_CUDA_UNITS=0 (every op copies its own host inputs), `units` (the default:
# one pinned copy per forward), `graph` KD_CUDA_GRAPH=1 (forwards captured and replayed).
#   bench/gpu_graph.sh [OUT_DIR]   (from engine_src/; env KD_ARCH as for build.sh;
#   KD_GRAPH_BUDGET_S, default 330: the steps after it are skipped, and said so)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/gpu_graph}"
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
budget_s="${KD_GRAPH_BUDGET_S:-330}"
t0=$SECONDS
left() { echo $((budget_s - (SECONDS - t0))); }
nvidia-smi >"$out/setup.log" 2>&1
bash scripts/build.sh >>"$out/setup.log" 2>&1 &
b1=$!
bash scripts/bundles.sh >"$out/bundles.log" 2>&1 &
b2=$!
wait $b1; r1=$?; wait $b2; r2=$?
echo "build rc=$r1 bundles rc=$r2 ($((SECONDS - t0)) s)"
(( r1 == 0 && r2 == 0 )) || { tail -n 30 "$out/setup.log" "$out/bundles.log"; exit 1; }
timeout 120 build/test_ops --backend cuda >"$out/test_ops.log" 2>&1
echo "test_ops cuda rc=$? ok=$(grep -c '^ok' "$out/test_ops.log") $(grep -E '^FAIL' "$out/test_ops.log" | head -n 3 | tr '\n' ' ') ($((SECONDS - t0)) s)"
modes=("before KD_CUDA_UNITS=0" "units KD_CUDA_UNITS=1" "graph KD_CUDA_GRAPH=1")
# run_tests.sh checks the default (units) at the end; graphs first here.
for m in "${modes[2]}"; do
    set -- $m
    ok=0 bad=0
    for f in tests/refs/model_*.kdtr; do
        cmds=("--expect golden" "--mode ddtree --expect ar --budget 4 --block 2" "--mode ddtree --expect ar --budget 8 --block 8"
              "--mode ddtree --expect ar --budget 16 --block 4" "--mode ddtree --expect ar --budget 48 --block 8")
        for c in "${cmds[@]}"; do
            if env "$2" timeout 60 build/kdtree check --bundle "$f" $c >>"$out/checks.log" 2>&1; then ok=$((ok + 1))
            else bad=$((bad + 1)); echo "FAIL $1 $f $c" | tee -a "$out/checks.log"; fi
        done
    done
    echo "checks $1: $ok ok, $bad failed ($((SECONDS - t0)) s)"
done
"$PYTHON" bench/tiny_manifest.py
for m in "${modes[@]}"; do
    set -- $m
    env "$2" timeout 120 build/kdtree bench --manifest tests/refs/manifest_tiny.json --out "$out/bench_$1.json" \
        --budgets 2,4,8,16,32 --repeats 3 --moe-experts 8 --moe-tokens 1 >"$out/bench_$1.log" 2>&1
    echo "bench $1 rc=$? ($((SECONDS - t0)) s)"
done
"$PYTHON" bench/per_step_table.py "$out" before units graph
tiny="tests/refs/model_tiny_int4.kdtr"
KD_CUDA_GRAPH=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 build/kdtree check --bundle "$tiny" \
    --mode ddtree --expect ar --budget 8 >"$out/memcheck_graph.log" 2>&1
echo "memcheck graph ddtree rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck_graph.log")"
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 build/kdtree check --bundle "$tiny" \
    --mode ddtree --expect ar --budget 8 >"$out/memcheck_units.log" 2>&1
echo "memcheck units ddtree rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck_units.log")"
for g in 1 0; do
    (( $(left) > 40 )) || { echo "run_tests KD_CUDA_GRAPH=$g: skipped, $(left) s of the budget left"; continue; }
    KD_CUDA_GRAPH=$g KD_TEST_BACKENDS=cuda KD_TEST_RESULTS="$out/test_results_graph$g.json" timeout "$(left)" \
        bash scripts/run_tests.sh >"$out/run_tests_graph$g.log" 2>&1
    echo "run_tests KD_CUDA_GRAPH=$g rc=$? ($((SECONDS - t0)) s): $(grep -E '^FAIL|TESTS (PASSED|FAILED)' "$out/run_tests_graph$g.log" | head -n 8 | tr '\n' ';')"
done
