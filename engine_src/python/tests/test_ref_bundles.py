"""The generated bundles: manifest, golden tokens, quantization trace, DDTree == AR, determinism."""

import copy
import hashlib
import json
import re

import numpy as np
import pytest

import gen_model
from kdtree_ref import bundle, ddtree, kdtr
from kdtree_ref.drafter import Drafter
from kdtree_ref.model import Transformer, generate
from kdtree_ref.quant import is_quantized

NAMES = ["tiny_fp32", "tiny_int4", "tiny2_fp32", "tiny2_int4"]


@pytest.fixture(scope="session")
def loaded(bundle_paths):
    return {name: bundle.load(path) for name, path in bundle_paths.items()}


def entries(manifest):
    return {b["name"]: b for b in manifest["bundles"]}


def test_generator_passes_its_check(generated):
    _, _, proc = generated
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("wrote") and ".kdtr" in line]
    assert len(lines) == 4
    for line in lines:
        assert re.fullmatch(r"wrote \S+\.kdtr  quantized \d+ weights \(G=32\)  golden\[:8\]=\[[\d, ]+\]", line)
    assert "check: every bundle matches" in proc.stdout


def test_manifest_format(manifest, bundle_paths):
    assert manifest["version"] == 1
    assert [b["name"] for b in manifest["bundles"]] == NAMES
    for b in manifest["bundles"]:
        assert b["file"] == f"model_{b['name']}.kdtr"
        assert b["config"] == b["name"].split("_")[0] and b["quant"] == b["name"].split("_")[1]
        assert b["sha256"] == hashlib.sha256(bundle_paths[b["name"]].read_bytes()).hexdigest()
        assert len(b["prompt"]) == gen_model.PROMPT_LEN and len(b["golden"]) == gen_model.GOLDEN_LEN
        assert len(b["golden_margins"]) == len(b["golden"])
        assert b["margins"]["logit_min"] == min(b["golden_margins"])
        assert set(b["margins"]) == {"logit_min", "route_min", "group_min"}
    accept = manifest["generator"]["accept_mean"]
    assert set(accept) == set(NAMES)


def test_bundle_headers_carry_prompt_and_golden(manifest, bundle_paths):
    for name, entry in entries(manifest).items():
        header = kdtr.read(bundle_paths[name]).header
        assert header["prompt"] == entry["prompt"] and header["golden"] == entry["golden"]
        assert header["config"] == gen_model.CONFIGS[entry["config"]].to_json()
        assert header["drafter"] == {"block_size": gen_model.BLOCK_SIZE, "mask_token": 399}
        assert header["quant"]["type"] == entry["quant"]


@pytest.mark.parametrize("name", NAMES)
def test_golden_is_not_degenerate(manifest, name):
    golden = entries(manifest)[name]["golden"]
    assert gen_model.degenerate(golden) is None
    assert len(set(golden)) >= gen_model.MIN_DISTINCT


@pytest.mark.parametrize("name", NAMES)
def test_margins_are_far_from_ties(manifest, name):
    margins = entries(manifest)[name]["margins"]
    assert margins["logit_min"] >= gen_model.MIN_LOGIT_MARGIN
    assert margins["route_min"] >= gen_model.MIN_ROUTE_MARGIN
    assert name.startswith("tiny_") or margins["group_min"] >= gen_model.MIN_GROUP_MARGIN


@pytest.mark.parametrize("config", ["tiny", "tiny2"])
def test_int4_golden_differs_from_fp32(manifest, config):
    e = entries(manifest)
    assert e[f"{config}_fp32"]["prompt"] == e[f"{config}_int4"]["prompt"]
    assert e[f"{config}_fp32"]["golden"] != e[f"{config}_int4"]["golden"]


