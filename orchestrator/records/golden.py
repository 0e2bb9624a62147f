"""The golden-token matrix: one host's row of per-bundle checks.

For every bundle of the committed expected manifest, five checks:

    local_vs_expected        this machine's regeneration has the expected golden tokens and bytes
                             (skipped for a streamed bundle, one too big to make here: its golden
                             tokens are the committed ones, which gen_model.py --check
                             --recompute-golden recomputes with the streaming reference)
    host_vs_expected         the host's regeneration has them too
    host_ar_vs_golden        the engine's autoregressive output on the host equals the golden tokens
    host_ddtree_vs_golden    the engine's DDTree output on the host equals them
    int4_differs_from_fp32   an INT4 bundle's golden tokens differ from its FP32 twin's (skipped for FP32)

A failed token check keeps the first divergent position, the tokens around it on both sides and
the reference's top-1/top-2 logit margin there (the manifest's golden_margins).
"""
from __future__ import annotations

import dataclasses

from .record import GoldenRecord, Mismatch


def matrix_row(expected: dict, local: dict, host: dict, outputs: dict) -> dict[str, GoldenRecord]:
    """Every expected bundle's checks for one host, from the four documents (manifests, outputs)."""
    local_bundles, host_bundles = _by_name(local), _by_name(host)
    engine = outputs.get("bundles")
    if not isinstance(engine, dict):
        engine = {}
    expected_bundles = _by_name(expected)
    row = {}
    for name, want in expected_bundles.items():
        golden, margins = list(want.get("golden", [])), want.get("golden_margins")
        ran = engine.get(name)
        if not isinstance(ran, dict):
            ran = {}
        checks = [
            _local_check(want, local_bundles.get(name), margins),
            _manifest_check("host_vs_expected", want, host_bundles.get(name), margins),
            _tokens_check("host_ar_vs_golden", golden, ran.get("ar"), margins),
            _tokens_check("host_ddtree_vs_golden", golden, ran.get("ddtree"), margins),
            _twin_check(want, host_bundles, expected_bundles),
        ]
        statuses = {check: status for check, status, _, _ in checks}
        mismatch = next((m for _, status, m, _ in checks if status == "failed" and m is not None), None)
        detail = "; ".join(f"{check}: {why}" for check, status, _, why in checks if status != "passed" and why)
        row[name] = GoldenRecord("failed" if "failed" in statuses.values() else "passed", statuses, mismatch, detail)
    return row


def failures(row: dict[str, GoldenRecord]) -> list[str]:
    """One line per failed bundle: which checks failed and where the tokens first diverge."""
    lines = []
    for name, rec in row.items():
        if rec.status != "failed":
            continue
        failed = ", ".join(c for c, s in rec.checks.items() if s == "failed")
        where = f" (first at position {rec.mismatch.position})" if rec.mismatch else f" ({rec.detail})"
        lines.append(f"{name}: {failed}{where}")
    return lines


def merge_gpu_rows(rows: dict[int, dict[str, GoldenRecord]]) -> dict[str, GoldenRecord]:
    """A host's row from its rows per GPU (index -> row): a bundle failed on any GPU is the first
    such GPU's record, its detail naming the GPU; otherwise the first GPU's."""
    merged: dict[str, GoldenRecord] = {}
    for index, row in sorted(rows.items()):
        for name, rec in row.items():
            if name not in merged or (rec.status == "failed" and merged[name].status != "failed"):
                detail = f"GPU {index}: {rec.detail}" if rec.status == "failed" else rec.detail
                merged[name] = dataclasses.replace(rec, detail=detail)
    return merged


def _by_name(manifest: dict) -> dict[str, dict]:
    bundles = manifest.get("bundles") if isinstance(manifest, dict) else None
    return {b["name"]: b for b in bundles if isinstance(b, dict) and isinstance(b.get("name"), str)} \
        if isinstance(bundles, list) else {}


def _local_check(want: dict, got: dict | None, margins):
    """local_vs_expected: this machine's regeneration, except for a streamed bundle, which it never makes."""
    if got is None and want.get("streamed") is True:
        return ("local_vs_expected", "skipped", None,
                "not regenerated here (a streamed bundle: its golden tokens are the committed ones)")
    return _manifest_check("local_vs_expected", want, got, margins)


def _manifest_check(check: str, want: dict, got: dict | None, margins):
    """(check, status, mismatch, why): a regenerated bundle has the expected tokens and bytes."""
    if got is None:
        return check, "failed", None, "the bundle is missing from the manifest"
    name, status, mismatch, why = _tokens_check(check, list(want.get("golden", [])), got.get("golden"), margins)
    if status == "passed" and got.get("sha256") != want.get("sha256"):
        return name, "failed", None, (f"same tokens but different bundle bytes (sha256 {str(got.get('sha256'))[:12]}, "
                                      f"expected {str(want.get('sha256'))[:12]})")
    return name, status, mismatch, why


def _tokens_check(check: str, golden: list, got, margins):
    """(check, status, mismatch, why): `got` equals the golden tokens."""
    if not isinstance(got, list):
        return check, "failed", None, "no tokens"
    mismatch = Mismatch.first(check, golden, list(got), margins if isinstance(margins, list) else None)
    return check, "failed" if mismatch else "passed", mismatch, ""


def _twin_check(want: dict, host_bundles: dict, expected_bundles: dict):
    """(check, status, None, why): an INT4 bundle's golden tokens differ from its FP32 twin's."""
    check = "int4_differs_from_fp32"
    if want.get("quant") != "int4":
        return check, "skipped", None, ""
    twin = next((b for b in expected_bundles.values()
                 if b.get("config") == want.get("config") and b.get("quant") == "fp32"), None)
    mine, theirs = host_bundles.get(want["name"]), host_bundles.get(twin["name"]) if twin else None
    if mine is None or theirs is None:
        return check, "failed", None, "no FP32 twin to compare with"
    if mine.get("golden") == theirs.get("golden"):
        return check, "failed", None, "the INT4 golden tokens equal the FP32 ones: the quantization left no trace"
    return check, "passed", None, ""
