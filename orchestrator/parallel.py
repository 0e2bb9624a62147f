"""Run one function per host in parallel (bounded); collect per-host outcomes as data.

One host failing never stops the others: its exception is kept in its Outcome. As in Fabric's
ThreadingGroup, the caller gets every host's result and decides (succeeded / failed / exit_code).
On an interrupt (Ctrl-C, or SIGTERM: cli.exit_codes) the hosts not started are cancelled,
`on_interrupt` runs (the run's stop: locks released, connections closed, so the commands on the
hosts stop), the running hosts are waited for (they end at once, their work cut off), and the
interrupt goes on.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Iterable

from .errors import KdError
from .inventory import Host

MAX_PARALLEL = 16


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a function returned on one host, or the error it raised."""

    host: Host
    value: Any = None
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


class Outcomes(dict):
    """host name -> Outcome, in the order the hosts were given."""

    @property
    def succeeded(self) -> list[Outcome]:
        return [o for o in self.values() if o.ok]

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.values() if not o.ok]

    @property
    def exit_code(self) -> int:
        """0 when every host succeeded, else 1."""
        return 0 if not self.failed else 1


def run_parallel(hosts: Iterable[Host], fn: Callable[[Host], Any], max_parallel: int = MAX_PARALLEL,
                 on_interrupt: Callable[[], None] | None = None) -> Outcomes:
    """Call fn(host) for every host, at most max_parallel at a time; never raises for a host."""
    hosts = list(hosts)

    def call(host: Host) -> Outcome:
        start = time.monotonic()
        try:
            return Outcome(host, fn(host), None, round(time.monotonic() - start, 3))
        except Exception as e:          # collected: one host never stops the others
            return Outcome(host, None, e, round(time.monotonic() - start, 3))

    outcomes = Outcomes()
    if not hosts:
        return outcomes
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(hosts)))) as pool:
        futures = [pool.submit(call, host) for host in hosts]
        try:
            for host, future in zip(hosts, futures):
                outcomes[host.name] = future.result()
        except KeyboardInterrupt:           # stop the hosts' work, here and on the hosts
            for future in futures:
                future.cancel()
            if on_interrupt is not None:
                on_interrupt()
            raise
    return outcomes
