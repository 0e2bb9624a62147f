"""Transports: one small interface to run commands on a host and read files back, two kinds.

    t = open_transport(host)            # SshTransport or LocalTransport, nothing opened yet
    r = t.run(command, timeout=60, on_output=print)   # -> Result(exit_code, seconds, tail, timed_out)
    t.check(command, timeout=60)        # the same, raises CommandError unless it exited 0
    out = t.capture(command, timeout=60, max_bytes=1 << 20)   # its raw output (bytes)
    data = t.read_file("build/bench.json", max_bytes=1 << 20)
    t.fetch("build/bench.json", run_dir / "ct200" / "bench.json", within=run_dir, max_bytes=...)
    p = t.start(command)                # a long-running command: p.readline(), p.write(), p.close()
    t.rsync_args(), t.rsync_dest(path)  # how rsync reaches the host (sync.py)
    t.close()                           # also stops its running commands (close_all(): every transport)

`command` is a complete shell command line, as built by remote.py. `timeout` is the client-side
limit in seconds (None: none): when it passes the client stops waiting and the Result says
timed_out (the host-side limit is remote.wrap's). SshTransport opens one Paramiko connection per
host on first use and reuses it for every command of the run; host keys are verified (hostkeys.py),
~/.ssh/config is honoured (or $KDTREE_SSH_CONFIG instead), and a `jump:` bastion or a ProxyJump of
the ssh config is used by both Paramiko and system ssh/rsync. LocalTransport runs the same command
lines with bash on this machine.
"""
from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import posixpath
import queue
import select
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import BinaryIO, Callable

from . import hostkeys, remote
from .errors import AuthError, CommandError, ConnectError, FetchError, HostError, cause_of
from .inventory import Host

