"""The regression detector on synthetic series: flat with noise, a step, a drift, outliers, few
points, both directions; and its statistics against brute force."""
from __future__ import annotations

import dataclasses

import itertools
import math
import random

import pytest

from orchestrator.records.detector import Point, Policy, judge, mad, mann_whitney_less, median


def run(rng: random.Random, mean: float, cv: float, repeats: int = 5, load: float = 0.0, commit: str = "c") -> Point:
    """One run: ``repeats`` samples around ``mean`` (relative noise ``cv``); with probability
    ``load`` a sample is slowed by 10-50 % (another process took the CPU for a while)."""
    samples = tuple(mean * (1 - (rng.uniform(0.1, 0.5) if rng.random() < load else 0.0)) * rng.gauss(1, cv)
                    for _ in range(repeats))
    return Point(median(samples), samples, run_id=f"run{rng.getrandbits(32):08x}", commit=commit)


def series(rng: random.Random, means: list[float], cv: float, **kw) -> list[Point]:
    return [run(rng, m, cv, commit=f"c{i:03d}", **kw) for i, m in enumerate(means)]


def flags(points: list[Point], tolerance: float = 0.10, better: str = "higher") -> list[int]:
    """Indices of the points judged regressed against the points before them."""
    return [i for i in range(len(points)) if judge(points[i], points[:i], tolerance, better).regressed]


# --------------------------------------------------------------------------------------------
# Statistics


def test_median_and_mad():
    assert median([3, 1, 2]) == 2 and median([4, 1, 2, 3]) == 2.5
    assert mad([1, 2, 3, 4, 100]) == 1
    with pytest.raises(ValueError):
        median([])


def brute_force_p(xs: list[float], ys: list[float]) -> float:
    """P(U <= observed U) over every assignment of the pooled values to the two groups."""
    pooled = xs + ys
    u = lambda a, b: sum((x > y) + 0.5 * (x == y) for x in a for y in b)  # noqa: E731
    observed = u(xs, ys)
    total = hits = 0
    for chosen in itertools.combinations(range(len(pooled)), len(xs)):
        a = [pooled[i] for i in chosen]
        b = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        total += 1
        hits += u(a, b) <= observed + 1e-9
    return hits / total


@pytest.mark.parametrize("xs, ys", [([1, 5, 7], [2, 3, 4, 6, 8]), ([1, 2, 3], [4, 5, 6]), ([9, 8, 7, 6], [1, 2, 3]),
                                    ([1.5, 2.5], [1, 2, 3, 4, 5, 6])])
def test_mann_whitney_exact_equals_brute_force(xs, ys):
    assert mann_whitney_less(xs, ys) == pytest.approx(brute_force_p(xs, ys))


def test_mann_whitney_normal_approximation_with_ties_is_close_to_brute_force():
    xs, ys = [1, 2, 2, 3, 3, 4], [2, 3, 4, 4, 5, 5, 6]
    assert mann_whitney_less(xs, ys) == pytest.approx(brute_force_p(xs, ys), abs=0.02)
    big_x = [float(i) for i in range(60)]
    big_y = [float(i) + 20 for i in range(60)]       # n x m beyond the exact limit
    p = mann_whitney_less(big_x, big_y)
    assert 0 < p < 1e-3 and mann_whitney_less(big_y, big_x) > 0.999


# --------------------------------------------------------------------------------------------
# Series


def test_flat_series_with_noise_raises_no_alarm():
    rng = random.Random(11)
    points = series(rng, [1000.0] * 60, cv=0.03)
    assert flags(points) == []


def test_flat_series_on_a_loaded_machine_raises_no_alarm_where_the_fixed_ratio_rule_does():
    rng = random.Random(5)
    points = series(rng, [1000.0] * 40, cv=0.03, load=0.5)
    old_rule = [i for i in range(1, len(points)) if points[i].value < 0.9 * points[i - 1].value]
    assert len(old_rule) >= 3                      # the load is real: the old rule cries wolf
    assert flags(points) == []


