"""The decode figures of the big configs' bundles (k2wide) in build/bench.json, against the GPU's
read ceiling measured in the same run (scripts/merge_gpu_bench.py's gpu.read_ceiling_GBps).

    python3 scripts/big_bundle_metrics.py build/bench.json tests/refs/manifest.json

For every config the manifest lists as written by the streaming writer (generator.keys) whose
INT4 bundle was benchmarked: <config>.ar_tokens_per_s and .ddtree_tokens_per_s (the INT4
bundle's, DDTree at its best budget), .decode_us_per_token (AR decode), .decode_step_bytes (what
one AR decode step must read at least: every weight but the embedding's other rows, the routed
experts the step uses (top-k of them) and the drafter, plus the KV cache at the golden prompt's
length), .decode_pct_ceiling (those bytes at the read ceiling over the measured time),
.moe_layer_decode_us (bench_gpu's K2-width MoE layer at one token, the shape of k2wide's MoE
layer). Decode alone (after the prompt), AR and DDTree at its best budget (the budget of the
highest decode tokens/s among those benchmarked): .ar_decode_tokens_per_s,
.ddtree_decode_tokens_per_s, .ddtree_round_bytes (what one DDTree round must read at least: the
AR step's bytes, the drafter's weights once and the tree's KV rows, one per node of the budget)
and .ddtree_decode_pct_ceiling (the round's bytes per committed token, the round committing the
budget's mean acceptance length, at the read ceiling over the measured time per token). The byte
breakdown by weight class, and DDTree's budget, acceptance and round bytes, go to details
"big_bundles".
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from kdtree_ref import kdtr  # noqa: E402


def metric(value: float, unit: str, better: str) -> dict:
    return {"value": value, "unit": unit, "better": better}


def weight_class(name: str, dense_layers: int) -> str:
    """The part of the model a stored tensor belongs to, for the byte breakdown."""
    if name.startswith("drafter."):
        return "drafter"
    if name in ("embed", "head"):
        return name
    if ".attn." in name:
        return "attention"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared." in name:
        return "shared_expert"
    if ".ffn.gate." in name:
        return "router"
    if ".ffn." in name:
        return "dense_ffn" if int(name.split(".")[1]) < dense_layers else "moe_other"
    return "norms"


def decode_step_bytes(header: dict) -> dict[str, int]:
    """Bytes one AR decode step reads at least, by weight class: whole tensors but one embedding
    row, top-k of the routed experts and no drafter; the KV cache at the golden prompt's length."""
    config = header["config"]
    vocab, routed, top_k = config["vocab_size"], config["n_routed_experts"], config["n_activated_experts"]
    out: dict[str, int] = {}
    for t in header["tensors"]:
        cls = weight_class(t["name"], config["n_dense_layers"])
        share = {"embed": 1 / vocab, "routed_experts": top_k / max(routed, 1), "drafter": 0}.get(cls, 1)
        out[cls] = out.get(cls, 0) + round(t["nbytes"] * share)
    context = len(header["prompt"]) + len(header["golden"]) // 2
    out["kv_cache"] = 4 * config["n_layers"] * context * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    out.pop("drafter", None)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def ddtree_round_bytes(header: dict, step: dict[str, int], budget: int) -> dict[str, int]:
    """Bytes one DDTree round of `budget` tree nodes reads at least, by part: the AR step's (one
    forward over every weight, counting top-k routed experts per MoE layer: the tree's nodes may
    select more), the drafter's weights once, and the tree's KV rows (one per node and layer)."""
    config = header["config"]
    drafter = sum(t["nbytes"] for t in header["tensors"] if t["name"].startswith("drafter."))
    tree_kv = 4 * config["n_layers"] * budget * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    return {"step": sum(step.values()), "drafter": drafter, "tree_kv": tree_kv}


def ddtree_best(runs: list[dict]) -> dict:
    """The benchmarked DDTree budget of the highest decode tokens/s."""
    return max(runs, key=lambda r: r["decode_tokens_per_second"])


def pct_of_ceiling(nbytes: float, seconds: float, ceiling_gbps: float) -> float:
    """nbytes read in `seconds`, as a percentage of the read ceiling (GB/s)."""
    return 100.0 * nbytes / seconds / (ceiling_gbps * 1e9)


