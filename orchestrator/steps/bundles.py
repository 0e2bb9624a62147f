"""Bundles: regenerate the model bundles on the host with its own Python, or skip it (cached) when
the generator's inputs are unchanged since the last regeneration there and its outputs are intact
(hashed on the host every run: a bundle changed there since is regenerated)."""
from __future__ import annotations

import posixpath

from ..resources.bundle_plan import gb
from . import STEPS, inputs
from .context import Outcome, StepContext

STAMP = STEPS["bundles"].stamp


def run(ctx: StepContext) -> Outcome:
    """Run the bundles command unless the generator's input hash and interpreter are unchanged
    and the bundle folder (the manifest's) holds, hash for hash, what the last regeneration left."""
    key = {"generator": ctx.reads.output("bundles_key").split()[-1], "python": ctx.host.python}
    if ctx.bundles is not None and not ctx.bundles.is_default:     # another selection: other bundles
        key["configs"] = " ".join(ctx.bundles.configs)
    stamp = ctx.stamps.get(STAMP) or {}
    if ctx.plan.use_cache and stamp.get("key") == key and stamp.get("run_id"):
        if _outputs(ctx) and stamp.get("outputs") == _outputs(ctx):      # {}: no manifest, never up to date
            return Outcome("cached", f"bundles of generator {key['generator'][:12]} are up to date", str(stamp["run_id"]))
        ctx.log(f"the bundles on the host are not those run {stamp['run_id']} regenerated "
                f"({inputs.changes(stamp.get('outputs') or {}, _outputs(ctx))}): regenerating")
    with ctx.session.changing(ctx.step):
        if ctx.bundles is not None:
            # What the writer will leave in all, beside its own progress reports (bundles and
            # bytes written so far): the declared disk need of the selected bundles.
            ctx.log(f"writing {len(ctx.bundles.bundles)} bundles of tiers {', '.join(ctx.bundles.tiers)}: "
                    f"{gb(ctx.bundles.disk_bytes)}")
        ctx.shell.run("bundles")
        ctx.stamps.write(STAMP, {"key": key, "run_id": ctx.run_dir.run_id, "outputs": _outputs(ctx)})
    return Outcome("passed", f"regenerated with {ctx.host.python}")


def _outputs(ctx: StepContext) -> dict[str, str]:
    """The content hashes of the files in the manifest's folder on the host (the bundles, the
    manifest); {} without the manifest."""
    folder = posixpath.dirname(ctx.project.results["manifest"])
    found = {p: h for p, h in ctx.reads.inputs(ctx.tree_hash).files.items() if posixpath.dirname(p) == folder}
    return found if ctx.project.results["manifest"] in found else {}
