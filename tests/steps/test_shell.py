"""steps/shell.py: the engine shell, running real commands on a local host."""
from __future__ import annotations

import dataclasses

import pytest

from orchestrator.connectors import factory
from orchestrator.errors import CommandError
from orchestrator.resources.gpus import Gpu
from orchestrator.steps.session import HostSession
from orchestrator.steps.shell import EngineShell


@pytest.fixture
def shell(make_inventory, tmp_path):
    """An engine shell on a local host whose project has a few commands of its own; its output lines."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host"),
                                    "timeouts": {"test": 7, "build": 11}}})
    (tmp_path / "host").mkdir()
    host = inv.hosts["local"]
    project = dataclasses.replace(inv.project, commands={
        **inv.project.commands, "say": 'echo "pinned=$CUDA_VISIBLE_DEVICES"',
        "fail": "echo 'disk: No space left on device'; exit 4",
        "key": "echo key", "broken": "echo half; exit 2"})
    lines: list[str] = []
    transport = factory.open_transport(host)
    yield EngineShell(HostSession(host, transport), project, out=lines.append, step="test"), lines
    transport.close()


def _gpu(index: int) -> Gpu:
    return Gpu(index, f"GPU-{index}", "H100", 0, 80000, 0, "9.0", None)


def test_a_command_runs_under_its_steps_deadline_pinned_to_the_claimed_gpus(shell):
    """Every command is built for the current step's timeout (or the step named); the claimed
    GPUs pin it by uuid and are noted for the step's record, once each; a new step starts its own
    record."""
    engine, lines = shell
    assert engine.build("true").timeout == 7 and engine.build("true", step="build").timeout == 11
    engine.session.gpus = (_gpu(0), _gpu(1))
    engine.run("say")
    assert lines[-1] == "pinned=GPU-0,GPU-1" and lines[0].startswith("$ CUDA_VISIBLE_DEVICES=GPU-0,GPU-1 ")
    engine.run("say", engine.gpu_env(_gpu(1)))
    assert lines[-1] == "pinned=GPU-1" and engine.devices_used == ["GPU-0", "GPU-1"]
    assert engine.gpu_env(_gpu(1))["KD_RESULTS_DIR"] == "build/gpu-1"
    engine.begin("build")
    assert engine.devices_used == [] and engine.command("key").timeout == 11


def test_a_failed_command_carries_its_evidence_and_counts_as_a_change(shell):
    """A command that exits non-zero is a CommandError with the host, the command, the exit status,
    the named cause and the tail; every command run (failed or not) may have changed the host."""
    engine, _ = shell
    before = engine.generation
    with pytest.raises(CommandError) as failed:
        engine.run("fail")
    e = failed.value
    assert (e.host, e.exit_status, e.message) == ("local", 4, "fail exited with 4: No space left on device")
    assert "No space left" in e.tail and engine.generation == before + 1
    assert engine.output("key", {}) == "key\n" and engine.generation == before + 1     # a read changes nothing


def test_short_commands_fused_in_one_give_what_each_gives_alone(shell):
    """outputs(): each command's output, or the error it alone would raise, from one host command."""
    engine, _ = shell
    found = engine.outputs({"key": "build", "broken": "test"}, {})
    assert found["key"] == engine.output("key", {}) == "key\n"
    assert isinstance(found["broken"], CommandError)
    with pytest.raises(CommandError) as alone:
        engine.output("broken", {})
    assert (found["broken"].message, found["broken"].exit_status) == (alone.value.message, alone.value.exit_status)
