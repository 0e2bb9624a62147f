"""The native engine under AddressSanitizer + UndefinedBehaviorSanitizer in the project's test run:
`KD_SANITIZE=1 scripts/run_tests.sh` in a temporary copy of engine_src/ (with the session's
reference bundles) builds the instrumented CPU engine, runs its whole suite (op tests, model tests,
loader negatives, every reproducer in tests/fuzz/regress) and a bounded fuzz run (KD_FUZZ_SECONDS)
over bundles, manifests, JSON and flags, once per session, started in the background when the
session begins (tests/early_builds.py). Any crash, sanitizer report, hang or
runaway allocation fails it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine_src"

# The session fixture (tests/early_builds.py) builds and runs the whole instrumented suite (minutes on 2 cores).
pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++"), pytest.mark.timeout(1800)]


def _results(copy: Path) -> dict:
    return json.loads((copy / "build" / "test_results.json").read_text())


def test_sanitized_suite_passes(sanitized_run):
    copy, run, seed = sanitized_run
    lines = run.stdout.strip().splitlines()
    findings = sorted((copy / "build" / "fuzz_findings").glob("*.case"))
    shown = "\n".join(f"{f.name}:\n{f.read_text(errors='replace')[:600]}" for f in findings[:3])
    assert run.returncode == 0, f"sanitized run_tests.sh (fuzz seed {seed}) failed:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}\n{shown}"
    assert lines[-1] == "ALL TESTS PASSED"
    for marker in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
        assert marker not in run.stdout + run.stderr


def test_build_is_instrumented(sanitized_run):
    copy, _, _ = sanitized_run
    info = json.loads((copy / "build" / "build_info.json").read_text())
    assert info["key"]["sanitize"] is True
    for flag in ("-fsanitize=address", "-fsanitize=undefined", "-fsanitize=float-cast-overflow", "-fno-sanitize-recover=all"):
        assert flag in info["key"]["cxxflags"]
    for binary in ("kdtree", "test_ops", "fuzz"):
        assert b"__asan_init" in (copy / "build" / binary).read_bytes(), f"build/{binary} is not instrumented"


def test_every_reproducer_ends_in_a_named_error(sanitized_run):
    copy, _, _ = sanitized_run
    regress = {t["name"]: t for t in _results(copy)["tests"] if t["name"].startswith("regress.")}
    cases = sorted(p.stem for p in (ENGINE / "tests" / "fuzz" / "regress").glob("*.case"))
    assert len(cases) >= 40
    assert sorted(name.removeprefix("regress.") for name in regress) == cases
    assert all(t["status"] == "passed" for t in regress.values()), [t for t in regress.values() if t["status"] != "passed"]


def test_bounded_fuzz_run_found_nothing(sanitized_run):
    copy, _, seed = sanitized_run
    fuzz = next(t for t in _results(copy)["tests"] if t["name"] == "fuzz.run")
    assert fuzz["status"] == "passed", fuzz["message"]
    summary = fuzz["message"]
    assert f"(seed {seed})" in summary
    assert "0 crashes, 0 sanitizer reports, 0 timeouts, 0 runaway allocations, 0 unnamed errors" in summary
    cases = int(summary.split("fuzz: ")[1].split(" cases")[0])
    assert cases >= 50, summary  # the run did real work within its time


def test_a_sanitizer_report_fails_the_case(sanitized_run, tmp_path):
    """The harness is not blind: a JSON case of 600,000 numbers parses (exit 0), and the same case
    is a runaway allocation once ASan refuses allocations over 64 MiB (the parsed array needs more;
    the harness itself, which only reads the case, stays under that)."""
    copy, _, _ = sanitized_run
    case = tmp_path / "big_array.case"
    case.write_text("kind: json\nexpect: ok\n---\n[@@REPEAT 600000@@0,@@END@@0]")
    replay = [str(copy / "build" / "fuzz"), "replay", "--refs", str(copy / "tests" / "refs"), str(case)]
    ok = subprocess.run(replay, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and ok.stdout.startswith("ok "), ok.stdout + ok.stderr
    env = dict(os.environ, ASAN_OPTIONS="max_allocation_size_mb=64")
    bad = subprocess.run(replay, capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 1 and bad.stdout.startswith("FAIL ") and "runaway allocation" in bad.stdout, bad.stdout + bad.stderr
