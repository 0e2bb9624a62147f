"""The run record (run.json) and the run directory.

A run writes one directory, ``runs/<run-id>/`` (or the ``--report-dir`` the user names):

    run.json                             the record below, versioned; everything a script needs
    report.md, report.html, junit.xml    rendered from run.json by orchestrator.report
    <host>/<step>.log                    each step's full output on each host
    <host>/<file>                        result files pulled back from the host

``runs/latest`` is a symlink to the newest run. The record is built with the dataclasses here
(``RunRecord.to_dict()``) and read back as a plain dict (``load_run``). Schema, version 1:

    {"version": 1, "run_id", "command": "doctor|deploy|validate|nightly|bisect|exec", "started", "finished", "seconds",
     "status": "passed|failed|interrupted",
     "source": {"tree_hash", "git_rev", "git_dirty"},
     "hosts": {NAME: {"status": "passed|failed|interrupted", "transport": "ssh|local", "address",
        "backend": "cpu|cuda|null", "deployed_tree_hash", "binary_tree_hash",
        "fingerprint": {"gpu", "gpu_count", "compute_capability", "driver", "nvcc", "arch",
                        "gpus_busy", "cpu"},
        "gpus": [{"index", "uuid", "name", "memory_used_mib", "memory_total_mib", "utilization_pct",
                  "compute_cap", "pci_bus_id", "processes": [{"pid", "name", "used_mib"}], "busy"}],
        "selected_gpus": [INDEX, ...] (the GPUs the run claimed and pinned its engine commands to),
        "steps": {STEP: {"status": "passed|failed|timeout|interrupted|skipped|cached", "seconds",
                         "log": "<host>/<step>.log", "message", "tail",
                         "reused_from": null | RUN_ID (a cached step: the run whose result it reused),
                         "cuda_visible_devices": null | [GPU UUID, ...] (what its engine commands saw),
                         "inputs": null | SHA256 (test, bench: of what the result depends on: the
                                   executables, the tree's other files, build key, command, env;
                                   equal in two runs: the same inputs),
                         "output_cut": null | {"bytes", "lines", "left_out_bytes", "left_out_lines"} (a
                                   long output: its log and console kept its first and last MB)}},
        "golden": {BUNDLE: {"status": "passed|failed", "checks": {CHECK: "passed|failed|skipped"},
                            "mismatch": null | {"check", "position", "expected", "actual",
                                                "window_start", "margin"},
                            "detail": "what failed, when no token position says it"}},
        "tests": {"passed", "failed", "skipped", "cases": [{"name", "status", "seconds", "message"}]},
        "stress": null | the same as "tests": the CUDA tests run under GPU load (the stress step;
                  its case "load.gpu_load" says whether the load ran throughout),
        "bench": {"metrics": {NAME: {"value", "unit", "better": "higher|lower",
                                     "samples"?, "n"?, "median"?, "mad"?, "noisy"?,
                                     "cpu_samples"?, "cal_samples"?, "cpu_share"?}}, "details": {...},
                  "gpu": null | {"index", "uuid", "co_tenants": [{"pid", "name", "max_used_mib", "samples"}],
                                 "samples"}},
        "gpu_runs": [{"gpu": INDEX, "uuid", "results_dir", "golden": {BUNDLE: as "golden"},
                      "golden_status": "passed|failed|null", "tests": {"passed", "failed", "skipped",
                      "failed_names"} | null, "tests_status": "passed|failed|null", "message"}]
                    (golden and test once per selected GPU, each pinned to its GPU),
        "build_key": {...} | null, "seconds",
        "bundles": null | {"tiers", "configs", "bundles": [{"name", "file", "config", "disk_bytes", "ram_bytes",
                   "gpu_bytes", "declared"}], "disk_bytes", "ram_bytes_per_engine", "gpu_bytes", "max_memory", "undeclared",
                   "timeouts": {STEP: SECONDS}, "seconds_per_gb"} (bundle_plan.py)}},
     "regressions": [{"host", "metric", "baseline", "value", "ratio", "threshold", "unit", "better",
                      "method", "evidence", "since_run", "bisect"}],
     "history": null | {"store", "dashboard", "contended": [{"host", "metric", "ratio", "cpu_change", "cal_change"?,
                                                              "calibration_change"?, "reason"}]}}

Secrets never reach the record: ``write_run`` redacts every string (keys included) with the
secret values the pipeline knows.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import secrets as _random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from orchestrator import ownership, ranges
from orchestrator.ranges import finite_number
from orchestrator.errors import UsageError
from orchestrator.inventory import STEPS

RUN_VERSION = 1
RUN_JSON = "run.json"
LATEST = "latest"

COMMANDS = ("doctor", "deploy", "validate", "nightly", "bisect", "exec", "check-bundle", "clean-bundles")
BASELINE_COMMANDS = ("validate", "nightly")      # runs that measure: baselines and comparisons use them
RUN_STATUSES = ("passed", "failed", "interrupted")
HOST_STATUSES = RUN_STATUSES
STEP_STATUSES = ("passed", "failed", "timeout", "interrupted", "skipped", "cached")
FAILED_STEP_STATUSES = ("failed", "timeout")
UNFINISHED_STEP_STATUSES = FAILED_STEP_STATUSES + ("interrupted",)     # a step whose log tail is kept
GOLDEN_CHECKS = (
    "local_vs_expected",
    "host_vs_expected",
    "host_ar_vs_golden",
    "host_ddtree_vs_golden",
    "int4_differs_from_fp32",
)
CHECK_STATUSES = ("passed", "failed", "skipped")
TEST_STATUSES = ("passed", "failed", "skipped")
LOAD_CASE = "load.gpu_load"  # the stress results' case saying whether the GPU load ran throughout

RUN_ID_RE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{4}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MESSAGE_LIMIT = 4000  # characters kept of a message parsed from a host's result file
# What one host's result files may put into the record (run.json stays a few MB per host at most):
MAX_CASES = 5000  # engine test cases (the engine has a few hundred)
MESSAGES_BUDGET = 1_000_000  # characters of test messages, all cases together
MAX_METRICS = 1000  # benchmark metrics
DETAILS_DEPTH = 16  # bench details nested deeper are dropped
DETAILS_BYTES = 256_000  # and so are larger ones
SAMPLES_LIMIT = 1000  # samples kept per benchmark metric
REDACTED = "[REDACTED]"
MIN_FRAGMENT = 6  # shortest cut-off piece of a secret redacted at the edge of a log tail


class RunRecordError(UsageError):
    """run.json or the run directory is missing, corrupt or of an unknown version."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


