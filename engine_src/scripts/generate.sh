#!/usr/bin/env bash
# Runs the engine in AR and DDTree mode on every bundle of the manifest ($KD_BUNDLE_DIR, default
# tests/refs) and writes build/outputs.json (README, "Result files"). The token count is each
# bundle's golden length; the golden tokens themselves are never read. Builds and regenerates
# bundles when missing.
#   KD_BUDGET (default 16) and KD_BLOCK (default: the bundle's drafter block) shape the tree.
set -euo pipefail
engine="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$engine"
[[ -x build/kdtree ]] || bash scripts/build.sh
refs="${KD_BUNDLE_DIR:-tests/refs}"   # where scripts/bundles.sh writes the bundles
[[ -f "$refs/manifest.json" ]] || bash scripts/bundles.sh
flags=(--manifest "$refs/manifest.json" --out build/outputs.json --budget "${KD_BUDGET:-16}")
[[ -n "${KD_BLOCK:-}" ]] && flags+=(--block "$KD_BLOCK")
build/kdtree outputs "${flags[@]}"
