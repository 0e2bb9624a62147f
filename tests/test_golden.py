"""The golden-token matrix as data: every check of orchestrator.golden on small manifests."""
from __future__ import annotations

import copy

from orchestrator import golden


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
