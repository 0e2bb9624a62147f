"""The GPU kernel benchmarks' figures reach the engine's bench.json, and from there the record:
scripts/merge_gpu_bench.py folds bench_gpu's report and PyTorch's side-by-side figures
(bench/torch_ref.py) in as gpu.* and gpu.torch.* metrics; torch_ref.py without a usable torch
writes a report that says so and exits 0. No GPU needed: the reports are written here in the
scripts' formats (the figures are examples, not measurements)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from orchestrator.records.result_files import bench_from_engine

ENGINE = Path(__file__).resolve().parents[2] / "engine_src"
MERGE = ENGINE / "scripts" / "merge_gpu_bench.py"
TORCH_REF = ENGINE / "bench" / "torch_ref.py"


def _gemm_row(N, K, M, us):
    return {"N": N, "K": K, "M": M, "w4a16_us": us, "w4a16_GBps": 2600.0, "w4a16_pct_ceiling": 58.0,
            "speedup_vs_sgemm": 8.0, "valid": True}


GPU = {"version": 1, "device": "example", "sm": "sm_90", "ceiling": {"read_GBps": 4500.0},
       "w4a16_gemm": [_gemm_row(28672, 8192, 1, 54.0), _gemm_row(28672, 8192, 16, 147.0),
                      _gemm_row(2048, 7168, 1, 8.0)],
       "moe_k2_layer": [{"tokens": 1, "int4_graph_us": 300.0, "fp32_cublas_us": 1270.0,
                         "speedup_int4_vs_fp32_cublas": 4.2}],
       "failures": 0}
TORCH = {"version": 1, "available": True, "torch": "2.11.0", "device": "example", "note": "5 of 6 timings",
         "rows": [{"kernel": "tinygemm", "N": 28672, "K": 8192, "M": 1, "us": 84.0, "valid": True},
                  {"kernel": "tinygemm", "N": 28672, "K": 8192, "M": 16, "us": 274.0, "valid": True},
                  {"kernel": "cublas_bf16", "N": 28672, "K": 8192, "M": 1, "us": 123.0},
                  {"kernel": "cublas_bf16", "N": 28672, "K": 8192, "M": 16, "error": "RuntimeError: boom"},
                  {"kernel": "tinygemm", "N": 7168, "K": 2048, "M": 1, "us": 9.5, "valid": True}]}


def _merge(tmp_path: Path, torch_report: dict | str | None) -> tuple[subprocess.CompletedProcess, dict]:
    bench, gpu = tmp_path / "bench.json", tmp_path / "bench_gpu.json"
    bench.write_text(json.dumps({"version": 1, "metrics": {"tiny_fp32.ar_tok_s": {"value": 900.0, "unit": "tok/s",
                                                                                  "better": "higher"}}}))
    gpu.write_text(json.dumps(GPU))
    args = [sys.executable, str(MERGE), str(bench), str(gpu)]
    if torch_report is not None:
        path = tmp_path / "bench_torch.json"
        path.write_text(torch_report if isinstance(torch_report, str) else json.dumps(torch_report))
        args.append(str(path))
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads(bench.read_text())


def test_torch_figures_become_metrics_with_ratios_against_ours(tmp_path):
    done, bench = _merge(tmp_path, TORCH)
    m = bench["metrics"]
    assert m["gpu.torch.tinygemm.28672x8192.m1.us"] == {"value": 84.0, "unit": "us", "better": "lower"}
    assert m["gpu.torch.tinygemm.28672x8192.m1.w4a16_speedup"]["value"] == 84.0 / 54.0
    assert m["gpu.torch.tinygemm.28672x8192.m16.w4a16_speedup"]["value"] == 274.0 / 147.0
    assert m["gpu.torch.cublas_bf16.28672x8192.m1.w4a16_speedup"]["better"] == "higher"
    # The failed timing has no metric; a shape bench_gpu did not time has a time but no ratio.
    assert not any(k.startswith("gpu.torch.cublas_bf16.28672x8192.m16") for k in m)
    assert "gpu.torch.tinygemm.7168x2048.m1.us" in m and "gpu.torch.tinygemm.7168x2048.m1.w4a16_speedup" not in m
    # bench_gpu's own metrics and the engine's are still there; the whole torch report is kept.
    assert m["gpu.w4a16.28672x8192.m1.us"]["value"] == 54.0 and "tiny_fp32.ar_tok_s" in m
    assert bench["gpu_kernels"]["torch"]["rows"][3]["error"] == "RuntimeError: boom"
    assert "7 of PyTorch's" in done.stdout and "5 of 6 timings" in done.stdout
    # The orchestrator's bench step keeps them in the record like the other gpu.* metrics.
    record = bench_from_engine(bench)
    assert record["metrics"]["gpu.torch.tinygemm.28672x8192.m1.w4a16_speedup"]["value"] == 84.0 / 54.0
    assert record["details"]["gpu_kernels"]["torch"]["torch"] == "2.11.0"


def test_a_skipped_or_unreadable_torch_report_adds_no_metric_and_says_why(tmp_path):
    skipped = {"version": 1, "available": False, "note": "skipped: this Python cannot import torch"}
    done, bench = _merge(tmp_path, skipped)
    assert not any(k.startswith("gpu.torch.") for k in bench["metrics"])
    assert "gpu.w4a16.28672x8192.m1.us" in bench["metrics"]
    assert bench["gpu_kernels"]["torch"]["note"] == skipped["note"] and "cannot import torch" in done.stdout
    done, bench = _merge(tmp_path, '{"version": 1, "avail')     # a report cut short
    assert not any(k.startswith("gpu.torch.") for k in bench["metrics"])
    assert "unreadable" in bench["gpu_kernels"]["torch"]["note"]
    _, bench = _merge(tmp_path, None)                              # no torch run at all
    assert "torch" not in bench["gpu_kernels"] and "gpu.read_ceiling_GBps" in bench["metrics"]


def test_torch_ref_without_torch_writes_a_skip_note_and_exits_0(tmp_path):
    """A torch that cannot be imported (a package that raises on import, first on the path) is a
    skip with its reason, never a failed benchmark."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('libtorch_cuda.so: cannot open shared object')\n")
    out = tmp_path / "bench_torch.json"
    done = subprocess.run([sys.executable, str(TORCH_REF), "--json", str(out), "--quick"], capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["available"] is False and "libtorch_cuda.so" in report["note"], report
    assert "skipped" in done.stdout
    bad = subprocess.run([sys.executable, str(TORCH_REF), "--json", str(out), "--m", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--m must be" in bad.stderr


def test_ours_timed_interleaved_with_torch_defines_the_w4a16_metrics_and_ratios(tmp_path):
    """torch_ref.py's "w4a16" rows (ours, timed in the same process between PyTorch's kernels)
    replace bench_gpu's own time of that shape and M, their share of the ceiling is computed
    from bench_gpu's ceiling, and PyTorch's ratios are against them; forced-super-chunk rows
    (w4a16_sc<L>) make no metric; the MoE layer's share of its byte limit becomes a metric."""
    rows = TORCH["rows"] + [
        {"kernel": "w4a16", "N": 28672, "K": 8192, "M": 1, "us": 42.0, "p10_us": 41.5, "p90_us": 43.0},
        {"kernel": "w4a16_sc512", "N": 28672, "K": 8192, "M": 1, "us": 40.0, "p10_us": 39.0, "p90_us": 41.0},
        {"kernel": "w4a16", "N": 28672, "K": 8192, "M": 16, "error": "RuntimeError: kd_w4_matmul: boom"}]
    gpu = dict(GPU, moe_k2_layer=[dict(GPU["moe_k2_layer"][0], pct_ceiling=61.5, byte_limit_bytes=2.6e8)])
    bench, gpu_path, torch_path = tmp_path / "bench.json", tmp_path / "bench_gpu.json", tmp_path / "bench_torch.json"
    bench.write_text(json.dumps({"version": 1, "metrics": {}}))
    gpu_path.write_text(json.dumps(gpu))
    torch_path.write_text(json.dumps(dict(TORCH, rows=rows)))
    done = subprocess.run([sys.executable, str(MERGE), str(bench), str(gpu_path), str(torch_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    m = json.loads(bench.read_text())["metrics"]
    assert m["gpu.w4a16.28672x8192.m1.us"]["value"] == 42.0
    expected_pct = 100.0 * (28672 * 8192 * 0.625 + 4.0 * (8192 + 28672)) / 42.0 / 1e3 / 4500.0
    assert abs(m["gpu.w4a16.28672x8192.m1.pct_ceiling"]["value"] - expected_pct) < 1e-9
    assert m["gpu.torch.tinygemm.28672x8192.m1.w4a16_speedup"]["value"] == 84.0 / 42.0
    # Ours failed at M = 16 in the interleaved run: bench_gpu's own figure stays.
    assert m["gpu.w4a16.28672x8192.m16.us"]["value"] == 147.0
    assert m["gpu.torch.tinygemm.28672x8192.m16.w4a16_speedup"]["value"] == 274.0 / 147.0
    assert not any("w4a16_sc512" in k for k in m)
    assert m["gpu.moe_k2.t1.pct_ceiling"] == {"value": 61.5, "unit": "%", "better": "higher"}


def test_a_kept_kernel_is_compared_with_ours_in_the_table_and_makes_no_metric(tmp_path):
    """torch_ref.py --kept: another tree's kernel timed beside ours. Its rows come after ours,
    the table gives its median over ours and says whether ours equals it bit for bit (a differing
    output is flagged), and the merge makes no metric of it."""
    spec = importlib.util.spec_from_file_location("torch_ref", TORCH_REF)
    assert spec is not None and spec.loader is not None
    torch_ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_ref)
    assert torch_ref._our_kernels([512], {"ours": None, "kept": None}) == [
        ("w4a16", "ours", 0), ("w4a16_sc512", "ours", 512), ("w4a16_kept", "kept", 0)]
    assert torch_ref._our_kernels([], {"kept": None}) == [("w4a16_kept", "kept", 0)]

    def row(kernel, M, us, **extra):
        return {"kernel": kernel, "N": 28672, "K": 8192, "M": M, "us": us, "p10_us": us - 1.0, "p90_us": us + 1.0,
                **extra}
    rows = [row("w4a16", 32, 182.0, bits_equal_kept=True), row("w4a16_kept", 32, 202.0),
            row("w4a16", 64, 360.0, bits_equal_kept=False), row("w4a16_kept", 64, 405.0)]
    text = torch_ref.table({"rows": rows})
    assert "M=32: w4a16 182.00 [181.00-183.00] bits=kept | w4a16_kept 202.00 [201.00-203.00] 1.11x" in text
    assert "M=64: w4a16 360.00 [359.00-361.00] BITS DIFFER FROM KEPT | w4a16_kept 405.00" in text

    bench, gpu_path, torch_path = tmp_path / "bench.json", tmp_path / "bench_gpu.json", tmp_path / "bench_torch.json"
    bench.write_text(json.dumps({"version": 1, "metrics": {}}))
    gpu_path.write_text(json.dumps(GPU))
    torch_path.write_text(json.dumps(dict(TORCH, rows=TORCH["rows"] + [row("w4a16_kept", 1, 50.0)])))
    done = subprocess.run([sys.executable, str(MERGE), str(bench), str(gpu_path), str(torch_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    m = json.loads(bench.read_text())["metrics"]
    assert not any("kept" in k for k in m) and m["gpu.w4a16.28672x8192.m1.us"]["value"] == 54.0
