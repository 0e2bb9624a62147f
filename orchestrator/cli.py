"""The command-line layer behind tasks.py: what `hosts`, `doctor`, `trust`, `deploy`, `exec`, `validate`,
`nightly`, `report` and `clean` do in
terms of the library, and how failures become exit codes (0 ok, 1 a host failed, 2 usage or
inventory error). The tasks themselves are orchestrator/tasks.py; `kdtree-orch` is program.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from . import inventory as inventory_mod
from .runner.console import Console
from .errors import HostKeyError, KdError, LocalWriteError, UsageError
from .inventory import Host, Inventory

# Start-up time counts (engineers run these tasks dozens of times a day): each task imports what
# it uses (Paramiko only when a host is reached; Jinja2 and the pipeline only for validate/report).
if TYPE_CHECKING:
    from .records import record

# The checkout this package sits in, when it runs from one (`invoke` in the repo, an editable install).
CHECKOUT = Path(__file__).resolve().parent.parent
DASHBOARD = "history.html"     # under runs/
INTERRUPTED = 130      # SIGINT (Ctrl-C)
TERMINATED = 143       # SIGTERM (a CI job cancelled, kill)
DEFAULT_KEEP = 10      # runs `clean` keeps
EXEC_TIMEOUT = 300     # seconds `exec` gives its command without --timeout
# bisect compares its probes' figures and verdicts with each other, each probe a run of its own: on a Slurm
# entry each would be an allocation of its own, on whatever node and GPUs Slurm gives it then.
BISECT_ON_SLURM = ("bisect: {host} is a `scheduler: slurm` entry: each probe would be a job of its own, on "
                   "whichever node and GPUs Slurm gives it, so its figures would not compare with the other "
                   "probes'. Bisect on an ssh host with the same GPU, or run `invoke validate --host {host}` "
                   "on the commits to compare (docs/slurm.md)")


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


def default_inventory() -> Path:
    """The inventory used without --inventory: the checkout's hosts.yaml when the package runs from
    a checkout, else (an installed package) hosts.yaml in the current directory."""
    if (CHECKOUT / "tasks.py").is_file() and (CHECKOUT / "hosts.yaml").is_file():
        return CHECKOUT / "hosts.yaml"
    return Path("hosts.yaml")


def load_inventory(inventory: str | None) -> Inventory:
    """The inventory file given with --inventory, or the default_inventory()."""
    return inventory_mod.load(inventory or default_inventory())


def load_selection(inventory: str | None, host=None, group=None, all=False,
                   nightly: bool = False, persist: bool = True) -> tuple[Inventory, list[Host]]:
    """The inventory and the hosts the flags select (none selected: `local`; for the nightly,
    every host but `local`), with no warm connection when not `persist` (--no-persist). A
    selection of no host is a UsageError naming why."""
    inv, hosts = _select(inventory, host, group, all, nightly)
    return inv, hosts if persist else [dataclasses.replace(h, persist=0.0) for h in hosts]


def _select(inventory: str | None, host, group, all, nightly: bool) -> tuple[Inventory, list[Host]]:
    if all and (host or group):
        raise UsageError("--all cannot be combined with --host or --group")
    inv = load_inventory(inventory)
    if nightly and not (host or group or all):
        hosts = [h for h in inv.hosts.values() if h.name != inventory_mod.DEFAULT_HOST]
        if not hosts:
            raise UsageError(f"nightly: {inv.path} has no host but `local`; name the hosts with --host, --group or --all")
        return inv, hosts
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


def doctor(inv: Inventory, hosts: list[Host], console: Console, parallel: int | None = None) -> int:
    """Check every host (the preflight step alone), `parallel` at a time; a run record; 1 if a check failed."""
    from .runner import pipeline
    return run_plan(inv, hosts, pipeline.Plan.of("doctor", max_parallel=parallel), console)


def deploy(inv: Inventory, hosts: list[Host], console: Console, dry_run: bool = False,
           parallel: int | None = None) -> int:
    """Sync the project source to every host, `parallel` at a time (the sync step alone; a run
    record), or with `dry_run` print what would run, resolving every host's address, and change nothing."""
    from .runner import pipeline
    if dry_run:
        return dry_run_deploy(inv, hosts, console)
    return run_plan(inv, hosts, pipeline.Plan.of("deploy", max_parallel=parallel), console)


