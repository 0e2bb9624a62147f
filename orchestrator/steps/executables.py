"""The executables a host's build left under build/: this machine's records of them
(`build/host-builds/` of the project, private to this user), and the one host command that hashes
them, checks them against those records and, only when they match one, runs the binary's
--version. A binary is never run before the host has found it to be one this machine saw built;
the client checks the hashes it is sent again before it trusts the version.

    records = load(project, key)                  # [{path: sha256}]: the last builds of `key`
    checked = check(transport, records, version)  # Checked(hashes, the version's output or None)
    matches(records, checked.hashes)              # built as recorded?
    remember(project, key, hashes(transport, timeout))   # after a build
    remember_key(project, host, key); last_key(project, host)   # the key of the host's last build step
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from .. import ownership, remote
from ..host import client
from ..inventory import Host, Project
from ..connectors.base import Transport

LOCAL_RECORDS = "build/host-builds"      # under the project root: what this user's builds produced
RECORDS_KEPT = 16                       # builds remembered per key (one per host, builds differ)
HASHES_MAX_BYTES = 1 << 20
VERSION_MAX_BYTES = 1 << 20
NO_MATCH = 10                           # the check's exit status when no record matched (nothing was run)
MATCHED = "MATCHED"                     # the line between the hashes and the version's output


@dataclasses.dataclass(frozen=True)
class Checked:
    """What the check found on the host: the hashes of the recorded paths that are executables
    under build/, and the --version output, None when no record matched (it was not run)."""

    hashes: dict[str, str]
    version: str | None


def load(project: Project, key: dict) -> list[dict[str, str]]:
    """The executables (path -> sha256) of the last builds recorded for `key`; none when the
    records file is missing or is not one."""
    data = _json(_path(project, key))
    builds = data.get("builds", []) if isinstance(data, dict) else []
    return [r for r in builds if isinstance(r, dict)] if isinstance(builds, list) else []


def remember(project: Project, key: dict, hashes: dict[str, str]) -> None:
    """Add a build's executables to the records of `key` (the last RECORDS_KEPT kept), privately."""
    records = [r for r in load(project, key) if r != hashes][-(RECORDS_KEPT - 1):] + [hashes]
    path = _path(project, key)
    ownership.private_dir(path.parent, "build record directory")
    ownership.write_private(path, json.dumps({"key": key, "builds": records}, indent=1))


def remember_key(project: Project, host: Host, key: dict) -> None:
    """Note `key` as the build key of `host`'s last build step (its next run checks the
    executables against that key's records before it knows the build key)."""
    path = _host_path(project, host)
    if _json(path) != {"key": key}:
        ownership.private_dir(path.parent, "build record directory")
        ownership.write_private(path, json.dumps({"key": key}))


def last_key(project: Project, host: Host) -> dict | None:
    """The build key remember_key noted for `host`, if any."""
    data = _json(_host_path(project, host))
    key = data.get("key") if isinstance(data, dict) else None
    return key if isinstance(key, dict) else None


def matches(records: list[dict[str, str]], current: dict[str, str]) -> bool:
    """Whether every executable of one record hashes as recorded."""
    return any(r and all(current.get(p) == h for p, h in r.items()) for r in records)


def hashes(transport: Transport, timeout: float) -> dict[str, str]:
    """sha256 of every executable file under build/ on the host."""
    return _parse(client.output(transport, client.build_hash(transport.host, timeout=timeout),
                                max_bytes=HASHES_MAX_BYTES))


def check(transport: Transport, records: list[dict[str, str]], version: remote.Command) -> Checked:
    """Run check_command: what it found."""
    command = check_command(transport.host, records, version)
    text = client.output(transport, command, max_bytes=HASHES_MAX_BYTES + VERSION_MAX_BYTES)
    sums, sep, output = text.partition(f"{MATCHED}\n")
    return Checked(_parse(sums), output if sep else None)


def check_command(host: Host, records: list[dict[str, str]], version: remote.Command) -> remote.Command:
    """One host command: hash the recorded executables and, when they match a record, run
    `version` (the project's version command); each part under the version's timeout."""
    hashing = client.build_check(host, records=records, timeout=version.timeout, matched=MATCHED, no_match=NO_MATCH)
    line = (f'({hashing.line}); rc=$?; if [ "$rc" = 0 ]; then {version.line}; '
            f'elif [ "$rc" != {NO_MATCH} ]; then exit "$rc"; fi')
    timeout = None if version.timeout is None else 2 * version.timeout
    return remote.Command(hashing.argv, line, timeout, what="checking the build's executables and its --version")


def _path(project: Project, key: dict):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return project.root / LOCAL_RECORDS / f"{digest}.json"


def _host_path(project: Project, host: Host):
    where = json.dumps([host.name, host.address, host.remote_dir])
    return project.root / LOCAL_RECORDS / "hosts" / f"{hashlib.sha256(where.encode()).hexdigest()[:32]}.json"


def _json(path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _parse(text: str) -> dict[str, str]:
    return {m.group(2): m.group(1) for m in re.finditer(r"^([0-9a-f]{64}) [ *](.+)$", text, re.M)}