# --------------------------------------------------------------------------------------------
# The record


@dataclass
class Source:
    """The engine source tree this run deployed."""

    tree_hash: str | None = None
    git_rev: str | None = None
    git_dirty: bool | None = None


@dataclass
class Fingerprint:
    """What a host is: its GPUs, toolchain and CPU, as preflight saw them."""

    gpu: str | None = None
    gpu_count: int = 0
    compute_capability: str | None = None
    driver: str | None = None
    nvcc: str | None = None
    arch: str | None = None
    gpus_busy: bool | None = None
    cpu: str | None = None


@dataclass
class StepRecord:
    """One step on one host: its outcome, duration, log (relative to the run dir) and log tail;
    a `cached` step names the run whose result it reused (`reused_from`)."""

    status: str
    seconds: float = 0.0
    log: str | None = None
    message: str = ""
    tail: str = ""
    reused_from: str | None = None
    cuda_visible_devices: list[str] | None = None
    inputs: str | None = None           # test, bench: the sha256 of what the result depends on
    output_cut: dict | None = None      # what the log left out of a long output (sink.BoundedSink.close)


@dataclass
class Mismatch:
    """Where two token sequences first diverge, with the tokens around it on both sides."""

    check: str
    position: int
    expected: list[int]
    actual: list[int]
    window_start: int
    margin: float | None = None

    @classmethod
    def first(
        cls,
        check: str,
        expected: list[int],
        actual: list[int],
        margins: list[float] | None = None,
        context: int = 4,
    ) -> Mismatch | None:
        """The first divergence of ``actual`` from ``expected`` (None when they are equal).

        A shorter sequence diverges where it ends. ``margins`` are the reference's top-1 minus
        top-2 logit per position (the manifest's ``golden_margins``); the one at the divergent
        position is kept.
        """
        position = next(
            (i for i, (e, a) in enumerate(zip(expected, actual)) if e != a),
            None if len(expected) == len(actual) else min(len(expected), len(actual)),
        )
        if position is None:
            return None
        start = max(0, position - context)
        end = position + context + 1
        margin = finite_number(margins[position]) if margins is not None and position < len(margins) else None
        return cls(check, position, [_token(t) for t in expected[start:end]], [_token(t) for t in actual[start:end]],
                   start, margin)


