"""What both SSH connectors (paramiko.py, openssh.py) share about reaching a host."""
from __future__ import annotations

from ..inventory import Host


def ssh_rsync_dest(host: Host, path: str) -> str:
    """`path` on an ssh host as rsync's destination (an IPv6 address in brackets)."""
    address = host.address
    assert address is not None                 # the inventory gives every ssh host one
    address = f"[{address}]" if ":" in address else address
    return f"{address}:{path}"
