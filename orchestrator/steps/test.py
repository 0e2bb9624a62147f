"""Test: run the engine's test suite on the host and read its machine-readable results."""
from __future__ import annotations

from ..errors import CommandError, KdError
from ..record import TestsRecord
from .context import Outcome, StepContext, StepError


def run(ctx: StepContext) -> Outcome:
    """Run the test command; record every test case (also when the suite failed). A validate run
    whose tree, build and bundles are those of the last passing test run on the host reuses its
    results (cached; nightly never)."""
    cached = ctx.cached_result("tests")
    if cached is not None:
        tests = TestsRecord.from_engine(cached[0])
        if tests.failed == 0 and tests.cases:
            ctx.record.tests = tests
            return Outcome("cached", f"{tests.passed} passed, {tests.skipped} skipped "
                                     f"(reused from run {cached[1]}: the same tree, build and bundles)", cached[1])
    failure = None
    data = None
    try:
        ctx.engine("test")
    except CommandError as e:
        failure = e
    try:
        data = ctx.pull_json("tests")
        ctx.record.tests = TestsRecord.from_engine(data)
    except KdError:
        if failure:
            raise failure from None
        raise
    tests = ctx.record.tests
    failed = [c.name for c in tests.cases if c.status == "failed"]
    if failed or failure:
        names = ", ".join(failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")
        raise StepError(f"{tests.failed} of {len(tests.cases)} engine tests failed" + (f": {names}" if names else ""),
                        host=ctx.host.name, command=failure.command if failure else None,
                        exit_status=failure.exit_status if failure else None, tail=failure.tail if failure else "")
    ctx.stamp_result(data)
    return Outcome("passed", f"{tests.passed} passed, {tests.skipped} skipped")
