"""What a step's results depend on, measured on the host: the content hashes of the built
executables and of every other file of the deployed tree (scripts, the Python reference, bundles,
manifests), so that test and bench results are reused when these are unchanged, whatever the
source tree hash says.

    found = inputs.measure(transport, project, tree)     # one command on the host, every run
    found.executables    # {"build/kdtree": sha256, ...}: top-level executables under build/
    found.files          # {"scripts/run_tests.sh": sha256, ...}: the tree but project.compiled and .documentation

An executable embeds the tree hash it was built from (`kdtree --version` reports it): its hash is
taken with every occurrence of the deployed tree hash replaced by zeros, so that an edit that
changes only the tree hash (a comment) leaves it equal. A binary of another tree keeps its stamp,
and so its hash differs. The source files the executables are compiled from (project.compiled)
are left out of `files`: they reach the results only through the executables; so are the files
no command reads (project.documentation: notes, the records of experiments).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

from ..host import client
from ..inventory import Project
from ..connectors.base import Transport

OUTPUT_MAX_BYTES = 4 << 20
SECONDS = 120
_TREE = re.compile(r"[0-9a-f]{64}\Z")
NOT_BUILT = "not built\n"      # hash_inputs.py's answer to if-built when the build stamp names another tree
_LINE = re.compile(r"^(x|f) ([0-9a-f]{64}) (.+)$", re.M)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The content hashes of a deployment's executables and other files."""

    executables: dict[str, str]
    files: dict[str, str]


def measure(transport: Transport, project: Project, tree: str) -> Inputs:
    """Hash, on the host, every top-level executable under build/ (the deployed `tree` hash in it
    masked) and every file of the deployed tree outside build/, .kdtree/, .git/, __pycache__/
    and *.pyc, leaving out project.compiled and project.documentation; CommandError when the host cannot."""
    return _parsed(project, _hash_on_host(transport, tree))


def measure_if_built(transport: Transport, project: Project, tree: str) -> Inputs | None:
    """measure(), or None without hashing when the host's build stamp names another tree than
    `tree` (the build step will rebuild: a read ahead of it would be thrown away)."""
    out = _hash_on_host(transport, tree, if_built=True)
    return None if out == NOT_BUILT else _parsed(project, out)


def _hash_on_host(transport: Transport, tree: str, if_built: bool = False) -> str:
    mask = tree if _TREE.match(tree) else ""
    command = client.hash_inputs(transport.host, program=_HOST_SIDE, mask=mask, if_built=if_built, timeout=SECONDS)
    return client.output(transport, command, max_bytes=OUTPUT_MAX_BYTES)


def _parsed(project: Project, out: str) -> Inputs:
    found: dict[str, dict[str, str]] = {"x": {}, "f": {}}
    for kind, digest, path in _LINE.findall(out):
        if kind == "x" or not left_out(project, path):
            found[kind][path] = digest
    return Inputs(found["x"], found["f"])


def left_out(project: Project, path: str) -> bool:
    """Whether `path` (relative to the tree) is one of project.compiled or project.documentation,
    or under one of their folders."""
    return any(path == c or (c.endswith("/") and path.startswith(c)) for c in project.compiled + project.documentation)


def digest(data) -> str:
    """The sha256 of a JSON value (keys sorted): a short name for a key in the record."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def changes(old: dict, new: dict, shown: int = 3) -> str:
    """What differs between two results keys, in words (`build/kdtree, scripts/bench.sh changed`)."""
    names = []
    for part in sorted(set(old) | set(new)):
        a, b = old.get(part), new.get(part)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and part in ("executables", "files"):
            names += [p for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p)]
        else:
            names.append(part)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    # an old key comes from the host's stamp: its names are shown bounded (the console escapes them)
    return ", ".join(str(n)[:200] for n in names[:shown]) + more + " changed" if names else "nothing changed"


# The hashing runs in the host's Python (hash_inputs.py, standard library only), which keeps the
# hashes of unchanged files between runs: a no-change validate no longer reads every bundle.
_HOST_SIDE = (Path(__file__).parent / "hash_inputs.py").read_text()
