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
"$PYTHON" - <<'EOF'
import json
m = json.load(open("tests/refs/manifest.json"))
m["bundles"] = [b for b in m["bundles"] if b["name"].startswith("tiny")]
json.dump(m, open("tests/refs/manifest_tiny.json", "w"))
EOF
for m in "${modes[@]}"; do
    set -- $m
    env "$2" timeout 120 build/kdtree bench --manifest tests/refs/manifest_tiny.json --out "$out/bench_$1.json" \
        --budgets 2,4,8,16,32 --repeats 3 --moe-experts 8 --moe-tokens 1 >"$out/bench_$1.log" 2>&1
    echo "bench $1 rc=$? ($((SECONDS - t0)) s)"
done
"$PYTHON" - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
for mode in ("before", "units", "graph"):
    try:
        j = json.load(open(f"{out}/bench_{mode}.json"))
    except Exception as e:
        print(mode, "no report:", e); continue
    for name, b in j["bundles"].items():
        ar = b["ar"]
        best = max(b["ddtree"], key=lambda t: t["speedup_over_ar"])
        s, a = ar["per_step"], best["per_step"]
        print(f"{mode:6} {name:10} AR {ar['tokens_per_second']:7.0f} tok/s {s['us']:6.1f} us/step {s['launches']:5.1f} launches "
              f"{s['kernels']:5.1f} kernels {s['copies']:4.1f} copies {s['syncs']:3.1f} syncs | DDTree B={best['budget']:2} "
              f"{best['tokens_per_second']:7.0f} tok/s x{best['speedup_over_ar']:.2f} accept {best['accept_mean']:.2f} "
              f"(accept/speedup {best['accept_mean'] / best['speedup_over_ar']:.2f}) {a['us']:6.1f} us/round "
              f"{a['launches']:5.1f} launches {a['kernels']:5.1f} kernels {a['copies']:4.1f} copies {a['syncs']:3.1f} syncs "
              f"equals_ar={all(t['equals_ar'] for t in b['ddtree'])}")
EOF
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
