"""The one ssh-config resolution of both SSH connectors: which config files are read
(config_file: $KDTREE_SSH_CONFIG alone, else the user's and the system's), how a host resolves
through them (its jump hosts, the address this machine must resolve), and its rsync destination.

Each connector reads those files with the reader of the program that connects, so that the host
whose key is verified is the one it connects to: Paramiko's SSHConfig for paramiko.py (which needs
no OpenSSH client: paramiko_config), `ssh -G` for openssh.py (OpenSSH's own reading: openssh_config).
"""
from __future__ import annotations

import functools
import os
import socket
import subprocess
from pathlib import Path

from ..errors import ConnectError
from ..inventory import Host

SYSTEM_SSH_CONFIG = "/etc/ssh/ssh_config"
OPENSSH_TIMEOUT = 10    # seconds for `ssh -G`, which reads files and connects nowhere


def ssh_rsync_dest(host: Host, path: str) -> str:
    """`path` on an ssh host as rsync's destination (an IPv6 address in brackets)."""
    address = host.address
    assert address is not None                 # the inventory gives every ssh host one
    address = f"[{address}]" if ":" in address else address
    return f"{address}:{path}"


def config_file() -> str | None:
    """The ssh config both connectors read instead of ~/.ssh/config and /etc/ssh/ssh_config
    ($KDTREE_SSH_CONFIG), or None."""
    return os.environ.get("KDTREE_SSH_CONFIG") or None


def paramiko_config():
    """The ssh config as OpenSSH reads it, read by Paramiko (for paramiko.py, which needs no OpenSSH
    client): config_file() alone, else ~/.ssh/config then /etc/ssh/ssh_config (the first value
    found for a key wins)."""
    import paramiko
    config = paramiko.SSHConfig()
    files = [config_file()] if config_file() else [str(Path("~/.ssh/config").expanduser()), SYSTEM_SSH_CONFIG]
    for path in files:
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                config.parse(f)
    return config


def openssh_config(host: Host) -> dict[str, str]:
    """What the ssh config makes of the host as OpenSSH reads it (`ssh -G`): for openssh.py, whose
    ssh connects to what this names."""
    try:
        return dict(_read_ssh_config(str(host.address), host.port, host.user, config_file()))
    except ValueError as e:
        raise ConnectError(f"ssh -G cannot read the ssh config for {host.address}: {e}", host=host.name,
                           retry=False) from None


@functools.lru_cache(maxsize=1024)
def _read_ssh_config(address: str, port: int | None, user: str | None, config: str | None) -> tuple:
    """`ssh -G`'s answer as (key, value) pairs, read once per process (openssh.uses_warm, the socket name and the key probe ask)."""
    argv = ["ssh", "-G"] + (["-F", config] if config else [])
    argv += (["-p", str(port)] if port else []) + (["-l", user] if user else [])
    proc = subprocess.run(argv + [address], capture_output=True, text=True, timeout=OPENSSH_TIMEOUT)
    if proc.returncode != 0:
        raise ValueError(proc.stderr.strip()[-300:])
    found: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "identityfile" and key in found:
            found[key] += " " + value
        else:
            found.setdefault(key, value)
    return tuple(found.items())


def jump_hops(host: Host, found: dict | None = None) -> list[str]:
    """The jump hosts in order (first hop first): `jump:` or the ssh config's ProxyJump."""
    if host.jump:
        return host.jump.split(",")
    found = paramiko_config().lookup(host.address) if found is None else found
    jump = found.get("proxyjump", "none")
    return [] if jump.lower() == "none" else jump.split(",")


def hop_parts(hop: str) -> tuple[str, str | None, int | None]:
    """`[user@]host[:port]` -> (host, user, port)."""
    user, _, rest = hop.rpartition("@")
    alias, _, port = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
    return alias, user or None, int(port) if port else None


def resolve_address(host: Host) -> str | None:
    """Why this machine cannot resolve the address it would connect to for `host` (its ssh
    config HostName, or its first jump host's), or None when it can (or needs not: `local`, or a
    ProxyCommand, which finds the host its own way)."""
    if host.is_local:
        return None
    config = paramiko_config()
    found = config.lookup(host.address)
    hops = jump_hops(host, found)
    if hops:
        alias = hop_parts(hops[0])[0]
        found, what = config.lookup(alias), f"jump host {alias}"
    elif found.get("proxycommand", "none").lower() != "none":
        return None
    else:
        alias, what = str(host.address), f"address {host.address}"
    name = found.get("hostname", alias)
    try:
        socket.getaddrinfo(name, None)
    except UnicodeError:                # an empty or over-long DNS label: no resolver is even asked
        return f"{what}{_shown(name, alias)} does not resolve here: it is not a valid DNS name"
    except socket.gaierror as e:
        return f"{what}{_shown(name, alias)} does not resolve here: {e.strerror or e}"
    return None


def _shown(name: str, alias: str) -> str:
    return f" (HostName {name})" if name != alias else ""
