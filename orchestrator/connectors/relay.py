"""rsync over the run's own SSH connection: one connection per host per run, no second handshake.

    with relay.rsync_shell(transport) as rsh:      # None: rsync reaches the host its own way
        argv = sync.rsync_argv(transport, project, rsh=rsh)

A deploy used to open two connections per host: Paramiko's, reused by every command, and the
system ssh that rsync starts (a full key exchange and authentication: ~0.3 s on loopback with
OpenSSH's default post-quantum key exchange, as long as everything else the deploy does on the
host). Here rsync's remote shell (`-e`) is rsh_helper.py, which hands rsync's remote command to
this process through a Unix socket; the command runs on the host in a session of the Paramiko
connection, whose host key was verified (RejectPolicy, known_hosts, host_key:) when it opened,
and through the same jump hosts.

Who can use the relay: the socket lives in a fresh 0700 directory (mkdtemp), removed as soon as
rsync's helper has connected (one connection per transfer), the peer must be this user
(SO_PEERCRED), and only rsync's server command
(`RSYNC --server ...`, RSYNC being rsync or the host's rsync_path) is accepted.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import struct
import sys
import tempfile
import threading
from pathlib import Path

from .. import remote
from ..errors import ConnectError
from .base import Transport
from .paramiko import SshTransport

HELPER = Path(__file__).with_name("rsh_helper.py")
CHUNK = 64 * 1024
COMMAND_MAX = 64 * 1024
_OPTION_WORD = re.compile(r"[A-Za-z0-9._=,/+-]+")


def helper_argv(socket_path: str) -> list[str]:
    """rsync's remote shell: the helper, started without site packages (fast), and the socket."""
    return [sys.executable, "-I", "-S", str(HELPER), socket_path]


def allowed(command: str, rsync_path: str | None) -> bool:
    """Whether `command` is the rsync server command rsync asks for and nothing else: the program
    (rsync, or the host's rsync_path as sync.rsync_argv quotes it), --server, then only option
    words (with --protect-args, paths and excludes travel inside rsync's protocol, not here)."""
    program = remote.quote([rsync_path]) if rsync_path else "rsync"
    if not command.startswith(program + " --server "):
        return False
    return all(_OPTION_WORD.fullmatch(word) for word in command[len(program) + 1:].split(" "))


def dry_run_shell(transport: Transport) -> str | None:
    """rsync_shell's value as --dry-run shows it (the private directory is made when it runs)."""
    own = transport.own_rsync_shell(connect=False)
    if own is not None:
        return own
    if not isinstance(transport, SshTransport):
        return None
    return remote.quote(helper_argv(os.path.join(tempfile.gettempdir(), "kdtree-rsh-XXXXXXXX", "s")))


@contextlib.contextmanager
def rsync_shell(transport: Transport):
    """rsync's `-e` value (a command line) that runs rsync's remote side over the transport's own
    connection, while the block lasts; None for a transport without one (local: no remote shell).
    A warm connection (openssh.py) is used by rsync's ssh directly, with no relay."""
    own = transport.own_rsync_shell()
    if own is not None:
        yield own
        return
    if not isinstance(transport, SshTransport):
        yield None
        return
    conn = transport.connection
    if conn is None or not conn.is_connected:
        # never reconnect here: the host lock was taken over this connection and died with it
        raise ConnectError("the connection to the host was lost before the transfer (its lock with it)",
                           host=transport.host.name, retry=False)
    relay = _Relay(transport)
    try:
        yield remote.quote(helper_argv(relay.path))
    finally:
        relay.close()


class _Relay:
    def __init__(self, transport: SshTransport):
        self.transport = transport
        self.dir = tempfile.mkdtemp(prefix="kdtree-rsh-")          # 0700, ours alone
        self.path = os.path.join(self.dir, "s")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self.listener.listen(4)
        self._channels: list = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        for chan in self._channels:
            with contextlib.suppress(Exception):
                chan.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _accept(self) -> None:
        """rsync starts its remote shell once: after the first connection the socket and its
        directory go at once, so nothing is left behind even if this process is then killed."""
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        with contextlib.suppress(OSError):
            self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        self._serve(client)

    def _serve(self, client: socket.socket) -> None:
        with client:
            try:
                uid = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
                if uid != os.getuid():
                    return
                command = self._read_command(client)
                if command is None or not allowed(command, self.transport.host.rsync_path):
                    _frame(client, b"e", f"kdtree rsh relay: refusing {shlex.quote(command or '')[:200]}\n".encode())
                    _frame(client, b"x", struct.pack(">i", 255))
                    return
                self._run(client, command)
            except Exception as e:        # the helper reports 255; rsync says what failed
                with contextlib.suppress(OSError):
                    _frame(client, b"e", f"kdtree rsh relay: {type(e).__name__}: {e}\n".encode())
                    _frame(client, b"x", struct.pack(">i", 255))

    @staticmethod
    def _read_command(client: socket.socket) -> str | None:
        head = _recv_exactly(client, 4)
        if head is None:
            return None
        size = struct.unpack(">I", head)[0]
        if size > COMMAND_MAX:
            return None
        data = _recv_exactly(client, size)
        return data.decode(errors="replace") if data is not None else None

    def _run(self, client: socket.socket, command: str) -> None:
        connection = self.transport.connection
        assert connection is not None                   # the relay runs on an open connection
        ssh = connection.paramiko                       # the verified Paramiko connection
        chan = ssh.open_session(timeout=self.transport.host.timeout("connect"))
        self._channels.append(chan)
        with chan:
            chan.exec_command(command)
            threading.Thread(target=_to_channel, args=(client, chan), daemon=True).start()
            while True:
                got = False
                while chan.recv_ready():
                    data = chan.recv(CHUNK)
                    if not data:
                        break
                    _frame(client, b"o", data)
                    got = True
                while chan.recv_stderr_ready():
                    _frame(client, b"e", chan.recv_stderr(CHUNK))
                    got = True
                if got:
                    continue
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if chan.closed or not ssh.is_active():
                    break
                chan.status_event.wait(0.05) if chan.eof_received else _wait_readable(chan, 0.5)
            status = chan.recv_exit_status() if chan.exit_status_ready() else -1
        _frame(client, b"x", struct.pack(">i", status if 0 <= status < 256 else 255))


def _to_channel(client: socket.socket, chan) -> None:
    """The helper's stdin (rsync's output to the host) to the channel; its end is the channel's EOF."""
    try:
        while True:
            data = client.recv(CHUNK)
            if not data:
                break
            chan.sendall(data)
    except (OSError, EOFError):
        pass
    with contextlib.suppress(Exception):
        chan.shutdown_write()


def _wait_readable(chan, timeout: float) -> None:
    import select
    select.select([chan], [], [], timeout)


def _frame(client: socket.socket, kind: bytes, payload: bytes) -> None:
    client.sendall(kind + struct.pack(">I", len(payload)) + payload)


def _recv_exactly(client: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = client.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data
