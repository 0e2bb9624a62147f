"""The reference model: absorbed decode against the textbook forward, routing rules, RoPE."""

import dataclasses
import json
import math

import numpy as np
import pytest

import gen_model
from kdtree_ref import prng
from kdtree_ref.model import (KVCache, ModelArgs, RopeScaling, Transformer, decode_step, generate, prefill, rope,
                              rope_frequencies, softmax_scale, top_margin, yarn_correction_range)

CONFIGS = sorted(gen_model.DEFAULT_CONFIGS)


@pytest.fixture(scope="module", params=CONFIGS)
def model(request):
    args = gen_model.CONFIGS[request.param]
    return Transformer(args, gen_model.init_weights(args))


def tokens(n, seed=0, vocab=400):
    return prng.integers(prng.stream_key("model-test", seed), n, vocab)


def test_absorbed_decode_equals_cacheless_forward(model):
    seq = tokens(24)
    full = model.forward_full(seq)
    cache = KVCache(model.args)
    steps = [prefill(model, seq[None, :9], cache).logits[0]]
    steps += [decode_step(model, np.array([t]), cache).logits[0] for t in seq[9:]]
    np.testing.assert_allclose(np.concatenate(steps), full, rtol=0, atol=1e-10 * np.abs(full).max())


def test_batched_sequences_equal_single_runs(model):
    prompts = np.stack([tokens(8, 1), tokens(8, 2), tokens(8, 3)])
    batch = generate(model, prompts, 6)
    for i in range(3):
        single = generate(model, prompts[i], 6)
        assert list(single.tokens[0]) == list(batch.tokens[i])
        np.testing.assert_allclose(single.hidden[0], batch.hidden[i], atol=1e-12)


def test_masked_forward_sees_only_visible_rows(model):
    # two independent continuations verified side by side equal each one alone
    prefix, a, b = tokens(6, 4), tokens(2, 5), tokens(2, 6)
    cache = KVCache(model.args)
    prefill(model, prefix[None], cache)
    mask = np.ones((4, 10), dtype=bool)
    mask[:, 6:] = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    both = model.forward(np.concatenate([a, b])[None], np.array([6, 7, 6, 7]), mask, cache).logits[0]
    for i, cont in enumerate((a, b)):
        alone = model.forward_full(np.concatenate([prefix, cont]))[6:]
        np.testing.assert_allclose(both[2 * i:2 * i + 2], alone, atol=1e-10 * np.abs(alone).max())


def test_rope_rotates_adjacent_pairs():
    x = np.array([[1.0, 0.0, 0.0, 1.0]])
    inv_freq, magnitude = rope_frequencies(ModelArgs(qk_rope_head_dim=4, rope_theta=10000.0))
    assert magnitude == 1.0
    out = rope(x, np.array([3]), inv_freq)
    angles = 3 * 10000.0 ** (-np.array([0, 2]) / 4)
    np.testing.assert_allclose(out[0], [np.cos(angles[0]), np.sin(angles[0]),
                                        -np.sin(angles[1]), np.cos(angles[1])])
    np.testing.assert_array_equal(rope(x, np.array([0]), inv_freq), x)
    np.testing.assert_allclose(rope(x, np.array([3]), inv_freq, 2.0), 2 * out)


