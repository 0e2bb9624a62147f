#!/usr/bin/env bash
# The device call of issue 38's ticket pass, from the checkout's root on the GPU host:
#   bash next_call.sh call   # ~500 s: the K2 MoE layer, main against four variants
#                            #   (bench/gpu_moe_ab.sh, 5 rounds, no gates), then the ncu probe of
#                            #   main (../2026-12-07-moe-block-tail/next_call.sh probe)
# Two variants are main's tree with one line changed (an exact text edit, failing on a missing
# anchor; the same edits as engine_src/bench/experiments/w4_glu_global_ticket.patch and
# w4_global_ticket_all.patch):
#   glu ("this")  w1/w3's SwiGLU launches take their tiles from the global ticket (a counter per
#                 slot and super-chunk shared by all of its blocks) instead of the block ticket
#                 (each block a fixed share of the tiles), so that blocks on faster SMs take more;
#   all           every launch of one or two quads on sm_90 does (w2's and the plain matmul's too).
# Two are carried as trees (.xfer/NAME.tgz, main's engine_src with the patch applied; carry .xfer):
#   w2pf          moe_shared_w2_prefetch.patch: at one token the shared expert's blocks of the
#                 w1/w3 launch prefetch its w2 words and scales into L2 too, after its w1/w3
#                 (9.2 MB more while the router and the gate run), for the w2 launch to hit;
#   w2ef          moe_shared_w2_prefetch_evict_first.patch: w2pf, and every streamed weight load
#                 marked evict-first in L2 (createpolicy), so the 165 MB that w1/w3 stream do not
#                 push the prefetched w2 out first.
# Lands in $OUT/m.tgz, $OUT/probe/, $OUT/driver.log.
#   bash next_call.sh halves # ~450 s: main against `halves` (.xfer/halves.tgz, carry .xfer: main's
#                            #   engine_src with w4_paired_halves_apart.patch): without SwiGLU a
#                            #   tile pairs half-tiles t and t + tiles instead of 2t and 2t + 1, so a
#                            #   warp's two weight streams are not 8 KB apart (w2's layout) but
#                            #   3.5 MB (same products, same bits). bench/gpu_moe_ab.sh, 7 rounds,
#                            #   gates on halves; then ncu's warp stall reasons and L2/DRAM
#                            #   sectors of every w4_kernel of the layer at one token in both.
# Lands in $OUT/m.tgz, $OUT/stall/, $OUT/driver.log.
#   bash next_call.sh rows   # ~250 s: halves's plain matmul against main's at every M, interleaved
#                            #   with tinygemm and cuBLAS bf16 (bench/gpu_rows.sh, no gates, ncu at
#                            #   M = 1); then `stall`. Lands in $OUT/r.tgz, $OUT/driver_rows.log.
#   bash next_call.sh pm     # ~300 s: ncu's PM sampling (DRAM throughput over the launch's time) and
#                            #   warp states of the layer's graph-path w1/w3 and w2 at one token,
#                            #   on bench_gpu --moe-int4 (no FP32 experts, so ncu's replay can save
#                            #   the device's memory); then warp states, speed of light and
#                            #   occupancy of the expert shapes at 8 and 16 rows. In $OUT/pm/.
#   bash next_call.sh stall  # ~150 s: ncu's sampled warp stall reasons (WarpStateStats) and speed of
#                            #   light of the layer's w4_kernel launches at one token, main's tree;
#                            #   then the DRAM throughput over time of its w1/w3 and w2 launches.
set -uo pipefail
root="$PWD"
here="$(cd "$(dirname "$0")" && pwd)"
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export PYTHON="${KD_TORCH_PYTHON:-/opt/torch/.venv/bin/python3}"
variant() {  # NAME OLD NEW: main's tree at /tmp/NAME/engine_src with line OLD of w4a16_core.cuh replaced by NEW
    rm -rf "/tmp/$1" && mkdir -p "/tmp/$1" && cp -r "$root/engine_src" "/tmp/$1/" && rm -rf "/tmp/$1/engine_src/build" || return 2
    "$PYTHON" - "/tmp/$1/engine_src/src/cuda/w4a16_core.cuh" "$2" "$3" <<'PY'
import sys
path, old, new = sys.argv[1:]
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f"edit: {s.count(old)} occurrences in {path} of: {old}")
open(path, "w").write(s.replace(old, new))
PY
}
case "${1:?usage: next_call.sh call|halves|rows|stall|pm}" in
call)
    rm -rf /tmp/kept_main && cp -r "$root/engine_src" /tmp/kept_main && rm -rf /tmp/kept_main/build || exit 2
    variant glu "    constexpr bool BT = w4_block_ticket(Q);" "    constexpr bool BT = w4_block_ticket(Q) && !GLU;" || exit 2
    variant all $'    return Q <= 2;\n#endif' $'    return false && Q;\n#endif' || exit 2
    for v in w2pf w2ef; do
        rm -rf "/tmp/$v" && mkdir -p "/tmp/$v" && tar xzf ".xfer/$v.tgz" -C "/tmp/$v" || exit 2
    done
    (cd /tmp/glu/engine_src && KD_MOE_AB_ROUNDS=5 KD_MOE_AB_GATES=none timeout 360 bash bench/gpu_moe_ab.sh "$OUT/m" \
        /tmp/kept_main all=/tmp/all/engine_src w2pf=/tmp/w2pf/engine_src w2ef=/tmp/w2ef/engine_src) 2>&1 \
        | tee "$OUT/driver.log" | cut -c1-220
    tar czf "$OUT/m.tgz" -C "$OUT" m && rm -rf "$OUT/m"
    timeout 200 bash "$here/../2026-12-07-moe-block-tail/next_call.sh" probe 2>&1 | tail -n 60 ;;
