"""The validate pipeline's steps, in order. Each is a function `run(ctx) -> Outcome` over a
StepContext (context.py): it runs the engine's commands on the host, fills the host's record and
raises a KdError with its evidence when it fails. Steps never print or exit.
"""
from __future__ import annotations

from ..inventory import STEPS as ORDER
from . import bench, build, bundles, golden, preflight, stress, sync, test
from .context import Outcome, StepContext, StepError

RUNNERS = {"preflight": preflight.run, "sync": sync.run, "build": build.run, "bundles": bundles.run,
           "golden": golden.run, "test": test.run, "bench": bench.run, "stress": stress.run}

__all__ = ["ORDER", "RUNNERS", "Outcome", "StepContext", "StepError"]
