#!/usr/bin/env python3
"""Write the reference bundles (tiny, tiny2; fp32 and int4) and their manifest.

    python gen_model.py [--out DIR] [--check EXPECTED_MANIFEST]

Every byte is reproducible on any machine: weights come from the integer PRNG, the golden
prompt is the first candidate whose greedy trajectory (FP32 and INT4 twin) keeps every logit
and routing margin far above FP32 rounding, and the drafter fit is rounded before storing.
--check compares the written manifest (sha256 and golden tokens of every bundle) with an
expected one and exits 1 naming the first difference.
"""

import argparse
import dataclasses
import hashlib
import inspect
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The matrices are tiny: BLAS threads only add contention (and this runs beside other work).
# Set before NumPy loads its BLAS.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from kdtree_ref import bundle_writer, ddtree, kdtr, progress, prng  # noqa: E402
from kdtree_ref.needs import bundle_needs  # noqa: E402
from kdtree_ref import drafter as drafting  # noqa: E402
from kdtree_ref.model import ModelArgs, RopeScaling, Trajectory, Transformer, generate  # noqa: E402
from kdtree_ref.quant import GROUP_SIZE, dequantize, is_quantized  # noqa: E402
from kdtree_ref.weights import SEED, Weights  # noqa: E402

MANIFEST_VERSION = 1
EXPECTED_MANIFEST = Path(__file__).resolve().parent.parent / "tests" / "refs" / "expected_manifest.json"
BUNDLES_PER_CONFIG = 2      # build_config's fp32 and int4 bundles (the total of the progress reports)
CONFIGS = {
    "tiny": ModelArgs(
        name="tiny", vocab_size=400, dim=192, n_layers=6, n_dense_layers=1, n_heads=4,
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        inter_dim=384, moe_inter_dim=96, n_routed_experts=8, n_shared_experts=1,
        n_activated_experts=2, n_expert_groups=1, n_limited_groups=1, route_scale=2.5,
        rope_theta=10000.0, norm_eps=1e-6, max_seq_len=256),
    "tiny2": ModelArgs(
        name="tiny2", vocab_size=400, dim=128, n_layers=4, n_dense_layers=1, n_heads=2,
        q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        inter_dim=256, moe_inter_dim=64, n_routed_experts=16, n_shared_experts=2,
        n_activated_experts=4, n_expert_groups=4, n_limited_groups=2, route_scale=2.827,
        rope_theta=50000.0, norm_eps=1e-6, max_seq_len=256),
    # Shaped like DeepSeek-V3's routing (64 experts in 8 groups, 4 groups kept, top-8, one shared
    # expert, first layer dense, route scale 2.5) and its YaRN RoPE (factor 40, beta 32 / 1,
    # mscale = mscale_all_dim = 1), with a 4096-position context. The original context is 512,
    # not V3's 4096, so that the golden prompt (RULES["k2mini"]: 1024 tokens) runs past it at a
    # cost CI can pay (a prompt past 4096 would cost 16 times as much attention).
    "k2mini": ModelArgs(
        name="k2mini", vocab_size=400, dim=128, n_layers=3, n_dense_layers=1, n_heads=4,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        inter_dim=256, moe_inter_dim=32, n_routed_experts=64, n_shared_experts=1,
        n_activated_experts=8, n_expert_groups=8, n_limited_groups=4, route_scale=2.5,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        norm_eps=1e-6, max_seq_len=4096),
    # Kimi K2's widths, routing and RoPE at two layers (the first dense, the second MoE): the shapes
    # the engine exists for, which the tiny configs never reach (7168-long reductions, 64-head
    # latent attention, 384 experts). Not in the default run (DEFAULT_CONFIGS): its bundles
    # (RECIPES: routed experts made directly as INT4, a low-rank drafter) are 13-15 GB and are
    # written on the GPU host, cached by its own generator key (generator_key).
    "k2wide": ModelArgs(
        name="k2wide", vocab_size=32768, dim=7168, n_layers=2, n_dense_layers=1, n_heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        inter_dim=18432, moe_inter_dim=2048, n_routed_experts=384, n_shared_experts=1,
        n_activated_experts=8, n_expert_groups=1, n_limited_groups=1, route_scale=2.827,
        rope_theta=50000.0,
        rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        norm_eps=1e-6, max_seq_len=4096),
}
DEFAULT_CONFIGS = ["tiny", "tiny2", "k2mini"]   # what a plain run builds (k2wide only when named)


