"""Verdicts that never lie: a selection of nothing, an interrupt, reused results, a dry run and the
command line itself say what really happened (on `local` and loopback sshd hosts; the real engine's
rebuild and reuse are in test_validate.py)."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from orchestrator import cli, inventory, remote, steps
from orchestrator.runner import pipeline
from orchestrator.records import run_store
from orchestrator.runner.console import Console
from orchestrator.errors import HostError, InventoryError, UsageError
from orchestrator.runner.run import Run

REPO = Path(__file__).resolve().parents[2]
TASKS = ("hosts", "doctor", "trust", "deploy", "validate", "nightly", "baseline", "report", "clean")


def run_task(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """A task as a user runs it: `python -m invoke ...` in the repo."""
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def orch(*args: str) -> subprocess.CompletedProcess:
    """`kdtree-orch ...` (the console entry), from another directory."""
    return subprocess.run([sys.executable, "-c", "from orchestrator.program import main; main()", *args], cwd="/",
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


def write_yaml(tmp_path: Path, hosts: dict, groups: dict | None = None, source: str | None = None) -> Path:
    data = yaml.safe_load((REPO / "hosts.yaml").read_text())
    data["project"]["source"] = source or str(REPO / "engine_src")
    data["hosts"] = hosts
    data["groups"] = groups or {}
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


LOCAL = {"transport": "local", "remote_dir": ".deploy/local"}
GPU = {"address": "gpu1", "remote_dir": "/srv/kdtree"}


# -- selections that select nothing ---------------------------------------------------------------
def test_a_group_without_hosts_is_a_usage_error_naming_it(tmp_path):
    """`--group blackwell` whose only host's `groups:` says something else selects nothing: exit 2
    naming the group, never a silent fall-back to `local` (validate and nightly alike)."""
    path = write_yaml(tmp_path, {"local": LOCAL, "ct200": GPU}, groups={"blackwell": {"description": "x"}})
    for task in ("validate", "nightly", "deploy", "doctor"):
        proc = run_task(task, "--inventory", str(path), "--group", "blackwell")
        assert proc.returncode == 2, (task, proc.stdout, proc.stderr)
        assert "--group blackwell: no host of" in proc.stderr and "in group 'blackwell'" in proc.stderr
        assert "[local]" not in proc.stdout
    assert not (tmp_path / "runs").exists()


def test_a_nightly_with_no_host_but_local_is_a_usage_error(tmp_path):
    proc = run_task("nightly", "--inventory", str(write_yaml(tmp_path, {"local": LOCAL})))
    assert proc.returncode == 2
    assert "has no host but `local`; name the hosts with --host, --group or --all" in proc.stderr


def test_an_undeclared_group_is_an_inventory_error_with_a_suggestion(tmp_path):
    path = write_yaml(tmp_path, {"ct200": {**GPU, "groups": ["blackwel"]}}, groups={"blackwell": {}})
    with pytest.raises(InventoryError) as e:
        inventory.load(path)
    assert str(e.value) == (f"{path}: host 'ct200': key 'groups': group 'blackwel' is not declared under "
                            "`groups:` (did you mean 'blackwell'?)")
    proc = run_task("hosts", "--inventory", str(path))
    assert proc.returncode == 2 and "did you mean 'blackwell'?" in proc.stderr


def test_an_empty_step_selection_is_a_usage_error(tmp_path):
    path = write_yaml(tmp_path, {"local": LOCAL})
    for flags in (["--steps", ","], ["--skip", ",".join(steps.ORDER)], ["--steps", "build", "--skip", "build"]):
        proc = run_task("validate", "--inventory", str(path), *flags)
        assert proc.returncode == 2, (flags, proc.stdout, proc.stderr)
        assert "selects no step (steps: preflight, sync, build" in proc.stderr
    with pytest.raises(UsageError, match="--steps selects no step"):
        pipeline.Plan.choose(" , ")
    assert not (tmp_path / "runs").exists()


# -- the opt-in stress step -----------------------------------------------------------------------
def test_stress_is_nightly_only_unless_steps_names_it():
    default = ("preflight", "sync", "build", "bundles", "golden", "test", "bench")
    validate = pipeline.Plan.choose(None, None, "validate")
    assert validate.steps == validate.listed == default
    chosen = pipeline.Plan.choose("build,test,stress", None, "validate")
    assert chosen.steps == ("build", "test", "stress") and chosen.listed == (*default, "stress")
    nightly = pipeline.Plan.choose(None, None, "nightly")
    assert nightly.steps == nightly.listed == (*default, "stress") == pipeline.Plan.of("nightly").steps
    without = pipeline.Plan.choose(None, "stress", "nightly")
    assert without.steps == default and without.listed[-1] == "stress"      # shown as `not selected`
    assert pipeline.Plan.choose(None, "bench", "validate").listed == default


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_stress_on_local_without_a_gpu_is_skipped_and_the_run_passes(make_inventory, tmp_path):
    """`validate --steps preflight,stress` on `local`: preflight finds no GPU, so stress is
    `skipped` with that reason in run.json, the summary, report.md and junit.xml; exit 0."""
    inv = make_inventory({"local": LOCAL})
    proc = run_task("validate", "--inventory", str(inv.path), "--steps", "preflight,stress", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    run_dir = tmp_path / "runs" / "latest"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == run["hosts"]["local"]["status"] == "passed"
    steps = run["hosts"]["local"]["steps"]
    reason = "the host has no GPU (preflight found none): nothing to run under GPU load"
    assert steps["stress"] == {**steps["stress"], "status": "skipped", "message": reason}
    assert [s for s, v in steps.items() if v["status"] != "skipped" or v["message"] != "not selected"] == \
        ["preflight", "stress"]
    assert run["hosts"]["local"]["stress"] is None and run["hosts"]["local"]["fingerprint"]["gpu_count"] == 0
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("local "))
    assert summary.split()[:11] == ["local", "passed", "-", "passed", *["skipped"] * 6, "skipped"]
    assert "stress    skipped" in proc.stdout and reason in proc.stdout
    assert f"No stress tests ran: local skipped ({reason})." in (run_dir / "report.md").read_text()
    junit = (run_dir / "junit.xml").read_text()
    assert 'name="step.stress" time=' in junit and f'<skipped message="{reason}"' in junit


# -- the inventory file -----------------------------------------------------------------------------
def test_a_duplicate_yaml_key_is_an_inventory_error_naming_the_line(tmp_path):
    path = write_yaml(tmp_path, {"gpu": {**GPU, "user": "alice"}})
    text = path.read_text().replace("    user: alice\n", "    user: alice\n    user: root\n")
    path.write_text(text)
    line = text.splitlines().index("    user: root") + 1
    with pytest.raises(InventoryError) as e:
        inventory.load(path)
    assert str(e.value) == f"{path}: line {line}: key 'user' given twice (first on line {line - 1}); remove one"


def test_relative_paths_resolve_against_the_inventory_folder_and_the_error_says_so(tmp_path):
    copied = tmp_path / "elsewhere"
    copied.mkdir()
    path = write_yaml(copied, {"local": LOCAL}, source="engine_src")
    with pytest.raises(InventoryError) as e:
        inventory.load(path)
    assert str(e.value) == (f"{path}: key 'project.source': {copied / 'engine_src'} is not a directory ('engine_src' "
                            f"is relative: relative paths resolve against the inventory file's folder, {copied})")
    (copied / "engine_src").mkdir()
    inv = inventory.load(path)
    assert inv.project.source == copied / "engine_src"
    assert inv.hosts["local"].remote_dir == str(copied / ".deploy" / "local")


# -- the command line ---------------------------------------------------------------------------------
def test_dash_h_is_help_on_every_task_and_the_host_flag_is_dash_capital_h(tmp_path):
    for task in TASKS:
        proc = run_task(task, "-h")
        assert proc.returncode == 0 and proc.stdout.startswith(f"Usage: inv[oke] [--core-opts] {task}"), (task, proc)
        if "--host" in proc.stdout:
            assert re.search(r"^  -H( STRING)?, --host", proc.stdout, re.M), task
    path = write_yaml(tmp_path, {"local": LOCAL})
    proc = run_task("deploy", "--inventory", str(path), "--dry-run", "-h")       # help, not `--host`
    assert proc.returncode == 0 and "Usage:" in proc.stdout and "[local]" not in proc.stdout
    proc = run_task("deploy", "--inventory", str(path), "--dry-run", "-H", "local")
    assert proc.returncode == 0 and "[local] # local: claim remote_dir" in proc.stdout


def test_usage_errors_exit_2_and_invoke_parse_errors_exit_1():
    for argv in (["nosuch"], ["--nope"], ["deploy", "--nope"], ["deploy", "--group"], ["trust"],
                 ["clean", "--keep", "abc"], ["deploy", "--host", "nope"]):
        proc = orch(*argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr
    for argv, message in ((["trust"], "error: trust needs one host: --host NAME (-H NAME)"),
                          (["clean", "--keep", "abc"], "error: --keep must be a whole number of runs, not 'abc'")):
        proc = run_task(*argv)
        assert (proc.returncode, proc.stderr.strip()) == (2, message)
    proc = run_task("deploy", "--nope")          # Invoke's own parser: its exit code 1 (docs/tasks.md, exit codes)
    assert proc.returncode == 1 and "No idea what '--nope' is!" in proc.stderr
    assert "exits with Invoke's own 1 under `invoke`" in (REPO / "docs" / "tasks.md").read_text()


def test_a_dry_run_resolves_every_address_and_says_nothing_changed(lab, tmp_path):
    """h1 resolves (127.0.0.1); `lost` is an ssh-config alias whose HostName is not a valid DNS name
    (it fails here, without asking any resolver). Exit 1, naming `lost`; nothing is created."""
    with open(lab.ssh_config, "a") as f:
        f.write(f"\nHost lost-{tmp_path.name}\n  HostName gpu..lab\n")
    h1 = lab.hosts["h1"]
    path = write_yaml(tmp_path, {"h1": lab.inventory_entry(h1, remote_dir=str(h1.root / f"dry-{tmp_path.name}")),
                                 "lost": {**GPU, "address": f"lost-{tmp_path.name}"}})
    proc = run_task("deploy", "--inventory", str(path), "--all", "--dry-run", env=lab.env())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "dry run: nothing was changed"
    assert lines[-2] == "cannot resolve the address of 1 host(s): lost"
    assert f"[lost] # ADDRESS DOES NOT RESOLVE: address lost-{tmp_path.name} (HostName gpu..lab) does not resolve" \
        in proc.stdout
    assert "[h1  ] # ADDRESS" not in proc.stdout
    assert not (h1.root / f"dry-{tmp_path.name}").exists() and not (tmp_path / "runs").exists()
    proc = run_task("deploy", "--inventory", str(path), "--host", "h1", "--dry-run", env=lab.env())
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "dry run: nothing was changed"


# -- an interrupt ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_keeps_what_finished_and_says_interrupted(make_inventory, tmp_path, sig):
    """On `local`: Ctrl-C / SIGTERM while `test` runs. preflight and sync keep `passed` and their
    time, test is `interrupted` with its partial log, bench `skipped`; the host and the run are
    `interrupted` in run.json, report.md, junit.xml and the summary; exit 130 / 143."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": ".deploy/local"}},
                         commands={**yaml.safe_load((REPO / "hosts.yaml").read_text())["project"]["commands"],
                                   "test": "echo testing so far; sleep 60"})
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "validate", "--inventory", str(inv.path),
                             "--skip", "build,bundles,golden"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "test      | testing so far" in line:
                break
        time.sleep(0.3)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    out = "".join(seen) + out
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], out + err
    run_dir = tmp_path / "runs" / "latest"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "interrupted" and run["hosts"]["local"]["status"] == "interrupted"
    steps = run["hosts"]["local"]["steps"]
    assert {s: v["status"] for s, v in steps.items()} == {
        "preflight": "passed", "sync": "passed", "build": "skipped", "bundles": "skipped", "golden": "skipped",
        "test": "interrupted", "bench": "skipped"}
    assert steps["preflight"]["seconds"] > 0 and steps["sync"]["seconds"] > 0 and steps["test"]["seconds"] >= 0.3
    assert steps["bench"]["message"] == "test interrupted"
    assert "testing so far" in steps["test"]["tail"] and "testing so far" in (run_dir / "local" / "test.log").read_text()
    report = (run_dir / "report.md").read_text()
    assert "INTERRUPTED" in report.splitlines()[0] and "| interrupted | the run was stopped" in report
    assert "### local · test: interrupted" in report
    junit = (run_dir / "junit.xml").read_text()
    assert 'name="step.test"' in junit and 'type="interrupted"' in junit and 'name="step.preflight"' in junit
    summary = next(l for l in out.splitlines() if l.startswith("local "))
    assert summary.split()[:5] == ["local", "INTERRUPTED", "-", "passed", "passed"]
    assert f"run {run['run_id']}: interrupted" in out


