"""Warm connections: an OpenSSH ControlMaster per host that outlives the run, so the next run
skips the handshake (docs/transport.md says why OpenSSH here, and what it costs).

    t = WarmTransport(host, stopped)    # a Transport: each command is an `ssh` over the master
    t.connect()                          # key probed, master reused or started (verified)
    openssh.listing(); openssh.close_all()   # `invoke connections [--close]`

Security model (docs/security.md):
- The master is started with the same key checks as a fresh connection: StrictHostKeyChecking=yes
  against the project known_hosts and the user's (no global file, no DNS, no key updates), or a
  pinned `host_key:` (OpenSSH's KnownHostsCommand answers the pinned key only).
- A master never hides a changed host key: OpenSSH skips key checking on a multiplexed session,
  and an sshd restarted with a new key keeps its old sessions, so every run first probes the
  host's key with a key exchange of its own (no authentication; ~0.1 s) under those same checks.
  A probe that fails makes the run fail exactly as a fresh connection does (the error is the
  Paramiko connection's own), and ends the master.
- The socket's name binds what it was verified against: the host's address, port, user, identity,
  ssh config and pinned key, and the known_hosts files' contents. A changed known_hosts or pin
  (invoke trust, ssh-keygen -R) means another socket, hence a freshly verified master.
- The sockets live in a directory of the user's own (KDTREE_CONTROL_DIR, else
  $XDG_RUNTIME_DIR/kdtree-ssh, else /tmp/kdtree-ssh-UID or, when that one is not the user's
  alone (another user can make that name first), $XDG_CACHE_HOME/kdtree-ssh, by default
  ~/.cache/kdtree-ssh), mode 0700, checked before every use: a directory that is a symlink,
  someone else's, or open to group or others is refused. Two users never share one; OpenSSH
  creates the socket 0600.
- ControlPersist closes a master idle for `persist` seconds (inventory, default 600); `persist:
  false` or --no-persist uses the run's own Paramiko connection and leaves nothing behind.
- A command goes over the socket or fails: it never falls back to a connection of its own
  (ProxyCommand /bin/false behind the socket), so a dead master is a lost connection, as a
  dropped Paramiko connection is. A stale socket (master gone, host rebooted) is found by
  `ssh -O check` before use and replaced. A master checked early (connect_soon) is checked again
  at the first command only when its idle bound could have ended it meanwhile: every client of
  it notes when it starts (`<socket>.used`), so the master's idle time is at most the time since.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

from .. import ownership, remote
from ..errors import ConnectError, HostError, UsageError
from ..inventory import Host
from . import hostkeys
from .local import ProcessTransport
from .paramiko import SshConnection
from .ssh_common import config_file, openssh_config, ssh_rsync_dest

# The probe only verifies the host key, so its key exchange is the fastest the host offers
# (Paramiko's curve25519 first; OpenSSH's post-quantum default costs ~70 ms of CPU a side).
PROBE_KEX = ("curve25519-sha256,curve25519-sha256@libssh.org,ecdh-sha2-nistp256,"
             "sntrup761x25519-sha512@openssh.com,diffie-hellman-group14-sha256")
PROBE_METHOD = "kdtree-key-probe"        # no such authentication method: the probe stops after the key check
CHECK_TIMEOUT = 10                       # seconds for `ssh -O check|exit`: the master answers locally
IDLE_MARGIN = 5                          # seconds: an idle bound this close is not trusted to hold (connect)
START_MARGIN = 2                         # seconds past the connect timeout for an ssh process's own start
MISSING_FROM_MUX = 255
TMP = Path("/tmp")                       # where the control directory is by default (a test may move it)
REMEDY = "Remove it, or set KDTREE_CONTROL_DIR to a directory of yours with mode 0700, or run with --no-persist"


def control_dir(create: bool = True) -> Path:
    """The user's private directory of control sockets (module doc), created 0700 (unless not
    `create`) and checked; UsageError naming the directory and what is wrong with it."""
    if os.environ.get("KDTREE_CONTROL_DIR"):
        path = Path(os.environ["KDTREE_CONTROL_DIR"])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "kdtree-ssh"
    else:
        return _default_dir(create)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    check_private(path)
    return path


def _default_dir(create: bool) -> Path:
    """/tmp/kdtree-ssh-UID when it is the user's alone; else (anyone can make that name first in
    /tmp: another user's `mkdir -m700` would stop every warm run) a folder of the user's cache,
    which nobody else can make or enter; UsageError saying what is wrong with both."""
    shared = TMP / f"kdtree-ssh-{os.geteuid()}"
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(shared, 0o700)
    taken = _not_private(shared)
    if taken is None:
        return shared
    try:
        own = ownership.cache_home() / "kdtree-ssh"
        ownership.private_dir(own, "control socket directory") if create else ownership.check_local_dir(own)
        why = _not_private(own)
    except (OSError, RuntimeError, UsageError) as e:
        why = getattr(e, "message", None) or str(e)
    if why:
        raise UsageError(f"no private directory for the control sockets: {taken}, and {why}: refusing to keep "
                         f"connections there. {REMEDY}")
    return own


def check_private(path: Path) -> None:
    """Refuse a socket directory that another user could reach into (module doc)."""
    why = _not_private(path)
    if why:
        raise UsageError(f"the control socket directory {why}: refusing to keep connections there. {REMEDY}")


def _not_private(path: Path) -> str | None:
    """What makes `path` no private socket directory (`PATH is owned by uid N, ...`), or None."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path} cannot be used: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return f"{path} is open to group or others (mode {stat.S_IMODE(st.st_mode):04o}, not 0700)"
    return None


