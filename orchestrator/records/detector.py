"""Benchmark regression verdicts from a metric's history: pure functions over numbers.

A metric's history is the series of its values on comparable runs (same host, GPU model, backend
and build flags; reused results left out), oldest first. ``judge`` decides whether the newest
value is a regression, and keeps the evidence.

The method (docs/nightly.md, "Benchmark history and regression detection", says why):

- history rule, with at least ``Policy.min_points`` earlier points: the baseline is the median of
  the last ``Policy.window`` points; the noise is the larger of the window's robust spread
  (1.4826 x MAD of its values: how much run-to-run results move), the run's own sample spread
  (1.4826 x MAD of its samples) and a floor (0.5 % of the baseline). The change is a regression
  when it is worse than the tolerance, its robust z-score (change / noise) is beyond
  ``Policy.z``, and, when both sides have samples, a one-sided Mann-Whitney rank test of the
  run's samples against the window's pooled samples gives p < ``Policy.alpha``.
- drift rule, with at least 2 x window earlier points: a slow slide, each run within the noise of
  the last, is caught by comparing the last window (and the new value) with the window before it:
  their medians differ by more than the tolerance and a Mann-Whitney test of the runs' values
  (one value per run, so run-to-run noise is what it measures) gives p < ``Policy.alpha``.
  A step the history rule caught inside those two windows explains their difference and is not
  reported again as a drift.
- few-points rule, with fewer points (a new host, the second night): a regression is a change
  worse than the tolerance and beyond ``Policy.sample_mads`` (3) x the MAD of the metric's own
  samples (the largest of this run's and each earlier run's, and of the earlier runs' values
  when there are two or more).
- per CPU second, for CPU timings that carry their figures per CPU second (``cpu_samples``:
  each repeat's figure over the CPU seconds per wall second the process had), the same rules
  also judge the per-CPU-second series of the earlier runs that have one, each night by its best
  repeat where the series' nights have ``Policy.best_of`` repeats or more (not for speed-ups;
  ``_per_cpu`` says why). With a history (the
  history or drift rule), a regression of that series is one when the wall clock too is worse
  than the tolerance, even where the wall clock's own noise on a loaded machine hides it (a
  50 % step, measured): the CPU seconds' noise is measured and other processes taking the cores
  barely move it. With fewer points a regression must show on both clocks by their rules. A wall-clock
  regression that the CPU seconds do not confirm was starved, not slowed by its code: its
  verdict is ``unjudged`` with the CPU-second change as the reason (measured under contention).
- relative to the calibration probe, for CPU timings that also carry ``cal_samples`` (the
  engine's fixed probe workload, measured beside each repeat, in the metric's own terms): cache
  and memory contention cost CPU seconds too (20-40 % on a starved night), to the probe as to the
  repeat beside it, so each repeat's figure per CPU second over the probe's (``cpu / cal``) keeps
  what the code did and cancels what the machine did, at the price of the probe's own noise
  (measured: about twice the CPU seconds'). So the ratio confirms, the CPU seconds decide: where
  this run and the history carry it (as many comparable points as the per-CPU-second series, up
  to a window), a per-CPU-second regression must show relative to the probe too: with few points
  by the same rule, with a history (whose run-to-run noise the CPU seconds' rule measured) by
  being worse than the tolerance. One it does not confirm is ``unjudged`` (measured under
  contention). The verdict keeps the change relative to the probe (``cal_change``) and the
  probe's own (``calibration_change``: how much the machine alone moved the metric).

A regression stays one while the runs after it stay at the worse level and the window has not yet
moved to it; each verdict names the first run of such a streak (``since_run``), so a caller can
tell a new regression from one already reported.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

MAD_SCALE = 1.4826          # MAD x this estimates a normal distribution's standard deviation
EXACT_LIMIT = 2500          # Mann-Whitney: exact distribution up to n x m pairs, normal beyond
STATUSES = ("regressed", "improved", "same", "new", "unjudged")
METHODS = ("history", "drift", "few-points", "none")


@dataclass(frozen=True)
class Policy:
    """The detector's settings (the defaults are what nightly uses)."""

    window: int = 10            # last N comparable runs form the baseline
    min_points: int = 5         # fewer earlier points: the few-points rule
    z: float = 4.0              # robust z-score beyond which a change is not noise
    alpha: float = 0.01         # rank tests: p below this is significant
    sample_mads: float = 3.0    # few-points rule: change beyond this many MADs of the samples
    floor: float = 0.005        # noise never below this fraction of the baseline
    best_of: int = 5            # per CPU second, nights of at least this many runs are judged by their best


