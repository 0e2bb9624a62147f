"""The steps as the runner treats them (steps.STEPS, pipeline.run_host), on a local host through
the validate task's own path (cli.validate)."""
from __future__ import annotations

import io
import json

import pytest

from orchestrator import cli
from orchestrator.runner.console import Console
from orchestrator.errors import StepError
from orchestrator.steps import sync as sync_step
from orchestrator.steps.context import StepContext
from orchestrator.steps.session import HostSession

FAILED_CASE = json.dumps({"tests": [{"name": "the socket read timed out", "status": "failed", "seconds": 1}]})


@pytest.mark.parametrize("test_command, status", [
    # a case of the suite failed, and its name says `timed out`: the step failed, it did not time out
    (f"mkdir -p build && printf '%s' '{FAILED_CASE}' > build/test_results.json", "failed"),
    ("sleep 30", "timeout"),        # past timeouts.test (1 s): the host-side timeout ends it
])
def test_a_step_times_out_only_when_it_ran_past_its_timeout_whatever_its_message_says(make_inventory, tmp_path,
                                                                                    test_command, status):
    inv = make_inventory({"local": {"transport": "local", "remote_dir": "d/local", "timeouts": {"test": 1}}},
                         commands={**_commands(make_inventory), "build_key": "echo '{}'", "test": test_command})
    out = io.StringIO()
    code = cli.validate(inv, [inv.hosts["local"]], Console(out), steps="sync,test", report_dir=str(tmp_path / "run"))
    steps = json.loads((tmp_path / "run" / "run.json").read_text())["hosts"]["local"]["steps"]
    assert code == 1 and steps["sync"]["status"] == "passed", out.getvalue()
    assert steps["test"]["status"] == status, steps["test"]
    if status == "failed":
        assert steps["test"]["message"] == "1 of 1 engine tests failed: the socket read timed out"


def _commands(make_inventory) -> dict:
    """The shipped project's commands."""
    return dict(make_inventory({}).project.commands)


def test_a_step_that_needs_the_tree_lock_fails_with_its_evidence_in_a_run_that_holds_none(make_inventory):
    """The sync runs under the lock held alone (sync.sync_tree takes it): outside a run that holds
    it, the step fails saying so (HostSession.held_lock), not with an attribute error of a missing lock."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": "d/local"}})
    host = inv.hosts["local"]
    ctx = StepContext(host, HostSession(host, None), *[None] * 7, step="sync")
    with pytest.raises(StepError, match="the sync step needs the tree lock, and this run holds none") as failed:
        sync_step.run(ctx)
    assert failed.value.host == "local"
