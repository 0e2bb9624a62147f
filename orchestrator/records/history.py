"""The benchmark history: every run's benchmark metrics, indexed in one SQLite file.

    with HistoryStore.open("runs/history.sqlite") as store:
        store.index_run(load_run(run_dir), run_dir)          # after every validate or nightly
        series = store.series(key, "tiny_fp32.ar_tokens_per_s", before="20261201-020000-ab12")

A point is one metric of one host in one run, filed under its comparable key: host, GPU model,
backend and build key (compiler versions, flags, arch), with the engine tree hash and git commit
it was measured on. Only runs whose bench step ran give new points; a reused (cached) bench
result is stored with ``reused`` set and never returned as part of a series, so it cannot count
twice. The regressions a run reported are stored beside its points for the dashboard.

The file is the standard library's sqlite3 with a rollback journal (one file, no -wal beside
it); ``rebuild`` recreates the index from the run directories' run.json files. Indexing a run
again replaces what was stored for it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import ranges
from ..bounded import short_text
from .detector import DEFAULT_POLICY, Point, Policy, Verdict, judge
from ..errors import LocalWriteError, UsageError
from .record import Regression, mapping
from .run_store import RunRecordError, list_runs, load_run

SCHEMA_VERSION = 3
DEFAULT_NAME = "history.sqlite"
SAMPLES_LIMIT = 1000        # samples kept per point (a host's report is not trusted to be small)
TEXT_LIMIT = 200

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, command TEXT, started TEXT, status TEXT, run_dir TEXT,
    tree_hash TEXT, git_rev TEXT, git_dirty INTEGER);
CREATE TABLE IF NOT EXISTS points (
    run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
    started TEXT NOT NULL, host TEXT NOT NULL, gpu TEXT NOT NULL, backend TEXT NOT NULL,
    build_key TEXT NOT NULL, tree_hash TEXT, git_rev TEXT, metric TEXT NOT NULL, value REAL NOT NULL,
    unit TEXT NOT NULL, better TEXT NOT NULL, n INTEGER, median REAL, mad REAL, samples TEXT,
    noisy INTEGER NOT NULL, reused INTEGER NOT NULL, reused_from TEXT, cpu_samples TEXT, cal_samples TEXT,
    PRIMARY KEY (run_id, host, metric));
CREATE INDEX IF NOT EXISTS points_series ON points (host, gpu, backend, build_key, metric, started);
CREATE INDEX IF NOT EXISTS points_gpu ON points (gpu);
CREATE INDEX IF NOT EXISTS points_tree ON points (tree_hash);
CREATE INDEX IF NOT EXISTS points_commit ON points (git_rev);
CREATE TABLE IF NOT EXISTS regressions (
    run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
    host TEXT NOT NULL, metric TEXT NOT NULL, evidence TEXT NOT NULL,
    PRIMARY KEY (run_id, host, metric));
"""


# The points' columns each older version lacks (version 2 added cpu_samples, version 3 cal_samples).
_ADDED_COLUMNS = {"1": ("cpu_samples", "cal_samples"), "2": ("cal_samples",)}


class HistoryError(UsageError):
    """The history file cannot be opened, is not a history, or is of an unknown version."""


@dataclass(frozen=True)
class SeriesKey:
    """What makes two measurements comparable: same host, GPU model, backend and build key."""

    host: str
    gpu: str
    backend: str
    build_key: str

    def label(self) -> str:
        """``ct200 · NVIDIA H200 · cuda · build 3f2a…`` for headings."""
        return f"{self.host} · {self.gpu} · {self.backend} · build {self.build_key[:8]}"


@dataclass(frozen=True)
class StoredPoint:
    """A point as stored: the detector's Point plus its key, metric and provenance."""

    key: SeriesKey
    metric: str
    run_id: str
    started: str
    tree_hash: str | None
    git_rev: str | None
    value: float
    unit: str
    better: str
    samples: tuple[float, ...]
    n: int | None
    median: float | None
    mad: float | None
    noisy: bool
    reused: bool
    reused_from: str | None
    cpu_samples: tuple[float, ...] = ()
    cal_samples: tuple[float, ...] = ()

    def point(self) -> Point:
        """The detector's view of this point (a speed-up, unit ``x``, is a ratio of two timings)."""
        return Point(self.value, self.samples, self.mad, self.run_id, self.git_rev, self.noisy, self.cpu_samples,
                     self.cal_samples, ratio=self.unit == "x")