DEFAULT_POLICY = Policy()


@dataclass(frozen=True)
class Point:
    """One run's measurement of one metric: its value (a median of repeats), its samples when the
    engine reported them (else the samples' MAD when known), and where it came from."""

    value: float
    samples: tuple[float, ...] = ()
    mad: float | None = None
    run_id: str = ""
    commit: str | None = None
    noisy: bool = False
    cpu_samples: tuple[float, ...] = ()     # the samples per CPU second (CPU timings)
    cal_samples: tuple[float, ...] = ()     # the calibration probe beside each of those, same terms
    ratio: bool = False                     # a speed-up: two timings' ratio, run by run (see _per_cpu)

    def sample_mad(self) -> float | None:
        """The MAD of the samples (or the MAD reported without them); None when unknown."""
        if len(self.samples) >= 2:
            return mad(self.samples)
        return self.mad


@dataclass
class Verdict:
    """What the detector decided about one metric's newest value, with its evidence."""

    status: str                     # regressed | improved | same | new | unjudged
    method: str                     # history | drift | few-points | none
    value: float
    better: str = "higher"
    tolerance: float = 0.10
    baseline: float | None = None   # median of the baseline window
    ratio: float | None = None      # value / baseline
    change: float | None = None     # relative change, > 0 is worse
    spread: float | None = None     # the noise scale the change was measured against
    score: float | None = None      # robust z-score (> 0 is worse), or change in sample MADs
    p_value: float | None = None
    window: list[str] = field(default_factory=list)    # run ids of the baseline window
    window_commits: list[str] = field(default_factory=list)
    sample_mad: float | None = None  # MAD of this run's samples
    noisy: bool = False
    good_commit: str | None = None  # newest commit of the window on the baseline's side
    bad_commit: str | None = None   # the judged run's commit
    since_run: str | None = None    # a regression: the first run of its unbroken streak
    since_commit: str | None = None
    cpu_change: float | None = None  # the change per CPU second (CPU timings), > 0 is worse
    cal_change: float | None = None  # the change of the ratio to the calibration probe, > 0 is worse
    calibration_change: float | None = None  # the probe's own change in the metric's terms (the machine)
    reason: str = ""

    @property
    def regressed(self) -> bool:
        return self.status == "regressed"

    def evidence(self) -> dict:
        """The verdict as JSON-ready data (for run.json's regressions and the history store)."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Robust statistics


def median(values: Iterable[float]) -> float:
    """The median (ValueError when empty)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("median of no values")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def mad(values: Iterable[float]) -> float:
    """The median absolute deviation from the median (not scaled)."""
    xs = list(values)
    centre = median(xs)
    return median(abs(x - centre) for x in xs)


