"""Golden: run the engine on every bundle on the host and check its tokens against the committed
expected manifest, this machine's regeneration and the host's regeneration (orchestrator.records.golden).
With GPUs claimed, the engine runs once per GPU, all at once, each pinned to its GPU: a column of
the hosts x GPUs x bundles matrix (run.json's gpu_runs).

The engine's outputs are reused, as test and bench results are (StepContext.cached_result), when
the executables, the bundles, the expected manifest and every other file of the deployed tree,
the build key and the command are those of the last passing golden step on the host: the step
is then `cached` and says from which run. The comparison itself is made again every run, against
today's expected manifest, this machine's regeneration and the host's manifest; reused outputs
that no longer pass are not trusted: the engine runs again. Never on GPUs, in a nightly or with
--no-cache (results_key)."""
from __future__ import annotations

from ..records import golden
from ..errors import KdError, StepError
from ..records.record import GoldenRecord
from .context import Outcome, StepContext, gpu_run


def run(ctx: StepContext) -> Outcome:
    """Generate the engine's AR and DDTree outputs (per GPU), pull them and the host's manifest,
    compare; one GPU's failure fails its cell and the step, the others are still checked."""
    if not ctx.session.gpus:
        reused = _reused(ctx)
        if reused is not None:
            return reused
        ctx.shell.run("generate")
        outputs = ctx.pull_json("outputs")
        ctx.record.golden = _checked(ctx, outputs, ctx.pull_json("manifest"))
        failed = golden.failures(ctx.record.golden)
        if failed:
            raise StepError("golden tokens differ: " + "; ".join(failed), host=ctx.host.name)
        ctx.stamp_result(outputs)
        return Outcome("passed", f"{len(ctx.record.golden)} bundles: AR and DDTree equal the golden tokens")
    outputs = ctx.on_each_gpu(lambda c, gpu: (c.shell.run("generate", c.shell.gpu_env(gpu)),
                                              c.pull_json("outputs", gpu))[1])
    manifest = ctx.pull_json("manifest")
    rows, problems = {}, []
    for gpu in ctx.session.gpus:
        cell = gpu_run(ctx, gpu)
        try:
            output = outputs[gpu.index]
            if isinstance(output, KdError):
                raise output
            cell.golden = rows[gpu.index] = _checked(ctx, output, manifest)
        except KdError as e:
            cell.golden_status, cell.message = "failed", e.message
            problems.append(f"GPU {gpu.index}: {e.message}")
            continue
        failed = golden.failures(cell.golden)
        cell.golden_status = "failed" if failed else "passed"
        if failed:
            problems.append(f"GPU {gpu.index}: golden tokens differ: " + "; ".join(failed))
    ctx.record.golden = golden.merge_gpu_rows(rows)
    if problems:
        raise StepError("; ".join(problems), host=ctx.host.name)
    on = ', '.join(str(g.index) for g in ctx.session.gpus)
    return Outcome("passed", f"{len(ctx.record.golden)} bundles on GPU {on}: "
                             "AR and DDTree equal the golden tokens on each")


def _reused(ctx: StepContext) -> Outcome | None:
    """The `cached` outcome when the last passing run's outputs hold for these inputs and still
    pass today's comparison (module doc); None: the engine must run."""
    reused = ctx.cached_result("outputs")
    if reused is None:
        return None
    rows = _checked(ctx, reused.data, ctx.pull_json("manifest"), made_by=reused.tree)
    failed = golden.failures(rows)
    if failed:
        ctx.log(f"the outputs of run {reused.run_id} fail today's comparison ({'; '.join(failed)[:300]}): "
                "running the engine again")
        return None
    ctx.record.golden = rows
    return Outcome("cached", f"{len(rows)} bundles: AR and DDTree equal the golden tokens (the engine's outputs "
                             f"reused from run {reused.run_id}: {reused.why}; compared again now, not regenerated)",
                   reused.run_id)


def _checked(ctx: StepContext, outputs: dict, host_manifest: dict, made_by: str | None = None) -> dict[str, GoldenRecord]:
    """The golden row of one set of engine outputs; StepError when a binary of another tree than
    the deployed one (`made_by`: the tree of the run whose outputs are reused) made them."""
    tree = made_by or ctx.tree_hash()
    if outputs.get("tree") != tree:
        raise StepError(f"the outputs were made by a binary of tree {str(outputs.get('tree'))[:12]}, "
                        f"not the deployed {tree[:12]}", host=ctx.host.name)
    if outputs.get("backend"):
        ctx.record.backend = outputs["backend"]
    expected = ctx.reference.expected()
    if ctx.bundles is not None:         # the selected tiers' bundles only
        expected = ctx.bundles.expected(expected)
    return golden.matrix_row(expected, ctx.reference.local(ctx.progress), host_manifest, outputs)
