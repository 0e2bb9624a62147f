"""The native engine in the project's test run: the CPU engine in a temporary copy of engine_src/,
holding the session's CPU build (tests/early_builds.py: its objects, so that build.sh compiles only
what a test changes), and its own suite (scripts/run_tests.sh), once per session.

The copy gets the session's reference bundles (conftest.py: generated once, shared with the
validate tests) in tests/refs, so run_tests.sh does not regenerate them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_copies import engine_copy
from orchestrator.runner import progress

ENGINE = Path(__file__).resolve().parents[2] / "engine_src"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _env() -> dict:
    env = dict(os.environ, KD_BACKEND="cpu", PYTHON=sys.executable)
    env.pop("KD_ARCH", None)
    return env


@pytest.fixture(scope="session")
def engine_run(tmp_path_factory, reference_bundles, cpu_build):
    """(engine copy, completed run_tests.sh) for the session."""
    copy = engine_copy(tmp_path_factory.mktemp("engine"))
    cpu_build.copy_build_to(copy)
    reference_bundles.copy_to(copy / "tests" / "refs")
    run = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=copy, env=_env(), capture_output=True, text=True,
                         timeout=900)
    return copy, run


def test_run_tests_passes(engine_run):
    _, run = engine_run
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0, f"run_tests.sh failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert lines[-1] == "ALL TESTS PASSED"
    assert not [line for line in lines if line.startswith("FAIL")]


def test_the_scripts_report_progress_the_orchestrator_reads(engine_run):
    """run_tests.sh reports after every test (tests run, passed of them), build.sh the files it
    compiles of those it must, then each link: every report is one orchestrator.runner.progress parses."""
    copy, run = engine_run
    results = json.loads((copy / "build" / "test_results.json").read_text())
    tests = [progress.parse(line) for line in run.stdout.splitlines() if line.startswith("::kdtree-progress")]
    assert None not in tests and len(tests) == len(results["tests"])
    assert tests[-1].done == len(results["tests"]) and tests[-1].what.startswith(f"{results['passed']} passed, 0 failed")
    (copy / "src" / "version.cpp").touch()          # one stale object (the tree is the same)
    build = subprocess.run(["bash", "scripts/build.sh"], cwd=copy, env=_env(), capture_output=True, text=True,
                           check=True, timeout=600)
    reports = [progress.parse(line) for line in build.stdout.splitlines() if line.startswith("::kdtree-progress")]
    assert None not in reports and {(r.total, r.unit) for r in reports} == {(1, "files")}
    assert [r.what for r in reports if r.done == 1] == ["compiled", "linking build/kdtree", "linking build/test_ops",
                                                        "linking build/fuzz"]
    assert reports[0] == progress.Update(0, 1, "files", None, "compiling src/version.cpp")


def test_results_file_lists_every_test(engine_run):
    copy, run = engine_run
    results = json.loads((copy / "build" / "test_results.json").read_text())
    assert results["version"] == 1 and results["backend"] == "cpu"
    assert results["failed"] == 0 and results["passed"] == sum(t["status"] == "passed" for t in results["tests"])
    names = {t["name"] for t in results["tests"]}
    manifest = json.loads((copy / "tests" / "refs" / "manifest.json").read_text())
    for bundle in manifest["bundles"]:
        assert f"model.cpu.{bundle['name']}.ar_equals_golden" in names
    for required in ("ops.cpu.matmul_w4a16.M17", "ops.cpu.mla_attention.tree_row_equals_chain",
                     "negative.altered_golden_token_detected", "negative.loader_nan_weight",
                     "regress.config_groups_zero", "regress.manifest_escapes_folder", "regress.flag_moe_tokens_negative",
                     "negative.ddtree_low_acceptance_of_a_fitted_drafter", "model.cpu.k2small_int4.ddtree_equals_reference.B2_L8"):
        assert required in names
    assert all(set(t) == {"name", "status", "seconds", "message"} for t in results["tests"])


def test_a_bundle_selection_naming_no_bundle_of_the_manifest_is_refused(engine_run):
    """KD_TEST_BUNDLES with a typo, or naming nothing, must not select nothing and pass: exit 2 naming the
    manifest's bundles."""
    copy, _ = engine_run
    run = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=copy, capture_output=True, text=True, timeout=120,
                         env=dict(_env(), KD_NO_BUILD="1", KD_TEST_BUNDLES="tiny_fp32,tiny_fp23",
                                  KD_TEST_RESULTS=str(copy / "build" / "selection.json")))
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "KD_TEST_BUNDLES names 'tiny_fp23', which is not a bundle of tests/refs/manifest.json" in run.stderr
    assert " tiny_fp32 " in run.stderr.rsplit("its bundles:", 1)[1] + " "
    empty = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=copy, capture_output=True, text=True, timeout=120,
                           env=dict(_env(), KD_NO_BUILD="1", KD_TEST_BUNDLES=",",
                                    KD_TEST_RESULTS=str(copy / "build" / "selection.json")))
    assert empty.returncode == 2 and "KD_TEST_BUNDLES=',' names no bundle" in empty.stderr, empty.stderr[-2000:]