@pytest.mark.parametrize("config", ["tiny", "tiny2"])
def test_int4_bundle_quantizes_exactly_the_ffn_weights(bundle_paths, config):
    fp32 = kdtr.read(bundle_paths[f"{config}_fp32"])
    int4 = kdtr.read(bundle_paths[f"{config}_int4"])
    assert int4.header["quant"] == {"type": "int4", "group_size": 32}
    quantized = [n for n in fp32.tensors if is_quantized(n)]
    assert quantized and not any(n.endswith((".qw", ".sc")) for n in fp32.tensors)
    for name in fp32.tensors:
        if name in quantized:
            out_dim, in_dim = fp32.tensors[name].shape
            assert int4.tensor(name + ".qw").shape == (out_dim, in_dim // 8)
            assert int4.tensor(name + ".qw").dtype == np.int32
            assert int4.tensor(name + ".sc").shape == (out_dim, in_dim // 32)
            assert name not in int4.tensors
        elif not name.startswith("drafter."):
            np.testing.assert_array_equal(int4.tensor(name), fp32.tensors[name])


@pytest.mark.parametrize("name", NAMES)
def test_autoregressive_decode_reproduces_golden(loaded, name):
    b = loaded[name]
    assert generate(b.model, b.prompt, len(b.golden)).tokens[0].tolist() == b.golden


@pytest.mark.parametrize("name", NAMES)
def test_float32_rounding_stays_far_below_the_margins(loaded, name):
    """The same model run in float32 (as the engine runs) gives the golden tokens, and its
    margins move by less than 1% of the thresholds the golden prompt was chosen with."""
    b = loaded[name]
    fp32 = Transformer(b.args, b.model.w, dtype=np.float32)
    ref, run = generate(b.model, b.prompt, len(b.golden)), generate(fp32, b.prompt, len(b.golden))
    assert run.tokens[0].tolist() == b.golden
    assert np.max(np.abs(run.logit_margin - ref.logit_margin)) < 0.01 * gen_model.MIN_LOGIT_MARGIN
    assert np.max(np.abs(run.route_margin - ref.route_margin)) < 0.01 * gen_model.MIN_ROUTE_MARGIN
    if b.args.n_expert_groups > 1:
        assert np.max(np.abs(run.group_margin - ref.group_margin)) < 0.01 * gen_model.MIN_GROUP_MARGIN


@pytest.mark.parametrize("budget,block", [(0, 8), (1, 8), (6, 3), (48, 8)])
@pytest.mark.parametrize("name", NAMES)
def test_ddtree_equals_autoregressive(loaded, name, budget, block):
    b = loaded[name]
    result = ddtree.decode(b.model, b.drafter, b.prompt, len(b.golden), budget, block)
    assert result.tokens == b.golden
    assert result.accept_mean > 1 or budget == 0


@pytest.mark.parametrize("name", NAMES)
def test_drafter_beats_chance_on_held_out_prompts(manifest, loaded, name):
    """The manifest's acceptance (held-out prompts) is well above a drafter that knows nothing."""
    b = loaded[name]
    uniform = Drafter(np.zeros_like(b.drafter.w), np.zeros_like(b.drafter.b))
    prompt = gen_model.prompts_from(b.args, "eval", 1)[0]
    chance = ddtree.decode(b.model, uniform, prompt, 32, 8).accept_mean
    fitted = manifest["generator"]["accept_mean"][name]["8"]
    assert fitted > 1.5 and fitted > chance + 0.4


def test_regeneration_is_bit_identical(bundle_paths, generator, tmp_path):
    """A second generator run (one config) writes the same bytes as the session's run."""
    proc = generator(tmp_path, "--configs", "tiny2")
    assert proc.returncode == 0, proc.stderr
    for name in ("tiny2_fp32", "tiny2_int4"):
        again = tmp_path / f"model_{name}.kdtr"
        assert again.read_bytes() == bundle_paths[name].read_bytes(), name


def test_check_names_the_first_difference(manifest, tmp_path):
    path = tmp_path / "expected.json"
    path.write_text(json.dumps(manifest))
    assert gen_model.check(manifest, path) is None
    altered = copy.deepcopy(manifest)
    altered["bundles"][1]["golden"][5] += 1
    path.write_text(json.dumps(altered))
    problem = gen_model.check(manifest, path)
    assert problem.startswith("tiny_int4: golden differs") and "first difference at token 5" in problem
    altered = copy.deepcopy(manifest)
    altered["bundles"][2]["sha256"] = "0" * 64
    path.write_text(json.dumps(altered))
    assert gen_model.check(manifest, path).startswith("tiny2_fp32: sha256 differs")
    assert "cannot read" in gen_model.check(manifest, tmp_path / "missing.json")


def test_check_of_one_config_ignores_the_others(manifest, tmp_path):
    path = tmp_path / "expected.json"
    path.write_text(json.dumps(manifest))
    only_tiny2 = dict(manifest, bundles=[b for b in manifest["bundles"] if b["config"] == "tiny2"])
    assert gen_model.check(only_tiny2, path) is None
