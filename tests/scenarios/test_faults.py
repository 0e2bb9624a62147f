"""Fault and attack suite (issue 8): the orchestrator keeps working, loses nothing, lets nothing in.

Every test proves one scenario of the issue against real OpenSSH sshd hosts on 127.0.0.1 (the
session `lab`, or fresh hosts of its own for anything that stops, kills or re-keys sshd) and
states in its docstring what the user sees and what must hold afterwards. Timeouts are small
(connect 3 s, keepalive 2 s, steps a few seconds) and source trees tiny, so the suite runs in a
few minutes. docs/guarantees.md lists each promise with the test that proves it.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import shutil
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from task_runs import deploy_task
from orchestrator import cli, inventory as inventory_mod, sync
from orchestrator.connectors import paramiko as connection, relay
from orchestrator.runner.console import Console
from orchestrator.errors import AuthError, HostKeyError, InventoryError
from orchestrator.connectors.factory import open_transport
from orchestrator.connectors.paramiko import SshTransport

REPO = Path(__file__).resolve().parents[2]
FAST = {"connect": 3, "keepalive": 2, "lock": 10}
_names = itertools.count(1)


# -- helpers ---------------------------------------------------------------------------------------
def fresh_host(lab, kind: str, **kwargs):
    """A new sshd host of this test alone (it may be stopped, killed or re-keyed)."""
    return lab.add_host(f"f{kind}{next(_names)}", **kwargs)


def entry(lab, host, **overrides) -> dict:
    """An inventory entry with the suite's small timeouts."""
    timeouts = {**FAST, **overrides.pop("timeouts", {})}
    return lab.inventory_entry(host, timeouts=timeouts, **overrides)


def count(host, pattern: str) -> int:
    return len(re.findall(pattern, host.log(), re.M))


def accepted(host) -> int:
    """How many sessions the host's sshd authenticated (nothing runs without one)."""
    return count(host, r"Accepted publickey")


def tree(path: Path) -> dict[str, bytes | str]:
    """Every entry under `path` (files with their content, links with their target)."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


def invoke(lab, *args: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """A task run as a user runs it: `python -m invoke ...` in the repo."""
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **lab.env(), **(env or {})})


def processes(pattern: str) -> list[str]:
    """Command lines (of any process on this machine, i.e. on both sides) matching a regex."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if re.search(pattern, line):
                found.append(f"{proc.name}: {line}")
    return found


def wait_for(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def session_pids(host) -> list[int]:
    """The sshd processes serving the host's open connections (children of its listener)."""
    children = subprocess.run(["pgrep", "-P", str(host.proc.pid)], capture_output=True, text=True).stdout.split()
    pids = [int(p) for p in children]
    for pid in list(pids):
        pids += [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                text=True).stdout.split()
                 if Path(f"/proc/{p}/exe").exists() and "sshd" in os.readlink(f"/proc/{p}/exe")]
    return pids


# -- 1, 2: host keys ----------------------------------------------------------------------------------
def test_1_unknown_host_key_is_refused_before_authentication(lab, make_inventory, remote_dir):
    """Scenario 1. The user sees: `invoke deploy` exits 1 and says the host key is not known, shows
    its SHA256 fingerprint and the `invoke trust --host H --fingerprint SHA256:...` command that pins
    it. Afterwards: the host never authenticated us (no session), remote_dir does not exist, and the
    pin command given in the message works.
    (tests/connectors/test_ssh.py::test_unknown_host_key_is_refused_before_anything_runs checks the
    transport and system ssh; this checks the task a user runs.)"""
    stranger = fresh_host(lab, "stranger", trusted=False)
    known = Path(remote_dir + "-known_hosts")
    inv = make_inventory({"s": entry(lab, stranger, remote_dir=remote_dir, known_hosts=str(known))})
    proc = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "s")
    fp = stranger.fingerprint()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"is not known: ssh-ed25519 {fp}" in proc.stdout
    assert f"invoke trust --host s --fingerprint {fp}" in proc.stdout
    assert accepted(stranger) == 0 and not Path(remote_dir).exists()
    pin = invoke(lab, "trust", "--inventory", str(inv.path), "--host", "s", "--fingerprint", fp)
    assert pin.returncode == 0 and known.read_text() == stranger.known_hosts_line()
    assert invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "s").returncode == 0


def test_2_changed_host_key_is_refused_by_every_path(lab, make_inventory, remote_dir, source):
    """Scenario 2. The user sees: HOST KEY CHANGED with the old and new fingerprints and how to
    re-pin, from every task (validate's preflight included); rsync has no path of its own (it runs
    only over the verified connection); `invoke deploy` exits 1.
    Afterwards: no session was authenticated after the key changed, and the deployed tree is exactly
    the one before (nothing ran, nothing was transferred)."""
    changer = fresh_host(lab, "changer")
    inv = make_inventory({"c": entry(lab, changer, remote_dir=remote_dir)})
    assert invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "c").returncode == 0
    before = tree(Path(remote_dir))
    old = changer.fingerprint()
    changer.new_host_key()
    sessions = accepted(changer)
    (source / "src" / "new.cpp").write_text("// must never arrive\n")
    host = inv.hosts["c"]

    proc = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "c")          # Paramiko
    assert proc.returncode == 1
    assert f"HOST KEY CHANGED for {changer.known_name}" in proc.stdout
    assert changer.fingerprint() in proc.stdout and old in proc.stdout and "invoke trust --host c" in proc.stdout
    validate = invoke(lab, "validate", "--inventory", str(inv.path), "--host", "c", "--steps", "preflight,sync",
                      "--report-dir", remote_dir + "-run")
    assert validate.returncode == 1 and "HOST KEY CHANGED" in validate.stdout

    t = SshTransport(host)
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        t.connect()
    with pytest.raises(Exception, match="the connection to the host was lost before the transfer"):
        with relay.rsync_shell(t):
            pass

    assert accepted(changer) == sessions
    assert tree(Path(remote_dir)) == before


