#!/usr/bin/env python3
"""The engine's bundle load, phase by phase: `kdtree verify` on one bundle, cold (the file's pages
dropped from the page cache first, where the kernel lets us) and warm, several runs, and the same
runs of a baseline build beside them (interleaved, so a burst of load on the machine falls on both).

    $PYTHON bench/load_bench.py [--size-mb 400 | --bundle FILE] [--quant fp32|int4] [--runs 3]
                                [--upload] [--backend cpu|cuda] [--baseline OTHER_KDTREE]
                                [--kdtree build/kdtree] [--out build/load_bench] [--keep]

From engine_src/, after scripts/build.sh. --size-mb writes a random version 2 bundle of about that
size with the streaming writer (python/random_bundle.py --size, one worker per core; hidden 1024,
vocab 16384 below 1 GB, its default config above); --bundle times an existing one instead (on a GPU
host, a k2wide bundle). --upload also puts the weights in --backend's memory (verify --upload: the
CUDA backend's upload is the GPU phase); a baseline without --upload is timed without it. Prints
one line per run (read, check and upload seconds and GB/s as verify reports them, the wall time,
the minor page faults and the peak RSS of the process), then the medians per build and cache
state; writes them to OUT/load_bench.json. The bundle written is removed unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent
SMALL = {"name": "loadbench", "vocab_size": 16384, "dim": 1024, "n_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128,
         "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "inter_dim": 2048}
PHASES = {"read": r"read in ([0-9.]+) s", "check": r"checked in ([0-9.]+) s", "upload": r"uploaded to \w+ in ([0-9.]+) s"}
BYTES = re.compile(r", ([0-9]+) bytes: ")


def write_bundle(path: Path, size_mb: int, quant: str) -> None:
    """A random version 2 bundle of about size_mb MB at path (random_bundle.py)."""
    sys.path.insert(0, str(ENGINE / "python"))
    import random_bundle  # noqa: PLC0415 (needs NumPy: only when a bundle is written)

    config = random_bundle.CONFIG if size_mb >= 1000 else dict(random_bundle.CONFIG, **SMALL)
    drafter = {"block_size": 8, "mask_token": config["vocab_size"] - 1, "kind": "lowrank_head", "rank": 64}
    argv = [str(path), "--config", json.dumps(config), "--quant", json.dumps({"type": quant}), "--drafter", json.dumps(drafter),
            "--size", str(size_mb * 10**6), "--workers", str(os.cpu_count() or 1)]
    if random_bundle.main(argv) != 0:
        raise SystemExit("random_bundle.py failed")


def drop_cached(path: Path) -> None:
    """Asks the kernel to drop the file's clean pages from the page cache (a hint: it may keep them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def supports_upload(kdtree: str) -> bool:
    usage = subprocess.run([kdtree, "--help"], capture_output=True, text=True, check=False).stdout
    return "--upload" in usage


def run_verify(kdtree: str, bundle: Path, args: argparse.Namespace, upload: bool) -> dict:
    """One `kdtree verify`: its phases in seconds, the wall time, the child's minor faults and peak RSS."""
    cmd = [kdtree, "verify", "--bundle", str(bundle), "--max-memory", args.max_memory]
    if upload:
        cmd += ["--upload"] + (["--backend", args.backend] if args.backend else [])
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        stdout = proc.stdout.read().decode() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN's peak RSS is every child's)
        wall = time.monotonic() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}: {stderr.strip()[-500:]}")
    out = {"wall_s": wall, "minor_faults": usage.ru_minflt, "max_rss_mb": usage.ru_maxrss / 1024, "line": stdout.strip()}
    for phase, pattern in PHASES.items():
        m = re.search(pattern, stdout)
        if m:
            out[f"{phase}_s"] = float(m.group(1))
    out["bytes"] = int(BYTES.search(stdout).group(1))
    return out


def show(build: str, cache: str, r: dict) -> str:
    gbps = lambda s: f"{r['bytes'] / 1e9 / s:6.2f}" if s else "     -"  # noqa: E731
    up = f"{r['upload_s']:7.3f} s" if "upload_s" in r else "      -  "
    return (f"{build:9} {cache:5} read {r['read_s']:7.3f} s ({gbps(r['read_s'])} GB/s)  check {r['check_s']:7.3f} s  upload {up}"
            f"  wall {r['wall_s']:7.3f} s  faults {r['minor_faults']:>9}  rss {r['max_rss_mb']:8.0f} MB")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--size-mb", type=int, default=400, help="write a random bundle of about this many MB (default 400)")
    which.add_argument("--bundle", type=Path, help="time this bundle instead of writing one")
    parser.add_argument("--quant", choices=("fp32", "int4"), default="fp32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--upload", action="store_true", help="also upload the weights (verify --upload)")
    parser.add_argument("--backend", choices=("cpu", "cuda"), help="the backend of --upload (default: the build's)")
    parser.add_argument("--kdtree", default=str(ENGINE / "build" / "kdtree"))
    parser.add_argument("--baseline", help="another kdtree binary, run beside it")
    parser.add_argument("--max-memory", default="1T")
    parser.add_argument("--out", type=Path, default=ENGINE / "build" / "load_bench")
    parser.add_argument("--keep", action="store_true", help="keep the bundle written")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bundle = args.bundle
    if bundle is None:
        bundle = args.out / f"random_{args.size_mb}mb_{args.quant}.kdtr"
        write_bundle(bundle, args.size_mb, args.quant)
    builds = {"this": args.kdtree, **({"baseline": args.baseline} if args.baseline else {})}
    uploads = {name: args.upload and supports_upload(path) for name, path in builds.items()}
    runs: dict[str, list[dict]] = {}
    try:
        for _ in range(args.runs):
            for cache in ("cold", "warm"):
                for name, path in builds.items():
                    if cache == "cold":
                        drop_cached(bundle)
                    r = run_verify(path, bundle, args, uploads[name])
                    runs.setdefault(f"{name} {cache}", []).append(r)
                    print(show(name, cache, r), flush=True)
    finally:
        if args.bundle is None and not args.keep:
            bundle.unlink()
    print(f"medians of {args.runs} runs, {bundle.name}, {os.cpu_count()} cores:")
    summary = {}
    for key, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
        summary[key] = med
        print(show(*key.split(), med))
    (args.out / "load_bench.json").write_text(json.dumps({"bundle": str(bundle), "runs": runs, "medians": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
