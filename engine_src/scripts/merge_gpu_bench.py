"""Fold the GPU kernel benchmarks (build/bench_gpu.json, scripts/bench_gpu.sh) into the engine's
build/bench.json: headline metrics under "gpu.*" and the whole report under "gpu_kernels"; with
PyTorch's figures on the same shapes (build/bench_torch.json, bench/torch_ref.py) also "gpu.torch.*"
and that report under "gpu_kernels"."torch".

    python3 scripts/merge_gpu_bench.py build/bench.json build/bench_gpu.json [build/bench_torch.json]
"""
from __future__ import annotations

import json
import sys


def metric(value, unit, better):
    return {"value": value, "unit": unit, "better": better}


def gpu_metrics(gpu: dict, torch_ref: dict | None = None) -> dict:
    """The figures a nightly run compares: ceiling, w4a16 time and bandwidth per shape and M,
    the K2 MoE layer INT4 vs FP32 per token count (and its share of its byte limit), and
    PyTorch's kernels on the w4a16 shapes. Where bench/torch_ref.py timed ours interleaved with
    PyTorch's (its "w4a16" rows), gpu.w4a16.*.us and .pct_ceiling are those medians."""
    ceiling = gpu["ceiling"]["read_GBps"]
    out = {"gpu.read_ceiling_GBps": metric(ceiling, "GB/s", "higher")}
    for row in gpu.get("w4a16_gemm", []):
        name = f"gpu.w4a16.{row['N']}x{row['K']}.m{row['M']}"
        out[f"{name}.us"] = metric(row["w4a16_us"], "us", "lower")
        out[f"{name}.pct_ceiling"] = metric(row["w4a16_pct_ceiling"], "%", "higher")
        out[f"{name}.speedup_vs_sgemm"] = metric(row["speedup_vs_sgemm"], "x", "higher")
    for row in interleaved_ours(torch_ref or {}):
        name = f"gpu.w4a16.{row['N']}x{row['K']}.m{row['M']}"
        out[f"{name}.us"] = metric(row["us"], "us", "lower")
        out[f"{name}.pct_ceiling"] = metric(100.0 * w4a16_bytes(row) / row["us"] / 1e3 / ceiling, "%", "higher")
    for row in gpu.get("moe_k2_layer", []):
        name = f"gpu.moe_k2.t{row['tokens']}"
        out[f"{name}.int4_us"] = metric(row["int4_graph_us"], "us", "lower")
        out[f"{name}.fp32_cublas_us"] = metric(row["fp32_cublas_us"], "us", "lower")
        out[f"{name}.int4_speedup"] = metric(row["speedup_int4_vs_fp32_cublas"], "x", "higher")
        if "pct_ceiling" in row:
            out[f"{name}.pct_ceiling"] = metric(row["pct_ceiling"], "%", "higher")
    out.update(torch_metrics(gpu, torch_ref or {}))
    return {k: v for k, v in out.items() if _number(v["value"])}


def w4a16_bytes(row: dict) -> float:
    """What one matmul_w4a16 call must move at least (bench_gpu's count): the weights' nibbles
    and fp32 scales, the fp32 activations read and outputs written."""
    return row["N"] * row["K"] * 0.625 + 4.0 * row["M"] * (row["K"] + row["N"])


def interleaved_ours(torch_ref: dict) -> list[dict]:
    """torch_ref.py's timed rows of our kernel as it runs by default (kernel "w4a16")."""
    if not torch_ref.get("available"):
        return []
    return [r for r in torch_ref.get("rows", []) if isinstance(r, dict) and r.get("kernel") == "w4a16"
            and _number(r.get("us")) and r["us"] > 0]


def torch_metrics(gpu: dict, torch_ref: dict) -> dict:
    """gpu.torch.<kernel>.<N>x<K>.m<M>.us for each timing PyTorch's kernels made, and
    .w4a16_speedup: its time over our w4a16 kernel's at the same shape and M (higher: ours
    faster), against ours from the same interleaved run where it has one, else bench_gpu's."""
    ours = {(r["N"], r["K"], r["M"]): r.get("w4a16_us") for r in gpu.get("w4a16_gemm", [])}
    ours.update({(r["N"], r["K"], r["M"]): r["us"] for r in interleaved_ours(torch_ref)})
    out = {}
    for row in torch_ref.get("rows", []) if torch_ref.get("available") else []:
        if not isinstance(row, dict) or str(row.get("kernel", "")).startswith("w4a16"):
            continue   # ours: the gpu.w4a16.* metrics above
        if not _number(row.get("us")) or row["us"] <= 0:
            continue   # a row with an error has no time
        name = f"gpu.torch.{row['kernel']}.{row['N']}x{row['K']}.m{row['M']}"
        out[f"{name}.us"] = metric(row["us"], "us", "lower")
        mine = ours.get((row["N"], row["K"], row["M"]))
        if _number(mine) and mine > 0:
            out[f"{name}.w4a16_speedup"] = metric(row["us"] / mine, "x", "higher")
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _torch_report(path: str) -> dict:
    """bench/torch_ref.py's report, or one that says why it could not be read (the comparison
    never fails the merge)."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        return {"available": False, "note": f"{path} unreadable: {e}"}
    return report if isinstance(report, dict) else {"available": False, "note": f"{path} is not a JSON object"}


def main(bench_path: str, gpu_path: str, torch_path: str | None = None) -> int:
    with open(bench_path) as f:
        bench = json.load(f)
    with open(gpu_path) as f:
        gpu = json.load(f)
    torch_ref = None
    if torch_path:
        torch_ref = _torch_report(torch_path)
        gpu["torch"] = torch_ref
    merged = gpu_metrics(gpu, torch_ref)
    bench.setdefault("metrics", {}).update(merged)
    bench["gpu_kernels"] = gpu
    with open(bench_path, "w") as f:
        json.dump(bench, f, indent=1)
    n_torch = sum(k.startswith("gpu.torch.") for k in merged)
    print(f"merged {len(merged)} GPU kernel metrics into {bench_path} ({n_torch} of PyTorch's"
          + ("" if torch_ref is None else f"; torch_ref: {torch_ref.get('note', '?')}") + ")")
    return 0


if __name__ == "__main__":
    if not 3 <= len(sys.argv) <= 4:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:4]))
