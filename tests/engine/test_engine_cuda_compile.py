"""The CUDA engine compiles and links for the production arch (sm_120) and the H200 (sm_90) on a
machine with nvcc, whether or not it has a GPU or the cuBLAS headers (CI has neither), so a CUDA
compile error cannot land; every kernel's ptxas resource usage is recorded for both arches with no
register spill; and the sanitized build (KD_SANITIZE=1, host code under ASan + UBSan) compiles and
links. The builds run once per session in copies of engine_src/, started in the background when
the session begins (tests/early_builds.py): sm_90 plain, sm_120 sanitized
(the sanitizer flags reach the host compiler alone, so its kernels and their ptxas figures are the
plain build's: one build fewer for CI)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from early_builds import CUDA_ARCHES, CUDA_SANITIZED
from engine_copies import cuda_home
from fake_gpus import FakeGpus

ENGINE = Path(__file__).resolve().parents[2] / "engine_src"
ARCHES, SANITIZED = CUDA_ARCHES, CUDA_SANITIZED   # built by the session fixture cuda_builds
CUDA_HOME = cuda_home()
pytestmark = pytest.mark.skipif(CUDA_HOME is None, reason="nvcc not found (no CUDA_HOME/bin/nvcc, none on PATH)")


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


KERNEL = re.compile(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s+)?(?:void\s+)?(\w+)\s*\(")


def _kernels_in_sources(cublas: bool) -> set[str]:
    """The __global__ functions build.sh compiles (src/cuda/ and the load generator); those under
    KD_HAVE_CUBLAS only when the build has cuBLAS."""
    names = set()
    for src in [*(ENGINE / "src" / "cuda").glob("*.cu*"), ENGINE / "bench" / "gpu_load.cu"]:
        text = src.read_text()
        if not cublas:
            text = re.sub(r"#ifdef KD_HAVE_CUBLAS.*?#endif", "", text, flags=re.S)
        names.update(KERNEL.findall(text))
    return names


def _short_name(function: str) -> str:
    """'void kd::cuda::(anonymous namespace)::w4_kernel<4, false>(kd::cuda::W4Params)' -> 'w4_kernel'."""
    head = re.split(r"[<(]", function.replace("(anonymous namespace)::", ""), maxsplit=1)[0]
    return head.split("::")[-1].split()[-1]


@pytest.mark.parametrize("arch", ARCHES)
def test_every_cuda_kernel_has_its_resource_usage_recorded_without_spills(cuda_builds, arch):
    """build/cuda_resources.json names every kernel with its registers and shared memory, and no
    device function spills (a spill also fails build.sh, which the compile test reports)."""
    build, tree = cuda_builds[arch]
    if build.returncode != 0:
        pytest.skip("the build failed (reported by the compile test)")
    report = json.loads((tree / "build" / "cuda_resources.json").read_text())
    assert report["arch"] == arch and report["spilling"] == 0
    spilling = [f"{f['function']}: {f['spill_stores']} B stores, {f['spill_loads']} B loads"
                for f in report["functions"] if f["spill_stores"] or f["spill_loads"]]
    assert not spilling, f"{arch}: {spilling}"
    kernels = [f for f in report["functions"] if f["kernel"]]
    for f in kernels:
        assert isinstance(f["registers"], int) and 0 < f["registers"] <= 255, f
        assert isinstance(f["smem_bytes"], int) and f["smem_bytes"] >= 0, f
    cublas = json.loads((tree / "build" / "build_info.json").read_text())["key"]["cublas"]
    missing = sorted(_kernels_in_sources(cublas) - {_short_name(f["function"]) for f in kernels})
    assert not missing, f"{arch}: kernels without a resource record: {missing}"


@pytest.mark.timeout(1800)  # both CUDA builds, one of them instrumented
def test_cuda_sanitized_build_compiles_and_links(cuda_builds):
    build, tree = cuda_builds[SANITIZED]
    assert build.returncode == 0, f"sanitized build.sh for {SANITIZED} failed:\n{build.stdout[-4000:]}\n{build.stderr[-8000:]}"
    info = json.loads((tree / "build" / "build_info.json").read_text())
    assert info["key"]["sanitize"] is True and "-Xcompiler=-fsanitize=address" in info["key"]["nvccflags"]
    for binary in ("kdtree", "test_ops", "fuzz"):
        assert b"__asan_init" in (tree / "build" / binary).read_bytes(), f"build/{binary} is not instrumented"
    # No GPU here: the instrumented binary still runs its CPU path and names the missing device.
    version = subprocess.run([str(tree / "build/kdtree"), "--version"], capture_output=True, text=True,
                             env=dict(os.environ, ASAN_OPTIONS="protect_shadow_gap=0"))
    assert version.returncode == 0 and "backend=cuda" in version.stdout, version.stdout + version.stderr


def test_cuda_backend_reports_itself_when_no_gpu(cuda_builds):
    """Without a GPU the CUDA build still runs its CPU path and names the missing device."""
    build, tree = cuda_builds["sm_90"]
    if build.returncode != 0:
        pytest.skip("the build failed (reported by the compile test)")
    version = subprocess.run([str(tree / "build/kdtree"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0, version.stderr
    assert "backend=cuda" in version.stdout


@pytest.mark.parametrize("asked", ["KD_TEST_BACKENDS=cuda", "nvidia-smi lists a GPU", None])
def test_a_cuda_backend_that_cannot_start_fails_the_tests_where_the_gpu_was_asked_for(cuda_builds, reference_bundles,
                                                                                    tmp_path, asked):
    """No GPU can be used here (no driver), which is what a GPU host whose memory a co-tenant holds
    looks like to the engine: where the tests were asked to run on the GPU (the stress command's
    KD_TEST_BACKENDS=cuda, or a GPU that nvidia-smi lists) run_tests.sh fails backend.cuda naming
    why, never a pass on the CPU backend alone; on a machine without a GPU it is a skip."""
    build, tree = cuda_builds["sm_90"]
    if build.returncode != 0:
        pytest.skip("the build failed (reported by the compile test)")
    reference_bundles.copy_to(tree / "tests" / "refs")
    fake = FakeGpus(tmp_path / "bin")
    fake.set(1 if asked == "nvidia-smi lists a GPU" else 0)
    env = dict(os.environ, KD_NO_BUILD="1", KD_BACKEND="auto", KD_TEST_BUNDLES="tiny_fp32", PYTHON=sys.executable,
               KD_TEST_RESULTS=str(tmp_path / "results.json"), PATH=f"{fake.bin}:{os.environ['PATH']}")
    env.pop("KD_TEST_BACKENDS", None)
    if asked == "KD_TEST_BACKENDS=cuda":
        env["KD_TEST_BACKENDS"] = "cuda"
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=600)
    cuda = {t["name"]: t for t in json.loads((tmp_path / "results.json").read_text())["tests"]}["backend.cuda"]
    if asked:
        assert proc.returncode == 1 and cuda["status"] == "failed", proc.stdout[-3000:]
        assert f"the CUDA backend was asked for ({asked}) and could not start: " in cuda["message"]
    else:
        assert cuda["status"] == "skipped" and "could not start" not in cuda["message"], cuda