def uses_warm(host: Host) -> bool:
    """Whether the host's connection is kept warm: persist on and reached directly (a jump host
    or a ProxyCommand is verified by another ssh process than ours: those keep Paramiko's), and
    this machine has OpenSSH's client."""
    if host.is_local or not host.persist or not shutil.which("ssh"):
        return False            # no OpenSSH client on this machine: Paramiko needs none
    found = openssh_config(host)
    return found.get("proxyjump", "none") == "none" and found.get("proxycommand", "none") == "none" \
        and not host.jump and not hostkeys.pin_contradicted(host, found)


class WarmTransport(ProcessTransport):
    """Commands run as `ssh` clients of the host's warm master (module doc)."""

    def __init__(self, host: Host, stopped: threading.Event | None = None):
        super().__init__(host, stopped)
        self._ready = False
        self._lock = threading.Lock()
        self.socket: Path | None = None

    def connect(self) -> None:
        early = self._await_early()
        with self._lock:
            if self._ready and early and self.socket is not None and not _idle_bound_far(self.host, self.socket) \
                    and not master_alive(self.socket):
                self._ready = False     # its idle bound ended it while the run started: connect again
            if self._ready:
                return
            self._refuse_if_stopped()
            self.socket = socket_path(self.host)
            ensure_master(self.host, self.socket, self.stopped)
            self._ready = True

    def argv(self, command: str) -> list[str]:
        self.connect()
        assert self.socket is not None
        _note_use(self.socket)
        return client_argv(self.host, self.socket) + ["--", command]

    def rsync_dest(self, path: str) -> str:
        return ssh_rsync_dest(self.host, path)

    def own_rsync_shell(self, connect: bool = True) -> str | None:
        """rsync's `-e`: an ssh client of the master, never a connection of its own (connect=False:
        the line alone, for --dry-run)."""
        if connect:
            self.connect()
            assert self.socket is not None
            _note_use(self.socket)
        return remote.quote(client_argv(self.host, self.socket or socket_path(self.host))[:-1])   # rsync adds the host

    def _exec(self, command, stdin, sink, deadline):
        code = super()._exec(command, stdin, sink, deadline)
        if code == MISSING_FROM_MUX and self.socket is not None and not master_alive(self.socket):
            raise ConnectError("connection lost while running a command (the warm connection ended)",
                               host=self.host.name, command=command, retry=False)
        return code


def socket_path(host: Host) -> Path:
    """The host's control socket: its name hashes what the master was verified against (module doc)."""
    found = openssh_config(host)
    files = [Path(f) for f in hostkeys.known_hosts_files(host.known_hosts)]
    config = config_file() or ""
    parts = [str(os.geteuid()), str(host.address), found["hostname"], found["port"], found["user"],    # ssh -G prints these
             host.identity or "", " ".join(found.get("identityfile", "").split()),
             host.host_key or "", config, _content(Path(config)) if config else ""]
    parts += [f"{f}={_content(f)}" for f in files]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    return control_dir() / f"{digest}.sock"


