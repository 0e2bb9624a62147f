"""The transport for a host: which connector reaches it."""
from __future__ import annotations

import threading

from ..inventory import Host
from .base import Transport
from .local import LocalTransport
from .openssh import WarmTransport, uses_warm
from .paramiko import SshTransport


def open_transport(host: Host, stopped: threading.Event | None = None) -> Transport:
    """The transport for a host (nothing is opened until it is used); `stopped`: its run's stop
    flag. An ssh host whose connection is kept warm (openssh.uses_warm) gets a WarmTransport."""
    if host.is_local:
        return LocalTransport(host, stopped)
    return WarmTransport(host, stopped) if uses_warm(host) else SshTransport(host, stopped)
