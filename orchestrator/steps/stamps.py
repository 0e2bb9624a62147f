"""The host's state files (state.STAMPS: the deploy record and each step's stamp) as one run
last read or wrote them: the step context's cache of them (StepContext.stamps).

All of them are read at the first ask, in one round trip. The run holds the tree lock: no other
run writes them meanwhile (a stamp is written only under the lock held alone, or not used:
GPUs), and the run's own writes go through `write`; a sync changes them on the host (`forget`).
"""
from __future__ import annotations

import json
from typing import Callable

Files = dict[str, "dict | None"]      # state file name -> its document, None when missing or unreadable


class Stamps:
    """One run's view of the host's state files: `read` reads them all (state.read_jsons, or
    the read started ahead), `write` stores one on the host (state.write_json)."""

    def __init__(self, read: Callable[[], Files], write: Callable[[str, dict], None]):
        self._read, self._write = read, write
        self._files: Files | None = None

    def get(self, name: str) -> dict | None:
        """The state file `name` as this run last read or wrote it (all of them read at the first ask)."""
        if self._files is None:
            self._files = self._read()
        return self._files[name]

    def write(self, name: str, data: dict) -> None:
        """Store the state file `name` on the host and as this run knows it."""
        self._write(name, data)
        if self._files is not None:
            self._files[name] = json.loads(json.dumps(data))     # as a read would give it back

    def forget(self) -> None:
        """The state files changed on the host (a sync): the next get() reads them again."""
        self._files = None
