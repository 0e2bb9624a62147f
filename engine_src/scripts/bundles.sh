#!/usr/bin/env bash
# Regenerate the reference bundles and check them against the committed expected manifest.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" python/gen_model.py --out tests/refs --check tests/refs/expected_manifest.json