# -- two runs in one process ----------------------------------------------------------------------------
def test_two_runs_in_one_process_do_not_interfere(lab, make_inventory, tmp_path):
    """Stopping one Run (an interrupt) stops its own commands and locks only: a second Run's
    command on the same host goes on and ends normally, and its lock stays held until it ends."""
    h1 = lab.hosts["h1"]
    inv = make_inventory({"a": lab.inventory_entry(h1, remote_dir=str(h1.root / f"run-a-{tmp_path.name}")),
                          "b": lab.inventory_entry(h1, remote_dir=str(h1.root / f"run-b-{tmp_path.name}")),
                          "local": {"transport": "local", "remote_dir": str(tmp_path / "local")}})
    from orchestrator import state
    owner = state.Owner.now("test")
    with Run("validate") as first, Run("validate") as second:
        results = {}
        commands = {}
        for name, run in (("first", first), ("second", second)):
            for host in ("a", "local"):
                transport = run.transport(inv.hosts[host])
                command = remote.wrap(["bash", "-c", "echo begun; sleep 2; echo done"], timeout=30)

                def work(t=transport, key=(name, host), command=command):
                    results[key] = t.run(command, timeout=40)
                commands[name, host] = threading.Thread(target=work)
                commands[name, host].start()
        lock_a = first.lock(first.transport(inv.hosts["a"]), owner)
        lock_b = second.lock(second.transport(inv.hosts["b"]), owner)
        time.sleep(0.5)
        first.stop()
        for thread in commands.values():
            thread.join(30)
        assert results["second", "a"].ok and results["second", "a"].tail.split() == ["begun", "done"]
        assert results["second", "local"].ok and results["second", "local"].tail.split() == ["begun", "done"]
        for host in ("a", "local"):     # stopped: its stdin ended, and its guard stopped it (143) at once
            assert results["first", host].exit_code == 143 and "done" not in results["first", host].tail
        with pytest.raises(HostError, match="the run was interrupted"):
            first.transport(inv.hosts["local"]).run("true", timeout=5)
        assert second.transport(inv.hosts["local"]).run("true", timeout=5).ok
        assert not list((Path(inv.hosts["a"].remote_dir) / ".kdtree").glob("holder-*.json"))    # first's lock released
        assert list((Path(inv.hosts["b"].remote_dir) / ".kdtree").glob("holder-*.json"))       # second's still held
        assert lock_a is not lock_b
    assert not list((Path(inv.hosts["b"].remote_dir) / ".kdtree").glob("holder-*.json"))        # released at its end


