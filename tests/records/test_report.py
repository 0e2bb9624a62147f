"""Reports rendered from a realistic run record: Markdown, HTML (checked in headless Chromium),
JUnit XML, regressions against a baseline, comparisons, secrets and hostile contents."""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from orchestrator.records import record as rec
from orchestrator.records import redaction, regression, report, result_files, run_store, run_view
from orchestrator.steps import ORDER as STEPS

from browser import chromium

SECRET = "hunter2-passphrase-9f8e7d"
GOLDEN = [17, 4, 88, 23, 5, 61, 61, 2, 40, 9, 33, 12, 7, 90, 14, 3, 55, 71, 8, 26, 44, 19, 63, 1]
MARGINS = [round(2.5 - 0.1 * i, 3) for i in range(len(GOLDEN))]
BUNDLES = ("tiny_fp32", "tiny_int4", "tiny2_fp32", "tiny2_int4")
TEST_NAMES = ("op_gemv_fp32", "op_gemv_int4", "op_rmsnorm", "op_rope", "op_mla_absorb", "model_tiny_ar", "model_tiny_ddtree")


# --------------------------------------------------------------------------------------------
# A fleet run: one host of each kind of outcome


def steps(host: str, outcome: dict[str, str], seconds: float = 1.5) -> dict[str, rec.StepRecord]:
    """Steps in pipeline order: those named get their status, the rest after a failure are skipped."""
    result, failed = {}, False
    for step in STEPS:
        status = "skipped" if failed else outcome.get(step, "passed")
        result[step] = rec.StepRecord(status, 0.0 if status == "skipped" else seconds, f"{host}/{step}.log")
        failed = failed or status in rec.FAILED_STEP_STATUSES
    return result


def golden_all_pass() -> dict[str, rec.GoldenRecord]:
    checks = {c: "passed" for c in rec.GOLDEN_CHECKS}
    return {b: rec.GoldenRecord("passed", dict(checks)) for b in BUNDLES}


def engine_tests(failing: str | None = None) -> rec.TestsRecord:
    data = {"version": 1, "backend": "cpu", "tests": [
        {"name": n, "status": "failed" if n == failing else "passed", "seconds": 0.25,
         "message": "max abs err 3.1e-02 > tol 1e-03 at [4][17]" if n == failing else ""} for n in TEST_NAMES]
        + [{"name": "op_gemv_cuda_graph", "status": "skipped", "seconds": 0, "message": "no GPU"}]}
    return result_files.tests_from_engine(data)


def bench(scale: float = 1.0, gpu: bool = False) -> dict:
    metrics = {
        "ar_tokens_per_s": {"value": 410.0 * scale, "unit": "tokens/s", "better": "higher"},
        "ddtree_tokens_per_s": {"value": 1180.0 * scale, "unit": "tokens/s", "better": "higher"},
        "moe_fp32_tokens_per_s": {"value": 520.0 * scale, "unit": "tokens/s", "better": "higher"},
        "moe_int4_tokens_per_s": {"value": 905.0 * scale, "unit": "tokens/s", "better": "higher"},
        "decode_step_ms": {"value": 2.44 / scale, "unit": "ms", "better": "lower"},
    }
    if gpu:
        metrics["gemv_fp32_bandwidth"] = {"value": 1380.0 * scale, "unit": "GB/s", "better": "higher"}
        metrics["gemv_int4_bandwidth"] = {"value": 1495.0 * scale, "unit": "GB/s", "better": "higher"}
    return result_files.bench_from_engine({"version": 1, "backend": "cuda" if gpu else "cpu", "metrics": metrics,
                                  "repeats": 5, "statistic": "median", "host": {"cpu": "x86_64"}})


def cuda_fingerprint(gpu: str, cc: str, arch: str) -> rec.Fingerprint:
    return rec.Fingerprint(gpu=gpu, gpu_count=8, compute_capability=cc, driver="580.65.06",
                           nvcc="13.0.48", arch=arch, gpus_busy=False, cpu="AMD EPYC 9555 64-Core")