@dataclass(frozen=True)
class Recipe:
    """How a config's two bundles are made, beyond its ModelArgs (the default: the tiny configs')."""

    direct_int4: bool = False       # routed experts made directly as INT4 codes (weights.py), no fp32 master
    # Non-empty: the bundle labelled `quant: fp32` is an int4 bundle keeping these weight classes
    # fp32 (header quant.keep_fp32; its routed experts are int4 like the int4 bundle's), the twin
    # the INT4 != FP32 check pairs with the int4 bundle. Empty: a plain fp32 bundle.
    twin_keep_fp32: tuple[str, ...] = ()
    drafter_rank: int = 0           # > 0: a lowrank_head drafter of this rank from the PRNG; 0: the fitted linear one


RECIPES = {"k2wide": Recipe(direct_int4=True, twin_keep_fp32=("dense", "shared"), drafter_rank=64)}
PROMPT_LEN = 16     # fit and eval prompts, and the golden prompts of the tiny configs
GOLDEN_LEN = 64
BLOCK_SIZE = 8
# A golden trajectory is accepted only if every step stays this far from a tie. FP32 rounding
# moves logits (std about 4) by about 1e-5 and router scores (in (0, 1)) by about 1e-6, so
# these leave a factor of 100 or more; stricter ones leave too few candidates.
MIN_LOGIT_MARGIN = 0.01
MIN_ROUTE_MARGIN = 2e-4
MIN_GROUP_MARGIN = 2e-4


@dataclass(frozen=True)
class GoldenRule:
    """How a config's golden prompt is chosen (README, "Reference bundles")."""

    prompt_len: int = PROMPT_LEN
    min_route_margin: float = MIN_ROUTE_MARGIN   # at every step
    min_group_margin: float = MIN_GROUP_MARGIN
    # 0: step 0's routing margins (every prompt token) are held to the minimums too. > 0 (long
    # prompts, where thousands of routing choices make a near-tie certain): they are not; instead
    # the golden tokens must come out the same when every router score of the prompt's forward is
    # moved by uniform noise of this amplitude (an engine that far off there).
    prompt_noise: float = 0.0
    search_batch: int = 8                        # candidate prompts decoded together


# k2mini: 2 MoE layers x 1024 prompt tokens x 32 candidate experts put the smallest prompt routing
# margin near 1e-5 and gave steps past the prompt margins below 2e-4 in most candidates. FP32
# moved k2mini's routing margins by at most 7e-7 over 1024-token prompts (float32 reference), so
# 2e-5 still leaves a factor of 30, and the prompt's noise (1e-4) is 150 times that drift.
RULES = {"tiny": GoldenRule(), "tiny2": GoldenRule(),
         "k2mini": GoldenRule(prompt_len=1024, min_route_margin=2e-5, min_group_margin=2e-5, prompt_noise=1e-4,
                              search_batch=1),
         # k2wide: the streaming reference in float32 moved the router selection scores by at most
         # 1.1e-6 and the logits by at most 8.9e-6 (std 4) against float64 (bench/k2wide_reference.py,
         # an 8-token prompt and 3 steps: 4.3k routing choices over 384 experts), k2mini's order of
         # drift; so k2mini's factors: routing margins 3e-5 (28 times), prompt noise 1e-4 (90 times),
         # the logit margin 0.01 (1100 times). No group margin: one group.
         "k2wide": GoldenRule(prompt_len=256, min_route_margin=3e-5, min_group_margin=3e-5, prompt_noise=1e-4,
                              search_batch=1)}
