"""`invoke validate` end to end against loopback sshd hosts, with the real engine (CPU backend).

One full run on h1 builds the engine there once, linking the session's CPU build's objects, which
the test puts there after a first sync (a cold compile is the timeout test's and, with every source
compiled, the --no-cache test's); the later runs reuse that build through the orchestrator's own cache (a copy
of h1's deployment carries its build stamp), which is itself one of the things tested.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from browser import dom
from fault_lab import wait_for
from orchestrator import remote

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "engine_src"

# A host whose bundle regeneration differs from everybody else's: its "python" flips golden
# token 17 of tiny_fp32 in the manifest that gen_model.py writes.
FLIPPING_PYTHON = r'''#!/usr/bin/env bash
"{python}" "$@"; rc=$?
if [ $rc -eq 0 ] && [[ " $* " == *gen_model.py* ]]; then
  "{python}" - "${{KD_BUNDLE_DIR:-tests/refs}}/manifest.json" <<'EOF'
import json, sys
path = sys.argv[1]
manifest = json.load(open(path))
bundle = next(b for b in manifest["bundles"] if b["name"] == "tiny_fp32")
bundle["golden"][17] = (bundle["golden"][17] + 1) % 400
json.dump(manifest, open(path, "w"))
EOF
fi
exit $rc
'''


COPY_IGNORE = shutil.ignore_patterns("build", "__pycache__", "*.kdtr", "manifest.json")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, reference_bundles) -> Path:
    """The folder of this module's inventories, runs/, local bundle cache and a snapshot of
    engine_src (so that edits to the working tree during the tests change nothing). The local
    bundle cache starts with the session's reference bundles under their generator key, as a
    previous run would have left it, when the snapshot's generator is the one that made them;
    the hosts regenerate theirs."""
    path = tmp_path_factory.mktemp("validate")
    shutil.copytree(ENGINE, path / "engine_src", ignore=COPY_IGNORE)
    reference_bundles.seed_local_cache(path, path / "engine_src")
    return path


# The nightlies here measure through a command of their own, so that a test can see which one ran: three
# samples of every bundle at one tree budget and the smallest MoE layer (the shipped bench_nightly's longer
# runs, and every budget, cost CI minutes that these tests of the verdicts do not need).
NIGHTLY_BENCH = 'KD_BENCH_ARGS="--repeats 3 --budgets 4 --moe-experts 8 --moe-tokens 1" bash scripts/bench.sh'
# Likewise validate's bench: every metric of every bundle, three samples each (the default), but two tree
# budgets and the smallest MoE layer; no test here judges the figures, only that they exist and pair up
# (the shipped command runs whole in CI's first command, `invoke validate` on local).
BENCH = 'KD_BENCH_ARGS="--budgets 4,8 --moe-experts 8 --moe-tokens 1" bash scripts/bench.sh'
# And validate's engine tests: the model tests on the tiny bundles, every other test whole (the whole suite
# runs in tests/engine/test_engine_native.py, and through the orchestrator in CI's first command).
TEST = "KD_TEST_BUNDLES=tiny_fp32,tiny_int4 bash scripts/run_tests.sh"


def write_inventory(workdir: Path, name: str, hosts: dict, source: Path | None = None) -> Path:
    """An inventory like the shipped one, with `hosts` and the engine `source` (default: the snapshot),
    whose test, bench and nightly bench commands are TEST, BENCH and NIGHTLY_BENCH."""
    data = yaml.safe_load((REPO / "hosts.yaml").read_text())
    data["project"]["source"] = str(source or workdir / "engine_src")
    data["project"]["commands"].update(test=TEST, bench=BENCH, bench_nightly=NIGHTLY_BENCH)
    data["hosts"] = hosts
    data.pop("groups", None)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def invoke(lab, inventory: Path, *args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    """`invoke validate` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "invoke", "validate", "--inventory", str(inventory), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **lab.env()})


