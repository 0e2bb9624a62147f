"""Bundles: regenerate the model bundles on the host with its own Python, or skip it (cached) when
the generator's inputs are unchanged since the last regeneration there."""
from __future__ import annotations

from .. import state
from ..errors import FetchError
from .context import Outcome, StepContext

STAMP = "bundles.json"


def run(ctx: StepContext) -> Outcome:
    """Run the bundles command unless the generator's input hash and interpreter are unchanged."""
    key = {"generator": ctx.engine_output("bundles_key").split()[-1], "python": ctx.host.python}
    ctx.cache_keys["bundles"] = key
    stamp = state.read_json(ctx.transport, STAMP) or {}
    if ctx.use_cache and stamp.get("key") == key and stamp.get("run_id") and _manifest_present(ctx):
        return Outcome("cached", f"bundles of generator {key['generator'][:12]} are up to date", str(stamp["run_id"]))
    with ctx.changing():
        ctx.engine("bundles")
        state.write_json(ctx.transport, STAMP, {"key": key, "run_id": ctx.run_dir.run_id})
    return Outcome("passed", f"regenerated with {ctx.host.python}")


def _manifest_present(ctx: StepContext) -> bool:
    try:
        ctx.transport.read_file(ctx.project.results["manifest"], max_bytes=16 << 20)
    except FetchError:
        return False
    return True