def hf_yarn(dim, base, factor, original, beta_fast, beta_slow):
    """Hugging Face's DeepseekV3YarnRotaryEmbedding inverse frequencies, transcribed line by line
    (torch -> NumPy, float64): the independent statement rope_frequencies is checked against."""
    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    freq_extra = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    freq_inter = 1.0 / (factor * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    inv_freq_mask = 1.0 - ramp
    return freq_inter * (1 - inv_freq_mask) + freq_extra * inv_freq_mask, (low, high)


@pytest.mark.parametrize("dim,original", [(64, 4096), (32, 512), (16, 512)])
def test_yarn_frequencies_follow_deepseek_v3(dim, original):
    """DeepSeek-V3's rope_scaling (factor 40, beta_fast 32, beta_slow 1, mscale = mscale_all_dim = 1):
    the frequencies of the HF code, unit cos/sin magnitude, softmax scale (0.1 ln 40 + 1)^2 tau."""
    scaling = RopeScaling(factor=40.0, original_max_position_embeddings=original, beta_fast=32.0, beta_slow=1.0,
                          mscale=1.0, mscale_all_dim=1.0)
    args = ModelArgs(qk_nope_head_dim=128, qk_rope_head_dim=dim, rope_theta=10000.0, rope_scaling=scaling)
    inv_freq, magnitude = rope_frequencies(args)
    want, (low, high) = hf_yarn(dim, 10000.0, 40.0, original, 32.0, 1.0)
    np.testing.assert_allclose(inv_freq, want, rtol=1e-14, atol=0)
    assert yarn_correction_range(args) == (low, high)
    plain = 10000.0 ** (-np.arange(0, dim, 2) / dim)
    assert np.all(inv_freq[:low + 1] == plain[:low + 1])          # fast pairs are kept
    np.testing.assert_allclose(inv_freq[high:], plain[high:] / 40, rtol=1e-15)  # slow pairs interpolated
    assert magnitude == 1.0
    assert softmax_scale(args) == pytest.approx((128 + dim) ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-15)
    if (dim, original) == (64, 4096):
        assert (low, high) == (10, 23)     # DeepSeek-V3's own rope dims and context


def pair_rotations(pair, dim, base, original):
    """The rotations per original context whose YaRN correction pair is `pair` (find_correction_dim inverted)."""
    return original / (2 * math.pi * base ** (2 * pair / dim))


@pytest.mark.parametrize("dim,base,original,beta,equal_ends", [
    (64, 50000.0, 4096, 1.0, False),                                   # Kimi-K2's own: pairs 19 and 20
    (32, 10000.0, 512, pair_rotations(-0.5, 32, 10000.0, 512), True),  # both ends clamped to pair 0
    (16, 10000.0, 512, pair_rotations(15.5, 16, 10000.0, 512), True)])  # both clamped to dim - 1
def test_yarn_with_equal_betas_follows_the_reference(dim, base, original, beta, equal_ends):
    """beta_fast == beta_slow (Kimi-K2: both 1) is accepted and gives the reference code's frequencies,
    including its 0.001 widening of a zero-width ramp."""
    scaling = RopeScaling(factor=32.0, original_max_position_embeddings=original, beta_fast=beta, beta_slow=beta,
                          mscale=1.0, mscale_all_dim=1.0)
    args = ModelArgs(qk_nope_head_dim=128, qk_rope_head_dim=dim, rope_theta=base, rope_scaling=scaling)
    inv_freq, magnitude = rope_frequencies(args)
    want, (low, high) = hf_yarn(dim, base, 32.0, original, beta, beta)
    np.testing.assert_allclose(inv_freq, want, rtol=1e-14, atol=0)
    assert (high == low + 0.001) == equal_ends and magnitude == 1.0
    assert yarn_correction_range(args) == (low, round(high))
    with pytest.raises(ValueError, match="beta_fast >= beta_slow"):
        RopeScaling(factor=32.0, original_max_position_embeddings=original, beta_fast=1.0, beta_slow=2.0)


def test_yarn_mscale_terms():
    """mscale != mscale_all_dim scales cos/sin by their ratio; mscale_all_dim 0 leaves the softmax scale."""
    args = ModelArgs(qk_nope_head_dim=32, qk_rope_head_dim=16,
                     rope_scaling=RopeScaling(factor=16.0, original_max_position_embeddings=256, mscale=0.707,
                                              mscale_all_dim=0.0))
    _, magnitude = rope_frequencies(args)
    assert magnitude == pytest.approx(0.1 * 0.707 * math.log(16) + 1)
    assert softmax_scale(args) == 48 ** -0.5


def test_rope_scaling_round_trips_through_the_header():
    args = gen_model.CONFIGS["k2mini"]
    assert ModelArgs.from_json(json.loads(json.dumps(args.to_json()))) == args
    assert "rope_scaling" not in gen_model.CONFIGS["tiny"].to_json()
    with pytest.raises(ValueError, match="unknown field 'rope_factor'"):
        ModelArgs.from_json({**args.to_json(), "rope_factor": 40})
    with pytest.raises(ValueError, match="rope_scaling: unknown field 'alpha'"):
        ModelArgs.from_json({**args.to_json(), "rope_scaling": {"factor": 4.0, "alpha": 1}})
    with pytest.raises(ValueError, match="unknown type 'linear'"):
        ModelArgs.from_json({**args.to_json(), "rope_scaling": {"type": "linear", "factor": 4.0}})


def gate_model(args, gate_logits, bias):
    """A model whose layer-1 router sees logits `gate_logits` for the input x = e_0."""
    weights = gen_model.init_weights(args)
    gate = np.zeros((args.n_routed_experts, args.dim), dtype=np.float32)
    gate[:, 0] = gate_logits
    weights["layers.1.ffn.gate.weight"] = gate
    weights["layers.1.ffn.gate.bias"] = np.asarray(bias, dtype=np.float32)
    x = np.zeros((1, args.dim))
    x[0, 0] = 1.0
    return Transformer(args, weights), x


def test_routing_top_k_weights_and_tie_break():
    args = gen_model.CONFIGS["tiny"]           # 8 experts, top-2, one group
    logits = np.array([0.0, 2.0, -1.0, 2.0, 1.0, 2.0, 0.0, 0.0])
    model, x = gate_model(args, logits, np.zeros(8))
    idx, weights, margin, group_margin = model.route(1, x)
    assert list(idx[0]) == [1, 3]               # a three-way tie goes to the lower indices
    np.testing.assert_allclose(weights[0], [args.route_scale / 2] * 2)
    assert margin[0] == 0 and group_margin[0] == np.inf


def test_bias_selects_but_does_not_weigh():
    args = gen_model.CONFIGS["tiny"]
    logits = np.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0])
    bias = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    model, x = gate_model(args, logits, bias)
    idx, weights, margin, _ = model.route(1, x)
    assert list(idx[0]) == [6, 0]
    s = 1 / (1 + np.exp(-np.array([-1.0, 1.0])))
    np.testing.assert_allclose(weights[0], s / s.sum() * args.route_scale)
    np.testing.assert_allclose(margin[0], s[1] - 0.5)     # second pick vs the 0.5s