def connections(console: Console, close: bool = False) -> int:
    """List this user's warm connections (host, where, idle bound, master alive); with `close`, end them all."""
    from .connectors import openssh
    if close:
        ended = openssh.close_all()
        console.say(f"ended {ended} warm connection(s) in {openssh.control_dir()}")
        return 0
    rows = [(r.get("host", "?"), r.get("where", "?"), f"{r.get('persist', '?')} s", r.get("started", "?"), r["state"])
            for r in openssh.listing()]
    if not rows:
        console.say(f"no warm connections in {openssh.control_dir()}")
        return 0
    console.table(["host", "where", "idle bound", "started", "master"], rows)
    return 0


def exec_command(inv: Inventory, hosts: list[Host], console: Console, argv: tuple[str, ...],
                 timeout: str | float | None = None, parallel: int | None = None) -> int:
    """Run `argv` (its words as typed) on every host, `parallel` at a time, for at most `timeout`
    seconds each (default EXEC_TIMEOUT): a run with the one step `exec` per host (run_plan)."""
    from .runner import pipeline
    from .steps.context import UserCommand
    command = UserCommand(argv, parse_timeout(timeout))
    return run_plan(inv, hosts, pipeline.Plan.of("exec", max_parallel=parallel, user_command=command), console)


def command_words(argv: list[str], remainder: str | None = None) -> tuple[str, ...]:
    """The words after the first `--` of the program's command line `argv` (sys.argv), each as
    the user's shell gave it: Invoke's own remainder joins them with spaces, losing the quoting.
    `remainder`: Invoke's, where it has one (3.x), which must be those words joined; a
    UsageError when there are none or they disagree."""
    if "--" not in argv or len(argv) == argv.index("--") + 1:
        raise UsageError("exec needs the command after --: invoke exec -H HOST -- COMMAND [ARG...]")
    words = tuple(argv[argv.index("--") + 1:])
    if remainder is not None and remainder != " ".join(words):
        raise UsageError(f"exec: the command line's words after -- ({' '.join(words)!r}) are not the ones "
                         f"Invoke parsed ({remainder!r}); nothing was run")
    return words


def parse_timeout(value: str | float | None) -> float:
    """--timeout SECONDS: a positive number up to the inventory's largest timeout (None: EXEC_TIMEOUT)."""
    if value is None:
        return EXEC_TIMEOUT
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = 0.0
    if not 0 < seconds <= inventory_mod.MAX_TIMEOUT:     # also refuses nan and inf
        raise UsageError(f"--timeout: {value!r} is not a number of seconds above 0 and at most {inventory_mod.MAX_TIMEOUT}")
    return seconds


def dry_run_deploy(inv: Inventory, hosts: list[Host], console: Console) -> int:
    """Print every command a deploy would run on each host and resolve each host's address
    (ssh config, then DNS); 1 when an address does not resolve. Nothing is changed."""
    from . import state, sync
    from .connectors.ssh_common import resolve_address
    from .connectors.factory import open_transport
    owner = state.Owner.now("deploy")
    console.width = max(len(h.name) for h in hosts)
    unresolved = []
    for host in hosts:
        out = console.host(host.name)
        for what, command in sync.deploy_commands(open_transport(host), inv.project, owner):
            out(f"# {what}")
            out(command)
        problem = resolve_address(host)
        if problem:
            unresolved.append(host.name)
            out(f"# ADDRESS DOES NOT RESOLVE: {problem}")
    if unresolved:
        console.say(f"cannot resolve the address of {len(unresolved)} host(s): {', '.join(unresolved)}")
    console.say("dry run: nothing was changed")
    return 1 if unresolved else 0


def load_host(inventory: str | None, name: str | None, task: str) -> Host:
    """The one host a task needs (--host); a UsageError naming the flag when none is given."""
    if not name:
        raise UsageError(f"{task} needs one host: --host NAME (-H NAME)")
    return load_inventory(inventory).select([name])[0]


