"""Connecting: one verified SSH connection to a host, with plain Paramiko (docs/transport.md says why).

    conn = SshConnection.open(host, stopped)   # jump hosts first, every host key verified
    conn.paramiko                              # the Paramiko Transport commands open sessions on
    conn.server_key(); conn.lost; conn.close()

The ssh config is honoured as OpenSSH reads it (ssh_common.paramiko_config): HostName, Port, User,
IdentityFile, ProxyJump, ProxyCommand. Host keys
are checked against the project's known_hosts files with RejectPolicy (hostkeys.verify_policy): an
unknown key stops the connection before authentication, a changed one is refused, and a key
other than a pinned `host_key:` is refused as soon as the key exchange ends (hostkeys.pinned_transport),
before known_hosts is even consulted or a credential offered. A refused or
reset connection (sshd restarting) is retried with backoff while the connect timeout lasts; a
timeout, a host key or an authentication failure never is. A keepalive watchdog closes a
connection whose host stops answering, so every command on it fails at once.
"""
from __future__ import annotations

import contextlib
import getpass
import itertools
import socket
import threading
import time
from typing import Any

from ..errors import AuthError, ConnectError, HostError
from ..inventory import Host
from . import hostkeys
from .base import CHUNK, STOP_GRACE, Transport, feed, remaining
from .ssh_common import hop_parts, jump_hops, paramiko_config, ssh_rsync_dest

CONNECT_BACKOFF = 0.5           # seconds before the 2nd attempt, doubling; retries stop at the connect timeout
KEEPALIVE_COUNT = 3             # a host that answers no keepalive for interval * count is gone


class SshConnection:
    """An open connection to one host, through its jump hosts, its keys verified."""

    def __init__(self, host: Host, client, hops: list, known_name: str):
        self.host, self.client, self.hops, self.known_name = host, client, hops, known_name
        self.lost: str | None = None        # why the keepalive watchdog closed it

    @classmethod
    def open(cls, host: Host, stopped: threading.Event) -> "SshConnection":
        """Connect (retrying a refused or reset connection with backoff within the connect
        timeout); HostError of the right kind when it cannot, or once `stopped` is set."""
        start, delay = time.monotonic(), CONNECT_BACKOFF
        for attempt in itertools.count(1):
            if stopped.is_set():
                raise HostError("the run was interrupted", host=host.name)
            try:
                return _open_once(host)
            except ConnectError as e:
                left = start + host.timeout("connect") - time.monotonic()
                if not e.retry or left <= 0:
                    if attempt == 1:
                        raise
                    raise ConnectError(f"{e.message} ({attempt} attempts in {time.monotonic() - start:.1f} s)",
                                       host=host.name, retry=False, timed_out=e.timed_out) from None
                time.sleep(min(delay, left))
                delay *= 2
        raise AssertionError("unreachable")

    @property
    def paramiko(self):
        """The Paramiko Transport of the connection."""
        return self.client.get_transport()

    @property
    def is_connected(self) -> bool:
        transport = self.paramiko
        return transport is not None and transport.is_active()

    def server_key(self) -> tuple[str, object]:
        """The verified host key: (known_hosts name, Paramiko key)."""
        return self.known_name, self.paramiko.get_remote_server_key()

    def close(self) -> None:
        """Close the connection and its jump hosts' (the last hop first)."""
        for client in [self.client, *reversed(self.hops)]:
            client.close()

    def watch(self) -> None:
        """Start the keepalive watchdog (ssh's ServerAliveCountMax; Paramiko's own keepalive never
        waits for an answer): every `keepalive` seconds ask the host for a reply; when none comes
        within KEEPALIVE_COUNT intervals (a hung host, a dead network), close the connection."""
        transport, interval = self.paramiko, self.host.timeout("keepalive")
        transport.set_keepalive(int(interval))

        def run() -> None:
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
                    self.lost = f"the host answered no keepalive for {interval * KEEPALIVE_COUNT:g} s"
                    transport.close()
                    return
        threading.Thread(target=run, daemon=True).start()


