"""Time, memory and float32 error of the streaming reference on k2wide (or another config).

    $PYTHON bench/k2wide_reference.py --dtype float64 --save run64.npz [--prompt-len 256] [--steps 3]
    $PYTHON bench/k2wide_reference.py --dtype float32 --compare run64.npz

Runs greedy decoding of the config's first golden candidate prompt with the streaming reference
(kdtree_ref/streaming.py) of one of its bundles and prints JSON: seconds to make the resident
weights, the prefill, each decode step, the whole trajectory extrapolated (prefill + GOLDEN_LEN - 1
steps), each as wall and CPU seconds (`*_cpu_s`, all threads: on a shared machine the wall time
says more about the other load than about the reference), and the process's peak RSS. --save keeps logits, router selection scores and margins;
--compare (the same prompt in another dtype) reports the largest differences from them: the FP32
error the golden rule's margins must leave room for.
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import gen_model  # noqa: E402
from kdtree_ref.model import KVCache, decode_step, prefill, top_margin  # noqa: E402
from kdtree_ref.streaming import StreamingTransformer  # noqa: E402
from kdtree_ref.weights import Weights  # noqa: E402


class Recording(StreamingTransformer):
    """A streaming model that keeps every router selection score (s + bias) it computes, per forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scores: list[np.ndarray] = []

    def gate_scores(self, layer, x):
        scores = super().gate_scores(layer, x)
        self.scores.append((scores + self.w[f"layers.{layer}.ffn.gate.bias"]).astype(np.float64))
        return scores


class Clock:
    """Wall and CPU seconds between laps."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (round(wall - self.wall, 1), round(cpu - self.cpu, 1))
        self.wall, self.cpu = wall, cpu
        return out


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # ru_maxrss is in KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="k2wide", choices=sorted(gen_model.CONFIGS))
    parser.add_argument("--quant", default="int4", choices=("int4", "fp32"), help="which bundle's model")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--prompt-len", type=int, default=0, help="default: the config's golden prompt length")
    parser.add_argument("--steps", type=int, default=3, help="decode steps after the prefill")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--compare", type=Path)
    opts = parser.parse_args()
    args = gen_model.CONFIGS[opts.config]
    recipe = gen_model.RECIPES.get(opts.config, gen_model.Recipe())
    length = opts.prompt_len or gen_model.RULES[opts.config].prompt_len
    prompt = gen_model.prompts_from(args, "golden", 1, 0, length)
    result = {"config": opts.config, "quant": opts.quant, "dtype": opts.dtype, "prompt_len": length}

    clock = Clock()
    model = Recording(Weights(args, direct_int4=recipe.direct_int4), gen_model.quant_header(recipe, opts.quant),
                      dtype=np.dtype(opts.dtype).type)
    result["resident_s"], result["resident_cpu_s"] = clock.lap()
    result["resident_rss_gib"] = round(peak_rss_gib(), 2)
    cache = KVCache(args, 1, capacity=length + opts.steps + 1, dtype=model.dtype)
    clock.lap()
    out = prefill(model, prompt, cache)
    result["prefill_s"], result["prefill_cpu_s"] = clock.lap()
    logits, margins = [out.logits[0, -1]], [float(np.min(out.route_margin))]
    steps, steps_cpu = [], []
    for _ in range(opts.steps):
        token = np.argmax(logits[-1])[None]
        clock.lap()
        out = decode_step(model, token, cache)
        wall, cpu = clock.lap()
        steps.append(wall)
        steps_cpu.append(cpu)
        logits.append(out.logits[0, 0])
        margins.append(float(np.min(out.route_margin)))
    result["decode_s"], result["decode_cpu_s"] = steps, steps_cpu
    for unit, per_step in (("s", steps), ("cpu_s", steps_cpu)):
        mean_step = float(np.mean(per_step)) if per_step else 0.0
        result[f"trajectory_{unit}_extrapolated"] = round(result[f"resident_{unit}"] + result[f"prefill_{unit}"]
                                                          + (gen_model.GOLDEN_LEN - 1) * mean_step)
    result["peak_rss_gib"] = round(peak_rss_gib(), 2)
    logits = np.array(logits, dtype=np.float64)
    result["tokens"] = [int(t) for t in np.argmax(logits, axis=-1)]
    result["logit_margins"] = [float(f"{m:.4g}") for m in top_margin(logits)]
    result["route_margins"] = [float(f"{m:.4g}") for m in margins]
    result["logit_std"] = float(f"{np.std(logits):.4g}")
    scores = np.concatenate([s.reshape(-1, s.shape[-1]) for s in model.scores])
    if opts.save:
        np.savez(opts.save, logits=logits, scores=scores, tokens=np.array(result["tokens"]))
    if opts.compare:
        base = np.load(opts.compare)
        result["same_tokens"] = bool(np.array_equal(base["tokens"], result["tokens"]))
        result["max_logit_diff"] = float(f"{np.max(np.abs(base['logits'] - logits)):.4g}")
        result["max_score_diff"] = float(f"{np.max(np.abs(base['scores'] - scores)):.4g}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