def test_a_step_is_flagged_on_the_first_run_after_it_with_its_evidence():
    rng = random.Random(3)
    points = series(rng, [1000.0] * 20 + [850.0], cv=0.02)
    verdict = judge(points[-1], points[:-1], 0.10)
    assert verdict.status == "regressed" and verdict.method == "history"
    assert verdict.window == [p.run_id for p in points[10:20]]
    assert verdict.baseline == pytest.approx(median(p.value for p in points[10:20]))
    assert verdict.change == pytest.approx(1 - points[-1].value / verdict.baseline)
    assert verdict.ratio == pytest.approx(points[-1].value / verdict.baseline)
    assert verdict.score > 4 and verdict.p_value < 0.01 and verdict.spread > 0
    assert verdict.good_commit == "c019" and verdict.bad_commit == "c020"
    assert verdict.sample_mad == pytest.approx(points[-1].sample_mad())
    assert "robust z" in verdict.reason and "Mann-Whitney p" in verdict.reason
    assert verdict.evidence()["window_commits"] == [f"c{i:03d}" for i in range(10, 20)]


def test_a_step_within_the_tolerance_or_within_the_noise_is_not_a_regression():
    rng = random.Random(4)
    small = series(rng, [1000.0] * 20 + [930.0], cv=0.01)         # 7 %: clear, but within 10 %
    assert judge(small[-1], small[:-1], 0.10).status == "same"
    noisy = series(rng, [1000.0] * 20 + [850.0], cv=0.12)         # 15 % inside 12 % run-to-run noise
    verdict = judge(noisy[-1], noisy[:-1], 0.10)
    assert verdict.status == "same" and abs(verdict.score) < 4


def test_a_step_in_a_lower_is_better_metric_and_an_improvement():
    rng = random.Random(6)
    slower = series(rng, [2.0] * 12 + [2.4], cv=0.02)             # ms: up is worse
    assert judge(slower[-1], slower[:-1], 0.10, "lower").status == "regressed"
    assert judge(slower[-1], slower[:-1], 0.10, "higher").status == "improved"


def test_after_a_step_the_streak_names_its_first_run_and_the_baseline_follows_the_new_level():
    rng = random.Random(7)
    points = series(rng, [1000.0] * 20 + [850.0] * 30, cv=0.02)
    flagged = flags(points)
    assert flagged[0] == 20 and flagged == list(range(20, flagged[-1] + 1))
    assert flagged[-1] < 26        # until the window has moved to the new level; never again as a drift
    assert judge(points[20], points[:20], 0.10).since_run == points[20].run_id
    later = judge(points[flagged[-1]], points[:flagged[-1]], 0.10)
    assert later.since_run == points[20].run_id and later.since_commit == "c020"


def test_a_slow_drift_is_caught_by_the_drift_rule():
    rng = random.Random(8)
    means = [1000.0 * (1 - 0.01 * i) for i in range(40)]            # -1 % a night: each night within the noise
    points = series(rng, means, cv=0.02)
    flagged = flags(points)
    assert flagged, "a 20 % slide over 20 nights must be caught"
    first = flagged[0]
    verdict = judge(points[first], points[:first], 0.10)
    assert verdict.method == "drift" and verdict.p_value < 0.01 and verdict.change > 0.10
    assert verdict.window == [p.run_id for p in points[first - 20:first - 10]]
    assert first <= 25
    # a night judged by the history rule alone sees no step: each change is small against the last runs
    assert judge(points[first], points[first - 10:first], 0.10).status == "same"


def test_outliers_in_the_history_neither_hide_a_step_nor_raise_alarms():
    rng = random.Random(9)
    points = series(rng, [1000.0] * 30, cv=0.02)
    for i in (5, 12, 17, 24):                       # single wild runs, both ways
        points[i] = run(rng, 1000.0 * (0.5 if i % 2 else 1.6), 0.02, commit=f"c{i:03d}")
    judged = [i for i in flags(points) if i not in (5, 12, 17, 24)]
    assert judged == []
    step = run(rng, 850.0, 0.02, commit="c030")
    assert judge(step, points, 0.10).status == "regressed"


