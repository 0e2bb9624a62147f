"""The trend dashboard: ``runs/history.html`` from the history store (rendering only).

One self-contained page (inline CSS and SVG, nothing fetched): per host and GPU, one chart per
metric over its runs, each point with its commit, its samples' range, the noise band the
detector judges it against (baseline median +- z x run-to-run noise of the runs before it) and the
tolerance line; the regressions the runs reported are marked and link to their run reports.
A summary table gives each series' latest value and the detector's verdict on it.
"""
from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Callable

from .detector import DEFAULT_POLICY, Policy, history_noise, judge
from .history import HistoryStore, SeriesKey, StoredPoint
from ..ownership import write_private
from .record import utc_now
from .report import _ENV     # the run report's Jinja2 environment: filters, style, autoescape
from .run_view import NAME_LIMIT, fmt, text

POINTS_LIMIT = 200          # newest points drawn per chart
LABELS_LIMIT = 16           # commit labels on an x axis
WIDTH, HEIGHT = 660, 250
LEFT, RIGHT, TOP, BOTTOM = 64, 44, 14, 64


def render_history(store: HistoryStore, out: Path | str, tolerance: Callable[[str], float] = lambda metric: 0.10,
                   policy: Policy = DEFAULT_POLICY) -> Path:
    """Write the dashboard to ``out`` (atomically); returns its path."""
    out = Path(out)
    page = _ENV.get_template("history.html.j2").render(history=view(store, out.parent, tolerance, policy))
    return write_private(out, page)


def view(store: HistoryStore, page_dir: Path, tolerance: Callable[[str], float], policy: Policy) -> dict:
    """The store as the template uses it: groups (host, GPU) of charts, and the summary rows."""
    runs = store.runs()
    reported = store.regressions()
    groups: dict[tuple[str, str], dict] = {}
    summary = []
    for key, metric in store.series_keys():
        points = store.series(key, metric)[-POINTS_LIMIT:]
        chart = _chart(key, metric, points, runs, reported, page_dir, tolerance(metric), policy)
        group = groups.setdefault((key.host, key.gpu), {"host": text(key.host, NAME_LIMIT), "gpu": text(key.gpu, NAME_LIMIT),
                                                         "charts": []})
        group["charts"].append(chart)
        summary.append(chart["latest"])
    return {"groups": list(groups.values()), "summary": summary, "generated": utc_now(), "policy": policy,
            "runs": len(runs), "regressions": sum(1 for c in summary if c["status"] == "regressed")}


