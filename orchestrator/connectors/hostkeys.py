"""Host keys: SHA256 fingerprints, the known_hosts files consulted, verification, pinning.

The one host-key policy of both SSH connectors: Paramiko's (paramiko.py: verify_policy,
pinned_transport) and OpenSSH's (openssh.py: pin_command, pin_contradicted) read the same files
(known_hosts_files) and the same pin. Keys are verified always (docs/security.md): against the project's known_hosts file
(`known_hosts:` of the host, default `known_hosts` beside hosts.yaml) and the user's
(~/.ssh/known_hosts, or $KDTREE_USER_KNOWN_HOSTS), or against a fingerprint pinned in the
inventory (`host_key:`). An unknown or changed key raises HostKeyError with the fingerprint
and how to pin it; a new host is pinned by `invoke trust`.
"""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
from pathlib import Path

from ..errors import HostKeyError
from ..inventory import Host


def fingerprint(key) -> str:
    """The SHA256 fingerprint of a Paramiko key, as ssh-keygen -l prints it."""
    return blob_fingerprint(key.asbytes())


def blob_fingerprint(blob: bytes) -> str:
    """The SHA256 fingerprint of a public key blob (a known_hosts line's base64 field, decoded)."""
    digest = hashlib.sha256(blob).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_name(hostname: str, port: int | None) -> str:
    """The name a host's key is filed under in known_hosts."""
    return hostname if port in (None, 22) else f"[{hostname}]:{port}"


def user_known_hosts() -> Path:
    """The user's known_hosts file: $KDTREE_USER_KNOWN_HOSTS or ~/.ssh/known_hosts."""
    return Path(os.environ.get("KDTREE_USER_KNOWN_HOSTS") or Path.home() / ".ssh" / "known_hosts")


def known_hosts_files(project_file: str | None) -> list[Path]:
    """Every known_hosts file consulted for a host, the project's first."""
    files = [Path(project_file)] if project_file else []
    return files + [user_known_hosts()]


def pin(file: Path, name: str, key) -> None:
    """Append `key` for host `name` to the known_hosts `file` (created 0600 if missing)."""
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(f"{name} {key.get_name()} {key.get_base64()}\n")


def unknown(host: str, name: str, key, hop: bool) -> HostKeyError:
    """The error for a key found in no known_hosts file: shows it and says how to pin it."""
    fp = fingerprint(key)
    what = f"the key of jump host {name}" if hop else f"the host key of {name}"
    return HostKeyError(
        f"{what} is not known: {key.get_name()} {fp}. Nothing was run. If this is the right key "
        f"(check it out of band), pin it: invoke trust --host {host} --fingerprint {fp}",
        host=host, known_name=name, key=key, fingerprint=fp, changed=False)


def changed(host: str, name: str, key, expected: str, where: str) -> HostKeyError:
    """The error for a key that differs from the one on record: possibly an attack."""
    fp = fingerprint(key)
    return HostKeyError(
        f"HOST KEY CHANGED for {name}: it offered {key.get_name()} {fp} but {where} has {expected}. "
        f"Nothing was run. If the change is expected (host reinstalled), remove the old entry "
        f"(ssh-keygen -R '{name}' -f FILE) or update host_key:, then run: invoke trust --host {host}",
        host=host, known_name=name, key=key, fingerprint=fp, changed=True)


def verify_policy(host: str, pinned: str | None, hop: bool):
    """Paramiko's RejectPolicy (for a key no known_hosts file lists), except a key matching the
    host's pinned fingerprint is accepted; any other key of a host with a pinned fingerprint is a
    changed key. (A pinned host's key exchange already refused such a key: pinned_transport; this
    is the same rule on its own. Paramiko is imported here, not with the module: a warm
    connection checks keys without it.)"""
    from paramiko import RejectPolicy

    class VerifyPolicy(RejectPolicy):
        def missing_host_key(self, client, hostname, key):
            if pinned and fingerprint(key) == pinned:
                return
            if pinned:      # a key that contradicts host_key: is changed, never merely unknown (trust pins no such key)
                raise changed(host, hostname, key, pinned, "host_key: in the inventory")
            raise unknown(host, hostname, key, hop)
    return VerifyPolicy()


def pinned_transport(host: str, name: str, pinned: str):
    """A Paramiko Transport class (SSHClient's transport_factory) whose key exchange refuses any
    key but the pinned one: the check happens before SSHClient looks at known_hosts and before
    authentication, so a host that fails the pin never sees a credential, even one whose real
    key known_hosts lists. A key that contradicts the pin is a changed key, never merely unknown
    (trust pins no such key)."""
    from paramiko import Transport

    class PinnedTransport(Transport):
        def start_client(self, event=None, timeout=None):
            super().start_client(event, timeout)
            key = self.get_remote_server_key()
            if fingerprint(key) != pinned:
                self.close()
                raise changed(host, name, key, pinned, "host_key: in the inventory")
    return PinnedTransport


def openssh_options(host: Host) -> dict[str, str]:
    """OpenSSH's options (`-o KEY=VALUE`) for the policy verify_policy and pinned_transport apply
    to Paramiko: the key is checked against known_hosts_files alone (no global file, no DNS, no
    key updates, no address check), an unknown or changed key refused, a `host_key:` pin
    answered by pin_command."""
    files = " ".join(f'"{f}"' for f in known_hosts_files(host.known_hosts))
    return {"StrictHostKeyChecking": "yes", "UserKnownHostsFile": files,
            "GlobalKnownHostsFile": "none", "UpdateHostKeys": "no", "VerifyHostKeyDNS": "no",
            "CheckHostIP": "no",
            "KnownHostsCommand": pin_command(host.host_key) if host.host_key else "none"}


def pin_command(pin: str) -> str:
    """OpenSSH's KnownHostsCommand answering the offered key as known only when its fingerprint is the pin."""
    # ssh also asks without a key (to order its algorithms): nothing to answer then, and no failure
    return f"/bin/sh -c 'test \"$1\" = \"$0\" && echo \"$2 $3 $4\"; exit 0' {pin} %f %H %t %K"


def pin_contradicted(host: Host, found: dict[str, str]) -> bool:
    """Whether a known_hosts file has a key for a pinned host other than the pin: Paramiko
    refuses such a host, OpenSSH would accept either, so such a host keeps Paramiko's connection
    (openssh.uses_warm). `found`: the host as `ssh -G` resolves it (ssh_common.openssh_config)."""
    if not host.host_key:
        return False
    name = known_name(found["hostname"], int(found["port"]))      # ssh -G always prints both
    for file in known_hosts_files(host.known_hosts):
        if not Path(file).is_file():
            continue
        lines = subprocess.run(["ssh-keygen", "-F", name, "-f", str(file)], capture_output=True, text=True).stdout
        for line in lines.splitlines():
            words = line.split()
            if len(words) >= 3 and not line.startswith("#") and blob_fingerprint(base64.b64decode(words[2])) != host.host_key:
                return True
    return False