def ensure_master(host: Host, sock: Path, stopped: threading.Event) -> None:
    """Reuse the host's live master after probing the key, or replace a stale one and start a
    master (each verifies the key); the error of a fresh connection when the key check fails."""
    with _locked(sock):
        probe = _Probe(host) if sock.is_socket() else None     # a key exchange while ssh -O check asks the master
        if master_alive(sock):
            assert probe is not None            # master_alive: the socket exists
            if probe.accepted():
                return
            stop_master(sock)
            _fresh_error(host, stopped, "the host key probe failed")
        if probe is not None:
            probe.cancel()
        _remove_stale(sock)
        _note_use(sock)                 # a new master is idle from its start
        error = _start_master(host, sock)
        if error is None:
            _describe(host, sock)
            return
        _fresh_error(host, stopped, error)
        error = _start_master(host, sock)       # the fresh connection worked: the host was restarting
        if error is not None:
            raise ConnectError(f"ssh could not start a warm connection: {error} (persist: false or "
                               f"--no-persist uses the run's own connection)", host=host.name, retry=False)
        _describe(host, sock)


def master_alive(sock: Path) -> bool:
    """Whether a master answers on the socket (`ssh -O check`)."""
    if not sock.is_socket():
        return False
    return _control(sock, "check")[0]


def stop_master(sock: Path) -> None:
    """End the master on the socket (`ssh -O exit`) and remove what it leaves."""
    if sock.is_socket():
        _control(sock, "exit")
    _remove_stale(sock)


def listing() -> list[dict]:
    """The warm connections of this user: host, where, idle bound, alive (pid) or stale."""
    rows = []
    for info in sorted(control_dir().glob("*.json")):
        sock = info.with_suffix(".sock")
        meta = _read_meta(info)
        alive, said = _control(sock, "check") if sock.is_socket() else (False, "")
        rows.append({**meta, "socket": str(sock), "alive": alive,
                     "state": said.strip() if alive else "gone (stale entry)"})
    return rows


def close_all() -> int:
    """End every warm connection of this user and remove stale entries; how many were ended."""
    ended = 0
    for info in sorted(control_dir().glob("*.json")):
        sock = info.with_suffix(".sock")
        if master_alive(sock):
            ended += 1
        stop_master(sock)
        info.unlink(missing_ok=True)
        sock.with_suffix(".lock").unlink(missing_ok=True)
        sock.with_suffix(".used").unlink(missing_ok=True)
    return ended


# -- ssh command lines -----------------------------------------------------------------------------
def _base_argv(host: Host) -> list[str]:
    """ssh with the orchestrator's key checks (hostkeys.openssh_options: the policy paramiko.py
    applies) and nothing else taken from the ssh config that could weaken them."""
    config = config_file()
    argv = ["ssh"] + (["-F", config] if config else [])
    options = {"BatchMode": "yes", **hostkeys.openssh_options(host),
               "ClearAllForwardings": "yes", "ForwardAgent": "no", "ForwardX11": "no",
               "PermitLocalCommand": "no", "RequestTTY": "no", "LogLevel": "ERROR",
               "ConnectTimeout": str(int(max(1, host.timeout("connect")))),
               "ServerAliveInterval": str(int(max(1, host.timeout("keepalive")))), "ServerAliveCountMax": "3"}
    for key, value in options.items():
        argv += ["-o", f"{key}={value}"]
    argv += ["-p", str(host.port)] if host.port else []
    argv += ["-l", host.user] if host.user else []
    argv += ["-i", host.identity] if host.identity else []
    return argv


def client_argv(host: Host, sock: Path) -> list[str]:
    """An ssh client of the master only: without the socket it cannot connect at all."""
    return _base_argv(host) + ["-o", "ControlMaster=no", "-o", f"ControlPath={sock}",
                               "-o", "ProxyCommand=/bin/false", "-T", str(host.address)]