def load_run(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def steps(run: dict, host: str) -> dict[str, str]:
    return {name: step["status"] for name, step in run["hosts"][host]["steps"].items()}


@pytest.fixture(scope="module")
def full_run(lab, workdir, cpu_build):
    """The whole pipeline once on h1, on a remote_dir that holds the synced sources and the
    session's CPU build's objects of this tree, nothing else: no binary, no bundles, no step's
    stamp."""
    remote_dir = lab.hosts["h1"].root / "engine"
    inventory = write_inventory(workdir, "h1", {"h1": lab.inventory_entry(lab.hosts["h1"], remote_dir=str(remote_dir))})
    synced = invoke(lab, inventory, "--host", "h1", "--steps", "preflight,sync", "--report-dir", str(workdir / "run-sync"))
    assert synced.returncode == 0, synced.stdout[-4000:] + synced.stderr[-2000:]
    cpu_build.seed(remote_dir)
    run_dir = workdir / "run-full"
    proc = invoke(lab, inventory, "--host", "h1", "--report-dir", str(run_dir))
    return proc, run_dir


def test_full_pipeline_passes_on_a_cpu_host(full_run):
    proc, run_dir = full_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    run = load_run(run_dir)
    assert run["status"] == "passed"
    host = run["hosts"]["h1"]
    assert steps(run, "h1") == dict.fromkeys(["preflight", "sync", "build", "bundles", "golden", "test", "bench"],
                                             "passed")
    assert host["backend"] == "cpu" and host["build_key"]["backend"] == "cpu"
    assert host["deployed_tree_hash"] == host["binary_tree_hash"] == run["source"]["tree_hash"]
    names = {f"{config}_{quant}" for config in ("tiny", "tiny2", "k2mini") for quant in ("fp32", "int4")}
    assert set(host["golden"]) == names     # k2mini: the long-context (YaRN, 1024-token prompt) goldens
    for bundle in host["golden"].values():
        assert bundle["status"] == "passed"
        assert bundle["checks"]["host_ar_vs_golden"] == bundle["checks"]["host_ddtree_vs_golden"] == "passed"
    assert host["tests"]["failed"] == 0 and host["tests"]["passed"] >= 10
    metrics = host["bench"]["metrics"]
    for name in names:      # tokens/s at long context for k2mini: decode alone, AR and DDTree
        for metric in ("ar_tokens_per_s", "ar_decode_tokens_per_s", "ddtree_best_decode_tokens_per_s",
                       "prefill_tokens_per_s"):
            assert metrics[f"{name}.{metric}"]["value"] > 0, (name, metric)
        # a speed-up's samples are paired by round: the best DDTree decode's run r over AR's run r
        speedup, tree, ar = (metrics[f"{name}.{m}"] for m in ("ddtree_best_decode_speedup", "ddtree_best_decode_tokens_per_s",
                                                                "ar_decode_tokens_per_s"))
        assert speedup["samples"] == pytest.approx([t / a for t, a in zip(tree["samples"], ar["samples"])], rel=1e-4), name
        if len(tree["cpu_samples"]) == len(ar["cpu_samples"]) == len(speedup["cpu_samples"]) == tree["n"]:
            assert speedup["cpu_samples"] == pytest.approx([t / a for t, a in zip(tree["cpu_samples"], ar["cpu_samples"])], rel=1e-4)
    for name in ("report.md", "report.html", "junit.xml", "h1/build.log", "h1/test.log", "h1/test_results.json"):
        assert (run_dir / name).is_file(), name
    assert "[h1] build" in proc.stdout and "ALL TESTS PASSED" in proc.stdout


def test_junit_has_a_case_per_step_and_per_engine_test(full_run):
    _, run_dir = full_run
    run = load_run(run_dir)
    cases = ET.parse(run_dir / "junit.xml").getroot().iter("testcase")
    names = [c.get("name") for c in cases]
    assert [n for n in names if n.startswith("step.")] == [f"step.{s}" for s in run["hosts"]["h1"]["steps"]]
    assert len([n for n in names if n.startswith("test.")]) == len(run["hosts"]["h1"]["tests"]["cases"])


@pytest.fixture(scope="module")
def second_run(lab, workdir, full_run):
    """h1 again (nothing changed) and h2, a copy of h1's deployment whose Python regenerates a
    different golden token: build cached on both, h2 fails at golden, h1 passes."""
    h1, h2 = lab.hosts["h1"], lab.hosts["h2"]
    shutil.copytree(h1.root / "engine", h2.root / "engine", symlinks=True, dirs_exist_ok=True)
    flipping = workdir / "flipping-python"
    flipping.write_text(FLIPPING_PYTHON.format(python=sys.executable))
    flipping.chmod(0o755)
    inventory = write_inventory(workdir, "h1h2", {
        "h1": lab.inventory_entry(h1, remote_dir=str(h1.root / "engine")),
        "h2": lab.inventory_entry(h2, remote_dir=str(h2.root / "engine"), python=str(flipping))})
    run_dir = workdir / "run-second"
    proc = invoke(lab, inventory, "--host", "h1", "--host", "h2", "--skip", "test,bench", "--report-dir", str(run_dir))
    return proc, run_dir


def test_second_run_hits_the_build_cache(second_run):
    proc, run_dir = second_run
    run = load_run(run_dir)
    assert steps(run, "h1") == {"preflight": "passed", "sync": "passed", "build": "cached", "bundles": "cached",
                                "golden": "cached", "test": "skipped", "bench": "skipped"}, proc.stdout[-4000:]
    assert steps(run, "h2")["build"] == "cached"
    assert run["hosts"]["h1"]["steps"]["build"]["seconds"] < 30


def test_a_host_with_different_golden_tokens_fails_at_the_right_position(second_run, tmp_path):
    proc, run_dir = second_run
    assert proc.returncode == 1
    run = load_run(run_dir)
    assert run["status"] == "failed" and run["hosts"]["h1"]["status"] == "passed"
    assert steps(run, "h2")["bundles"] == "passed" and steps(run, "h2")["golden"] == "failed"
    golden = run["hosts"]["h2"]["golden"]
    assert golden["tiny_fp32"]["checks"]["host_vs_expected"] == "failed"
    assert golden["tiny_fp32"]["checks"]["host_ar_vs_golden"] == "passed"
    assert [b for b, g in golden.items() if g["status"] == "failed"] == ["tiny_fp32"]
    mismatch = golden["tiny_fp32"]["mismatch"]
    assert mismatch["check"] == "host_vs_expected" and mismatch["position"] == 17
    expected = json.loads((run_dir.parent / "engine_src/tests/refs/expected_manifest.json").read_text())
    want = next(b for b in expected["bundles"] if b["name"] == "tiny_fp32")
    assert mismatch["expected"] == want["golden"][13:22]
    assert mismatch["actual"][4] == (want["golden"][17] + 1) % 400
    assert mismatch["margin"] == pytest.approx(want["golden_margins"][17])
    assert "position 17" in run["hosts"]["h2"]["steps"]["golden"]["message"]
    html = dom(tmp_path, run_dir / "report.html")
    assert 'data-host="h2" data-bundle="tiny_fp32" data-status="failed"' in html
    assert 'diverges at position <span class="pos">17</span>' in html
    assert "golden tokens differ" in (run_dir / "report.md").read_text()


# The stress command on a CPU build: the same run_tests.sh with the load switch, but without
# KD_TEST_BACKENDS=cuda (which a CPU build refuses), so that it runs and writes real results; the model
# tests on the tiny bundles, as TEST (h2's flipped token is tiny_fp32's).
STRESS_ON_CPU = ("KD_GPU_LOAD=cycle KD_TEST_BUNDLES=tiny_fp32,tiny_int4 KD_TEST_RESULTS=build/stress_results.json "
                 "bash scripts/run_tests.sh")
NO_GPU = "the host has no GPU (preflight found none): nothing to run under GPU load"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_stress_without_a_gpu_is_skipped_and_the_run_passes(lab, workdir, full_run):
    """--steps ...,stress on a CPU host: skipped with preflight's no-GPU reason; --steps stress
    alone (no preflight, no build in the run): the shipped command runs and run_tests.sh refuses
    the CPU build (exit 2), which is a skip with its reason, not a failure."""
    run_dir = workdir / "run-stress-skipped"
    proc = invoke(lab, workdir / "h1.yaml", "--host", "h1", "--steps", "preflight,build,stress", "--report-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run = load_run(run_dir)
    assert run["status"] == "passed" and steps(run, "h1")["build"] == "cached"
    assert list(steps(run, "h1"))[-1] == "stress" and run["hosts"]["h1"]["steps"]["stress"]["status"] == "skipped"
    assert run["hosts"]["h1"]["steps"]["stress"]["message"] == NO_GPU and run["hosts"]["h1"]["stress"] is None
    assert f"No stress tests ran: h1 skipped ({NO_GPU})." in (run_dir / "report.md").read_text()

    run_dir = workdir / "run-stress-alone"
    proc = invoke(lab, workdir / "h1.yaml", "--host", "h1", "--steps", "stress", "--report-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run = load_run(run_dir)
    stress = run["hosts"]["h1"]["steps"]["stress"]
    assert run["status"] == "passed" and stress["status"] == "skipped", stress
    assert stress["message"] == ("the stress command refused this setup (exit 2): "
                                 "run_tests.sh: KD_TEST_BACKENDS names cuda, but this is a cpu build")
    assert "KD_GPU_LOAD=cycle KD_TEST_BACKENDS=cuda" in (run_dir / "h1" / "stress.log").read_text()


def test_stress_results_are_recorded_and_reported_with_the_load_status(lab, workdir, second_run, tmp_path):
    """The stress step's results, from real run_tests.sh runs on CPU builds (STRESS_ON_CPU): on h1
    every test passes but load.gpu_load is skipped (no CUDA backend to load), which is no stress
    test: failed; on h2 (whose regenerated manifest has a flipped golden token) tests fail. Both
    results are in run.json, the summary, report.md, report.html and junit.xml."""
    data = yaml.safe_load((workdir / "h1h2.yaml").read_text())
    data["project"]["commands"]["stress"] = STRESS_ON_CPU
    inventory = workdir / "h1h2-stress.yaml"
    inventory.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = workdir / "run-stress-cpu"
    proc = invoke(lab, inventory, "--host", "h1", "--host", "h2", "--steps", "stress", "--report-dir", str(run_dir))
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    run = load_run(run_dir)
    h1, h2 = run["hosts"]["h1"], run["hosts"]["h2"]
    assert h1["steps"]["stress"]["status"] == h2["steps"]["stress"]["status"] == "failed"
    assert h1["stress"]["failed"] == 0 and h1["stress"]["passed"] >= 10
    load = next(c for c in h1["stress"]["cases"] if c["name"] == "load.gpu_load")
    assert load["status"] == "skipped" and "no CUDA backend is tested here" in load["message"]
    assert h1["steps"]["stress"]["message"].startswith(
        "the stress tests passed, but load.gpu_load is skipped: nothing shows they ran under GPU load")
    failing = [c["name"] for c in h2["stress"]["cases"] if c["status"] == "failed"]
    assert "model.cpu.tiny_fp32.ar_equals_manifest_golden" in failing and h2["stress"]["failed"] == len(failing)
    assert h2["steps"]["stress"]["message"].startswith(f"{len(failing)} of {len(h2['stress']['cases'])} stress tests failed")
    assert (run_dir / "h1" / "stress_results.json").is_file()

    summary = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith(("h1 ", "h2 "))}
    assert summary["h1"][:3] == ["h1", "FAILED", "-"] and f"{h1['stress']['passed']}/{len(h1['stress']['cases'])}" in summary["h1"]
    md = (run_dir / "report.md").read_text()
    assert (f"| h1 | failed | {h1['stress']['passed']} | 0 | {h1['stress']['skipped']} | skipped: KD_GPU_LOAD=cycle: "
            "no CUDA backend is tested here") in md
    assert "Failing under load on **h2**:" in md and "`model.cpu.tiny_fp32.ar_equals_manifest_golden` failed" in md
    html = dom(tmp_path, run_dir / "report.html")
    assert 'id="stress"' in html and 'data-test="model.cpu.tiny_fp32.ar_equals_manifest_golden"' in html
    suites = {s.get("name"): s for s in ET.parse(run_dir / "junit.xml").getroot().iter("testsuite")}
    for name, host in (("h1", h1), ("h2", h2)):
        cases = {c.get("name"): c for c in suites[name].iter("testcase") if c.get("name").startswith("stress.")}
        assert len(cases) == len(host["stress"]["cases"])
    assert suites["h1"].find("testcase[@name='stress.load.gpu_load']/skipped") is not None
    assert suites["h2"].find("testcase[@name='stress.model.cpu.tiny_fp32.ar_equals_manifest_golden']/failure") is not None


def test_a_failing_build_shows_the_compiler_error(lab, workdir, full_run):
    broken = workdir / "broken-engine"
    shutil.copytree(workdir / "engine_src", broken, ignore=COPY_IGNORE)
    with open(broken / "src" / "main.cpp", "a") as f:
        f.write("\nthis is not C++;\n")
    h1 = lab.hosts["h1"]
    shutil.copytree(h1.root / "engine", h1.root / "broken", symlinks=True)   # incremental: only main.cpp
    inventory = write_inventory(workdir, "broken", {"h1": lab.inventory_entry(h1, remote_dir=str(h1.root / "broken"))},
                                source=broken)
    run_dir = workdir / "run-broken"
    proc = invoke(lab, inventory, "--host", "h1", "--report-dir", str(run_dir))
    assert proc.returncode == 1
    run = load_run(run_dir)
    assert steps(run, "h1") == {"preflight": "passed", "sync": "passed", "build": "failed", "bundles": "skipped",
                                "golden": "skipped", "test": "skipped", "bench": "skipped"}
    build = run["hosts"]["h1"]["steps"]["build"]
    assert "main.cpp" in build["tail"] and "error" in build["tail"]
    assert "this is not C++" in (run_dir / "report.md").read_text()
    failure = next(c for c in ET.parse(run_dir / "junit.xml").getroot().iter("testcase")
                   if c.get("name") == "step.build").find("failure")
    assert failure is not None and "main.cpp" in (failure.text or "")


def test_a_step_timeout_kills_the_build_and_keeps_its_partial_log(lab, workdir):
    h2 = lab.hosts["h2"]
    remote_dir = h2.root / "slow"
    inventory = write_inventory(workdir, "slow", {"h2": lab.inventory_entry(
        h2, remote_dir=str(remote_dir), timeouts={"connect": 5, "keepalive": 5, "build": 3})})
    run_dir = workdir / "run-timeout"
    proc = invoke(lab, inventory, "--host", "h2", "--steps", "preflight,sync,build", "--report-dir", str(run_dir))
    assert proc.returncode == 1
    run = load_run(run_dir)
    build = run["hosts"]["h2"]["steps"]["build"]
    assert build["status"] == "timeout", build
    assert 3 <= build["seconds"] < 30
    assert "scripts/build.sh" in (run_dir / "h2" / "build.log").read_text()
    assert steps(run, "h2")["bundles"] == "skipped"
    assert not processes_in(remote_dir), "the build outlived its timeout"


def processes_in(directory: Path) -> list[str]:
    """Command lines of the processes whose working directory is inside `directory`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cwd = os.readlink(proc / "cwd")
            if cwd == str(directory) or cwd.startswith(f"{directory}/"):
                found.append((proc / "cmdline").read_text().replace("\0", " "))
        except OSError:
            continue
    return found


def left_after_the_guards(directory: Path) -> list[str]:
    """processes_in(directory) once the step guards there have ended (waiting at most KILL_AFTER +
    5 s): a client stops waiting for a stopped command's end after STOP_GRACE, and a guard on a
    loaded host may still be killing what its step left then (it does so on its own)."""
    wait_for(lambda: not [c for c in processes_in(directory) if " kdtree-step " in c], remote.KILL_AFTER + 5)
    return processes_in(directory)


def copy_of_h1(lab, workdir, name: str, drop_stamps=()) -> tuple[Path, Path]:
    """A copy of the full run's deployment on h1 (its build and result stamps with it), and an
    inventory for it; `drop_stamps`: state files left out (that step then runs for real). The
    tests using it come before the nightly below, which re-runs bench on h1's deployment (so that
    its bench.json is no longer the one the full run stamped)."""
    h1 = lab.hosts["h1"]
    shutil.copytree(h1.root / "engine", h1.root / name, symlinks=True)
    for stamp in drop_stamps:
        (h1.root / name / ".kdtree" / stamp).unlink()
    return h1.root / name, write_inventory(workdir, name, {"h1": lab.inventory_entry(h1, remote_dir=str(h1.root / name))})


def test_no_cache_really_rebuilds_and_regenerates(lab, workdir, full_run):
    """--no-cache on a host whose build and bundles are up to date: both run (not cached), the
    build log shows every source compiled."""
    _, inventory = copy_of_h1(lab, workdir, "nocache")
    run_dir = workdir / "run-nocache"
    proc = invoke(lab, inventory, "--host", "h1", "--steps", "preflight,sync,build,bundles", "--no-cache",
                  "--report-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run = load_run(run_dir)
    assert steps(run, "h1")["build"] == "passed" and steps(run, "h1")["bundles"] == "passed"
    log = (run_dir / "h1" / "build.log").read_text()
    assert "KD_REBUILD=1: full rebuild" in log
    sources = [p.relative_to(workdir / "engine_src").as_posix() for p in (workdir / "engine_src" / "src").glob("*.cpp")]
    assert sources and all(f"build.sh: compiling {s}" in log for s in sources)
    assert "regenerated with" in run["hosts"]["h1"]["steps"]["bundles"]["message"]


def test_reused_results_say_so_everywhere(lab, workdir, full_run, tmp_path):
    """Nothing changed since the full run: build, bundles, test and bench are `cached` with
    `reused_from` the full run's id in run.json, the console and the reports; comparing the two
    runs calls every metric `reused`, never `same`; a nightly never reuses."""
    _, full_dir = full_run
    full_id = load_run(full_dir)["run_id"]
    _, inventory = copy_of_h1(lab, workdir, "reuse")
    run_dir = workdir / "run-reuse"
    proc = invoke(lab, inventory, "--host", "h1", "--report-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run = load_run(run_dir)
    reused = {name: s.get("reused_from") for name, s in run["hosts"]["h1"]["steps"].items()}
    assert steps(run, "h1") == {"preflight": "passed", "sync": "passed", "build": "cached", "bundles": "cached",
                                "golden": "cached", "test": "cached", "bench": "cached"}
    assert reused == {"preflight": None, "sync": None, "build": full_id, "bundles": full_id, "golden": full_id,
                      "test": full_id, "bench": full_id}
    assert run["hosts"]["h1"]["golden"] and all(g["status"] == "passed" for g in run["hosts"]["h1"]["golden"].values())
    assert "compared again now, not regenerated" in run["hosts"]["h1"]["steps"]["golden"]["message"]
    assert "bash scripts/generate.sh" not in (run_dir / "h1" / "golden.log").read_text()
    assert f"[h1] bench     cached (reused from run {full_id})" in proc.stdout
    assert f"reused results (not re-run): h1 build from run {full_id}; h1 bundles from run {full_id}" in proc.stdout
    report_md = (run_dir / "report.md").read_text()
    assert f"cached (run {full_id})" in report_md and "(not re-run)" in report_md
    assert f"reused from run {full_id}" in (run_dir / "junit.xml").read_text()
    html = dom(tmp_path, run_dir / "report.html")
    assert f"reused from {full_id}" in html
    proc = subprocess.run([sys.executable, "-m", "invoke", "report", "--inventory", str(inventory), "--run",
                           str(run_dir), "--compare", str(full_dir)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    compare = next(run_dir.glob("compare-*.md")).read_text()
    rows = [line for line in compare.splitlines() if line.startswith("| h1 ")]
    assert rows and all(f"reused (current reused from run {full_id}: not a new measurement)" in r for r in rows)
    assert not any("| same" in r for r in rows)


def edited_engine(workdir, name: str, path: str, old: str, new: str) -> Path:
    """A copy of the engine snapshot (file times kept, as a sync sees them) with the first `old`
    of `path` replaced by `new`."""
    source = workdir / f"engine_{name}"
    shutil.copytree(workdir / "engine_src", source, ignore=COPY_IGNORE)
    text = (source / path).read_text()
    assert old in text
    (source / path).write_text(text.replace(old, new, 1))
    return source


def test_a_comment_edit_rebuilds_and_reuses_test_and_bench(lab, workdir, full_run):
    """A comment added to one .cpp makes a new tree: sync and build run (that file compiled, the
    binary reports the new tree), but the executables are the full run's but for their tree
    stamp, and nothing else test and bench read changed: both are `cached`, reused from the full
    run with the same `inputs`, and say that it ran on another tree."""
    _, full_dir = full_run
    full = load_run(full_dir)
    source = edited_engine(workdir, "comment", "src/tree.cpp", "\n", "  // an edited comment\n")
    remote, _ = copy_of_h1(lab, workdir, "comment")
    inventory = write_inventory(workdir, "comment", {"h1": lab.inventory_entry(lab.hosts["h1"], remote_dir=str(remote))},
                                source)
    run_dir = workdir / "run-comment"
    proc = invoke(lab, inventory, "--host", "h1", "--report-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run, old_tree = load_run(run_dir), full["source"]["tree_hash"]
    host = run["hosts"]["h1"]
    assert steps(run, "h1") == {"preflight": "passed", "sync": "passed", "build": "passed", "bundles": "cached",
                                "golden": "cached", "test": "cached", "bench": "cached"}
    assert host["binary_tree_hash"] == run["source"]["tree_hash"] != old_tree
    assert "build.sh: compiling src/tree.cpp" in (run_dir / "h1" / "build.log").read_text()
    for step in ("golden", "test", "bench"):
        record = host["steps"][step]
        assert record["reused_from"] == full["run_id"], record
        assert record["inputs"] == full["hosts"]["h1"]["steps"][step]["inputs"] and len(record["inputs"]) == 64
        assert f"it ran on tree {old_tree[:12]}, not this {run['source']['tree_hash'][:12]}" in record["message"]
    assert f"[h1] test      cached (reused from run {full['run_id']})" in proc.stdout


def test_a_code_change_or_a_tampered_binary_or_bundle_runs_test_and_bench_again(lab, workdir, full_run):
    """A changed string in one .cpp changes the executables: bench is not reused but runs (cut
    short by a 3 s timeout, which proves it ran without paying for it), its log naming what
    changed; a binary and a bundle changed on the host since the full run: test runs again."""
    full_id = load_run(full_run[1])["run_id"]
    h1 = lab.hosts["h1"]
    source = edited_engine(workdir, "code", "src/cli_main.cpp", '"usage:\\n"', '"usage (edited):\\n"')
    for name, steps_, source_ in (("code", "preflight,sync,build,bench", source), ("tampered", "preflight,test", None)):
        remote, _ = copy_of_h1(lab, workdir, name)
        for tampered in ("build/test_ops", "tests/refs/model_tiny_fp32.kdtr") if name == "tampered" else ():
            with (remote / tampered).open("ab") as f:
                f.write(b"\0")
        entry = lab.inventory_entry(h1, remote_dir=str(remote), timeouts={"connect": 5, "keepalive": 5, "test": 3, "bench": 3})
        run_dir = workdir / f"run-{name}"
        proc = invoke(lab, write_inventory(workdir, name, {"h1": entry}, source_), "--host", "h1", "--steps", steps_,
                      "--report-dir", str(run_dir))
        step = steps_.rsplit(",", 1)[-1]
        run = load_run(run_dir)
        assert proc.returncode != 0 and steps(run, "h1")[step] == "timeout", proc.stdout[-4000:]
        assert run["hosts"]["h1"]["steps"][step]["reused_from"] is None
        log = (run_dir / "h1" / f"{step}.log").read_text()
        changed = "build/kdtree" if name == "code" else "build/test_ops, tests/refs/model_tiny_fp32.kdtr"
        assert f"not reused from run {full_id}: " in log and changed in log, log[:2000]


def test_an_interrupt_during_test_keeps_every_finished_step(lab, workdir, full_run):
    """The scenario of a Ctrl-C during `test` on an sshd host with the real engine: preflight,
    sync, build, bundles and golden keep their outcome and time, test is `interrupted` with the
    output it had, bench `skipped`, the run `interrupted`, exit 130."""
    remote, inventory = copy_of_h1(lab, workdir, "interrupt", drop_stamps=["test.json"])
    run_dir = workdir / "run-interrupt"
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "validate", "--inventory", str(inventory), "--host", "h1",
                             "--report-dir", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **lab.env(), "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:
            if line.startswith("[h1] test      | "):
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:] + err[-2000:]
    run = load_run(run_dir)
    assert run["status"] == "interrupted" and run["hosts"]["h1"]["status"] == "interrupted"
    assert steps(run, "h1") == {"preflight": "passed", "sync": "passed", "build": "cached", "bundles": "cached",
                                "golden": "cached", "test": "interrupted", "bench": "skipped"}
    record = run["hosts"]["h1"]["steps"]
    assert all(record[s]["seconds"] > 0 for s in ("preflight", "sync", "golden"))
    assert record["test"]["tail"].strip() and record["test"]["tail"] in (run_dir / "h1" / "test.log").read_text()
    assert "no engine tests ran" not in (run_dir / "report.md").read_text()
    assert "### h1 · test: interrupted" in (run_dir / "report.md").read_text()
    assert not left_after_the_guards(remote), "the tests outlived the interrupt"


def test_nightly_flags_a_benchmark_regression_and_exits_3(lab, workdir, full_run):
    _, full_dir = full_run
    full = load_run(full_dir)
    metric, value = next((m, v["value"]) for m, v in full["hosts"]["h1"]["bench"]["metrics"].items()
                         if v["better"] == "higher" and v["value"] > 0)
    baseline = workdir / "baseline.json"
    baseline.write_text(json.dumps({"version": 1, "hosts": {"h1": {metric: value * 10}}, "thresholds": {"*": 0.5}}))
    run_dir = workdir / "run-nightly"
    proc = subprocess.run([sys.executable, "-m", "invoke", "nightly", "--inventory", str(workdir / "h1.yaml"),
                           "--host", "h1", "--skip", "test", "--baseline", str(baseline), "--report-dir", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=1200, env={**os.environ, **lab.env()})
    assert proc.returncode == 3, proc.stdout[-4000:] + proc.stderr[-2000:]
    run = load_run(run_dir)
    assert run["command"] == "nightly" and run["status"] == "passed"
    stress = run["hosts"]["h1"]["steps"]["stress"]          # nightly runs the stress step, last
    assert list(run["hosts"]["h1"]["steps"])[-1] == "stress" and stress["status"] == "skipped"
    if shutil.which("nvidia-smi") is None:
        assert stress["message"] == NO_GPU
    assert [(r["host"], r["metric"]) for r in run["regressions"]] == [("h1", metric)]
    assert f"REGRESSION h1 {metric}" in proc.stdout
    # the nightly's own bench command, after the variables the step sets for it (KD_MAX_MEMORY: the bundles' need)
    assert re.search(rf"^\$ (KD_[A-Z_]+=\S+ )*{re.escape(NIGHTLY_BENCH)}$", (run_dir / "h1" / "bench.log").read_text(),
                     re.M)
    assert metric in (run_dir / "report.md").read_text()


def test_report_rerenders_and_compares_two_runs(lab, workdir, full_run):
    _, full_dir = full_run
    again = workdir / "run-copy"
    shutil.copytree(full_dir, again)
    (again / "report.html").unlink()
    proc = subprocess.run([sys.executable, "-m", "invoke", "report", "--inventory", str(workdir / "h1.yaml"),
                           "--run", str(again), "--compare", str(full_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (again / "report.html").is_file()
    compare = next(again.glob("compare-*.md")).read_text()
    assert "h1" in compare and "tokens/s" in compare



# --------------------------------------------------------------------------------------------
# Benchmark history and bisect (a git repository of the engine snapshot; h2 gets a copy of h1's
# deployment, its build and build cache included)

GOLDEN_BREAK = ("        g.tokens.push_back(token);\n    }\n    g.decode_counters",
                "        if (g.tokens.size() == 7) token = (token + 1) % model.config().vocab_size;\n"
                "        g.tokens.push_back(token);\n    }\n    g.decode_counters")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def history_repo(lab, workdir, full_run, reference_bundles):
    """A repository holding the engine snapshot and an inventory for h2 (a copy of h1's built
    deployment): c0 the snapshot, c1 a change outside engine_src, c2 AR's 8th token moved (golden
    breaks), c3 an engine README change. Its local bundle cache (build/, ignored) holds the
    session's reference bundles, as workdir's does: no commit changes the generator, so neither
    the nightly nor a bisect probe regenerates them here. Returns (repo, inventory, [c0, c1, c2, c3])."""
    repo = workdir / "history-repo"
    shutil.copytree(workdir / "engine_src", repo / "engine_src")
    reference_bundles.seed_local_cache(repo, repo / "engine_src")
    h1, h2 = lab.hosts["h1"], lab.hosts["h2"]
    shutil.copytree(h1.root / "engine", h2.root / "history-engine", symlinks=True)
    inventory = write_inventory(repo, "hosts", {"h2": lab.inventory_entry(h2, remote_dir=str(h2.root / "history-engine"))},
                                source=repo / "engine_src")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "t@example.invalid")
    git(repo, "config", "user.name", "t")
    (repo / ".gitignore").write_text("/runs/\nbuild/\nhosts.yaml\n*.pyc\n__pycache__/\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "c0: the engine")
    shas = [git(repo, "rev-parse", "HEAD")]
    (repo / "NOTES.md").write_text("notes\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "c1: notes")
    shas.append(git(repo, "rev-parse", "HEAD"))
    decode = repo / "engine_src" / "src" / "decode.cpp"
    assert decode.read_text().count(GOLDEN_BREAK[0]) == 1, f"GOLDEN_BREAK's anchor is not in {decode} once: update it"
    decode.write_text(decode.read_text().replace(*GOLDEN_BREAK))
    git(repo, "commit", "-qam", "c2: AR's 8th token moves")
    shas.append(git(repo, "rev-parse", "HEAD"))
    readme = repo / "engine_src" / "README.md"
    readme.write_text(readme.read_text() + "\nA line.\n")
    git(repo, "commit", "-qam", "c3: engine README")
    shas.append(git(repo, "rev-parse", "HEAD"))
    return repo, inventory, shas


def orch(lab, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **lab.env()})


def test_nightly_judges_each_metric_against_its_history_and_prints_the_bisect_command(lab, workdir, full_run,
                                                                                      history_repo):
    from orchestrator.records.history import HistoryStore, host_key
    repo, inventory, shas = history_repo
    git(repo, "checkout", "-q", shas[1])                # the engine of c0, the commit c1
    _, full_dir = full_run
    full = load_run(full_dir)
    h1 = full["hosts"]["h1"]
    metric, measured = next((m, v) for m, v in h1["bench"]["metrics"].items() if m.endswith("ar_tokens_per_s"))
    assert measured["noisy"] is True and len(measured["samples"]) == measured["n"] >= 3   # CPU timings, samples
    assert len(measured["cpu_samples"]) == measured["n"] and measured["cpu_share"] > 0    # and per CPU second
    store_path = workdir / "kept-history" / "nightly.sqlite"
    # Ten earlier nightlies at c0, ten times faster: far beyond what load on a shared CI machine moves a CPU
    # timing between two runs (at three times, a run measured 1.5x faster than full_run read as ratio 0.504).
    with HistoryStore.open(store_path) as store:
        for i in range(10):
            earlier = json.loads(json.dumps(full))
            earlier.update(run_id=f"20200101-0000{i:02d}-aaaa", started=f"2020-01-01T00:00:{i:02d}Z", command="nightly",
                           source={"tree_hash": h1["deployed_tree_hash"], "git_rev": shas[0], "git_dirty": False})
            host = earlier["hosts"]["h1"]
            host["bench"]["metrics"] = {metric: {**measured, "value": measured["value"] * 10,
                                                 "samples": [measured["value"] * 10 * f for f in (0.99, 1, 1.01)],
                                                 "cpu_samples": [v * 10 for v in measured["cpu_samples"]]}}
            earlier["hosts"] = {"h2": host}
            store.index_run(earlier)
        assert host_key("h2", host) in [k for k, _ in store.series_keys()]
    run_dir = repo / "runs" / "nightly-history"
    proc = orch(lab, "nightly", "--inventory", str(inventory), "--host", "h2", "--steps", "sync,build,bundles,bench",
                "--history", str(store_path), "--report-dir", str(run_dir))
    assert proc.returncode == 3, proc.stdout[-4000:] + proc.stderr[-2000:]
    run = load_run(run_dir)
    assert run["hosts"]["h2"]["steps"]["build"]["status"] in ("passed", "cached")    # the checkout rewrote mtimes
    (reg,) = [r for r in run["regressions"] if r["metric"] == metric]
    assert reg["method"] == "history" and reg["ratio"] < 0.5 and len(reg["evidence"]["window"]) == 10
    assert reg["evidence"]["score"] > 4 and reg["evidence"]["good_commit"] == shas[0]
    command = f"invoke bisect --host h2 --good {shas[0]} --bad {shas[1]} --metric {metric}"
    assert reg["bisect"] == command and f"find the commit: {command}" in proc.stdout
    assert f"REGRESSION h2 {metric}" in proc.stdout and "robust z" in proc.stdout
    assert "history: per CPU second: change" in proc.stdout and "; wall clock: change" in proc.stdout
    assert [r["metric"] for r in run["regressions"]] == [metric]      # every other metric is new: no history
    assert run["history"]["store"] == str(store_path)
    board = repo / "runs" / "history.html"
    assert run["history"]["dashboard"] == "../history.html" and board.is_file()
    html = (run_dir / "report.html").read_text()
    assert 'id="history-link" href="../history.html"' in html and command in html
    page = board.read_text()
    assert '<a href="nightly-history/report.html">' in page and 'data-regressed="true"' in page
    with HistoryStore.open(store_path) as store:
        assert len(store.points(run_id=run["run_id"])) == len(run["hosts"]["h2"]["bench"]["metrics"])


def test_bisect_finds_the_commit_that_broke_the_golden_tokens_without_touching_the_checkout(lab, history_repo):
    repo, inventory, shas = history_repo
    git(repo, "checkout", "-q", shas[1])
    (repo / "NOTES.md").write_text("an uncommitted edit\n")
    proc = orch(lab, "bisect", "--inventory", str(inventory), "--host", "h2", "--good", shas[0], "--bad", shas[3],
                "--golden")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == f"first bad commit: {shas[2]} c2: AR's 8th token moves"
    probes = [line for line in lines if line.startswith("probe ")]
    assert len(probes) == 3 and all("/4:" in p for p in probes)       # 3 distinct engine trees: at most 4 probes
    assert "BAD" in probes[0] and "golden:" in probes[0] and "good" in probes[1]
    assert "cached build" in probes[1]                                  # c0's build came from the host's cache
    assert git(repo, "rev-parse", "HEAD") == shas[1] and (repo / "NOTES.md").read_text() == "an uncommitted edit\n"
    assert git(repo, "worktree", "list").count("\n") == 0
    bisect_runs = [json.loads(p.read_text()) for p in (repo / "runs").glob("*/run.json")]
    assert sum(r["command"] == "bisect" for r in bisect_runs) == 3
    assert {r["source"]["git_rev"] for r in bisect_runs if r["command"] == "bisect"} == {shas[0], shas[2], shas[3]}
