#!/usr/bin/env bash
# The next device call of issue 38 after the twelfth pass (built, not run), from the checkout's
# root on the GPU host (about 200 s):
#   mkdir -p /tmp/tail && tar xzf .xfer/tail.tgz -C /tmp/tail && bash next_call.sh
# `.xfer/tail.tgz` is main's engine_src with engine_src/bench/experiments/w4_split_k_tail.patch
# applied, made on the checkout's machine by
#   rm -rf /tmp/t && mkdir -p /tmp/t && git archive HEAD engine_src | tar x -C /tmp/t &&
#   (cd /tmp/t && git apply /work/main/engine_src/bench/experiments/w4_split_k_tail.patch) &&
#   tar czf .xfer/tail.tgz -C /tmp/t engine_src
# (carry [".xfer"]). The tail tree sums the split-K super-chunks of a plain matmul inside the
# streaming launch where every warp has one tile (the K2 expert's shapes at 1-16 rows): the last
# of a tile's n_sc warps adds them, in w4_sum_kernel's order, and w4_sum_kernel's launch goes.
# The twelfth pass's `nosum` bounds what it can win: 1.13-1.26x on the expert shapes.
# `tailnr` is the tail tree without the re-read of a warp's first step after its last tile when
# the tail sums (made here by an exact text edit): whether that load, in flight at the fence,
# costs the fence its time. No spill on sm_90 (sm_120 spills 8-24 bytes: timing on sm_90 only).
# bench/gpu_rows.sh runs from the tail tree ("this") and tailnr against main ("kept"): the op tests,
# interleaved timings with tinygemm and cuBLAS bf16 and bit equality with main at every M,
# bench_gpu --quick of both, memcheck and run_tests.sh of both, ncu at 1 and 16 rows.
# Lands in $OUT/r.tgz and $OUT/driver.log.
set -uo pipefail
root="$PWD"
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export PYTHON="${KD_TORCH_PYTHON:-/opt/torch/.venv/bin/python3}"
[[ -d /tmp/tail/engine_src ]] || { echo "next_call.sh: no tail tree at /tmp/tail (tar xzf .xfer/tail.tgz -C /tmp/tail)" >&2; exit 2; }
rm -rf /tmp/tailnr && mkdir -p /tmp/tailnr && cp -r /tmp/tail/engine_src /tmp/tailnr/ && rm -rf /tmp/tailnr/engine_src/build
"$PYTHON" - /tmp/tailnr/engine_src/src/cuda/w4a16_core.cuh <<'PY' || exit 2
import sys
path = sys.argv[1]
old = "                    cur = fetch(last_b ? 0 : st + 2, std::false_type{});"
new = "                    if (!(last_b && p.tail_ctr && next >= n_tiles)) cur = fetch(last_b ? 0 : st + 2, std::false_type{});"
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f"edit: {s.count(old)} occurrences in {path} of: {old}")
open(path, "w").write(s.replace(old, new))
PY
cp -r "$root/engine_src" /tmp/kept_main && rm -rf /tmp/kept_main/build
cd /tmp/tail/engine_src || exit 2
KD_ROWS_GATES=1 KD_ROWS_QUICK="kept this tailnr" KD_ROWS_NCU_M="1 16" timeout 500 \
    bash bench/gpu_rows.sh "$OUT/r" /tmp/kept_main tailnr=/tmp/tailnr/engine_src 2>&1 | tee "$OUT/driver.log" | cut -c1-220
tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$OUT/r"
