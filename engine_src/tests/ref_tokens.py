"""Reference tokens for prompts that are in no bundle (used by scripts/run_tests.sh).

    $PYTHON tests/ref_tokens.py BUNDLE [--prompts K] [-n N]

Prints JSON: [{"prompt": [...], "tokens": [...]}, ...]. Candidate prompts come from a fixed
LCG seeded by the bundle's config name; each is decoded greedily by the float64 reference
(kdtree_ref) and its tokens are kept up to the first step whose logit or routing margin is too
small for an FP32 engine to be held to it (beyond a near-tie both answers are right).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from kdtree_ref import kdtr  # noqa: E402
from kdtree_ref.model import ModelArgs, Transformer, generate  # noqa: E402
from kdtree_ref.quant import dequantize  # noqa: E402

MIN_LOGIT_MARGIN = 1e-3   # FP32 moves logits by about 1e-5
MIN_ROUTE_MARGIN = 1e-4   # and router scores by about 1e-6
MIN_TOKENS = 8            # a prompt is used only if this many leading steps are safe
PROMPT_LEN = 12


def load_model(path: str) -> tuple[Transformer, list[int]]:
    bundle = kdtr.read(path)
    weights = {}
    for name, array in bundle.tensors.items():
        if name.endswith(".qw"):
            base = name[:-3]
            weights[base] = dequantize(array, bundle.tensors[base + ".sc"])
        elif not name.endswith(".sc") and not name.startswith("drafter."):
            weights[name] = array
    return Transformer(ModelArgs.from_json(bundle.header["config"]), weights), bundle.header["prompt"]


def candidates(seed_text: str, vocab: int, count: int, avoid: list[int]) -> np.ndarray:
    state = sum(ord(c) * 131**i for i, c in enumerate(seed_text)) % 2**63 + 12345
    out = []
    while len(out) < count:
        prompt = []
        for _ in range(PROMPT_LEN):
            state = (6364136223846793005 * state + 1442695040888963407) % 2**64
            prompt.append(int(state >> 33) % vocab)
        if prompt != avoid[:PROMPT_LEN]:
            out.append(prompt)
    return np.array(out)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("-n", type=int, default=24)
    opts = parser.parse_args()
    model, bundle_prompt = load_model(opts.bundle)
    prompts = candidates(model.args.name, model.args.vocab_size, 4 * opts.prompts, bundle_prompt)
    traj = generate(model, prompts, opts.n)
    safe = ((traj.logit_margin >= MIN_LOGIT_MARGIN) & (traj.route_margin >= MIN_ROUTE_MARGIN)
            & (traj.group_margin >= MIN_ROUTE_MARGIN))
    result = []
    for i, prompt in enumerate(prompts):
        usable = int(np.cumprod(safe[i]).sum())
        if usable >= MIN_TOKENS and len(result) < opts.prompts:
            result.append({"prompt": prompt.tolist(), "tokens": traj.tokens[i, :usable].tolist()})
    json.dump(result, sys.stdout)
    print()
    return 0 if result else 1


if __name__ == "__main__":
    sys.exit(main())
