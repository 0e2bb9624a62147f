"""Benchmark baselines, regressions and comparisons: the domain logic the nightly verdict and
`invoke report --compare` rest on (orchestrator.records.report only renders it).

The nightly job compares benchmarks with a baseline: a previous run.json or a baseline file

    {"version": 1, "created": ISO-8601, "source_run": RUN_ID,
     "hosts": {HOST: {METRIC: VALUE}}, "thresholds": {METRIC_OR_GLOB: RELATIVE_TOLERANCE}}

(``thresholds`` optional), with per-metric relative tolerances that absorb the noise left in the
engine's medians of repeats. A host whose bench step was `cached` (its figures reused from an
earlier run) is never compared as a new measurement.
"""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from orchestrator.records import ranges
from orchestrator.ownership import write_private
from orchestrator.records.ranges import finite_number
from orchestrator.records.record import Regression, mapping as _dict, unique as _unique, utc_now

BASELINE_VERSION = 1
DEFAULT_THRESHOLD = 0.10  # relative tolerance of a metric no threshold names


def baseline_values(baseline: dict) -> dict[str, dict[str, float]]:
    """``{host: {metric: value}}`` from a baseline file's dict or from a run record."""
    hosts = _dict(baseline.get("hosts"))
    if "run_id" in baseline:
        hosts = {h: {m: _dict(v).get("value") for m, v in _dict(_dict(_dict(rec).get("bench")).get("metrics")).items()}
                 for h, rec in hosts.items()}
    return {str(h): {str(m): v for m, v in _dict(ms).items() if ranges.FIGURE.number(v) is not None}
            for h, ms in hosts.items()}


def make_baseline(run: dict, thresholds: dict[str, float] | None = None) -> dict:
    """A baseline file's content from a run: each passing host's benchmark values."""
    passing = {h: rec for h, rec in _dict(run.get("hosts")).items() if _dict(rec).get("status") == "passed"}
    data = {"version": BASELINE_VERSION, "created": utc_now(), "source_run": run.get("run_id"),
            "hosts": baseline_values({"run_id": run.get("run_id"), "hosts": passing})}
    if thresholds:
        data["thresholds"] = dict(thresholds)
    return data


def write_baseline(run: dict, path: Path | str, thresholds: dict[str, float] | None = None) -> Path:
    """Write a baseline file (to commit, e.g. benchmarks/baseline.json) from a run."""
    return write_private(path, json.dumps(make_baseline(run, thresholds), indent=2, sort_keys=True) + "\n")


