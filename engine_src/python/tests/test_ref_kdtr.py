import hashlib
import json
import struct

import numpy as np
import pytest

from kdtree_ref import kdtr

META = {"config": {"name": "t"}, "quant": {"type": "fp32"}, "drafter": {"block_size": 2, "mask_token": 3},
        "prompt": [1, 2], "golden": [3, 4]}


def tensors():
    return {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
            "b.qw": np.array([[-1, 0x12345678]], dtype=np.int32),
            "c": np.ones((5,), dtype=np.float32)}


@pytest.fixture
def blob():
    return kdtr.encode(META, tensors())


def read_bytes(tmp_path, data: bytes):
    path = tmp_path / "x.kdtr"
    path.write_bytes(data)
    return kdtr.read(path), path


def test_round_trip(tmp_path):
    path = tmp_path / "m.kdtr"
    sha = kdtr.write(path, META, tensors())
    b = kdtr.read(path)
    for key, value in META.items():
        assert b.header[key] == value
    for name, value in tensors().items():
        np.testing.assert_array_equal(b.tensor(name), value)
        assert b.tensor(name).dtype == value.dtype
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()


def test_layout(blob):
    magic, version, n = struct.unpack_from("<4sIQ", blob)
    assert (magic, version) == (b"KDTR", 1)
    header = json.loads(blob[16:16 + n])
    start = -(-(16 + n) // 64) * 64
    assert blob[16 + n:start] == b"\0" * (start - 16 - n)
    assert len(blob) == start + header["data_bytes"]
    for entry in header["tensors"]:
        assert entry["offset"] % 64 == 0
        assert entry["nbytes"] == 4 * int(np.prod(entry["shape"]))
    b = header["tensors"][1]
    assert b["dtype"] == "i32"
    words = np.frombuffer(blob, "<i4", 2, start + b["offset"])
    assert list(words) == [-1, 0x12345678]


def test_encoding_is_deterministic():
    assert kdtr.encode(META, tensors()) == kdtr.encode(META, tensors())


def expect_error(tmp_path, data, *fragments):
    with pytest.raises(kdtr.KdtrError) as err:
        read_bytes(tmp_path, data)
    message = str(err.value)
    assert str(tmp_path / "x.kdtr") in message
    for fragment in fragments:
        assert fragment in message


def test_wrong_magic(tmp_path, blob):
    expect_error(tmp_path, b"GGUF" + blob[4:], "wrong magic")


def test_wrong_version(tmp_path, blob):
    expect_error(tmp_path, blob[:4] + struct.pack("<I", 2) + blob[8:], "version 2")


def test_bad_json_header(tmp_path, blob):
    n = struct.unpack_from("<Q", blob, 8)[0]
    expect_error(tmp_path, blob[:16] + b"{" * n + blob[16 + n:], "bad JSON header")


def test_header_without_a_key(tmp_path):
    text = json.dumps({"config": {}}).encode()
    expect_error(tmp_path, struct.pack("<4sIQ", b"KDTR", 1, len(text)) + text, "missing key")


@pytest.mark.parametrize("keep", [0, 10, 40, -1])
def test_truncated_file(tmp_path, blob, keep):
    expect_error(tmp_path, blob[:keep] if keep >= 0 else blob[:-4], "truncated")


def test_checksum_mismatch(tmp_path, blob):
    corrupt = bytearray(blob)
    corrupt[-1] ^= 1
    expect_error(tmp_path, bytes(corrupt), "checksum mismatch")
    assert kdtr.decode(bytes(corrupt), verify=False).tensors["c"][-1] != 1.0


def rewrite_header(blob, edit):
    """The blob with its header edited by `edit(header)`, keeping the data section in place."""
    n = struct.unpack_from("<Q", blob, 8)[0]
    header = json.loads(blob[16:16 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))     # same length: the data section does not move
    assert len(text) == n
    return blob[:16] + text + blob[16 + n:]


def test_tensor_out_of_bounds(tmp_path, blob):
    def edit(h):
        assert h["tensors"][2]["offset"] == 128
        h["tensors"][2]["offset"] = 192       # aligned, but past the 148-byte data section
    expect_error(tmp_path, rewrite_header(blob, edit), "'c' out of bounds")


def test_tensor_shape_mismatch(tmp_path, blob):
    def edit(h):
        h["tensors"][2]["shape"] = [6]
    expect_error(tmp_path, rewrite_header(blob, edit), "'c'", "does not match shape")


def test_tensor_entry_without_a_key(tmp_path, blob):
    def edit(h):
        del h["tensors"][1]["offset"]
    expect_error(tmp_path, rewrite_header(blob, edit), "'b.qw' lacks ['offset']")


def test_unknown_dtype(tmp_path, blob):
    def edit(h):
        h["tensors"][0]["dtype"] = "f16"
    expect_error(tmp_path, rewrite_header(blob, edit), "'a': unknown dtype 'f16'")


def test_missing_tensor(tmp_path, blob):
    b, path = read_bytes(tmp_path, blob)
    with pytest.raises(kdtr.KdtrError) as err:
        b.tensor("head")
    assert str(path) in str(err.value) and "missing tensor 'head'" in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(kdtr.KdtrError, match="cannot read"):
        kdtr.read(tmp_path / "nope.kdtr")


def test_writer_rejects_other_dtypes():
    with pytest.raises(TypeError):
        kdtr.encode(META, {"x": np.zeros(3)})
    with pytest.raises(ValueError, match="lacks"):
        kdtr.encode({"config": {}}, {})
