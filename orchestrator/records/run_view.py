"""The view of a run record: run.json (a dict, see orchestrator.records.record) made safe and convenient
for the report templates, the JUnit writer, the comparison and the dashboard (orchestrator.records.report
and orchestrator.records.dashboard render it; nothing here renders).

Contents pulled from hosts may be hostile (huge strings, control characters, markup, odd types):
``view()`` turns whatever the record holds into clean, bounded, typed data. Every string is
redacted with the secrets the caller passes and made visible (orchestrator.safe_text: control
characters escaped), every number is a float or None, every list is bounded; the golden bundles,
metric names and bar charts are collected on the way.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, Iterable

from orchestrator.resources import gpus as gpus_mod
from orchestrator.bounded import short_text
from orchestrator.records.ranges import finite_number
from orchestrator.records.record import (
    GOLDEN_CHECKS,
    HOST_STATUSES,
    LOAD_CASE,
    STEP_STATUSES,
    UNFINISHED_STEP_STATUSES,
    Fingerprint,
    mapping as _dict,
    step_order,
    unique as _unique,
    utc_now,
)
from orchestrator.records.redaction import redact
from orchestrator.safe_text import visible

NAME_LIMIT = 120
MESSAGE_LIMIT = 2000
TAIL_LIMIT = 12000
DETAILS_LIMIT = 4000
CASES_LIMIT = 200  # failing engine tests listed per host
METRICS_LIMIT = 200
CHART_ROWS_LIMIT = 40
GPUS_LIMIT = 64           # GPUs, and co-tenant processes, listed per host

FINGERPRINT_KEYS = [f.name for f in fields(Fingerprint)]

_PALETTE = ("#0969da", "#8250df", "#1a7f37", "#bc4c00", "#bf3989", "#1b7c83", "#9a6700", "#57606a")


# --------------------------------------------------------------------------------------------
# Clean values


def text(value: Any, limit: int = MESSAGE_LIMIT, secrets: Iterable[str] = (), keep_end: bool = False) -> str:
    """``value`` as printable text: redacted, control characters escaped into visible text
    (safe_text.visible: terminal escapes, XML-invalid characters, lone surrogates),
    cut to ``limit`` characters (its end kept when ``keep_end``, as for a log tail)."""
    if value is None:
        return ""
    s = value if isinstance(value, str) else short_text(value, 4 * limit)
    s = visible(redact(s, secrets))
    if len(s) <= limit:
        return s
    cut = len(s) - limit
    return f"[… {cut} characters cut]\n" + s[-limit:] if keep_end else s[:limit] + f" [… {cut} characters cut]"


def fmt(value: float | None) -> str:
    """A number for a table: about four significant digits, thousands separated."""
    if value is None:
        return "—"
    a = abs(value)
    if a >= 1000:
        return f"{value:,.0f}"
    if a >= 100:
        return f"{value:.1f}"
    if a >= 1 or a == 0:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _status(value: Any, allowed: Iterable[str], default: str = "failed") -> str:
    return value if isinstance(value, str) and value in allowed else default


# --------------------------------------------------------------------------------------------
# The view: a run record made safe and convenient for the templates


def view(run: dict, secrets: Iterable[str] = ()) -> dict:
    """The run record as the templates use it: every string cleaned, every number a float or
    None, every list bounded; the golden bundles, metric names and charts collected."""
    secrets = [s for s in secrets if s]
    hosts = [_host_view(text(name, NAME_LIMIT, secrets), h, secrets) for name, h in _dict(run.get("hosts")).items()]
    source = _dict(run.get("source"))
    regressions = [_regression_view(r, secrets) for r in _list(run.get("regressions")) if isinstance(r, dict)]
    return {
        "run_id": text(run.get("run_id"), NAME_LIMIT, secrets),
        "command": text(run.get("command"), NAME_LIMIT, secrets),
        "status": _status(run.get("status"), ("passed", "failed", "interrupted")),
        "started": text(run.get("started"), 40, secrets),
        "finished": text(run.get("finished"), 40, secrets),
        "seconds": finite_number(run.get("seconds")),
        "source": {
            "tree_hash": text(source.get("tree_hash"), 80, secrets),
            "git_rev": text(source.get("git_rev"), 80, secrets),
            "git_dirty": source.get("git_dirty") is True,
        },
        "hosts": hosts,
        "counts": {s: sum(1 for h in hosts if h["status"] == s) for s in HOST_STATUSES},
        "steps": sorted(_unique(s["name"] for h in hosts for s in h["steps"]), key=step_order),
        "bundles": _unique(b for h in hosts for b in h["golden"]),
        "golden_rows": [row for h in hosts for row in _golden_rows(h)],
        "gpu_hosts": [h for h in hosts if h["gpus"]],
        "slurm_hosts": [h for h in hosts if h["job"]],
        "metrics": _metric_rows(hosts, regressions),
        "bench_hosts": [h for h in hosts if h["bench"] and h["bench"]["metrics"]],
        "charts": _charts(hosts),
        "regressions": regressions,
        "dashboard": _dashboard_link(run.get("history"), secrets),
        "failures": [(h, s) for h in hosts for s in h["steps"] if s["status"] in UNFINISHED_STEP_STATUSES],
        "reused": [(h, s) for h in hosts for s in h["steps"] if s["reused_from"]],
        "generated": utc_now(),
    }


def _host_view(name: str, host: Any, secrets: list[str]) -> dict:
    host = _dict(host)
    raw = _dict(host.get("fingerprint"))
    fp = {k: _fingerprint_value(raw.get(k), secrets) for k in FINGERPRINT_KEYS}
    steps = [_step_view(text(s, 40, secrets), v, secrets) for s, v in _dict(host.get("steps")).items()]
    steps.sort(key=lambda s: step_order(s["name"]))
    deployed = text(host.get("deployed_tree_hash"), 80, secrets)
    binary = text(host.get("binary_tree_hash"), 80, secrets)
    return {
        "name": name,
        "status": _status(host.get("status"), HOST_STATUSES),
        "transport": text(host.get("transport"), 20, secrets),
        "address": text(host.get("address"), NAME_LIMIT, secrets),
        "backend": text(host.get("backend"), 20, secrets) or "—",
        "deployed_tree_hash": deployed,
        "binary_tree_hash": binary,
        "tree_match": (deployed == binary) if deployed and binary else None,
        "fingerprint": fp,
        "gpu_label": _gpu_label(fp, steps),
        "steps": steps,
        "step_map": {s["name"]: s for s in steps},
        "seconds": sum(s["seconds"] or 0 for s in steps),
        "golden": {text(b, NAME_LIMIT, secrets): _golden_view(g, secrets) for b, g in _dict(host.get("golden")).items()},
        "tests": _tests_view(host.get("tests"), secrets),
        "stress": _stress_view(host.get("stress"), secrets),
        "bench": _bench_view(host.get("bench"), secrets),
        "gpus": _gpus_view(host, secrets),
        "gpu_runs": [_gpu_run_view(r, secrets) for r in _list(host.get("gpu_runs"))[:GPUS_LIMIT] if isinstance(r, dict)],
        "job": _job_view(host.get("job"), secrets),
    }


def _job_view(job: Any, secrets: list[str]) -> dict | None:
    """A Slurm entry's job (record.SlurmJob) as the reports show it, apart from the step times;
    None for any other host."""
    if not isinstance(job, dict):
        return None
    wait = finite_number(job.get("queue_wait"))
    return {**{k: text(job.get(k), NAME_LIMIT, secrets) for k in ("job_id", "partition", "node", "cuda_visible_devices",
                                                                  "submitted", "started", "time_limit", "state")},
            "gpus": ",".join(str(i) for i in map(_whole, _list(job.get("gpus"))[:GPUS_LIMIT]) if i is not None),
            "queue_wait": wait, "reason": text(job.get("reason"), MESSAGE_LIMIT, secrets),
            "ended": text(job.get("ended"), MESSAGE_LIMIT, secrets)}


def _golden_rows(host: dict) -> list[dict]:
    """The host's rows of the golden matrix: one per GPU it ran on (hosts x GPUs x bundles), or one."""
    per_gpu = [r for r in host["gpu_runs"] if r["golden"]]
    if per_gpu:
        return [{"label": f"{host['name']} GPU {r['gpu']}", "key": f"{host['name']}-gpu{r['gpu']}", "golden": r["golden"]}
                for r in per_gpu]
    return [{"label": host["name"], "key": host["name"], "golden": host["golden"]}]


