"""Hostile hosts and other users (docs/security.md): three attacker models, each
promise tested as a class, not only the instance that was reported.

Another user is a real second uid (ATTACKER): its actions run under `setpriv --reuid/--regid`
(or its files are made by chown, where only ownership matters); the hosts are the session's real
loopback sshd hosts, where the deploying user is root.
"""
from __future__ import annotations

import io
import json
import os
import re
import resource
import shutil
import stat
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from orchestrator import bounded, cli, inventory as inventory_mod, ownership, remote, state
from orchestrator.runner import pipeline
from orchestrator.resources import gpu_claims, gpus
from orchestrator.records import record, report, run_store
from orchestrator.runner.console import Console
from orchestrator.errors import DestinationError, HostError, HostKeyError, InventoryError
from orchestrator.host import client
from orchestrator.inventory import Host
from orchestrator.safe_text import visible
from orchestrator.connectors.factory import open_transport
from orchestrator.connectors.local import LocalTransport

from fault_lab import entry, fake_commands, run_validate, tree, wait_for

ATTACKER = 4242
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the tests create a second user's files")

# A build stand-in that writes build/kdtree, whose --version reports the deployed tree; like the
# engine's incremental build, it keeps a build/kdtree that is already there.
FAKE_BUILD = ("mkdir -p build && h=$(bash scripts/tree_hash.sh | tail -1) && { [ -x build/kdtree ] || { "
              "printf '#!/bin/sh\\necho kdtree 0.0 tree=%s backend=cpu arch=none\\n' \"$h\" > build/kdtree && "
              "chmod 755 build/kdtree; }; }")


def as_attacker(script: str, background: bool = False, check: bool = True):
    """Run a bash script as the second uid (no groups); `check`: it must succeed."""
    argv = ["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "bash", "-c", script]
    if background:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return subprocess.run(argv, check=check, timeout=30, capture_output=not check, text=True)


def attacker_reach(paths: dict[str, Path]) -> dict[str, str]:
    """What the second uid gets when it opens each path read-only (`flock` needs no more) or,
    for an executable, runs it: 'opened', or the shell's error."""
    found = {}
    for what, path in paths.items():
        action = f"{path} --version" if what.startswith("run ") else f": < {path}"
        proc = as_attacker(f"{action} >/dev/null", check=False)
        found[what] = "opened" if proc.returncode == 0 else proc.stderr.strip().rsplit(": ", 1)[-1]
    return found


def modes_open_to_others(root: Path) -> list[str]:
    """Every path under `root` (itself included, symlinks aside) with a group or other bit."""
    return [f"{p} {p.stat().st_mode & 0o777:o}" for p in [root, *root.rglob("*")]
            if not p.is_symlink() and p.stat().st_mode & 0o077]


@pytest.fixture
def shared():
    """A world-reachable place like /tmp on a GPU host: `shared/` root-owned, mode 1777, and a
    root-only directory `vault/` (0700) with a file only root may read."""
    base = Path(tempfile.mkdtemp(prefix="kdtree-hostile-", dir="/tmp"))
    base.chmod(0o755)
    (base / "shared").mkdir()
    (base / "shared").chmod(0o1777)
    (base / "vault").mkdir(mode=0o700)
    (base / "vault" / "secret").write_text("root only\n")
    (base / "vault" / "secret").chmod(0o600)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def deploy(inv, name="h") -> tuple[int, str]:
    out = io.StringIO()
    return cli.deploy(inv, [inv.hosts[name]], Console(out)), out.getvalue()


# -- the three reproductions of the report ------------------------------------------------------------
def test_a_a_squatted_state_dir_with_a_symlinked_owner_file_is_refused(lab, make_inventory, shared):
    """(a) Another user created remote_dir (under a sticky /tmp-like dir) with `.kdtree/marker` and
    `.kdtree/owner` a symlink to a root-only file. The user sees: deploy FAILED, `refusing to use
    remote_dir: ... owned by uid 4242`. Afterwards: the root-only file was neither shown nor
    changed, nothing was written into the squatted directory."""
    remote = shared / "shared" / "engine"
    as_attacker(f"mkdir -p {remote}/.kdtree && echo x > {remote}/.kdtree/marker && "
                f"ln -s {shared}/vault/secret {remote}/.kdtree/owner")
    before = tree(shared)
    inv = make_inventory({"h": entry(lab, lab.hosts["h1"], remote_dir=str(remote))})
    code, out = deploy(inv)
    assert code == 1 and "refusing to use remote_dir" in out and f"owned by uid {ATTACKER}" in out, out
    assert "root only" not in out
    assert tree(shared) == before and (shared / "vault" / "secret").read_text() == "root only\n"


def test_b_a_planted_binary_with_a_forged_stamp_never_runs(lab, make_inventory, shared, tmp_path):
    """(b) Another user planted `build/kdtree` (it would create a canary) and a `.kdtree/build.json`
    forged for the deployed tree in a remote_dir they created. The user sees: validate FAILED at
    sync, `owned by uid 4242`. Afterwards: the planted binary never ran (no canary)."""
    remote = shared / "shared" / "engine"
    canary = shared / "shared" / "canary"
    as_attacker(f"mkdir -p {remote}/.kdtree {remote}/build && echo x > {remote}/.kdtree/marker && "
                f"printf '#!/bin/sh\\ntouch {canary}\\necho kdtree 0.0 tree=x\\n' > {remote}/build/kdtree && "
                f"chmod 755 {remote}/build/kdtree && echo '{{}}' > {remote}/.kdtree/build.json")
    inv = make_inventory({"h": entry(lab, lab.hosts["h1"], remote_dir=str(remote))},
                         commands=fake_commands(build=FAKE_BUILD, version="build/kdtree --version"))
    code, run_dir, out = run_validate(inv, ["h"], "sync,build", tmp_path / "run")
    steps = json.loads((run_dir / "run.json").read_text())["hosts"]["h"]["steps"]
    assert code == 1 and steps["sync"]["status"] == "failed" and f"owned by uid {ATTACKER}" in steps["sync"]["message"]
    assert steps["build"]["status"] == "skipped" and not canary.exists()


def test_b_a_swapped_binary_under_a_matching_stamp_is_rebuilt_before_it_runs(lab, make_inventory, tmp_path):
    """(b), second line: the host's stamp matches, but build/kdtree is not the binary this machine
    recorded after building it (swapped by anything that got past the ownership rule, e.g. the
    deploying account itself). The user sees: build passed (not cached) with `building again` in
    its log. Afterwards: the swapped binary never ran (it was removed before the incremental build,
    which would have kept it)."""
    h1 = lab.hosts["h1"]
    canary = tmp_path / "canary"
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(h1.root / f"swap-{tmp_path.name}"))},
                         commands=fake_commands(build=FAKE_BUILD, version="build/kdtree --version"))
    statuses = []
    for i in range(3):
        code, run_dir, out = run_validate(inv, ["h"], "sync,build", tmp_path / f"run{i}")
        statuses.append(json.loads((run_dir / "run.json").read_text())["hosts"]["h"]["steps"]["build"]["status"])
        if i == 1:
            binary = h1.root / f"swap-{tmp_path.name}" / "build" / "kdtree"
            binary.write_text(binary.read_text().replace("#!/bin/sh\n", f"#!/bin/sh\ntouch {canary}\n"))
    assert statuses == ["passed", "cached", "passed"], statuses
    assert "removing them and building again" in (tmp_path / "run2" / "h" / "build.log").read_text()
    assert not canary.exists() and "touch" not in binary.read_text()


