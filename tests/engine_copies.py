"""Where the tests find nvcc, how they copy engine_src/ to build it on their own, and the
session's CPU build that the whole-pipeline tests start from."""
from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class CpuBuild:
    """A copy of engine_src/ (`tree`) built for the CPU backend by its scripts/build.sh: its objects
    (build/obj/, with the dependency files naming what each was compiled from) and binaries."""

    tree: Path

    @staticmethod
    def env() -> dict[str, str]:
        """This environment as a host's build step sees it for a CPU build: KD_BACKEND=cpu, and no
        variable of ours that would change the build key (compiler, arch, sanitizer, cache size)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KD_") and k != "CXX"}
        return {**env, "KD_BACKEND": "cpu"}

    def seed(self, remote_dir: Path) -> None:
        """Give `remote_dir`, a deployment of the same tree that the orchestrator made (it refuses a
        non-empty remote_dir without its marker), this build's objects and generated header (file
        times kept), as an earlier compile there would have left them, but no binary and no
        build cache: its build step runs build.sh, which compiles nothing (a changed source
        still compiles, --no-cache everything) and links the binaries."""
        marker = remote_dir / ".kdtree" / "marker"
        assert marker.is_file(), f"{remote_dir} is no deployment of the orchestrator's (no {marker}): sync it first"
        for part in ("obj", "gen"):
            shutil.copytree(self.tree / "build" / part, remote_dir / "build" / part, symlinks=True, dirs_exist_ok=True)

    def copy_build_to(self, tree: Path) -> None:
        """Put this build's whole build/ (objects, binaries, cache) into `tree`, a copy of the same
        sources: its next build compiles only what changed since (file times are kept)."""
        shutil.copytree(self.tree / "build", tree / "build", symlinks=True, dirs_exist_ok=True)
