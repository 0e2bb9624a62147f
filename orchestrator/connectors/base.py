"""Transports: one small interface to run commands on a host and read files back, three kinds.

    t = open_transport(host)            # factory.py: WarmTransport, SshTransport or LocalTransport, unopened
    r = t.run(command, on_output=print)   # a remote.Command -> Result(exit_code, seconds, tail, timed_out)
    t.check(command)                    # the same, raises CommandError unless it exited 0
    out = t.capture(command, max_bytes=1 << 20)   # its raw output (bytes)
    data = t.read_file("build/bench.json", max_bytes=1 << 20)
    t.fetch("build/bench.json", run_dir / "ct200" / "bench.json", within=run_dir, max_bytes=...)
    p = t.start(command)                # a long-running command: p.readline(), p.write(), p.close()
    t.rsync_dest(path)                  # the host's path as rsync's destination (sync.py)
    t.close()                           # also stops its running commands

`command` is a remote.Command: its command line, the host-side timeout it runs under (from which
the client's deadline is derived: when it passes the client stops waiting and the Result says
timed_out), its stdin. A bare command line with `timeout=` (the client's limit) is accepted for
tests and for commands held open for the run's length (the lock). SshTransport runs each command
in a session of one verified connection per host (paramiko.py: host keys, ssh config, jump
hosts, keepalive), opened on first use and reused by every command of the run and by rsync
(relay.py). LocalTransport runs the same command lines with bash on this machine. WarmTransport
(openssh.py), the default for a host reached directly, runs them as `ssh` clients of an OpenSSH
master kept between runs; it shares LocalTransport's process handling (ProcessTransport).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import posixpath
import queue
import secrets
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol, Sequence

from .. import ownership, remote
from ..errors import CommandError, FetchError, HostError, OutputOverflow, cause_of, refusal
from ..host import client
from ..inventory import Host

TAIL_BYTES = 64 * 1024
MAX_LINE = 64 * 1024    # a longer output line is passed on (logged, printed) in pieces of this size
CHUNK = 64 * 1024
STOP_GRACE = 5          # seconds the commands of a closed transport get, together, to end (a guarded
                        # step's stop and cleanup) before they are cut off
UNREAD_BYTES = 4 << 20  # a started command's output not yet read: beyond it the rest is dropped (Process)

OutputCallback = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Result:
    """What a command did: exit code (None when the client gave up), duration, output tail.
    `timed_out`: the client gave up, or the command exited with coreutils timeout's 124/137."""

    command: str
    exit_code: int | None
    seconds: float
    tail: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Readable(Protocol):
    """What a command's stdin is read from: a binary stream, HeldInput, _BytesReader."""

    def read(self, n: int, /) -> bytes: ...


class HeldInput:
    """A command's stdin that sends `data` first (secret values), then stays open until the
    command ends, as a command without stdin data does (a guarded command keeps running)."""

    def __init__(self, data: bytes):
        self._data, self._released = data, threading.Event()

    def read(self, n: int) -> bytes:
        if self._data:
            chunk, self._data = self._data[:n], self._data[n:]
            return chunk
        self._released.wait()
        return b""

    def release(self) -> None:
        self._released.set()


