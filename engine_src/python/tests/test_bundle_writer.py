"""The parallel writer of big configs' bundles (kdtree_ref.bundle_writer, gen_model's streamed
configs) writes the bytes the in-memory generator makes, in format version 2, and keeps them
while their generator key and golden tokens stand."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import gen_model
from kdtree_ref import bundle_writer, kdtr
from kdtree_ref.weights import Weights

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import small_k2  # noqa: E402

LABELS = ("fp32", "int4")


@pytest.fixture(scope="module")
def in_memory():
    """k2small's two bundles made by gen_model.build_config (version 1), by label."""
    return {b.entry["quant"]: b for b in small_k2.build()}


def write(in_memory, out_dir, workers=2):
    source = Weights(small_k2.ARGS, direct_int4=True)
    quants = {label: gen_model.quant_header(small_k2.RECIPE, label) for label in LABELS}
    golden = {label: in_memory[label].entry for label in LABELS}
    return bundle_writer.write_pair(source, quants, gen_model.drafter_header(small_k2.ARGS, small_k2.RECIPE), golden,
                                    out_dir, workers)


def test_the_writer_writes_the_in_memory_generators_bytes_in_version_2(in_memory, tmp_path):
    made = write(in_memory, tmp_path)
    for label in LABELS:
        want = kdtr.decode(in_memory[label].blob)
        got = kdtr.read(tmp_path / f"model_k2small_{label}.kdtr")        # every hash checked
        assert got.version == 2
        assert {k: got.header[k] for k in ("config", "quant", "drafter", "prompt", "golden")} == \
               {k: want.header[k] for k in ("config", "quant", "drafter", "prompt", "golden")}
        assert list(got.tensors) == list(want.tensors)
        for name in want.tensors:
            assert np.array_equal(got.tensor(name), want.tensor(name)), name
        # the same bundle, encoded whole in memory as version 2, has the same identity
        same = kdtr.encode({k: want.header[k] for k in ("config", "quant", "drafter", "prompt", "golden")},
                           dict(want.tensors), version=2)
        assert made[label][0] == got.identity() == kdtr.identity_of(same)
        assert (tmp_path / f"model_k2small_{label}.kdtr").read_bytes() == same


def test_hashing_alone_gives_the_written_identities(in_memory, tmp_path):
    written = write(in_memory, tmp_path, workers=1)
    hashed = write(in_memory, None, workers=3)
    assert {k: v[0] for k, v in hashed.items()} == {k: v[0] for k, v in written.items()}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"model_k2small_{label}.kdtr" for label in LABELS]


def streamed_k2small(monkeypatch):
    """gen_model with k2small as a streamed config."""
    monkeypatch.setitem(gen_model.CONFIGS, "k2small", small_k2.ARGS)
    monkeypatch.setitem(gen_model.RECIPES, "k2small", small_k2.RECIPE)
    monkeypatch.setitem(gen_model.RULES, "k2small", small_k2.RULE)


@pytest.fixture
def gen_runs(in_memory, tmp_path, monkeypatch, capsys):
    streamed_k2small(monkeypatch)
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps({"bundles": [in_memory[label].entry for label in LABELS]}))
    out = tmp_path / "refs"

    def run(*extra):
        assert gen_model.main(["--out", str(out), "--configs", "k2small", "--golden", str(golden), "--workers", "2",
                               *extra]) == 0
        return capsys.readouterr().out, json.loads((out / "manifest.json").read_text())
    return run, out, golden


def test_gen_model_writes_a_streamed_config_and_keeps_it_while_nothing_changed(gen_runs, in_memory):
    run, out, golden = gen_runs
    said, manifest = run()
    assert "wrote model_k2small_fp32.kdtr, model_k2small_int4.kdtr" in said
    entries = {b["quant"]: b for b in manifest["bundles"]}
    for label in LABELS:
        path = out / f"model_k2small_{label}.kdtr"
        assert entries[label]["sha256"] == kdtr.read(path).identity()
        assert entries[label]["needs"]["disk_bytes"] == path.stat().st_size
        assert entries[label]["golden"] == in_memory[label].entry["golden"]
    assert manifest["generator"]["keys"] == {"k2small": gen_model.generator_key("k2small")}
    # again: kept, not rewritten
    mtime = (out / "model_k2small_int4.kdtr").stat().st_mtime_ns
    said, again = run()
    assert "kept (generator key and golden unchanged)" in said and again["bundles"] == manifest["bundles"]
    assert (out / "model_k2small_int4.kdtr").stat().st_mtime_ns == mtime
    # --hash-only: the same entries, no file touched
    said, hashed = run("--hash-only")
    assert "hashed" in said and hashed["bundles"] == manifest["bundles"]
    assert (out / "model_k2small_int4.kdtr").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("change", ["index", "golden", "key"])
def test_a_streamed_config_is_rewritten_when_its_file_golden_or_key_changed(gen_runs, in_memory, change, monkeypatch):
    run, out, golden = gen_runs
    _, first = run()
    path = out / "model_k2small_int4.kdtr"
    if change == "index":                           # a damaged index (the digest no longer matches)
        with open(path, "r+b") as f:
            f.seek(-40, 2)
            byte = f.read(1)
            f.seek(-40, 2)
            f.write(bytes([byte[0] ^ 1]))
    elif change == "golden":
        data = json.loads(golden.read_text())
        data["bundles"][1]["golden"] = data["bundles"][1]["golden"][::-1]
        golden.write_text(json.dumps(data))
    else:
        monkeypatch.setitem(gen_model.RULES, "k2small", gen_model.GoldenRule(min_route_margin=1e-3))
    said, second = run()
    assert "wrote model_k2small_fp32.kdtr, model_k2small_int4.kdtr" in said
    assert kdtr.read(path).identity() == {b["quant"]: b for b in second["bundles"]}["int4"]["sha256"]


def test_a_streamed_config_without_golden_tokens_is_refused_naming_the_file(tmp_path, monkeypatch):
    streamed_k2small(monkeypatch)
    empty = tmp_path / "golden.json"
    empty.write_text(json.dumps({"bundles": []}))
    with pytest.raises(SystemExit, match=r"k2small: .*golden.json holds no golden tokens for both bundles"):
        gen_model.main(["--out", str(tmp_path / "refs"), "--configs", "k2small", "--golden", str(empty)])