def _control(sock: Path, op: str) -> tuple[bool, str]:
    """`ssh -O op` to the master on `sock`: whether it said yes (a master that does not answer
    within CHECK_TIMEOUT says no), and what it said."""
    argv = ["ssh", "-o", f"ControlPath={sock}", "-O", op, "kdtree-warm"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, ""
    return proc.returncode == 0, proc.stderr


def _start_master(host: Host, sock: Path) -> str | None:
    """Start a master in the background (ssh -f after authentication); None, or ssh's error."""
    argv = _base_argv(host) + ["-M", "-N", "-f", "-o", f"ControlPath={sock}", "-o", "ControlMaster=yes",
                               "-o", f"ControlPersist={int(host.persist)}", str(host.address)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=host.timeout("connect") + START_MARGIN)    # a handshake's bound (paramiko.py)
    except subprocess.TimeoutExpired:
        return f"no connection within {host.timeout('connect')} s"
    return None if proc.returncode == 0 else (proc.stderr.strip()[-500:] or f"ssh exited {proc.returncode}")


class _Probe:
    """The host's key probed now, in the background: a key exchange of its own under the same
    checks as a master's, stopped before authentication (no such method)."""

    def __init__(self, host: Host):
        argv = _base_argv(host) + ["-o", "ControlPath=none", "-o", f"KexAlgorithms={PROBE_KEX}",
                                   "-o", f"PreferredAuthentications={PROBE_METHOD}", str(host.address), "true"]
        self._limit = host.timeout("connect") + START_MARGIN      # a handshake's bound, as a master's
        found = openssh_config(host)
        # ssh's own words when it gives up for want of a method, which it says only after the key
        # checks passed: `user@host: Permission denied (publickey).` (its stderr lines end in \r\n)
        self._refusal = re.compile(re.escape(f"{found['user']}@{found['hostname']}") +
                                   r": Permission denied \([^\r\n]*\)\.\r\n")
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE)

    def accepted(self) -> bool:
        """Whether the host offered a key the checks accept: ssh gave up for want of an
        authentication method, saying only that (0: a host that wants no authentication). A
        host's own text reaches ssh's stderr only after ssh's words on that line ("Received
        disconnect from ...: Permission denied (publickey)", sent before any key exchange, even
        with a line break of its own in it), so anything more than ssh's one line is no acceptance."""
        try:
            _, err = self._proc.communicate(timeout=self._limit)
        except subprocess.TimeoutExpired:
            self.cancel()
            return False
        text = err.decode("utf-8", errors="replace")
        return self._proc.returncode == 0 or \
            self._proc.returncode == 255 and self._refusal.fullmatch(text) is not None

    def cancel(self) -> None:
        """Stop it (no master to vouch for: a new one verifies the key itself)."""
        self._proc.kill()
        self._proc.communicate()


def _fresh_error(host: Host, stopped: threading.Event, why: str) -> None:
    """Raise what a fresh (Paramiko) connection raises now: the same error, the same words, the
    same retries as without warm connections. Returns when that connection succeeds."""
    try:
        SshConnection.open(host, stopped).close()
    except HostError:
        raise
    except Exception as e:      # noqa: BLE001 - anything else is still this host's failure
        raise ConnectError(f"{why}: {e}", host=host.name, retry=False) from None


def _content(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "-"


def _remove_stale(sock: Path) -> None:
    """Remove a socket no master answers on (ours: the directory was checked)."""
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()


@contextlib.contextmanager
def _locked(sock: Path):
    """One run at a time starts or replaces the host's master (two concurrent runs share it)."""
    fd = os.open(sock.with_suffix(".lock"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _note_use(sock: Path) -> None:
    """Note that a client of the master starts now (the `.used` file's time: _idle_bound_far)."""
    fd = os.open(sock.with_suffix(".used"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.utime(fd)
    finally:
        os.close(fd)


def _idle_bound_far(host: Host, sock: Path) -> bool:
    """Whether the master cannot have reached its idle bound yet: a client of it started (or it
    was started) less than `persist` seconds ago, with IDLE_MARGIN to spare; a master's idle time
    counts from its last client's end, which is later. A time ahead of this clock is not trusted."""
    try:
        since = time.time() - os.stat(sock.with_suffix(".used"), follow_symlinks=False).st_mtime
    except OSError:
        return False
    return 0 <= since < float(host.persist) - IDLE_MARGIN


def _describe(host: Host, sock: Path) -> None:
    """Write what `invoke connections` shows of a master (host, where, idle bound)."""
    meta = {"host": host.name, "where": f"{host.user + '@' if host.user else ''}{host.address}"
            f"{':' + str(host.port) if host.port else ''}", "persist": host.persist,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    fd = os.open(sock.with_suffix(".json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f)


def _read_meta(info: Path) -> dict:
    try:
        meta = json.loads(info.read_text())
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return {}