def load_baseline(path: Path | str) -> dict:
    """Read a baseline: a baseline file or a run.json (ValueError naming the file when neither)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read baseline: {e}") from None
    if not isinstance(data, dict) or data.get("version") != BASELINE_VERSION or not isinstance(data.get("hosts"), dict):
        raise ValueError(f"{path}: not a baseline (version {BASELINE_VERSION} with 'hosts') nor a run.json")
    return data


def threshold_for(metric: str, thresholds: dict[str, float]) -> float:
    """A metric's relative tolerance: its own entry, else the longest matching glob, else
    ``*``, else DEFAULT_THRESHOLD."""
    if metric in thresholds:
        return float(thresholds[metric])
    globs = sorted((p for p in thresholds if p != "*" and fnmatch.fnmatchcase(metric, p)), key=len, reverse=True)
    if globs:
        return float(thresholds[globs[0]])
    return float(thresholds.get("*", DEFAULT_THRESHOLD))


def _tolerances(baseline: dict, thresholds: dict[str, float] | None) -> dict[str, float]:
    merged = {**_dict(baseline.get("thresholds")), **(thresholds or {})}
    return {str(k): float(v) for k, v in merged.items() if finite_number(v) is not None and v >= 0}


def find_regressions(current_run: dict, baseline: dict, thresholds: dict[str, float] | None = None) -> list[Regression]:
    """The metrics of ``current_run`` (a run.json dict) worse than ``baseline`` by more than
    their tolerance, for RunRecord.regressions.

    ``baseline`` is a run record or a baseline file; ``thresholds`` maps metric names (or globs,
    ``*`` for the rest) to relative tolerances, over the baseline file's own ``thresholds``.
    Direction follows each metric's ``better``: a ``higher`` metric regresses when
    value < baseline * (1 - t), a ``lower`` one when value > baseline * (1 + t). Metrics absent
    on either side, or with a baseline <= 0, are not compared. Sorted by host then metric.
    """
    reference = baseline_values(baseline)
    tolerances = _tolerances(baseline, thresholds)
    found = []
    reused = _reused_bench(current_run)
    for host, record in _dict(current_run.get("hosts")).items():
        if host in reused:          # figures of an earlier run: not a new measurement
            continue
        metrics = _dict(_dict(_dict(record).get("bench")).get("metrics"))
        for name, metric in metrics.items():
            value, base = ranges.FIGURE.number(_dict(metric).get("value")), ranges.FIGURE.number(reference.get(host, {}).get(name))
            if value is None or base is None or base <= 0:
                continue
            better = "lower" if metric.get("better") == "lower" else "higher"
            tolerance, ratio = threshold_for(name, tolerances), value / base
            if (ratio < 1 - tolerance) if better == "higher" else (ratio > 1 + tolerance):
                found.append(Regression(host, name, base, value, round(ratio, 4), tolerance,
                                        str(metric.get("unit") or ""), better))
    return sorted(found, key=lambda r: (r.host, r.metric))


# --------------------------------------------------------------------------------------------
# Comparing two runs


def compare(base: dict, current: dict, thresholds: dict[str, float] | None = None) -> list[dict]:
    """Two runs' benchmarks side by side: a row per host and metric present in either, with
    ``ratio`` = current / base and a ``verdict``: better, worse, same (within the metric's
    tolerance), new or gone; ``reused`` when either side's figures were reused from an earlier
    run (its bench step `cached`: not a new measurement, never compared), with ``reused_from``."""
    tolerances = _tolerances({}, thresholds)
    a, b = _bench_metrics(base), _bench_metrics(current)
    reused_a, reused_b = _reused_bench(base), _reused_bench(current)
    rows = []
    for host in _unique([*a, *b]):
        for name in _unique([*a.get(host, {}), *b.get(host, {})]):
            ma, mb = a.get(host, {}).get(name), b.get(host, {}).get(name)
            meta = mb or ma
            assert meta is not None         # the name is one of a's or b's
            va, vb = (ma or {}).get("value"), (mb or {}).get("value")
            ratio = vb / va if va and vb is not None else None
            reused = "; ".join(f"{side} reused from run {r[host]}" for side, r in (("base", reused_a), ("current", reused_b))
                               if host in r)
            verdict = "reused" if reused and va is not None and vb is not None else \
                _verdict(va, vb, ratio, meta["better"], threshold_for(name, tolerances))
            rows.append({"host": host, "metric": name, "unit": meta["unit"], "better": meta["better"],
                         "base": va, "current": vb, "ratio": ratio, "verdict": verdict, "reused_from": reused})
    return rows


def _reused_bench(run: dict) -> dict[str, str]:
    """host -> the run id its bench figures were reused from, for hosts whose bench was cached."""
    reused = {}
    for host, record in _dict(run.get("hosts")).items():
        step = _dict(_dict(_dict(record).get("steps")).get("bench"))
        if step.get("status") == "cached":
            reused[str(host)] = str(step.get("reused_from") or "an earlier run")
    return reused


def _bench_metrics(run: dict) -> dict[str, dict[str, dict]]:
    hosts = {}
    for host, record in _dict(run.get("hosts")).items():
        metrics = _dict(_dict(_dict(record).get("bench")).get("metrics"))
        hosts[str(host)] = {str(n): {"value": ranges.FIGURE.number(_dict(m).get("value")), "unit": str(_dict(m).get("unit") or ""),
                                     "better": "lower" if _dict(m).get("better") == "lower" else "higher"}
                            for n, m in metrics.items()}
    return hosts


def _verdict(base: float | None, current: float | None, ratio: float | None, better: str, tolerance: float) -> str:
    if base is None:
        return "new"
    if current is None:
        return "gone"
    if ratio is None or abs(ratio - 1) <= tolerance:
        return "same"
    return "better" if (ratio > 1) == (better == "higher") else "worse"
