"""The orchestrator's host-side bash scripts: one file each in this folder (orchestrator/host/*.sh),
package data that shellcheck checks (tests/host/test_host_scripts.py, .ci/run).

A script goes to a host as `bash -c SCRIPT kdtree ARGS...` (remote.script): its values are
positional arguments, never spliced into its text. A file starts with a block of comment lines (a
`shellcheck` directive, then what the script does and its arguments) that documents it and is not
sent: the script is what follows, byte for byte (a blank line there is its first line). A script
that works under remote_dir is sent after ownership.sh, whose check runs first (ownership.guard).
The only values put into a text are the package's own constants, as `@NAME@` placeholders.

    script_text("sync_list")                   # the script's text
    script_text("lock", FINISH_TAIL=8192)      # with @FINISH_TAIL@ replaced
"""
from __future__ import annotations

import functools
import re
from importlib import resources

_PLACEHOLDER = re.compile(r"@[A-Z][A-Z_]*@")


def script_text(name: str, **values: object) -> str:
    """The text sent to a host for host/NAME.sh: the file after its leading comment lines, each
    `@KEY@` replaced by str(values[KEY]). ValueError when a value has no placeholder or a
    placeholder is left without a value."""
    text = _body(name)
    for key, value in values.items():
        if f"@{key}@" not in text:
            raise ValueError(f"host/{name}.sh has no placeholder @{key}@")
        text = text.replace(f"@{key}@", str(value))
    left = _PLACEHOLDER.search(text)
    if left:
        raise ValueError(f"host/{name}.sh: no value given for {left.group()}")
    return text


@functools.cache
def _body(name: str) -> str:
    """host/NAME.sh without its leading comment lines (read once per process)."""
    text = resources.files(__name__).joinpath(f"{name}.sh").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "".join(lines[start:])