def _token(value: Any) -> Any:
    """A token id as the record keeps it: an int, else (a host's garbage) a short text."""
    return value if isinstance(value, int) and not isinstance(value, bool) else short_text(value, 40)


@dataclass
class GoldenRecord:
    """One bundle's golden-token checks on one host; ``mismatch`` is the first failing check's."""

    status: str
    checks: dict[str, str] = field(default_factory=dict)
    mismatch: Mismatch | None = None
    detail: str = ""


@dataclass
class TestCase:
    """One engine test's outcome."""

    __test__ = False  # not a pytest class
    name: str
    status: str
    seconds: float = 0.0
    message: str = ""


@dataclass
class TestsRecord:
    """The engine's test results on one host."""

    __test__ = False
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    cases: list[TestCase] = field(default_factory=list)

    @classmethod
    def from_engine(cls, data: Any) -> TestsRecord:
        """Parse the engine's ``build/test_results.json`` (a dict), tolerating odd contents; at
        most MAX_CASES cases (ValueError beyond), their messages within MESSAGES_BUDGET characters."""
        raw = data.get("tests") if isinstance(data, dict) else None
        raw = [item for item in raw if isinstance(item, dict)] if isinstance(raw, list) else []
        if len(raw) > MAX_CASES:
            raise ValueError(f"{len(raw)} test cases, more than {MAX_CASES}")
        budget = [MESSAGES_BUDGET]
        cases = [_test_case(item, budget) for item in raw]
        counts = {s: sum(1 for c in cases if c.status == s) for s in TEST_STATUSES}
        return cls(counts["passed"], counts["failed"], counts["skipped"], cases)


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
    kept must lie inside its field's range (orchestrator.ranges: ranges.OutOfRange, a ValueError,
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


def short_text(value: Any, limit: int) -> str:
    """``value`` as a string of at most ``limit`` characters (JSON for non-strings)."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value, default=str)
        except (RecursionError, ValueError):
            value = "[unprintable]"
    return value[:limit]


@dataclass
class GpuRun:
    """Golden and test on one selected GPU of a host (each GPU's run pinned to it alone, its
    results in its own folder on the host): a column of the hosts x GPUs x bundles matrix."""

    gpu: int
    uuid: str
    results_dir: str
    golden: dict[str, GoldenRecord] = field(default_factory=dict)
    golden_status: str | None = None
    tests: dict | None = None           # passed, failed, skipped, failed_names (the first few)
    tests_status: str | None = None
    message: str = ""


@dataclass
class HostRecord:
    """Everything one run learned about one host."""

    status: str = "failed"
    transport: str = "ssh"
    address: str | None = None
    backend: str | None = None
    deployed_tree_hash: str | None = None
    binary_tree_hash: str | None = None
    fingerprint: Fingerprint = field(default_factory=Fingerprint)
    steps: dict[str, StepRecord] = field(default_factory=dict)
    golden: dict[str, GoldenRecord] = field(default_factory=dict)
    tests: TestsRecord | None = None
    bench: dict | None = None
    stress: TestsRecord | None = None
    gpus: list[dict] = field(default_factory=list)
    selected_gpus: list[int] = field(default_factory=list)
    gpu_runs: list[GpuRun] = field(default_factory=list)
    seconds: float = 0.0
    build_key: dict | None = None       # what the engine's build key command printed (compilers, flags, arch)
    bundles: dict | None = None         # the bundles the host runs, their needs, the scaled timeouts (bundle_plan)


@dataclass
class Regression:
    """A benchmark metric that got worse than its baseline by more than its threshold: ``method``
    says which rule (``baseline``: a fixed ratio against a baseline file; the history detector's
    ``history``, ``drift`` or ``few-points``), ``evidence`` what it saw (orchestrator.detector's
    Verdict), ``since_run`` the first run of an unbroken streak, ``bisect`` the command to run."""

    host: str
    metric: str
    baseline: float
    value: float
    ratio: float
    threshold: float
    unit: str = ""
    better: str = "higher"
    method: str = "baseline"
    evidence: dict | None = None
    since_run: str | None = None
    bisect: str | None = None


@dataclass
class RunRecord:
    """One run of a command over hosts: the content of run.json."""

    run_id: str
    command: str
    started: str
    finished: str | None = None
    seconds: float = 0.0
    status: str = "failed"
    source: Source = field(default_factory=Source)
    hosts: dict[str, HostRecord] = field(default_factory=dict)
    regressions: list[Regression] = field(default_factory=list)
    history: dict | None = None         # {"store": history file, "dashboard": path from the run dir, "contended": [...]}
    version: int = RUN_VERSION

    def to_dict(self) -> dict:
        """The JSON-ready dict, ``version`` first and each host's steps in pipeline order."""
        data = asdict(self)
        for host in data["hosts"].values():
            host["steps"] = dict(sorted(host["steps"].items(), key=lambda kv: step_order(kv[0])))
        return {"version": data.pop("version"), **data}


