"""INT4 W4A16 group quantization, exactly as engine_src/README.md ("INT4 W4A16") fixes it.

A float32 weight `W[out][in]` becomes `qw[out][in/8]` (int32, 8 nibbles per word, nibble k of
word j = input element 8j+k in bits 4k..4k+3) and `sc[out][in/G]` (float32, G = 32).
Scale `s = max|w| / 7` per group, `nibble = rint(w / s) + 8` (half to even), all in float32;
value `= (nibble - 8) * s`. A group whose scale is 0 (all zeros, or so small that max|w| / 7
underflows) stores nibbles 8.

An int4 bundle's header may keep weight classes in fp32 (`quant.keep_fp32`, a list of "dense":
the dense layers' ffn.w1/w2/w3, and "shared": the shared expert's w1/w2/w3); the routed experts
are int4 whenever the bundle is.
"""

import numpy as np

GROUP_SIZE = 32


def quantize(w: np.ndarray, group_size: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a 2-D weight; returns (qw int32 [out][in/8], sc float32 [out][in/G])."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    out_dim, in_dim = w.shape
    if in_dim % group_size or group_size % 8:
        raise ValueError(f"input dim {in_dim} is not a multiple of the group size {group_size}")
    if not np.all(np.isfinite(w)):
        raise ValueError("cannot quantize a weight with inf or nan")
    groups = w.reshape(out_dim, in_dim // group_size, group_size)
    scale = np.max(np.abs(groups), axis=-1) / np.float32(7)
    divisor = np.where(scale == 0, np.float32(1), scale)[..., None]
    levels = np.rint(groups / divisor)
    levels[scale == 0] = 0
    # |w| / s <= 7 up to one float32 rounding, so rint stays within [-7, 7]
    return pack_nibbles(levels.reshape(out_dim, in_dim) + 8), scale.astype(np.float32)


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """The packed int32 weight [out][in/8] of nibbles [out][in] (0..15): nibble k of word j is
    input 8j+k, in bits 4k..4k+3."""
    out_dim, in_dim = nibbles.shape
    grouped = np.asarray(nibbles).astype(np.uint32).reshape(out_dim, in_dim // 8, 8)
    shifts = 4 * np.arange(8, dtype=np.uint32)
    words = np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint32)
    return words.view(np.int32)


def unpack_nibbles(qw: np.ndarray) -> np.ndarray:
    """Nibbles [out][in] (0..15, int64) of a packed int32 weight [out][in/8]."""
    words = np.asarray(qw, dtype=np.int32).view(np.uint32)
    shifts = 4 * np.arange(8, dtype=np.uint32)
    nibbles = (words[..., None] >> shifts) & np.uint32(15)
    return nibbles.reshape(words.shape[0], -1).astype(np.int64)


def dequantize(qw: np.ndarray, sc: np.ndarray, group_size: int = GROUP_SIZE) -> np.ndarray:
    """The float32 weight [out][in] that (qw, sc) stands for: (nibble - 8) * scale in float32."""
    levels = (unpack_nibbles(qw) - 8).astype(np.float32)
    scale = np.repeat(np.asarray(sc, dtype=np.float32), group_size, axis=1)
    return levels * scale


KEEP_FP32_CLASSES = ("dense", "shared")


def weight_class(name: str) -> str | None:
    """The class of an FFN matrix ("dense", "shared" or "routed"), None for any other tensor."""
    if ".ffn." not in name or name.rsplit(".", 1)[-1] not in ("w1", "w2", "w3"):
        return None
    if ".ffn.experts." in name:
        return "routed"
    return "shared" if ".ffn.shared." in name else "dense"


def is_quantized(name: str, keep_fp32=()) -> bool:
    """Whether a tensor is stored INT4 in an int4 bundle whose header keeps the classes
    `keep_fp32` in fp32: every ffn.w1/w2/w3 (dense, routed experts, shared) not kept."""
    cls = weight_class(name)
    return cls is not None and cls not in keep_fp32
