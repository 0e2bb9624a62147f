"""scripts/big_bundle_metrics.py: a streamed bundle's decode bytes and its share of the read ceiling."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import gen_model
from kdtree_ref import bundle_writer, kdtr
from kdtree_ref.weights import Weights

ENGINE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ENGINE / "tests"))
import small_k2  # noqa: E402

spec = importlib.util.spec_from_file_location("big_bundle_metrics", ENGINE / "scripts" / "big_bundle_metrics.py")
big_bundle_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(big_bundle_metrics)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """k2small's bundles written by the streaming writer, and a manifest naming k2small streamed."""
    out = tmp_path_factory.mktemp("refs")
    golden = {b.entry["quant"]: b.entry for b in small_k2.build()}
    source = Weights(small_k2.ARGS, direct_int4=True)
    quants = {q: gen_model.quant_header(small_k2.RECIPE, q) for q in golden}
    bundle_writer.write_pair(source, quants, gen_model.drafter_header(small_k2.ARGS, small_k2.RECIPE), golden, out, 2)
    manifest = {"generator": {"keys": {"k2small": "key"}},
                "bundles": [{**golden[q], "file": f"model_k2small_{q}.kdtr"} for q in golden]}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def bench(tmp_path: Path, with_gpu: bool = True) -> Path:
    metrics = {"gpu.read_ceiling_GBps": {"value": 1000.0}, "gpu.moe_k2.t1.int4_us": {"value": 50.0}} if with_gpu else {}
    data = {"metrics": metrics, "bundles": {"k2small_int4": {
        "ar": {"tokens_per_second": 100.0, "decode_tokens_per_second": 200.0},
        "ddtree": [{"budget": 4, "tokens_per_second": 150.0, "decode_tokens_per_second": 180.0, "accept_mean": 1.5},
                   {"budget": 16, "tokens_per_second": 120.0, "decode_tokens_per_second": 190.0, "accept_mean": 2.0}]}}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def test_the_decode_step_reads_every_weight_but_the_unused_experts_embedding_rows_and_drafter(refs, tmp_path, capsys):
    path = bench(tmp_path)
    assert big_bundle_metrics.main(str(path), str(refs / "manifest.json")) == 0
    out = json.loads(path.read_text())
    m, parts = out["metrics"], out["big_bundles"]["k2small"]["decode_step_bytes"]
    header = kdtr.read(refs / "model_k2small_int4.kdtr").header
    a = small_k2.ARGS
    experts = sum(t["nbytes"] for t in header["tensors"] if ".ffn.experts." in t["name"])
    assert parts["routed_experts"] == round(experts * a.n_activated_experts / a.n_routed_experts)
    assert parts["embed"] == 4 * a.dim and parts["head"] == 4 * a.dim * a.vocab_size
    assert "drafter" not in parts
    everything_else = sum(t["nbytes"] for t in header["tensors"]
                          if not t["name"].startswith(("drafter.", "embed")) and ".ffn.experts." not in t["name"])
    assert sum(parts.values()) == everything_else + parts["routed_experts"] + parts["embed"] + parts["kv_cache"]
    total = m["k2small.decode_step_bytes"]["value"]
    assert total == sum(parts.values())
    assert m["k2small.decode_us_per_token"]["value"] == pytest.approx(5000.0)
    assert m["k2small.decode_pct_ceiling"]["value"] == pytest.approx(100 * total / 5e-3 / 1e12)
    assert m["k2small.ddtree_tokens_per_s"]["value"] == 150.0 and m["k2small.ar_tokens_per_s"]["value"] == 100.0
    assert m["k2small.moe_layer_decode_us"]["value"] == 50.0
    assert "k2small: a decode step reads" in capsys.readouterr().out


def test_ddtree_at_its_fastest_decode_budget_reads_the_step_the_drafter_and_the_tree_per_committed_token(refs, tmp_path,
                                                                                                          capsys):
    path = bench(tmp_path)
    big_bundle_metrics.main(str(path), str(refs / "manifest.json"))
    out = json.loads(path.read_text())
    m, d = out["metrics"], out["big_bundles"]["k2small"]["ddtree"]
    header = kdtr.read(refs / "model_k2small_int4.kdtr").header
    a = small_k2.ARGS
    drafter = sum(t["nbytes"] for t in header["tensors"] if t["name"].startswith("drafter."))
    assert drafter > 0
    # Budget 16: the higher decode rate (190 against 180), though the lower rate with the prefill.
    round_bytes = m["k2small.decode_step_bytes"]["value"] + drafter + 4 * a.n_layers * 16 * (a.kv_lora_rank + a.qk_rope_head_dim)
    assert (d["budget"], d["accept_mean"], d["budgets"]) == (16, 2.0, [4, 16])
    assert m["k2small.ddtree_round_bytes"]["value"] == round_bytes == sum(d["round_bytes"].values())
    assert m["k2small.ddtree_decode_tokens_per_s"]["value"] == 190.0
    assert m["k2small.ar_decode_tokens_per_s"]["value"] == 200.0
    # 2 tokens a round: half a round's bytes a token, 190 tokens a second, against 1000 GB/s.
    assert m["k2small.ddtree_decode_pct_ceiling"]["value"] == pytest.approx(100 * round_bytes / 2 * 190 / 1e12)
    assert "k2small: DDTree at its best budget (16 of [4, 16]): 190.0 decode tokens/s against AR's 200.0" in capsys.readouterr().out


def test_without_a_gpu_ceiling_no_share_of_it_is_claimed(refs, tmp_path):
    path = bench(tmp_path, with_gpu=False)
    big_bundle_metrics.main(str(path), str(refs / "manifest.json"))
    m = json.loads(path.read_text())["metrics"]
    assert "k2small.decode_step_bytes" in m
    assert "k2small.decode_pct_ceiling" not in m and "k2small.moe_layer_decode_us" not in m
    assert "k2small.ddtree_round_bytes" in m and "k2small.ddtree_decode_pct_ceiling" not in m


def test_a_manifest_without_streamed_configs_leaves_the_bench_untouched(refs, tmp_path):
    path = bench(tmp_path)
    before = path.read_text()
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({**json.loads((refs / "manifest.json").read_text()), "generator": {}}))
    big_bundle_metrics.main(str(path), str(manifest))
    assert path.read_text() == before
