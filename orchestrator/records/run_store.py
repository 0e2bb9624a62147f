"""The run store: the run directories, ``runs/latest``, and reading, listing and cleaning runs.

A run writes one directory, ``runs/<run-id>/`` (or the ``--report-dir`` the user names):

    run.json                             the run record (orchestrator.records.record), versioned
    report.md, report.html, junit.xml    rendered from run.json by orchestrator.records.report
    <host>/<step>.log                    each step's full output on each host
    <host>/<file>                        result files pulled back from the host

``runs/latest`` is a symlink to the newest run. run.json is written atomically and private
(0600), every string in it redacted (write_run), and read back as a plain dict (load_run).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import secrets as _random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from orchestrator import ownership
from orchestrator.records import ranges
from orchestrator.errors import UsageError
from orchestrator.records.record import BASELINE_COMMANDS, RUN_VERSION, RunRecord, mapping
from orchestrator.records.redaction import redact_tree

RUN_JSON = "run.json"
LATEST = "latest"
RUN_ID_RE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{4}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RunRecordError(UsageError):
    """run.json or the run directory is missing, corrupt or of an unknown version."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


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


def write_run(run_dir: RunDir | Path | str, record: RunRecord | dict, secrets: Iterable[str] = ()) -> Path:
    """Write run.json atomically, every string in it redacted; returns its path."""
    folder = run_dir.path if isinstance(run_dir, RunDir) else Path(run_dir)
    data = record.to_dict() if isinstance(record, RunRecord) else record
    data = redact_tree(data, list(secrets))
    return ownership.write_private(folder / RUN_JSON, json.dumps(data, indent=2, allow_nan=False) + "\n")


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