# --------------------------------------------------------------------------------------------
# Points from a run record


def build_key_id(build_key: object) -> str:
    """A short stable id of a build key (a dict from the engine's `build.sh --key`, or text)."""
    text = build_key if isinstance(build_key, str) else json.dumps(build_key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def host_key(name: str, host: dict) -> SeriesKey:
    """The comparable key of a host record of run.json.

    The build key is the host record's ``build_key`` (what build.sh --key printed); a record
    written before it was kept falls back to what the fingerprint says of the toolchain (arch,
    nvcc), which is coarser but never mixes GPU and CPU builds.
    """
    fp = mapping(host.get("fingerprint"))
    backend = _text(host.get("backend")) or "unknown"
    build = host.get("build_key")
    if build in (None, "", {}):
        build = {"backend": backend, "arch": fp.get("arch"), "nvcc": fp.get("nvcc")}
    return SeriesKey(_text(name), _text(fp.get("gpu")) or "no GPU", backend, build_key_id(build))


def run_points(run: dict) -> list[StoredPoint]:
    """Every benchmark metric of a run record as a point (reused ones marked as such).

    A host contributes when its bench step passed (new measurements) or was cached (reused); its
    metrics are bounded and typed here, since they came from the host.
    """
    source = mapping(run.get("source"))
    points = []
    for name, host in (run.get("hosts") or {}).items():
        if not isinstance(host, dict):
            continue
        step = mapping(mapping(host.get("steps")).get("bench"))
        status = step.get("status")
        bench = mapping(host.get("bench"))
        metrics = mapping(bench.get("metrics"))
        if status not in ("passed", "cached") or not metrics:
            continue
        key = host_key(name, host)
        reused_from = _text(step.get("reused_from")) or None
        reused = status == "cached" or reused_from is not None
        busy = mapping(host.get("fingerprint")).get("gpus_busy") is True
        for metric, data in metrics.items():
            point = _point(key, _text(metric), data, run, source, host, reused, reused_from, busy)
            if point is not None:
                points.append(point)
    return points


def _point(key: SeriesKey, metric: str, data: object, run: dict, source: dict, host: dict,
           reused: bool, reused_from: str | None, busy: bool) -> StoredPoint | None:
    """The point of one metric of a host record: None when its value is no number inside a
    figure's range (a record written before the bench step checked the ranges); its other numbers
    outside their range are left out."""
    value = ranges.FIGURE.number(data.get("value")) if isinstance(data, dict) else None
    if not isinstance(data, dict) or value is None or not metric:
        return None
    samples = _numbers(data.get("samples"))
    cpu_samples = _numbers(data.get("cpu_samples"), ranges.POSITIVE, whole=True)
    cal_samples = _numbers(data.get("cal_samples"), ranges.POSITIVE, whole=True)
    n = data.get("n")
    return StoredPoint(
        key=key, metric=metric, run_id=_text(run.get("run_id")), started=_text(run.get("started")),
        tree_hash=_text(host.get("deployed_tree_hash") or source.get("tree_hash")) or None,
        git_rev=_text(source.get("git_rev")) or None,
        value=value, unit=_text(data.get("unit")),
        better="lower" if data.get("better") == "lower" else "higher",
        samples=samples, n=n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else len(samples) or None,
        median=ranges.FIGURE.number(data.get("median")), mad=ranges.FIGURE.number(data.get("mad")),
        noisy=data.get("noisy") is True or busy, reused=reused, reused_from=reused_from,
        cpu_samples=cpu_samples,
        cal_samples=cal_samples if len(cal_samples) == len(cpu_samples) else ())


def _numbers(raw: object, field: ranges.Range = ranges.FIGURE, whole: bool = False) -> tuple[float, ...]:
    """The numbers inside `field`'s range of a list from run.json, at most SAMPLES_LIMIT; with
    `whole`, none unless every item is one (figures that pair up with another list's)."""
    items = raw[:SAMPLES_LIMIT] if isinstance(raw, list) else []
    kept = tuple(v for v in map(field.number, items) if v is not None)
    return () if whole and len(kept) != len(items) else kept


def _text(value: object) -> str:
    return short_text(value, TEXT_LIMIT) if value is not None else ""


# --------------------------------------------------------------------------------------------
# The store


class HistoryStore:
    """The history file, open. Use as a context manager (``HistoryStore.open(path)``)."""

    def __init__(self, connection: sqlite3.Connection, path: Path):
        self.db, self.path = connection, path

    @classmethod
    def open(cls, path: Path | str) -> HistoryStore:
        """Open (or create) the history file; HistoryError names the file when it is not one."""
        path = Path(path)
        if path.is_dir() or path.is_symlink():
            raise HistoryError(f"{path}: the history file is a directory or a symlink")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)      # a fresh checkout's runs/: private
        with contextlib.suppress(FileExistsError):      # a new history is private too (SQLite would make it 0644)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        try:
            db = sqlite3.connect(path, timeout=30)
            db.execute("PRAGMA foreign_keys = ON")
            db.execute("PRAGMA journal_mode = DELETE")
            db.executescript(_SCHEMA)
            version = db.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
            if version is not None and version[0] in _ADDED_COLUMNS:  # an older version gains its columns
                with db:
                    for column in _ADDED_COLUMNS[version[0]]:
                        db.execute(f"ALTER TABLE points ADD COLUMN {column} TEXT")
                    db.execute("UPDATE meta SET value = ? WHERE key = 'version'", (str(SCHEMA_VERSION),))
                version = (str(SCHEMA_VERSION),)
            if version is None:
                with db:
                    db.execute("INSERT INTO meta VALUES ('version', ?)", (str(SCHEMA_VERSION),))
            elif version[0] != str(SCHEMA_VERSION):
                db.close()
                raise HistoryError(f"{path}: history version {version[0]}, this orchestrator reads {SCHEMA_VERSION} "
                                   "(move it away and run `invoke history --rebuild`)")
        except sqlite3.DatabaseError as e:
            raise HistoryError(f"{path}: not a history file ({e}); move it away and run `invoke history --rebuild`") from None
        return cls(db, path)

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the file."""
        self.db.close()

    # -- writing ------------------------------------------------------------------------------
    def index_run(self, run: dict, run_dir: Path | str | None = None) -> int:
        """Store a run record's points and reported regressions (replacing an earlier indexing of
        the same run); returns the number of points stored. LocalWriteError when the file cannot
        grow (a full disk: nothing of the run is stored)."""
        try:
            with self.db:
                return self._index(run, run_dir)
        except sqlite3.OperationalError as e:
            raise LocalWriteError(self.path, str(e)) from None

    def rebuild(self, runs_root: Path | str) -> tuple[int, int, list[str]]:
        """Forget everything and index every run directory under ``runs_root`` again.

        Returns (runs indexed, points stored, problems): an unreadable run is skipped and named.
        """
        runs = points = 0
        problems = []
        with self.db:
            self.db.execute("DELETE FROM runs")
            for path in list_runs(runs_root):
                try:
                    run = load_run(path)
                except RunRecordError as e:
                    problems.append(str(e))
                    continue
                points += self._index(run, path)
                runs += 1
        return runs, points, problems

    def _index(self, run: dict, run_dir: Path | str | None) -> int:
        run_id = _text(run.get("run_id"))
        source = mapping(run.get("source"))
        self.db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
        self.db.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (
            run_id, _text(run.get("command")), _text(run.get("started")), _text(run.get("status")),
            str(Path(run_dir).absolute()) if run_dir is not None else None,
            _text(source.get("tree_hash")) or None, _text(source.get("git_rev")) or None,
            None if source.get("git_dirty") is None else int(bool(source.get("git_dirty")))))
        points = run_points(run)
        self.db.executemany("INSERT OR REPLACE INTO points VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [
            (p.run_id, p.started, p.key.host, p.key.gpu, p.key.backend, p.key.build_key, p.tree_hash, p.git_rev,
             p.metric, p.value, p.unit, p.better, p.n, p.median, p.mad,
             json.dumps(list(p.samples)) if p.samples else None, int(p.noisy), int(p.reused), p.reused_from,
             json.dumps(list(p.cpu_samples)) if p.cpu_samples else None,
             json.dumps(list(p.cal_samples)) if p.cal_samples else None)
            for p in points])
        for reg in run.get("regressions") or []:
            if isinstance(reg, dict) and reg.get("host") is not None and reg.get("metric") is not None:
                self.db.execute("INSERT OR REPLACE INTO regressions VALUES (?, ?, ?, ?)",
                                (run_id, _text(reg["host"]), _text(reg["metric"]), json.dumps(reg, default=str)))
        return len(points)

    # -- reading ------------------------------------------------------------------------------
    def series(self, key: SeriesKey, metric: str, before: str | None = None, limit: int | None = None,
               include_reused: bool = False) -> list[StoredPoint]:
        """A metric's comparable points, oldest first: new measurements only (unless
        ``include_reused``), those of runs started before run ``before`` when given, the newest
        ``limit`` when given."""
        sql = ("SELECT * FROM points WHERE host = ? AND gpu = ? AND backend = ? AND build_key = ? AND metric = ?"
               + ("" if include_reused else " AND reused = 0"))
        args: list = [key.host, key.gpu, key.backend, key.build_key, metric]
        if before is not None:
            row = self.db.execute("SELECT started FROM runs WHERE run_id = ?", (before,)).fetchone()
            if row is None:
                raise ValueError(f"run {before!r} is not in the history {self.path}")
            sql += " AND (started, run_id) < (?, ?)"
            args += [row[0], before]
        sql += " ORDER BY started DESC, run_id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        return _in_range(reversed(self.db.execute(sql, args).fetchall()))

    def series_keys(self) -> list[tuple[SeriesKey, str]]:
        """Every (comparable key, metric) with at least one new measurement in range, sorted."""
        found = {(p.key, p.metric) for p in _in_range(self.db.execute("SELECT * FROM points WHERE reused = 0"))}
        return sorted(found, key=lambda km: (km[0].host, km[0].gpu, km[0].backend, km[0].build_key, km[1]))

    def points(self, **where: str) -> list[StoredPoint]:
        """Points matching every given column (host, gpu, backend, build_key, tree_hash, git_rev,
        metric, run_id), oldest first, reused ones included."""
        unknown = set(where) - {"host", "gpu", "backend", "build_key", "tree_hash", "git_rev", "metric", "run_id"}
        if unknown:
            raise ValueError(f"cannot select points by {sorted(unknown)}")
        clause = " AND ".join(f"{column} = ?" for column in where) or "1"
        rows = self.db.execute(f"SELECT * FROM points WHERE {clause} ORDER BY started, run_id, host, metric",
                               list(where.values())).fetchall()
        return _in_range(rows)

    def has_run(self, run_id: str) -> bool:
        """Whether the run is indexed."""
        return self.db.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is not None

    def runs(self) -> dict[str, dict]:
        """Every indexed run: run id -> command, started, status, run_dir, tree_hash, git_rev."""
        rows = self.db.execute("SELECT run_id, command, started, status, run_dir, tree_hash, git_rev FROM runs").fetchall()
        return {r[0]: dict(zip(("command", "started", "status", "run_dir", "tree_hash", "git_rev"), r[1:])) for r in rows}

    def regressions(self) -> dict[tuple[str, str, str], dict]:
        """Every reported regression: (run id, host, metric) -> the run's regression entry."""
        rows = self.db.execute("SELECT run_id, host, metric, evidence FROM regressions").fetchall()
        return {(r[0], r[1], r[2]): json.loads(r[3]) for r in rows}