def fleet_record() -> rec.RunRecord:
    tree = "3fa2c19b7d0e4a6f8b21c5d9e0f7a1b2c3d4e5f60718293a4b5c6d7e8f901234"
    cpu = rec.Fingerprint(arch="none", cpu="Intel Xeon Gold 6430")
    hosts = {}

    local_steps = steps("local", {"build": "cached", "bundles": "cached"})
    hosts["local"] = rec.HostRecord("passed", "local", None, "cpu", tree, tree, cpu, local_steps,
                                    golden_all_pass(), engine_tests(), bench(1.0))

    hosts["ct200"] = rec.HostRecord("passed", "ssh", "ct200", "cuda", tree, tree,
                                    cuda_fingerprint("NVIDIA RTX PRO 6000 Blackwell", "12.0", "sm_120"),
                                    steps("ct200", {}, 4.0), golden_all_pass(), engine_tests(), bench(9.0, gpu=True))

    golden = golden_all_pass()
    actual = list(GOLDEN)
    actual[17] = 72
    mismatch = rec.Mismatch.first("host_ddtree_vs_golden", GOLDEN, actual, MARGINS)
    golden["tiny_int4"] = rec.GoldenRecord("failed", {**golden["tiny_int4"].checks, "host_ddtree_vs_golden": "failed"}, mismatch)
    ct201_steps = steps("ct201", {"golden": "failed"}, 3.0)
    ct201_steps["golden"].message = "tiny_int4: host DDTree output diverges from the golden tokens at position 17"
    hosts["ct201"] = rec.HostRecord("failed", "ssh", "ct201", "cuda", tree, tree,
                                    cuda_fingerprint("NVIDIA H100 80GB HBM3", "9.0", "sm_90"), ct201_steps, golden)

    ct202_steps = steps("ct202", {"build": "failed"}, 12.25)
    ct202_steps["build"].message = "build failed: bash scripts/build.sh exited with 2"
    ct202_steps["build"].tail = ("nvcc -O3 -arch=sm_120 -c src/cuda/gemv_int4.cu\n"
                                 "src/cuda/gemv_int4.cu(88): error: identifier \"__hfma2x\" is undefined\n"
                                 f"export KD_TOKEN={SECRET}\n1 error detected in the compilation of \"src/cuda/gemv_int4.cu\".\n"
                                 "make: *** [build/gemv_int4.o] Error 2")
    hosts["ct202"] = rec.HostRecord("failed", "ssh", "ct202", None, tree, None,
                                    cuda_fingerprint("NVIDIA RTX PRO 6000 Blackwell", "12.0", "sm_120"), ct202_steps)

    ct203_steps = steps("ct203", {"test": "failed"}, 2.0)
    ct203_steps["test"].message = "1 of 8 engine tests failed"
    ct203_steps["test"].tail = "op_gemv_int4 ... FAILED (max abs err 3.1e-02 > tol 1e-03)\n1 TEST FAILED"
    hosts["ct203"] = rec.HostRecord("failed", "ssh", "ct203", "cpu", tree, tree, cpu, ct203_steps,
                                    golden_all_pass(), engine_tests(failing="op_gemv_int4"))

    ct204_steps = steps("ct204", {"bench": "timeout"}, 2.0)
    ct204_steps["bench"].seconds = 900.0
    ct204_steps["bench"].message = "bench timed out after 900 s; the remote process group was killed"
    ct204_steps["bench"].tail = "bench: ar_tokens_per_s repeat 3/5 ..."
    hosts["ct204"] = rec.HostRecord("failed", "ssh", "ct204", "cpu", tree, tree, cpu, ct204_steps,
                                    golden_all_pass(), engine_tests())

    return rec.RunRecord("20261129-172233-ab12", "nightly", "2026-11-29T17:22:33Z", "2026-11-29T17:41:02Z", 1109.0,
                         rec.run_status(hosts), rec.Source(tree, "2a19bd3f00", False), hosts)


@pytest.fixture
def run() -> dict:
    return json.loads(json.dumps(fleet_record().to_dict()))


