"""Build: compile the engine on the host, or skip it (cached) when nothing it depends on changed;
then prove the binary was built from the deployed tree.

A build is reused only when the host's stamp matches and the executables under build/ are, hash
for hash, those this machine recorded after a build with the same key (`build/host-builds/` of
the project, private to this user): a stamp on the host alone proves nothing about the binary.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from .. import ownership, record, remote
from .context import Outcome, StepContext, StepError

STAMP = "build.json"
RESTORED = "(restored from build/trees/"      # what build.sh prints when its tree cache had the build
LOCAL_RECORDS = "build/host-builds"      # under the project root: what this user's builds produced
RECORDS_KEPT = 16                       # builds remembered per key (one per host, builds differ)
HASHES_MAX_BYTES = 1 << 20


def run(ctx: StepContext) -> Outcome:
    """Build unless the stamp of the last successful build matches (tree hash + build key) and its
    executables are those this machine recorded for that key; without the cache (--no-cache) the
    engine rebuilds from scratch."""
    tree = ctx.tree_hash()
    key: dict[str, Any] = {"tree": tree, "build": ctx.build_key()}
    stamp = record.mapping(ctx.stamp(STAMP))
    if ctx.use_cache and stamp.get("key") == key and stamp.get("run_id"):
        if _recorded(ctx, key):
            version = _checked_version(ctx, tree)
            return Outcome("cached", f"{_what(version)} of tree {tree[:12]} is up to date", str(stamp["run_id"]))
        ctx.log("the build stamp matches, but the executables under build/ are not those this machine recorded "
                "for it: removing them and building again")
        # an incremental build would keep a newer binary as it is (and run it): it must be made anew
        ctx.transport.check(remote.script(_DROP_SCRIPT, ctx.host.remote_dir, timeout=ctx.host.timeout(ctx.step),
                                          what="removing build/'s executables"))
    # --no-cache: a full rebuild (the engine's build is incremental; its log lists every compile)
    with ctx.changing():
        result = ctx.engine("build", None if ctx.use_cache else {"KD_REBUILD": "1"})
        version = _checked_version(ctx, tree)
        _record(ctx, key)
        ctx.write_stamp(STAMP, {"key": key, "run_id": ctx.run_dir.run_id})
    if RESTORED in result.tail:     # the engine's build cache had this tree: nothing was compiled
        return Outcome("cached", f"{_what(version)} of tree {tree[:12]} restored from the host's build cache")
    return Outcome("passed", _what(version))


def _records_path(ctx: StepContext, key: dict):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return ctx.project.root / LOCAL_RECORDS / f"{digest}.json"


def _local_records(ctx: StepContext, key: dict) -> list[dict]:
    try:
        data = json.loads(_records_path(ctx, key).read_text())
    except (OSError, ValueError):
        return []
    return [r for r in data.get("builds", []) if isinstance(r, dict)] if isinstance(data, dict) else []


def _recorded(ctx: StepContext, key: dict) -> bool:
    """Whether build/'s executables on the host hash as those of a build this machine recorded."""
    records = _local_records(ctx, key)
    paths = sorted({p for r in records for p in r})
    if not paths:
        return False
    current = _hashes(ctx, paths)
    return any(all(current.get(p) == h for p, h in r.items()) for r in records)


def _record(ctx: StepContext, key: dict) -> None:
    """Remember the hashes of the executables the build left under build/, for this key."""
    hashes = _hashes(ctx, [])
    records = [r for r in _local_records(ctx, key) if r != hashes][-(RECORDS_KEPT - 1):] + [hashes]
    path = _records_path(ctx, key)
    ownership.private_dir(path.parent, "build record directory")
    ownership.write_private(path, json.dumps({"key": key, "builds": records}, indent=1))


def _hashes(ctx: StepContext, paths: list[str]) -> dict[str, str]:
    """sha256 of every executable file under build/ on the host; `paths` given (relative to
    remote_dir): of those of them only."""
    command = remote.script(_HASH_SCRIPT, ctx.host.remote_dir, *paths, timeout=ctx.host.timeout(ctx.step),
                            what="hashing the build's executables")
    out = ctx.transport.capture(command, max_bytes=HASHES_MAX_BYTES)
    return {m.group(2): m.group(1) for m in re.finditer(r"^([0-9a-f]{64}) [ *](.+)$",
                                                        out.decode(errors="replace"), re.M)}


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


_HASH_SCRIPT = ownership.guard(r'''
cd -- "$1" || exit 3; shift
find build -type f -perm /111 -print0 | sort -z |
  if [ $# -eq 0 ]; then cat; else grep -zxF -f <(printf '%s\n' "$@"); fi | xargs -0 -r sha256sum --
exit 0
''')

_DROP_SCRIPT = ownership.guard(r'''
cd -- "$1" && { [ ! -d build ] || find build -type f -perm /111 -delete; }
''')
