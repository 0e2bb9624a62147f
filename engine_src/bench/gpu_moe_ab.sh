#!/usr/bin/env bash
# The K2 MoE layer of this engine tree against a kept tree's (main's, say) in one device call
# (issue 38, target 3): builds both trees' bench_gpu (each from this tree's bench/bench_gpu.cu, so
# both print the same rows and the layer's output bits) and this tree's engine; this tree's CUDA
# op tests; `bench_gpu --quick --moe-only` of the two trees alternately, KD_MOE_AB_ROUNDS rounds
# each (default 4), each run measuring its own read ceiling; a table of the medians and whether
# the output bits are equal; `bench_gpu --moe 1` (the layer's stages) of both; ncu's duration of
# each kernel of the layer at one token in both; then this tree's gates: compute-sanitizer
# memcheck of the op tests and run_tests.sh (KD_TEST_BUNDLES as given).
#   bench/gpu_moe_ab.sh OUT_DIR KEPT_ENGINE_SRC   (from engine_src/; env KD_ARCH as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
(( $# == 2 )) || { echo "usage: bench/gpu_moe_ab.sh OUT_DIR KEPT_ENGINE_SRC" >&2; exit 2; }
out="$1"
kept="$(cd "$2" && pwd)" || exit 2
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
t0=$SECONDS
nvidia-smi >"$out/setup.log" 2>&1
cp bench/bench_gpu.cu "$kept/bench/bench_gpu.cu" || exit 2
bash scripts/build.sh >"$out/build_this.log" 2>&1 &
pids=($!)
for t in "$kept" "$PWD"; do
    (cd "$t" && KD_BENCH_GPU_BUILD_ONLY=1 KD_BENCH_TORCH=0 KD_RESULTS_DIR=build/ab bash scripts/bench_gpu.sh) \
        >>"$out/build_bench.log" 2>&1 & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "builds rc=$rc ($((SECONDS - t0)) s)"
(( rc == 0 )) || { tail -n 30 "$out"/build_*.log; exit 1; }
timeout 120 build/test_ops --backend cuda >"$out/test_ops.log" 2>&1
echo "test_ops rc=$? ok=$(grep -c '^ok' "$out/test_ops.log") $(grep -E '^FAIL|rror' "$out/test_ops.log" | head -n 3 | tr '\n' ' ') ($((SECONDS - t0)) s)"
grep -E 'moe_ffn' "$out/test_ops.log"
for r in $(seq 1 "${KD_MOE_AB_ROUNDS:-4}"); do
    for n in kept this; do
        bin="$PWD/build/ab/bench_gpu"
        [[ $n == kept ]] && bin="$kept/build/ab/bench_gpu"
        timeout 100 "$bin" --quick --moe-only --json "$out/moe_${n}_$r.json" >"$out/moe_${n}_$r.log" 2>&1
        echo "bench_gpu --moe-only $n round $r rc=$? ($((SECONDS - t0)) s)"
    done
done
"$PYTHON" - "$out" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
rows = {}  # (tree, T) -> list of rows
for path in sorted(glob.glob(f"{out}/moe_*_*.json")):
    tree = path.rsplit("/", 1)[1].split("_")[1]
    try:
        doc = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{path}: unreadable ({e})")
        continue
    for row in doc["moe_k2_layer"]:
        rows.setdefault((tree, int(row["tokens"])), []).append(dict(row, ceiling=doc["ceiling"]["read_GBps"]))
print("tree  T   graph us [min-max]        pct_ceiling  graph8 us  pct_graph8  ceiling GB/s  bits (distinct)  valid")
for (tree, T), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    g = [r["int4_graph_us"] for r in rs]
    print(f"{tree:5} {T:<3} {statistics.median(g):8.1f} [{min(g):.1f}-{max(g):.1f}]"
          f"  {statistics.median(r['pct_ceiling'] for r in rs):9.1f} %"
          f"  {statistics.median(r['int4_graph8_us'] for r in rs):9.1f}"
          f"  {statistics.median(r['pct_ceiling_graph8'] for r in rs):8.1f} %"
          f"  {statistics.median(r['ceiling'] for r in rs):10.0f}"
          f"  {','.join(sorted({r['int4_out_bits'] for r in rs}))}  {all(r['valid'] for r in rs)}")
for T in sorted({t for _, t in rows}):
    k, t = rows.get(("kept", T), []), rows.get(("this", T), [])
    if k and t:
        same = {r["int4_out_bits"] for r in k} == {r["int4_out_bits"] for r in t}
        ratio = statistics.median(r["int4_graph_us"] for r in k) / statistics.median(r["int4_graph_us"] for r in t)
        print(f"T={T}: kept / this graph time {ratio:.3f}x; output bits equal: {same}")
PY
for n in kept this; do
    bin="$PWD/build/ab/bench_gpu"
    [[ $n == kept ]] && bin="$kept/build/ab/bench_gpu"
    timeout 60 "$bin" --moe 1 >"$out/stages_$n.log" 2>&1
    echo "bench_gpu --moe 1 $n rc=$? ($((SECONDS - t0)) s)"
    grep -vE '^device' "$out/stages_$n.log" | sed "s/^/$n: /"
    timeout 90 ncu --clock-control none --csv --print-kernel-base function --metrics gpu__time_duration.sum \
        -k 'regex:w4_kernel|w4_sum_kernel|moe_lists|moe_combine|mm_narrow|moe_gate' --launch-count 16 \
        "$bin" --moe 1 >"$out/ncu_$n.csv" 2>&1
    echo "ncu $n rc=$? ($((SECONDS - t0)) s)"
    "$PYTHON" - "$out/ncu_$n.csv" "$n" <<'PY'
import csv, sys
lines = [ln for ln in open(sys.argv[1], errors="replace") if ln.startswith('"')]
for r in csv.DictReader(lines):
    print(f"{sys.argv[2]}: {r.get('ID')} {r.get('Kernel Name', '')[:40]} grid {r.get('Grid Size', '')} {r.get('Metric Value')} {r.get('Metric Unit')}")
PY
done
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 build/test_ops --backend cuda >"$out/memcheck.log" 2>&1
echo "memcheck rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck.log")"
timeout "${KD_MOE_AB_TESTS_S:-240}" bash scripts/run_tests.sh >"$out/run_tests.log" 2>&1
r=$?
echo "run_tests rc=$r ($((SECONDS - t0)) s): $(grep -cE '^PASS' "$out/run_tests.log") pass; $(grep -E '^FAIL|TESTS (PASSED|FAILED)' "$out/run_tests.log" | head -n 4 | tr '\n' ';')"