# -- doctor and deploy leave a run record -------------------------------------------------------------
def test_the_paths_a_run_ends_with_are_found_from_the_current_directory(make_inventory, tmp_path):
    """The last lines of a validate name the benchmark history, its dashboard, the report and
    junit.xml by paths that work where the user is (this test runs the task from the checkout,
    the inventory and its runs/ being elsewhere): the dashboard was once `../history.html`, a
    path relative to the run directory."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": ".deploy/local"}})
    proc = run_task("validate", "--inventory", str(inv.path), "--steps", "preflight")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    history = re.search(r"^benchmark history: (\S+) \(dashboard (\S+)\)$", proc.stdout, re.M)
    last = re.search(r"^run \S+: passed  report: (\S+)  junit: (\S+)$", proc.stdout, re.M)
    assert history and last, proc.stdout
    printed = [*history.groups(), *last.groups()]
    assert [(REPO / p).resolve() for p in printed] == [tmp_path / "runs" / "history.sqlite", tmp_path / "runs" / "history.html",
                                                       (tmp_path / "runs" / "latest").resolve() / "report.html",
                                                       (tmp_path / "runs" / "latest").resolve() / "junit.xml"]
    assert all((REPO / p).is_file() for p in printed)


def test_doctor_and_deploy_write_a_run_record_like_validate(make_inventory, tmp_path):
    inv = make_inventory({"local": {"transport": "local", "remote_dir": ".deploy/local"}})
    for task, step in (("doctor", "preflight"), ("deploy", "sync")):
        out = io.StringIO()
        assert getattr(cli, task)(inv, [inv.hosts["local"]], Console(out)) == 0
        run_dir = (tmp_path / "runs" / "latest").resolve()
        run = run_store.load_run(run_dir)
        assert (run["command"], run["status"]) == (task, "passed")
        assert list(run["hosts"]["local"]["steps"]) == [step]
        assert (run_dir / "local" / f"{step}.log").is_file() and (run_dir / "report.md").is_file()
        header = next(l for l in out.getvalue().splitlines() if l.startswith("host "))
        assert header.split() == ["host", "status", "backend", step, "seconds", "first", "failure"]
    proc = run_task("report", "--inventory", str(inv.path))       # report and clean work on every run
    assert proc.returncode == 0, proc.stderr
    proc = run_task("clean", "--inventory", str(inv.path), "--keep", "0")
    assert proc.returncode == 0 and run_store.list_runs(tmp_path / "runs") == []