# -- 3: authentication ----------------------------------------------------------------------------------
def test_3_authentication_failure_is_one_attempt_with_a_clear_error(lab, make_inventory, remote_dir, tmp_path):
    """Scenario 3. The user sees, within seconds: `authentication to 127.0.0.1:PORT as root failed`,
    exit code 1. Afterwards: the host saw exactly one connection (no retry), and nothing ran."""
    locked = fresh_host(lab, "locked")
    nobody = tmp_path / "no_keys"
    nobody.write_text("")
    locked.config.write_text(locked.config.read_text().replace(f"AuthorizedKeysFile {lab.authorized_keys}",
                                                               f"AuthorizedKeysFile {nobody}"))
    locked.restart()
    attempts = r"(Connection closed|Disconnected) (by|from) authenticating user"
    connections = count(locked, attempts)
    inv = make_inventory({"l": entry(lab, locked, remote_dir=remote_dir)})
    start = time.monotonic()
    with pytest.raises(AuthError, match=r"authentication to 127\.0\.0\.1:\d+ as root failed"):
        open_transport(inv.hosts["l"]).run("true", timeout=10)
    assert time.monotonic() - start < 5
    wait_for(lambda: count(locked, attempts) == connections + 1, 3)
    time.sleep(0.3)
    assert count(locked, attempts) == connections + 1
    start = time.monotonic()
    proc = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "l")
    assert proc.returncode == 1 and "authentication to 127.0.0.1:" in proc.stdout and "failed" in proc.stdout
    assert time.monotonic() - start < 10
    wait_for(lambda: count(locked, attempts) == connections + 2, 3)
    time.sleep(0.3)
    assert count(locked, attempts) == connections + 2
    assert accepted(locked) == 0 and not Path(remote_dir).exists()


# -- 4: unreachable -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["closed-port", "sigstopped-sshd"])
def test_4_unreachable_host_fails_within_the_connect_timeout_while_others_finish(
        lab, make_inventory, tmp_path, fault):
    """Scenario 4. A closed port (connection refused) or a stopped sshd (SIGSTOP: the kernel accepts
    the TCP connection, no SSH banner ever comes). The user sees: the host FAILED with `cannot reach
    127.0.0.1:PORT` in the summary, within the connect timeout (3 s) plus a little; the other hosts
    deploy normally. Afterwards: h1 and h2 hold the full tree, the exit code is 1."""
    bad = fresh_host(lab, "unreach")
    if fault == "closed-port":
        bad.stop()
    else:
        os.kill(bad.proc.pid, signal.SIGSTOP)
    try:
        hosts = {"h1": lab.hosts["h1"], "h2": lab.hosts["h2"], "bad": bad}
        inv = make_inventory({n: entry(lab, h, remote_dir=str(h.root / f"unreach-{tmp_path.name}"))
                              for n, h in hosts.items()})
        out = io.StringIO()
        console = Console(out)
        start = time.monotonic()
        assert cli.deploy(inv, list(inv.hosts.values()), console) == 1
        text = out.getvalue()
        lines = text.splitlines()
        header = next(l.split() for l in lines if l.startswith("host "))
        rows = {l.split()[0]: l.split() for l in lines if l.split()[:1] in (["h1"], ["h2"], ["bad"])}
        assert rows["h1"][1] == rows["h2"][1] == "passed" and rows["bad"][1] == "FAILED"
        seconds = float(rows["bad"][header.index("seconds")])     # host, status, backend, sync, seconds, failure
        assert seconds < FAST["connect"] + 3, text
        assert "cannot reach 127.0.0.1:" in text
        assert time.monotonic() - start < FAST["connect"] + 10
        for n in ("h1", "h2"):
            assert (hosts[n].root / f"unreach-{tmp_path.name}" / "src" / "main.cpp").is_file()
    finally:
        if fault != "closed-port":
            os.kill(bad.proc.pid, signal.SIGCONT)
            bad.stop()


# -- 5: a host that hangs mid-step --------------------------------------------------------------------
def fake_commands(**overrides) -> dict:
    """The shipped project commands with fast stand-ins for the engine's (build key, version)."""
    import yaml
    commands = dict(yaml.safe_load((REPO / "hosts.yaml").read_text())["project"]["commands"])
    commands.update({"build_key": "echo '{}'", "version": "echo kdtree 0.0 tree=none"}, **overrides)
    return commands


def run_validate(inv, host_names, steps, report_dir, **kwargs):
    """The validate pipeline in this process (as `invoke validate` runs it): (exit code, run dir, output)."""
    out = io.StringIO()
    code = cli.validate(inv, [inv.hosts[n] for n in host_names], Console(out), steps=steps,
                        report_dir=str(report_dir), **kwargs)
    return code, Path(report_dir), out.getvalue()


def test_5_a_host_that_hangs_mid_step_is_detected_by_keepalive(lab, make_inventory, tmp_path):
    """Scenario 5. The host's sshd session processes are stopped (SIGSTOP) while a step runs. The user
    sees: the step FAILED with `connection lost while running a command: the host answered no
    keepalive for 6 s`, within keepalive (2 s) x 3 plus a little, not after the step's 60 s timeout.
    Afterwards (the host resumes): the step's remote process tree is gone, and the next run works."""
    hung = fresh_host(lab, "hung")
    marker = f"5{os.getpid() % 1000:03d}"
    inv = make_inventory({"hung": entry(lab, hung, remote_dir=str(hung.root / "engine"), timeouts={"build": 60})},
                         commands=fake_commands(build=f"echo started; sleep 6{marker} & sleep 7{marker}; wait"))
    result = {}
    runner = threading.Thread(target=lambda: result.update(
        r=run_validate(inv, ["hung"], "sync,build", tmp_path / "run")))
    runner.start()
    assert wait_for(lambda: len(processes(rf"^sleep [67]{marker}")) == 2, 30)
    stopped = session_pids(hung)
    assert stopped
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        runner.join(30)
        detected = time.monotonic() - start
        assert not runner.is_alive()
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    code, run_dir, out = result["r"]
    assert code == 1 and detected < 2 * 3 + 4, (detected, out)
    build = json.loads((run_dir / "run.json").read_text())["hosts"]["hung"]["steps"]["build"]
    assert build["status"] == "failed"
    assert "connection lost while running a command: the host answered no keepalive for 6 s" in build["message"]
    assert wait_for(lambda: not processes(rf"^sleep [67]{marker}"), 10), processes(rf"^sleep [67]{marker}")
    code, _, out = run_validate(inv, ["hung"], "sync", tmp_path / "next")
    assert code == 0, out


