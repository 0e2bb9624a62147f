"""KDTR bundle format, versions 1 and 2: the in-memory writer, the layout plan and the reader.

Both versions, little-endian: offset 0 magic `KDTR`, 4: u32 version, 8: u64 header length n,
16: n bytes of UTF-8 JSON header (compact, keys in the order below), zero fill up to the next
multiple of 64 = D, the data section's start. Header keys: config, quant, drafter, prompt,
golden, tensors (entries name, dtype "f32" | "i32", shape, offset, nbytes), data_bytes, and in
version 1 only data_sha256 (hex sha256 of the data section). Tensors are laid out in table
order, each at the next multiple of 64 (relative to D) after the previous one's end, zero fill
between; data_bytes ends at the last tensor's last byte. Which tensors a header calls for is
`schema.tensor_specs` (the quant.keep_fp32 and drafter.kind extensions included).

Version 1 ends there: the file is exactly D + data_bytes bytes.

Version 2 (for big bundles) adds a trailing index at I = the first multiple of 64 at or after
D + data_bytes (zero fill between): 4 bytes `KDTI`, u32 count (= the number of header tensors),
count x 32 bytes: the raw sha256 of each tensor's nbytes bytes in header tensor order, then 32
bytes: the bundle digest = sha256 of (the file's bytes [0, D) followed by the index's bytes
from `KDTI` up to but not including the digest). The file ends exactly there:
size = I + 8 + 32 count + 32. A bundle's identity (the manifest's `sha256`): version 1 the
sha256 of the whole file, version 2 the bundle digest.

The readers (this one and the engine's) refuse, naming the file and the problem: a wrong magic
or version, a header that is not a JSON object, a missing or unknown top-level key, a bad tensor
entry (unknown dtype, nbytes not matching the shape, an offset not a multiple of 64, a tensor
outside the data section, a layout other than the one above), a missing or extra tensor for the
config, a file shorter or longer than the layout, fill bytes that are not zero, a v1 data_sha256
mismatch, a v2 index magic, count, tensor hash or digest mismatch. `kdtree_ref.stream` writes
version 2 bundles in parallel without holding them in memory.
"""

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .schema import SchemaError, TensorSpec, tensor_specs

MAGIC = b"KDTR"
INDEX_MAGIC = b"KDTI"
VERSIONS = (1, 2)
ALIGN = 64
HASH_BYTES = 32
_PREFIX = struct.Struct("<4sIQ")
_INDEX_HEAD = struct.Struct("<4sI")
_DTYPES = {"f32": np.dtype("<f4"), "i32": np.dtype("<i4")}
_HEADER_KEYS = ("config", "quant", "drafter", "prompt", "golden")
_TABLE_KEYS = {1: ("tensors", "data_bytes", "data_sha256"), 2: ("tensors", "data_bytes")}
_ENTRY_KEYS = ("name", "dtype", "shape", "offset", "nbytes")