def test_group_limited_routing():
    args = gen_model.CONFIGS["tiny2"]          # 16 experts in 4 groups of 4, keep 2 groups, top-4
    logits = np.full(16, -3.0)
    logits[[0, 1]] = [3.0, 2.9]                 # group 0: strong pair
    logits[[4, 5, 6]] = [1.0, 1.0, 1.0]         # group 1: medium
    logits[8] = 3.5                             # group 2: one very strong expert, weak partner
    logits[[12, 13]] = [0.5, 0.4]               # group 3
    model, x = gate_model(args, logits, np.zeros(16))
    idx, weights, margin, group_margin = model.route(1, x)
    s = 1 / (1 + np.exp(-logits))
    group_scores = [s[0] + s[1], s[4] + s[5], s[8] + s[9], s[12] + s[13]]
    ranked = sorted(group_scores, reverse=True)
    assert ranked[:2] == group_scores[:2]       # groups 0 and 1 are kept
    assert sorted(idx[0]) == [0, 1, 4, 5]       # expert 8 is strong but its group is dropped
    np.testing.assert_allclose(group_margin[0], ranked[1] - ranked[2])
    np.testing.assert_allclose(margin[0], s[5] - s[6])
    np.testing.assert_allclose(weights[0].sum(), args.route_scale)


def test_plain_wq_and_lora_query_configs_both_exist():
    assert gen_model.CONFIGS["tiny"].q_lora_rank > 0 and gen_model.CONFIGS["tiny2"].q_lora_rank == 0
    assert gen_model.CONFIGS["tiny2"].n_expert_groups > 1


def test_config_json_round_trip():
    args = gen_model.CONFIGS["tiny2"]
    assert dataclasses.replace(args) == type(args)(**args.to_json())


def test_top_margin():
    np.testing.assert_allclose(top_margin(np.array([[1.0, 3.0, 2.5], [0.0, 0.0, -1.0]])), [0.5, 0.0])