def test_c_a_parent_owned_by_another_user_cannot_swap_remote_dir_mid_sync(lab, make_inventory, shared):
    """(c) With the tar stream, remote_dir's parent belongs to another user, who swaps remote_dir for
    a symlink to a root-only directory as soon as `.kdtree/sync.partial` appears. The user sees:
    deploy FAILED before anything was written, naming the parent and its owner. Afterwards: the
    root-only directory is intact, no sync ever started."""
    parent = shared / "shared" / "theirs"
    remote = parent / "engine"
    as_attacker(f"mkdir -m 755 {parent}")
    swapper = as_attacker(f"for i in $(seq 400); do if [ -e {remote}/.kdtree/sync.partial ]; then "
                          f"mv {remote} {parent}/old && ln -s {shared}/vault {remote}; exit; fi; sleep 0.05; done",
                          background=True)
    before = tree(shared / "vault")
    inv = make_inventory({"h": entry(lab, lab.hosts["h1"], remote_dir=str(remote), rsync_path="/nonexistent/rsync")})
    code, out = deploy(inv)
    swapper.kill()
    swapper.wait()
    assert code == 1 and f"{parent} (a parent of remote_dir) is owned by uid {ATTACKER}" in out, out
    assert tree(shared / "vault") == before and not remote.exists()


# -- the class: each path level x each way another user could hold it ---------------------------------------
LEVELS = ["parent", "remote_dir", ".kdtree", "state file", "build"]
WAYS = ["other uid", "group-writable", "other-writable", "symlink"]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("level", LEVELS)
def test_every_path_level_held_by_another_user_is_refused(lab, make_inventory, tmp_path, level, way):
    """A deployed remote_dir (`<base>/parent/engine`, with a build/ directory); then one level of
    the path is given to another uid, made writable by a group of another user or by others, or
    replaced by a symlink. The user
    sees: the next deploy FAILED with `refusing to use remote_dir:` naming that path and why.
    Afterwards: nothing under the base (nor what a symlink points to) changed."""
    h1 = lab.hosts["h1"]
    base = h1.root / f"levels-{tmp_path.name}"
    remote = base / "parent" / "engine"
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote))})
    assert deploy(inv)[0] == 0
    (remote / "build").mkdir()
    (remote / "build" / "kdtree").write_text("binary\n")
    outside = base / "outside"
    outside.mkdir()
    (outside / "file").write_text("outside\n")
    path = {"parent": remote.parent, "remote_dir": remote, ".kdtree": remote / ".kdtree",
            "state file": remote / ".kdtree" / "deploy.json", "build": remote / "build"}[level]
    if way == "other uid":
        os.chown(path, ATTACKER, ATTACKER)
        why = f"owned by uid {ATTACKER}"
    elif way == "group-writable":         # a group shared with the other user
        os.chown(path, -1, ATTACKER)
        path.chmod(path.stat().st_mode | 0o020)
        why = "writable by group or others"
    elif way == "other-writable":
        path.chmod(0o777 if path.is_dir() else 0o666)
        why = "writable by group or others"
    else:
        shutil.move(path, outside / path.name)
        path.symlink_to(outside / path.name)
        why = "resolves to" if level == "parent" else "is a symlink"
    before = tree(base)
    code, out = deploy(inv)
    assert code == 1 and "refusing to use remote_dir:" in out and why in out, out
    assert str(path) in out, out
    assert tree(base) == before


