"""Deploy against real sshd hosts on 127.0.0.1 (and the local transport): mirror, excludes,
incremental transfer, --delete, tar fallback, destination safety, lock, repair, fleets, dry-run."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from task_runs import deploy_task
from orchestrator import cli, doctor, state, sync
from orchestrator.runner.console import Console
from orchestrator.errors import HostError, SyncError
from orchestrator.connectors.factory import open_transport
from orchestrator.host import client

REPO = Path(__file__).resolve().parents[2]

EXCLUDED = ["build/kdtree", "python/kdtree_ref/__pycache__/model.cpython-311.pyc", "python/x.pyc",
            "tests/refs/model_tiny_fp32.kdtr", "tests/refs/manifest.json"]
# One host-made file per exclusion class of hosts.yaml (build/, .git/, __pycache__/, *.pyc, bundles,
# the generated manifest); test_every_exclusion_class_is_planted keeps this list complete.
HOST_ONLY = ["build/kdtree", ".git/HEAD", "python/kdtree_ref/__pycache__/ref.cpython-311.pyc", "scripts/old.pyc",
             "tests/refs/model_tiny_fp32.kdtr", "tests/refs/manifest.json"]
SYNCED = ["README.md", "python/kdtree_ref/model.py", "scripts/tree_hash.sh", "src/main.cpp",
          "tests/refs/expected_manifest.json"]


def files(root) -> list[str]:
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and not p.relative_to(root).parts[0] == ".kdtree")


@pytest.fixture
def deployer(lab, make_inventory, remote_dir):
    """deployer(**entry) -> deploy(): deploys the `source` tree to h1 (or as entry says) as
    `invoke deploy` does (task_runs.deploy_task)."""
    def make(**entry):
        inv = make_inventory({"h": lab.inventory_entry(lab.hosts["h1"], **{"remote_dir": remote_dir, **entry})})
        deploy = lambda: deploy_task(inv, "h")      # noqa: E731
        deploy.inventory, deploy.dir = inv, Path(inv.hosts["h"].remote_dir)
        return deploy
    return make


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the source's files belong to another uid")
@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_a_checkout_of_another_uid_deploys_as_the_host_user(deployer, source, method):
    """Deploying as root (as to ct200) from a checkout that belongs to another uid (a laptop
    user's): the tree on the host is the host user's, not the checkout's owner's, so it passes
    the ownership check on the first deploy and the next (rsync -a as root kept the owner)."""
    for path in (source, *source.rglob("*")):
        os.lchown(path, 4242, 4242)
    deploy = deployer(**({"rsync_path": "/nonexistent/rsync"} if method == "tar" else {}))
    assert deploy().method == method and deploy().files == 0
    owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in (deploy.dir, *deploy.dir.rglob("*"))}
    assert owners == {(0, 0)}, owners


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_deploy_redeploy_delete_and_excludes(deployer, source, method):
    deploy = deployer(**({"rsync_path": "/nonexistent/rsync"} if method == "tar" else {}))
    first = deploy()
    assert (first.method, first.files, first.deleted) == (method, len(SYNCED), 0)
    assert files(deploy.dir) == SYNCED
    record = json.loads((deploy.dir / ".kdtree" / "deploy.json").read_text())
    assert record["tree_hash"] == first.tree_hash == sync.source_id(deploy.inventory.project).tree_hash
    assert (record["method"], record["files"]) == (method, len(SYNCED))
    # on the host, one file of every exclusion class (results of earlier builds, generated bundles and
    # refs, a checkout's .git, caches) must survive --delete and the tar sync's deletions, untouched
    planted = {rel: f"made on the host: {rel}\n" for rel in HOST_ONLY}
    for rel, text in planted.items():
        (deploy.dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (deploy.dir / rel).write_text(text)
    stamps = {rel: os.lstat(deploy.dir / rel).st_mtime_ns for rel in planted}

    again = deploy()
    assert (again.files, again.deleted) == (0, 0)
    assert {rel: (deploy.dir / rel).read_text() for rel in planted} == planted

    time.sleep(1.1)   # a different mtime second, as for any real edit
    (source / "src" / "main.cpp").write_text("int main() { return 1; }\n")
    (source / "README.md").unlink()
    changed = deploy()
    assert (changed.files, changed.deleted) == (1, 1) and changed.tree_hash != first.tree_hash
    assert (deploy.dir / "src" / "main.cpp").read_text() == "int main() { return 1; }\n"
    assert files(deploy.dir) == sorted([f for f in SYNCED if f != "README.md"] + list(planted))
    assert {rel: (deploy.dir / rel).read_text() for rel in planted} == planted
    assert {rel: os.lstat(deploy.dir / rel).st_mtime_ns for rel in planted} == stamps
    assert sorted(os.listdir(deploy.dir / ".kdtree")) == ["deploy.json", "gate.flock", "lock.flock", "marker"]


def test_every_exclusion_class_is_planted():
    """HOST_ONLY holds a file under each exclude pattern of the shipped hosts.yaml (.kdtree/, the
    orchestrator's own state, has tests of its own), so the redeploy test covers every class."""
    excludes = yaml.safe_load((REPO / "hosts.yaml").read_text())["project"]["excludes"]
    uncovered = [p for p in excludes if p != ".kdtree/"
                 and not any(sync._under_excluded(rel, False, [p]) for rel in HOST_ONLY)]
    assert uncovered == []


@pytest.mark.parametrize("path, is_dir, patterns, excluded", [
    ("top", True, ["/top/"], True), ("a/top", True, ["/top/"], False), ("a/b", False, ["/a/b"], True),
    ("x/a/b", False, ["/a/b"], False), ("x/a/b", False, ["a/b"], True), ("top", False, ["/top/"], False),
    ("/top", False, ["/top"], True), ("fooX", False, ["fooX"], True), ("Xcache", True, ["/Xcache/"], True),
])
def test_exclude_patterns_anchored_and_directory_only(path, is_dir, patterns, excluded):
    """rsync's rules: a leading '/' anchors at the top (the whole path must match), a trailing '/'
    matches directories only, a pattern with a '/' inside matches the end of the path."""
    assert sync.is_excluded(path, is_dir, patterns) is excluded


@pytest.mark.parametrize("path, is_dir, patterns, excluded", [
    ("build/x", False, ["build/"], True), ("build", False, ["build/"], False), ("x", False, ["*/"], False),
    ("a/b/c", False, ["b/"], True), (".kdtree/lock.flock", False, [], True), ("src/main.cpp", False, ["*.o"], False),
])
def test_the_tar_sync_never_deletes_what_is_under_an_excluded_directory(path, is_dir, patterns, excluded):
    """A host path gone from the source is deleted unless it or a directory above it is
    excluded (the state directory always is); a file is not a directory of the same name."""
    assert sync._under_excluded(path, is_dir, patterns) is excluded


def test_a_deployed_tree_is_the_recorded_one_only_while_the_host_still_hashes_to_it(make_inventory, tmp_path):
    """deployed_tree (what lets a run skip its sync): the deploy record's tree hash only when the
    tree on the host hashes to it now, no sync broke half-way, and a record names a hash."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": ".deploy/local"}})
    root = tmp_path / ".deploy" / "local"
    deploy = lambda: deploy_task(inv, "local")
    with open_transport(inv.hosts["local"]) as t:
        tree = deploy().tree_hash
        assert sync.deployed_tree(t, inv.project) == tree
        (root / sync.PARTIAL).write_text("")
        assert sync.deployed_tree(t, inv.project) is None
        (root / sync.PARTIAL).write_text("x" * 5000)      # too large to read: a mark all the same
        assert sync.deployed_tree(t, inv.project) is None
        (root / sync.PARTIAL).unlink()
        (root / "src" / "main.cpp").write_text("changed on the host\n")
        assert sync.deployed_tree(t, inv.project) is None
        assert deploy().tree_hash == tree and sync.deployed_tree(t, inv.project) == tree
        record = json.loads((root / ".kdtree" / "deploy.json").read_text())
        (root / ".kdtree" / "deploy.json").write_text(json.dumps({**record, "tree_hash": ""}))
        assert sync.deployed_tree(t, inv.project) is None
        (root / ".kdtree" / "deploy.json").write_text(json.dumps(record))
        (root / "scripts" / "tree_hash.sh").write_text("true\n")     # a host whose hash command prints nothing
        with pytest.raises(SyncError, match="the tree hash command printed nothing") as failed:
            sync.deployed_tree(t, inv.project)
        assert failed.value.host == "local"


SENT = ("method", "files", "bytes", "deleted", "repaired", "tree_hash", "seconds")     # a sync's result, as both kinds give it


@pytest.mark.parametrize("by_task, probed", [(True, False), (False, False), (False, True)],
                         ids=["deploy", "lock-then-sync", "probe-lock-then-sync"])
@pytest.mark.parametrize("rsync_path, method", [(None, "rsync"), ("/nonexistent/rsync", "tar")])
def test_a_sync_records_what_it_deployed_and_says_so(make_inventory, source, tmp_path, rsync_path, method,
                                                      by_task, probed):
    """The deploy record on the host and the result: the tree, its git state, when, by whom, how,
    what was sent; the log says how it went. The same through invoke deploy and through
    sync_tree under a lock taken on its own (as validate takes it), told where rsync is by the
    doctor's probe (as validate's is) or not; so is the in-progress mark a sync that breaks
    leaves, naming its owner to the next, which repairs."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host"),
                                    **({"rsync_path": rsync_path} if rsync_path else {})}})
    (source / "scripts" / "tree_hash.sh").write_text("echo " + "f" * 64 + "\n")
    tree = sync.SourceId("f" * 64, "abc123", True) if not by_task else sync.source_id(inv.project)
    owner = state.Owner("laptop", 7, "2026-01-01T00:00:00Z", "deploy")
    owners = re.escape(str(owner)) if not by_task else \
        rf"deploy by pid {os.getpid()} on {re.escape(socket.gethostname())}, started \S+"

    def deploy() -> dict:
        """What the sync did (SENT: as its result says), its status, its error's message, its log lines."""
        if by_task:
            done = deploy_task(inv, "local")
            return {k: getattr(done, k) for k in (*SENT, "status", "message", "log")}
        log: list[str] = []
        with open_transport(inv.hosts["local"]) as t:
            rsync = doctor.rsync_of(doctor.probe(t, import_numpy=False)) if probed else None
            with state.acquire(t, owner) as lock:
                try:
                    result = sync.sync_tree(t, inv.project, tree, owner, log.append, lock, rsync)
                except SyncError as e:
                    return {"status": "failed", "message": e.message, "host": e.host, "log": log}
        return {**{k: getattr(result, k) for k in SENT}, "status": "passed", "log": log}
    start = time.monotonic()
    result = deploy()
    took = time.monotonic() - start
    assert not (tmp_path / "host" / ".kdtree" / "sync.partial").exists()
    record = json.loads((tmp_path / "host" / ".kdtree" / "deploy.json").read_text())
    assert {k: record[k] for k in ("version", "tree_hash", "git_revision", "git_dirty", "method", "deleted")} == \
        {"version": 1, "tree_hash": "f" * 64, "git_revision": tree.git_revision, "git_dirty": tree.git_dirty,
         "method": method, "deleted": 0}
    assert re.fullmatch(owners, str(state.Owner(**record["by"]))) and record["by"]["command"] == "deploy"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["deployed_at"])
    assert (result["status"], result["method"], result["files"], result["tree_hash"], result["repaired"]) == \
        ("passed", method, len(SYNCED), "f" * 64, None)
    assert result["bytes"] == record["bytes"] > 0 and isinstance(result["seconds"], float)
    assert 0 < result["seconds"] <= took and result["seconds"] == round(result["seconds"], 3)
    log = result["log"]
    assert log[-1] == (f"deployed {'f' * 12} with {method}: {len(SYNCED)} files, {result['bytes']} bytes sent, 0 deleted")
    assert log[:-1] == ([] if method == "rsync" else ["no rsync on the host: using a tar stream"])
    # the next sync breaks after it began: on the host (which has .kdtree/) the tree hashes otherwise, or not at all
    for script, why in ((f"[ -e .kdtree ] && echo 0000 || echo {'f' * 64}",
                         f"the deployed tree hash 0000 differs from the local {'f' * 64}"),
                        (f"[ -e .kdtree ] || echo {'f' * 64}", "the tree hash command printed nothing")):
        (source / "scripts" / "tree_hash.sh").write_text(script + "\n")
        broke = deploy()
        assert (broke["status"], broke["message"], broke.get("host", "local")) == ("failed", why, "local")
        assert re.fullmatch(f"started {owners}\n", (tmp_path / "host" / ".kdtree" / "sync.partial").read_text())
    (source / "scripts" / "tree_hash.sh").write_text("echo " + "f" * 64 + "\n")
    assert re.fullmatch(f"started {owners}", deploy()["repaired"])