# -- 14: transient failures -----------------------------------------------------------------------------
def test_14_sshd_down_for_a_few_seconds_is_retried_with_backoff(lab, make_inventory, remote_dir, monkeypatch):
    """Scenario 14. sshd is down for 3 s when the deploy starts. The user sees: the deploy succeeds
    (a little late). Afterwards: the tree is deployed; the connection was attempted several times with
    growing pauses (backoff); an authentication or host-key failure is attempted exactly once."""
    flaky = fresh_host(lab, "flaky")
    inv = make_inventory({"f": entry(lab, flaky, remote_dir=remote_dir, timeouts={"connect": 5})})
    attempts = []
    real_open = connection._open_once

    def counting_open(host):
        attempts.append(time.monotonic())
        return real_open(host)
    monkeypatch.setattr(connection, "_open_once", counting_open)
    flaky.stop()
    threading.Timer(3, flaky.start).start()
    start = time.monotonic()
    result = deploy_task(inv, "f")
    assert result.code == 0 and result.files > 0 and (Path(remote_dir) / "src" / "main.cpp").is_file()
    assert time.monotonic() - start >= 3 and len(attempts) >= 3
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], gaps

    attempts.clear()                                       # host key changed: one attempt, no retry
    flaky.new_host_key()
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        open_transport(inv.hosts["f"]).connect()
    assert len(attempts) == 1
    attempts.clear()                                       # authentication refused: one attempt
    key = inv.hosts["f"]
    lab.untrust(flaky)                                      # (the new key is trusted from here on)
    lab.trust(flaky)
    with pytest.raises(AuthError):
        open_transport(inventory_mod.Host(**{**key.__dict__, "user": "nosuchuser"})).connect()
    assert len(attempts) == 1


# -- 6: step timeout -----------------------------------------------------------------------------------
def test_6_a_step_timeout_kills_the_whole_remote_tree_and_keeps_the_partial_log(lab, make_inventory, tmp_path):
    """Scenario 6. A build that outlives its 3 s timeout, having started a grandchild, background
    children (`&`, a subshell's `&`, nohup) and one that left the process group (setsid). The user
    sees: build TIMEOUT after ~3 s, later steps skipped, exit code 1, and the output printed before
    the timeout in the report (run.json tail, report.md, report.html, junit.xml) and the step log.
    Afterwards: not one of those processes is left on the host."""
    m = f"6{os.getpid() % 1000:03d}"
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
SLOW_CAT = "import os, sys, time\nwhile True:\n    d = os.read(0, 8192)\n    if not d: break\n    os.write(1, d)\n    time.sleep(0.2)"


def slow_rsync(tmp_path: Path, marker: str) -> Path:
    """An rsync_path for the host: rsync receiving through a pipe that passes 40 kB/s (the pipe
    process carries `marker` on its command line; both end when the connection does)."""
    wrapper = tmp_path / "slow-rsync"
    wrapper.write_text("#!/bin/bash\n[ \"$1\" = --version ] && exec rsync --version    # the sync's version query\n"
                       f"exec rsync \"$@\" < <(exec {sys.executable} -c {shlex.quote(SLOW_CAT)} {marker} 2>/dev/null)\n")
    wrapper.chmod(0o755)
    return wrapper


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
    m = f"7{os.getpid() % 1000:03d}{next(_names)}"
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


def outside(remote_dir: Path) -> dict:
    """Everything beside remote_dir in its parent (which no deploy may touch)."""
    parent = remote_dir.parent
    return {k: v for k, v in tree(parent).items() if not (k == remote_dir.name or k.startswith(remote_dir.name + "/"))}


# -- 8: sshd killed during a sync ----------------------------------------------------------------------------
def test_8_sshd_killed_during_a_sync_is_repaired_by_the_next_run(lab, make_inventory, source, tmp_path):
    """Scenario 8. sshd (listener and sessions) is SIGKILLed while rsync is transferring. The user
    sees: the deploy FAILED naming the host (exit 1); after sshd is back, the next deploy says `the
    previous sync did not finish ...; this sync repairs the tree` and that it recovered the dead
    run's lock, and exits 0. Afterwards: the tree on the host is exactly the source (tree hash
    verified), and nothing outside remote_dir changed."""
    m = f"8{os.getpid() % 1000:03d}"
    victim = fresh_host(lab, "victim")
    remote = victim.root / "area" / "engine"
    (victim.root / "area" / "neighbour").mkdir(parents=True)
    (victim.root / "area" / "neighbour" / "precious").write_text("keep\n")
    (victim.root / "area" / "notes.txt").write_text("keep too\n")
    before = outside(remote)
    (source / "big.bin").write_bytes(os.urandom(1 << 20))
    inv = make_inventory({"v": entry(lab, victim, remote_dir=str(remote),
                                     rsync_path=str(slow_rsync(tmp_path, f"slowcat-{m}")))})
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", "--inventory", str(inv.path), "--host", "v"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **lab.env()})
    try:
        assert wait_for(lambda: processes(rf"slowcat-{m}"), 30)
        time.sleep(0.5)
        for pid in session_pids(victim) + [victim.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1 and re.search(r"^v +FAILED", out, re.M), out + err
    assert (remote / sync.PARTIAL).exists()
    victim.start()
    inv = make_inventory({"v": entry(lab, victim, remote_dir=str(remote))})
    again = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "v")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "the previous sync did not finish (started deploy by pid" in again.stdout
    assert "this sync repairs the tree" in again.stdout
    assert "recovered the lock left by a run that died: deploy by pid" in again.stdout
    assert (remote / "big.bin").read_bytes() == (source / "big.bin").read_bytes()
    assert not (remote / sync.PARTIAL).exists()
    assert json.loads((remote / ".kdtree" / "deploy.json").read_text())["tree_hash"] == \
        sync.source_id(inv.project).tree_hash
    assert outside(remote) == before


# -- 9: remote disk full ----------------------------------------------------------------------------------
@pytest.fixture
def small_disk(lab, tmp_path, tmpfs):
    """A 512 kB tmpfs mounted on h2 (its own filesystem: it fills up); skipped where mount is refused."""
    return tmpfs(lab.hosts["h2"].root / f"disk-{tmp_path.name}", "512k", "755")


