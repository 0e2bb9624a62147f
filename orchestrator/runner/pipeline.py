"""The one execution path of every host task: a plan of steps over the selected hosts, in
parallel, into one run record and one run directory.

    plan = Plan.choose(steps="build,test", skip=None)        # or Plan.of("doctor"), Plan.of("deploy"),
                                                             # Plan.of("exec", user_command=UserCommand(argv, 60))
    run_dir, record = execute(inventory, hosts, plan, console)
    finish(run_dir, record, runs_root, secrets)               # run.json, reports, runs/latest

Data flows one way: Host -> StepContext -> steps fill the HostRecord -> RunRecord -> run.json and
the reports. Each host runs its steps in order under its host lock and stops at its first failure
(later steps: skipped); a failing host never stops the others. A run.Run owns the connections,
locks, GPU claims and stop flag. Nothing here decides exit codes.

Locks: on a host with GPUs, validate and nightly hold the tree lock shared (runs of the same
deployed tree run side by side, each on the GPUs it claimed) and alone only while sync, build or
bundles change the tree; on a host without GPUs, and for deploy, a run holds it alone from its
first step that needs it; a `scheduler: slurm` entry's run holds it alone, its allocation the claim
(slurm/run.py). preflight takes it (beside its checks) with the GPUs; doctor takes none, nor
does exec: the user's own command, outside the deployed tree (an nvidia-smi while a validate runs).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
import typing
from collections.abc import Mapping
from pathlib import Path

from .. import ownership, remote, state, sync
from . import parallel, progress
from ..resources import gpus
from ..records import record, redaction, run_store
from .console import Console
from ..errors import CommandError, KdError, UsageError
from ..inventory import Host, Inventory, Project
from ..records.record import HostRecord, RunRecord, StepRecord
from .run import Run
from ..records.run_store import RunDir
from .sink import BoundedSink
from ..steps import ORDER, STEPS
from ..steps.context import StepContext, UserCommand
from ..steps.session import HostSession

# What only some commands use is imported where it is used (start-up time: a warm deploy is mostly
# the interpreter's): the doctor's checks and the preflight step, the bundle plan, Slurm's allocation.
if typing.TYPE_CHECKING:
    from ..connectors.base import Transport
    from ..resources.bundle_plan import BundlePlan
    from ..slurm.run import Allocation
    from ..steps.bundle_tasks import BundleTask      # a step module: imported only when its command runs

LOCAL_TIMEOUT = 900                   # seconds a project command run on this machine may take (LocalReference)
# Every host task is a plan of these steps, run by run_host: doctor is the preflight checks alone,
# deploy the sync alone, validate every step but the opt-in ones, nightly every step, a bisect
# probe what its question needs, exec the user's own command.
COMMAND_STEPS = {"doctor": ("preflight",), "deploy": ("sync",),
                 "validate": tuple(s for s in ORDER if not STEPS[s].opt_in), "nightly": ORDER,
                 "bisect": ("sync", "build", "bundles", "golden", "bench"), "exec": ("exec",),
                 "check-bundle": ("check_bundle",), "clean-bundles": ("clean_bundles",)}
UNLOCKED_COMMANDS = ("doctor", "exec")     # no tree lock (see Locks above)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A command's steps (those selected of its list), and whether build, bundles, test and
    bench may reuse results when nothing they depend on changed."""

    command: str = "validate"
    steps: tuple[str, ...] = COMMAND_STEPS["validate"]
    use_cache: bool = True
    max_parallel: int | None = None         # hosts in flight (--parallel); None: parallel.default_parallel()
    gpus: gpus.Override | None = None       # --gpus
    user_command: UserCommand | None = None     # exec: the command typed after --
    task: BundleTask | None = None          # check-bundle, clean-bundles: what was asked

    @property
    def claims_gpus(self) -> bool:
        """Whether the plan's runs claim GPUs and pin the engine to them (validate, nightly, check-bundle)."""
        return self.command in ("validate", "nightly", "check-bundle")

    @property
    def reuses_results(self) -> bool:
        """Whether golden, test and bench may take the results of an earlier run with the same
        inputs (StepContext.cached_result): not with --no-cache, nor in a nightly, which measures
        every night."""
        return self.use_cache and self.command != "nightly"

    @property
    def history_bench(self) -> bool:
        """Whether the bench measures for the benchmark history (nightly, bisect), with the
        project's bench_nightly command when it names one (docs/nightly.md)."""
        return self.command in ("nightly", "bisect")

    @property
    def imports_numpy(self) -> bool:
        """Whether the doctor probe reads numpy's version by importing it (doctor), not from its
        installed metadata (a tenth of the time: the later steps import it where they use it)."""
        return self.command == "doctor"

    @property
    def takes_lock(self) -> bool:
        """Whether the plan's runs hold the tree lock (all but doctor's and exec's)."""
        return self.command not in UNLOCKED_COMMANDS

    @property
    def listed(self) -> tuple[str, ...]:
        """Every step of the command, selected or not, and any opt-in step selected (the columns
        of its summary)."""
        return tuple(s for s in STEPS if s in COMMAND_STEPS[self.command] or s in self.steps)

    @classmethod
    def of(cls, command: str, **options) -> "Plan":
        """Every step of `command`."""
        return cls(command, COMMAND_STEPS[command], **options)

    @classmethod
    def choose(cls, steps: str | None = None, skip: str | None = None, command: str = "validate",
               **options) -> "Plan":
        """The steps named by --steps (default: the command's list, which for validate leaves out
        the opt-in steps) minus those named by --skip (comma lists); UsageError when that leaves none."""
        chosen = _step_list(steps, "--steps") if steps is not None else list(COMMAND_STEPS[command])
        skipped = _step_list(skip, "--skip") if skip else []
        selected = tuple(s for s in ORDER if s in chosen and s not in skipped)
        if not selected:
            flags = " ".join(f for f, v in (("--steps", steps), ("--skip", skip)) if v is not None)
            raise UsageError(f"{flags} selects no step (steps: {', '.join(ORDER)})")
        return cls(command, selected, **options)


