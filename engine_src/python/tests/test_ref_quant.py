import numpy as np
import pytest

from kdtree_ref import prng
from kdtree_ref.quant import dequantize, is_quantized, quantize, unpack_nibbles


def random_weight(out_dim=8, in_dim=64, seed=1):
    return (prng.uniform(prng.stream_key("quant-test", seed), (out_dim, in_dim)) * 0.3).astype(np.float32)


def test_shapes_and_dtypes():
    qw, sc = quantize(random_weight(8, 96))
    assert qw.shape == (8, 12) and qw.dtype == np.int32
    assert sc.shape == (8, 3) and sc.dtype == np.float32


def test_round_trip_error_is_at_most_half_a_step():
    w = random_weight(16, 128)
    qw, sc = quantize(w)
    err = np.abs(dequantize(qw, sc) - w).reshape(16, 4, 32)
    # half a quantization step, plus float32 rounding of the division and the product
    assert np.all(err <= sc[..., None] * (0.5 + 1e-5))


def test_group_maximum_is_exact_level_seven():
    w = random_weight(4, 64)
    qw, sc = quantize(w)
    np.testing.assert_array_equal(sc, np.max(np.abs(w.reshape(4, 2, 32)), axis=-1) / np.float32(7))
    nib = unpack_nibbles(qw).reshape(4, 2, 32)
    assert np.all(np.max(np.abs(nib - 8), axis=-1) == 7)
    assert nib.min() >= 1 and nib.max() <= 15


def test_nibble_layout_low_nibble_first():
    # group max 7 -> scale 1: each value is its own level
    row = np.array([1, -1, 2, -2, 3, -3, 7, -7] + [0] * 24, dtype=np.float32)
    qw, sc = quantize(row[None])
    assert sc[0, 0] == 1.0
    nibbles = [9, 7, 10, 6, 11, 5, 15, 1]
    expected = sum(n << (4 * k) for k, n in enumerate(nibbles))
    assert int(qw[0, 0].view(np.uint32)) == expected
    assert all(int(word.view(np.uint32)) == 0x88888888 for word in qw[0, 1:])


def test_rounding_is_half_to_even():
    row = np.zeros(32, dtype=np.float32)
    row[:4] = [7.0, 0.5, 1.5, -2.5]            # scale 1
    nib = unpack_nibbles(quantize(row[None])[0])[0, :4]
    assert list(nib - 8) == [7, 0, 2, -2]


def test_zero_group_has_zero_scale_and_nibbles_eight():
    w = random_weight(2, 64)
    w[1, 32:] = 0
    qw, sc = quantize(w)
    assert sc[1, 1] == 0
    assert np.all(unpack_nibbles(qw)[1, 32:] == 8)
    assert np.all(dequantize(qw, sc)[1, 32:] == 0)


def test_extreme_values():
    big = np.float32(3.0e38)
    w = np.zeros((3, 32), dtype=np.float32)
    w[0, :2] = [big, -big]                       # largest finite magnitudes
    w[1, 0] = np.float32(1e-45)                  # a denormal whose scale underflows: a zero group
    w[2, :2] = [1e-30, 1.0]                      # tiny values vanish next to a large one
    qw, sc = quantize(w)
    deq = dequantize(qw, sc)
    assert np.all(np.isfinite(deq))
    assert deq[0, 0] == pytest.approx(float(big), rel=1e-6) and deq[0, 1] == -deq[0, 0]
    assert sc[1, 0] == 0 and np.all(deq[1] == 0)
    assert deq[2, 0] == 0 and deq[2, 1] == pytest.approx(1.0, rel=1e-6)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple"):
        quantize(np.ones((2, 40), dtype=np.float32))
    with pytest.raises(ValueError, match="nan"):
        quantize(np.full((1, 32), np.nan, dtype=np.float32))


def test_quantized_tensor_names():
    assert is_quantized("layers.0.ffn.w1")
    assert is_quantized("layers.3.ffn.experts.7.w2")
    assert is_quantized("layers.3.ffn.shared.w3")
    assert not is_quantized("layers.3.ffn.gate.weight")
    assert not is_quantized("layers.0.attn.wq_a")
    assert not is_quantized("head") and not is_quantized("embed")
