"""Real OpenSSH sshd hosts on 127.0.0.1 for tests, fault tests and benchmarks.

    lab = SshLab(tmp_dir)                  # a client key, an ssh config, known_hosts files
    h1 = lab.add_host("h1")                # its own sshd: port, host key, remote root, log
    fleet = lab.add_hosts(16, "node")      # node1 .. node16
    bastion = lab.add_host("bastion", log_level="DEBUG1")
    g1 = lab.add_host("g1", setenv={"PATH": f"{fake_bin}:/usr/bin:/bin"})   # a fake nvidia-smi first on its PATH
    lab.inventory_entry(h1, jump="bastion")   # a hosts.yaml entry for it
    with lab.environment(): ...            # KDTREE_SSH_CONFIG / KDTREE_USER_KNOWN_HOSTS set
    h1.stop(); h1.start(); h1.new_host_key(); h1.log()
    lab.close()

Nothing here reads or writes ~/.ssh: the client uses the lab's ssh config (ssh -F, and
$KDTREE_SSH_CONFIG for the orchestrator) and the lab's known_hosts files. Only 127.0.0.1 is used.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def keygen(path: Path) -> Path:
    """A fresh ed25519 key pair at path (and path.pub)."""
    path.unlink(missing_ok=True)
    Path(f"{path}.pub").unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)
    return path


class SshdHost:
    """One sshd process on 127.0.0.1 acting as a host: own port, host key, root dir, log."""

    def __init__(self, lab: "SshLab", name: str, log_level: str = "VERBOSE", setenv: dict | None = None):
        self.lab, self.name = lab, name
        self.dir = lab.dir / name
        self.root = self.dir / "root"           # the host's "disk": remote_dir lives under it
        self.root.mkdir(parents=True, exist_ok=True)
        self.home = self.dir / "home"           # HOME of its sessions: no dotfiles of this machine
        self.home.mkdir(exist_ok=True)
        self.port = free_port()
        self.host_key = keygen(self.dir / "ssh_host_ed25519_key")
        self.log_path = self.dir / "sshd.log"
        self.config = self.dir / "sshd_config"
        self.config.write_text("\n".join([
            f"Port {self.port}", f"ListenAddress {LOOPBACK}", f"HostKey {self.host_key}",
            f"PidFile {self.dir / 'sshd.pid'}", f"AuthorizedKeysFile {lab.authorized_keys}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "PermitRootLogin yes", "StrictModes no", "AllowTcpForwarding yes",
            "MaxSessions 64", "MaxStartups 100", f"LogLevel {log_level}", "Subsystem sftp internal-sftp",
            "SetEnv " + " ".join(f'"{k}={v}"' for k, v in {"HOME": self.home, **(setenv or {})}.items()), ""]))
        self.proc: subprocess.Popen | None = None

    @property
    def known_name(self) -> str:
        return f"[{LOOPBACK}]:{self.port}"

    def known_hosts_line(self) -> str:
        keytype, key = Path(f"{self.host_key}.pub").read_text().split()[:2]
        return f"{self.known_name} {keytype} {key}\n"

    def fingerprint(self) -> str:
        out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", f"{self.host_key}.pub"],
                             check=True, capture_output=True, text=True).stdout
        return out.split()[1]

    def start(self) -> "SshdHost":
        if self.proc is not None and self.proc.poll() is None:
            return self
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config)], stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd {self.name} exited: {self.log()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, self.port), timeout=0.2):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"sshd {self.name} did not listen on {self.port}")

    def stop(self) -> None:
        """Stop the listener (sessions already open are ended too)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def new_host_key(self) -> None:
        """Give the host a different key (as after a reinstall, or an impostor) and restart."""
        keygen(self.host_key)
        self.restart()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class SshLab:
    """A set of loopback sshd hosts with the client-side files to reach them."""

    def __init__(self, base: Path):
        self.dir = Path(base)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.client_key = keygen(self.dir / "client_ed25519")
        self.authorized_keys = self.dir / "authorized_keys"
        shutil.copy(f"{self.client_key}.pub", self.authorized_keys)
        self.ssh_config = self.dir / "ssh_config"
        self.ssh_config.write_text("")
        self.known_hosts = self.dir / "known_hosts"           # the project's pinned keys
        self.user_known_hosts = self.dir / "user_known_hosts"  # stands in for ~/.ssh/known_hosts
        self.known_hosts.write_text("")
        self.user_known_hosts.write_text("")
        self.hosts: dict[str, SshdHost] = {}
        self.control_dir = self.dir / "ctl"       # short: a socket path is at most 107 bytes

    def add_host(self, name: str, *, trusted: bool = True, log_level: str = "VERBOSE",
                 setenv: dict | None = None) -> SshdHost:
        """Start a new sshd host, add its alias to the ssh config and (trusted) its key;
        `setenv`: variables its sessions get (e.g. a PATH with a fake nvidia-smi first)."""
        host = SshdHost(self, name, log_level, setenv).start()
        self.hosts[name] = host
        with open(self.ssh_config, "a") as f:
            f.write(f"Host {name}\n  HostName {LOOPBACK}\n  Port {host.port}\n  User root\n"
                    f"  IdentityFile {self.client_key}\n  IdentitiesOnly yes\n\n")
        if trusted:
            self.trust(host)
        return host

    def add_hosts(self, count: int, prefix: str = "host", **kwargs) -> list[SshdHost]:
        """Start `count` hosts named prefix1, prefix2, ... (as add_host)."""
        return [self.add_host(f"{prefix}{i}", **kwargs) for i in range(1, count + 1)]

    def trust(self, host: SshdHost) -> None:
        with open(self.known_hosts, "a") as f:
            f.write(host.known_hosts_line())

    def untrust(self, host: SshdHost) -> None:
        lines = self.known_hosts.read_text().splitlines(keepends=True)
        self.known_hosts.write_text("".join(l for l in lines if not l.startswith(host.known_name + " ")))

    def env(self) -> dict[str, str]:
        """The orchestrator's environment for the lab: its ssh config, its user known_hosts, and
        a control socket directory of its own (warm connections; ended by close())."""
        return {"KDTREE_SSH_CONFIG": str(self.ssh_config), "KDTREE_USER_KNOWN_HOSTS": str(self.user_known_hosts),
                "KDTREE_CONTROL_DIR": str(self.control_dir)}

    @contextlib.contextmanager
    def environment(self):
        saved = {k: os.environ.get(k) for k in self.env()}
        os.environ.update(self.env())
        try:
            yield self
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def ssh_argv(self, host: SshdHost, command: str) -> list[str]:
        """System ssh running a command on a host (a client process of its own, for tests)."""
        return ["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}", host.name, command]

    def ssh(self, host: SshdHost, command: str, **kwargs) -> subprocess.CompletedProcess:
        """Run a command on a host with system ssh (for checks made by tests)."""
        return subprocess.run(self.ssh_argv(host, command), capture_output=True, text=True, timeout=60, **kwargs)

    def inventory_entry(self, host: SshdHost, **overrides) -> dict:
        """A hosts.yaml entry for `host`: its alias, its remote_dir under its root, the lab's keys;
        no warm connection unless `persist` is given (tests/connectors/test_warm.py tests those)."""
        entry = {"address": host.name, "remote_dir": str(host.root / "kdtree-engine"), "python": sys.executable,
                 "known_hosts": str(self.known_hosts), "timeouts": {"connect": 5, "keepalive": 5}, "persist": False}
        entry.update(overrides)
        return entry

    def end_masters(self) -> None:
        """End every warm connection (ControlMaster) started under the lab's control directory."""
        for sock in self.control_dir.glob("*.sock") if self.control_dir.is_dir() else ():
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "lab"], capture_output=True, timeout=10)

    def close(self) -> None:
        self.end_masters()
        for host in self.hosts.values():
            host.stop()


class Hostile:
    """A listener on 127.0.0.1 (at `port`, or a free one) that plays a broken SSH server, one
    connection at a time: `how` (socket) -> None runs on each accepted connection; the connections
    stay open until the end."""

    def __init__(self, how, port: int = 0):
        self.server = socket.create_server(("127.0.0.1", port))
        self.port, self.how, self.open = self.server.getsockname()[1], how, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.open.append(conn)
            threading.Thread(target=self.how, args=(conn,), daemon=True).start()

    def close(self):
        for conn in [self.server, *self.open]:
            conn.close()