def test_samples_that_overlap_the_baseline_keep_a_point_from_being_a_regression():
    rng = random.Random(10)
    history = series(rng, [1000.0] * 12, cv=0.01)
    # the median is 15 % down, but the samples straddle the baseline: measured during bursts of load
    current = Point(850.0, (600.0, 850.0, 1000.0, 1010.0, 700.0), run_id="loaded")
    verdict = judge(current, history, 0.10)
    assert verdict.status == "same" and verdict.spread >= 1.4826 * mad(current.samples) - 1e-9


def test_few_points_rule_tolerance_and_three_sample_mads():
    first = Point(1000.0, (990.0, 1000.0, 1010.0), run_id="a", commit="a")
    clear = Point(850.0, (845.0, 850.0, 855.0), run_id="b", commit="b")
    verdict = judge(clear, [first], 0.10)
    assert verdict.status == "regressed" and verdict.method == "few-points"
    assert verdict.spread == 10.0 and verdict.score == pytest.approx(15.0)
    assert "fewer than 5" in verdict.reason
    wide = Point(850.0, (800.0, 850.0, 960.0), run_id="c")        # MAD 50: 150 is not beyond 3 x 50
    assert judge(wide, [first], 0.10).status == "same"
    near = Point(920.0, (919.0, 920.0, 921.0), run_id="d")        # 8 %: within the tolerance
    assert judge(near, [first], 0.10).status == "same"


def test_few_points_rule_for_a_noisy_metric_counts_the_spread_between_runs():
    first = Point(1000.0, (990.0, 1000.0, 1010.0), run_id="a", noisy=True)
    # the second night: a whole run 14 % slower is judged by its own samples and the first night's;
    # the run under judgement never widens its own allowance (a 90 % drop would pass otherwise)
    slower = Point(860.0, (855.0, 860.0, 866.0), run_id="b", noisy=True)
    assert judge(slower, [first], 0.10).regressed
    tenth = Point(100.0, run_id="t", noisy=True)                               # one sample, as --repeats 1
    assert judge(tenth, [Point(1000.0, run_id="a", noisy=True)], 0.10).regressed
    # earlier runs pooled: samples spread by load across the window widen a noisy metric's allowance
    spread = [Point(1000.0, (700.0, 1000.0, 1300.0), run_id="w1", noisy=True),
              Point(1000.0, (650.0, 1000.0, 1350.0), run_id="w2", noisy=True)]
    assert judge(Point(860.0, (855.0, 860.0, 866.0), run_id="e", noisy=True), spread, 0.10).status == "same"
    second = Point(1004.0, (995.0, 1004.0, 1012.0), run_id="c", noisy=True)   # from the third night on
    step = judge(Point(850.0, (845.0, 850.0, 855.0), run_id="d", noisy=True), [first, second], 0.10)
    assert step.regressed and step.method == "few-points"


def test_few_points_rule_without_samples_falls_back_to_the_tolerance_and_says_so():
    verdict = judge(Point(850.0), [Point(1000.0)], 0.10)
    assert verdict.status == "regressed" and "no samples reported" in verdict.reason
    mad_only = judge(Point(850.0, mad=60.0), [Point(1000.0, mad=5.0)], 0.10)
    assert mad_only.status == "same" and mad_only.spread == 60.0


def test_no_history_is_new_and_a_non_positive_baseline_is_not_judged():
    assert judge(Point(1.0), [], 0.10).status == "new"
    verdict = judge(Point(1.0), [Point(0.0)] * 6, 0.10)
    assert verdict.status == "unjudged" and "not positive" in verdict.reason


def test_policy_settings_are_honoured():
    rng = random.Random(12)
    points = series(rng, [1000.0] * 8 + [850.0], cv=0.02)
    assert judge(points[-1], points[:-1], 0.10).method == "history"
    assert judge(points[-1], points[:-1], 0.10, policy=Policy(min_points=10)).method == "few-points"
    assert judge(points[-1], points[:-1], 0.20).status == "same"
    assert judge(points[-1], points[:-1], 0.10, policy=Policy(z=1e6)).status == "same"


