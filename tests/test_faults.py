"""Fault and attack suite (issue 8): the orchestrator keeps working, loses nothing, lets nothing in.

Every test proves one scenario of the issue against real OpenSSH sshd hosts on 127.0.0.1 (the
session `lab`, or fresh hosts of its own for anything that stops, kills or re-keys sshd) and
states in its docstring what the user sees and what must hold afterwards. Timeouts are small
(connect 3 s, keepalive 2 s, steps a few seconds) and source trees tiny, so the suite runs in a
few minutes. README.md, "Guarantees", lists each promise with the test that proves it.
"""
from __future__ import annotations

import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator import cli, inventory as inventory_mod, remote, state, sync
from orchestrator.console import Console
from orchestrator.errors import AuthError, ConnectError, HostKeyError, InventoryError
from orchestrator.transport import SshTransport, open_transport

REPO = Path(__file__).resolve().parent.parent
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
    pin command given in the message works. (tests/test_ssh.py::test_unknown_host_key_is_refused_before_anything_runs
    checks the transport and system ssh; this checks the task a user runs.)"""
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
    re-pin, from Paramiko (every task), system ssh and rsync alike; `invoke deploy` exits 1.
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
    ssh = subprocess.run(t.ssh_argv(f"touch {remote_dir}/ssh-ran"), capture_output=True, text=True)   # system ssh
    assert ssh.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in ssh.stderr
    argv = sync.rsync_argv(t, inv.project)                          # rsync with its own ssh (-e)
    assert argv[argv.index("-e") + 1].startswith("ssh ")
    rsync = subprocess.run(argv, capture_output=True, text=True)
    assert rsync.returncode in (12, 255) and "Host key verification failed" in rsync.stderr

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
    assert wait_for(lambda: count(locked, attempts), 2) == connections + 1
    start = time.monotonic()
    proc = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "l")
    assert proc.returncode == 1 and "authentication to 127.0.0.1:" in proc.stdout and "failed" in proc.stdout
    assert time.monotonic() - start < 10
    assert wait_for(lambda: count(locked, attempts), 2) == connections + 2
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
        rows = {l.split()[0]: l.split() for l in text.splitlines() if l.split()[:1] in (["h1"], ["h2"], ["bad"])}
        assert rows["h1"][1] == rows["h2"][1] == "ok" and rows["bad"][1] == "FAILED"
        seconds = float(rows["bad"][2])         # host, status, (empty columns), seconds, error
        assert seconds < FAST["connect"] + 3, text
        assert "cannot reach 127.0.0.1:" in text
        assert time.monotonic() - start < FAST["connect"] + 10
        for n in ("h1", "h2"):
            assert (hosts[n].root / f"unreach-{tmp_path.name}" / "src" / "main.cpp").is_file()
    finally:
        if fault != "closed-port":
            os.kill(bad.proc.pid, signal.SIGCONT)
            bad.stop()
