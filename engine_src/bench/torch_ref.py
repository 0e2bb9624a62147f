"""What a user would otherwise run, timed on the same GPU and shapes as bench_gpu's w4a16 table:
PyTorch's INT4 kernel (tinygemm: torch._weight_int4pack_mm, bf16 activations, group 32, weights
packed by torch._convert_weight_to_int4pack) and cuBLAS bf16 (torch.matmul on bf16 weights).

    python3 bench/torch_ref.py --json PATH [--quick] [--m 1,16]

Timing as bench_gpu's: CUDA events around back-to-back calls over a rotating set of weight copies
(one rotation reads >= 512 MB, several times the L2, so no call finds its weights in L2), warm-up
first, the median over repeats of the time per call. tinygemm's output is checked against the
same weights dequantized in fp32 (its weights: nibble n in 1..15, w = (n - 8) * scale, the
engine's quantiser's range; zero point 0). Without torch, without a GPU, or on any torch error the
report says why ("available": false, or a row's "error") and the exit status is still 0: this
comparison never fails a benchmark run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

SHAPES = ((2048, 7168), (7168, 2048), (28672, 8192))   # N x K, bench_gpu's
GROUP = 32
INNER_K_TILES = 8
ROTATION_BYTES = 512 << 20


def _report(path: str, report: dict) -> None:
    """Write the report; a note on stdout says what happened."""
    with open(path + ".tmp", "w") as f:   # whole or absent: a killed run leaves no half report
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"torch_ref: {report['note']} ({path})")


def _per_call_us(torch, reps: int, copies: int, fn) -> float:
    """Median over reps of the time of `copies` back-to-back calls fn(0..copies-1), per call (us)."""
    for i in range(min(copies, 4)):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for i in range(copies):
            fn(i)
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end) / copies)
    times.sort()
    return times[len(times) // 2]


def _pack_int4(torch, nibbles):
    """tinygemm's packed weight from nibbles [N][K] (int32, 0..15): the uint8 [N][K/2] input of
    torch >= 2.5 (even k in the high half), else the int32 [N][K] one of earlier versions; the
    first error when neither is taken."""
    try:
        as_bytes = ((nibbles[:, ::2] << 4) | nibbles[:, 1::2]).to(torch.uint8)
        return torch._convert_weight_to_int4pack(as_bytes, INNER_K_TILES)
    except (RuntimeError, TypeError) as first:
        try:
            return torch._convert_weight_to_int4pack(nibbles.contiguous(), INNER_K_TILES)
        except (RuntimeError, TypeError):
            raise first from None


def _random_int4(torch, gen, N: int, K: int):
    """Nibbles [N][K] in 1..15 (int32) and bf16 scales [K/32][N] in [0.002, 0.02]: the engine's
    quantiser's ranges, w = (nibble - 8) * scale."""
    q = torch.randint(1, 16, (N, K), device="cuda", dtype=torch.int32, generator=gen)
    s = (torch.rand((K // GROUP, N), device="cuda", generator=gen) * 0.018 + 0.002).to(torch.bfloat16)
    return q, s


def _tinygemm_set(torch, gen, q0, s0, N: int, K: int, copies: int):
    """`copies` packed weights and their [K/32][N][scale, zero] tables (zero point 0), the first
    from q0 and s0."""
    packed, tables = [], []
    for c in range(copies):
        q, s = (q0, s0) if c == 0 else _random_int4(torch, gen, N, K)
        packed.append(_pack_int4(torch, q))
        tables.append(torch.stack([s, torch.zeros_like(s)], dim=2).contiguous())
    return packed, tables


def _nmse(got, ref) -> float:
    """Normalised mean squared error of got against ref (fp32 tensors)."""
    return float(((got - ref) ** 2).sum() / (ref ** 2).sum().clamp_min(1e-30))


def _bench_shape(torch, N: int, K: int, ms: list[int], reps: int) -> list[dict]:
    """Rows for one N x K: tinygemm and cuBLAS bf16 at each M, each with its time or its error
    (a tinygemm failure leaves cuBLAS's rows timed)."""
    gen = torch.Generator(device="cuda").manual_seed(N * 31 + K)
    copies_q = max(2, ROTATION_BYTES // (N * K // 2) + 1)
    copies_b = max(2, ROTATION_BYTES // (N * K * 2) + 1)
    try:
        x = (torch.rand((max(ms), K), device="cuda", generator=gen) * 2 - 1).to(torch.bfloat16)
        q0, s0 = _random_int4(torch, gen, N, K)
        dense = (q0 - 8).float() * s0.float().t().repeat_interleave(GROUP, dim=1)   # fp32 [N][K]
        wb = [dense.to(torch.bfloat16) for _ in range(copies_b)]
        ref = x.float() @ dense.t()
        del dense
    except Exception as e:   # noqa: BLE001 — any torch failure becomes a row, never a failed bench
        return [{"kernel": k, "N": N, "K": K, "M": m, "error": _one_line(e)} for k in ("tinygemm", "cublas_bf16")
                for m in ms]
    tiny_error = err = None
    try:
        packed, tables = _tinygemm_set(torch, gen, q0, s0, N, K, copies_q)
        err = _nmse(torch._weight_int4pack_mm(x, packed[0], GROUP, tables[0]).float(), ref)
    except Exception as e:   # noqa: BLE001
        tiny_error = _one_line(e)
    del q0, ref
    rows = []
    for m in ms:
        xm = x[:m].contiguous()
        for kernel, copies, call in (
                ("tinygemm", copies_q, lambda i, xm=xm: torch._weight_int4pack_mm(xm, packed[i], GROUP, tables[i])),
                ("cublas_bf16", copies_b, lambda i, xm=xm: torch.matmul(xm, wb[i].t()))):
            row = {"kernel": kernel, "N": N, "K": K, "M": m, "copies": copies}
            if kernel == "tinygemm" and tiny_error is not None:
                rows.append({**row, "error": tiny_error})
                continue
            try:
                us = _per_call_us(torch, reps, copies, call)
                weight_bytes = N * K * (0.5 + 4.0 / GROUP) if kernel == "tinygemm" else N * K * 2.0
                row.update(us=us, GBps=(weight_bytes + 2.0 * m * (K + N)) / us / 1e3)
                if kernel == "tinygemm":
                    row.update(nmse_vs_fp32=err, valid=err is not None and err < 1e-4)
            except Exception as e:   # noqa: BLE001
                row["error"] = _one_line(e)
            rows.append(row)
    return rows


def _one_line(e: BaseException) -> str:
    """An exception as one bounded line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def run(ms: list[int], reps: int) -> dict:
    """The report: torch's version, the device, one row per kernel, shape and M."""
    try:
        import torch
    except Exception as e:   # noqa: BLE001 — no torch (or a broken one) is a skip, said as such
        return {"available": False, "note": f"skipped: this Python ({sys.executable}) cannot import torch ({_one_line(e)})"}
    if not torch.cuda.is_available():
        return {"available": False, "torch": torch.__version__,
                "note": f"skipped: torch {torch.__version__} sees no CUDA device"}
    missing = [f for f in ("_weight_int4pack_mm", "_convert_weight_to_int4pack") if not hasattr(torch, f)]
    if missing:
        return {"available": False, "torch": torch.__version__,
                "note": f"skipped: torch {torch.__version__} has no {', '.join(missing)}"}
    started = time.monotonic()
    rows = []
    for N, K in SHAPES:
        rows += _bench_shape(torch, N, K, ms, reps)
        torch.cuda.empty_cache()
    failed = [r for r in rows if "error" in r]
    invalid = [r for r in rows if r.get("valid") is False]
    note = f"{len(rows) - len(failed)} of {len(rows)} timings in {time.monotonic() - started:.0f} s"
    if failed:
        note += f"; {len(failed)} failed (first: {failed[0]['error']})"
    if invalid:
        note += f"; tinygemm's output differs from the fp32 reference (nmse {invalid[0]['nmse_vs_fp32']:.1e})"
    return {"available": True, "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
            "group": GROUP, "inner_k_tiles": INNER_K_TILES, "reps": reps, "rows": rows, "note": note}


def main(argv: list[str]) -> int:
    """Parse the flags, run, write the report; 0 whatever torch did, 2 on bad flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where the report goes")
    parser.add_argument("--quick", action="store_true", help="5 repeats instead of 15")
    parser.add_argument("--m", default="1,16", help="token counts, comma-separated (default 1,16)")
    args = parser.parse_args(argv)
    try:
        ms = [int(v) for v in args.m.split(",")]
        if not ms or min(ms) < 1 or max(ms) > 256:
            raise ValueError
    except ValueError:
        parser.error(f"--m must be comma-separated token counts in 1..256, got '{args.m}'")
    try:
        report = run(ms, 5 if args.quick else 15)
    except Exception as e:   # noqa: BLE001 — the comparison never fails the bench
        traceback.print_exc()
        report = {"available": False, "note": f"failed: {_one_line(e)}"}
    _report(args.json, {"version": 1, **report})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
