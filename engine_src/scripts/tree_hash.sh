#!/usr/bin/env bash
# Prints the source tree hash of DIR (default: the engine folder): the sha256 of the
# `sha256sum` lines ("<hex>  <relative path>") of every regular file, sorted bytewise by path,
# followed, when the tree has symlinks, by a record `symlink <relative path>\0<target>\0` for each
# (sorted bytewise by path; the target as the link holds it, not followed), so retargeting a link
# changes the hash. It leaves out build/, .git/, .kdtree/, __pycache__/ (at any depth, as the sync
# excludes do), *.pyc, tests/refs/model_*.kdtr and tests/refs/manifest.json.
set -euo pipefail
dir="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
cd "$dir"
listed() {   # the relative paths of entries of find type $1 that the hash covers, NUL-separated, sorted
  find . \( -type d \( -name build -o -name .git -o -name .kdtree -o -name __pycache__ \) -prune \) -o \
         \( -type "$1" ! -name '*.pyc' ! -path './tests/refs/model_*.kdtr' ! -path './tests/refs/manifest.json' \
            -printf '%P\0' \) | LC_ALL=C sort -z
}
{
  listed f | xargs -0 -r sha256sum --
  listed l | while IFS= read -r -d '' link; do
    printf 'symlink %s\0' "$link"
    readlink -z -- "$link"
  done
} | sha256sum | cut -d' ' -f1