@pytest.fixture
def baseline(run) -> dict:
    """The local and ct200 hosts' benchmarks of an earlier night, slightly different."""
    older = copy.deepcopy(run)
    for host in ("local", "ct200"):
        for metric in older["hosts"][host]["bench"]["metrics"].values():
            metric["value"] *= 1.03 if metric["better"] == "higher" else 0.97
    return regression.make_baseline(older)


# --------------------------------------------------------------------------------------------
# Markdown


def test_a_passed_bundle_with_a_skipped_check_says_why_in_both_reports(run):
    golden = run["hosts"]["local"]["golden"]["tiny_fp32"]
    golden["checks"]["local_vs_expected"] = "skipped"
    golden["detail"] = "local_vs_expected: not regenerated here (a streamed bundle: its golden tokens are the committed ones)"
    md, page = report.render_markdown(run), report.render_html(run)
    assert "✓ pass (local_vs_expected: not regenerated here (a streamed bundle: its golden tokens are the committed ones))" in md
    assert '✓ pass<div class="detail">local_vs_expected: not regenerated here' in page


def test_markdown_names_hosts_statuses_mismatch_and_failures(run):
    md = report.render_markdown(run)
    assert md.startswith("# kdtree nightly 20261129-172233-ab12: FAILED")
    for host in ("local", "ct200", "ct201", "ct202", "ct203", "ct204"):
        assert f"| **{host}** |" in md
    assert "✗ host_ddtree_vs_golden @ 17" in md
    assert "diverges at position 17" in md
    assert "Reference margin there (top-1 − top-2 logit): **0.800**" in md
    assert "| actual | 90 | 14 | 3 | 55 | **72** | 8 | 26 | 44 | 19 |" in md
    assert "### ct202 · build: failed after 12.2 s" in md
    assert 'identifier "__hfma2x" is undefined' in md
    assert "### ct204 · bench: timeout after 15 min 0 s" in md
    assert "`op_gemv_int4` failed" in md
    assert "↺ cached" in md
    assert "| `gemv_int4_bandwidth` | GB/s | higher | — | 13,455 |" in md


def test_markdown_tables_are_well_formed(run):
    """Every table row of a table has the same number of cells as its header."""
    lines = report.render_markdown(run).splitlines()
    tables, current = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    assert len(tables) >= 6
    for table in tables:
        widths = {line.replace("\\|", "").count("|") for line in table}
        assert len(widths) == 1, table


# --------------------------------------------------------------------------------------------
# JUnit


def test_junit_has_a_case_per_host_step_and_engine_test(run):
    root = ET.fromstring(report.render_junit(run))
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert list(suites) == ["local", "ct200", "ct201", "ct202", "ct203", "ct204"]
    engine_cases = {"local": 8, "ct200": 8, "ct201": 0, "ct202": 0, "ct203": 8, "ct204": 8}
    for host, suite in suites.items():
        cases = suite.findall("testcase")
        assert {c.get("classname") for c in cases} == {host}
        assert len(cases) == len(STEPS) + engine_cases[host]
        assert int(suite.get("tests")) == len(cases)
    assert int(root.get("tests")) == 6 * len(STEPS) + 32
    failures = {(c.get("classname"), c.get("name")): c.find("failure") for c in root.iter("testcase")
                if c.find("failure") is not None}
    assert sorted(failures) == [("ct201", "step.golden"), ("ct202", "step.build"), ("ct203", "step.test"),
                                ("ct203", "test.op_gemv_int4"), ("ct204", "step.bench")]
    build = failures[("ct202", "step.build")]
    assert build.get("message") == "build failed: bash scripts/build.sh exited with 2"
    assert "__hfma2x" in build.text and SECRET in build.text  # no secrets passed: nothing to redact
    assert failures[("ct204", "step.bench")].get("type") == "timeout"
    golden = failures[("ct201", "step.golden")].text
    assert "tiny_int4: host_ddtree_vs_golden diverges at position 17 (reference margin 0.800)" in golden
    assert "  expected:     90     14      3     55     71" in golden
    assert "  actual:       90     14      3     55     72" in golden
    assert int(root.get("failures")) == 5
    assert int(root.get("skipped")) == 4 * 1 + 3 + 5 + 2 + 1  # engine skips + steps after each failure (golden, build, test, bench)


