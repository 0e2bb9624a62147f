"""Our INT4 kernel side by side with what a user would otherwise run, interleaved in one process
on one GPU and stream: the backend's matmul_w4a16 (through build/libkd_w4.so, bench/w4_shim.cu),
PyTorch's INT4 kernel (tinygemm: torch._weight_int4pack_mm, bf16 activations, group 32, weights
packed by torch._convert_weight_to_int4pack) and cuBLAS bf16 (torch.matmul on bf16 weights).

    python3 bench/torch_ref.py --json PATH [--ours LIB] [--kept LIB] [--quick] [--m 1,2,4,8,16]
                               [--m-large 32,64] [--schunk 512,256]

Timing: CUDA events around back-to-back calls over a rotating set of weight copies (one rotation
reads >= 512 MB, several times the L2, so no call finds its weights in L2), warm-up first. Each
repetition times every kernel once, in an order that rotates from one repetition to the next, so
a clock or a co-tenant that drifts reaches them all alike; each row has the median, p10 and p90
over the repetitions of the time per call. All three kernels get the same weights (nibble n in
1..15, w = (n - 8) * scale with bf16 scales, the engine's quantiser's range; zero point 0) and
the same activations (ours in fp32, theirs in bf16: the same values); each output is checked
against those weights dequantized in fp32. --schunk adds rows "w4a16_sc<L>": ours with the
super-chunk forced to L inputs (a measurement knob, w4_schunk_override). --kept adds rows
"w4a16_kept": another engine tree's libkd_w4.so (the kernel a change is measured against), timed
in the same repetitions, and each "w4a16" row says whether its output equals the kept kernel's bit
for bit ("bits_equal_kept": the same arithmetic). Without torch, without
a GPU, or on any torch error the report says why ("available": false, or a row's "error") and
the exit status is still 0: this comparison never fails a benchmark run.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
import traceback

SHAPES = ((2048, 7168), (7168, 2048), (28672, 8192))   # N x K, bench_gpu's
LARGE = (28672, 8192)                                    # the shape also timed at --m-large
GROUP = 32
INNER_K_TILES = 8
ROTATION_BYTES = 512 << 20


def _report(path: str, report: dict) -> None:
    """Write the report; a note on stdout says what happened."""
    with open(path + ".tmp", "w") as f:   # whole or absent: a killed run leaves no half report
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"torch_ref: {report['note']} ({path})")


def _quantile(sorted_times: list[float], q: float) -> float:
    """The q-quantile of sorted times (nearest rank)."""
    return sorted_times[round(q * (len(sorted_times) - 1))]


def _interleaved_us(torch, reps: int, kernels: dict) -> dict:
    """kernels: name -> (copies, fn(i)). Per name, the sorted per-call times (us) of `reps`
    repetitions; a repetition times `copies` back-to-back calls fn(0..copies-1) of every kernel,
    the kernels' order rotated by one each repetition. A kernel whose call raises gets its error."""
    names = list(kernels)
    times: dict = {n: [] for n in names}
    for n in names:                     # warm-up (handles, module load, first-call work)
        copies, fn = kernels[n]
        try:
            for i in range(min(copies, 4)):
                fn(i)
        except Exception as e:   # noqa: BLE001 — a failing kernel becomes a row's error
            times[n] = _one_line(e)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    live = [n for n in names if isinstance(times[n], list)]
    for r in range(reps):
        for n in live[r % len(live):] + live[:r % len(live)] if live else []:
            copies, fn = kernels[n]
            start.record()
            for i in range(copies):
                fn(i)
            end.record()
            end.synchronize()
            times[n].append(1000.0 * start.elapsed_time(end) / copies)
    return {n: sorted(t) if isinstance(t, list) else t for n, t in times.items()}


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


