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
    try:
        ctx.engine("test")
    except CommandError as e:
        failure = e
    data, ctx.record.tests = pull_results(ctx, "tests", failure)
    raise_on_failures(ctx, ctx.record.tests, failure, "engine tests")
    ctx.stamp_result(data)
    return Outcome("passed", f"{ctx.record.tests.passed} passed, {ctx.record.tests.skipped} skipped")


def pull_results(ctx: StepContext, result: str, failure: CommandError | None) -> tuple[dict, TestsRecord]:
    """The run_tests.sh results file `result` (a key of project.results), pulled and parsed; when
    it cannot be read, the command's own `failure` (if any) is raised, else the read error."""
    try:
        data = ctx.pull_json(result)
    except KdError:
        if failure:
            raise failure from None
        raise
    return data, TestsRecord.from_engine(data)


def raise_on_failures(ctx: StepContext, tests: TestsRecord, failure: CommandError | None, what: str) -> None:
    """StepError naming the first failed cases when any case failed or the command failed."""
    failed = [c.name for c in tests.cases if c.status == "failed"]
    if failed or failure:
        names = ", ".join(failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")
        raise StepError(f"{tests.failed} of {len(tests.cases)} {what} failed" + (f": {names}" if names else ""),
                        host=ctx.host.name, command=failure.command if failure else None,
                        exit_status=failure.exit_status if failure else None, tail=failure.tail if failure else "")