def _step_list(text: str, flag: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in ORDER]
    if unknown:
        raise UsageError(f"{flag}: unknown step {unknown[0]!r} (steps: {', '.join(ORDER)})")
    return names


class LocalReference:
    """The golden tokens every host is checked against: the engine's committed expected manifest,
    and the bundles regenerated on this machine once per run (cached by the generator's input hash)."""

    def __init__(self, project: Project, cache_root: Path, use_cache: bool = True):
        self.project, self.cache_root, self.use_cache = project, cache_root, use_cache
        self._lock = threading.Lock()
        self._local: dict | None = None
        self._expected: dict | None = None
        self._key: Future | None = None

    def start(self) -> None:
        """Ask for the generator's key now, in the background (the hosts' first steps run
        meanwhile); the regeneration itself waits for its first use."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-bundles-key")
        self._key = pool.submit(self._local_command, "bundles_key")
        pool.shutdown(wait=False)

    def expected(self) -> dict:
        """The committed expected manifest, read once per run: every host, and each host's early
        probe and its steps, see the same one."""
        with self._lock:
            if self._expected is None:
                path = self.project.source / self.project.results["expected_manifest"]
                try:
                    self._expected = json.loads(path.read_text())
                except (OSError, ValueError) as e:
                    raise KdError(f"cannot read the expected manifest {path}: {e}") from None
            return self._expected

    def local(self, reporter: progress.Reporter | None = None) -> dict:
        """This machine's regeneration (generated on first use, then reused by every host);
        `reporter`: where the regeneration, when this call makes it, reports its progress."""
        with self._lock:
            if self._local is None:
                self._local = self._generate(reporter)
            return self._local

    def _generate(self, reporter: progress.Reporter | None) -> dict:
        key = (self._key.result() if self._key is not None else self._local_command("bundles_key")).split()[-1]
        out = self.cache_root / key
        manifest = out / Path(self.project.results["manifest"]).name
        if not self.use_cache or not manifest.is_file():       # --no-cache regenerates here too
            self._local_command("bundles", {"KD_BUNDLE_DIR": str(out)}, reporter)
        try:
            return json.loads(manifest.read_text())
        except (OSError, ValueError) as e:
            raise KdError(f"the local regeneration left no readable manifest at {manifest}: {e}") from None

    def _local_command(self, name: str, env: dict | None = None, reporter: progress.Reporter | None = None) -> str:
        """The standard output of the project's command `name` run here (its progress reports go
        to `reporter`, not into it); CommandError unless it exits 0 within LOCAL_TIMEOUT and prints."""
        snippet = self.project.commands[name]
        environ = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHON": sys.executable, "KD_BACKEND": "cpu",
                   **(env or {})}
        with tempfile.TemporaryFile() as errors:
            proc = subprocess.Popen(["bash", "-c", snippet], cwd=self.project.source, stdout=subprocess.PIPE,
                                    stderr=errors, text=True, env={**_base_env(), **environ}, start_new_session=True)
            assert proc.stdout is not None          # stdout=PIPE
            timed_out = threading.Event()

            def stop() -> None:         # the whole group: a child left holding stdout would keep the read waiting
                timed_out.set()
                os.killpg(proc.pid, signal.SIGKILL)
            timer = threading.Timer(LOCAL_TIMEOUT, stop)
            timer.start()
            try:        # read as it comes: a regeneration takes minutes, and says how far it is
                output = "".join(line for line in proc.stdout if not _reported(line, reporter))
            finally:
                timer.cancel()
                proc.wait()
            errors.seek(0)
            tail = (output + errors.read().decode(errors="replace"))[-4000:]
        if proc.returncode != 0 or not output.split():
            why = f"timed out after {LOCAL_TIMEOUT} s" if timed_out.is_set() else "failed"
            raise CommandError(f"the local {name} command {why}", command=snippet, exit_status=proc.returncode,
                               tail=tail)
        return output


def _reported(line: str, reporter: progress.Reporter | None) -> bool:
    """Whether `line` is a progress report (then given to `reporter`, when there is one)."""
    update = progress.parse(line.rstrip("\n"))
    if update is not None and reporter is not None:
        reporter.report(update)
    return update is not None


def _base_env() -> dict:
    return {k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "LC_ALL", "TMPDIR", "USER")}


def execute(inv: Inventory, hosts: list[Host], plan: Plan, console: Console, report_dir: str | None = None, *,
            secrets: Mapping[str, tuple[str, ...]]) -> tuple[RunDir, RunRecord]:
    """Run the plan's steps on every host (in parallel, bounded) into a new run directory, each
    host's `secrets` (remote.host_secrets) redacted from what it writes; return it and the run's
    record (written by `finish`). An interrupt (Ctrl-C, SIGTERM) stops the run:
    the steps that finished keep their outcome, the running ones are `interrupted`, the rest
    `skipped`, and the record says `interrupted`."""
    runs_root = inv.project.root / "runs"
    run_dir = run_store.create_run_dir(runs_root, report_dir)
    # the reports' templates are compiled (Jinja2) meanwhile, for `finish`: the hosts' work is mostly waiting
    threading.Thread(target=_prepare_reports, daemon=True).start()
    reference = LocalReference(inv.project, inv.project.root / "build" / "local-bundles", plan.use_cache)
    with Run(plan.command) as run:
        # the first hosts connect (warm: the master checked, the key probed) and run the doctor's
        # probe (read-only) while the source is hashed here
        run.prepare(hosts[:plan.max_parallel or parallel.default_parallel()], _first_command(plan, inv.project, reference))
        rec, source = _started(inv, hosts, plan, console, run_dir)
        shared = _Shared(inv.project, run_dir, source, state.Owner.now(plan.command), reference,
                         progress.Display(console), secrets)
        if "golden" in plan.steps:
            shared.reference.start()
        records = {h.name: HostRecord(transport=h.transport, address=h.address) for h in hosts}
        start = time.monotonic()
        try:
            with shared.display:
                outcomes = parallel.run_parallel(
                    hosts, lambda h: run_host(h, plan, shared, run, records[h.name], console), plan.max_parallel,
                    run.stop)
        except parallel.Interrupted as interrupt:
            outcomes = interrupt.outcomes
        except KeyboardInterrupt:           # before or after the hosts' calls
            outcomes = parallel.HostOutcomes()
        for host in hosts:
            _settle(records[host.name], plan, outcomes.get(host.name), run.stopped.is_set())
    rec.hosts = records
    rec.finished, rec.seconds = record.utc_now(), round(time.monotonic() - start, 3)
    rec.status = record.run_status(rec.hosts, run.stopped.is_set())
    return run_dir, rec


def _first_command(plan: Plan, project: Project,
                   reference: LocalReference) -> typing.Callable[[Transport], dict[str, list[str]]] | None:
    """What each host runs as soon as it is connected: the doctor's probe, with the room for the
    host's bundles (those its preflight judges), when a step of the plan checks the host; else nothing."""
    if not any(STEPS[s].checks for s in plan.steps):
        return None

    def probe(transport: Transport) -> dict[str, list[str]]:
        # imported here, in the host's thread: the host connects meanwhile
        from .. import doctor
        from ..resources import capacity
        try:
            bundles = _bundle_plan(transport.host, plan, project, reference)
        except KdError:         # the host's run fails with it, before its preflight reads the probe
            bundles = None
        return doctor.probe(transport, plan.imports_numpy, capacity.bundle_files(bundles, project))
    return probe