def test_9_remote_disk_full(lab, make_inventory, source, tmp_path, small_disk):
    """Scenario 9. remote_dir is a 512 kB tmpfs and the tree grows past it. The user sees: validate's
    sync FAILED with a message that names the host and says `No space left on device`, in rsync's
    own words (once lost whenever rsync ended its remote shell before it had passed them on); exit code 1.
    Afterwards: the local run directory is complete (run.json, reports, the sync log); the previous
    deployment on the host is intact (its files and deploy record unchanged); once the tree fits
    again, the next deploy repairs it and says so."""
    inv = make_inventory({"small": entry(lab, lab.hosts["h2"], remote_dir=str(small_disk))})
    assert invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "small").returncode == 0
    deployed = tree(small_disk)
    (source / "big.bin").write_bytes(os.urandom(1 << 20))
    run_dir = tmp_path / "run"
    proc = invoke(lab, "validate", "--inventory", str(inv.path), "--host", "small", "--steps", "sync",
                  "--report-dir", str(run_dir))
    assert proc.returncode == 1
    run = json.loads((run_dir / "run.json").read_text())
    message = run["hosts"]["small"]["steps"]["sync"]["message"]
    assert "No space left on device" in message, run["hosts"]["small"]["steps"]["sync"]
    # rsync's own words (its receiver's error, sent through the transfer's stream), not only the
    # free-space check the sync falls back on when rsync says nothing
    assert f"No space left on device (in {small_disk})" in message, run["hosts"]["small"]["steps"]["sync"]
    assert "[receiver] write failed on" in (run_dir / "small" / "sync.log").read_text()
    assert re.search(r"small .*No space left on device", proc.stdout)
    for name in ("report.md", "report.html", "junit.xml", "small/sync.log"):
        assert (run_dir / name).is_file(), name
    assert "No space left on device" in (run_dir / "report.md").read_text()
    now = tree(small_disk)
    assert {k: v for k, v in now.items() if not k.startswith(".kdtree")} == \
        {k: v for k, v in deployed.items() if not k.startswith(".kdtree")}
    assert now[".kdtree/deploy.json"] == deployed[".kdtree/deploy.json"]
    (source / "big.bin").unlink()
    again = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "small")
    assert again.returncode == 0 and "this sync repairs the tree" in again.stdout, again.stdout + again.stderr


# -- 10: concurrent runs ------------------------------------------------------------------------------------
PAIRS = [("deploy", "deploy"), ("validate", "validate"), ("deploy", "validate")]


@pytest.mark.parametrize("first,second", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_10_two_concurrent_runs_on_one_host(lab, make_inventory, source, tmp_path, first, second):
    """Scenario 10. Two runs (deploy or validate) start at the same moment on one host. The user
    sees: exactly one proceeds (exit 0); the other fails at once (exit 1) saying `is locked by
    another run: <task> by pid <pid of the winner> on <this machine>, started ...`. Afterwards: the
    tree is deployed once, correctly, and the lock is free. (In-process contention and a dead ssh
    client's lock: tests/scenarios/test_deploy.py::test_lock_contention_and_recovery_of_a_dead_runs_lock.)"""
    m = f"10{os.getpid() % 1000:03d}{next(_names)}"
    (source / "big.bin").write_bytes(os.urandom(100 << 10))
    h1 = lab.hosts["h1"]
    remote = h1.root / f"concurrent-{tmp_path.name}"
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote), rsync_path=str(slow_rsync(tmp_path, f"slowcat-{m}")))})

    def start(task):
        args = [task, "--inventory", str(inv.path), "--host", "h"]
        if task == "validate":
            args += ["--steps", "sync", "--report-dir", str(tmp_path / f"run-{next(_names)}")]
        return subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, **lab.env()})
    procs = [start(first), start(second)]
    results = [(p, *p.communicate(timeout=120)) for p in procs]
    winners = [r for r in results if r[0].returncode == 0]
    losers = [r for r in results if r[0].returncode != 0]
    assert len(winners) == 1 and len(losers) == 1, [(p.returncode, o[-2000:], e[-2000:]) for p, o, e in results]
    winner, loser = winners[0][0], losers[0]
    winner_task = first if winner is procs[0] else second
    assert loser[0].returncode == 1
    assert re.search(rf"is locked by another run: {winner_task} by pid {winner.pid} on {re.escape(os.uname().nodename)}",
                     loser[1]), loser[1]
    assert (remote / "big.bin").read_bytes() == (source / "big.bin").read_bytes()
    assert not list((remote / ".kdtree").glob("holder-*.json"))


def test_10_a_killed_runs_lock_is_recovered(lab, make_inventory, source, tmp_path):
    """Scenario 10, second half. `invoke deploy` is SIGKILLed (no cleanup at all) while it holds the
    lock. The user sees: the next deploy proceeds and says `recovered the lock left by a run that
    died: deploy by pid <the killed pid> ...`. Afterwards: the tree is deployed, the lock is free."""
    m = f"10{os.getpid() % 1000:03d}{next(_names)}"
    (source / "big.bin").write_bytes(os.urandom(200 << 10))
    h1 = lab.hosts["h1"]
    remote = h1.root / f"killed-{tmp_path.name}"
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote), rsync_path=str(slow_rsync(tmp_path, f"slowcat-{m}")))})
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", "--inventory", str(inv.path), "--host", "h"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **lab.env()})
    assert wait_for(lambda: processes(rf"slowcat-{m}"), 30)
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not processes(rf"slowcat-{m}"), 10)
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote))})
    again = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "h")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"recovered the lock left by a run that died: deploy by pid {proc.pid} on" in again.stdout
    assert (remote / "big.bin").read_bytes() == (source / "big.bin").read_bytes()


# -- 11: dangerous destinations -------------------------------------------------------------------------------
DANGEROUS = ["", "/", "/root", "/home/alice", "/srv/kdtree/../..", "/srv/a/../b", "/tmp", "/usr/local", "srv/kdtree",
             "/etc/kdtree"]


def test_11_dangerous_destinations_in_the_inventory_are_refused_before_anything_runs(lab, make_inventory):
    """Scenario 11, inventory side: remote_dir empty, '/', a home directory, a path with '..', a
    system path or a relative one. The user sees: exit code 2 and `hosts.yaml: host 'h': key
    'remote_dir': ... refusing to deploy there` (or why the path is not acceptable). Afterwards:
    no connection was authenticated on the host."""
    h1 = lab.hosts["h1"]
    sessions = accepted(h1)
    for bad in DANGEROUS:
        with pytest.raises(InventoryError) as e:
            make_inventory({"h": entry(lab, h1, remote_dir=bad)})
        assert "host 'h': key 'remote_dir'" in str(e.value), (bad, str(e.value))
    good = make_inventory({"h": entry(lab, h1, remote_dir="/srv/kdtree")})
    text = good.path.read_text().replace("/srv/kdtree", "/srv/kdtree/../..")
    good.path.write_text(text)
    proc = invoke(lab, "deploy", "--inventory", str(good.path), "--host", "h")
    assert proc.returncode == 2 and "key 'remote_dir'" in proc.stderr and "refusing to deploy there" in proc.stderr
    assert accepted(h1) == sessions


