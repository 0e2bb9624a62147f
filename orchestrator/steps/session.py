"""The host session: a run's connection to one host and what it holds there, the tree lock and
the GPU claim, for the steps of the run (StepContext.session).

The run (run.Run) holds them: the session takes them through it, over its transport, so that
the run releases them on an interrupt and at its end; the session keeps what it took.
"""
from __future__ import annotations

import contextlib
import dataclasses
import typing
from concurrent.futures import Future
from typing import Callable

from .. import remote, state
from ..errors import StepError
from ..resources.gpus import Request
from ..inventory import Host
from ..connectors.base import Transport
from . import STEPS

if typing.TYPE_CHECKING:      # gpu_claims imports what imports this module at run time
    from ..resources.gpu_claims import GpuClaim
    from ..resources.gpus import Gpu
    from ..runner.run import Run
    from ..slurm.run import Allocation


@dataclasses.dataclass
class HostSession:
    """One host's connection in a run, the tree lock and GPU claim the run holds over it, and the
    GPUs claimed."""

    host: Host
    transport: Transport
    holder: Run | None = None           # the run that holds the lock and the claim (None: a session outside a run)
    owner: state.Owner | None = None    # the holder, as the host shows it to other runs
    claims_gpus: bool = False           # the run claims GPUs (validate, nightly, check-bundle); else it only looks
    gpu_request: Request = dataclasses.field(default_factory=Request)   # the inventory's GPU policy, --gpus over it
    probe: Future[dict[str, list[str]]] | None = None   # the doctor probe started as the host connected (Run.prepare)
    lock: state.HostLock | None = None  # the run's tree lock on the host (None: not taken yet)
    claim: GpuClaim | None = None       # the run's GPU claim on the host (None: none taken)
    gpus: tuple[Gpu, ...] = ()          # the GPUs claimed for the run, ascending index
    job: Allocation | None = None       # a `scheduler: slurm` entry's allocation, held: engine commands are its job steps

    @property
    def measures_anew(self) -> bool:
        """Whether what golden, test, bench and stress give must come from this run, never an
        earlier one's: on claimed GPUs (a faulty or busy GPU must show) and on a `scheduler: slurm`
        entry, whose node and GPUs Slurm may pick differently from run to run."""
        return bool(self.gpus) or self.host.slurm is not None

    def on_node(self, command: remote.Command) -> remote.Command:
        """`command` as it runs where the engine runs: a job step of the held allocation on a
        `scheduler: slurm` entry (slurm.run.Allocation.step), else as it is."""
        return self.job.step(command) if self.job is not None else command

    def take_lock(self, mode: str, wait: float = 0) -> state.HostLock:
        """The tree lock in `mode`, taken for the run (waiting up to `wait` seconds), not yet kept
        as the session's (hold_tree does)."""
        if self.holder is None or self.owner is None:
            raise ValueError(f"this host session takes no tree lock (asked for it in {mode} mode)")
        return self.holder.lock(self.transport, self.owner, mode, wait)

    def hold_tree(self, mode: str, wait: float = 0, taken: Future[state.HostLock] | None = None,
                  log: Callable[[str], None] = print) -> state.HostLock:
        """Take the tree lock in `mode` for the rest of the run (waiting up to `wait` seconds), or
        hold the one `taken` already (started as take_lock(mode, wait)). The lock held; a stale
        lock it recovered is said to `log`."""
        lock = self.lock = taken.result() if taken is not None else self.take_lock(mode, wait)
        if lock.stale:
            log(f"recovered the lock left by a run that died: {lock.stale}")
        return lock

    def hold_gpus(self) -> GpuClaim:
        """Claim the GPUs of the session's request for the rest of the run; the claim held."""
        if not self.claims_gpus or self.holder is None or self.owner is None:
            raise ValueError("this host session claims no GPUs (only doctor looks at them)")
        claim = self.claim = self.holder.claim_gpus(self.transport, self.gpu_request, self.owner)
        self.gpus = claim.gpus
        return claim

    def held_lock(self, step: str) -> state.HostLock:
        """The tree lock the run holds; StepError naming `step` when it holds none (a session
        outside such a run)."""
        if self.lock is None:
            raise StepError(f"the {step} step needs the tree lock, and this run holds none", host=self.host.name)
        return self.lock

    def changing(self, step: str):
        """The with-block in which `step`, one that changes the deployed tree (sync, build,
        bundles: Step.changes_tree), changes it: the run holds the tree lock alone for it
        (LockError naming the runs using it)."""
        if not STEPS[step].changes_tree:       # a step that does is declared so: the lock modes rest on it
            raise ValueError(f"the {step} step is not declared to change the deployed tree")
        return self.lock.exclusive() if self.lock is not None else contextlib.nullcontext()

    def held(self) -> tuple:
        """What the run holds on the host (the GPU claim, then the lock), for it to release."""
        return tuple(thing for thing in (self.claim, self.lock) if thing is not None)
