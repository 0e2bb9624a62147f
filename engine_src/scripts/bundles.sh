#!/usr/bin/env bash
# Regenerate the reference bundles and their manifest with $PYTHON, into $KD_BUNDLE_DIR
# (default tests/refs). Whether they match the committed expected manifest is checked by the
# tests and by the orchestrator's golden step, which report where they differ;
# `python/gen_model.py --check tests/refs/expected_manifest.json` checks by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
# KD_CONFIGS (space-separated config names): those configs' bundles instead of the default run's.
configs=()
if [[ -n "${KD_CONFIGS:-}" ]]; then read -r -a configs <<<"$KD_CONFIGS"; configs=(--configs "${configs[@]}"); fi
"${PYTHON:-python3}" python/gen_model.py --out "${KD_BUNDLE_DIR:-tests/refs}" "${configs[@]}"
