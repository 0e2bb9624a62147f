"""The CUDA engine compiles and links for the production arch (sm_120) and the H200 (sm_90) on a
machine with nvcc, whether or not it has a GPU or the cuBLAS headers (CI has neither), so a CUDA
compile error cannot land. Both builds run once per session in a copy of engine_src/."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine_src"
ARCHES = ("sm_120", "sm_90")


def _cuda_home() -> Path | None:
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home)
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parent.parent if nvcc else None


CUDA_HOME = _cuda_home()
pytestmark = pytest.mark.skipif(CUDA_HOME is None, reason="nvcc not found (no CUDA_HOME/bin/nvcc, none on PATH)")


@pytest.fixture(scope="session")
def cuda_builds(tmp_path_factory):
    """arch -> (completed build.sh process, `kdtree --version` output, build dir copy)."""
    results = {}
    for arch in ARCHES:
        tree = tmp_path_factory.mktemp(f"engine_{arch}")
        shutil.copytree(ENGINE, tree, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("build", "__pycache__", "*.kdtr", ".kdtree"))
        env = dict(os.environ, KD_BACKEND="cuda", KD_ARCH=arch, CUDA_HOME=str(CUDA_HOME),
                   PATH=f"{CUDA_HOME / 'bin'}:{os.environ.get('PATH', '')}")
        build = subprocess.run(["bash", "scripts/build.sh"], cwd=tree, env=env, capture_output=True, text=True,
                               timeout=400)
        results[arch] = (build, tree)
    return results


@pytest.mark.parametrize("arch", ARCHES)
def test_cuda_engine_compiles_and_links(cuda_builds, arch):
    build, tree = cuda_builds[arch]
    assert build.returncode == 0, f"build.sh for {arch} failed:\n{build.stdout[-4000:]}\n{build.stderr[-8000:]}"
    for binary in ("build/kdtree", "build/test_ops"):
        assert (tree / binary).is_file(), f"{binary} missing after the {arch} build"
    assert f"backend=cuda arch={arch}" in build.stdout


@pytest.mark.parametrize("arch", ARCHES)
def test_cuda_objects_hold_machine_code_for_the_arch(cuda_builds, arch):
    build, tree = cuda_builds[arch]
    if build.returncode != 0:
        pytest.skip("the build failed (reported by the compile test)")
    cuobjdump = CUDA_HOME / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        pytest.skip(f"{cuobjdump} not installed (nvcc-only toolkit)")
    listing = subprocess.run([str(cuobjdump), "--list-elf", str(tree / "build/kdtree")],
                             capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    assert f".{arch}." in listing.stdout, listing.stdout


def test_cuda_backend_reports_itself_when_no_gpu(cuda_builds):
    """Without a GPU the CUDA build still runs its CPU path and names the missing device."""
    build, tree = cuda_builds["sm_90"]
    if build.returncode != 0:
        pytest.skip("the build failed (reported by the compile test)")
    version = subprocess.run([str(tree / "build/kdtree"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0, version.stderr
    assert "backend=cuda" in version.stdout
