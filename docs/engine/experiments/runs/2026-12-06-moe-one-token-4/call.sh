#!/usr/bin/env bash
# One device call of issue 38's fourth MoE pass: the MoE layer of this tree (and VARIANTS,
# NAME=FOLDER engine trees) against the checkout's engine_src (main's) with bench/gpu_moe_ab.sh,
# then (after the A/B, not during it) k2wide's INT4 bundle written and benchmarked by
# scripts/bench.sh end to end (AR and DDTree at every default budget, the GPU kernel table,
# big_bundle_metrics.py). Everything lands in $OUT/call.tgz (the device returns at most 8 files).
#   bash call.sh ROUNDS [NAME=FOLDER ...]   (from the checkout's root; this tree at /tmp/this)
# env: KD_GATES (the trees run_tests.sh runs on, default this), KD_K2WIDE=0 (no k2wide bench),
# KD_AB_S / KD_BENCH_S (time limits of the A/B and of bench.sh, seconds); KD_MOE_AB_OWN_BENCH as
# gpu_moe_ab.sh takes it.
set -uo pipefail
root="$PWD"
this=/tmp/this/engine_src
res=/tmp/res
mkdir -p "$res"
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
rounds="$1"; shift
t0=$SECONDS
pack() { tar czf "$OUT/call.tgz" -C "$res" . ; cp "$res/driver.log" "$OUT/driver.log" 2>/dev/null; }
trap pack EXIT
{
    echo "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
    echo "kept: $root/engine_src ($(git -C "$root" log -1 --format=%h 2>/dev/null))"
    (cd "$this" && KD_MOE_AB_ROUNDS="$rounds" KD_MOE_AB_GATES="${KD_GATES:-this}" KD_MOE_AB_TESTS_S=200 \
        timeout "${KD_AB_S:-260}" bash bench/gpu_moe_ab.sh "$res/ab" "$root/engine_src" "$@")
    echo "A/B rc=$? ($((SECONDS - t0)) s)"
    pack
    if [[ "${KD_K2WIDE:-1}" == 1 ]]; then
        cd "$this" || exit 2
        timeout 120 nice python3 python/gen_model.py --out /tmp/k2all --configs k2wide >"$res/gen.log" 2>&1
        echo "gen_model k2wide rc=$? ($((SECONDS - t0)) s)"
        # The INT4 bundle alone (the fp32 twin's figures are not asked for): a manifest of its entry.
        mkdir -p /tmp/k2
        ln -sf /tmp/k2all/model_k2wide_int4.kdtr /tmp/k2/
        python3 - <<'PY'
import json
m = json.load(open("/tmp/k2all/manifest.json"))
m["bundles"] = [b for b in m["bundles"] if b["config"] == "k2wide" and b["quant"] == "int4"]
json.dump(m, open("/tmp/k2/manifest.json", "w"), indent=1)
need = max(b["needs"]["ram_bytes"] for b in m["bundles"])
open("/tmp/k2/max_memory", "w").write(str(need))
PY
        KD_BENCH_TORCH=0 KD_BUNDLE_DIR=/tmp/k2 KD_RESULTS_DIR=/tmp/res/bench KD_MAX_MEMORY="$(cat /tmp/k2/max_memory)" \
            timeout "${KD_BENCH_S:-230}" bash scripts/bench.sh >"$res/bench.log" 2>&1
        echo "bench.sh k2wide rc=$? ($((SECONDS - t0)) s)"
        grep -E "k2wide|ddtree budget|read ceiling" "$res/bench.log" | grep -v kdtree-progress | head -n 30
    fi
} 2>&1 | tee "$res/driver.log"
