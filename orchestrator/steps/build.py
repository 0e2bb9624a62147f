"""Build: compile the engine on the host, or skip it (cached) when nothing it depends on changed;
then prove the binary was built from the deployed tree."""
from __future__ import annotations

import json

from .. import state
from .context import Outcome, StepContext, StepError

STAMP = "build.json"
RESTORED = "(restored from build/trees/"      # what build.sh prints when its tree cache had the build


def run(ctx: StepContext) -> Outcome:
    """Build unless the stamp of the last successful build matches (tree hash + build key);
    without the cache (--no-cache) the engine rebuilds from scratch."""
    tree = ctx.tree_hash()
    key = {"tree": tree, "build": build_key(ctx)}
    ctx.cache_keys["build"] = ctx.record.build_key = key["build"]
    stamp = state.read_json(ctx.transport, STAMP) or {}
    if ctx.use_cache and stamp.get("key") == key and stamp.get("run_id"):
        version = _checked_version(ctx, tree)
        return Outcome("cached", f"{_what(version)} of tree {tree[:12]} is up to date", str(stamp["run_id"]))
    # --no-cache: a full rebuild (the engine's build is incremental; its log lists every compile)
    with ctx.changing():
        result = ctx.engine("build", None if ctx.use_cache else {"KD_REBUILD": "1"})
        version = _checked_version(ctx, tree)
        state.write_json(ctx.transport, STAMP, {"key": key, "run_id": ctx.run_dir.run_id})
    if RESTORED in result.tail:     # the engine's build cache had this tree: nothing was compiled
        return Outcome("cached", f"{_what(version)} of tree {tree[:12]} restored from the host's build cache")
    return Outcome("passed", _what(version))


def _what(version: dict[str, str]) -> str:
    """`cuda build for sm_90`, or `cpu build`."""
    arch = version["arch"]
    return f"{version['backend']} build" + (f" for {arch}" if arch not in ("none", "?") else "")


def parse_version(line: str) -> dict[str, str]:
    """`kdtree 0.1.0 tree=<hash> backend=cpu arch=none` -> {"version", "tree", "backend", "arch"}."""
    words = line.split()
    if len(words) < 2 or words[0] != "kdtree":
        return {}
    fields = dict(w.split("=", 1) for w in words[2:] if "=" in w)
    return {"version": words[1], **fields}


def build_key(ctx: StepContext) -> dict:
    """The engine's build key on the host (compilers, flags, arch: what build.sh --key prints)."""
    text = ctx.engine_output("build_key")
    try:
        key = json.loads(text)
    except ValueError:
        raise StepError("the build key is not JSON", host=ctx.host.name, tail=text) from None
    if not isinstance(key, dict):
        raise StepError("the build key is not a JSON object", host=ctx.host.name, tail=text)
    return key


def _checked_version(ctx: StepContext, tree: str) -> dict[str, str]:
    """The binary's --version, recorded; StepError unless it was built from `tree`."""
    line = ctx.engine_output("version").strip().splitlines()
    version = parse_version(line[-1] if line else "")
    if not version.get("tree"):
        raise StepError(f"cannot read the engine's version line: {line[-1] if line else '(nothing)'}",
                        host=ctx.host.name)
    ctx.log(f"binary: {line[-1]}")
    ctx.record.binary_tree_hash = version["tree"]
    ctx.record.backend = version.get("backend")
    if version.get("arch") not in (None, "none"):
        ctx.record.fingerprint.arch = version["arch"]
    if version["tree"] != tree:
        raise StepError(f"the binary was built from tree {version['tree'][:12]} but the deployed tree is {tree[:12]}",
                        host=ctx.host.name)
    version.setdefault("backend", "?")
    version.setdefault("arch", "?")
    return version
