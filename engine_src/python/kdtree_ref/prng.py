"""Integer PRNG (SplitMix64 over a counter) mapped to floats exactly.

NumPy's distribution streams are not promised stable across versions, so every random value
of the bundles comes from here: the i-th value of a stream is `splitmix64(key + (i+1) * GAMMA)`
mod 2^64 (SplitMix64 run from state `key`), and the mappings to floats and integers use only
shifts, integer products and multiplications by powers of two, which are exact everywhere.
"""

import hashlib

import numpy as np

GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on a uint64 array (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def stream_key(*parts) -> int:
    """A 64-bit stream key from any printable parts (e.g. seed and tensor name)."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def bits(key: int, n: int) -> np.ndarray:
    """The first n uint64 outputs of the stream `key`."""
    counter = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        state = np.uint64(key) + counter * np.uint64(GAMMA)
    return splitmix64(state)


def uniform(key: int, shape) -> np.ndarray:
    """Floats uniform on [-1, 1) on the grid 2^-23 (exact in float32), as float64."""
    n = int(np.prod(shape, dtype=np.int64))
    top24 = (bits(key, n) >> np.uint64(40)).astype(np.int64)
    return ((top24 - (1 << 23)) * 2.0**-23).reshape(shape)


def integers(key: int, n: int, high: int) -> np.ndarray:
    """n integers in [0, high), high < 2^32, as int64 (multiply-shift on the top 32 bits)."""
    if not 0 < high < 2**32:
        raise ValueError(f"high must be in (0, 2^32), got {high}")
    top32 = bits(key, n) >> np.uint64(32)
    return ((top32 * np.uint64(high)) >> np.uint64(32)).astype(np.int64)
