"""Build: compile the engine on the host, or skip it (cached) when nothing it depends on changed;
then prove the binary was built from the deployed tree.

A build is reused only when the host's stamp matches and the executables under build/ are, hash
for hash, those this machine recorded after a build with the same key (steps.executables): a
stamp on the host alone proves nothing about the binary.
"""
from __future__ import annotations

from typing import Any

from ..records import record
from ..host import client
from . import STEPS, executables
from ..errors import StepError
from .context import Outcome, StepContext
from .host_reads import NOT_READ

STAMP = STEPS["build"].stamp
RESTORED = "(restored from build/trees/"      # what build.sh prints when its tree cache had the build


def run(ctx: StepContext) -> Outcome:
    """Build unless the stamp of the last successful build matches (tree hash + build key) and its
    executables are those this machine recorded for that key; without the cache (--no-cache) the
    engine rebuilds from scratch."""
    tree = ctx.tree_hash()
    key: dict[str, Any] = {"tree": tree, "build": ctx.build_key()}
    stamp = record.mapping(ctx.stamps.get(STAMP))
    if ctx.plan.use_cache and stamp.get("key") == key and stamp.get("run_id"):
        version = _reusable(ctx, key, tree)
        if version is not None:
            executables.remember_key(ctx.project, ctx.host, key)
            return Outcome("cached", f"{_what(version)} of tree {tree[:12]} is up to date", str(stamp["run_id"]))
        ctx.log("the build stamp matches, but the executables under build/ are not those this machine recorded "
                "for it: removing them and building again")
        # an incremental build would keep a newer binary as it is (and run it): it must be made anew
        ctx.session.transport.check(client.build_drop(ctx.host, timeout=ctx.host.timeout(ctx.step)))
    # --no-cache: a full rebuild (the engine's build is incremental; its log lists every compile)
    with ctx.session.changing(ctx.step):
        result = ctx.shell.run("build", None if ctx.plan.use_cache else {"KD_REBUILD": "1"})
        version = _checked_version(ctx, tree)
        executables.remember(ctx.project, key, executables.hashes(ctx.session.transport, ctx.host.timeout(ctx.step)))
        executables.remember_key(ctx.project, ctx.host, key)
        ctx.stamps.write(STAMP, {"key": key, "run_id": ctx.run_dir.run_id})
    if RESTORED in result.tail:     # the engine's build cache had this tree: nothing was compiled
        return Outcome("cached", f"{_what(version)} of tree {tree[:12]} restored from the host's build cache")
    return Outcome("passed", _what(version))


def _reusable(ctx: StepContext, key: dict, tree: str) -> dict[str, str] | None:
    """The binary's version when build/'s executables are those this machine recorded for `key`
    (checked on the host before the binary runs: read ahead, or now); None when they are not."""
    records = executables.load(ctx.project, key)
    if not records:
        return None
    ahead = ctx.reads.built(key)
    checked = ahead if ahead is not NOT_READ else \
        executables.check(ctx.session.transport, records, ctx.shell.command("version"))
    if not executables.matches(records, checked.hashes) or checked.version is None:
        return None
    return _checked_version(ctx, tree, checked.version)


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


def _checked_version(ctx: StepContext, tree: str, output: str | None = None) -> dict[str, str]:
    """The binary's --version (its `output` when it ran already), recorded; StepError unless it
    was built from `tree`."""
    line = (ctx.reads.output("version") if output is None else output).strip().splitlines()
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

