"""Weights made per (seed, name): parts of a stream equal the whole, direct INT4 experts follow their rule."""

import math

import numpy as np
import pytest

from kdtree_ref import prng, weights
from kdtree_ref.model import ModelArgs
from kdtree_ref.quant import dequantize, unpack_nibbles

MASK = 2**64 - 1


def splitmix_int(key: int, i: int) -> int:
    """Output i of stream `key` in Python integers (the module docstring's formula, not NumPy's)."""
    z = (key + (i + 1) * prng.GAMMA) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


SMALL = ModelArgs(name="wtest", vocab_size=64, dim=64, n_layers=2, n_dense_layers=1, n_heads=2, q_lora_rank=32,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, inter_dim=96,
                  moe_inter_dim=32, n_routed_experts=4, n_shared_experts=1, n_activated_experts=2)


@pytest.mark.parametrize("first,n", [(0, 5), (13, 30), (100, 1)])
def test_stream_parts_equal_the_whole_stream(first, n):
    key = prng.stream_key("t", "part")
    whole = prng.bits(key, first + n)
    assert np.array_equal(prng.bits(key, n, first), whole[first:])
    assert [int(x) for x in whole[first:]] == [splitmix_int(key, i) for i in range(first, first + n)]
    assert np.array_equal(prng.uniform(key, (n,), first), prng.uniform(key, (first + n,))[first:])


@pytest.mark.parametrize("first,n", [(0, 14), (3, 40), (27, 1), (0, 1000)])
def test_int4_codes_are_base15_digits_of_the_stream(first, n):
    key = prng.stream_key("t", "codes")
    codes = prng.int4_codes(key, n, first)
    expected = [splitmix_int(key, c // 14) * 15 ** (c % 14 + 1) // 2**64 % 15 - 7 for c in range(first, first + n)]
    assert codes.dtype == np.int8 and codes.tolist() == expected


def test_int4_codes_are_near_uniform():
    codes = prng.int4_codes(prng.stream_key("t", "uniformity"), 15 * 20000)
    counts = np.bincount(codes + 7, minlength=15)
    assert counts.min() > 0.95 * 20000 and counts.max() < 1.05 * 20000
    assert abs(codes.mean()) < 0.05


def test_rows_of_a_tensor_equal_the_whole_tensor():
    w = weights.Weights(SMALL)
    for name in ("embed", "head", "layers.0.ffn.w2", "layers.0.attn_norm"):
        whole = w.fp32(name)
        assert np.array_equal(w.fp32(name, (5, 9)), whole[5:9]), name


def test_direct_experts_follow_their_rule():
    w = weights.Weights(SMALL, direct_int4=True)
    name = "layers.1.ffn.experts.2.w2"
    spec = w.specs[name]
    qw, sc = w.expert_int4(name)
    out_dim, in_dim = spec.shape
    assert qw.shape == (out_dim, in_dim // 8) and sc.shape == (out_dim, in_dim // 32) and sc.dtype == np.float32
    codes = unpack_nibbles(qw) - 8
    key = prng.stream_key(weights.SEED, SMALL.name, name, "codes")
    assert np.array_equal(codes.ravel(), prng.int4_codes(key, out_dim * in_dim))
    s0 = spec.std / math.sqrt(56 / 3 * 13 / 12)
    u = prng.uniform(prng.stream_key(weights.SEED, SMALL.name, name, "scales"), sc.shape)
    assert np.array_equal(sc, (s0 * (1 + u / 2)).astype(np.float32))
    assert np.array_equal(dequantize(qw, sc), codes.astype(np.float32) * np.repeat(sc, 32, axis=1))
    assert np.array_equal(w.expert_fp32(name), dequantize(qw, sc))
    with pytest.raises(ValueError, match="no float32 master"):
        w.fp32(name)
    assert not w.is_direct("layers.1.ffn.shared.w1") and not weights.Weights(SMALL).is_direct(name)


def test_direct_experts_have_the_float32_experts_scale():
    args = ModelArgs(**{**SMALL.__dict__, "dim": 1024, "moe_inter_dim": 512, "n_routed_experts": 1,
                        "n_activated_experts": 1})
    direct = weights.Weights(args, direct_int4=True)
    for proj in ("w1", "w2"):
        name = f"layers.1.ffn.experts.0.{proj}"
        std = float(np.std(dequantize(*direct.expert_int4(name))))
        assert abs(std / direct.specs[name].std - 1) < 0.01, (proj, std)
