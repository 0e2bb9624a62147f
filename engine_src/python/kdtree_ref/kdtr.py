"""KDTR bundle format, version 1 (engine_src/README.md, "KDTR bundle format").

Layout, little-endian: magic `KDTR`, u32 version, u64 header length n, n bytes of UTF-8 JSON
header, zero padding up to a multiple of 64, then the data section. Tensor offsets are relative
to the data section and multiples of 64; `data_sha256` is the sha256 of the data section.
"""

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"KDTR"
VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<4sIQ")
_DTYPES = {"f32": np.dtype("<f4"), "i32": np.dtype("<i4")}
_HEADER_KEYS = ("config", "quant", "drafter", "prompt", "golden")


class KdtrError(Exception):
    """A bundle that cannot be read or written; the message names the file and the problem."""

    def __init__(self, path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype_name(array: np.ndarray) -> str:
    if array.dtype == np.float32:
        return "f32"
    if array.dtype == np.int32:
        return "i32"
    raise TypeError(f"only float32 and int32 tensors can be stored, got {array.dtype}")


def encode(meta: dict, tensors: dict[str, np.ndarray]) -> bytes:
    """The bytes of a bundle: `meta` holds config, quant, drafter, prompt and golden."""
    missing = [k for k in _HEADER_KEYS if k not in meta]
    if missing:
        raise ValueError(f"bundle header lacks {missing}")
    table, chunks, offset = [], [], 0
    for name, array in tensors.items():
        dtype = _dtype_name(array)
        raw = np.ascontiguousarray(array, dtype=_DTYPES[dtype]).tobytes()
        start = _align(offset)
        chunks.append(b"\0" * (start - offset) + raw)
        table.append({"name": name, "dtype": dtype, "shape": list(array.shape),
                      "offset": start, "nbytes": len(raw)})
        offset = start + len(raw)
    data = b"".join(chunks)
    header = {k: meta[k] for k in _HEADER_KEYS}
    header.update(tensors=table, data_bytes=len(data), data_sha256=hashlib.sha256(data).hexdigest())
    text = json.dumps(header, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, VERSION, len(text))
    pad = _align(len(prefix) + len(text)) - len(prefix) - len(text)
    return prefix + text + b"\0" * pad + data


def write(path, meta: dict, tensors: dict[str, np.ndarray]) -> str:
    """Write a bundle; returns the sha256 of the file."""
    blob = encode(meta, tensors)
    Path(path).write_bytes(blob)
    return hashlib.sha256(blob).hexdigest()


@dataclass
class Bundle:
    """A bundle read back: its header (dict) and tensors by name (read-only arrays)."""

    path: str
    header: dict
    tensors: dict[str, np.ndarray]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name`; a KdtrError naming the file if the bundle lacks it."""
        try:
            return self.tensors[name]
        except KeyError:
            raise KdtrError(self.path, f"missing tensor {name!r}") from None


def decode(blob: bytes, path="<bytes>", verify: bool = True) -> Bundle:
    """Parse bundle bytes; errors name `path`. verify checks the data sha256."""
    if len(blob) < _PREFIX.size:
        raise KdtrError(path, f"truncated file: {len(blob)} bytes, shorter than the 16-byte prefix")
    magic, version, n = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise KdtrError(path, f"wrong magic {magic!r}, expected {MAGIC!r}: not a KDTR bundle")
    if version != VERSION:
        raise KdtrError(path, f"unsupported version {version}, this reader knows {VERSION}")
    if _PREFIX.size + n > len(blob):
        raise KdtrError(path, f"truncated file: header of {n} bytes runs past the end ({len(blob)} bytes)")
    try:
        header = json.loads(blob[_PREFIX.size:_PREFIX.size + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KdtrError(path, f"bad JSON header: {err}") from None
    if not isinstance(header, dict):
        raise KdtrError(path, "bad JSON header: not an object")
    for key in _HEADER_KEYS + ("tensors", "data_bytes", "data_sha256"):
        if key not in header:
            raise KdtrError(path, f"bad header: missing key {key!r}")
    start = _align(_PREFIX.size + n)
    size = header["data_bytes"]
    if start + size > len(blob):
        raise KdtrError(path, f"truncated file: data section needs {start + size} bytes, file has {len(blob)}")
    data = blob[start:start + size]
    if verify and hashlib.sha256(data).hexdigest() != header["data_sha256"]:
        raise KdtrError(path, "checksum mismatch: data section sha256 differs from data_sha256")
    tensors = {}
    for entry in header["tensors"]:
        missing = [k for k in ("name", "dtype", "shape", "offset", "nbytes") if k not in entry]
        if missing:
            raise KdtrError(path, f"bad header: tensor entry {entry.get('name')!r} lacks {missing}")
        name = entry["name"]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise KdtrError(path, f"tensor {name!r}: unknown dtype {entry['dtype']!r}")
        shape, offset, nbytes = tuple(entry["shape"]), entry["offset"], entry["nbytes"]
        if nbytes != 4 * int(np.prod(shape, dtype=np.int64)):
            raise KdtrError(path, f"tensor {name!r}: nbytes {nbytes} does not match shape {list(shape)}")
        if offset % ALIGN:
            raise KdtrError(path, f"tensor {name!r}: offset {offset} is not a multiple of {ALIGN}")
        if offset < 0 or offset + nbytes > size:
            raise KdtrError(path, f"tensor {name!r} out of bounds: [{offset}, {offset + nbytes}) "
                                  f"outside the {size}-byte data section")
        tensors[name] = np.frombuffer(data, dtype=dtype, count=nbytes // 4, offset=offset).reshape(shape)
    return Bundle(str(path), header, tensors)


def read(path, verify: bool = True) -> Bundle:
    """Read and check a bundle file."""
    try:
        blob = Path(path).read_bytes()
    except OSError as err:
        raise KdtrError(path, f"cannot read: {err.strerror}") from None
    return decode(blob, path, verify)