halves)
    rm -rf /tmp/kept_main && cp -r "$root/engine_src" /tmp/kept_main && rm -rf /tmp/kept_main/build || exit 2
    rm -rf /tmp/halves && mkdir -p /tmp/halves && tar xzf .xfer/halves.tgz -C /tmp/halves || exit 2
    (cd /tmp/halves/engine_src && KD_MOE_AB_ROUNDS=7 KD_MOE_AB_GATES=this KD_MOE_AB_TESTS_S=200 timeout 420 \
        bash bench/gpu_moe_ab.sh "$OUT/m" /tmp/kept_main) 2>&1 | tee "$OUT/driver.log" | cut -c1-220
    tar czf "$OUT/m.tgz" -C "$OUT" m && rm -rf "$OUT/m"
    mkdir -p "$OUT/stall" || exit 2
    metrics=gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct
    metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active
    for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle lg_throttle mio_throttle no_instruction not_selected; do
        metrics+=,smsp__warp_issue_stalled_${r}_per_warp_active.pct
    done
    for t in kept halves; do
        bin=/tmp/kept_main/build/ab/bench_gpu; [[ $t == halves ]] && bin=/tmp/halves/engine_src/build/ab/bench_gpu
        timeout 80 ncu --clock-control none --csv --print-kernel-base function --metrics "$metrics" -k 'regex:w4_kernel' \
            --launch-count 12 "$bin" --moe 1 >"$OUT/stall/ncu_$t.csv" 2>&1
        echo "ncu stall $t rc=$?" | tee -a "$OUT/driver.log"
        "$PYTHON" - "$OUT/stall/ncu_$t.csv" "$t" <<'PY' | tee -a "$OUT/driver.log"
import csv, sys
from collections import defaultdict
lines = [ln for ln in open(sys.argv[1], errors="replace") if ln.startswith('"')]
kernels = defaultdict(dict)
for r in csv.DictReader(lines):
    kernels[(int(r["ID"]), r.get("Grid Size", ""))][r["Metric Name"]] = r["Metric Value"].replace(",", "")
for (i, grid), m in sorted(kernels.items()):
    g = lambda key: float(m.get(key, "nan"))
    stalls = " ".join(f"{k.split('stalled_')[1].split('_per')[0]}={float(v):.0f}" for k, v in sorted(m.items()) if "stalled" in k)
    print(f"{sys.argv[2]}: {i:2d} grid {grid:12s} {g('gpu__time_duration.sum') / 1e3:6.2f} us"
          f" dram {g('dram__bytes_read.sum') / 1e6:6.1f} MB L2 {g('lts__t_sectors_srcunit_tex_op_read.sum') * 32 / 1e6:6.1f} MB"
          f" hit {g('lts__t_sector_op_read_hit_rate.pct'):4.1f} % issue {g('smsp__issue_active.avg.pct_of_peak_sustained_active'):4.1f} % | {stalls}")
PY
    done ;;
rows)
    # halves's plain matmul against main's, interleaved with tinygemm and cuBLAS bf16 in one process
    # (bench/gpu_rows.sh, no gates: the halves call ran them), ncu at M = 1; then the stall probe.
    rm -rf /tmp/kept_main && cp -r "$root/engine_src" /tmp/kept_main && rm -rf /tmp/kept_main/build || exit 2
    rm -rf /tmp/halves && mkdir -p /tmp/halves && tar xzf .xfer/halves.tgz -C /tmp/halves || exit 2
    cp engine_src/bench/gpu_rows.sh /tmp/halves/engine_src/bench/ || exit 2
    (cd /tmp/halves/engine_src && KD_ROWS_QUICK="" KD_ROWS_NCU_M="1" timeout 170 bash bench/gpu_rows.sh "$OUT/r" /tmp/kept_main) 2>&1 \
        | tee "$OUT/driver_rows.log" | cut -c1-220
    tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$OUT/r"
    bash "$0" stall ;;
