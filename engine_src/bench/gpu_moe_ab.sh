#!/usr/bin/env bash
# The K2 MoE layer of engine trees (this one, named "this", and variants NAME=FOLDER, each an
# engine_src folder) against a kept tree's (main's, say) in one device call (issue 38, target 3).
# Builds every tree's bench_gpu from this tree's bench/bench_gpu.cu (so all print the same rows
# and the layer's output bits; the kept tree's file is overwritten) and the trees' engines; per
# tree the CUDA op tests; `bench_gpu --quick --moe-only` of all trees in turn, KD_MOE_AB_ROUNDS
# rounds (default 3), each run measuring its own read ceiling; a table of the medians and whether
# each tree's output bits equal the kept tree's; `bench_gpu --only N K 1` on the expert's and the
# large shape (time and output bits of the plain matmul); per tree compute-sanitizer memcheck of
# the op tests and run_tests.sh (KD_TEST_BUNDLES as given; in parallel, at most
# KD_MOE_AB_TESTS_S seconds; KD_MOE_AB_GATES: the names of the trees both run on, default all,
# "none": none); last, ncu's duration of each kernel of the layer at one token in the kept tree and this
# one. KD_MOE_AB_OWN_BENCH=1: each tree builds its own bench/bench_gpu.cu (a tree whose layer
# calls an op the kept tree lacks; the rows printed must then be the same in all of them).
#   bench/gpu_moe_ab.sh OUT_DIR KEPT_ENGINE_SRC [NAME=ENGINE_SRC ...]   (from engine_src/; env KD_ARCH as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
(( $# >= 2 )) || { echo "usage: bench/gpu_moe_ab.sh OUT_DIR KEPT_ENGINE_SRC [NAME=ENGINE_SRC ...]" >&2; exit 2; }
out="$1"
kept="$(cd "$2" && pwd)" || exit 2
shift 2
names=(this); trees=("$PWD")
for a in "$@"; do
    names+=("${a%%=*}"); trees+=("$(cd "${a#*=}" && pwd)") || exit 2
done
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
t0=$SECONDS
nvidia-smi >"$out/setup.log" 2>&1
pids=()
for t in "$kept" "${trees[@]}"; do
    [[ "$t" == "$PWD" || "${KD_MOE_AB_OWN_BENCH:-0}" == 1 ]] || cp bench/bench_gpu.cu "$t/bench/bench_gpu.cu" || exit 2
    (cd "$t" && KD_BENCH_GPU_BUILD_ONLY=1 KD_BENCH_TORCH=0 KD_RESULTS_DIR=build/ab bash scripts/bench_gpu.sh) \
        >>"$out/build_bench.log" 2>&1 & pids+=($!)
done
for i in "${!trees[@]}"; do
    (cd "${trees[$i]}" && bash scripts/build.sh) >"$out/build_${names[$i]}.log" 2>&1 & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "builds rc=$rc ($((SECONDS - t0)) s)"
(( rc == 0 )) || { tail -n 30 "$out"/build_*.log; exit 1; }
bench_of() { if [[ $1 == kept ]]; then echo "$kept/build/ab/bench_gpu"; else echo "${trees[$2]}/build/ab/bench_gpu"; fi; }
for i in "${!trees[@]}"; do
    n="${names[$i]}"
    timeout 120 "${trees[$i]}/build/test_ops" --backend cuda >"$out/test_ops_$n.log" 2>&1
    echo "test_ops $n rc=$? ok=$(grep -c '^ok' "$out/test_ops_$n.log") $(grep -E '^FAIL|rror' "$out/test_ops_$n.log" | head -n 3 | tr '\n' ' ') ($((SECONDS - t0)) s)"
    grep -E 'moe_ffn' "$out/test_ops_$n.log" | sed "s/^/$n: /"
done
for r in $(seq 1 "${KD_MOE_AB_ROUNDS:-3}"); do
    for i in -1 "${!trees[@]}"; do
        n=kept; (( i >= 0 )) && n="${names[$i]}"
        timeout 100 "$(bench_of "$n" "$i")" --quick --moe-only --json "$out/moe_${n}_$r.json" >"$out/moe_${n}_$r.log" 2>&1
        echo "bench_gpu --moe-only $n round $r rc=$? ($((SECONDS - t0)) s)"
    done
done
"$PYTHON" - "$out" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
rows = {}  # (tree, T) -> rows of every round
for path in sorted(glob.glob(f"{out}/moe_*_*.json")):
    tree = path.rsplit("/", 1)[1][len("moe_"):].rsplit("_", 1)[0]
    try:
        doc = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{path}: unreadable ({e})")
        continue
    for row in doc["moe_k2_layer"]:
        rows.setdefault((tree, int(row["tokens"])), []).append(dict(row, ceiling=doc["ceiling"]["read_GBps"]))
print("tree      T   graph us [min-max]      pct_ceiling  graph8 us  pct_graph8  ceiling GB/s  out bits  valid  kept/this  bits=kept")
med = lambda rs, k: statistics.median(r[k] for r in rs)
for (tree, T), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] != "kept", kv[0][0])):
    k = rows.get(("kept", T), [])
    g = [r["int4_graph_us"] for r in rs]
    print(f"{tree:9} {T:<3} {statistics.median(g):8.1f} [{min(g):.1f}-{max(g):.1f}]  {med(rs, 'pct_ceiling'):9.1f} %"
          f"  {med(rs, 'int4_graph8_us'):9.1f}  {med(rs, 'pct_ceiling_graph8'):8.1f} %  {med(rs, 'ceiling'):10.0f}"
          f"  {','.join(sorted({r['int4_out_bits'] for r in rs}))}  {all(r['valid'] for r in rs)}"
          f"  {med(k, 'int4_graph_us') / statistics.median(g):.3f}x" if k else "",
          ({r["int4_out_bits"] for r in k} == {r["int4_out_bits"] for r in rs}) if k else "")
PY
for i in -1 "${!trees[@]}"; do
    n=kept; (( i >= 0 )) && n="${names[$i]}"
    for shape in "2048 7168" "7168 2048" "28672 8192"; do
        # shellcheck disable=SC2086
        timeout 30 "$(bench_of "$n" "$i")" --only $shape 1 2>&1 | grep -E '^matmul_w4a16' | sed "s/^/$n: /"
    done
done
gated=()  # indices of the trees memcheck and run_tests.sh run on
for i in "${!trees[@]}"; do
    [[ -z "${KD_MOE_AB_GATES:-}" || " $KD_MOE_AB_GATES " == *" ${names[$i]} "* ]] && gated+=("$i")
done
for i in "${gated[@]}"; do
    n="${names[$i]}"
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "${trees[$i]}/build/test_ops" --backend cuda \
        >"$out/memcheck_$n.log" 2>&1
    echo "memcheck $n rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck_$n.log")"
