"""The generated bundles: manifest, golden tokens, quantization trace, DDTree == AR, determinism."""

import copy
import dataclasses
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

CONFIGS = list(gen_model.DEFAULT_CONFIGS)
NAMES = [f"{config}_{quant}" for config in CONFIGS for quant in ("fp32", "int4")]


@pytest.fixture(scope="session")
def loaded(bundle_paths):
    return {name: bundle.load(path) for name, path in bundle_paths.items()}


def entries(manifest):
    return {b["name"]: b for b in manifest["bundles"]}


def test_generator_passes_its_check(generated):
    _, _, proc = generated
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("wrote") and ".kdtr" in line]
    assert len(lines) == len(NAMES)
    for line in lines:
        assert re.fullmatch(r"wrote \S+\.kdtr  quantized \d+ weights \(G=32\)  golden\[:8\]=\[[\d, ]+\]", line)
    assert "check: every bundle matches" in proc.stdout


def test_generator_reports_its_progress(generated, bundle_paths):
    """A progress report (kdtree_ref/progress.py) as each config starts and after each bundle:
    bundles written of all, and the bytes written so far."""
    _, _, proc = generated
    reports = [line.split(" what=", 1) for line in proc.stdout.splitlines() if line.startswith("::kdtree-progress ")]
    fields = [dict(f.split("=", 1) for f in head.split()[1:]) for head, _ in reports]
    assert len(reports) == len(NAMES) + len(CONFIGS)
    assert all(f["unit"] == "bundles" and f["total"] == str(len(NAMES)) for f in fields)
    after = [(f, what) for f, (_, what) in zip(fields, reports) if what.startswith("wrote ")]
    assert [what for _, what in after] == [f"wrote {path.name}" for path in bundle_paths.values()]
    sizes = [path.stat().st_size for path in bundle_paths.values()]
    assert [(int(f["done"]), int(f["bytes"])) for f, _ in after] == \
        [(i + 1, sum(sizes[:i + 1])) for i in range(len(sizes))]


def test_manifest_format(manifest, bundle_paths):
    assert manifest["version"] == 1
    assert [b["name"] for b in manifest["bundles"]] == NAMES
    for b in manifest["bundles"]:
        assert b["file"] == f"model_{b['name']}.kdtr"
        assert b["config"] == b["name"].split("_")[0] and b["quant"] == b["name"].split("_")[1]
        assert b["sha256"] == hashlib.sha256(bundle_paths[b["name"]].read_bytes()).hexdigest()
        assert len(b["prompt"]) == gen_model.RULES[b["config"]].prompt_len and len(b["golden"]) == gen_model.GOLDEN_LEN
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
        assert header["drafter"] == {"block_size": gen_model.BLOCK_SIZE, "mask_token": header["config"]["vocab_size"] - 1}
        assert header["quant"]["type"] == entry["quant"]


@pytest.mark.parametrize("name", NAMES)
def test_golden_is_not_degenerate(manifest, name):
    golden = entries(manifest)[name]["golden"]
    assert gen_model.degenerate(golden) is None
    assert len(set(golden)) >= gen_model.MIN_DISTINCT


@pytest.mark.parametrize("name", NAMES)
def test_margins_are_far_from_ties(manifest, name):
    entry = entries(manifest)[name]
    margins, rule = entry["margins"], gen_model.RULES[entry["config"]]
    assert margins["logit_min"] >= gen_model.MIN_LOGIT_MARGIN
    if not rule.prompt_noise:     # else step 0 (the prompt) is not held to them: see the next test
        assert margins["route_min"] >= rule.min_route_margin
        assert name.startswith("tiny_") or margins["group_min"] >= rule.min_group_margin


@pytest.mark.parametrize("name", [n for n in NAMES if gen_model.RULES[n.split("_")[0]].prompt_noise])
def test_long_prompt_golden_is_robust(loaded, name):
    """Past the prompt every routing margin clears the rule's thresholds, the prompt runs past the
    original RoPE context, and router noise on the whole prompt leaves the golden tokens alone."""
    b = loaded[name]
    rule = gen_model.RULES[b.args.name]
    assert len(b.prompt) >= 1000 and len(b.prompt) > b.args.rope_scaling.original_max_position_embeddings
    traj = generate(b.model, b.prompt, len(b.golden))
    assert traj.tokens[0].tolist() == b.golden
    assert gen_model.robust(gen_model.held_margins(traj, rule)[0], rule)
    assert gen_model.survives_prompt_noise(b.args, b.model, b.header["quant"]["type"], b.prompt, traj.tokens[0], rule)


@pytest.mark.parametrize("change", ["no_rope_scaling", "no_softmax_correction", "no_group_limit"])
def test_long_context_golden_depends_on_yarn_and_group_limit(loaded, change):
    """k2mini's golden tokens catch an engine without YaRN, without its softmax-scale correction
    or without the group limit: the reference with that change decodes other tokens."""
    b = loaded["k2mini_fp32"]
    scaling = b.args.rope_scaling
    args = {"no_rope_scaling": dataclasses.replace(b.args, rope_scaling=None),
            "no_softmax_correction": dataclasses.replace(b.args, rope_scaling=dataclasses.replace(scaling, mscale_all_dim=0.0)),
            "no_group_limit": dataclasses.replace(b.args, n_limited_groups=b.args.n_expert_groups)}[change]
    assert generate(Transformer(args, b.model.w), b.prompt, len(b.golden)).tokens[0].tolist() != b.golden


@pytest.mark.parametrize("config", CONFIGS)
def test_int4_golden_differs_from_fp32(manifest, config):
    e = entries(manifest)
    assert e[f"{config}_fp32"]["prompt"] == e[f"{config}_int4"]["prompt"]
    assert e[f"{config}_fp32"]["golden"] != e[f"{config}_int4"]["golden"]


@pytest.mark.parametrize("config", CONFIGS)
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


# k2mini's routing thresholds are 10 times lower than the tiny configs' (gen_model.RULES): FP32's
# drift there is still below a twentieth of them.
ROUTE_DRIFT_SHARE = 0.05


@pytest.mark.parametrize("name", NAMES)
def test_float32_rounding_stays_far_below_the_margins(loaded, name):
    """The same model run in float32 (as the engine runs) gives the golden tokens, and its margins
    move by less than 1% (logits) and 5% (routing) of the thresholds the golden prompt was chosen with."""
    b = loaded[name]
    fp32 = Transformer(b.args, b.model.w, dtype=np.float32)
    ref, run = generate(b.model, b.prompt, len(b.golden)), generate(fp32, b.prompt, len(b.golden))
    rule = gen_model.RULES[b.args.name]
    assert run.tokens[0].tolist() == b.golden
    assert np.max(np.abs(run.logit_margin - ref.logit_margin)) < 0.01 * gen_model.MIN_LOGIT_MARGIN
    assert np.max(np.abs(run.route_margin - ref.route_margin)) < ROUTE_DRIFT_SHARE * rule.min_route_margin
    if b.args.n_expert_groups > 1:
        assert np.max(np.abs(run.group_margin - ref.group_margin)) < ROUTE_DRIFT_SHARE * rule.min_group_margin


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
