"""The validate pipeline's steps, in order, exec (the user's own command, which `invoke exec`
runs alone) and the bundle commands' steps (bundle_tasks). Each is a function `run(ctx) -> Outcome` over a StepContext (context.py): it runs
its commands on the host, fills the host's record and raises a KdError with its evidence when it
fails. Steps never print or exit.
"""
from __future__ import annotations

from ..inventory import STEPS as ORDER
from . import adhoc, bench, build, bundle_tasks, bundles, golden, preflight, stress, sync, test
from .context import Outcome, StepContext, StepError, UserCommand

# In pipeline order (run summaries list a plan's steps in it): ORDER, then exec.
RUNNERS = {"preflight": preflight.run, "sync": sync.run, "build": build.run, "bundles": bundles.run,
           "golden": golden.run, "test": test.run, "bench": bench.run, "stress": stress.run,
           "exec": adhoc.run, "check_bundle": bundle_tasks.check_bundle, "clean_bundles": bundle_tasks.clean_bundles}

__all__ = ["ORDER", "RUNNERS", "Outcome", "StepContext", "StepError", "UserCommand"]
