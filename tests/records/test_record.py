"""The run record and the run directory: schema, atomic writes, loading, latest, clean."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import stat
from pathlib import Path

import pytest

from orchestrator.records import record as rec
from orchestrator.records import redaction, result_files, run_store
from orchestrator.steps import ORDER
from orchestrator.runner.console import Console


def small_record(run_id: str = "20261129-172233-ab12", status: str = "passed") -> rec.RunRecord:
    steps = {s: rec.StepRecord("passed", 1.0, f"local/{s}.log") for s in reversed(ORDER)}
    steps["build"] = rec.StepRecord("cached", 0.1, "local/build.log", reused_from="20261128-010000-bbbb")
    host = rec.HostRecord(rec.host_status(steps), "local", None, "cpu", "abc", "abc", rec.Fingerprint(cpu="x86_64"), steps,
                          {"tiny_fp32": rec.GoldenRecord("passed", {c: "passed" for c in rec.GOLDEN_CHECKS})},
                          rec.TestsRecord(1, 0, 0, [rec.TestCase("op_rope", "passed", 0.1)]),
                          {"metrics": {"ar_tokens_per_s": {"value": 400.0, "unit": "tokens/s", "better": "higher"}}, "details": {}})
    return rec.RunRecord(run_id, "validate", "2026-11-29T17:22:33Z", "2026-11-29T17:23:00Z", 27.0, status,
                         rec.Source("abc", "2a19bd3", True), {"local": host})


def make_runs(root, names):
    for name in names:
        (root / name).mkdir(parents=True)
        run_store.write_run(root / name, small_record(name))
    return [root / n for n in names]


RUN_IDS = ["20261127-010000-aaaa", "20261128-010000-bbbb", "20261128-230000-cccc", "20261129-010000-dddd",
           "20261129-120000-eeee"]


# --------------------------------------------------------------------------------------------
# The record


def test_record_serialises_to_the_documented_schema():
    data = small_record().to_dict()
    assert list(data)[:4] == ["version", "run_id", "command", "started"]
    assert data["version"] == rec.RUN_VERSION == 1
    host = data["hosts"]["local"]
    assert list(host["steps"]) == list(ORDER)  # pipeline order whatever the insertion order
    assert host["steps"]["build"] == {"status": "cached", "seconds": 0.1, "log": "local/build.log", "message": "", "tail": "",
                                      "reused_from": "20261128-010000-bbbb", "cuda_visible_devices": None,
                                      "inputs": None, "output_cut": None}
    assert set(host) == {"status", "transport", "address", "backend", "deployed_tree_hash", "binary_tree_hash",
                         "fingerprint", "steps", "golden", "tests", "bench", "stress", "gpus", "selected_gpus",
                         "gpu_runs", "build_key", "seconds", "bundles", "job"}
    assert set(host["fingerprint"]) == {"gpu", "gpu_count", "compute_capability", "driver", "nvcc", "arch", "gpus_busy", "cpu"}
    assert host["golden"]["tiny_fp32"]["mismatch"] is None
    assert host["tests"]["cases"][0] == {"name": "op_rope", "status": "passed", "seconds": 0.1, "message": ""}
    assert data["source"] == {"tree_hash": "abc", "git_rev": "2a19bd3", "git_dirty": True}
    assert data["regressions"] == []
    json.dumps(data, allow_nan=False)


def test_host_and_run_status():
    ok = {"build": rec.StepRecord("cached"), "test": rec.StepRecord("passed"), "bench": rec.StepRecord("skipped")}
    assert rec.host_status(ok) == "passed"
    assert rec.host_status({**ok, "test": rec.StepRecord("timeout")}) == "failed"
    passed, failed = rec.HostRecord("passed"), rec.HostRecord("failed")
    assert rec.run_status({"a": passed}) == "passed"
    assert rec.run_status({"a": passed, "b": failed}) == "failed"
    assert rec.run_status({}) == "failed"
    assert rec.run_status({"a": passed}, interrupted=True) == "interrupted"


def test_mismatch_first_divergence_window_and_margin():
    golden = list(range(100, 130))
    assert rec.Mismatch.first("host_ar_vs_golden", golden, list(golden)) is None
    actual = list(golden)
    actual[12] = 7
    m = rec.Mismatch.first("host_ar_vs_golden", golden, actual, [0.01 * i for i in range(30)], context=3)
    assert (m.position, m.window_start, m.margin) == (12, 9, pytest.approx(0.12))
    assert m.expected == [109, 110, 111, 112, 113, 114, 115] and m.actual == [109, 110, 111, 7, 113, 114, 115]
    early = rec.Mismatch.first("c", [1, 2, 3], [9, 2, 3])
    assert (early.position, early.window_start, early.margin) == (0, 0, None)
    short = rec.Mismatch.first("c", [1, 2, 3, 4], [1, 2])
    assert (short.position, short.expected, short.actual) == (2, [1, 2, 3, 4], [1, 2])


def test_engine_test_results_parse_tolerantly():
    tests = result_files.tests_from_engine({"version": 1, "passed": 99, "tests": [
        {"name": "a", "status": "passed", "seconds": 0.5},
        {"name": "b", "status": "failed", "message": "x" * 10_000},
        {"name": "c", "status": "skipped", "seconds": "fast"},
        {"name": "d", "status": "exploded", "seconds": float("nan")},
        "junk", None]})
    assert (tests.passed, tests.failed, tests.skipped) == (1, 2, 1)  # counted from the cases, not trusted
    assert [c.status for c in tests.cases] == ["passed", "failed", "skipped", "failed"]
    assert tests.cases[2].seconds == 0.0 and tests.cases[3].seconds == 0.0
    assert len(tests.cases[1].message) == result_files.MESSAGE_LIMIT
    assert result_files.tests_from_engine("not json") == rec.TestsRecord()


def test_bench_keeps_numeric_metrics_and_the_rest_as_details():
    bench = result_files.bench_from_engine({"version": 1, "backend": "cuda", "repeats": 5, "metrics": {
        "ar_tokens_per_s": {"value": 410.5, "unit": "tokens/s", "better": "higher"},
        "step_ms": {"value": 2, "unit": "ms", "better": "lower"},
        "odd": {"value": "fast"}, "nan": {"value": float("nan")}, "flag": {"value": True}, "junk": 3,
        "huge": {"value": 10**400}}})
    assert bench["metrics"] == {"ar_tokens_per_s": {"value": 410.5, "unit": "tokens/s", "better": "higher"},
                                "step_ms": {"value": 2, "unit": "ms", "better": "lower"}}
    assert bench["details"] == {"backend": "cuda", "repeats": 5}
    assert result_files.bench_from_engine(None) == {"metrics": {}, "details": {}}


def test_bench_metrics_keep_their_samples_and_spread_bounded_and_typed():
    bench = result_files.bench_from_engine({"metrics": {
        "tok": {"value": 10.0, "unit": "tokens/s", "better": "higher", "samples": [9.5, 10.0, "x", None, float("inf"), 10.5],
                "n": 3, "median": 10.0, "mad": 0.5, "noisy": True},
        "odd": {"value": 1.0, "samples": "1,2", "n": True, "mad": -1, "median": "ten", "noisy": "yes"},
        "many": {"value": 1.0, "samples": [1.0] * 5000, "n": 10**12}}})
    assert bench["metrics"]["tok"] == {"value": 10.0, "unit": "tokens/s", "better": "higher", "samples": [9.5, 10.0, 10.5],
                                       "n": 3, "median": 10.0, "mad": 0.5, "noisy": True}
    assert bench["metrics"]["odd"] == {"value": 1.0, "unit": "", "better": "higher"}
    assert len(bench["metrics"]["many"]["samples"]) == result_files.SAMPLES_LIMIT and "n" not in bench["metrics"]["many"]


def test_bench_details_too_deep_or_too_large_are_dropped():
    deep = {}
    for _ in range(900):
        deep = {"d": deep}
    assert result_files.bench_from_engine({"tree": deep})["details"] == {"omitted": "nested deeper than 16 levels"}
    big = result_files.bench_from_engine({"samples": list(range(100_000))})["details"]
    assert big["omitted"].endswith("bytes, more than 256000")
    assert result_files.bench_from_engine({"samples": [1.5] * 10})["details"] == {"samples": [1.5] * 10}


# --------------------------------------------------------------------------------------------
# Writing and loading


def test_write_and_load_round_trip_atomically(tmp_path):
    path = run_store.write_run(tmp_path, small_record())
    assert path == tmp_path / "run.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # private to the user (docs/security.md)
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left behind
    assert run_store.load_run(tmp_path) == json.loads(json.dumps(small_record().to_dict()))
    assert run_store.load_run(path)["run_id"] == "20261129-172233-ab12"


def test_write_run_redacts_every_string_and_key(tmp_path):
    data = small_record().to_dict()
    data["hosts"]["local"]["steps"]["test"]["tail"] = "login with s3cr3t-t0ken-xyz ok"
    data["hosts"]["local"]["bench"]["details"] = {"s3cr3t-t0ken-xyz": ["nested s3cr3t-t0ken-xyz"]}
    run_store.write_run(tmp_path, data, secrets=["s3cr3t-t0ken-xyz", ""])
    text = (tmp_path / "run.json").read_text()
    assert "s3cr3t" not in text
    loaded = run_store.load_run(tmp_path)
    assert loaded["hosts"]["local"]["steps"]["test"]["tail"] == "login with [REDACTED] ok"
    assert loaded["hosts"]["local"]["bench"]["details"] == {"[REDACTED]": ["nested [REDACTED]"]}


@pytest.mark.parametrize("content, problem", [
    (None, "no run record here"),
    ("{not json", "corrupt run record"),
    ("[1, 2]", "not a run record"),
    ('{"version": 2, "run_id": "x", "hosts": {}}', "unknown run record version 2"),
    ('{"version": 1, "hosts": {}}', "no 'run_id' or 'hosts'"),
    (b"\xff\xfe\x00", "cannot read"),
])
def test_load_run_names_the_file_and_the_problem(tmp_path, content, problem):
    if isinstance(content, bytes):
        (tmp_path / "run.json").write_bytes(content)
    elif content is not None:
        (tmp_path / "run.json").write_text(content)
    with pytest.raises(run_store.RunRecordError) as err:
        run_store.load_run(tmp_path)
    assert problem in str(err.value) and str(tmp_path / "run.json") in str(err.value)
    assert err.value.exit_code == 2


# --------------------------------------------------------------------------------------------
# The run directory


def test_run_ids_are_sortable_and_unique(tmp_path):
    run_id = run_store.new_run_id()
    assert run_store.RUN_ID_RE.match(run_id)
    dirs = [run_store.create_run_dir(tmp_path) for _ in range(20)]
    assert len({d.run_id for d in dirs}) == 20
    assert all(d.path.parent == tmp_path and d.path.name == d.run_id and d.path.is_dir() for d in dirs)


def test_log_paths_and_pulled_files_stay_inside_the_run_dir(tmp_path):
    run = run_store.create_run_dir(tmp_path / "runs")
    assert run.log_ref("ct200", "build") == "ct200/build.log"
    assert run.log_path("ct200", "build") == run.path / "ct200" / "build.log"
    assert (run.path / "ct200").is_dir()
    assert run.host_file("ct200", "bench.json") == run.path / "ct200" / "bench.json"
    for bad in ("..", ".", "../x", "a/b", "-rf", "", "x\ny", "/etc"):
        with pytest.raises(ValueError):
            run.log_path(bad, "build")
        with pytest.raises(ValueError):
            run.host_file("ct200", bad)
    os.symlink("/etc/passwd", run.path / "ct200" / "test_results.json")
    with pytest.raises(ValueError, match="symlink"):
        run.host_file("ct200", "test_results.json")


def test_read_tail_reads_only_the_end_of_a_huge_log(tmp_path):
    log = tmp_path / "build.log"
    with open(log, "wb") as f:
        f.write(b"x" * 50_000_000 + b"\n")
        f.write(b"".join(b"line %d\n" % i for i in range(100)) + b"bad \xff byte")
    tail = run_store.read_tail(log, lines=3)
    assert tail == "line 98\nline 99\nbad \ufffd byte"
    assert len(run_store.read_tail(log, lines=1000, max_bytes=1000)) <= 1000
    assert run_store.read_tail(tmp_path / "missing.log") == ""


def test_report_dir_must_be_new_empty_or_an_earlier_run(tmp_path):
    fresh = run_store.create_run_dir(tmp_path / "runs", report_dir=tmp_path / "new" / "dir")
    assert fresh.path == tmp_path / "new" / "dir" and fresh.path.is_dir() and run_store.RUN_ID_RE.match(fresh.run_id)
    (tmp_path / "empty").mkdir()
    assert run_store.create_run_dir(tmp_path / "runs", report_dir=tmp_path / "empty").path == tmp_path / "empty"
    run_store.write_run(tmp_path / "empty", small_record())
    assert run_store.create_run_dir(tmp_path / "runs", report_dir=tmp_path / "empty").path == tmp_path / "empty"
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".bashrc").write_text("keep me")
    with pytest.raises(run_store.RunRecordError, match="not empty"):
        run_store.create_run_dir(tmp_path / "runs", report_dir=tmp_path / "home")
    os.symlink(tmp_path / "empty", tmp_path / "link")
    with pytest.raises(run_store.RunRecordError, match="not a plain directory"):
        run_store.create_run_dir(tmp_path / "runs", report_dir=tmp_path / "link")
    assert not (tmp_path / "runs").exists()  # a report dir leaves runs/ alone


def test_a_report_dir_named_like_a_run_id_under_runs_is_a_run_there(tmp_path, monkeypatch):
    """What the nightly workflow does: an absolute --report-dir runs/<run-id> it names itself is
    found as the last good run and cleaned like the runs the orchestrator names; a relative report
    dir is made absolute (the steps join it to other folders)."""
    root = tmp_path / "runs"
    run = run_store.create_run_dir(root, report_dir=root / "20261201-021700-3f2a")
    assert run.run_id == "20261201-021700-3f2a" and run.path == root / "20261201-021700-3f2a"
    nightly = small_record(run.run_id)
    nightly.command = "nightly"
    run_store.write_run(run, nightly)
    assert run_store.last_good_run(root)["run_id"] == "20261201-021700-3f2a"
    assert run_store.clean(root, keep=0) == []                 # the newest passing nightly is never cleaned
    make_runs(root, ["20261202-021700-4b3c"])             # a newer passing nightly takes its place
    newer = run_store.load_run(root / "20261202-021700-4b3c")
    newer["command"] = "nightly"
    run_store.write_run(root / "20261202-021700-4b3c", newer)
    assert run_store.clean(root, keep=0) == [run.path]
    monkeypatch.chdir(tmp_path)
    relative = run_store.create_run_dir(root, report_dir="reports/nightly-7")
    assert relative.path == tmp_path / "reports" / "nightly-7" and relative.path.is_absolute()
    assert run_store.RUN_ID_RE.match(relative.run_id)


def test_latest_points_at_the_newest_run_relatively(tmp_path):
    root = tmp_path / "runs"
    first, second = make_runs(root, RUN_IDS[:2])
    link = run_store.update_latest(root, first)
    assert os.readlink(link) == first.name
    run_store.update_latest(root, second)
    assert os.readlink(link) == second.name and link.resolve() == second.resolve()
    assert sorted(p.name for p in root.iterdir()) == [*RUN_IDS[:2], "latest"]  # no temporary link left
    elsewhere = tmp_path / "report"
    elsewhere.mkdir()
    run_store.update_latest(root, elsewhere)
    assert link.resolve() == elsewhere.resolve()


def test_resolve_run_by_latest_id_or_path(tmp_path):
    root = tmp_path / "runs"
    runs = make_runs(root, RUN_IDS[:2])
    with pytest.raises(run_store.RunRecordError, match="no latest run"):
        run_store.resolve_run(root)
    run_store.update_latest(root, runs[1])
    assert run_store.resolve_run(root) == runs[1].resolve()
    assert run_store.resolve_run(root, "latest") == runs[1].resolve()
    assert run_store.resolve_run(root, RUN_IDS[0]) == runs[0]
    assert run_store.resolve_run(root, str(runs[0] / "run.json")) == runs[0]
    assert run_store.resolve_run(tmp_path / "elsewhere", runs[1]) == runs[1]
    with pytest.raises(run_store.RunRecordError, match="no such run"):
        run_store.resolve_run(root, "20200101-000000-0000")


def test_last_good_run_skips_failures_other_commands_and_junk(tmp_path):
    root = tmp_path / "runs"
    make_runs(root, RUN_IDS)
    for name, command, status in [(RUN_IDS[1], "nightly", "passed"), (RUN_IDS[2], "nightly", "passed"),
                                  (RUN_IDS[3], "nightly", "failed"), (RUN_IDS[4], "validate", "passed")]:
        data = run_store.load_run(root / name)
        data.update(command=command, status=status)
        run_store.write_run(root / name, data)
    (root / "20261129-130000-ffff").mkdir()
    (root / "20261129-130000-ffff" / "run.json").write_text("{corrupt")
    assert run_store.last_good_run(root)["run_id"] == RUN_IDS[2]
    assert run_store.last_good_run(root, exclude=RUN_IDS[2])["run_id"] == RUN_IDS[1]
    assert run_store.last_good_run(root, command="validate")["run_id"] == RUN_IDS[4]
    assert run_store.last_good_run(root, command="deploy") is None
    assert run_store.last_good_run(tmp_path / "none") is None


# --------------------------------------------------------------------------------------------
# clean


def test_clean_keeps_the_newest_runs_and_repoints_latest(tmp_path):
    root = tmp_path / "runs"
    runs = make_runs(root, RUN_IDS)
    run_store.update_latest(root, runs[1])  # latest at a run that is going away
    removed = run_store.clean(root, keep=2)
    assert removed == runs[:3]
    assert [p.name for p in run_store.list_runs(root)] == RUN_IDS[3:]
    assert os.readlink(root / "latest") == RUN_IDS[4]
    assert run_store.clean(root, keep=2) == []


def test_clean_never_touches_anything_outside_runs_nor_follows_links(tmp_path):
    root = tmp_path / "runs"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.txt").write_text("keep")
    fake = tmp_path / "20200101-000000-0000"  # looks like a run, lives outside runs/
    fake.mkdir()
    (fake / "keep.txt").write_text("keep")
    runs = make_runs(root, RUN_IDS[:3])
    os.symlink(outside, runs[0] / "escape")  # a link inside a doomed run
    os.symlink(outside / "data.txt", runs[0] / "escape.txt")
    os.symlink(fake, root / "20190101-000000-0000")  # a run-named link to outside, sorts oldest
    (root / "notes").mkdir()  # not a run
    (root / "README").write_text("keep")
    run_store.update_latest(root, runs[2])
    removed = run_store.clean(root, keep=1)
    assert removed == runs[:2]
    assert (outside / "data.txt").read_text() == "keep" and (fake / "keep.txt").read_text() == "keep"
    assert (root / "20190101-000000-0000").is_symlink() and (root / "notes").is_dir() and (root / "README").exists()
    assert os.readlink(root / "latest") == RUN_IDS[2]


def test_clean_keep_zero_removes_every_run_and_latest(tmp_path):
    root = tmp_path / "runs"
    runs = make_runs(root, RUN_IDS[:2])
    run_store.update_latest(root, runs[1])
    assert run_store.clean(root, keep=0) == runs
    assert list(root.iterdir()) == []
    with pytest.raises(ValueError):
        run_store.clean(root, keep=-1)
    assert run_store.clean(tmp_path / "missing", keep=3) == []


def test_clean_leaves_a_latest_pointing_outside_runs(tmp_path):
    root = tmp_path / "runs"
    make_runs(root, RUN_IDS[:2])
    report_dir = tmp_path / "ci-report"
    report_dir.mkdir()
    run_store.update_latest(root, report_dir)
    run_store.clean(root, keep=0)
    assert (root / "latest").resolve() == report_dir.resolve() and report_dir.is_dir()


def write_command_runs(root, runs):
    """Runs of given (run id, command, status)."""
    for run_id, command, status in runs:
        (root / run_id).mkdir(parents=True)
        record = small_record(run_id, status)
        record.command = command
        run_store.write_run(root / run_id, record)


def test_clean_never_removes_the_newest_passing_nightly(tmp_path):
    root = tmp_path / "runs"
    write_command_runs(root, [(RUN_IDS[0], "nightly", "passed"), (RUN_IDS[1], "nightly", "failed"),
                              (RUN_IDS[2], "deploy", "passed"), (RUN_IDS[3], "doctor", "passed")])
    removed = run_store.clean(root, keep=1)
    assert [p.name for p in removed] == RUN_IDS[1:3]
    assert [p.name for p in run_store.list_runs(root)] == [RUN_IDS[0], RUN_IDS[3]]       # the baseline stays
    assert [p.name for p in run_store.clean(root, keep=0)] == [RUN_IDS[3]]
    assert [p.name for p in run_store.list_runs(root)] == [RUN_IDS[0]]


def test_baselines_and_comparisons_default_to_the_newest_validate_or_nightly(tmp_path):
    root = tmp_path / "runs"
    write_command_runs(root, [(RUN_IDS[0], "nightly", "passed"), (RUN_IDS[1], "validate", "failed"),
                              (RUN_IDS[2], "deploy", "passed"), (RUN_IDS[3], "doctor", "passed")])
    assert run_store.newest_run(root).name == RUN_IDS[1]             # doctor and deploy runs measure nothing
    assert run_store.newest_run(root, passed=True).name == RUN_IDS[0]
    assert run_store.newest_run(root, ("deploy",)).name == RUN_IDS[2]
    assert run_store.newest_run(tmp_path / "none") is None
    from orchestrator import cli, inventory
    inv = inventory.load(Path(__file__).resolve().parents[2] / "hosts.yaml")
    inv = dataclasses.replace(inv, project=dataclasses.replace(inv.project, root=tmp_path))
    out = io.StringIO()
    assert cli.baseline(inv, Console(out), str(tmp_path / "baseline.json")) == 0
    assert f"from {RUN_IDS[1]}" in out.getvalue()


def test_redact_takes_the_longest_secret_first_and_any_value():
    """A secret inside a longer one is replaced after it (else the longer one's rest would leak);
    a non-string value is redacted as its text."""
    assert redaction.redact("x abcdefgh1xyz y", ["bcdefgh1", "abcdefgh1xyz"]) == "x [REDACTED] y"
    assert redaction.redact(12345678, ["2345678"]) == "1[REDACTED]"
    assert redaction.redact(None, ["secret-value"]) == "None"


def test_a_divergence_past_the_margins_has_no_margin():
    mismatch = rec.Mismatch.first("host_ar_vs_golden", [1, 2, 3], [1, 2, 3, 4], [0.5, 1.5, 2.5])
    assert (mismatch.position, mismatch.margin, mismatch.expected, mismatch.actual) == (3, None, [1, 2, 3], [1, 2, 3, 4])


@pytest.mark.parametrize("text, want", [
    ("BCDEFGHIJ rest", "[REDACTED] rest"),            # the longest cut-off start: all but one character
    ("CDEFGHIJ rest", "[REDACTED] rest"),
    ("EFGHIJ rest", "[REDACTED] rest"),               # MIN_FRAGMENT characters: still a piece of it
    ("FGHIJ rest", "FGHIJ rest"),                     # fewer: left alone
    ("Jolly rest", "Jolly rest"),
    ("head ABCDEFGHI", "head [REDACTED]"),
    ("head ABCDEFGH", "head [REDACTED]"),
    ("head ABCDEF", "head [REDACTED]"),
    ("head ABCDE", "head ABCDE"),
    ("CDEFGHIJ mid ABCDEFG", "[REDACTED] mid [REDACTED]"),
])
def test_redact_cuts_off_pieces_of_a_secret_at_either_edge(text, want):
    assert redaction.redact(text, ["ABCDEFGHIJ"]) == want


def test_redact_tree_leaves_keys_that_are_not_strings():
    assert redaction.redact_tree({("k", 1): "a ABCDEFGHIJ", 2: ["ABCDEFGHIJ"]}, ["ABCDEFGHIJ"]) == \
        {("k", 1): "a [REDACTED]", 2: ["[REDACTED]"]}
