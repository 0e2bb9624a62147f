"""Writes tests/refs/manifest_tiny.json: the bundle manifest with the tiny bundles only (the
launch-bound models the decode-step benchmarks compare).

    python3 bench/tiny_manifest.py   (from engine_src/, after scripts/bundles.sh)
"""
import json

manifest = json.load(open("tests/refs/manifest.json"))
manifest["bundles"] = [b for b in manifest["bundles"] if b["name"].startswith("tiny")]
json.dump(manifest, open("tests/refs/manifest_tiny.json", "w"))