@pytest.mark.parametrize("seed", range(5))
def test_detection_of_a_fifteen_percent_slowdown_on_a_quiet_machine(seed):
    rng = random.Random(100 + seed)
    for history_length in (1, 3, 6, 15):
        points = series(rng, [1000.0] * history_length + [850.0], cv=0.015)
        verdict = judge(points[-1], points[:-1], 0.10)
        assert verdict.regressed, (history_length, verdict.reason)
        assert not math.isnan(verdict.change)


def cpu_run(rng: random.Random, cpu_rate: float, share: float, cv: float = 0.02, repeats: int = 3,
            commit: str = "c") -> Point:
    """One run of a CPU timing (higher is better) whose process had ``share`` of a core: its wall-clock
    samples are the per-CPU-second rate (``cpu_rate``, relative noise ``cv``) times the share."""
    cpu = tuple(cpu_rate * rng.gauss(1, cv) for _ in range(repeats))
    shares = tuple(min(1.0, share * rng.gauss(1, 0.02)) for _ in range(repeats))
    wall = tuple(c * s for c, s in zip(cpu, shares))
    return Point(median(wall), wall, run_id=f"run{rng.getrandbits(32):08x}", commit=commit, noisy=True, cpu_samples=cpu)


@pytest.mark.parametrize("history_length", [1, 3, 8])
def test_a_run_starved_of_cpu_is_unjudged_with_its_reason_not_a_regression(history_length):
    rng = random.Random(7 + history_length)
    history = [cpu_run(rng, 1000.0, 0.95, commit=f"c{i}") for i in range(history_length)]
    starved = cpu_run(rng, 1000.0, 0.45, commit="loaded")      # the wall clock says 0.47x
    verdict = judge(starved, history, 0.10)
    assert verdict.status == "unjudged" and not verdict.regressed, verdict.reason
    assert "measured under contention" in verdict.reason and abs(verdict.cpu_change) < 0.10
    assert verdict.ratio < 0.6                                  # the wall-clock evidence stays on record
    # the same starved run without its CPU seconds: nothing tells load from code, it is a regression
    blind = Point(starved.value, starved.samples, run_id="blind", noisy=True)
    assert judge(blind, [Point(p.value, p.samples, run_id=p.run_id, noisy=True) for p in history], 0.10).regressed


@pytest.mark.parametrize("share", [0.95, 0.45])
@pytest.mark.parametrize("history_length", [1, 3, 8])
def test_code_that_costs_cpu_time_is_a_regression_however_loaded_the_run(share, history_length):
    rng = random.Random(31 + history_length)
    history = [cpu_run(rng, 1000.0, 0.95, commit=f"c{i}") for i in range(history_length)]
    slower = cpu_run(rng, 800.0, share, commit="slow")          # 20 % fewer tokens per CPU second
    verdict = judge(slower, history, 0.10)
    assert verdict.regressed and verdict.reason.startswith("per CPU second: "), verdict.reason
    assert verdict.cpu_change == pytest.approx(0.2, abs=0.05)


def test_with_a_history_the_cpu_seconds_decide_where_the_wall_clock_noise_hides_a_step():
    rng = random.Random(11)
    # nights starved by different loads: the wall clock moves 2x between them, the CPU seconds do not
    history = [cpu_run(rng, 1000.0, share, commit=f"c{i}") for i, share in enumerate([0.9, 0.45, 0.7, 0.3, 0.8, 0.5])]
    slower = cpu_run(rng, 600.0, 0.6, commit="slow")            # 40 % more CPU time per token
    wall_only = judge(Point(slower.value, slower.samples, run_id="w", noisy=True),
                      [Point(p.value, p.samples, run_id=p.run_id, noisy=True) for p in history], 0.10)
    assert wall_only.status == "same"                           # within the wall clock's noise
    verdict = judge(slower, history, 0.10)
    assert verdict.regressed and verdict.method == "history" and "per CPU second: " in verdict.reason
    # with fewer points, a change on the CPU seconds alone is not enough: both clocks must show it
    few = judge(cpu_run(rng, 850.0, 0.95), [cpu_run(rng, 1000.0, 0.5, commit="c")], 0.10)
    assert not few.regressed and few.cpu_change == pytest.approx(0.15, abs=0.05)