def _gpus_view(host: dict, secrets: list[str]) -> dict | None:
    """The host's GPU table (gpus.table_rows) with what the run selected; None without GPUs."""
    records = []
    for g in _list(host.get("gpus"))[:GPUS_LIMIT]:
        g = _dict(g)
        records.append({
            "index": _whole(g.get("index")), "name": text(g.get("name"), NAME_LIMIT, secrets),
            **{k: _whole(g.get(k)) for k in ("memory_used_mib", "memory_total_mib", "utilization_pct")},
            "busy": g.get("busy") is True,
            "processes": [{"pid": _whole(p.get("pid")), "name": text(p.get("name"), NAME_LIMIT, secrets),
                           "used_mib": _whole(p.get("used_mib"))}
                          for p in map(_dict, _list(g.get("processes"))[:GPUS_LIMIT])],
        })
    if not records:
        return None
    selected = [i for i in map(_whole, _list(host.get("selected_gpus"))) if i is not None]
    return {"header": gpus_mod.TABLE_HEADER, "rows": gpus_mod.table_rows(records, selected), "selected": selected}


def _gpu_run_view(run: dict, secrets: list[str]) -> dict:
    tests = _dict(run.get("tests"))
    return {
        "gpu": _whole(run.get("gpu")),
        "uuid": text(run.get("uuid"), NAME_LIMIT, secrets),
        "golden": {text(b, NAME_LIMIT, secrets): _golden_view(g, secrets) for b, g in _dict(run.get("golden")).items()},
        "golden_status": _status(run.get("golden_status"), ("passed", "failed"), "—"),
        "tests": {k: _whole(tests.get(k)) or 0 for k in ("passed", "failed", "skipped")} if tests else None,
        "tests_status": _status(run.get("tests_status"), ("passed", "failed"), "—"),
        "message": text(run.get("message"), MESSAGE_LIMIT, secrets),
    }


