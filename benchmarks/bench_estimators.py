#!/usr/bin/env python3
"""Which figure of a night is steadiest from night to night: the engine bench's estimators compared.

    python3 benchmarks/bench_estimators.py --base BUILD/kdtree --slow SLOW/kdtree --manifest M
        [--nights 5] [--min-time-ms 250] [--configs plain5,auto5,plain15] [--metrics a,b] [--json out.json]

A script, not a test. Each "night" is a set of fresh `kdtree bench` processes, one after the
other, on the machine as it is (other processes, load): the base binary with the bench's plain
runs (`--repeats 5`, a run = one generation), with runs of at least --min-time-ms (`--repeats 5
--min-time-ms T`: what a run's figure is then depends on the engine: an engine before
--min-time-ms reported the run's tokens over its summed seconds, this one its best generation),
and with many plain runs (`--repeats 15`); then the slow binary (the same engine with a slowing
commit) with the same (--configs narrows them). Per metric and clock (wall, per CPU second
where the backend reports CPU seconds) it prints each candidate estimator of a night's figure
(the median of 5 plain runs, the median and the best of 5 runs of T, the best of 15 plain runs,
their 75th percentile and median), the robust spread of the base nights' figures
(1.4826 x MAD / median) and the slow nights' step against the base nights' median with its
robust z: the estimator to choose is the one whose step stands furthest above its spread.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {  # name: extra bench flags
    "plain5": ["--repeats", "5"],
    "auto5": ["--repeats", "5", "--min-time-ms", "{min_time}"],
    "plain15": ["--repeats", "15"],
}
ESTIMATORS = {  # name: (config, function of the samples; rates, higher is better)
    "median of 5 plain runs": ("plain5", statistics.median),
    "median of 5 runs of >= T": ("auto5", statistics.median),
    "best of 5 runs of >= T": ("auto5", max),
    "best of 15 plain runs": ("plain15", max),
    "75th percentile of 15 plain runs": ("plain15", lambda v: statistics.quantiles(v, n=4)[2]),
    "median of 15 plain runs": ("plain15", statistics.median),
}


def bench(binary: Path, manifest: Path, flags: list[str], out: Path) -> dict:
    """One `kdtree bench` process; its bench.json with the load average and seconds it took."""
    load, start, began = os.getloadavg()[0], time.monotonic(), time.time()
    subprocess.run([str(binary), "bench", "--manifest", str(manifest), "--out", str(out), "--budgets", "4",
                    "--moe-tokens", "1", "--moe-experts", "8", *flags], check=True, capture_output=True, text=True)
    return {"bench": json.loads(out.read_text()), "load": load, "seconds": time.monotonic() - start, "began": began}


def spread(values: list[float]) -> float:
    """1.4826 x MAD / median of the values."""
    med = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - med) for v in values) / med


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--slow", type=Path, required=True)
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--nights", type=int, default=5)
    parser.add_argument("--min-time-ms", type=int, default=250)
    parser.add_argument("--metrics", default="tiny_fp32.ar_decode_tokens_per_s")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which runs each night makes (of %(default)s)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kdtree-estimators-"))
    chosen = [c for c in args.configs.split(",") if c]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown[0]!r} (of {', '.join(CONFIGS)})")
    nights = []
    for night in range(args.nights):
        runs = {}
        for binary, kind, configs in ((args.base, "base", chosen), (args.slow, "slow", chosen)):
            for name in configs:
                flags = [f.format(min_time=args.min_time_ms) for f in CONFIGS[name]]
                runs[f"{kind}/{name}"] = bench(binary, args.manifest, flags, work / "bench.json")
        nights.append(runs)
        print(f"night {night + 1}: load {min(r['load'] for r in runs.values()):.1f}-{max(r['load'] for r in runs.values()):.1f}, "
              + ", ".join(f"{k} {r['seconds']:.0f} s" for k, r in runs.items()), flush=True)
    figures = {}
    for metric in args.metrics.split(","):
        for clock, key in (("wall", "samples"), ("per CPU second", "cpu_samples")):
            if not all(key in n[k]["bench"]["metrics"][metric] for n in nights for k in n):
                continue        # a GPU backend reports no CPU seconds
            print(f"\n{metric}, {clock}: estimator, base nights' figures, spread, slow nights / base median, robust z")
            for est, (config, fn) in ESTIMATORS.items():
                if config not in chosen:
                    continue
                base = [fn(n[f"base/{config}"]["bench"]["metrics"][metric][key]) for n in nights]
                slow_key = f"slow/{config}"
                slow = [fn(n[slow_key]["bench"]["metrics"][metric][key]) for n in nights if slow_key in n]
                med, sp = statistics.median(base), spread(base)
                steps = [s / med for s in slow]
                zs = [(med - s) / (sp * med) if sp > 0 else float("inf") for s in slow]
                figures[f"{metric}/{clock}/{est}"] = {"base": base, "slow": slow, "spread": sp, "steps": steps, "z": zs}
                print(f"  {est:34s} {' '.join(f'{v:7.0f}' for v in base)}  spread {sp:5.1%}  "
                      f"slow {' '.join(f'{s:.3f}x' for s in steps) or '-'}  z {' '.join(f'{z:+.1f}' for z in zs) or '-'}")
    if args.json:
        args.json.write_text(json.dumps({"nights": [{k: {"load": r["load"], "seconds": r["seconds"], "began": r["began"]} for k, r in n.items()}
                                                    for n in nights], "figures": figures}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