def test_version_names_the_source_tree(engine_run):
    copy, _ = engine_run
    version = subprocess.run([str(copy / "build" / "kdtree"), "--version"], capture_output=True, text=True,
                             check=True).stdout.strip()
    match = re.fullmatch(r"kdtree \S+ tree=([0-9a-f]{64}) backend=cpu arch=none", version)
    assert match, version
    tree = subprocess.run(["bash", "scripts/tree_hash.sh"], cwd=copy, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert match.group(1) == tree


def test_generate_writes_outputs_equal_to_golden(engine_run):
    copy, _ = engine_run
    subprocess.run(["bash", "scripts/generate.sh"], cwd=copy, env=_env(), capture_output=True, text=True,
                   check=True, timeout=300)
    outputs = json.loads((copy / "build" / "outputs.json").read_text())
    manifest = json.loads((copy / "tests" / "refs" / "manifest.json").read_text())
    assert outputs["version"] == 1 and outputs["backend"] == "cpu"
    for bundle in manifest["bundles"]:
        out = outputs["bundles"][bundle["name"]]
        assert out["ar"] == bundle["golden"]
        assert out["ddtree"] == out["ar"]
        assert out["accept_mean"] > 1


def test_rebuild_is_incremental(engine_run):
    copy, _ = engine_run
    subprocess.run(["bash", "scripts/build.sh"], cwd=copy, env=_env(), capture_output=True, text=True, check=True)
    info = json.loads((copy / "build" / "build_info.json").read_text())
    assert info["rebuilt"] == []
    assert info["key"]["backend"] == "cpu"


def test_generate_into_a_results_dir_without_building(engine_run):
    """KD_RESULTS_DIR and KD_NO_BUILD: what one of several runs at once (one per GPU) uses."""
    copy, _ = engine_run
    env = {**_env(), "KD_RESULTS_DIR": "build/gpu-3", "KD_NO_BUILD": "1"}
    before = (copy / "build" / "kdtree").stat().st_mtime_ns
    subprocess.run(["bash", "scripts/generate.sh"], cwd=copy, env=env, capture_output=True, text=True, check=True,
                   timeout=300)
    outputs = json.loads((copy / "build" / "gpu-3" / "outputs.json").read_text())
    manifest = json.loads((copy / "tests" / "refs" / "manifest.json").read_text())
    assert {name: o["ar"] for name, o in outputs["bundles"].items()} == {b["name"]: b["golden"] for b in manifest["bundles"]}
    assert (copy / "build" / "kdtree").stat().st_mtime_ns == before


def test_no_build_refuses_a_missing_build(tmp_path):
    copy = tmp_path / "engine_src"
    shutil.copytree(ENGINE, copy, ignore=shutil.ignore_patterns("build", "__pycache__", "*.pyc", ".kdtree"))
    env = {**_env(), "KD_RESULTS_DIR": "build/gpu-0", "KD_NO_BUILD": "1"}
    gen = subprocess.run(["bash", "scripts/generate.sh"], cwd=copy, env=env, capture_output=True, text=True, timeout=60)
    assert gen.returncode == 2
    assert "generate.sh: build/kdtree is missing and KD_NO_BUILD is set" in gen.stderr
    tests = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=copy, env=env, capture_output=True, text=True,
                           timeout=60)
    assert tests.returncode == 1 and tests.stdout.strip().splitlines()[-1] == "1 TESTS FAILED"
    results = json.loads((copy / "build" / "gpu-0" / "test_results.json").read_text())
    assert [(t["name"], t["status"], t["message"]) for t in results["tests"]] == \
        [("build", "failed", "exit 1: build/kdtree or build/test_ops is missing and KD_NO_BUILD is set ")]
    assert not (copy / "build" / "kdtree").exists()


def _build(copy: Path, **env) -> dict:
    subprocess.run(["bash", "scripts/build.sh"], cwd=copy, env={**_env(), **env}, capture_output=True, text=True,
                   check=True, timeout=600)
    return json.loads((copy / "build" / "build_info.json").read_text())


