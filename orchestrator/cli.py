"""The command-line layer behind tasks.py: what `hosts`, `doctor`, `trust`, `deploy`, `validate`,
`nightly`, `report` and `clean` do in
terms of the library, and how failures become exit codes (0 ok, 1 a host failed, 2 usage or
inventory error). `main()` is the `kdtree-orch` console entry: Invoke's Program over tasks.py.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from . import inventory as inventory_mod
from .console import Console
from .errors import HostKeyError, KdError, UsageError
from .inventory import Host, Inventory

# Start-up time counts (engineers run these tasks dozens of times a day): each task imports what
# it uses (Paramiko only when a host is reached; Jinja2 and the pipeline only for validate/report).
if TYPE_CHECKING:
    from . import parallel, record

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_INVENTORY = REPO_ROOT / "hosts.yaml"
INTERRUPTED = 130      # SIGINT (Ctrl-C)
TERMINATED = 143       # SIGTERM (a CI job cancelled, kill)


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (the hosts' work stopped, their locks released), exit 143."""


def _on_sigterm(signum, frame):
    raise Terminated()


def interrupted_code(error: BaseException | None = None) -> int:
    """The exit code of an interrupted run: 143 after SIGTERM, else 130."""
    return TERMINATED if isinstance(error, Terminated) or _terminated.is_set() else INTERRUPTED


_terminated = threading.Event()


@contextlib.contextmanager
def exit_codes():
    """Turn an orchestrator error into its message on stderr and its exit code (130: interrupted,
    143: terminated). SIGTERM is handled as Ctrl-C is, while the task runs."""
    from invoke import Exit
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_sigterm(signum, frame):
            _terminated.set()
            _on_sigterm(signum, frame)
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except KdError as e:
        from .safe_text import visible      # the error may quote a host's output
        print(f"error: {visible(str(e))}", file=sys.stderr)
        raise Exit(code=e.exit_code) from None
    except KeyboardInterrupt as e:
        print("interrupted", file=sys.stderr)
        raise Exit(code=interrupted_code(e)) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def load_inventory(inventory: str | None) -> Inventory:
    """The inventory file given with --inventory, or hosts.yaml beside tasks.py."""
    return inventory_mod.load(inventory or DEFAULT_INVENTORY)


def load_selection(inventory: str | None, host=None, group=None, all=False) -> tuple[Inventory, list[Host]]:
    """The inventory and the hosts the flags select (none selected: `local`)."""
    if all and (host or group):
        raise UsageError("--all cannot be combined with --host or --group")
    inv = load_inventory(inventory)
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
    from . import doctor as doctor_mod, parallel
    from .transport import open_transport
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
    """Sync the project source to every host in parallel (or print what would run); summary.
    The local tree hash runs while the hosts connect (a subprocess: it overlaps the handshakes)."""
    from . import parallel, state, sync
    from .transport import open_transport
    owner = state.Owner.now("deploy")
    console.width = max(len(h.name) for h in hosts)
    if dry_run:
        for host in hosts:
            out = console.host(host.name)
            for what, command in sync.deploy_commands(open_transport(host), inv.project, owner):
                out(f"# {what}")
                out(command)
        return 0
    console.log_dir = inv.project.root / "runs" / "deploy"

    def announce(pending) -> None:
        if pending.exception() is None:
            source = pending.result()
            console.say(f"deploying {inv.project.source} (tree {source.tree_hash[:12]}"
                        f"{', git ' + source.git_revision[:10] if source.git_revision else ''}"
                        f"{', uncommitted changes' if source.git_dirty else ''}) to {len(hosts)} host(s)")

    def one(host: Host) -> sync.DeployResult:
        with open_transport(host) as transport:
            transport.connect()
            return sync.deploy(transport, inv.project, pending.result(), owner, console.host(host.name))

    with concurrent.futures.ThreadPoolExecutor(1) as hasher:
        pending = hasher.submit(sync.source_id, inv.project)
        pending.add_done_callback(announce)
        outcomes = parallel.run_parallel(hosts, one)
    pending.result()        # a failed local tree hash failed every host: report it once, as the task's error
    summary(console, outcomes, lambda o: [o.value.method, o.value.files, o.value.bytes, o.value.deleted]
            if o.ok else ["", "", "", ""], ["method", "files", "bytes", "deleted"])
    return outcomes.exit_code


def trust(host: Host, fingerprints: list[str], console: Console) -> int:
    """Show the host's key (and its jump hosts' keys) and pin unknown ones into the project
    known_hosts file; with --fingerprint, only keys with those fingerprints are pinned."""
    from . import hostkeys
    from .transport import SshTransport
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