def _open_once(host: Host) -> SshConnection:
    """Open the jump hosts' connections in order, then the host's through them."""
    import paramiko
    config = paramiko_config()
    found = config.lookup(host.address)
    hops = jump_hops(host, found)
    chain = [_Target.of(config, *hop_parts(hop), host.identity) for hop in hops]
    chain.append(_Target.of(config, str(host.address), host.user, host.port, host.identity))
    proxy = found.get("proxycommand", "none")
    sock = paramiko.ProxyCommand(proxy) if not hops and proxy.lower() != "none" else None
    clients: list = []
    try:
        for i, target in enumerate(chain):
            last = i == len(chain) - 1
            clients.append(_connect(host, target, sock, host.host_key if last else None, hop=not last))
            if not last:
                sock = _channel(host, clients[-1], target, chain[i + 1])
        target, client = chain[-1], clients.pop()
        name = hostkeys.known_name(target.hostname, target.port)
    except HostError:
        for opened in reversed(clients):
            opened.close()
        raise
    connection = SshConnection(host, client, clients, name)
    connection.watch()
    return connection


class _Target:
    """Where one connection goes, as the ssh config resolves an alias."""

    def __init__(self, alias: str, hostname: str, port: int, user: str, key_files: list[str]):
        self.alias, self.hostname, self.port, self.user, self.key_files = alias, hostname, port, user, key_files

    @classmethod
    def of(cls, config, alias: str, user: str | None, port: int | None, identity: str | None) -> "_Target":
        """The inventory's values first, then the ssh config's, then ssh's defaults."""
        found = config.lookup(alias)
        keys = ([identity] if identity else []) + list(found.get("identityfile", []))
        return cls(alias, found["hostname"], int(port or found.get("port", 22)),    # lookup's default: alias
                   user or found.get("user") or getpass.getuser(), keys)

    @property
    def where(self) -> str:
        return f"{self.hostname}:{self.port}"


def _connect(host: Host, target: _Target, sock, pinned: str | None, hop: bool):
    """One Paramiko client connected and authenticated to `target` (over `sock`: a jump host's
    channel or a ProxyCommand). Its key is checked after the key exchange and before any
    credential is offered: against the `pinned` fingerprint if any, and against the known_hosts
    files (a key they list for the host must match; one they do not list must be pinned)."""
    import paramiko
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(hostkeys.verify_policy(host.name, pinned, hop))
    factory = hostkeys.pinned_transport(host.name, hostkeys.known_name(target.hostname, target.port), pinned) \
        if pinned else None
    for file in hostkeys.known_hosts_files(host.known_hosts):
        if file.is_file():
            client.get_host_keys().load(str(file))
    timeout = host.timeout("connect")
    start = time.monotonic()
    try:
        client.connect(target.hostname, target.port, target.user, key_filename=target.key_files or None,
                       timeout=timeout, sock=sock, banner_timeout=timeout, auth_timeout=timeout,
                       transport_factory=factory)
    except HostError:
        client.close()
        raise
    except Exception as e:
        client.close()
        raise _connect_error(host, target, e, time.monotonic() - start) from None
    _no_delay(client.get_transport().sock)
    return client


def _channel(host: Host, client, hop: _Target, target: _Target):
    """A channel through the jump host `hop` to `target` (ssh -W): the next connection's socket."""
    start = time.monotonic()
    try:
        return client.get_transport().open_channel("direct-tcpip", (target.hostname, target.port), ("", 0),
                                                   timeout=host.timeout("connect"))
    except Exception as e:
        error = _connect_error(host, target, e, time.monotonic() - start)
        raise ConnectError(f"{error.message} (through jump host {hop.where})", host=host.name,
                           retry=isinstance(error, ConnectError) and error.retry, timed_out=error.timed_out) from None


def _connect_error(host: Host, target: _Target, e: Exception, elapsed: float = 0.0) -> HostError:
    """A connection failure as the HostError of its kind (retry: only a transient one)."""
    import paramiko
    where, timeout = target.where, host.timeout("connect")
    if isinstance(e, paramiko.BadHostKeyException):
        name = hostkeys.known_name(e.hostname, target.port)
        return hostkeys.changed(host.name, name, e.key, hostkeys.fingerprint(e.expected_key), "known_hosts")
    if isinstance(e, paramiko.AuthenticationException):
        return AuthError(f"authentication to {where} as {target.user} failed: {e}", host=host.name)
    if isinstance(e, socket.gaierror):
        return ConnectError(f"cannot reach {where}: {e.strerror or e}", host=host.name, retry=False)
    if isinstance(e, (socket.timeout, TimeoutError)):
        return ConnectError(f"cannot reach {where}: timed out after {timeout} s", host=host.name, retry=False,
                            timed_out=True)
    if isinstance(e, paramiko.SSHException) and (isinstance(e.__context__, (socket.timeout, TimeoutError))
                                                  or elapsed >= timeout - 0.5):
        # the TCP connection opened but the host said nothing in time (a hung sshd): not
        # transient, and retrying would multiply the wait
        return ConnectError(f"cannot reach {where}: no SSH answer within {timeout} s "
                            f"(sshd hung or not an SSH server: {e})", host=host.name, retry=False)
    if isinstance(e, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionError, EOFError,
                      paramiko.SSHException, OSError)):
        return ConnectError(f"cannot reach {where}: {e}", host=host.name, retry=True)
    return ConnectError(f"cannot connect to {where}: {type(e).__name__}: {e}", host=host.name, retry=False)