TAIL_BYTES = 64 * 1024
MAX_LINE = 64 * 1024    # a longer output line is passed on (logged, printed) in pieces of this size
CHUNK = 64 * 1024
CONNECT_BACKOFF = 0.5           # seconds before the 2nd attempt, doubling; retries stop at the connect timeout
KEEPALIVE_COUNT = 3             # a host that answers no keepalive for interval * count is gone
STOP_GRACE = 2          # seconds a stopped local command gets before it is killed

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
    """The interface every transport offers; subclasses implement `_exec` (and connect/close)."""

    def __init__(self, host: Host):
        self.host = host
        _ALL.add(self)

    # -- to implement -------------------------------------------------------------------------
    def _exec(self, command: str, stdin: BinaryIO | None, sink: Callable[[bytes], None],
              deadline: float | None) -> int | None:
        """Run `command`, feeding it `stdin`, passing its output (stdout and stderr merged) to
        `sink`; return its exit code, or None when `deadline` (time.monotonic) passed first."""
        raise NotImplementedError

    def connect(self) -> None:
        """Open the connection now (otherwise the first command does). Idempotent."""

    def close(self) -> None:
        """Close the connection; the transport may be used again (it reconnects)."""

    def rsync_args(self) -> list[str]:
        """rsync options that make it reach this host (e.g. `-e ssh ...`)."""
        return []

    def rsync_dest(self, path: str) -> str:
        """`path` on this host as an rsync destination."""
        return path

    # -- built on _exec ------------------------------------------------------------------------
    def run(self, command: str, *, timeout: float | None, on_output: OutputCallback | None = None,
            stdin: bytes | BinaryIO | None = None) -> Result:
        """Run a command line; stream its output lines to `on_output`; never raises for a
        non-zero exit (HostError only when the host cannot be reached). Without `stdin` data the
        command's stdin stays open until it ends: a guarded command (remote.GUARD) stops when
        it closes (the client gives up, closes the transport, or dies)."""
        if _STOPPED.is_set():
            raise HostError("the run was interrupted", host=self.host.name)
        collector = _Collector(on_output, TAIL_BYTES)
        if isinstance(stdin, (bytes, bytearray)):
            stdin = _BytesReader(bytes(stdin))
        start = time.monotonic()
        deadline = start + timeout if timeout is not None else None
        try:
            code = self._exec(command, stdin, collector.feed, deadline)
        finally:
            if isinstance(stdin, HeldInput):
                stdin.release()
        collector.flush()
        return Result(command, code, round(time.monotonic() - start, 3), collector.tail(),
                      code is None or code in remote.TIMEOUT_EXIT_CODES)

    def check(self, command: str, *, timeout: float | None, on_output: OutputCallback | None = None,
              stdin: bytes | BinaryIO | None = None, what: str = "command") -> Result:
        """`run`, raising CommandError (with the command, exit code and tail) unless it exited 0."""
        result = self.run(command, timeout=timeout, on_output=on_output, stdin=stdin)
        if not result.ok:
            why = "timed out" if result.timed_out else "failed"
            cause = None if result.timed_out else cause_of(result.tail)
            why += f": {cause}" if cause else ""
            raise CommandError(f"{what} {why}", host=self.host.name, command=command,
                               exit_status=result.exit_code, tail=result.tail)
        return result

    def capture(self, command: str, *, timeout: float | None, max_bytes: int, what: str = "command") -> bytes:
        """The raw output of a command; CommandError unless it exited 0 within `max_bytes`."""
        code, data = self._capture(command, timeout, max_bytes)
        if code != 0 or len(data) > max_bytes:
            why = f"printed more than {max_bytes} bytes" if len(data) > max_bytes else "failed"
            raise CommandError(f"{what} {why}", host=self.host.name, command=command, exit_status=code,
                               tail=data[-2000:].decode(errors="replace"))
        return data

    def read_file(self, path: str, max_bytes: int, timeout: float = 60) -> bytes:
        """The content of a regular file on the host (relative: under remote_dir). Refuses a
        symlink, anything but a regular file, and a file larger than `max_bytes`."""
        path = posixpath.join(self.host.remote_dir, path)
        command = remote.script_command(_READ_SCRIPT, path, str(max_bytes), self.host.remote_dir, timeout=timeout)
        code, data = self._capture(command, remote.client_timeout(timeout), max_bytes)
        if code == 0 and len(data) <= max_bytes:
            return data
        why = f"is larger than {max_bytes} bytes" if code == 6 or len(data) > max_bytes \
            else _READ_ERRORS.get(code, f"cannot be read (exit code {code})")
        raise FetchError(f"{path} {why}", host=self.host.name, command=command, exit_status=code,
                         tail="" if code in _READ_ERRORS or code == 0 else data[-2000:].decode(errors="replace"))

    def _capture(self, command: str, timeout: float | None, max_bytes: int) -> tuple[int | None, bytes]:
        """Run a command keeping at most max_bytes + 1 bytes of its output."""
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
        resolved.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(resolved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
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


class Process:
    """A command started with Transport.start: read its output lines, write to its stdin."""

    def __init__(self, transport: Transport, command: str):
        self._lines: queue.Queue = queue.Queue()
        read_end, self._write_end = os.pipe()
        self._stdin = os.fdopen(read_end, "rb", buffering=0)
        self.result: Result | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(transport, command), daemon=True)
        self._thread.start()

    def _run(self, transport, command):
        try:
            self.result = transport.run(command, timeout=None, on_output=self._lines.put, stdin=self._stdin)
        except BaseException as e:          # handed to the caller by readline/close
            self.error = e
        finally:
            self._lines.put(None)

    def readline(self, timeout: float) -> str | None:
        """The next output line; None at the end of the output. Raises TimeoutError."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout} s") from None
        if line is None:
            self._lines.put(None)
            if self.error is not None:
                raise self.error
        return line

    def write(self, data: bytes) -> None:
        os.write(self._write_end, data)

    def close(self, timeout: float = 30) -> Result | None:
        """Close its stdin and wait for it to end; its Result (None if it did not end in time)."""
        if self._write_end is not None:
            os.close(self._write_end)
            self._write_end = None
        self._thread.join(timeout)
        return self.result


class LocalTransport(Transport):
    """Commands run with bash on this machine, in their own session."""

    def __init__(self, host: Host):
        super().__init__(host)
        self._running: set[subprocess.Popen] = set()

    def close(self) -> None:
        """Stop the commands still running (as a closed channel does on an ssh host)."""
        for proc in list(self._running):
            _stop(proc)

    def _exec(self, command, stdin, sink, deadline):
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self._running.add(proc)
        feeder = _feed(stdin, lambda data: (proc.stdin.write(data), proc.stdin.flush()), proc.stdin.close) \
            if stdin else None
        fd = proc.stdout.fileno()
        try:
            while True:
                wait = _remaining(deadline)
                if wait is not None and wait <= 0:
                    _stop(proc)
                    return None
                ready, _, _ = select.select([fd], [], [], min(wait, 1.0) if wait is not None else 1.0)
                if ready:
                    data = os.read(fd, CHUNK)
                    if not data:
                        break
                    sink(data)
            wait = _remaining(deadline)
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


class SshTransport(Transport):
    """Commands run over one Paramiko connection (Fabric's Connection, hardened); rsync reaches
    the host with system ssh given the same config, known_hosts files and jump hosts."""

    def __init__(self, host: Host):
        super().__init__(host)
        self._conn = None
        self._hops: list = []
        self._pinned_file: Path | None = None
        self._lock = threading.Lock()
        self._lost: str | None = None       # why the keepalive watchdog closed the connection

    # -- connection ----------------------------------------------------------------------------
    def connect(self) -> None:
        with self._lock:
            if self._conn is not None and self._conn.is_connected:
                return
            if _STOPPED.is_set():
                raise HostError("the run was interrupted", host=self.host.name)
            # a refused or reset connection (sshd restarting) is retried with backoff for as long as
            # the connect timeout lasts; a timeout, a host key or an authentication failure never is
            start, delay = time.monotonic(), CONNECT_BACKOFF
            for attempt in itertools.count(1):
                try:
                    self._conn = self._open()
                    return
                except ConnectError as e:
                    left = start + self.host.timeout("connect") - time.monotonic()
                    if not e.retry or left <= 0:
                        if attempt == 1:
                            raise
                        raise ConnectError(f"{e.message} ({attempt} attempts in {time.monotonic() - start:.1f} s)",
                                           host=self.host.name, retry=False) from None
                    time.sleep(min(delay, left))
                    delay *= 2

    def close(self) -> None:
        with self._lock:
            for conn in [self._conn, *self._hops]:
                if conn is not None:
                    conn.close()
            self._conn, self._hops = None, []
            if self._pinned_file is not None:
                self._pinned_file.unlink(missing_ok=True)
                self._pinned_file = None

    def _open(self):
        """Open the jump hosts' connections in order, then the host's through them."""
        import fabric
        host = self.host
        config = fabric.Config(runtime_ssh_path=ssh_config_file()) if ssh_config_file() else fabric.Config()
        ssh_config = config.base_ssh_config.lookup(host.address)
        hops = self.jump_hops(ssh_config)
        gateway: object = False
        if not hops and ssh_config.get("proxycommand", "none").lower() != "none":
            gateway = ssh_config["proxycommand"]
        self._hops = []
        try:
            for hop in hops:
                gateway = self._connection(config, hop, None, None, gateway,
                                           hostkeys.VerifyPolicy(host.name, None, hop=True))
                self._hops.append(gateway)
                self._open_one(gateway)
            policy = hostkeys.VerifyPolicy(host.name, host.host_key, hop=False)
            conn = self._connection(config, host.address, host.user, host.port, gateway, policy)
            self._open_one(conn)
        except HostError:
            for hop in self._hops:
                hop.close()
            self._hops = []
            raise
        conn.transport.set_keepalive(int(host.timeout("keepalive")))
        self._lost = None
        threading.Thread(target=self._watch, args=(conn.transport,), daemon=True).start()
        key = conn.transport.get_remote_server_key()
        name = hostkeys.known_name(conn.host, conn.port)
        if host.host_key and hostkeys.fingerprint(key) != host.host_key:
            conn.close()
            raise hostkeys.changed(host.name, name, key, host.host_key, "host_key: in the inventory")
        if policy.accepted:
            self._pin_for_ssh(name, key)
        return conn

    def _open_one(self, conn) -> None:
        """Open one Fabric connection, its failure as a HostError of the right kind."""
        start = time.monotonic()
        try:
            conn.open()
        except HostError:
            _discard(conn)
            raise
        except Exception as e:
            _discard(conn)
            raise self._connect_error(e, conn, time.monotonic() - start) from None
        _no_delay(conn.transport.sock)

    def _connection(self, config, target, user, port, gateway, policy):
        import fabric
        kwargs = {"banner_timeout": self.host.timeout("connect"), "auth_timeout": self.host.timeout("connect")}
        if self.host.identity:
            kwargs["key_filename"] = [self.host.identity]
        conn = fabric.Connection(target, user=user, port=port, config=config, gateway=gateway,
                                 connect_timeout=int(self.host.timeout("connect")), connect_kwargs=kwargs)
        # Fabric accepts unknown keys (auto-add) and loads no known_hosts: verify against ours instead.
        conn.client.set_missing_host_key_policy(policy)
        for file in hostkeys.known_hosts_files(self.host.known_hosts):
            if file.is_file():
                conn.client.get_host_keys().load(str(file))
        return conn

    def _connect_error(self, e: Exception, conn, elapsed: float = 0.0) -> HostError:
        import paramiko
        where = f"{conn.host}:{conn.port}"
        if isinstance(e, paramiko.BadHostKeyException):
            name = hostkeys.known_name(e.hostname, conn.port)
            return hostkeys.changed(self.host.name, name, e.key, hostkeys.fingerprint(e.expected_key),
                                    "known_hosts")
        if isinstance(e, paramiko.AuthenticationException):
            return AuthError(f"authentication to {where} as {conn.user} failed: {e}", host=self.host.name)
        if isinstance(e, socket.gaierror):
            return ConnectError(f"cannot reach {where}: {e.strerror or e}", host=self.host.name, retry=False)
        if isinstance(e, (socket.timeout, TimeoutError)):
            return ConnectError(f"cannot reach {where}: timed out after {self.host.timeout('connect')} s",
                                host=self.host.name, retry=False)
        if isinstance(e, paramiko.SSHException) and (isinstance(e.__context__, (socket.timeout, TimeoutError))
                                                      or elapsed >= self.host.timeout("connect") - 0.5):
            # the TCP connection opened but the host said nothing in time (a hung sshd): not
            # transient, and retrying would multiply the wait
            return ConnectError(f"cannot reach {where}: no SSH answer within {self.host.timeout('connect')} s "
                                f"(sshd hung or not an SSH server: {e})", host=self.host.name, retry=False)
        if isinstance(e, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionError, EOFError,
                          paramiko.SSHException, OSError)):
            return ConnectError(f"cannot reach {where}: {e}", host=self.host.name, retry=True)
        return ConnectError(f"cannot connect to {where}: {type(e).__name__}: {e}", host=self.host.name, retry=False)

    def _watch(self, transport) -> None:
        """Keepalive with a deadline (ssh's ServerAliveCountMax; Paramiko's keepalive never waits for
        an answer): every `keepalive` seconds ask the host for a reply; when none comes within
        KEEPALIVE_COUNT intervals (a hung host, a dead network), close the connection, so every
        command on it fails at once instead of waiting for its own timeout."""
        interval = self.host.timeout("keepalive")
        while transport.is_active():
            time.sleep(interval)
            answered = threading.Event()

            def ask(answered: threading.Event) -> None:
                try:
                    transport.global_request("keepalive@openssh.com", wait=True)
                except Exception:
                    pass
                answered.set()
            threading.Thread(target=ask, args=(answered,), daemon=True).start()
            if not answered.wait(interval * KEEPALIVE_COUNT) and transport.is_active():
                self._lost = f"the host answered no keepalive for {interval * KEEPALIVE_COUNT:g} s"
                transport.close()
                return

    def server_key(self) -> tuple[str, object]:
        """The verified host key of the connection: (known_hosts name, Paramiko key)."""
        self.connect()
        return hostkeys.known_name(self._conn.host, self._conn.port), self._conn.transport.get_remote_server_key()

    def _pin_for_ssh(self, name: str, key) -> None:
        """Give system ssh the key that matched `host_key:` (a file removed on close)."""
        fd, path = tempfile.mkstemp(prefix="kdtree-pinned-", suffix=".known_hosts")
        os.close(fd)
        self._pinned_file = Path(path)
        hostkeys.pin(self._pinned_file, name, key)

    def jump_hops(self, ssh_config=None) -> list[str]:
        """The jump hosts in order (first hop first): `jump:` or the ssh config's ProxyJump."""
        if self.host.jump:
            return self.host.jump.split(",")
        if ssh_config is None:
            ssh_config = ssh_config_lookup(self.host.address)
        jump = ssh_config.get("proxyjump", "none")
        return [] if jump.lower() == "none" else jump.split(",")

    # -- commands ------------------------------------------------------------------------------
    def _exec(self, command, stdin, sink, deadline):
        self.connect()
        transport = self._conn.transport
        try:
            chan = transport.open_session(timeout=self.host.timeout("connect"))
        except Exception as e:
            raise ConnectError(f"cannot open a session: {e}", host=self.host.name, retry=False) from None
        with chan:
            chan.set_combine_stderr(True)
            chan.exec_command(command)
            if stdin:       # otherwise stdin stays open until the channel closes (remote.GUARD)
                _feed(stdin, chan.sendall, chan.shutdown_write)
            while True:
                wait = _remaining(deadline)
                if wait is not None and wait <= 0:
                    return None
                chan.settimeout(min(wait, 1.0) if wait is not None else 1.0)
                try:
                    data = chan.recv(CHUNK)
                except socket.timeout:
                    if not transport.is_active():
                        break
                    continue
                if not data:
                    break
                sink(data)
            while not chan.status_event.wait(0.5):
                wait = _remaining(deadline)
                if not transport.is_active() or (wait is not None and wait <= 0):
                    break
            # no exit status, or Paramiko's -1 of a channel closed with its connection: the host is lost
            code = chan.recv_exit_status() if chan.exit_status_ready() else None
            if code is None and transport.is_active():
                return None
            if code is None or code < 0:
                raise ConnectError("connection lost while running a command" + (f": {self._lost}" if self._lost else ""),
                                   host=self.host.name, command=command, retry=False)
            return code

    # -- system ssh / rsync --------------------------------------------------------------------
    def ssh_options(self) -> list[str]:
        """system ssh's argv up to the destination: the same config, known_hosts files (plus a
        key pinned by host_key:), identity and jump hosts as the Paramiko connection."""
        argv = self._base_options()
        argv += self._jump_options(self.jump_hops())
        if self.host.user:
            argv += ["-l", self.host.user]
        if self.host.port:
            argv += ["-p", str(self.host.port)]
        return argv

    def ssh_argv(self, command: str) -> list[str]:
        """The full argv of system ssh running `command` on the host."""
        return self.ssh_options() + ["--", self.host.address, command]

    def rsync_args(self) -> list[str]:
        return ["-e", remote.quote(self.ssh_options())]

    def rsync_dest(self, path: str) -> str:
        address = f"[{self.host.address}]" if ":" in self.host.address else self.host.address
        return f"{address}:{path}"

    def _base_options(self) -> list[str]:
        files = hostkeys.known_hosts_files(self.host.known_hosts)
        if self._pinned_file is not None:
            files.append(self._pinned_file)
        argv = ["ssh"]
        if ssh_config_file():
            argv += ["-F", ssh_config_file()]
        argv += ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                 "-o", "UserKnownHostsFile=" + " ".join(f'"{_pct(str(f))}"' for f in files),
                 "-o", f"ConnectTimeout={int(self.host.timeout('connect'))}",
                 "-o", f"ServerAliveInterval={int(self.host.timeout('keepalive'))}",
                 "-o", f"ServerAliveCountMax={KEEPALIVE_COUNT}"]
        if self.host.identity:
            argv += ["-i", _pct(self.host.identity)]
        return argv

    def _jump_options(self, hops: list[str]) -> list[str]:
        """-o ProxyCommand=ssh ... -W [%h]:%p LAST_HOP, recursively through the earlier hops."""
        if not hops:
            return []
        *before, last = hops
        user_host, _, port = last.rpartition(":") if last.count(":") == 1 else (last, "", "")
        user, _, hop_host = user_host.rpartition("@")
        inner = self._base_options() + self._jump_options(before)
        inner += (["-l", user] if user else []) + (["-p", port] if port else [])
        command = remote.quote([_pct(a) for a in inner] + ["-W", "[%h]:%p", _pct(hop_host)])
        return ["-o", "ProxyCommand=" + command]


