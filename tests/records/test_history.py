"""The history store: runs indexed by comparable key, reused results kept out of series, rebuild
from run directories, bounded host data, and the verdicts of a run against its history."""
from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.records import record as rec
from orchestrator.records import result_files, run_store
from orchestrator.records.history import (HistoryError, HistoryStore, SeriesKey, build_key_id, contended,
                                          host_key, judge_run, regressions, run_points)

H200 = rec.Fingerprint(gpu="NVIDIA H200", gpu_count=1, compute_capability="9.0", arch="sm_90", nvcc="13.0")
BUILD = {"backend": "cuda", "arch": "sm_90", "cxx": "g++ 13.2", "nvcc": "13.0", "cxxflags": "-O2"}


def bench(values: dict[str, float], repeats: int = 5, rng: random.Random | None = None) -> dict:
    """A bench record: each metric with its samples (spread 1 %) around its value."""
    rng = rng or random.Random(0)
    metrics = {}
    for name, value in values.items():
        samples = sorted(value * rng.gauss(1, 0.01) for _ in range(repeats))
        metrics[name] = {"value": samples[repeats // 2], "unit": "ms" if name.endswith("_ms") else "tokens/s",
                         "better": "lower" if name.endswith("_ms") else "higher", "samples": samples}
    return {"metrics": metrics, "details": {}}


def a_run(i: int, hosts: dict[str, dict], command: str = "nightly", commit: str | None = None) -> dict:
    """A run record (as run.json holds it) started ``i`` minutes after a fixed time."""
    records = {}
    for name, h in hosts.items():
        steps = {"build": rec.StepRecord("passed"), "bench": rec.StepRecord(h.get("bench_status", "passed"))}
        host = rec.HostRecord("passed", "ssh", name, h.get("backend", "cuda"), f"tree{i:03d}", f"tree{i:03d}",
                              h.get("fingerprint", H200), steps, bench=h.get("bench"))
        records[name] = host
    run = rec.RunRecord(f"20261201-{i // 60:02d}{i % 60:02d}00-{i:04x}", command, f"2026-12-01T{i // 60:02d}:{i % 60:02d}:00Z",
                        status="passed", source=rec.Source(f"tree{i:03d}", commit or f"commit{i:03d}", False),
                        hosts=records).to_dict()
    for name, h in hosts.items():
        if "build_key" in h:
            run["hosts"][name]["build_key"] = h["build_key"]
        if "reused_from" in h:
            run["hosts"][name]["steps"]["bench"]["reused_from"] = h["reused_from"]
    return run


@pytest.fixture
def store(tmp_path):
    with HistoryStore.open(tmp_path / "runs" / "history.sqlite") as s:
        yield s


def test_points_are_filed_under_host_gpu_backend_and_build_key(store):
    a100 = rec.Fingerprint(gpu="NVIDIA A100", arch="sm_80", nvcc="13.0")
    for i in range(3):
        store.index_run(a_run(i, {
            "gpu1": {"bench": bench({"ar_tokens_per_s": 100.0 + i}), "build_key": BUILD},
            "gpu2": {"bench": bench({"ar_tokens_per_s": 50.0}), "fingerprint": a100, "build_key": BUILD},
            "cpu": {"bench": bench({"ar_tokens_per_s": 5.0}), "backend": "cpu", "fingerprint": rec.Fingerprint()},
        }))
    store.index_run(a_run(3, {"gpu1": {"bench": bench({"ar_tokens_per_s": 80.0}), "build_key": {**BUILD, "cxxflags": "-O0"}}}))
    keys = store.series_keys()
    assert len(keys) == 4
    gpu1 = SeriesKey("gpu1", "NVIDIA H200", "cuda", build_key_id(BUILD))
    series = store.series(gpu1, "ar_tokens_per_s")
    assert [p.run_id for p in series] == [a_run(i, {})["run_id"] for i in range(3)]
    assert [p.value for p in series] == pytest.approx([100, 101, 102], rel=0.03)
    assert series[0].git_rev == "commit000" and series[0].tree_hash == "tree000" and len(series[0].samples) == 5
    assert store.series(SeriesKey("gpu1", "NVIDIA H200", "cuda", build_key_id({**BUILD, "cxxflags": "-O0"})),
                        "ar_tokens_per_s")[0].value < 90
    cpu_key = next(k for k, _ in keys if k.host == "cpu")
    assert cpu_key.gpu == "no GPU" and cpu_key.backend == "cpu"
    assert [p.run_id for p in store.points(git_rev="commit001")] == [a_run(1, {})["run_id"]] * 3
    assert len(store.points(tree_hash="tree003")) == 1 and len(store.points(gpu="NVIDIA A100")) == 3
    with pytest.raises(ValueError, match="cannot select points by"):
        store.points(colour="red")


def test_the_schema_indexes_every_lookup_and_stays_one_file(store, tmp_path):
    store.index_run(a_run(0, {"h": {"bench": bench({"m": 1.0})}}))
    indexed = {row[0] for row in store.db.execute("SELECT sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}
    text = " ".join(indexed)
    for column in ("host, gpu, backend, build_key, metric, started", "(gpu)", "(tree_hash)", "(git_rev)"):
        assert column in text
    plan = " ".join(str(r) for r in store.db.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM points WHERE host='h' AND gpu='g' AND backend='b' AND build_key='k' AND metric='m'"))
    assert "points_series" in plan
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["history.sqlite"]


def test_a_reused_result_is_stored_but_never_a_new_point(store):
    store.index_run(a_run(0, {"h": {"bench": bench({"m": 10.0})}}))
    store.index_run(a_run(1, {"h": {"bench": bench({"m": 10.0}), "bench_status": "cached"}}))
    store.index_run(a_run(2, {"h": {"bench": bench({"m": 10.0}), "reused_from": a_run(0, {})["run_id"]}}))
    key = store.series_keys()[0][0]
    assert len(store.series(key, "m")) == 1
    every = store.series(key, "m", include_reused=True)
    assert [p.reused for p in every] == [False, True, True]
    assert every[2].reused_from == a_run(0, {})["run_id"]


def test_indexing_a_run_again_replaces_it_and_before_and_limit_select(store):
    for i in range(6):
        store.index_run(a_run(i, {"h": {"bench": bench({"m": float(i + 1)})}}))
    store.index_run(a_run(2, {"h": {"bench": bench({"m": 99.0})}}))
    key = store.series_keys()[0][0]
    values = [p.value for p in store.series(key, "m")]
    assert values == pytest.approx([1, 2, 99, 4, 5, 6], rel=0.03)
    assert [p.value for p in store.series(key, "m", before=a_run(4, {})["run_id"])] == pytest.approx([1, 2, 99, 4], rel=0.03)
    assert [p.value for p in store.series(key, "m", limit=2)] == pytest.approx([5, 6], rel=0.03)
    with pytest.raises(ValueError, match="not in the history"):
        store.series(key, "m", before="20991231-000000-ffff")


def test_host_data_is_bounded_and_typed():
    hostile = {"metrics": {
        "ok": {"value": 1.0, "samples": [1.0, float("nan"), "x", True, 2.0] + [1.5] * 5000, "n": True, "mad": -1},
        "inf": {"value": float("inf")}, "text": {"value": "fast"}, "x" * 500: {"value": 3.0, "noisy": "yes"},
        "": {"value": 4.0}, "busy": {"value": 5.0, "noisy": True},
    }}
    run = a_run(0, {"h": {"bench": hostile}})
    points = {p.metric: p for p in run_points(run)}
    assert set(points) == {"ok", "x" * 200, "busy"}
    ok = points["ok"]
    assert len(ok.samples) <= 1000 and all(isinstance(s, float) for s in ok.samples) and 2.0 in ok.samples
    assert ok.mad is None and ok.n == len(ok.samples) and not ok.noisy
    assert points["busy"].noisy and not points["x" * 200].noisy


def test_metrics_measured_while_the_gpus_were_busy_are_noisy():
    busy = rec.Fingerprint(gpu="NVIDIA H200", gpus_busy=True)
    points = run_points(a_run(0, {"h": {"bench": bench({"m": 1.0}), "fingerprint": busy}}))
    assert points[0].noisy


def test_a_run_whose_bench_did_not_run_gives_no_points():
    run = a_run(0, {"h": {"bench": bench({"m": 1.0}), "bench_status": "failed"},
                    "i": {"bench": None}})
    assert run_points(run) == []


def test_host_key_falls_back_to_the_toolchain_when_no_build_key_was_kept():
    host = {"backend": "cuda", "fingerprint": {"gpu": "NVIDIA H200", "arch": "sm_90", "nvcc": "13.0"}}
    assert host_key("h", host) == host_key("h", json.loads(json.dumps(host)))
    assert host_key("h", host) != host_key("h", {**host, "fingerprint": {**host["fingerprint"], "arch": "sm_120"}})
    assert host_key("h", {**host, "build_key": BUILD}).build_key == build_key_id(BUILD)


def test_rebuild_reindexes_every_run_directory_and_names_the_unreadable_ones(tmp_path):
    runs_root = tmp_path / "runs"
    for i in range(4):
        run = a_run(i, {"h": {"bench": bench({"m": 10.0 + i})}})
        (runs_root / run["run_id"]).mkdir(parents=True)
        run_store.write_run(runs_root / run["run_id"], run)
    broken = runs_root / "20261201-235900-dead"
    broken.mkdir()
    (broken / "run.json").write_text("{not json")
    with HistoryStore.open(runs_root / "history.sqlite") as store:
        store.index_run(a_run(50, {"h": {"bench": bench({"m": 1.0})}}))       # a run whose directory is gone
        runs, points, problems = store.rebuild(runs_root)
        assert (runs, points) == (4, 4)
        assert len(problems) == 1 and "20261201-235900-dead" in problems[0] and "not JSON" in problems[0]
        key = store.series_keys()[0][0]
        assert [p.value for p in store.series(key, "m")] == pytest.approx([10, 11, 12, 13], rel=0.03)
        assert store.runs()[a_run(0, {})["run_id"]]["run_dir"] == str((runs_root / a_run(0, {})["run_id"]).absolute())


def test_a_fresh_checkouts_history_and_runs_folder_are_private(tmp_path):
    """Issue 37, finding 13: the first validate of a fresh checkout opens the history before any
    run directory exists: runs/ is made 0700 and history.sqlite 0600 (its journal follows the
    file's mode), whatever the umask."""
    old = os.umask(0o022)
    try:
        with HistoryStore.open(tmp_path / "runs" / "history.sqlite") as store:
            store.index_run(a_run(0, {"h": {"bench": bench({"m": 1.0})}}))
    finally:
        os.umask(old)
    assert oct((tmp_path / "runs").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "runs" / "history.sqlite").stat().st_mode & 0o777) == "0o600"


def test_a_file_that_is_not_a_history_is_refused_with_its_name(tmp_path):
    bad = tmp_path / "notes.sqlite"
    bad.write_text("these are my notes, not a database" * 100)
    with pytest.raises(HistoryError, match="notes.sqlite: not a history file"):
        HistoryStore.open(bad)
    assert bad.read_text().startswith("these are my notes")
    other = tmp_path / "other.sqlite"
    HistoryStore.open(other).close()
    db = sqlite3.connect(other)
    with db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'version'")
    db.close()
    with pytest.raises(HistoryError, match="history version 99"):
        HistoryStore.open(other)
    with pytest.raises(HistoryError, match="is a directory"):
        HistoryStore.open(tmp_path)


@pytest.mark.parametrize("version, missing", [("1", ("cal_samples", "cpu_samples")), ("2", ("cal_samples",))])
def test_cpu_seconds_and_probe_are_kept_and_an_older_history_gains_them_in_place(tmp_path, version, missing):
    path = tmp_path / "old.sqlite"
    HistoryStore.open(path).close()
    db = sqlite3.connect(path)          # the older schema: points without the later columns
    with db:
        for column in missing:
            db.execute(f"ALTER TABLE points DROP COLUMN {column}")
        db.execute("UPDATE meta SET value = ? WHERE key = 'version'", (version,))
    db.close()
    data = bench({"tok_per_s": 1000.0})
    data["metrics"]["tok_per_s"].update(cpu_samples=[2000.0, 2010.0, 1990.0], cpu_share=0.5,
                                        cal_samples=[230.0, 231.0, 229.0])
    cpu = result_files.bench_from_engine({"metrics": {**data["metrics"], "odd": {"value": 1.0, "cpu_samples": [1.0, -2.0],
                                                                     "cpu_share": 0.0, "cal_samples": [0.0]},
                                             "unpaired": {"value": 1.0, "cpu_samples": [1.0, 2.0],
                                                          "cal_samples": [3.0]}}})
    assert cpu["metrics"]["tok_per_s"]["cpu_share"] == 0.5
    assert not {"cpu_samples", "cpu_share", "cal_samples"} & set(cpu["metrics"]["odd"])
    with HistoryStore.open(path) as store:
        store.index_run(a_run(1, {"h": {"bench": cpu}}))
        (point,) = store.points(metric="tok_per_s")
        assert point.cpu_samples == (2000.0, 2010.0, 1990.0) and point.point().cpu_samples == point.cpu_samples
        assert point.cal_samples == (230.0, 231.0, 229.0) and point.point().cal_samples == point.cal_samples
        (unpaired,) = store.points(metric="unpaired")     # a probe figure per CPU sample, or none
        assert unpaired.cpu_samples == (1.0, 2.0) and unpaired.cal_samples == ()
    assert sqlite3.connect(path).execute("SELECT value FROM meta WHERE key = 'version'").fetchone() == ("3",)


def test_judge_run_finds_a_step_in_the_history_and_does_not_judge_reused_results(store):
    rng = random.Random(1)
    for i in range(12):
        store.index_run(a_run(i, {"h": {"bench": bench({"tok_per_s": 1000.0, "layer_ms": 2.0}, rng=rng)}}))
    slow = a_run(12, {"h": {"bench": bench({"tok_per_s": 840.0, "layer_ms": 2.0}, rng=rng)},
                      "c": {"bench": bench({"tok_per_s": 10.0}), "bench_status": "cached"}})
    store.index_run(slow)
    verdicts = {(p.key.host, p.metric): v for p, v in judge_run(store, slow, lambda metric: 0.10)}
    step = verdicts[("h", "tok_per_s")]
    assert step.status == "regressed" and step.method == "history" and len(step.window) == 10
    assert step.good_commit == "commit011" and step.bad_commit == "commit012"
    assert verdicts[("h", "layer_ms")].status == "same"
    reused = verdicts[("c", "tok_per_s")]
    assert reused.status == "unjudged" and "reused result" in reused.reason


def test_a_night_starved_of_cpu_is_listed_as_contended_not_as_a_regression(store):
    rng = random.Random(3)

    def night(i: int, share: float, cpu_rate: float = 2000.0) -> dict:
        data = bench({"tok_per_s": cpu_rate * share}, rng=rng)
        data["metrics"]["tok_per_s"].update(cpu_samples=[cpu_rate * rng.gauss(1, 0.01) for _ in range(5)], noisy=True)
        return a_run(i, {"h": {"backend": "cpu", "bench": data}})

    for i in range(6):
        store.index_run(night(i, 0.95))
    starved, slower = night(6, 0.4), night(7, 0.95, cpu_rate=1500.0)
    found = judge_run(store, starved, lambda metric: 0.10)
    assert regressions(found) == [] and [c["metric"] for c in contended(found)] == ["tok_per_s"]
    assert contended(found)[0]["ratio"] < 0.5 and abs(contended(found)[0]["cpu_change"]) < 0.05
    found = judge_run(store, slower, lambda metric: 0.10)
    assert [r.metric for r in regressions(found)] == ["tok_per_s"] and contended(found) == []


def test_a_second_night_with_contended_caches_is_listed_with_the_calibration_probe(store):
    rng = random.Random(4)

    def night(i: int, share: float, machine: float) -> dict:
        data = bench({"tok_per_s": 2000.0 * machine * share}, rng=rng)
        moments = [machine * rng.gauss(1, 0.01) for _ in range(5)]     # the CPU seconds move with the probe
        data["metrics"]["tok_per_s"].update(cpu_samples=[2000.0 * m for m in moments],
                                            cal_samples=[230.0 * m * rng.gauss(1, 0.005) for m in moments], noisy=True)
        return a_run(i, {"h": {"backend": "cpu", "bench": data}})

    store.index_run(night(0, 0.95, 1.0))
    found = judge_run(store, night(1, 0.5, 0.7), lambda metric: 0.10)
    (entry,) = contended(found)
    assert regressions(found) == [] and entry["cpu_change"] > 0.25
    assert abs(entry["cal_change"]) < 0.05 and entry["calibration_change"] > 0.25
    assert "relative to the calibration probe" in entry["reason"]


def test_reported_regressions_are_kept_for_the_dashboard(store):
    run = a_run(0, {"h": {"bench": bench({"m": 1.0})}})
    run["regressions"] = [{"host": "h", "metric": "m", "value": 1.0, "baseline": 2.0, "ratio": 0.5}, "junk"]
    store.index_run(run)
    assert store.regressions() == {(run["run_id"], "h", "m"): run["regressions"][0]}


def test_the_history_task_rebuilds_draws_and_lists(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    project = tmp_path / "project"
    (project / "engine_src").mkdir(parents=True)
    data = yaml.safe_load((repo / "hosts.yaml").read_text())
    data["project"]["source"] = str(project / "engine_src")
    data.pop("groups", None)
    data["hosts"] = {"local": {"transport": "local", "remote_dir": ".deploy/local"}}
    inventory = project / "hosts.yaml"
    inventory.write_text(yaml.safe_dump(data))
    rng = random.Random(2)
    for i in range(8):
        run = a_run(i, {"h": {"bench": bench({"tok_per_s": 1000.0 if i < 7 else 700.0}, rng=rng)}})
        (project / "runs" / run["run_id"]).mkdir(parents=True)
        run_store.write_run(project / "runs" / run["run_id"], run)
    (project / "runs" / "20261201-235959-beef").mkdir()
    (project / "runs" / "20261201-235959-beef" / "run.json").write_text("[]")

    def history(*args):
        return subprocess.run([sys.executable, "-m", "invoke", "history", "--inventory", str(inventory), *args],
                              cwd=repo, capture_output=True, text=True, timeout=120)
    proc = history("--rebuild", "--html")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"indexed 8 run(s), 8 point(s) from {project / 'runs'} into {project / 'runs' / 'history.sqlite'}" in proc.stdout
    assert "skipped: " in proc.stdout and "20261201-235959-beef" in proc.stdout
    assert (project / "runs" / "history.html").is_file()
    listing = history()
    assert listing.returncode == 0
    row = next(line for line in listing.stdout.splitlines() if "tok_per_s" in line)
    assert row.split()[0] == "h" and row.split()[-1] == "regressed"
    bad = history("--history", str(tmp_path))
    assert bad.returncode == 2 and "is a directory" in bad.stderr
