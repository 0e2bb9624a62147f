#!/usr/bin/env bash
# Runs the engine in AR and DDTree mode on every bundle of the manifest ($KD_BUNDLE_DIR, default
# tests/refs) and writes $KD_RESULTS_DIR/outputs.json (default build/; README, "Result files").
# The token count is each bundle's golden length; the golden tokens themselves are never read.
# Builds and regenerates bundles when missing, unless KD_NO_BUILD is set (then they must exist).
#   KD_BUDGET (default 16) and KD_BLOCK (default: the bundle's drafter block) shape the tree.
#   KD_MAX_MEMORY (bytes, default the engine's 4 GiB): --max-memory, what one bundle may ask for.
set -euo pipefail
engine="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$engine"
refs="${KD_BUNDLE_DIR:-tests/refs}"   # where scripts/bundles.sh writes the bundles
results="${KD_RESULTS_DIR:-build}"
if [[ -n "${KD_NO_BUILD:-}" ]]; then
    for f in build/kdtree "$refs/manifest.json"; do
        [[ -e "$f" ]] || { echo "generate.sh: $f is missing and KD_NO_BUILD is set (build and regenerate first)" >&2; exit 2; }
    done
fi
[[ -x build/kdtree ]] || bash scripts/build.sh
[[ -f "$refs/manifest.json" ]] || bash scripts/bundles.sh
mkdir -p "$results"
flags=(--manifest "$refs/manifest.json" --out "$results/outputs.json" --budget "${KD_BUDGET:-16}")
[[ -n "${KD_BLOCK:-}" ]] && flags+=(--block "$KD_BLOCK")
[[ -n "${KD_MAX_MEMORY:-}" ]] && flags+=(--max-memory "$KD_MAX_MEMORY")
build/kdtree outputs "${flags[@]}"
