"""steps/session.py: the host session, over a local host's real tree lock held by a real Run."""
from __future__ import annotations

import os

import pytest

from fake_gpus import FakeGpus

from orchestrator import state
from orchestrator.errors import StepError
from orchestrator.resources.gpus import Request
from orchestrator.runner.run import Run
from orchestrator.steps import STEPS
from orchestrator.steps.session import HostSession


class Recorded(Run):
    """A run that notes how each lock was asked of it (and takes it as Run does)."""

    def __init__(self):
        super().__init__("validate")
        self.asked: list[tuple[str, float]] = []

    def lock(self, transport, owner, mode=state.EXCLUSIVE, wait=0):
        self.asked.append((mode, wait))
        return super().lock(transport, owner, mode, wait)


@pytest.fixture
def local(make_inventory, tmp_path):
    """(a local host, its transport, a run that holds what its sessions take)."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    host = inv.hosts["local"]
    with Recorded() as run:
        yield host, run.transport(host), run


def _session(local, **how) -> HostSession:
    host, transport, run = local
    return HostSession(host, transport, run, state.Owner.now("validate"), **how)


def test_only_a_step_declared_to_change_the_tree_may_hold_it_alone(local):
    """changing(step): the with-block of a step that changes the deployed tree (Step.changes_tree),
    under the lock held alone; any other step asking for it is a programming error, never a lock
    held alone."""
    host, transport, _ = local
    for name, step in STEPS.items():
        session = HostSession(host, transport)      # no lock held: changing() holds nothing more
        if step.changes_tree:
            with session.changing(name):
                pass
        else:
            with pytest.raises(ValueError, match=f"the {name} step is not declared to change the deployed tree"):
                session.changing(name)
    assert [n for n, s in STEPS.items() if s.changes_tree] == ["sync", "build", "bundles"]
    session = _session(local)
    lock = session.hold_tree(state.SHARED)
    with session.changing("build"):
        assert lock.mode == state.EXCLUSIVE
    assert lock.mode == state.SHARED
    lock.release()


def test_the_lock_is_held_for_the_run_in_the_mode_asked(local):
    """hold_tree takes the lock through the run in the mode and wait asked and keeps it for held_lock
    and held(); a step that needs the lock in a session that holds none fails naming the step and
    the host. (The sync begins with a command of its own: tests/host/test_host_client.py.)"""
    host, transport, run = local
    bare = _session(local)
    with pytest.raises(StepError, match="the sync step needs the tree lock, and this run holds none") as failed:
        bare.held_lock("sync")
    assert failed.value.host == "local" and bare.held() == ()
    with pytest.raises(ValueError, match="this host session takes no tree lock"):
        HostSession(host, transport).hold_tree(state.SHARED)
    for mode in (state.EXCLUSIVE, state.SHARED):
        session = _session(local)
        lock = session.hold_tree(mode, 3)
        assert run.asked[-1] == (mode, 3) and lock.mode == mode
        assert session.held_lock("sync") is lock and session.held() == (lock,)
        lock.release()


def test_gpus_are_claimed_only_by_a_session_that_claims_them(local, tmp_path, monkeypatch):
    """hold_gpus claims the session's request through the run and keeps the claim and its GPUs
    (released with the run); a session made to look only (doctor) has no claim to make."""
    fake = FakeGpus(tmp_path / "bin")        # first on the PATH of the local host's commands
    fake.set(2)
    monkeypatch.setenv("PATH", f"{fake.bin}:{os.environ['PATH']}")
    with pytest.raises(ValueError, match="this host session claims no GPUs"):
        _session(local).hold_gpus()
    session = _session(local, claims_gpus=True, gpu_request=Request("any", count=1))
    lock = session.hold_tree(state.SHARED)       # the tree's state directory is the claims' (as preflight)
    claim = session.hold_gpus()
    assert (session.claim, session.held()) == (claim, (claim, lock))
    assert [g.uuid for g in session.gpus] == [fake.uuid(0)] and session.gpus == claim.gpus
