"""The golden-token matrix as data: every check of orchestrator.records.golden on small manifests."""
from __future__ import annotations

import copy

from orchestrator.records import golden


def manifest() -> dict:
    golden_fp32 = list(range(10, 30))
    golden_int4 = golden_fp32[:5] + [99] + golden_fp32[6:]
    bundle = lambda name, quant, tokens: {"name": name, "config": "tiny", "quant": quant, "sha256": f"sha-{name}",
                                          "golden": tokens, "golden_margins": [0.5 + i for i in range(20)]}
    return {"version": 1, "bundles": [bundle("tiny_fp32", "fp32", golden_fp32), bundle("tiny_int4", "int4", golden_int4)]}


def outputs(m: dict) -> dict:
    return {"bundles": {b["name"]: {"ar": list(b["golden"]), "ddtree": list(b["golden"])} for b in m["bundles"]}}


def test_everything_equal_passes_every_check():
    m = manifest()
    row = golden.matrix_row(m, copy.deepcopy(m), copy.deepcopy(m), outputs(m))
    assert row["tiny_fp32"].status == "passed" and row["tiny_int4"].status == "passed"
    assert row["tiny_fp32"].checks["int4_differs_from_fp32"] == "skipped"
    assert row["tiny_int4"].checks == dict.fromkeys(["local_vs_expected", "host_vs_expected", "host_ar_vs_golden",
                                                     "host_ddtree_vs_golden", "int4_differs_from_fp32"], "passed")
    assert golden.failures(row) == []


def test_a_divergent_ddtree_output_points_at_its_position_and_margin():
    m = manifest()
    out = outputs(m)
    out["bundles"]["tiny_fp32"]["ddtree"][7] = 1
    row = golden.matrix_row(m, m, m, out)
    rec = row["tiny_fp32"]
    assert rec.status == "failed" and rec.checks["host_ddtree_vs_golden"] == "failed"
    assert rec.checks["host_ar_vs_golden"] == "passed"
    assert (rec.mismatch.check, rec.mismatch.position, rec.mismatch.margin) == ("host_ddtree_vs_golden", 7, 7.5)
    assert rec.mismatch.expected == list(range(13, 22)) and rec.mismatch.actual[4] == 1
    assert golden.failures(row) == ["tiny_fp32: host_ddtree_vs_golden (first at position 7)"]


def test_same_tokens_with_different_bytes_fail_with_a_detail():
    m = manifest()
    host = copy.deepcopy(m)
    host["bundles"][0]["sha256"] = "sha-other"
    rec = golden.matrix_row(m, m, host, outputs(m))["tiny_fp32"]
    assert rec.checks["host_vs_expected"] == "failed" and rec.mismatch is None
    assert "same tokens but different bundle bytes" in rec.detail


def test_missing_bundle_and_missing_outputs_fail():
    m = manifest()
    host = copy.deepcopy(m)
    del host["bundles"][1]
    out = outputs(m)
    del out["bundles"]["tiny_int4"]
    rec = golden.matrix_row(m, m, host, out)["tiny_int4"]
    assert rec.checks["host_vs_expected"] == rec.checks["host_ar_vs_golden"] == "failed"
    assert rec.checks["int4_differs_from_fp32"] == "failed"
    assert "missing from the manifest" in rec.detail and "no FP32 twin" in rec.detail


def test_a_streamed_bundle_is_checked_against_the_committed_golden_and_says_so():
    m = manifest()
    for b in m["bundles"]:
        b["streamed"] = True
    local = {"bundles": []}                 # the client never makes a streamed bundle
    row = golden.matrix_row(m, local, copy.deepcopy(m), outputs(m))
    for rec in row.values():
        assert rec.status == "passed" and rec.checks["local_vs_expected"] == "skipped"
        assert rec.detail == "local_vs_expected: not regenerated here (a streamed bundle: its golden tokens are the committed ones)"
    m["bundles"][0]["streamed"] = "yes"     # only the generator's own true marks one
    assert golden.matrix_row(m, local, m, outputs(m))["tiny_fp32"].checks["local_vs_expected"] == "failed"
    out = outputs(m)
    out["bundles"]["tiny_int4"]["ar"][3] = 7    # the host's tokens are still checked, and fail as ever
    rec = golden.matrix_row(m, local, m, out)["tiny_int4"]
    assert rec.status == "failed" and rec.mismatch.check == "host_ar_vs_golden"


def test_an_int4_bundle_equal_to_its_fp32_twin_fails():
    m = manifest()
    m["bundles"][1]["golden"] = list(m["bundles"][0]["golden"])
    rec = golden.matrix_row(m, m, m, outputs(m))["tiny_int4"]
    assert rec.checks["int4_differs_from_fp32"] == "failed" and "quantization left no trace" in rec.detail


def test_a_shorter_output_diverges_where_it_ends():
    m = manifest()
    out = outputs(m)
    out["bundles"]["tiny_fp32"]["ar"] = out["bundles"]["tiny_fp32"]["ar"][:12]
    rec = golden.matrix_row(m, m, m, out)["tiny_fp32"]
    assert rec.mismatch.position == 12 and rec.mismatch.check == "host_ar_vs_golden"


