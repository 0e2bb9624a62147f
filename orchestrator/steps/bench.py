"""Bench: run the engine's benchmarks on the host and pull its JSON report."""
from __future__ import annotations

from ..record import bench_from_engine
from .build import build_key
from .context import Outcome, StepContext


def run(ctx: StepContext) -> Outcome:
    """Run the bench command and record its metrics; a validate run whose tree, build and bundles
    are those of the last successful bench on the host reuses its report (cached; nightly never)."""
    cached = ctx.cached_result("bench")
    if cached is not None:
        data, run_id = cached
        ctx.record.bench = bench_from_engine(data)
        return Outcome("cached", f"{len(ctx.record.bench['metrics'])} metrics reused from run {run_id} "
                                 "(the same tree, build and bundles; not a new measurement)", run_id)
    ctx.engine("bench")
    data = ctx.pull_json("bench")
    ctx.record.bench = bench_from_engine(data)
    if ctx.record.fingerprint.gpus_busy:    # another process used the GPUs while this one measured
        for metric in ctx.record.bench["metrics"].values():
            metric["noisy"] = True
    if ctx.record.build_key is None:        # the build step did not run: the history still files by it
        ctx.record.build_key = build_key(ctx)
    ctx.stamp_result(data)
    return Outcome("passed", f"{len(ctx.record.bench['metrics'])} metrics")