def test_junit_escapes_what_xml_cannot_hold(run):
    run["hosts"]["ct202"]["steps"]["build"]["tail"] = "<x> & \"q\" ]]> \x1b[31mred\x1b[0m \x00\x07 \ud800 end"
    xml = report.render_junit(run)
    root = ET.fromstring(xml)
    failure = next(c.find("failure") for c in root.iter("testcase") if c.get("name") == "step.build" and c.find("failure") is not None)
    assert failure.text.endswith('<x> & "q" ]]> \\x1b[31mred\\x1b[0m \\x00\\x07 \ufffd end')


# --------------------------------------------------------------------------------------------
# Rendering a run directory


def test_render_run_writes_all_reports(tmp_path, run):
    run_store.write_run(tmp_path, run)
    paths = report.render_run(tmp_path)
    assert {p.name for p in paths.values()} == {"report.md", "report.html", "junit.xml"}
    assert all(p.parent == tmp_path and p.stat().st_size > 1000 for p in paths.values())
    assert not list(tmp_path.glob(".*.tmp"))


def test_render_run_views_the_record_once_for_the_three_reports(tmp_path, run, monkeypatch):
    """The view (every string of the record bounded, escaped and redacted) is made once and read by
    the three renderers, each of which gives what it gives alone."""
    run_store.write_run(tmp_path, run)
    made = []
    # each view stamps the second it was made: one fixed second, so renders a second apart compare equal
    monkeypatch.setattr(run_view, "utc_now", lambda: "2026-12-06T12:00:00Z")
    monkeypatch.setattr(report, "view", lambda *args: made.append(1) or run_view.view(*args))
    paths = report.render_run(tmp_path, secrets=[SECRET])
    assert len(made) == 1
    loaded = run_store.load_run(tmp_path)
    for kind, render in (("md", report.render_markdown), ("html", report.render_html), ("junit", report.render_junit)):
        assert paths[kind].read_text() == render(loaded, [SECRET]), kind


def test_render_run_without_record_says_so(tmp_path):
    with pytest.raises(run_store.RunRecordError, match="no run record here"):
        report.render_run(tmp_path)


# --------------------------------------------------------------------------------------------
# Secrets and hostile contents


def test_secrets_never_reach_any_report(tmp_path, run):
    run["hosts"]["ct203"]["steps"]["test"]["message"] = f"token {SECRET} rejected"
    run["hosts"]["ct203"]["tests"]["cases"][1]["message"] = f"env KD_TOKEN={SECRET}"
    run["hosts"]["ct200"]["bench"]["details"] = {"env": {"TOKEN": SECRET}}
    run["hosts"]["ct204"]["steps"]["bench"]["tail"] = SECRET[7:] + "\nlast line"  # a tail cut mid-secret
    run_store.write_run(tmp_path, run, secrets=[SECRET])
    paths = report.render_run(tmp_path, secrets=[SECRET])
    for path in [tmp_path / "run.json", *paths.values()]:
        body = path.read_text()
        assert SECRET not in body and SECRET[7:] not in body, path.name
    assert "[REDACTED]" in paths["md"].read_text()


def test_each_renderer_redacts_on_its_own(tmp_path, run):
    """The renderers redact without relying on write_run: a run.json written without the secrets
    (an older record, another caller) still gives reports without them, in every format."""
    run["hosts"]["ct203"]["steps"]["test"]["message"] = f"token {SECRET} rejected"
    run["hosts"]["ct204"]["steps"]["bench"]["tail"] = SECRET[7:] + "\nlast line"
    for render in (report.render_markdown, report.render_html, report.render_junit):
        body = render(run, [SECRET])
        assert SECRET not in body and SECRET[7:] not in body and "REDACTED" in body, render.__name__
    run_store.write_run(tmp_path, run)
    for path in report.render_run(tmp_path, secrets=[SECRET]).values():
        assert SECRET not in path.read_text(), path.name


