"""Integer PRNG (SplitMix64 over a counter) mapped to floats and INT4 codes exactly.

NumPy's distribution streams are not promised stable across versions, so every random value
of the bundles comes from here: the i-th value of a stream (i = 0, 1, ...) is
`splitmix64(key + (i+1) * GAMMA)` mod 2^64 (SplitMix64 run from state `key`), and the mappings
to floats, integers and codes use only shifts, integer products and divisions and
multiplications by powers of two, which are exact everywhere. Every value depends on its key
and index alone, so any part of a stream (a tensor's rows, one expert) is made on its own by
starting at its first index (`first`), with the same values as a whole-stream run.
"""

import hashlib

import numpy as np

GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on a uint64 array (wrapping arithmetic)."""
    z = np.array(x, dtype=np.uint64)     # a copy: the steps below work in place
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(_M1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_M2)
        z ^= z >> np.uint64(31)
    return z


def stream_key(*parts) -> int:
    """A 64-bit stream key from any printable parts (e.g. seed and tensor name)."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def bits(key: int, n: int, first: int = 0) -> np.ndarray:
    """Outputs first .. first+n-1 of the stream `key` (uint64)."""
    state = np.arange(first + 1, first + n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        state *= np.uint64(GAMMA)
        state += np.uint64(key)
    return splitmix64(state)


def uniform(key: int, shape, first: int = 0) -> np.ndarray:
    """Floats uniform on [-1, 1) on the grid 2^-23 (exact in float32), as float64: value i of the
    stream is (top 24 bits of output i - 2^23) * 2^-23. Returns values first .. first+size-1 in
    `shape` (rows r0.. of a [R][C] tensor: first = r0 * C)."""
    n = int(np.prod(shape, dtype=np.int64))
    top24 = (bits(key, n, first) >> np.uint64(40)).astype(np.int64)
    return ((top24 - (1 << 23)) * 2.0**-23).reshape(shape)


def integers(key: int, n: int, high: int) -> np.ndarray:
    """n integers in [0, high), high < 2^32, as int64 (multiply-shift on the top 32 bits)."""
    if not 0 < high < 2**32:
        raise ValueError(f"high must be in (0, 2^32), got {high}")
    top32 = bits(key, n) >> np.uint64(32)
    return ((top32 * np.uint64(high)) >> np.uint64(32)).astype(np.int64)


CODE_DIGITS = 14    # base-15 digits (INT4 codes) per 64-bit output
_BASE = np.uint64(15)
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_CODES_CHUNK = 8192   # 64-bit outputs worked on at once (64 KB a temporary)


def int4_codes(key: int, n: int, first: int = 0) -> np.ndarray:
    """Codes first .. first+n-1 of the stream `key`, in -7..7 (int8): code c is digit k = c mod 14
    of output x = c // 14 read as a base-15 fraction x / 2^64, most significant first, minus 7:
    floor(x 15^(k+1) / 2^64) mod 15 - 7. Fourteen digits, not the 16 that fit in 2^64: digit k
    is uniform up to 15^(k+1) / 2^64, below 0.16 % for k <= 13, while the 15th and 16th digits
    would be off by 2.4 % and 36 %. Computed on 32-bit halves (x 15 needs 68 bits)."""
    start, stop = first // CODE_DIGITS, (first + n + CODE_DIGITS - 1) // CODE_DIGITS
    x = bits(key, stop - start, start)
    digits = np.empty((stop - start, CODE_DIGITS), dtype=np.int8)
    for c0 in range(0, stop - start, _CODES_CHUNK):      # a chunk's 14 passes stay in the CPU's cache
        part = x[c0:c0 + _CODES_CHUNK]
        hi, lo, out = part >> _SHIFT32, part & _LOW32, digits[c0:c0 + _CODES_CHUNK]
        for k in range(CODE_DIGITS):
            # (hi 2^32 + lo) x 15 = hi' 2^32 + lo' with lo' < 2^32: the digit is hi' >> 32
            lo *= _BASE
            hi *= _BASE
            hi += lo >> _SHIFT32
            out[:, k] = hi >> _SHIFT32
            hi &= _LOW32
            lo &= _LOW32
    skip = first - start * CODE_DIGITS
    codes = digits.reshape(-1)[skip:skip + n]
    codes -= np.int8(7)
    return codes