class Transport:
    """The interface every transport offers; subclasses implement `_exec` (and connect/close).
    `stopped`: the stop flag of the run that owns it (run.Run): once set, it neither connects nor
    starts a command again (a retry would resume interrupted work)."""

    def __init__(self, host: Host, stopped: threading.Event | None = None):
        self.host = host
        self.stopped = stopped if stopped is not None else threading.Event()
        self._early: threading.Thread | None = None
        self._early_error: BaseException | None = None

    def connect_soon(self) -> None:
        """Start connecting in the background, while this machine does its own work (the run's
        source hash): the next connect() waits for it and raises its error. Every check of a
        connection (host key, key probe) is made before its first command all the same."""
        self._early = threading.Thread(target=self._connect_early, daemon=True)
        self._early.start()

    def _connect_early(self) -> None:
        try:
            self.connect()
        except BaseException as e:      # noqa: BLE001 - handed to the next connect() (_await_early)
            self._early_error = e

    def _await_early(self) -> bool:
        """Wait for a connect_soon() under way (not from its own thread) and raise its error once;
        whether there was one to wait for."""
        early = self._early
        if early is None or early is threading.current_thread():
            return False
        early.join()
        self._early = None
        error, self._early_error = self._early_error, None
        if error is not None:
            raise error
        return True

    def _refuse_if_stopped(self) -> None:
        if self.stopped.is_set():
            raise HostError("the run was interrupted", host=self.host.name)

    # -- to implement -------------------------------------------------------------------------
    def _exec(self, command: str, stdin: Readable | None, sink: Callable[[bytes], None],
              deadline: float | None) -> int | None:
        """Run `command`, feeding it `stdin`, passing its output (stdout and stderr merged) to
        `sink`; return its exit code, or None when `deadline` (time.monotonic) passed first."""
        raise NotImplementedError

    def connect(self) -> None:
        """Open the connection now (otherwise the first command does). Idempotent."""

    def close(self) -> None:
        """Close the connection; the transport may be used again (it reconnects)."""

    def rsync_dest(self, path: str) -> str:
        """`path` on this host as an rsync destination."""
        return path

    def own_rsync_shell(self, connect: bool = True) -> str | None:
        """rsync's `-e` when rsync can use the transport's connection itself (a warm connection's
        socket; `connect`: open it first); None otherwise (local, or through relay.py)."""
        return None

    # -- built on _exec ------------------------------------------------------------------------
    def run(self, command: remote.Command | str, *, timeout: float | None = None,
            on_output: OutputCallback | None = None, stdin: bytes | BinaryIO | None = None) -> Result:
        """Run a command; stream its output lines to `on_output`; never raises for a non-zero exit
        (HostError only when the host cannot be reached). A remote.Command brings its deadline
        and stdin; a bare command line (tests, long-held commands) runs with the client limit
        `timeout` (None: none) and `stdin`. Without stdin data, or after it for a Command that
        holds stdin, the command's stdin stays open until it ends: a guarded command
        (remote.GUARD) stops when it closes (the client gives up, closes the transport, or dies)."""
        self._refuse_if_stopped()
        line, timeout, data = _parts(command, timeout, stdin)
        collector = _Collector(on_output, TAIL_BYTES)
        source: Readable | None = _BytesReader(bytes(data)) if isinstance(data, (bytes, bytearray)) else data
        start = time.monotonic()
        deadline = start + timeout if timeout is not None else None
        try:
            code = self._exec(line, source, collector.feed, deadline)
        finally:
            if isinstance(source, HeldInput):
                source.release()
        collector.flush()
        return Result(line, code, round(time.monotonic() - start, 3), collector.tail(), remote.timed_out(code))

    def check(self, command: remote.Command | str, *, timeout: float | None = None,
              on_output: OutputCallback | None = None, stdin: bytes | BinaryIO | None = None,
              what: str | None = None) -> Result:
        """`run`, raising CommandError (with the command, exit code and tail) unless it exited 0."""
        result = self.run(command, timeout=timeout, on_output=on_output, stdin=stdin)
        if not result.ok:
            why = "timed out" if result.timed_out else "failed"
            cause = None if result.timed_out else cause_of(result.tail)
            why += f": {cause}" if cause else ""
            raise CommandError(f"{_what(command, what)} {why}", host=self.host.name, command=result.command,
                               exit_status=result.exit_code, tail=result.tail, timed_out=result.timed_out)
        return result

    def capture(self, command: remote.Command | str, *, max_bytes: int, timeout: float | None = None,
                what: str | None = None) -> bytes:
        """The raw output of a command; CommandError unless it exited 0 within `max_bytes`."""
        line, timeout, _ = _parts(command, timeout, None)
        code, data = self._capture(line, timeout, max_bytes)
        why = capture_failure(code, len(data), max_bytes)
        if why:
            raise CommandError(f"{_what(command, what)} {why}", host=self.host.name, command=line, exit_status=code,
                               tail=data[-2000:].decode(errors="replace"),
                               timed_out=len(data) <= max_bytes and remote.timed_out(code))
        return data

    def read_file(self, path: str, max_bytes: int, timeout: float = 60) -> bytes:
        """The content of a regular file on the host (relative: under remote_dir). Refuses a
        symlink, anything but a regular file, and a file larger than `max_bytes`."""
        path = posixpath.join(self.host.remote_dir, path)
        command = client.read_file(self.host, path=path, max_bytes=max_bytes, timeout=timeout)
        code, data = self._capture(command.line, command.deadline, max_bytes)
        if code == 0 and len(data) <= max_bytes:
            return data
        if code == ownership.UNSAFE_EXIT:
            why = f"cannot be read safely: {refusal(data.decode(errors='replace'))}"
            raise FetchError(f"{path} {why}", host=self.host.name, command=command.line, exit_status=code,
                             tail=data[-2000:].decode(errors="replace"))
        raise self._unread(path, code, data, max_bytes, command.line)

    def read_files(self, paths: Sequence[tuple[str, int]], timeout: float = 60) -> dict[str, bytes | FetchError]:
        """Several files as read_file reads each (path, max_bytes), in one command: each path's
        content, or the FetchError read_file would raise for it. The command failing as a whole
        (the ownership check, a timeout, an answer that does not frame as asked) raises FetchError."""
        root = self.host.remote_dir
        mark = b"\n" + secrets.token_hex(16).encode() + b" "     # after each file: its exit status, then a newline
        command = client.read_files(self.host, mark=mark[1:-1].decode(), paths=paths, timeout=timeout)
        limit = sum(most + 1 + len(mark) + 8 for _, most in paths)
        code, data = self._capture(command.line, command.deadline, limit)
        found: dict[str, bytes | FetchError] = {}
        rest = data if code == 0 and len(data) <= limit else b""
        for path, most in paths:
            content, sep, rest = rest.partition(mark)
            status, newline, rest = rest.partition(b"\n")
            if not sep or not newline or not status.isdigit():
                break
            found[path] = content if status == b"0" and len(content) <= most else \
                self._unread(posixpath.join(root, path), int(status), content, most, command.line)
        if len(found) != len(paths) or rest:
            why = f"cannot be read safely: {refusal(data.decode(errors='replace'))}" \
                if code == ownership.UNSAFE_EXIT else f"could not be read (exit code {code}, an answer of {len(data)} bytes)"
            raise FetchError(f"{', '.join(p for p, _ in paths)} {why}", host=self.host.name, command=command.line,
                             exit_status=code, tail=data[-2000:].decode(errors="replace"))
        return found

    def _unread(self, path: str, code: int | None, data: bytes, max_bytes: int, line: str) -> FetchError:
        """read_file's error for `path`, read with exit status `code` (`data`: what it printed)."""
        why = f"is larger than {max_bytes} bytes" if len(data) > max_bytes \
            else _READ_ERRORS.get(code, f"cannot be read (exit code {code})")
        return FetchError(f"{path} {why}", host=self.host.name, command=line, exit_status=code,
                          tail="" if code in _READ_ERRORS or code == 0 else data[-2000:].decode(errors="replace"))

    def _capture(self, command: str, timeout: float | None, max_bytes: int) -> tuple[int | None, bytes]:
        """Run a command line keeping at most max_bytes + 1 bytes of its output."""
        self._refuse_if_stopped()
        chunks, size = [], 0

        def sink(data: bytes) -> None:
            nonlocal size
            if size <= max_bytes:
                chunks.append(data[:max_bytes + 1 - size])
            size += len(data)

        deadline = time.monotonic() + timeout if timeout is not None else None
        code = self._exec(command, None, sink, deadline)
        return code, b"".join(chunks)

    def fetch(self, remote_path: str, local_path, *, within, max_bytes: int) -> Path:
        """Copy a file from the host to `local_path`, which must lie inside the local directory
        `within` (no `..`, no symlink on the way); the same refusals as read_file."""
        root = Path(within).resolve()
        target = Path(local_path)
        target = (target if target.is_absolute() else root / target)
        resolved = target.parent.resolve() / target.name
        if root != resolved.parent and root not in resolved.parent.parents or target.name in ("", ".", ".."):
            raise FetchError(f"refusing to write {target}: outside {root}", host=self.host.name)
        data = self.read_file(remote_path, max_bytes)
        with ownership.writing(resolved):           # a full disk here: LocalWriteError naming the file
            resolved.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(resolved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise FetchError(f"refusing to write {resolved}: it is a symlink", host=self.host.name) from None
                raise
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return resolved

    def start(self, command: str) -> "Process":
        """Start a long-running command whose stdin stays open until Process.close()."""
        return Process(self, command)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_OVERFLOW = object()        # in a Process's queue: what follows was dropped


class Process:
    """A command started with Transport.start: read its output lines, write to its stdin. At most
    UNREAD_BYTES of its output wait to be read (a host that floods a helper's output, or one nobody
    reads any more, cannot fill this machine's memory): readline raises OutputOverflow past them."""

    def __init__(self, transport: Transport, command: str):
        self._lines: queue.Queue = queue.Queue()
        self._unread = 0
        self._overflowed = False
        self._count = threading.Lock()
        read_end, write_end = os.pipe()
        self._write_end: int | None = write_end
        self._stdin = os.fdopen(read_end, "rb", buffering=0)
        self.result: Result | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(transport, command), daemon=True)
        self._thread.start()

    def _run(self, transport, command):
        try:
            self.result = transport.run(command, timeout=None, on_output=self._put, stdin=self._stdin)
        except BaseException as e:          # handed to the caller by readline/close
            self.error = e
        finally:
            self._lines.put(None)

    def _put(self, line: str) -> None:
        with self._count:
            if self._overflowed:
                return
            self._overflowed = self._unread + len(line) > UNREAD_BYTES
            self._unread += 0 if self._overflowed else len(line)
        self._lines.put(_OVERFLOW if self._overflowed else line)

    def readline(self, timeout: float) -> str | None:
        """The next output line; None at the end of the output. Raises TimeoutError, and
        OutputOverflow where output was dropped."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout} s") from None
        if line is _OVERFLOW:
            self._lines.put(_OVERFLOW)
            raise OutputOverflow(f"more than {UNREAD_BYTES} bytes of its output were not read; the rest was dropped")
        if line is not None:
            with self._count:
                self._unread -= len(line)
        if line is None:
            self._lines.put(None)
            if self.error is not None:
                raise self.error
        return line

    def write(self, data: bytes) -> None:
        if self._write_end is None:
            raise ValueError("the process's stdin is closed")
        os.write(self._write_end, data)

    def close(self, timeout: float = 30) -> Result | None:
        """Close its stdin and wait for it to end; its Result (None if it did not end in time)."""
        if self._write_end is not None:
            os.close(self._write_end)
            self._write_end = None
        self._thread.join(timeout)
        return self.result


READ_MISSING = 4         # read_file's FetchError.exit_status when the file does not exist
_READ_ERRORS: dict[int | None, str] = {3: "is a symlink; refusing to read it", READ_MISSING: "does not exist",
                5: "is not a regular file; refusing to read it",
                7: "resolves outside remote_dir (a symlink on the way); refusing to read it"}


def capture_failure(code: int | None, size: int, max_bytes: int) -> str | None:
    """Why a command whose output is captured failed, in words (exit status `code`, None: no
    answer in time; `size` bytes printed), or None when it did not."""
    if size > max_bytes:
        return f"printed more than {max_bytes} bytes"
    if remote.timed_out(code):
        return "timed out"
    return "failed" if code != 0 else None


def _parts(command: remote.Command | str, timeout: float | None, stdin) -> tuple[str, float | None, Any]:
    """(command line, client limit in seconds, stdin) of a Command, or of a bare command line."""
    if isinstance(command, str):
        return command, timeout, stdin
    if timeout is not None or stdin is not None:
        raise TypeError("a remote.Command carries its own timeout and stdin")
    data = command.stdin
    if not command.holds_stdin:
        return command.line, command.deadline, data
    if not isinstance(data, (bytes, type(None))):
        raise TypeError("a remote.Command that holds its stdin takes its data as bytes")
    return command.line, command.deadline, HeldInput(data or b"")


def _what(command: remote.Command | str, what: str | None) -> str:
    return what or (command.what if isinstance(command, remote.Command) else "command")


class _Collector:
    """Splits output into lines for a callback and keeps its tail."""

    def __init__(self, on_output: OutputCallback | None, tail_bytes: int):
        self.on_output, self.tail_bytes = on_output, tail_bytes
        self._tail = bytearray()
        self._partial = b""

    def feed(self, data: bytes) -> None:
        self._tail += data
        if len(self._tail) > 2 * self.tail_bytes:
            del self._tail[:-self.tail_bytes]
        if self.on_output is not None:
            *lines, self._partial = (self._partial + data).split(b"\n")
            while len(self._partial) > MAX_LINE:        # endless output without newlines: bounded pieces
                lines.append(self._partial[:MAX_LINE])
                self._partial = self._partial[MAX_LINE:]
            for line in lines:
                self.on_output(line.decode(errors="replace").rstrip("\r"))

    def flush(self) -> None:
        if self.on_output is not None and self._partial:
            self.on_output(self._partial.decode(errors="replace"))
            self._partial = b""

    def tail(self) -> str:
        return bytes(self._tail[-self.tail_bytes:]).decode(errors="replace")


class _BytesReader:
    def __init__(self, data: bytes):
        self._data, self._pos = data, 0

    def read(self, n: int) -> bytes:
        chunk = self._data[self._pos:self._pos + n]
        self._pos += len(chunk)
        return chunk


def feed(source, write, done) -> threading.Thread:
    """Copy `source` (a command's stdin) to `write` in a thread, then call `done` (end of input)."""
    def pump():
        try:
            while chunk := source.read(CHUNK):
                write(chunk)
        except (OSError, ValueError, EOFError):
            pass
        finally:
            try:
                done()
            except (OSError, EOFError):
                pass
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def remaining(deadline: float | None) -> float | None:
    """Seconds left until `deadline` (time.monotonic), negative once past; None for no deadline."""
    return None if deadline is None else deadline - time.monotonic()