# The modules whose code decides the bytes of a config's bundles besides gen_model.py's own
# functions listed in KEY_FUNCTIONS (generator_key).
KEY_MODULES = ("prng.py", "quant.py", "weights.py", "model.py", "drafter.py", "kdtr.py", "schema.py", "stream.py",
               "bundle_writer.py")
MAX_CANDIDATES = 512
MIN_DISTINCT = 24
MAX_PERIOD = 16
FIT_PROMPTS = 64
EVAL_PROMPTS = 4
EVAL_TOKENS = 48
EVAL_BUDGETS = (8, 32)


def init_weights(args: ModelArgs) -> dict[str, np.ndarray]:
    """Random float32 weights under the README's tensor names, from the integer PRNG."""
    return Weights(args).all_fp32()


def quant_header(recipe: Recipe, quant: str) -> dict:
    """The header `quant` of a config's bundle labelled `quant` ("fp32" or "int4")."""
    if quant == "int4":
        return {"type": "int4", "group_size": GROUP_SIZE}
    if recipe.twin_keep_fp32:
        return {"type": "int4", "group_size": GROUP_SIZE, "keep_fp32": list(recipe.twin_keep_fp32)}
    return {"type": "fp32"}


def bundle_weights(source: Weights, header: dict):
    """(tensors to store, in bundle order; the float32 weights the model computes with; the number of
    INT4 matrices) of a bundle whose header `quant` is `header`."""
    stored, model_weights, count = {}, {}, 0
    for name in source.specs:
        tensors = source.stored(name, header)
        stored.update(tensors)
        if name in tensors:
            model_weights[name] = tensors[name]
        else:
            model_weights[name] = dequantize(tensors[name + ".qw"], tensors[name + ".sc"], GROUP_SIZE)
            count += 1
    return stored, model_weights, count


def step_margins(traj: Trajectory) -> np.ndarray:
    """[B][3] minimum logit, route and group margins of each trajectory."""
    return np.stack([traj.logit_margin.min(1), traj.route_margin.min(1), traj.group_margin.min(1)], 1)


def degenerate(tokens) -> str | None:
    """Why a golden sequence is degenerate (too few distinct tokens, a short cycle), or None."""
    tokens = list(tokens)
    if len(set(tokens)) < MIN_DISTINCT:
        return f"only {len(set(tokens))} distinct tokens"
    tail = len(tokens) // 2
    for period in range(1, MAX_PERIOD + 1):
        if all(tokens[i] == tokens[i + period] for i in range(tail, len(tokens) - period)):
            return f"ends in a cycle of period {period}"
    return None


def robust(margins: np.ndarray, rule: GoldenRule) -> bool:
    """Whether minimum (logit, route, group) margins all clear a rule's thresholds."""
    logit, route, group = margins
    return logit >= MIN_LOGIT_MARGIN and route >= rule.min_route_margin and group >= rule.min_group_margin


def held_margins(traj: Trajectory, rule: GoldenRule) -> np.ndarray:
    """[B][3] the margins a rule holds to its thresholds: every step's, or with prompt noise the
    logit margins of every step and the routing margins of the steps after the prompt."""
    margins = step_margins(traj)
    if rule.prompt_noise:
        margins[:, 1:] = step_margins(traj.steps_after_prompt())[:, 1:]
    return margins


class PromptRouterNoise(Transformer):
    """A model whose router scores are moved by uniform noise in [-amp, amp) (integer PRNG) in the
    forward that runs a prompt from an empty cache: an engine that far off on the prompt."""

    def __init__(self, model: Transformer, amp: float, key: str):
        self.__dict__.update(model.__dict__)        # the model's own weights, not a copy
        self.amp, self.key, self.on_prompt = amp, key, False

    def forward(self, tokens, positions, mask, cache):
        self.on_prompt = cache.length == 0
        return super().forward(tokens, positions, mask, cache)

    def gate_scores(self, layer: int, x: np.ndarray) -> np.ndarray:
        scores = super().gate_scores(layer, x)
        if not self.on_prompt:
            return scores
        return scores + self.amp * prng.uniform(prng.stream_key(SEED, self.key, "router-noise", layer), scores.shape)


