"""The steps, each declared once here as a `Step` record: what the rest of the orchestrator knows
of a step (its place in the pipeline, its default timeout, what it reads ahead, reuses and
stamps, whether it changes the deployed tree) is read from `STEPS`, never from a list of names
of its own.

A step's work is a function `run(ctx) -> Outcome` in a module of this package, over a
StepContext (context.py): it runs its commands on the host, fills the host's record and raises
a KdError with its evidence when it fails. Steps never print or exit.

This module imports nothing of the orchestrator: the inventory takes the step names and their
default timeouts from it, and every step module imports the inventory. So a step's function is
imported when it is first asked for (`Step.runner`), not here.
"""
from __future__ import annotations

import dataclasses
import importlib
import typing
from types import MappingProxyType
from typing import Callable

if typing.TYPE_CHECKING:
    from .context import Outcome, StepContext


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: its name (the key of its timeout, its log file and its entry in the record) and
    the function that does its work (`function` of steps/`module`.py); the rest says what the
    runner and the step context do around it."""

    name: str
    module: str
    function: str = "run"
    # seconds: the default of the inventory's timeouts.<name>. None: the step of a command of its
    # own (exec, check-bundle, clean-bundles), not of the validate pipeline: no --steps names it
    timeout: float | None = None
    opt_in: bool = False                # validate runs it only when --steps names it (nightly always)
    checks: bool = False                # the host checks: their probe starts as the host connects (Run.prepare);
                                        # with the GPUs the step takes the tree lock itself, once they passed
    changes_tree: bool = False          # it changes the deployed tree: alone under the tree lock (ctx.session.changing)
    reads_ahead: bool = False           # HostReads.read_ahead starts its host reads before the first such step
    reuses: tuple[str, ...] = ()        # the result files (keys of project.results) its reuse pulls (read ahead)
    stamp: str = ""                     # the state file of .kdtree/ it writes: what it last did (state.STAMPS)
    command: str = ""                   # the project command whose results it stamps and reuses (results_key)
    scaled: bool = False                # its timeout grows with the selected bundles' bytes (bundle_plan)
    bundles: bool = False               # the selected bundles shape it: a plan with it makes a bundle plan
    on_node: bool = False               # its engine commands (exec's: the user's) need a compute node: on a
                                        # `scheduler: slurm` entry they run as job steps of the host's allocation

    @property
    def runner(self) -> Callable[[StepContext], Outcome]:
        """The function that does the step's work."""
        return typing.cast("Callable[[StepContext], Outcome]",
                           getattr(importlib.import_module(f"{__name__}.{self.module}"), self.function))


# In pipeline order (record.step_order, a plan's summary columns), then the steps of their own command.
STEPS: typing.Mapping[str, Step] = MappingProxyType({s.name: s for s in (
    Step("preflight", "preflight", timeout=60, checks=True, bundles=True),
    Step("sync", "sync", timeout=300, changes_tree=True, stamp="deploy.json"),
    Step("build", "build", timeout=900, changes_tree=True, reads_ahead=True, stamp="build.json", on_node=True),
    Step("bundles", "bundles", timeout=600, changes_tree=True, reads_ahead=True, stamp="bundles.json",
         scaled=True, bundles=True, on_node=True),
    Step("golden", "golden", timeout=600, reads_ahead=True, reuses=("outputs", "manifest"), stamp="golden.json",
         command="generate", scaled=True, bundles=True, on_node=True),
    Step("test", "test", timeout=900, reads_ahead=True, reuses=("tests",), stamp="test.json", command="test",
         scaled=True, bundles=True, on_node=True),
    Step("bench", "bench", timeout=900, reads_ahead=True, reuses=("bench",), stamp="bench.json", command="bench",
         scaled=True, bundles=True, on_node=True),
    Step("stress", "stress", timeout=600, opt_in=True, bundles=True, on_node=True),
    Step("exec", "adhoc", on_node=True),
    Step("check_bundle", "bundle_tasks", "check_bundle", on_node=True),
    Step("clean_bundles", "bundle_tasks", "clean_bundles", bundles=True),
)})
# The validate pipeline's steps, in order: the ones --steps and --skip name, each with a timeout of its own.
ORDER = tuple(s.name for s in STEPS.values() if s.timeout is not None)
