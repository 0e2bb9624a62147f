"""The host client (orchestrator/host/client.py) against a real loopback sshd: the sync's first and
last steps, run by the lock holder when told, under the tree lock held alone; the state writer,
bounded output with its evidence; and the package's shape: only the client builds a host script's
command line, and the lock script holds no sync of its own (it runs the scripts it is handed)."""
from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path

import pytest

from orchestrator import host as host_scripts, state
from orchestrator.connectors.factory import open_transport
from orchestrator.errors import CommandError
from orchestrator.host import client
from orchestrator.inventory import Host
from orchestrator.state import EXCLUSIVE, Owner

PACKAGE = Path(client.__file__).resolve().parent.parent
HASH = "a" * 64


@pytest.fixture
def host(lab, make_inventory, remote_dir):
    inv = make_inventory({"h": lab.inventory_entry(lab.hosts["h1"], remote_dir=remote_dir)})
    return inv.hosts["h"]


@pytest.fixture
def held(host):
    """A transport to the sshd host and the tree lock it holds alone."""
    with open_transport(host) as transport:
        lock = state.acquire(transport, Owner("laptop", 4, "2026-01-01T00:00:00Z", "deploy"), EXCLUSIVE)
        yield transport, lock
        lock.release()


def plain_host() -> Host:
    """A host entry for command lines only (nothing connects to it)."""
    return Host(name="x", transport="local", remote_dir="/x/y")


def state_dir(host) -> Path:
    return Path(host.remote_dir) / ".kdtree"


def test_begin_sync_marks_the_sync_and_says_where_rsync_is_and_what_the_last_one_left(held, host):
    """The first sync finds no mark and leaves one naming its owner; the next is told what that
    mark said, as one line of at most 500 printable characters (a hostile mark's newlines and
    control characters become spaces); both are told where rsync is and its version line."""
    _, lock = held
    owner = Owner("laptop", 4, "2026-01-01T00:00:00Z", "deploy")
    facts = lock.begin_sync()
    assert set(facts) == {"RSYNC", "RSYNC_VERSION"} and facts["RSYNC_VERSION"].startswith("rsync  version")
    assert (state_dir(host) / "sync.partial").read_text() == f"started {owner}\n"
    (state_dir(host) / "sync.partial").write_bytes(b"started x\n\x1b[31mred\n" + b"y" * 2000)
    again = lock.begin_sync()
    assert again["PARTIAL"].startswith("started x  [31mred y") and len(again["PARTIAL"]) == 500
    known = lock.begin_sync(ask_rsync=False)        # the run's doctor probe said where rsync is: not asked again
    assert set(known) == {"PARTIAL"} and (state_dir(host) / "sync.partial").read_text() == f"started {owner}\n"


def test_the_lock_runs_no_sync_step_while_it_is_shared_and_a_failed_one_carries_its_evidence(host):
    """Told to begin or end a sync under a shared lock, the lock holder runs nothing (no mark, no
    record) and says so; held alone over a state directory it cannot write, the step's exit status
    and output come back."""
    owner = Owner("laptop", 4, "2026-01-01T00:00:00Z", "validate")
    with open_transport(host) as transport:
        with state.acquire(transport, owner, state.SHARED) as lock:
            with pytest.raises(CommandError, match="^h: beginning the sync failed: the lock is not held alone"):
                client.begun(lock._tell(client.begin_sync_request(owner, None)), host)
            request = client.finish_sync_request(tree_hash=HASH, record={}, hash_line=f"echo {HASH}")
            with pytest.raises(CommandError, match="^h: ending the sync failed: the lock is not held alone"):
                client.finished(lock._tell(request), host)
            assert not (state_dir(host) / "sync.partial").exists() and not (state_dir(host) / "deploy.json").exists()
            lock.to_exclusive()
            (state_dir(host) / "sync.partial").mkdir()         # printf > sync.partial fails: a directory
            with pytest.raises(CommandError, match="^h: beginning the sync failed") as failed:
                lock.begin_sync()
            assert failed.value.exit_status == 3 and "sync.partial" in failed.value.tail
            lock.to_shared()
            with pytest.raises(ValueError, match="held alone"):
                lock.begin_sync()


def test_finish_sync_records_the_deploy_only_when_the_host_hashes_the_local_tree(held, host):
    """Another hash: the record is not written and the mark stays (exit status 0, the hash's
    output as the tail); a failing hash command: its exit status and its stderr; the local hash:
    the record stored as sent and the mark cleared."""
    _, lock = held
    (state_dir(host) / "sync.partial").write_text("started deploy\n")
    record = {"version": 1, "tree_hash": HASH, "by": {"client": "laptop \\x41 \\c\nété"}}
    assert lock.finish_sync(tree_hash=HASH, record=record, hash_line="echo other") == (0, "other\n")
    assert (state_dir(host) / "sync.partial").exists() and not (state_dir(host) / "deploy.json").exists()
    code, tail = lock.finish_sync(tree_hash=HASH, record=record, hash_line="echo oops >&2; exit 3")
    assert (code, tail) == (3, "\noops\n") and not (state_dir(host) / "deploy.json").exists()
    hash_line = f"echo 'a  b'\necho {HASH}"        # spaces, a newline: an argument as given
    assert lock.finish_sync(tree_hash=HASH, record=record, hash_line=hash_line) == (0, f"a  b\n{HASH}\n")
    assert (state_dir(host) / "deploy.json").read_text() == json.dumps(record) + "\n"
    assert not (state_dir(host) / "sync.partial").exists()