def survives_prompt_noise(args: ModelArgs, model: Transformer, quant: str, prompt: np.ndarray, golden: np.ndarray,
                          rule: GoldenRule) -> bool:
    """Whether the golden tokens come out the same with the prompt's router scores perturbed."""
    noisy = PromptRouterNoise(model, rule.prompt_noise, f"{args.name}/{quant}")
    return bool(np.array_equal(generate(noisy, prompt[None], GOLDEN_LEN).tokens[0], golden))


def prompts_from(args: ModelArgs, purpose: str, count: int, first: int = 0, length: int = PROMPT_LEN) -> np.ndarray:
    """Prompts [count][length] over tokens 0..V-2 (the mask token V-1 never appears)."""
    return np.stack([prng.integers(prng.stream_key(SEED, args.name, purpose, i), length,
                                   args.vocab_size - 1) for i in range(first, first + count)])


@dataclass
class Golden:
    """The chosen golden prompt and the FP32 and INT4 greedy trajectories after it."""

    prompt: np.ndarray
    candidate: int
    fp32: Trajectory
    int4: Trajectory


def search_prompt(args: ModelArgs, fp32: Transformer, int4: Transformer, rule: GoldenRule) -> Golden:
    """The first candidate prompt whose FP32 and INT4 goldens are robust under `rule`, not degenerate
    and differ (the INT4 model runs only on a batch with an FP32 trajectory that passes)."""

    def passes(traj: Trajectory) -> np.ndarray:
        margins = held_margins(traj, rule)
        return np.array([robust(margins[i], rule) and degenerate(traj.tokens[i]) is None for i in range(len(margins))])

    for first in range(0, MAX_CANDIDATES, rule.search_batch):
        prompts = prompts_from(args, "golden", rule.search_batch, first, rule.prompt_len)
        tf = generate(fp32, prompts, GOLDEN_LEN)
        ok = passes(tf)
        if not ok.any():
            continue
        tq = generate(int4, prompts, GOLDEN_LEN)
        ok &= passes(tq)
        for i in np.flatnonzero(ok):
            if np.any(tf.tokens[i] != tq.tokens[i]) and (
                    not rule.prompt_noise
                    or (survives_prompt_noise(args, fp32, "fp32", prompts[i], tf.tokens[i], rule)
                        and survives_prompt_noise(args, int4, "int4", prompts[i], tq.tokens[i], rule))):
                return Golden(prompts[i], first + int(i), tf.row(i), tq.row(i))
    raise SystemExit(f"gen_model: no robust golden prompt for {args.name} among {MAX_CANDIDATES} candidates")


def fit_drafter(args: ModelArgs, model: Transformer) -> drafting.Drafter:
    """Ridge-fit the drafter on the model's own greedy trajectories from FIT_PROMPTS prompts."""
    traj = generate(model, prompts_from(args, "fit", FIT_PROMPTS), GOLDEN_LEN + BLOCK_SIZE)
    features, targets = drafting.training_pairs(traj, model.w["embed"], BLOCK_SIZE)
    return drafting.fit(features, targets, args.vocab_size)


def drafter_header(args: ModelArgs, recipe: Recipe) -> dict:
    """The header `drafter` object of a config's bundles (a lowrank_head one when the recipe says so)."""
    header = {"block_size": BLOCK_SIZE, "mask_token": args.vocab_size - 1}
    if recipe.drafter_rank:
        header.update(kind="lowrank_head", rank=recipe.drafter_rank)
    return header


