"""Reports rendered from a run record: report.md, report.html, junit.xml; comparisons; regressions.

Everything renders from run.json (a dict, see orchestrator.record) through ``view()``, which turns
whatever the record holds into clean, bounded, typed data: contents pulled from hosts may be
hostile (huge strings, control characters, markup, odd types), and rendering never trusts them.
HTML is escaped by Jinja2's autoescape, XML by ElementTree, Markdown by the filters below, and
every message and log tail is redacted with the secrets the caller passes.

The nightly job compares benchmarks with a baseline: a previous run.json or a baseline file

    {"version": 1, "created": ISO-8601, "source_run": RUN_ID,
     "hosts": {HOST: {METRIC: VALUE}}, "thresholds": {METRIC_OR_GLOB: RELATIVE_TOLERANCE}}

(``thresholds`` optional), with per-metric relative tolerances that absorb the noise left in the
engine's medians of repeats.
"""

from __future__ import annotations

import fnmatch
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable

import jinja2

from orchestrator import gpus as gpus_mod

from orchestrator.record import (
    HOST_STATUSES,
    UNFINISHED_STEP_STATUSES,
    Fingerprint,
    GOLDEN_CHECKS,
    RUN_JSON,
    Regression,
    STEP_STATUSES,
    atomic_write,
    finite_number,
    load_run,
    redact,
    short_text,
    step_order,
    utc_now,
)

__all__ = [
    "redact", "text", "view", "render_markdown", "render_html", "render_junit", "render_run",
    "compare", "render_compare", "write_compare",
    "find_regressions", "threshold_for", "baseline_values", "make_baseline", "write_baseline", "load_baseline",
]

REPORT_FILES = {"md": "report.md", "html": "report.html", "junit": "junit.xml"}
BASELINE_VERSION = 1
DEFAULT_THRESHOLD = 0.10  # relative tolerance of a metric no threshold names

NAME_LIMIT = 120
MESSAGE_LIMIT = 2000
TAIL_LIMIT = 12000
DETAILS_LIMIT = 4000
CASES_LIMIT = 200  # failing engine tests listed per host
METRICS_LIMIT = 200
CHART_ROWS_LIMIT = 40
GPUS_LIMIT = 64           # GPUs, and co-tenant processes, listed per host

FINGERPRINT_KEYS = [f.name for f in fields(Fingerprint)]

_ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[@-Z\\-_])")
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_SYMBOLS = {"passed": "✓", "failed": "✗", "timeout": "◷", "skipped": "–", "cached": "↺",
            "interrupted": "■", "none": "·"}
_PALETTE = ("#0969da", "#8250df", "#1a7f37", "#bc4c00", "#bf3989", "#1b7c83", "#9a6700", "#57606a")


# --------------------------------------------------------------------------------------------
# Clean values


def text(value: Any, limit: int = MESSAGE_LIMIT, secrets: Iterable[str] = (), keep_end: bool = False) -> str:
    """``value`` as printable text: redacted, terminal escapes and XML-invalid characters gone,
    cut to ``limit`` characters (its end kept when ``keep_end``, as for a log tail)."""
    if value is None:
        return ""
    s = value if isinstance(value, str) else short_text(value, 4 * limit)
    s = _NOT_XML.sub("", _ANSI.sub("", redact(s, secrets)))
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


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


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
        "failures": [(h, s) for h in hosts for s in h["steps"] if s["status"] in UNFINISHED_STEP_STATUSES],
        "reused": [(h, s) for h in hosts for s in h["steps"] if s["reused_from"]],
        "generated": utc_now(),
    }


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


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
        "gpu_label": _gpu_label(fp),
        "steps": steps,
        "step_map": {s["name"]: s for s in steps},
        "seconds": sum(s["seconds"] or 0 for s in steps),
        "golden": {text(b, NAME_LIMIT, secrets): _golden_view(g, secrets) for b, g in _dict(host.get("golden")).items()},
        "tests": _tests_view(host.get("tests"), secrets),
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


def _gpu_label(fp: dict) -> str:
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
    }


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
        group = {"label": name, "y": y + len(bars) * (BAR_HEIGHT + BAR_GAP) / 2, "bars": []}
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


def _fence(body: str) -> str:
    """A Markdown code fence longer than any backtick run in ``body``."""
    longest = max((len(m) for m in re.findall(r"`+", body)), default=0)
    return "`" * max(3, longest + 1)


def _md(value: Any) -> str:
    """Text safe inside a Markdown table cell or line: no pipes, newlines or raw HTML."""
    s = str(value).replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return " ".join(s.split())


def _md_code(value: Any) -> str:
    """Inline Markdown code for a value that may itself hold backticks."""
    s = " ".join(str(value).replace("|", "\\|").split())
    if not s:
        return ""
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    return f"{ticks} {s} {ticks}" if "`" in s else f"{ticks}{s}{ticks}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f} s" if value < 120 else f"{int(value // 60)} min {value % 60:.0f} s"


def _margin(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",), default=False),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(md=_md, code=_md_code, fence=_fence, fmt=fmt, secs=_seconds, margin=_margin,
                       symbol=lambda s: _SYMBOLS.get(s, "?"), short=lambda h: h[:12] if h else "—")
    return env


_ENV = _environment()


def render_markdown(run: dict, secrets: Iterable[str] = ()) -> str:
    """report.md: the run as GitHub-flavoured Markdown."""
    return _ENV.get_template("report.md.j2").render(run=view(run, secrets))


def render_html(run: dict, secrets: Iterable[str] = ()) -> str:
    """report.html: one self-contained page (inline CSS and SVG, nothing fetched)."""
    return _ENV.get_template("report.html.j2").render(run=view(run, secrets))


# --------------------------------------------------------------------------------------------
# JUnit XML


def render_junit(run: dict, secrets: Iterable[str] = ()) -> str:
    """junit.xml: a testsuite per host, a testcase per step (``step.<name>``) and per engine
    test (``test.<name>``), classname the host; failures carry the message and the log tail."""
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
        for case in (host["tests"] or {}).get("cases", []):
            _junit_case(suite, host["name"], f"test.{case['name']}", case["status"], case["seconds"], case["message"], "")
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
# Baselines and regressions


def baseline_values(baseline: dict) -> dict[str, dict[str, float]]:
    """``{host: {metric: value}}`` from a baseline file's dict or from a run record."""
    hosts = _dict(baseline.get("hosts"))
    if "run_id" in baseline:
        hosts = {h: {m: _dict(v).get("value") for m, v in _dict(_dict(_dict(rec).get("bench")).get("metrics")).items()}
                 for h, rec in hosts.items()}
    return {str(h): {str(m): v for m, v in _dict(ms).items() if finite_number(v) is not None} for h, ms in hosts.items()}


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
    return atomic_write(path, json.dumps(make_baseline(run, thresholds), indent=2, sort_keys=True) + "\n")


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
            value, base = finite_number(_dict(metric).get("value")), finite_number(reference.get(host, {}).get(name))
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
        hosts[str(host)] = {str(n): {"value": finite_number(_dict(m).get("value")), "unit": str(_dict(m).get("unit") or ""),
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