def _stored(row: tuple) -> StoredPoint | None:
    """The point a row holds; None when a number of it is outside its field's range (a history
    indexed before the ranges were checked: such a point is never judged or plotted)."""
    (run_id, started, host, gpu, backend, build_key, tree_hash, git_rev, metric, value, unit, better,
     n, med, mad, samples, noisy, reused, reused_from, cpu_samples, cal_samples) = row
    point = StoredPoint(SeriesKey(host, gpu, backend, build_key), metric, run_id, started, tree_hash, git_rev,
                        value, unit, better, _listed(samples), n, med, mad, bool(noisy), bool(reused), reused_from,
                        _listed(cpu_samples), _listed(cal_samples))
    figures = (point.value, *point.samples, *(v for v in (med, mad) if v is not None))
    in_range = all(ranges.FIGURE.number(v) is not None for v in figures) and \
        all(ranges.POSITIVE.number(v) is not None for v in (*point.cpu_samples, *point.cal_samples))
    return point if in_range else None


def _in_range(rows) -> list[StoredPoint]:
    """The points of these rows whose numbers are all inside their ranges, in the rows' order."""
    return [p for p in map(_stored, rows) if p is not None]


def _listed(text: str | None) -> tuple:
    """A stored list of numbers (JSON text, or NULL for none)."""
    return tuple(json.loads(text)) if text else ()


