#!/usr/bin/env bash
# Issue 23's detection test on the GPU machine, as an ssh host of itself (lab.sh):
#   bash docs/gpu-reference/history-detection.sh OUTDIR [QUIET_RUNS] [MIN_TIME_MS] [TARGET]
# from the repo root (with .debs/ and .whl/, see lab.sh). benchmarks/history_acceptance.py's
# detection part against the host h200: QUIET_RUNS (default 5: the night after the commit is
# judged by the history rule) nightlies of the unchanged tree into a fresh history, then a commit in
# the scratch engine history that makes AR decoding 15 % slower (3 of every 17 steps' forward pass
# run twice: 17.65 % more work per decoded token, as on the CPU), then one nightly, which must flag
# TARGET (default k2mini_fp32.ar_decode_tokens_per_s: a step the GPU spends its time on; a tiny
# bundle's 0.5 ms step is bound by the host's launches, where the commit did not show) on the
# first night after it. Steps sync, build, bundles, bench; the bench is the engine's own (`kdtree
# bench`, 5 repeats of at least MIN_TIME_MS each, default 200; 16 experts in the MoE layer), without
# the GPU kernel benchmarks, to fit the device time. Writes OUTDIR/detection.log and
# OUTDIR/detection.json.
set -euo pipefail
out=$(realpath -m "${1:?usage: history-detection.sh OUTDIR [QUIET_RUNS]}")
quiet=${2:-5}
min_time=${3:-200}
target=${4:-k2mini_fp32.ar_decode_tokens_per_s}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
# shellcheck source=docs/gpu-reference/lab.sh
. docs/gpu-reference/lab.sh

# The scratch history clones a git repository: this tree, committed once into a repository of
# its own (the copy that reaches the device is not one, or is inside another).
src="$lab/src"
rm -rf "$src" "$lab/history"
mkdir -p "$src"
tar --exclude=./.git --exclude=./.debs --exclude=./.whl --exclude=./.deploy --exclude=./runs \
    --exclude=./engine_src/build --exclude='./engine_src/tests/refs/model_*.kdtr' -cf - . | tar -xf - -C "$src"
git -C "$src" init -q
git -C "$src" -c user.email=bench@example.invalid -c user.name="history acceptance" add -A
git -C "$src" -c user.email=bench@example.invalid -c user.name="history acceptance" commit -qm "the tree under test"

set -x
PYTHONUNBUFFERED=1 python3 "$src/benchmarks/history_acceptance.py" --parts detection --host h200 \
    --inventory "$inv" --quiet-runs "$quiet" --steps sync,build,bundles,bench --target "$target" \
    --bench-command "mkdir -p \"\${KD_RESULTS_DIR:-build}\" && build/kdtree bench --manifest \"\${KD_BUNDLE_DIR:-tests/refs}/manifest.json\" --out \"\${KD_RESULTS_DIR:-build}/bench.json\" --budgets 4,16 --moe-tokens 1 --moe-experts 16 --repeats 5 --min-time-ms $min_time" \
    --work-dir "$lab/history" --json "$out/detection.json" 2>&1 | tee "$out/detection.log"