def step_order(step: str) -> int:
    """A step's place in the pipeline's order; steps it does not know come last."""
    return STEPS.index(step) if step in STEPS else len(STEPS)


def host_status(steps: dict[str, StepRecord], stopped: bool = False) -> str:
    """``failed`` when any step failed or timed out; ``interrupted`` when one was interrupted, or
    the run was ``stopped`` before every step ran; else ``passed``."""
    if any(s.status in FAILED_STEP_STATUSES for s in steps.values()):
        return "failed"
    if any(s.status == "interrupted" for s in steps.values()) or \
            stopped and any(s.status == "skipped" and s.message == INTERRUPTED_SKIP for s in steps.values()):
        return "interrupted"
    return "passed"


INTERRUPTED_SKIP = "the run was interrupted before it ran"


def run_status(hosts: dict[str, HostRecord], interrupted: bool = False) -> str:
    """``interrupted``, else ``failed`` when any host failed (or none ran), else ``passed``."""
    if interrupted:
        return "interrupted"
    if not hosts or any(h.status != "passed" for h in hosts.values()):
        return "failed"
    return "passed"


def mapping(value: Any) -> dict:
    """``value`` when it is a dict, else an empty one (a record read back may hold anything)."""
    return value if isinstance(value, dict) else {}


def unique(items: Iterable[str]) -> list[str]:
    """``items`` without repeats, in their first order."""
    return list(dict.fromkeys(items))


def utc_now() -> str:
    """The current time as ISO 8601 UTC, seconds precision (``2026-11-29T17:22:33Z``)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------------
# Secrets


def redact(text: Any, secrets: Iterable[str]) -> str:
    """``text`` with every secret value replaced by ``[REDACTED]``.

    Also a piece of a secret cut off at the start or end of ``text`` (a log tail starts or ends
    mid-secret), when that piece is at least a few characters long. Non-strings are str()'d.
    """
    text = text if isinstance(text, str) else str(text)
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
        text = _redact_edges(text, secret)
    return text


def _redact_edges(text: str, secret: str) -> str:
    for n in range(len(secret) - 1, MIN_FRAGMENT - 1, -1):
        if text.startswith(secret[-n:]):
            text = REDACTED + text[n:]
            break
    for n in range(len(secret) - 1, MIN_FRAGMENT - 1, -1):
        if text.endswith(secret[:n]):
            text = text[:-n] + REDACTED
            break
    return text


def redact_tree(value: Any, secrets: Iterable[str]) -> Any:
    """A copy of a JSON-like value with every string in it (dict keys too) redacted."""
    secrets = [s for s in secrets if s]
    if not secrets:
        return value
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {redact_tree(k, secrets) if isinstance(k, str) else k: redact_tree(v, secrets)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_tree(v, secrets) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# The run directory


def new_run_id(now: _dt.datetime | None = None) -> str:
    """A fresh run id, sortable by time: ``20261129-172233-ab12`` (UTC, 4 random hex digits)."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return f"{now:%Y%m%d-%H%M%S}-{_random.token_hex(2)}"


def check_name(name: str, what: str = "name") -> str:
    """``name`` when it is safe as one path component (host, step, file), else ValueError."""
    if not isinstance(name, str) or not NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"unsafe {what} for a run directory path: {name!r}")
    return name