def close_all() -> None:
    """Close every transport of this process for good (on an interrupt): remote commands stop
    too, and no transport connects or starts a command again (a retry would resume the work)."""
    _STOPPED.set()
    for transport in list(_ALL):
        transport.close()


def open_transport(host: Host) -> Transport:
    """The transport for a host (nothing is opened until it is used)."""
    return LocalTransport(host) if host.is_local else SshTransport(host)


def ssh_config_file() -> str | None:
    """The ssh config used instead of ~/.ssh/config and /etc/ssh/ssh_config ($KDTREE_SSH_CONFIG)."""
    return os.environ.get("KDTREE_SSH_CONFIG") or None


def ssh_config_lookup(alias: str) -> dict:
    """The ssh config settings for a host alias, as Paramiko reads them."""
    import fabric
    config = fabric.Config(runtime_ssh_path=ssh_config_file()) if ssh_config_file() else fabric.Config()
    return config.base_ssh_config.lookup(alias)


# -- helpers -------------------------------------------------------------------------------------
_ALL: "weakref.WeakSet[Transport]" = weakref.WeakSet()
_STOPPED = threading.Event()        # set by close_all(): the run was interrupted

_READ_SCRIPT = r'''
[ -L "$1" ] && exit 3
real=$(realpath -e -- "$1" 2>/dev/null) && case $real in "$(realpath -m -- "$3")"/*) ;; *) exit 7;; esac
[ -e "$1" ] || exit 4
[ -f "$1" ] || exit 5
[ "$(stat -c %s -- "$1")" -le "$2" ] || exit 6
exec head -c "$(($2 + 1))" -- "$1"
'''
_READ_ERRORS = {3: "is a symlink; refusing to read it", 4: "does not exist",
                5: "is not a regular file; refusing to read it",
                7: "resolves outside remote_dir (a symlink on the way); refusing to read it"}


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


def _feed(source, write, done) -> threading.Thread:
    """Copy `source` to `write` in a thread, then call `done` (end of input)."""
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


def _close(stream) -> None:
    try:
        stream.close()
    except OSError:
        pass


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _stop(proc: subprocess.Popen) -> None:
    """Stop a local command: end its stdin (a guarded command kills its group), then kill."""
    _close(proc.stdin)
    try:
        proc.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def _discard(conn) -> None:
    """Close a connection that failed to open: Fabric's close() does nothing before open()
    succeeded, which would leave Paramiko's socket open (a session half-way through auth)."""
    conn.close()
    conn.client.close()


def _no_delay(sock) -> None:
    """Send small SSH packets at once (TCP_NODELAY, as OpenSSH does): without it every command's
    last packet waits for the peer's delayed ACK, ~40 ms per round trip. A jump host's channel
    (the socket of a connection through a bastion) has no such option: its hop's socket has it."""
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def _pct(value: str) -> str:
    """Escape ssh's %-tokens in a value ssh expands (identity, known_hosts, ProxyCommand)."""
    return value.replace("%", "%%")