def _whole(value: Any) -> int | None:
    number = finite_number(value)
    return int(number) if number is not None and number.is_integer() else None


def _fingerprint_value(value: Any, secrets: list[str]) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return text(value, NAME_LIMIT, secrets)


def _gpu_label(fp: dict, steps: list[dict]) -> str:
    if not any(s["name"] == "preflight" and s["status"] in ("passed", "failed") for s in steps):
        return "not probed"     # deploy, exec, validate without preflight: an empty fingerprint says nothing
    if not fp.get("gpu"):
        return "no GPU"
    count = fp.get("gpu_count", "")
    cc = f" (cc {fp['compute_capability']})" if fp.get("compute_capability") else ""
    return f"{count}× {fp['gpu']}{cc}" if count and count not in ("0", "1") else f"{fp['gpu']}{cc}"


def _step_view(name: str, step: Any, secrets: list[str]) -> dict:
    step = _dict(step)
    return {
        "name": name,
        "status": _status(step.get("status"), STEP_STATUSES),
        "seconds": finite_number(step.get("seconds")),
        "log": text(step.get("log"), 200, secrets),
        "message": text(step.get("message"), MESSAGE_LIMIT, secrets),
        "tail": text(step.get("tail"), TAIL_LIMIT, secrets, keep_end=True),
        "reused_from": text(step.get("reused_from"), NAME_LIMIT, secrets) if step.get("reused_from") else "",
    }


def _golden_view(golden: Any, secrets: list[str]) -> dict:
    golden = _dict(golden)
    checks = _dict(golden.get("checks"))
    return {
        "status": _status(golden.get("status"), ("passed", "failed")),
        "checks": [(text(c, 60, secrets), _status(checks.get(c), ("passed", "failed", "skipped")))
                   for c in _unique([*GOLDEN_CHECKS, *checks]) if c in checks],
        "mismatch": _mismatch_view(golden.get("mismatch"), secrets),
        "detail": text(golden.get("detail") or "", 300, secrets),
    }