def test_the_contention_check_only_looks_at_earlier_runs_with_cpu_seconds():
    rng = random.Random(5)
    old = [Point(1000.0, (990.0, 1000.0, 1010.0), run_id=f"old{i}", noisy=True) for i in range(3)]
    starved = cpu_run(rng, 1000.0, 0.45)
    assert judge(starved, old, 0.10).regressed                  # no earlier CPU seconds: no check
    with_cpu = [*old, cpu_run(rng, 1000.0, 0.95, commit="new")]
    verdict = judge(starved, with_cpu, 0.10)
    assert verdict.status == "unjudged" and "measured under contention" in verdict.reason


def loaded_night(rng: random.Random, code_rate: float, commit: str, runs: int = 8) -> Point:
    """A night of a CPU timing on a shared machine: other processes slow each run per CPU second by
    0-40 % (never speed one up) and one run of the night meets a quiet moment; the wall clock
    follows at a share of 0.8."""
    slowed = [0.0] + [rng.uniform(0.0, 0.4) for _ in range(runs - 1)]
    cpu = tuple(code_rate * (1 - s) * rng.gauss(1, 0.005) for s in slowed)
    wall = tuple(c * 0.8 for c in cpu)
    return Point(median(wall), wall, run_id=f"run{rng.getrandbits(32):08x}", commit=commit, noisy=True, cpu_samples=cpu)


def test_per_cpu_second_a_night_is_judged_by_its_best_run():
    """Load slows most runs of a night by varying amounts: their median wanders from night to
    night, the best run does not, so a 15 % slower code stands out against the best runs of the
    earlier nights where it would hide in their medians' spread."""
    rng = random.Random(23)
    history = [loaded_night(rng, 1000.0, f"c{i}") for i in range(6)]
    medians = [median(p.cpu_samples) for p in history]
    assert (max(medians) - min(medians)) / median(medians) > 0.1    # the medians wander
    verdict = judge(loaded_night(rng, 850.0, "slow"), history, 0.10)
    assert verdict.regressed and verdict.method == "history" and verdict.reason.startswith("per CPU second: "), verdict.reason
    assert verdict.cpu_change == pytest.approx(0.15, abs=0.02)
    for i in range(10):     # unchanged code on nights as loaded: never a regression
        assert not judge(loaded_night(rng, 1000.0, f"q{i}"), history, 0.10).regressed
    # with one earlier night the runs' own spread stays the allowance: a night whose runs were all
    # slowed but whose best moved less than the tolerance is no regression
    starved = Point(800.0, (800.0,) * 3, run_id="s", noisy=True, cpu_samples=(950.0, 700.0, 650.0))
    assert not judge(starved, history[:1], 0.10).regressed


def test_a_speed_up_is_judged_per_cpu_second_by_the_median_of_its_runs_not_its_best():
    """A speed-up is the ratio of two timings: load on either moves it either way, so its best run
    is the luckiest one; an earlier night's lucky run must not make an unchanged night look worse."""
    def night(cpu, ratio):
        return Point(1.0, (0.99, 1.0, 1.01), run_id=f"r{cpu}", noisy=True, cpu_samples=cpu, ratio=ratio)
    lucky, plain = (1.0, 1.0, 1.0, 1.0, 2.5), (1.0, 0.99, 1.01, 1.0, 1.0)
    assert judge(night(plain, True), [night(lucky, True)], 0.10).status == "same"
    # as a rate it would be judged by its best: 1.01 against 2.5 per CPU second, which the wall clock does not show
    assert judge(night(plain, False), [night(lucky, False)], 0.10).status == "unjudged"
    # nights of fewer than Policy.best_of (5) runs are judged by their median: the best of 3 says too little
    assert judge(night(plain[:3], False), [night(lucky[2:], False)], 0.10).status == "same"