def big_metrics(bench: dict, manifest: dict, refs: Path) -> tuple[dict, dict]:
    """(metrics, details) of the streamed configs' INT4 bundles that bench.json holds figures of."""
    metrics, details = bench.get("metrics", {}), bench.get("bundles", {})
    ceiling = metrics.get("gpu.read_ceiling_GBps", {}).get("value")
    out, breakdown = {}, {}
    for config in manifest.get("generator", {}).get("keys", {}):
        entry = next((b for b in manifest["bundles"] if b["config"] == config and b["quant"] == "int4"), None)
        runs = details.get(f"{config}_int4")
        if entry is None or not runs:
            continue
        header = kdtr.read(refs / entry["file"], lazy=True).header
        parts = decode_step_bytes(header)
        total = sum(parts.values())
        us = 1e6 / runs["ar"]["decode_tokens_per_second"]
        out[f"{config}.ar_tokens_per_s"] = metric(runs["ar"]["tokens_per_second"], "tokens/s", "higher")
        out[f"{config}.ddtree_tokens_per_s"] = metric(max(r["tokens_per_second"] for r in runs["ddtree"]), "tokens/s", "higher")
        out[f"{config}.decode_us_per_token"] = metric(us, "us", "lower")
        out[f"{config}.decode_step_bytes"] = metric(total, "bytes", "lower")
        best = ddtree_best(runs["ddtree"])
        rnd = ddtree_round_bytes(header, parts, best["budget"])
        per_token = sum(rnd.values()) / best["accept_mean"]
        out[f"{config}.ar_decode_tokens_per_s"] = metric(runs["ar"]["decode_tokens_per_second"], "tokens/s", "higher")
        out[f"{config}.ddtree_decode_tokens_per_s"] = metric(best["decode_tokens_per_second"], "tokens/s", "higher")
        out[f"{config}.ddtree_round_bytes"] = metric(sum(rnd.values()), "bytes", "lower")
        if ceiling:
            out[f"{config}.decode_pct_ceiling"] = metric(pct_of_ceiling(total, us * 1e-6, ceiling), "%", "higher")
            out[f"{config}.ddtree_decode_pct_ceiling"] = metric(
                pct_of_ceiling(per_token, 1.0 / best["decode_tokens_per_second"], ceiling), "%", "higher")
        moe = metrics.get("gpu.moe_k2.t1.int4_us")
        if moe:
            out[f"{config}.moe_layer_decode_us"] = metric(moe["value"], "us", "lower")
        top = sorted(parts, key=parts.get, reverse=True)[:2]
        breakdown[config] = {"decode_step_bytes": parts, "total": total, "read_ceiling_GBps": ceiling,
                             "dominated_by": top,
                             "ddtree": {"budget": best["budget"], "accept_mean": best["accept_mean"],
                                        "budgets": [r["budget"] for r in runs["ddtree"]],
                                        "round_bytes": rnd, "bytes_per_token": per_token},
                             "note": f"{top[0]} and {top[1]} are {100 * (parts[top[0]] + parts[top[1]]) / total:.0f} % "
                                     f"of the bytes a decode step reads at {header['config']['n_layers']} layers"}
    return out, breakdown


def main(bench_path: str, manifest_path: str) -> int:
    bench = json.loads(Path(bench_path).read_text())
    manifest = json.loads(Path(manifest_path).read_text())
    found, breakdown = big_metrics(bench, manifest, Path(manifest_path).parent)
    if found:
        bench.setdefault("metrics", {}).update(found)
        bench["big_bundles"] = breakdown
        Path(bench_path).write_text(json.dumps(bench, indent=1))
    for config, b in breakdown.items():
        pct = found.get(f"{config}.decode_pct_ceiling", {}).get("value")
        print(f"{config}: a decode step reads {b['total'] / 1e9:.3f} GB ({b['note']}); "
              f"{found[f'{config}.decode_us_per_token']['value']:.0f} us a token"
              + (f", {pct:.1f} % of the read ceiling" if pct is not None else ""))
        d, pct = b["ddtree"], found.get(f"{config}.ddtree_decode_pct_ceiling", {}).get("value")
        print(f"{config}: DDTree at its best budget ({d['budget']} of {d['budgets']}): "
              f"{found[f'{config}.ddtree_decode_tokens_per_s']['value']:.1f} decode tokens/s against AR's "
              f"{found[f'{config}.ar_decode_tokens_per_s']['value']:.1f}, {d['accept_mean']:.2f} tokens a round, "
              f"{d['bytes_per_token'] / 1e9:.3f} GB a token" + (f", {pct:.1f} % of the read ceiling" if pct is not None else ""))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