def test_a_root_owned_sticky_parent_is_accepted_and_synced_modes_are_the_users_alone(lab, make_inventory, shared,
                                                                                      source):
    """The rule's exception and the sync's side: remote_dir under a root-owned sticky directory (as
    /tmp) deploys, and a world-readable or -writable source file or folder arrives with no group
    or other bit (rsync keeps modes, so they are stripped; the tar stream extracts under the
    commands' umask 077), with rsync and with the tar stream (issue 37, finding 3)."""
    (source / "README.md").chmod(0o666)
    (source / "src").chmod(0o777)
    (source / "scripts" / "tree_hash.sh").chmod(0o755)
    for method in ("rsync", "tar"):
        remote = shared / "shared" / f"engine-{method}"
        extra = {"rsync_path": "/nonexistent/rsync"} if method == "tar" else {}
        inv = make_inventory({"h": entry(lab, lab.hosts["h1"], remote_dir=str(remote), **extra)})
        code, out = deploy(inv)
        assert code == 0, out
        assert f"with {method}" in out
        assert modes_open_to_others(remote) == [], method
        assert (remote / "scripts" / "tree_hash.sh").stat().st_mode & 0o700 == 0o700, method     # still the user's to run
        assert attacker_reach({"tree": remote / "README.md"}) == {"tree": "Permission denied"}


def test_another_user_can_open_no_lock_or_claim_read_no_result_and_run_no_binary(lab, gpu_lab, make_inventory,
                                                                                 shared):
    """Issue 37, findings 1 to 3: while a run holds the tree lock and a GPU claim on a host whose
    remote_dir another user can reach (under a sticky /tmp), and the engine has written a secret
    into build/test_results.json and built build/kdtree, that user can open neither the lock nor
    the claim file (a read-only handle is all `flock` needs to keep every run of ours out), read
    no result and run no binary of ours (its processes would pass for ours on the GPU). Every path
    under remote_dir is the user's alone."""
    host, fake = gpu_lab
    fake.set(2)
    remote_dir = shared / "shared" / "engine"
    inv = make_inventory({"g": entry(lab, host, remote_dir=str(remote_dir))})
    assert deploy(inv, "g")[0] == 0
    g = inv.hosts["g"]
    build = "mkdir -p build && echo s3cret > build/test_results.json && printf '#!/bin/sh\\necho kdtree\\n' > " \
            "build/kdtree && chmod +x build/kdtree"
    with open_transport(g) as t, state.acquire(t, state.Owner.now("test"), mode=state.SHARED), \
            gpu_claims.acquire(t, gpus.Request.for_host(g), state.Owner.now("test")) as claim:
        t.check(remote.step(g, build, 30))
        kdtree = remote_dir / ".kdtree"
        reach = attacker_reach({"lock": kdtree / "lock.flock", "gate": kdtree / "gate.flock",
                                "claim": kdtree / f"gpu-{claim.gpus[0].uuid}.flock",
                                "claim's owner": kdtree / f"gpu-{claim.gpus[0].uuid}.owner",
                                "result": remote_dir / "build" / "test_results.json",
                                "run build/kdtree": remote_dir / "build" / "kdtree"})
        assert reach == dict.fromkeys(reach, "Permission denied")
        assert modes_open_to_others(remote_dir) == []


def test_an_earlier_deploy_open_to_other_users_is_made_private_by_the_next_run(lab, make_inventory, shared):
    """Issue 37, findings 1 and 3, on a host deployed by an earlier version (folders 0755, files
    0644, the lock and a GPU claim file among them): the other user could open the lock; the next
    deploy makes the whole remote_dir the user's alone, and then they cannot."""
    remote_dir = shared / "shared" / "engine-old"
    inv = make_inventory({"h": entry(lab, lab.hosts["h1"], remote_dir=str(remote_dir))})
    assert deploy(inv)[0] == 0
    claim = remote_dir / ".kdtree" / "gpu-GPU-00000000-1111-2222-3333-444455556666.flock"
    claim.touch()
    (remote_dir / "build").mkdir()
    (remote_dir / "build" / "test_results.json").write_text("s3cret\n")
    subprocess.run(["chmod", "-R", "go+rX", str(remote_dir)], check=True)
    paths = {"lock": remote_dir / ".kdtree" / "lock.flock", "claim": claim,
             "result": remote_dir / "build" / "test_results.json"}
    assert attacker_reach(paths) == dict.fromkeys(paths, "opened")       # the earlier version's hole
    code, out = deploy(inv)
    assert code == 0, out
    assert attacker_reach(paths) == dict.fromkeys(paths, "Permission denied")
    assert modes_open_to_others(remote_dir) == []