def _chart(key: SeriesKey, metric: str, points: list[StoredPoint], runs: dict, reported: dict, page_dir: Path,
           tol: float, policy: Policy) -> dict:
    better = points[-1].better
    bands = [_band(points[:i], tol, better, policy) for i in range(len(points))]
    values = [v for p in points for v in (p.value, *p.samples)]
    values += [v for b in bands if b for v in (b["low"], b["high"], b["limit"])]
    low, high = min(values), max(values)
    pad = (high - low) * 0.08 or abs(high) * 0.05 or 1.0
    low, high = low - pad, high + pad
    x = _scale(0, max(1, len(points) - 1), LEFT + 8, WIDTH - RIGHT - 8)
    y = _scale(low, high, HEIGHT - BOTTOM, TOP)
    drawn = [_point(p, i, x, y, runs, reported, page_dir) for i, p in enumerate(points)]
    verdict = judge(points[-1].point(), [p.point() for p in points[:-1]], tol, better, policy)
    unit = text(points[-1].unit, 40)
    return {
        "host": text(key.host, NAME_LIMIT), "metric": text(metric, NAME_LIMIT), "unit": unit, "better": better,
        "series": text(key.label(), NAME_LIMIT), "build_key": key.build_key, "backend": text(key.backend, 20),
        "width": WIDTH, "height": HEIGHT, "left": LEFT, "right": WIDTH - RIGHT, "top": TOP, "bottom": HEIGHT - BOTTOM,
        "points": drawn, "band": _band_path(bands, x, y, "low", "high"), "limit": _line(bands, x, y, "limit"),
        "baseline": _line(bands, x, y, "base"),
        "ticks": [{"y": round(y(v), 1), "label": fmt(v)} for v in _ticks(low, high)],
        "labels": drawn[::max(1, -(-len(drawn) // LABELS_LIMIT))],
        "latest": {"host": text(key.host, NAME_LIMIT), "gpu": text(key.gpu, NAME_LIMIT), "metric": text(metric, NAME_LIMIT),
                   "unit": unit, "better": better, "value": points[-1].value, "baseline": verdict.baseline,
                   "ratio": verdict.ratio, "status": verdict.status, "method": verdict.method,
                   "reason": text(verdict.reason, 400), "points": len(points), "anchor": _anchor(key, metric)},
        "anchor": _anchor(key, metric),
        "tolerance": tol,
    }


def _band(before: list[StoredPoint], tol: float, better: str, policy: Policy) -> dict | None:
    """The noise band a point is judged against: the window before it (history rule only)."""
    window = [p.point() for p in before[-policy.window:]]
    if len(window) < policy.min_points:
        return None
    base, noise = history_noise(window, policy)
    if base <= 0:
        return None
    return {"base": base, "low": base - policy.z * noise, "high": base + policy.z * noise,
            "limit": base * (1 - tol) if better == "higher" else base * (1 + tol)}


def _point(p: StoredPoint, i: int, x, y, runs: dict, reported: dict, page_dir: Path) -> dict:
    run = runs.get(p.run_id, {})
    report = _report_link(run.get("run_dir"), page_dir)
    regression = reported.get((p.run_id, p.key.host, p.metric))
    samples = sorted(p.samples)
    return {
        "x": round(x(i), 1), "y": round(y(p.value), 1),
        "lo": round(y(samples[0]), 1) if samples else None, "hi": round(y(samples[-1]), 1) if samples else None,
        "run_id": text(p.run_id, NAME_LIMIT), "commit": text(p.git_rev or "", 40), "short": text((p.git_rev or "?")[:8], 8),
        "value": fmt(p.value), "samples": len(samples), "noisy": p.noisy, "href": report,
        "regressed": regression is not None, "started": text(p.started, 40),
        "ratio": regression.get("ratio") if isinstance(regression, dict) else None,
    }


def _report_link(run_dir: str | None, page_dir: Path) -> str | None:
    """The run's report.html relative to the page, URL-quoted; None when it is not on disk."""
    if not run_dir:
        return None
    report = Path(run_dir) / "report.html"
    if not report.is_file():
        return None
    return urllib.parse.quote(os.path.relpath(report, page_dir.absolute()))


def _scale(lo: float, hi: float, out_lo: float, out_hi: float):
    span = (hi - lo) or 1.0
    return lambda v: out_lo + (v - lo) / span * (out_hi - out_lo)


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    step = (high - low) / (count - 1)
    return [low + step * k for k in range(count)]


def _band_path(bands: list[dict | None], x, y, lower: str, upper: str) -> list[str]:
    """SVG polygon point lists, one per unbroken run of points that have a band."""
    polygons = []
    for segment in _segments(bands):
        top = [f"{x(i):.1f},{y(b[upper]):.1f}" for i, b in segment]
        bottom = [f"{x(i):.1f},{y(b[lower]):.1f}" for i, b in reversed(segment)]
        polygons.append(" ".join(top + bottom))
    return polygons


def _line(bands: list[dict | None], x, y, field: str) -> list[str]:
    return [" ".join(f"{x(i):.1f},{y(b[field]):.1f}" for i, b in segment) for segment in _segments(bands)]


def _segments(bands: list[dict | None]) -> list[list[tuple[int, dict]]]:
    segments: list[list[tuple[int, dict]]] = []
    current: list[tuple[int, dict]] = []
    for i, band in enumerate(bands):
        if band is None:
            if current:
                segments.append(current)
            current = []
        else:
            current.append((i, band))
    if current:
        segments.append(current)
    return segments


def _anchor(key: SeriesKey, metric: str) -> str:
    raw = f"{key.host}-{key.gpu}-{key.backend}-{key.build_key[:8]}-{metric}"
    return "c-" + "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in raw)[:160]