def probed_run(rng: random.Random, code_rate: float, share: float, contention: float, commit: str = "c",
               better: str = "higher") -> Point:
    """A CPU timing measured beside the calibration probe: cache and memory contention slows the
    work per CPU second by ``contention`` (0.3: 30 % fewer per CPU second), for the bench's repeats
    and for the probe beside each (its figure in the metric's terms, about 230 runs per CPU
    second), and ``share`` of a core scales the wall clock; ``code_rate`` is what the code does on
    a machine to itself. A time (``better`` lower) is the inverse: milliseconds per unit of work."""
    cpu, cal, wall = [], [], []
    for _ in range(3):
        machine = (1 - contention) * rng.gauss(1, 0.02)     # the same moment, for both
        rate, probe = code_rate * machine * rng.gauss(1, 0.02), 230.0 * machine * rng.gauss(1, 0.01)
        if better == "lower":
            rate, probe = 1e3 / rate, 1e3 / probe
        cpu.append(rate)
        cal.append(probe)
        wall.append(rate * share if better == "higher" else rate / share)
    return Point(median(wall), tuple(wall), run_id=f"run{rng.getrandbits(32):08x}", commit=commit, noisy=True,
                 cpu_samples=tuple(cpu), cal_samples=tuple(cal))


@pytest.mark.parametrize("better", ["higher", "lower"])
@pytest.mark.parametrize("history_length", [1, 2, 3, 4])
def test_an_early_night_whose_caches_were_contended_is_unjudged_by_the_calibration_probe(history_length, better):
    # the early nights of a new history: whole nights starved and their caches contended, so the
    # CPU seconds move with the wall clock (30 % here); the probe beside each repeat moves with them
    rng = random.Random(41 + history_length)
    history = [probed_run(rng, 1000.0, 0.9, 0.0, commit=f"c{i}", better=better) for i in range(history_length)]
    contended = probed_run(rng, 1000.0, 0.4, 0.3, commit="loaded", better=better)
    verdict = judge(contended, history, 0.10, better)
    assert not verdict.regressed, verdict.reason
    assert verdict.status == "unjudged" and "relative to the calibration probe the change is" in verdict.reason
    assert verdict.cpu_change > 0.25 and abs(verdict.cal_change) < 0.08 and verdict.calibration_change > 0.25
    # without the probe (as before it) the CPU seconds confirm the wall clock: a false alarm
    blind = [Point(p.value, p.samples, run_id=p.run_id, noisy=True, cpu_samples=p.cpu_samples) for p in history]
    assert judge(Point(contended.value, contended.samples, run_id="b", noisy=True, cpu_samples=contended.cpu_samples),
                 blind, 0.10, better).regressed


@pytest.mark.parametrize("contention", [0.0, 0.3])
@pytest.mark.parametrize("history_length", [1, 3, 8])
def test_a_real_slowdown_is_caught_on_the_first_night_with_the_calibration_probe(history_length, contention):
    # the code does 15 % less per CPU second; the probe, which runs none of the engine's code, does not
    rng = random.Random(59 + history_length)
    history = [probed_run(rng, 1000.0, 0.9, 0.0, commit=f"c{i}") for i in range(history_length)]
    slower = probed_run(rng, 850.0, 0.9 - contention, contention, commit="slow")
    verdict = judge(slower, history, 0.10)
    assert verdict.regressed and verdict.reason.startswith("per CPU second: "), verdict.reason
    assert "relative to the calibration probe: " in verdict.reason                 # it confirms
    assert verdict.cal_change == pytest.approx(0.15, abs=0.05)
    assert verdict.calibration_change == pytest.approx(contention, abs=0.06)


def test_with_a_history_a_change_the_probe_explains_is_unjudged():
    # nights so alike that their run-to-run noise is tiny: a night whose caches were contended
    # (12 % fewer per CPU second, the probe 25 % slower) passes the history rule's z-score; the
    # ratio to the probe is better, not worse than the tolerance: not judged, with the reason
    rng = random.Random(71)
    history = [probed_run(rng, 1000.0, 0.9, 0.0, commit=f"c{i}") for i in range(8)]
    contended = probed_run(rng, 880.0 / 0.75, 0.5, 0.25, commit="loaded")
    verdict = judge(contended, history, 0.10)
    assert verdict.status == "unjudged" and verdict.cpu_change == pytest.approx(0.12, abs=0.04), verdict.reason
    assert verdict.calibration_change > 0.2 and verdict.cal_change < 0 and "history rule per CPU second" in verdict.reason
    blind = [Point(p.value, p.samples, run_id=p.run_id, noisy=True, cpu_samples=p.cpu_samples) for p in history]
    assert judge(Point(contended.value, contended.samples, run_id="b", noisy=True, cpu_samples=contended.cpu_samples),
                 blind, 0.10).regressed                                     # without the probe: a false alarm


