"""The fault suite's helpers (tests/scenarios/test_faults_*.py; the hostile, bounds and progress
tests use some): fresh sshd hosts of a test's own, inventory entries with the suite's small
timeouts, what a host's sshd log and this machine's processes show, tasks run as a user runs them,
and slow or fake commands that give a test the time to act mid-step."""
from __future__ import annotations

import io
import itertools
import os
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import cli
from orchestrator.runner.console import Console

REPO = Path(__file__).resolve().parent.parent
FAST = {"connect": 3, "keepalive": 2, "lock": 10}
names = itertools.count(1)     # numbers that make a test's host, marker and run names unique
# digits of this pytest process alone, in the markers of the processes a test looks for: what an
# earlier pytest left (a guarded mutant's run leaves processes on purpose) never matches them, not
# even when that pytest's pid comes round again (pids wrap within minutes on a busy machine)
MARK = str(random.SystemRandom().randrange(10 ** 5, 10 ** 6))
# a pipe that passes 40 kB/s (slow_rsync's)
SLOW_CAT = "import os, sys, time\nwhile True:\n    d = os.read(0, 8192)\n    if not d: break\n    os.write(1, d)\n    time.sleep(0.2)"


def fresh_host(lab, kind: str, **kwargs):
    """A new sshd host of this test alone (it may be stopped, killed or re-keyed)."""
    return lab.add_host(f"f{kind}{next(names)}", **kwargs)


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


def slow_rsync(tmp_path: Path, marker: str) -> Path:
    """An rsync_path for the host: rsync receiving through a pipe that passes 40 kB/s (the pipe
    process carries `marker` on its command line; both end when the connection does)."""
    wrapper = tmp_path / "slow-rsync"
    wrapper.write_text("#!/bin/bash\n[ \"$1\" = --version ] && exec rsync --version    # the sync's version query\n"
                       f"exec rsync \"$@\" < <(exec {sys.executable} -c {shlex.quote(SLOW_CAT)} {marker} 2>/dev/null)\n")
    wrapper.chmod(0o755)
    return wrapper


def outside(remote_dir: Path) -> dict:
    """Everything beside remote_dir in its parent (which no deploy may touch)."""
    parent = remote_dir.parent
    return {k: v for k, v in tree(parent).items() if not (k == remote_dir.name or k.startswith(remote_dir.name + "/"))}