@pytest.mark.parametrize("case", ["home", "symlink", "through-symlink", "state-symlink", "foreign"])
def test_11_dangerous_destinations_on_the_host_are_refused_before_anything_changes(
        lab, make_inventory, tmp_path, case):
    """Scenario 11, host side (what only the host can tell): remote_dir is the login's home
    directory, a symlink to elsewhere, a path through a symlink, a marked directory whose .kdtree is
    a symlink, or a non-empty directory the orchestrator did not create. The user sees: the deploy
    FAILED with `refusing to use remote_dir: ...` naming the reason. Afterwards: the targets are
    byte-for-byte unchanged (rsync --delete never ran) and no .kdtree was created in them."""
    h1 = lab.hosts["h1"]
    base = h1.root / f"danger-{case}-{tmp_path.name}"
    target = base / "elsewhere"
    target.mkdir(parents=True)
    (target / "precious").write_text("keep me\n")
    remote, reason = {
        "home": (h1.home, "is the home directory"),
        "symlink": (base / "link", "is a symlink"),
        "through-symlink": (base / "link" / "engine", "resolves to"),
        "state-symlink": (base / "owned", "/.kdtree is a symlink"),
        "foreign": (target, "is not empty and was not created by the orchestrator"),
    }[case]
    (base / "link").symlink_to(target)
    if case == "state-symlink":
        (base / "owned").mkdir()
        (base / "owned" / ".kdtree").symlink_to(target)
    before = {"target": tree(target), "home": tree(h1.home)}
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote))})
    out = io.StringIO()
    assert cli.deploy(inv, [inv.hosts["h"]], Console(out)) == 1
    assert "refusing to use remote_dir:" in out.getvalue() and reason in out.getvalue(), out.getvalue()
    assert {"target": tree(target), "home": tree(h1.home)} == before


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_11_delete_never_follows_a_symlink_planted_in_the_tree(lab, make_inventory, source, tmp_path, method):
    """Scenario 11, inside an owned remote_dir: someone on the host replaced the deployed `src`
    directory and `README.md` with symlinks to a directory and a file outside. The user sees: the
    deploy passes. Afterwards: `src` and `README.md` are the source's again (real directory and
    file), and what the symlinks pointed to is untouched (--delete removed the links, not their targets)."""
    h1 = lab.hosts["h1"]
    remote = h1.root / f"planted-{method}-{tmp_path.name}"
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote),
                                     **({"rsync_path": "/nonexistent/rsync"} if method == "tar" else {}))})
    assert cli.deploy(inv, [inv.hosts["h"]], Console(io.StringIO())) == 0
    outside_dir = h1.root / f"outside-{method}-{tmp_path.name}"
    outside_dir.mkdir()
    (outside_dir / "main.cpp").write_text("not yours\n")
    (outside_dir / "extra.txt").write_text("not yours either\n")
    (outside_dir / "file").write_text("the file\n")
    shutil.rmtree(remote / "src")
    (remote / "src").symlink_to(outside_dir)
    (remote / "README.md").unlink()
    (remote / "README.md").symlink_to(outside_dir / "file")
    before = tree(outside_dir)
    out = io.StringIO()
    assert cli.deploy(inv, [inv.hosts["h"]], Console(out)) == 0, out.getvalue()
    assert tree(outside_dir) == before
    assert not (remote / "src").is_symlink() and (remote / "src" / "main.cpp").read_text() == \
        (source / "src" / "main.cpp").read_text()
    assert not (remote / "README.md").is_symlink() and (remote / "README.md").read_text() == "engine\n"


# -- 12: injection -----------------------------------------------------------------------------------------
def payloads(canary: Path) -> list[str]:
    """Values that would create `canary` if any shell evaluated them."""
    c = str(canary)
    return [f"$(touch {c})", f"`touch {c}`", f"x;touch {c}", f"x|touch {c}", f"x' ; touch {c}; '",
            f'x" ; touch {c}; "', f"x\ntouch {c}", f"x && touch {c}", f"-oProxyCommand=touch {c}",
            f"x -oProxyCommand=touch {c}", f"x$IFS;touch$IFS{c}"]


INJECTABLE = ["address", "user", "remote_dir", "python", "cuda_home", "rsync_path", "arch", "jump", "identity",
              "known_hosts", "host_key"]


def test_12_injection_through_inventory_values_is_rejected(lab, make_inventory, tmp_path):
    """Scenario 12, inventory: host and group names, and every host value that reaches a command
    line (address, user, remote_dir, python, cuda_home, rsync_path, arch, jump, identity,
    known_hosts, host_key) with
    `$(...)`, backticks, `;`, `|`, quotes, a newline, `&&`, a leading '-' or an option after a space.
    The user sees: exit code 2 and a message naming the file, the host and the key (a path made only
    of harmless characters, e.g. `/srv/-oProxyCommand=touch x`, is a legal path and is passed
    literally, quoted once). Afterwards: the canary file does not exist and the host authenticated
    no session for the refused inventory."""
    canary = tmp_path / "canary"
    h1 = lab.hosts["h1"]
    sessions = accepted(h1)
    for key in INJECTABLE:
        for value in payloads(canary):
            base = entry(lab, h1, remote_dir=str(h1.root / "inj"))
            if key in ("python", "cuda_home", "rsync_path", "remote_dir", "identity", "known_hosts"):
                value = "/srv/" + value         # absolute, so that only the payload is wrong
            try:
                make_inventory({"h": {**base, key: value}})
            except InventoryError as e:
                assert f"host 'h': key '{key}'" in str(e), (key, value, str(e))
            else:       # accepted only as a path of harmless characters, which is quoted once wherever it goes
                assert key in ("remote_dir", "python", "cuda_home", "rsync_path", "identity", "known_hosts") and \
                    re.fullmatch(r"[A-Za-z0-9 ._/+,:@=-]+", value) and not value.startswith("-"), (key, value)
    for value in payloads(canary):              # host names and group names
        with pytest.raises(InventoryError, match="host name may use|is not a group name"):
            make_inventory({value: entry(lab, h1)})
        with pytest.raises(InventoryError, match="is not a group name|must not"):
            make_inventory({"h": {**entry(lab, h1), "groups": [value]}})
    proc = invoke(lab, "deploy", "--inventory", str(make_inventory({"h": entry(lab, h1)}).path), "--host", "h")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = yaml_with(make_inventory, {"h": {**entry(lab, h1), "user": f"root;touch {canary}"}})
    proc = invoke(lab, "deploy", "--inventory", str(bad), "--host", "h")
    assert proc.returncode == 2 and "key 'user'" in proc.stderr
    assert not canary.exists() and accepted(h1) == sessions + 1