def test_redact_replaces_whole_and_cut_off_secrets():
    assert redaction.redact("a hunter2-passphrase b", ["hunter2-passphrase"]) == "a [REDACTED] b"
    assert redaction.redact("passphrase-9f8e7d\nok", [SECRET]) == "[REDACTED]\nok"
    assert redaction.redact("ok\nexport X=hunter2-pass", [SECRET]) == "ok\nexport X=[REDACTED]"
    assert redaction.redact("nothing here", [SECRET, ""]) == "nothing here"


def test_hostile_contents_render_escaped_bounded_and_without_crashing(run):
    huge = "A" * 5_000_000
    ct203 = run["hosts"]["ct203"]
    ct203["steps"]["test"]["tail"] = huge + "<script>alert(1)</script>"
    ct203["steps"]["test"]["message"] = "<img src=x onerror=alert(1)>"
    ct203["steps"]["test"]["seconds"] = "soon"
    ct203["tests"]["cases"].extend([None, 7, {"name": ["odd"], "status": {"x": 1}, "seconds": float("inf")}])
    ct203["tests"]["cases"].extend({"name": f"gen_{i}", "status": "failed"} for i in range(5000))
    ct203["fingerprint"] = "not a dict"
    run["hosts"]["ct200"]["bench"]["metrics"]["evil</text><script>"] = {"value": "NaN", "unit": {"u": 1}}
    run["hosts"]["ct200"]["bench"]["metrics"]["neg"] = {"value": -5, "unit": "x", "better": "sideways"}
    run["hosts"]["ct200"]["bench"]["metrics"]["huge"] = {"value": 10**400, "unit": "x"}
    deep = []
    for _ in range(100_000):
        deep = [deep]
    run["hosts"]["ct200"]["steps"]["bench"]["message"] = deep
    run["hosts"]["ct201"]["golden"]["tiny_int4"]["mismatch"]["expected"] = "not a list"
    run["hosts"]["ct204"]["steps"]["bench"] = ["odd"]
    run["hosts"]["weird"] = None
    run["regressions"] = [{"host": 3, "metric": None, "ratio": "x"}, "junk"]
    html = report.render_html(run)
    md = report.render_markdown(run)
    xml = report.render_junit(run)
    ET.fromstring(xml)
    assert len(html) < 1_500_000 and len(md) < 1_000_000 and len(xml) < 3_000_000
    assert "<script>" not in html and "<img src=x" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "characters cut]" in html
    assert "[unprintable]" in html
    assert "and 4802 more failing tests" in html  # 1 + the odd dict + 5000 failing, 200 listed


def test_text_keeps_the_end_of_a_tail_and_the_start_of_a_message():
    assert run_view.text("x" * 50 + "END", 10, keep_end=True).endswith("xxxxxxxEND")
    assert run_view.text("START" + "x" * 50, 10).startswith("STARTxxxxx [")


# --------------------------------------------------------------------------------------------
# Regressions and baselines


def test_noise_within_threshold_is_no_regression(run, baseline):
    """The baseline is 3 % better everywhere; the default 10 % tolerance absorbs it."""
    assert regression.find_regressions(run, baseline) == []
    assert regression.find_regressions(run, baseline, {"*": 0.05}) == []


def test_a_real_drop_is_a_regression_in_both_directions(run, baseline):
    metrics = run["hosts"]["ct200"]["bench"]["metrics"]
    metrics["ddtree_tokens_per_s"]["value"] *= 0.70
    metrics["decode_step_ms"]["value"] *= 1.30
    metrics["gemv_int4_bandwidth"]["value"] *= 1.50  # better, never a regression
    found = regression.find_regressions(run, baseline, {"decode_*": 0.2})
    assert [(r.host, r.metric) for r in found] == [("ct200", "ddtree_tokens_per_s"), ("ct200", "decode_step_ms")]
    ddtree, step = found
    assert ddtree.ratio == pytest.approx(0.70 / 1.03, abs=1e-4) and ddtree.threshold == 0.10
    assert ddtree.baseline == pytest.approx(1180.0 * 9 * 1.03) and ddtree.better == "higher"
    assert step.threshold == 0.2 and step.better == "lower" and step.unit == "ms"