def test_a_divergence_at_the_final_token_fails():
    """The last position is compared too (a comparison that stops one short passes this)."""
    m = manifest()
    out = outputs(m)
    out["bundles"]["tiny_fp32"]["ar"][-1] = 1
    rec = golden.matrix_row(m, m, m, out)["tiny_fp32"]
    assert rec.status == "failed" and rec.checks["host_ar_vs_golden"] == "failed"
    assert (rec.mismatch.position, rec.mismatch.margin) == (19, 19.5) and rec.mismatch.actual[-1] == 1
    host = copy.deepcopy(m)
    host["bundles"][0]["golden"][-1] = 1
    assert golden.matrix_row(m, m, host, outputs(m))["tiny_fp32"].checks["host_vs_expected"] == "failed"


def test_hostile_documents_fail_their_checks_with_exact_details():
    """Garbage where the manifests and outputs should be (no bundles dict, no golden list, margins
    of the wrong type, bundles without names) fails the checks it touches, never the row."""
    m = manifest()
    m["bundles"][0]["golden_margins"] = {i: 9.5 for i in range(20)}      # indexable, but not a list
    del m["bundles"][1]["golden"]
    m["bundles"] += [5, {"config": "tiny"}, {"name": "other_int4", "config": "other", "quant": "int4", "golden": [1]},
                     {"name": "third_fp32", "config": "third", "quant": "fp32", "golden": [1]}]
    host = copy.deepcopy(m)
    host["bundles"][0]["golden"][3] = 1
    row = golden.matrix_row(m, {"bundles": 7}, host, {"bundles": "garbage"})
    assert list(row) == ["tiny_fp32", "tiny_int4", "other_int4", "third_fp32"]
    fp32 = row["tiny_fp32"]
    assert fp32.checks == {"local_vs_expected": "failed", "host_vs_expected": "failed", "host_ar_vs_golden": "failed",
                           "host_ddtree_vs_golden": "failed", "int4_differs_from_fp32": "skipped"}
    assert (fp32.mismatch.check, fp32.mismatch.position, fp32.mismatch.margin) == ("host_vs_expected", 3, None)
    assert fp32.detail == ("local_vs_expected: the bundle is missing from the manifest; "
                           "host_ar_vs_golden: no tokens; host_ddtree_vs_golden: no tokens")
    assert golden.matrix_row(m, ["not", "a", "manifest"], m, {})["tiny_fp32"].checks["local_vs_expected"] \
        == "failed"
    assert row["tiny_int4"].detail.startswith("local_vs_expected: the bundle is missing from the manifest; "
                                              "host_vs_expected: no tokens;")
    assert row["other_int4"].detail.endswith("int4_differs_from_fp32: no FP32 twin to compare with")
    passed = golden.matrix_row(manifest(), manifest(), manifest(), outputs(manifest()))["tiny_fp32"]
    assert golden.failures({"ok": passed, **row})[:3:2] == [
        "tiny_fp32: local_vs_expected, host_vs_expected, host_ar_vs_golden, host_ddtree_vs_golden (first at position 3)",
        "other_int4: local_vs_expected, host_ar_vs_golden, host_ddtree_vs_golden, int4_differs_from_fp32 "
        "(local_vs_expected: the bundle is missing from the manifest; host_ar_vs_golden: no tokens; "
        "host_ddtree_vs_golden: no tokens; int4_differs_from_fp32: no FP32 twin to compare with)"]
    m = manifest()
    m["bundles"][1]["golden"] = list(m["bundles"][0]["golden"])
    assert golden.matrix_row(m, m, m, outputs(m))["tiny_int4"].detail == (
        "int4_differs_from_fp32: the INT4 golden tokens equal the FP32 ones: the quantization left no trace")


def test_the_details_name_the_bytes_and_the_margin_of_a_local_divergence():
    m = manifest()
    local, host = copy.deepcopy(m), copy.deepcopy(m)
    local["bundles"][0]["golden"][2] = 1
    host["bundles"][0]["sha256"] = "0123456789abcdef"
    m["bundles"][0]["sha256"] = "fedcba9876543210"
    rec = golden.matrix_row(m, local, host, outputs(m))["tiny_fp32"]
    assert (rec.mismatch.check, rec.mismatch.position, rec.mismatch.margin) == ("local_vs_expected", 2, 2.5)
    assert rec.detail == ("host_vs_expected: same tokens but different bundle bytes (sha256 0123456789ab, "
                          "expected fedcba987654)")
    host["bundles"][0]["sha256"] = m["bundles"][0]["sha256"]
    host["bundles"][0]["golden"][4] = 1
    rec = golden.matrix_row(m, m, host, outputs(m))["tiny_fp32"]
    assert (rec.mismatch.check, rec.mismatch.position, rec.mismatch.margin) == ("host_vs_expected", 4, 4.5)
    assert rec.detail == "" and golden.matrix_row(m, m, m, outputs(m))["tiny_int4"].detail == ""


def test_gpu_rows_merge_to_the_first_failing_gpu_of_each_bundle():
    m = manifest()
    ok = golden.matrix_row(m, m, m, outputs(m))
    bad = {}
    for at in (3, 5):
        out = outputs(m)
        out["bundles"]["tiny_fp32"]["ar"][at] = 1
        out["bundles"]["tiny_int4"]["ar"] = None
        bad[at] = golden.matrix_row(m, m, m, out)
    merged = golden.merge_gpu_rows({2: bad[5], 0: ok, 1: bad[3]})
    assert list(merged) == ["tiny_fp32", "tiny_int4"]
    assert merged["tiny_fp32"].status == "failed" and merged["tiny_fp32"].mismatch.position == 3
    assert merged["tiny_fp32"].detail == "GPU 1: " and merged["tiny_int4"].detail == "GPU 1: host_ar_vs_golden: no tokens"
    assert golden.merge_gpu_rows({0: ok, 1: ok}) == ok
