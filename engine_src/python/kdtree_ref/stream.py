"""Parallel writer of version 2 KDTR bundles (format: kdtr.py) too big to hold in memory.

The layout comes from the header and the tensor specs alone (`kdtr.plan`), so any number of
processes can write one bundle at once, each on its own file descriptor with os.pwrite:

    p = kdtr.plan(meta, specs)                  # once; a Plan is picklable
    stream.create(path, p)                      # once: the file at its final size (sparse), header written
    with stream.Part(path, p) as part:          # in every worker process
        digest = part.write(name, array)        # a whole tensor, its sha256 returned
        sink = part.rows(name)                  # or a tensor row block by row block, in order,
        sink.write(rows); digest = sink.close() #   hashed as it goes
        part.write_rows(name, first_row, rows)  # or rows at any place, from any process; then
        digest = part.hash(name)                #   whoever finishes the tensor hashes it back from the file
    stream.finish(path, p, digests)             # once: the index and the bundle digest, written last

Until finish has written the index, zeros stand where it goes, and every reader refuses the file.
"""

import hashlib
import os

import numpy as np

from .kdtr import HASH_BYTES, KdtrError, Plan, raw_bytes
from .schema import TensorSpec

_CHUNK = 64 << 20  # bytes per pwrite / pread call (Linux moves at most about 2 GiB per call)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:done + _CHUNK], offset + done)


def create(path, plan: Plan) -> None:
    """Create (or truncate) the bundle file at its final size, sparse, with its header written."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, plan.size)
        _pwrite_all(fd, memoryview(plan.prefix), 0)
    finally:
        os.close(fd)


class RowSink:
    """One tensor written in row blocks, in order, and hashed as they are written (to the file
    descriptor `fd` at the tensor's place in `plan`; fd None: hashed only, written nowhere)."""

    def __init__(self, plan: Plan, index: int, fd: int | None = None):
        self._plan, self._index, self._fd = plan, index, fd
        self._spec = plan.specs[index]
        self._done = 0
        self._sha = hashlib.sha256()

    def write(self, rows: np.ndarray) -> None:
        """Append rows (shape [k] + the tensor's shape[1:]) after the ones written so far."""
        spec = self._spec
        raw = raw_bytes(rows, TensorSpec(spec.name, spec.dtype, (rows.shape[0],) + spec.shape[1:]))
        if self._done + len(raw) > spec.nbytes:
            raise ValueError(f"tensor {spec.name!r}: rows past its {spec.nbytes} bytes")
        if self._fd is not None:
            _pwrite_all(self._fd, raw, self._plan.offsets[self._index] + self._done)
        self._sha.update(raw)
        self._done += len(raw)

    def close(self) -> bytes:
        """The tensor's sha256, once every row is written."""
        if self._done != self._spec.nbytes:
            raise ValueError(f"tensor {self._spec.name!r}: {self._done} of its {self._spec.nbytes} bytes written")
        return self._sha.digest()


class Part:
    """One process's handle on a bundle being written (its own file descriptor)."""

    def __init__(self, path, plan: Plan):
        self.path, self.plan = str(path), plan
        self.fd = os.open(path, os.O_RDWR)
        size = os.fstat(self.fd).st_size
        if size != plan.size:
            os.close(self.fd)
            raise KdtrError(path, f"is {size} bytes, the plan says {plan.size}: not created by stream.create for this plan")

    def __enter__(self) -> "Part":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the file descriptor."""
        os.close(self.fd)

    def write(self, name: str, array: np.ndarray) -> bytes:
        """Write a whole tensor at its offset; returns its sha256."""
        sink = self.rows(name)
        sink.write(array.reshape((1,) + array.shape) if array.ndim == 0 else array)
        return sink.close()

    def rows(self, name: str) -> RowSink:
        """A sink that writes tensor `name` row block by row block, in order, hashing as it goes."""
        return RowSink(self.plan, self.plan.find(name), self.fd)

    def write_rows(self, name: str, first_row: int, rows: np.ndarray) -> None:
        """Write rows [first_row, first_row + len(rows)) of tensor `name` (no hash: see hash)."""
        i = self.plan.find(name)
        spec = self.plan.specs[i]
        raw = raw_bytes(rows, TensorSpec(spec.name, spec.dtype, (rows.shape[0],) + spec.shape[1:]))
        row_bytes = spec.nbytes // spec.shape[0] if spec.shape and spec.shape[0] else 0
        if first_row < 0 or first_row * row_bytes + len(raw) > spec.nbytes:
            raise ValueError(f"tensor {name!r}: rows [{first_row}, {first_row + rows.shape[0]}) outside its {spec.shape[0]} rows")
        _pwrite_all(self.fd, raw, self.plan.offsets[i] + first_row * row_bytes)

    def hash(self, name: str) -> bytes:
        """The sha256 of tensor `name` as the file holds it now (read back)."""
        i = self.plan.find(name)
        sha, offset, left = hashlib.sha256(), self.plan.offsets[i], self.plan.specs[i].nbytes
        while left:
            chunk = os.pread(self.fd, min(left, _CHUNK), offset)
            if not chunk:
                raise KdtrError(self.path, f"tensor {name!r}: the file ends inside it")
            sha.update(chunk)
            offset += len(chunk)
            left -= len(chunk)
        return sha.digest()


def finish(path, plan: Plan, digests: dict[str, bytes]) -> str:
    """Write the index (every tensor's sha256, by name) and the digest; returns the bundle's identity (hex)."""
    names = [s.name for s in plan.specs]
    unknown = sorted(set(digests) - set(names))
    missing = [n for n in names if n not in digests]
    if unknown or missing:
        raise ValueError(f"digests: missing {missing[:3]}, unknown {unknown[:3]}")
    index = plan.index([digests[n] for n in names])
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != plan.size:
            raise KdtrError(path, f"is not {plan.size} bytes as its plan says")
        _pwrite_all(fd, memoryview(index), plan.index_start)
        os.fsync(fd)
    finally:
        os.close(fd)
    return index[-HASH_BYTES:].hex()
