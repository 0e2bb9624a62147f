"""The validate pipeline: the steps over the selected hosts, in parallel, into one run record.

    plan = Plan.choose(steps="build,test", skip=None)
    run_dir, record = validate(inventory, hosts, plan, console, command="validate")

Data flows one way: Host -> StepContext -> steps fill the HostRecord -> RunRecord -> run.json and
the reports. Each host runs its steps in order under its host lock and stops at its first failure
(later steps: skipped); a failing host never stops the others. Nothing here decides exit codes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import ownership, parallel, record, remote, report, state, sync
from .console import Console
from .errors import CommandError, KdError, UsageError
from .inventory import Host, Inventory, Project
from .record import HostRecord, RunDir, RunRecord, StepRecord
from .safe_text import visible
from .steps import ORDER, RUNNERS, StepContext
from .transport import open_transport

LOCK_FREE_STEPS = ("preflight",)      # read-only: runs before the host lock is taken


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which steps run, and whether build and bundles may be skipped when nothing changed."""

    steps: tuple[str, ...] = ORDER
    use_cache: bool = True
    max_parallel: int = parallel.MAX_PARALLEL

    @classmethod
    def choose(cls, steps: str | None = None, skip: str | None = None, **options) -> "Plan":
        """The steps named by --steps (default: all) minus those named by --skip (comma lists)."""
        chosen = _step_list(steps, "--steps") if steps else list(ORDER)
        skipped = _step_list(skip, "--skip") if skip else []
        return cls(tuple(s for s in ORDER if s in chosen and s not in skipped), **options)


def _step_list(text: str, flag: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in ORDER]
    if unknown:
        raise UsageError(f"{flag}: unknown step {unknown[0]!r} (steps: {', '.join(ORDER)})")
    return names


class LocalReference:
    """The golden tokens every host is checked against: the engine's committed expected manifest,
    and the bundles regenerated on this machine once per run (cached by the generator's input hash)."""

    def __init__(self, project: Project, cache_root: Path):
        self.project, self.cache_root = project, cache_root
        self._lock = threading.Lock()
        self._local: dict | None = None

    def expected(self) -> dict:
        """The committed expected manifest."""
        path = self.project.source / self.project.results["expected_manifest"]
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise KdError(f"cannot read the expected manifest {path}: {e}") from None

    def local(self) -> dict:
        """This machine's regeneration (generated on first use, then reused by every host)."""
        with self._lock:
            if self._local is None:
                self._local = self._generate()
            return self._local

    def _generate(self) -> dict:
        key = self._local_command("bundles_key").split()[-1]
        out = self.cache_root / key
        manifest = out / Path(self.project.results["manifest"]).name
        if not manifest.is_file():
            self._local_command("bundles", {"KD_BUNDLE_DIR": str(out)})
        try:
            return json.loads(manifest.read_text())
        except (OSError, ValueError) as e:
            raise KdError(f"the local regeneration left no readable manifest at {manifest}: {e}") from None

    def _local_command(self, name: str, env: dict | None = None) -> str:
        snippet = self.project.commands[name]
        environ = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHON": sys.executable, "KD_BACKEND": "cpu",
                   **(env or {})}
        proc = subprocess.run(["bash", "-c", snippet], cwd=self.project.source, capture_output=True, text=True,
                              env={**_base_env(), **environ}, timeout=900)
        if proc.returncode != 0 or not proc.stdout.split():
            raise CommandError(f"the local {name} command failed", command=snippet, exit_status=proc.returncode,
                               tail=(proc.stdout + proc.stderr)[-4000:])
        return proc.stdout


def _base_env() -> dict:
    return {k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "LC_ALL", "TMPDIR", "USER")}


def validate(inv: Inventory, hosts: list[Host], plan: Plan, console: Console, *, command: str = "validate",
             report_dir: str | None = None) -> tuple[RunDir, RunRecord]:
    """Run the plan's steps on every host; write run.json and the reports; return both."""
    runs_root = inv.project.root / "runs"
    run_dir = record.create_run_dir(runs_root, report_dir)
    source = sync.source_id(inv.project)
    run = RunRecord(run_id=run_dir.run_id, command=command, started=record.utc_now(),
                    source=record.Source(source.tree_hash, source.git_revision, source.git_dirty))
    console.width = max(len(h.name) for h in hosts)
    console.say(f"{command} run {run_dir.run_id}: tree {source.tree_hash[:12]} on {len(hosts)} host(s), "
                f"steps {', '.join(plan.steps)}")
    reference = LocalReference(inv.project, inv.project.root / "build" / "local-bundles")
    owner = state.Owner.now(command)
    start = time.monotonic()
    interrupted = False
    try:
        outcomes = parallel.run_parallel(
            hosts, lambda h: run_host(h, plan, inv.project, run_dir, source, owner, reference, console),
            plan.max_parallel)
    except KeyboardInterrupt:
        interrupted, outcomes = True, parallel.Outcomes()
    for host in hosts:
        outcome = outcomes.get(host.name)
        run.hosts[host.name] = outcome.value if outcome and outcome.ok else _crashed(host, outcome)
    run.finished, run.seconds = record.utc_now(), round(time.monotonic() - start, 3)
    run.status = record.run_status(run.hosts, interrupted)
    return run_dir, run


