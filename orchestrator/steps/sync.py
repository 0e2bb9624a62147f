"""Sync: put the engine source on the host (orchestrator.sync) under the run's lock."""
from __future__ import annotations

from .. import sync
from .context import Outcome, StepContext


def run(ctx: StepContext) -> Outcome:
    """Deploy the source tree and remember the verified tree hash for the later steps."""
    result = sync.sync_tree(ctx.transport, ctx.project, ctx.source, ctx.owner, ctx.log)
    ctx.deployed_tree_hash = result.tree_hash
    ctx.record.deployed_tree_hash = result.tree_hash
    repaired = f"; repaired a broken sync ({result.repaired})" if result.repaired else ""
    return Outcome("passed", f"{result.method}: {result.files} files, {result.bytes} bytes sent, "
                             f"{result.deleted} deleted{repaired}")