def yaml_with(make_inventory, hosts: dict) -> Path:
    """Write an inventory without validating it (to hand a bad one to a task)."""
    import yaml
    path = make_inventory({}).path
    data = yaml.safe_load(path.read_text())
    data["hosts"] = hosts
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_12_injection_through_command_line_arguments(lab, make_inventory, tmp_path):
    """Scenario 12, command line: --host, --group, --steps, --skip, --report-dir, --run and
    --inventory carrying the payloads. The user sees: exit code 2 naming the unknown host, group
    or step, or (a report dir) a directory with exactly that literal name. Afterwards: the canary
    file does not exist."""
    canary = tmp_path / "canary"
    inv = make_inventory({"h": entry(lab, lab.hosts["h1"], remote_dir=str(lab.hosts["h1"].root / "cli-inj"))})
    for value in payloads(canary)[:8]:
        for args in (["deploy", "--host", value], ["doctor", "--group", value], ["validate", "--host", "h", "--steps", value],
                     ["validate", "--host", "h", "--skip", value], ["report", "--run", value]):
            proc = invoke(lab, *args[:1], "--inventory", str(inv.path), *args[1:], timeout=60)
            assert proc.returncode in (1, 2), (args, proc.stdout, proc.stderr)
    report_dir = tmp_path / f"runs $(touch {canary}) ;x"
    proc = invoke(lab, "validate", "--inventory", str(inv.path), "--host", "h", "--steps", "sync",
                  "--report-dir", str(report_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (report_dir / "run.json").is_file()
    proc = invoke(lab, "deploy", "--inventory", f"{tmp_path}/$(touch {canary}).yaml")
    assert proc.returncode == 2 and "cannot read" in proc.stderr
    assert not canary.exists()


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_12_file_names_and_a_remote_dir_with_spaces_pass_literally(lab, make_inventory, source, tmp_path, method):
    """Scenario 12, data: source files whose names carry the payloads (and a leading '-'), deployed
    to a remote_dir with spaces, with RSYNC_OLD_ARGS=1 (and RSYNC_PROTECT_ARGS=0) in the environment,
    which would make rsync split remote arguments on spaces. The user sees: the deploy passes.
    Afterwards: every file is on the host under its literal name with its content, the tree hash
    matches, and the canary does not exist."""
    canary = tmp_path / "canary"
    names = [p.replace("\n", "_nl_").replace("/", "_") for p in payloads(canary)] + ["-rf", "--delete", "a b  c", "*", "?"]
    for name in names:
        (source / "src" / name).write_text(f"content of {name}\n")
    (source / "src" / "new\nline").write_text("newline in the name\n")
    h1 = lab.hosts["h1"]
    remote = h1.root / f"spaced {method} {tmp_path.name}" / "engine dir"
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote),
                                     **({"rsync_path": "/nonexistent/rsync"} if method == "tar" else {}))})
    proc = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "h",
                  env={"RSYNC_OLD_ARGS": "1", "RSYNC_PROTECT_ARGS": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"with {method}" in proc.stdout
    for name in names:
        assert (remote / "src" / name).read_text() == f"content of {name}\n", name
    assert (remote / "src" / "new\nline").read_text() == "newline in the name\n"
    assert not canary.exists()
    assert sorted(p.name for p in (remote / "src").iterdir()) == sorted(p.name for p in (source / "src").iterdir())


# -- 15: hostile results ------------------------------------------------------------------------------------
HOSTILE = {
    "symlink": "ln -sf /etc/passwd build/test_results.json",
    "dir-symlink": "rm -rf build; mkdir -p ../outside; echo '{\"tests\": []}' > ../outside/test_results.json; "
                   "ln -s \"$(cd ../outside && pwd)\" build",
    "huge": "truncate -s 3G build/test_results.json",
    "fifo": "mkfifo build/test_results.json",
    "deep": "python3 -c 'print(\"[\" * 200000)' > build/test_results.json",
    "wide": "python3 -c 'import json; print(json.dumps({\"tests\": [{\"name\": \"t\" * 5000 + str(i), \"status\": "
            "\"passed\", \"message\": \"m\" * 100000} for i in range(120)]}))' > build/test_results.json",
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_15_hostile_result_files_cannot_escape_or_exhaust(lab, make_inventory, tmp_path, case):
    """Scenario 15: the host answers the test step with a hostile result file: a symlink to
    /etc/passwd, its build/ directory a symlink to a directory outside remote_dir, a 3 GB (sparse) file, a FIFO, JSON nested
    200000 deep, or JSON with huge strings. The user sees: the test step FAILED with the reason
    (`is a symlink; refusing to read it`, `is larger than`, `is not a regular file`, `not valid
    JSON`) -- or, for merely large but valid content, passed with the strings cut short. Afterwards:
    nothing was written outside the run directory, every file in it is bounded, and the run (this
    process) stayed within a bounded amount of memory."""
    import resource
    h2 = lab.hosts["h2"]
    test = f"mkdir -p build; {HOSTILE[case]}; echo done"
    inv = make_inventory({"h": entry(lab, h2, remote_dir=str(h2.root / f"hostile-{case}-{tmp_path.name}"))},
                         commands=fake_commands(test=test))
    before = tree(tmp_path / "src")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, run_dir, out = run_validate(inv, ["h"], "sync,test", tmp_path / "run")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    step = json.loads((run_dir / "run.json").read_text())["hosts"]["h"]["steps"]["test"]
    expected = {"symlink": "is a symlink; refusing to read it", "dir-symlink": "build is a symlink",
                "huge": "is larger than", "fifo": "is not a regular file", "deep": "is not valid JSON"}.get(case)
    if expected:
        assert code == 1 and step["status"] == "failed" and expected in step["message"], step
    else:
        assert step["status"] in ("passed", "failed"), step
    assert grown_mb < 200, grown_mb
    assert tree(tmp_path / "src") == before
    for path in run_dir.rglob("*"):
        assert not path.is_symlink() and path.resolve().is_relative_to(run_dir.resolve())
        assert path.is_dir() or path.stat().st_size < 32 << 20, path


def test_15_endless_output_without_newlines_is_bounded(lab, make_inventory, tmp_path):
    """Scenario 15, logs: a step prints 64 MB without a single newline. The user sees: the command
    ends in seconds (the stand-in build then fails its version check), its log holds the first and
    last MB of the output. Afterwards: this process's memory grew by far less than the output
    (output is handled in bounded pieces, never as one growing line)."""
    import resource
    h2 = lab.hosts["h2"]
    inv = make_inventory({"h": entry(lab, h2, remote_dir=str(h2.root / f"noisy-{tmp_path.name}"))},
                         commands=fake_commands(build="head -c 64000000 /dev/zero | tr '\\0' x"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    run_dir = tmp_path / "run"
    with open(os.devnull, "w") as devnull:        # as a terminal: the console keeps nothing
        code = cli.validate(inv, [inv.hosts["h"]], Console(devnull), steps="sync,build", report_dir=str(run_dir))
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    assert time.monotonic() - start < 60
    build = json.loads((run_dir / "run.json").read_text())["hosts"]["h"]["steps"]["build"]
    assert code == 1 and "the binary was built from tree none" in build["message"]    # past the noisy command
    assert (run_dir / "h" / "build.log").stat().st_size < 3 << 20         # its first and last MB (sink.py)
    assert build["output_cut"]["bytes"] >= 64000000
    assert grown_mb < 100, grown_mb


# -- 13: secrets ------------------------------------------------------------------------------------------
@pytest.fixture
def agent(tmp_path):
    """An ssh-agent of this test holding a passphrase-protected key (added with ssh-add through
    SSH_ASKPASS: the passphrase never passes through the orchestrator)."""
    if not (shutil.which("ssh-agent") and shutil.which("ssh-add")):
        pytest.skip("ssh-agent/ssh-add (openssh-client) are not installed")
    passphrase = f"pass-{os.urandom(6).hex()}-phrase"
    key = tmp_path / "protected_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-C", "protected", "-f", str(key)], check=True)
    out = subprocess.run(["ssh-agent", "-s"], capture_output=True, text=True, check=True).stdout
    env = dict(re.findall(r"(SSH_AUTH_SOCK|SSH_AGENT_PID)=([^;]+);", out))
    askpass = tmp_path / "askpass"
    askpass.write_text('#!/bin/sh\nprintf "%s\\n" "$KD_TEST_PASSPHRASE"\n')
    askpass.chmod(0o700)
    try:
        subprocess.run(["ssh-add", str(key)], check=True, capture_output=True, timeout=20, stdin=subprocess.DEVNULL,
                       env={**os.environ, **env, "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force",
                            "DISPLAY": "none", "KD_TEST_PASSPHRASE": passphrase})
        yield key, passphrase, env
    finally:
        os.kill(int(env["SSH_AGENT_PID"]), signal.SIGTERM)


def test_13_passphrase_key_and_secret_env_never_leak(lab, make_inventory, tmp_path, agent, monkeypatch):
    """Scenario 13. The host accepts only a passphrase-protected key, loaded into ssh-agent (the
    documented way: the orchestrator never sees a passphrase); the host's `secret_env: [KD_TOKEN]`
    hands the build a token from the orchestrator's environment (over the command's stdin). The
    token contains quotes, `$(...)` and a newline, and the build prints it. The user sees: validate
    passes; the log shows `[REDACTED]` where the token was. Afterwards: the token reached the build
    intact (its sha256 on the host); neither the token nor the passphrase appears in any file of
    the run directory (step logs, run.json, report.md, report.html, junit.xml), the console output,
    or any process's command line on either side while the run lasted; the canary does not exist."""
    key, passphrase, agent_env = agent
    canary = tmp_path / "canary"
    token = f"tok-{os.urandom(8).hex()} 'q' \"dq\" $(touch {canary})\nsecond-line-of-the-token-{os.urandom(4).hex()}"
    keyed = fresh_host(lab, "keyed")
    only = tmp_path / "authorized_keys"
    only.write_text(Path(f"{key}.pub").read_text())
    keyed.config.write_text(keyed.config.read_text().replace(f"AuthorizedKeysFile {lab.authorized_keys}",
                                                             f"AuthorizedKeysFile {only}"))
    keyed.restart()
    with open(lab.ssh_config, "a") as f:
        f.write(f"Host {keyed.name}-agent\n  HostName 127.0.0.1\n  Port {keyed.port}\n  User root\n"
                f"  IdentityFile {key}\n  IdentitiesOnly yes\n\n")
    build = ('echo "token is $KD_TOKEN"; mkdir -p build; printf %s "$KD_TOKEN" | sha256sum > build/token.sha; '
             'sleep 2; echo "the token was $KD_TOKEN" >&2; exit 3')
    inv = make_inventory({"k": {**entry(lab, keyed, remote_dir=str(keyed.root / "engine")),
                                "address": f"{keyed.name}-agent", "secret_env": ["KD_TOKEN"]}},
                         commands=fake_commands(build=build))
    for name, value in agent_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KD_TOKEN", token)
    secrets = [token, *token.splitlines(), passphrase]
    seen, running = [], threading.Event()

    def watch():
        while not running.is_set():
            seen.extend(line for line in processes(r".") if any(s in line for s in secrets))
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        code, run_dir, out = run_validate(inv, ["k"], "sync,build", tmp_path / "run")
    finally:
        running.set()
        watcher.join()
    assert code == 1, out            # the build exits 3 after printing the token twice
    assert (keyed.root / "engine" / "build" / "token.sha").read_text().split()[0] == \
        __import__("hashlib").sha256(token.encode()).hexdigest()
    assert seen == []
    log = (run_dir / "k" / "build.log").read_text()
    assert "token is [REDACTED]" in log and "the token was [REDACTED]" in log
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"run.json", "report.md", "report.html", "junit.xml", "build.log"}
    for path in files:
        text = path.read_text(errors="replace")
        for secret in secrets:
            assert secret not in text, (path, secret)
    for secret in secrets:
        assert secret not in out
    assert not canary.exists()
    # a secret that is not set: refused before anything runs (exit 2), naming host and variable
    monkeypatch.delenv("KD_TOKEN")
    from orchestrator.errors import UsageError
    with pytest.raises(UsageError, match="host 'k': secret_env KD_TOKEN is not set"):
        run_validate(inv, ["k"], "sync,build", tmp_path / "run2")


def test_13_secret_env_names_are_validated(lab, make_inventory):
    """Scenario 13, inventory: `secret_env` lists variable names; anything else, or a variable the
    orchestrator sets itself, is refused with exit code 2 naming the host and the key."""
    for bad, why in ((["KD_TOKEN; touch x"], "not an environment variable name"), (["PATH"], "set by the orchestrator"),
                     ("KD_TOKEN", "must be a list"), (["-x"], "must not start with '-'")):
        with pytest.raises(InventoryError, match=re.escape(why)) as e:
            make_inventory({"h": {**entry(lab, lab.hosts["h1"]), "secret_env": bad}})
        assert "host 'h': key 'secret_env'" in str(e.value)


# -- 5 (network): a partition made with a network namespace -----------------------------------------------------
@pytest.fixture
def ns_host(lab, tmp_path):
    """An sshd in a network namespace of this test, reached over a veth pair by IPv6 link-local
    addresses (fe80::1 here, fe80::2 there: no routable address anywhere). Skipped where `ip netns`
    is not available or not permitted."""
    from sshd import SSHD, SshdHost
    if not shutil.which("ip"):
        pytest.skip("`ip` (iproute2) is not installed: no network namespaces")
    ns = f"kdt{os.getpid() % 10000}n{next(_names)}"
    outer, inner = f"{ns}a", f"{ns}b"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    proc = None
    try:
        for argv in (["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns],
                     ["ip", "addr", "add", "fe80::1/64", "dev", outer, "nodad"], ["ip", "link", "set", outer, "up"],
                     ["ip", "-n", ns, "addr", "add", "fe80::2/64", "dev", inner, "nodad"],
                     ["ip", "-n", ns, "link", "set", inner, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"],
                     # a link taken down keeps its addresses: the connections survive the partition
                     ["sysctl", "-qw", f"net.ipv6.conf.{outer}.keep_addr_on_down=1"],
                     ["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{inner}.keep_addr_on_down=1"]):
            step = subprocess.run(argv, capture_output=True, text=True)
            if step.returncode != 0:
                pytest.skip(f"cannot set up the namespace's link ({' '.join(argv)}): {step.stderr.strip()}")
        host = SshdHost(lab, ns)
        host.config.write_text(host.config.read_text().replace("ListenAddress 127.0.0.1", "ListenAddress ::"))
        log = open(host.log_path, "ab")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(host.config)],
                                stdout=log, stderr=log)
        log.close()
        import socket

        def listening():
            with socket.socket(socket.AF_INET6) as s:
                s.settimeout(0.5)
                return s.connect_ex((f"fe80::2%{outer}", host.port, 0, socket.if_nametoindex(outer))) == 0
        if not wait_for(listening, 10):
            pytest.skip(f"sshd in the namespace does not answer: {host.log()[-500:]}")
        with open(lab.ssh_config, "a") as f:
            f.write(f"Host {ns}\n  HostName fe80::2%{outer}\n  Port {host.port}\n  User root\n"
                    f"  IdentityFile {lab.client_key}\n  IdentitiesOnly yes\n\n")
        yield host, ns, outer
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:            # the sshd sessions (and anything they left) of this namespace
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", outer], capture_output=True)


def test_5_a_network_partition_mid_step_is_detected_by_keepalive(lab, make_inventory, tmp_path, ns_host):
    """Scenario 5 across a real link: the host lives in a network namespace; mid-step the link goes
    down (every packet dropped, no reset). The user sees: the step FAILED with `connection lost
    while running a command: the host answered no keepalive for 6 s` within keepalive x 3 plus a
    little, long before the step's 12 s timeout. Afterwards (the link back up): the step's process
    tree on the host is gone, at the latest when the host-side timeout fires (the host may never
    hear that the client closed: its FIN was lost in the partition), and the host lock is free (its
    holder heard no heartbeat for 3 keepalives): the next deploy works and names the dead run."""
    host, ns, outer = ns_host
    marker = f"55{os.getpid() % 1000:03d}"
    inv = make_inventory({"far": {**entry(lab, host, remote_dir=str(host.root / "engine"), timeouts={"build": 12},
                                          known_hosts=str(tmp_path / "none")),
                                  "address": ns, "host_key": host.fingerprint()}},
                         commands=fake_commands(build=f"echo started; sleep 6{marker}"))
    result = {}
    runner = threading.Thread(target=lambda: result.update(r=run_validate(inv, ["far"], "sync,build", tmp_path / "run")))
    runner.start()
    try:
        assert wait_for(lambda: processes(rf"^sleep 6{marker}"), 30)
        subprocess.run(["ip", "link", "set", outer, "down"], check=True)
        start = time.monotonic()
        runner.join(30)
        detected = time.monotonic() - start
    finally:
        subprocess.run(["ip", "link", "set", outer, "up"], check=True)
    assert not runner.is_alive()
    code, run_dir, out = result["r"]
    build = json.loads((run_dir / "run.json").read_text())["hosts"]["far"]["steps"]["build"]
    assert code == 1 and build["status"] == "failed" and detected < 2 * 3 + 4, (detected, build)
    assert "the host answered no keepalive for 6 s" in build["message"]
    assert wait_for(lambda: not processes(rf"^sleep 6{marker}"), 12), processes(rf"^sleep 6{marker}")
    # the lock holder on the host heard no heartbeat for 3 keepalives: it let go; the next run says whose it was
    again = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "far")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "recovered the lock left by a run that died: validate by pid" in again.stdout


