"""Stress: the engine's CUDA tests again, with the engine's own GPU load generator running on the
same GPU (run_tests.sh with KD_GPU_LOAD), so that a result that depends on having the GPU alone
is caught before a shared production host finds it. Never cached: a repeat is the point."""
from __future__ import annotations

from ..errors import CommandError, StepError
from ..records.record import LOAD_CASE
from .context import Outcome, StepContext
from .test import pull_results, raise_on_failures

SETUP_EXIT = 2                    # run_tests.sh: the environment asks for what the build lacks
PASSED_LINE = "ALL TESTS PASSED"


def run(ctx: StepContext) -> Outcome:
    """Skipped where the host has no GPU or the build is not CUDA; otherwise run the stress
    command and record its results as `stress`: passed only when every test passed and
    load.gpu_load says they ran under load; failed when the GPU could not be used."""
    reason = _not_applicable(ctx)
    if reason:
        ctx.log(f"skipped: {reason}")
        return Outcome("skipped", reason)
    if "stress" not in ctx.project.commands or "stress" not in ctx.project.results:
        raise StepError("the inventory's project has no `commands: stress:` or no `results: stress:` "
                        "(see hosts.yaml): nothing to run", host=ctx.host.name)
    failure, tail = None, ""
    try:
        tail = ctx.shell.run("stress").tail
    except CommandError as e:
        if e.exit_status == SETUP_EXIT:
            return Outcome("skipped", f"the stress command refused this setup (exit {SETUP_EXIT}): {_last_line(e.tail)}")
        failure = e
    _, ctx.record.stress = pull_results(ctx, "stress", failure)
    tests = ctx.record.stress
    raise_on_failures(ctx, tests, failure, "stress tests")
    # A CUDA backend that could not start is a failed test of run_tests.sh here (the stress command
    # asks for cuda): raise_on_failures has named it. Skipped is only for a host without a GPU.
    load = {c.name: c for c in tests.cases}.get(LOAD_CASE)
    if PASSED_LINE not in tail:
        raise StepError(f"the stress command exited 0 without printing {PASSED_LINE}", host=ctx.host.name,
                        command=ctx.project.commands["stress"], tail=tail)
    if load is None or load.status != "passed":
        raise StepError(f"the stress tests passed, but {LOAD_CASE} is {load.status if load else 'missing'}: "
                        f"nothing shows they ran under GPU load{': ' + load.message if load and load.message else ''}",
                        host=ctx.host.name)
    return Outcome("passed", f"{tests.passed} passed, {tests.skipped} skipped under GPU load ({load.message})")


def _not_applicable(ctx: StepContext) -> str:
    """Why the stress test cannot run on this host, as far as this run's preflight and build know."""
    preflight = ctx.record.steps.get("preflight")
    if preflight is not None and preflight.status == "passed" and ctx.record.fingerprint.gpu_count == 0:
        return "the host has no GPU (preflight found none): nothing to run under GPU load"
    if ctx.record.backend not in (None, "cuda"):
        return f"a {ctx.record.backend} build: the stress test runs the CUDA backend under GPU load"
    return ""


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"
