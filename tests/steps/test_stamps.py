"""steps/stamps.py: the step context's cache of the host's state files, over a local host's real
.kdtree/ (state.read_jsons and state.write_json as the context uses them)."""
from __future__ import annotations

import functools
import json

import pytest

from orchestrator import state
from orchestrator.connectors import factory
from orchestrator.steps.stamps import Stamps


@pytest.fixture
def host_state(make_inventory, tmp_path):
    """(Stamps over a local host, its .kdtree/ folder, the number of reads it made so far)."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    transport = factory.open_transport(inv.hosts["local"])
    kd = tmp_path / "host" / ".kdtree"
    kd.mkdir(parents=True)
    reads: list[int] = []

    def read() -> dict:
        reads.append(1)
        return state.read_jsons(transport, state.STAMPS)
    return Stamps(read, functools.partial(state.write_json, transport)), kd, reads


def test_the_state_files_are_read_once_until_a_sync_changes_them(host_state):
    """All of them in one read at the first ask; a change on the host is not seen (the run holds the
    tree lock: nobody else writes them) until forget(), as after a sync."""
    stamps, kd, reads = host_state
    (kd / "build.json").write_text('{"key": 1}')
    (kd / "bundles.json").write_text("[1]")
    assert stamps.get("build.json") == {"key": 1} and stamps.get("bundles.json") is None
    assert stamps.get("deploy.json") is None and len(reads) == 1
    (kd / "build.json").write_text('{"key": 2}')
    assert stamps.get("build.json") == {"key": 1} and len(reads) == 1
    stamps.forget()
    assert stamps.get("build.json") == {"key": 2} and len(reads) == 2


def test_the_runs_own_writes_reach_the_host_and_are_kept_as_a_read_would_give_them(host_state):
    stamps, kd, reads = host_state
    stamps.write("test.json", {"run_id": "r0"})          # before any read: the first read finds it
    assert json.loads((kd / "test.json").read_text()) == {"run_id": "r0"} and not reads
    assert stamps.get("test.json") == {"run_id": "r0"} and len(reads) == 1
    stamps.write("bench.json", {"run_id": ("r", 1)})
    assert stamps.get("bench.json") == {"run_id": ["r", 1]} == json.loads((kd / "bench.json").read_text())
    assert len(reads) == 1
