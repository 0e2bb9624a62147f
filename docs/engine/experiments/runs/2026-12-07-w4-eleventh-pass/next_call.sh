#!/usr/bin/env bash
# The device calls of issue 38 after the eleventh pass (run in the twelfth pass), from the checkout's
# root on the GPU host:
#   bash next_call.sh rows      # ~150 s: this tree's matmul against its variants, bench/gpu_rows.sh
#   bash next_call.sh moe       # ~250 s: the K2 MoE layer, main against sumrel, bench/gpu_moe_ab.sh
#   bash next_call.sh validate  # ~420 s: docs/gpu-reference/reproduce.sh OUT/rec wide
# "rows" needs the octet tree of the eleventh pass unpacked at /tmp/oct (`.xfer/oct.tgz`: main
# 319fcdb's engine_src with engine_src/bench/experiments/w4_token_octets.patch applied, made by
#   mkdir -p /tmp/o && git archive 319fcdb engine_src | tar x -C /tmp/o &&
#   (cd /tmp/o && git apply /work/main/engine_src/bench/experiments/w4_token_octets.patch) &&
#   tar czf .xfer/oct.tgz -C /tmp/o engine_src
# ) and makes each variant from a copy of a tree by exact text edits, failing on a missing anchor:
#   oct2b  the octets at two blocks per SM at 16 rows, with the index fetch there (no spill on
#          sm_90: 126 / 128 registers), the eleventh pass's twoblk without its 8-byte spill;
#   nows   this tree with the split-K workspace stored for the pass's first token only (the
#          other tokens' values still computed): the time the workspace's stores cost at 2-16 rows;
#   nosum  this tree without the split-K sum's launch: what that launch costs.
# nows and nosum give wrong results (their op tests fail): timing only. "moe" makes
#   sumrel  this tree with w4_sum_kernel releasing the launch after it (griddepcontrol
#           .launch_dependents) before its own wait instead of after: moe_ffn's w2 blocks may then
#           become resident, and fetch their first weights (W4Params::early), while w1/w3 drains
#           rather than after it. The same results, bit for bit; what it may gain is w2's ramp
#           at one token (target 3).
# and runs bench/gpu_moe_ab.sh from it against main: 9 rounds of --moe-only, op tests, memcheck,
# run_tests.sh on sumrel, ncu of the layer's kernels. Lands in $OUT/r.tgz (moe: $OUT/m.tgz),
# $OUT/driver.log, and for validate $OUT/rec/ and $OUT/reproduce.log.
set -uo pipefail
root="$PWD"
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export PYTHON="${KD_TORCH_PYTHON:-/opt/torch/.venv/bin/python3}"
core=src/cuda/w4a16_core.cuh
# edit TREE OLD NEW: replace the one occurrence of OLD in TREE's w4a16_core.cuh.
edit() {
    "$PYTHON" - "$1/$core" "$2" "$3" <<'EOF' || exit 2
import sys
path, old, new = sys.argv[1:]
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f"edit: {s.count(old)} occurrences in {path} of: {old}")
open(path, "w").write(s.replace(old, new))
EOF
}
variant() {  # variant NAME FROM: a copy of FROM's engine_src at /tmp/NAME/engine_src
    rm -rf "/tmp/$1" && mkdir -p "/tmp/$1" && cp -r "$2" "/tmp/$1/engine_src" && rm -rf "/tmp/$1/engine_src/build"
}
case "${1:?usage: next_call.sh rows|moe|validate}" in
rows)
    [[ -d /tmp/oct/engine_src ]] || { echo "next_call.sh: no octet tree at /tmp/oct (tar xzf .xfer/oct.tgz -C /tmp/oct)" >&2; exit 2; }
    variant oct2b /tmp/oct/engine_src
    edit /tmp/oct2b/engine_src "__launch_bounds__(KD_W4_THREADS, Q >= 2 ? 1 : 2)" "__launch_bounds__(KD_W4_THREADS, Q >= 4 ? 1 : 2)"
    edit /tmp/oct2b/engine_src "constexpr bool IDX = w4_full_steps_here(Q);" "constexpr bool IDX = w4_full_steps_here(Q) || Q == 2;"
    variant nows "$root/engine_src"
    edit /tmp/nows/engine_src "            if (tok >= m_count) continue;
            // A 32-bit index" "            if (tok >= m_count || (tok > 0 && part[q][0] != 1234.5f)) continue;  // ABLATION: token 0 only
            // A 32-bit index"
    variant nosum "$root/engine_src"
    edit /tmp/nosum/engine_src "        launch_chained(\"w4_sum_kernel launch\", sum," "        if (p.M < 0) launch_chained(\"w4_sum_kernel launch\", sum,"
    cp -r "$root/engine_src" /tmp/kept_main && rm -rf /tmp/kept_main/build
    cd "$root/engine_src" || exit 2
    KD_ALLOW_SPILLS=1 KD_ROWS_GATES=memcheck KD_ROWS_QUICK="kept this oct2b" KD_ROWS_NCU_M="4 16" timeout 400 \
        bash bench/gpu_rows.sh "$OUT/r" /tmp/kept_main oct=/tmp/oct/engine_src oct2b=/tmp/oct2b/engine_src \
        nows=/tmp/nows/engine_src nosum=/tmp/nosum/engine_src 2>&1 | tee "$OUT/driver.log" | cut -c1-220
    tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$OUT/r" ;;
moe)
    variant sumrel "$root/engine_src"
    edit /tmp/sumrel/engine_src "__global__ void w4_sum_kernel(W4Params p) {
    chain_acquire();
    chain_release();" "__global__ void w4_sum_kernel(W4Params p) {
    chain_release();
    chain_acquire();"
    cp -r "$root/engine_src" /tmp/kept_main && rm -rf /tmp/kept_main/build
    cd /tmp/sumrel/engine_src || exit 2
    KD_MOE_AB_ROUNDS=9 KD_MOE_AB_GATES=this timeout 500 bash bench/gpu_moe_ab.sh "$OUT/m" /tmp/kept_main 2>&1 \
        | tee "$OUT/driver.log" | cut -c1-220
    tar czf "$OUT/m.tgz" -C "$OUT" m && rm -rf "$OUT/m" ;;
validate)
    timeout 560 bash docs/gpu-reference/reproduce.sh "$OUT/rec" wide >"$OUT/reproduce.log" 2>&1
    echo "reproduce rc=$?"
    tail -n 30 "$OUT/reproduce.log" | cut -c1-250 ;;
*)
    echo "next_call.sh: unknown part '$1' (rows, moe or validate)" >&2; exit 2 ;;
esac
