#!/usr/bin/env bash
# Side by side on one GPU, in one device call: this tree's matmul_w4a16 kernel against the
# kernels of other engine trees (a commit's engine_src/, an experiment's patched copy).
# Builds bench_gpu in every tree in parallel (and this tree's engine for its op tests), then:
# test_ops --backend cuda of this tree; `bench_gpu --only` per tree, interleaved and repeated
# (KD_AB_REPS, default 2), at M = 1 on 28672x8192, 7168x2048 and 2048x7168 and at M = 2..16 on
# 28672x8192, each line with the output's bits (equal bits: the same arithmetic); `bench_gpu
# --quick` per tree (read ceiling, the rotated table, the MoE layer at 1, 4, 16 tokens); with
# KD_AB_NCU=1 an ncu profile of each tree's M = 1 launch on 28672x8192 (warp states, stall
# sampling per instruction: OUT/ncu_<tree>.txt and OUT/ncu_<tree>_sass.csv; KD_AB_NCU_NAMES limits
# it to some entries, KD_AB_QUICK likewise the --quick runs); with KD_AB_GATES=1 run_tests.sh and
# compute-sanitizer memcheck of this tree's op tests; with KD_AB_FULL=1 the full `bench_gpu
# --json OUT/bench_full.json` of the first entry (the rotated table with 15 repeats).
#   bench/gpu_ab.sh OUT NAME=TREE[@VAR=VALUE]...   (from engine_src/; each TREE an engine_src
#   folder, `.` for this one; VAR=VALUE an environment setting for that entry's runs, so one
#   build can be several entries; env KD_ARCH as for build.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
out="$1"; shift
mkdir -p "$out"
export KD_BACKEND=cuda PYTHON="${PYTHON:-python3}"
names=(); trees=(); envs=()
for a in "$@"; do
    spec="${a#*=}"
    names+=("${a%%=*}"); trees+=("$(cd "${spec%%@*}" && pwd)")
    [[ "$spec" == *@* ]] && envs+=("${spec#*@}") || envs+=("KD_AB_NONE=1")
done
t0=$SECONDS
nvidia-smi >"$out/setup.log" 2>&1
pids=()
bash scripts/build.sh >>"$out/setup.log" 2>&1 & pids+=($!)
built=" "
for i in "${!trees[@]}"; do
    [[ "$built" == *" ${trees[$i]} "* ]] && continue
    built+="${trees[$i]} "
    (cd "${trees[$i]}" && KD_BENCH_GPU_BUILD_ONLY=1 KD_RESULTS_DIR=build/ab bash scripts/bench_gpu.sh) \
        >"$out/build_${names[$i]}.log" 2>&1 & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "builds rc=$rc ($((SECONDS - t0)) s)"
(( rc == 0 )) || { tail -n 20 "$out"/setup.log "$out"/build_*.log; exit 1; }
timeout 120 build/test_ops --backend cuda >"$out/test_ops.log" 2>&1
echo "test_ops cuda rc=$? ok=$(grep -c '^ok' "$out/test_ops.log") $(grep -E '^FAIL' "$out/test_ops.log" | head -n 5 | tr '\n' ' ') ($((SECONDS - t0)) s)"
shapes=("28672 8192 1" "7168 2048 1" "2048 7168 1" "28672 8192 2" "28672 8192 4" "28672 8192 8" "28672 8192 16")
for rep in $(seq "${KD_AB_REPS:-2}"); do
    for shape in "${shapes[@]}"; do
        for i in "${!trees[@]}"; do
            r="$(env "${envs[$i]}" timeout 30 "${trees[$i]}/build/ab/bench_gpu" --only $shape 2>&1 | grep -E 'matmul_w4a16|rror')"
            echo "${names[$i]} $r" | tee -a "$out/only.log"
        done
    done
done
echo "only timings done ($((SECONDS - t0)) s)"
for i in "${!trees[@]}"; do
    [[ " ${KD_AB_QUICK:-${names[*]}} " == *" ${names[$i]} "* ]] || continue
    env "${envs[$i]}" timeout 150 "${trees[$i]}/build/ab/bench_gpu" --quick >"$out/quick_${names[$i]}.log" 2>&1
    echo "bench_gpu --quick ${names[$i]} rc=$? ($((SECONDS - t0)) s)"
    grep -E "^read-band|M=1 |M=16 |T=1 |T=16 " "$out/quick_${names[$i]}.log" | sed "s/^/${names[$i]}: /"
done
if [[ "${KD_AB_NCU:-0}" == 1 ]]; then
    for i in "${!trees[@]}"; do
        n="${names[$i]}"
        [[ " ${KD_AB_NCU_NAMES:-${names[*]}} " == *" $n "* ]] || continue
        env "${envs[$i]}" timeout 150 ncu --clock-control none -k regex:w4_kernel --launch-skip 5 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
            --section Occupancy --section LaunchStats -f -o "$out/ncu_$n" \
            "${trees[$i]}/build/ab/bench_gpu" --only 28672 8192 1 >"$out/ncu_${n}_run.log" 2>&1
        echo "ncu $n rc=$? ($((SECONDS - t0)) s)"
        ncu -i "$out/ncu_$n.ncu-rep" --page details --print-details all >"$out/ncu_$n.txt" 2>&1
        ncu -i "$out/ncu_$n.ncu-rep" --page source --csv --print-source sass >"$out/ncu_${n}_sass.csv" 2>&1
    done
fi
if [[ "${KD_AB_GATES:-0}" == 1 ]]; then
    timeout "${KD_AB_TESTS_S:-200}" bash scripts/run_tests.sh >"$out/run_tests.log" 2>&1
    echo "run_tests rc=$? ($((SECONDS - t0)) s): $(grep -cE '^PASS' "$out/run_tests.log") pass; $(grep -E '^FAIL|TESTS (PASSED|FAILED)' "$out/run_tests.log" | head -n 8 | tr '\n' ';')"
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 build/test_ops --backend cuda >"$out/memcheck.log" 2>&1
    echo "memcheck rc=$? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$out/memcheck.log")"
fi
if [[ "${KD_AB_FULL:-0}" == 1 ]]; then
    env "${envs[0]}" timeout 200 "${trees[0]}/build/ab/bench_gpu" --json "$out/bench_full.json" >"$out/bench_full.log" 2>&1
    echo "bench_gpu (full) ${names[0]} rc=$? ($((SECONDS - t0)) s)"
    grep -E "^read-band|x 8192  M=|T=1 |T=16 " "$out/bench_full.log"
fi