def mann_whitney_less(xs: Sequence[float], ys: Sequence[float]) -> float:
    """One-sided Mann-Whitney U test: p-value of ``xs`` tending to be smaller than ``ys``.

    Exact (the permutation distribution of U) when there are no ties and n x m <= EXACT_LIMIT,
    else the normal approximation with tie correction and continuity correction.
    """
    n, m = len(xs), len(ys)
    if n == 0 or m == 0:
        raise ValueError("Mann-Whitney needs samples on both sides")
    ranks = _midranks([*xs, *ys])
    u = sum(ranks[:n]) - n * (n + 1) / 2           # pairs (x, y) with x > y (ties count 1/2)
    ties = len(set(ranks)) < n + m
    if not ties and n * m <= EXACT_LIMIT:
        counts = _u_distribution(n, m)
        return sum(counts[: int(round(u)) + 1]) / math.comb(n + m, n)
    mean = n * m / 2
    tie_term = sum(t ** 3 - t for t in _tie_sizes(ranks))
    var = n * m / 12 * ((n + m + 1) - tie_term / ((n + m) * (n + m - 1)))
    if var <= 0:
        return 1.0
    z = (u - mean + 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(-z / math.sqrt(2))


def _midranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _tie_sizes(ranks: list[float]) -> list[int]:
    sizes: dict[float, int] = {}
    for r in ranks:
        sizes[r] = sizes.get(r, 0) + 1
    return [t for t in sizes.values() if t > 1]


def _u_distribution(n: int, m: int) -> list[int]:
    """How many of the C(n+m, n) orderings give U = 0, 1, ..., n*m (the Gaussian binomial
    coefficient's coefficients, built one element at a time)."""
    # rows[j][u]: orderings of i x's and j y's with U = u, for the current i
    rows = [[1] for _ in range(m + 1)]
    for i in range(1, n + 1):
        new = [[1]]
        for j in range(1, m + 1):
            # the largest element is an x (it beats all j y's) or a y (adds nothing)
            a, b = rows[j], new[j - 1]
            size = i * j + 1
            row = [0] * size
            for u, c in enumerate(a):
                if u + j < size:
                    row[u + j] += c
            for u, c in enumerate(b):
                row[u] += c
            new.append(row)
        rows = new
    return rows[m]


# --------------------------------------------------------------------------------------------
# The verdict


def judge(current: Point, history: Sequence[Point], tolerance: float, better: str = "higher",
          policy: Policy = DEFAULT_POLICY) -> Verdict:
    """Whether ``current`` regressed against ``history`` (comparable earlier points, oldest first,
    reused results already left out), with the evidence. See the module docstring for the rules.

    A regression that the runs just before also showed is still a regression; ``since_run`` and
    ``since_commit`` name the first run of that unbroken streak (the run itself when it is new).
    """
    verdict = _judge(current, history, tolerance, better, policy)
    if verdict.status == "regressed":
        first = current
        for i in range(len(history) - 1, max(-1, len(history) - 1 - policy.window), -1):
            if _judge(history[i], history[:i], tolerance, better, policy).status != "regressed":
                break
            first = history[i]
        verdict.since_run, verdict.since_commit = first.run_id, first.commit
    return verdict


def _judge(current: Point, history: Sequence[Point], tolerance: float, better: str, policy: Policy) -> Verdict:
    """The verdict on one point, without looking for the start of a streak."""
    verdict = _judge_wall(current, history, tolerance, better, policy)
    if current.cpu_samples:
        _per_cpu_second(verdict, current, history, policy)
    return verdict


def _best(values: Sequence[float], better: str) -> float:
    return max(values) if better == "higher" else min(values)


def _per_cpu(point: Point, better: str, few: bool, best: bool) -> Point:
    """A CPU timing's point per CPU second: the best of its ``cpu_samples`` (its least disturbed
    run, as timeit advises). Measured on the same nights (docs/benchmarks/records/2026-12-03-issue-23-benchmark-history.md), the best of a
    night's runs moved 0.2-5 % between nights where their median moved 1.7-12.7 %: other
    processes slow most runs of a night by varying amounts and seldom speed one up, so the best is
    the figure the code sets. With a history its noise is the spread of the earlier nights' bests
    (the history rule's window), not of this night's runs, which measure the load; with few
    points (``few``), where no spread between nights is known yet, the runs' MAD is kept as the
    few-points rule's allowance. A speed-up (``ratio``) is judged by the median of its runs and
    their samples: load that slows one of its two timings moves it either way, so its best run is
    the luckiest, not the least disturbed (a replayed night raised a false alarm that way). So is
    a series whose nights have fewer than ``Policy.best_of`` runs (``best`` false): the best of 3
    runs of a starved night is still a starved run (replayed: nights of 3 runs raised 5 false
    alarms in 40 judged by their best, none by their median)."""
    if point.ratio or not best:
        return Point(median(point.cpu_samples), point.cpu_samples, None, point.run_id, point.commit, point.noisy)
    return Point(_best(point.cpu_samples, better), (), mad(point.cpu_samples) if few else None, point.run_id,
                 point.commit, point.noisy)


def _calibrated(point: Point, better: str, few: bool, best: bool) -> Point:
    """A CPU timing's point relative to the calibration probe: the best of its figures per CPU
    second over the best of the probe's beside them (both in the metric's terms, so the direction
    stays), each the least disturbed of its night, as ``_per_cpu``; with few points the MAD of the
    runs' ratios is kept as the allowance; a speed-up's (or, without ``best``, any) is the median
    of its runs' ratios."""
    ratios = tuple(c / k for c, k in zip(point.cpu_samples, point.cal_samples))
    if point.ratio or not best:
        return Point(median(ratios), ratios, None, point.run_id, point.commit, point.noisy)
    return Point(_best(point.cpu_samples, better) / _best(point.cal_samples, better), (), mad(ratios) if few else None,
                 point.run_id, point.commit, point.noisy)


def _has_calibration(point: Point) -> bool:
    return len(point.cal_samples) == len(point.cpu_samples) > 0 and all(k > 0 for k in point.cal_samples)


def _probe_change(current: Point, window: Sequence[Point], better: str) -> float | None:
    """How much the calibration probe alone moved, in the metric's terms (> 0: the machine made it worse)."""
    base = median(median(p.cal_samples) for p in window)
    return _worse(median(current.cal_samples), base, better) if base > 0 else None


def _per_cpu_second(verdict: Verdict, current: Point, history: Sequence[Point], policy: Policy) -> None:
    """Judge the per-CPU-second series too: with a history its regression is one when the wall
    clock is worse than the tolerance too; with fewer points it must confirm the wall clock's, and
    the series relative to the calibration probe must confirm both where the history has it; a
    wall-clock regression they do not confirm is unjudged (the run was starved, or its caches and
    memory were contended); a per-CPU-second regression the wall clock does not show (a load that
    fell on the same night can hide it) is unjudged too, never passed."""
    earlier = [p for p in history if p.cpu_samples]
    if not earlier:
        return
    few = len(earlier[-policy.window:]) < policy.min_points
    best = all(len(p.cpu_samples) >= policy.best_of for p in [current, *earlier[-2 * policy.window:]])
    cpu = _judge_wall(_per_cpu(current, verdict.better, few, best), [_per_cpu(p, verdict.better, few, best) for p in earlier],
                      verdict.tolerance, verdict.better, policy)
    verdict.cpu_change = cpu.change
    probe = _probe_verdict(verdict, current, earlier, policy, best)
    beyond_tolerance = verdict.change is not None and verdict.change > verdict.tolerance
    regressed = cpu.status == "regressed" and (verdict.status == "regressed" or (cpu.method != "few-points" and beyond_tolerance))
    if regressed and (probe is None or _probe_confirms(probe)):
        also = f"; relative to the calibration probe: {probe.reason}" if probe is not None else ""
        verdict.reason = f"per CPU second: {cpu.reason}{also}; wall clock: {verdict.reason}"
        verdict.status, verdict.method = "regressed", cpu.method
        verdict.good_commit = cpu.good_commit or verdict.good_commit
        return
    if regressed and probe is not None:     # the CPU seconds confirm, the probe explains: the caches
        verdict.status = "unjudged"
        verdict.reason = (f"measured under contention: {cpu.method} rule per CPU second {_shown(cpu.change)} ({cpu.reason}), "
                          f"wall clock {_shown(verdict.change)}, but relative to the calibration probe the change is "
                          f"{_shown(probe.change)} ({probe.reason}; the probe itself {_shown(verdict.calibration_change)}): "
                          "other processes took the caches, not the code")
        return
    if verdict.status == "regressed":
        verdict.status = "unjudged"
        verdict.reason = (f"measured under contention: {verdict.reason}, but per CPU second the change is "
                          f"{_shown(cpu.change)} ({cpu.reason}): other processes took the cores, not the code")
    elif cpu.status == "regressed":     # the clocks disagree: a load that fell can hide a slower code
        probe_text = f"; relative to the calibration probe {_shown(probe.change)}" if probe is not None else ""
        verdict.status = "unjudged"
        verdict.reason = (f"the clocks disagree: per CPU second {_shown(cpu.change)} ({cpu.reason}), but the wall "
                          f"clock {_shown(verdict.change)} ({verdict.reason}){probe_text}: not judged")


def _probe_confirms(probe: Verdict) -> bool:
    """Whether the series relative to the calibration probe confirms a per-CPU-second regression:
    by the same rule as the CPU seconds (with few points: the tolerance and the samples' MADs;
    with a history: the tolerance and the spread of its own earlier nights). Being worse than the
    tolerance alone is not enough: a night whose probe moved 42 % left a MoE timing 11 % worse
    relative to it, at a robust z of 0.5 against the nights before (the 20 quiet nights of
    docs/benchmarks/records/2026-12-03-issue-23-benchmark-history.md: a false alarm under the older rule)."""
    return probe.status == "regressed"


def _probe_verdict(verdict: Verdict, current: Point, earlier: list[Point], policy: Policy, best: bool) -> Verdict | None:
    """The series relative to the calibration probe judged by the same rules, when this run and
    as many of the earlier runs as have CPU seconds (up to a window) carry the probe; its change
    and the probe's own go into the verdict's evidence."""
    probed = [p for p in earlier if _has_calibration(p)]
    if not _has_calibration(current) or len(probed) < min(len(earlier), policy.window):
        return None
    few = len(probed[-policy.window:]) < policy.min_points
    probe = _judge_wall(_calibrated(current, verdict.better, few, best), [_calibrated(p, verdict.better, few, best) for p in probed],
                        verdict.tolerance, verdict.better, policy)
    verdict.cal_change = probe.change
    verdict.calibration_change = _probe_change(current, probed[-policy.window:], verdict.better)
    return probe


def _shown(change: float | None) -> str:
    return f"{change:+.1%}" if change is not None else "unknown"


def _judge_wall(current: Point, history: Sequence[Point], tolerance: float, better: str, policy: Policy) -> Verdict:
    """The verdict on one point by its values (the wall clock for timings)."""
    verdict = Verdict("same", "none", current.value, better, tolerance, noisy=current.noisy,
                      bad_commit=current.commit)
    if not history:
        verdict.status, verdict.reason = "new", "no comparable earlier run"
        return verdict
    window = list(history[-policy.window:])
    base = median(p.value for p in window)
    verdict.baseline, verdict.window = base, [p.run_id for p in window]
    verdict.window_commits = _unique(p.commit for p in window if p.commit)
    if base <= 0:
        verdict.status, verdict.reason = "unjudged", f"baseline {base:g} is not positive"
        return verdict
    verdict.ratio = current.value / base
    verdict.change = _worse(current.value, base, better)
    verdict.sample_mad = current.sample_mad()
    verdict.good_commit = _good_commit(window, base, better, tolerance)
    if len(window) < policy.min_points:
        return _few_points(verdict, current, window, policy)
    _history_rule(verdict, current, window, policy)
    if verdict.status == "same" and len(history) >= 2 * policy.window and not _stepped(history, tolerance, better, policy):
        _drift_rule(verdict, current, list(history[-2 * policy.window:-policy.window]), window, policy)
    return verdict


def _stepped(history: Sequence[Point], tolerance: float, better: str, policy: Policy) -> bool:
    """Whether a point of the last two windows was a step by the history rule: then the two
    windows differ by that step, already reported, and the drift rule must not report it again."""
    for i in range(len(history) - 2 * policy.window, len(history)):
        window = list(history[max(0, i - policy.window):i])
        if len(window) < policy.min_points:
            continue
        base = median(p.value for p in window)
        if base <= 0:
            continue
        probe = Verdict("same", "none", history[i].value, better, tolerance, baseline=base,
                        change=_worse(history[i].value, base, better))
        _history_rule(probe, history[i], window, policy)
        if probe.status != "same":
            return True
    return False


def _compared(verdict: Verdict) -> tuple[float, float]:
    """The baseline and the change of a verdict that the rules judge (judge sets both first)."""
    if verdict.baseline is None or verdict.change is None:
        raise ValueError(f"verdict on {verdict.value:g} has no baseline to compare with")
    return verdict.baseline, verdict.change


def _worse(value: float, base: float, better: str) -> float:
    """Relative change from base, positive when worse in the metric's direction."""
    change = (value - base) / abs(base)
    return -change if better == "higher" else change


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _few_points_mad(current: Point, window: list[Point]) -> float | None:
    """The noise the few-points rule allows for: the largest MAD of the metric's own samples (this
    run's and each earlier run's), and of the earlier runs' values when there are two or more.
    A noisy metric (CPU timings, a busy GPU) also counts the MAD of all the earlier runs' samples
    pooled: a load slows a whole run, which one run's samples cannot show. The run under judgement
    never widens that pool: its own shift would hide itself."""
    mads = [m for m in (p.sample_mad() for p in [current, *window]) if m is not None]
    if len(window) >= 2:
        mads.append(mad(p.value for p in window))
    pooled = [s for p in window for s in (p.samples or (p.value,))]
    if any(p.noisy for p in [current, *window]) and len(pooled) >= 2:
        mads.append(mad(pooled))
    return max(mads) if mads else None


def _good_commit(window: list[Point], base: float, better: str, tolerance: float) -> str | None:
    """The newest commit in the window whose value sits on the baseline's side (for bisect)."""
    for p in reversed(window):
        if p.commit and _worse(p.value, base, better) <= tolerance / 2:
            return p.commit
    return None


def _few_points(verdict: Verdict, current: Point, window: list[Point], policy: Policy) -> Verdict:
    verdict.method = "few-points"
    base, change = _compared(verdict)
    noise = _few_points_mad(current, window)
    distance = abs(current.value - base)
    verdict.spread = noise
    verdict.score = distance / noise if noise else None
    beyond = abs(change) > verdict.tolerance and distance > policy.sample_mads * (noise or 0.0)
    verdict.status = ("regressed" if change > 0 else "improved") if beyond else "same"
    allowance = f"{policy.sample_mads:g} x MAD {noise:.4g}" if noise else "no samples reported"
    verdict.reason = (f"{len(window)} comparable earlier run(s), fewer than {policy.min_points}: "
                      f"change {change:+.1%} vs tolerance {verdict.tolerance:.0%} and {allowance}")
    return verdict


def history_noise(window: Sequence[Point], policy: Policy = DEFAULT_POLICY) -> tuple[float, float]:
    """The baseline window's median and its run-to-run noise: 1.4826 x MAD of its values, never
    below the policy's floor (the history rule's noise before the run's own samples count)."""
    base = median(p.value for p in window)
    return base, max(MAD_SCALE * mad(p.value for p in window), policy.floor * abs(base))


def _history_rule(verdict: Verdict, current: Point, window: list[Point], policy: Policy) -> None:
    verdict.method = "history"
    base, noise = history_noise(window, policy)
    spreads = [noise]
    own = current.sample_mad()
    if own is not None:
        spreads.append(MAD_SCALE * own)
    verdict.spread = max(spreads)
    _, change = _compared(verdict)
    score = verdict.score = change * abs(base) / verdict.spread
    pooled = [s for p in window for s in p.samples]
    beyond = abs(change) > verdict.tolerance and abs(score) > policy.z
    p_value = None
    if beyond and len(current.samples) >= 3 and len(pooled) >= 3:     # the rank test only where it decides
        p_value = verdict.p_value = _directional_p(current.samples, pooled, change, verdict.better)
        beyond = p_value < policy.alpha
    verdict.status = ("regressed" if change > 0 else "improved") if beyond else "same"
    test = f", Mann-Whitney p {p_value:.2g} (alpha {policy.alpha:g})" if p_value is not None else ""
    verdict.reason = (f"change {change:+.1%} vs tolerance {verdict.tolerance:.0%}; robust z {score:+.1f} "
                      f"vs {policy.z:g} over the last {len(window)} comparable runs{test}")


def _drift_rule(verdict: Verdict, current: Point, anchor: list[Point], window: list[Point], policy: Policy) -> None:
    """A slow slide: the last window plus the new value against the window before it."""
    recent = [p.value for p in window] + [current.value]
    before = [p.value for p in anchor]
    anchor_base = median(before)
    if anchor_base <= 0:
        return
    change = _worse(median(recent), anchor_base, verdict.better)
    if abs(change) <= verdict.tolerance:
        return
    p = _directional_p(recent, before, change, verdict.better)
    if p >= policy.alpha:
        return
    verdict.status = "regressed" if change > 0 else "improved"
    verdict.method, verdict.p_value = "drift", p
    verdict.baseline, verdict.change = anchor_base, change
    verdict.ratio = current.value / anchor_base
    verdict.window = [q.run_id for q in anchor]
    verdict.window_commits = _unique(q.commit for q in anchor if q.commit)
    verdict.spread = max(MAD_SCALE * mad(before), policy.floor * abs(anchor_base))
    verdict.score = change * abs(anchor_base) / verdict.spread
    verdict.good_commit = _good_commit(anchor, anchor_base, verdict.better, verdict.tolerance)
    verdict.reason = (f"drift: the last {len(window)} runs and this one moved {change:+.1%} from the "
                      f"{len(anchor)} runs before (tolerance {verdict.tolerance:.0%}), "
                      f"Mann-Whitney p {p:.2g} (alpha {policy.alpha:g})")


def _directional_p(new: Sequence[float], old: Sequence[float], change: float, better: str) -> float:
    """p-value that ``new`` moved away from ``old`` in the direction of ``change``."""
    lower = (change > 0) == (better == "higher")    # the values went down
    return mann_whitney_less(new, old) if lower else mann_whitney_less(old, new)