def _mismatch_view(mismatch: Any, secrets: list[str]) -> dict | None:
    if not isinstance(mismatch, dict):
        return None
    position = finite_number(mismatch.get("position"))
    start = finite_number(mismatch.get("window_start")) or 0
    expected = _list(mismatch.get("expected"))[:64]
    actual = _list(mismatch.get("actual"))[:64]
    columns = []
    for i in range(max(len(expected), len(actual))):
        pos = int(start) + i
        columns.append({
            "position": pos,
            "expected": text(expected[i], 20, secrets) if i < len(expected) else "∅",
            "actual": text(actual[i], 20, secrets) if i < len(actual) else "∅",
            "diverges": position is not None and pos == int(position),
        })
    return {
        "check": text(mismatch.get("check"), 60, secrets),
        "position": int(position) if position is not None else None,
        "margin": finite_number(mismatch.get("margin")),
        "columns": columns,
    }


def _tests_view(tests: Any, secrets: list[str]) -> dict | None:
    if not isinstance(tests, dict):
        return None
    cases = [c for c in _list(tests.get("cases")) if isinstance(c, dict)]
    failing = [c for c in cases if c.get("status") not in ("passed", "skipped")]
    return {
        "passed": int(finite_number(tests.get("passed")) or 0),
        "failed": int(finite_number(tests.get("failed")) or 0),
        "skipped": int(finite_number(tests.get("skipped")) or 0),
        "total": len(cases),
        "cases": [_case_view(c, secrets) for c in cases],
        "failing": [_case_view(c, secrets) for c in failing[:CASES_LIMIT]],
        "failing_cut": max(0, len(failing) - CASES_LIMIT),
    }


def _stress_view(stress: Any, secrets: list[str]) -> dict | None:
    """The tests view of the stress results, with `load`: their load.gpu_load case (None when
    the results have none: nothing says the tests ran under load)."""
    view = _tests_view(stress, secrets)
    if view is not None:
        view["load"] = next((c for c in view["cases"] if c["name"] == LOAD_CASE), None)
    return view


def _case_view(case: dict, secrets: list[str]) -> dict:
    return {
        "name": text(case.get("name"), NAME_LIMIT, secrets) or "?",
        "status": _status(case.get("status"), ("passed", "failed", "skipped")),
        "seconds": finite_number(case.get("seconds")),
        "message": text(case.get("message"), MESSAGE_LIMIT, secrets),
    }


def _bench_view(bench: Any, secrets: list[str]) -> dict | None:
    if not isinstance(bench, dict):
        return None
    metrics = {}
    for name, m in list(_dict(bench.get("metrics")).items())[:METRICS_LIMIT]:
        m = _dict(m)
        metrics[text(name, NAME_LIMIT, secrets)] = {
            "value": finite_number(m.get("value")),
            "unit": text(m.get("unit"), 40, secrets),
            "better": "lower" if m.get("better") == "lower" else "higher",
        }
    details = bench.get("details")
    gpu = _dict(bench.get("gpu"))
    return {"metrics": metrics, "details": text(json.dumps(details, indent=1, default=str), DETAILS_LIMIT, secrets) if details else "",
            "gpu": {"index": _whole(gpu.get("index")), "uuid": text(gpu.get("uuid"), NAME_LIMIT, secrets),
                    "samples": _whole(gpu.get("samples")) or 0,
                    "co_tenants": [{"pid": _whole(p.get("pid")), "name": text(p.get("name"), NAME_LIMIT, secrets),
                                    "max_used_mib": _whole(p.get("max_used_mib"))}
                                   for p in map(_dict, _list(gpu.get("co_tenants"))[:GPUS_LIMIT])]} if gpu else None}