def _started(inv: Inventory, hosts: list[Host], plan: Plan, console: Console,
             run_dir: RunDir) -> tuple[RunRecord, sync.SourceId]:
    """The run's record as it starts (the source tree's hash and git revision), announced."""
    source = sync.source_id(inv.project)
    rec = RunRecord(run_id=run_dir.run_id, command=plan.command, started=record.utc_now(),
                    source=record.Source(source.tree_hash, source.git_revision, source.git_dirty))
    console.width = max(len(h.name) for h in hosts)
    console.say(f"{plan.command} run {run_dir.run_id}: tree {source.tree_hash[:12]}"
                f"{', git ' + source.git_revision[:10] if source.git_revision else ''}"
                f"{' (uncommitted changes)' if source.git_dirty else ''} on {len(hosts)} host(s), "
                f"steps {', '.join(plan.steps)}")
    return rec, source


def _prepare_reports() -> None:
    from ..records import report
    report.prepare()


def finish(run_dir: RunDir, run: RunRecord, runs_root: Path, secrets=()) -> dict[str, Path]:
    """Write run.json and the reports, and point runs/latest at the run."""
    from ..records import report
    run_store.write_run(run_dir, run, secrets)
    paths = report.render_run(run_dir.path, secrets)
    run_store.update_latest(runs_root, run_dir.path)
    return paths


