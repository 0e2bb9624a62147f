"""GPU claims on a host, so that two runs of one deployed tree (a person's and the nightly) take
different GPUs instead of refusing each other.

    with acquire(transport, request, owner) as claim:   # query, choose, claim; waits up to request.wait
        claim.gpus            # the GPUs this run holds, ascending index (empty: the host has none)
        claim.inventory       # every GPU as nvidia-smi reported it when they were claimed
        claim.stale           # (uuid, Owner) of claims left by runs that died, now recovered
        claim.visible_devices()    # CUDA_VISIBLE_DEVICES: the claimed GPUs by uuid

A claim is a flock per GPU in `<remote_dir>/.kdtree/` (`gpu-<uuid>.flock`, its holder in
`gpu-<uuid>.owner`), beside the tree lock, private as it is (no other user can open one) and held
as it is (state.py): by one process on the host for as long as the run lasts and its heartbeat
keeps coming; the kernel releases the flocks of a
run that died and the next run recovers them and says whose they were. Claims are seen only by
runs of the same remote_dir: other users, and other trees, are kept off a GPU only by nvidia-smi's
process list once their work runs. The caller holds the tree lock first (it creates `.kdtree/`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from . import gpus as gpus_mod
from .. import state
from ..errors import DestinationError
from ..host import client
from .gpus import Choice, Gpu, GpuInventory, GpuSelectionError, Request
from ..connectors.base import Transport

POLL_SECONDS = 2.0            # between two looks at the GPUs while waiting for enough (gpu_wait)


@dataclasses.dataclass
class GpuClaim:
    """GPUs held for a run on one host; release() (or leaving the with-block) lets them go."""

    inventory: GpuInventory
    gpus: tuple[Gpu, ...]
    stale: tuple[tuple[str, state.Owner], ...] = ()
    lock: state.HostLock | None = None

    def visible_devices(self) -> str:
        """CUDA_VISIBLE_DEVICES for the claimed GPUs: their uuids, comma-separated."""
        return ",".join(g.uuid for g in self.gpus)

    def release(self, timeout: float = 30) -> None:
        """Let the GPUs go (waiting up to `timeout` seconds for the holder on the host to end)."""
        if self.lock is not None:
            self.lock.release(timeout)

    def __enter__(self) -> "GpuClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """What one claim command answered: the holder process when it claimed enough, else None;
    who holds the GPUs it could not take (uuid -> owner), the stale claims it recovered."""

    process: object | None
    claimed: tuple[str, ...]
    held: dict
    stale: tuple[tuple[str, state.Owner], ...]


def acquire(transport: Transport, request: Request, owner: state.Owner, *,
            driver_paths: Sequence[str] = gpus_mod.DRIVER_PATHS, poll: float = POLL_SECONDS,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> GpuClaim:
    """Claim the GPUs `request` asks for on the host of `transport`, waiting up to request.wait
    seconds for enough; GpuSelectionError names each GPU that could not be taken and why."""
    host = transport.host
    start = clock()
    held: dict[str, str] = {}
    while True:
        found = gpus_mod.query(transport, driver_paths)
        choice = gpus_mod.choose(found.gpus, request, held, host=host.name)
        if choice.needed == 0:
            return GpuClaim(found, ())
        attempt = _claim(transport, owner, choice) if choice.usable else None
        if attempt is not None and attempt.process is not None:
            taken = tuple(sorted((g for g in found.gpus if g.uuid in attempt.claimed), key=lambda g: g.index))
            lock = state.HostLock(transport, attempt.process, None, host.timeout("keepalive"))
            return GpuClaim(found, taken, attempt.stale, lock)
        if attempt is not None and not attempt.held.keys() <= held.keys():
            held.update(attempt.held)           # learned which GPUs other runs hold: choose again now
            continue
        choice = gpus_mod.choose(found.gpus, request, held, host=host.name)
        waited = clock() - start
        if waited >= request.wait:
            raise GpuSelectionError(choice.shortage(waited if request.wait else 0.0), host=host.name)
        sleep(min(poll, request.wait - waited))
        held = {}


def held_claims(transport: Transport, uuids: Sequence[str]) -> dict[str, str]:
    """Which of these GPUs other runs of this remote_dir hold now (uuid -> owner), taking none."""
    host = transport.host
    process = transport.start(client.gpu_claim(host, state.Owner.now("probe"), uuids=uuids, count=0).line)
    return _answer(process, host, uuids).held


def preview(transport: Transport, request: Request, *,
            driver_paths: Sequence[str] = gpus_mod.DRIVER_PATHS) -> tuple[GpuInventory, Choice]:
    """What a run would take now (doctor): the GPUs found and the choice, claims of other runs
    counted, nothing claimed."""
    found = gpus_mod.query(transport, driver_paths)
    held = held_claims(transport, [g.uuid for g in found.gpus]) if found.gpus else {}
    return found, gpus_mod.choose(found.gpus, request, held, host=transport.host.name)


def _claim(transport: Transport, owner: state.Owner, choice: Choice) -> _Attempt:
    host = transport.host
    uuids = [g.uuid for g in choice.usable]
    command = client.gpu_claim(host, owner, uuids=uuids, count=choice.needed, silence=state.lock_silence(host))
    return _answer(transport.start(command.line), host, uuids)


def _answer(process, host, asked: Sequence[str]) -> _Attempt:
    """Read the claim command's answer: CLAIMED (it holds them now), SHORT or PROBED (it ended).
    Only the GPUs `asked` about are taken from HELD and STALE lines (a host that names others, or
    the same again, grows nothing: the answer's size is bounded by client.answers)."""
    held: dict[str, str] = {}
    stale: dict[str, state.Owner] = {}
    for word, rest in client.answers(process, host, "GPU claim command", host.timeout("lock")):
        uuid, _, text = rest.partition(" ")
        if word in ("HELD", "STALE") and uuid not in asked:
            continue
        if word == "CLAIMED":
            return _Attempt(process, tuple(rest.split()), held, tuple(stale.items()))
        if word == "HELD":
            held[uuid] = gpus_mod.visible(str(state.Owner.parse(text) or "owner unknown"), 300)
        elif word == "STALE":
            stale[uuid] = state.Owner.parse(text) or state.Owner("unknown", 0, "unknown", gpus_mod.visible(text, 200))
        elif word in ("SHORT", "PROBED"):
            process.close()
            return _Attempt(None, (), held, ())
        elif word == "UNSAFE":
            process.close()
            raise DestinationError(f"cannot claim GPUs: {gpus_mod.visible(rest, 300)}", host=host.name)
    raise AssertionError("answers() ends only by raising")

