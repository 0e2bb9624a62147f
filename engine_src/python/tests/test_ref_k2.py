"""k2wide's definition and k2small (tests/small_k2.py): direct INT4 experts, the keep_fp32 twin, the lowrank_head drafter."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

import gen_model
from kdtree_ref import bundle, ddtree, kdtr
from kdtree_ref.drafter import LowRankDrafter
from kdtree_ref.model import RopeScaling, generate

# tests/small_k2.py of engine_src (not conftest's PYTHON_DIR: the full suite has two conftest modules)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import small_k2  # noqa: E402


@pytest.fixture(scope="module")
def k2small():
    """{label: (Built, kdtr.Bundle)} of k2small's two bundles."""
    return {b.entry["quant"]: (b, kdtr.decode(b.blob)) for b in small_k2.build()}


def test_k2wide_is_kimi_k2_at_two_layers():
    a = gen_model.CONFIGS["k2wide"]
    assert (a.dim, a.n_layers, a.n_dense_layers, a.n_heads, a.q_lora_rank, a.kv_lora_rank) == (7168, 2, 1, 64, 1536, 512)
    assert (a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.inter_dim, a.moe_inter_dim) == (128, 64, 128, 18432, 2048)
    assert (a.n_routed_experts, a.n_activated_experts, a.n_shared_experts, a.n_expert_groups, a.n_limited_groups) == (384, 8, 1, 1, 1)
    assert (a.route_scale, a.rope_theta, a.vocab_size) == (2.827, 50000.0, 32768)
    assert a.rope_scaling == RopeScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                                         mscale=1.0, mscale_all_dim=1.0)
    assert gen_model.RULES["k2wide"].prompt_len >= 256 and gen_model.GOLDEN_LEN == 64
    assert "k2wide" not in gen_model.DEFAULT_CONFIGS and set(gen_model.DEFAULT_CONFIGS) == set(gen_model.CONFIGS) - {"k2wide"}


def test_k2wide_bundle_sizes():
    """The INT4 bundle about 13.5 GB, the mixed twin about 15.0 GB (decimal), as issue 36 sizes them."""
    recipe = gen_model.RECIPES["k2wide"]
    int4 = gen_model.bundle_nbytes(gen_model.CONFIGS["k2wide"], recipe, "int4") / 1e9
    twin = gen_model.bundle_nbytes(gen_model.CONFIGS["k2wide"], recipe, "fp32") / 1e9
    assert 13.4 < int4 < 13.7 and 14.9 < twin < 15.2 and int4 + twin < 28.7, (int4, twin)


def test_k2wide_key_ignores_the_other_configs(monkeypatch):
    key = gen_model.generator_key("k2wide")
    tiny = gen_model.generator_key("tiny")
    monkeypatch.setitem(gen_model.CONFIGS, "tiny", dataclasses.replace(gen_model.CONFIGS["tiny"], dim=256))
    monkeypatch.setitem(gen_model.RULES, "k2mini", gen_model.GoldenRule(prompt_len=512))
    assert gen_model.generator_key("k2wide") == key and gen_model.generator_key("tiny") != tiny
    monkeypatch.setitem(gen_model.RULES, "k2wide", dataclasses.replace(gen_model.RULES["k2wide"], prompt_len=300))
    assert gen_model.generator_key("k2wide") != key


def test_twin_keeps_dense_and_shared_fp32_and_shares_the_experts(k2small):
    (_, twin), (_, int4) = k2small["fp32"], k2small["int4"]
    assert twin.header["quant"] == {"type": "int4", "group_size": 32, "keep_fp32": ["dense", "shared"]}
    assert int4.header["quant"] == {"type": "int4", "group_size": 32}
    for proj in ("w1", "w2", "w3"):
        for prefix in ("layers.0.ffn.", "layers.1.ffn.shared."):
            assert prefix + proj in twin.tensors and prefix + proj + ".qw" in int4.tensors
            assert prefix + proj + ".qw" not in twin.tensors and prefix + proj not in int4.tensors
        for e in range(small_k2.ARGS.n_routed_experts):
            name = f"layers.1.ffn.experts.{e}.{proj}"
            assert name not in twin.tensors and name not in int4.tensors
            for part in (".qw", ".sc"):
                assert np.array_equal(twin.tensors[name + part], int4.tensors[name + part])


def test_bundle_nbytes_counts_the_written_tensors(k2small):
    for quant, (_, read) in k2small.items():
        written = sum(t["nbytes"] for t in read.header["tensors"])
        assert gen_model.bundle_nbytes(small_k2.ARGS, small_k2.RECIPE, quant) == written


def test_lowrank_drafter_is_stored_and_read(k2small, tmp_path):
    built, read = k2small["int4"]
    args, rank, block = small_k2.ARGS, small_k2.RECIPE.drafter_rank, gen_model.BLOCK_SIZE
    assert read.header["drafter"] == {"block_size": block, "mask_token": args.vocab_size - 1, "kind": "lowrank_head",
                                      "rank": rank}
    assert read.tensors["drafter.v"].shape == (rank, 2 * args.dim)
    assert read.tensors["drafter.u"].shape == (block, args.dim, rank)
    assert read.tensors["drafter.b"].shape == (block, args.vocab_size) and "drafter.w" not in read.tensors
    path = tmp_path / built.entry["file"]
    path.write_bytes(built.blob)
    loaded = bundle.load(path)
    assert isinstance(loaded.drafter, LowRankDrafter)
    h, e = loaded.model.w["norm"], loaded.model.w["embed"][3]
    f = np.concatenate([h, e]).astype(np.float64)
    want = (loaded.model.w["head"].astype(np.float64) @ (read.tensors["drafter.u"].astype(np.float64)
                                                         @ (read.tensors["drafter.v"].astype(np.float64) @ f)).T).T
    np.testing.assert_allclose(loaded.drafter.logits(h, e), want + read.tensors["drafter.b"], rtol=1e-12)


@pytest.mark.parametrize("budget,block", [(4, 2), (16, 8), (48, 8)])
def test_lowrank_ddtree_equals_autoregressive(k2small, tmp_path, budget, block):
    built, _ = k2small["fp32"]
    path = tmp_path / built.entry["file"]
    path.write_bytes(built.blob)
    loaded = bundle.load(path)
    ar = generate(loaded.model, loaded.prompt[None], 40).tokens[0].tolist()
    assert ar == loaded.golden[:40]
    assert ddtree.decode(loaded.model, loaded.drafter, loaded.prompt, 40, budget, block).tokens == ar