class Ours:
    """The backend's matmul_w4a16 through build/libkd_w4.so (bench/w4_shim.cu), queued on
    PyTorch's current stream."""

    def __init__(self, torch, path: str):
        self.torch = torch
        lib = ctypes.CDLL(path)
        for name, res, args in (("kd_w4_init", ctypes.c_int, [ctypes.c_void_p]),
                                ("kd_w4_error", ctypes.c_char_p, []),
                                ("kd_w4_tiled_words", ctypes.c_size_t, [ctypes.c_int, ctypes.c_int]),
                                ("kd_w4_tiled_scales", ctypes.c_size_t, [ctypes.c_int, ctypes.c_int]),
                                ("kd_w4_tile", ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2),
                                ("kd_w4_matmul", ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3),
                                ("kd_w4_set_schunk", ctypes.c_int, [ctypes.c_int]),
                                ("kd_w4_schunk", ctypes.c_int, [])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib
        self._check(lib.kd_w4_init(torch.cuda.current_stream().cuda_stream), "kd_w4_init")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.kd_w4_error().decode(errors='replace')[:200]}")

    def tiled(self, nibbles, scales):
        """The tiled layout of nibbles [N][K] (int32, 0..15) with scales [K/32][N] (bf16)."""
        torch = self.torch
        N, K = nibbles.shape
        words = torch.zeros((N, K // 8), device="cuda", dtype=torch.int64)
        for i in range(8):   # the bundle's layout: word j, bits 4i..4i+3 = input 8j + i
            words |= nibbles[:, i::8].to(torch.int64) << (4 * i)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        sc = scales.float().t().contiguous()
        tq = torch.empty(self.lib.kd_w4_tiled_words(N, K), device="cuda", dtype=torch.int32)
        ts = torch.empty(self.lib.kd_w4_tiled_scales(N, K), device="cuda", dtype=torch.float32)
        self._check(self.lib.kd_w4_tile(tq.data_ptr(), ts.data_ptr(), words.data_ptr(), sc.data_ptr(), N, K),
                    "kd_w4_tile")
        return tq, ts

    def matmul(self, y, x, tq, ts, sc_len: int) -> None:
        """y = x W^T with the super-chunk forced to sc_len inputs (0: the default)."""
        M, K = x.shape
        self._check(self.lib.kd_w4_set_schunk(sc_len), "kd_w4_set_schunk")
        self._check(self.lib.kd_w4_matmul(y.data_ptr(), x.data_ptr(), tq.data_ptr(), ts.data_ptr(), M, y.shape[1], K),
                    "kd_w4_matmul")


def _weight_sets(torch, gen, q0, s0, N: int, K: int, copies: int, libs: dict):
    """`copies` weight sets, the first from q0 and s0: tinygemm's packed weights, their
    [K/32][N][scale, zero] tables (zero point 0) and each library's tiled copies (name -> list)."""
    packed, tables, tiled = [], [], {name: [] for name in libs}
    for c in range(copies):
        q, s = (q0, s0) if c == 0 else _random_int4(torch, gen, N, K)
        packed.append(_pack_int4(torch, q))
        tables.append(torch.stack([s, torch.zeros_like(s)], dim=2).contiguous())
        for name, lib in libs.items():
            tiled[name].append(lib.tiled(q, s))
    return packed, tables, tiled


def _nmse(got, ref) -> float:
    """Normalised mean squared error of got against ref (fp32 tensors)."""
    return float(((got - ref) ** 2).sum() / (ref ** 2).sum().clamp_min(1e-30))


def _our_kernels(schunks: list[int], libs: dict) -> list[tuple[str, str, int]]:
    """Our rows (name, library, forced super-chunk length) for the libraries in libs ("ours",
    "kept"): w4a16 (the default), w4a16_sc<L>, then w4a16_kept."""
    rows = [("w4a16", "ours", 0)] + [(f"w4a16_sc{L}", "ours", L) for L in schunks] if "ours" in libs else []
    return rows + ([("w4a16_kept", "kept", 0)] if "kept" in libs else [])


def _bench_shape(torch, libs: dict, N: int, K: int, ms: list[int], reps: int, schunks: list[int]) -> list[dict]:
    """Rows for one N x K: each kernel at each M, timed interleaved, each with its times or its
    error (a failing kernel leaves the others timed). libs: "ours" and "kept" (Ours), if given."""
    gen = torch.Generator(device="cuda").manual_seed(N * 31 + K)
    copies_q = max(2, ROTATION_BYTES // (N * K // 2) + 1)
    copies_b = max(2, ROTATION_BYTES // (N * K * 2) + 1)
    mine = _our_kernels(schunks, libs)
    names = ["tinygemm", "cublas_bf16"] + [n for n, _, _ in mine]
    try:
        x = (torch.rand((max(ms), K), device="cuda", generator=gen) * 2 - 1).to(torch.bfloat16)
        xf = x.float()
        q0, s0 = _random_int4(torch, gen, N, K)
        dense = (q0 - 8).float() * s0.float().t().repeat_interleave(GROUP, dim=1)   # fp32 [N][K]
        wb = [dense.to(torch.bfloat16) for _ in range(copies_b)]
        ref = xf @ dense.t()
        del dense
        packed, tables, tiled = _weight_sets(torch, gen, q0, s0, N, K, copies_q, libs)
        del q0
    except Exception as e:   # noqa: BLE001 — any torch failure becomes a row, never a failed bench
        return [{"kernel": k, "N": N, "K": K, "M": m, "error": _one_line(e)} for k in names for m in ms]
    rows = []
    for m in ms:
        xm, xfm = x[:m].contiguous(), xf[:m].contiguous()
        kernels = {"tinygemm": (copies_q, lambda i, xm=xm: torch._weight_int4pack_mm(xm, packed[i], GROUP, tables[i])),
                   "cublas_bf16": (copies_b, lambda i, xm=xm: torch.matmul(xm, wb[i].t()))}
        outs = {}
        for name, key, L in mine:
            outs[name] = y = torch.empty((m, N), device="cuda", dtype=torch.float32)
            kernels[name] = (copies_q, lambda i, y=y, xfm=xfm, L=L, lib=libs[key], t=tiled[key]: lib.matmul(y, xfm, *t[i], L))
        errors = {}
        for name, (_, fn) in kernels.items():   # outputs of weight set 0 against the fp32 reference
            try:
                got = fn(0)
                errors[name] = _nmse((outs[name] if got is None else got).float(), ref[:m])
            except Exception as e:   # noqa: BLE001
                errors[name] = _one_line(e)
        same = {"w4a16", "w4a16_kept"} <= outs.keys() and bool(torch.equal(outs["w4a16"], outs["w4a16_kept"]))
        times = _interleaved_us(torch, reps, {n: k for n, k in kernels.items() if not isinstance(errors[n], str)})
        for name in names:
            row = {"kernel": name, "N": N, "K": K, "M": m, "copies": kernels[name][0]}
            err = errors[name] if isinstance(errors[name], str) else times[name]
            if isinstance(err, str):
                rows.append({**row, "error": err})
                continue
            t = times[name]
            us = _quantile(t, 0.5)
            weight_bytes = N * K * 2.0 if name == "cublas_bf16" else N * K * (0.5 + 4.0 / GROUP)
            row.update(us=us, p10_us=_quantile(t, 0.1), p90_us=_quantile(t, 0.9), reps=len(t),
                       GBps=(weight_bytes + 2.0 * m * (K + N)) / us / 1e3, nmse_vs_fp32=errors[name],
                       valid=errors[name] < (1e-4 if name == "tinygemm" else 1e-9 if name.startswith("w4a16") else 1e-2))
            if name.startswith("w4a16"):
                key, L = next((k, L) for n, k, L in mine if n == name)
                libs[key].lib.kd_w4_set_schunk(L)
                row["schunk"] = libs[key].lib.kd_w4_schunk()
                libs[key].lib.kd_w4_set_schunk(0)
            if name == "w4a16" and "kept" in libs:
                row["bits_equal_kept"] = same
            rows.append(row)
    return rows


def _one_line(e: BaseException) -> str:
    """An exception as one bounded line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def run(ms: list[int], ms_large: list[int], reps: int, ours_path: str | None, schunks: list[int],
        kept_path: str | None = None) -> dict:
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
    libs, notes = {}, []
    for key, path in (("ours", ours_path), ("kept", kept_path)):
        if not path:
            notes += [] if key == "kept" else ["ours not timed (no --ours)"]
            continue
        try:
            libs[key] = Ours(torch, path)
            notes.append(f"{key} from {os.path.basename(path)}" if key == "ours" else f"kept from {path}")
        except Exception as e:   # noqa: BLE001 — the torch rows still count
            notes.append(f"{key} not timed ({_one_line(e)})")
    ours_note = "; ".join(notes)
    rows = []
    for N, K in SHAPES:
        rows += _bench_shape(torch, libs, N, K, ms + (ms_large if (N, K) == LARGE else []), reps, schunks)
        torch.cuda.empty_cache()
    failed = [r for r in rows if "error" in r]
    invalid = [r for r in rows if r.get("valid") is False]
    note = f"{len(rows) - len(failed)} of {len(rows)} timings ({reps} interleaved repetitions) in " \
           f"{time.monotonic() - started:.0f} s; {ours_note}"
    if failed:
        note += f"; {len(failed)} failed (first: {failed[0]['error']})"
    if invalid:
        note += f"; {invalid[0]['kernel']}'s output differs from the fp32 reference (nmse {invalid[0]['nmse_vs_fp32']:.1e})"
    return {"available": True, "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
            "group": GROUP, "inner_k_tiles": INNER_K_TILES, "reps": reps, "interleaved": True, "rows": rows,
            "note": note}


def table(report: dict) -> str:
    """The report's timings as text: per shape and M, each kernel's median [p10-p90] in us and
    its median over ours (w4a16): "faster" counts only at 1.05 or more."""
    lines = []
    rows = [r for r in report.get("rows", []) if "us" in r]
    keys = sorted({(r["N"], r["K"], r["M"]) for r in rows}, key=lambda k: (k[0] * k[1], k[2]))
    for N, K, M in keys:
        at = {r["kernel"]: r for r in rows if (r["N"], r["K"], r["M"]) == (N, K, M)}
        ours = at.get("w4a16", {}).get("us")
        cells = [f"{k} {r['us']:.2f} [{r['p10_us']:.2f}-{r['p90_us']:.2f}]"
                 + (f" {r['us'] / ours:.2f}x" if ours and k != "w4a16" else "")
                 + ({True: " bits=kept", False: " BITS DIFFER FROM KEPT"}.get(r.get("bits_equal_kept"), ""))
                 for k, r in at.items()]
        lines.append(f"{N}x{K} M={M}: " + " | ".join(cells))
    return "\n".join(lines)


def _ints(text: str, flag: str, parser, lo: int, hi: int) -> list[int]:
    """Comma-separated integers in lo..hi (empty text: none), or a usage error naming the flag."""
    try:
        values = [int(v) for v in text.split(",")] if text else []
        if any(v < lo or v > hi for v in values):
            raise ValueError
    except ValueError:
        parser.error(f"{flag} must be comma-separated token counts in {lo}..{hi}, got '{text}'")
    return values


def main(argv: list[str]) -> int:
    """Parse the flags, run, write the report; 0 whatever torch did, 2 on bad flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where the report goes")
    parser.add_argument("--ours", help="build/libkd_w4.so: time the backend's matmul_w4a16 with them")
    parser.add_argument("--kept", help="another tree's libkd_w4.so: time it too (rows w4a16_kept) and compare bits")
    parser.add_argument("--quick", action="store_true", help="20 repetitions instead of 40")
    parser.add_argument("--m", default="1,2,4,8,16", help="token counts, comma-separated (default 1,2,4,8,16)")
    parser.add_argument("--m-large", default="32,64", help="more token counts for 28672 x 8192 (default 32,64)")
    parser.add_argument("--schunk", default="", help="super-chunk lengths to force in extra rows of ours (256,512,1024)")
    args = parser.parse_args(argv)
    ms = _ints(args.m, "--m", parser, 1, 256)
    if not ms:
        parser.error("--m must name at least one token count")
    ms_large = _ints(args.m_large, "--m-large", parser, 1, 256)
    schunks = _ints(args.schunk, "--schunk", parser, 256, 1024)
    if any(v not in (256, 512, 1024) for v in schunks):
        parser.error(f"--schunk takes 256, 512 or 1024, got '{args.schunk}'")
    try:
        report = run(ms, ms_large, 20 if args.quick else 40, args.ours, schunks, args.kept)
    except Exception as e:   # noqa: BLE001 — the comparison never fails the bench
        traceback.print_exc()
        report = {"available": False, "note": f"failed: {_one_line(e)}"}
    _report(args.json, {"version": 2, **report})
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