done
pids=()
for i in "${gated[@]}"; do
    (cd "${trees[$i]}" && timeout "${KD_MOE_AB_TESTS_S:-240}" bash scripts/run_tests.sh) >"$out/run_tests_${names[$i]}.log" 2>&1 & pids+=($!)
done
for k in "${!gated[@]}"; do
    i="${gated[$k]}"
    wait "${pids[$k]}"
    r=$?
    l="$out/run_tests_${names[$i]}.log"
    echo "run_tests ${names[$i]} rc=$r ($((SECONDS - t0)) s): $(grep -cE '^PASS' "$l") pass; $(grep -E '^FAIL|TESTS (PASSED|FAILED)' "$l" | head -n 4 | tr '\n' ';')"
done
for i in -1 0; do  # the kept tree and this one
    n=kept; (( i >= 0 )) && n="${names[$i]}"
    timeout 60 ncu --clock-control none --csv --print-kernel-base function --metrics gpu__time_duration.sum \
        -k 'regex:w4_kernel|w4_sum_kernel|moe_lists|moe_combine|mm_narrow|moe_gate' --launch-count 40 \
        "$(bench_of "$n" "$i")" --moe 1 >"$out/ncu_$n.csv" 2>&1
    echo "ncu $n rc=$? ($((SECONDS - t0)) s)"
    "$PYTHON" - "$out/ncu_$n.csv" "$n" <<'PY'
import csv, sys
lines = [ln for ln in open(sys.argv[1], errors="replace") if ln.startswith('"')]
for r in csv.DictReader(lines):
    print(f"{sys.argv[2]}: {r.get('ID')} {r.get('Kernel Name', '')[:36]} grid {r.get('Grid Size', '')} {r.get('Metric Value')} {r.get('Metric Unit')}")
PY
done
