"""steps/session.py: the host session, over a local host's real tree lock (state.acquire as
Run.lock takes it)."""
from __future__ import annotations

import dataclasses

import pytest

from orchestrator import state
from orchestrator.connectors import factory
from orchestrator.errors import StepError
from orchestrator.steps import STEPS
from orchestrator.steps.session import HostSession


@pytest.fixture
def local(make_inventory, tmp_path):
    """(a local host, its transport, a take_lock over the real lock that records how it was asked)."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    host = inv.hosts["local"]
    transport = factory.open_transport(host)
    asked: list[tuple[str, float, bool]] = []

    def take_lock(mode: str, wait: float, begin_sync: bool) -> state.HostLock:
        asked.append((mode, wait, begin_sync))
        return state.acquire(transport, state.Owner.now("validate"), mode, wait)
    yield host, transport, take_lock, asked
    transport.close()


def test_only_a_step_declared_to_change_the_tree_may_hold_it_alone(local):
    """changing(step): the with-block of a step that changes the deployed tree (Step.changes_tree),
    under the lock held alone; any other step asking for it is a programming error, never a lock
    held alone."""
    host, transport, take_lock, _ = local
    for name, step in STEPS.items():
        session = HostSession(host, transport)      # no lock held: changing() holds nothing more
        if step.changes_tree:
            with session.changing(name):
                pass
        else:
            with pytest.raises(ValueError, match=f"the {name} step is not declared to change the deployed tree"):
                session.changing(name)
    assert [n for n, s in STEPS.items() if s.changes_tree] == ["sync", "build", "bundles"]
    session = HostSession(host, transport, take_lock)
    lock = session.hold_tree(state.SHARED)
    with session.changing("build"):
        assert lock.mode == state.EXCLUSIVE
    assert lock.mode == state.SHARED
    lock.release()


def test_the_lock_is_held_for_the_run_and_begins_a_planned_sync_only_when_held_alone(local):
    """hold_tree keeps the lock it took for held_lock and held(); the lock command begins the sync
    only in a run that syncs and only for the lock held alone; a step that needs the lock in a
    session that holds none fails naming the step and the host."""
    host, transport, take_lock, asked = local
    bare = HostSession(host, transport, take_lock)
    with pytest.raises(StepError, match="the sync step needs the tree lock, and this run holds none") as failed:
        bare.held_lock("sync")
    assert failed.value.host == "local" and bare.held() == ()
    for begins_sync, mode, begun in [(True, state.EXCLUSIVE, True), (True, state.SHARED, False),
                                     (False, state.EXCLUSIVE, False)]:
        session = HostSession(host, transport, take_lock, begins_sync=begins_sync)
        lock = session.hold_tree(mode, 3)
        assert asked[-1] == (mode, 3, begun)
        assert session.held_lock("sync") is lock and session.held() == (lock,)
        lock.release()


def test_gpus_are_claimed_only_by_a_session_that_claims_them(local):
    """hold_gpus claims the session's request once and keeps the claim and its GPUs; a session
    made to look only (doctor) has no claim to make."""
    host, transport, _, _ = local
    with pytest.raises(ValueError, match="this host session claims no GPUs"):
        HostSession(host, transport).hold_gpus()

    @dataclasses.dataclass
    class Claim:        # what gpu_claims.acquire gives, as far as the session keeps it
        gpus: tuple
        released: bool = False

        def release(self, wait: float = 0) -> None:
            self.released = True
    requests = []
    session = HostSession(host, transport, claim_gpus=lambda request: requests.append(request) or Claim(("g0",)))
    claim = session.hold_gpus()
    assert (session.claim, session.gpus, requests) == (claim, ("g0",), [session.gpu_request])
    assert session.held() == (claim,)
