"""The streaming reference (weights made on demand) computes what the full reference computes."""

import sys
from pathlib import Path

import numpy as np
import pytest

import gen_model
from kdtree_ref import prng
from kdtree_ref.model import KVCache, Transformer, decode_step, generate, prefill
from kdtree_ref.streaming import StreamingTransformer
from kdtree_ref.weights import Weights

# tests/small_k2.py of engine_src (not conftest's PYTHON_DIR: the full suite has two conftest modules)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import small_k2  # noqa: E402

CASES = {  # config, recipe, bundle label
    "k2small_int4": (small_k2.ARGS, small_k2.RECIPE, "int4"),
    "k2small_twin": (small_k2.ARGS, small_k2.RECIPE, "fp32"),
    "tiny_int4": (gen_model.CONFIGS["tiny"], gen_model.Recipe(), "int4"),
    "tiny2_fp32": (gen_model.CONFIGS["tiny2"], gen_model.Recipe(), "fp32"),
}


def models(case: str):
    """(full, streaming) reference models of one bundle; chunks of 32 rows, so every product is split."""
    args, recipe, label = CASES[case]
    source = Weights(args, direct_int4=recipe.direct_int4)
    quant = gen_model.quant_header(recipe, label)
    full = Transformer(args, gen_model.bundle_weights(source, quant)[1])
    return full, StreamingTransformer(source, quant, chunk_rows=32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_streaming_equals_full_reference(case):
    full, streaming = models(case)
    prompt = prng.integers(prng.stream_key("streaming-test", case), 24, full.args.vocab_size - 1)[None]
    a, b = generate(full, prompt, 12), generate(streaming, prompt, 12)
    assert np.array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(b.hidden, a.hidden, rtol=1e-12, atol=1e-12 * np.abs(a.hidden).max())
    caches = [KVCache(full.args, 1, 40), KVCache(full.args, 1, 40)]
    outs = [prefill(m, prompt, c) for m, c in zip((full, streaming), caches)]
    outs += [decode_step(m, a.tokens[:, 0], c) for m, c in zip((full, streaming), caches)]
    for want, got in (outs[0:2], outs[2:4]):
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-12, atol=1e-12 * np.abs(want.logits).max())
        np.testing.assert_array_equal(got.route_margin == np.inf, want.route_margin == np.inf)
        finite = np.isfinite(want.route_margin)
        np.testing.assert_allclose(got.route_margin[finite], want.route_margin[finite], rtol=1e-9, atol=1e-13)


def test_streaming_keeps_no_routed_expert():
    _, streaming = models("k2small_int4")
    held = set(streaming.w) | set(streaming.wt) | set(streaming.kept)
    assert not [name for name in held if ".experts." in name] and "embed" not in held
