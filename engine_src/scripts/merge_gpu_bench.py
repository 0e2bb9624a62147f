"""Fold the GPU kernel benchmarks (build/bench_gpu.json, scripts/bench_gpu.sh) into the engine's
build/bench.json: headline metrics under "gpu.*" and the whole report under "gpu_kernels".

    python3 scripts/merge_gpu_bench.py build/bench.json build/bench_gpu.json
"""
import json
import sys


def metric(value, unit, better):
    return {"value": value, "unit": unit, "better": better}


def gpu_metrics(gpu: dict) -> dict:
    """The figures a nightly run compares: ceiling, w4a16 time and bandwidth per shape and M,
    the K2 MoE layer INT4 vs FP32 per token count."""
    out = {"gpu.read_ceiling_GBps": metric(gpu["ceiling"]["read_GBps"], "GB/s", "higher")}
    for row in gpu.get("w4a16_gemm", []):
        name = f"gpu.w4a16.{row['N']}x{row['K']}.m{row['M']}"
        out[f"{name}.us"] = metric(row["w4a16_us"], "us", "lower")
        out[f"{name}.pct_ceiling"] = metric(row["w4a16_pct_ceiling"], "%", "higher")
        out[f"{name}.speedup_vs_sgemm"] = metric(row["speedup_vs_sgemm"], "x", "higher")
    for row in gpu.get("moe_k2_layer", []):
        name = f"gpu.moe_k2.t{row['tokens']}"
        out[f"{name}.int4_us"] = metric(row["int4_graph_us"], "us", "lower")
        out[f"{name}.fp32_cublas_us"] = metric(row["fp32_cublas_us"], "us", "lower")
        out[f"{name}.int4_speedup"] = metric(row["speedup_int4_vs_fp32_cublas"], "x", "higher")
    return {k: v for k, v in out.items() if isinstance(v["value"], (int, float))}


def main(bench_path: str, gpu_path: str) -> int:
    with open(bench_path) as f:
        bench = json.load(f)
    with open(gpu_path) as f:
        gpu = json.load(f)
    bench.setdefault("metrics", {}).update(gpu_metrics(gpu))
    bench["gpu_kernels"] = gpu
    with open(bench_path, "w") as f:
        json.dump(bench, f, indent=1)
    print(f"merged {len(gpu_metrics(gpu))} GPU kernel metrics into {bench_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
