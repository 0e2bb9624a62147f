"""The run record: the content of run.json, built with the dataclasses here (``RunRecord.to_dict()``)
and read back as a plain dict (run_store.load_run). run_store.py keeps the run directories the
record is written into; result_files.py parses the engine's result files into its parts.
Schema, version 1:

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
                   "timeouts": {STEP: SECONDS}, "seconds_per_gb"} (bundle_plan.py),
        "job": null | {"job_id", "partition", "node", "gpus": [INDEX, ...], "cuda_visible_devices",
                "submitted", "started", "queue_wait" (seconds in Slurm's queue: in no step's seconds),
                "time_limit", "state", "reason", "ended"} (a `scheduler: slurm` entry's allocation)}},
     "regressions": [{"host", "metric", "baseline", "value", "ratio", "threshold", "unit", "better",
                      "method", "evidence", "since_run", "bisect"}],
     "history": null | {"store", "dashboard", "contended": [{"host", "metric", "ratio", "cpu_change", "cal_change"?,
                                                              "calibration_change"?, "reason"}]}}

Secrets never reach the record: run_store.write_run redacts every string (keys included) with the
secret values the pipeline knows (redaction.py).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from orchestrator.bounded import short_text
from orchestrator.steps import ORDER
from orchestrator.records.ranges import finite_number

RUN_VERSION = 1

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
class SlurmJob:
    """A `scheduler: slurm` entry's allocation in the run (slurm/run.py): slurmctld's job id,
    partition, node, the GPU indices and CUDA_VISIBLE_DEVICES Slurm gave, the submit and start
    times (Slurm's clock), the seconds it waited in the queue (apart from every step's seconds),
    its time limit as Slurm prints it, the CPUs it holds, its last state and reason, and how it
    ended, in words."""

    job_id: str
    partition: str
    node: str | None = None
    gpus: list[int] = field(default_factory=list)
    cuda_visible_devices: str | None = None
    submitted: str | None = None
    started: str | None = None
    queue_wait: float | None = None
    time_limit: str | None = None
    cpus: int | None = None
    state: str | None = None
    reason: str | None = None
    ended: str = ""


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
    job: SlurmJob | None = None         # a `scheduler: slurm` entry's allocation (None: any other host)


@dataclass
class Regression:
    """A benchmark metric that got worse than its baseline by more than its threshold: ``method``
    says which rule (``baseline``: a fixed ratio against a baseline file; the history detector's
    ``history``, ``drift`` or ``few-points``), ``evidence`` what it saw (orchestrator.records.detector's
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
    """A step's place in the pipeline's order; the others (exec, the bundle commands') come last."""
    return ORDER.index(step) if step in ORDER else len(ORDER)


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