def test_a_co_tenant_that_copies_the_benchs_marker_is_still_a_co_tenant(lab, gpu_lab, make_inventory, shared,
                                                                        tmp_path):
    """Issue 37, finding 2, as reported: while the bench runs on its GPU, another user starts a
    job there with the run's marker copied into its environment (here read from where the bench
    leaves it; on a real host, from the command line). The user sees: bench passed but NOISY,
    naming that job's pid; its metrics marked noisy. Before, the job passed for the step's own
    and the bench said "alone on it"."""
    host, fake = gpu_lab
    remote_dir = shared / "shared" / "engine"
    leak = shared / "shared" / "marker"
    fake.set(2, own_under={"dir": str(remote_dir), "gpu_uuid": fake.uuid(0), "log": str(tmp_path / "listed")})
    bench = (f'echo "$KDTREE_OWNER" > {leak} && chmod 644 {leak} && mkdir -p "$KD_RESULTS_DIR" && sleep 6 && '
             'echo \'{"version": 1, "metrics": {"m": {"value": 1.0, "unit": "ms", "better": "lower"}}}\' '
             '> "$KD_RESULTS_DIR/bench.json"')
    # (the bench lasts past the sampler's second look, SAMPLE_SECONDS in: the job is there by then)
    job = as_attacker(f"for i in $(seq 200); do [ -s {leak} ] && exec env KDTREE_OWNER=$(cat {leak}) sleep 60; "
                      "sleep 0.05; done", background=True)
    try:
        inv = make_inventory({"g": entry(lab, host, remote_dir=str(remote_dir))},
                             commands=fake_commands(bench=bench))
        code, run_dir, out = run_validate(inv, ["g"], "sync,bench", tmp_path / "run")
    finally:
        job.kill()
        job.wait()
    record_ = json.loads((run_dir / "run.json").read_text())["hosts"]["g"]
    assert code == 0, out
    assert f"NOISY: 1 other process(es) on the GPU meanwhile (pid {job.pid} sleep)" in record_["steps"]["bench"]["message"]
    assert record_["bench"]["metrics"]["m"]["noisy"] is True


def test_a_process_of_another_user_is_never_the_steps_own_whatever_it_copied(lab, make_inventory, shared):
    """Issue 37, finding 2: the bench step's own processes on its GPU (not co-tenants) are told by
    their executable or the run's marker, which is on the step's command line for every user to
    copy; a deploying root reads everyone's. Another user's process that carries the marker, or
    runs an executable from the folder asked about, is still not the step's: only processes of
    the connecting user are."""
    marker = "KDTREE_OWNER=0123456789abcdef"
    theirs = as_attacker(f"exec env {marker} sleep 60", background=True)
    ours = subprocess.Popen(["env", marker, "sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])                 # ours, but neither marked nor from the folder
    try:
        assert wait_for(lambda: f"\0{marker}\0".encode() in Path(f"/proc/{theirs.pid}/environ").read_bytes(), 10)
        inv = make_inventory({"h": entry(lab, lab.hosts["h1"], remote_dir=str(shared / "shared" / "engine"))})
        pids = {theirs.pid, ours.pid, other.pid}
        with open_transport(inv.hosts["h"]) as t:
            assert gpus.own_pids(t, pids, str(shared / "shared" / "engine"), marker) == {ours.pid}
            # the folder whose executables are the step's: theirs runs /usr/bin/sleep too
            sleep_dir = os.path.dirname(os.path.realpath(f"/proc/{theirs.pid}/exe"))
            assert gpus.own_pids(t, pids, sleep_dir, "KDTREE_OWNER=other") == {ours.pid, other.pid}
    finally:
        for proc in (theirs, ours, other):
            proc.kill()
            proc.wait()


def test_group_write_for_the_users_private_group_is_accepted(lab, make_inventory, tmp_path):
    """As Debian's OpenSSH: a group-writable parent, remote_dir or file whose group is the deploying
    user's private group (only that user in it; root's group here) passes (a umask of 002 is no
    hole), and so does a group-writable run directory of that group on this machine."""
    h1 = lab.hosts["h1"]
    remote = h1.root / f"private-group-{tmp_path.name}" / "engine"
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote))})
    assert deploy(inv)[0] == 0
    for path in (remote.parent, remote, remote / "README.md"):
        os.chown(path, -1, os.getegid())
        path.chmod(path.stat().st_mode | 0o020)
    code, out = deploy(inv)
    assert code == 0, out
    report_dir = tmp_path / "reports"
    report_dir.mkdir(mode=0o770)
    os.chown(report_dir, -1, os.getegid())
    assert run_store.create_run_dir(tmp_path / "runs", report_dir).path == report_dir