def trust(host: Host, fingerprints: list[str], console: Console) -> int:
    """Show the host's key (and its jump hosts' keys) and pin unknown ones into the project
    known_hosts file; with --fingerprint, only keys with those fingerprints are pinned."""
    from .connectors import hostkeys
    from .connectors.paramiko import SshTransport
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
            assert host.known_hosts is not None     # the inventory gives every host one
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
             command: str = "validate", baseline: str | None = None, history: str | None = None,
             gpus: str | None = None, parallel: int | None = None, bundles: str | None = None) -> int:
    """Run the pipeline's steps (--steps/--skip) on the hosts, `parallel` at a time, on the GPUs
    --gpus asks for (over each host's gpu_policy and gpu_count), with the bundle tiers --bundles
    names (over each host's `bundles`); see run_plan."""
    from .runner import pipeline
    from .resources import gpus as gpus_mod
    plan = pipeline.Plan.choose(steps, skip, command, use_cache=not no_cache, gpus=gpus_mod.parse_flag(gpus),
                                max_parallel=parallel)
    return run_plan(inv, with_tiers(inv, hosts, bundles), plan, console, report_dir=report_dir, baseline=baseline,
                    history=history)


def with_tiers(inv: Inventory, hosts: list[Host], bundles: str | None) -> list[Host]:
    """The hosts with the bundle tiers of --bundles (a comma list; UsageError if unknown), if given."""
    from .resources import bundle_plan
    tiers = bundle_plan.parse_flag(bundles, inv.project)
    return hosts if tiers is None else [dataclasses.replace(h, bundles=tiers) for h in hosts]


def check_bundle(inv: Inventory, host: Host, console: Console, path: str | None,
                 max_memory: str | None = None) -> int:
    """Run the deployed engine's bundle check on `path` on the host (check-bundle: one step,
    steps.bundle_tasks); `max_memory`: the engine's --max-memory in bytes. See run_plan."""
    from .runner import pipeline
    from .steps.bundle_tasks import BundleTask
    if path is None:
        raise UsageError("check-bundle: give the bundle's path on the host (absolute, or relative to remote_dir)")
    problem = inventory_mod.path_problem(path)
    if problem:
        raise UsageError(f"check-bundle: the path {path[:200]!r} {problem}")
    memory = None
    if max_memory is not None:
        if not str(max_memory).isdigit() or not (1 << 20) <= int(max_memory) <= (1 << 50):
            raise UsageError(f"--max-memory {str(max_memory)[:40]!r}: give bytes from {1 << 20} to {1 << 50}")
        memory = int(max_memory)
    task = BundleTask(path=path, max_memory=memory)
    return run_plan(inv, [host], pipeline.Plan.of("check-bundle", task=task), console)


def clean_bundles(inv: Inventory, hosts: list[Host], console: Console, bundles: str | None = None,
                  remove: bool = False, parallel: int | None = None) -> int:
    """List each host's bundles and, with `remove`, remove those its tiers (--bundles over its
    `bundles`) do not use (clean-bundles: one step, steps.bundle_tasks). See run_plan."""
    from .runner import pipeline
    from .steps.bundle_tasks import BundleTask
    plan = pipeline.Plan.of("clean-bundles", task=BundleTask(remove=remove), max_parallel=parallel)
    return run_plan(inv, with_tiers(inv, hosts, bundles), plan, console)


