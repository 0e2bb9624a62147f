"""A run: one command (doctor, deploy, validate, nightly) over its hosts, and everything it holds.

    with Run("validate") as run:
        run.prepare(hosts[:8], doctor.probe)     # start connecting (and probing) while this machine works
        transport = run.transport(host)          # closed when the run ends
        lock = run.lock(transport, owner)        # released when the run ends (or run.release(lock))
        claim = run.claim_gpus(transport, request, owner)   # GPUs, released when the run ends
        ...
        run.stop()                               # on an interrupt: locks released, connections closed

The Run owns its hosts' connections, the host locks and GPU claims it holds and its stop flag, so
two runs in one process never touch each other's (no process-wide state). Once stopped, its transports neither
connect nor start a command again: a retry would resume the interrupted work.
"""
from __future__ import annotations

import threading
import typing
from concurrent.futures import Future
from typing import Callable

from .. import state
from ..errors import HostError
from ..inventory import Host
from ..connectors.base import Transport
from ..connectors.factory import open_transport

if typing.TYPE_CHECKING:      # imported by claim_gpus, which only the runs that claim GPUs call (start-up time)
    from ..resources.gpu_claims import GpuClaim
    from ..resources.gpus import Request

STOP_LOCK_WAIT = 2      # seconds each lock gets to be released on an interrupt, before connections close


class Run:
    """The connections, locks and stop flag of one command's run; a context manager."""

    def __init__(self, command: str):
        self.command = command
        self.stopped = threading.Event()
        self._guard = threading.Lock()
        self._transports: list[Transport] = []
        self._prepared: dict[str, Future[Transport]] = {}
        self._first: dict[str, Future] = {}
        self._locks: list[state.HostLock] = []
        self._claims: list[GpuClaim] = []

    def transport(self, host: Host) -> Transport:
        """A transport to `host` owned by this run (nothing opened until it is used, unless
        prepare() started it: then it waits for that and raises what it raised)."""
        with self._guard:
            pending = self._prepared.pop(host.name, None)
        if pending is not None:
            return pending.result()
        return self._open(host)

    def prepare(self, hosts: list[Host], first: Callable[[Transport], object] | None = None) -> None:
        """Start opening `hosts`' transports (reading their ssh config: openssh.uses_warm) and
        connecting them (Transport.connect_soon), in the background, for transport() to hand out
        (the hosts that run first, while this machine hashes the source); a failure is raised by
        transport() or the first command. Given `first` (a read-only command: the doctor probe),
        also run it on each as soon as its connection is up, for first_result()."""
        for host in hosts:
            if host.is_local and first is None:
                continue
            pending: Future[Transport] = Future()
            started: Future[object] | None = Future() if first is not None else None
            threading.Thread(target=self._open_early, args=(host, pending, first, started), daemon=True).start()
            with self._guard:
                self._prepared[host.name] = pending
                if started is not None:
                    self._first[host.name] = started

    def first_result(self, host: Host) -> Future | None:
        """The outcome of prepare()'s `first` command on `host` (None when it was not started)."""
        with self._guard:
            return self._first.pop(host.name, None)

    def _open_early(self, host: Host, pending: "Future[Transport]", first, started: Future | None) -> None:
        try:
            transport = self._open(host)
            if not host.is_local:
                transport.connect_soon()
        except BaseException as e:      # noqa: BLE001 - raised by transport(host)
            pending.set_exception(e)
            if started is not None:
                started.set_exception(e)
            return
        pending.set_result(transport)
        if started is not None:
            try:
                started.set_result(first(transport))
            except BaseException as e:      # noqa: BLE001 - raised to whoever takes the result
                started.set_exception(e)

    def _open(self, host: Host) -> Transport:
        transport = open_transport(host, self.stopped)
        with self._guard:
            self._transports.append(transport)
        return transport

    def lock(self, transport: Transport, owner: state.Owner, mode: str = state.EXCLUSIVE,
             wait: float = 0) -> state.HostLock:
        """Take the host lock over `transport` (state.acquire) in `mode`, waiting up to `wait`
        seconds for it, and hold it for this run."""
        return self._hold(self._locks, state.acquire(transport, owner, mode, wait), transport)

    def claim_gpus(self, transport: Transport, request: Request, owner: state.Owner) -> GpuClaim:
        """Claim the GPUs `request` asks for on the host (gpu_claims.acquire) for this run."""
        from ..resources import gpu_claims
        return self._hold(self._claims, gpu_claims.acquire(transport, request, owner), transport)

    def _hold(self, held: list, thing, transport: Transport):
        with self._guard:
            if not self.stopped.is_set():
                held.append(thing)
                return thing
        thing.release(STOP_LOCK_WAIT)       # taken just as the run stopped: let it go at once
        raise HostError("the run was interrupted", host=transport.host.name)

    def release(self, held) -> None:
        """Release a lock or GPU claim this run holds (before its host's transport closes: the
        holder on the host then says goodbye instead of seeing a dead run)."""
        with self._guard:
            for things in (self._locks, self._claims):
                if held in things:
                    things.remove(held)
        held.release()

    def stop(self) -> None:
        """Stop for good (an interrupt): release the GPU claims and the locks (the next run finds
        them free, not a dead run's), then close every connection, which stops the commands on
        the hosts."""
        self.stopped.set()
        self._release(STOP_LOCK_WAIT)

    def close(self) -> None:
        """Release what is still held and close every connection (the end of the run)."""
        self._release(30)

    def _release(self, wait: float) -> None:
        with self._guard:
            held, self._claims, self._locks = self._claims + self._locks, [], []
            transports, self._transports = self._transports, []
        for thing in held:
            thing.release(wait)
        # all at once: each gives its running commands STOP_GRACE to end, so a fleet's stop takes
        # that long, not that long a host
        closing = [threading.Thread(target=transport.close) for transport in transports]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