def tampered_local_host(tmp_path) -> Host:
    """A local host whose deployed tree has build/ owned by another uid (local: the same scripts)."""
    remote = tmp_path / "engine"
    (remote / ".kdtree").mkdir(parents=True)
    (remote / ".kdtree" / "marker").write_text("x\n")
    (remote / ".kdtree" / "build.json").write_text("{}\n")
    (remote / "build").mkdir()
    (remote / "build" / "kdtree").write_text("#!/bin/sh\n")
    os.chown(remote / "build", ATTACKER, ATTACKER)
    return Host(name="local", transport="local", remote_dir=str(remote))


def operations(host: Host) -> dict[str, tuple[str, bytes | None]]:
    """Every kind of command the orchestrator runs under remote_dir, with its stdin."""
    from orchestrator.steps import executables
    owner = state.Owner.now("test")
    d = host.remote_dir
    return {
        "lock": (client.lock(host, owner, mode=state.EXCLUSIVE).line, None),
        "write state": (client.write_json_command(host, name="build.json", data={}), None),
        "read file": (client.read_file(host, path=f"{d}/.kdtree/build.json", max_bytes=100, timeout=10), None),
        "read files": (client.read_files(host, mark="mark", paths=[(".kdtree/build.json", 100)], timeout=10), None),
        "list (tar)": (client.sync_list(host, timeout=10), None),
        "delete (tar)": (client.sync_delete(host, paths=[b"build"], timeout=10), None),
        "extract (tar)": (client.sync_extract(host, stream=io.BytesIO(b""), timeout=10), None),
        "hash inputs": (client.hash_inputs(host, program="open('executed', 'w')", mask="", if_built=False,
                                           timeout=10), None),
        "hash build": (client.build_hash(host, timeout=10), None),
        "drop build": (client.build_drop(host, timeout=10), None),
        "check build, run --version": (executables.check_command(host, [{"build/kdtree": "0" * 64}],
                                                                 remote.step(host, "touch executed", 10)), None),
        "engine command": (remote.step_command(host, "touch executed", 10), None),
    }


@pytest.mark.parametrize("operation", list(operations(Host(name="x", transport="local", remote_dir="/x/y"))))
def test_every_write_lock_delete_read_and_execute_checks_first(tmp_path, operation):
    """Each command the orchestrator runs under remote_dir (lock, sync, state, tar, hash, engine
    steps) checks ownership first: with build/ owned by another uid it exits 86 with
    `UNSAFE ... owned by uid 4242` and changes nothing (nothing executed, nothing deleted)."""
    host = tampered_local_host(tmp_path)
    command, stdin = operations(host)[operation]
    before = tree(tmp_path)
    if isinstance(command, str):
        result = LocalTransport(host).run(command, timeout=30, stdin=stdin)
    else:                   # a remote.Command carries its own timeout and stdin
        result = LocalTransport(host).run(command)
    assert result.exit_code == ownership.UNSAFE_EXIT, result
    assert f"UNSAFE {host.remote_dir}/build is owned by uid {ATTACKER}" in result.tail
    assert tree(tmp_path) == before


def test_a_sync_checks_ownership_again_before_it_ends(tmp_path):
    """A sync ends under the lock, which checked remote_dir when it was taken: a build/ handed to
    another uid since (after rsync wrote the tree) is refused at the end, with `UNSAFE ... owned by
    uid 4242`, before the tree hash runs and without a deploy record (a DestinationError)."""
    d = tmp_path / "engine"
    host = Host(name="local", transport="local", remote_dir=str(d))
    hash_line = remote.wrap(["bash", "-c", "touch executed; echo x"], timeout=10, reads_stdin=True)
    with LocalTransport(host) as t:
        lock = state.acquire(t, state.Owner.now("test"))
        (d / "build").mkdir()
        os.chown(d / "build", ATTACKER, ATTACKER)
        with pytest.raises(DestinationError, match=f"^local: refusing to use remote_dir: {d}/build is owned by uid {ATTACKER}"):
            lock.finish_sync(tree_hash="x", record={"tree_hash": "x"}, hash_line=hash_line)
        lock.release()
    assert not (d / "executed").exists() and not (d / ".kdtree" / "deploy.json").exists()


