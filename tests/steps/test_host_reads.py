"""steps/host_reads.py: the host reads, kept until the next engine command, on a local host."""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import pytest

from orchestrator.runner import pipeline
from orchestrator.connectors import factory
from orchestrator.steps.host_reads import NOT_READ, HostReads
from orchestrator.steps.session import HostSession
from orchestrator.steps.shell import EngineShell


@pytest.fixture
def reads(make_inventory, tmp_path):
    """Host reads over an engine shell on a local host whose `count` command counts its runs."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    (tmp_path / "host").mkdir()
    host = inv.hosts["local"]
    project = dataclasses.replace(inv.project, commands={**inv.project.commands, "count": "echo >> runs; wc -l < runs",
                                                         "touch": "true"})
    transport = factory.open_transport(host)
    yield HostReads(EngineShell(HostSession(host, transport), project, out=lambda line: None, step="build"),
                    pipeline.Plan.of("validate"))
    transport.close()


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_a_read_is_taken_from_ahead_until_an_engine_command_runs(reads):
    """get() gives what was read ahead under its key (NOT_READ: the read was not made, so it reads
    now); once an engine command ran, everything read ahead or measured is read again."""
    reads.ahead = {("engine", "count"): _done("41\n"), "skipped": _done(NOT_READ)}
    assert reads.output("count") == "41\n" and reads.get("skipped", lambda: "now") == "now"
    reads.measured = "kept"
    assert reads.inputs(lambda: "no tree") == "kept"
    reads.shell.run("touch")
    assert reads.output("count").strip() == "1" and reads.output("count").strip() == "2"
    assert reads.ahead == {} and reads.measured is None
