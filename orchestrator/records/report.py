"""Reports rendered from a run record: report.md, report.html, junit.xml, and the comparison of two
runs (its rows come from orchestrator.records.regression, the domain logic of baselines, regressions and
comparisons; this module only renders).

Everything renders from run.json through ``run_view.view()``, which turns whatever the record
holds into clean, bounded, typed data (hostile contents pulled from hosts included), every
message and log tail redacted with the secrets the caller passes and made visible
(orchestrator.safe_text: control characters escaped). Then HTML is escaped by Jinja2's
autoescape, XML by ElementTree, Markdown by safe_text's filters (no markup, links, images or
mentions).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterable

import jinja2

from orchestrator import ownership
from orchestrator.errors import UsageError
from orchestrator.ownership import write_private
from orchestrator.records.record import UNFINISHED_STEP_STATUSES
from orchestrator.records.regression import compare
from orchestrator.records.run_store import RUN_JSON, load_run
from orchestrator.records.run_view import NAME_LIMIT, fmt, text, view
from orchestrator.safe_text import markdown, markdown_block, markdown_code, markdown_fence

__all__ = ["render_markdown", "render_html", "render_junit", "render_run", "render_compare", "write_compare"]

REPORT_FILES = {"md": "report.md", "html": "report.html", "junit": "junit.xml"}

_SYMBOLS = {"passed": "✓", "failed": "✗", "timeout": "◷", "skipped": "–", "cached": "↺",
            "interrupted": "■", "none": "·"}


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
    return _markdown(view(run, secrets))


def render_html(run: dict, secrets: Iterable[str] = ()) -> str:
    """report.html: one self-contained page (inline CSS and SVG, nothing fetched)."""
    return _html(view(run, secrets))


def _markdown(v: dict) -> str:
    return _ENV.get_template("report.md.j2").render(run=v)


def _html(v: dict) -> str:
    return _ENV.get_template("report.html.j2").render(run=v)


# --------------------------------------------------------------------------------------------
# JUnit XML


def render_junit(run: dict, secrets: Iterable[str] = ()) -> str:
    """junit.xml: a testsuite per host, a testcase per step (``step.<name>``), per engine test
    (``test.<name>``) and per test of the stress step (``stress.<name>``), classname the host; failures carry the message and the log tail."""
    return _junit(view(run, secrets))


def _junit(v: dict) -> str:
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
    v = view(run, list(secrets))        # one view for the three (the templates only read it)
    rendered = {"md": _markdown(v), "html": _html(v), "junit": _junit(v)}
    return {kind: write_private(run_dir / REPORT_FILES[kind], body) for kind, body in rendered.items()}


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
    return {"md": write_private(current_dir / f"{stem}.md", markdown),
            "html": write_private(current_dir / f"{stem}.html", html)}