def test_a_sync_without_rsync_here_uses_tar_and_says_where_rsync_is_missing(make_inventory, source, tmp_path,
                                                                             monkeypatch):
    """The host has rsync but this machine has none (which finds nothing): a tar stream, and the
    log names this machine, not the host."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    monkeypatch.setattr(sync.shutil, "which", lambda name, *a, **k: None)
    result = deploy_task(inv, "local")
    assert result.method == "tar" and result.log[0] == "no rsync on this machine: using a tar stream"


def test_a_sync_whose_rsync_connection_drops_once_retries_and_says_so(make_inventory, source, tmp_path, fake_tool):
    """rsync exits 12 (its connection dropped) on the first try: the sync retries, the log says
    why, and the tree is deployed."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    dropped = tmp_path / "dropped"
    fake_tool("rsync", f'[ "$1" = --version ] || [ -e {dropped} ] || '
                       f'{{ touch {dropped}; echo "connection unexpectedly closed" >&2; exit 12; }}\n'
                       f'exec {shutil.which("rsync")} "$@"')
    result = deploy_task(inv, "local")
    assert result.method == "rsync" and files(tmp_path / "host") == SYNCED
    assert result.log[0] == "rsync failed with exit code 12, retrying: connection unexpectedly closed"


@pytest.mark.timeout(120)
def test_the_rsync_version_query_leaves_the_lock_holders_commands_alone(make_inventory, source, tmp_path, fake_tool):
    """The lock holder asks the host's rsync for its version as the sync begins; an rsync (or an
    rsync_path wrapper) that reads its stdin there gets nothing of the lock's own command stream."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    fake_tool("rsync", f'[ "$1" = --version ] && cat > /dev/null\nexec {shutil.which("rsync")} "$@"')
    result = deploy_task(inv, "local")
    assert result.method == "rsync" and files(tmp_path / "host") == SYNCED


def test_the_rsync_argv_of_a_sync(make_inventory, source):
    """What rsync is told: contents compared only when asked (a repair), the host's rsync_path
    over ssh only (a local host runs this machine's rsync)."""
    from orchestrator.connectors.paramiko import SshTransport
    inv = make_inventory({"h": {"address": "h", "remote_dir": "/srv/kdtree", "rsync_path": "/opt/rsync dir/rsync"},
                          "local": {"transport": "local", "remote_dir": "/srv/kd", "rsync_path": "/opt/rsync"}})
    argv = sync.rsync_argv(SshTransport(inv.hosts["h"]), inv.project)
    assert "--checksum" not in argv and argv[-3] == "--rsync-path='/opt/rsync dir/rsync'"
    assert "--checksum" in sync.rsync_argv(SshTransport(inv.hosts["h"]), inv.project, checksum=True)
    local = sync.rsync_argv(open_transport(inv.hosts["local"]), inv.project)
    assert not [a for a in local if a.startswith("--rsync-path")] and local[-2:] == [f"{source}/", "/srv/kd/"]


@pytest.mark.parametrize("local, remote, expected", [
    ("rsync  version 3.2.7  protocol version 31", "rsync  version 3.4.1  protocol version 32", True),
    ("rsync  version 3.2.4  protocol version 31", "rsync  version v3.2.4  protocol version 31", True),
    ("rsync  version 3.2.7  protocol version 31", "rsync  version 3.1.3  protocol version 31", False),
    ("rsync  version 3.2.3  protocol version 31", "rsync  version 3.2.7  protocol version 31", False),
    ("rsync  version 3.2.7  protocol version 31", "", False),
    ("", "rsync  version 3.2.7  protocol version 31", False),
])
def test_rsync_errors_come_through_the_transfer_stream_where_both_rsyncs_can(local, remote, expected):
    """--stderr=client only where both ends know it (3.2.4 on): an older host rsync would refuse it."""
    assert sync.messages_by_protocol(local, remote) is expected


def test_a_tar_sync_sends_empty_directories(make_inventory, source, tmp_path):
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    (source / "empty" / "dir").mkdir(parents=True)
    (tmp_path / "host" / ".kdtree").mkdir(parents=True)
    with open_transport(inv.hosts["local"]) as t:
        sync._tar_sync(t, inv.project, everything=False)
    assert (tmp_path / "host" / "empty" / "dir").is_dir()


def test_a_tar_sync_whose_host_hangs_fails_within_the_sync_timeout(make_inventory, tmp_path, fake_tool):
    """Each command of the tar sync (listing remote_dir, deleting removed files, extracting the
    stream) runs under the host's sync timeout: a host where that one hangs fails in about a
    second, naming the command; the next sync completes the tree."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host"),
                                    "timeouts": {"sync": 1}}})
    (tmp_path / "host" / ".kdtree").mkdir(parents=True)
    (tmp_path / "host" / "old.txt").write_text("gone from the source\n")       # something to delete
    with open_transport(inv.hosts["local"]) as t:
        for tool, only, what in [("find", "./.kdtree", "listing remote_dir"), ("rm", "old.txt", "deleting removed files"),
                                 ("tar", "-xzf", "extracting the tar stream")]:
            fake = fake_tool(tool, f'case " $* " in *" {only} "*) exec sleep 30;; esac\nexec {shutil.which(tool)} "$@"')
            start = time.monotonic()
            with pytest.raises(HostError, match=f"{what} timed out"):
                sync._tar_sync(t, inv.project, everything=False)
            assert time.monotonic() - start < 8, what
            fake.unlink()
        counts = sync._tar_sync(t, inv.project, everything=False)
        assert (counts["files"], counts["deleted"]) == (len(SYNCED), 0) and counts["bytes"] > 0
    assert files(tmp_path / "host") == SYNCED


def test_the_tar_sync_sends_symlinks_and_deletes_a_removed_directory(deployer, source):
    """Symlinks are sent on every tar sync (even over a host file that looks the same by size and
    mtime); a directory gone from the source is deleted with what it held."""
    deploy = deployer(rsync_path="/nonexistent/rsync")
    (source / "docs" / "old").mkdir(parents=True)
    (source / "docs" / "old" / "a.txt").write_text("a\n")
    os.symlink("README.md", source / "link")
    assert deploy().method == "tar"
    assert os.readlink(deploy.dir / "link") == "README.md" and (deploy.dir / "docs" / "old" / "a.txt").is_file()
    # a regular file on the host where the source has the symlink, of the link's size and mtime: still replaced
    (deploy.dir / "link").unlink()
    (deploy.dir / "link").write_text("README.m\n")
    mtime = os.lstat(source / "link").st_mtime_ns
    os.utime(deploy.dir / "link", ns=(mtime, mtime))
    assert os.path.getsize(deploy.dir / "link") == os.lstat(source / "link").st_size
    assert deploy().method == "tar" and os.readlink(deploy.dir / "link") == "README.md"
    shutil.rmtree(source / "docs" / "old")
    assert deploy().deleted == 2 and not (deploy.dir / "docs" / "old").exists()


def test_a_tar_sync_deletes_a_file_whose_name_is_not_utf8(deployer, source):
    """A file named with bytes that are not UTF-8 is deployed by the tar sync and, once gone from
    the source, deleted from the host by the next one: names travel as bytes end to end."""
    deploy = deployer(rsync_path="/nonexistent/rsync")
    name = os.fsdecode(b"odd-\xff\xfe-name.txt")      # surrogate-escaped, as os.walk gives it
    (source / name).write_bytes(b"x\n")
    assert deploy().method == "tar" and (deploy.dir / name).read_bytes() == b"x\n"
    (source / name).unlink()
    assert deploy().deleted == 1 and not (deploy.dir / name).exists()
    assert deploy().deleted == 0


def test_local_transport_deploy(make_inventory, tmp_path, source):
    inv = make_inventory({"local": {"transport": "local", "remote_dir": ".deploy/local"}})
    out = io.StringIO()
    assert cli.deploy(inv, [inv.hosts["local"]], Console(out)) == 0
    assert files(tmp_path / ".deploy" / "local") == SYNCED
    run = json.loads((tmp_path / "runs" / "latest" / "run.json").read_text())      # a deploy leaves a run record
    assert run["command"] == "deploy" and run["status"] == "passed"
    assert run["hosts"]["local"]["steps"]["sync"]["status"] == "passed"
    assert "deployed" in (tmp_path / "runs" / "latest" / "local" / "sync.log").read_text()
    assert not (tmp_path / "runs" / "deploy").exists()


def test_dangerous_destinations_are_refused(deployer, lab, remote_dir, tmp_path):
    foreign = Path(remote_dir)
    foreign.mkdir(parents=True)
    (foreign / "precious").write_text("keep me\n")
    refused = deployer()()
    assert (refused.code, refused.status) == (1, "failed") and os.listdir(foreign) == ["precious"]
    assert re.match("refusing to use remote_dir: .* is not empty and was not created by the orchestrator",
                    refused.message), refused.message

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me\n")
    link = Path(remote_dir + "-link")
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    assert "is a symlink" in deployer(remote_dir=str(link))().message
    assert "resolves to" in deployer(remote_dir=str(link / "sub"))().message
    assert os.listdir(outside) == ["precious"]

    afile = tmp_path / "a-file"             # a remote_dir that cannot be made says why, in the host's words
    afile.write_text("keep me\n")
    refused = deployer(remote_dir=str(afile / "engine"))()
    assert re.fullmatch(f"refusing to use remote_dir: cannot create {afile}/engine/.kdtree "
                        r"\(mkdir: cannot create directory .*a-file.*: Not a directory\)", refused.message), refused.message
    assert refused.status == "failed" and afile.read_text() == "keep me\n"


def test_lock_contention_and_recovery_of_a_dead_runs_lock(deployer, lab):
    deploy = deployer()
    deploy()
    inv = deploy.inventory
    holder = state.Owner("laptop", 4242, "2026-01-01T00:00:00Z", "validate")
    with open_transport(inv.hosts["h"]) as t, state.acquire(t, holder):
        locked = deploy()
        assert locked.status == "failed" and "is locked by another run: validate by pid 4242 on laptop, started " \
            "2026-01-01T00:00:00Z" in locked.message
    assert deploy().stale_lock is None          # released cleanly

    # a run that dies holding the lock: its ssh client is killed, the host keeps no lock
    dead = state.Owner("ci-runner", 999, "2026-01-02T00:00:00Z", "deploy")
    argv = lab.ssh_argv(lab.hosts["h1"], client.lock(inv.hosts["h"], dead, mode=state.EXCLUSIVE).line)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "LOCKED exclusive"
    proc.kill()
    proc.wait()
    time.sleep(0.3)
    result = deploy()
    assert result.status == "passed" and result.stale_lock == str(dead)
    assert f"sync      | recovered the lock left by a run that died: {dead}\n" in result.output


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_a_sync_broken_half_way_is_repaired(deployer, source, method):
    deploy = deployer(**({"rsync_path": "/nonexistent/rsync"} if method == "tar" else {}))
    deploy()
    # what an interrupted sync leaves: the in-progress mark and a damaged tree
    (deploy.dir / sync.PARTIAL).write_text("started deploy by pid 1 on x\r\tPARTIAL forged\n")   # one line, printable
    main = deploy.dir / "src" / "main.cpp"
    stat = main.stat()
    main.write_text("int main() { return 9; }\n")                 # same size and time: only contents differ
    os.utime(main, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (deploy.dir / "scripts" / "tree_hash.sh").unlink()
    result = deploy()
    assert result.repaired == "started deploy by pid 1 on x  PARTIAL forged"
    assert any("did not finish" in line and "repairs" in line for line in result.log)
    assert files(deploy.dir) == SYNCED and (deploy.dir / "src" / "main.cpp").read_text() == (source / "src/main.cpp").read_text()
    assert not (deploy.dir / sync.PARTIAL).exists()


def test_parallel_deploy_with_one_host_down(lab, make_inventory, tmp_path):
    down = lab.add_host("down")
    down.stop()
    names = {"h1": lab.hosts["h1"], "h2": lab.hosts["h2"], "down": down}
    inv = make_inventory({n: lab.inventory_entry(h, remote_dir=str(h.root / f"fleet-{tmp_path.name}"))
                          for n, h in names.items()})
    out = io.StringIO()
    assert cli.deploy(inv, list(inv.hosts.values()), Console(out)) == 1
    text = out.getvalue()
    rows = {line.split()[0]: line.split()[1] for line in text.splitlines() if line.split()[:1] in (["h1"], ["h2"], ["down"])}
    assert rows == {"h1": "passed", "h2": "passed", "down": "FAILED"}
    assert "cannot reach 127.0.0.1:" in text
    for n in ("h1", "h2"):
        assert files(names[n].root / f"fleet-{tmp_path.name}") == SYNCED


def test_dry_run_changes_nothing(lab, make_inventory, remote_dir):
    inv = make_inventory({"h": lab.inventory_entry(lab.hosts["h1"], remote_dir=remote_dir)})
    out = io.StringIO()
    assert cli.deploy(inv, [inv.hosts["h"]], Console(out), dry_run=True) == 0
    assert not Path(remote_dir).exists()
    text = out.getvalue()
    assert "[h] # local: transfer" in text and "rsync -az --no-owner --no-group --delete" in text and f"h1:{remote_dir}/" in text
    assert text.splitlines()[-1] == "dry run: nothing was changed"


def test_invoke_deploy_end_to_end(lab, make_inventory, remote_dir):
    inv = make_inventory({"h": lab.inventory_entry(lab.hosts["h1"], remote_dir=remote_dir)})
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "invoke", "deploy", "--inventory", str(inv.path), "--host", "h"],
                          cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[h] sync      | deployed" in proc.stdout and files(remote_dir) == SYNCED


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_a_remote_dir_with_spaces(deployer, remote_dir, method):
    spaced = remote_dir + "/a dir with spaces"
    deploy = deployer(remote_dir=spaced, **({"rsync_path": "/nonexistent/rsync"} if method == "tar" else {}))
    assert deploy().method == method
    assert files(spaced) == SYNCED