def test_thresholds_tight_enough_flag_the_noise(run, baseline):
    found = regression.find_regressions(run, baseline, {"*": 0.01})
    assert len(found) == 5 + 7  # every local and ct200 metric is 3 % worse than its baseline


def test_threshold_lookup_prefers_exact_then_longest_glob():
    t = {"*": 0.3, "gemv_*": 0.2, "gemv_int4_*": 0.15, "gemv_int4_bandwidth": 0.05}
    assert regression.threshold_for("gemv_int4_bandwidth", t) == 0.05
    assert regression.threshold_for("gemv_int4_latency", t) == 0.15
    assert regression.threshold_for("gemv_fp32_bandwidth", t) == 0.2
    assert regression.threshold_for("ar_tokens_per_s", t) == 0.3
    assert regression.threshold_for("ar_tokens_per_s", {}) == regression.DEFAULT_THRESHOLD


def test_baseline_file_round_trip_and_previous_run_as_baseline(tmp_path, run):
    path = regression.write_baseline(run, tmp_path / "baseline.json", thresholds={"*": 0.08})
    data = regression.load_baseline(path)
    assert data["version"] == 1 and data["source_run"] == run["run_id"] and data["thresholds"] == {"*": 0.08}
    assert set(data["hosts"]) == {"local", "ct200"}  # only passing hosts make a baseline
    assert data["hosts"]["ct200"]["gemv_int4_bandwidth"] == pytest.approx(1495.0 * 9)
    assert regression.baseline_values(run)["local"] == data["hosts"]["local"]
    slower = copy.deepcopy(run)
    slower["hosts"]["local"]["bench"]["metrics"]["ar_tokens_per_s"]["value"] *= 0.9
    assert [r.metric for r in regression.find_regressions(slower, data)] == ["ar_tokens_per_s"]  # 8 % from the file
    assert regression.find_regressions(slower, run) == []  # a run.json baseline, default 10 %


def test_load_baseline_rejects_junk(tmp_path):
    (tmp_path / "b.json").write_text('{"version": 7, "hosts": {}}')
    with pytest.raises(ValueError, match="not a baseline"):
        regression.load_baseline(tmp_path / "b.json")


def test_regressions_are_highlighted_in_the_reports(baseline):
    record = fleet_record()
    record.hosts["ct200"].bench["metrics"]["ddtree_tokens_per_s"]["value"] *= 0.5
    record.regressions = regression.find_regressions(record.to_dict(), baseline)
    run = record.to_dict()
    assert run["regressions"][0]["metric"] == "ddtree_tokens_per_s"
    md = report.render_markdown(run)
    assert "## Benchmark regressions" in md
    assert "| ct200 | `ddtree_tokens_per_s` | 10,939 tokens/s | **5,310** tokens/s | 0.485 | ±10% (higher is better) |" in md
    assert "**5,310 ▼**" in md
    html = report.render_html(run)
    assert 'id="regressions"' in html and 'class="num regressed"' in html


# --------------------------------------------------------------------------------------------
# Comparing runs


