"""Where the tests find nvcc, how they copy engine_src/ to build it on their own, and what the
session makes once for the tests that start from it: the CPU build and the reference bundles."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

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


@dataclasses.dataclass(frozen=True)
class ReferenceBundles:
    """The engine's bundles and manifest in `folder`, made by the generator whose input hash
    (`scripts/tree_hash.sh python`, the orchestrator's bundles key) is `key`."""

    folder: Path
    key: str

    @classmethod
    def generate(cls, out: Path, run: Callable[..., subprocess.CompletedProcess]) -> "ReferenceBundles":
        """engine_src's bundles generated into `out` by its scripts/bundles.sh with this interpreter;
        `run(args, cwd=, env=, timeout=)` runs the command and captures its output."""
        env = {**os.environ, "PYTHON": sys.executable, "KD_BUNDLE_DIR": str(out), "OPENBLAS_NUM_THREADS": "1",
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = run(["bash", "scripts/bundles.sh"], cwd=ENGINE, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return cls(out, cls.key_of(ENGINE))

    @staticmethod
    def key_of(engine: Path) -> str:
        """The orchestrator's bundles key of an engine tree: the hash of its generator's inputs."""
        return subprocess.run(["bash", "scripts/tree_hash.sh", "python"], cwd=engine, capture_output=True, text=True,
                              check=True).stdout.split()[-1]

    def copy_to(self, folder: Path) -> None:
        """Put the bundles and manifest into `folder` (an engine copy's tests/refs, or a cache entry)."""
        folder.mkdir(parents=True, exist_ok=True)
        for path in self.folder.iterdir():
            shutil.copy2(path, folder / path.name)

    def seed_local_cache(self, root: Path, engine: Path) -> None:
        """Put the bundles into the local bundle cache of the inventories in `root` (the pipeline's
        build/local-bundles/<key>), as an earlier run would have left them, when `engine`'s
        generator is the one that made them: their runs then skip this machine's regeneration
        (the hosts still regenerate theirs)."""
        if self.key_of(engine) == self.key:
            self.copy_to(root / "build" / "local-bundles" / self.key)