# -- this machine: the run directory -------------------------------------------------------------------
def test_a_report_dir_another_user_could_redirect_is_refused(tmp_path, lab, make_inventory):
    """--report-dir owned by another user (or group/other-writable, or with a parent that is), and a
    run dir whose host folder is a symlink: refused before a byte is written there (exit 2), with
    the path and why; a fresh run dir is private (0700) and so is every file in it (0600)."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, ATTACKER, ATTACKER)
    writable = tmp_path / "writable"
    writable.mkdir()
    writable.chmod(0o777)
    for report_dir, why in ((foreign, f"owned by uid {ATTACKER}"), (writable, "writable by group or others"),
                            (writable / "sub", "writable by group or others")):
        with pytest.raises(ownership.UnsafeLocalPath, match=why) as caught:
            run_store.create_run_dir(tmp_path / "runs", report_dir)
        assert caught.value.exit_code == 2
    assert not (writable / "sub").exists() or not any((writable / "sub").iterdir())
    run_dir = run_store.create_run_dir(tmp_path / "runs")
    (tmp_path / "elsewhere").mkdir()
    (run_dir.path / "h").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ownership.UnsafeLocalPath, match="not a plain directory"):
        run_dir.log_path("h", "build")
    h2 = lab.hosts["h2"]
    inv = make_inventory({"h": entry(lab, h2, remote_dir=str(h2.root / f"private-{tmp_path.name}"))},
                         commands=fake_commands(build=FAKE_BUILD, version="build/kdtree --version"))
    code, run_dir, out = run_validate(inv, ["h"], "sync,build", tmp_path / "run")
    assert code == 0, out
    for path in [run_dir, *run_dir.rglob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path


def test_runs_may_be_the_users_link_to_a_history_elsewhere_but_not_another_users(tmp_path):
    """runs/ as a symlink of this user's to a private history (as the nightly job links it) works;
    the same link owned by another uid, or pointing into a directory another uid owns, is refused."""
    (tmp_path / "history").mkdir(mode=0o700)
    (tmp_path / "runs").symlink_to(tmp_path / "history")
    run_dir = run_store.create_run_dir(tmp_path / "runs")
    assert run_dir.path.parent == tmp_path / "runs" and (tmp_path / "history" / run_dir.run_id).is_dir()
    os.lchown(tmp_path / "runs", ATTACKER, ATTACKER)
    with pytest.raises(ownership.UnsafeLocalPath, match="runs is not a plain directory"):
        run_store.create_run_dir(tmp_path / "runs")
    os.lchown(tmp_path / "runs", os.geteuid(), os.getegid())
    os.chown(tmp_path / "history", ATTACKER, ATTACKER)
    with pytest.raises(ownership.UnsafeLocalPath, match=f"history is owned by uid {ATTACKER}"):
        run_store.create_run_dir(tmp_path / "runs")


def test_a_secret_in_a_pulled_result_file_never_lands_on_disk(lab, make_inventory, tmp_path, source, monkeypatch):
    """A host's test results carry the secret_env value in clear and JSON-escaped (`\\u0074...`).
    The user sees: the test step passed. Afterwards: no file of the run directory holds the value in
    either form, and the pulled file says [REDACTED]."""
    token = f"tok-{os.urandom(8).hex()}"
    monkeypatch.setenv("KD_TOKEN", token)
    escaped = "".join(f"\\u{ord(c):04x}" for c in token)
    (source / "scripts" / "leak.py").write_text(
        "import os\n"
        "t = os.environ['KD_TOKEN']\n"
        "esc = ''.join('\\\\u%04x' % ord(c) for c in t)\n"
        "os.makedirs('build', exist_ok=True)\n"
        "open('build/test_results.json', 'w').write("
        "'{\"tests\": [{\"name\": \"t %s\", \"status\": \"passed\", \"message\": \"%s\"}]}' % (t, esc))\n")
    h2 = lab.hosts["h2"]
    inv = make_inventory({"h": entry(lab, h2, remote_dir=str(h2.root / f"secret-{tmp_path.name}"),
                                     secret_env=["KD_TOKEN"])}, commands=fake_commands(test='"$PYTHON" scripts/leak.py'))
    code, run_dir, out = run_validate(inv, ["h"], "sync,test", tmp_path / "run")
    assert code == 0, out
    pulled = (run_dir / "h" / "test_results.json").read_text()
    assert pulled.count("[REDACTED]") == 2, pulled
    for path in run_dir.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            assert token not in text and escaped not in text, path


# -- host output is data ------------------------------------------------------------------------------
CONTROLS = [chr(c) for c in [*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0)]] + \
    ["\u2028", "\u2029", "\u202e", "\u2066"]        # a lone CR (U+000D) is among the C0 ones


def sample_run(text: str) -> dict:
    """A run record whose host strings (name of a test, messages, tail) all carry `text`."""
    run = record.RunRecord("20261201-000000-abcd", "validate", "2026-12-01T00:00:00Z")
    host = record.HostRecord(status="failed", address="h")
    host.steps["test"] = record.StepRecord("failed", 1.0, "h/test.log", f"tests failed {text}", f"tail {text} end")
    host.tests = record.TestsRecord(0, 1, 0, [record.TestCase(f"case{text}x", "failed", 0.1, f"msg {text}")])
    run.hosts["h"] = host
    return run.to_dict()


@pytest.mark.parametrize("char", CONTROLS, ids=lambda c: f"U+{ord(c):04X}")
def test_every_control_character_is_escaped_in_every_format(char):
    """Each control character (C0 but tab and newline, DEL, C1, Unicode line/paragraph separators,
    bidi overrides, a lone CR) from a host reaches the terminal, report.md, report.html and
    junit.xml as visible text (`\\x1b`, `\\r`, `\\u202e`), never as itself."""
    shown = visible(char)
    assert shown.startswith("\\") and char not in shown
    out = io.StringIO()
    console = Console(out)
    console.host("h")(f"before{char}after\nsecond line")
    cli.run_summary(console, record.RunRecord("r", "validate", "t", hosts={"h": record.HostRecord(
        status="failed", steps={"test": record.StepRecord("failed", message=f"first {char}failure")})}), pipeline.Plan())
    run = sample_run(char)
    rendered = {"terminal": out.getvalue(), "md": report.render_markdown(run), "html": report.render_html(run),
                "junit": report.render_junit(run)}
    for fmt, text in rendered.items():
        assert char not in text, fmt
        assert shown in text, fmt
    assert out.getvalue().startswith(f"[h] before{shown}after\n[h] second line\n")
    ET.fromstring(rendered["junit"])        # well-formed whatever the host sent


def test_terminal_takeover_sequences_are_shown_not_obeyed():
    """The report's instances: OSC 52 (clipboard), OSC 0 (title), cursor moves, `compiling\\rtest
    passed` and a test named `\\e[1G\\e[2K` in the summary's first-failure column: all shown
    escaped, on lines that start with the host's prefix."""
    out = io.StringIO()
    console = Console(out)
    say = console.host("h")
    for line in ("\x1b]52;c;ZXZpbA==\x07", "\x1b]0;owned\x07", "\x1b[2J\x1b[H", "compiling\rtest passed"):
        say(line)
    cli.run_summary(console, record.RunRecord("r", "validate", "t", hosts={"h": record.HostRecord(
        status="failed", steps={"test": record.StepRecord("failed", message="1 failed: \x1b[1G\x1b[2Kok")})}),
        pipeline.Plan())
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert "[h] compiling\\rtest passed" in text and "\\x1b]52;c;ZXZpbA==\\x07" in text
    assert "test: 1 failed: \\x1b[1G\\x1b[2Kok" in text


def test_a_line_wider_than_the_terminal_continues_under_the_hosts_prefix():
    """A host pads a line to the terminal's width so that its end would wrap onto a visual line of
    its own, looking like another host's status (`[h2] test passed`). On a terminal of 40 columns
    every visual line, wide characters included, starts with `[h] ` and fits."""
    out = io.StringIO()
    Console(out, columns=40).host("h")("x" * 36 + "[h2] test passed " + "漢" * 30)
    lines = out.getvalue().splitlines()
    assert len(lines) > 2 and all(line.startswith("[h] ") for line in lines), lines
    assert all(sum(2 if ord(c) > 0x2e80 else 1 for c in line) <= 40 for line in lines), lines


def test_markdown_neutralises_mentions_links_images_and_html():
    """Host text in report.md (a PR comment) cannot mention anyone, link, embed an image, break a
    table cell or smuggle HTML."""
    hostile = "@octocat @org/team #12 [click](https://evil.example) ![img](https://evil.example/x.png) " \
              "<img src=x onerror=alert(1)> www.evil.example | &#64;admin `code`"
    md = report.render_markdown(sample_run(hostile))
    for bad in ("@octocat", "@org", "#12", "https://evil", "www.evil"):       # anywhere, code blocks included
        assert bad not in md, bad
    outside_code = re.sub(r"(?ms)^(`{3,})text\n.*?^\1$", "", md)       # code renders nothing: not links
    outside_code = re.sub(r"(?<!\\)(`+) .*? \1|(?<!\\)`[^`]+`", "", outside_code)
    for bad in ("[click](", "![img](", "<img", "&#64;admin"):
        assert bad not in outside_code, bad
    assert "@\u200boctocat" in md and "\\[click\\]" in outside_code and "&lt;img" in outside_code


# -- bounded everywhere --------------------------------------------------------------------------------------
def test_one_hosts_garbage_fails_its_step_and_never_the_run_record(lab, make_inventory, tmp_path):
    """One host's outputs.json nests a value 600 lists deep, another's test_results.json holds 5.3 M
    empty cases (15.9 MB), a third names a test with a lone surrogate and invalid UTF-8. The user
    sees: the first two hosts' steps FAILED naming the file and the limit; the third passed.
    Afterwards: run.json (under 20 MB), the reports and junit.xml exist with every host, and this
    process grew by far less than 1 GB."""
    h1, h2 = lab.hosts["h1"], lab.hosts["h2"]
    deep = "mkdir -p build && python3 -c 'print(\"{\\\"tree\\\": 1, \\\"x\\\": \" + \"[\" * 600 + \"]\" * 600 + \"}\")' > build/outputs.json"
    many = "mkdir -p build && python3 -c 'import sys; sys.stdout.write(\"{\\\"tests\\\": [\" + \"{},\" * 5300000 + \"{}]}\")' > build/test_results.json"
    odd = ("mkdir -p build && printf '{\"tests\": [{\"name\": \"a\\\\ud800b\\xff\\xfe\", \"status\": \"passed\"}]}' "
           "> build/test_results.json")
    inv = make_inventory({
        "deep": entry(lab, h1, remote_dir=str(h1.root / f"deep-{tmp_path.name}")),
        "many": entry(lab, h2, remote_dir=str(h2.root / f"many-{tmp_path.name}")),
        "odd": entry(lab, h1, remote_dir=str(h1.root / f"odd-{tmp_path.name}"))},
        commands=fake_commands(generate=deep, test=f"case $PWD in */many-*) {many};; *) {odd};; esac"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, run_dir, out = run_validate(inv, ["deep"], "sync,golden", tmp_path / "run1")
    steps = json.loads((run_dir / "run.json").read_text())["hosts"]["deep"]["steps"]
    assert code == 1 and "build/outputs.json is not valid JSON or is nested deeper than 32 levels" in \
        steps["golden"]["message"], steps
    code, run_dir, out = run_validate(inv, ["many", "odd"], "sync,test", tmp_path / "run2")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    run = json.loads((run_dir / "run.json").read_text())
    assert "more than 500000" in run["hosts"]["many"]["steps"]["test"]["message"], run["hosts"]["many"]["steps"]
    assert run["hosts"]["odd"]["steps"]["test"]["status"] == "passed"
    assert run["hosts"]["odd"]["tests"]["cases"][0]["name"] == "a\ufffdb\ufffd\ufffd"
    assert (run_dir / "run.json").stat().st_size < 20 << 20
    for name in ("report.md", "report.html", "junit.xml"):
        assert "odd" in (run_dir / name).read_text()
    assert grown_mb < 1024, grown_mb


def test_bounded_json_limits():
    """The limits themselves: depth, values, size; NaN/Infinity become None; surrogates U+FFFD."""
    assert bounded.loads(b'{"a": [1, NaN, Infinity], "s": "\\ud800"}', "f") == {"a": [1, None, None], "s": "\ufffd"}
    with pytest.raises(ValueError, match="nested deeper than 32"):
        bounded.loads("[" * 33 + "]" * 33, "f")
    assert bounded.loads("[" * 32 + "]" * 32, "f")
    with pytest.raises(ValueError, match="more than 10"):
        bounded.loads(json.dumps(list(range(20))), "f", max_values=10)
    with pytest.raises(ValueError, match="larger than 4 bytes"):
        bounded.loads(b"[1,2]", "f", max_bytes=4)
    assert bounded.loads('["[[[[", "],,,"]', "f", max_depth=1, max_values=3) == ["[[[[", "],,,"]


def test_a_host_that_trickles_lock_lines_is_given_up_on_at_the_lock_timeout(tmp_path, monkeypatch):
    """A host whose lock command prints a line every half second and never answers: the lock gives
    up after `timeouts.lock` (2 s) overall, not per line."""
    host = Host(name="local", transport="local", remote_dir=str(tmp_path / "engine"),
                timeouts={**inventory_mod.DEFAULT_TIMEOUTS, "lock": 2})
    monkeypatch.setattr(client, "lock", lambda *a, **k: remote.Command((), "while true; do echo waiting; sleep 0.5; done",
                                                                      None))
    start = time.monotonic()
    with pytest.raises(HostError, match="no answer from the lock command within 2 s"):
        state.acquire(LocalTransport(host), state.Owner.now("test"))
    assert time.monotonic() - start < 6


# -- host keys and inventory numbers --------------------------------------------------------------------------
def test_a_key_contradicting_host_key_is_changed_and_never_pinned(lab, make_inventory, tmp_path):
    """`host_key:` pins one fingerprint; the host offers another key that no known_hosts file lists.
    The user sees: HOST KEY CHANGED (not `not known`), from validate's transport and from `invoke
    trust`. Afterwards: the project known_hosts file is unchanged (trust pinned nothing)."""
    impostor = lab.add_host(f"impostor{os.getpid()}", trusted=False)
    known = tmp_path / "known_hosts"
    known.write_text("")
    inv = make_inventory({"h": entry(lab, impostor, known_hosts=str(known), host_key=lab.hosts["h2"].fingerprint())})
    from orchestrator.connectors.paramiko import SshTransport
    with pytest.raises(HostKeyError) as caught:
        SshTransport(inv.hosts["h"]).connect()
    assert caught.value.changed and "HOST KEY CHANGED" in str(caught.value)
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        cli.trust(inv.hosts["h"], [], Console(io.StringIO()))
    assert known.read_text() == ""
    impostor.stop()


@pytest.mark.parametrize("value, problem", [
    (float("nan"), "must be finite"), (float("inf"), "must be finite"), (10 ** 9, "must be finite"),
])
def test_inventory_numbers_are_finite(make_inventory, value, problem):
    with pytest.raises(InventoryError, match=f"timeouts.build.*{problem}"):
        make_inventory({"h": {"address": "a", "remote_dir": "/srv/k", "timeouts": {"build": value}}})


def test_inventory_names_are_length_limited(make_inventory):
    with pytest.raises(InventoryError, match="a host name is at most 64 characters, not 300"):
        make_inventory({"h" * 300: {"address": "a", "remote_dir": "/srv/k"}})
    with pytest.raises(InventoryError, match="a group name is at most 64 characters"):
        make_inventory({"h": {"address": "a", "remote_dir": "/srv/k", "groups": ["g" * 65]}})
    with pytest.raises(InventoryError, match="at most 1024 characters"):
        make_inventory({"h": {"address": "a", "remote_dir": "/srv/" + "k" * 1100}})
