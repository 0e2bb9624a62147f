"""Commands as processes on this machine: bash here (LocalTransport), or the `ssh` client of a
warm OpenSSH master (openssh.WarmTransport), each in its own session, stopped with the transport."""
from __future__ import annotations

import os
import select
import subprocess
import threading
import time

from ..inventory import Host
from .base import CHUNK, STOP_GRACE, HeldInput, Transport, feed, remaining


class ProcessTransport(Transport):
    """Commands run as local processes (`argv(command)`), each in its own session: bash on this
    machine (LocalTransport), or an ssh client of a warm connection (openssh.WarmTransport)."""

    def __init__(self, host: Host, stopped: threading.Event | None = None):
        super().__init__(host, stopped)
        self._running: set[subprocess.Popen] = set()

    def close(self) -> None:
        """Stop the commands still running (as a closed channel does on an ssh host): their stdin
        ends at once, and they get STOP_GRACE seconds together before they are killed."""
        running = list(self._running)
        for proc in running:
            _close(proc.stdin)
        deadline = time.monotonic() + STOP_GRACE
        for proc in running:
            _stop(proc, deadline)

    def argv(self, command: str) -> list[str]:
        """The process that runs `command`."""
        raise NotImplementedError

    def _exec(self, command, stdin, sink, deadline):
        proc = subprocess.Popen(self.argv(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self._running.add(proc)
        feeder = feed(stdin, lambda data: (proc.stdin.write(data), proc.stdin.flush()), proc.stdin.close) \
            if stdin else None
        fd = proc.stdout.fileno()
        try:
            while True:
                wait = remaining(deadline)
                if wait is not None and wait <= 0:
                    _stop(proc)
                    return None
                ready, _, _ = select.select([fd], [], [], min(wait, 1.0) if wait is not None else 1.0)
                if ready:
                    data = os.read(fd, CHUNK)
                    if not data:
                        break
                    sink(data)
            wait = remaining(deadline)
            try:
                return proc.wait(timeout=max(wait, 0.1) if wait is not None else None)
            except subprocess.TimeoutExpired:
                _stop(proc)
                return None
        finally:
            self._running.discard(proc)
            proc.stdout.close()
            if isinstance(stdin, HeldInput):
                stdin.release()
            if feeder:
                feeder.join(1)
            else:
                _close(proc.stdin)      # the end of stdin stops a guarded command (remote.GUARD)


class LocalTransport(ProcessTransport):
    """Commands run with bash on this machine, in their own session."""

    def argv(self, command: str) -> list[str]:
        return ["bash", "-c", command]


def _close(stream) -> None:
    try:
        stream.close()
    except OSError:
        pass


def _stop(proc: subprocess.Popen, deadline: float | None = None) -> None:
    """Stop a local command: end its stdin (a guarded command stops its step and cleans up), then
    kill it if it has not ended by `deadline` (time.monotonic; default: STOP_GRACE from now)."""
    _close(proc.stdin)
    if deadline is None:
        deadline = time.monotonic() + STOP_GRACE
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()