def test_compare_puts_two_runs_side_by_side(tmp_path, run):
    older = copy.deepcopy(run)
    older["run_id"] = "20261128-020000-0001"
    older["hosts"]["ct200"]["bench"]["metrics"]["ddtree_tokens_per_s"]["value"] *= 2
    older["hosts"]["local"]["bench"]["metrics"]["decode_step_ms"]["value"] *= 2
    del older["hosts"]["ct200"]["bench"]["metrics"]["gemv_int4_bandwidth"]
    older["hosts"]["local"]["bench"]["metrics"]["retired_metric"] = {"value": 1.0, "unit": "x", "better": "higher"}
    rows = {(r["host"], r["metric"]): r for r in regression.compare(older, run)}
    assert rows[("ct200", "ddtree_tokens_per_s")]["verdict"] == "worse"
    assert rows[("ct200", "ddtree_tokens_per_s")]["ratio"] == pytest.approx(0.5)
    assert rows[("local", "decode_step_ms")]["verdict"] == "better"
    assert rows[("local", "ar_tokens_per_s")]["verdict"] == "same"
    assert rows[("ct200", "gemv_int4_bandwidth")]["verdict"] == "new"
    assert rows[("local", "retired_metric")]["verdict"] == "gone"
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    run_store.write_run(a, older), run_store.write_run(b, run)
    paths = report.write_compare(a, b)
    assert paths["md"] == b / "compare-20261128-020000-0001.md"
    md = paths["md"].read_text()
    assert "| ct200 | `ddtree_tokens_per_s` | tokens/s | higher | 21,240 | 10,620 | 0.500 | **worse** |" in md
    html = paths["html"].read_text()
    assert 'data-verdict="worse"' in html and "0.500×" in html


def test_a_reused_benchmark_is_never_compared_as_a_new_measurement(tmp_path, run, baseline):
    older = copy.deepcopy(run)
    older["run_id"] = "20261128-020000-0001"
    older["hosts"]["ct200"]["bench"]["metrics"]["ddtree_tokens_per_s"]["value"] *= 2
    run["hosts"]["ct200"]["steps"]["bench"] = {"status": "cached", "seconds": 0.2, "log": "ct200/bench.log",
                                              "message": "", "tail": "", "reused_from": "20261127-020000-0abc"}
    rows = {(r["host"], r["metric"]): r for r in regression.compare(older, run)}
    reused = rows[("ct200", "ddtree_tokens_per_s")]
    assert reused["verdict"] == "reused" and reused["reused_from"] == "current reused from run 20261127-020000-0abc"
    assert rows[("local", "decode_step_ms")]["verdict"] == "same" and not rows[("local", "decode_step_ms")]["reused_from"]
    slower = copy.deepcopy(run)
    for metric in slower["hosts"]["ct200"]["bench"]["metrics"].values():
        metric["value"] *= 0.5 if metric["better"] == "higher" else 2
    assert regression.find_regressions(slower, baseline) == []       # figures of an earlier run: no verdict
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    run_store.write_run(a, older), run_store.write_run(b, run)
    md = report.write_compare(a, b)["md"].read_text()
    assert "reused (current reused from run 20261127-020000-0abc: not a new measurement)" in md


# --------------------------------------------------------------------------------------------
# The HTML in a real browser

@pytest.fixture(scope="module")
def browser_dom(tmp_path_factory) -> tuple[str, Path]:
    """The fleet report rendered by headless Chromium: its DOM after layout, and a screenshot."""
    tmp = tmp_path_factory.mktemp("browser")
    run = json.loads(json.dumps(fleet_record().to_dict()))
    run["regressions"] = [{"host": "ct200", "metric": "ddtree_tokens_per_s", "baseline": 12000.0, "value": 10620.0,
                           "ratio": 0.885, "threshold": 0.05, "unit": "tokens/s", "better": "higher"}]
    run_store.write_run(tmp, run)
    html = report.render_run(tmp)["html"]
    dom = chromium(tmp, "--dump-dom", html.as_uri())
    chromium(tmp, f"--screenshot={tmp / 'report.png'}", "--window-size=1440,2400", html.as_uri())
    return dom, tmp / "report.png"


def test_browser_shows_hosts_statuses_and_step_cells(browser_dom):
    dom, _ = browser_dom
    assert '<span id="run-status" data-status="failed">' in dom
    for host, status in [("local", "passed"), ("ct200", "passed"), ("ct201", "failed"), ("ct202", "failed"),
                         ("ct203", "failed"), ("ct204", "failed")]:
        assert f'<tr data-host="{host}" data-status="{status}">' in dom
    assert 'data-step="build" data-status="cached"' in dom
    assert 'data-step="bench" data-status="timeout"' in dom
    assert "NVIDIA RTX PRO 6000 Blackwell" in dom