def run_plan(inv: Inventory, hosts: list[Host], plan, console: Console, *, report_dir: str | None = None,
             baseline: str | None = None, history: str | None = None) -> int:
    """Run a plan on the hosts, write the run directory, index a validate or nightly run in the
    benchmark history and redraw the dashboard, print the summary. A nightly's regressions come from the history
    detector, or with --baseline from the fixed ratio against that file. Exit code: 0 passed,
    1 a host failed, 3 (nightly) a benchmark regressed, 130/143 interrupted."""
    from . import remote
    from .runner import parallel, pipeline
    from .records import record, regression, run_store
    if plan.command in record.BASELINE_COMMANDS:    # only runs that measure are indexed (sqlite, Jinja2: start-up time)
        from .records import history as history_mod
        # the dashboard's module (0.1-0.2 s of imports) loads while the hosts work, for the end
        threading.Thread(target=importlib.import_module, args=(f"{__package__}.records.dashboard",),
                         daemon=True).start()
    secrets = remote.host_secrets(hosts)     # all set? (else exit 2)
    parallel.fit_fd_limit(min(plan.max_parallel or parallel.default_parallel(), len(hosts)))     # else exit 2
    if any(h.persist and not h.is_local for h in hosts):
        from .connectors import openssh
        openssh.control_dir()          # a socket directory another user could reach: exit 2 before any host
    runs_root = inv.project.root / "runs"
    reference = _baseline(baseline) if plan.command == "nightly" else None
    tolerances = (reference or {}).get("thresholds") or {}
    tolerance = lambda metric: regression.threshold_for(metric, tolerances)     # noqa: E731
    with contextlib.ExitStack() as stack:
        store = (stack.enter_context(history_mod.HistoryStore.open(_history_path(runs_root, history)))  # bad: exit 2 now
                 if plan.command in record.BASELINE_COMMANDS else None)      # only runs that measure are indexed
        run_dir, run = pipeline.execute(inv, hosts, plan, console, report_dir=report_dir, secrets=secrets)
        contended: list[dict] = []
        if plan.command == "nightly" and run.status != "interrupted":
            if reference is not None:
                run.regressions = regression.find_regressions(run.to_dict(), reference)
            elif store is not None:
                verdicts = history_mod.judge_run(store, run.to_dict(), tolerance)
                run.regressions, contended = history_mod.regressions(verdicts), history_mod.contended(verdicts)
        board = runs_root / DASHBOARD
        if store is not None:
            run.history = {"store": str(store.path.absolute()), "dashboard": os.path.relpath(board, run_dir.path.absolute()),
                           "contended": contended}
        try:
            paths = pipeline.finish(run_dir, run, runs_root, [v for values in secrets.values() for v in values])
            if store is not None:
                store.index_run(run_store.load_run(run_dir.path), run_dir.path)
                from .records import dashboard
                dashboard.render_history(store, board, tolerance)
        except LocalWriteError:             # a full disk: the summary still, then the one line (exit 1)
            run_summary(console, run, plan)
            raise
    run_summary(console, run, plan)
    if store is not None:       # absolute, as every path of the run's last lines: run.json's link is the report's
        console.say(f"benchmark history: {store.path.absolute()} (dashboard {board.absolute()})")
    console.say(f"\nrun {run.run_id}: {run.status}  report: {paths['html']}  junit: {paths['junit']}")
    if run.status == "interrupted":
        return interrupted_code()
    if run.status != "passed":
        return 1
    return 3 if run.regressions else 0


def _baseline(path: str | None) -> dict | None:
    """The baseline file given with nightly --baseline (None: the history decides)."""
    from .records import regression
    if not path:
        return None
    try:
        return regression.load_baseline(path)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _history_path(runs_root: Path, path: str | None) -> Path:
    """The history file: --history, else runs/history.sqlite."""
    from .records import history
    return Path(path) if path else history.default_path(runs_root)


