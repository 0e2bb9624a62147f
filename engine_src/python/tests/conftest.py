"""Shared fixtures: the bundles are generated once per session, into a temporary folder."""

import os

# The reference's matrices are tiny: BLAS threads only add contention. This takes effect when
# NumPy is first imported after this file (the usual case); child processes get it explicitly.
SINGLE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
for _var, _value in SINGLE_THREAD.items():
    os.environ.setdefault(_var, _value)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

PYTHON_DIR = Path(__file__).resolve().parent.parent
EXPECTED = PYTHON_DIR.parent / "tests" / "refs" / "expected_manifest.json"


def run_generator(out: Path, *args: str) -> subprocess.CompletedProcess:
    """Run gen_model.py --out OUT ARGS in a child process."""
    return subprocess.run([sys.executable, str(PYTHON_DIR / "gen_model.py"), "--out", str(out), *args],
                          capture_output=True, text=True, env=dict(os.environ, **SINGLE_THREAD))


@pytest.fixture(scope="session")
def generator():
    """run_generator, for tests that run gen_model.py themselves."""
    return run_generator


@pytest.fixture(scope="session")
def generated(tmp_path_factory):
    """(folder, manifest, gen_model output) of one run of gen_model.py --check against the expected manifest."""
    out = tmp_path_factory.mktemp("refs")
    proc = run_generator(out, "--check", str(EXPECTED))
    assert (out / "manifest.json").exists(), proc.stdout + proc.stderr
    return out, json.loads((out / "manifest.json").read_text()), proc


@pytest.fixture(scope="session")
def manifest(generated):
    return generated[1]


@pytest.fixture(scope="session")
def bundle_paths(generated):
    """Bundle name -> path of the generated file."""
    out, manifest, _ = generated
    return {b["name"]: out / b["file"] for b in manifest["bundles"]}
