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
case "${1:?usage: next_call.sh call}" in
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
*)
    echo "next_call.sh: unknown part '$1' (call)" >&2; exit 2 ;;
esac