def _regression_view(reg: dict, secrets: list[str]) -> dict:
    return {
        "host": text(reg.get("host"), NAME_LIMIT, secrets),
        "metric": text(reg.get("metric"), NAME_LIMIT, secrets),
        "unit": text(reg.get("unit"), 40, secrets),
        "better": "lower" if reg.get("better") == "lower" else "higher",
        "baseline": finite_number(reg.get("baseline")),
        "value": finite_number(reg.get("value")),
        "ratio": finite_number(reg.get("ratio")),
        "threshold": finite_number(reg.get("threshold")),
        "method": text(reg.get("method") or "baseline", 20, secrets),
        "reason": text(_dict(reg.get("evidence")).get("reason"), 600, secrets),
        "since_run": text(reg.get("since_run"), NAME_LIMIT, secrets),
        "bisect": text(reg.get("bisect"), 600, secrets),
    }


def _dashboard_link(history: Any, secrets: list[str]) -> str | None:
    """The trend dashboard's path relative to the run directory (a plain relative path only)."""
    link = text(_dict(history).get("dashboard"), 400, secrets)
    if not link or link.startswith(("/", "\\")) or ":" in link or not link.endswith(".html"):
        return None
    return link


def _metric_rows(hosts: list[dict], regressions: list[dict]) -> list[dict]:
    """One row per metric: its unit and direction, and per host its value and regression flag."""
    regressed = {(r["host"], r["metric"]) for r in regressions}
    rows: dict[str, dict] = {}
    for h in hosts:
        for name, m in (h["bench"] or {}).get("metrics", {}).items():
            row = rows.setdefault(name, {"name": name, "unit": m["unit"], "better": m["better"], "values": {}})
            row["values"][h["name"]] = {"value": m["value"], "regressed": (h["name"], name) in regressed}
    return list(rows.values())


# --------------------------------------------------------------------------------------------
# Bar charts (inline SVG): one per unit, a bar per host for each metric of that unit

CHART_WIDTH = 640
LABEL_WIDTH = 190
BAR_AREA = 370
BAR_HEIGHT = 14
BAR_GAP = 3
GROUP_GAP = 10
LEGEND_HEIGHT = 24


def _charts(hosts: list[dict]) -> list[dict]:
    """Bar charts of the benchmark metrics, grouped by unit, with their bars laid out."""
    colors = {h["name"]: _PALETTE[i % len(_PALETTE)] for i, h in enumerate(hosts)}
    by_unit: dict[str, dict[str, list[tuple[str, float]]]] = {}
    directions: dict[str, set[str]] = {}
    for h in hosts:
        for name, m in (h["bench"] or {}).get("metrics", {}).items():
            if m["value"] is not None and m["value"] >= 0:
                unit = m["unit"] or "value"
                by_unit.setdefault(unit, {}).setdefault(name, []).append((h["name"], m["value"]))
                directions.setdefault(unit, set()).add(m["better"])
    return [_chart(unit, metrics, colors, directions[unit]) for unit, metrics in by_unit.items()]


def _chart(unit: str, metrics: dict[str, list[tuple[str, float]]], colors: dict[str, str], directions: set[str]) -> dict:
    items = list(metrics.items())[:CHART_ROWS_LIMIT]
    top = max((v for _, bars in items for _, v in bars), default=0) or 1
    y = LEGEND_HEIGHT
    groups = []
    for name, bars in items:
        group: dict[str, Any] = {"label": name, "y": y + len(bars) * (BAR_HEIGHT + BAR_GAP) / 2, "bars": []}
        for host, value in bars:
            group["bars"].append({
                "host": host, "color": colors[host], "y": y, "value": fmt(value),
                "width": round(max(1.0, BAR_AREA * value / top), 1),
            })
            y += BAR_HEIGHT + BAR_GAP
        groups.append(group)
        y += GROUP_GAP
    legend = [{"host": h, "color": c, "x": LABEL_WIDTH + i * 110} for i, (h, c) in enumerate(colors.items())
              if any(h == b[0] for _, bars in items for b in bars)]
    return {"unit": unit, "better": directions.pop() if len(directions) == 1 else None, "groups": groups, "legend": legend, "width": CHART_WIDTH, "height": y,
            "label_width": LABEL_WIDTH, "bar_height": BAR_HEIGHT}
