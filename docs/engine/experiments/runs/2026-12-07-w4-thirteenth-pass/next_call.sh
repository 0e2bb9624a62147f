#!/usr/bin/env bash
# The device calls of issue 38's thirteenth pass, from the checkout's root on the GPU host:
#   bash next_call.sh rows      # ~100 s: this tree against main, bench/gpu_rows.sh (run: call 2)
#   bash next_call.sh tailq     # ~210 s: the tail at 1-16 rows with the rows' loads together
#                               #   (run: runs/2026-12-07-moe-block-tail/call3)
#   bash next_call.sh moe       # ~250 s: the K2 MoE layer with its grouped sums by each tile's last
#                               #   block, and without the sum launches (bound), against main
#                               #   (run: runs/2026-12-07-moe-block-tail/call1)
#   bash next_call.sh validate  # ~460 s: docs/gpu-reference/reproduce.sh OUT/rec wide (run: docs/gpu-reference/2026-12-07d)
# "rows" needs main's engine_src from before the tail landed unpacked at /tmp/kept_main
# (`.xfer/main.tgz`, made by `git archive HEAD engine_src | gzip > .xfer/main.tgz` then; carry
# [".xfer"]). This tree has the split-K sum by each tile's last warp in an instantiation of its
# own, w4_kernel<1, false, true>, for plain launches of at most 4 rows (the call before measured it
# at every row count: slower from 8 rows, and its registers cost the other launches). It runs
# twice, as "this" and "again" (a copy), for the spread of the expert shapes' interleaved timings:
# the op tests, the timings with tinygemm and cuBLAS bf16, bit equality with main at every M,
# bench_gpu --quick of main and this tree, memcheck of both. run_tests ran in a call of its own.
# "tailq" needs the tree of engine_src/bench/experiments/w4_split_k_tail_rows_together.patch
# unpacked at /tmp/tailq (`.xfer/tailq.tgz`, made on the checkout's machine by
#   rm -rf /tmp/t && mkdir -p /tmp/t && git archive HEAD engine_src | tar x -C /tmp/t &&
#   (cd /tmp/t && git apply "$PWD/engine_src/bench/experiments/w4_split_k_tail_rows_together.patch") &&
#   tar czf .xfer/tailq.tgz -C /tmp/t engine_src
# from the checkout's root): the tail for plain launches of 1-16 rows (w4_kernel<Q, false, true>,
# Q = 1, 2, 4), run after the tile loop, where the loop's registers are free, with every row's
# loads in flight before the first addition (call 1's tail summed row after row and lost at 8
# and 16 rows). It runs from tailq as "this" against the checkout's tree (the landed tail) as
# "kept", with every gate: op tests, bit equality at every M, bench_gpu --quick, memcheck,
# run_tests.sh.
# "moe" (added by the session after, record 2026-12-07-moe-block-tail.md) needs the tree of
# engine_src/bench/experiments/w4_grouped_block_tail.patch unpacked at /tmp/moebt (`.xfer/moebt.tgz`,
# made as tailq's with that patch): grouped launches of one pass of one quad under the block
# ticket (the MoE layer at 1-4 tokens on sm_90) sum their super-chunks in the streaming launch,
# each tile's last block after one fence per thread, and the op tests gain two split-K MoE
# shapes. It runs as "this" against the checkout's tree ("kept") beside "nosum", the checkout's
# tree without the grouped launches' sum launches (an exact text edit, failing on a missing
# anchor): its results are wrong (w2 reads h that no sum wrote), timing only, the bound on what
# any sum inside the grouped launches can win for target 3, as the twelfth pass's nosum was for
# the plain matmul. bench/gpu_moe_ab.sh, 5 rounds, run_tests.sh on "this" only.
# Lands in $OUT/r.tgz ($OUT/m.tgz for moe), $OUT/driver.log, and for validate $OUT/rec/ and
# $OUT/reproduce.log.
set -uo pipefail
root="$PWD"
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export PYTHON="${KD_TORCH_PYTHON:-/opt/torch/.venv/bin/python3}"
case "${1:?usage: next_call.sh rows|tailq|moe|validate}" in
rows)
    rm -rf /tmp/kept_main /tmp/again && mkdir -p /tmp/kept_main /tmp/again || exit 2
    tar xzf .xfer/main.tgz -C /tmp/kept_main --strip-components=1 || exit 2
    cp -r "$root/engine_src" /tmp/again/ && rm -rf /tmp/again/engine_src/build
    cd "$root/engine_src" || exit 2
    KD_ROWS_GATES=memcheck KD_ROWS_QUICK="kept this" KD_ROWS_NCU_M="" timeout 400 \
        bash bench/gpu_rows.sh "$OUT/r" /tmp/kept_main again=/tmp/again/engine_src 2>&1 | tee "$OUT/driver.log" | cut -c1-220
    tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$OUT/r" ;;
tailq)
    [[ -d /tmp/tailq/engine_src ]] || { echo "next_call.sh: no tailq tree at /tmp/tailq (tar xzf .xfer/tailq.tgz -C /tmp/tailq)" >&2; exit 2; }
    rm -rf /tmp/kept_main && cp -r "$root/engine_src" /tmp/kept_main && rm -rf /tmp/kept_main/build
    cd /tmp/tailq/engine_src || exit 2
    KD_ROWS_GATES=1 KD_ROWS_QUICK="kept this" KD_ROWS_NCU_M="" timeout 500 \
        bash bench/gpu_rows.sh "$OUT/r" /tmp/kept_main 2>&1 | tee "$OUT/driver.log" | cut -c1-220
    tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$OUT/r" ;;
moe)
    [[ -d /tmp/moebt/engine_src ]] || { echo "next_call.sh: no moe tree at /tmp/moebt (tar xzf .xfer/moebt.tgz -C /tmp/moebt)" >&2; exit 2; }
    rm -rf /tmp/kept_main /tmp/moenosum && mkdir -p /tmp/moenosum || exit 2
    cp -r "$root/engine_src" /tmp/kept_main && rm -rf /tmp/kept_main/build
    cp -r "$root/engine_src" /tmp/moenosum/ && rm -rf /tmp/moenosum/engine_src/build
    "$PYTHON" - /tmp/moenosum/engine_src/src/cuda/w4a16_core.cuh <<'PY' || exit 2
import sys
path = sys.argv[1]
old = "    if (p.n_sc > 1 && !tailed) {"
new = "    if (p.n_sc > 1 && !tailed && !p.slot_expert) {  // ABLATION: no grouped sums"
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f"edit: {s.count(old)} occurrences in {path} of: {old}")
open(path, "w").write(s.replace(old, new))
PY
    cd /tmp/moebt/engine_src || exit 2
    KD_MOE_AB_ROUNDS=5 KD_MOE_AB_GATES=this timeout 540 bash bench/gpu_moe_ab.sh "$OUT/m" /tmp/kept_main \
        nosum=/tmp/moenosum/engine_src 2>&1 | tee "$OUT/driver.log" | cut -c1-220
    tar czf "$OUT/m.tgz" -C "$OUT" m && rm -rf "$OUT/m" ;;
validate)
    timeout 580 bash docs/gpu-reference/reproduce.sh "$OUT/rec" wide >"$OUT/reproduce.log" 2>&1
    echo "reproduce rc=$?"
    tail -n 30 "$OUT/reproduce.log" | cut -c1-250 ;;
*)
    echo "next_call.sh: unknown part '$1' (rows, tailq, moe or validate)" >&2; exit 2 ;;
esac