@dataclass(frozen=True)
class RunDir:
    """A run's directory: where run.json, the reports and the per-host logs go."""

    path: Path
    run_id: str

    @property
    def run_json(self) -> Path:
        return self.path / RUN_JSON

    def log_ref(self, host: str, step: str) -> str:
        """The log's path as run.json records it, relative to the run dir: ``<host>/<step>.log``."""
        return f"{check_name(host, 'host')}/{check_name(step, 'step')}.log"

    def log_path(self, host: str, step: str) -> Path:
        """Where a step's log goes; the host's folder is created."""
        return self.host_file(host, f"{check_name(step, 'step')}.log")

    def host_file(self, host: str, name: str) -> Path:
        """Where a file pulled back from ``host`` goes; always inside the run dir."""
        folder = self.path / check_name(host, "host")
        folder.mkdir(mode=0o700, exist_ok=True)
        ownership.check_local_dir(folder, "host folder of the run")      # not a symlink, not another user's
        target = folder / check_name(name, "file name")
        if target.is_symlink():
            raise ValueError(f"refusing to write through a symlink: {target}")
        return target


def read_tail(path: Path | str, lines: int = 60, max_bytes: int = 64_000) -> str:
    """The last ``lines`` lines of a log, reading at most its last ``max_bytes`` bytes (a log
    may be huge); undecodable bytes are replaced. A missing log reads as ''."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read(max_bytes)
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


def create_run_dir(runs_root: Path | str, report_dir: Path | str | None = None) -> RunDir:
    """Make a new run directory: ``runs_root/<run-id>/``, or ``report_dir`` when given.

    A ``report_dir`` must be new, empty, or hold an earlier run (a run.json): anything else is
    refused, so a typo cannot scatter reports over an unrelated folder. A relative one is taken
    from the current directory. One named like a run id (``20261129-172233-ab12``) gives the run
    that id, so a report dir directly under runs_root is a run like any other there (the nightly's
    baseline, ``report --run``, ``clean``). Both must pass the ownership rule
    (ownership.check_local_dir: no other user can redirect what the run writes); new directories
    are private (0700), and so are the files written in them (0600).
    """
    if report_dir is not None:
        path = Path(report_dir).absolute()  # the steps resolve paths inside it from other folders
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise RunRecordError(path, "report dir is not a plain directory")
        if path.is_dir() and any(path.iterdir()) and not (path / RUN_JSON).is_file():
            raise RunRecordError(path, "report dir is not empty and holds no earlier run")
        ownership.private_dir(path, "report dir")
        return RunDir(path, path.name if RUN_ID_RE.match(path.name) else new_run_id())
    root = Path(runs_root)
    ownership.private_dir(root, "runs directory", link_ok=True)      # runs/ may link to a history elsewhere
    while True:
        run_id = new_run_id()
        try:
            (root / run_id).mkdir(mode=0o700)
        except FileExistsError:
            continue
        return RunDir(root / run_id, run_id)


def update_latest(runs_root: Path | str, run_dir: Path | str) -> Path:
    """Point ``runs_root/latest`` at ``run_dir`` atomically (a new link renamed over the old).

    The link is relative when the run lies inside runs_root, so the folder can be moved.
    """
    root = Path(runs_root)
    root.mkdir(parents=True, exist_ok=True)
    target = Path(run_dir).absolute()
    try:
        target = target.relative_to(root.absolute())
    except ValueError:
        pass
    tmp = root / f".{LATEST}.{os.getpid()}.{_random.token_hex(4)}"
    with ownership.writing(root / LATEST):
        os.symlink(target, tmp)
        os.replace(tmp, root / LATEST)
    return root / LATEST


def atomic_write(path: Path | str, data: str | bytes) -> Path:
    """Write a file so readers see either the old content or the new, never a partial one
    (private to this user: 0600; ownership.write_private)."""
    return ownership.write_private(path, data)


def write_run(run_dir: RunDir | Path | str, record: RunRecord | dict, secrets: Iterable[str] = ()) -> Path:
    """Write run.json atomically, every string in it redacted; returns its path."""
    folder = run_dir.path if isinstance(run_dir, RunDir) else Path(run_dir)
    data = record.to_dict() if isinstance(record, RunRecord) else record
    data = redact_tree(data, list(secrets))
    return atomic_write(folder / RUN_JSON, json.dumps(data, indent=2, allow_nan=False) + "\n")


def load_run(path: Path | str) -> dict:
    """Read a run record from a run directory or a run.json file, checking its version.

    Raises RunRecordError naming the file and the problem (missing, not JSON, not a run record,
    an unknown version).
    """
    path = Path(path)
    file = path / RUN_JSON if path.is_dir() else path
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunRecordError(file, "no run record here") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunRecordError(file, f"cannot read: {e}") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise RunRecordError(file, f"corrupt run record (not JSON: {e})") from None
    if not isinstance(data, dict) or "version" not in data:
        raise RunRecordError(file, "not a run record (no 'version')")
    if data["version"] != RUN_VERSION:
        raise RunRecordError(file, f"unknown run record version {data['version']!r} (this orchestrator reads {RUN_VERSION})")
    if not isinstance(data.get("hosts"), dict) or not isinstance(data.get("run_id"), str):
        raise RunRecordError(file, "not a run record (no 'run_id' or 'hosts')")
    return data


def list_runs(runs_root: Path | str) -> list[Path]:
    """The run directories directly under runs_root, oldest first (symlinks are not runs)."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if RUN_ID_RE.match(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(runs, key=lambda p: p.name)