def test_browser_shows_the_golden_matrix_and_the_mismatch(browser_dom):
    dom, _ = browser_dom
    assert dom.count('class="cell s-passed"') == 4 * 4 + 3  # ct202 never got to golden
    assert 'data-host="ct201" data-bundle="tiny_int4" data-status="failed"' in dom
    assert "host_ddtree_vs_golden @ 17" in dom
    assert 'diverges at position <span class="pos">17</span>' in dom
    assert '<b class="margin">0.800</b>' in dom
    assert '<td class="diverge">72</td>' in dom and '<td class="diverge">71</td>' in dom


def test_browser_shows_failures_tests_benchmarks_and_plots(browser_dom):
    dom, _ = browser_dom
    assert "identifier \"__hfma2x\" is undefined" in dom
    assert '<tr data-test="op_gemv_int4">' in dom
    assert 'class="regressed"' in dom
    assert dom.count("<svg") == 3  # tokens/s, ms, GB/s
    assert 'data-unit="tokens/s"' in dom and 'data-unit="GB/s"' in dom
    assert dom.count("<rect") == 2 + 8 + 2 + 1 + 2 + 2  # legends and bars of the three charts


def test_browser_screenshot_is_written(browser_dom):
    _, png = browser_dom
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000


def test_a_deploy_run_shows_only_its_steps_and_says_what_did_not_run():
    steps = {"preflight": rec.StepRecord("passed", 0.4, "ct200/preflight.log"),
             "sync": rec.StepRecord("passed", 3.2, "ct200/sync.log")}
    deploy = rec.RunRecord("20261129-180000-0a0b", "deploy", "2026-11-29T18:00:00Z", "2026-11-29T18:00:04Z", 3.6, "passed",
                           rec.Source("abc"), {"ct200": rec.HostRecord("passed", "ssh", "ct200", steps=steps)}).to_dict()
    md = report.render_markdown(deploy)
    assert "| host | status | backend | GPU | tree | preflight | sync | total |" in md
    assert "No golden checks ran." in md and "No engine tests ran." in md and "No benchmarks ran." in md
    assert "No step failed." in md
    root = ET.fromstring(report.render_junit(deploy))
    assert [c.get("name") for c in root.iter("testcase")] == ["step.preflight", "step.sync"]
    assert root.get("failures") == "0"
    assert "No benchmarks ran." in report.render_html(deploy)


def test_safe_text_each_function_exactly():
    """orchestrator.safe_text's outputs, exactly (each escape, entity, span and fence)."""
    from orchestrator import safe_text as st
    assert st.visible("a\r\nb\rc\x1b\u202e\ud800") == "a\nb\\rc\\x1b\\u202e\ufffd"
    assert st.markdown("a & <b> `c` @dev | [x] #12 http://h www.e") == (
        "a &amp; &lt;b&gt; \\`c\\` @\u200bdev \\| \\[x\\] #\u200b12 http:\u200b//h www\u200b.e")
    assert st.markdown_block("x\n@dev\x07") == "x\n@\u200bdev\\x07"
    assert st.markdown_code("a | b  @dev") == "`a \\| b @\u200bdev`"
    assert st.markdown_code("a `` b") == "``` a `` b ```"
    assert st.markdown_code("  ") == ""
    assert st.markdown_fence("x ```` y") == "`````" and st.markdown_fence("x") == "```"


def test_compiled_templates_are_kept_only_in_a_private_directory(tmp_path, monkeypatch):
    """The templates' bytecode cache (Jinja2 loads Python code from it) is a 0700 directory of
    this user's; one group- or world-writable is not used (templates compiled every run)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = report._bytecode_cache()
    where = tmp_path / "kdtree-orchestrator" / "templates"
    assert cache is not None and oct(where.stat().st_mode & 0o777) == "0o700"
    env = report._environment()
    env.bytecode_cache = cache
    env.get_template("report.md.j2")
    assert list(where.glob("__jinja2_*.cache"))
    where.chmod(0o777)
    assert report._bytecode_cache() is None
