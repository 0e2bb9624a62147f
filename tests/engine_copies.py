"""Where the tests find nvcc, and how they copy engine_src/ to build it on their own."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine_src"


def cuda_home() -> Path | None:
    """The CUDA toolkit holding nvcc ($CUDA_HOME, /usr/local/cuda, or nvcc on PATH), or None."""
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home)
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parent.parent if nvcc else None


def engine_copy(folder: Path) -> Path:
    """A copy of engine_src/ in `folder` without its build, caches and bundles."""
    copy = folder / "engine_src"
    shutil.copytree(ENGINE, copy, ignore=shutil.ignore_patterns(
        "build", "__pycache__", "*.pyc", ".kdtree", "*.kdtr", "manifest.json"))
    return copy