def resolve_run(runs_root: Path | str, ref: str | Path | None = None) -> Path:
    """The run directory ``ref`` names: None or ``latest``, a run id under runs_root, or a path."""
    root = Path(runs_root)
    if ref is None or str(ref) == LATEST:
        link = root / LATEST
        if not link.exists():
            raise RunRecordError(link, "no latest run")
        return link.resolve()
    if RUN_ID_RE.match(str(ref)) and (root / str(ref)).is_dir():
        return root / str(ref)
    path = Path(ref)
    if path.is_file() and path.name == RUN_JSON:
        return path.parent
    if path.is_dir():
        return path
    raise RunRecordError(path, "no such run (give a run id, a run directory or 'latest')")


def last_good_run(runs_root: Path | str, command: str = "nightly", exclude: str | None = None) -> dict | None:
    """The newest readable run of ``command`` that passed, its figures in range (the nightly's
    default baseline)."""
    path = newest_run(runs_root, (command,), passed=True, exclude=exclude)
    return load_run(path) if path else None


def newest_run(runs_root: Path | str, commands: Iterable[str] = BASELINE_COMMANDS, passed: bool = False,
               exclude: str | None = None) -> Path | None:
    """The newest readable run directory of one of ``commands`` (``passed``: that passed, every
    benchmark figure of it inside its range: a baseline to keep and compare with)."""
    commands = tuple(commands)
    for path in reversed(list_runs(runs_root)):
        if path.name == exclude:
            continue
        try:
            run = load_run(path)
        except RunRecordError:
            continue
        if run.get("command") in commands and (not passed or run.get("status") == "passed" and _figures_in_range(run)):
            return path
    return None


def _figures_in_range(run: dict) -> bool:
    """Whether every benchmark value of a run record is inside a figure's range (one written
    before the bench step checked them may hold 5e-324 or 1e308)."""
    return all(ranges.FIGURE.number(mapping(m).get("value")) is not None
               for host in run["hosts"].values()
               for m in mapping(mapping(mapping(host).get("bench")).get("metrics")).values())


def clean(runs_root: Path | str, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` runs under runs_root; returns what was deleted. The
    newest passing nightly (the next nightly's baseline; a run whose benchmark figures are outside
    their range is none) is never deleted.

    Only run directories directly inside runs_root are candidates (names like a run id, real
    directories, never symlinks), and rmtree does not follow links inside them. ``latest`` is
    repointed at the newest remaining run, or removed when none remains.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0, not {keep}")
    root = Path(runs_root)
    runs = list_runs(root)
    baseline = newest_run(root, ("nightly",), passed=True)
    doomed = [p for p in runs[: max(0, len(runs) - keep)] if p != baseline]
    for path in doomed:
        shutil.rmtree(path)
    _repair_latest(root, [p for p in runs if p not in doomed])
    return doomed


def _repair_latest(root: Path, remaining: list[Path]) -> None:
    link = root / LATEST
    if not link.is_symlink() or link.exists():
        return
    if remaining:
        update_latest(root, remaining[-1])
    else:
        link.unlink()