def finish(run_dir: RunDir, run: RunRecord, runs_root: Path, secrets=()) -> dict[str, Path]:
    """Write run.json and the reports, and point runs/latest at the run."""
    record.write_run(run_dir, run, secrets)
    paths = report.render_run(run_dir.path, secrets)
    record.update_latest(runs_root, run_dir.path)
    return paths


def run_host(host: Host, plan: Plan, project: Project, run_dir: RunDir, source: sync.SourceId,
             owner: state.Owner, reference: LocalReference, console: Console) -> HostRecord:
    """Every step on one host, in order; the first failure skips the rest."""
    rec = HostRecord(transport=host.transport, address=host.address)
    out = console.host(host.name)
    with open_transport(host) as transport:
        ctx = StepContext(host, transport, project, run_dir, source, owner, reference, rec, plan.use_cache,
                          secrets=tuple(remote.secret_strings(host)))
        lock, stopped_by = None, None
        try:
            for step in ORDER:
                if step not in plan.steps:
                    rec.steps[step] = StepRecord("skipped", message="not selected")
                elif stopped_by:
                    rec.steps[step] = StepRecord("skipped", message=f"{stopped_by} failed")
                else:
                    if lock is None and step not in LOCK_FREE_STEPS:
                        lock = _acquire(ctx, step, out)
                        if lock is None:
                            stopped_by = step
                            continue
                    rec.steps[step] = _run_step(ctx, step, out)
                    if rec.steps[step].status in record.FAILED_STEP_STATUSES:
                        stopped_by = step
        finally:
            if lock:
                lock.release()
    rec.status = record.host_status(rec.steps)
    return rec


def _acquire(ctx: StepContext, step: str, out) -> state.HostLock | None:
    """Take the host lock for the rest of the run; on failure record it as the step's failure."""
    try:
        lock = state.acquire(ctx.transport, ctx.owner)
    except KdError as e:
        out(f"{step}: FAILED  {e.message}")
        ctx.record.steps[step] = StepRecord("failed", 0.0, None, e.message, e.tail)
        return None
    if lock.stale:
        out(f"recovered the lock left by a run that died: {lock.stale}")
    return lock


def _run_step(ctx: StepContext, step: str, out) -> StepRecord:
    """One step with its log file, timing and outcome; errors become a failed/timeout record."""
    log_path = ctx.run_dir.log_path(ctx.host.name, step)
    start = time.monotonic()
    with ownership.private_open(log_path) as log:
        def write(text: str) -> None:
            if ctx.secrets:
                text = "\n".join(record.redact(line, ctx.secrets) for line in record.redact(text, ctx.secrets).split("\n"))
            log.write(f"{visible(text)}\n")
            log.flush()
            out(f"{step:9} | {text}")
        ctx.step, ctx.log = step, write
        out(f"{step:9} ...")
        try:
            outcome = RUNNERS[step](ctx)
            status, message, tail = outcome.status, outcome.message, ""
        except KdError as e:
            status = "timeout" if _timed_out(e) else "failed"
            message, tail = e.message, e.tail
            write(str(e))
    if ctx.secrets:
        message, tail = record.redact(message, ctx.secrets), record.redact(tail, ctx.secrets)
    seconds = round(time.monotonic() - start, 3)
    out(f"{step:9} {status.upper() if status in record.FAILED_STEP_STATUSES else status} "
        f"({seconds:.1f} s){'  ' + message if message else ''}")
    if status in record.FAILED_STEP_STATUSES and not tail:
        tail = record.read_tail(log_path)
    return StepRecord(status, seconds, ctx.run_dir.log_ref(ctx.host.name, step), message, tail)


def _timed_out(error: KdError) -> bool:
    return error.exit_status in (124, 137) or (error.exit_status is None and "timed out" in error.message)


def _crashed(host: Host, outcome) -> HostRecord:
    """The record of a host whose run ended without one (an unexpected error or an interrupt)."""
    message = outcome.summary if outcome else "interrupted"
    return HostRecord(status="failed", transport=host.transport, address=host.address,
                      steps={"preflight": StepRecord("failed", message=message)})
