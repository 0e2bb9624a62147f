"""Bisect: find the first commit between a good and a bad revision whose engine is bad.

    commits = commit_range(repo, "v1.2", "HEAD", "engine_src")
    with Worktree(repo) as tree:
        result = search(commits, lambda c: probe(tree.checkout(c.sha)))
    print(result.last_line())          # first bad commit: <sha> <subject>

The repository is never touched: every probe commit is checked out in a git worktree of its own
(under a temporary directory, removed at the end), so the user's checkout, index and branch stay
as they were. Commits whose engine tree (``git rev-parse <commit>:engine_src``) equals their
parent's cannot differ in behaviour and are not probed: the range is a list of distinct engine
trees. The search first confirms both ends (the bad revision is bad, the good one good), then
halves the commits between them: at most ceil(log2 n) + 2 probes for n distinct trees.

What makes a commit bad is the caller's probe: its golden step failing, or a metric measured
worse than the midpoint between the good and the bad measurement (``MetricJudge``), beyond the
noise that the two ends' samples show. A CPU timing is compared per CPU second when the ends
report it so (other processes on the host's cores then cost nothing), and a probe whose figure
lands in the middle of the gap between the ends (neither clearly good nor clearly bad: a
disturbed measurement) is measured again, up to REMEASURE times, its samples pooled; returning to
a commit costs no build (the host keeps builds by tree).
"""
from __future__ import annotations

import math
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

from .detector import Policy, mad, median
from ..errors import KdError, UsageError


REMEASURE = 2          # more measurements of a probe whose figure is too close to call
UNSURE_BAND = 1 / 8     # too close to call: within this fraction of the ends' gap around the midpoint


class BisectError(KdError):
    """The bisection cannot go on: an end is not what it was said to be, or a probe failed."""


@dataclass(frozen=True)
class Commit:
    """One commit of the range: its sha, subject and engine tree id."""

    sha: str
    subject: str
    tree: str


@dataclass
class ProbeResult:
    """What one probe found at a commit."""

    bad: bool
    evidence: str
    value: float | None = None
    samples: tuple[float, ...] = ()
    built: bool = True              # whether the host compiled for it (False: a cached build)
    seconds: float = 0.0
    better: str = "higher"          # a metric's direction
    cpu_samples: tuple[float, ...] = ()   # a CPU timing's samples per CPU second
    ratio: bool = False             # a speed-up (two timings' ratio): judged by its median, as the detector does

    def pooled(self, again: ProbeResult) -> ProbeResult:
        """This probe and a second measurement of the same commit as one: samples pooled, the
        value the better of the two (a value is the engine's best repeat), evidence of both."""
        values = [v for v in (self.value, again.value) if v is not None]
        value = (max(values) if self.better == "higher" else min(values)) if values else None
        return ProbeResult(again.bad, f"{self.evidence}; again: {again.evidence}", value, self.samples + again.samples,
                           self.built or again.built, self.seconds + again.seconds, self.better,
                           self.cpu_samples + again.cpu_samples, self.ratio)


class Judge(Protocol):
    """Decides a probe: bad or good, and whether its measurement is too close to call."""

    def __call__(self, result: ProbeResult) -> bool: ...

    def unsure(self, result: ProbeResult) -> bool: ...


class SelfJudged:
    """A probe that says itself whether it is bad (the golden check): never unsure."""

    def __call__(self, result: ProbeResult) -> bool:
        """The probe's own verdict."""
        return result.bad

    def unsure(self, result: ProbeResult) -> bool:
        """Never: a golden check is exact."""
        return False


