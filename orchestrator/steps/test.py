"""Test: run the engine's test suite on the host and read its machine-readable results. With GPUs
claimed, the suite runs once per GPU, all at once, each pinned to its GPU (run.json's gpu_runs);
with several GPUs each case's name says its GPU (`gpu<index>.<name>`)."""
from __future__ import annotations

from ..errors import CommandError, KdError, StepError
from ..records.record import TestCase, TestsRecord
from ..records.result_files import tests_from_engine
from .context import Outcome, StepContext, gpu_run

SHOWN_FAILURES = 5


def run(ctx: StepContext) -> Outcome:
    """Run the test command; record every test case (also when the suite failed). A validate run
    whose executables, build key, bundles and scripts are those of the last passing test run on
    the host reuses its results (cached; nightly and GPU runs never)."""
    reused = ctx.cached_result("tests")
    if reused is not None:
        tests = _tests(ctx, reused.data)
        if tests.failed == 0 and tests.cases:
            ctx.record.tests = tests
            return Outcome("cached", f"{tests.passed} passed, {tests.skipped} skipped "
                                     f"(reused from run {reused.run_id}: {reused.why})", reused.run_id)
    if ctx.session.gpus:
        return _on_each_gpu(ctx)
    data, failure = _suite(ctx)
    tests = ctx.record.tests = _tests(ctx, data)
    raise_on_failures(ctx, tests, failure, "engine tests")
    ctx.stamp_result(data)
    return Outcome("passed", f"{tests.passed} passed, {tests.skipped} skipped")


def _suite(ctx: StepContext, gpu=None) -> tuple[dict, CommandError | None]:
    """Run the suite (on `gpu` alone) and pull its results: (the results, the command's failure);
    without readable results the command's failure (or the reading error) is raised."""
    failure = None
    try:
        ctx.shell.run("test", ctx.shell.gpu_env(gpu) if gpu is not None else None)
    except CommandError as e:
        failure = e
    return pull_results(ctx, "tests", failure, gpu)[0], failure


def pull_results(ctx: StepContext, result: str, failure: CommandError | None,
                 gpu=None) -> tuple[dict, TestsRecord]:
    """The run_tests.sh results file `result` (a key of project.results; of `gpu`'s run), pulled
    and parsed; when it cannot be read, the command's own `failure` (if any) is raised, else the
    read error."""
    try:
        data = ctx.pull_json(result, gpu)
        tests = _tests(ctx, data, result)
    except KdError:
        if failure:
            raise failure from None
        raise
    return data, tests


def raise_on_failures(ctx: StepContext, tests: TestsRecord, failure: CommandError | None, what: str) -> None:
    """StepError naming the first failed cases when any case failed or the command failed."""
    if tests.failed or failure:
        raise StepError(_failed(tests, what), host=ctx.host.name, command=failure.command if failure else None,
                        exit_status=failure.exit_status if failure else None, tail=failure.tail if failure else "")


def _on_each_gpu(ctx: StepContext) -> Outcome:
    results = ctx.on_each_gpu(_suite)
    several = len(ctx.session.gpus) > 1
    cases: list[TestCase] = []
    problems = []
    for gpu in ctx.session.gpus:
        cell = gpu_run(ctx, gpu)
        result = results[gpu.index]
        if isinstance(result, KdError):
            cell.tests_status, cell.message = "failed", result.message
            problems.append(f"GPU {gpu.index}: {result.message}")
            continue
        data, failure = result
        tests = _tests(ctx, data)
        failed = [c.name for c in tests.cases if c.status == "failed"]
        cell.tests = {"passed": tests.passed, "failed": tests.failed, "skipped": tests.skipped,
                      "failed_names": failed[:SHOWN_FAILURES]}
        cell.tests_status = "failed" if failed or failure else "passed"
        if failed or failure:
            problems.append(f"GPU {gpu.index}: {_failed(tests, 'engine tests')}")
        cases += [TestCase(f"gpu{gpu.index}.{c.name}" if several else c.name, c.status, c.seconds, c.message)
                  for c in tests.cases]
    counts = {s: sum(c.status == s for c in cases) for s in ("passed", "failed", "skipped")}
    ctx.record.tests = TestsRecord(counts["passed"], counts["failed"], counts["skipped"], cases)
    if problems:
        raise StepError("; ".join(problems), host=ctx.host.name)
    return Outcome("passed", f"{counts['passed']} passed, {counts['skipped']} skipped on GPU "
                             f"{', '.join(str(g.index) for g in ctx.session.gpus)}")


def _failed(tests: TestsRecord, what: str) -> str:
    """`3 of 147 engine tests failed: a, b, c` (`what`: engine tests)."""
    failed = [c.name for c in tests.cases if c.status == "failed"]
    names = ", ".join(failed[:SHOWN_FAILURES]) + (f" and {len(failed) - SHOWN_FAILURES} more"
                                                  if len(failed) > SHOWN_FAILURES else "")
    return f"{tests.failed} of {len(tests.cases)} {what} failed" + (f": {names}" if names else "")


def _tests(ctx: StepContext, data: dict, result: str = "tests") -> TestsRecord:
    """The engine's results as the record keeps them; StepError when they break a limit."""
    try:
        return tests_from_engine(data)
    except ValueError as e:
        raise StepError(f"{ctx.project.results[result]}: {e}", host=ctx.host.name) from None
