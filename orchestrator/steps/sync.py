"""Sync: put the engine source on the host (orchestrator.sync) under the run's lock."""
from __future__ import annotations

from .. import state, sync
from .context import Outcome, StepContext


def run(ctx: StepContext) -> Outcome:
    """Deploy the source tree and remember the verified tree hash for the later steps. Under a
    shared lock (other runs may use the tree) a tree that is already this run's is left as it is;
    otherwise the run holds the tree alone while it syncs."""
    if ctx.session.lock is not None and ctx.session.lock.mode == state.SHARED:
        deployed = sync.deployed_tree(ctx.session.transport, ctx.project)
        if deployed == ctx.source.tree_hash:
            ctx.deployed_tree_hash = ctx.record.deployed_tree_hash = deployed
            return Outcome("cached", f"tree {deployed[:12]} is deployed already (its hash verified on the host)")
    with ctx.session.changing(ctx.step):            # the lock holder begins the sync, over the lock's channel
        result = sync.sync_tree(ctx.session.transport, ctx.project, ctx.source, ctx.owner, ctx.log,
                                ctx.session.held_lock(ctx.step), _probed_rsync(ctx))
    ctx.deployed_tree_hash = result.tree_hash
    ctx.record.deployed_tree_hash = result.tree_hash
    ctx.stamps.forget()             # the deploy record changed
    repaired = f"; repaired a broken sync ({result.repaired})" if result.repaired else ""
    return Outcome("passed", f"{result.method}: {result.files} files, {result.bytes} bytes sent, "
                             f"{result.deleted} deleted{repaired}")


def _probed_rsync(ctx: StepContext) -> tuple[str, str] | None:
    """Where rsync is on the host and its version line, as this run's doctor probe found them
    ("" where there is none); None when no probe answered (the sync then asks)."""
    probe = ctx.session.probe
    if probe is None or not probe.done() or probe.exception() is not None:
        return None
    from .. import doctor        # only where a probe ran: a deploy never imports the doctor
    return doctor.rsync_of(probe.result())