def run_summary(console: Console, run: record.RunRecord, plan) -> None:
    """The final table of every run: each host, its status, backend, each step's outcome (a reused
    one as `cached`), golden, tests and stress tests when the plan has them, seconds, the first failure."""
    from .records import record
    console.say()
    steps = list(plan.listed)
    extra = [c for c, step in (("golden", "golden"), ("tests", "test"), ("stress", "stress")) if step in steps]
    rows = []
    for name, host in run.hosts.items():
        failed = next((f"{step}: {s.message}" for step, s in host.steps.items()
                       if s.status in record.UNFINISHED_STEP_STATUSES), "")
        golden = sum(g.status == "passed" for g in host.golden.values())
        columns = {"golden": f"{golden}/{len(host.golden)}" if host.golden else "-",
                   "tests": f"{host.tests.passed}/{len(host.tests.cases)}" if host.tests else "-",
                   "stress": f"{host.stress.passed}/{len(host.stress.cases)}" if host.stress else "-"}
        rows.append([name, host.status.upper() if host.status != "passed" else "passed", host.backend or "-",
                     *[host.steps[s].status if s in host.steps else "-" for s in steps],
                     *[columns[c] for c in extra], f"{host.seconds:.1f}",
                     failed.splitlines()[0][:100] if failed else ""])
    console.table(["host", "status", "backend", *steps, *extra, "seconds", "first failure"], rows)
    reused = [f"{name} {step} from run {s.reused_from}" for name, host in run.hosts.items()
              for step, s in host.steps.items() if s.reused_from]
    if reused:
        console.say("reused results (not re-run): " + "; ".join(reused))
    for name, host in run.hosts.items():       # apart from the step times: the queue wait is in none of them
        if host.job is not None:
            from .slurm import run as slurm_run     # a Slurm entry's run alone (start-up time)
            console.say(f"slurm {name}: {slurm_run.describe(host.job)}")
    for reg in run.regressions:
        why = (reg.evidence or {}).get("reason") or "fixed ratio against the baseline file"
        console.say(f"REGRESSION {reg.host} {reg.metric}: {reg.value:g} vs baseline {reg.baseline:g} "
                    f"(x{reg.ratio:.2f}, tolerance {reg.threshold:.0%}; {reg.method}: {why})")
        if reg.since_run and reg.since_run != run.run_id:
            console.say(f"  regressed since run {reg.since_run}")
        if reg.bisect:
            console.say(f"  find the commit: {reg.bisect}")
    if run.history:
        for c in run.history.get("contended") or []:
            probe = (f", {c['cal_change']:+.1%} relative to the calibration probe (the probe itself "
                     f"{c['calibration_change']:+.1%})" if "cal_change" in c and "calibration_change" in c else "")
            why = ("the clocks disagree (a load that fell can hide a slower code)" if c["reason"].startswith("the clocks")
                   else "measured under contention (other processes took the cores or their caches)")
            console.say(f"NOT JUDGED {c['host']} {c['metric']}: x{c['ratio']:.2f} on the wall clock, "
                        f"{c['cpu_change']:+.1%} per CPU second{probe}: {why}")


def history(inv: Inventory, console: Console, history: str | None = None, rebuild: bool = False,
            html: bool = False) -> int:
    """Reindex the history from the run directories (--rebuild), write the dashboard (--html);
    without either, print every series' latest value and verdict."""
    from .records import dashboard, detector, history as history_mod, regression
    runs_root = inv.project.root / "runs"
    tolerance = lambda metric: regression.threshold_for(metric, {})     # noqa: E731
    with history_mod.HistoryStore.open(_history_path(runs_root, history)) as store:
        if rebuild:
            runs, indexed, problems = store.rebuild(runs_root)
            console.say(f"indexed {runs} run(s), {indexed} point(s) from {runs_root} into {store.path}")
            for problem in problems:
                console.say(f"skipped: {problem}")
        if html:
            console.say(f"wrote {dashboard.render_history(store, runs_root / DASHBOARD, tolerance)}")
        if not (rebuild or html):
            rows = []
            for key, metric in store.series_keys():
                points = store.series(key, metric)
                verdict = detector.judge(points[-1].point(), [p.point() for p in points[:-1]], tolerance(metric),
                                         points[-1].better)
                rows.append([key.host, key.gpu, key.backend, metric, len(points), f"{points[-1].value:g}",
                             "-" if verdict.baseline is None else f"{verdict.baseline:g}", verdict.status])
            console.table(["host", "gpu", "backend", "metric", "points", "latest", "baseline", "verdict"], rows)
    return 0