def judge_run(store: HistoryStore, run: dict, tolerance: Callable[[str], float],
              policy: Policy = DEFAULT_POLICY) -> list[tuple[StoredPoint, Verdict]]:
    """The detector's verdict on every benchmark metric of ``run`` against its comparable history
    in ``store`` (runs started before it). A reused result is not judged: its verdict says so."""
    verdicts = []
    indexed = store.has_run(_text(run.get("run_id")))
    for point in run_points(run):
        if point.reused:
            origin = f" from run {point.reused_from}" if point.reused_from else ""
            verdicts.append((point, Verdict("unjudged", "none", point.value, point.better, tolerance(point.metric),
                                            reason=f"reused result{origin}: not a new measurement")))
            continue
        # 3 windows: the drift rule looks 2 back, and the start of a streak is judged on its own past
        before = store.series(point.key, point.metric, before=point.run_id if indexed else None,
                              limit=3 * policy.window)
        verdicts.append((point, judge(point.point(), [p.point() for p in before], tolerance(point.metric),
                                      point.better, policy)))
    return verdicts


def regressions(verdicts: list[tuple[StoredPoint, Verdict]]) -> list[Regression]:
    """The regressed verdicts as run.json's regressions, each with its evidence and the exact
    bisect command (good: the newest commit of the baseline window on the baseline's side, bad:
    the commit that started the streak); sorted by host then metric."""
    from .bisect import command_for         # the bisect module: for a regression alone (start-up time)
    found = []
    for point, verdict in verdicts:
        if not verdict.regressed:
            continue
        bad = verdict.since_commit or verdict.bad_commit
        if verdict.baseline is None or verdict.ratio is None:
            raise ValueError(f"{point.key.host} {point.metric}: a regressed verdict without a baseline")
        found.append(Regression(point.key.host, point.metric, verdict.baseline, verdict.value, round(verdict.ratio, 4),
                                verdict.tolerance, point.unit, point.better, verdict.method, verdict.evidence(),
                                verdict.since_run, command_for(point.key.host, point.metric, verdict.good_commit, bad)))
    return sorted(found, key=lambda r: (r.host, r.metric))


def contended(verdicts: list[tuple[StoredPoint, Verdict]]) -> list[dict]:
    """The verdicts left unjudged because the run was measured under contention (slower on the
    wall clock, not per CPU second or not relative to the calibration probe): host, metric,
    wall-clock ratio, change per CPU second, change relative to the probe and the probe's own
    (when the run had the probe), and reason, sorted by host then metric."""
    found = []
    for point, verdict in verdicts:
        if verdict.status != "unjudged" or verdict.cpu_change is None or verdict.ratio is None:
            continue
        entry = {"host": point.key.host, "metric": point.metric, "ratio": round(verdict.ratio, 4),
                 "cpu_change": round(verdict.cpu_change, 4), "reason": verdict.reason}
        for key in ("cal_change", "calibration_change"):
            value = getattr(verdict, key)
            if value is not None:
                entry[key] = round(value, 4)
        found.append(entry)
    return sorted(found, key=lambda c: (c["host"], c["metric"]))


def default_path(runs_root: Path | str) -> Path:
    """Where the history lives unless --history names another file: runs/history.sqlite."""
    return Path(runs_root) / DEFAULT_NAME