stall)
    # The halves call's stall probe (14 counters, many replay passes over the layer's weights) ran
    # past its 80 s; this one samples the warps' stall reasons instead (ncu's WarpStateStats
    # section, one pass) for the layer's seven w4_kernel launches at one token, main's tree.
    mkdir -p "$OUT/stall" && cd engine_src || exit 2
    (KD_BENCH_GPU_BUILD_ONLY=1 KD_BENCH_TORCH=0 KD_RESULTS_DIR=build/ab bash scripts/bench_gpu.sh) >"$OUT/stall/build.log" 2>&1 \
        || { tail -n 30 "$OUT/stall/build.log"; exit 1; }
    timeout 90 ncu --clock-control none --csv --page details --section WarpStateStats --section SpeedOfLight \
        -k 'regex:w4_kernel' --launch-count 7 build/ab/bench_gpu --moe 1 >"$OUT/stall/ncu_warp_state.csv" 2>&1
    echo "ncu warp state rc=$?" | tee "$OUT/driver.log"
    "$PYTHON" - "$OUT/stall/ncu_warp_state.csv" <<'PY' | tee -a "$OUT/driver.log"
import csv, sys
lines = [ln for ln in open(sys.argv[1], errors="replace") if ln.startswith('"')]
for r in csv.DictReader(lines):
    print(f"{r.get('ID')} {r.get('Grid Size', '')} | {r.get('Section Name', '')} | {r.get('Metric Name', '')} = {r.get('Metric Value', '')} {r.get('Metric Unit', '')}")
PY
    # DRAM throughput over the launch's time (ncu's PM sampling) of the graph path's w1/w3 and w2
    # (the 6th and 7th w4_kernel of --moe 1): a slow start or end against a slow middle.
    timeout 60 ncu --clock-control none --section PmSampling -k 'regex:w4_kernel' --launch-skip 5 --launch-count 2 \
        build/ab/bench_gpu --moe 1 >"$OUT/stall/ncu_pm_sampling.txt" 2>&1
    echo "ncu pm sampling rc=$?" | tee -a "$OUT/driver.log" ;;
pm)
    # The stall probes above ran past their time: ncu's sections replay a launch, saving and
    # restoring the device's memory, 78 GB with --moe's FP32 experts. --moe-int4 runs the same
    # INT4 launches without them. The sections' text from the saved reports (--print-details all).
    mkdir -p "$OUT/pm" && cd engine_src || exit 2
    (KD_BENCH_GPU_BUILD_ONLY=1 KD_BENCH_TORCH=0 KD_RESULTS_DIR=build/ab bash scripts/bench_gpu.sh) >"$OUT/pm/build.log" 2>&1 \
        || { tail -n 30 "$OUT/pm/build.log"; exit 1; }
    timeout 60 build/ab/bench_gpu --moe-int4 1 2>&1 | head -n 20 | tee "$OUT/driver.log"
    ncu --list-sections >"$OUT/pm/sections.txt" 2>&1
    grep -iE "pm|warp" "$OUT/pm/sections.txt" | tee -a "$OUT/driver.log"
    for sec in PmSampling WarpStateStats; do
        timeout 150 ncu --clock-control none --section "$sec" -k 'regex:w4_kernel' --launch-skip 5 --launch-count 2 \
            -o "$OUT/pm/$sec" build/ab/bench_gpu --moe-int4 1 >"$OUT/pm/$sec.log" 2>&1
        echo "ncu $sec rc=$?" | tee -a "$OUT/driver.log"
        ncu --import "$OUT/pm/$sec.ncu-rep" --page details --print-details all >"$OUT/pm/$sec.txt" 2>&1
        head -n 150 "$OUT/pm/$sec.txt" | cut -c1-200 | tee -a "$OUT/driver.log"
    done
    # Target 2: the expert shapes at 8 and 16 rows (112 blocks, 12-17 % of DRAM peak): issue-bound
    # or waiting? Their programs are small, so the sections replay quickly.
    for shape in "2048 7168 8" "7168 2048 16"; do
        name="e${shape##* }"
        # shellcheck disable=SC2086
        timeout 90 ncu --clock-control none --section WarpStateStats --section SpeedOfLight --section Occupancy \
            -k 'regex:w4_kernel' --launch-skip 3 --launch-count 1 build/ab/bench_gpu --only $shape \
            >"$OUT/pm/$name.txt" 2>&1
        echo "ncu $name rc=$?" | tee -a "$OUT/driver.log"
        grep -vE "^==(PROF|WARNING)==" "$OUT/pm/$name.txt" | head -n 80 | cut -c1-200 | tee -a "$OUT/driver.log"
    done ;;
*)
    echo "next_call.sh: unknown part '$1' (call, halves, rows, stall or pm)" >&2; exit 2 ;;
esac