def make_drafter(source: Weights, recipe: Recipe, model: Transformer):
    """(drafter, its header object, its tensors): the recipe's low-rank drafter, or the linear one fitted to `model`."""
    header = drafter_header(source.args, recipe)
    if recipe.drafter_rank:
        v, u, b = source.lowrank_drafter(recipe.drafter_rank, BLOCK_SIZE)
        return drafting.LowRankDrafter(v, u, b, model.head_logits), header, {"drafter.v": v, "drafter.u": u, "drafter.b": b}
    drafter = fit_drafter(source.args, model)
    return drafter, header, {"drafter.w": drafter.w, "drafter.b": drafter.b}


def measure_acceptance(args: ModelArgs, model: Transformer, drafter: drafting.AnyDrafter) -> dict:
    """Mean DDTree acceptance length per budget on held-out prompts (not used by the fit)."""
    prompts = prompts_from(args, "eval", EVAL_PROMPTS)
    result = {}
    for budget in EVAL_BUDGETS:
        lengths = [n for p in prompts for n in ddtree.decode(model, drafter, p, EVAL_TOKENS, budget).accepted]
        result[str(budget)] = round(float(np.mean(lengths)), 4)
    return result


def rounded_margin(x: float) -> float | None:
    """A margin for the manifest: 6 significant digits; None for 'no such margin' (inf)."""
    return None if not np.isfinite(x) else float(f"{x:.6g}")


@dataclass
class Built:
    """One bundle built in memory: its bytes, manifest entry and what gets printed."""

    name: str
    blob: bytes
    entry: dict
    n_quantized: int
    accept: dict
    candidate: int      # index of the golden prompt among the candidates


def build_config(args: ModelArgs, recipe: Recipe | None = None, rule: GoldenRule | None = None) -> list[Built]:
    """The fp32 and int4 bundles of one config (in memory: not for k2wide), by its recipe and golden
    rule (default: RECIPES' and RULES' entries for its name)."""
    recipe = recipe or RECIPES.get(args.name, Recipe())
    rule = rule or RULES[args.name]
    source = Weights(args, direct_int4=recipe.direct_int4)
    made = {quant: bundle_weights(source, quant_header(recipe, quant)) for quant in ("fp32", "int4")}
    models = {quant: Transformer(args, made[quant][1]) for quant in made}
    golden = search_prompt(args, models["fp32"], models["int4"], rule)
    built = []
    for quant, traj in (("fp32", golden.fp32), ("int4", golden.int4)):
        stored, _, count = made[quant]
        model = models[quant]
        drafter, drafter_header, drafter_tensors = make_drafter(source, recipe, model)
        tensors = {**stored, **drafter_tensors}
        prompt, tokens = [int(t) for t in golden.prompt], [int(t) for t in traj.tokens[0]]
        meta = {"config": args.to_json(), "quant": quant_header(recipe, quant), "drafter": drafter_header,
                "prompt": prompt, "golden": tokens}
        blob = kdtr.encode(meta, tensors)
        lm, rm, gm = step_margins(traj)[0]
        name = f"{args.name}_{quant}"
        entry = {"name": name, "file": f"model_{name}.kdtr", "sha256": hashlib.sha256(blob).hexdigest(),
                 "config": args.name, "quant": quant, "prompt": prompt, "golden": tokens,
                 "margins": {"logit_min": rounded_margin(lm), "route_min": rounded_margin(rm),
                             "group_min": rounded_margin(gm)},
                 "golden_margins": [rounded_margin(m) for m in traj.logit_margin[0]],
                 "needs": bundle_needs(args, len(blob), sum(4 * t.size for t in tensors.values()),
                                       drafter_header["block_size"], len(prompt))}
        built.append(Built(name, blob, entry, count, measure_acceptance(args, model, drafter), golden.candidate))
    # the prompt search guarantees these; checked again on what is written, loudly
    for b in built:
        problem = degenerate(b.entry["golden"])
        if problem or len(b.entry["golden"]) != GOLDEN_LEN:
            raise SystemExit(f"gen_model: {b.name}: degenerate golden tokens: {problem}")
    if built[0].entry["golden"] == built[1].entry["golden"]:
        raise SystemExit(f"gen_model: {args.name}: INT4 golden equals FP32 golden: quantization left no trace")
    return built


