"""Fault suite (issue 8), the remote work: a step timeout kills the whole remote process tree and
keeps the partial log; an interrupt (SIGINT, SIGTERM) during sync, build or test stops the remote
work and releases the lock.

Every test proves one scenario of the issue against real OpenSSH sshd hosts on 127.0.0.1 (the
session `lab`, or fresh hosts of its own for anything that stops, kills or re-keys sshd) and
states in its docstring what the user sees and what must hold afterwards. Timeouts are small
(connect 3 s, keepalive 2 s, steps a few seconds) and source trees tiny. docs/guarantees.md lists
each promise with the test that proves it; the helpers are tests/fault_lab.py's.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


from fault_lab import MARK, REPO, entry, fake_commands, invoke, names, processes, run_validate, slow_rsync, wait_for


# -- 6: step timeout -----------------------------------------------------------------------------------
def test_6_a_step_timeout_kills_the_whole_remote_tree_and_keeps_the_partial_log(lab, make_inventory, tmp_path):
    """Scenario 6. A build that outlives its 3 s timeout, having started a grandchild, background
    children (`&`, a subshell's `&`, nohup) and one that left the process group (setsid). The user
    sees: build TIMEOUT after ~3 s, later steps skipped, exit code 1, and the output printed before
    the timeout in the report (run.json tail, report.md, report.html, junit.xml) and the step log.
    Afterwards: not one of those processes is left on the host."""
    m = f"6{MARK}"
    build = (f"echo partial-output-{m}; sleep 5{m} & (sleep 6{m} &); nohup sleep 7{m} >/dev/null 2>&1 & "
             f"setsid sleep 8{m} & bash -c 'sleep 9{m}'")
    h2 = lab.hosts["h2"]
    inv = make_inventory({"h2": entry(lab, h2, remote_dir=str(h2.root / f"timeout-{tmp_path.name}"),
                                      timeouts={"build": 3})}, commands=fake_commands(build=build))
    start = time.monotonic()
    code, run_dir, out = run_validate(inv, ["h2"], "sync,build,test", tmp_path / "run")
    assert code == 1 and time.monotonic() - start < 20
    run = json.loads((run_dir / "run.json").read_text())
    steps = run["hosts"]["h2"]["steps"]
    assert steps["build"]["status"] == "timeout" and steps["test"]["status"] == "skipped"
    assert 3 <= steps["build"]["seconds"] < 10
    assert "timed out after 3 s" in steps["build"]["message"]
    assert f"partial-output-{m}" in steps["build"]["tail"]
    assert f"partial-output-{m}" in (run_dir / "h2" / "build.log").read_text()
    for name in ("report.md", "report.html", "junit.xml"):
        assert f"partial-output-{m}" in (run_dir / name).read_text(), name
    assert re.search(r"h2 .*build.*TIMEOUT|build +TIMEOUT", out)
    assert wait_for(lambda: not processes(rf"^sleep [5-9]{m}"), 3), processes(rf"^sleep [5-9]{m}")


# -- 7: interrupts ---------------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def reading_from(pid: int) -> list[int]:
    """The processes whose stdin is the pipe process `pid` writes to."""
    try:
        pipe = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return []
    readers = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int(proc.name) != pid and os.readlink(proc / "fd" / "0") == pipe:
                readers.append(int(proc.name))
        except OSError:
            continue
    return readers


INTERRUPTS = [("deploy", "sync", signal.SIGINT), ("deploy", "sync", signal.SIGTERM),
              ("validate", "sync", signal.SIGINT), ("validate", "sync", signal.SIGTERM),
              ("validate", "build", signal.SIGINT), ("validate", "build", signal.SIGTERM),
              ("validate", "test", signal.SIGINT), ("validate", "test", signal.SIGTERM)]


@pytest.mark.parametrize("task,phase,sig", INTERRUPTS, ids=[f"{t}-{p}-{s.name}" for t, p, s in INTERRUPTS])
def test_7_an_interrupted_run_stops_the_remote_work_and_releases_the_lock(
        lab, make_inventory, source, tmp_path, task, phase, sig):
    """Scenario 7. `invoke deploy` / `invoke validate` gets SIGINT (Ctrl-C) or SIGTERM (CI cancelling
    a job) during the sync, the build or the tests. The user sees: `interrupted`, exit code 130
    (SIGINT) or 143 (SIGTERM), within seconds; deploy and validate both write the run directory:
    the run and the host `interrupted`, sync `passed` (with its time) when it had finished, the
    running step `interrupted` with the output it had, the rest `skipped`. Afterwards: the remote rsync / build / test processes are gone, the host lock is
    free (its owner file removed: the next run does not report a dead run's lock), and the next run
    works."""
    m = f"7{MARK}{next(names)}"
    h1 = lab.hosts["h1"]
    remote = h1.root / f"interrupt-{tmp_path.name}"
    slow = {}
    if phase == "sync":
        (source / "big.bin").write_bytes(os.urandom(1 << 20))
        slow = {"rsync_path": str(slow_rsync(tmp_path, f"slowcat-{m}"))}
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote), **slow)},
                         commands=fake_commands(build=f"echo building; sleep 3{m}", test=f"echo testing; sleep 3{m}"))
    args = [task, "--inventory", str(inv.path), "--host", "h"]
    if task == "validate":
        args += ["--steps", {"sync": "sync", "build": "sync,build", "test": "sync,test"}[phase],
                 "--report-dir", str(tmp_path / "run")]
    proc = subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **lab.env(), "PYTHONUNBUFFERED": "1"})
    try:
        if phase == "sync":
            found = wait_for(lambda: [int(p.split(":")[0]) for p in processes(rf"slowcat-{m}")], 30)
            assert len(found) == 1, processes(rf"slowcat-{m}")
            found += wait_for(lambda: reading_from(found[0]), 5)     # the remote rsync, fed by the slow pipe
            assert len(found) == 2 and "rsync" in Path(f"/proc/{found[1]}/cmdline").read_text()
            remote_pids = found
        else:
            found = wait_for(lambda: [int(p.split(":")[0]) for p in processes(rf"^sleep 3{m}")], 30)
            assert found
            remote_pids = found
        assert all(alive(p) for p in remote_pids)
        start = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], out + err
    assert time.monotonic() - start < 10, out + err
    assert "interrupted" in err + out
    assert wait_for(lambda: not any(alive(p) for p in remote_pids), 5), "the remote work goes on"
    assert not list((remote / ".kdtree").glob("holder-*.json")), "the lock's holder file was left behind"
    run = json.loads(((tmp_path / "run") if task == "validate" else (tmp_path / "runs" / "latest")).joinpath(
        "run.json").read_text())          # deploy and validate alike: finished steps keep their outcome
    assert run["status"] == run["hosts"]["h"]["status"] == "interrupted"
    statuses = {name: s["status"] for name, s in run["hosts"]["h"]["steps"].items()}
    assert statuses[phase] == "interrupted", statuses
    if phase != "sync":
        assert statuses["sync"] == "passed" and run["hosts"]["h"]["steps"]["sync"]["seconds"] > 0
        assert {"build": "building", "test": "testing"}[phase] in run["hosts"]["h"]["steps"][phase]["tail"].splitlines()
    assert all(v == "skipped" for k, v in statuses.items() if k not in ("sync", phase)), statuses
    (source / "big.bin").unlink(missing_ok=True)
    again = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "h")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "recovered the lock" not in again.stdout and (remote / "src" / "main.cpp").is_file()
