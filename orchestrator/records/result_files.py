"""The engine's result files, parsed into the parts of a host's run record: its test results
(``build/test_results.json``: tests_from_engine, also the stress step's) and its benchmark report
(``build/bench.json``: bench_from_engine). Whatever a host wrote is bounded here (cases, messages,
metrics, samples, the details' depth and size) and every benchmark number checked against its
range (orchestrator.records.ranges), so that run.json stays a few MB per host at most.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.records import ranges
from orchestrator.records.ranges import finite_number
from orchestrator.records.record import TEST_STATUSES, TestCase, TestsRecord
from orchestrator.bounded import short_text

MESSAGE_LIMIT = 4000  # characters kept of a message parsed from a host's result file
# What one host's result files may put into the record (run.json stays a few MB per host at most):
MAX_CASES = 5000  # engine test cases (the engine has a few hundred)
MESSAGES_BUDGET = 1_000_000  # characters of test messages, all cases together
MAX_METRICS = 1000  # benchmark metrics
DETAILS_DEPTH = 16  # bench details nested deeper are dropped
DETAILS_BYTES = 256_000  # and so are larger ones
SAMPLES_LIMIT = 1000  # samples kept per benchmark metric


def tests_from_engine(data: Any) -> TestsRecord:
    """Parse the engine's ``build/test_results.json`` (a dict), tolerating odd contents; at
    most MAX_CASES cases (ValueError beyond), their messages within MESSAGES_BUDGET characters."""
    raw = data.get("tests") if isinstance(data, dict) else None
    raw = [item for item in raw if isinstance(item, dict)] if isinstance(raw, list) else []
    if len(raw) > MAX_CASES:
        raise ValueError(f"{len(raw)} test cases, more than {MAX_CASES}")
    budget = [MESSAGES_BUDGET]
    cases = [_test_case(item, budget) for item in raw]
    counts = {s: sum(1 for c in cases if c.status == s) for s in TEST_STATUSES}
    return TestsRecord(counts["passed"], counts["failed"], counts["skipped"], cases)


def _test_case(item: dict, budget: list[int]) -> TestCase:
    """One case; its message takes from the host's shared `budget` of characters."""
    status = item.get("status")
    message = short_text(item.get("message") or "", min(MESSAGE_LIMIT, budget[0]))
    budget[0] -= len(message)
    if not budget[0] and item.get("message"):
        message += "[message cut: this host's test messages are over the record's budget]"
    return TestCase(
        name=short_text(item.get("name", "?"), 200),
        status=status if status in TEST_STATUSES else "failed",
        seconds=finite_number(item.get("seconds")) or 0.0,
        message=message,
    )


def bench_from_engine(data: Any) -> dict:
    """The ``bench`` part of a host record from the engine's ``build/bench.json``.

    Keeps the metrics whose value is a number (``unit`` a string, ``better`` higher or lower) with
    what the engine says of their noise: ``samples`` (numbers, at most SAMPLES_LIMIT), ``n``,
    ``median``, ``mad``, ``noisy`` (true only when the engine says so) and, for CPU timings,
    ``cpu_samples`` (the same figures per CPU second, positive), ``cal_samples`` (the calibration
    probe beside each repeat, in the metric's terms, positive) and ``cpu_share`` (CPU seconds per
    wall second of the repeats, positive), at most MAX_METRICS (ValueError beyond). Every number
    kept must lie inside its field's range (orchestrator.records.ranges: ranges.OutOfRange, a ValueError,
    names the metric, the field and the value). Every other top-level key but ``version`` and
    ``metrics`` goes to ``details``, replaced by a note when it is nested too deeply or too large
    to keep.
    """
    data = data if isinstance(data, dict) else {}
    metrics = {}
    raw = data.get("metrics")
    if isinstance(raw, dict) and len(raw) > MAX_METRICS:
        raise ValueError(f"{len(raw)} benchmark metrics, more than {MAX_METRICS}")
    for name, metric in (raw.items() if isinstance(raw, dict) else ()):
        name = short_text(name, 200)
        value = ranges.FIGURE.read(metric.get("value"), f"metric {name}: value") if isinstance(metric, dict) else None
        if value is not None:
            better = metric.get("better")
            metrics[name] = {
                "value": value,
                "unit": short_text(metric.get("unit") or "", 40),
                "better": better if better in ("higher", "lower") else "higher",
                **_noise(metric, f"metric {name}:"),
            }
    details = {k: v for k, v in data.items() if k not in ("version", "metrics")}
    return {"metrics": metrics, "details": _bounded(details)}


def _noise(metric: dict, what: str) -> dict:
    """A metric's samples and spread as the engine reported them, typed, bounded and in range
    (OutOfRange naming `what` and the field otherwise). Per-CPU-second figures with one not
    positive are no such figures (left out, as a negative MAD or CPU share is)."""
    noise: dict[str, Any] = {}
    for key in ("samples", "cpu_samples", "cal_samples"):
        samples = metric.get(key)
        if isinstance(samples, list):
            numbers = [s for s in samples[:SAMPLES_LIMIT] if finite_number(s) is not None]
            field = ranges.FIGURE if key == "samples" else ranges.POSITIVE
            if numbers and (key == "samples" or all(v > 0 for v in numbers)):
                noise[key] = [field.check(v, f"{what} {key}") for v in numbers]
    n = metric.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 31:
        noise["n"] = n
    for key, field in (("median", ranges.FIGURE), ("mad", ranges.FIGURE), ("cpu_share", ranges.CPU_SHARE)):
        number = finite_number(metric.get(key))
        if number is not None and (key == "median" or number > 0 or key == "mad" and number == 0):
            noise[key] = field.check(number, f"{what} {key}")
    if metric.get("noisy") is True:
        noise["noisy"] = True
    return noise


def _bounded(details: dict) -> dict:
    if _depth(details) > DETAILS_DEPTH:
        return {"omitted": f"nested deeper than {DETAILS_DEPTH} levels"}
    size = len(json.dumps(details, default=str))
    return details if size <= DETAILS_BYTES else {"omitted": f"{size} bytes, more than {DETAILS_BYTES}"}


def _depth(value: Any, limit: int = DETAILS_DEPTH + 1) -> int:
    """Nesting depth of a JSON-like value, counted no further than ``limit``."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)