def bisect(inv: Inventory, host: Host, console: Console, good: str | None, bad: str | None,
           metric: str | None = None, golden: bool = False) -> int:
    """Find the first bad commit between --good and --bad on one host (see orchestrator.records.bisect)."""
    from .records import bisect as bisect_mod
    from .runner import probe
    if bool(metric) == bool(golden):
        raise UsageError("bisect needs exactly one of --metric NAME and --golden")
    if not good or not bad:
        raise UsageError("bisect needs --good REV and --bad REV")
    if host.slurm is not None:
        raise UsageError(BISECT_ON_SLURM.format(host=host.name))
    repo, source = probe.repository(inv.project)
    commits = bisect_mod.commit_range(repo, good, bad, source)
    what = f"metric {metric}" if metric else "the golden check"
    console.say(f"bisect {what} on {host.name}: {len(commits)} distinct {source} trees from {commits[0].sha[:12]} to "
                f"{commits[-1].sha[:12]}, at most {bisect_mod.max_probes(len(commits))} probes")
    with bisect_mod.Worktree(repo) as tree:
        probing = probe.Prober(inv, host, console, tree, source, metric)
        classify = (lambda g, b: bisect_mod.MetricJudge(g, b, b.better)) if metric else None
        result = bisect_mod.search(commits, probing, classify, log=console.say)
    bad_probe = next(p for c, p in result.probes if c == result.first_bad)
    good_probe = next(p for c, p in result.probes if c == result.last_good)
    console.say(f"{result.builds} build(s) in {len(result.probes)} probe(s), {result.seconds:.0f} s; "
                f"last good {result.last_good.sha[:12]}: {good_probe.evidence}; first bad: {bad_probe.evidence}")
    console.say(result.last_line())
    return 0


def rerender(inv: Inventory, console: Console, run: str | None = None, compare_to: str | None = None) -> int:
    """Re-render a run's reports (default: the latest of any command); with compare_to, write the
    benchmark comparison of the two runs beside the newer one's reports (default: the newest
    validate or nightly run)."""
    from .records import report, run_store
    runs_root = inv.project.root / "runs"
    run_dir = run_store.resolve_run(runs_root, run)
    paths = report.render_run(run_dir)
    console.say(f"rendered {paths['md']}, {paths['html']}, {paths['junit']}")
    if compare_to:
        if run is None:         # a comparison is of measurements: the newest validate or nightly
            run_dir = _measured_run(runs_root)
        written = report.write_compare(run_store.resolve_run(runs_root, compare_to), run_dir)
        console.say(f"comparison: {written['md']}, {written['html']}")
    return 0


def baseline(inv: Inventory, console: Console, out: str | None, run: str | None = None) -> int:
    """Write a baseline file from a run (default: the newest validate or nightly run) for
    `nightly --baseline`."""
    from .records import regression, run_store
    if not out:
        raise UsageError("baseline needs the file to write: --out FILE")
    runs_root = inv.project.root / "runs"
    run_dir = run_store.resolve_run(runs_root, run) if run else _measured_run(runs_root)
    path = regression.write_baseline(run_store.load_run(run_dir), out)
    hosts = regression.load_baseline(path)["hosts"]
    console.say(f"wrote {path}: {sum(len(m) for m in hosts.values())} metrics of {len(hosts)} host(s) from {run_dir.name}")
    return 0


def _measured_run(runs_root: Path) -> Path:
    """The newest validate or nightly run (the default of baselines and comparisons)."""
    from .records import run_store
    path = run_store.newest_run(runs_root)
    if path is None:
        raise run_store.RunRecordError(runs_root, "no validate or nightly run here")
    return path


def clean(inv: Inventory, console: Console, keep: str | int | None = None) -> int:
    """Delete all but the newest `keep` runs under runs/ (default 10)."""
    from .records import run_store
    try:
        keep = DEFAULT_KEEP if keep is None else int(keep)
    except ValueError:
        raise UsageError(f"--keep must be a whole number of runs, not {keep!r}") from None
    if keep < 0:
        raise UsageError(f"--keep must be 0 or more, not {keep}")
    runs_root = inv.project.root / "runs"
    removed = run_store.clean(runs_root, keep)
    baseline = run_store.newest_run(runs_root, ("nightly",), passed=True)
    kept = f" and the newest passing nightly {baseline.name}" if baseline else ""
    console.say(f"removed {len(removed)} run(s), kept the newest {keep}{kept}")
    return 0