def _no_delay(sock) -> None:
    """Send small SSH packets at once (TCP_NODELAY, as OpenSSH does): without it every command's
    last packet waits for the peer's delayed ACK, ~40 ms per round trip. A jump host's channel
    (the socket of a connection through a bastion) has no such option: its hop's socket has it."""
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class SshTransport(Transport):
    """Commands run in sessions of one verified Paramiko connection to the host (SshConnection),
    opened on first use and reused by every command (and by rsync, through relay.py)."""

    def __init__(self, host: Host, stopped: threading.Event | None = None):
        super().__init__(host, stopped)
        self.connection: SshConnection | None = None
        self._lock = threading.Lock()
        self._running: set[Any] = set()         # the channels of the commands running now

    def connect(self) -> None:
        self._await_early()
        with self._lock:
            if self.connection is not None and self.connection.is_connected:
                return
            self._refuse_if_stopped()
            self.connection = SshConnection.open(self.host, self.stopped)

    def close(self) -> None:
        """Stop the commands still running, as ProcessTransport does: their stdin ends at once (a
        guarded command stops its step and cleans up), and they get STOP_GRACE seconds together to
        end; then close the connection."""
        with self._lock:
            running, connection = list(self._running), self.connection
        for chan in running:
            try:
                chan.shutdown_write()
            except Exception:       # a channel or connection closed meanwhile: nothing to stop
                pass
        if connection is not None and connection.is_connected:
            deadline = time.monotonic() + STOP_GRACE
            for chan in running:
                chan.status_event.wait(max(deadline - time.monotonic(), 0))
        with self._lock:
            if self.connection is not None:
                self.connection.close()
            self.connection = None

    def server_key(self) -> tuple[str, Any]:
        """The verified host key of the connection: (known_hosts name, Paramiko key)."""
        self.connect()
        assert self.connection is not None         # connect() opened it
        return self.connection.server_key()

    def rsync_dest(self, path: str) -> str:
        return ssh_rsync_dest(self.host, path)

    def _exec(self, command, stdin, sink, deadline):
        self.connect()
        with self._lock:
            connection = self.connection
        if connection is None:          # closed since: a stopped run's transport
            self._refuse_if_stopped()
            raise ConnectError("the connection was closed", host=self.host.name, retry=False)
        transport = connection.paramiko
        try:
            chan = transport.open_session(timeout=self.host.timeout("connect"))
        except Exception as e:
            raise ConnectError(f"cannot open a session: {e}", host=self.host.name, retry=False) from None
        with self._lock:
            self._running.add(chan)
        try:
            return self._command(connection, chan, command, stdin, sink, deadline)
        finally:
            with self._lock:
                self._running.discard(chan)
            with contextlib.suppress(EOFError, OSError):     # the connection was closed meanwhile (a stop)
                chan.close()

    def _command(self, connection: SshConnection, chan, command, stdin, sink, deadline):
        """Run `command` in the open session `chan` of `connection`: its output to `sink`; its
        exit status, None when `deadline` passed first."""
        transport = connection.paramiko
        chan.set_combine_stderr(True)
        chan.exec_command(command)
        if stdin:       # otherwise stdin stays open until the channel closes (remote.GUARD)
            feed(stdin, chan.sendall, chan.shutdown_write)
        while True:
            wait = remaining(deadline)
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
            wait = remaining(deadline)
            if not transport.is_active() or (wait is not None and wait <= 0):
                break
        # no exit status, or Paramiko's -1 of a channel closed with its connection: the host is lost
        code = chan.recv_exit_status() if chan.exit_status_ready() else None
        if code is None and transport.is_active():
            return None
        if code is None or code < 0:
            raise ConnectError("connection lost while running a command" + (f": {connection.lost}" if connection.lost else ""),
                               host=self.host.name, command=command, retry=False)
        return code
