"""Golden: run the engine on every bundle on the host and check its tokens against the committed
expected manifest, this machine's regeneration and the host's regeneration (orchestrator.golden)."""
from __future__ import annotations

from .. import golden
from .context import Outcome, StepContext, StepError


def run(ctx: StepContext) -> Outcome:
    """Generate the engine's AR and DDTree outputs, pull them and the host's manifest, compare."""
    ctx.engine("generate")
    outputs = ctx.pull_json("outputs")
    host_manifest = ctx.pull_json("manifest")
    tree = ctx.tree_hash()
    if outputs.get("tree") != tree:
        raise StepError(f"the outputs were made by a binary of tree {str(outputs.get('tree'))[:12]}, "
                        f"not the deployed {tree[:12]}", host=ctx.host.name)
    if outputs.get("backend"):
        ctx.record.backend = outputs["backend"]
    ctx.record.golden = golden.matrix_row(ctx.reference.expected(), ctx.reference.local(), host_manifest, outputs)
    failed = golden.failures(ctx.record.golden)
    if failed:
        raise StepError("golden tokens differ: " + "; ".join(failed), host=ctx.host.name)
    return Outcome("passed", f"{len(ctx.record.golden)} bundles: AR and DDTree equal the golden tokens")
