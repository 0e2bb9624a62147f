#!/usr/bin/env python3
"""Rewrite a KDTR bundle in another format version (1 or 2), same header and tensors.

    python/kdtr_convert.py SRC DST [--version 2]

The source is read and fully checked first; prints the destination's identity (the manifest's
`sha256`: version 1 the file's sha256, version 2 the bundle digest). Exit 1 naming the file on a
bad source.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kdtree_ref import kdtr  # noqa: E402


def convert(src, dst, version: int) -> str:
    """Write SRC's header and tensors to DST as format `version`; returns DST's identity."""
    b = kdtr.read(src)
    meta = {k: b.header[k] for k in ("config", "quant", "drafter", "prompt", "golden")}
    return kdtr.write(dst, meta, {name: b.tensors[name] for name in b.tensors}, version)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--version", type=int, choices=kdtr.VERSIONS, default=2)
    args = parser.parse_args(argv)
    try:
        print(convert(args.src, args.dst, args.version))
    except kdtr.KdtrError as err:
        print(f"kdtr_convert: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