# -- the build cache ----------------------------------------------------------------------------------------
def test_the_build_cache_is_keyed_on_the_toolchain_and_arch(lab, make_inventory, tmp_path):
    """A build is reused only while the tree and the engine's build key (compilers, flags, arch) are
    those of the stamp: the same key twice is `cached`, another key (here another arch) builds again,
    and so does going back to the first key (the stamp is the other key's, even though this machine
    recorded the first key's executables and they hash the same)."""
    h2 = lab.hosts["h2"]
    key = tmp_path / "build_key.json"
    build = "mkdir -p build && echo 'echo built' > build/kdtree && chmod +x build/kdtree && echo compiled"
    version = "echo kdtree 0.0 tree=$(bash scripts/tree_hash.sh | awk '{print $NF}') backend=cuda arch=sm_90"
    inv = make_inventory({"h2": entry(lab, h2, remote_dir=str(h2.root / f"buildkey-{tmp_path.name}"))},
                         commands=fake_commands(build=build, build_key=f"cat {key}", version=version))
    statuses = []
    for arch in ("sm_90", "sm_90", "sm_120", "sm_90"):
        key.write_text(json.dumps({"backend": "cuda", "arch": arch, "cxx": "g++ 13"}))
        code, run_dir, out = run_validate(inv, ["h2"], "sync,build", tmp_path / f"run-{len(statuses)}")
        assert code == 0, out
        statuses.append(json.loads((run_dir / "run.json").read_text())["hosts"]["h2"]["steps"]["build"]["status"])
    assert statuses == ["passed", "cached", "passed", "passed"]
