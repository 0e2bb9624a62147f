"""The command-line layer behind tasks.py: what `hosts`, `doctor`, `trust` and `deploy` do in
terms of the library, and how failures become exit codes (0 ok, 1 a host failed, 2 usage or
inventory error). `main()` is the `kdtree-orch` console entry: Invoke's Program over tasks.py.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from . import doctor as doctor_mod, hostkeys, inventory as inventory_mod, parallel, state, sync
from .console import Console
from .errors import HostKeyError, KdError, UsageError
from .inventory import Host, Inventory
from .transport import SshTransport, open_transport

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_INVENTORY = REPO_ROOT / "hosts.yaml"


@contextlib.contextmanager
def exit_codes():
    """Turn an orchestrator error into its message on stderr and its exit code."""
    from invoke import Exit
    try:
        yield
    except KdError as e:
        print(f"error: {e}", file=sys.stderr)
        raise Exit(code=e.exit_code) from None


def load_selection(inventory: str | None, host=None, group=None, all=False) -> tuple[Inventory, list[Host]]:
    """The inventory (default: hosts.yaml beside tasks.py) and the hosts the flags select."""
    if all and (host or group):
        raise UsageError("--all cannot be combined with --host or --group")
    inv = inventory_mod.load(inventory or DEFAULT_INVENTORY)
    return inv, inv.select(host or (), group, all)


def hosts_table(inv: Inventory, console: Console) -> int:
    """Print every host and group of the inventory."""
    rows = [(h.name, h.transport, h.address or "-", h.remote_dir, h.arch, h.gpus, ",".join(h.groups) or "-")
            for h in inv.hosts.values()]
    console.table(["host", "transport", "address", "remote_dir", "arch", "gpus", "groups"], rows)
    if inv.groups:
        console.say()
        console.table(["group", "hosts", "description"],
                      [(g.name, ",".join(g.members) or "-", g.description) for g in inv.groups.values()])
    return 0


def doctor(hosts: list[Host], console: Console) -> int:
    """Check every host in parallel; print the findings and a summary; 1 if a check failed."""
    console.width = max(len(h.name) for h in hosts)

    def check(host: Host) -> list[doctor_mod.Finding]:
        out = console.host(host.name)
        with open_transport(host) as transport:
            findings = doctor_mod.diagnose(transport)
        for f in findings:
            out(f"{f.status:4}  {f.check:9}  {f.detail}")
        if doctor_mod.failed(findings):
            raise KdError("; ".join(f"{f.check}: {f.detail}" for f in doctor_mod.failed(findings)), host=host.name)
        return findings

    outcomes = parallel.run_parallel(hosts, check)
    summary(console, outcomes, lambda o: [sum(f.status == "warn" for f in o.value or [])], ["warnings"])
    return outcomes.exit_code


def deploy(inv: Inventory, hosts: list[Host], console: Console, dry_run: bool = False) -> int:
    """Sync the project source to every host in parallel (or print what would run); summary."""
    owner = state.Owner.now("deploy")
    console.width = max(len(h.name) for h in hosts)
    if dry_run:
        for host in hosts:
            out = console.host(host.name)
            for what, command in sync.deploy_commands(open_transport(host), inv.project, owner):
                out(f"# {what}")
                out(command)
        return 0
    source = sync.source_id(inv.project)
    console.say(f"deploying {inv.project.source} (tree {source.tree_hash[:12]}"
                f"{', git ' + source.git_revision[:10] if source.git_revision else ''}"
                f"{', uncommitted changes' if source.git_dirty else ''}) to {len(hosts)} host(s)")
    console.log_dir = inv.project.root / "runs" / "deploy"

    def one(host: Host) -> sync.DeployResult:
        with open_transport(host) as transport:
            return sync.deploy(transport, inv.project, source, owner, console.host(host.name))

    outcomes = parallel.run_parallel(hosts, one)
    summary(console, outcomes, lambda o: [o.value.method, o.value.files, o.value.bytes, o.value.deleted]
            if o.ok else ["", "", "", ""], ["method", "files", "bytes", "deleted"])
    return outcomes.exit_code


def trust(host: Host, fingerprints: list[str], console: Console) -> int:
    """Show the host's key (and its jump hosts' keys) and pin unknown ones into the project
    known_hosts file; with --fingerprint, only keys with those fingerprints are pinned."""
    if host.is_local:
        raise UsageError(f"host {host.name!r} is local: it has no host key")
    out = console.host(host.name)
    for _ in range(8):
        transport = SshTransport(host)
        try:
            transport.connect()
        except HostKeyError as e:
            if e.changed:
                raise
            if fingerprints and e.fingerprint not in fingerprints:
                raise KdError(f"{e.known_name} offered {e.key.get_name()} {e.fingerprint}, which is not the "
                              f"fingerprint given ({', '.join(fingerprints)}); nothing pinned", host=host.name) from None
            hostkeys.pin(Path(host.known_hosts), e.known_name, e.key)
            out(f"pinned {e.known_name} {e.key.get_name()} {e.fingerprint} in {host.known_hosts}")
            continue
        else:
            name, key = transport.server_key()
            if fingerprints and hostkeys.fingerprint(key) not in fingerprints:
                raise KdError(f"{name} is known with {key.get_name()} {hostkeys.fingerprint(key)}, not the fingerprint "
                              f"given ({', '.join(fingerprints)})", host=host.name)
            out(f"{name} {key.get_name()} {hostkeys.fingerprint(key)}: verified and trusted")
            return 0
        finally:
            transport.close()
    raise KdError("too many unknown keys on the way", host=host.name)


def summary(console: Console, outcomes: parallel.Outcomes, columns, header: list[str]) -> None:
    """The final table: every host, its outcome, task-specific columns, seconds, the error."""
    console.say()
    rows = [[name, "ok" if o.ok else "FAILED", *columns(o), f"{o.seconds:.1f}", o.summary]
            for name, o in outcomes.items()]
    console.table(["host", "status", *header, "seconds", "error"], rows)
    for o in outcomes.failed:
        console.say()
        console.say(str(o.error) if isinstance(o.error, KdError) else f"{o.host.name}: {o.error!r}")


def main() -> None:
    """kdtree-orch: the tasks of tasks.py, from anywhere."""
    from invoke import Collection, Program
    sys.path.insert(0, str(REPO_ROOT))
    import tasks
    Program(namespace=Collection.from_module(tasks), version="0.1.0", name="kdtree-orch").run()