@dataclasses.dataclass(frozen=True)
class _Shared:
    """What every host of a run shares."""

    project: Project
    run_dir: RunDir
    source: sync.SourceId
    owner: state.Owner
    reference: LocalReference
    display: progress.Display           # every running step reports its progress to it
    secrets: Mapping[str, tuple[str, ...]]     # each host's strings to redact (remote.host_secrets)


def run_host(host: Host, plan: Plan, shared: _Shared, run: Run, rec: HostRecord, console: Console) -> HostRecord:
    """Every step of the plan on one host, in order, into `rec`; the first failure skips the rest.
    The host lock is taken before the first step that changes the host and held to the end."""
    out = console.host(host.name)
    start = time.monotonic()
    bundles = _bundles_for(host, plan, shared, rec)
    if bundles is not None:         # its steps' timeouts scale with the bundles (bundle_plan)
        host = dataclasses.replace(host, timeouts=bundles.timeouts(host))
    request = gpus.Request.for_host(host, plan.gpus, -(-bundles.gpu_bytes // (1 << 20)) if bundles else 0)
    probe = run.first_result(host)
    transport = run.transport(host)
    job = _allocation(transport, rec)
    claims = plan.claims_gpus and job is None
    session = HostSession(host, transport, run, shared.owner,
                          claims_gpus=claims, gpu_request=request, probe=probe)
    ctx = StepContext(host, session, shared.project, shared.run_dir, shared.source, shared.owner,
                      shared.reference, rec, plan, secrets=shared.secrets[host.name], bundles=bundles)
    stopped_by = None
    try:
        for step in plan.listed:
            if step not in plan.steps:
                rec.steps[step] = StepRecord("skipped", message="not selected")
            elif stopped_by:
                rec.steps[step] = StepRecord("skipped", message=f"{stopped_by} {rec.steps[stopped_by].status}")
            elif run.stopped.is_set():
                rec.steps[step] = StepRecord("skipped", message=record.INTERRUPTED_SKIP)
            else:
                if session.lock is None and plan.takes_lock and not (claims and STEPS[step].checks) \
                        and not _hold(ctx, run, claims, step, out):
                    stopped_by = step
                    continue
                if job is not None and STEPS[step].on_node and session.job is None \
                        and not _hold(ctx, run, False, step, out, job):
                    stopped_by = step
                    continue
                readers = tuple(s for s in plan.listed if s in plan.steps and STEPS[s].reads_ahead)
                if readers and step == readers[0]:
                    ctx.reads.read_ahead(readers, ctx.deployed_tree_hash)
                rec.steps[step] = _run_step(ctx, run, step, out, shared.display)
                if rec.steps[step].status in record.UNFINISHED_STEP_STATUSES:
                    stopped_by = step
    finally:
        if job is not None:
            job.release(rec.steps, run.stopped.is_set())
        for held in session.held():
            run.release(held)
        session.transport.close()
        rec.seconds = round(time.monotonic() - start, 3)
    rec.status = record.host_status(rec.steps, run.stopped.is_set())
    return rec


def _allocation(transport: Transport, rec: HostRecord) -> Allocation | None:
    """A `scheduler: slurm` entry's allocation, the claim of its run (not submitted yet); None for any other host."""
    if transport.host.slurm is None:
        return None
    from ..slurm import run as slurm_run
    return slurm_run.Allocation.of(transport, rec)


def _bundles_for(host: Host, plan: Plan, shared: _Shared, rec: HostRecord) -> BundlePlan | None:
    """The bundles the host runs (_bundle_plan), recorded."""
    bundles = _bundle_plan(host, plan, shared.project, shared.reference)
    if bundles is not None:
        rec.bundles = bundles.to_record(host)
    return bundles


def _bundle_plan(host: Host, plan: Plan, project: Project, reference: LocalReference) -> BundlePlan | None:
    """The bundles the host runs (its tiers in the expected manifest); None for a plan without a
    step they shape (deploy, exec)."""
    if not any(STEPS[s].bundles for s in plan.steps):
        return None
    from ..resources import bundle_plan
    return bundle_plan.for_host(host, project, reference.expected())


def _settle(rec: HostRecord, plan: Plan, outcome: parallel.HostOutcome[HostRecord] | None, stopped: bool) -> None:
    """Complete a host's record after the run: a host never started (interrupted first) has its
    steps `skipped`; one whose runner crashed keeps what it recorded and the error."""
    if outcome is not None and not outcome.ok:
        step = next((s for s in plan.steps if s not in rec.steps), plan.steps[0])
        rec.steps[step] = StepRecord("failed", message=outcome.summary)
    for step in plan.listed:
        if step not in rec.steps:
            rec.steps[step] = StepRecord("skipped", message=record.INTERRUPTED_SKIP if stopped else "not run")
    rec.status = record.host_status(rec.steps, stopped)


def _hold(ctx: StepContext, run: Run, claims: bool, step: str, out,
          job: Allocation | None = None) -> bool:
    """Before `step`, the first step that needs them, take the tree lock (and, for validate and
    nightly, the GPUs: preflight does it otherwise), or a Slurm entry's allocation (`job`), for
    the rest of the run; on failure record it as the step's outcome."""
    ctx.log = lambda text: out(f"{step:9} | {text}")
    try:
        if job is not None:         # its queue wait is in no step's seconds (the record's job says it)
            ctx.log(job.hold())
            ctx.session.job = job
        elif claims:
            from ..steps import preflight as preflight_step
            ctx.log(preflight_step.hold_tree_and_gpus(ctx))
        else:
            ctx.session.hold_tree(state.EXCLUSIVE, log=ctx.log)
    except KdError as e:
        status = "interrupted" if run.stopped.is_set() else "failed"
        out(f"{step:9} {status.upper()}  {e.message}")
        ctx.record.steps[step] = StepRecord(status, 0.0, None, e.message, e.tail)
        return False
    return True


def _run_step(ctx: StepContext, run: Run, step: str, out, display: progress.Display) -> StepRecord:
    """One step with its log file, timing and outcome; errors become a failed/timeout record, and
    any error once the run was stopped an `interrupted` one (with the output it had). What the
    step reports of its progress goes to the run's display."""
    log_path = ctx.run_dir.log_path(ctx.host.name, step)
    start = time.monotonic()
    reused_from = None
    with ownership.private_open(log_path) as log:
        sink = BoundedSink(log, log_path, lambda text: out(f"{step:9} | {text}"))

        def redacted(text: str) -> str:
            if not ctx.secrets:
                return text
            return "\n".join(redaction.redact(line, ctx.secrets) for line in redaction.redact(text, ctx.secrets).split("\n"))

        def write(text: str) -> None:
            sink(redacted(text))
        ctx.begin(step, write)
        ctx.progress = display.step(ctx.host.name, step, lambda text: sink(redacted(text), show=False),
                                    lambda text: out(redacted(text)), ctx.secrets)
        out(f"{step:9} ...")
        try:
            outcome = STEPS[step].runner(ctx)
            status, message, tail, reused_from = outcome.status, outcome.message, "", outcome.reused_from
        except KdError as e:
            status = "interrupted" if run.stopped.is_set() else "timeout" if _timed_out(e) else "failed"
            message, tail = (f"interrupted: {e.message}" if status == "interrupted" else e.message), e.tail
            write(str(e))
        finally:
            ctx.progress.close()
            ctx.progress = progress.Ignored()
        cut = sink.close()
    if sink.error is not None and status != "interrupted":     # a log that could not be written fails its step
        status, message = "failed", sink.error.message + (f"; {message}" if message else "")
    if ctx.secrets:
        message, tail = redaction.redact(message, ctx.secrets), redaction.redact(tail, ctx.secrets)
    seconds = round(time.monotonic() - start, 3)
    shown = status.upper() if status in record.UNFINISHED_STEP_STATUSES else status
    reuse = f" (reused from run {reused_from})" if reused_from else ""
    left_out = f" [{cut['left_out_bytes']} bytes of output left out of the log]" if cut else ""
    out(f"{step:9} {shown}{reuse} ({seconds:.1f} s){left_out}{'  ' + message if message else ''}")
    if status in record.UNFINISHED_STEP_STATUSES and not tail:
        tail = run_store.read_tail(log_path)
    return StepRecord(status, seconds, ctx.run_dir.log_ref(ctx.host.name, step), message, tail, reused_from,
                      list(ctx.shell.devices_used) or None, ctx.inputs_digest, cut)


def _timed_out(error: KdError) -> bool:
    """Whether a step's error is a timeout: as the error says, else by its exit status."""
    if error.timed_out is not None:
        return error.timed_out
    return error.exit_status in remote.TIMEOUT_EXIT_CODES
