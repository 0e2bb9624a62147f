#!/usr/bin/env bash
# Prints the source tree hash of DIR (default: the engine folder): the sha256 of the
# `sha256sum` lines ("<hex>  <relative path>") of every regular file, sorted bytewise by path,
# leaving out build/, .git/, .kdtree/, __pycache__/ (at any depth, as the sync excludes do),
# *.pyc, tests/refs/model_*.kdtr and tests/refs/manifest.json.
set -euo pipefail
dir="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
cd "$dir"
find . \( -type d \( -name build -o -name .git -o -name .kdtree -o -name __pycache__ \) -prune \) -o \
       \( -type f ! -name '*.pyc' ! -path './tests/refs/model_*.kdtr' ! -path './tests/refs/manifest.json' -printf '%P\0' \) |
    LC_ALL=C sort -z |
    xargs -0 -r sha256sum -- |
    sha256sum | cut -d' ' -f1