def test_finish_sync_sends_back_only_the_tail_of_a_flooding_hash_command(held):
    """A hash command that prints 100 kB: the client gets its last FINISH_TAIL bytes, printable."""
    _, lock = held
    code, tail = lock.finish_sync(tree_hash=HASH, record={}, hash_line="head -c 100000 /dev/zero | tr '\\0' 'z'; echo")
    assert code == 0 and len(tail) <= client.FINISH_TAIL + 1 and set(tail) <= {"z", "\n"}


def test_write_json_stores_a_state_document_that_read_json_reads_back(held, host):
    transport, _ = held
    client.write_json(transport, name="build.json", data={"key": {"tree": HASH}, "run_id": "r1"})
    assert state.read_json(transport, "build.json") == {"key": {"tree": HASH}, "run_id": "r1"}
    assert oct((state_dir(host) / "build.json").stat().st_mode & 0o777) == "0o600"


def test_output_is_bounded_and_its_failure_carries_the_evidence(held, host):
    """A script that prints more than asked for, or fails: CommandError naming the host, the
    command line, the exit status and the tail of what it printed."""
    transport, _ = held
    files = ["missing.kdtr", "there.kdtr", "b/a link.kdtr", "b/two words.kdtr"]
    probe = client.doctor_probe(host, import_numpy=False, bundle_files=files)
    (Path(host.remote_dir) / "there.kdtr").write_bytes(b"x" * 5000)
    (Path(host.remote_dir) / "b").mkdir()
    (Path(host.remote_dir) / "b" / "two words.kdtr").write_bytes(b"x" * 70000)
    (Path(host.remote_dir) / "b" / "a link.kdtr").symlink_to(Path(host.remote_dir) / "there.kdtr")
    facts = client.output(transport, probe, max_bytes=65536).splitlines()
    assert f"disk_path={host.remote_dir}" in facts and any(f.startswith("mem_available_kb=") for f in facts)
    have = [f.split("=", 1)[1].split(" ", 1) for f in facts if f.startswith("have_bytes=")]
    # the files there, each with its own allocated bytes; a link is not counted
    assert [name for _, name in have] == ["there.kdtr", "b/two words.kdtr"]
    assert 5000 <= int(have[0][0]) < 65536 <= int(have[1][0])
    with pytest.raises(CommandError, match="^h: the doctor probe printed more than 10 bytes") as big:
        client.output(transport, probe, max_bytes=10)
    assert big.value.command.startswith("umask 077") and big.value.tail.startswith("rsync=")
    (Path(host.remote_dir) / "bundles").symlink_to("/")
    with pytest.raises(CommandError, match="^h: listing the bundles failed") as failed:
        client.output(transport, client.bundle_list(host, folder="bundles"), max_bytes=4096)
    assert failed.value.exit_status == 4 and failed.value.host == "h" and "leads outside remote_dir" in failed.value.tail
    with pytest.raises(TypeError, match="gets no stdin"):
        client.output(transport, client.sync_delete(host, paths=[b"x"], timeout=10), max_bytes=10)


def test_the_lock_script_holds_no_sync_of_its_own():
    """No sync in the lock script: it neither begins nor ends one itself; it runs the sync's first
    and last steps (begin_sync.sh, finish_sync.sh after the ownership check: files of their own)
    that the client hands it as its last arguments."""
    lock = host_scripts.script_text("lock")
    assert "sync" not in lock and "hash" not in lock and '("${@:7}")' in lock
    line = client.lock(plain_host(), Owner("laptop", 4, "2026-01-01T00:00:00Z", "deploy"), mode=EXCLUSIVE).line
    begin, finish = (shlex.quote(text) for text in client._held_texts())
    assert line.endswith(f" {begin} {finish}") and "kd_owned \"$1\"\n" in client._held_texts()[1]


def test_only_the_host_client_builds_a_host_script_command_line():
    """script_text (a host script's text) is called by host/client.py alone, but for the wrappers
    every command line carries (remote.py: the step guard, the secrets reader; ownership.py:
    the ownership check, which guarded engine steps run too)."""
    allowed = {"orchestrator/host/client.py", "orchestrator/remote.py", "orchestrator/ownership.py"}
    callers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "script_text":
                callers.add(str(path.relative_to(PACKAGE.parent)))
    assert callers <= allowed, sorted(callers - allowed)
    assert not hasattr(client.remote, "script") and not hasattr(client.remote, "script_command")