def validate(inv: Inventory, hosts: list[Host], console: Console, *, steps: str | None = None,
             skip: str | None = None, report_dir: str | None = None, no_cache: bool = False,
             command: str = "validate", baseline: str | None = None) -> int:
    """Run the pipeline on the hosts, write the run directory, print the summary. Exit code:
    0 passed, 1 a host failed, 3 (nightly) a benchmark regressed, 130 interrupted."""
    from . import pipeline, report
    from . import remote
    plan = pipeline.Plan.choose(steps, skip, use_cache=not no_cache)
    secrets = [value for host in hosts for value in remote.secret_strings(host)]     # all set? (else exit 2)
    run_dir, run = pipeline.validate(inv, hosts, plan, console, command=command, report_dir=report_dir)
    runs_root = inv.project.root / "runs"
    if command == "nightly":
        reference = _baseline(runs_root, baseline, exclude=run.run_id)
        if reference is not None:
            run.regressions = report.find_regressions(run.to_dict(), reference)
    paths = pipeline.finish(run_dir, run, runs_root, secrets)
    run_summary(console, run)
    console.say(f"\nrun {run.run_id}: {run.status}  report: {paths['html']}  junit: {paths['junit']}")
    if run.status == "interrupted":
        return interrupted_code()
    if run.status != "passed":
        return 1
    return 3 if run.regressions else 0


def _baseline(runs_root: Path, path: str | None, exclude: str) -> dict | None:
    """The nightly's baseline: a baseline file given with --baseline, else the last good nightly."""
    from . import record, report
    if path:
        try:
            return report.load_baseline(path)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return record.last_good_run(runs_root, "nightly", exclude=exclude)


def run_summary(console: Console, run: record.RunRecord) -> None:
    """The final table of a validate run: every host, its status, backend and each step's outcome."""
    from . import pipeline, record
    console.say()
    rows = []
    for name, host in run.hosts.items():
        golden = sum(g.status == "passed" for g in host.golden.values())
        tests = f"{host.tests.passed}/{len(host.tests.cases)}" if host.tests else "-"
        failed = next((f"{step}: {s.message}" for step, s in host.steps.items()
                       if s.status in record.FAILED_STEP_STATUSES), "")
        rows.append([name, host.status.upper() if host.status != "passed" else "passed", host.backend or "-",
                     *[host.steps[s].status if s in host.steps else "-" for s in pipeline.ORDER],
                     f"{golden}/{len(host.golden)}" if host.golden else "-", tests, failed.splitlines()[0][:100] if failed else ""])
    console.table(["host", "status", "backend", *pipeline.ORDER, "golden", "tests", "first failure"], rows)
    for reg in run.regressions:
        console.say(f"REGRESSION {reg.host} {reg.metric}: {reg.value:g} vs baseline {reg.baseline:g} "
                    f"(x{reg.ratio:.2f}, tolerance {reg.threshold:.0%})")


def rerender(inv: Inventory, console: Console, run: str | None = None, compare_to: str | None = None) -> int:
    """Re-render a run's reports (default: the latest); with compare_to, write the benchmark
    comparison of the two runs beside the newer one's reports."""
    from . import record, report
    runs_root = inv.project.root / "runs"
    run_dir = record.resolve_run(runs_root, run)
    paths = report.render_run(run_dir)
    console.say(f"rendered {paths['md']}, {paths['html']}, {paths['junit']}")
    if compare_to:
        written = report.write_compare(record.resolve_run(runs_root, compare_to), run_dir)
        console.say(f"comparison: {written['md']}, {written['html']}")
    return 0


def baseline(inv: Inventory, console: Console, out: str, run: str | None = None) -> int:
    """Write a baseline file from a run (default: the latest) for `nightly --baseline`."""
    from . import record, report
    run_dir = record.resolve_run(inv.project.root / "runs", run)
    path = report.write_baseline(record.load_run(run_dir), out)
    hosts = report.load_baseline(path)["hosts"]
    console.say(f"wrote {path}: {sum(len(m) for m in hosts.values())} metrics of {len(hosts)} host(s) from {run_dir.name}")
    return 0


def clean(inv: Inventory, console: Console, keep: int) -> int:
    """Delete all but the newest `keep` runs under runs/."""
    from . import record
    if keep < 0:
        raise UsageError(f"--keep must be 0 or more, not {keep}")
    removed = record.clean(inv.project.root / "runs", keep)
    console.say(f"removed {len(removed)} run(s), kept the newest {keep}")
    return 0


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
    """kdtree-orch: the tasks of tasks.py, from anywhere (a flag Invoke cannot parse: exit 2)."""
    from invoke import Collection, Program
    from invoke.exceptions import ParseError

    class UsageExit2(Program):
        def parse_core(self, argv):
            try:
                return super().parse_core(argv)
            except ParseError as e:
                _usage_exit(e)

        def parse_tasks(self):
            try:
                return super().parse_tasks()
            except ParseError as e:
                _usage_exit(e)

    sys.path.insert(0, str(REPO_ROOT))
    import tasks
    UsageExit2(namespace=Collection.from_module(tasks), version="0.1.0", name="kdtree-orch").run()


def _usage_exit(error: Exception) -> None:
    print(error, file=sys.stderr)
    sys.exit(2)