@dataclass
class BisectResult:
    """The first bad commit, with every probe made on the way."""

    first_bad: Commit
    last_good: Commit
    probes: list[tuple[Commit, ProbeResult]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def builds(self) -> int:
        """How many probes compiled the engine."""
        return sum(1 for _, p in self.probes if p.built)

    def last_line(self) -> str:
        """``first bad commit: <sha> <subject>``."""
        return f"first bad commit: {self.first_bad.sha} {self.first_bad.subject}"


def _git(repo: Path, *args: str, what: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UsageError(f"{what}: git {' '.join(args)} exited with {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def resolve(repo: Path, rev: str, flag: str) -> str:
    """The full sha of ``rev``; UsageError naming the flag when it is no commit of the repository."""
    if not rev or rev.startswith("-"):
        raise UsageError(f"{flag} {rev!r} is not a revision")
    return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", what=f"{flag} {rev!r} is no commit in {repo}").strip()


def commit_range(repo: Path | str, good: str, bad: str, source: str = "engine_src") -> list[Commit]:
    """The commits from ``good`` to ``bad`` (both included, oldest first) along the ancestry path,
    one per distinct engine tree (a commit that leaves ``source`` unchanged is dropped)."""
    repo = Path(repo)
    good_sha, bad_sha = resolve(repo, good, "--good"), resolve(repo, bad, "--bad")
    if good_sha == bad_sha:
        raise UsageError(f"--good and --bad are the same commit ({good_sha[:12]})")
    if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", good_sha, bad_sha]).returncode != 0:
        raise UsageError(f"--good {good} ({good_sha[:12]}) is not an ancestor of --bad {bad} ({bad_sha[:12]})")
    listed = _git(repo, "rev-list", "--reverse", "--ancestry-path", "--first-parent", f"{good_sha}..{bad_sha}",
                  what="listing the commits").split()
    commits: list[Commit] = []
    for sha in [good_sha, *listed]:
        line = _git(repo, "log", "-1", "--format=%H%x00%s", sha, what="reading a commit").strip()
        sha, subject = line.split("\x00", 1)
        tree = _git(repo, "rev-parse", f"{sha}:{source}", what=f"{source} at {sha[:12]}").strip()
        if commits and commits[-1].tree == tree:
            continue
        commits.append(Commit(sha, subject, tree))
    if len(commits) < 2:
        raise UsageError(f"{source} is the same at --good {good} and --bad {bad}: nothing to bisect")
    return commits


def command_for(host: str, metric: str, good: str | None, bad: str | None) -> str | None:
    """The exact `invoke bisect` command that finds the commit behind a metric's regression
    between a good and a bad commit; None when either is unknown or they are the same."""
    if not good or not bad or good == bad:
        return None
    return f"invoke bisect --host {shlex.quote(host)} --good {good} --bad {bad} --metric {shlex.quote(metric)}"


def max_probes(n: int) -> int:
    """The most probes a search over n distinct trees makes: both ends, then halving."""
    return math.ceil(math.log2(max(n, 2))) + 2


def search(commits: Sequence[Commit], probe: Callable[[Commit], ProbeResult],
           classify: Callable[[ProbeResult, ProbeResult], Judge] | None = None,
           log: Callable[[str], None] = print) -> BisectResult:
    """Find the first bad commit: probe the last commit and the first, confirm that the last is
    bad and the first good, then halve the range. Without ``classify`` a probe says itself
    whether it is bad (the golden check); with it, ``classify(good_end, bad_end)`` returns the
    judge of every probe (a metric: ``MetricJudge``); a probe it finds too close to call is
    measured again (REMEASURE times at most, pooled). Each probe is logged and kept."""
    start = time.monotonic()
    probes: list[tuple[Commit, ProbeResult]] = []

    def once(index: int) -> ProbeResult:
        t0 = time.monotonic()
        result = probe(commits[index])
        result.seconds = result.seconds or round(time.monotonic() - t0, 3)
        return result

    def measure(index: int, judge: Judge | None = None) -> ProbeResult:
        result = once(index)
        tries = 0
        while judge is not None and tries < REMEASURE and judge.unsure(result):
            tries += 1
            log(f"  {commits[index].sha[:12]}: {result.evidence} is too close to call: measuring again")
            result = result.pooled(once(index))
        probes.append((commits[index], result))
        return result

    def report(index: int, result: ProbeResult) -> bool:
        commit = commits[index]
        log(f"probe {[c for c, _ in probes].index(commit) + 1}/{max_probes(len(commits))}: {commit.sha[:12]} "
            f"{commit.subject[:60]}: {'BAD' if result.bad else 'good'} ({result.evidence}"
            f"{'' if result.built else '; cached build'}, {result.seconds:.1f} s)")
        return result.bad

    last, first = measure(len(commits) - 1), measure(0)
    decide = classify(first, last) if classify else SelfJudged()
    for result in (last, first):
        result.bad = decide(result)
    if not report(len(commits) - 1, last):
        raise BisectError(f"the bad revision {commits[-1].sha[:12]} is not bad: {last.evidence}")
    if report(0, first):
        raise BisectError(f"the good revision {commits[0].sha[:12]} is bad: {first.evidence}")
    good, bad = 0, len(commits) - 1
    while bad - good > 1:
        middle = (good + bad) // 2
        result = measure(middle, decide)
        result.bad = decide(result)
        if report(middle, result):
            bad = middle
        else:
            good = middle
    return BisectResult(commits[bad], commits[good], probes, round(time.monotonic() - start, 3))


def judged_by_best(cpu_samples: Sequence[float], ratio: bool = False) -> bool:
    """Whether a probe's figure per CPU second is its best run (else the median of its runs)."""
    return not ratio and len(cpu_samples) >= Policy.best_of


def per_cpu_figure(cpu_samples: Sequence[float], better: str, ratio: bool = False) -> tuple[float, tuple[float, ...]]:
    """A probe's figure per CPU second and the samples behind it: with ``Policy.best_of`` runs or
    more (not a speed-up) its best run, with the better half of its runs as the samples (the
    runs the load disturbed least: their spread is the best's noise, where the other half's
    measures the load); else the median of its runs, with all of them."""
    if not judged_by_best(cpu_samples, ratio):
        return median(cpu_samples), tuple(cpu_samples)
    ranked = sorted(cpu_samples, reverse=better == "higher")
    return ranked[0], tuple(ranked[: len(ranked) // 2 + 1])


class MetricJudge:
    """Bad or good for a metric: closer to the bad end's measurement than to the good end's.

    The threshold is the midpoint of the two ends' figures: per CPU second when both ends report
    ``cpu_samples``, else their values. Per CPU second a probe of ``Policy.best_of`` runs or more
    is judged by its best run and a smaller one (or a speed-up) by the median of its runs, as the
    detector judges a night (``detector._per_cpu`` says why). The ends must differ by more than
    3 x the larger MAD of the samples behind their figures, or there is no step to find. A probe within
    UNSURE_BAND of the gap around the midpoint is too close to call (``unsure``). Use it as
    ``search``'s ``classify``: ``search(commits, probe, lambda good, bad: MetricJudge(good, bad, "higher"))``.
    """

    def __init__(self, good: ProbeResult, bad: ProbeResult, better: str):
        if good.value is None or bad.value is None:
            raise BisectError("a metric probe returned no value")
        self.per_cpu = bool(good.cpu_samples and bad.cpu_samples)
        self.better = better
        (g, good_samples), (b, bad_samples) = self._figure(good), self._figure(bad)
        noise = max([mad(s) for s in (good_samples, bad_samples) if len(s) >= 2] or [0.0])
        self.gap = abs(b - g)
        worse = (b < g) if better == "higher" else (b > g)
        unit = " per CPU second" if self.per_cpu else ""
        if not worse or self.gap <= 3 * noise:
            raise BisectError(f"the bad end ({b:g}{unit}) is not worse than the good end ({g:g}{unit}) "
                              f"beyond 3 x the samples' MAD ({noise:g}): nothing to bisect")
        self.threshold = (g + b) / 2

    def _figure(self, result: ProbeResult) -> tuple[float, tuple[float, ...]]:
        """The figure a probe is judged by, and the samples its noise is read from."""
        if self.per_cpu:
            if not result.cpu_samples:
                raise BisectError(f"a probe reported no figures per CPU second, the ends did ({result.evidence})")
            return per_cpu_figure(result.cpu_samples, self.better, result.ratio)
        if result.value is None:
            raise BisectError(f"a metric probe returned no value ({result.evidence})")
        return result.value, result.samples

    def __call__(self, result: ProbeResult) -> bool:
        """Whether a measurement sits on the bad side of the midpoint."""
        value, _ = self._figure(result)
        return value < self.threshold if self.better == "higher" else value > self.threshold

    def unsure(self, result: ProbeResult) -> bool:
        """Whether a measurement is too close to the midpoint to call."""
        value, _ = self._figure(result)
        return abs(value - self.threshold) < UNSURE_BAND * self.gap


class Worktree:
    """A detached git worktree of the repository in a temporary directory, for probing commits
    without touching the user's checkout; removed (and pruned from the repository) on exit."""

    def __init__(self, repo: Path | str):
        self.repo = Path(repo)
        self.parent: Path | None = None
        self.path: Path | None = None

    def __enter__(self) -> Worktree:
        self.parent = Path(tempfile.mkdtemp(prefix="kdtree-bisect-"))
        self.path = self.parent / "tree"
        _git(self.repo, "worktree", "add", "--detach", "--quiet", str(self.path), "HEAD", what="creating the bisect worktree")
        return self

    def checkout(self, sha: str) -> Path:
        """Check ``sha`` out in the worktree (forcefully: nothing in it is the user's); its path."""
        assert self.path is not None
        _git(self.path, "checkout", "--detach", "--force", "--quiet", sha, what=f"checking out {sha[:12]}")
        _git(self.path, "clean", "-fdxq", what="cleaning the bisect worktree")
        return self.path

    def __exit__(self, *exc) -> None:
        if self.path is not None:
            subprocess.run(["git", "-C", str(self.repo), "worktree", "remove", "--force", str(self.path)],
                           capture_output=True)
        if self.parent is not None:
            shutil.rmtree(self.parent, ignore_errors=True)
        subprocess.run(["git", "-C", str(self.repo), "worktree", "prune"], capture_output=True)