def first_difference(a: list, b: list) -> int:
    """Index of the first position where two token lists differ (or the shorter length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check(manifest: dict, expected_path: Path) -> str | None:
    """The first difference (file, sha256, prompt, golden tokens) between the bundles of the
    written manifest and those of the same configs in the expected one, or None."""
    try:
        expected = json.loads(expected_path.read_text())
    except (OSError, ValueError) as err:
        return f"cannot read the expected manifest {expected_path}: {err}"
    got = {b["name"]: b for b in manifest["bundles"]}
    built = {b["config"] for b in manifest["bundles"]}
    wanted = [b for b in expected["bundles"] if b["config"] in built]
    for want in wanted:
        have = got.get(want["name"])
        if have is None:
            return f"{want['name']}: in {expected_path} but not written"
        for key in ("file", "sha256", "prompt", "golden"):
            if have[key] != want[key]:
                detail = (f"first difference at token {first_difference(have[key], want[key])}"
                          if key in ("prompt", "golden") else f"got {have[key]}, expected {want[key]}")
                return f"{want['name']}: {key} differs from {expected_path} ({detail})"
    extra = sorted(set(got) - {b["name"] for b in wanted})
    return f"{extra[0]}: written but not in {expected_path}" if extra else None


def is_streamed(name: str) -> bool:
    """Whether a config's bundles are written by kdtree_ref.bundle_writer (too big to make in memory;
    their golden tokens come from golden_search.py, committed in the expected manifest)."""
    return RECIPES.get(name, Recipe()).direct_int4


def golden_entries(path: Path, name: str) -> dict[str, dict]:
    """{label: manifest entry} of config `name` in a manifest or a golden_search result (their `bundles`)."""
    try:
        found = {b["quant"]: b for b in json.loads(path.read_text())["bundles"] if b.get("config") == name}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(f"gen_model: {name}: cannot read golden tokens from {path}: {err}") from err
    if set(found) != {"fp32", "int4"}:
        raise SystemExit(f"gen_model: {name}: {path} holds no golden tokens for both bundles (fp32 and int4): "
                         f"run golden_search.py --config {name} and commit its result")
    return found


def reusable(name: str, key: str, golden: dict[str, dict], out: Path) -> list[dict] | None:
    """The previous run's manifest entries of a streamed config, when its generator key and golden
    tokens are unchanged and each file is whole (its size and stored digest those entries name)."""
    try:
        previous = json.loads((out / "manifest.json").read_text())
        if previous["generator"].get("keys", {}).get(name) != key:
            return None
        entries = [b for b in previous["bundles"] if b["config"] == name]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if sorted(b["quant"] for b in entries) != ["fp32", "int4"]:
        return None
    for b in entries:
        path = out / b["file"]
        want = golden[b["quant"]]
        if (b["prompt"], b["golden"]) != (want["prompt"], want["golden"]) or not path.is_file():
            return None
        try:    # the layout and the digest over header and index: cheap (each tensor's hash: the engine's load)
            whole = path.stat().st_size == b["needs"]["disk_bytes"] and kdtr.read(path, lazy=True).identity() == b["sha256"]
        except kdtr.KdtrError:
            whole = False
        if not whole:
            return None
    return entries


def write_streamed(name: str, out: Path, golden_path: Path, workers: int, hash_only: bool) -> tuple[list[dict], bool]:
    """(manifest entries, reused) of a streamed config's two bundles, written by worker processes
    with the golden tokens of `golden_path` (hash_only: entries alone, no files)."""
    args, recipe = CONFIGS[name], RECIPES[name]
    golden = golden_entries(golden_path, name)
    kept = None if hash_only else reusable(name, generator_key(name), golden, out)
    if kept:
        return kept, True
    source = Weights(args, direct_int4=recipe.direct_int4)
    quants = {label: quant_header(recipe, label) for label in ("fp32", "int4")}
    made = bundle_writer.write_pair(source, quants, drafter_header(args, recipe), golden,
                                    None if hash_only else out, workers)
    entries = []
    for label, (identity, plan) in made.items():
        g = golden[label]
        entries.append({"name": f"{name}_{label}", "file": f"model_{name}_{label}.kdtr", "sha256": identity,
                        "config": name, "quant": label, "streamed": True, "prompt": g["prompt"], "golden": g["golden"],
                        "margins": g["margins"], "golden_margins": g["golden_margins"],
                        "needs": bundle_needs(args, plan.size, sum(s.nbytes for s in plan.specs), BLOCK_SIZE,
                                              len(g["prompt"]))})
    return entries, False


def generator_key(name: str) -> str:
    """The key a config's bundles are cached and rebuilt by (sha256, hex): its config, recipe, golden
    rule, the generator's constants, and the code that makes its bytes (KEY_MODULES and
    KEY_FUNCTIONS), so that a change to another config (the tiny ones: the default run) leaves it."""
    args = CONFIGS[name]
    spec = {"seed": SEED, "config": args.to_json(), "recipe": dataclasses.asdict(RECIPES.get(name, Recipe())),
            "rule": dataclasses.asdict(RULES[name]), "golden_len": GOLDEN_LEN, "block_size": BLOCK_SIZE,
            "group_size": GROUP_SIZE, "thresholds": [MIN_LOGIT_MARGIN, MIN_ROUTE_MARGIN, MIN_GROUP_MARGIN],
            "candidates": [MAX_CANDIDATES, MIN_DISTINCT, MAX_PERIOD]}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    package = Path(kdtr.__file__).resolve().parent
    for module in KEY_MODULES:
        digest.update(b"\0" + module.encode() + b"\0" + (package / module).read_bytes())
    for function in KEY_FUNCTIONS:
        digest.update(b"\0" + inspect.getsource(function).encode())
    return digest.hexdigest()


def bundle_nbytes(args: ModelArgs, recipe: Recipe, quant: str) -> int:
    """The tensors' bytes of a config's bundle labelled `quant` (its file is this plus the header and
    at most 64 bytes of alignment per tensor), from the shapes alone."""
    source = Weights(args, direct_int4=recipe.direct_int4)
    header = quant_header(recipe, quant)
    int4, keep = header["type"] == "int4", tuple(header.get("keep_fp32", ()))
    total = 0
    for name_, spec in source.specs.items():
        count = int(np.prod(spec.shape, dtype=np.int64))
        # INT4: 4 bits per weight and a float32 scale per group
        quantized = source.is_direct(name_) or (int4 and is_quantized(name_, keep))
        total += count // 2 + 4 * (count // GROUP_SIZE) if quantized else 4 * count
    block, h, vocab = BLOCK_SIZE, args.dim, args.vocab_size
    rank = recipe.drafter_rank
    drafter = rank * 2 * h + block * h * rank if rank else block * vocab * 2 * h
    return total + 4 * (drafter + block * vocab)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "refs",
                        help="output folder (default: engine_src/tests/refs)")
    parser.add_argument("--check", type=Path, metavar="EXPECTED",
                        help="compare sha256 and golden tokens with this manifest; exit 1 on a difference")
    parser.add_argument("--key", choices=sorted(CONFIGS), metavar="CONFIG",
                        help="print CONFIG's generator key (the cache key of its bundles) and exit")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=DEFAULT_CONFIGS,
                        help=f"configs to build (default: {' '.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--golden", type=Path, default=EXPECTED_MANIFEST, metavar="MANIFEST",
                        help="big configs (k2wide): the manifest or golden_search.py result giving their prompt and "
                             "golden tokens (default: the committed expected manifest)")
    parser.add_argument("--hash-only", action="store_true",
                        help="big configs: compute their manifest entries (sha256, needs) without writing the bundles")
    parser.add_argument("--recompute-golden", action="store_true",
                        help="with --check, big configs: recompute their golden tokens with the streaming float64 "
                             "reference (about 15 CPU-minutes a bundle at k2wide's width) and compare")
    parser.add_argument("--workers", type=int, default=bundle_writer.default_workers(),
                        help="big configs: writer processes (default: every core)")
    opts = parser.parse_args(argv)
    if opts.key:
        print(generator_key(opts.key))
        return 0
    start = time.perf_counter()
    opts.out.mkdir(parents=True, exist_ok=True)
    bundles, acceptance, candidates = [], {}, {}
    total, written = BUNDLES_PER_CONFIG * len(opts.configs), 0
    for name in opts.configs:
        if is_streamed(name):
            entries, reused = write_streamed(name, opts.out, opts.golden, opts.workers, opts.hash_only)
            bundles.extend(entries)
            written += 0 if reused else sum(e["needs"]["disk_bytes"] for e in entries)
            said = "kept (generator key and golden unchanged)" if reused else "hashed" if opts.hash_only else "wrote"
            print(f"{said} {', '.join(e['file'] for e in entries)}", flush=True)
            progress.report(len(bundles), total, "bundles", f"{said} {name}'s bundles", written)
            continue
        progress.report(len(bundles), total, "bundles", f"making {name}: weights, golden prompt, drafter", written)
        for b in build_config(CONFIGS[name]):
            path = opts.out / b.entry["file"]
            path.write_bytes(b.blob)
            bundles.append(b.entry)
            acceptance[b.name] = b.accept
            candidates[name] = b.candidate
            written += len(b.blob)
            print(f"wrote {path}  quantized {b.n_quantized} weights (G={GROUP_SIZE})  "
                  f"golden[:8]={b.entry['golden'][:8]}", flush=True)
            progress.report(len(bundles), total, "bundles", f"wrote {b.entry['file']}", written)
    manifest = {
        "version": MANIFEST_VERSION,
        "generator": {
            "script": "python/gen_model.py", "seed": SEED, "group_size": GROUP_SIZE,
            "prompt_len": PROMPT_LEN, "golden_len": GOLDEN_LEN, "golden_candidate": candidates,
            "thresholds": {"logit_min": MIN_LOGIT_MARGIN, "route_min": MIN_ROUTE_MARGIN,
                           "group_min": MIN_GROUP_MARGIN},
            "golden_rules": {name: dataclasses.asdict(RULES[name]) for name in opts.configs
                             if RULES[name] != GoldenRule()},
            "drafter": {"block_size": BLOCK_SIZE, "grid": f"2^-{drafting.GRID_BITS}",
                        "fit_prompts": FIT_PROMPTS, "eval_prompts": EVAL_PROMPTS,
                        "eval_tokens": EVAL_TOKENS},
            "accept_mean": acceptance,
            "keys": {name: generator_key(name) for name in opts.configs if is_streamed(name)},
            "python": platform.python_version(), "numpy": np.__version__,
            "seconds": round(time.perf_counter() - start, 2),
        },
        "bundles": bundles,
    }
    manifest_path = opts.out / "manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {manifest_path}  {len(bundles)} bundles in {manifest['generator']['seconds']} s")
    if opts.check:
        problem = check(manifest, opts.check)
        if problem:
            print(f"CHECK FAILED: {problem}", file=sys.stderr)
            return 1
        print(f"check: every bundle matches {opts.check}")
        if opts.recompute_golden:
            import golden_search  # the streaming search's models: only when asked (it imports this module)
            for name in filter(is_streamed, opts.configs):
                problem = golden_search.recompute(golden_search.Config.named(name), golden_entries(opts.check, name),
                                                  opts.workers)
                if problem:
                    print(f"CHECK FAILED: {problem}", file=sys.stderr)
                    return 1
                print(f"check: {name}'s golden tokens are the streaming reference's")
    return 0


# gen_model.py's functions that decide a bundle's bytes (generator_key).
KEY_FUNCTIONS = (quant_header, bundle_weights, make_drafter, fit_drafter, search_prompt, held_margins, robust,
                 degenerate, survives_prompt_noise, prompts_from, build_config)


if __name__ == "__main__":
    sys.exit(main())
