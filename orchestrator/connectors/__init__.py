"""Connectors: how commands reach a host and files come back (docs/architecture.md, Commands and transports).

base.py (the Transport interface) <- local.py (processes here) <- openssh.py (a warm OpenSSH master);
base.py <- paramiko.py (one verified Paramiko connection) <- relay.py (rsync over it); both SSH
connectors over hostkeys.py (the one host-key policy) and ssh_common.py; factory.py picks one.
"""