def test_returning_to_an_earlier_tree_restores_its_build_without_compiling(engine_run):
    copy, _ = engine_run
    source = copy / "src" / "version.cpp"
    original = source.read_text()
    first = _build(copy)
    try:
        source.write_text(original + "\n// a comment-only change\n")
        changed = _build(copy)
        assert changed["tree"] != first["tree"] and "src/version.cpp" in changed["rebuilt"]
        source.write_text(original)
        back = _build(copy)
        assert back["tree"] == first["tree"] and back["rebuilt"] == [] and back["restored"].startswith("build/trees/")
        version = subprocess.run([str(copy / "build" / "kdtree"), "--version"], capture_output=True, text=True, check=True)
        assert f"tree={first['tree']}" in version.stdout
        source.write_text(original + "\n// a comment-only change\n")
        assert _build(copy)["restored"]                               # both trees are kept
        source.write_text(original)
        again = _build(copy, KD_BUILD_CACHE="1")                       # keep one: the other tree is evicted
        assert again["tree"] == first["tree"]
        assert [p.name.split("-")[0] for p in (copy / "build" / "trees").iterdir()] == [first["tree"]]
    finally:
        source.write_text(original)
    assert _build(copy)["tree"] == first["tree"]


def _bench(copy: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """`kdtree bench` on the first tiny2 bundle alone, 8 tokens, one budget, the smallest MoE layer."""
    manifest = json.loads((copy / "tests" / "refs" / "manifest.json").read_text())
    manifest["bundles"] = [next(b for b in manifest["bundles"] if b["name"].startswith("tiny2"))]
    small = copy / "tests" / "refs" / "manifest-one.json"
    small.write_text(json.dumps(manifest))
    return subprocess.run([str(copy / "build" / "kdtree"), "bench", "--manifest", str(small), "--out",
                           str(tmp_path / "bench.json"), "-n", "8", "--budgets", "2", "--repeats", "2",
                           "--moe-experts", "8", "--moe-tokens", "1", *flags], capture_output=True, text=True, timeout=300)


def test_bench_runs_last_the_min_time(engine_run, tmp_path):
    """--min-time-ms: each run of a timing repeats its generation until the run has lasted that
    long, its figure its best generation's; without it a run is one generation."""
    copy, _ = engine_run
    for flags, at_least in (((), None), (("--min-time-ms", "40"), 40)):
        proc = _bench(copy, tmp_path, *flags)
        assert proc.returncode == 0, proc.stderr[-2000:]
        bench = json.loads((tmp_path / "bench.json").read_text())
        (name, bundle), = bench["bundles"].items()
        assert bench["repeats"] == 2 and bench["min_time_ms"] == (at_least or 0)
        ar, tree = bundle["ar"], bundle["ddtree"][0]
        if at_least is None:
            assert ar["generations"] == tree["generations"] == [1, 1]
            continue
        # an 8-token decode of tiny2 takes a few milliseconds: 40 ms is several generations a run
        assert min(ar["generations"]) > 1 and min(tree["generations"]) > 1 and tree["equals_ar"]
        # each run lasted the time, and its figure is its best generation's: at least the run's
        # mean (its tokens, 8 a generation, over its seconds)
        assert min(ar["run_seconds"]) >= at_least / 1e3 and min(tree["run_seconds"]) >= at_least / 1e3
        samples = bench["metrics"][f"{name}.ar_tokens_per_s"]["samples"]
        assert len(samples) == 2
        assert all(s >= 8 * g / t for s, g, t in zip(samples, ar["generations"], ar["run_seconds"])), samples
    proc = _bench(copy, tmp_path, "--min-time-ms", "10001")
    assert proc.returncode == 1 and "--min-time-ms" in proc.stderr


def test_a_bundles_declared_ram_need_is_the_engines_own_estimate_for_the_largest_run(engine_run):
    """The manifest's needs.ram_bytes (kdtree_ref.needs.bundle_needs) less the process allowance is what the
    engine itself asks for the largest run the scripts make (DDTree budget 64, or the whole prompt):
    --max-memory at that figure runs, one byte under is refused naming the need."""
    copy, _ = engine_run
    allowance = int(subprocess.run([sys.executable, "-c", "from kdtree_ref import needs; print(needs.NEEDS_PROCESS_BYTES)"],
                                   cwd=copy / "python", capture_output=True, text=True, check=True).stdout)
    for bundle in json.loads((copy / "tests/refs/manifest.json").read_text())["bundles"]:
        exact = bundle["needs"]["ram_bytes"] - allowance
        for limit, status in ((exact, 0), (exact - 1, 1)):
            run = subprocess.run(["build/kdtree", "check", "--bundle", f"tests/refs/{bundle['file']}", "--expect", "golden",
                                  "--mode", "ddtree", "--budget", "64", "-n", "2", "--max-memory", str(limit)],
                                 cwd=copy, env=_env(), capture_output=True, text=True, timeout=120)
            assert run.returncode == status, (bundle["name"], limit, run.stdout[-500:], run.stderr[-500:])
        assert "over --max-memory" in run.stderr
