"""Fault suite (issue 8), the deployed tree: a sync cut off by a killed sshd is repaired by the
next run, a full remote disk, two runs on one host and a killed run's lock, dangerous destinations
refused before anything changes, and the build cache keyed on the toolchain.

Every test proves one scenario of the issue against real OpenSSH sshd hosts on 127.0.0.1 (the
session `lab`, or fresh hosts of its own for anything that stops, kills or re-keys sshd) and
states in its docstring what the user sees and what must hold afterwards. Timeouts are small
(connect 3 s, keepalive 2 s, steps a few seconds) and source trees tiny. docs/guarantees.md lists
each promise with the test that proves it; the helpers are tests/fault_lab.py's.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from orchestrator import cli, sync
from orchestrator.runner.console import Console
from orchestrator.errors import InventoryError

from fault_lab import (MARK, REPO, accepted, entry, fake_commands, fresh_host, invoke, names, outside, processes,
                       run_validate, session_pids, slow_rsync, tree, wait_for)


# -- 8: sshd killed during a sync ----------------------------------------------------------------------------
def test_8_sshd_killed_during_a_sync_is_repaired_by_the_next_run(lab, make_inventory, source, tmp_path):
    """Scenario 8. sshd (listener and sessions) is SIGKILLed while rsync is transferring. The user
    sees: the deploy FAILED naming the host (exit 1); after sshd is back, the next deploy says `the
    previous sync did not finish ...; this sync repairs the tree` and that it recovered the dead
    run's lock, and exits 0. Afterwards: the tree on the host is exactly the source (tree hash
    verified), and nothing outside remote_dir changed."""
    m = f"8{MARK}"
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
    m = f"10{MARK}{next(names)}"
    (source / "big.bin").write_bytes(os.urandom(100 << 10))
    h1 = lab.hosts["h1"]
    remote = h1.root / f"concurrent-{tmp_path.name}"
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote), rsync_path=str(slow_rsync(tmp_path, f"slowcat-{m}")))})

    def start(task):
        args = [task, "--inventory", str(inv.path), "--host", "h"]
        if task == "validate":
            args += ["--steps", "sync", "--report-dir", str(tmp_path / f"run-{next(names)}")]
        return subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, **lab.env()})
    procs = [start(first), start(second)]
    results = [(p, *p.communicate(timeout=120)) for p in procs]
    winners = [r for r in results if r[0].returncode == 0]
    losers = [r for r in results if r[0].returncode != 0]
    assert len(winners) == 1 and len(losers) == 1, [(p.returncode, o[-2000:], e[-2000:]) for p, o, e in results]
    winner, loser = winners[0][0], losers[0]
    winner_task = first if winner is procs[0] else second
    assert loser[0].returncode == 1, (loser[1][-2000:], loser[2][-2000:])
    assert re.search(rf"is locked by another run: {winner_task} by pid {winner.pid} on {re.escape(os.uname().nodename)}",
                     loser[1]), loser[1]
    assert (remote / "big.bin").read_bytes() == (source / "big.bin").read_bytes()
    assert not list((remote / ".kdtree").glob("holder-*.json"))


def test_10_a_killed_runs_lock_is_recovered(lab, make_inventory, source, tmp_path):
    """Scenario 10, second half. `invoke deploy` is SIGKILLed (no cleanup at all) while it holds the
    lock. The user sees: the next deploy proceeds and says `recovered the lock left by a run that
    died: deploy by pid <the killed pid> ...`. Afterwards: the tree is deployed, the lock is free."""
    m = f"10{MARK}{next(names)}"
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
