"""Reports rendered from a run record: report.md, report.html, junit.xml, and the comparison of two
runs (its rows come from orchestrator.regression, the domain logic of baselines, regressions and
comparisons; this module only renders).

Everything renders from run.json (a dict, see orchestrator.record) through ``view()``, which turns
whatever the record holds into clean, bounded, typed data: contents pulled from hosts may be
hostile (huge strings, control characters, markup, odd types), and rendering never trusts them.
Every string is first made visible (orchestrator.safe_text: control characters escaped), then
HTML is escaped by Jinja2's autoescape, XML by ElementTree, Markdown by safe_text's filters (no
markup, links, images or mentions), and every message and log tail is redacted with the secrets
the caller passes.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable

import jinja2

from orchestrator import gpus as gpus_mod
from orchestrator import ownership
from orchestrator.errors import UsageError
from orchestrator.ranges import finite_number
from orchestrator.regression import compare
from orchestrator.safe_text import markdown, markdown_block, markdown_code, markdown_fence, visible
from orchestrator.record import (
    HOST_STATUSES,
    LOAD_CASE,
    UNFINISHED_STEP_STATUSES,
    Fingerprint,
    GOLDEN_CHECKS,
    RUN_JSON,
    STEP_STATUSES,
    atomic_write,
    load_run,
    redact,
    mapping as _dict,
    short_text,
    step_order,
    unique as _unique,
    utc_now,
)

__all__ = ["redact", "text", "view", "render_markdown", "render_html", "render_junit", "render_run",
           "render_compare", "write_compare"]

REPORT_FILES = {"md": "report.md", "html": "report.html", "junit": "junit.xml"}

NAME_LIMIT = 120
MESSAGE_LIMIT = 2000
TAIL_LIMIT = 12000
DETAILS_LIMIT = 4000
CASES_LIMIT = 200  # failing engine tests listed per host
METRICS_LIMIT = 200
CHART_ROWS_LIMIT = 40
GPUS_LIMIT = 64           # GPUs, and co-tenant processes, listed per host

FINGERPRINT_KEYS = [f.name for f in fields(Fingerprint)]

_SYMBOLS = {"passed": "✓", "failed": "✗", "timeout": "◷", "skipped": "–", "cached": "↺",
            "interrupted": "■", "none": "·"}
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
    }


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


# --------------------------------------------------------------------------------------------
# Templates


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f} s" if value < 120 else f"{int(value // 60)} min {value % 60:.0f} s"


def _margin(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    """The compiled templates, kept between runs in a directory of this user's cache that only
    they can write ($XDG_CACHE_HOME or ~/.cache, kdtree-orchestrator/templates, checked as the
    run directory is: Jinja2 loads Python code from it); compiling them costs 0.5-1 s of CPU a
    run on a busy 2-core machine, more than a no-change deploy's own work. None (compiled every
    run, nothing else changes) when no such directory can be had."""
    try:
        return jinja2.FileSystemBytecodeCache(
            str(ownership.private_dir(ownership.cache_home() / "kdtree-orchestrator" / "templates", "template cache")))
    except (OSError, RuntimeError, UsageError):
        return None


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        bytecode_cache=_bytecode_cache(),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",), default=False),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(md=markdown, code=markdown_code, block=markdown_block, fence=markdown_fence, fmt=fmt, secs=_seconds, margin=_margin,
                       symbol=lambda s: _SYMBOLS.get(s, "?"), short=lambda h: h[:12] if h else "—")
    return env


_ENV = _environment()
_RUN_TEMPLATES = ("report.md.j2", "report.html.j2")


def prepare() -> None:
    """Compile the run report's templates now (the run calls it in the background, while the
    hosts work), so that writing the reports at the end costs only their rendering."""
    for name in _RUN_TEMPLATES:
        _ENV.get_template(name)


def render_markdown(run: dict, secrets: Iterable[str] = ()) -> str:
    """report.md: the run as GitHub-flavoured Markdown."""
    return _ENV.get_template("report.md.j2").render(run=view(run, secrets))


def render_html(run: dict, secrets: Iterable[str] = ()) -> str:
    """report.html: one self-contained page (inline CSS and SVG, nothing fetched)."""
    return _ENV.get_template("report.html.j2").render(run=view(run, secrets))


# --------------------------------------------------------------------------------------------
# JUnit XML


def render_junit(run: dict, secrets: Iterable[str] = ()) -> str:
    """junit.xml: a testsuite per host, a testcase per step (``step.<name>``), per engine test
    (``test.<name>``) and per test of the stress step (``stress.<name>``), classname the host; failures carry the message and the log tail."""
    v = view(run, secrets)
    root = ET.Element("testsuites", name=f"kdtree {v['command']} {v['run_id']}")
    for host in v["hosts"]:
        suite = ET.SubElement(root, "testsuite", name=host["name"], timestamp=v["started"], hostname=host["address"] or host["name"])
        props = ET.SubElement(suite, "properties")
        for key in ("backend", "transport", "deployed_tree_hash", "gpu_label"):
            ET.SubElement(props, "property", name=key, value=str(host[key] or ""))
        for step in host["steps"]:
            evidence = "\n".join(filter(None, [_golden_summary(host) if step["name"] == "golden" else "", step["tail"]]))
            _junit_case(suite, host["name"], f"step.{step['name']}", step["status"], step["seconds"],
                        step["message"], evidence, step["reused_from"])
        for kind, results in (("test", host["tests"]), ("stress", host["stress"])):
            for case in (results or {}).get("cases", []):
                _junit_case(suite, host["name"], f"{kind}.{case['name']}", case["status"], case["seconds"],
                            case["message"], "")
        _junit_totals(suite)
    _junit_totals(root)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _golden_summary(host: dict) -> str:
    """The failed golden checks of a host, one bundle a paragraph, tokens around a divergence."""
    lines = []
    for bundle, golden in host["golden"].items():
        m = golden["mismatch"]
        if golden["status"] != "failed":
            continue
        if m is None:
            lines.append(f"{bundle}: failed: " + ", ".join(c for c, s in golden["checks"] if s == "failed"))
            continue
        lines += [f"{bundle}: {m['check']} diverges at position {m['position']} (reference margin {_margin(m['margin'])})",
                  "  position: " + " ".join(f"{c['position']:>6}" for c in m["columns"]),
                  "  expected: " + " ".join(f"{c['expected']:>6}" for c in m["columns"]),
                  "  actual:   " + " ".join(f"{c['actual']:>6}" for c in m["columns"])]
    return "\n".join(lines)


def _junit_case(suite: ET.Element, classname: str, name: str, status: str, seconds: float | None,
                message: str, tail: str, reused_from: str = "") -> None:
    case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{seconds or 0:.3f}")
    summary = message.splitlines()[0][:500] if message else status
    if status in UNFINISHED_STEP_STATUSES:
        body = "\n\n".join(part for part in (message, tail) if part)
        ET.SubElement(case, "failure", message=summary, type=status).text = body
    elif status == "skipped":
        ET.SubElement(case, "skipped", message=summary)
    elif status == "cached":
        ET.SubElement(case, "system-out").text = f"cached: reused from run {reused_from or '?'} (not re-run)"


def _junit_totals(element: ET.Element) -> None:
    cases = element.iter("testcase")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
    for case in cases:
        counts["tests"] += 1
        counts["failures"] += case.find("failure") is not None
        counts["skipped"] += case.find("skipped") is not None
        counts["time"] += float(case.get("time", 0))
    for key, value in counts.items():
        element.set(key, f"{value:.3f}" if key == "time" else str(value))


# --------------------------------------------------------------------------------------------
# Writing a run's reports


def render_run(run_dir: Path | str, secrets: Iterable[str] = ()) -> dict[str, Path]:
    """Render run.json of ``run_dir`` into report.md, report.html and junit.xml beside it
    (each written atomically); returns their paths by kind (md, html, junit)."""
    run_dir = Path(run_dir)
    run = load_run(run_dir / RUN_JSON)
    secrets = list(secrets)
    rendered = {"md": render_markdown(run, secrets), "html": render_html(run, secrets), "junit": render_junit(run, secrets)}
    return {kind: atomic_write(run_dir / REPORT_FILES[kind], body) for kind, body in rendered.items()}


# --------------------------------------------------------------------------------------------
# Comparing two runs (the rows are regression.compare's)


def render_compare(base: dict, current: dict, thresholds: dict[str, float] | None = None,
                   secrets: Iterable[str] = ()) -> tuple[str, str]:
    """The comparison as (Markdown, self-contained HTML)."""
    secrets = [s for s in secrets if s]
    rows = [{**r, "host": text(r["host"], NAME_LIMIT, secrets), "metric": text(r["metric"], NAME_LIMIT, secrets),
             "unit": text(r["unit"], 40, secrets), "reused_from": text(r["reused_from"], 200, secrets)}
            for r in compare(base, current, thresholds)]
    context = {"base": view(base, secrets), "current": view(current, secrets), "rows": rows}
    return (_ENV.get_template("compare.md.j2").render(**context),
            _ENV.get_template("compare.html.j2").render(**context))


def write_compare(base_dir: Path | str, current_dir: Path | str, thresholds: dict[str, float] | None = None,
                  secrets: Iterable[str] = ()) -> dict[str, Path]:
    """Write ``compare-<base run id>.md`` and ``.html`` into the current run's directory."""
    base, current = load_run(base_dir), load_run(current_dir)
    markdown, html = render_compare(base, current, thresholds, secrets)
    stem = "compare-" + re.sub(r"[^A-Za-z0-9._-]", "_", str(base["run_id"]))[:80]
    current_dir = Path(current_dir)
    return {"md": atomic_write(current_dir / f"{stem}.md", markdown),
            "html": atomic_write(current_dir / f"{stem}.html", html)}
