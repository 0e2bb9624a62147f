import hashlib
import json
import struct

import numpy as np
import pytest

from kdtree_ref import kdtr, schema

# A small config with every kind of tensor: a dense layer, an MoE layer with two routed experts
# and a shared expert, widths that INT4 accepts (multiples of 32).
CONFIG = {"name": "t", "vocab_size": 16, "dim": 32, "n_layers": 2, "n_dense_layers": 1, "n_heads": 2,
          "q_lora_rank": 0, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
          "inter_dim": 32, "moe_inter_dim": 32, "n_routed_experts": 2, "n_shared_experts": 1,
          "n_activated_experts": 1, "n_expert_groups": 1, "n_limited_groups": 1, "route_scale": 1.0,
          "rope_theta": 10000.0, "norm_eps": 1e-6, "max_seq_len": 32}
META = {"config": CONFIG, "quant": {"type": "fp32"}, "drafter": {"block_size": 2, "mask_token": 15},
        "prompt": [1, 2], "golden": [3, 4]}
INT4 = dict(META, quant={"type": "int4", "group_size": 32, "keep_fp32": ["shared"]})
LOWRANK = dict(META, drafter={"block_size": 2, "mask_token": 15, "kind": "lowrank_head", "rank": 3})


def make_tensors(meta, seed=0) -> dict[str, np.ndarray]:
    """Random tensors of exactly the header's tensor set."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in schema.tensor_specs(meta):
        if s.dtype == "f32":
            out[s.name] = rng.standard_normal(s.shape).astype(np.float32)
        else:
            out[s.name] = rng.integers(-2**31, 2**31, s.shape, dtype=np.int64).astype(np.int32)
    return out


@pytest.fixture(params=[1, 2])
def version(request):
    return request.param


def read_bytes(tmp_path, data: bytes, **kw):
    path = tmp_path / "x.kdtr"
    path.write_bytes(data)
    return kdtr.read(path, **kw), path


@pytest.mark.parametrize("meta", [META, INT4, LOWRANK], ids=["fp32", "int4_keep_shared", "lowrank_drafter"])
def test_round_trip(tmp_path, meta, version):
    tensors = make_tensors(meta)
    path = tmp_path / "m.kdtr"
    identity = kdtr.write(path, meta, tensors, version)
    for lazy in (False, True):
        b = kdtr.read(path, lazy=lazy)
        assert b.version == version
        for key, value in meta.items():
            assert b.header[key] == value
        assert list(b.tensors) == list(tensors)
        for name, value in tensors.items():
            np.testing.assert_array_equal(b.tensor(name), value)
            assert b.tensor(name).dtype == value.dtype
        assert b.identity() == identity
    blob = path.read_bytes()
    assert identity == (hashlib.sha256(blob).hexdigest() if version == 1 else blob[-32:].hex())


def test_int4_keep_fp32_and_lowrank_tensor_sets():
    names = {s.name: s for s in schema.tensor_specs(INT4)}
    assert names["layers.0.ffn.w1.qw"].shape == (32, 4) and names["layers.0.ffn.w1.sc"].shape == (32, 1)
    assert "layers.1.ffn.shared.w2" in names and "layers.1.ffn.shared.w2.qw" not in names
    assert "layers.1.ffn.experts.1.w3.qw" in names and "layers.0.attn.wo" in names
    both = {s.name for s in schema.tensor_specs(dict(INT4, quant={"type": "int4", "keep_fp32": ["dense", "shared"]}))}
    assert "layers.0.ffn.w1" in both and "layers.1.ffn.experts.0.w1.qw" in both
    low = {s.name: s.shape for s in schema.tensor_specs(LOWRANK)}
    assert (low["drafter.v"], low["drafter.u"], low["drafter.b"]) == ((3, 64), (2, 32, 3), (2, 16))
    assert "drafter.w" not in low


def test_layout(version):
    blob = kdtr.encode(META, make_tensors(META), version)
    magic, got_version, n = struct.unpack_from("<4sIQ", blob)
    assert (magic, got_version) == (b"KDTR", version)
    header = json.loads(blob[16:16 + n])
    start = -(-(16 + n) // 64) * 64
    assert blob[16 + n:start] == b"\0" * (start - 16 - n)
    assert ("data_sha256" in header) == (version == 1)
    end, data = 0, blob[start:start + header["data_bytes"]]
    for entry in header["tensors"]:
        assert entry["offset"] == -(-end // 64) * 64 and data[end:entry["offset"]] == b"\0" * (entry["offset"] - end)
        assert entry["nbytes"] == 4 * int(np.prod(entry["shape"]))
        end = entry["offset"] + entry["nbytes"]
    assert end == header["data_bytes"]
    if version == 1:
        assert len(blob) == start + end and header["data_sha256"] == hashlib.sha256(data).hexdigest()
        return
    index = -(-(start + end) // 64) * 64
    count = len(header["tensors"])
    assert blob[start + end:index] == b"\0" * (index - start - end)
    assert blob[index:index + 8] == b"KDTI" + struct.pack("<I", count)
    assert len(blob) == index + 8 + 32 * count + 32
    for i, entry in enumerate(header["tensors"]):
        raw = data[entry["offset"]:entry["offset"] + entry["nbytes"]]
        assert blob[index + 8 + 32 * i:index + 40 + 32 * i] == hashlib.sha256(raw).digest()
    assert blob[-32:] == hashlib.sha256(blob[:start] + blob[index:-32]).digest()


def test_encoding_is_deterministic(version):
    assert kdtr.encode(META, make_tensors(META), version) == kdtr.encode(META, make_tensors(META), version)


def test_writer_refuses_what_readers_refuse():
    tensors = make_tensors(META)
    with pytest.raises(TypeError):
        kdtr.encode(META, dict(tensors, embed=np.zeros((16, 32))))
    with pytest.raises(ValueError, match="lacks"):
        kdtr.encode({"config": {}}, {})
    with pytest.raises(ValueError, match="'head'"):
        kdtr.encode(META, {k: v for k, v in tensors.items() if k != "head"})
    with pytest.raises(ValueError, match="'layers.2.attn_norm'"):
        kdtr.encode(META, dict(tensors, **{"layers.2.attn_norm": np.ones(32, np.float32)}))


# ---- every reader error of the format, one case each, on both versions where it applies ------

def header_of(blob):
    n = struct.unpack_from("<Q", blob, 8)[0]
    return json.loads(blob[16:16 + n]), n


def rewrite_header(blob, edit):
    """The blob with its header edited by `edit(header)`, the data (and v2 index) moved along and a
    v2 digest recomputed, so that the edit is the only thing wrong with it."""
    header, n = header_of(blob)
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    prefix = blob[:8] + struct.pack("<Q", len(text)) + text
    prefix += b"\0" * (-len(prefix) % 64)
    out = prefix + blob[-(-(16 + n) // 64) * 64:]
    if struct.unpack_from("<I", blob, 4)[0] == 2:
        out = out[:-32] + hashlib.sha256(prefix + out[index_at(blob) - len(blob) + len(out):-32]).digest()
    return out


def set_tensor(name, key, value):
    def edit(h):
        next(t for t in h["tensors"] if t["name"] == name)[key] = value
    return edit


def index_at(blob):
    return -(-data_end(blob) // 64) * 64


def data_end(blob):
    header, n = header_of(blob)
    return -(-(16 + n) // 64) * 64 + header["data_bytes"]


def flip(blob, at):
    out = bytearray(blob)
    out[at] ^= 1
    return bytes(out)


def drop_key(key):
    def edit(h):
        del h[key]
    return edit


def add_key(key):
    def edit(h):
        del h["golden"]
        h["golden"], h[key] = [3, 4], 1
    return edit


def shorten_tensor_list(h):
    h["tensors"] = [t for t in h["tensors"] if t["name"] != "drafter.b"]
    h["data_bytes"] = h["tensors"][-1]["offset"] + h["tensors"][-1]["nbytes"]


CASES = {  # name: (versions, blob -> corrupted blob, message fragments)
    "wrong_magic": ((1, 2), lambda b: b"GGUF" + b[4:], ["wrong magic"]),
    "wrong_version": ((1, 2), lambda b: b[:4] + struct.pack("<I", 3) + b[8:], ["unsupported version 3"]),
    "header_not_json": ((1, 2), lambda b: b[:16] + b"{" * header_of(b)[1] + b[16 + header_of(b)[1]:], ["bad JSON header"]),
    "header_not_an_object": ((1, 2), lambda b: b[:16] + b"[" + b" " * (header_of(b)[1] - 2) + b"]" + b[16 + header_of(b)[1]:],
                             ["not an object"]),
    "missing_key": ((1, 2), lambda b: rewrite_header(b, drop_key("golden")), ["missing key 'golden'"]),
    "unknown_key": ((1, 2), lambda b: rewrite_header(b, add_key("extra")), ["unknown key 'extra'"]),
    "v2_with_data_sha256": ((2,), lambda b: rewrite_header(b, add_key("data_sha256")), ["unknown key 'data_sha256'"]),
    "tensor_outside_data": ((1, 2), lambda b: rewrite_header(b, set_tensor("drafter.b", "offset", 1 << 20)),
                            ["'drafter.b' out of bounds"]),
    "nbytes_not_shape": ((1, 2), lambda b: rewrite_header(b, set_tensor("norm", "shape", [33])),
                         ["'norm'", "does not match shape"]),
    "offset_not_aligned": ((1, 2), lambda b: rewrite_header(b, set_tensor("norm", "offset", 8)),
                           ["'norm': offset 8 is not a multiple of 64"]),
    "offset_off_layout": ((1, 2), lambda b: rewrite_header(b, set_tensor("embed", "offset", 64)), ["the layout puts it at 0"]),
    "unknown_dtype": ((1, 2), lambda b: rewrite_header(b, set_tensor("embed", "dtype", "f16")), ["unknown dtype 'f16'"]),
    "missing_tensor": ((1, 2), lambda b: rewrite_header(b, shorten_tensor_list), ["missing tensor 'drafter.b'"]),
    "renamed_tensor": ((1, 2), lambda b: rewrite_header(b, set_tensor("norm", "name", "layers.2.norm")),
                       ["missing tensor 'norm'"]),
    "wrong_shape_for_config": ((1, 2), lambda b: rewrite_header(b, set_tensor("norm", "dtype", "i32")),
                               ["tensor 'norm' is i32 [32], the config calls for f32 [32]"]),
    "extra_layer_tensors": ((1, 2), lambda b: rewrite_header(b, lambda h: h["config"].update(n_layers=1)),
                     ["extra tensor 'layers.1.attn_norm'"]),
    "unknown_keep_fp32_class": ((1, 2), lambda b: rewrite_header(b, lambda h: h["quant"].update(type="int4", keep_fp32=["attn"])),
                                ["quant.keep_fp32: unknown weight class 'attn'"]),
    "keep_fp32_in_fp32": ((1, 2), lambda b: rewrite_header(b, lambda h: h["quant"].update(keep_fp32=[])),
                          ["'keep_fp32' is only for int4"]),
    "unknown_drafter_kind": ((1, 2), lambda b: rewrite_header(b, lambda h: h["drafter"].update(kind="tree")),
                             ["unknown drafter kind 'tree'"]),
    "unknown_drafter_key": ((1, 2), lambda b: rewrite_header(b, lambda h: h["drafter"].update(rank=2)),
                            ["drafter: unknown key 'rank'"]),
    "nonzero_fill": ((1, 2), lambda b: flip(b, 16 + header_of(b)[1]), ["nonzero fill byte in the header's fill"]),
    "truncated": ((1, 2), lambda b: b[:-1], ["truncated file"]),
    "bytes_after_the_end": ((1, 2), lambda b: b + b"\0", ["1 bytes after the end of the layout"]),
    "v1_data_sha256": ((1,), lambda b: flip(b, len(b) - 1), ["checksum mismatch"]),
    "v2_index_magic": ((2,), lambda b: flip(b, index_at(b)), ["bad index magic"]),
    "v2_index_count": ((2,), lambda b: flip(b, index_at(b) + 4), ["index count mismatch"]),
    "v2_tensor_hash": ((2,), lambda b: flip(b, data_end(b) - 1), ["tensor 'drafter.b': sha256"]),
    "v2_digest": ((2,), lambda b: flip(b, len(b) - 1), ["bundle digest mismatch"]),
    "v2_index_hash_entry": ((2,), lambda b: flip(b, index_at(b) + 8), ["bundle digest mismatch"]),
}


@pytest.mark.parametrize("case,version", [(c, v) for c, (versions, _, _) in CASES.items() for v in versions])
def test_reader_error(tmp_path, case, version):
    _, corrupt, fragments = CASES[case]
    blob = kdtr.encode(META, make_tensors(META), version)
    read_bytes(tmp_path, blob)  # the uncorrupted bundle reads
    with pytest.raises(kdtr.KdtrError) as err:
        read_bytes(tmp_path, corrupt(blob))
    message = str(err.value)
    assert str(tmp_path / "x.kdtr") in message
    for fragment in fragments:
        assert fragment in message


def test_v2_lazy_reader_checks_a_tensor_on_first_access(tmp_path):
    blob = bytearray(kdtr.encode(META, make_tensors(META), 2))
    header, n = header_of(bytes(blob))
    start = -(-(16 + n) // 64) * 64
    head = next(t for t in header["tensors"] if t["name"] == "head")
    blob[start + head["offset"]] ^= 1
    b, _ = read_bytes(tmp_path, bytes(blob), lazy=True)  # the digest holds: header and index are intact
    b.tensor("embed")
    with pytest.raises(kdtr.KdtrError, match="tensor 'head': sha256"):
        b.tensor("head")
    with pytest.raises(kdtr.KdtrError, match="tensor 'head': sha256"):
        read_bytes(tmp_path, bytes(blob))
    assert kdtr.decode(bytes(blob), verify=False).tensors["head"] is not None


def test_missing_tensor_lookup_names_the_file(tmp_path):
    b, path = read_bytes(tmp_path, kdtr.encode(META, make_tensors(META)))
    with pytest.raises(kdtr.KdtrError) as err:
        b.tensor("drafter.w2")
    assert str(path) in str(err.value) and "missing tensor 'drafter.w2'" in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(kdtr.KdtrError, match="cannot read"):
        kdtr.read(tmp_path / "nope.kdtr")
