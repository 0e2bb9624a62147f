"""Run one function per host in parallel (bounded); collect per-host outcomes as data.

One host failing never stops the others: its exception is kept in its HostOutcome. As in Fabric's
ThreadingGroup, the caller gets every host's result and decides (pipeline: into the run record).
On an interrupt (Ctrl-C, or SIGTERM: cli.exit_codes) the hosts not started are cancelled,
`on_interrupt` runs (the run's stop: locks released, connections closed, so the commands on the
hosts stop), the running hosts are waited for (they end at once, their work cut off), and the
interrupt goes on as Interrupted, with the outcomes of the hosts that had started.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import resource
import time
from typing import Callable, Generic, Iterable, TypeVar

from ..errors import KdError, UsageError
from ..inventory import Host

MAX_PARALLEL_FLAG = 4096
# File descriptors: what the process holds before any host, and at most per host in flight (a
# warm host: the lock holder's and a command's ssh pipes, rsync's pipes and its ssh; a Paramiko
# host: its socket and a pipe per open channel). Measured with benchmarks/bench_orchestrator.py
# --sections scale; the estimate is kept above the measured figures (docs/benchmarks/).
FD_BASE = 64
FD_PER_HOST = 16
T = TypeVar("T")     # what the function run on each host returns


def default_parallel() -> int:
    """Hosts in flight without --parallel: 4 per core (the hosts' work is mostly waiting on the
    network and on system ssh/rsync processes), at most 32."""
    return min(32, 4 * (os.cpu_count() or 1))


def parse_parallel(value) -> int | None:
    """--parallel N: a whole number of hosts in flight from 1 (None: the default)."""
    if value is None:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if not 1 <= n <= MAX_PARALLEL_FLAG or str(value).strip() != str(n):
        raise UsageError(f"--parallel: {value!r} is not a number of hosts from 1 to {MAX_PARALLEL_FLAG}")
    return n


def fit_fd_limit(in_flight: int) -> None:
    """Make sure `in_flight` hosts at once fit in the process's file descriptor limit, raising the
    soft limit toward the hard one when needed; UsageError saying how many hosts fit otherwise
    (rather than a run that fails half-way with "Too many open files")."""
    need = FD_BASE + FD_PER_HOST * in_flight
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        return
    fit = max(0, (max(soft, hard) - FD_BASE) // FD_PER_HOST)
    raise UsageError(f"{in_flight} hosts in flight need about {need} file descriptors, but this process may open at "
                     f"most {hard} (ulimit -n; soft {soft}): {fit} hosts fit. Raise the limit (ulimit -n {need}) "
                     f"or use --parallel {fit}" if fit else
                     f"this process may open only {hard} file descriptors (ulimit -n): not even one host fits; "
                     f"raise the limit (ulimit -n {need})")


@dataclasses.dataclass(frozen=True)
class HostOutcome(Generic[T]):
    """One host's outcome of a parallel run: what the function returned on it, or the error it raised."""

    host: Host
    value: T | None = None
    error: BaseException | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def summary(self) -> str:
        """One line for a summary table: the error's first line, or ''."""
        if self.error is None:
            return ""
        text = str(self.error) if isinstance(self.error, KdError) else f"{type(self.error).__name__}: {self.error}"
        first = text.splitlines()[0] if text else type(self.error).__name__
        return first.removeprefix(f"{self.host.name}: ")


class HostOutcomes(dict[str, HostOutcome[T]]):
    """host name -> HostOutcome, in the order the hosts were given."""


def run_parallel(hosts: Iterable[Host], fn: Callable[[Host], T], max_parallel: int | None = None,
                 on_interrupt: Callable[[], None] | None = None) -> HostOutcomes[T]:
    """Call fn(host) for every host, at most max_parallel at a time; never raises for a host."""
    hosts = list(hosts)

    finished: dict[str, HostOutcome[T]] = {}        # each call records its own: an interrupt
                                                    # may land anywhere in the loop below

    def call(host: Host) -> HostOutcome[T]:
        start = time.monotonic()
        try:
            outcome = HostOutcome(host, fn(host), None, round(time.monotonic() - start, 3))
        except Exception as e:          # collected: one host never stops the others
            outcome = HostOutcome(host, None, e, round(time.monotonic() - start, 3))
        finished[host.name] = outcome
        return outcome

    def in_order() -> HostOutcomes[T]:
        return HostOutcomes((h.name, finished[h.name]) for h in hosts if h.name in finished)

    if not hosts:
        return HostOutcomes()
    in_flight = max(1, min(max_parallel or default_parallel(), len(hosts)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=in_flight) as pool:
        try:
            running = {pool.submit(call, host) for host in hosts}
            while running:      # in steps of a second: a signal that comes as the wait begins
                _, running = concurrent.futures.wait(running, timeout=1)    # is not noticed until it ends
        except KeyboardInterrupt as interrupt:      # stop the hosts' work, here and on the hosts
            pool.shutdown(wait=False, cancel_futures=True)      # the hosts not started never start
            if on_interrupt is not None:
                on_interrupt()
            pool.shutdown(wait=True)
            raise Interrupted(in_order()) from interrupt
    return in_order()


class Interrupted(KeyboardInterrupt):
    """An interrupt during run_parallel, with the outcomes of the hosts that had started (their
    calls ended once stopped: what each recorded, or the error it ended with)."""

    def __init__(self, outcomes: "HostOutcomes"):
        super().__init__()
        self.outcomes = outcomes
