#!/usr/bin/env bash
# How far the engine bench's figures move between processes on the GPU machine, and what the
# redundant-forwards commit does to them (issue 23's detection, docs/gpu-reference/README.md):
#   bash docs/gpu-reference/bench-spread.sh OUTDIR [NIGHTS] [MIN_TIME_MS]
# from the repo root, on the GPU machine (no ssh: it runs the engine directly). Builds this tree's
# engine (CUDA) and a copy with benchmarks/history_acceptance.py's slowing commit applied, makes
# the bundles, then runs benchmarks/bench_estimators.py: NIGHTS (default 4) sets of fresh `kdtree
# bench` processes on three bundles (tiny_fp32, tiny2_int4, k2mini_fp32), each set with plain runs
# (one generation a run) and with runs of at least MIN_TIME_MS (default 200), base and slow.
# Writes OUTDIR/spread.log and OUTDIR/spread.json.
set -euo pipefail
out=$(realpath -m "${1:?usage: bench-spread.sh OUTDIR [NIGHTS] [MIN_TIME_MS]}")
nights=${2:-4}
min_time=${3:-200}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
work=${KD_SPREAD_WORK:-/opt/kd-spread}
rm -rf "$work"
mkdir -p "$work/base"
tar --exclude=./build --exclude='./tests/refs/model_*.kdtr' --exclude=./tests/refs/manifest.json -C engine_src -cf - . |
    tar -xf - -C "$work/base"
(cd "$work/base" && bash scripts/build.sh >"$out/build.log" 2>&1 && bash scripts/bundles.sh >>"$out/build.log" 2>&1)
cp -r "$work/base" "$work/slow"
python3 - "$work/slow" <<'PY'
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("acceptance", "benchmarks/history_acceptance.py")
acceptance = importlib.util.module_from_spec(spec)
spec.loader.exec_module(acceptance)
path, edits = acceptance.SLOWING_PATCH
source = Path(sys.argv[1]) / Path(path).relative_to("engine_src")
text = source.read_text()
for old, new in edits:
    assert text.count(old) == 1, f"{source}: the patch's anchor is not there once"
    text = text.replace(old, new)
source.write_text(text)
PY
(cd "$work/slow" && bash scripts/build.sh >>"$out/build.log" 2>&1)
python3 - "$work/base/tests/refs" <<'PY'
import json, sys
refs = sys.argv[1]
data = json.load(open(f"{refs}/manifest.json"))
data["bundles"] = [b for b in data["bundles"] if b["name"] in ("tiny_fp32", "tiny2_int4", "k2mini_fp32")]
json.dump(data, open(f"{refs}/manifest-spread.json", "w"))
PY
set -x
PYTHONUNBUFFERED=1 python3 benchmarks/bench_estimators.py --base "$work/base/build/kdtree" --slow "$work/slow/build/kdtree" \
    --manifest "$work/base/tests/refs/manifest-spread.json" --nights "$nights" --min-time-ms "$min_time" --configs plain5,auto5 \
    --metrics tiny_fp32.ar_decode_tokens_per_s,tiny2_int4.ar_decode_tokens_per_s,k2mini_fp32.ar_decode_tokens_per_s \
    --json "$out/spread.json" 2>&1 | tee "$out/spread.log"
# Which core the process runs on: the same plain bench pinned to four cores, PINNED_ROUNDS (2) times each (a tiny
# bundle's step is bound by the host's launches; a core that is slower for the whole process would
# show here as a figure that follows the core, not the moment).
set +x
command -v taskset >/dev/null || { echo "no taskset on this machine: the pinned runs are left out" | tee -a "$out/spread.log"; exit 0; }
for round in $(seq 1 "${PINNED_ROUNDS:-2}"); do
    for core in 0 5 10 15; do
        taskset -c "$core" "$work/base/build/kdtree" bench --manifest "$work/base/tests/refs/manifest-spread.json" \
            --out "$work/pinned.json" --budgets 4 --moe-tokens 1 --moe-experts 8 --repeats 5 >/dev/null
        python3 - "$work/pinned.json" "$round" "$core" <<'PY' | tee -a "$out/spread.log"
import json, statistics, sys
metrics = json.load(open(sys.argv[1]))["metrics"]
figures = ", ".join(f"{m} {statistics.median(metrics[m]['samples']):.0f}" for m in
                    ("tiny_fp32.ar_decode_tokens_per_s", "tiny2_int4.ar_decode_tokens_per_s", "k2mini_fp32.ar_decode_tokens_per_s"))
print(f"pinned round {sys.argv[2]} core {sys.argv[3]:>2}: median of 5 plain runs: {figures}")
PY
    done
done
