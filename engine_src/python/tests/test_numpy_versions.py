"""The generator's bytes are NumPy's version's business nowhere: the oldest NumPy the project
supports (pyproject's lower bound) makes the committed tiny bundles (config tiny) and the streaming writer's
k2small bundles byte for byte as the NumPy of this environment (the newest the bound allows,
where CI installs it) does."""

import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from kdtree_ref import bundle_writer
from kdtree_ref.weights import Weights

import gen_model

REPO = Path(__file__).resolve().parents[3]
PYTHON_DIR = Path(__file__).resolve().parents[1]
EXPECTED = PYTHON_DIR.parent / "tests" / "refs" / "expected_manifest.json"

# k2small's two bundles by the streaming writer, their identities printed as JSON (run under either NumPy)
WRITE_K2SMALL = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import gen_model, small_k2
from kdtree_ref import bundle_writer
from kdtree_ref.weights import Weights
golden = {b.entry["quant"]: b.entry for b in small_k2.build()}
quants = {q: gen_model.quant_header(small_k2.RECIPE, q) for q in golden}
made = bundle_writer.write_pair(Weights(small_k2.ARGS, direct_int4=True), quants,
                                gen_model.drafter_header(small_k2.ARGS, small_k2.RECIPE), golden, None, 2)
print(json.dumps({"numpy": __import__("numpy").__version__, "identities": {q: made[q][0] for q in made}}))
"""


def oldest_numpy() -> str:
    """pyproject's lower bound of numpy, as a pip requirement of that minor release (e.g. numpy==1.26.*)."""
    text = (REPO / "pyproject.toml").read_text()
    low = re.search(r'"numpy>=(\d+)\.(\d+)', text)
    assert low, "pyproject.toml names no numpy lower bound"
    return f"numpy=={low.group(1)}.{low.group(2)}.*"


@pytest.fixture(scope="module")
def old_python(tmp_path_factory) -> Path:
    """A virtual environment with the oldest supported NumPy (installed from the package index)."""
    env = tmp_path_factory.mktemp("oldest-numpy") / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--only-binary=:all:", oldest_numpy()],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        pytest.skip(f"{oldest_numpy()} could not be installed here (no package index?): {pip.stderr.strip()[-300:]}")
    return python


def run(python: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([str(python), *argv], capture_output=True, text=True, timeout=900, env=env)


def test_the_oldest_numpy_makes_the_committed_tiny_bundles(old_python, tmp_path):
    done = run(old_python, str(PYTHON_DIR / "gen_model.py"), "--out", str(tmp_path), "--configs", "tiny",
               "--check", str(EXPECTED))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["generator"]["numpy"].startswith(oldest_numpy().split("==")[1].rstrip("*"))
    assert "check: every bundle matches" in done.stdout


def test_the_oldest_numpy_streams_k2smalls_bundles_to_the_same_bytes(old_python):
    sys.path.insert(0, str(PYTHON_DIR.parent / "tests"))
    import small_k2
    golden = {b.entry["quant"]: b.entry for b in small_k2.build()}
    quants = {q: gen_model.quant_header(small_k2.RECIPE, q) for q in golden}
    here = bundle_writer.write_pair(Weights(small_k2.ARGS, direct_int4=True), quants,
                                    gen_model.drafter_header(small_k2.ARGS, small_k2.RECIPE), golden, None, 2)
    done = run(old_python, "-c", WRITE_K2SMALL, str(PYTHON_DIR), str(PYTHON_DIR.parent / "tests"))
    assert done.returncode == 0, done.stderr[-2000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    newest = __import__("numpy").__version__
    assert there["numpy"].split(".")[:2] != newest.split(".")[:2], f"NumPy {newest} on both sides: nothing compared"
    assert there["identities"] == {q: here[q][0] for q in here}
