"""Expected manifests for the bundle tests (tests/resources/test_bundle_needs.py and the Slurm
tests): bundles with declared needs in a source tree's tests/refs/expected_manifest.json."""
from __future__ import annotations

import json
from pathlib import Path

GB = 10**9


def needs(disk=GB // 100, ram=GB // 10, gpu=GB // 2) -> dict:
    """A bundle's declared needs in bytes (disk, RAM of one engine process, GPU memory)."""
    return {"disk_bytes": disk, "ram_bytes": ram, "gpu_bytes": gpu}


def write_manifest(source: Path, **bundles: dict) -> None:
    """The source tree's expected manifest: one bundle per keyword (name = CONFIG_QUANT) with these
    needs (None: none declared, as a manifest written before they existed)."""
    entries = [{"name": name, "file": f"model_{name}.kdtr", "config": name.rsplit("_", 1)[0],
                "quant": name.rsplit("_", 1)[1], "prompt": [1], "golden": [2], **({"needs": value} if value else {})}
               for name, value in bundles.items()]
    (source / "tests/refs/expected_manifest.json").write_text(json.dumps({"version": 1, "bundles": entries}))
