"""The orchestrator's exceptions: a small hierarchy whose instances carry their evidence.

Every failure names the host it happened on and, where a command was involved, the command,
its exit code and the tail of its output, so that a message alone is enough to act on.
`exit_code` is the process exit code tasks.py turns the error into (docs/tasks.md, exit codes).
"""
from __future__ import annotations

TAIL_LINES = 20
# Causes worth naming in a failure's first line (strerror texts, as tools print them).
KNOWN_CAUSES = ("No space left on device", "Disk quota exceeded", "Read-only file system", "Permission denied",
                "Input/output error", "Too many open files", "Cannot allocate memory", "File name too long")
UNSAFE_PREFIX = "UNSAFE "    # how the host-side ownership check (ownership.CHECK) begins its refusal


def refusal(output: str) -> str | None:
    """The ownership check's refusal in a command's output (`UNSAFE ...` without the word), or None."""
    for line in output.splitlines():
        if line.startswith(UNSAFE_PREFIX):
            return line[len(UNSAFE_PREFIX):].strip()
    return None


def cause_of(output: str) -> str | None:
    """The well-known cause of a failure found in a command's output (e.g. `No space left on
    device`, or the ownership check's refusal), so that the message says why and not only that it
    failed; None if there is none."""
    refused = refusal(output)
    if refused:
        return f"unsafe: {refused}"
    for cause in KNOWN_CAUSES:
        if cause.lower() in output.lower():
            return cause
    return None


class KdError(Exception):
    """Base of every orchestrator error. `timed_out`: whether what failed ran past its time limit,
    when the raiser knows (None: judged by the exit status, 124 or 137: remote.TIMEOUT_EXIT_CODES)."""

    exit_code = 1

    def __init__(self, message: str, *, host: str | None = None, command: str | None = None,
                 exit_status: int | None = None, tail: str = "", timed_out: bool | None = None):
        super().__init__(message)
        self.message = message
        self.host = host
        self.command = command
        self.exit_status = exit_status
        self.tail = tail
        self.timed_out = timed_out

    def __str__(self) -> str:
        lines = [f"{self.host}: {self.message}" if self.host else self.message]
        if self.command is not None:
            lines.append("  command: " + self.command.replace("\n", "\\n"))    # one line: a tail keeps the output
        if self.exit_status is not None:
            lines.append(f"  exit code: {self.exit_status}")
        if self.tail.strip():
            lines.append("  output (tail):")
            lines.extend("    " + line for line in self.tail.rstrip().splitlines()[-TAIL_LINES:])
        return "\n".join(lines)


class UsageError(KdError):
    """A wrong command-line flag or combination of flags."""

    exit_code = 2


class InventoryError(UsageError):
    """hosts.yaml is invalid or a selection names no such host or group: names file, host, key."""

    def __init__(self, file, problem: str, *, host: str | None = None, key: str | None = None):
        where = [str(file)]
        if host is not None:
            where.append(f"host {host!r}")
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(": ".join(where + [problem]))
        self.file, self.problem, self.inventory_host, self.key = str(file), problem, host, key


class HostError(KdError):
    """Something failed on (or on the way to) one host; the other hosts go on."""


class ConnectError(HostError):
    """The host could not be reached (refused, timed out, reset). `retry`: worth another try."""

    def __init__(self, message: str, *, host: str, retry: bool, **evidence):
        super().__init__(message, host=host, **evidence)
        self.retry = retry


class AuthError(HostError):
    """The host refused our credentials; never retried."""


class HostKeyError(HostError):
    """The key of a host (or of its jump host) is unknown or changed; nothing runs on that host.
    Never retried. `known_name` is its known_hosts name ([addr]:port), `key` the key it offered."""

    def __init__(self, message: str, *, host: str, known_name: str, key, fingerprint: str, changed: bool):
        super().__init__(message, host=host)
        self.known_name = known_name
        self.key = key
        self.fingerprint = fingerprint
        self.changed = changed


class CommandError(HostError):
    """A command on the host failed (non-zero exit or timeout)."""


class StepError(HostError):
    """A step found something wrong (not a failed command: a wrong result)."""


class LockError(HostError):
    """Another run holds the host's lock; `owner` says who."""

    def __init__(self, message: str, *, host: str, owner: str):
        super().__init__(message, host=host)
        self.owner = owner


class DestinationError(HostError):
    """remote_dir is not a directory the orchestrator may write to (or --delete into)."""


class SyncError(HostError):
    """The transfer of the source tree failed or could not be verified."""


class FetchError(HostError):
    """A file could not be read back from the host safely (symlink, too large, outside)."""


class OutputOverflow(Exception):
    """A started command printed more than connectors.base.UNREAD_BYTES that were not read yet;
    the rest was dropped (what reads its answer turns this into a HostError)."""


class LocalWriteError(KdError):
    """A file of the run could not be written on this machine (a full disk, a read-only one):
    the message names the file and the system's reason."""

    def __init__(self, path, reason: OSError | str):
        why = (reason.strerror or str(reason)) if isinstance(reason, OSError) else reason
        super().__init__(f"cannot write {path}: {why}")
        self.path = path