class KdtrError(Exception):
    """A bundle that cannot be read or written; the message names the file and the problem."""

    def __init__(self, path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


def align(n: int) -> int:
    """n rounded up to the next multiple of 64."""
    return -(-n // ALIGN) * ALIGN


def _dtype_name(array: np.ndarray) -> str:
    if array.dtype == np.float32:
        return "f32"
    if array.dtype == np.int32:
        return "i32"
    raise TypeError(f"only float32 and int32 tensors can be stored, got {array.dtype}")


def specs_of(tensors: dict[str, np.ndarray]) -> list[TensorSpec]:
    """The specs (name, dtype, shape) of arrays, in their order."""
    return [TensorSpec(name, _dtype_name(a), tuple(int(d) for d in a.shape)) for name, a in tensors.items()]


def _table(specs: list[TensorSpec]) -> tuple[list[dict], int]:
    """The header's tensor table (offsets relative to D) and data_bytes."""
    table, end = [], 0
    for s in specs:
        start = align(end)
        table.append({"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "offset": start, "nbytes": s.nbytes})
        end = start + s.nbytes
    return table, end


def _check_specs(meta: dict, specs: list[TensorSpec]) -> None:
    """A writer never writes what the readers refuse: the specs are exactly the header's tensor set."""
    missing = [k for k in _HEADER_KEYS if k not in meta]
    if missing:
        raise ValueError(f"bundle header lacks {missing}")
    want = {s.name: s for s in tensor_specs(meta)}
    have = {s.name: s for s in specs}
    if len(have) != len(specs):
        raise ValueError("a tensor name is given twice")
    for name in have.keys() | want.keys():
        if have.get(name) != want.get(name):
            raise ValueError(f"tensor {name!r}: given {have.get(name)}, the header calls for {want.get(name)}")


def _prefix(meta: dict, version: int, table: list[dict], data_bytes: int, data_sha256: str | None) -> bytes:
    """The file's bytes [0, D): preamble, compact JSON header, zero fill."""
    header = {k: meta[k] for k in _HEADER_KEYS}
    header.update(tensors=table, data_bytes=data_bytes)
    if version == 1:
        header["data_sha256"] = data_sha256
    text = json.dumps(header, separators=(",", ":")).encode()
    head = _PREFIX.pack(MAGIC, version, len(text)) + text
    return head + b"\0" * (align(len(head)) - len(head))


@dataclass(frozen=True)
class Plan:
    """Where every byte of a version 2 bundle goes, from the header and the tensor specs alone."""

    prefix: bytes                   # the file's bytes [0, D)
    specs: tuple[TensorSpec, ...]   # in header table order
    offsets: tuple[int, ...]        # absolute file offset of each tensor
    index_start: int                # I
    size: int                       # the whole file

    @property
    def data_start(self) -> int:
        return len(self.prefix)

    def find(self, name: str) -> int:
        """The position of tensor `name` in the table; KeyError if the bundle has none."""
        for i, s in enumerate(self.specs):
            if s.name == name:
                return i
        raise KeyError(name)

    def index(self, hashes: list[bytes]) -> bytes:
        """The trailing index for these per-tensor sha256 digests (table order), digest included."""
        if len(hashes) != len(self.specs) or any(len(h) != HASH_BYTES for h in hashes):
            raise ValueError(f"need {len(self.specs)} sha256 digests of {HASH_BYTES} bytes")
        body = _INDEX_HEAD.pack(INDEX_MAGIC, len(hashes)) + b"".join(hashes)
        return body + hashlib.sha256(self.prefix + body).digest()


def plan(meta: dict, specs) -> Plan:
    """The version 2 layout of a bundle with header `meta` and these tensor specs (in table order)."""
    specs = list(specs)
    _check_specs(meta, specs)
    table, data_bytes = _table(specs)
    prefix = _prefix(meta, 2, table, data_bytes, None)
    index_start = align(len(prefix) + data_bytes)
    return Plan(prefix, tuple(specs), tuple(len(prefix) + t["offset"] for t in table), index_start,
                index_start + _INDEX_HEAD.size + HASH_BYTES * len(specs) + HASH_BYTES)


def raw_bytes(array: np.ndarray, spec: TensorSpec) -> memoryview:
    """The little-endian bytes of an array that matches spec (no copy when it is contiguous)."""
    if tuple(array.shape) != spec.shape or _dtype_name(array) != spec.dtype:
        raise ValueError(f"tensor {spec.name!r}: got {array.dtype} {list(array.shape)}, expected {spec.dtype} {list(spec.shape)}")
    return memoryview(np.ascontiguousarray(array, dtype=_DTYPES[spec.dtype]).reshape(-1).view(np.uint8))


def encode(meta: dict, tensors: dict[str, np.ndarray], version: int = 1) -> bytes:
    """The bytes of a bundle: `meta` holds config, quant, drafter, prompt and golden."""
    if version not in VERSIONS:
        raise ValueError(f"unknown format version {version}")
    specs = specs_of(tensors)
    _check_specs(meta, specs)
    table, data_bytes = _table(specs)
    data = bytearray(data_bytes)
    raws = [raw_bytes(a, s) for a, s in zip(tensors.values(), specs)]
    for t, raw in zip(table, raws):
        data[t["offset"]:t["offset"] + t["nbytes"]] = raw
    if version == 1:
        return _prefix(meta, 1, table, data_bytes, hashlib.sha256(data).hexdigest()) + bytes(data)
    p = plan(meta, specs)
    fill = b"\0" * (p.index_start - p.data_start - data_bytes)
    return p.prefix + bytes(data) + fill + p.index([hashlib.sha256(r).digest() for r in raws])


def write(path, meta: dict, tensors: dict[str, np.ndarray], version: int = 1) -> str:
    """Write a bundle; returns its identity (version 1: the file's sha256, 2: the bundle digest)."""
    blob = encode(meta, tensors, version)
    Path(path).write_bytes(blob)
    return identity_of(blob)


def identity_of(blob) -> str:
    """The identity of well-formed bundle bytes: v1 the sha256 of them all, v2 the stored digest."""
    version = struct.unpack_from("<I", blob, 4)[0]
    return hashlib.sha256(blob).hexdigest() if version == 1 else bytes(blob[-HASH_BYTES:]).hex()


# ---- reading ----------------------------------------------------------------------------------

class _Tensors(Mapping):
    """Tensors by name, as read-only arrays into the file; a v2 tensor's hash is checked on first
    access when the bundle was read lazily."""

    def __init__(self, path, buf, entries: dict[str, dict], hashes: dict[str, bytes]):
        self._path, self._buf, self._entries, self._unchecked = path, buf, entries, dict(hashes)

    def __getitem__(self, name: str) -> np.ndarray:
        e = self._entries[name]
        if name in self._unchecked:
            _check_hash(self._path, self._buf, e, self._unchecked[name])
            del self._unchecked[name]
        array = np.frombuffer(self._buf, dtype=_DTYPES[e["dtype"]], count=e["nbytes"] // 4, offset=e["start"])
        return array.reshape(e["shape"])

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _check_hash(path, buf, entry: dict, want: bytes) -> None:
    got = hashlib.sha256(buf[entry["start"]:entry["start"] + entry["nbytes"]]).digest()
    if got != want:
        raise KdtrError(path, f"tensor {entry['name']!r}: sha256 {got.hex()[:16]}... differs from the index's "
                              f"{want.hex()[:16]}...")


@dataclass
class Bundle:
    """A bundle read back: its header (dict), version, and tensors by name (read-only arrays)."""

    path: str
    header: dict
    tensors: Mapping
    version: int = 1
    _buf: object = field(default=None, repr=False)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name`; a KdtrError naming the file if the bundle lacks it."""
        try:
            return self.tensors[name]
        except KeyError:
            raise KdtrError(self.path, f"missing tensor {name!r}") from None

    def identity(self) -> str:
        """The manifest's `sha256` of this bundle: v1 the whole file's sha256, v2 the bundle digest."""
        return identity_of(self._buf)


def _header(path, buf) -> tuple[int, dict, int]:
    """(version, header, D) from the preamble and header, checked."""
    if len(buf) < _PREFIX.size:
        raise KdtrError(path, f"truncated file: {len(buf)} bytes, shorter than the 16-byte prefix")
    magic, version, n = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise KdtrError(path, f"wrong magic {magic!r}, expected {MAGIC!r}: not a KDTR bundle")
    if version not in VERSIONS:
        raise KdtrError(path, f"unsupported version {version}, this reader knows {', '.join(map(str, VERSIONS))}")
    if _PREFIX.size + n > len(buf):
        raise KdtrError(path, f"truncated file: header of {n} bytes runs past the end ({len(buf)} bytes)")
    try:
        header = json.loads(bytes(buf[_PREFIX.size:_PREFIX.size + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KdtrError(path, f"bad JSON header: {err}") from None
    if not isinstance(header, dict):
        raise KdtrError(path, "bad JSON header: not an object")
    known = _HEADER_KEYS + _TABLE_KEYS[version]
    for key in known:
        if key not in header:
            raise KdtrError(path, f"bad header: missing key {key!r}")
    unknown = sorted(set(header) - set(known))
    if unknown:
        raise KdtrError(path, f"bad header: unknown key {unknown[0]!r} in a version {version} header")
    return version, header, align(_PREFIX.size + n)


def _nonneg_int(value) -> bool:
    return type(value) is int and value >= 0


def _entries(path, header: dict, data_start: int) -> dict[str, dict]:
    """The tensor table checked entry by entry; entries gain `start` (their file offset)."""
    size = header["data_bytes"]
    if not _nonneg_int(size):
        raise KdtrError(path, f"bad header: data_bytes {size!r} is not a non-negative integer")
    if not isinstance(header["tensors"], list):
        raise KdtrError(path, "bad header: tensors is not a list")
    entries = {}
    for entry in header["tensors"]:
        if not isinstance(entry, dict):
            raise KdtrError(path, f"bad header: tensor entry {entry!r} is not an object")
        name = entry.get("name")
        missing = [k for k in _ENTRY_KEYS if k not in entry]
        if missing:
            raise KdtrError(path, f"bad header: tensor entry {name!r} lacks {missing}")
        unknown = sorted(set(entry) - set(_ENTRY_KEYS))
        if unknown or not isinstance(name, str) or name in entries:
            raise KdtrError(path, f"bad header: tensor entry {name!r}: unknown key, bad name or listed twice")
        dtype, shape, offset, nbytes = entry["dtype"], entry["shape"], entry["offset"], entry["nbytes"]
        if dtype not in _DTYPES:
            raise KdtrError(path, f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(map(_nonneg_int, shape)) or not _nonneg_int(nbytes):
            raise KdtrError(path, f"tensor {name!r}: shape {shape!r} or nbytes {nbytes!r} is not made of non-negative integers")
        if nbytes != 4 * int(np.prod(shape, dtype=object)):
            raise KdtrError(path, f"tensor {name!r}: nbytes {nbytes} does not match shape {shape}")
        if not _nonneg_int(offset) or offset % ALIGN:
            raise KdtrError(path, f"tensor {name!r}: offset {offset!r} is not a multiple of {ALIGN}")
        if offset + nbytes > size:
            raise KdtrError(path, f"tensor {name!r} out of bounds: [{offset}, {offset + nbytes}) "
                                  f"outside the {size}-byte data section")
        entries[name] = dict(entry, start=data_start + offset)
    return entries


def _check_layout(path, header: dict, entries: dict[str, dict]) -> None:
    """Tensors follow each other in table order, each at the next multiple of 64; data_bytes ends at the last."""
    end = 0
    for name, e in entries.items():
        if e["offset"] != align(end):
            raise KdtrError(path, f"tensor {name!r}: offset {e['offset']}, the layout puts it at {align(end)} "
                                  "(tensors follow each other in table order, 64-aligned)")
        end = e["offset"] + e["nbytes"]
    if header["data_bytes"] != end:
        raise KdtrError(path, f"bad header: data_bytes {header['data_bytes']}, the last tensor ends at {end}")


def _check_tensor_set(path, header: dict, entries: dict[str, dict]) -> None:
    try:
        want = tensor_specs(header)
    except SchemaError as err:
        raise KdtrError(path, f"bad header: {err}") from None
    names = set()
    for spec in want:
        e = entries.get(spec.name)
        if e is None:
            raise KdtrError(path, f"missing tensor {spec.name!r}: the config calls for {spec.dtype} {list(spec.shape)}")
        if (e["dtype"], tuple(e["shape"])) != (spec.dtype, spec.shape):
            raise KdtrError(path, f"tensor {spec.name!r} is {e['dtype']} {e['shape']}, the config calls for "
                                  f"{spec.dtype} {list(spec.shape)}")
        names.add(spec.name)
    extra = [n for n in entries if n not in names]
    if extra:
        raise KdtrError(path, f"extra tensor {extra[0]!r}: not in the config's tensor set")


def _check_zero(path, buf, start: int, end: int, what: str) -> None:
    if any(bytes(buf[start:end])):
        raise KdtrError(path, f"nonzero fill byte in {what} [{start}, {end})")


def _check_size(path, buf, need: int) -> None:
    if len(buf) < need:
        raise KdtrError(path, f"truncated file: the layout needs {need} bytes, the file has {len(buf)}")
    if len(buf) > need:
        raise KdtrError(path, f"{len(buf) - need} bytes after the end of the layout ({need} bytes): the file is longer "
                              "than its header says")


def _index(path, buf, data_end: int, count: int) -> list[bytes]:
    """The v2 index's per-tensor hashes, after its placement, magic, count, size and digest are checked."""
    start = align(data_end)
    if len(buf) < start + _INDEX_HEAD.size:
        raise KdtrError(path, f"truncated file: the index starts at {start}, the file has {len(buf)} bytes")
    _check_zero(path, buf, data_end, start, "the fill before the index")
    magic, stored = _INDEX_HEAD.unpack_from(buf, start)
    if magic != INDEX_MAGIC:
        raise KdtrError(path, f"bad index magic {bytes(magic)!r} at {start}, expected {INDEX_MAGIC!r}")
    if stored != count:
        raise KdtrError(path, f"index count mismatch: the index holds {stored} hashes, the header lists {count} tensors")
    body_end = start + _INDEX_HEAD.size + HASH_BYTES * count
    _check_size(path, buf, body_end + HASH_BYTES)
    return [bytes(buf[start + 8 + HASH_BYTES * i:start + 8 + HASH_BYTES * (i + 1)]) for i in range(count)]


def _check_digest(path, buf, data_start: int, index_start: int) -> None:
    digest = hashlib.sha256()
    digest.update(buf[:data_start])
    digest.update(buf[index_start:len(buf) - HASH_BYTES])
    if digest.digest() != bytes(buf[-HASH_BYTES:]):
        raise KdtrError(path, "bundle digest mismatch: the index's digest differs from the sha256 of the header and index")


def decode(blob, path="<bytes>", verify: bool = True, lazy: bool = False) -> Bundle:
    """Parse and check bundle bytes (any buffer); errors name `path`. verify checks the hashes: v1's
    data_sha256 now; v2's digest now and each tensor's hash now, or on its first access if lazy."""
    buf = memoryview(blob).cast("B") if not isinstance(blob, bytes) else blob
    version, header, data_start = _header(path, buf)
    entries = _entries(path, header, data_start)
    _check_tensor_set(path, header, entries)
    _check_layout(path, header, entries)
    _check_zero(path, buf, _PREFIX.size + struct.unpack_from("<Q", buf, 8)[0], data_start, "the header's fill")
    data_end = data_start + header["data_bytes"]
    ordered = list(entries.values())
    for before, after in zip([None] + ordered, ordered + [None]):
        gap_start = before["start"] + before["nbytes"] if before else data_start
        _check_zero(path, buf, min(gap_start, len(buf)), min(after["start"] if after else data_end, len(buf)),
                    "the data section's fill")
    hashes: dict[str, bytes] = {}
    if version == 1:
        _check_size(path, buf, data_end)
        if verify and hashlib.sha256(buf[data_start:data_end]).hexdigest() != header["data_sha256"]:
            raise KdtrError(path, "checksum mismatch: data section sha256 differs from data_sha256")
    else:
        stored = _index(path, buf, data_end, len(ordered))
        if verify:
            _check_digest(path, buf, data_start, align(data_end))
            hashes = {e["name"]: h for e, h in zip(ordered, stored)}
            if not lazy:
                with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                    list(pool.map(lambda e: _check_hash(path, buf, e, hashes[e["name"]]), ordered))
                hashes = {}
    return Bundle(str(path), header, _Tensors(str(path), buf, entries, hashes), version, buf)


def read(path, verify: bool = True, lazy: bool = False) -> Bundle:
    """Read and check a bundle file (mapped, not copied into memory); see decode for verify and lazy."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except (OSError, ValueError) as err:
        raise KdtrError(path, f"cannot read: {getattr(err, 'strerror', None) or err}") from None
    return decode(buf, path, verify, lazy)
