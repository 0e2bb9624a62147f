"""Bench: run the engine's benchmarks on the host and pull its JSON report."""
from __future__ import annotations

from ..record import bench_from_engine
from .context import Outcome, StepContext


def run(ctx: StepContext) -> Outcome:
    """Run the bench command and record its metrics."""
    ctx.engine("bench")
    ctx.record.bench = bench_from_engine(ctx.pull_json("bench"))
    return Outcome("passed", f"{len(ctx.record.bench['metrics'])} metrics")