def test_with_a_history_the_probe_confirms_only_beyond_its_own_noise():
    # measured (20 quiet nights under load, night 7): a MoE timing 43 % worse per CPU second
    # against steady nights, the probe beside it 42 % worse: relative to the probe 11 % worse,
    # beyond the tolerance but at a robust z of 0.5 against the probe-relative nights before,
    # whose probe moved by itself. Not a regression: unjudged, the probe's spread in the reason
    rng = random.Random(97)
    history = [Point(1000.0, (990.0, 1000.0, 1010.0), run_id=f"r{i}", commit="c", noisy=True,
                     cpu_samples=tuple(1000.0 * rng.gauss(1, 0.005) for _ in range(3)),
                     cal_samples=(probe := 230.0 * rng.uniform(0.8, 1.2), probe, probe)) for i in range(8)]
    ratios = sorted(median(p.cpu_samples) / median(p.cal_samples) for p in history)
    contended = Point(600.0, (590.0, 600.0, 610.0), run_id="loaded", commit="c", noisy=True,
                      cpu_samples=(700.0, 700.0, 700.0), cal_samples=(700.0 / (median(ratios) * 0.885),) * 3)
    verdict = judge(contended, history, 0.10)
    assert verdict.cal_change == pytest.approx(0.115, abs=0.005) and verdict.cpu_change == pytest.approx(0.3, abs=0.01)
    assert verdict.status == "unjudged" and "other processes took the caches" in verdict.reason, verdict.reason
    # the same step relative to a steady probe is confirmed
    steady = [dataclasses.replace(p, cal_samples=(230.0,) * 3) for p in history]
    assert judge(dataclasses.replace(contended, cal_samples=(700.0 / (1000.0 / 230.0 * 0.885),) * 3), steady, 0.10).regressed


def test_the_probe_counts_only_once_the_history_has_as_many_probed_points_as_cpu_seconds():
    rng = random.Random(67)
    old = [probed_run(rng, 1000.0, 0.9, 0.0, commit=f"o{i}") for i in range(2)]
    unprobed = [Point(p.value, p.samples, run_id=p.run_id, noisy=True, cpu_samples=p.cpu_samples) for p in old]
    probed = [probed_run(rng, 1000.0, 0.9, 0.0, commit=f"n{i}") for i in range(2)]
    contended = probed_run(rng, 1000.0, 0.4, 0.3, commit="loaded")
    # 2 probed points of 4 with CPU seconds: the per-CPU-second series decides (and raises the alarm)
    verdict = judge(contended, [*unprobed, *probed], 0.10)
    assert verdict.regressed and verdict.cal_change is None and "calibration probe" not in verdict.reason
    # a probe figure is paired with each CPU sample or it is not used
    odd = Point(contended.value, contended.samples, run_id="odd", noisy=True, cpu_samples=contended.cpu_samples,
                cal_samples=contended.cal_samples[:2])
    assert judge(odd, probed, 0.10).cal_change is None


def test_a_regression_per_cpu_second_that_a_falling_load_hides_on_the_wall_clock_is_not_passed():
    # measured: a 15 % slower commit on a night whose CPU share rose from 0.2 to 0.4, the wall
    # clock 6 % faster; the clocks disagree, so the verdict is unjudged, not same
    rng = random.Random(83)
    history = [cpu_run(rng, 1000.0, 0.2, commit=f"c{i}") for i in range(8)]
    slower = cpu_run(rng, 850.0, 0.4, commit="slow")
    verdict = judge(slower, history, 0.10)
    assert verdict.status == "unjudged" and verdict.reason.startswith("the clocks disagree"), verdict.reason
    assert verdict.cpu_change == pytest.approx(0.15, abs=0.04) and verdict.change < 0
