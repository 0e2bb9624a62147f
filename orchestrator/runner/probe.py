"""A bisect probe: one commit's engine deployed, built and measured (or golden-checked) on a host.

    repo, source = repository(inventory.project)
    with Worktree(repo) as tree:
        result = search(commits, Prober(inventory, host, console, tree, source, metric))

Each probe is an ordinary run of the pipeline (command ``bisect``, its own run directory under
runs/, ``runs/latest`` left alone) with only the steps the question needs: sync, build, bundles and
bench for a metric, sync, build, bundles and golden for the golden check. The engine source is
the commit's checkout in the bisect worktree, so the golden check compares against that commit's
own committed expected manifest. The host keeps several builds by tree hash (the engine's build
cache), so coming back to a tree compiles nothing: such a probe says ``cached build``.
"""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

from .. import remote
from . import pipeline
from ..records import record, report, run_store
from ..records.bisect import BisectError, Commit, ProbeResult, Worktree, judged_by_best, per_cpu_figure
from .console import Console
from ..errors import UsageError
from ..inventory import Host, Inventory, Project


def repository(project: Project) -> tuple[Path, str]:
    """The git repository holding the project and the engine source's path inside it."""
    proc = subprocess.run(["git", "-C", str(project.root), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UsageError(f"{project.root} is not in a git repository: bisect needs the engine's history")
    repo = Path(proc.stdout.strip())
    try:
        source = project.source.resolve().relative_to(repo.resolve())
    except ValueError:
        raise UsageError(f"the engine source {project.source} is not inside the git repository {repo}") from None
    return repo, str(source)


class Prober:
    """The probe ``bisect.search`` calls for each commit."""

    def __init__(self, inv: Inventory, host: Host, console: Console, tree: Worktree, source: str,
                 metric: str | None = None):
        self.inv, self.host, self.console, self.tree, self.source, self.metric = inv, host, console, tree, source, metric

    def __call__(self, commit: Commit) -> ProbeResult:
        path = self.tree.checkout(commit.sha)
        project = dataclasses.replace(self.inv.project, source=path / self.source)
        # the bisect command's steps but the measure not asked for: bench for a metric, golden for the golden check
        plan = pipeline.Plan.choose(skip="golden" if self.metric else "bench", command="bisect")
        run_dir, run = pipeline.execute(dataclasses.replace(self.inv, project=project), [self.host], plan, self.console,
                                        secrets=remote.host_secrets([self.host]))
        run_store.write_run(run_dir, run)
        report.render_run(run_dir.path)
        if run.status == "interrupted":
            raise KeyboardInterrupt
        host = run.hosts[self.host.name]
        built = host.steps["build"].status == "passed"
        return self._measured(commit, host, built, run_dir) if self.metric else self._golden(commit, host, built, run_dir)

    def _failed(self, commit: Commit, host: record.HostRecord, run_dir, allowed: str | None = None) -> None:
        """BisectError when a step the verdict does not rest on failed (the commit cannot be judged)."""
        for step, s in host.steps.items():
            if s.status in record.UNFINISHED_STEP_STATUSES and step != allowed:
                raise BisectError(f"commit {commit.sha[:12]} ({commit.subject}) cannot be judged: its {step} step "
                                  f"{s.status}: {s.message} (run {run_dir.path})", host=self.host.name, tail=s.tail)

    def _measured(self, commit: Commit, host: record.HostRecord, built: bool, run_dir) -> ProbeResult:
        self._failed(commit, host, run_dir)
        metrics = (host.bench or {}).get("metrics", {})
        if self.metric not in metrics:
            raise BisectError(f"commit {commit.sha[:12]}: the bench has no metric {self.metric!r} "
                              f"(it has {', '.join(sorted(metrics)[:12]) or 'none'})", host=self.host.name)
        m = metrics[self.metric]
        reused = " (a reused result)" if host.steps["bench"].status == "cached" else ""
        cpu = tuple(m.get("cpu_samples") or ())
        ratio = m["unit"] == "x"
        per_cpu = ""
        if cpu:
            figure, _ = per_cpu_figure(cpu, m["better"], ratio)
            per_cpu = f", {figure:g} per CPU second ({'best' if judged_by_best(cpu, ratio) else 'median'} of {len(cpu)} runs)"
        return ProbeResult(False, f"{self.metric} {m['value']:g} {m['unit']}{per_cpu}{reused}", m["value"],
                           tuple(m.get("samples") or ()), built, better=m["better"], cpu_samples=cpu, ratio=ratio)

    def _golden(self, commit: Commit, host: record.HostRecord, built: bool, run_dir) -> ProbeResult:
        self._failed(commit, host, run_dir, allowed="golden")
        return golden_verdict(host, built)


def golden_verdict(host: record.HostRecord, built: bool) -> ProbeResult:
    """A golden probe's verdict from its host record: good when every bundle's checks passed, in a
    golden step that passed or was `cached` (the engine's outputs reused from a run of the same
    executables, build key, bundles and scripts, and checked again against this commit's expected
    manifest: the evidence says so); else bad, naming the first bundle that differs."""
    step = host.steps["golden"]
    failed = [(name, g) for name, g in host.golden.items() if g.status != "passed"]
    if step.status in ("passed", "cached") and not failed:
        reused = f" (the engine's outputs reused from run {step.reused_from})" if step.status == "cached" else ""
        return ProbeResult(False, f"golden tokens of {len(host.golden)} bundle(s) match{reused}", built=built)
    if not failed:
        return ProbeResult(True, f"golden step {step.status}: {step.message}", built=built)
    name, g = failed[0]
    where = f"{g.mismatch.check} @ {g.mismatch.position}" if g.mismatch else g.detail
    return ProbeResult(True, f"golden: {len(failed)} bundle(s) differ, first {name}: {where}", built=built)
